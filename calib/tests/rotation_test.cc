// Eigenbases, the sign rule, H, P_br and R = U·H·P_br (seeds/000 §3, A.4; spec/numerics.md §9).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>

#include "kvq/calib/covariance.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

// Eigenvalues 5 (e2), 3 ((e0+e1)/√2), 1 ((e0−e1)/√2), −1 (e3), by construction.
MatrixXd HandMadeMatrix() {
  MatrixXd c(4, 4);
  c << 2, 1, 0, 0,
       1, 2, 0, 0,
       0, 0, 5, 0,
       0, 0, 0, -1;
  return c;
}

TEST(SortedEigenBasis, DescendingOrderAndSignRuleOnHandMadeMatrix) {
  const EigenBasis e = SortedEigenBasis(HandMadeMatrix());
  ASSERT_EQ(e.values.size(), 4);
  const double expected_values[] = {5, 3, 1, -1};
  const double r = 1.0 / std::sqrt(2.0);
  // Column k is the k-th eigenvector. (e0−e1)/√2 has a tie in |component|: the lowest index
  // (component 0) is made positive.
  const double expected_vectors[4][4] = {{0, 0, 1, 0}, {r, r, 0, 0}, {r, -r, 0, 0}, {0, 0, 0, 1}};
  for (int k = 0; k < 4; ++k) {
    EXPECT_NEAR(e.values(k), expected_values[k], 1e-12) << "eigenvalue " << k;
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(e.vectors(i, k), expected_vectors[k][i], 1e-12)
          << "eigenvector " << k << " component " << i;
    }
  }
}

TEST(SortedEigenBasis, SignRuleMakesLargestComponentPositive) {
  MatrixXd basis(3, 2);
  basis << 0.1, -0.5,
           -0.9, 0.5,   // column 1 ties between rows 0 and 1: row 0 wins and becomes positive
           0.2, 0.1;
  ApplySignRule(basis);
  EXPECT_EQ(basis(1, 0), 0.9);
  EXPECT_EQ(basis(0, 0), -0.1);
  EXPECT_EQ(basis(0, 1), 0.5);
  EXPECT_EQ(basis(1, 1), -0.5);
  // The sign rule is idempotent and undoes any sign flip of a column.
  MatrixXd flipped = -basis;
  ApplySignRule(flipped);
  EXPECT_EQ(flipped, basis);
}

TEST(SortedEigenBasis, DampingShiftsEigenvaluesAndKeepsVectors) {
  const MatrixXd c = HandMadeMatrix();
  const EigenBasis plain = SortedEigenBasis(c);
  const EigenBasis damped = SortedEigenBasis(c, 0.5);
  const double shift = 0.5 * c.diagonal().mean();  // α·mean(diag) = 0.5·2
  for (int k = 0; k < 4; ++k) {
    EXPECT_NEAR(damped.values(k), plain.values(k) + shift, 1e-12);
    EXPECT_LT((damped.vectors.col(k) - plain.vectors.col(k)).norm(), 1e-12);
  }
}

TEST(SortedEigenBasis, RejectsBadInput) {
  MatrixXd asymmetric = HandMadeMatrix();
  asymmetric(0, 1) = 1.5;
  EXPECT_THROW(SortedEigenBasis(asymmetric), Error);
  MatrixXd nan = HandMadeMatrix();
  nan(2, 2) = std::nan("");
  EXPECT_THROW(SortedEigenBasis(nan), Error);
  EXPECT_THROW(SortedEigenBasis(MatrixXd::Zero(3, 4)), Error);
  EXPECT_THROW(SortedEigenBasis(HandMadeMatrix(), -1.0), Error);
}

TEST(Hadamard, SylvesterOrderAndOrthonormal) {
  const MatrixXd h = HadamardMatrix(8);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      const double expected = ((__builtin_popcount(i & j) & 1) ? -1.0 : 1.0) / std::sqrt(8.0);
      EXPECT_EQ(h(i, j), expected);
    }
  }
  EXPECT_LT((h.transpose() * h - MatrixXd::Identity(8, 8)).cwiseAbs().maxCoeff(), 1e-15);
  EXPECT_THROW(HadamardMatrix(12), Error);
}

TEST(BitReversal, MatchesPaperPlacementAndIsAnInvolution) {
  // seeds/000 A.4, d = 128: top-1 ↦ 0, top-2 ↦ 64, top-3 ↦ 32, top-4 ↦ 96, top-5..8 ↦ 16, 80,
  // 48, 112.
  const int expected[] = {0, 64, 32, 96, 16, 80, 48, 112};
  for (int k = 0; k < 8; ++k) EXPECT_EQ(BitReverse(k, 128), expected[k]) << "k = " << k;
  for (int j = 0; j < 128; ++j) EXPECT_EQ(BitReverse(BitReverse(j, 128), 128), j);
  const MatrixXd p = BitReversalMatrix(128);
  VectorXd x(128);
  for (int i = 0; i < 128; ++i) x(i) = i * 1.5 - 7;
  const Eigen::RowVectorXd y = x.transpose() * p;
  for (int j = 0; j < 128; ++j) EXPECT_EQ(y(j), x(BitReverse(j, 128))) << "j = " << j;
}

// A realistic target: C_Q of one KV head of a small synthetic capture.
MatrixXd SyntheticQueryCovariance() {
  const Activations acts = Synthesize(testing::SynthShape(1, 8, 2, 128, 512, 0));
  return QueryCovariance(acts, 0, 1, acts.info.calib_tokens);
}

// Bits of the plain fp64 product U·H (k ascending) moved by P_br, rounded once to fp32.
std::vector<float> ReferenceRotation(const MatrixXd& u) {
  const int d = static_cast<int>(u.rows());
  const MatrixXd h = HadamardMatrix(d);
  const MatrixXd p = BitReversalMatrix(d);
  MatrixXd uh(d, d), uhp(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int k = 0; k < d; ++k) acc += u(i, k) * h(k, j);
      uh(i, j) = acc;
    }
  }
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int k = 0; k < d; ++k) acc += uh(i, k) * p(k, j);  // one nonzero term: exact
      uhp(i, j) = acc;
    }
  }
  std::vector<float> out(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) out[static_cast<size_t>(i) * d + j] = static_cast<float>(uhp(i, j));
  }
  return out;
}

TEST(OscarRotation, OrthogonalAndEqualToRoundedProduct) {
  const EigenBasis e = SortedEigenBasis(SyntheticQueryCovariance());
  const std::vector<float> r = ToRowMajorF32(OscarRotation(e.vectors));
  const std::vector<float> reference = ReferenceRotation(e.vectors);
  for (size_t i = 0; i < r.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &r[i], 4);
    std::memcpy(&b, &reference[i], 4);
    ASSERT_EQ(a, b) << "R[" << i / 128 << "][" << i % 128 << "] = " << r[i] << " vs "
                    << reference[i];
  }
  const MatrixXd rd = FromRowMajorF32(r.data(), 128, 128);
  const double deviation = (rd.transpose() * rd - MatrixXd::Identity(128, 128)).cwiseAbs().maxCoeff();
  EXPECT_LT(deviation, 1e-6);
  // The same product through Eigen's GEMM differs by at most one fp32 ulp anywhere.
  const MatrixXd eigen_product = e.vectors * HadamardMatrix(128) * BitReversalMatrix(128);
  EXPECT_LT((eigen_product - rd).cwiseAbs().maxCoeff(), 1e-7);
}

// Lemma 1 of seeds/000: diag(Rᵀ C_Q R) = tr(C_Q)/d for R = U·H·P_br; not for H alone.
TEST(OscarRotation, Lemma1EqualisesTheImportanceDiagonal) {
  const MatrixXd cq = SyntheticQueryCovariance();
  const EigenBasis e = SortedEigenBasis(cq);
  const std::vector<float> r = ToRowMajorF32(OscarRotation(e.vectors));
  const MatrixXd rd = FromRowMajorF32(r.data(), 128, 128);
  const VectorXd diag = (rd.transpose() * cq * rd).diagonal();
  EXPECT_NEAR(diag.mean(), cq.trace() / 128, 1e-6 * cq.trace());
  EXPECT_LE(diag.maxCoeff() / diag.mean(), 1.0 + 1e-5);
  EXPECT_GE(diag.minCoeff() / diag.mean(), 1.0 - 1e-5);

  const MatrixXd h = HadamardMatrix(128);
  const VectorXd hadamard_diag = (h.transpose() * cq * h).diagonal();
  std::printf("[ lemma 1  ] OSCAR max/mean %.7f, pure Hadamard max/mean %.3f\n",
              diag.maxCoeff() / diag.mean(), hadamard_diag.maxCoeff() / hadamard_diag.mean());
  EXPECT_GT(hadamard_diag.maxCoeff() / hadamard_diag.mean(), 1.2);
}

// With G < d, the top d/G eigenvectors land in distinct groups of U·P_br, and R = U·H·P_br
// takes column j from column β(j) of U·H.
TEST(OscarRotation, BitReversalPutsTopEigenvectorsInDistinctGroups) {
  const EigenBasis e = SortedEigenBasis(SyntheticQueryCovariance());
  const MatrixXd up = BasisBitReversal(e.vectors);
  for (int group : {32, 64}) {
    std::set<int> groups;
    for (int k = 0; k < 128 / group; ++k) {
      int column = -1;
      for (int j = 0; j < 128; ++j) {
        if (up.col(j) == e.vectors.col(k)) column = j;
      }
      ASSERT_GE(column, 0) << "eigenvector " << k << " not found in U·P_br";
      groups.insert(column / group);
    }
    EXPECT_EQ(static_cast<int>(groups.size()), 128 / group) << "G = " << group;
  }
  const MatrixXd uh = BasisHadamard(e.vectors);
  const MatrixXd r = OscarRotation(e.vectors);
  for (int j = 0; j < 128; ++j) EXPECT_EQ(r.col(j), uh.col(BitReverse(j, 128))) << "j = " << j;
}

TEST(AblationBases, AreOrthogonal) {
  const EigenBasis e = SortedEigenBasis(SyntheticQueryCovariance());
  const MatrixXd id = MatrixXd::Identity(128, 128);
  for (const MatrixXd& m : {BasisHadamard(e.vectors), BasisBitReversal(e.vectors),
                            HadamardBitReversal(128), RandomOrthogonal(128, 5)}) {
    EXPECT_LT((m.transpose() * m - id).cwiseAbs().maxCoeff(), 1e-12);
  }
}

TEST(RandomOrthogonal, SeededAndDeterministic) {
  const MatrixXd a = RandomOrthogonal(64, 11);
  const MatrixXd b = RandomOrthogonal(64, 11);
  const MatrixXd c = RandomOrthogonal(64, 12);
  EXPECT_EQ(a, b);
  EXPECT_GT((a - c).cwiseAbs().maxCoeff(), 0.1);
  // Haar-like: entries spread around 1/√d, not concentrated on a few.
  EXPECT_LT(a.cwiseAbs().maxCoeff(), 0.7);
}

}  // namespace
}  // namespace kvq::calib
