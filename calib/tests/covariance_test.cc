// Calibration targets against plain fp64 references that build the full T×T attention.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvq/calib/covariance.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

const Activations& SmallCapture() {
  static const Activations* acts = [] {
    SynthOptions o = testing::SynthShape(2, 6, 2, 64, 600, 3);
    o.calib_tokens = 300;  // not a multiple of the block sizes tested
    return new Activations(Synthesize(o));
  }();
  return *acts;
}

struct NaiveAttention {
  MatrixXd output_covariance;
  VectorXd key_weight;
  double mean_entropy = 0, mean_sink_mass = 0;
};

// The full masked softmax matrix per query head, in fp64.
NaiveAttention Naive(const Activations& acts, int layer, int kv_head, int64_t tokens, int sink) {
  const int d = acts.info.head_dim;
  const int g = acts.info.group_size();
  NaiveAttention out;
  out.output_covariance = MatrixXd::Zero(d, d);
  out.key_weight = VectorXd::Zero(tokens);
  MatrixXd k(tokens, d), v(tokens, d);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int c = 0; c < d; ++c) {
      k(t, c) = acts.k(layer, t, kv_head)[c];
      v(t, c) = acts.v(layer, t, kv_head)[c];
    }
  }
  for (int i = 0; i < g; ++i) {
    MatrixXd q(tokens, d);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int c = 0; c < d; ++c) q(t, c) = acts.q(layer, t, kv_head * g + i)[c];
    }
    MatrixXd s = q * k.transpose() / std::sqrt(static_cast<double>(d));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t u = t + 1; u < tokens; ++u) s(t, u) = -std::numeric_limits<double>::infinity();
      const double m = s.row(t).maxCoeff();
      double sum = 0;
      for (int64_t u = 0; u <= t; ++u) sum += std::exp(s(t, u) - m);
      double entropy = 0, sink_mass = 0;
      for (int64_t u = 0; u < tokens; ++u) {
        const double p = u <= t ? std::exp(s(t, u) - m) / sum : 0.0;
        if (p > 0) entropy -= p * std::log(p);
        if (u < sink) sink_mass += p;
        s(t, u) = p;
      }
      out.mean_entropy += entropy;
      out.mean_sink_mass += sink_mass;
    }
    const MatrixXd o = s * v;
    out.output_covariance += o.transpose() * o;
    out.key_weight += s.colwise().sum().transpose();
  }
  const double n = static_cast<double>(g) * tokens;
  out.output_covariance /= n;
  out.mean_entropy /= n;
  out.mean_sink_mass /= n;
  return out;
}

double RelativeError(const MatrixXd& a, const MatrixXd& b) { return (a - b).norm() / b.norm(); }

TEST(AttentionStatistics, FlashStyleEqualsNaiveFullMatrix) {
  const Activations& acts = SmallCapture();
  const int64_t tokens = acts.info.calib_tokens;
  for (int layer = 0; layer < 2; ++layer) {
    for (int kv_head = 0; kv_head < 2; ++kv_head) {
      const NaiveAttention naive = Naive(acts, layer, kv_head, tokens, 2);
      for (int block : {128, 37, 1}) {
        const AttentionStatistics flash =
            ComputeAttentionStatistics(acts, layer, kv_head, tokens, true, 2, block);
        EXPECT_LT(RelativeError(flash.output_covariance, naive.output_covariance), 1e-12)
            << "layer " << layer << " head " << kv_head << " block " << block;
        EXPECT_LT((flash.key_weight - naive.key_weight).norm() / naive.key_weight.norm(), 1e-12)
            << "layer " << layer << " head " << kv_head << " block " << block;
        EXPECT_NEAR(flash.mean_entropy, naive.mean_entropy, 1e-10 * naive.mean_entropy);
        EXPECT_NEAR(flash.mean_sink_mass, naive.mean_sink_mass, 1e-12);
        // Every row's probabilities sum to one, so the key weights sum to the row count.
        EXPECT_NEAR(flash.key_weight.sum(), 3.0 * tokens, 1e-9 * tokens);
      }
    }
  }
}

// A segmented capture attends within segments only: its statistics are the row-weighted means
// of each segment's own, and the sink is counted from each segment's start.
TEST(AttentionStatistics, SegmentsAreIndependentSequences) {
  const Activations& whole = SmallCapture();  // 600 tokens
  const int64_t segment = 150;
  Activations segmented = whole;
  segmented.info.segment_tokens = segment;
  const int64_t tokens = 300;  // two segments
  MatrixXd expected = MatrixXd::Zero(64, 64);
  double entropy = 0, sink = 0;
  for (int s = 0; s < 2; ++s) {
    Activations part = whole;  // segment s moved to the front
    for (int l = 0; l < 2; ++l) {
      for (std::vector<float>* v : {&part.layers[l].q, &part.layers[l].k, &part.layers[l].v}) {
        const size_t per_token = v->size() / 600;
        std::copy(v->begin() + s * segment * per_token, v->begin() + (s + 1) * segment * per_token,
                  v->begin());
      }
    }
    const AttentionStatistics one = ComputeAttentionStatistics(part, 1, 0, segment, false, 3);
    expected += one.output_covariance / 2.0;
    entropy += one.mean_entropy / 2.0;
    sink += one.mean_sink_mass / 2.0;
  }
  for (int block : {128, 37}) {
    const AttentionStatistics both =
        ComputeAttentionStatistics(segmented, 1, 0, tokens, true, 3, block);
    EXPECT_LT(RelativeError(both.output_covariance, expected), 1e-12) << block;
    EXPECT_NEAR(both.mean_entropy, entropy, 1e-10 * entropy) << block;
    EXPECT_NEAR(both.mean_sink_mass, sink, 1e-12) << block;
    EXPECT_NEAR(both.key_weight.sum(), 3.0 * tokens, 1e-9 * tokens);
    // Segment 1's first key receives the attention of its own queries only.
    EXPECT_GT(both.key_weight(segment), 1.0);
  }
  // Not the same as one 300-token sequence.
  EXPECT_GT(RelativeError(ComputeAttentionStatistics(whole, 1, 0, tokens, false).output_covariance,
                          expected),
            1e-3);
}

TEST(QueryCovariance, MeanOfQtQOverTheGroupsQueryHeads) {
  const Activations& acts = SmallCapture();
  const int64_t tokens = 100;
  MatrixXd expected = MatrixXd::Zero(64, 64);
  for (int head = 3; head < 6; ++head) {  // KV head 1 owns query heads 3, 4, 5
    for (int64_t t = 0; t < tokens; ++t) {
      const Eigen::Map<const Eigen::VectorXf> q(acts.q(1, t, head), 64);
      expected += q.cast<double>() * q.cast<double>().transpose();
    }
  }
  expected /= 3.0 * tokens;
  EXPECT_LT(RelativeError(QueryCovariance(acts, 1, 1, tokens), expected), 1e-14);
}

TEST(KeyWeightedValueCovariance, WeightsEachValueByTheAttentionItReceives) {
  const Activations& acts = SmallCapture();
  const int64_t tokens = acts.info.calib_tokens;
  const AttentionStatistics s = ComputeAttentionStatistics(acts, 0, 1, tokens, true);
  MatrixXd expected = MatrixXd::Zero(64, 64);
  for (int64_t t = 0; t < tokens; ++t) {
    const Eigen::VectorXd v = Eigen::Map<const Eigen::VectorXf>(acts.v(0, t, 1), 64).cast<double>();
    expected += s.key_weight(t) * v * v.transpose();
  }
  expected /= s.key_weight.sum();
  EXPECT_LT(RelativeError(KeyWeightedValueCovariance(acts, 0, 1, tokens, s.key_weight), expected),
            1e-13);
  // It differs from the attention-output covariance and from the raw one: three targets.
  EXPECT_GT(RelativeError(expected, s.output_covariance), 0.05);
  EXPECT_GT(RelativeError(expected, RawCovariance(acts, 0, 1, false, tokens)), 0.05);
  VectorXd negative = s.key_weight;
  negative(4) = -1;
  EXPECT_THROW(KeyWeightedValueCovariance(acts, 0, 1, tokens, negative), Error);
  EXPECT_THROW(KeyWeightedValueCovariance(acts, 0, 1, tokens, s.key_weight.head(10)), Error);
}

TEST(Covariance, RejectsOutOfRangeArguments) {
  const Activations& acts = SmallCapture();
  EXPECT_THROW(QueryCovariance(acts, 2, 0, 10), Error);
  EXPECT_THROW(QueryCovariance(acts, 0, 2, 10), Error);
  EXPECT_THROW(RawCovariance(acts, 0, 0, true, 601), Error);
  EXPECT_THROW(ComputeAttentionStatistics(acts, 0, 0, 0, false), Error);
  EXPECT_THROW(ComputeAttentionStatistics(acts, 0, 0, 10, false, 1, 0), Error);
}

}  // namespace
}  // namespace kvq::calib
