// Error metrics: the fp64 building blocks against hand-computed values, and EvaluateHead against
// an independent brute-force recomputation that APPENDS tokens one at a time and reads the
// cache at every query's own length (no full-length prefill, no GEMMs).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kvq/calib/metrics.h"
#include "kvq/calib/rope_logit.h"
#include "kvq/calib/schemes.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testing::SmallSchemeOptions;

TEST(MetricBlocks, SoftmaxByHand) {
  const double logits[3] = {0.0, std::log(2.0), std::log(5.0)};
  double p[3];
  SoftmaxF64(logits, 3, p);
  EXPECT_NEAR(p[0], 1.0 / 8, 1e-15);
  EXPECT_NEAR(p[1], 2.0 / 8, 1e-15);
  EXPECT_NEAR(p[2], 5.0 / 8, 1e-15);
  const double big[2] = {1000.0, 1000.0};  // max subtraction keeps it finite
  SoftmaxF64(big, 2, p);
  EXPECT_EQ(p[0], 0.5);
  EXPECT_EQ(p[1], 0.5);
}

TEST(MetricBlocks, KlDivergenceByHand) {
  const double p[2] = {0.5, 0.5};
  const double q[2] = {0.25, 0.75};
  EXPECT_EQ(KlDivergence(p, p, 2), 0.0);
  EXPECT_NEAR(KlDivergence(p, q, 2), 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0), 1e-15);
  const double p0[3] = {0.0, 0.5, 0.5};
  const double q0[3] = {0.2, 0.4, 0.4};
  EXPECT_NEAR(KlDivergence(p0, q0, 3), std::log(0.5 / 0.4), 1e-15);  // p_i = 0 terms vanish
  const double qz[3] = {0.5, 0.5, 0.0};
  EXPECT_TRUE(std::isinf(KlDivergence(p0, qz, 3)));  // mass where q has none
}

TEST(MetricBlocks, TopKOverlapByHand) {
  std::vector<double> up(12), down(12);
  for (int i = 0; i < 12; ++i) {
    up[i] = i + 1;
    down[i] = 12 - i;
  }
  EXPECT_EQ(TopKOverlap(up.data(), up.data(), 12, 10), 1.0);
  // top10(up) = {2..11}, top10(down) = {0..9}: 8 in common.
  EXPECT_DOUBLE_EQ(TopKOverlap(up.data(), down.data(), 12, 10), 0.8);
  // n < k: k' = n, identical sets.
  EXPECT_EQ(TopKOverlap(up.data(), down.data(), 3, 10), 1.0);
  // Ties go to the lower index: uniform p picks {0, 1}; q prefers index 2 then 0.
  const double uniform[4] = {0.25, 0.25, 0.25, 0.25};
  const double q[4] = {0.3, 0.1, 0.5, 0.1};
  EXPECT_DOUBLE_EQ(TopKOverlap(uniform, q, 4, 2), 0.5);
}

TEST(MetricBlocks, ErrorSumRelative) {
  ErrorSum s;
  s.Add(3.0, 1.0);
  s.Add(2.0, 2.0);
  EXPECT_EQ(s.error, 4.0);
  EXPECT_EQ(s.reference, 5.0);
  EXPECT_EQ(s.Relative(), 0.8);
  EXPECT_EQ(ErrorSum{}.Relative(), 0.0);
  EXPECT_TRUE(std::isinf((ErrorSum{1.0, 0.0}).Relative()));
}

// A small capture: d = 64, g = 2, 256 calibration + 256 held-out tokens.
const Activations& SmallActs() {
  static const Activations acts = Synthesize(testing::SmallSynthOptions(1, 512, 5));
  return acts;
}

MetricOptions AllQueries() {
  MetricOptions m;
  m.query_positions = 0;
  m.prefix_tokens = 16;
  return m;
}

TEST(EvaluateHead, Bf16SchemeHasZeroErrorAndFullOverlap) {
  const HeldOutHead data = PrepareHeldOut(SmallActs(), 0, 1, AllQueries());
  const LayerScheme s =
      SliceKvHead(BuildLayerScheme("bf16", SmallActs(), nullptr, 0, SmallSchemeOptions()), 1);
  const HeadMetrics m = EvaluateHead(data, s, cpu::BestBackend(), AllQueries());
  EXPECT_EQ(m.k_rel_mse, 0.0);
  EXPECT_EQ(m.v_rel_mse, 0.0);
  EXPECT_EQ(m.logit_rel_mse, 0.0);
  EXPECT_EQ(m.sv_rel_mse, 0.0);
  EXPECT_EQ(m.attn_kl, 0.0);
  EXPECT_EQ(m.top10_overlap, 1.0);
  EXPECT_EQ(m.output_rel_mse, 0.0);
  EXPECT_EQ(m.bits_per_element, 16.0);
  EXPECT_EQ(m.history_tokens, 0);
  EXPECT_TRUE(std::isnan(m.tr_ek));
  EXPECT_TRUE(std::isnan(m.group_range));
  EXPECT_LT(m.attend_check, 1e-5);
}

// The RoPE-logit MAE from a brute force: each cache row read back one at a time at the full
// length, RoPE undone on it, its reference row and the queries of its capture token (token and
// position recomputed here from the prefix and the capture), then R_Δ turned term by term.
double BruteRopeLogitMae(const Activations& acts, const HeldOutHead& data,
                         const LayerScheme& scheme) {
  const int d = data.head_dim, g = data.group;
  const cpu::Backend& backend = cpu::BestBackend();
  cpu::PagedKVCache cache(scheme.params, scheme.key, scheme.value, backend);
  const int seq = cache.AddSequence();
  cache.Prefill(seq, data.keys.data(), data.values.data(), static_cast<size_t>(data.tokens));
  double sum = 0;
  int64_t terms = 0;
  std::vector<double> e(d), q(d);
  for (int64_t i = 0; i < data.tokens; ++i) {
    const int64_t token = i < data.prefix ? i : acts.info.calib_tokens + (i - data.prefix);
    std::vector<float> rotated(d), original(d);
    if (cache.IsBf16Position(seq, static_cast<size_t>(i))) {
      const uint16_t* row = cache.Bf16Row(seq, static_cast<size_t>(i), cpu::KV::kKey);
      for (int c = 0; c < d; ++c) original[c] = F32FromBf16(row[c]);
    } else {
      cache.DequantizedHistoryRow(seq, static_cast<size_t>(i) - scheme.params.sink, 0,
                                  cpu::KV::kKey, rotated.data());
      cpu::RotateInverse(backend, cache.HeadParams(cpu::KV::kKey, 0),
                         cache.Rotation(cpu::KV::kKey, 0), rotated.data(), original.data(), 1);
    }
    for (int c = 0; c < d; ++c) e[c] = original[c] - data.k(i, c);
    UndoRope(e.data(), d, acts.info.rope_base, static_cast<double>(token));
    for (int j = 0; j < g; ++j) {
      const float* qr = acts.q(data.layer, token, data.kv_head * g + j);
      for (int c = 0; c < d; ++c) q[c] = qr[c];
      UndoRope(q.data(), d, acts.info.rope_base, static_cast<double>(token));
      for (double delta : RopeLogitOffsets()) {
        sum += std::fabs(RotatedLogit(q.data(), e.data(), d, acts.info.rope_base, delta));
        ++terms;
      }
    }
  }
  return sum / static_cast<double>(terms);
}

TEST(EvaluateHead, RopeLogitMaeMatchesABruteForceForEveryKindOfScheme) {
  const Activations& acts = SmallActs();
  const MetricOptions options = AllQueries();
  const HeldOutHead data = PrepareHeldOut(acts, 0, 1, options);
  double naive = 0, tq_mse = 0;
  for (const char* name : {"bf16", "naive", "hadamard_bitrev", "saw_int4", "kivi", "fp8_unscaled",
                           "tq_mse", "tq_mse_fwht"}) {
    const LayerScheme s =
        SliceKvHead(BuildLayerScheme(name, acts, nullptr, 0, SmallSchemeOptions()), 1);
    const HeadMetrics m = EvaluateHead(data, s, cpu::BestBackend(), options);
    const double b = BruteRopeLogitMae(acts, data, s);
    if (std::string(name) == "bf16") {
      EXPECT_EQ(m.rope_logit_mae, 0.0);
      EXPECT_EQ(b, 0.0);
      continue;
    }
    EXPECT_GT(m.rope_logit_mae, 0.0) << name;
    EXPECT_NEAR(m.rope_logit_mae, b, 1e-9 * b) << name;
    if (std::string(name) == "naive") naive = m.rope_logit_mae;
    if (std::string(name) == "tq_mse") tq_mse = m.rope_logit_mae;
  }
  // The sink and recent rows of naive stay bf16 (S0 = 16, W = 32); tq_mse quantizes every row.
  EXPECT_NE(naive, tq_mse);
}

TEST(EvaluateHead, PrepareHeldOutLayout) {
  const Activations& acts = SmallActs();
  MetricOptions o = AllQueries();
  o.query_positions = 10;
  const HeldOutHead h = PrepareHeldOut(acts, 0, 1, o);
  EXPECT_EQ(h.tokens, 16 + 256);
  EXPECT_EQ(h.first_query, h.tokens - 10);
  EXPECT_EQ(h.rows(), 20);
  // Row 16 of the sequence is held-out token calib_tokens (= 256) of the capture.
  EXPECT_EQ(h.k(16, 3), RoundToBf16(acts.k(0, 256, 1)[3]));
  EXPECT_EQ(h.k(15, 3), RoundToBf16(acts.k(0, 15, 1)[3]));
  // Query row 3 = position first_query + 1, query head 1·g + 1 = 3.
  EXPECT_EQ(h.q(3, 7), acts.q(0, 256 + (h.first_query + 1 - 16), 3)[7]);
  // The RoPE-logit MAE's rows: every position's own token's queries and RoPE position.
  EXPECT_EQ(h.rope_base, acts.info.rope_base);
  ASSERT_EQ(h.rope_positions.size(), static_cast<size_t>(h.tokens));
  EXPECT_EQ(h.rope_positions[15], 15.0);
  EXPECT_EQ(h.rope_positions[16], 256.0);
  EXPECT_EQ(h.token_queries[(16 * 2 + 1) * 64 + 5], acts.q(0, 256, 3)[5]);
  o.prefix_tokens = 300;
  EXPECT_THROW(PrepareHeldOut(acts, 0, 0, o), Error);
  o.prefix_tokens = 0;
  EXPECT_THROW(PrepareHeldOut(acts, 1, 0, o), Error);
  EXPECT_THROW(PrepareHeldOut(acts, 0, 2, o), Error);
}

// Every metric recomputed from a cache grown by Append, read at each query's own length.
HeadMetrics BruteForce(const HeldOutHead& data, const LayerScheme& scheme, int top_k) {
  const int d = data.head_dim;
  const int g = data.group;
  const cpu::Backend& backend = cpu::BestBackend();
  cpu::PagedKVCache cache(scheme.params, scheme.key, scheme.value, backend);
  const int seq = cache.AddSequence();
  // Rows of one position read back in the original space.
  auto read = [&](size_t pos, cpu::KV kv, double* out) {
    if (cache.IsBf16Position(seq, pos)) {
      const uint16_t* row = cache.Bf16Row(seq, pos, kv);
      for (int c = 0; c < d; ++c) out[c] = F32FromBf16(row[c]);
      return;
    }
    std::vector<float> rotated(d), original(d);
    cache.DequantizedHistoryRow(seq, pos - scheme.params.sink, 0, kv, rotated.data());
    cpu::RotateInverse(backend, cache.HeadParams(kv, 0), cache.Rotation(kv, 0), rotated.data(),
                       original.data(), 1);
    for (int c = 0; c < d; ++c) out[c] = original[c];
  };
  ErrorSum logit, sv, output;
  double kl = 0, overlap = 0;
  int rows = 0;
  for (int64_t p = 0; p < data.tokens; ++p) {
    cache.Append(seq, data.keys.data() + p * d, data.values.data() + p * d);
    if (p < data.first_query) continue;
    const int64_t n = p + 1;
    std::vector<double> k(n * d), v(n * d);
    for (int64_t i = 0; i < n; ++i) {
      read(static_cast<size_t>(i), cpu::KV::kKey, &k[i * d]);
      read(static_cast<size_t>(i), cpu::KV::kValue, &v[i * d]);
    }
    for (int j = 0; j < g; ++j) {
      const int64_t r = (p - data.first_query) * g + j;
      std::vector<double> sq(n), sr(n), pq(n), pr(n);
      for (int64_t i = 0; i < n; ++i) {
        double a = 0, b = 0;
        for (int c = 0; c < d; ++c) {
          a += data.q(r, c) * k[i * d + c];
          b += data.q(r, c) * data.k(i, c);
        }
        sq[i] = data.scale * a;
        sr[i] = data.scale * b;
        logit.Add(sq[i], sr[i]);
      }
      SoftmaxF64(sq.data(), n, pq.data());
      SoftmaxF64(sr.data(), n, pr.data());
      kl += KlDivergence(pr.data(), pq.data(), n);
      overlap += TopKOverlap(pr.data(), pq.data(), n, top_k);
      for (int c = 0; c < d; ++c) {
        double o_q = 0, o_r = 0, o_sv = 0;
        for (int64_t i = 0; i < n; ++i) {
          o_q += pq[i] * v[i * d + c];
          o_r += pr[i] * data.v(i, c);
          o_sv += pr[i] * v[i * d + c];
        }
        output.Add(o_q, o_r);
        sv.Add(o_sv, o_r);
      }
      ++rows;
    }
  }
  // Cache-level K/V error at the full length.
  ErrorSum ke, ve;
  std::vector<double> row(d);
  for (int64_t i = 0; i < data.tokens; ++i) {
    read(static_cast<size_t>(i), cpu::KV::kKey, row.data());
    for (int c = 0; c < d; ++c) ke.Add(row[c], data.k(i, c));
    read(static_cast<size_t>(i), cpu::KV::kValue, row.data());
    for (int c = 0; c < d; ++c) ve.Add(row[c], data.v(i, c));
  }
  HeadMetrics m;
  m.k_rel_mse = ke.Relative();
  m.v_rel_mse = ve.Relative();
  m.logit_rel_mse = logit.Relative();
  m.sv_rel_mse = sv.Relative();
  m.output_rel_mse = output.Relative();
  m.attn_kl = kl / rows;
  m.top10_overlap = overlap / rows;
  m.bits_per_element = cache.Bytes(seq).bits_per_element();
  m.history_tokens = static_cast<int64_t>(cache.HistoryLength(seq));
  return m;
}

void ExpectClose(double a, double b, const char* what, const std::string& scheme) {
  EXPECT_NEAR(a, b, 1e-9 * std::max(std::fabs(b), 1e-12)) << what << " of " << scheme;
}

TEST(EvaluateHead, MatchesBruteForceAppendAtEveryQueryLength) {
  const Activations& acts = SmallActs();
  const MetricOptions options = AllQueries();
  const HeldOutHead data = PrepareHeldOut(acts, 0, 1, options);
  for (const char* name : {"naive", "hadamard_bitrev", "saw_int4"}) {
    const LayerScheme s =
        SliceKvHead(BuildLayerScheme(name, acts, nullptr, 0, SmallSchemeOptions()), 1);
    const HeadMetrics m = EvaluateHead(data, s, cpu::BestBackend(), options);
    const HeadMetrics b = BruteForce(data, s, options.top_k);
    ExpectClose(m.k_rel_mse, b.k_rel_mse, "k_rel_mse", name);
    ExpectClose(m.v_rel_mse, b.v_rel_mse, "v_rel_mse", name);
    ExpectClose(m.logit_rel_mse, b.logit_rel_mse, "logit_rel_mse", name);
    ExpectClose(m.sv_rel_mse, b.sv_rel_mse, "sv_rel_mse", name);
    ExpectClose(m.output_rel_mse, b.output_rel_mse, "output_rel_mse", name);
    ExpectClose(m.attn_kl, b.attn_kl, "attn_kl", name);
    EXPECT_EQ(m.top10_overlap, b.top10_overlap) << name;
    EXPECT_EQ(m.bits_per_element, b.bits_per_element) << name;
    EXPECT_EQ(m.history_tokens, b.history_tokens) << name;
    EXPECT_GT(m.output_rel_mse, 0.0) << name;
    EXPECT_LT(m.top10_overlap, 1.0) << name;
    EXPECT_LT(m.attend_check, options.attend_tolerance) << name;
  }
}

TEST(EvaluateHead, TrEkOfTheIdentitySchemeIsThePerTokenKeyResidual) {
  // Without rotation and clip, x̃ = k, so tr(E_K)·N = Σ_history ‖k − k̂‖² = k_rel_mse·Σ‖k‖².
  const Activations& acts = SmallActs();
  const HeldOutHead data = PrepareHeldOut(acts, 0, 0, AllQueries());
  const LayerScheme s =
      SliceKvHead(BuildLayerScheme("naive", acts, nullptr, 0, SmallSchemeOptions()), 0);
  const HeadMetrics m = EvaluateHead(data, s, cpu::BestBackend(), AllQueries());
  ASSERT_EQ(m.history_tokens, 16 + 256 - 16 - 32);
  EXPECT_NEAR(m.tr_ek * m.history_tokens, m.k_rel_mse * data.k.squaredNorm(),
              1e-9 * m.tr_ek * m.history_tokens);
  // Mean group range of the unclipped history rows, recomputed from the data.
  double range = 0;
  for (int64_t i = 16; i < 16 + m.history_tokens; ++i) {
    for (int g0 = 0; g0 < 64; g0 += 32) {
      double lo = 1e300, hi = -1e300;
      for (int c = g0; c < g0 + 32; ++c) {
        lo = std::min(lo, data.k(i, c));
        hi = std::max(hi, data.k(i, c));
      }
      range += hi - lo;
    }
  }
  EXPECT_NEAR(m.group_range, range / (2.0 * m.history_tokens), 1e-12 * m.group_range);
  // Bits: (16 sink + 32 recent) bf16 rows, the rest 64·2/8 + 2·4 = 24 bytes per row, K and V.
  const double bytes = 2.0 * (48 * 64 * 2 + m.history_tokens * 24);
  EXPECT_DOUBLE_EQ(m.bits_per_element, 8 * bytes / (2.0 * data.tokens * 64));
}

TEST(EvaluateHead, RejectsAMultiHeadScheme) {
  const Activations& acts = SmallActs();
  const HeldOutHead data = PrepareHeldOut(acts, 0, 0, AllQueries());
  const LayerScheme layer = BuildLayerScheme("naive", acts, nullptr, 0, SmallSchemeOptions());
  EXPECT_THROW(EvaluateHead(data, layer, cpu::BestBackend(), AllQueries()), Error);
}

}  // namespace
}  // namespace kvq::calib
