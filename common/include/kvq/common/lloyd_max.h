// fp64 Lloyd–Max scalar quantizers for one coordinate of a randomly rotated unit vector: the
// generator of the codebook tables (tables.inc: CodebookBeta, CodebookGaussian; the accessor
// kvq::tables::Codebook) and the exact quantizer MSE the tests and docs quote.
//
// Densities of y, one coordinate of a uniform unit vector in R^m (TurboQuant's definition):
//   kBeta      f(y) ∝ (1 − y²)^((m−3)/2) on [−1, 1], m >= 2 (m = 2: the arcsine law, infinite
//              at ±1). Integrated in θ with y = sin θ, where the weight is cos^(m−2) θ: smooth
//              for every m, so no endpoint singularity is left.
//   kGaussian  N(0, 1/m), m >= 1 (the limit for large m; what the authors' code uses).
//              Integrated in z = y·√m over [−40, 40] (exp(−z²/2) is 0 in fp64 beyond 38.6).
// docs/numerics.md ("Codebook tables") describes the solver and its stopping rule.
#pragma once

#include <string>
#include <vector>

namespace kvq {

enum class CodebookDensity { kBeta, kGaussian };

// "beta" or "gaussian".
const char* CodebookDensityName(CodebookDensity density);
// The density named `name`; kvq::Error(kInvalidArgument) naming it otherwise.
CodebookDensity ParseCodebookDensity(const std::string& name);

// One width's Lloyd–Max quantizer in fp64. Only the positive half is solved: the quantizer is
// symmetric by construction (centroids −c mirrored, a boundary at 0), so antisymmetry is exact.
struct LloydMaxHalf {
  std::vector<double> centroids;  // 2^(bits−1) values, ascending, in (0, y_max)
  int newton_steps = 0;           // accepted Newton steps at this width
  double residual = 0;            // max_i |T_i(c) − c_i| at the returned centroids (fp64)
};

// Widths 1..max_bits (1..8) for one density and m (kBeta: m >= 2; kGaussian: m >= 1); element
// b−1 is width b. Width 1 is the conditional mean of the positive half; width b > 1 starts
// from width b−1's cells split at their centroids (the conditional means of the two halves)
// and runs damped Newton on the fixed-point residual R(c) = T(c) − c, T the Lloyd map
// (cell boundaries at the midpoints of adjacent centroids, centroids to the cells' conditional
// means; its Jacobian is tridiagonal). Each step is halved until max |R| decreases (at most 30
// times) and keeps the centroids increasing inside (0, y_max); the first step that no halving
// makes decrease max |R| ends the width: the fp64 noise floor of T. Deterministic: the same
// binary and libm give the same bits. Throws kInvalidArgument for m or max_bits out of range,
// kUnsupported if a width takes more than 50 steps.
std::vector<LloydMaxHalf> SolveLloydMax(CodebookDensity density, int m, int max_bits);

// m · E[(y − q(y))²] for y distributed as `density` at m, with q the quantizer of the 2^bits
// ascending centroids and 2^bits − 1 ascending boundaries given (y in the cell between
// consecutive boundaries maps to its centroid). For kBeta this is E‖u − û‖² for a uniform unit
// vector u in R^m quantized coordinate-wise after a rotation (TurboQuant's D_mse). Integrated by
// the same fp64 quadrature as the solver (relative error ~1e-15). Throws kInvalidArgument for
// m or bits out of range (as SolveLloydMax).
double QuantizerMse(CodebookDensity density, int m, int bits, const float* centroids,
                    const float* boundaries);

}  // namespace kvq
