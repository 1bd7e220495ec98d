// The CUDA decode attention (kvq/gpu/attention.h) against the fp64 reference over the same
// stored rows (cpu::AttendReferenceF64) and against the CPU oracle (cpu::AttendBatch), on
// caches built by the CPU paged cache (cpu::PagedKVCache) and uploaded as they are stored,
// with the page ids shuffled so the page-table indirection is exercised.
//
// Tolerance, per query head: max_j |out - ref| / max_j |ref|.
//  * Quantized cache: kGpuAttentionTolerance = 1e-3 (the spec's GPU bound). Error budget of the
//    kernels: codes enter the tensor cores as exact bf16 integers; bf16 sink / recent rows are
//    exact; the query (q~ for the history, q for the bf16 rows), p and p * scale are carried as
//    bf16 hi + lo pairs, |x - (hi + lo)| <= 2^-17 |x|. The one lossy step left is the QK^T of
//    the history, whose codes carry a +128 bias removed after the fp32 accumulation
//    (128 * sum q~ cancels): ~2^-24 * 128 * sqrt(64) * |sum q~| per group, about 4e-5 nats on a
//    logit for N(0,1)-like rows. A logit perturbation delta moves the output by
//    sum_t p_t delta_t (v_t - o), i.e. relative to max|o| by a few times delta for the flat
//    softmax of random rows: expected 1e-5 .. 2e-4, so 1e-3 has a 5x margin.
//    (First device run, 2026-11-21: with q~ rounded once to fp16 instead of hi + lo, the error
//    was 1e-3 .. 3e-3, twice the estimate for that design; hence hi + lo.)
//  * bf16 cache: kBf16CacheTolerance = 1e-4: no bias, every operand within 2^-17, so the same
//    amplification gives ~3e-5 (measured 1.3e-5 on the first device run).
//  * Against the oracle: the two tolerances add (the oracle is within 1e-5 of the reference).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/conformance/prng.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/common/format.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"

namespace kvq::gpu {
namespace {

using conformance::SplitMix64;

constexpr double kBf16CacheTolerance = 1e-4;

// Host data: the testbed's (kvq/testbed/data.h): per-head random orthogonal rotations and clip
// ratios (MakeCache), K/V-like rows (KvRows: bell-shaped, channels j % 29 == 3 eight times
// larger), queries (Queries), page ids (RandomPermutation).

struct Config {
  std::string id;    // the test's name (a gtest parameter name)
  std::string name;  // what the messages call it
  int hq = 8, hkv = 2, d = 128, bits = 2, group = 64, sink = 64, recent = 256, page = 64;
  int value_group = 0;  // 0: the same as group
  int value_bits = 0;   // 0: the same as bits (K and V apart: K4V2, K2V4, ...)
  // Spec 1.1: tile > 0 stores the keys as affine_tile over tiles of `tile` tokens (values stay
  // per token in groups of value_group), with a norm spanning norm_heads KV heads when norm is
  // set (Hkv: the token scope); F = flush.
  int tile = 0;
  bool norm = false;
  int norm_heads = 1;
  int flush = 1;
  bool quantized = true;
  bool fp8 = false;  // spec 1.2: fp8_e4m3 on K and V (bits and groups unused), per-head scales
  // Spec 1.3: codebook rows on K and V at bits / value_bits (groups unused); key_widths: the
  // keys' row limits admit per-head widths (segments 8, code_bytes d), which MakeCache draws
  // (Block-GTQ's allocation); density: the tables'.
  bool codebook = false;
  bool key_widths = false;
  CodebookDensity density = CodebookDensity::kBeta;
  RotationKind key_rotation = RotationKind::kDense;
  RotationKind value_rotation = RotationKind::kDense;
  bool key_bitrev = true, value_bitrev = true;
  int hadamard_block = 0;
  std::vector<int> lengths;
  bool bf16_queries = false;  // queries that are exact bf16 values (the lo operand is skipped)
  float value_magnitude = 1.0f;  // value rows are KvRows times this (a power of two)
  uint64_t seed = 1;
  double tolerance = kGpuAttentionTolerance;  // per head, against the fp64 reference
  bool check_oracle = true;  // also against the CPU oracle (skipped only for time)
};

// cfg's cache parameters, unvalidated: some tests hand the planner configurations it must
// refuse.
CacheParams MakeParams(const Config& cfg) {
  const auto half = [&](int group, int bits, RotationKind rotation, bool bitrev) {
    const int block = rotation == RotationKind::kHadamard ? cfg.hadamard_block : 0;
    if (cfg.fp8) {
      return testbed::Write().head_dim(cfg.d).fp8().rotation(rotation).hadamard_block(block).bitrev(bitrev);
    }
    if (cfg.codebook) {
      return testbed::Write().head_dim(cfg.d).codebook_rows(bits).codebook(cfg.density)
          .rotation(rotation).hadamard_block(block).bitrev(bitrev);
    }
    return testbed::Write().head_dim(cfg.d).group(group).bits(bits).rotation(rotation)
        .hadamard_block(block).bitrev(bitrev);
  };
  testbed::Write key = half(cfg.group, cfg.bits, cfg.key_rotation, cfg.key_bitrev);
  if (cfg.tile > 0) {
    key.tile(cfg.tile).norm(cfg.norm).norm_heads(cfg.norm ? cfg.norm_heads : 1);
  }
  if (cfg.key_widths) key.segments(8).code_bytes(cfg.d);
  testbed::Cache c =
      testbed::Cache().q_heads(cfg.hq).kv_heads(cfg.hkv).sink(cfg.sink).recent(cfg.recent)
          .flush(cfg.flush).page(cfg.page)
          .key(key)
          .value(half(cfg.value_group > 0 ? cfg.value_group : cfg.group,
                      cfg.value_bits > 0 ? cfg.value_bits : cfg.bits, cfg.value_rotation,
                      cfg.value_bitrev));
  if (!cfg.quantized) c.bf16();
  return c.Unchecked();
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) {
    KVQ_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
  }
  DeviceBuffer(const T* host, size_t n) : DeviceBuffer(n) {
    if (n) KVQ_CUDA_CHECK(cudaMemcpy(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.data(), host.size()) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(count, o.count);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  std::vector<T> ToHost() const {
    std::vector<T> h(count);
    if (count) KVQ_CUDA_CHECK(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// The knobs of a plan the tests set: the quantized-history loop and the heads per block of the
// rotation and merge (0: the plan's).
struct Variant {
  QuantLoop loop = QuantLoop::kTwoMma;
  int aux_heads = 0;
  int window_split = 0;  // window tokens per window block (0: the plan's)
};

const char* LoopName(QuantLoop loop) {
  switch (loop) {
    case QuantLoop::kTwoMma: return "two-MMA loop";
    case QuantLoop::kPacked: return "packed hi/lo loop";
    case QuantLoop::kInt8Qk: return "int8 QK loop";
  }
  return "?";
}

// The cache of cfg.lengths sequences on the host (cpu::PagedKVCache) and on the device, page
// ids shuffled on upload.
struct TestCase {
  Config cfg;
  CacheParams params;
  cpu::PagedKVCache cache;
  std::vector<int> seqs;
  std::vector<float> q;  // [B, Hq, d]
  int max_len = 0;

  // device
  DeviceBuffer<int32_t> lens, tables;
  int max_pages = 0;
  DeviceBuffer<uint8_t> planes[2][kMaxPlanes];  // K, V: the pool per plane of the layout
  DeviceBuffer<uint16_t> sink_k, sink_v, recent_k, recent_v;
  DeviceBuffer<float> rot_k, rot_v, q_dev;
  DeviceBuffer<float> scale_k, scale_v;  // fp8 history: s^ per KV head
  DeviceBuffer<uint8_t> widths_k, widths_v;  // codebook history: block widths per KV head

  explicit TestCase(const Config& c) : TestCase(c, SplitMix64(c.seed)) {}
  TestCase(const Config& c, SplitMix64 rng)
      : cfg(c), params(MakeParams(c)), cache(testbed::MakeCache(params, &rng)) {
    const int d = cfg.d, hkv = cfg.hkv;
    for (int len : cfg.lengths) {
      const int s = cache.AddSequence();
      const std::vector<float> k = testbed::KvRows(static_cast<size_t>(len), hkv, d, &rng);
      const std::vector<float> v =
          testbed::KvRows(static_cast<size_t>(len), hkv, d, &rng, cfg.value_magnitude);
      cache.Prefill(s, k.data(), v.data(), len);
      seqs.push_back(s);
      max_len = std::max(max_len, len);
    }
    const int batch = static_cast<int>(seqs.size());
    q = testbed::Queries(static_cast<size_t>(batch) * cfg.hq, d, &rng);
    if (cfg.bf16_queries) {
      for (float& x : q) x = RoundToBf16(x);
    }
    Upload(&rng);
  }

  void Upload(SplitMix64* rng) {
    const int batch = static_cast<int>(seqs.size());
    const int d = cfg.d, hkv = cfg.hkv, page = cfg.page;
    std::vector<int32_t> lens_h;
    for (int s : seqs) lens_h.push_back(static_cast<int32_t>(cache.Length(s)));
    lens = DeviceBuffer<int32_t>(lens_h);
    q_dev = DeviceBuffer<float>(q);
    const size_t row = static_cast<size_t>(hkv) * d;
    if (params.quantized()) {
      // Pool with shuffled page ids: CPU page i -> device page perm[i].
      const int pages = cache.NumPages();
      const std::vector<int32_t> perm = testbed::RandomPermutation(pages, rng);
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        const FormatLayout& layout = cache.Layout(which);
        for (int plane = 0; plane < layout.num_planes; ++plane) {
          const size_t pb = cache.PagePlaneBytes(which, plane);
          // Filler of pages no sequence owns: NaN for bf16 planes, 0xAB bytes for codes.
          std::vector<uint8_t> bytes(std::max<size_t>(pages, 1) * pb, 0xAB);
          if (layout.plane(plane).dtype == DType::kBF16) {
            for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
              bytes[i] = 0xc0;
              bytes[i + 1] = 0x7f;
            }
          }
          for (int i = 0; i < pages; ++i) {
            std::memcpy(&bytes[perm[i] * pb], cache.PoolPlane(which, plane) + i * pb, pb);
          }
          planes[kv][plane] = DeviceBuffer<uint8_t>(bytes);
        }
      }
      max_pages = 1;
      for (int s : seqs) max_pages = std::max<int>(max_pages, cache.PageTable(s).size());
      std::vector<int32_t> tab(static_cast<size_t>(batch) * max_pages, -1);
      for (int b = 0; b < batch; ++b) {
        const std::vector<int32_t>& pt = cache.PageTable(seqs[b]);
        for (size_t i = 0; i < pt.size(); ++i) tab[b * max_pages + i] = perm[pt[i]];
      }
      tables = DeviceBuffer<int32_t>(tab);
      // Batched windows; rows the cache does not use are NaN so reading them would show.
      const size_t sink_elems = static_cast<size_t>(cfg.sink) * row;
      const size_t ring_elems = static_cast<size_t>(params.ring_slots()) * row;
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        std::vector<uint16_t> sink(std::max<size_t>(batch * sink_elems, 8), 0x7fc0);
        std::vector<uint16_t> ring(batch * ring_elems, 0x7fc0);
        for (int b = 0; b < batch; ++b) {
          const size_t t = cache.Length(seqs[b]);
          const size_t n_sink = std::min<size_t>(t, cfg.sink);
          std::memcpy(&sink[b * sink_elems], cache.SinkRows(seqs[b], which), n_sink * row * 2);
          for (size_t pos = cache.RecentBegin(seqs[b]); pos < t; ++pos) {
            const size_t slot = pos % params.ring_slots();
            std::memcpy(&ring[b * ring_elems + slot * row],
                        cache.RecentRing(seqs[b], which) + slot * row, row * 2);
          }
        }
        (kv ? sink_v : sink_k) = DeviceBuffer<uint16_t>(sink);
        (kv ? recent_v : recent_k) = DeviceBuffer<uint16_t>(ring);
      }
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        if (!cache.Rotation(which, 0)) continue;
        std::vector<float> r;
        for (int h = 0; h < hkv; ++h) {
          const float* m = cache.Rotation(which, h);
          r.insert(r.end(), m, m + static_cast<size_t>(d) * d);
        }
        (kv ? rot_v : rot_k) = DeviceBuffer<float>(r);
      }
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        if (cache.Layout(which).format != Format::kFp8E4m3) continue;
        std::vector<float> s;
        for (int h = 0; h < hkv; ++h) s.push_back(cache.HeadParams(which, h).head_scale);
        (kv ? scale_v : scale_k) = DeviceBuffer<float>(s);
      }
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        const std::vector<uint8_t>& w = cache.Heads(which).widths;
        if (!w.empty()) (kv ? widths_v : widths_k) = DeviceBuffer<uint8_t>(w);
      }
    } else {
      // bf16 cache: page the dense rows, page ids shuffled.
      max_pages = (max_len + page - 1) / page;
      const int pages = max_pages * batch;
      const std::vector<int32_t> perm = testbed::RandomPermutation(pages, rng);
      std::vector<int32_t> tab(static_cast<size_t>(batch) * max_pages);
      const size_t page_elems = static_cast<size_t>(hkv) * page * d;
      for (int kv = 0; kv < 2; ++kv) {
        const cpu::KV which = kv ? cpu::KV::kValue : cpu::KV::kKey;
        std::vector<uint16_t> pool(pages * page_elems, 0x7fc0);
        for (int b = 0; b < batch; ++b) {
          const size_t t = cache.Length(seqs[b]);
          const uint16_t* dense = cache.DenseRows(seqs[b], which);
          for (int i = 0; i < max_pages; ++i) tab[b * max_pages + i] = perm[b * max_pages + i];
          for (size_t pos = 0; pos < t; ++pos) {
            const int pg = tab[b * max_pages + pos / page];
            const size_t slot = pos % page;
            for (int h = 0; h < hkv; ++h) {
              std::memcpy(&pool[pg * page_elems + (h * page + slot) * d], dense + (pos * hkv + h) * d,
                          d * 2);
            }
          }
        }
        std::vector<uint8_t> bytes(pool.size() * 2);
        std::memcpy(bytes.data(), pool.data(), bytes.size());
        planes[kv][kBf16RowsPlane] = DeviceBuffer<uint8_t>(bytes);
      }
      tables = DeviceBuffer<int32_t>(tab);
    }
  }

  DecodeAttentionInputs Inputs() const {
    DecodeAttentionInputs in;
    in.batch = static_cast<int>(seqs.size());
    in.max_seq_len = max_len;
    in.seq_lens = lens.ptr;
    in.page_tables = tables.ptr;
    in.max_pages = max_pages;
    for (int i = 0; i < kMaxPlanes; ++i) {
      in.key_planes[i] = planes[0][i].ptr;
      in.value_planes[i] = planes[1][i].ptr;
    }
    in.sink_key = sink_k.ptr;
    in.sink_value = sink_v.ptr;
    in.recent_key = recent_k.ptr;
    in.recent_value = recent_v.ptr;
    in.key_heads.rotation = rot_k.ptr;
    in.value_heads.rotation = rot_v.ptr;
    in.key_heads.scale = scale_k.ptr;
    in.value_heads.scale = scale_v.ptr;
    in.key_heads.widths = widths_k.ptr;
    in.value_heads.widths = widths_v.ptr;
    in.q = q_dev.ptr;
    return in;
  }

  // Runs the GPU attention with the plan's knobs set as `v` says on poisoned (NaN) output and
  // returns it, [B, Hq, d]. timeline: DecodeAttentionInputs::timeline (null: off).
  std::vector<float> RunGpu(const Variant& v, uint64_t* timeline = nullptr) const {
    const int batch = static_cast<int>(seqs.size());
    DecodeAttentionPlan plan = PlanDecodeAttention(params, batch, max_len);
    plan.quant_loop = v.loop;
    if (v.aux_heads > 0) plan.aux_heads_per_block = v.aux_heads;
    if (v.window_split > 0 && params.quantized()) {
      const int window = std::min(max_len, params.sink + params.ring_slots());
      plan.window_tokens_per_split = v.window_split;
      plan.window_splits = (window + v.window_split - 1) / v.window_split;
      plan.workspace_bytes = DecodeAttentionWorkspaceBytes(params, batch, plan);
    }
    DeviceBuffer<unsigned char> ws(plan.workspace_bytes);
    KVQ_CUDA_CHECK(cudaMemset(ws.ptr, 0xFF, plan.workspace_bytes));
    DeviceBuffer<float> out(static_cast<size_t>(batch) * cfg.hq * cfg.d);
    KVQ_CUDA_CHECK(cudaMemset(out.ptr, 0xFF, out.count * sizeof(float)));
    DecodeAttentionInputs in = Inputs();
    in.timeline = timeline;
    DecodeAttention(params, in, plan, ws.ptr, plan.workspace_bytes, out.ptr);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    return out.ToHost();
  }
};

// Checks every output against the fp64 reference and the oracle; reports the worst error.
// Quantized caches run every loop of the history kernel that serves their heads per block: the
// two-MMA loop, and with at most 4 heads a block the packed hi / lo and the int8 QK loops.
void CheckAgainstReferences(const TestCase& tc) {
  const double tolerance = tc.cfg.tolerance;
  const bool check_oracle = tc.cfg.check_oracle;
  const int batch = static_cast<int>(tc.seqs.size());
  const int hq = tc.cfg.hq, d = tc.cfg.d;
  std::vector<float> oracle(static_cast<size_t>(batch) * hq * d);
  if (check_oracle) cpu::AttendBatch(cpu::BestBackend(), tc.cache, tc.seqs, tc.q.data(), oracle.data());
  std::vector<std::vector<double>> refs(batch);  // fp64 reference, once for every variant
  for (int b = 0; b < batch; ++b) {
    refs[b].resize(static_cast<size_t>(hq) * d);
    cpu::AttendReferenceF64(tc.cache, tc.seqs[b], &tc.q[static_cast<size_t>(b) * hq * d], refs[b].data());
  }
  // The key format's loops (kvq/gpu/formats.h): fp8 history has the two-MMA loop only (over
  // rows converted to bf16), tiled keys and codebook rows no int8 QK loop.
  const unsigned loops = tc.params.quantized()
                             ? attention::DecodeFormatOf(tc.params.key.format).loops
                             : attention::kTwoMmaLoop;
  const bool few_heads = std::min(hq / tc.cfg.hkv, attention::kMaxHeadsPerBlock) <= 4;
  std::vector<Variant> variants;
  variants.push_back({QuantLoop::kTwoMma});  // a bf16 cache's one loop
  if (few_heads && (loops & attention::kPackedLoop) != 0) variants.push_back({QuantLoop::kPacked});
  if (few_heads && (loops & attention::kInt8QkLoop) != 0) variants.push_back({QuantLoop::kInt8Qk});
  // The plan's loop.
  const Variant planned{PlanDecodeAttention(tc.params, batch, tc.max_len).quant_loop};
  // The plan's loop with the rotation and merge a block per KV head (or 8 heads), as large
  // batches take them (the small test batches plan a block per query head).
  const int g = hq / tc.cfg.hkv;
  if (g > 1) {
    Variant wide = planned;
    wide.aux_heads = attention::WidestAuxHeads(g, d);
    variants.push_back(wide);
    if (wide.aux_heads > 2 && g % 2 == 0) {
      Variant pairs = wide;  // fewer heads than the merge instantiation holds
      pairs.aux_heads = 2;
      variants.push_back(pairs);
    }
  }
  // The plan's loop with the whole window in one block per sequence and head chunk, as the
  // planner cuts it for large batches (the small test batches get 64-token window blocks).
  if (tc.params.quantized()) {
    Variant one_window = planned;
    one_window.window_split = 320;
    variants.push_back(one_window);
  }
  for (const Variant& v : variants) {
    SCOPED_TRACE(::testing::Message() << LoopName(v.loop) << ", aux_heads " << v.aux_heads
                                      << ", window_split " << v.window_split);
    const std::vector<float> gpu = tc.RunGpu(v);
    double worst_ref = 0.0, worst_oracle = 0.0;
    for (int b = 0; b < batch; ++b) {
      const float* out = &gpu[static_cast<size_t>(b) * hq * d];
      for (int i = 0; i < hq * d; ++i) {
        ASSERT_TRUE(std::isfinite(out[i])) << tc.cfg.name << " seed " << tc.cfg.seed << ": sequence "
                                           << b << " (t = " << tc.cache.Length(tc.seqs[b])
                                           << ") head " << i / d << " channel " << i % d
                                           << " not written or not finite: " << out[i];
      }
      const std::vector<double>& ref = refs[b];
      const std::vector<double> err = cpu::RelativeErrorPerHead(out, ref.data(), hq, d);
      for (int h = 0; h < hq; ++h) {
        worst_ref = std::max(worst_ref, err[h]);
        EXPECT_LE(err[h], tolerance) << tc.cfg.name << " seed " << tc.cfg.seed << ": sequence " << b
                                     << " (t = " << tc.cache.Length(tc.seqs[b]) << ") head " << h
                                     << " vs fp64 reference";
      }
      if (check_oracle) {
        std::vector<double> oracle_d(oracle.begin() + static_cast<size_t>(b) * hq * d,
                                     oracle.begin() + static_cast<size_t>(b + 1) * hq * d);
        const std::vector<double> e2 = cpu::RelativeErrorPerHead(out, oracle_d.data(), hq, d);
        for (int h = 0; h < hq; ++h) {
          worst_oracle = std::max(worst_oracle, e2[h]);
          EXPECT_LE(e2[h], tolerance + cpu::kAttentionOracleTolerance)
              << tc.cfg.name << " seed " << tc.cfg.seed << ": sequence " << b << " head " << h
              << " vs CPU oracle";
        }
      }
    }
    std::printf("[ %s, %s%s%s ] max rel. error per head: %.3e vs fp64 reference, %.3e vs oracle (tolerance %.1e)\n",
                tc.cfg.name.c_str(), tc.params.quantized() ? LoopName(v.loop) : "bf16 loop",
                (v.aux_heads > 0 ? ", rotation/merge " + std::to_string(v.aux_heads) + " heads a block" : std::string()).c_str(),
                v.window_split > 0 ? (", " + std::to_string(v.window_split) + "-token window blocks").c_str() : "",
                worst_ref, worst_oracle, tolerance);
  }
}

#define REQUIRE_GPU()                                          \
  do {                                                         \
    if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

// Lengths around every boundary of the default layout (S0 = 64, W = 256, P = 64): T = 1, inside
// the sink, sink full, no history (t <= S0 + W), one history token, exactly one page, a page
// plus one, several pages, and an uneven long one.
const std::vector<int> kBoundaryLengths = {1, 37, 64, 65, 320, 321, 384, 385, 1000, 4123};

// The configurations every loop of the history kernel is checked on (CheckAgainstReferences),
// one row each; the defaults are Config's (INT2, d = 128, G = 64, g = 4, dense R + P_br on K and
// V, S0 = 64, W = 256, P = 64).
std::vector<Config> AttentionConfigs() {
  std::vector<Config> all;
  auto add = [&](const char* id, const char* name, auto&& set) {
    Config cfg;
    cfg.id = id;
    cfg.name = name;
    set(cfg);
    all.push_back(cfg);
  };
  add("Int2Dense_Gqa4_Boundaries", "int2 d128 G64 g4 dense+bitrev",
      [](Config& c) { c.lengths = kBoundaryLengths; });
  add("Int2Dense_Gqa4_Bf16Queries", "int2 d128 G64 g4 bf16 queries", [](Config& c) {
    c.lengths = {2, 300, 700, 2500};
    c.bf16_queries = true;
    c.seed = 7;
  });
  // Value rows far from unit magnitude: the INT-b PV loops carry p * scale * 2^64 against code
  // fields worth 2^-133 each (spec/cache.md §5: value group scales in [2^-50, 2^56]); rows of
  // magnitude 2^44 and 2^-40 put the scales near 2^43 and 2^-41. The error is relative to the
  // output's magnitude, so the tolerance is the usual one.
  add("Int2Dense_Gqa4_ValueMagnitudes_2p44", "int2 d128 G64 g4 values x 2^44", [](Config& c) {
    c.lengths = {65, 400, 3000};
    c.value_magnitude = 0x1p44f;
    c.seed = 11;
  });
  add("Int2Dense_Gqa4_ValueMagnitudes_2m40", "int2 d128 G64 g4 values x 2^-40", [](Config& c) {
    c.lengths = {65, 400, 3000};
    c.value_magnitude = 0x1p-40f;
    c.seed = 11;
  });
  add("Int2Hadamard_Gqa1_Group32_Page16", "int2 d128 G32 g1 P16 hadamard32 / identity",
      [](Config& c) {
        c.hq = 2;
        c.hkv = 2;
        c.group = 32;
        c.page = 16;
        c.key_rotation = RotationKind::kHadamard;
        c.hadamard_block = 32;
        c.value_rotation = RotationKind::kIdentity;
        c.value_bitrev = false;
        c.lengths = {1, 321, 336, 337, 999, 3000};
        c.seed = 2;
      });
  // Different K and V groups (the group epilogue takes each as its own compile-time value).
  add("Int2Dense_Gqa4_KeyGroup32_ValueGroup128", "int2 d128 G_K32 G_V128 g4", [](Config& c) {
    c.hq = 8;
    c.hkv = 2;
    c.group = 32;
    c.value_group = 128;
    c.lengths = {65, 385, 2000};
    c.seed = 9;
  });
  add("Int2Dense_Gqa8_Group128_Page128", "int2 d128 G128 g8 P128", [](Config& c) {
    c.hq = 8;
    c.hkv = 1;
    c.group = 128;
    c.page = 128;
    c.sink = 16;
    c.recent = 64;
    c.lengths = {80, 81, 208, 209, 2222};
    c.seed = 3;
  });
  add("Int2Dense_Gqa16_TwoHeadChunks", "int2 d128 G64 g16", [](Config& c) {
    c.hq = 32;
    c.hkv = 2;
    c.lengths = {500, 1500};
    c.seed = 4;
  });
  // Spec 1.2's fp8 history (converted to bf16 in shared memory, s^ folded into the step): the
  // engines' configuration (no windows, identity), windows around a dense + P_br history, the
  // FWHT at d = 64 with g = 1, and d = 256.
  add("Fp8Identity_NoWindows_Gqa4", "fp8 d128 g4 no windows", [](Config& c) {
    c.fp8 = true;
    c.sink = 0;
    c.recent = 0;
    c.key_rotation = c.value_rotation = RotationKind::kIdentity;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = {1, 63, 64, 65, 1000, 4123};
    c.seed = 21;
  });
  add("Fp8Dense_Gqa4_Boundaries", "fp8 d128 g4 dense+bitrev", [](Config& c) {
    c.fp8 = true;
    c.lengths = kBoundaryLengths;
    c.seed = 22;
  });
  add("Fp8Hadamard_HeadDim64_Gqa1_Page16", "fp8 d64 g1 P16 hadamard", [](Config& c) {
    c.fp8 = true;
    c.d = 64;
    c.hq = 2;
    c.hkv = 2;
    c.page = 16;
    c.sink = 4;
    c.recent = 8;
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = {1, 13, 77, 3001};
    c.seed = 23;
  });
  // Spec 1.3's codebook history: TurboQuant-MSE's buffer-free K3V2, Block-GTQ's per-head key
  // widths over windows (eight segments, codes spanning bytes), the Gaussian tables with the
  // FWHT at d = 64 and P = 16, widths 8 and 1, d = 256 with g = 8, and the register-fragment
  // path at every width it takes on each side (b <= 4: K2V4 and K1V3 at d = 128, K3V1 and
  // K1V2 at d = 64, whose odd widths put a lane's bits off word boundaries, K4V2 at d = 256).
  // The decoded-tile path: per-head widths and b = 8.
  add("CodebookK3V2_NoWindows_Gqa4", "codebook K3V2 d128 g4 no windows", [](Config& c) {
    c.codebook = true;
    c.bits = 3;
    c.value_bits = 2;
    c.sink = 0;
    c.recent = 0;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = {1, 63, 64, 65, 1000, 4123};
    c.seed = 31;
  });
  add("CodebookWidths_Gqa4_Boundaries", "codebook per-head K widths, V2, d128 g4", [](Config& c) {
    c.codebook = true;
    c.key_widths = true;
    c.bits = 3;
    c.value_bits = 2;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = kBoundaryLengths;
    c.seed = 32;
  });
  add("CodebookGaussian_HeadDim64_Gqa1_Page16", "codebook gaussian K4V4 d64 g1 P16 hadamard",
      [](Config& c) {
        c.codebook = true;
        c.density = CodebookDensity::kGaussian;
        c.bits = 4;
        c.d = 64;
        c.hq = 2;
        c.hkv = 2;
        c.page = 16;
        c.sink = 4;
        c.recent = 8;
        c.key_rotation = c.value_rotation = RotationKind::kHadamard;
        c.key_bitrev = c.value_bitrev = false;
        c.lengths = {1, 13, 77, 3001};
        c.seed = 33;
      });
  add("CodebookK8V1_Gqa4", "codebook K8V1 d128 g4", [](Config& c) {
    c.codebook = true;
    c.bits = 8;
    c.value_bits = 1;
    c.sink = 4;
    c.recent = 16;
    c.lengths = {5, 700, 2049};
    c.seed = 34;
  });
  add("CodebookWidths_HeadDim256_Gqa8", "codebook per-head K widths, V3, d256 g8",
      [](Config& c) {
        c.codebook = true;
        c.key_widths = true;
        c.bits = 2;
        c.value_bits = 3;
        c.d = 256;
        c.hq = 16;
        c.hkv = 2;
        c.lengths = {1, 400, 1777};
        c.seed = 35;
      });
  add("CodebookK2V4_Gqa4", "codebook K2V4 d128 g4", [](Config& c) {
    c.codebook = true;
    c.bits = 2;
    c.value_bits = 4;
    c.sink = 4;
    c.recent = 16;
    c.lengths = {5, 700, 2049};
    c.seed = 36;
  });
  add("CodebookK1V3_Gqa4", "codebook K1V3 d128 g4 no windows", [](Config& c) {
    c.codebook = true;
    c.bits = 1;
    c.value_bits = 3;
    c.sink = 0;
    c.recent = 0;
    c.lengths = {1, 64, 1000, 2049};
    c.seed = 37;
  });
  add("CodebookK3V1_HeadDim64_Gqa4", "codebook K3V1 d64 g4", [](Config& c) {
    c.codebook = true;
    c.bits = 3;
    c.value_bits = 1;
    c.d = 64;
    c.lengths = {5, 700, 2049};
    c.seed = 38;
  });
  add("CodebookK4V2_HeadDim256_Gqa4", "codebook K4V2 d256 g4", [](Config& c) {
    c.codebook = true;
    c.bits = 4;
    c.value_bits = 2;
    c.d = 256;
    c.lengths = {1, 400, 1777};
    c.seed = 40;
  });
  add("CodebookK1V2_HeadDim64_Gqa2_Page16", "codebook K1V2 d64 g2 P16", [](Config& c) {
    c.codebook = true;
    c.bits = 1;
    c.value_bits = 2;
    c.d = 64;
    c.hq = 4;
    c.hkv = 2;
    c.page = 16;
    c.lengths = {1, 77, 3001};
    c.seed = 39;
  });
  add("Fp8Dense_HeadDim256_Gqa8", "fp8 d256 g8 dense+bitrev", [](Config& c) {
    c.fp8 = true;
    c.d = 256;
    c.hq = 16;
    c.hkv = 2;
    c.lengths = {1, 400, 1777};
    c.seed = 24;
  });
  add("Int4Dense_Gqa4", "int4 d128 G64 g4", [](Config& c) {
    c.bits = 4;
    c.lengths = {1, 321, 385, 2049};
    c.seed = 5;
  });
  // K and V apart: each side's codes at its own width, per-token keys (int8 QK loop at g = 4,
  // the bf16 loops at g = 8) and tiled keys.
  add("Int4K_Int2V_Gqa4_Boundaries", "K4V2 d128 G64 g4", [](Config& c) {
    c.bits = 4;
    c.value_bits = 2;
    c.lengths = kBoundaryLengths;
    c.seed = 40;
  });
  add("Int2K_Int4V_Gqa8_Group128", "K2V4 d128 G_K64 G_V128 g8", [](Config& c) {
    c.hq = 16;
    c.value_bits = 4;
    c.value_group = 128;
    c.lengths = {1, 321, 385, 1000, 3001};
    c.seed = 41;
  });
  add("Int4K_Int2V_HeadDim64_Group32", "K4V2 d64 G32 g4", [](Config& c) {
    c.d = 64;
    c.bits = 4;
    c.value_bits = 2;
    c.group = 32;
    c.lengths = {1, 320, 321, 777, 2000};
    c.seed = 42;
  });
  add("Int2Dense_HeadDim64_Group32", "int2 d64 G32 g4", [](Config& c) {
    c.d = 64;
    c.group = 32;
    c.lengths = {1, 400, 1777};
    c.seed = 6;
  });
  add("Int2Dense_HeadDim256_Group64", "int2 d256 G64 g4", [](Config& c) {
    c.d = 256;
    c.lengths = {1, 400, 1777};
    c.seed = 8;
  });
  add("Int4Dense_HeadDim64", "int4 d64 G32 g4", [](Config& c) {
    c.d = 64;
    c.bits = 4;
    c.group = 32;
    c.lengths = {1, 400, 1777};
    c.seed = 9;
  });
  // The oracle is skipped here only for time; the fp64 reference covers the same rows.
  add("Int2Dense_Long64K", "int2 d128 G64 g4 T=64K", [](Config& c) {
    c.lengths = {65536, 3000};
    c.seed = 10;
    c.check_oracle = false;
  });
  add("Bf16Cache_Gqa4", "bf16 cache d128 g4", [](Config& c) {
    c.quantized = false;
    c.lengths = {1, 15, 16, 64, 65, 1000, 20000};
    c.seed = 11;
    c.tolerance = kBf16CacheTolerance;
  });
  add("Bf16Cache_Gqa1_Bf16Queries", "bf16 cache d128 g1 bf16 queries", [](Config& c) {
    c.quantized = false;
    c.hq = 2;
    c.bf16_queries = true;
    c.page = 16;
    c.lengths = {1, 17, 333, 4000};
    c.seed = 12;
    c.tolerance = kBf16CacheTolerance;
  });
  // ---- Spec 1.1: tiled keys (affine_tile, the scales folded into the query), the flush F,
  // W = 0 and S0 = 0. The schemes' own configurations (kivi, kivi_hadamard, kivi_norm, ots,
  // saw_int4, saw_int4_k of calib/include/kvq/calib/schemes.inc: S0 = 0, W = 1, F = 128, K tiles
  // of 32 tokens, V groups of 32; SAW: INT4, G = d, S0 = W = 0) and the edges around them.
  // Lengths: inside the first block (no history), one block and one token (H = 128), a page
  // boundary, several blocks, an uneven long one.
  const std::vector<int> kFlushLengths = {1, 128, 129, 130, 256, 257, 700, 3001};
  auto kivi = [&](Config& c) {
    c.sink = 0;
    c.recent = 1;
    c.flush = 128;
    c.tile = 32;
    c.group = 32;
    c.page = 64;
    c.key_rotation = c.value_rotation = RotationKind::kIdentity;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = kFlushLengths;
  };
  add("Kivi_Int2_Tile32", "kivi: int2 K tiles of 32, V G32, S0 0 W 1 F 128", [&](Config& c) {
    kivi(c);
    c.seed = 21;
  });
  add("KiviHadamard_Int2_Tile32", "kivi_hadamard: FWHT K and V", [&](Config& c) {
    kivi(c);
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.seed = 22;
  });
  add("KiviNorm_Int2_Tile32", "kivi_norm: key norm per KV head", [&](Config& c) {
    kivi(c);
    c.norm = true;
    c.seed = 23;
  });
  add("Ots_Int2_Tile32", "ots (OScaR): FWHT, key norm per KV head", [&](Config& c) {
    kivi(c);
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.norm = true;
    c.seed = 24;
  });
  add("Ots_Int2_Tile32_TokenScopeNorm", "ots, token-scope norm (one over the KV heads)",
      [&](Config& c) {
        kivi(c);
        c.key_rotation = c.value_rotation = RotationKind::kHadamard;
        c.norm = true;
        c.norm_heads = c.hkv;
        c.seed = 25;
      });
  // G_k = 64 (16 bytes a channel), windows of spec 1.0's kind beside it, g = 8 (two-MMA loop),
  // and a sink with W = 0.
  add("Tile64_Int2_Gqa8_Sink", "int2 K tiles of 64, V G64, S0 16 W 0 F 64, g 8", [&](Config& c) {
    c.hq = 8;
    c.hkv = 1;
    c.sink = 16;
    c.recent = 0;
    c.flush = 64;
    c.tile = 64;
    c.group = 64;
    c.norm = true;
    c.lengths = {1, 16, 17, 80, 81, 143, 1000, 2100};
    c.seed = 26;
  });
  add("Tile32_Int4_ValueGroup64", "int4 K tiles of 32, V G64, F 32, W 8", [&](Config& c) {
    c.bits = 4;
    c.sink = 4;
    c.recent = 8;
    c.flush = 32;
    c.tile = 32;
    c.group = 64;
    c.page = 32;
    c.norm = true;
    c.lengths = {1, 12, 13, 44, 45, 77, 500, 1999};
    c.seed = 27;
  });
  add("Tile32_Int2K_Int4V", "int2 K tiles of 32 over int4 V G64 (K2V4)", [&](Config& c) {
    kivi(c);
    c.value_bits = 4;
    c.value_group = 64;
    c.norm = true;
    c.seed = 43;
  });
  add("Tile32_Int4K_Int2V_Gqa8", "int4 K tiles of 32 over int2 V G32, g 8 (K4V2)",
      [&](Config& c) {
        kivi(c);
        c.hq = 16;
        c.bits = 4;
        c.value_bits = 2;
        c.seed = 44;
      });
  add("Tile32_Int2_HeadDim64", "int2 d64 K tiles of 32, V G32", [&](Config& c) {
    kivi(c);
    c.d = 64;
    c.norm = true;
    c.seed = 28;
  });
  add("Tile32_Int2_HeadDim256", "int2 d256 K tiles of 32, V G64", [&](Config& c) {
    kivi(c);
    c.d = 256;
    c.group = 64;
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.norm = true;
    c.seed = 29;
  });
  // SAW-INT4 (G = d, S0 = W = 0: no window blocks) and saw_int4_k (FWHT of the keys only).
  auto saw = [&](Config& c) {
    c.bits = 4;
    c.group = c.d;
    c.sink = 0;
    c.recent = 0;
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.key_bitrev = c.value_bitrev = false;
    c.lengths = {1, 2, 63, 64, 65, 1000, 4097};
  };
  add("SawInt4_GroupD_NoWindows", "saw_int4: int4 G = d, S0 = W = 0", [&](Config& c) {
    saw(c);
    c.seed = 30;
  });
  add("SawInt4K_GroupD_NoWindows", "saw_int4_k: keys rotated only", [&](Config& c) {
    saw(c);
    c.value_rotation = RotationKind::kIdentity;
    c.seed = 31;
  });
  add("Ots_Int2_Long64K", "ots T=64K", [&](Config& c) {
    kivi(c);
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.norm = true;
    c.lengths = {65536, 3000};
    c.seed = 32;
    c.check_oracle = false;
  });
  // Small enough for compute-sanitizer (memcheck / racecheck / synccheck): both kernel paths,
  // page edges.
  auto small = [](Config& c) {
    c.sink = 8;
    c.recent = 16;
    c.page = 16;
    c.lengths = {1, 24, 25, 40, 41, 200};
    c.seed = 13;
  };
  add("Sanitizer_Small_Int2", "sanitizer int2", small);
  add("Sanitizer_Small_Ots", "sanitizer ots", [&](Config& c) {
    kivi(c);
    c.key_rotation = c.value_rotation = RotationKind::kHadamard;
    c.norm = true;
    c.page = 32;
    c.lengths = {1, 128, 129, 200, 300};
    c.seed = 33;
  });
  add("Sanitizer_Small_K4V2", "sanitizer K4V2", [&](Config& c) {
    small(c);
    c.bits = 4;
    c.value_bits = 2;
  });
  add("Sanitizer_Small_Saw", "sanitizer saw_int4", [&](Config& c) {
    saw(c);
    c.lengths = {1, 40, 200};
    c.seed = 34;
  });
  add("Sanitizer_Small_Bf16", "sanitizer bf16", [&](Config& c) {
    small(c);
    c.quantized = false;
    c.tolerance = kBf16CacheTolerance;
  });
  return all;
}

// gtest prints a parameter by its id, not its bytes.
void PrintTo(const Config& cfg, std::ostream* os) { *os << cfg.id; }

class GpuAttentionConfig : public ::testing::TestWithParam<Config> {};

TEST_P(GpuAttentionConfig, MatchesReferences) {
  REQUIRE_GPU();
  CheckAgainstReferences(TestCase(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Configs, GpuAttentionConfig, ::testing::ValuesIn(AttentionConfigs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return info.param.id;
                         });

// One mma.sync m16n8k16 (bf16 in, fp32 out) of a warp: A [16][16] row-major, B [16][8] (k, n),
// D [16][8], all as the fragment layout of the PTX ISA places them.
__global__ void MmaBf16Probe(const uint16_t* a, const uint16_t* b, float* d) {
  const int lane = static_cast<int>(threadIdx.x);
  const int gi = lane / 4, t4 = lane % 4;
  auto pair = [](const uint16_t* p, int i, int j, int stride) {  // elements (i, j), (i, j + 1)
    return static_cast<uint32_t>(p[i * stride + j]) |
           static_cast<uint32_t>(p[i * stride + j + 1]) << 16;
  };
  auto kpair = [&](int k, int n) {  // B rows k, k + 1 of column n
    return static_cast<uint32_t>(b[k * 8 + n]) | static_cast<uint32_t>(b[(k + 1) * 8 + n]) << 16;
  };
  const uint32_t a0 = pair(a, gi, 2 * t4, 16), a1 = pair(a, gi + 8, 2 * t4, 16);
  const uint32_t a2 = pair(a, gi, 2 * t4 + 8, 16), a3 = pair(a, gi + 8, 2 * t4 + 8, 16);
  const uint32_t b0 = kpair(2 * t4, gi), b1 = kpair(2 * t4 + 8, gi);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  d[gi * 8 + 2 * t4] = c[0];
  d[gi * 8 + 2 * t4 + 1] = c[1];
  d[(gi + 8) * 8 + 2 * t4] = c[2];
  d[(gi + 8) * 8 + 2 * t4 + 1] = c[3];
}

// The INT-b PV loops feed code fields to the tensor cores in place, as bf16 bit patterns
// v < 256 worth exactly v * 2^-133 (subnormals, and the first normal binade for v >= 128),
// against B operands near 2^64 (CodeField::InPlace, kPvOperandScale). That is only right if
// the tensor cores keep bf16 subnormal inputs instead of flushing them: checked here on every
// pattern, against B = +-m * 2^57 (m in [128, 255]), so every sum is a multiple of 2^-76
// below 2^20 of them: exact in fp32 whatever the summation order.
TEST(GpuAttention, TensorCoresKeepBf16Subnormals) {
  REQUIRE_GPU();
  SplitMix64 rng(133);
  std::vector<uint16_t> a(16 * 16), b(16 * 8);
  for (int trial = 0; trial < 17; ++trial) {
    for (int i = 0; i < 256; ++i) {
      // Trial 0..15: pattern v = 16 * trial + (i % 16) in row i / 16 spread over the tile, so
      // every v in [0, 256) appears; trial 16: random patterns.
      const int v = trial < 16 ? 16 * trial + (i % 16) : static_cast<int>(rng.Below(256));
      a[(i * 7) % 256] = static_cast<uint16_t>(v);
    }
    for (int i = 0; i < 16 * 8; ++i) {
      // bf16 of +-m * 2^57: an 8-bit significand m in [128, 255].
      const int m = 128 + static_cast<int>(rng.Below(128));
      const float x = std::ldexp(static_cast<float>(m), 57) * (rng.Bit() ? -1.0f : 1.0f);
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      b[i] = static_cast<uint16_t>(bits >> 16);  // exact: m has 8 significant bits
    }
    DeviceBuffer<uint16_t> a_dev(a), b_dev(b);
    DeviceBuffer<float> d_dev(16 * 8);
    MmaBf16Probe<<<1, 32>>>(a_dev.ptr, b_dev.ptr, d_dev.ptr);
    KVQ_CUDA_CHECK(cudaGetLastError());
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = d_dev.ToHost();
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 8; ++n) {
        double want = 0.0;
        for (int k = 0; k < 16; ++k) {
          uint32_t bits = static_cast<uint32_t>(b[k * 8 + n]) << 16;
          float bf;
          std::memcpy(&bf, &bits, 4);
          want += std::ldexp(static_cast<double>(a[m * 16 + k]), -133) * bf;
        }
        ASSERT_EQ(static_cast<double>(got[m * 8 + n]), want)
            << "trial " << trial << " row " << m << " column " << n
            << ": the tensor cores do not keep bf16 subnormal operands exactly";
      }
    }
  }
}

// The query rotation stage: the same bits as the CPU write path's Rotate (spec dense rule,
// FWHT, bit reversal), for every head of a batch.
TEST(GpuAttention, RotateQueries_BitExact) {
  REQUIRE_GPU();
  SplitMix64 rng(21);
  // One (d, rotation, g, heads per block) case: every head of a batch of 2 over 2 KV heads.
  auto check = [&](int d, int kind, int g, int heads_per_block) {
    const WriteParams wp = testbed::Write().head_dim(d).group(32)
                               .rotation(static_cast<RotationKind>(kind))
                               .hadamard_block(kind == 2 ? 32 : 0).bitrev(kind != 0);
    const int hkv = 2, batch = 2, hq = hkv * g;
    const std::vector<float> rot = testbed::HeadRotations(wp, hkv, &rng);
    const std::vector<float> q =
        testbed::Queries(static_cast<size_t>(batch) * hq, d, &rng, 2.0f);
    DeviceBuffer<float> q_dev(q), rot_dev(rot), out(q.size());
    attention::RotateQueriesParams rp;
    rp.batch = batch;
    rp.num_q_heads = hq;
    rp.q_per_kv = g;
    rp.heads_per_block = heads_per_block;
    rp.rotation = MakeRotationArgs(wp, HeadData{rot_dev.ptr});
    rp.q = q_dev.ptr;
    rp.q_rot = out.ptr;
    KVQ_CUDA_CHECK(attention::DispatchRotateQueries(d, rp, nullptr));
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    // The CPU's rotation of every (batch, head) row, [B * Hq, d].
    std::vector<float> want(q.size());
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < hq; ++h) {
        const size_t off = (static_cast<size_t>(b) * hq + h) * d;
        cpu::Rotate(cpu::ScalarBackend(), wp,
                    kind == 1 ? &rot[static_cast<size_t>(h / g) * d * d] : nullptr, &q[off],
                    &want[off], 1);
      }
    }
    testbed::NamedTensors inputs = {{"q", testbed::AsTensor(q, d)}};
    if (!rot.empty()) inputs.emplace_back("rotation", testbed::AsTensor(rot, d));
    EXPECT_TRUE(testbed::BitsEqual(
        "RotateQueries " + testbed::Describe(wp) + " g " + std::to_string(g) +
            " heads per block " + std::to_string(heads_per_block),
        "q_rot", testbed::AsTensor(want, d), testbed::AsTensor(out.ToHost(), d), inputs));
  };
  for (int d : {64, 128, 256}) {
    for (int kind = 0; kind < 3; ++kind) {
      for (const int g : {3, 8, 16}) {
        check(d, kind, g, 1);
        check(d, kind, g, attention::WidestAuxHeads(g, d));
      }
    }
  }
  // A block size that does not divide g is refused, not run.
  attention::RotateQueriesParams bad;
  bad.batch = 1;
  bad.num_q_heads = 6;
  bad.q_per_kv = 3;
  bad.heads_per_block = 2;
  EXPECT_EQ(attention::DispatchRotateQueries(128, bad, nullptr), cudaErrorInvalidValue);
  // More heads than a block has threads for (d = 256: 4 heads of 256 threads).
  bad.num_q_heads = 16;
  bad.q_per_kv = 8;
  bad.heads_per_block = 8;
  EXPECT_EQ(attention::DispatchRotateQueries(256, bad, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(attention::WidestAuxHeads(8, 256), 4);
  EXPECT_EQ(attention::WidestAuxHeads(6, 256), 3);
  EXPECT_EQ(attention::WidestAuxHeads(16, 128), 8);
}

// Configurations the kernels do not cover are refused by name, without a device.
TEST(GpuAttention, UnsupportedConfigurationsThrow) {
  Config cfg;
  cfg.bits = 4;
  cfg.group = 32;  // d*b/8 = 64 > G
  using testbed::ExpectError;
  ExpectError([&] { PlanDecodeAttention(MakeParams(cfg), 1, 100, 132); }, ErrorCode::kUnsupported,
              {"32"});
  Config gqa;
  gqa.hq = 24;
  gqa.hkv = 2;  // g = 12
  EXPECT_THROW(PlanDecodeAttention(MakeParams(gqa), 1, 100, 132), Error);
  // Key tiles of 128 tokens (32 bytes a channel), and K and V kinds no loop pairs:
  // kUnsupported naming the value.
  const CacheParams base = MakeParams(Config());
  Config tiled;
  tiled.tile = 128;
  tiled.page = 128;
  tiled.flush = 128;
  ExpectError([&] { PlanDecodeAttention(MakeParams(tiled), 1, 100, 132); },
              ErrorCode::kUnsupported, {"128"});
  const CacheParams fp8_values =
      testbed::Cache(base).value(testbed::Write(base.value).fp8()).Unchecked();
  ExpectError([&] { PlanDecodeAttention(fp8_values, 1, 100, 132); }, ErrorCode::kUnsupported,
              {"affine_token (bits 2) and value fp8_e4m3 (bits 8)"});
  // K and V at their own widths are served (K2V4, K4V2).
  const CacheParams k2v4 =
      testbed::Cache(base).value(testbed::Write(base.value).bits(4)).Unchecked();
  EXPECT_NO_THROW(PlanDecodeAttention(k2v4, 1, 100, 132));
  Config ok;
  const DecodeAttentionPlan plan = PlanDecodeAttention(MakeParams(ok), 1, 131072, 132);
  EXPECT_GE(static_cast<int64_t>(plan.hist_splits) * plan.hist_tokens_per_split, 131072 - 320);
  EXPECT_EQ(plan.hist_tokens_per_split % attention::kTileTokens, 0);
  EXPECT_EQ(plan.window_tokens_per_split, 64);
  EXPECT_EQ(plan.window_splits, 5);
  EXPECT_EQ(plan.quant_loop, QuantLoop::kInt8Qk) << "g = 4 takes the int8 QK loop";
  EXPECT_THROW(PlanDecodeAttention(MakeParams(ok), 0, 100, 132), Error);
  // A loop the kernels do not have is refused before anything is launched (the pointers below
  // are never dereferenced).
  DecodeAttentionPlan unknown = plan;
  unknown.quant_loop = static_cast<QuantLoop>(7);
  alignas(256) static unsigned char workspace[256];
  static int32_t lens[1] = {131072};
  static float q[128], out[128];
  DecodeAttentionInputs in;
  in.batch = 1;
  in.max_seq_len = 131072;
  in.seq_lens = lens;
  in.q = q;
  // DecodeAttention refuses `plan` as an invalid argument with an error that names `knob`.
  auto expect_refused = [&](const Config& cfg, const DecodeAttentionPlan& bad, const char* knob) {
    ExpectError(
        [&] { DecodeAttention(MakeParams(cfg), in, bad, workspace, bad.workspace_bytes, out); },
        ErrorCode::kInvalidArgument, {knob});
  };
  expect_refused(ok, unknown, "quant_loop 7");
  // The int8 QK and packed loops serve at most 4 heads per block: g = 8 with either is refused.
  Config wide = ok;
  wide.hq = 64;
  DecodeAttentionPlan wide_plan = PlanDecodeAttention(MakeParams(wide), 1, 131072, 132);
  EXPECT_EQ(wide_plan.quant_loop, QuantLoop::kTwoMma);
  wide_plan.quant_loop = QuantLoop::kInt8Qk;
  expect_refused(wide, wide_plan, "quant_loop 2");
  wide_plan.quant_loop = QuantLoop::kPacked;
  expect_refused(wide, wide_plan, "quant_loop 1");
  // Rotation / merge blocks must take a divisor of g heads (g = 4 here).
  DecodeAttentionPlan aux = plan;
  aux.aux_heads_per_block = 3;
  expect_refused(ok, aux, "aux_heads_per_block");
}

// The profiling records (DecodeAttentionInputs::timeline): one per block of the three kernels,
// each block of the kind its split implies, and the stamps in the order the kernels' programmatic
// dependencies promise: a history block has its rotated queries only after every rotation block
// finished, and the merge ends after every decode block. Profiling does not change the output.
TEST(GpuAttention, Timeline_RecordsEveryBlockInDependencyOrder) {
  REQUIRE_GPU();
  Config cfg;
  cfg.name = "timeline";
  cfg.sink = 8;
  cfg.recent = 16;
  cfg.page = 16;
  cfg.lengths = {1, 20, 500, 3000};  // window only, window only, both, both
  cfg.seed = 14;
  const TestCase tc(cfg);
  const int batch = static_cast<int>(tc.seqs.size());
  const DecodeAttentionPlan plan = PlanDecodeAttention(tc.params, batch, tc.max_len);
  const DecodeStepBlocks blocks = DecodeAttentionBlocks(tc.params, batch, plan);
  ASSERT_EQ(blocks.rotate, batch * cfg.hq / plan.aux_heads_per_block);
  ASSERT_EQ(blocks.merge, batch * cfg.hq / plan.aux_heads_per_block);
  const int heads_x = cfg.hkv;  // g = 4: one head chunk per KV head
  ASSERT_EQ(blocks.decode,
            static_cast<int64_t>(heads_x) * batch * (plan.hist_splits + plan.window_splits));
  DeviceBuffer<uint64_t> timeline(4 * blocks.total());
  KVQ_CUDA_CHECK(cudaMemset(timeline.ptr, 0, timeline.count * 8));
  const Variant loop{plan.quant_loop};
  const std::vector<float> profiled = tc.RunGpu(loop, timeline.ptr);
  const std::vector<float> plain = tc.RunGpu(loop);
  ASSERT_EQ(profiled.size(), plain.size());
  EXPECT_EQ(std::memcmp(profiled.data(), plain.data(), plain.size() * 4), 0);

  const std::vector<uint64_t> rec = timeline.ToHost();
  using attention::BlockKind;
  auto kind = [&](int64_t i) { return static_cast<BlockKind>(rec[4 * i + 3] >> 32); };
  uint64_t rotate_last_exit = 0, decode_last_exit = 0;
  int64_t history = 0, window = 0, empty = 0;
  for (int64_t i = 0; i < blocks.total(); ++i) {
    SCOPED_TRACE(::testing::Message() << "block record " << i);
    ASSERT_GT(rec[4 * i], 0u) << "entry stamped";
    ASSERT_GE(rec[4 * i + 2], rec[4 * i]) << "exit after entry";
    if (i < blocks.rotate) {
      EXPECT_EQ(kind(i), BlockKind::kRotate);
      rotate_last_exit = std::max(rotate_last_exit, rec[4 * i + 2]);
      continue;
    }
    if (i >= blocks.rotate + blocks.decode) {
      EXPECT_EQ(kind(i), BlockKind::kMerge);
      continue;
    }
    // Decode block (x, y = sequence, z = split); what its split holds.
    const int64_t d = i - blocks.rotate;
    const int b = static_cast<int>((d / heads_x) % batch);
    const int z = static_cast<int>(d / (heads_x * batch));
    const int t = static_cast<int>(tc.cache.Length(tc.seqs[b]));
    const int n_hist = std::max(0, t - cfg.recent - cfg.sink);
    const int n_window = std::min(t, cfg.sink) + std::max(0, t - std::max(cfg.sink, t - cfg.recent));
    BlockKind want;
    if (z < plan.hist_splits) {
      want = z * plan.hist_tokens_per_split < n_hist ? BlockKind::kHistory : BlockKind::kEmpty;
    } else {
      want = (z - plan.hist_splits) * plan.window_tokens_per_split < n_window ? BlockKind::kWindow
                                                                             : BlockKind::kEmpty;
    }
    EXPECT_EQ(kind(d + blocks.rotate), want) << "b " << b << " z " << z;
    decode_last_exit = std::max(decode_last_exit, rec[4 * i + 2]);
    history += want == BlockKind::kHistory;
    window += want == BlockKind::kWindow;
    empty += want == BlockKind::kEmpty;
    if (want == BlockKind::kHistory) {
      EXPECT_GE(rec[4 * i + 1], rec[4 * i]) << "queries ready after entry";
      EXPECT_LE(rec[4 * i + 1], rec[4 * i + 2]) << "and before exit";
    } else {
      EXPECT_EQ(rec[4 * i + 1], 0u) << "only history blocks read the rotated queries";
    }
  }
  EXPECT_GT(history, 0);
  EXPECT_GT(window, 0);
  EXPECT_GT(empty, 0);
  for (int64_t i = blocks.rotate; i < blocks.rotate + blocks.decode; ++i) {
    if (kind(i) == BlockKind::kHistory) {
      EXPECT_GE(rec[4 * i + 1], rotate_last_exit) << "block record " << i;
    }
  }
  for (int64_t i = blocks.rotate + blocks.decode; i < blocks.total(); ++i) {
    EXPECT_GE(rec[4 * i + 1], decode_last_exit) << "merge block record " << i << ": partials ready";
    EXPECT_GE(rec[4 * i + 2], rec[4 * i + 1]) << "merge block record " << i;
  }
}

// The plan fills whole waves of resident decode blocks (4 per SM at d = 128) with history
// blocks and covers every paged token with splits of at most kMaxSplitTokens, for the int8 QK
// loop and for the bf16 loops alike.
TEST(GpuAttention, PlanFillsWholeWaves) {
  Config ok;  // d = 128, S0 = 64, W = 256
  ok.hq = 32;
  ok.hkv = 8;
  for (const bool allow_int8 : {true, false}) {
    for (const int batch : {1, 3, 8, 32, 128}) {
      for (const int len : {400, 8192, 32768, 131072}) {
        SCOPED_TRACE(::testing::Message() << "B " << batch << " T " << len << " int8 " << allow_int8);
        const DecodeAttentionPlan plan =
            PlanDecodeAttention(MakeParams(ok), batch, len, 132, allow_int8);
        // g = 4 takes the int8 QK loop unless refused, then the packed hi / lo bf16 loop.
        EXPECT_EQ(plan.quant_loop, allow_int8 ? QuantLoop::kInt8Qk : QuantLoop::kPacked);
        const int resident = attention::ResidentDecodeBlocksPerSm(128) * 132;
        EXPECT_EQ(resident, 4 * 132);
        const int64_t paged = len - 320;
        const int64_t hist_blocks = static_cast<int64_t>(plan.hist_splits) * 8 * batch;
        EXPECT_GE(static_cast<int64_t>(plan.hist_splits) * plan.hist_tokens_per_split, paged);
        EXPECT_LE(plan.hist_tokens_per_split, attention::kMaxSplitTokens);
        EXPECT_EQ(plan.hist_tokens_per_split % attention::kTileTokens, 0);
        // No more waves than the split cap forces, and a long single sequence fills its wave.
        const int64_t min_splits = (paged + attention::kMaxSplitTokens - 1) / attention::kMaxSplitTokens;
        const int64_t waves = (min_splits * 8 * batch + resident - 1) / resident;
        EXPECT_LE(hist_blocks, waves * resident);
        if (batch == 1 && len == 131072) EXPECT_GE(hist_blocks, resident * 9 / 10);
        // One sequence: the window blocks get slots beside the one history wave (they would
        // otherwise run after it).
        const int64_t window_blocks = static_cast<int64_t>(plan.window_splits) * 8 * batch;
        if (batch == 1) EXPECT_LE(hist_blocks + window_blocks, resident);
        // Window blocks of 64 tokens while they fit one wave, else the fewest splits that fit
        // (one split of the whole window at least), in multiples of 64 tokens.
        EXPECT_EQ(plan.window_tokens_per_split % 64, 0);
        EXPECT_GE(static_cast<int64_t>(plan.window_splits) * plan.window_tokens_per_split, std::min(len, 320));
        if (8 * batch * 5 <= resident) {
          EXPECT_EQ(plan.window_tokens_per_split, 64);
        } else {
          EXPECT_TRUE(window_blocks <= resident || plan.window_splits == 1) << window_blocks;
          EXPECT_GT(plan.window_tokens_per_split, 64);
        }
        // The rotation: a block per query head while they fit on the SMs, else per KV head.
        EXPECT_EQ(plan.aux_heads_per_block, batch * 32 <= 2 * 132 ? 1 : 4);
      }
    }
  }
  // The bf16 cache keeps about 8 blocks per SM over the grid (its pipeline is shallow).
  Config bf16 = ok;
  bf16.quantized = false;
  const DecodeAttentionPlan plan = PlanDecodeAttention(MakeParams(bf16), 1, 131072, 132);
  EXPECT_EQ(plan.hist_tokens_per_split, 1024);  // ceil(131072 / ceil(8 * 132 / 8)) -> 64s
  EXPECT_EQ(plan.hist_splits, 128);
  EXPECT_EQ(plan.window_splits, 0);
  EXPECT_EQ(plan.quant_loop, QuantLoop::kTwoMma);
  // g = 8 fills all N = 8 columns with heads: no packing.
  Config wide = ok;
  wide.hq = 64;
  EXPECT_EQ(PlanDecodeAttention(MakeParams(wide), 1, 131072, 132).quant_loop, QuantLoop::kTwoMma);
}

}  // namespace
}  // namespace kvq::gpu
