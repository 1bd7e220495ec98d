// The paged CUDA writes (PrefillWrite, AppendStep) against the CPU oracle's PagedKVCache
// (scalar backend): every history row or tile of every plane (codes, scale, min, norm) at the
// page and slot the GPU page table names, the bf16 sink rows and the ring slots in use, bit for
// bit. Pools and windows are poisoned first (twice, with two bytes); the whole pool is
// compared, so a stray write into a page or slot not in use fails too. Spec 1.1's caches are
// among the cases (KIVI, OScaR with a per-head and a token-scope norm, SAW-INT4 at G = d with
// W = 0, flushes of F > 1 on per-token formats), and over random lengths the history a GPU
// prefill writes equals the one its decode steps demote, bit for bit. DecodeStep (the append
// with the decode overlapping it) leaves the cache and the output of AppendStep then
// DecodeAttention, bit for bit, on the stream and under CUDA-graph replay.
#include <gtest/gtest.h>

#include <cstring>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/write.h"
#include "kvq/testbed/cache_checks.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"

namespace kvq::gpu {
namespace {

using namespace kvq::gpu::testing;
using conformance::SplitMix64;
using cpu::KV;
using testbed::AllBitsEqual;
using testbed::AsTensor;
using testbed::Cache;
using testbed::Describe;
using testbed::NamedTensors;
using testbed::Write;

struct CacheCase {
  const char* name;
  CacheParams params;
};

std::vector<CacheCase> Cases() {
  // Spec 1.1: KIVI (tiles of 32 keys, per-token values of G = 32, S0 = 0, W = 1, F = 128), OScaR
  // (FWHT on K and V, a norm per key row: per KV head or one per token; sink and window), tiles
  // of 64 and 128 with INT4 and a block FWHT with P_br under W = 0, SAW-INT4 (G = d, block FWHT,
  // S0 = W = 0) at d = 256 and d = 128, and a per-token format flushed F = 64 at a time.
  const Write kivi_v = Write().head_dim(128).group(32).bits(2);
  return {
      {"d128_kivi_F128_W1",
       Cache().kv_heads(2).q_heads(4).sink(0).recent(1).flush(128).page(64)
           .key(Write().head_dim(128).tile(32).bits(2)).value(kivi_v)},
      {"d128_ots_head_norm_S4_W3_F64",
       Cache().kv_heads(2).q_heads(4).sink(4).recent(3).flush(64).page(32)
           .key(Write().head_dim(128).tile(32).bits(2).hadamard().norm())
           .value(Write(kivi_v).hadamard())},
      {"d64_ots_token_norm_3heads_F32_W0",
       Cache().kv_heads(3).q_heads(3).sink(2).recent(0).flush(32).page(32)
           .key(Write().head_dim(64).tile(32).bits(2).hadamard().norm().norm_heads(3).clip(0.9f))
           .value(Write().head_dim(64).tile(32).bits(2).hadamard().bitrev())},
      {"d256_tile64_int4_tile128_W0_F128",
       Cache().kv_heads(1).q_heads(2).sink(0).recent(0).flush(128).page(128)
           .key(Write().head_dim(256).tile(64).bits(4).hadamard(16).bitrev().norm())
           .value(Write().head_dim(256).tile(128).bits(2).clip(0.5f))},
      {"d256_saw_int4_W0",
       Cache().kv_heads(2).q_heads(4).sink(0).recent(0).page(16)
           .both(Write().head_dim(256).group(256).bits(4).hadamard(128))},
      {"d128_saw_int4_W0_sink",
       Cache().kv_heads(2).q_heads(8).sink(3).recent(0).page(16)
           .both(Write().head_dim(128).group(128).bits(4).hadamard())},
      {"d64_token_F64_W5_dense",
       Cache().kv_heads(2).q_heads(4).sink(1).recent(5).flush(64).page(16)
           .key(Write().head_dim(64).group(32).bits(2).rotation(RotationKind::kDense).clip(0.9f))
           .value(Write().head_dim(64).group(64).bits(4).hadamard().bitrev())},
      {"d64_dense_bitrev_int2_fwht_int4",
       Cache().kv_heads(2).q_heads(4).sink(4).recent(16).page(16)
           .key(Write().head_dim(64).group(32).bits(2).rotation(RotationKind::kDense).bitrev()
                    .clip(0.9f))
           .value(Write().head_dim(64).group(64).bits(4).hadamard())},
      {"d128_oscar_defaults",
       Cache().kv_heads(8).q_heads(16).sink(64).recent(256).page(64)
           .key(Write().head_dim(128).group(64).bits(2).rotation(RotationKind::kDense).clip(0.96f))
           .value(Write().head_dim(128).group(64).bits(2).rotation(RotationKind::kDense)
                      .clip(0.92f))},
      // Spec 1.2: fp8_e4m3 without windows (the fp8 schemes' default) and with them, dense
      // and FWHT rotations, scales that saturate and that reach the subnormals.
      {"d128_fp8_hadamard_W0",
       Cache().kv_heads(2).q_heads(4).sink(0).recent(0).page(16)
           .both(Write().head_dim(128).hadamard().fp8(0.0625f))},
      {"d64_fp8_dense_sink_window",
       Cache().kv_heads(2).q_heads(4).sink(2).recent(4).page(16)
           .key(Write().head_dim(64).rotation(RotationKind::kDense).fp8(1.0f / 448.0f).clip(0.9f))
           .value(Write().head_dim(64).fp8(37.5f))},
      {"d256_block16_int4_identity_bitrev_int2_no_sink",
       Cache().kv_heads(1).q_heads(2).sink(0).recent(1).page(16)
           .key(Write().head_dim(256).group(128).bits(4).hadamard(16).clip(0.5f))
           .value(Write().head_dim(256).group(32).bits(2).bitrev())},
  };
}

// Per-KV-head data shared by the CPU cache and the device: random orthogonal rotations where a
// half is dense, and clip ratios that differ between heads and between K and V.
struct HeadsData {
  std::vector<float> rotation_k, rotation_v, clip_k, clip_v;
};

HeadsData MakeHeads(const CacheParams& c, SplitMix64* rng) {
  HeadsData h;
  h.rotation_k = testbed::HeadRotations(c.key, c.num_kv_heads, rng);
  h.rotation_v = testbed::HeadRotations(c.value, c.num_kv_heads, rng);
  const float ratios[] = {1.0f, 0.96f, 0.9f, 0.75f};
  for (int i = 0; i < c.num_kv_heads; ++i) {
    h.clip_k.push_back(ratios[i % 4]);
    h.clip_v.push_back(ratios[(i + 1) % 4]);
  }
  return h;
}

// The per-head data as a failure dump's inputs (the tests add their rows and page tables).
NamedTensors HeadInputs(const CacheParams& c, const HeadsData& h) {
  const int64_t d = c.head_dim();
  NamedTensors inputs;
  if (!h.rotation_k.empty()) inputs.emplace_back("rotation_k", AsTensor(h.rotation_k, d));
  if (!h.rotation_v.empty()) inputs.emplace_back("rotation_v", AsTensor(h.rotation_v, d));
  inputs.emplace_back("clip_k", AsTensor(h.clip_k));
  inputs.emplace_back("clip_v", AsTensor(h.clip_v));
  return inputs;
}

// Device copies of the per-head data and one pool per K / V: a buffer per plane of the
// format's layout (LayoutOf), `pages` pages each.
struct DeviceCache {
  DeviceBuffer<float> rotation_k, rotation_v, clip_k, clip_v;
  FormatLayout layout[2];
  DeviceBuffer<uint8_t> planes[2][kMaxPlanes];
  int num_pages = 0;

  DeviceCache(const CacheParams& c, const HeadsData& h, int pages)
      : rotation_k(h.rotation_k), rotation_v(h.rotation_v), clip_k(h.clip_k), clip_v(h.clip_v),
        layout{LayoutOf(c.key), LayoutOf(c.value)}, num_pages(pages) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = 0; i < layout[kv].num_planes; ++i) {
        planes[kv][i] = DeviceBuffer<uint8_t>(
            static_cast<size_t>(pages) * layout[kv].PageBytes(i, c.page_size, c.num_kv_heads));
      }
    }
  }
  void Poison(uint8_t byte) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = 0; i < layout[kv].num_planes; ++i) planes[kv][i].Fill(byte);
    }
  }
  HeadData Heads(KV kv) const {
    HeadData d;
    d.rotation = kv == KV::kKey ? rotation_k.get() : rotation_v.get();
    d.clip = kv == KV::kKey ? clip_k.get() : clip_v.get();
    return d;
  }
  PagePool Pool(KV kv) const {
    const int k = static_cast<int>(kv);
    PagePool pool;
    for (int i = 0; i < layout[k].num_planes; ++i) pool.planes[i] = planes[k][i].get();
    pool.num_pages = num_pages;
    return pool;
  }
};

// The pools to compare, one tensor per K / V plane ("key.pool.codes", ...), [rows, row bytes].
// Expected: poison everywhere, then every history row of `tables[s]` (a token's row, its tile's
// row, or its row shared by the KV heads: FormatLayout::RowOffset) copied from the CPU cache's
// sequence `seqs[s]`, at the CPU page its own table names.
void AddPools(const cpu::PagedKVCache& cache, const std::vector<int>& seqs,
              const std::vector<std::vector<int32_t>>& tables, const DeviceCache& dev,
              uint8_t poison, NamedTensors* expected, NamedTensors* got) {
  const CacheParams& c = cache.params();
  for (KV kv : {KV::kKey, KV::kValue}) {
    const int k = static_cast<int>(kv);
    const FormatLayout& layout = dev.layout[k];
    for (int i = 0; i < layout.num_planes; ++i) {
      const size_t row_bytes = layout.plane(i).row_bytes();
      const int heads = static_cast<int>(layout.HeadsPerPage(i, c.num_kv_heads));
      const uint8_t* pool = cache.PoolPlane(kv, i);
      std::vector<uint8_t> want(dev.planes[k][i].size(), poison);
      for (size_t s = 0; s < seqs.size(); ++s) {
        const std::vector<int32_t>& cpu_table = cache.PageTable(seqs[s]);
        const size_t history = cache.HistoryLength(seqs[s]);
        for (size_t t = 0; t < history; ++t) {
          for (int h = 0; h < heads; ++h) {
            const int64_t slot = static_cast<int64_t>(t % c.page_size);
            const size_t from = layout.RowOffset(i, c.page_size, c.num_kv_heads,
                                                 cpu_table[t / c.page_size], h, slot);
            const size_t to = layout.RowOffset(i, c.page_size, c.num_kv_heads,
                                               tables[s][t / c.page_size], h, slot);
            std::copy(pool + from, pool + from + row_bytes, want.begin() + to);
          }
        }
      }
      const std::string name =
          std::string(kv == KV::kKey ? "key" : "value") + ".pool." + layout.plane(i).name;
      expected->emplace_back(name, AsTensor(want, static_cast<int64_t>(row_bytes)));
      got->emplace_back(name,
                        AsTensor(dev.planes[k][i].Download(), static_cast<int64_t>(row_bytes)));
    }
  }
}

// The windows of sequence `seq` to compare ("<prefix>key.sink", "<prefix>key.ring", ...):
// sink rows in use and ring slots in use must equal the CPU cache; with `exact_unused`, every
// other row must still hold the poison (prefill into fresh windows).
void AddWindows(const cpu::PagedKVCache& cache, int seq, const std::vector<uint16_t>& sink,
                const std::vector<uint16_t>& ring, KV kv, bool exact_unused, uint8_t poison,
                const std::string& prefix, NamedTensors* expected, NamedTensors* got) {
  const CacheParams& c = cache.params();
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const uint16_t poison16 = static_cast<uint16_t>(poison * 0x0101u);
  std::vector<uint16_t> want_sink(sink.size(), poison16), want_ring(ring.size(), poison16);
  const int ring_slots = c.ring_slots();  // W + F - 1: position p at slot p % ring_slots
  std::vector<bool> sink_used(c.sink, false), ring_used(ring_slots, false);
  const uint16_t* cpu_sink = cache.SinkRows(seq, kv);
  for (size_t p = 0; p < cache.SinkLength(seq); ++p) {
    std::copy(cpu_sink + p * row, cpu_sink + (p + 1) * row, want_sink.begin() + p * row);
    sink_used[p] = true;
  }
  const uint16_t* cpu_ring = cache.RecentRing(seq, kv);
  for (size_t p = cache.RecentBegin(seq); p < cache.Length(seq); ++p) {
    const size_t slot = p % ring_slots;
    std::copy(cpu_ring + slot * row, cpu_ring + (slot + 1) * row, want_ring.begin() + slot * row);
    ring_used[slot] = true;
  }
  std::vector<uint16_t> got_sink = sink, got_ring = ring;
  if (!exact_unused) {  // slots not in use may hold older tokens: compare only those in use
    for (int s = 0; s < c.sink; ++s) {
      if (!sink_used[s]) std::fill_n(got_sink.begin() + s * row, row, poison16);
    }
    for (int s = 0; s < ring_slots; ++s) {
      if (!ring_used[s]) std::fill_n(got_ring.begin() + s * row, row, poison16);
    }
  }
  const std::string name = prefix + (kv == KV::kKey ? "key" : "value");
  const int64_t columns = static_cast<int64_t>(row);
  expected->emplace_back(name + ".sink", AsTensor(want_sink, columns));
  got->emplace_back(name + ".sink", AsTensor(got_sink, columns));
  expected->emplace_back(name + ".ring", AsTensor(want_ring, columns));
  got->emplace_back(name + ".ring", AsTensor(got_ring, columns));
}

// bf16 rows of `tokens` tokens [tokens, Hkv, d] for the half written with p: every test row kind
// p's write path accepts in turn (conformance::MixedRows; with a norm, no row whose squares
// overflow), so a call of at least 24 rows holds every edge kind.
std::vector<uint16_t> Tokens(size_t tokens, const CacheParams& c, const WriteParams& p,
                             SplitMix64* rng) {
  return testbed::ToBf16(
      conformance::MixedRows(tokens * static_cast<size_t>(c.num_kv_heads), p, rng,
                             conformance::TestRowKinds(p)));
}

// The pages of a batch prefilled to `initial` lengths and stepped `steps` times: the longest
// sequence then, a page table's width (its history's pages and one more), the pool (every
// table's pages and two more) and the pool's page ids in a random order (drawn from rng).
struct StepPages {
  StepPages(const CacheParams& c, const std::vector<int>& initial, int steps, SplitMix64* rng)
      : longest(*std::max_element(initial.begin(), initial.end()) + steps),
        max_pages(static_cast<int>((c.HistoryTokens(longest) + c.page_size - 1) / c.page_size) +
                  1),
        pool_pages(static_cast<int>(initial.size()) * max_pages + 2),
        order(testbed::RandomPermutation(pool_pages, rng)) {}
  int longest, max_pages, pool_pages;
  std::vector<int32_t> order;
};

// A batch of sequences prefilled to `initial` lengths on the GPU, then `steps` decode steps
// that demote or flush into the pages of the GPU's page tables; the final state equals the CPU
// cache that ran the same steps, or with `prefill_reference` the CPU cache prefilled with the
// same rows at the final lengths.
void CheckAppendSteps(const CacheParams& c, const std::vector<int>& initial, int steps,
                      uint64_t seed, bool prefill_reference) {
  const int s0 = c.sink, ring = c.ring_slots();
  SplitMix64 rng(seed);
  const HeadsData heads = MakeHeads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const int batch = static_cast<int>(initial.size());
  const StepPages pages(c, initial, steps, &rng);
  const int max_pages = pages.max_pages, pool_pages = pages.pool_pages;
  const std::vector<int32_t>& order = pages.order;
  std::vector<std::vector<int32_t>> tables(batch);
  std::vector<int32_t> flat_tables;
  for (int b = 0; b < batch; ++b) {
    tables[b].assign(order.begin() + b * max_pages, order.begin() + (b + 1) * max_pages);
    flat_tables.insert(flat_tables.end(), tables[b].begin(), tables[b].end());
  }

  std::vector<std::vector<uint16_t>> prefill_k(batch), prefill_v(batch);
  std::vector<std::vector<uint16_t>> step_k(steps), step_v(steps);
  for (int b = 0; b < batch; ++b) {
    prefill_k[b] = Tokens(initial[b], c, c.key, &rng);
    prefill_v[b] = Tokens(initial[b], c, c.value, &rng);
  }
  // The steps' rows drawn at once, [steps * batch, Hkv, d], so that they take every row kind
  // (one step alone may have fewer rows than kinds).
  const std::vector<uint16_t> all_steps_k = Tokens(static_cast<size_t>(steps) * batch, c, c.key,
                                                   &rng);
  const std::vector<uint16_t> all_steps_v = Tokens(static_cast<size_t>(steps) * batch, c,
                                                   c.value, &rng);
  for (int s = 0; s < steps; ++s) {
    const size_t begin = static_cast<size_t>(s) * batch * row, end = begin + batch * row;
    step_k[s].assign(all_steps_k.begin() + begin, all_steps_k.begin() + end);  // [batch, Hkv, d]
    step_v[s].assign(all_steps_v.begin() + begin, all_steps_v.begin() + end);
  }
  NamedTensors inputs = HeadInputs(c, heads);
  for (int b = 0; b < batch; ++b) {
    if (initial[b] == 0) continue;
    const std::string seq = "seq" + std::to_string(b);
    inputs.emplace_back(seq + ".prefill_key", AsTensor(prefill_k[b], static_cast<int64_t>(row)));
    inputs.emplace_back(seq + ".prefill_value", AsTensor(prefill_v[b], static_cast<int64_t>(row)));
  }
  inputs.emplace_back("steps_key", AsTensor(all_steps_k, static_cast<int64_t>(row)));
  inputs.emplace_back("steps_value", AsTensor(all_steps_v, static_cast<int64_t>(row)));
  inputs.emplace_back("page_tables", AsTensor(flat_tables, max_pages));

  cpu::PagedKVCache cache(c, heads.rotation_k, heads.rotation_v, heads.clip_k, heads.clip_v,
                          cpu::ScalarBackend());
  std::vector<int> seqs;
  for (int b = 0; b < batch; ++b) {
    seqs.push_back(cache.AddSequence());
    if (prefill_reference) {  // the same rows, prefilled at the final length in one call
      std::vector<uint16_t> k = prefill_k[b], v = prefill_v[b];
      for (int s = 0; s < steps; ++s) {
        k.insert(k.end(), step_k[s].begin() + b * row, step_k[s].begin() + (b + 1) * row);
        v.insert(v.end(), step_v[s].begin() + b * row, step_v[s].begin() + (b + 1) * row);
      }
      cache.PrefillBf16(seqs[b], k.data(), v.data(), initial[b] + steps);
    } else if (initial[b] > 0) {
      cache.PrefillBf16(seqs[b], prefill_k[b].data(), prefill_v[b].data(), initial[b]);
    }
  }
  for (int s = 0; s < steps && !prefill_reference; ++s) {
    for (int b = 0; b < batch; ++b) {
      cache.AppendBf16(seqs[b], step_k[s].data() + b * row, step_v[s].data() + b * row);
    }
  }

  DeviceCache dev(c, heads, pool_pages);
  DeviceBuffer<int32_t> dtables(flat_tables), dlengths(batch);
  DeviceBuffer<uint16_t> sink_k(batch * s0 * row), sink_v(batch * s0 * row);
  DeviceBuffer<uint16_t> ring_k(batch * ring * row), ring_v(batch * ring * row);
  DeviceBuffer<int> flags(1);
  for (uint8_t poison : kPoisons) {
    dev.Poison(poison);
    sink_k.Fill(poison);
    sink_v.Fill(poison);
    ring_k.Fill(poison);
    ring_v.Fill(poison);
    flags.Fill(0);
    for (int b = 0; b < batch; ++b) {
      if (initial[b] == 0) continue;
      DeviceBuffer<uint16_t> dk(prefill_k[b]), dv(prefill_v[b]);
      Windows one{sink_k.get() + b * s0 * row, sink_v.get() + b * s0 * row,
                  ring_k.get() + b * ring * row, ring_v.get() + b * ring * row};
      PrefillWrite(c, dk.get(), dv.get(), initial[b], dtables.get() + b * max_pages,
                   dev.Heads(KV::kKey), dev.Heads(KV::kValue), dev.Pool(KV::kKey),
                   dev.Pool(KV::kValue), one, flags.get());
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    }
    std::vector<int32_t> lengths(initial.begin(), initial.end());
    const Windows windows{sink_k.get(), sink_v.get(), ring_k.get(), ring_v.get()};
    for (int s = 0; s < steps; ++s) {
      dlengths.Upload(lengths);
      DeviceBuffer<uint16_t> dk(step_k[s]), dv(step_v[s]);
      AppendStep(c, dk.get(), dv.get(), batch, dlengths.get(), dtables.get(), max_pages,
                 dev.Heads(KV::kKey), dev.Heads(KV::kValue), dev.Pool(KV::kKey),
                 dev.Pool(KV::kValue), windows, flags.get());
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      for (int32_t& len : lengths) ++len;
    }
    std::string ctx = "PagedWrite append " + Describe(c) + " seed " + std::to_string(seed) +
                      (prefill_reference ? " vs prefill" : "") + " steps " +
                      std::to_string(steps) + " initial";
    for (int len : initial) ctx += " " + std::to_string(len);
    ctx += " poison " + std::to_string(poison);
    EXPECT_EQ(flags.Download()[0], 0) << ctx;
    NamedTensors expected, got;
    AddPools(cache, seqs, tables, dev, poison, &expected, &got);
    const std::vector<uint16_t> sk = sink_k.Download(), sv = sink_v.Download();
    const std::vector<uint16_t> rk = ring_k.Download(), rv = ring_v.Download();
    for (int b = 0; b < batch; ++b) {
      auto slice = [](const std::vector<uint16_t>& all, size_t begin, size_t count) {
        return std::vector<uint16_t>(all.begin() + begin, all.begin() + begin + count);
      };
      const std::string seq = "seq" + std::to_string(b) + ".";
      AddWindows(cache, seqs[b], slice(sk, b * s0 * row, s0 * row),
                 slice(rk, b * ring * row, ring * row), KV::kKey, false, poison, seq, &expected,
                 &got);
      AddWindows(cache, seqs[b], slice(sv, b * s0 * row, s0 * row),
                 slice(rv, b * ring * row, ring * row), KV::kValue, false, poison, seq,
                 &expected, &got);
    }
    EXPECT_TRUE(AllBitsEqual(ctx, expected, got, inputs));
  }
}

// DecodeStep against AppendStep then DecodeAttention (synchronised between them), on two
// copies of one cache: a batch at lengths around every window, flush and page boundary, stepped
// until each sequence has demoted or flushed, the output and every byte of the pools and
// windows compared after every step; the last steps run as a captured graph, replayed. A
// DecodeStep block that streamed history the append was still writing, or a window block that
// read the ring too early, changes the output; an append the decode overtook changes the cache.
void CheckDecodeStep(const CacheParams& c, const std::vector<int>& initial, int steps,
                     uint64_t seed) {
  SplitMix64 rng(seed);
  const HeadsData heads = MakeHeads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const int batch = static_cast<int>(initial.size());
  const StepPages pages(c, initial, steps, &rng);
  const int longest = pages.longest, max_pages = pages.max_pages, pool_pages = pages.pool_pages;
  const std::vector<int32_t> tables(pages.order.begin(),
                                    pages.order.begin() + batch * max_pages);
  DecodeAttentionPlan plan;
  try {
    plan = PlanDecodeAttention(c, batch, longest);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnsupported) throw;
    GTEST_SKIP() << Describe(c) << ": " << e.what();
  }
  const int s0 = c.sink, ring = c.ring_slots();
  DeviceBuffer<int32_t> dtables(tables), dlengths(batch), dseq_lens(batch);
  DeviceBuffer<int> flags(1);
  DeviceBuffer<float> k_scale(std::vector<float>(c.num_kv_heads, c.key.head_scale));
  DeviceBuffer<float> v_scale(std::vector<float>(c.num_kv_heads, c.value.head_scale));
  DeviceBuffer<uint8_t> workspace(plan.workspace_bytes);
  DeviceBuffer<float> out[2] = {DeviceBuffer<float>(batch * c.num_q_heads * c.head_dim()),
                                DeviceBuffer<float>(batch * c.num_q_heads * c.head_dim())};
  // Copy 0 steps apart, copy 1 through DecodeStep.
  struct Copy {
    DeviceCache dev;
    DeviceBuffer<uint16_t> sink_k, sink_v, ring_k, ring_v;
  };
  std::vector<Copy> copies;
  for (int i = 0; i < 2; ++i) {
    copies.push_back(Copy{DeviceCache(c, heads, pool_pages),
                          DeviceBuffer<uint16_t>(std::max<size_t>(1, batch * s0 * row)),
                          DeviceBuffer<uint16_t>(std::max<size_t>(1, batch * s0 * row)),
                          DeviceBuffer<uint16_t>(std::max<size_t>(1, batch * ring * row)),
                          DeviceBuffer<uint16_t>(std::max<size_t>(1, batch * ring * row))});
  }
  const auto windows = [&](Copy& copy, int b) {
    return Windows{copy.sink_k.get() + b * s0 * row, copy.sink_v.get() + b * s0 * row,
                   copy.ring_k.get() + b * ring * row, copy.ring_v.get() + b * ring * row};
  };
  for (Copy& copy : copies) {
    copy.dev.Poison(0x5A);
    for (auto* w : {&copy.sink_k, &copy.sink_v, &copy.ring_k, &copy.ring_v}) w->Fill(0x5A);
  }
  for (int b = 0; b < batch; ++b) {
    if (initial[b] == 0) continue;
    DeviceBuffer<uint16_t> dk(Tokens(initial[b], c, c.key, &rng));
    DeviceBuffer<uint16_t> dv(Tokens(initial[b], c, c.value, &rng));
    for (Copy& copy : copies) {
      PrefillWrite(c, dk.get(), dv.get(), initial[b], dtables.get() + b * max_pages,
                   copy.dev.Heads(KV::kKey), copy.dev.Heads(KV::kValue), copy.dev.Pool(KV::kKey),
                   copy.dev.Pool(KV::kValue), windows(copy, b), flags.get());
    }
  }
  const auto inputs = [&](Copy& copy) {
    DecodeAttentionInputs in;
    in.batch = batch;
    in.max_seq_len = longest;
    in.seq_lens = dseq_lens.get();
    in.page_tables = dtables.get();
    in.max_pages = max_pages;
    for (int i = 0; i < kMaxPlanes; ++i) {
      in.key_planes[i] = copy.dev.Pool(KV::kKey).planes[i];
      in.value_planes[i] = copy.dev.Pool(KV::kValue).planes[i];
    }
    in.sink_key = copy.sink_k.get();
    in.sink_value = copy.sink_v.get();
    in.recent_key = copy.ring_k.get();
    in.recent_value = copy.ring_v.get();
    in.key_heads = copy.dev.Heads(KV::kKey);
    in.value_heads = copy.dev.Heads(KV::kValue);
    in.key_heads.scale = k_scale.get();
    in.value_heads.scale = v_scale.get();
    return in;
  };
  cudaStream_t stream;
  KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<int32_t> lengths(initial.begin(), initial.end());
  const int graph_steps = 2;  // the last ones, as a captured graph
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> after = lengths;
    for (int32_t& len : after) ++len;
    dlengths.Upload(lengths);
    dseq_lens.Upload(after);
    DeviceBuffer<uint16_t> dk(Tokens(batch, c, c.key, &rng)), dv(Tokens(batch, c, c.value, &rng));
    DecodeAttentionInputs in0 = inputs(copies[0]), in1 = inputs(copies[1]);
    DeviceBuffer<float> q(testbed::Queries(static_cast<size_t>(batch) * c.num_q_heads,
                                           c.head_dim(), &rng, 2.0f));
    in0.q = in1.q = q.get();
    const Windows all0{copies[0].sink_k.get(), copies[0].sink_v.get(), copies[0].ring_k.get(),
                       copies[0].ring_v.get()};
    const Windows all1{copies[1].sink_k.get(), copies[1].sink_v.get(), copies[1].ring_k.get(),
                       copies[1].ring_v.get()};
    AppendStep(c, dk.get(), dv.get(), batch, dlengths.get(), dtables.get(), max_pages,
               in0.key_heads, in0.value_heads, copies[0].dev.Pool(KV::kKey),
               copies[0].dev.Pool(KV::kValue), all0, flags.get(), stream);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    DecodeAttention(c, in0, plan, workspace.get(), plan.workspace_bytes, out[0].get(), stream);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    // DecodeStep trusts nothing it finds in the workspace: the rotated queries and the counters
    // of its history blocks' wait (0x7F7F7F7F: above any count) are its own to write.
    workspace.Fill(0x7F);
    const auto step = [&] {
      DecodeStep(c, dk.get(), dv.get(), dlengths.get(), copies[1].dev.Pool(KV::kKey),
                 copies[1].dev.Pool(KV::kValue), all1, flags.get(), in1, plan, workspace.get(),
                 plan.workspace_bytes, out[1].get(), stream);
    };
    const bool graph = s >= steps - graph_steps;
    if (graph) {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      step();
      KVQ_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      KVQ_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      KVQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
      KVQ_CUDA_CHECK(cudaGraphExecDestroy(exec));
      KVQ_CUDA_CHECK(cudaGraphDestroy(g));
    } else {
      step();
      KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    std::string ctx = "DecodeStep " + Describe(c) + " seed " + std::to_string(seed) + " step " +
                      std::to_string(s) + (graph ? " (graph)" : "") + " lengths";
    for (int len : lengths) ctx += " " + std::to_string(len);
    ASSERT_EQ(flags.Download()[0], 0) << ctx;
    const std::vector<float> o0 = out[0].Download(), o1 = out[1].Download();
    ASSERT_EQ(std::memcmp(o0.data(), o1.data(), o0.size() * sizeof(float)), 0)
        << ctx << ": the outputs differ";
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = 0; i < copies[0].dev.layout[kv].num_planes; ++i) {
        ASSERT_EQ(copies[0].dev.planes[kv][i].Download(), copies[1].dev.planes[kv][i].Download())
            << ctx << ": " << (kv ? "value" : "key") << " plane "
            << copies[0].dev.layout[kv].plane(i).name << " differs";
      }
    }
    ASSERT_EQ(copies[0].sink_k.Download(), copies[1].sink_k.Download()) << ctx << ": sink K";
    ASSERT_EQ(copies[0].sink_v.Download(), copies[1].sink_v.Download()) << ctx << ": sink V";
    ASSERT_EQ(copies[0].ring_k.Download(), copies[1].ring_k.Download()) << ctx << ": ring K";
    ASSERT_EQ(copies[0].ring_v.Download(), copies[1].ring_v.Download()) << ctx << ": ring V";
    lengths = after;
  }
  KVQ_CUDA_CHECK(cudaStreamDestroy(stream));
}

class PagedWriteTest : public ::testing::TestWithParam<CacheCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

TEST_P(PagedWriteTest, PrefillMatchesCpuCache) {
  const CacheParams& c = GetParam().params;
  const int s0 = c.sink, w = c.recent, f = c.flush, page = c.page_size;
  const int ring = c.ring_slots();
  SplitMix64 rng(1234);
  const HeadsData heads = MakeHeads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  for (int tokens : {3, s0, s0 + w, s0 + w + 1, s0 + w + f - 1, s0 + w + f, s0 + w + page,
                     s0 + w + 2 * f + 1, s0 + w + 3 * page + 5}) {
    if (tokens <= 0) continue;
    const std::vector<uint16_t> k = Tokens(tokens, c, c.key, &rng);
    const std::vector<uint16_t> v = Tokens(tokens, c, c.value, &rng);
    cpu::PagedKVCache cache(c, heads.rotation_k, heads.rotation_v, heads.clip_k, heads.clip_v,
                            cpu::ScalarBackend());
    const int seq = cache.AddSequence();
    cache.PrefillBf16(seq, k.data(), v.data(), tokens);

    // The GPU's own page table: a random permutation over a pool with spare pages.
    const int history = static_cast<int>(c.HistoryTokens(tokens));
    const int pages_needed = (history + page - 1) / page;
    const int pool_pages = pages_needed + 3;
    const std::vector<int32_t> order = testbed::RandomPermutation(pool_pages, &rng);
    const std::vector<int32_t> table(order.begin(), order.begin() + std::max(pages_needed, 1));
    NamedTensors inputs = HeadInputs(c, heads);
    inputs.emplace_back("key", AsTensor(k, static_cast<int64_t>(row)));
    inputs.emplace_back("value", AsTensor(v, static_cast<int64_t>(row)));
    inputs.emplace_back("page_table", AsTensor(table));

    DeviceCache dev(c, heads, pool_pages);
    DeviceBuffer<uint16_t> dk(k), dv(v);
    DeviceBuffer<int32_t> dtable(table);
    DeviceBuffer<uint16_t> sink_k(s0 * row), sink_v(s0 * row), ring_k(ring * row),
        ring_v(ring * row);
    DeviceBuffer<int> flags(1);
    for (uint8_t poison : kPoisons) {
      dev.Poison(poison);
      sink_k.Fill(poison);
      sink_v.Fill(poison);
      ring_k.Fill(poison);
      ring_v.Fill(poison);
      flags.Fill(0);
      Windows windows{sink_k.get(), sink_v.get(), ring_k.get(), ring_v.get()};
      PrefillWrite(c, dk.get(), dv.get(), tokens, dtable.get(), dev.Heads(KV::kKey),
                   dev.Heads(KV::kValue), dev.Pool(KV::kKey), dev.Pool(KV::kValue), windows,
                   flags.get());
      const std::string ctx = "PagedWrite prefill " + std::string(GetParam().name) + " T " +
                              std::to_string(tokens) + " poison " + std::to_string(poison);
      EXPECT_EQ(flags.Download()[0], 0) << ctx;
      NamedTensors expected, got;
      AddPools(cache, {seq}, {table}, dev, poison, &expected, &got);
      AddWindows(cache, seq, sink_k.Download(), ring_k.Download(), KV::kKey, true, poison, "",
                 &expected, &got);
      AddWindows(cache, seq, sink_v.Download(), ring_v.Download(), KV::kValue, true, poison, "",
                 &expected, &got);
      EXPECT_TRUE(AllBitsEqual(ctx, expected, got, inputs));
    }
  }
}

// A batch of sequences at different lengths (in the sink, just before the first demotion, at
// it, and deep in the history) prefilled, then stepped; every step demotes into the pages of
// the GPU's page tables. The final state equals the CPU cache that ran the same steps.
TEST_P(PagedWriteTest, AppendStepsMatchCpuCache) {
  const CacheParams& c = GetParam().params;
  const int s0 = c.sink, w = c.recent, f = c.flush, page = c.page_size;
  // Every sequence reaches a flush (or F = 1's demotions) within the steps.
  CheckAppendSteps(c,
                   {0, std::max(0, s0 - 1), std::max(0, s0 + w - 1), s0 + w, s0 + w + page + 3},
                   std::max(page, f) + 3, 99, /*prefill_reference=*/false);
}

TEST_P(PagedWriteTest, DecodeStepEqualsAppendThenDecode) {
  const CacheParams& c = GetParam().params;
  const int s0 = c.sink, w = c.recent, f = c.flush, page = c.page_size;
  // Sequences in the sink, at the ring's end, at the first demotion or flush, deep in the
  // history; each demotes or flushes within the steps.
  CheckDecodeStep(c, {1, std::max(1, s0 + w - 1), s0 + w + f - 1, s0 + w + 3 * page + 5},
                  std::max(page, f) + 3, 77);
}

// Over random lengths: a batch prefilled to L0_b and stepped n times holds, in its pages and
// windows, the bits of a prefill to L0_b + n (the CPU cache's, which the PrefillMatchesCpuCache
// test holds the GPU prefill to): the history the decode steps demote equals the prefill's.
TEST_P(PagedWriteTest, DemotedHistoryEqualsPrefillOverRandomLengths) {
  const CacheParams& c = GetParam().params;
  const int span = c.sink + c.recent + 2 * std::max(c.flush, c.page_size);
  SplitMix64 rng(4711);
  for (int round = 0; round < 3; ++round) {
    std::vector<int> initial;
    for (int b = 0; b < 3; ++b) initial.push_back(static_cast<int>(rng.Below(span)));
    const int steps = 1 + static_cast<int>(rng.Below(c.flush + c.page_size + 2));
    CheckAppendSteps(c, initial, steps, 100 + round, /*prefill_reference=*/true);
  }
}

// A bad value argument (a dense value rotation without its matrices; for a tiled value, which
// has no dense kernel, a value pool without its codes plane) is refused before the key write
// is queued: the call throws naming the value tensor, and neither pool nor window is touched,
// for a prefill and for an append step.
TEST_P(PagedWriteTest, BadValueArgumentsWriteNothing) {
  const CacheParams& base = GetParam().params;
  const bool tiled_value = base.value.format == Format::kAffineTile;
  const CacheParams c =
      tiled_value ? base
                  : Cache(base).value(Write(base.value).rotation(RotationKind::kDense).hadamard_block(0));
  const int tokens = c.sink + c.recent + 2 * std::max(c.page_size, c.flush);
  SplitMix64 rng(17);
  const HeadsData heads = MakeHeads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const std::vector<uint16_t> k = Tokens(tokens, c, c.key, &rng);
  const std::vector<uint16_t> v = Tokens(tokens, c, c.value, &rng);
  DeviceCache dev(c, heads, 3);
  DeviceBuffer<uint16_t> dk(k), dv(v);
  DeviceBuffer<int32_t> dtable(std::vector<int32_t>{2, 0});
  DeviceBuffer<uint16_t> sink_k(std::max<size_t>(c.sink * row, 8)),
      sink_v(std::max<size_t>(c.sink * row, 8)), ring_k(c.ring_slots() * row),
      ring_v(c.ring_slots() * row);
  for (auto* buffer : {&sink_k, &sink_v, &ring_k, &ring_v}) buffer->Fill(0xEE);
  dev.Poison(0xEE);
  HeadData bad_value = dev.Heads(KV::kValue);
  PagePool value_pool = dev.Pool(KV::kValue);
  if (tiled_value) {
    value_pool.planes[kTileCodesPlane] = nullptr;
  } else {
    bad_value.rotation = nullptr;
  }
  const Windows windows{sink_k.get(), sink_v.get(), ring_k.get(), ring_v.get()};
  auto expect_untouched = [&](const char* call) {
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    for (int kv = 0; kv < 2; ++kv) {
      for (uint8_t byte : dev.planes[kv][kAffineCodesPlane].Download()) ASSERT_EQ(byte, 0xEE) << call << " pool " << kv;
    }
    for (auto* buffer : {&sink_k, &sink_v, &ring_k, &ring_v}) {
      for (uint16_t x : buffer->Download()) ASSERT_EQ(x, 0xEEEE) << call << " windows";
    }
  };
  testbed::ExpectError(
      [&] {
        PrefillWrite(c, dk.get(), dv.get(), tokens, dtable.get(), dev.Heads(KV::kKey), bad_value,
                     dev.Pool(KV::kKey), value_pool, windows);
      },
      ErrorCode::kInvalidArgument, {"(value)"});
  expect_untouched("PrefillWrite");
  DeviceBuffer<int32_t> dlen(std::vector<int32_t>{tokens});
  const std::vector<uint16_t> step = Tokens(1, c, c.key, &rng);
  DeviceBuffer<uint16_t> sk(step), sv(step);
  EXPECT_THROW(AppendStep(c, sk.get(), sv.get(), 1, dlen.get(), dtable.get(), 2,
                          dev.Heads(KV::kKey), bad_value, dev.Pool(KV::kKey), value_pool,
                          windows),
               Error);
  expect_untouched("AppendStep");
}

// A page id outside the pool, and a sequence that must demote with no page table entry, raise
// kErrorFlagBadPage and write nothing.
TEST_P(PagedWriteTest, BadPagesRaiseTheFlagAndWriteNothing) {
  const CacheParams& c = GetParam().params;
  const int tokens = c.sink + c.recent + c.flush;  // exactly one flush (one token at F = 1)
  SplitMix64 rng(5);
  const HeadsData heads = MakeHeads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const std::vector<uint16_t> k = Tokens(tokens, c, c.key, &rng);
  const std::vector<uint16_t> v = Tokens(tokens, c, c.value, &rng);
  DeviceCache dev(c, heads, 2);
  DeviceBuffer<uint16_t> dk(k), dv(v);
  // The pool has pages 0 and 1 only; every entry of the table names page 7.
  DeviceBuffer<int32_t> dtable(
      std::vector<int32_t>((c.HistoryTokens(tokens) + c.page_size - 1) / c.page_size, 7));
  DeviceBuffer<uint16_t> sink_k(c.sink * row), sink_v(c.sink * row),
      ring_k(c.ring_slots() * row), ring_v(c.ring_slots() * row);
  DeviceBuffer<int> flags(1);
  dev.Poison(0xFF);
  flags.Fill(0);
  PrefillWrite(c, dk.get(), dv.get(), tokens, dtable.get(), dev.Heads(KV::kKey),
               dev.Heads(KV::kValue), dev.Pool(KV::kKey), dev.Pool(KV::kValue),
               Windows{sink_k.get(), sink_v.get(), ring_k.get(), ring_v.get()}, flags.get());
  EXPECT_EQ(flags.Download()[0], kErrorFlagBadPage);
  for (uint8_t byte : dev.planes[0][kAffineCodesPlane].Download()) ASSERT_EQ(byte, 0xFF);
  EXPECT_THROW(CheckErrorFlags(flags.get(), "PrefillWrite"), Error);

  // Append at length S0 + W + F - 1 with max_pages = 0: position S0 must enter the history
  // but has no page.
  flags.Fill(0);
  DeviceBuffer<int32_t> dlen(std::vector<int32_t>{c.sink + c.recent + c.flush - 1});
  const std::vector<uint16_t> step = Tokens(1, c, c.key, &rng);
  DeviceBuffer<uint16_t> sk(step), sv(step);
  AppendStep(c, sk.get(), sv.get(), 1, dlen.get(), nullptr, 0, dev.Heads(KV::kKey),
             dev.Heads(KV::kValue), dev.Pool(KV::kKey), dev.Pool(KV::kValue),
             Windows{sink_k.get(), sink_v.get(), ring_k.get(), ring_v.get()}, flags.get());
  EXPECT_EQ(flags.Download()[0], kErrorFlagBadPage);
  for (uint8_t byte : dev.planes[1][kAffineCodesPlane].Download()) ASSERT_EQ(byte, 0xFF);
}

INSTANTIATE_TEST_SUITE_P(Caches, PagedWriteTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<CacheCase>& info) {
                           return std::string(info.param.name) + "__cuda";
                         });

}  // namespace
}  // namespace kvq::gpu
