// The paged KV cache: parameter validation, the prefill/demotion invariant (a token's history
// bits do not depend on how it got there), layout, page pool, byte accounting and errors.
#include "kvq/cpu_ref/cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/conformance/prng.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/cache_checks.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::cpu {
namespace {


using testbed::CacheHolds;
using testbed::ExpectError;
using testbed::ToBf16;

TEST(CacheParams, DefaultsAreValid) {
  CacheParams p;
  p.Validate();
  EXPECT_EQ(p.group_size(), 4);
  EXPECT_EQ(p.scale(), static_cast<float>(1.0 / std::sqrt(128.0)));
  p.softmax_scale = 0.25f;
  EXPECT_EQ(p.scale(), 0.25f);
}

TEST(CacheParams, RejectsNamingTheValue) {
  // The defaults changed by `change` must be rejected with a message naming `piece`.
  const auto expect_rejected = [](const std::function<void(CacheParams&)>& change,
                                  const std::string& piece) {
    CacheParams p;
    change(p);
    ExpectError([&] { p.Validate(); }, ErrorCode::kInvalidArgument, {piece});
  };
  expect_rejected(
      [](CacheParams& p) {
        p.num_q_heads = 12;
        p.num_kv_heads = 8;
      },
      "num_q_heads 12");
  expect_rejected([](CacheParams& p) { p.num_kv_heads = 0; }, "num_kv_heads 0");
  expect_rejected([](CacheParams& p) { p.num_q_heads = 0; }, "num_q_heads 0");
  expect_rejected([](CacheParams& p) { p.key.head_dim = 64; }, "key head_dim 64");
  expect_rejected([](CacheParams& p) { p.value.head_dim = 96; }, "value: head_dim 96");
  for (int page : {0, 8, 48, 2048, -64}) {
    expect_rejected([&](CacheParams& p) { p.page_size = page; },
                    "page size " + std::to_string(page));
  }
  expect_rejected([](CacheParams& p) { p.sink = -1; }, "sink length -1");
  expect_rejected([](CacheParams& p) { p.recent = -1; }, "recent window -1");
  // A tile format: F and P must be whole tiles, a norm spans 1 or every KV head.
  const auto tile = [](CacheParams& p) {
    p.key.format = Format::kAffineTile;
    p.key.group = 32;
    p.flush = 64;
  };
  expect_rejected([&](CacheParams& p) { tile(p); p.flush = 48; }, "flush granularity 48");
  expect_rejected([&](CacheParams& p) { tile(p); p.flush = 1; }, "flush granularity 1");
  expect_rejected([&](CacheParams& p) { tile(p); p.page_size = 16; }, "page size 16");
  expect_rejected(
      [&](CacheParams& p) {
        tile(p);
        p.key.norm = true;
        p.key.norm_heads = 3;
      },
      "norm spans 3 KV heads");
  expect_rejected([](CacheParams& p) { p.key.bits = 3; }, "key: bits 3");
  expect_rejected([](CacheParams& p) { p.softmax_scale = -1.0f; }, "softmax scale -1");
  expect_rejected(
      [](CacheParams& p) { p.softmax_scale = std::numeric_limits<float>::quiet_NaN(); },
      "softmax scale nan");
  // Boundaries that are fine.
  CacheParams p;
  p.sink = 0;
  p.recent = 1;
  p.page_size = 16;
  p.Validate();
  p.page_size = 1024;
  p.Validate();
  p.recent = 0;  // spec 1.1: every token after the sink goes straight to the history
  p.Validate();
  tile(p);
  p.page_size = 32;
  p.key.norm = true;
  p.key.norm_heads = p.num_kv_heads;  // the token scope
  p.Validate();
  p.key.norm_heads = 1;
  p.Validate();
}

// The prefill == demotion invariant over random configurations (flush F included) and the byte
// accounting are RapidCheck properties: fuzz/cache_props_test.cc.

// ---- spec/differences.md, "clip threshold" and "clip at ρ = 1" ----
// The authors' prefill kernel clips at the order statistic a[k], as kvq does. Their decode-flush
// kernel, which quantizes every token demoted from the bf16 recent window, bisects [0, max|x|]
// in log2(d) steps and keeps the upper end: about a[k - 1] plus up to max|x| / d, and at ρ = 1
// (k = d - 1) it clips the largest value. With that pair of rules a token's history bits would
// depend on whether prefill wrote it or decode demoted it. kvq has one rule for both paths
// (spec/numerics.md §4, spec/cache.md §3). The rows below are built so that the two rules give
// different thresholds on every row (checked first); the tests then show that the history bits
// are the same by both paths, and are the order statistic's.

// The authors' flush threshold (OSCAR @ 473ff3f9, gpu_flush_int2.py:204-218), in fp32.
float BisectionThreshold(const float* x, int d, float rho) {
  const int k = std::min(std::max(static_cast<int>(static_cast<double>(rho) * d), 0), d - 1);
  float lo = 0.0f, hi = 0.0f;
  for (int j = 0; j < d; ++j) hi = std::max(hi, std::fabs(x[j]));
  for (int step = 1; step < d; step *= 2) {  // log2(d) steps
    const float mid = (lo + hi) * 0.5f;
    int above = 0;
    for (int j = 0; j < d; ++j) above += std::fabs(x[j]) > mid ? 1 : 0;
    if (above > d - k) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return hi;
}

// kvq's threshold: a[min(floor(rho d), d - 1)] of the ascending magnitudes.
float OrderStatistic(const float* x, int d, float rho) {
  std::vector<float> a(x, x + d);
  for (float& v : a) v = std::fabs(v);
  std::sort(a.begin(), a.end());
  const size_t k = std::min(static_cast<size_t>(std::floor(static_cast<double>(rho) * d)),
                            static_cast<size_t>(d - 1));
  return a[k];
}

// The bf16 (scale, min) of every group of x [d] clipped at tau (spec/numerics.md §4-5).
void GroupMetadata(const float* x, const WriteParams& p, float tau, uint16_t* scale,
                   uint16_t* min) {
  for (int g = 0; g < p.num_groups(); ++g) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int j = g * p.group; j < (g + 1) * p.group; ++j) {
      const float v = x[j] > tau ? tau : (x[j] < -tau ? -tau : x[j]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    lo += 0.0f;
    hi += 0.0f;
    scale[g] = Bf16FromF32((hi - lo) / static_cast<float>(p.levels()));
    min[g] = Bf16FromF32(lo);
  }
}

// n rows of d small values (multiples of 1/64 in [-2, 2], exact in bf16), each with one
// outlier of magnitude 960 (exact in bf16) at a random channel and sign. The bisection's grid
// step is 960 / d >= 3.75 > 2, so it stops above every small value, while a[k] (k < d - 1) is a
// small value and at ρ = 1 a[d - 1] = 960.
std::vector<float> OutlierRows(size_t n, int d, std::mt19937_64& rng) {
  std::vector<float> x(n * static_cast<size_t>(d));
  for (size_t r = 0; r < n; ++r) {
    float* row = &x[r * static_cast<size_t>(d)];
    for (int j = 0; j < d; ++j) row[j] = static_cast<float>(static_cast<int>(rng() % 257) - 128) / 64.0f;
    row[rng() % static_cast<uint64_t>(d)] = rng() % 2 ? 960.0f : -960.0f;
  }
  return x;
}

// One cache, Hkv = 2 with per-head clip ratios `clips` (keys and values alike), identity
// rotation so that the stored rows are the rows given. Sequence a: one prefill of T tokens;
// sequence b: a prefill with no history yet, then one AppendBf16 a token, so that every history
// token of b was demoted. Checks every history row of both against the order statistic's
// (scale, min), a against b plane by plane, and that the bisection's threshold would have
// stored another (scale, min). Calls `more(cache, a, i, head, kv, row)` on each history row.
template <typename More>
void ExpectOneClipRuleForPrefillAndDemotion(int d, int group, int bits, int flush,
                                            const std::vector<float>& clips, uint64_t seed,
                                            More more) {
  std::mt19937_64 rng(seed);
  const int hkv = 2;
  const CacheParams p = testbed::Cache().q_heads(hkv).kv_heads(hkv).sink(3).recent(5).page(16)
                           .flush(flush).both(testbed::Write().head_dim(d).group(group).bits(bits))
                           .Build();
  const std::string context = "seed " + std::to_string(seed) + " F=" + std::to_string(flush) +
                              " " + testbed::Describe(p);
  SCOPED_TRACE(context);
  PagedKVCache cache(p, {}, {}, clips, clips, ScalarBackend());
  const size_t tokens = 40;
  const size_t row = static_cast<size_t>(hkv * d);
  const std::vector<float> x[2] = {OutlierRows(tokens * hkv, d, rng),
                                   OutlierRows(tokens * hkv, d, rng)};
  const std::vector<uint16_t> bits16[2] = {ToBf16(x[0]), ToBf16(x[1])};
  for (int kv = 0; kv < 2; ++kv) {
    for (size_t r = 0; r < tokens * hkv; ++r) {
      const float* xr = &x[kv][r * static_cast<size_t>(d)];
      const float rho = clips[r % hkv];
      ASSERT_NE(BisectionThreshold(xr, d, rho), OrderStatistic(xr, d, rho))
          << "row " << r << ": the two clip rules agree, so the row tests nothing";
    }
  }
  const int a = cache.AddSequence();
  const int b = cache.AddSequence();
  cache.PrefillBf16(a, bits16[0].data(), bits16[1].data(), tokens);
  const size_t head_start = static_cast<size_t>(p.sink + p.recent);
  cache.PrefillBf16(b, bits16[0].data(), bits16[1].data(), head_start);
  ASSERT_EQ(cache.HistoryLength(b), 0u);
  for (size_t t = head_start; t < tokens; ++t) {
    cache.AppendBf16(b, &bits16[0][t * row], &bits16[1][t * row]);
  }
  const size_t history = static_cast<size_t>(p.HistoryTokens(static_cast<int64_t>(tokens)));
  ASSERT_GT(history, 0u);
  ASSERT_EQ(cache.HistoryLength(a), history);
  ASSERT_EQ(cache.HistoryLength(b), history);
  for (size_t i = 0; i < history; ++i) {
    const size_t position = static_cast<size_t>(p.sink) + i;
    for (int h = 0; h < hkv; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const KV half = static_cast<KV>(kv);
        const WriteParams wp = cache.HeadParams(half, h);
        const float* xr = &x[kv][position * row + static_cast<size_t>(h * d)];
        const std::string where = std::string(kv ? "value" : "key") + " position " +
                                  std::to_string(position) + " head " + std::to_string(h);
        const HistoryRunView ra = cache.HistoryRow(a, i, h, half);
        const HistoryRunView rb = cache.HistoryRow(b, i, h, half);
        const FormatLayout& layout = cache.Layout(half);
        for (int plane = 0; plane < layout.num_planes; ++plane) {
          ASSERT_EQ(std::memcmp(ra.plane[plane], rb.plane[plane], layout.plane(plane).row_bytes()),
                    0)
              << where << ": prefill and demotion stored different " << layout.plane(plane).name;
        }
        const size_t ng = static_cast<size_t>(wp.num_groups());
        std::vector<uint16_t> scale(ng), min(ng), bisect_scale(ng), bisect_min(ng);
        GroupMetadata(xr, wp, OrderStatistic(xr, d, wp.clip), scale.data(), min.data());
        GroupMetadata(xr, wp, BisectionThreshold(xr, d, wp.clip), bisect_scale.data(),
                      bisect_min.data());
        const uint16_t* stored_scale = reinterpret_cast<const uint16_t*>(ra.plane[1]);
        const uint16_t* stored_min = reinterpret_cast<const uint16_t*>(ra.plane[2]);
        for (size_t g = 0; g < ng; ++g) {
          ASSERT_EQ(stored_scale[g], scale[g]) << where << " group " << g;
          ASSERT_EQ(stored_min[g], min[g]) << where << " group " << g;
        }
        ASSERT_FALSE(scale == bisect_scale && min == bisect_min)
            << where << ": a bisection threshold would have stored the same metadata";
        more(cache, a, i, h, half, xr);
      }
    }
  }
}

TEST(PagedKVCache, ClipThresholdDifferenceSameBitsByPrefillAndDemotion) {
  uint64_t seed = 1;
  for (const auto& shape : {std::array<int, 3>{64, 32, 2}, std::array<int, 3>{128, 128, 2},
                            std::array<int, 3>{128, 64, 4}, std::array<int, 3>{256, 128, 2}}) {
    for (int flush : {1, 4}) {
      ExpectOneClipRuleForPrefillAndDemotion(
          shape[0], shape[1], shape[2], flush, {0.92f, 0.96f}, seed++,
          [](const PagedKVCache&, int, size_t, int, KV, const float*) {});
    }
  }
}

// At ρ = 1 the authors' flush clipped the measured outlier 990.302 to 15.47; kvq's τ is max|x|,
// nothing is clipped (spec/numerics.md §4), and the outlier comes back within one step.
TEST(PagedKVCache, ClipAtRhoOneDifferenceOutlierKeptByPrefillAndDemotion) {
  uint64_t seed = 100;
  for (const auto& shape : {std::array<int, 3>{64, 32, 2}, std::array<int, 3>{128, 128, 2},
                            std::array<int, 3>{128, 64, 4}}) {
    for (int flush : {1, 4}) {
      ExpectOneClipRuleForPrefillAndDemotion(
          shape[0], shape[1], shape[2], flush, {1.0f, 1.0f}, seed++,
          [](const PagedKVCache& cache, int seq, size_t i, int head, KV kv, const float* x) {
            const WriteParams wp = cache.HeadParams(kv, head);
            const int d = wp.head_dim;
            std::vector<float> y(static_cast<size_t>(d));
            cache.DequantizedHistoryRow(seq, i, head, kv, y.data());
            const HistoryRunView row = cache.HistoryRow(seq, i, head, kv);
            const uint16_t* scale = reinterpret_cast<const uint16_t*>(row.plane[1]);
            for (int j = 0; j < d; ++j) {
              if (std::fabs(x[j]) != 960.0f) continue;
              const float step = F32FromBf16(scale[j / wp.group]);
              EXPECT_LE(std::fabs(y[j] - x[j]), step)
                  << "history token " << i << " head " << head << " channel " << j
                  << ": the outlier " << x[j] << " came back as " << y[j];
            }
          });
    }
  }
}

TEST(PagedKVCache, NoHistoryUpToSinkPlusWindow) {
  conformance::SplitMix64 rng(7);
  CacheParams p = testbed::Cache().q_heads(8).kv_heads(2).sink(5).recent(11).page(16).both(testbed::Write().head_dim(64).bits(2).group(32).rotation(RotationKind::kHadamard).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  std::vector<float> k = testbed::KvRows(17, 2, 64, &rng), v = testbed::KvRows(17, 2, 64, &rng);
  for (size_t t = 0; t < 16; ++t) {
    cache.Append(seq, &k[t * 128], &v[t * 128]);
    EXPECT_EQ(cache.HistoryLength(seq), 0u);
    EXPECT_EQ(cache.NumPages(), 0) << "length " << t + 1;
    EXPECT_TRUE(cache.PageTable(seq).empty());
  }
  cache.Append(seq, &k[16 * 128], &v[16 * 128]);  // length 17 = S0 + W + 1: position 5 demoted
  EXPECT_EQ(cache.HistoryLength(seq), 1u);
  EXPECT_EQ(cache.NumPages(), 1);
  EXPECT_FALSE(cache.IsBf16Position(seq, 5));
  EXPECT_TRUE(cache.IsBf16Position(seq, 4));
  EXPECT_TRUE(cache.IsBf16Position(seq, 6));
}

TEST(PagedKVCache, LayoutOfPagesRingAndSink) {
  conformance::SplitMix64 rng(11);
  CacheParams p = testbed::Cache().q_heads(4).kv_heads(2).sink(3).recent(5).page(16).both(testbed::Write().head_dim(64).bits(2).group(64).rotation(RotationKind::kIdentity).bitrev(false)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int a = cache.AddSequence();
  const int b = cache.AddSequence();
  const size_t row = 128;
  const std::vector<uint16_t> ka = ToBf16(testbed::KvRows(60, 2, 64, &rng));
  const std::vector<uint16_t> va = ToBf16(testbed::KvRows(60, 2, 64, &rng));
  // Interleave: a gets 40 tokens, b 60, a 20 more, so pages alternate between sequences.
  cache.PrefillBf16(a, ka.data(), va.data(), 40);
  cache.PrefillBf16(b, ka.data(), va.data(), 60);
  cache.PrefillBf16(a, ka.data() + 40 * row, va.data() + 40 * row, 20);
  ASSERT_EQ(cache.HistoryLength(a), 52u);  // 60 - 3 - 5
  ASSERT_EQ(cache.PageTable(a).size(), 4u);
  ASSERT_EQ(cache.PageTable(b).size(), 4u);
  EXPECT_EQ(cache.NumPages(), 8);
  // Pages are handed out in order of need: a took 0, 1; b took 2..5; a took 6, 7.
  EXPECT_EQ(cache.PageTable(a), (std::vector<int32_t>{0, 1, 6, 7}));
  EXPECT_EQ(cache.PageTable(b), (std::vector<int32_t>{2, 3, 4, 5}));
  // History token i lives at page_table[i / P], slot i % P: check through the raw pool.
  const size_t cb = 16, ng = 1, page = 16;
  for (size_t i = 0; i < 52; ++i) {
    for (int h = 0; h < 2; ++h) {
      const size_t base =
          (static_cast<size_t>(cache.PageTable(a)[i / page]) * 2 + static_cast<size_t>(h)) * page +
          i % page;
      const HistoryRunView ref = cache.HistoryRow(a, i, h, KV::kKey);
      EXPECT_EQ(ref.plane[0], cache.PoolPlane(KV::kKey, 0) + base * cb);
      EXPECT_EQ(ref.plane[1], cache.PoolPlane(KV::kKey, 1) + base * ng * 2);
      EXPECT_EQ(ref.plane[2], cache.PoolPlane(KV::kKey, 2) + base * ng * 2);
    }
  }
  // Ring: position p at slot p % W; sink rows in order.
  for (size_t pos = 55; pos < 60; ++pos) {
    EXPECT_EQ(std::memcmp(cache.RecentRing(a, KV::kValue) + (pos % 5) * row, &va[pos * row],
                          row * 2), 0) << "position " << pos;
  }
  EXPECT_EQ(std::memcmp(cache.SinkRows(a, KV::kKey), ka.data(), 3 * row * 2), 0);
  // Unused slots of the last page are zero.
  const size_t last = static_cast<size_t>(cache.PageTable(a)[3]);
  for (size_t slot = 52 % 16; slot < 16; ++slot) {
    for (size_t byte = 0; byte < cb; ++byte) {
      EXPECT_EQ(cache.PoolPlane(KV::kKey, 0)[((last * 2) * page + slot) * cb + byte], 0);
    }
  }
  // Removing a frees its pages (zeroed); the next allocations reuse them, newest freed first.
  cache.RemoveSequence(a);
  EXPECT_FALSE(cache.HasSequence(a));
  EXPECT_EQ(cache.NumFreePages(), 4);
  for (int plane = 0; plane < cache.Layout(KV::kKey).num_planes; ++plane) {
    const size_t bytes = cache.PagePlaneBytes(KV::kKey, plane);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(cache.PoolPlane(KV::kKey, plane)[7 * bytes + i], 0);
  }
  const int c = cache.AddSequence();
  EXPECT_NE(c, a);  // ids are not reused
  cache.PrefillBf16(c, ka.data(), va.data(), 3 + 5 + 17);  // 17 history tokens: 2 pages
  EXPECT_EQ(cache.PageTable(c), (std::vector<int32_t>{7, 6}));
  EXPECT_EQ(cache.NumPages(), 8);
  EXPECT_EQ(cache.NumFreePages(), 2);
  const std::vector<uint16_t> kc(ka.begin(), ka.begin() + 25 * row);
  const std::vector<uint16_t> vc(va.begin(), va.begin() + 25 * row);
  const std::vector<uint16_t> both[2] = {kc, vc};
  EXPECT_TRUE(CacheHolds(cache, c, both)) << "reused pages";
}

TEST(PagedKVCache, ByteAccountingAndEffectiveBits) {
  conformance::SplitMix64 rng(3);
  CacheParams p;  // Hkv 8, d 128, G 64, INT2, S0 64, W 256, P 64
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const std::vector<float> k = testbed::KvRows(1000, 8, 128, &rng), v = testbed::KvRows(1000, 8, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), 1000);
  const CacheBytes b = cache.Bytes(seq);
  const size_t row_bytes = 8 * 128 * 2;
  EXPECT_EQ(b.sink, 2 * 64 * row_bytes);
  EXPECT_EQ(b.recent, 2 * 256 * row_bytes);
  // 680 history tokens; per token and head 32 code bytes and 2 groups * 4 metadata bytes, K and V.
  EXPECT_EQ(b.history_codes, 680u * 8 * 2 * 32);
  EXPECT_EQ(b.history_metadata, 680u * 8 * 2 * 8);
  // 11 pages of 64 slots.
  EXPECT_EQ(b.history_codes_allocated, 11u * 64 * 8 * 2 * 32);
  EXPECT_EQ(b.history_metadata_allocated, 11u * 64 * 8 * 2 * 8);
  EXPECT_EQ(b.elements, 2u * 1000 * 8 * 128);
  const double want_bits = 8.0 * static_cast<double>(b.sink + b.recent + 680u * 8 * 2 * 40) /
                           (2.0 * 1000 * 8 * 128);
  EXPECT_DOUBLE_EQ(b.bits_per_element(), want_bits);
  EXPECT_GT(b.bits_per_element_allocated(), b.bits_per_element());
  // History alone is 2.5 bits per element (40 bytes per 128 values).
  EXPECT_DOUBLE_EQ(8.0 * (b.history_codes + b.history_metadata) / (2.0 * 680 * 8 * 128), 2.5);

  // The bf16 baseline: 16 bits per element, no pages.
  CacheParams q = p;
  q.key.format = q.value.format = kvq::Format::kBf16;
  PagedKVCache dense(q, {}, {});
  const int s2 = dense.AddSequence();
  dense.Prefill(s2, k.data(), v.data(), 1000);
  const CacheBytes d = dense.Bytes(s2);
  EXPECT_EQ(d.history_codes + d.history_metadata + d.history_codes_allocated, 0u);
  EXPECT_EQ(d.sink + d.recent, 2u * 1000 * row_bytes);
  EXPECT_DOUBLE_EQ(d.bits_per_element(), 16.0);
  EXPECT_EQ(dense.NumPages(), 0);
}

TEST(PagedKVCache, Bf16CacheKeepsEveryRow) {
  conformance::SplitMix64 rng(5);
  CacheParams p = testbed::Cache().q_heads(4).kv_heads(4).sink(2).recent(3).page(16).both(testbed::Write().head_dim(64).bits(2).group(64).rotation(RotationKind::kDense).bitrev(false)).Unchecked();
  p.key.format = p.value.format = kvq::Format::kBf16;
  PagedKVCache cache(p, {}, {});
  const int seq = cache.AddSequence();
  const std::vector<float> k = testbed::KvRows(40, 4, 64, &rng), v = testbed::KvRows(40, 4, 64, &rng);
  cache.Prefill(seq, k.data(), v.data(), 30);
  for (size_t t = 30; t < 40; ++t) cache.Append(seq, &k[t * 256], &v[t * 256]);
  EXPECT_EQ(cache.HistoryLength(seq), 0u);
  EXPECT_EQ(cache.NumPages(), 0);
  EXPECT_EQ(cache.SinkRows(seq, KV::kKey), nullptr);
  const std::vector<uint16_t> both[2] = {ToBf16(k), ToBf16(v)};
  EXPECT_TRUE(CacheHolds(cache, seq, both)) << "bf16 cache";
  EXPECT_EQ(std::memcmp(cache.DenseRows(seq, KV::kValue), both[1].data(), both[1].size() * 2), 0);
}

TEST(PagedKVCache, DequantizedHistoryRowMatchesWritePath) {
  conformance::SplitMix64 rng(9);
  CacheParams p = testbed::Cache().q_heads(8).kv_heads(2).sink(4).recent(8).page(16).both(testbed::Write().head_dim(128).bits(2).group(64).rotation(RotationKind::kDense).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const std::vector<float> k = testbed::KvRows(50, 2, 128, &rng), v = testbed::KvRows(50, 2, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), 50);
  std::vector<float> x(128), got(128);
  for (size_t i = 0; i < cache.HistoryLength(seq); ++i) {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 128; ++j) x[j] = RoundToBf16(v[(4 + i) * 256 + h * 128 + j]);
      const QuantizedRows q = QuantizeRows(ScalarBackend(), cache.HeadParams(KV::kValue, h),
                                           cache.Rotation(KV::kValue, h), x.data(), 1);
      cache.DequantizedHistoryRow(seq, i, h, KV::kValue, got.data());
      ASSERT_EQ(std::memcmp(got.data(), q.dequantized.data(), 128 * sizeof(float)), 0)
          << "history row " << i << " head " << h;
    }
  }
  const std::vector<float> all = cache.DequantizedHistory(seq, 1, KV::kValue);
  cache.DequantizedHistoryRow(seq, 7, 1, KV::kValue, got.data());
  EXPECT_EQ(std::memcmp(&all[7 * 128], got.data(), 128 * sizeof(float)), 0);
}

TEST(PagedKVCache, RejectsBadInputsAndStaysUnchanged) {
  conformance::SplitMix64 rng(13);
  CacheParams p = testbed::Cache().q_heads(4).kv_heads(2).sink(2).recent(3).page(16).both(testbed::Write().head_dim(64).bits(2).group(32).rotation(RotationKind::kHadamard).bitrev(false)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  std::vector<float> k = testbed::KvRows(8, 2, 64, &rng), v = testbed::KvRows(8, 2, 64, &rng);

  ExpectError([&] { cache.Prefill(seq + 100, k.data(), v.data(), 1); },
              ErrorCode::kInvalidArgument, {"unknown sequence id " + std::to_string(seq + 100)});
  ExpectError([&] { cache.RemoveSequence(-3); }, ErrorCode::kInvalidArgument,
              {"unknown sequence id -3"});
  ExpectError([&] { cache.Length(42); }, ErrorCode::kInvalidArgument, {"unknown sequence id 42"});

  std::vector<float> bad = k;
  bad[1 * 128 + 64 + 17] = std::numeric_limits<float>::quiet_NaN();  // token 1, head 1, ch 17
  ExpectError([&] { cache.Prefill(seq, bad.data(), v.data(), 2); }, ErrorCode::kNonFinite,
              {"key value nan", "token 1", "KV head 1", "channel 17"});
  bad = v;
  bad[5] = 3.4e38f;  // finite in fp32, rounds to inf in bf16
  ExpectError([&] { cache.Prefill(seq, k.data(), bad.data(), 1); }, ErrorCode::kNonFinite,
              {"value value", "rounds to inf in bf16", "token 0", "KV head 0", "channel 5"});
  std::vector<uint16_t> kb = ToBf16(k);
  kb[3] = 0x7f80;  // +inf
  const std::vector<uint16_t> vb = ToBf16(v);
  ExpectError([&] { cache.AppendBf16(seq, kb.data(), vb.data()); }, ErrorCode::kNonFinite,
              {"key bf16 value 0x7f80", "KV head 0", "channel 3"});
  EXPECT_EQ(cache.Length(seq), 0u);

  // A row whose rotation overflows is accepted into the ring, and rejected when it is
  // demoted: the Append that would demote it throws naming the position, and changes nothing.
  std::vector<float> huge(128, 3.0e38f);
  cache.Prefill(seq, k.data(), v.data(), 2);      // positions 0, 1: the sink
  cache.Prefill(seq, huge.data(), v.data(), 1);   // position 2: recent
  cache.Prefill(seq, k.data(), v.data(), 2);      // positions 3, 4: recent (W = 3 full)
  EXPECT_EQ(cache.Length(seq), 5u);
  ExpectError([&] { cache.Append(seq, k.data(), v.data()); }, ErrorCode::kNonFinite,
              {"positions [2, 3)", "key", "KV head 0"});
  EXPECT_EQ(cache.Length(seq), 5u);
  EXPECT_EQ(cache.NumPages(), 0);
  EXPECT_EQ(std::memcmp(cache.Bf16Row(seq, 2, KV::kKey), ToBf16(huge).data(), 256), 0);
  ExpectError([&] { cache.Bf16Row(seq, 9, KV::kKey); }, ErrorCode::kInvalidArgument,
              {"position 9"});
}

TEST(PagedKVCache, RejectsBadWriteData) {
  CacheParams p = testbed::Cache().q_heads(4).kv_heads(2).sink(2).recent(3).page(16).both(testbed::Write().head_dim(64).bits(2).group(32).rotation(RotationKind::kDense).bitrev(false)).Unchecked();
  std::vector<float> eye(2 * 64 * 64, 0.0f);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 64; ++i) eye[(h * 64 + i) * 64 + i] = 1.0f;
  }
  ExpectError([&] { PagedKVCache c(p, std::vector<float>(64 * 64), eye); },
              ErrorCode::kShapeMismatch, {"key rotation has 4096 values", "8192"});
  std::vector<float> nan_eye = eye;
  nan_eye[64 * 64 + 5 * 64 + 9] = std::numeric_limits<float>::infinity();
  ExpectError([&] { PagedKVCache c(p, eye, nan_eye); }, ErrorCode::kNonFinite,
              {"value rotation of KV head 1", "row 5", "column 9"});
  ExpectError([&] { PagedKVCache c(p, eye, eye, {1.0f}); }, ErrorCode::kShapeMismatch,
              {"key clip ratios have 1 values"});
  ExpectError([&] { PagedKVCache c(p, eye, eye, {}, {0.9f, 1.5f}); },
              ErrorCode::kInvalidArgument, {"value clip ratio 1.5 of KV head 1"});
  p.key.rotation = RotationKind::kIdentity;
  ExpectError([&] { PagedKVCache c(p, eye, eye); }, ErrorCode::kInvalidArgument,
              {"key rotation given (8192 values)", "identity"});
  p.page_size = 20;
  ExpectError([&] { PagedKVCache c(p, {}, eye); }, ErrorCode::kInvalidArgument,
              {"page size 20"});
}

}  // namespace
}  // namespace kvq::cpu

namespace kvq::cpu {
namespace {

// KIVI's and OScaR's timing (spec/cache.md §2): with S0 = 0, W = 1, F = 128 the token that
// completes a block is first read in bf16; H(128) = 0, H(129) = 128, H(257) = 256, and K and V
// share the boundary. Appends and one prefill store the same bits (CacheHolds).
TEST(PagedKVCacheSpec11, KiviTimingAndOneBoundary) {
  const CacheParams p = testbed::Cache().kv_heads(2).q_heads(4).sink(0).recent(1).flush(128)
                            .page(64).key(testbed::Write().head_dim(64).tile(32))
                            .value(testbed::Write().head_dim(64).group(32)).Build();
  EXPECT_EQ(p.HistoryTokens(128), 0);
  EXPECT_EQ(p.HistoryTokens(129), 128);
  EXPECT_EQ(p.HistoryTokens(256), 128);
  EXPECT_EQ(p.HistoryTokens(257), 256);
  EXPECT_EQ(p.ring_slots(), 128);
  conformance::SplitMix64 rng(4);
  PagedKVCache cache(p, {}, {});
  const int appended = cache.AddSequence(), prefilled = cache.AddSequence();
  std::vector<uint16_t> rows[2];
  for (int kv = 0; kv < 2; ++kv) rows[kv] = ToBf16(testbed::KvRows(260, 2, 64, &rng));
  const size_t row = 2 * 64;
  for (size_t t = 0; t < 260; ++t) {
    cache.AppendBf16(appended, &rows[0][t * row], &rows[1][t * row]);
    EXPECT_EQ(cache.HistoryLength(appended), static_cast<size_t>(p.HistoryTokens(t + 1)));
    EXPECT_EQ(cache.RecentBegin(appended), static_cast<size_t>(p.HistoryTokens(t + 1)));
  }
  cache.PrefillBf16(prefilled, rows[0].data(), rows[1].data(), 260);
  EXPECT_TRUE(CacheHolds(cache, appended, rows));
  EXPECT_TRUE(CacheHolds(cache, prefilled, rows));
  for (int kv = 0; kv < 2; ++kv) {
    for (size_t i = 0; i < 256; ++i) {
      for (int h = 0; h < 2; ++h) {
        std::vector<float> a(64), b(64);
        cache.DequantizedHistoryRow(appended, i, h, static_cast<KV>(kv), a.data());
        cache.DequantizedHistoryRow(prefilled, i, h, static_cast<KV>(kv), b.data());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), 64 * sizeof(float)), 0) << i;
      }
    }
  }
}

// W = 0: every token after the sink is history when it arrives (the current one included).
TEST(PagedKVCacheSpec11, RecentWindowZero) {
  const CacheParams p = testbed::Cache().kv_heads(1).q_heads(2).sink(3).recent(0).page(16)
                            .both(testbed::Write().head_dim(256).group(256).bits(4).hadamard(128))
                            .Build();
  EXPECT_EQ(p.ring_slots(), 0);
  conformance::SplitMix64 rng(6);
  PagedKVCache cache(p, {}, {});
  const int seq = cache.AddSequence();
  std::vector<uint16_t> rows[2];
  for (int kv = 0; kv < 2; ++kv) rows[kv] = ToBf16(testbed::KvRows(40, 1, 256, &rng));
  for (size_t t = 0; t < 40; ++t) {
    cache.AppendBf16(seq, &rows[0][t * 256], &rows[1][t * 256]);
    EXPECT_EQ(cache.HistoryLength(seq), t + 1 > 3 ? t + 1 - 3 : 0);
    EXPECT_EQ(cache.RecentBegin(seq), t + 1);
    EXPECT_EQ(cache.IsBf16Position(seq, t), t < 3);
  }
  EXPECT_TRUE(CacheHolds(cache, seq, rows));
}

// Honest accounting at d = 128, INT2, over a history of whole blocks: KIVI stores 3.0 bits per
// element (K: 2 + 32 bits of (scale, min) per channel per 32 tokens; V: 2 + 32 / 32), OScaR
// 3.0625 (K's bf16 norm per token and head: + 16 / 128 on K), the token-scope norm once per
// token for the 4 KV heads (+ 16 / 512 on K); SAW-INT4 4.25 (G = d).
TEST(PagedKVCacheSpec11, HistoryBitsPerElement) {
  const testbed::Write kk = testbed::Write().head_dim(128).tile(32);
  const testbed::Write vv = testbed::Write().head_dim(128).group(32);
  const auto history_bits = [](const CacheParams& p) {
    PagedKVCache cache(p, {}, {});
    const int seq = cache.AddSequence();
    conformance::SplitMix64 rng(2);
    const size_t t = 129;  // KIVI: 128 history tokens and 1 recent; SAW: 129 history tokens
    const std::vector<float> k = testbed::KvRows(t, p.num_kv_heads, 128, &rng);
    cache.Prefill(seq, k.data(), k.data(), t);
    const CacheBytes b = cache.Bytes(seq);
    const double history_elements =
        2.0 * static_cast<double>(cache.HistoryLength(seq)) * p.num_kv_heads * 128;
    const double bits =
        8.0 * static_cast<double>(b.history_codes + b.history_metadata) / history_elements;
    EXPECT_EQ(p.history_bits_per_element(), bits);  // the parameters' own count, one page
    return bits;
  };
  const testbed::Cache kivi =
      testbed::Cache().kv_heads(4).q_heads(4).sink(0).recent(1).flush(128).page(128);
  EXPECT_EQ(history_bits(testbed::Cache(kivi).key(kk).value(vv)), 3.0);
  EXPECT_EQ(history_bits(testbed::Cache(kivi).key(testbed::Write(kk).hadamard().norm()).value(vv)),
            3.0625);
  EXPECT_EQ(history_bits(testbed::Cache(kivi).key(testbed::Write(kk).hadamard().norm().norm_heads(4))
                             .value(vv)),
            3.0 + 16.0 / 512 / 2);
  EXPECT_EQ(history_bits(testbed::Cache(kivi).recent(0).flush(1).page(64).both(
                testbed::Write().head_dim(128).group(128).bits(4).hadamard())),
            4.25);
}

}  // namespace
}  // namespace kvq::cpu
