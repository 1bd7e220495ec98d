// Shared by the write-path tests: row generators (seeded random distributions and the edge
// rows the spec has to get right) and bitwise comparisons that name seed, row and column.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::testing {

inline std::vector<std::string> BackendNames(bool include_scalar) {
  std::vector<std::string> names;
  for (const Backend& backend : Backends()) {
    if (include_scalar || backend.hwy_target != 0) names.push_back(backend.name);
  }
  return names;
}

inline std::string ParamName(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

inline std::string Hex(uint32_t bits) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(8) << std::setfill('0') << bits;
  return os.str();
}

inline std::string Describe(float v) {
  std::ostringstream os;
  os << std::setprecision(9) << v << " (" << Hex(F32Bits(v)) << ")";
  return os.str();
}

// Bitwise equality of [rows, cols] buffers; reports up to 5 mismatches with their position.
template <typename T>
::testing::AssertionResult SameBits(const std::vector<T>& want, const std::vector<T>& got,
                                    size_t cols, const std::string& context) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure() << context << ": sizes " << want.size() << " vs "
                                         << got.size();
  }
  if (std::memcmp(want.data(), got.data(), want.size() * sizeof(T)) == 0) {
    return ::testing::AssertionSuccess();
  }
  auto failure = ::testing::AssertionFailure();
  failure << context << ": bits differ";
  int shown = 0;
  for (size_t i = 0; i < want.size() && shown < 5; ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) == 0) continue;
    failure << "\n  row " << i / cols << " column " << i % cols << ": scalar ";
    if constexpr (std::is_same_v<T, float>) {
      failure << Describe(want[i]) << " backend " << Describe(got[i]);
    } else {
      failure << +want[i] << " backend " << +got[i];
    }
    ++shown;
  }
  return failure;
}

// Seeded random rows of several distributions, each row one distribution.
enum class Distribution {
  kUniform,      // U(-1, 1)
  kNormal,       // N(0, 1) * 3
  kHeavyTailed,  // Cauchy-like: normal / |uniform|^0.8, capped at 1e6
  kOutliers,     // N(0, 1) with ~3% entries x 100
  kBf16Normal,   // N(0, 4) rounded to bf16, as K/V rows arrive (many exact ties)
  kLargeScale,   // N(0, 1) * 1e20
  kTinyScale,    // N(0, 1) * 1e-30
  kSubnormal,    // U(-1, 1) * 1e-39: subnormal
  kSmallInteger, // integers in [-4, 4] (equal magnitudes, zeros, ties everywhere)
  kCount
};

inline const char* DistributionName(Distribution dist) {
  switch (dist) {
    case Distribution::kUniform: return "uniform";
    case Distribution::kNormal: return "normal";
    case Distribution::kHeavyTailed: return "heavy-tailed";
    case Distribution::kOutliers: return "outliers";
    case Distribution::kBf16Normal: return "bf16-normal";
    case Distribution::kLargeScale: return "large-scale";
    case Distribution::kTinyScale: return "tiny-scale";
    case Distribution::kSubnormal: return "subnormal";
    case Distribution::kSmallInteger: return "small-integer";
    case Distribution::kCount: break;
  }
  return "?";
}

inline void FillRow(Distribution dist, std::mt19937_64& rng, float* row, size_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t j = 0; j < d; ++j) {
    float v = 0.0f;
    switch (dist) {
      case Distribution::kUniform: v = uniform(rng); break;
      case Distribution::kNormal: v = 3.0f * normal(rng); break;
      case Distribution::kHeavyTailed: {
        const float u = std::fabs(uniform(rng)) + 1e-6f;
        v = std::fmin(std::fmax(normal(rng) / std::pow(u, 0.8f), -1e6f), 1e6f);
        break;
      }
      case Distribution::kOutliers:
        v = normal(rng);
        if (rng() % 32 == 0) v *= 100.0f;
        break;
      case Distribution::kBf16Normal: v = RoundToBf16(4.0f * normal(rng)); break;
      case Distribution::kLargeScale: v = 1e20f * normal(rng); break;
      case Distribution::kTinyScale: v = 1e-30f * normal(rng); break;
      case Distribution::kSubnormal: v = 1e-39f * uniform(rng); break;
      case Distribution::kSmallInteger: v = static_cast<float>(static_cast<int>(rng() % 9) - 4); break;
      case Distribution::kCount: break;
    }
    row[j] = v;
  }
}

// Rows whose bits the spec pins down in corner cases, for head_dim d; `p` shapes the rows
// that target the quantizer (group size, levels) and the clip (rank k).
inline std::vector<float> EdgeRows(const WriteParams& p, uint64_t seed) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const float levels = static_cast<float>(p.levels());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows;
  auto add = [&](auto&& fill) {
    const size_t start = rows.size();
    rows.resize(start + d);
    for (size_t j = 0; j < d; ++j) rows[start + j] = fill(j);
  };
  add([](size_t) { return 0.0f; });
  add([](size_t) { return -0.0f; });
  add([](size_t j) { return (j % 3 == 0) ? -0.0f : 0.0f; });
  add([](size_t) { return 1.5f; });
  add([](size_t) { return -3.25f; });
  add([&](size_t j) { return j == 7 ? 1e30f : normal(rng); });            // one huge outlier
  add([&](size_t j) { return j == d - 1 ? -4e4f : normal(rng); });
  add([&](size_t) { return 1e-40f * normal(rng); });                       // subnormals
  add([&](size_t j) { return (j % 4 == 0) ? -0.0f : 1e-44f * static_cast<float>(j % 7); });
  add([](size_t j) { return j == 0 ? 1.17549435e-38f : 1.4e-45f; });      // min normal, min sub
  // Ties: per group lo = m, hi = m + L*s, the rest at m + (k + 0.5)*s for random k < L, with
  // m and s exactly representable in bf16 so that (x - m̂)/ŝ is exactly k + 0.5.
  {
    const float m = -2.0f;
    const float s = (p.bits == 2) ? 0.25f : 0.375f;
    add([&](size_t j) {
      const size_t in_group = j % group;
      if (in_group == 0) return m;
      if (in_group == 1) return m + levels * s;
      const float k = static_cast<float>(rng() % static_cast<unsigned>(p.levels()));
      return m + (k + 0.5f) * s;
    });
    add([&](size_t j) {  // the same ties around zero, and at magnitude 2^20
      const size_t in_group = j % group;
      const float base = (j / group) % 2 == 0 ? 0.0f : 1048576.0f;
      if (in_group == 0) return base;
      if (in_group == 1) return base + levels * 4.0f;
      const float k = static_cast<float>(rng() % static_cast<unsigned>(p.levels()));
      return base + (k + 0.5f) * 4.0f;
    });
  }
  // A large minimum with a tiny range: m̂ = bf16(lo) differs from lo by several ŝ.
  add([&](size_t j) { return 1001.0f + static_cast<float>(j % 3) * 0.5f; });
  add([&](size_t j) { return -8.0e37f + static_cast<float>(j % 5) * 2.0e37f; });  // near 2^126
  // Many equal magnitudes straddling the clip rank, with both signs of the threshold.
  add([&](size_t j) { return (j % 2 == 0 ? 1.0f : -1.0f) * (j % 3 == 0 ? 0.5f : 1.0f); });
  add([&](size_t j) {
    if (j < d / 8) return 0.25f * normal(rng);
    if (j > d - d / 16) return 8.0f * normal(rng);
    return (rng() % 2 == 0) ? 2.0f : -2.0f;
  });
  add([&](size_t j) { return static_cast<float>(j % 2 == 0 ? 1 : -1) * static_cast<float>(j / 2); });
  return rows;
}

// Write parameters of head_dim `d`, group `group` and `bits` bits; every other field keeps its
// default (identity rotation, clip 1, no bit reversal).
inline WriteParams ShapeParams(int d, int group, int bits) {
  WriteParams p;
  p.head_dim = d;
  p.group = group;
  p.bits = bits;
  return p;
}

// A dense d x d matrix of N(0, 1/d) entries, with a few exact zeros and negative zeros.
inline std::vector<float> RandomMatrix(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
  std::vector<float> r(static_cast<size_t>(d) * d);
  for (size_t i = 0; i < r.size(); ++i) {
    r[i] = normal(rng);
    if (rng() % 64 == 0) r[i] = (rng() % 2 == 0) ? 0.0f : -0.0f;
  }
  return r;
}

}  // namespace kvq::cpu::testing
