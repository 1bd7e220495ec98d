// Properties of decode attention over the paged cache (RapidCheck), on random configurations
// of testbed::ArbitraryCacheParams() and every CPU backend:
//  - where a sequence's pages sit in the pool does not change its output (bit for bit);
//  - query head h reads KV head h / (Hq / Hkv) and nothing else: each KV head's query heads
//    give the same bits as a one-KV-head cache of that head's rows;
//  - every quantized cache (codebook sides with per-head widths included) and the bf16 cache
//    are within the oracle's tolerance of the fp64 reference.
// Replay a failure with RC_PARAMS="seed=<seed printed by RapidCheck>".
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"
#include "kvq/testbed/rapidcheck.h"

namespace kvq::cpu {
namespace {

const Backend& ArbitraryCpuBackend() {
  const std::vector<Backend>& list = Backends();
  return list[static_cast<size_t>(*rc::gen::inRange<int>(0, static_cast<int>(list.size())))];
}

// Per-head write data of a cache (testbed::DrawCacheHeads), drawn once so two caches share it.
using testbed::CacheHeads;

PagedKVCache MakeCache(const CacheParams& p, const CacheHeads& h, const Backend& backend) {
  return PagedKVCache(p, h.key, h.value, backend);
}

RC_GTEST_PROP(AttentionProps, WhereThePagesSitDoesNotChangeTheOutput, ()) {
  const CacheParams p = *testbed::ArbitraryCacheParams();
  RC_PRE(p.quantized());
  const Backend& backend = ArbitraryCpuBackend();
  testbed::SplitMix64 rng(*rc::gen::arbitrary<uint64_t>());
  const CacheHeads heads = testbed::DrawCacheHeads(p, &rng);
  const int hkv = p.num_kv_heads, d = p.head_dim();
  const size_t row = static_cast<size_t>(hkv * d);
  const size_t t = static_cast<size_t>(*rc::gen::inRange(1, 200));
  const std::vector<float> k = testbed::KvRows(t, hkv, d, &rng), v = testbed::KvRows(t, hkv, d, &rng);
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(p.num_q_heads), d, &rng, 0.5f);

  // A: the sequence alone, its pages in order. B: another sequence's appends interleaved with
  // the sequence's chunks, then removed, so the pages are spread over the pool.
  PagedKVCache a = MakeCache(p, heads, backend);
  const int sa = a.AddSequence();
  a.Prefill(sa, k.data(), v.data(), t);
  PagedKVCache b = MakeCache(p, heads, backend);
  const int other = b.AddSequence();
  const int sb = b.AddSequence();
  const std::vector<float> filler = testbed::KvRows(1, hkv, d, &rng);
  for (size_t done = 0; done < t;) {
    const size_t chunk = std::min(t - done, 1 + static_cast<size_t>(rng.Below(24)));
    b.Prefill(sb, &k[done * row], &v[done * row], chunk);
    done += chunk;
    for (int i = 0; i < 24; ++i) b.Append(other, filler.data(), filler.data());
  }
  b.RemoveSequence(other);
  RC_TAG(a.PageTable(sa) == b.PageTable(sb) ? "same page ids" : "pages moved");

  std::vector<float> out_a(q.size()), out_b(q.size());
  Attend(backend, a, sa, q.data(), out_a.data());
  Attend(backend, b, sb, q.data(), out_b.data());
  RC_ASSERT(std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) == 0);
}

RC_GTEST_PROP(AttentionProps, EachQueryHeadReadsOnlyItsKvHead, ()) {
  CacheParams p = *testbed::ArbitraryCacheParams();
  // A token-scope norm couples the KV heads of a token by design (one norm over all of them):
  // here it becomes the per-head norm.
  if (p.key.norm) p.key.norm_heads = 1;
  if (p.value.norm) p.value.norm_heads = 1;
  const Backend& backend = ArbitraryCpuBackend();
  testbed::SplitMix64 rng(*rc::gen::arbitrary<uint64_t>());
  const CacheHeads heads = testbed::DrawCacheHeads(p, &rng);
  const int hkv = p.num_kv_heads, g = p.group_size(), d = p.head_dim();
  const size_t dd = static_cast<size_t>(d);
  const size_t t = static_cast<size_t>(*rc::gen::inRange(1, 160));
  const std::vector<float> k = testbed::KvRows(t, hkv, d, &rng), v = testbed::KvRows(t, hkv, d, &rng);
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(p.num_q_heads), d, &rng, 0.5f);
  PagedKVCache full = MakeCache(p, heads, backend);
  const int seq = full.AddSequence();
  full.Prefill(seq, k.data(), v.data(), t);
  std::vector<float> out(q.size());
  Attend(backend, full, seq, q.data(), out.data());

  for (int h = 0; h < hkv; ++h) {
    CacheParams one = p;
    one.num_kv_heads = 1;
    one.num_q_heads = g;
    const CacheHeads mine{heads.key.Slice(p.key, h, "key"),
                          heads.value.Slice(p.value, h, "value")};
    std::vector<float> kh(t * dd), vh(t * dd);
    for (size_t i = 0; i < t; ++i) {
      std::memcpy(&kh[i * dd], &k[(i * hkv + h) * dd], dd * sizeof(float));
      std::memcpy(&vh[i * dd], &v[(i * hkv + h) * dd], dd * sizeof(float));
    }
    PagedKVCache single = MakeCache(one, mine, backend);
    const int s = single.AddSequence();
    single.Prefill(s, kh.data(), vh.data(), t);
    std::vector<float> got(static_cast<size_t>(g) * dd);
    Attend(backend, single, s, &q[static_cast<size_t>(h * g) * dd], got.data());
    RC_ASSERT(std::memcmp(got.data(), &out[static_cast<size_t>(h * g) * dd],
                          got.size() * sizeof(float)) == 0);
  }
}

// Every quantized configuration (per-token rows, tiles with and without a norm, F > 1, W = 0)
// against the fp64 reference over the same dequantized history.
RC_GTEST_PROP(AttentionProps, QuantizedCacheIsWithinTheOracleToleranceOfFp64, ()) {
  const CacheParams p = *testbed::ArbitraryCacheParams();
  RC_PRE(p.quantized());
  const Backend& backend = ArbitraryCpuBackend();
  testbed::SplitMix64 rng(*rc::gen::arbitrary<uint64_t>());
  const CacheHeads heads = testbed::DrawCacheHeads(p, &rng);
  const int hkv = p.num_kv_heads, d = p.head_dim();
  const size_t t = static_cast<size_t>(*rc::gen::inRange(1, 400));
  const std::vector<float> k = testbed::KvRows(t, hkv, d, &rng), v = testbed::KvRows(t, hkv, d, &rng);
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(p.num_q_heads), d, &rng, 0.5f);
  PagedKVCache cache = MakeCache(p, heads, backend);
  const int seq = cache.AddSequence();
  cache.Prefill(seq, k.data(), v.data(), t);
  RC_TAG(cache.HistoryLength(seq) > 0 ? "history" : "no history");
  std::vector<float> out(q.size());
  std::vector<double> ref(q.size());
  Attend(backend, cache, seq, q.data(), out.data());
  AttendReferenceF64(cache, seq, q.data(), ref.data());
  for (double e : RelativeErrorPerHead(out.data(), ref.data(), p.num_q_heads, d)) {
    RC_ASSERT(e <= kAttentionOracleTolerance);
  }
}

RC_GTEST_PROP(AttentionProps, Bf16CacheIsWithinTheOracleToleranceOfFp64, ()) {
  const CacheParams p = testbed::Cache(*testbed::ArbitraryCacheParams()).bf16().Build();
  const Backend& backend = ArbitraryCpuBackend();
  testbed::SplitMix64 rng(*rc::gen::arbitrary<uint64_t>());
  const int hkv = p.num_kv_heads, d = p.head_dim();
  const size_t t = static_cast<size_t>(*rc::gen::inRange(1, 300));
  // Logits stay within the oracle's stated domain (|s| <= ~32).
  const std::vector<float> k = testbed::KvRows(t, hkv, d, &rng), v = testbed::KvRows(t, hkv, d, &rng);
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(p.num_q_heads), d, &rng, 0.5f);
  PagedKVCache cache(p, {}, {}, {}, {}, backend);
  const int seq = cache.AddSequence();
  cache.Prefill(seq, k.data(), v.data(), t);
  std::vector<float> out(q.size());
  std::vector<double> ref(q.size());
  Attend(backend, cache, seq, q.data(), out.data());
  AttendReferenceF64(cache, seq, q.data(), ref.data());
  for (double e : RelativeErrorPerHead(out.data(), ref.data(), p.num_q_heads, d)) {
    RC_ASSERT(e <= kAttentionOracleTolerance);
  }
}

}  // namespace
}  // namespace kvq::cpu
