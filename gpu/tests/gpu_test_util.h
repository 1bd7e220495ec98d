// Shared helpers of the gpu/ tests: device buffers, row generators with the edge cases the
// spec's bits are most fragile on, and bitwise comparisons that name the first mismatch.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"

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

enum class RowKind {
  kNormal,            // N(0, 1)
  kZeros,             // all +0
  kNegativeZeros,     // all -0
  kMixedZeros,        // +0 and -0
  kConstant,          // one value repeated
  kOutliers,          // N(0, 1) with a few entries of magnitude up to 1e30
  kSubnormal,         // values in the fp32 subnormal range
  kTies,              // (identity rotation) codes exactly halfway: rint's half-to-even
  kEqualMagnitudes,   // most entries +-c: the clip order statistic falls in a run of ties
  kFewValues,         // entries from {-2, -1, 0, 1, 2}
  kWideRange,         // magnitudes spread over 1e-30 .. 1e30
  kOffset,            // a large common offset with a tiny spread: bf16(min) is steps off the min
  kCount,
};

inline const char* RowKindName(RowKind kind) {
  switch (kind) {
    case RowKind::kNormal: return "normal";
    case RowKind::kZeros: return "zeros";
    case RowKind::kNegativeZeros: return "negative_zeros";
    case RowKind::kMixedZeros: return "mixed_zeros";
    case RowKind::kConstant: return "constant";
    case RowKind::kOutliers: return "outliers";
    case RowKind::kSubnormal: return "subnormal";
    case RowKind::kTies: return "ties";
    case RowKind::kEqualMagnitudes: return "equal_magnitudes";
    case RowKind::kFewValues: return "few_values";
    case RowKind::kWideRange: return "wide_range";
    case RowKind::kOffset: return "offset";
    case RowKind::kCount: break;
  }
  return "unknown";
}

// One row of d values of the given kind. `group` and `levels` shape the tie rows: each group
// spans [0, L] exactly (s = 1) and its other entries sit on k + 0.5.
inline void FillRow(RowKind kind, float* row, int d, int group, int levels, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, d - 1);
  switch (kind) {
    case RowKind::kNormal:
      for (int j = 0; j < d; ++j) row[j] = normal(rng);
      break;
    case RowKind::kZeros:
      for (int j = 0; j < d; ++j) row[j] = 0.0f;
      break;
    case RowKind::kNegativeZeros:
      for (int j = 0; j < d; ++j) row[j] = -0.0f;
      break;
    case RowKind::kMixedZeros:
      for (int j = 0; j < d; ++j) row[j] = (rng() & 1u) ? 0.0f : -0.0f;
      break;
    case RowKind::kConstant: {
      const float c = normal(rng);
      for (int j = 0; j < d; ++j) row[j] = c;
      break;
    }
    case RowKind::kOutliers:
      for (int j = 0; j < d; ++j) row[j] = normal(rng);
      for (int k = 0; k < 3; ++k) {
        row[pick(rng)] = ((rng() & 1u) ? 1.0f : -1.0f) *
                         std::pow(10.0f, static_cast<float>(rng() % 31));
      }
      break;
    case RowKind::kSubnormal:
      for (int j = 0; j < d; ++j) {
        const uint32_t mantissa = rng() & 0x007fffffu;
        row[j] = F32FromBits(((rng() & 1u) << 31) | mantissa);
      }
      break;
    case RowKind::kTies:
      for (int g = 0; g < d / group; ++g) {
        float* x = row + g * group;
        x[0] = 0.0f;
        x[1] = static_cast<float>(levels);
        for (int j = 2; j < group; ++j) {
          x[j] = static_cast<float>(rng() % static_cast<uint32_t>(levels)) + 0.5f;
        }
      }
      break;
    case RowKind::kEqualMagnitudes: {
      const float c = std::fabs(normal(rng)) + 0.5f;
      for (int j = 0; j < d; ++j) {
        const uint32_t r = rng() % 10u;
        row[j] = r == 0 ? normal(rng) * 3.0f : ((r & 1u) ? c : -c);
      }
      break;
    }
    case RowKind::kFewValues:
      for (int j = 0; j < d; ++j) row[j] = static_cast<float>(static_cast<int>(rng() % 5u) - 2);
      break;
    case RowKind::kWideRange:
      for (int j = 0; j < d; ++j) {
        const float exponent = static_cast<float>(static_cast<int>(rng() % 61u) - 30);
        row[j] = ((rng() & 1u) ? 1.0f : -1.0f) * std::pow(10.0f, exponent) *
                 (1.0f + static_cast<float>(rng() % 1000u) / 1000.0f);
      }
      break;
    case RowKind::kOffset: {
      const float c = 1000.0f * normal(rng);
      for (int j = 0; j < d; ++j) row[j] = c + 1.0e-3f * normal(rng);
      break;
    }
    case RowKind::kCount:
      break;
  }
}

// n rows cycling through every RowKind (random rows fill the rest), as fp32.
inline std::vector<float> MixedRows(size_t n, int d, int group, int levels, std::mt19937& rng) {
  std::vector<float> rows(n * static_cast<size_t>(d));
  const int kinds = static_cast<int>(RowKind::kCount);
  for (size_t r = 0; r < n; ++r) {
    const RowKind kind = r < static_cast<size_t>(2 * kinds) ? static_cast<RowKind>(r % kinds)
                                                            : RowKind::kNormal;
    FillRow(kind, rows.data() + r * d, d, group, levels, rng);
  }
  return rows;
}

// Rounds fp32 rows to bf16 bits (RNE), and widens bf16 bits back to fp32 (exact).
inline std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = Bf16FromF32(x[i]);
  return out;
}
inline std::vector<float> FromBf16(const std::vector<uint16_t>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = F32FromBf16(x[i]);
  return out;
}

// A random d x d fp32 matrix per head, entries N(0, 1/d) (orthogonality is not needed for
// bit comparisons), with a few exact zeros.
inline std::vector<float> RandomRotations(int heads, int d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
  std::vector<float> r(static_cast<size_t>(heads) * d * d);
  for (float& v : r) v = (rng() % 97u == 0) ? 0.0f : normal(rng);
  return r;
}

inline uint32_t Bits(float f) { return F32Bits(f); }
inline uint32_t Bits(uint16_t v) { return v; }
inline uint32_t Bits(uint8_t v) { return v; }

template <typename T>
std::string ValueString(T v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, float>) {
    os.precision(9);
    os << v << " (0x" << std::hex << F32Bits(v) << ")";
  } else {
    os << "0x" << std::hex << static_cast<uint32_t>(v);
  }
  return os.str();
}

// Bitwise equality of two arrays of `row_len` elements per row; on failure names the array,
// row, column and both values, plus `context` (seed and parameters).
template <typename T>
::testing::AssertionResult BitsEqual(const std::vector<T>& expected, const std::vector<T>& actual,
                                     size_t row_len, const std::string& what,
                                     const std::string& context) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure() << what << ": sizes " << expected.size() << " vs "
                                         << actual.size() << " [" << context << "]";
  }
  size_t mismatches = 0;
  size_t first = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (Bits(expected[i]) != Bits(actual[i])) {
      if (mismatches == 0) first = i;
      ++mismatches;
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << mismatches << " of " << expected.size()
         << " elements differ; first at row " << first / row_len << ", column "
         << first % row_len << ": expected " << ValueString(expected[first]) << ", got "
         << ValueString(actual[first]) << " [" << context << "]";
}

inline std::string ParamsString(const WriteParams& p) {
  std::ostringstream os;
  os << "d=" << p.head_dim << " G=" << p.group << " b=" << p.bits
     << " rot=" << RotationKindName(p.rotation) << " block=" << p.fwht_block()
     << " bitrev=" << p.bitrev << " clip=" << p.clip;
  return os.str();
}

// The rotation variants of the test grid.
struct RotationVariant {
  const char* name;
  RotationKind kind;
  int block_divisor;  // Hadamard block = d / block_divisor; 0: fixed block in `block`
  int block;
  bool bitrev;
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

inline WriteParams MakeParams(int d, int group, int bits, const RotationVariant& v, float clip) {
  WriteParams p;
  p.head_dim = d;
  p.group = group;
  p.bits = bits;
  p.rotation = v.kind;
  p.bitrev = v.bitrev;
  p.clip = clip;
  if (v.kind == RotationKind::kHadamard) {
    p.hadamard_block = v.block_divisor != 0 ? d / v.block_divisor : v.block;
  }
  p.Validate();
  return p;
}

// Clip ratios that reach each selection path: no clip (max), the peeling path at its limit
// (12 above), the radix path just past it (13 above), the middle, and rank 0 (the minimum).
inline std::vector<float> ClipRatios(int d) {
  return {1.0f, 0.96f, (static_cast<float>(d) - 12.5f) / static_cast<float>(d),
          (static_cast<float>(d) - 13.5f) / static_cast<float>(d), 0.5f, 0.001f};
}

// (d, G) pairs of the grid.
struct Shape {
  int d;
  int group;
};
inline std::vector<Shape> Shapes() {
  return {{64, 32}, {64, 64}, {128, 32}, {128, 64}, {128, 128}, {256, 32}, {256, 64}, {256, 128}};
}

}  // namespace kvq::gpu::testing
