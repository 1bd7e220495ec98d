#include "kvq/calib/rotation.h"

#include <cmath>

#include "kvq/calib/random.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"

namespace kvq::calib {
namespace {

bool IsPowerOfTwo(int d) { return d >= 1 && (d & (d - 1)) == 0; }

int Log2(int d) {
  int bits = 0;
  while ((1 << bits) < d) ++bits;
  return bits;
}

}  // namespace

void ApplySignRule(MatrixXd& basis) {
  for (Eigen::Index c = 0; c < basis.cols(); ++c) {
    Eigen::Index arg = 0;
    double best = -1.0;
    for (Eigen::Index r = 0; r < basis.rows(); ++r) {
      const double magnitude = std::fabs(basis(r, c));
      if (magnitude > best) {  // strict: a tie keeps the lowest index
        best = magnitude;
        arg = r;
      }
    }
    if (basis(arg, c) < 0) basis.col(c) = -basis.col(c);
  }
}

EigenBasis SortedEigenBasis(const MatrixXd& covariance, double damping) {
  KVQ_CHECK(covariance.rows() == covariance.cols() && covariance.rows() > 0, kShapeMismatch,
            "covariance must be square and non-empty, got ", covariance.rows(), "x",
            covariance.cols());
  KVQ_CHECK(std::isfinite(damping) && damping >= 0, kInvalidArgument, "damping ", damping,
            " must be finite and >= 0");
  const Eigen::Index d = covariance.rows();
  double scale = 0.0;
  for (Eigen::Index i = 0; i < d; ++i) {
    for (Eigen::Index j = 0; j < d; ++j) {
      KVQ_CHECK(std::isfinite(covariance(i, j)), kNonFinite, "covariance entry (", i, ", ", j,
                ") = ", covariance(i, j), " is not finite");
      scale = std::max(scale, std::fabs(covariance(i, j)));
    }
  }
  for (Eigen::Index i = 0; i < d; ++i) {
    for (Eigen::Index j = 0; j < i; ++j) {
      KVQ_CHECK(std::fabs(covariance(i, j) - covariance(j, i)) <= 1e-9 * scale, kInvalidArgument,
                "covariance is not symmetric: (", i, ", ", j, ") = ", covariance(i, j),
                " but (", j, ", ", i, ") = ", covariance(j, i));
    }
  }
  MatrixXd target = covariance;
  if (damping > 0) {
    const double shift = damping * covariance.diagonal().mean();
    target.diagonal().array() += shift;
  }
  Eigen::SelfAdjointEigenSolver<MatrixXd> solver(target, Eigen::ComputeEigenvectors);
  KVQ_CHECK(solver.info() == Eigen::Success, kInvalidArgument,
            "eigendecomposition did not converge (d = ", d, ")");
  EigenBasis result;
  result.values = solver.eigenvalues().reverse();        // Eigen sorts ascending
  result.vectors = solver.eigenvectors().rowwise().reverse();
  ApplySignRule(result.vectors);
  return result;
}

MatrixXd HadamardMatrix(int d) {
  KVQ_CHECK(IsPowerOfTwo(d), kInvalidArgument, "Hadamard size ", d, " is not a power of two");
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  MatrixXd h(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) h(i, j) = (__builtin_popcount(i & j) & 1) ? -scale : scale;
  }
  return h;
}

int BitReverse(int j, int d) {
  return static_cast<int>(kvq::BitReverse(static_cast<uint32_t>(j), Log2(d)));
}

MatrixXd BitReversalMatrix(int d) {
  KVQ_CHECK(IsPowerOfTwo(d), kInvalidArgument, "bit reversal size ", d, " is not a power of two");
  MatrixXd p = MatrixXd::Zero(d, d);
  for (int j = 0; j < d; ++j) p(BitReverse(j, d), j) = 1.0;
  return p;
}

MatrixXd BasisHadamard(const MatrixXd& basis) {
  KVQ_CHECK(basis.rows() == basis.cols(), kShapeMismatch, "basis must be square, got ",
            basis.rows(), "x", basis.cols());
  // Fixed summation order (k ascending, from +0), so the fp64 product and hence the rounded
  // fp32 R do not depend on Eigen's cache-size-dependent GEMM blocking.
  const int d = static_cast<int>(basis.cols());
  const MatrixXd h = HadamardMatrix(d);
  MatrixXd product(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int k = 0; k < d; ++k) acc += basis(i, k) * h(k, j);
      product(i, j) = acc;
    }
  }
  return product;
}

MatrixXd BasisBitReversal(const MatrixXd& basis) {
  KVQ_CHECK(basis.rows() == basis.cols(), kShapeMismatch, "basis must be square, got ",
            basis.rows(), "x", basis.cols());
  // Multiplying by P_br only moves columns (column j of U·P_br is column β(j) of U): exact.
  const int d = static_cast<int>(basis.cols());
  KVQ_CHECK(IsPowerOfTwo(d), kInvalidArgument, "bit reversal size ", d, " is not a power of two");
  MatrixXd permuted(d, d);
  for (int j = 0; j < d; ++j) permuted.col(j) = basis.col(BitReverse(j, d));
  return permuted;
}

MatrixXd OscarRotation(const MatrixXd& basis) {
  return BasisBitReversal(BasisHadamard(basis));
}

MatrixXd HadamardBitReversal(int d) { return BasisBitReversal(HadamardMatrix(d)); }

MatrixXd RandomOrthogonal(int d, uint64_t seed) {
  KVQ_CHECK(d >= 1, kInvalidArgument, "random orthogonal size ", d, " must be >= 1");
  Xoshiro256 rng(DeriveSeed(seed, {0x6f7274686fULL}));  // "ortho"
  MatrixXd gaussian(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) gaussian(i, j) = rng.Normal();
  }
  // Modified Gram–Schmidt, twice (our own loop, so the result does not depend on Eigen's
  // blocking): the Q factor with R's diagonal positive, which makes it Haar distributed.
  MatrixXd q = gaussian;
  for (int j = 0; j < d; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < j; ++i) {
        double dot = 0.0;
        for (int r = 0; r < d; ++r) dot += q(r, i) * q(r, j);
        for (int r = 0; r < d; ++r) q(r, j) -= dot * q(r, i);
      }
    }
    double norm2 = 0.0;
    for (int r = 0; r < d; ++r) norm2 += q(r, j) * q(r, j);
    const double inv = 1.0 / std::sqrt(norm2);
    for (int r = 0; r < d; ++r) q(r, j) *= inv;
  }
  return q;
}

std::vector<float> ToRowMajorF32(const MatrixXd& m) {
  std::vector<float> out(static_cast<size_t>(m.rows() * m.cols()));
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
      out[static_cast<size_t>(i * m.cols() + j)] = static_cast<float>(m(i, j));
    }
  }
  return out;
}

MatrixXd FromRowMajorF32(const float* values, int rows, int cols) {
  MatrixXd m(rows, cols);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) m(i, j) = values[static_cast<size_t>(i) * cols + j];
  }
  return m;
}

}  // namespace kvq::calib
