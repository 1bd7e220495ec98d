// Properties of the paged cache (RapidCheck), on random configurations of
// testbed::ArbitraryCacheParams() (the flush granularity F, W = 0, tiled keys with and without
// a per-head or per-token norm, codebook sides with and without per-head widths included) and every CPU backend:
//  - a token's history bits do not depend on how it arrived (one prefill, a prefix then fp32
//    appends, bf16 appends one by one, random chunks; sequences interleaved in one pool);
//  - the byte accounting counts exactly the planes the format stores.
// Replay a failure with RC_PARAMS="seed=<seed printed by RapidCheck>".
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/testbed/cache_checks.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"
#include "kvq/testbed/rapidcheck.h"

namespace kvq::cpu {
namespace {

const Backend& ArbitraryCpuBackend() {
  const std::vector<Backend>& list = Backends();
  return list[static_cast<size_t>(*rc::gen::inRange<int>(0, static_cast<int>(list.size())))];
}

// Four sequences of random lengths in one pool get the same rows by four routes (one prefill, a
// prefix then fp32 appends, bf16 appends one by one, random chunks); each must hold exactly the
// encoding of its original rows (testbed::CacheHolds).
void CheckHowTokensArrived(const CacheParams& p) {
  const Backend& backend = ArbitraryCpuBackend();
  const uint64_t seed = *rc::gen::arbitrary<uint64_t>();
  RC_TAG(p.flush > 1 ? "F > 1" : "F = 1");
  RC_TAG(p.quantized() ? "quantized" : "bf16 cache");
  RC_TAG(p.recent == 0 ? "W = 0" : "W > 0");
  RC_TAG(p.quantized() && p.key.format == Format::kCodebook
             ? (p.key.segments > 1 ? "codebook keys, per-head widths" : "codebook keys, uniform")
             : "other keys");
  RC_TAG(p.quantized() && p.key.format == Format::kAffineTile
             ? (p.key.norm ? (p.key.norm_heads > 1 ? "tiles, token norm" : "tiles, head norm")
                           : "tiles")
             : "per-token rows");
  testbed::SplitMix64 rng(seed);
  PagedKVCache cache = testbed::MakeCache(p, &rng, backend);
  const int hkv = p.num_kv_heads, d = p.head_dim();
  const size_t row = static_cast<size_t>(hkv * d);

  constexpr int kWays = 4;  // 0: one prefill; 1: prefix + fp32 appends; 2: bf16 appends; 3: chunks
  std::vector<uint16_t> rows[kWays][2];
  size_t target[kWays];
  int ids[kWays];
  for (int s = 0; s < kWays; ++s) {
    // Longer sequences for tiles, whose history grows F >= G_k tokens at a time.
    target[s] = static_cast<size_t>(*rc::gen::inRange(1, p.flush >= 32 ? 330 : 130));
    for (int kv = 0; kv < 2; ++kv) {
      rows[s][kv] = testbed::ToBf16(testbed::KvRows(target[s], hkv, d, &rng));
    }
    ids[s] = cache.AddSequence();
  }
  cache.PrefillBf16(ids[0], rows[0][0].data(), rows[0][1].data(), target[0]);
  size_t done[kWays] = {target[0], static_cast<size_t>(*rc::gen::inRange<size_t>(0, target[1] + 1)),
                        0, 0};
  cache.PrefillBf16(ids[1], rows[1][0].data(), rows[1][1].data(), done[1]);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int s = 1; s < kWays; ++s) {  // interleave the three incremental writers
      if (done[s] == target[s]) continue;
      progressed = true;
      const uint16_t* k = &rows[s][0][done[s] * row];
      const uint16_t* v = &rows[s][1][done[s] * row];
      if (s == 1) {
        std::vector<float> kf(row), vf(row);
        for (size_t i = 0; i < row; ++i) {
          kf[i] = F32FromBf16(k[i]);
          vf[i] = F32FromBf16(v[i]);
        }
        cache.Append(ids[s], kf.data(), vf.data());
        done[s] += 1;
      } else if (s == 2) {
        cache.AppendBf16(ids[s], k, v);
        done[s] += 1;
      } else {
        const size_t chunk = std::min(target[s] - done[s], 1 + static_cast<size_t>(rng.Below(40)));
        cache.PrefillBf16(ids[s], k, v, chunk);
        done[s] += chunk;
      }
    }
  }
  for (int s = 0; s < kWays; ++s) {
    RC_ASSERT(cache.Length(ids[s]) == target[s]);
    const auto holds = testbed::CacheHolds(cache, ids[s], rows[s]);
    if (!holds) RC_FAIL(testbed::Describe(p) + " on " + backend.name + ", way " +
                        std::to_string(s) + ": " + holds.message());
  }
}

RC_GTEST_PROP(CacheProps, HistoryBitsDoNotDependOnHowTokensArrived, ()) {
  CheckHowTokensArrived(*testbed::ArbitraryCacheParams());
}

// The same on codebook caches only (spec 1.3): TurboQuant-MSE rows or per-head Block-GTQ
// widths on each side, K and V widths apart, any windows.
RC_GTEST_PROP(CacheProps, CodebookHistoryBitsDoNotDependOnHowTokensArrived, ()) {
  const CacheParams p = *rc::gen::suchThat(testbed::ArbitraryCacheParams(), [](const CacheParams& c) {
    return c.quantized() && c.key.format == Format::kCodebook;
  });
  RC_TAG(p.value.format == Format::kCodebook ? "codebook values" : "affine values");
  RC_TAG(p.key.bits != p.value.bits ? "K and V widths apart" : "same widths");
  CheckHowTokensArrived(p);
}

RC_GTEST_PROP(CacheProps, ByteAccountingCountsTheFormatsPlanes, ()) {
  const CacheParams p = *testbed::ArbitraryCacheParams();
  testbed::SplitMix64 rng(*rc::gen::arbitrary<uint64_t>());
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const size_t t = static_cast<size_t>(*rc::gen::inRange(0, 400));
  const int hkv = p.num_kv_heads, d = p.head_dim();
  const std::vector<float> k = testbed::KvRows(t, hkv, d, &rng), v = testbed::KvRows(t, hkv, d, &rng);
  cache.Prefill(seq, k.data(), v.data(), t);

  const size_t row_bytes = static_cast<size_t>(hkv * d) * 2;  // one bf16 row of K (or of V)
  const size_t history = static_cast<size_t>(p.HistoryTokens(static_cast<int64_t>(t)));
  const size_t sink = std::min(t, static_cast<size_t>(p.sink));
  const size_t recent_begin = static_cast<size_t>(p.RecentBegin(static_cast<int64_t>(t)));
  const size_t pages = cache.PageTable(seq).size();
  RC_ASSERT(pages == (history + p.page_size - 1) / p.page_size);
  // Bytes per history token of all KV heads, from the spec's description of each format
  // (spec/cache.md §4), not from the layout code: affine_token stores d*b/8 code bytes and a
  // bf16 (scale, min) per group; affine_tile d*b/8 code bytes per token and a bf16 (scale, min)
  // per channel per tile of G_k tokens, plus a bf16 norm per token and KV head (or one per
  // token for every head); codebook its `code_bytes` (d*b/8 when 0) and a bf16 corrected norm
  // per segment slot (spec/numerics.md §5.4.5). History lengths are whole tiles.
  size_t codes = 0, metadata = 0;
  const size_t heads = static_cast<size_t>(hkv);
  for (const WriteParams* w : {&p.key, &p.value}) {
    if (!w->quantized()) continue;
    if (w->format == Format::kCodebook) {
      codes += heads * static_cast<size_t>(w->code_bytes != 0 ? w->code_bytes
                                                              : d * w->bits / 8);
      metadata += heads * 2 * static_cast<size_t>(w->segments);
      continue;
    }
    codes += heads * static_cast<size_t>(w->packed_bytes());
    if (w->format == Format::kAffineTile) {
      RC_ASSERT(history % static_cast<size_t>(w->group) == 0);
      metadata += heads * 4 * static_cast<size_t>(d) / static_cast<size_t>(w->group);
      if (w->norm) metadata += 2 * (w->norm_heads > 1 ? 1 : heads);
    } else {
      metadata += heads * static_cast<size_t>(w->num_groups()) * 4;
    }
  }
  const CacheBytes b = cache.Bytes(seq);
  RC_ASSERT(b.elements == 2 * t * static_cast<size_t>(hkv * d));
  RC_ASSERT(b.sink == 2 * sink * row_bytes);
  RC_ASSERT(b.recent == 2 * (t - recent_begin) * row_bytes);
  RC_ASSERT(b.history_codes == history * codes);
  RC_ASSERT(b.history_metadata == history * metadata);
  const size_t allocated = pages * static_cast<size_t>(p.page_size);
  RC_ASSERT(b.history_codes_allocated == allocated * codes);
  RC_ASSERT(b.history_metadata_allocated == allocated * metadata);
  // Every token is counted once: sink + history + recent rows cover [0, t).
  RC_ASSERT(sink + history + (t - recent_begin) == t);
  if (t > 0) {
    RC_ASSERT(b.bits_per_element() == 8.0 * static_cast<double>(b.total()) /
                                          static_cast<double>(b.elements));
  }
  // The pool holds exactly the planes' bytes of the pages handed out.
  for (KV kv : {KV::kKey, KV::kValue}) {
    if (!p.quantized()) break;
    const FormatLayout& layout = cache.Layout(kv);
    for (int i = 0; i < layout.num_planes; ++i) {
      RC_ASSERT(cache.PagePlaneBytes(kv, i) == layout.PageBytes(i, p.page_size, hkv));
    }
  }
}

}  // namespace
}  // namespace kvq::cpu
