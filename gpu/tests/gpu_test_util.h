// What the gpu/ tests share beyond the testbed (kvq/testbed: rows, builders, seeded data, the
// bit comparator): device buffers, the skip without a device, the poison bytes, and the grid of
// the write tests (rotation variants, clip ratios, shapes).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/testbed/params.h"

namespace kvq::gpu::testing {

// Every test that touches the GPU starts with this: CI has nvcc but no device.
#define KVQ_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                       \
    if (!::kvq::gpu::HasCudaDevice()) GTEST_SKIP() << "no CUDA device";      \
  } while (0)

// An owning device buffer of T with host round trips (the library's DeviceArray).
template <typename T>
using DeviceBuffer = DeviceArray<T>;

// The two poison bytes every output is filled with before a run. Each byte value is a
// legitimate packed byte, so a run with each proves every byte was written.
inline constexpr uint8_t kPoisons[2] = {0x00, 0xFF};

// The rotation variants of the test grid.
struct RotationVariant {
  const char* name;
  RotationKind kind;
  int block_divisor;  // Hadamard block = d / block_divisor; 0: fixed block in `block`
  int block;
  bool bitrev;

  // Write params of head dimension d with this rotation (the caller adds group, bits, clip).
  testbed::Write Params(int d) const {
    const int h = kind != RotationKind::kHadamard ? 0 : (block_divisor != 0 ? d / block_divisor
                                                                            : block);
    return testbed::Write().head_dim(d).rotation(kind).hadamard_block(h).bitrev(bitrev);
  }
};

inline const std::vector<RotationVariant>& RotationVariants() {
  static const std::vector<RotationVariant> variants = {
      {"identity", RotationKind::kIdentity, 0, 0, false},
      {"identity_bitrev", RotationKind::kIdentity, 0, 0, true},
      {"dense", RotationKind::kDense, 0, 0, false},
      {"dense_bitrev", RotationKind::kDense, 0, 0, true},
      {"fwht", RotationKind::kHadamard, 0, 0, false},
      {"fwht_bitrev", RotationKind::kHadamard, 0, 0, true},
      {"fwht_block16", RotationKind::kHadamard, 0, 16, false},
      {"fwht_block32_bitrev", RotationKind::kHadamard, 0, 32, true},
      {"fwht_block_half", RotationKind::kHadamard, 2, 0, false},
  };
  return variants;
}

// Clip ratios that reach each selection path: no clip (max), the peeling path at its limit
// (12 above), the radix path just past it (13 above), the middle, and rank 0 (the minimum).
inline std::vector<float> ClipRatios(int d) {
  return {1.0f, 0.96f, (static_cast<float>(d) - 12.5f) / static_cast<float>(d),
          (static_cast<float>(d) - 13.5f) / static_cast<float>(d), 0.5f, 0.001f};
}

// (d, G) pairs of the grid: G = d at d = 256 too (spec 1.1, SAW-INT4's one pair a row).
struct Shape {
  int d;
  int group;
};
inline std::vector<Shape> Shapes() {
  return {{64, 32},  {64, 64},  {128, 32},  {128, 64},
          {128, 128}, {256, 32}, {256, 64}, {256, 128}, {256, 256}};
}

}  // namespace kvq::gpu::testing
