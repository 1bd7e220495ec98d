// Internal to kvq_cpu_ref: how the backend list is assembled from the implementation files,
// and the few constants every implementation of the write path shares.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::internal {

// The scalar executable spec (write_scalar.cc).
WriteKernels ScalarWriteKernels();

// One Backend per Highway target compiled into write_hwy.cc and supported by this CPU, best
// first (write_hwy.cc). Built once; never empty (the portable target, HWY_SCALAR with GCC 12 or EMU128
// elsewhere, is always compiled and supported).
const std::vector<Backend>& HwyBackends();

// log2 of a power of two.
inline int Log2(int power_of_two) {
  int log = 0;
  while ((1 << log) < power_of_two) ++log;
  return log;
}

// beta(j): the low `bits` bits of j in reverse order (an involution).
inline uint32_t BitReverse(uint32_t j, int bits) {
  uint32_t reversed = 0;
  for (int b = 0; b < bits; ++b) reversed |= ((j >> b) & 1u) << (bits - 1 - b);
  return reversed;
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

// The FWHT normaliser: 1/sqrt(block) computed in double and rounded once to fp32.
inline float FwhtScale(int block) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
}

// k = min(floor(rho*d), d-1) with rho*d computed in double: the 0-based ascending rank of the
// clip threshold among the d magnitudes of a row.
inline size_t ClipRank(float rho, int d) {
  const double position = std::floor(static_cast<double>(rho) * static_cast<double>(d));
  const size_t k = static_cast<size_t>(position);
  return k < static_cast<size_t>(d - 1) ? k : static_cast<size_t>(d - 1);
}

}  // namespace kvq::cpu::internal
