// RoPE-logit MAE (seeds/004 App. B.3): the offset grid, RoPE undone by hand, hand-computed MAEs,
// the accumulator against the rotation's definition applied term by term, and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvq/calib/rope_logit.h"
#include "kvq/common/error.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testing::ExpectError;

TEST(RopeLogit, OffsetsAreFiftyEvenlySpacedInPlusMinus1024) {
  const std::vector<double>& d = RopeLogitOffsets();
  ASSERT_EQ(d.size(), 50u);
  EXPECT_EQ(d.front(), -1024.0);
  EXPECT_EQ(d.back(), 1024.0);
  for (int j = 0; j < 50; ++j) EXPECT_EQ(d[j], -1024.0 + 2048.0 * j / 49.0) << j;
  EXPECT_NEAR(d[1] - d[0], 2048.0 / 49.0, 1e-12);  // numpy linspace: not integers
}

// d = 4, base 100: θ_0 = 1, θ_1 = 100^(−1/2) = 0.1. Rotate-half pairs (0, 2) and (1, 3).
TEST(RopeLogit, UndoRopeInvertsRotateHalfByHand) {
  const double p = 3.0;
  double x[4] = {std::cos(p), 0.0, std::sin(p), 0.0};  // e_0 after RoPE at position 3
  UndoRope(x, 4, 100.0, p);
  EXPECT_NEAR(x[0], 1.0, 1e-12);
  EXPECT_NEAR(x[1], 0.0, 1e-12);
  EXPECT_NEAR(x[2], 0.0, 1e-12);
  EXPECT_NEAR(x[3], 0.0, 1e-12);
  double y[4] = {0.0, std::cos(0.1 * p), 0.0, std::sin(0.1 * p)};  // e_1, θ_1 = 0.1
  UndoRope(y, 4, 100.0, p);
  EXPECT_NEAR(y[1], 1.0, 1e-12);
  EXPECT_NEAR(y[3], 0.0, 1e-12);
  // Another base turns pair 1 by another angle: the base matters.
  double z[4] = {0.0, std::cos(0.1 * p), 0.0, std::sin(0.1 * p)};
  UndoRope(z, 4, 10000.0, p);
  EXPECT_GT(std::fabs(z[3]), 0.1);
}

TEST(RopeLogit, ExactKeysGiveZero) {
  RopeLogitMae mae(64, 1e6);
  std::vector<double> zero(64, 0.0), q(2 * 64, 1.5);
  mae.Add(zero.data(), q.data(), 2, 17.0);
  mae.AddExact(3);  // three bf16 rows' queries
  EXPECT_EQ(mae.sum(), 0.0);
  EXPECT_EQ(mae.terms(), (2 + 3) * 50);
  EXPECT_EQ(mae.Mean(), 0.0);
}

// q = 2·e_1, e = 0.5·e_1 at position 0: qᵀR_Δe = cos(0.1·Δ); q = e_2, e = e_0: sin(Δ).
TEST(RopeLogit, KnownPerturbationsGiveTheKnownMae) {
  const std::vector<double>& offsets = RopeLogitOffsets();
  double cos_mean = 0, sin_mean = 0;
  for (double delta : offsets) {
    cos_mean += std::fabs(std::cos(0.1 * delta)) / offsets.size();
    sin_mean += std::fabs(std::sin(delta)) / offsets.size();
  }
  {
    RopeLogitMae mae(4, 100.0);
    const double e[4] = {0, 0.5, 0, 0}, q[4] = {0, 2, 0, 0};
    mae.Add(e, q, 1, 0.0);
    EXPECT_NEAR(mae.Mean(), cos_mean, 1e-12);
    // The same pair at any position (both post-RoPE there): RoPE undone, same terms.
    RopeLogitMae at(4, 100.0);
    double er[4] = {0, 0.5 * std::cos(0.1 * 40), 0, 0.5 * std::sin(0.1 * 40)};
    double qr[4] = {0, 2 * std::cos(0.1 * 40), 0, 2 * std::sin(0.1 * 40)};
    at.Add(er, qr, 1, 40.0);
    EXPECT_NEAR(at.Mean(), cos_mean, 1e-12);
    // At the one offset Δ = 10, base 100 gives |cos(1)|; base 1e4 (θ_1 = 0.01) |cos(0.1)|.
    RopeLogitMae base100(4, 100.0, {10.0}), base1e4(4, 1e4, {10.0});
    base100.Add(e, q, 1, 0.0);
    base1e4.Add(e, q, 1, 0.0);
    EXPECT_NEAR(base100.Mean(), std::cos(1.0), 1e-12);
    EXPECT_NEAR(base1e4.Mean(), std::cos(0.1), 1e-12);
  }
  {
    RopeLogitMae mae(4, 100.0);
    const double e[4] = {1, 0, 0, 0}, q[4] = {0, 0, 1, 0};
    mae.Add(e, q, 1, 0.0);
    EXPECT_NEAR(mae.Mean(), sin_mean, 1e-12);
    // Averaged with a zero-error pair: half.
    mae.AddExact(1);
    EXPECT_NEAR(mae.Mean(), sin_mean / 2, 1e-12);
  }
}

// The accumulator (cos/sin tables, pair sums) against RoPE undone on q and e and R_Δ applied
// term by term; and, RoPE rotations commuting, against the post-RoPE rows turned by Δ directly.
TEST(RopeLogit, AccumulatorMatchesTheDirectComputation) {
  const int d = 128, g = 3;
  const double base = 1e6, position = 1234.0;
  std::mt19937 rng(7);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> e(d), q(static_cast<size_t>(g) * d);
  for (double& v : e) v = 0.05 * n(rng);
  for (double& v : q) v = 3.0 * n(rng);
  RopeLogitMae mae(d, base);
  mae.Add(e.data(), q.data(), g, position);

  std::vector<double> e_pre = e;
  UndoRope(e_pre.data(), d, base, position);
  double undone = 0, post = 0;
  for (int j = 0; j < g; ++j) {
    std::vector<double> q_pre(q.begin() + j * d, q.begin() + (j + 1) * d);
    UndoRope(q_pre.data(), d, base, position);
    for (double delta : RopeLogitOffsets()) {
      undone += std::fabs(RotatedLogit(q_pre.data(), e_pre.data(), d, base, delta));
      post += std::fabs(RotatedLogit(q.data() + j * d, e.data(), d, base, delta));
    }
  }
  const double terms = g * 50.0;
  EXPECT_EQ(mae.terms(), g * 50);
  EXPECT_GT(mae.Mean(), 0.0);
  EXPECT_NEAR(mae.Mean(), undone / terms, 1e-12 * undone / terms);
  EXPECT_NEAR(mae.Mean(), post / terms, 1e-9 * post / terms);
}

TEST(RopeLogit, RefusesWhatCannotUndoRope) {
  ExpectError([] { RopeLogitMae(64, 0.0); }, ErrorCode::kInvalidArgument, "rope_base 0");
  ExpectError([] { RopeLogitMae(64, -10.0); }, ErrorCode::kInvalidArgument, "rope_base -10");
  ExpectError([] { RopeLogitMae(64, std::numeric_limits<double>::quiet_NaN()); },
              ErrorCode::kInvalidArgument, "rope_base nan");
  ExpectError([] { RopeLogitMae(63, 1e4); }, ErrorCode::kInvalidArgument, "head_dim 63");
  ExpectError([] { RopeLogitMae(64, 1e4, {}); }, ErrorCode::kInvalidArgument, "no offset");
  double x[4] = {1, 2, 3, 4};
  ExpectError([&] { UndoRope(x, 4, 0.0, 1.0); }, ErrorCode::kInvalidArgument, "rope_base 0");
}

}  // namespace
}  // namespace kvq::calib
