// Decode attention over the paged cache, every backend (scalar and each Highway target)
// against the fp64 reference: max relative error per query head <= kAttentionOracleTolerance.
// The reference itself is checked against Algorithm 1 of seeds/000 taken literally.
#include "kvq/cpu_ref/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/conformance/prng.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::cpu {
namespace {


std::vector<float> RandomQuery(const CacheParams& p, conformance::SplitMix64& rng,
                               float magnitude) {
  return testbed::Queries(static_cast<size_t>(p.num_q_heads), p.head_dim(), &rng, magnitude);
}

// Attend with `backend` and hold every query head against the fp64 reference.
void ExpectMatchesReference(const Backend& backend, const PagedKVCache& cache, int seq,
                            const std::vector<float>& q, const std::string& context,
                            const AttentionOptions& options = {}) {
  const CacheParams& p = cache.params();
  const int d = p.head_dim();
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<double> ref(q.size());
  Attend(backend, cache, seq, q.data(), out.data(), options);
  AttendReferenceF64(cache, seq, q.data(), ref.data());
  const std::vector<double> errors = RelativeErrorPerHead(out.data(), ref.data(), p.num_q_heads, d);
  for (int h = 0; h < p.num_q_heads; ++h) {
    if (errors[h] <= kAttentionOracleTolerance) continue;
    int worst = 0;
    for (int j = 0; j < d; ++j) {
      if (std::fabs(out[h * d + j] - ref[h * d + j]) > std::fabs(out[h * d + worst] - ref[h * d + worst])) worst = j;
    }
    ADD_FAILURE() << context << " backend " << backend.name << " length " << cache.Length(seq)
                  << " history " << cache.HistoryLength(seq) << ": query head " << h
                  << " relative error " << errors[h] << " > " << kAttentionOracleTolerance
                  << " (channel " << worst << ": got " << out[h * d + worst] << ", reference "
                  << ref[h * d + worst] << ")";
    return;
  }
}

class AttentionTest : public ::testing::TestWithParam<const Backend*> {
 protected:
  const Backend& backend() const { return *GetParam(); }
};

// Lengths around every boundary: T = 1, inside the sink, no history, history of P - 1, P,
// P + 1 tokens, exactly one page, several pages, across configurations (GQA 1, 4 and 8; dense,
// Hadamard and identity rotations; INT2 and INT4; d 64, 128, 256; G 32, 64, 128).
TEST_P(AttentionTest, MatchesReferenceAtBoundaries) {
  struct Config {
    int hq, hkv, d, bits, group, sink, recent, page;
    RotationKind rotation;
    bool bitrev;
  };
  const Config configs[] = {
      {8, 8, 128, 2, 64, 4, 8, 16, RotationKind::kDense, true},      // Hq = Hkv
      {32, 4, 128, 2, 64, 4, 8, 16, RotationKind::kDense, true},     // Hq/Hkv = 8
      {16, 4, 64, 4, 32, 0, 5, 16, RotationKind::kHadamard, false},  // Hq/Hkv = 4, no sink
      {4, 2, 256, 2, 128, 3, 1, 32, RotationKind::kIdentity, false}, // W = 1
      {6, 2, 128, 4, 64, 2, 7, 16, RotationKind::kHadamard, true},   // g = 3 (batches 2 + 1)
  };
  uint64_t seed = 100;
  for (const Config& c : configs) {
    CacheParams p = testbed::Cache().q_heads(c.hq).kv_heads(c.hkv).sink(c.sink).recent(c.recent).page(c.page).both(testbed::Write().head_dim(c.d).bits(c.bits).group(c.group).rotation(c.rotation).bitrev(c.bitrev)).Unchecked();
    const size_t reserved = static_cast<size_t>(c.sink + c.recent);
    const size_t P = static_cast<size_t>(c.page);
    const std::vector<size_t> lengths = {1,
                                         static_cast<size_t>(std::max(1, c.sink)),
                                         reserved,
                                         reserved + 1,
                                         reserved + P - 1,
                                         reserved + P,
                                         reserved + P + 1,
                                         reserved + 3 * P + 5};
    for (size_t length : lengths) {
      conformance::SplitMix64 rng(++seed);
      const std::string context = "seed " + std::to_string(seed) + " " + testbed::Describe(p);
      PagedKVCache cache = testbed::MakeCache(p, &rng);
      const int seq = cache.AddSequence();
      const std::vector<float> k = testbed::KvRows(length, c.hkv, c.d, &rng);
      const std::vector<float> v = testbed::KvRows(length, c.hkv, c.d, &rng);
      // Build by prefill of half and decode of the rest, as a server would.
      const size_t half = length / 2;
      const size_t row = static_cast<size_t>(c.hkv * c.d);
      cache.Prefill(seq, k.data(), v.data(), half);
      for (size_t t = half; t < length; ++t) cache.Append(seq, &k[t * row], &v[t * row]);
      for (float magnitude : {1.0f, 4.0f}) {  // flat and peaked (logits up to ~30)
        ExpectMatchesReference(backend(), cache, seq, RandomQuery(p, rng, magnitude),
                               context + " |q|~" + std::to_string(magnitude));
      }
    }
  }
}

// Spec 1.1's caches at their boundaries: tiled keys (KIVI), with the FWHT and a per-head or
// per-token norm (OScaR), W = 0 with and without a sink (SAW-INT4: G = d, d = 256 included),
// F > 1 with per-token rows. Lengths around the first and later flushes (H jumps by F).
TEST_P(AttentionTest, Spec11CachesMatchReferenceAtFlushBoundaries) {
  struct Config {
    const char* name;
    testbed::Cache cache;
  };
  const testbed::Write kivi_k = testbed::Write().head_dim(128).bits(2).tile(32);
  const testbed::Write kivi_v = testbed::Write().head_dim(128).bits(2).group(32);
  const Config configs[] = {
      {"kivi", testbed::Cache().q_heads(8).kv_heads(2).sink(0).recent(1).flush(128).page(128)
                   .key(kivi_k).value(kivi_v)},
      {"kivi_gk64_s4_w8_f64", testbed::Cache().q_heads(4).kv_heads(2).sink(4).recent(8).flush(64)
                                  .page(64).key(testbed::Write(kivi_k).tile(64))
                                  .value(kivi_v)},
      {"ots_head_norm", testbed::Cache().q_heads(6).kv_heads(2).sink(0).recent(1).flush(64)
                            .page(64).key(testbed::Write(kivi_k).hadamard().norm())
                            .value(testbed::Write(kivi_v).hadamard())},
      {"ots_token_norm", testbed::Cache().q_heads(6).kv_heads(3).sink(0).recent(1).flush(32)
                             .page(32).key(testbed::Write(kivi_k).hadamard().norm().norm_heads(3))
                             .value(testbed::Write(kivi_v).hadamard())},
      {"tile_int4_d64_dense_norm", testbed::Cache().q_heads(4).kv_heads(1).sink(2).recent(3)
                                       .flush(32).page(64)
                                       .key(testbed::Write().head_dim(64).bits(4).tile(32)
                                                .rotation(RotationKind::kDense).norm())
                                       .value(testbed::Write().head_dim(64).bits(4).tile(32))},
      {"saw_int4_d256", testbed::Cache().q_heads(4).kv_heads(2).sink(0).recent(0).page(16)
                            .key(testbed::Write().head_dim(256).bits(4).group(256).hadamard(128))
                            .value(testbed::Write().head_dim(256).bits(4).group(256).hadamard(128))},
      {"saw_int4_k_d128", testbed::Cache().q_heads(8).kv_heads(2).sink(0).recent(0).page(16)
                              .key(testbed::Write().head_dim(128).bits(4).group(128).hadamard())
                              .value(testbed::Write().head_dim(128).bits(4).group(128))},
      {"w0_with_sink", testbed::Cache().q_heads(2).kv_heads(1).sink(5).recent(0).page(16)
                           .both(testbed::Write().head_dim(64).bits(2).group(32).hadamard())},
      {"f8_w3", testbed::Cache().q_heads(4).kv_heads(2).sink(2).recent(3).flush(8).page(16)
                    .both(testbed::Write().head_dim(64).bits(2).group(64).rotation(
                        RotationKind::kDense))},
  };
  uint64_t seed = 900;
  for (const Config& c : configs) {
    const CacheParams p = c.cache.Build();
    const size_t reserved = static_cast<size_t>(p.sink + p.recent);
    const size_t f = static_cast<size_t>(p.flush);
    std::vector<size_t> lengths = {1, reserved + 1, reserved + f - 1, reserved + f,
                                   reserved + f + 1, reserved + 2 * f + 3};
    std::sort(lengths.begin(), lengths.end());
    lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
    for (size_t length : lengths) {
      if (length == 0) continue;
      conformance::SplitMix64 rng(++seed);
      const std::string context = std::string(c.name) + " seed " + std::to_string(seed) + " " +
                                  testbed::Describe(p);
      PagedKVCache cache = testbed::MakeCache(p, &rng);
      const int seq = cache.AddSequence();
      const int hkv = p.num_kv_heads, d = p.head_dim();
      const std::vector<float> k = testbed::KvRows(length, hkv, d, &rng);
      const std::vector<float> v = testbed::KvRows(length, hkv, d, &rng);
      const size_t half = length / 2;
      const size_t row = static_cast<size_t>(hkv * d);
      cache.Prefill(seq, k.data(), v.data(), half);
      for (size_t t = half; t < length; ++t) cache.Append(seq, &k[t * row], &v[t * row]);
      ASSERT_EQ(cache.HistoryLength(seq), static_cast<size_t>(p.HistoryTokens(length))) << context;
      for (float magnitude : {1.0f, 4.0f}) {
        ExpectMatchesReference(backend(), cache, seq, RandomQuery(p, rng, magnitude),
                               context + " |q|~" + std::to_string(magnitude));
      }
    }
  }
}

// Spec 1.3's codebook caches (TurboQuant-MSE rows, Block-GTQ per-head widths, K and V of
// different widths or formats) through the decode step of every backend, against the fp64
// reference over the same decoded history (per-segment norm times centroid, spec/numerics.md
// §7.3). Lengths around the first page and the windows.
TEST_P(AttentionTest, Spec13CodebookCachesMatchReference) {
  struct Config {
    const char* name;
    testbed::Cache cache;
  };
  // segments = 8 and code_bytes = d: MakeCache draws per-head widths (testbed::HeadWidths).
  const testbed::Write widths128 = testbed::Write().head_dim(128).codebook_rows(3).segments(8)
                                       .code_bytes(128).rotation(RotationKind::kDense);
  const Config configs[] = {
      {"tq_mse_k3v2_d128", testbed::Cache().q_heads(8).kv_heads(2).sink(0).recent(0).page(16)
                               .key(testbed::Write().head_dim(128).codebook_rows(3)
                                        .rotation(RotationKind::kDense))
                               .value(testbed::Write().head_dim(128).codebook_rows(2)
                                          .rotation(RotationKind::kDense))},
      {"tq_mse_fwht_b4_d64_protected", testbed::Cache().q_heads(4).kv_heads(1).sink(4)
                                           .recent(8).page(16)
                                           .both(testbed::Write().head_dim(64).codebook_rows(4)
                                                     .hadamard())},
      {"blockgtq_widths_k_v2", testbed::Cache().q_heads(6).kv_heads(2).sink(2).recent(3)
                                   .page(16).key(widths128)
                                   .value(testbed::Write().head_dim(128).codebook_rows(2)
                                              .rotation(RotationKind::kDense))},
      {"widths_both_sides_gaussian", testbed::Cache().q_heads(4).kv_heads(2).sink(0).recent(5)
                                         .page(32)
                                         .both(testbed::Write(widths128).codebook(
                                             CodebookDensity::kGaussian))},
      {"codebook_b1_k_int4_v_d256", testbed::Cache().q_heads(4).kv_heads(1).sink(1).recent(2)
                                        .page(16)
                                        .key(testbed::Write().head_dim(256).codebook_rows(1)
                                                 .hadamard())
                                        .value(testbed::Write().head_dim(256).bits(4).group(64))},
  };
  uint64_t seed = 1300;
  for (const Config& c : configs) {
    const CacheParams p = c.cache.Build();
    const size_t reserved = static_cast<size_t>(p.sink + p.recent);
    const size_t page = static_cast<size_t>(p.page_size);
    for (size_t length : {size_t{1}, reserved + 1, reserved + page, reserved + page + 1,
                          reserved + 3 * page + 5}) {
      conformance::SplitMix64 rng(++seed);
      const std::string context = std::string(c.name) + " seed " + std::to_string(seed) + " " +
                                  testbed::Describe(p);
      PagedKVCache cache = testbed::MakeCache(p, &rng);
      ASSERT_EQ(cache.Heads(KV::kKey).widths.empty(), p.key.segments == 1) << context;
      const int seq = cache.AddSequence();
      const int hkv = p.num_kv_heads, d = p.head_dim();
      const std::vector<float> k = testbed::KvRows(length, hkv, d, &rng);
      const std::vector<float> v = testbed::KvRows(length, hkv, d, &rng);
      const size_t half = length / 2;
      const size_t row = static_cast<size_t>(hkv * d);
      cache.Prefill(seq, k.data(), v.data(), half);
      for (size_t t = half; t < length; ++t) cache.Append(seq, &k[t * row], &v[t * row]);
      ASSERT_EQ(cache.HistoryLength(seq), static_cast<size_t>(p.HistoryTokens(length))) << context;
      for (float magnitude : {1.0f, 4.0f}) {
        ExpectMatchesReference(backend(), cache, seq, RandomQuery(p, rng, magnitude),
                               context + " |q|~" + std::to_string(magnitude));
      }
    }
  }
}

// The same cache read with different history chunkings: all within the bound.
TEST_P(AttentionTest, ChunkingDoesNotMatter) {
  conformance::SplitMix64 rng(5);
  CacheParams p = testbed::Cache().q_heads(16).kv_heads(4).sink(8).recent(16).page(16).both(testbed::Write().head_dim(128).bits(2).group(64).rotation(RotationKind::kDense).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const std::vector<float> k = testbed::KvRows(300, 4, 128, &rng), v = testbed::KvRows(300, 4, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), 300);
  const std::vector<float> q = RandomQuery(p, rng, 2.0f);
  for (int chunk : {1, 2, 3, 17, 1000}) {
    AttentionOptions options;
    options.chunk_pages = chunk;
    ExpectMatchesReference(backend(), cache, seq, q, "chunk_pages " + std::to_string(chunk),
                           options);
  }
}

// Several sequences of different lengths in one batch, each against its own reference.
TEST_P(AttentionTest, BatchOfDifferentLengths) {
  conformance::SplitMix64 rng(21);
  CacheParams p = testbed::Cache().q_heads(32).kv_heads(8).sink(16).recent(32).page(16).both(testbed::Write().head_dim(128).bits(2).group(64).rotation(RotationKind::kDense).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const std::vector<size_t> lengths = {1, 40, 48, 49, 64, 65, 200, 333};
  std::vector<int> seqs;
  for (size_t length : lengths) {
    const int seq = cache.AddSequence();
    const std::vector<float> k = testbed::KvRows(length, 8, 128, &rng);
    const std::vector<float> v = testbed::KvRows(length, 8, 128, &rng);
    cache.Prefill(seq, k.data(), v.data(), length);
    seqs.push_back(seq);
  }
  std::reverse(seqs.begin(), seqs.end());
  const size_t per = 32 * 128;
  std::vector<float> q = RandomQuery(p, rng, 1.0f);
  for (size_t b = 1; b < seqs.size(); ++b) {
    const std::vector<float> more = RandomQuery(p, rng, 1.0f);
    q.insert(q.end(), more.begin(), more.end());
  }
  std::vector<float> out(q.size());
  AttendBatch(backend(), cache, seqs, q.data(), out.data());
  for (size_t b = 0; b < seqs.size(); ++b) {
    std::vector<double> ref(per);
    AttendReferenceF64(cache, seqs[b], &q[b * per], ref.data());
    const std::vector<double> errors = RelativeErrorPerHead(&out[b * per], ref.data(), 32, 128);
    for (int h = 0; h < 32; ++h) {
      ASSERT_LE(errors[h], kAttentionOracleTolerance)
          << "batch entry " << b << " (length " << cache.Length(seqs[b]) << ") head " << h;
    }
  }
}

// The bf16 baseline cache through the same API.
TEST_P(AttentionTest, Bf16Cache) {
  conformance::SplitMix64 rng(8);
  CacheParams p = testbed::Cache().q_heads(32).kv_heads(8).sink(64).recent(256).page(64).both(testbed::Write().head_dim(128).bits(2).group(64).rotation(RotationKind::kIdentity).bitrev(false)).Unchecked();
  p.key.format = p.value.format = kvq::Format::kBf16;
  PagedKVCache cache(p, {}, {});
  const int seq = cache.AddSequence();
  const std::vector<float> k = testbed::KvRows(700, 8, 128, &rng), v = testbed::KvRows(700, 8, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), 700);
  ExpectMatchesReference(backend(), cache, seq, RandomQuery(p, rng, 3.0f), "bf16 cache");
}

// A long sequence: 20K tokens, the default serving configuration shape.
TEST_P(AttentionTest, LongSequence) {
  conformance::SplitMix64 rng(77);
  CacheParams p = testbed::Cache().q_heads(8).kv_heads(2).sink(64).recent(256).page(64).both(testbed::Write().head_dim(128).bits(2).group(64).rotation(RotationKind::kDense).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const size_t length = 20000;
  const std::vector<float> k = testbed::KvRows(length, 2, 128, &rng);
  const std::vector<float> v = testbed::KvRows(length, 2, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), length);
  ASSERT_EQ(cache.HistoryLength(seq), length - 320);
  for (float magnitude : {1.0f, 4.0f}) {
    ExpectMatchesReference(backend(), cache, seq, RandomQuery(p, rng, magnitude),
                           "20K |q|~" + std::to_string(magnitude));
  }
}

// The CPU kernels of every CPU backend (the CUDA decode step has its own tests in gpu/tests).
INSTANTIATE_TEST_SUITE_P(Backends, AttentionTest,
                         ::testing::ValuesIn(testbed::TestBackends({.scalar = true, .cuda = false})),
                         testbed::BackendTestName);

// The reference against Algorithm 1 of seeds/000 read literally: dequantize the history, map
// it back by Rᵀ, concatenate sink | history | recent and run plain softmax attention. For an
// orthogonal R the two agree up to fp64 rounding and R's fp32 rounding.
TEST(AttendReference, MatchesAlgorithmOneLiterally) {
  conformance::SplitMix64 rng(31);
  CacheParams p = testbed::Cache().q_heads(8).kv_heads(2).sink(4).recent(6).page(16).both(testbed::Write().head_dim(64).bits(2).group(32).rotation(RotationKind::kDense).bitrev(true)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const size_t length = 60, d = 64;
  const std::vector<float> k = testbed::KvRows(length, 2, 64, &rng), v = testbed::KvRows(length, 2, 64, &rng);
  cache.Prefill(seq, k.data(), v.data(), length);
  const std::vector<float> q = RandomQuery(p, rng, 2.0f);
  std::vector<double> ref(q.size());
  AttendReferenceF64(cache, seq, q.data(), ref.data());

  const double scale = 1.0 / std::sqrt(64.0);
  for (int kvh = 0; kvh < 2; ++kvh) {
    // K_all, V_all [length, d] in the original space.
    std::vector<double> k_all(length * d), v_all(length * d);
    for (size_t pos = 0; pos < length; ++pos) {
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<double>& all = kv == 0 ? k_all : v_all;
        const KV half = static_cast<KV>(kv);
        if (cache.IsBf16Position(seq, pos)) {
          const uint16_t* row = cache.Bf16Row(seq, pos, half) + kvh * d;
          for (size_t j = 0; j < d; ++j) all[pos * d + j] = F32FromBf16(row[j]);
          continue;
        }
        std::vector<float> x(d);
        cache.DequantizedHistoryRow(seq, pos - 4, kvh, half, x.data());
        // Undo P_br, then multiply by Rᵀ.
        std::vector<double> y(d);
        for (size_t j = 0; j < d; ++j) {
          uint32_t r = 0;
          for (int b = 0; b < 6; ++b) r |= ((static_cast<uint32_t>(j) >> b) & 1u) << (5 - b);
          y[j] = x[r];
        }
        const float* R = cache.Rotation(half, kvh);
        for (size_t i = 0; i < d; ++i) {
          double s = 0.0;
          for (size_t j = 0; j < d; ++j) s += y[j] * R[i * d + j];
          all[pos * d + i] = s;
        }
      }
    }
    for (int hh = 0; hh < 4; ++hh) {
      const int h = kvh * 4 + hh;
      std::vector<double> logits(length);
      double mx = -1e300;
      for (size_t pos = 0; pos < length; ++pos) {
        double s = 0.0;
        for (size_t j = 0; j < d; ++j) s += q[h * d + j] * k_all[pos * d + j];
        logits[pos] = s * scale;
        mx = std::max(mx, logits[pos]);
      }
      double total = 0.0;
      std::vector<double> o(d, 0.0);
      for (size_t pos = 0; pos < length; ++pos) {
        const double w = std::exp(logits[pos] - mx);
        total += w;
        for (size_t j = 0; j < d; ++j) o[j] += w * v_all[pos * d + j];
      }
      double max_ref = 0.0, max_diff = 0.0;
      for (size_t j = 0; j < d; ++j) {
        max_ref = std::max(max_ref, std::fabs(ref[h * d + j]));
        max_diff = std::max(max_diff, std::fabs(o[j] / total - ref[h * d + j]));
      }
      // The reference takes q~ from the spec'd fp32 rotation stage (sequential fp32 sums:
      // ~sqrt(d)·2^-24 relative error per element) where this test rotates K in fp64, so they
      // differ by ~1e-6; a semantic mistake (a transpose, a missing P_br) differs by O(1).
      EXPECT_LE(max_diff / max_ref, 5e-5) << "query head " << h;
    }
  }
}

// spec/cache.md §5.1, the decode algebra of a tile: with x^[t][j] = n^_t (code[t][j] s^[j] +
// m^[j]) in exact arithmetic, q~.x^_t = n^_t (sum_j a[j] code[t][j] + c) with a = q~ o s^ and
// c = q~ . m^ built once per (query head, tile). The folded logits, in fp64 from the stored
// planes, agree with the reference's logits over the fp32 dequantized rows to the fp32
// rounding of those rows (relative to sum_j |q~_j x^_tj|).
TEST(AttendReference, TileLogitsFoldScalesAndMinsIntoTheQuery) {
  conformance::SplitMix64 rng(44);
  const CacheParams p = testbed::Cache().q_heads(2).kv_heads(1).sink(0).recent(1).flush(64)
                            .page(64).key(testbed::Write().head_dim(128).bits(2).tile(32)
                                              .hadamard().norm())
                            .value(testbed::Write().head_dim(128).bits(2).group(32)).Build();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  const size_t d = 128;
  const std::vector<float> k = testbed::KvRows(200, 1, 128, &rng), v = testbed::KvRows(200, 1, 128, &rng);
  cache.Prefill(seq, k.data(), v.data(), 200);
  const size_t history = cache.HistoryLength(seq);
  ASSERT_EQ(history, 192u);
  const std::vector<float> rows = cache.DequantizedHistory(seq, 0, KV::kKey);
  const std::vector<float> q = RandomQuery(p, rng, 2.0f);
  std::vector<float> q_rot(d);
  Rotate(ScalarBackend(), p.key, nullptr, q.data(), q_rot.data(), 1);
  const int slice = p.key.tile_channel_bytes();
  for (size_t t0 = 0; t0 < history; t0 += 32) {
    const HistoryRunView tile = cache.HistoryRow(seq, t0, 0, KV::kKey);
    ASSERT_EQ(tile.tile_offset, 0);
    const uint16_t* scale = reinterpret_cast<const uint16_t*>(tile.plane[1]);
    const uint16_t* min = reinterpret_cast<const uint16_t*>(tile.plane[2]);
    std::vector<double> a(d);
    double c = 0.0;
    for (size_t j = 0; j < d; ++j) {
      a[j] = static_cast<double>(q_rot[j]) * F32FromBf16(scale[j]);
      c += static_cast<double>(q_rot[j]) * F32FromBf16(min[j]);
    }
    for (size_t r = 0; r < 32; ++r) {
      const HistoryRunView row = cache.HistoryRow(seq, t0 + r, 0, KV::kKey);
      double folded = c, direct = 0.0, magnitude = 0.0;
      for (size_t j = 0; j < d; ++j) {
        const int byte = tile.plane[0][j * slice + r % slice];
        const int code = (byte >> (2 * (r / slice))) & 3;
        folded += a[j] * code;
        direct += static_cast<double>(q_rot[j]) * rows[(t0 + r) * d + j];
        magnitude += std::fabs(static_cast<double>(q_rot[j]) * rows[(t0 + r) * d + j]);
      }
      folded *= F32FromBf16(reinterpret_cast<const uint16_t*>(row.plane[3])[0]);
      // Each x^ is rounded twice in fp32 (the sum, the norm product): 2^-23 relative.
      EXPECT_LE(std::fabs(folded - direct), 0x1p-22 * magnitude) << "row " << t0 + r;
    }
  }
}

TEST(Attend, RejectsBadInputs) {
  conformance::SplitMix64 rng(2);
  CacheParams p = testbed::Cache().q_heads(4).kv_heads(2).sink(2).recent(3).page(16).both(testbed::Write().head_dim(64).bits(2).group(32).rotation(RotationKind::kHadamard).bitrev(false)).Unchecked();
  PagedKVCache cache = testbed::MakeCache(p, &rng);
  const int seq = cache.AddSequence();
  std::vector<float> q = RandomQuery(p, rng, 1.0f), out(q.size());
  const Backend& backend = BestBackend();
  const auto expect = [](auto fn, ErrorCode code, const std::string& piece) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected '" << piece << "'";
    } catch (const Error& e) {
      EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
      EXPECT_NE(std::string(e.what()).find(piece), std::string::npos) << e.what();
    }
  };
  expect([&] { Attend(backend, cache, seq, q.data(), out.data()); },
         ErrorCode::kInvalidArgument, "is empty");
  expect([&] { Attend(backend, cache, 99, q.data(), out.data()); }, ErrorCode::kInvalidArgument,
         "unknown sequence id 99");
  const std::vector<float> k = testbed::KvRows(30, 2, 64, &rng);
  cache.Prefill(seq, k.data(), k.data(), 30);
  q[2 * 64 + 7] = std::numeric_limits<float>::infinity();
  expect([&] { Attend(backend, cache, seq, q.data(), out.data()); }, ErrorCode::kNonFinite,
         "head 2, channel 7");
  q[2 * 64 + 7] = 0.0f;
  AttentionOptions options;
  options.chunk_pages = 0;
  expect([&] { Attend(backend, cache, seq, q.data(), out.data(), options); },
         ErrorCode::kInvalidArgument, "chunk_pages 0");
  Backend without = backend;
  without.attention = AttentionKernels();
  expect([&] { Attend(without, cache, seq, q.data(), out.data()); }, ErrorCode::kUnsupported,
         "no decode-attention kernels");
}

}  // namespace
}  // namespace kvq::cpu
