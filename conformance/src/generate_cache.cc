// Golden-vector cases of the paged cache (storage bits after prefill, appends with demotion and
// sequence removal) and of decode attention (outputs against the fp64 reference).
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/params_builder.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"
#include "generator_internal.h"

namespace kvq::conformance::internal {
namespace {

int64_t I(size_t v) { return static_cast<int64_t>(v); }


std::vector<CacheConfig> CacheConfigs() {
  std::vector<CacheConfig> configs;
  {
    // Per-head dense rotations and clip ratios; two sequences interleave their demotions, one
    // is removed and a third reuses its freed page.
    CacheConfig c;
    c.name = "d64_b2_g32_dense_s4_w8_p16";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(64).group(32).bits(2).rotation(RotationKind::kDense))
        .value(params::Write().head_dim(64).group(32).bits(2).rotation(RotationKind::kDense))
        .Build();
    c.rotation_k = {0, 1};
    c.rotation_v = {2, 3};
    c.key.clip = {0.96f, 1.0f};
    c.value.clip = {0.92f, 0.96f};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 30);
      const int b = s->Add();
      s->Prefill(b, 3);
      for (int i = 0; i < 16; ++i) {
        s->Append(a);
        s->Append(b);
      }
      const int c3 = s->Add();
      s->Prefill(c3, 24);
      s->Remove(b);
      for (int i = 0; i < 12; ++i) s->Append(c3);
    };
    configs.push_back(c);
  }
  {
    // No sink, a short window, Hadamard + bit reversal keys, identity INT4 values.
    CacheConfig c;
    c.name = "d128_b4_hadamard_bitrev_s0_w4_p16";
    c.params =
        params::Cache().kv_heads(1).q_heads(2).sink(0).recent(4).page(16)
            .key(params::Write().head_dim(128).group(64).bits(4).clip(0.96f).hadamard().bitrev())
            .value(params::Write().head_dim(128).group(128).bits(4))
            .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 37);
      const int b = s->Add();
      s->Prefill(b, 1);
      for (int i = 0; i < 10; ++i) {
        s->Append(a);
        if (i % 2 == 0) s->Append(b);
      }
    };
    configs.push_back(c);
  }
  {
    // Different bits and groups for K and V, block-diagonal FWHT keys, per-head clips, g = 1.
    CacheConfig c;
    c.name = "d128_kb2_vb4_block32_s8_w16_p16";
    c.params =
        params::Cache().kv_heads(2).q_heads(2).sink(8).recent(16).page(16)
            .key(params::Write().head_dim(128).group(128).bits(2).hadamard(32))
            .value(params::Write().head_dim(128).group(32).bits(4).hadamard().bitrev())
            .Build();
    c.key.clip = {0.92f, 0.96f};
    c.value.clip = {1.0f, 0.5f};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 40);
      for (int i = 0; i < 6; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "d256_b2_g64_identity_s2_w4_p16";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(2).recent(4).page(16)
        .key(params::Write().head_dim(256).group(64).bits(2).clip(0.92f))
        .value(params::Write().head_dim(256).group(64).bits(2).clip(0.96f))
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 30);
      for (int i = 0; i < 6; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  // ---- spec 1.1 ----
  {
    // KIVI: tiled keys (G_k = 32), per-token values (G = 32), S0 = 0, W = 1, F = 64: the
    // history grows 64 tokens when the 65th token past it arrives. Two sequences interleave,
    // one is removed and a third reuses its pages.
    CacheConfig c;
    c.name = "kivi_d64_gk32_f64_w1";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(0).recent(1).flush(64).page(64)
        .key(params::Write().head_dim(64).bits(2).tile(32))
        .value(params::Write().head_dim(64).bits(2).group(32))
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 110);  // history 64
      const int b = s->Add();
      s->Prefill(b, 50);   // no history yet
      for (int i = 0; i < 20; ++i) {
        s->Append(a);      // a reaches 130: history 128 at 129
        s->Append(b);      // b reaches 70: history 64 at 65
      }
      s->Remove(b);
      const int c3 = s->Add();
      s->Prefill(c3, 66);  // reuses b's page: history 64
    };
    configs.push_back(c);
  }
  {
    // OScaR: FWHT keys and values, the norm per token over every KV head (the authors'
    // scope), tiles of 32, F = 32, W = 1.
    CacheConfig c;
    c.name = "ots_token_norm_d64_hkv2_f32";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(0).recent(1).flush(32).page(32)
        .key(params::Write().head_dim(64).bits(2).tile(32).hadamard().norm().norm_heads(2))
        .value(params::Write().head_dim(64).bits(2).group(32).hadamard())
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 50);
      for (int i = 0; i < 40; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    // OScaR with the per-head norm (kvq's default), a sink, W = 8, F = 64 over G_k = 32, d = 128.
    CacheConfig c;
    c.name = "ots_head_norm_d128_s4_w8_f64";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(4).recent(8).flush(64).page(64)
        .key(params::Write().head_dim(128).bits(2).tile(32).hadamard().norm())
        .value(params::Write().head_dim(128).bits(2).group(32).hadamard())
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 80);
      for (int i = 0; i < 60; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    // SAW-INT4: one (scale, min) per row (G = d = 256), FWHT blocks of 128 on K and V, no
    // windows (S0 = W = 0): every token is history when it arrives.
    CacheConfig c;
    c.name = "saw_int4_d256_g256_w0";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(0).recent(0).page(16)
        .both(params::Write().head_dim(256).bits(4).group(256).hadamard(128))
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 20);
      for (int i = 0; i < 5; ++i) s->Append(a);
      const int b = s->Add();
      s->Append(b);
    };
    configs.push_back(c);
  }
  {
    // W = 0 with a sink and F = 8 on per-token rows, tiled INT4 values with a per-head norm.
    CacheConfig c;
    c.name = "w0_s3_f32_tiled_values_d64";
    c.params = params::Cache().kv_heads(2).q_heads(2).sink(3).recent(0).flush(32).page(32)
        .key(params::Write().head_dim(64).bits(2).group(64).rotation(RotationKind::kDense))
        .value(params::Write().head_dim(64).bits(4).tile(32).norm())
        .Build();
    c.rotation_k = {0, 1};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 40);
      for (int i = 0; i < 30; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  // ---- spec 1.2 ----
  {
    // FP8 as the engines run it: no windows (S0 = W = 0), per-head scales on both sides, two
    // sequences, one removed and its pages reused.
    CacheConfig c;
    c.name = "fp8_d64_w0_scales";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(0).recent(0).page(16)
        .both(params::Write().head_dim(64).fp8())
        .Build();
    c.key.scale = {0.0123f, 0.002f};
    c.value.scale = {0.0045f, 1.0f};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 20);
      const int b = s->Add();
      s->Prefill(b, 5);
      for (int i = 0; i < 8; ++i) {
        s->Append(a);
        s->Append(b);
      }
      s->Remove(b);
      const int c3 = s->Add();
      s->Prefill(c3, 17);
    };
    configs.push_back(c);
  }
  {
    // FP8 after the FWHT of K and V, with bf16 windows (S0 = 4, W = 8) and one scale per side.
    CacheConfig c;
    c.name = "fp8_hadamard_d128_s4_w8";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(128).fp8(0.0078125f).hadamard())
        .value(params::Write().head_dim(128).fp8(0.003f).hadamard())
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 30);
      for (int i = 0; i < 10; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    // FP8 keys over INT4 values (K and V in different formats), d = 256.
    CacheConfig c;
    c.name = "fp8k_int4v_d256_s2_w4";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(2).recent(4).page(16)
        .key(params::Write().head_dim(256).fp8(0.02f))
        .value(params::Write().head_dim(256).group(64).bits(4))
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 24);
      for (int i = 0; i < 6; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  // ---- spec 1.3 ----
  {
    // TurboQuant-MSE K3V2: dense per-head rotations, uniform rows of 3 (K) and 2 (V) bits, no
    // windows (S0 = W = 0); two sequences interleave, one is removed and its pages reused.
    CacheConfig c;
    c.name = "codebook_k3v2_d64_dense_w0";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(0).recent(0).page(16)
        .key(params::Write().head_dim(64).codebook_rows(3).rotation(RotationKind::kDense))
        .value(params::Write().head_dim(64).codebook_rows(2).rotation(RotationKind::kDense))
        .Build();
    c.rotation_k = {0, 1};
    c.rotation_v = {2, 3};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 21);
      const int b = s->Add();
      s->Prefill(b, 4);
      for (int i = 0; i < 8; ++i) {
        s->Append(a);
        s->Append(b);
      }
      s->Remove(b);
      const int c3 = s->Add();
      s->Prefill(c3, 18);
    };
    configs.push_back(c);
  }
  {
    // Block-GTQ keys: per-head block widths of average 2.5 (head 0: widths 1..4, four segments;
    // head 1: 2 and 3, two segments; both 40 code bytes), so the row limits are 4 segments and
    // 40 code bytes; TurboQuant-MSE values at 2 bits after the FWHT; the protected windows'
    // shape at a small scale (S0 = 4, W = 8).
    CacheConfig c;
    c.name = "blockgtq_d128_k_widths_v2_s4_w8";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(128).codebook_rows(3).segments(4).code_bytes(40)
                 .rotation(RotationKind::kDense))
        .value(params::Write().head_dim(128).codebook_rows(2).hadamard())
        .Build();
    c.rotation_k = {0, 1};
    for (int i = 0; i < 64; ++i) c.key.widths.push_back(static_cast<uint8_t>(1 + (i * 7) % 4));
    for (int i = 0; i < 64; ++i) c.key.widths.push_back(static_cast<uint8_t>(i < 32 ? 3 : 2));
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 30);
      for (int i = 0; i < 10; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    // Gaussian tables at 5 bits (the LSB-first bit stream) after the FWHT with bit reversal,
    // d = 64, one KV head, a sink and a window.
    CacheConfig c;
    c.name = "codebook_b5_gaussian_d64_fwht_bitrev_s2_w4";
    c.params = params::Cache().kv_heads(1).q_heads(2).sink(2).recent(4).page(16)
        .both(params::Write().head_dim(64).codebook_rows(5).codebook(CodebookDensity::kGaussian)
                  .hadamard().bitrev())
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 25);
      for (int i = 0; i < 6; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  {
    // The bf16 baseline: every token kept as bf16, no pages.
    CacheConfig c;
    c.name = "bf16_d64";
    c.params = params::Cache().kv_heads(2).q_heads(4).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(64).group(32).bits(2))
        .value(params::Write().head_dim(64).group(32).bits(2)).bf16()
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 10);
      const int b = s->Add();
      s->Prefill(b, 3);
      for (int i = 0; i < 5; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  return configs;
}

// Attention-only configurations: a history longer than one chunk of pages next to a sink-only
// and a history-free sequence; GQA g = 4 with an explicit softmax scale.
std::vector<CacheConfig> AttentionOnlyConfigs() {
  std::vector<CacheConfig> configs;
  {
    CacheConfig c;
    c.name = "d128_b2_g64_dense_long";
    c.params = params::Cache().kv_heads(1).q_heads(4).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(128).group(64).bits(2).clip(0.96f)
                 .rotation(RotationKind::kDense))
        .value(params::Write().head_dim(128).group(64).bits(2).clip(0.92f)
                   .rotation(RotationKind::kDense))
        .Build();
    c.rotation_k = {0};
    c.rotation_v = {1};
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 80);  // 68 history tokens: 5 pages, more than one 4-page chunk
      for (int i = 0; i < 3; ++i) s->Append(a);
      const int b = s->Add();
      s->Prefill(b, 3);  // sink only
      const int c3 = s->Add();
      s->Prefill(c3, 10);  // sink and recent, no history
    };
    configs.push_back(c);
  }
  {
    CacheConfig c;
    c.name = "d64_b4_g64_hadamard_gqa4_scale0p25";
    c.params = params::Cache().kv_heads(2).q_heads(8).sink(4).recent(8).page(16)
        .key(params::Write().head_dim(64).group(64).bits(4).clip(0.96f).hadamard())
        .value(params::Write().head_dim(64).group(32).bits(4).clip(0.92f).hadamard().bitrev())
        .softmax_scale(0.25f)
        .Build();
    c.script = [](Script* s) {
      const int a = s->Add();
      s->Prefill(a, 45);
      for (int i = 0; i < 4; ++i) s->Append(a);
    };
    configs.push_back(c);
  }
  return configs;
}

// A per-head array of a cache case as a tensor [Hkv, extent] (absent when the side holds none).
void AddHeadArray(Safetensors* file, const std::string& name, int hkv,
                  const std::vector<uint8_t>& values) {
  if (!values.empty()) file->Add(name, Tensor::U8({hkv, I(values.size()) / hkv}, values));
}
// Rotations travel as fixture indices (CacheConfig::rotation_k / rotation_v), never as values.
void AddHeadArray(Safetensors*, const std::string& name, int, const std::vector<float>& values) {
  KVQ_CHECK(values.empty(), kInvalidArgument, "generator: ", name, " given as values; a cache "
            "case names its rotations by fixture index");
}

// The common inputs of cache and attention cases: parameters, rotations, clips, script, rows.
// Keys are bell-shaped with one 6x outlier channel per KV head (as real keys have); values
// uniform; all rounded to bf16.
Safetensors CacheInputs(VectorCollector* out, const CacheConfig& config, const std::string& name,
                        CaseKind kind, SplitMix64* rng) {
  Safetensors file = out->NewCase(name, kind, rng, SpecVersionOf(config.params));
  const CacheParams& p = config.params;
  PutCacheParams(p, &file.metadata);
  const int d = p.head_dim();
  const int hkv = p.num_kv_heads;
  if (p.quantized()) {
    // The d fixture's matrices, or the case's own fixture (scheme cases).
    auto use = [&](const char* index_tensor, const std::vector<int32_t>& indices) {
      if (config.rotation_fixture.empty()) {
        out->UseRotations(&file, d, index_tensor, indices);
      } else {
        out->UseFixtureRotations(&file, config.rotation_fixture, index_tensor, indices);
      }
    };
    if (p.key.rotation == RotationKind::kDense) use("in.rotation_k_index", config.rotation_k);
    if (p.value.rotation == RotationKind::kDense) use("in.rotation_v_index", config.rotation_v);
    // Each per-head scalar of head_data.inc given: "in.<name>_k" / "in.<name>_v" F32 [Hkv].
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                     \
    if (!config.key.name.empty()) file.Add("in." #name "_k", Tensor::F32({hkv}, config.key.name)); \
    if (!config.value.name.empty()) {                                                         \
      file.Add("in." #name "_v", Tensor::F32({hkv}, config.value.name));                     \
    }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
    // Each per-head array given as values (codebook widths; rotations are fixture indices
    // above): "in.<name>_k" / "_v" [Hkv, extent], which ReplayCacheScript reads back.
#define KVQ_HEAD_ARRAY(name, ...)                                      \
    AddHeadArray(&file, "in." #name "_k", hkv, config.key.name);      \
    AddHeadArray(&file, "in." #name "_v", hkv, config.value.name);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  }
  Script script;
  config.script(&script);
  file.Add("in.ops", Tensor::I32({I(script.ops().size() / 3), 3}, script.ops()));
  std::vector<int> outlier(hkv);
  for (int h = 0; h < hkv; ++h) outlier[h] = static_cast<int>(rng->Below(d));
  const size_t count = script.rows() * hkv * d;
  std::vector<uint16_t> k(count), v(count);
  for (size_t i = 0; i < count; ++i) {
    const int channel = static_cast<int>(i % d);
    const int head = static_cast<int>((i / d) % hkv);
    const float key = rng->Bell() * 1.5f * (channel == outlier[head] ? 6.0f : 1.0f);
    k[i] = Bf16FromF32(key);
    v[i] = Bf16FromF32(rng->Uniform());
  }
  file.Add("in.k", Tensor::BF16({I(script.rows()), hkv, d}, k));
  file.Add("in.v", Tensor::BF16({I(script.rows()), hkv, d}, v));
  return file;
}

// What the runner compares for a cache case (runner.cc ReplayCache reads the same names).
void AddCacheExpectations(const ReplayedCache& replayed, Safetensors* file) {
  const cpu::PagedKVCache& cache = *replayed.cache;
  const CacheParams& p = cache.params();
  const int hkv = p.num_kv_heads, d = p.head_dim(), psize = p.page_size;
  const size_t row = static_cast<size_t>(hkv * d);
  file->Add("expect.pool_pages", Tensor::I32({2}, {cache.NumPages(), cache.NumFreePages()}));
  const char* names[2] = {"key", "value"};
  const cpu::KV kvs[2] = {cpu::KV::kKey, cpu::KV::kValue};
  const int64_t pages = cache.NumPages();
  if (p.quantized()) {
    // Every plane of the format: [pages, Hkv, rows per page, elements] (formats.inc).
    for (int h = 0; h < 2; ++h) {
      const FormatLayout& layout = cache.Layout(kvs[h]);
      for (int i = 0; i < layout.num_planes; ++i) {
        const PlaneSpec& plane = layout.plane(i);
        Tensor t;
        t.dtype = plane.dtype;
        t.shape = {pages, layout.HeadsPerPage(i, hkv), layout.RowsPerPage(i, psize), plane.elements};
        const uint8_t* bytes = cache.PoolPlane(kvs[h], i);
        t.bytes.assign(bytes, bytes + static_cast<size_t>(pages) * cache.PagePlaneBytes(kvs[h], i));
        file->Add(std::string("expect.pool.") + names[h] + "." + plane.name, std::move(t));
      }
    }
  }
  for (size_t slot = 0; slot < replayed.slot_ids.size(); ++slot) {
    const int id = replayed.slot_ids[slot];
    if (id < 0) continue;
    const std::string base = "expect.seq" + std::to_string(slot);
    const size_t t = cache.Length(id);
    file->Add(base + ".shape",
              Tensor::I32({4}, {static_cast<int32_t>(t), static_cast<int32_t>(cache.SinkLength(id)),
                                static_cast<int32_t>(cache.HistoryLength(id)),
                                static_cast<int32_t>(cache.RecentBegin(id))}));
    const std::vector<int32_t>& table = cache.PageTable(id);
    file->Add(base + ".page_table", Tensor::I32({I(table.size())}, table));
    for (int h = 0; h < 2; ++h) {
      if (!p.quantized()) {
        const uint16_t* dense = cache.DenseRows(id, kvs[h]);
        file->Add(base + ".dense." + names[h],
                  Tensor::BF16({I(t), hkv, d}, std::vector<uint16_t>(dense, dense + t * row)));
        continue;
      }
      const size_t sink = cache.SinkLength(id);
      const uint16_t* sink_rows = cache.SinkRows(id, kvs[h]);
      file->Add(base + ".sink." + names[h],
                Tensor::BF16({I(sink), hkv, d},
                             std::vector<uint16_t>(sink_rows, sink_rows + sink * row)));
      std::vector<uint16_t> recent;
      const size_t begin = cache.RecentBegin(id);
      for (size_t pos = begin; pos < t; ++pos) {
        const uint16_t* r = cache.Bf16Row(id, pos, kvs[h]);
        recent.insert(recent.end(), r, r + row);
      }
      file->Add(base + ".recent." + names[h], Tensor::BF16({I(t - begin), hkv, d}, recent));
    }
  }
}

void AddCacheCase(VectorCollector* out, const CacheConfig& config) {
  const std::string name = "cache/" + config.name;
  SplitMix64 rng(0);
  Safetensors file = CacheInputs(out, config, name, CaseKind::kCache, &rng);
  const ReplayedCache replayed = ReplayCacheScript(file, out->fixtures(), cpu::ScalarBackend());
  AddCacheExpectations(replayed, &file);
  out->AddCase(name, CaseKind::kCache, file);
}

}  // namespace

void AddAttentionCase(VectorCollector* out, const CacheConfig& config) {
  const std::string name = "attention/" + config.name;
  SplitMix64 rng(0);
  Safetensors file = CacheInputs(out, config, name, CaseKind::kAttention, &rng);
  const ReplayedCache replayed = ReplayCacheScript(file, out->fixtures(), cpu::ScalarBackend());
  const cpu::PagedKVCache& cache = *replayed.cache;
  const int hq = cache.params().num_q_heads, d = cache.params().head_dim();
  const size_t per_query = static_cast<size_t>(hq * d);
  std::vector<int32_t> slots;
  for (size_t slot = 0; slot < replayed.slot_ids.size(); ++slot) {
    if (replayed.slot_ids[slot] >= 0) slots.push_back(static_cast<int32_t>(slot));
  }
  std::vector<float> q(slots.size() * per_query), expected(q.size());
  std::vector<double> reference(q.size());
  for (float& v : q) v = rng.Bell();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int id = replayed.slot_ids[slots[i]];
    double* ref = reference.data() + i * per_query;
    cpu::AttendReferenceF64(cache, id, q.data() + i * per_query, ref);
    for (size_t j = 0; j < per_query; ++j) expected[i * per_query + j] = static_cast<float>(ref[j]);
    // The scalar oracle must meet its own tolerance, or the case would be useless.
    std::vector<float> oracle(per_query);
    cpu::Attend(cpu::ScalarBackend(), cache, id, q.data() + i * per_query, oracle.data());
    const std::vector<double> errors = cpu::RelativeErrorPerHead(oracle.data(), ref, hq, d);
    for (int h = 0; h < hq; ++h) {
      KVQ_CHECK(errors[h] <= kAttentionCpuTolerance, kMismatch, "generator: ", name,
                ": the scalar oracle's relative error ", errors[h], " at query ", i, ", head ", h,
                " exceeds ", kAttentionCpuTolerance);
    }
  }
  file.metadata["tolerance"] = ShortestDouble(kAttentionCpuTolerance);
  file.metadata["tolerance_gpu"] = ShortestDouble(kAttentionGpuTolerance);
  file.metadata["tolerance_measure"] =
      "per query head: max_j |out - reference| / max_j |reference| (spec/cache.md 5)";
  const int64_t nq = I(slots.size());
  file.Add("in.query_slots", Tensor::I32({nq}, slots));
  file.Add("in.q", Tensor::F32({nq, hq, d}, q));
  file.Add("expect.out", Tensor::F32({nq, hq, d}, expected));
  file.Add("expect.reference_f64", Tensor::U8({nq, hq, d, 8}, F64ToBytes(reference)));
  for (const auto& [key, value] : config.metadata) file.metadata[key] = value;
  out->AddCase(name, CaseKind::kAttention, file);
}

void AddCacheAndAttentionCases(VectorCollector* out) {
  for (const CacheConfig& config : CacheConfigs()) {
    AddCacheCase(out, config);
    AddAttentionCase(out, config);
  }
  for (const CacheConfig& config : AttentionOnlyConfigs()) AddAttentionCase(out, config);
}

}  // namespace kvq::conformance::internal
