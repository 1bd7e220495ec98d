// Eigenbases and the OSCAR rotation R = U·H·P_br (seeds/000 §3, appendix A.4), in fp64, plus
// the ablation bases of seeds/000 table 4. Row-vector convention: x~ = x·R, so a basis is a
// d×d matrix whose COLUMNS are the directions. Matrices are Eigen fp64, column vectors as
// columns; the calibration file stores them row-major fp32 (spec/numerics.md §9).
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <vector>

namespace kvq::calib {

using MatrixXd = Eigen::MatrixXd;
using VectorXd = Eigen::VectorXd;

struct EigenBasis {
  MatrixXd vectors;  // [d, d], column k = eigenvector k
  VectorXd values;   // [d], descending
};

// Eigendecomposition of a symmetric d×d fp64 matrix (Eigen's SelfAdjointEigenSolver) with
// eigenvalues sorted descending (equal eigenvalues keep the solver's relative order, reversed)
// and each eigenvector's largest-|component| made positive (ties: the lowest index).
// `damping` α ≥ 0 adds α·mean(diag(C))·I first (same eigenvectors, eigenvalues shifted).
// Throws kvq::Error: not square (kShapeMismatch), non-finite entries (kNonFinite), not
// symmetric to 1e-9 relative (kInvalidArgument), negative or non-finite α, solver failure.
EigenBasis SortedEigenBasis(const MatrixXd& covariance, double damping = 0.0);

// The sign rule alone, in place on each column.
void ApplySignRule(MatrixXd& basis);

// Normalised Sylvester Hadamard H[i][j] = (−1)^popcount(i&j) / √d. d a power of two ≥ 1.
MatrixXd HadamardMatrix(int d);

// β(j): the low log2(d) bits of j reversed. d a power of two.
int BitReverse(int j, int d);

// P_br as a matrix with (x·P_br)[j] = x[β(j)], i.e. P[β(j)][j] = 1.
MatrixXd BitReversalMatrix(int d);

// R = U·H·P_br in fp64: column j of R is column β(j) of U·H. U [d, d], d a power of two.
MatrixXd OscarRotation(const MatrixXd& basis);

// The ablations of seeds/000 table 4, each d×d orthogonal (fp64):
MatrixXd BasisHadamard(const MatrixXd& basis);   // U·H (no bit reversal)
MatrixXd BasisBitReversal(const MatrixXd& basis);  // U·P_br (no Hadamard)
MatrixXd HadamardBitReversal(int d);              // H·P_br (no eigenbasis: QuaRot + P_br)
// A Haar-random orthogonal matrix from a seed: QR of a Gaussian matrix (our own generator),
// columns signed so that R's diagonal is positive. Same seed → same matrix on any machine.
MatrixXd RandomOrthogonal(int d, uint64_t seed);

// Row-major fp32 copy (each entry rounded once to nearest), the layout the write path takes.
std::vector<float> ToRowMajorF32(const MatrixXd& m);
MatrixXd FromRowMajorF32(const float* values, int rows, int cols);

}  // namespace kvq::calib
