#include "kvq/common/orthogonality.h"

#include <algorithm>
#include <cmath>

#include "kvq/common/error.h"

namespace kvq {

double OrthogonalityError(const float* m, int d) {
  double worst = 0.0;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j <= i; ++j) {
      double dot = 0.0;
      for (int r = 0; r < d; ++r) {
        dot += static_cast<double>(m[r * d + i]) * static_cast<double>(m[r * d + j]);
      }
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

void CheckOrthogonal(const float* m, int d, const std::string& what) {
  const double deviation = OrthogonalityError(m, d);
  KVQ_CHECK(deviation <= kOrthogonalityTolerance, kInvalidArgument, what,
            " is not orthogonal: max |RᵀR − I| = ", deviation, " (tolerance ",
            kOrthogonalityTolerance, ")");
}

}  // namespace kvq
