// The paged KV cache: parameter validation, the prefill/demotion invariant (a token's history
// bits do not depend on how it got there), layout, page pool, byte accounting and errors.
#include "kvq/cpu_ref/cache.h"

#include <gtest/gtest.h>

#include <algorithm>
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
  expect_rejected([](CacheParams& p) { p.recent = 0; }, "recent window 0");
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
}

// The prefill == demotion invariant over random configurations (flush F included) and the byte
// accounting are RapidCheck properties: fuzz/cache_props_test.cc.

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
              {"key rotation matrices given", "'identity'"});
  p.page_size = 20;
  ExpectError([&] { PagedKVCache c(p, {}, eye); }, ErrorCode::kInvalidArgument,
              {"page size 20"});
}

}  // namespace
}  // namespace kvq::cpu
