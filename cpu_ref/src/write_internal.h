// Internal to kvq_cpu_ref: how the backend list is assembled from the implementation files,
// and the few constants every implementation of the write path shares.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::internal {

// The scalar executable spec (write_scalar.cc).
WriteKernels ScalarWriteKernels();

// The Highway targets whose write-path tables registered themselves (write_hwy.cc,
// hwy_targets.h): every target write_hwy.cc was compiled for.
std::vector<int64_t> HwyWriteTargets();
// The write-path table of one of those targets. Throws kvq::Error(kUnsupported) for a target
// that was not compiled.
WriteKernels HwyWriteKernels(int64_t hwy_target);

// The rotation stages of the write path without its validation (rotation(), P_br), for callers
// that validated already (the decode driver): y [n, d] = x·R then P_br; y may alias x.
void RotateRows(const Backend& backend, const WriteParams& p, const float* rotation,
                const float* x, float* y, size_t n);
// The inverse map y = x·P_brᵀ·Rᵀ given r_transposed = Rᵀ (dense only; else unused).
void RotateRowsInverse(const Backend& backend, const WriteParams& p, const float* r_transposed,
                       const float* x, float* y, size_t n);

// log2 of a power of two.
inline int Log2(int power_of_two) {
  int log = 0;
  while ((1 << log) < power_of_two) ++log;
  return log;
}

// beta(j) for j = 0..d-1, d = 64, 128 or 256, as int32 gather indices. Built once.
inline const int32_t* BitReverseTable(int d) {
  struct Tables {
    int32_t by_log2[9][256];
    Tables() {
      for (int log2_d = 0; log2_d <= 8; ++log2_d) {
        for (int j = 0; j < (1 << log2_d); ++j) {
          by_log2[log2_d][j] = static_cast<int32_t>(BitReverse(static_cast<uint32_t>(j), log2_d));
        }
      }
    }
  };
  static const Tables tables;
  return tables.by_log2[Log2(d)];
}

// k = min(floor(rho*d), d-1) with rho*d computed in double: the 0-based ascending rank of the
// clip threshold among the d magnitudes of a row.
inline size_t ClipRank(float rho, int d) {
  const double position = std::floor(static_cast<double>(rho) * static_cast<double>(d));
  const size_t k = static_cast<size_t>(position);
  return k < static_cast<size_t>(d - 1) ? k : static_cast<size_t>(d - 1);
}

}  // namespace kvq::cpu::internal
