// Orthogonality of a dense rotation: every consumer of a user's R (kvq quantize, dequantize,
// rotate, attend, the calibration file) holds it to the same rule, so a matrix that is not a
// rotation never reaches the write path silently.
#pragma once

#include <string>

namespace kvq {

// The calibration's tolerance on max |MᵀM − I| (fp64), spec/formats.md §5.
inline constexpr double kOrthogonalityTolerance = 1e-4;

// max over (i, j) of |(MᵀM)[i][j] − δ_ij| for M [d, d] fp32 row-major, in fp64.
double OrthogonalityError(const float* m, int d);

// Throws kvq::Error(kInvalidArgument) naming `what` and the deviation when
// OrthogonalityError(m, d) > kOrthogonalityTolerance.
void CheckOrthogonal(const float* m, int d, const std::string& what);

}  // namespace kvq
