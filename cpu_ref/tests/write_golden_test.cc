// Hand-worked cases for each stage, run on every backend (the scalar reference included).
// Each expected value is derived in the comment next to it from the spec's rules, not from
// running the code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

class WriteGoldenTest : public ::testing::TestWithParam<const Backend*> {
 protected:
  const WriteKernels& k() const { return (*GetParam()).write; }
};

// ---------------------------------------------------------------- quantize

// d = G = 64, INT2. lo = -1.5 (channel 0), hi = 1.5 (channel 63): s = 3/3 = 1 exactly, so
// ŝ = 1.0 = bf16 0x3F80 and m̂ = -1.5 = bf16 0xBFC0 (sign 1, exponent 127, mantissa .1).
// q = rint(x + 1.5) clamped to [0, 3]:
//   -1.5 -> 0;  -1.25 -> rint(0.25) = 0;  -1.0 -> rint(0.5) = 0 (tie to even);
//   -0.5 -> 1;  0.0 -> rint(1.5) = 2 (tie to even);  0.25 -> rint(1.75) = 2;
//    0.5 -> 2;  1.0 -> rint(2.5) = 2 (tie to even);  1.5 -> 3;  0.1 -> rint(1.6) = 2.
TEST_P(WriteGoldenTest, QuantizeInt2KnownCodesAndTiesToEven) {
  const WriteParams p = testbed::Write().head_dim(64).group(64).bits(2).Build();
  std::vector<float> x(64, 0.1f);
  const float inputs[] = {-1.5f, -1.25f, -1.0f, -0.5f, 0.0f, 0.25f, 0.5f, 1.0f};
  const uint8_t expected[] = {0, 0, 0, 1, 2, 2, 2, 2};
  for (int i = 0; i < 8; ++i) x[i] = inputs[i];
  x[63] = 1.5f;
  std::vector<uint8_t> codes(64);
  uint16_t scale = 0, min = 0;
  k().quantize(x.data(), codes.data(), &scale, &min, 1, p);
  EXPECT_EQ(scale, 0x3F80);
  EXPECT_EQ(min, 0xBFC0);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(codes[i], expected[i]) << "channel " << i << " x " << x[i];
  for (int i = 8; i < 63; ++i) EXPECT_EQ(codes[i], 2) << "channel " << i;
  EXPECT_EQ(codes[63], 3);
}

// INT4, two groups of 32. Group 0: lo = 0, hi = 15 * 0.125 = 1.875: s = 0.125 = bf16 0x3E00,
// m̂ = +0 = 0x0000. x = (k + 0.5) * 0.125 lands on k + 0.5: rounds to the even neighbour.
// Group 1 is constant 5.0: s = 0 so ŝ = 0 and every code is 0; m̂ = bf16(5) = 0x40A0.
TEST_P(WriteGoldenTest, QuantizeInt4TiesAndConstantGroup) {
  const WriteParams p = testbed::Write().head_dim(64).group(32).bits(4).Build();
  std::vector<float> x(64, 5.0f);
  x[0] = 0.0f;
  x[1] = 1.875f;
  for (int i = 2; i < 32; ++i) x[i] = (static_cast<float>(i % 15) + 0.5f) * 0.125f;
  std::vector<uint8_t> codes(64);
  uint16_t scale[2], min[2];
  k().quantize(x.data(), codes.data(), scale, min, 1, p);
  EXPECT_EQ(scale[0], 0x3E00);
  EXPECT_EQ(min[0], 0x0000);
  EXPECT_EQ(scale[1], 0x0000);
  EXPECT_EQ(min[1], 0x40A0);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 15);
  for (int i = 2; i < 32; ++i) {
    const int kk = i % 15;
    EXPECT_EQ(codes[i], kk % 2 == 0 ? kk : kk + 1) << "channel " << i << " tie at " << kk << ".5";
  }
  for (int i = 32; i < 64; ++i) EXPECT_EQ(codes[i], 0) << "channel " << i;
}

// lo = 0, hi = 1, INT2: s = fp32(1/3) = 0x3EAAAAAB; its low half 0xAAAB > 0x8000 rounds the
// bf16 up: ŝ = 0x3EAB = 0.333984375 (> s). Codes: 1/ŝ = 2.994... -> 3; 0.5/ŝ = 1.497 -> 1;
// 0.6/ŝ = 1.796 -> 2; 0.16/ŝ = 0.479 -> 0; 0.17/ŝ = 0.509 -> 1. Codes are computed against
// what is stored (spec/differences.md, "quantizer metadata"): the authors' fp32 s and half-up
// rounding give 0.5/s + 0 + 0.5 = 2.0 -> 2 for x = 0.5, where kvq stores 1.
TEST_P(WriteGoldenTest, QuantizeScaleRoundedToBf16) {
  const WriteParams p = testbed::Write().head_dim(64).group(64).bits(2).Build();
  std::vector<float> x(64, 0.5f);
  x[0] = 0.0f;
  x[1] = 1.0f;
  x[2] = 0.6f;
  x[3] = 0.16f;
  x[4] = 0.17f;
  std::vector<uint8_t> codes(64);
  uint16_t scale = 0, min = 0;
  k().quantize(x.data(), codes.data(), &scale, &min, 1, p);
  EXPECT_EQ(scale, 0x3EAB);
  EXPECT_EQ(min, 0x0000);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 3);
  EXPECT_EQ(codes[2], 2);
  EXPECT_EQ(codes[3], 0);
  EXPECT_EQ(codes[4], 1);
  EXPECT_EQ(codes[5], 1);
}

// A group of negative zeros: lo = -0 + 0 = +0, so m̂ is +0 (0x0000), never 0x8000; s = 0.
TEST_P(WriteGoldenTest, QuantizeNegativeZeroGroupStoresPositiveZero) {
  const WriteParams p = testbed::Write().head_dim(64).group(32).bits(2).Build();
  std::vector<float> x(64, -0.0f);
  for (int i = 32; i < 64; i += 2) x[i] = 0.0f;  // group 1 mixes the two zeros
  std::vector<uint8_t> codes(64, 0xff);
  uint16_t scale[2], min[2];
  k().quantize(x.data(), codes.data(), scale, min, 1, p);
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(scale[g], 0x0000) << "group " << g;
    EXPECT_EQ(min[g], 0x0000) << "group " << g;
  }
  for (int i = 0; i < 64; ++i) EXPECT_EQ(codes[i], 0);
}

// The largest range the write path admits: lo = -2^125, hi = 2^125 (hi - lo = 2^126).
TEST_P(WriteGoldenTest, QuantizeLargeRange) {
  const WriteParams p = testbed::Write().head_dim(64).group(64).bits(2).Build();
  const float big = 4.2535296e37f;  // 2^125
  std::vector<float> x(64, 0.0f);
  x[0] = -big;
  x[1] = big;
  std::vector<uint8_t> codes(64);
  uint16_t scale = 0, min = 0;
  k().quantize(x.data(), codes.data(), &scale, &min, 1, p);
  // m̂ = -2^125: sign 1, exponent 125 + 127 = 252 = 0xFC, fraction 0: bits 0xFE00.
  EXPECT_EQ(min, 0xFE00);
  // s = 2^126/3 = 2^124 * 4/3 = 2^124 * 1.0101010...b: fp32 exponent 251 (0xFB), fraction
  // 0x2AAAAB (the bits after the 23rd, 1010..., round up): bits 0x7DAAAAAB. The dropped low
  // half 0xAAAB > 0x8000 rounds the bf16 up: ŝ = 0x7DAB = 2^124 * 1.3359375.
  EXPECT_EQ(scale, 0x7DAB);
  EXPECT_EQ(codes[0], 0);
  // (2^125 - m̂) / ŝ = 2^126 / ŝ = 4 / 1.3359375 = 2.994 -> 3.
  EXPECT_EQ(codes[1], 3);
  // (0 - m̂) / ŝ = 2^125 / ŝ = 2 / 1.3359375 = 1.497 -> 1.
  EXPECT_EQ(codes[2], 1);
}

// ---------------------------------------------------------------- spec/differences.md

// The spec's code of one element (spec/numerics.md §5 step 4): 0 when the stored scale is 0,
// else clamp(rint((x - mf) / sf), 0, L) with fp32 arithmetic and rint to nearest even.
uint8_t SpecCode(float x, uint16_t scale, uint16_t min, int levels) {
  const float sf = F32FromBf16(scale);
  if (sf == 0.0f) return 0;
  const float t = (x - F32FromBf16(min)) / sf;
  return static_cast<uint8_t>(std::nearbyint(std::clamp(t, 0.0f, static_cast<float>(levels))));
}

// spec/differences.md, "code clamp and packing". The authors' single-scale kernel (G = d) floors
// the scale at 1e-8 / 3 and neither clamps a code nor masks it when it packs. On the exactly
// constant row x = -2.14435 (measured on an H100) every code came out 8, and every byte
// 8 | 8 << 2 | 8 << 4 | 8 << 6 = 0xA8 (mod 256) unpacks to (0, 2, 2, 2). In kvq hi - lo = 0, so
// s = ŝ = 0 and every code is 0 (spec/numerics.md §5 step 4): the bytes are 0, m̂ = bf16(x) and
// every dequantized value is m̂. Checked for every head_dim, group (G = d included), bit width
// and two clip ratios, from the smallest subnormal to the largest accepted magnitude, through
// the validating write path; the packed bytes also unpack to the codes.
TEST_P(WriteGoldenTest, CodeClampConstantRowsStoreZeroCodesAndBytes) {
  const Backend& backend = (*GetParam());
  const float values[] = {-2.14435f,       -2.140625f, -0.9296875f, 1.0f,          0.0f,
                          -0.0f,           1e-8f,      3.3333334e-9f, 1e-40f,      F32FromBits(1u),
                          F32FromBits(0x80000001u), 65504.0f,   kMaxRotatedAbs, -kMaxRotatedAbs};
  const size_t n = sizeof(values) / sizeof(values[0]);
  for (int d : {64, 128, 256}) {
    for (int group : {32, 64, 128}) {
      if (group > d) continue;
      for (int bits : {2, 4}) {
        for (float rho : {1.0f, 0.92f}) {
          WriteParams p = testbed::Write().head_dim(d).group(group).bits(bits).Build();
          p.clip = rho;
          const size_t dd = static_cast<size_t>(d);
          const size_t groups = static_cast<size_t>(p.num_groups());
          const size_t bytes = static_cast<size_t>(p.packed_bytes());
          std::vector<float> x(n * dd);
          for (size_t r = 0; r < n; ++r) std::fill_n(x.begin() + r * dd, dd, values[r]);
          const QuantizedRows q = QuantizeRows(backend, p, nullptr, x.data(), n);
          const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
          const std::vector<uint8_t> q_packed = q.Values<uint8_t>("packed");
          const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
          const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
          std::vector<uint8_t> unpacked(n * dd, 0xff);
          backend.write.unpack(q_packed.data(), unpacked.data(), n, p);
          for (size_t r = 0; r < n; ++r) {
            const std::string where = "d " + std::to_string(d) + " G " + std::to_string(group) +
                                      " bits " + std::to_string(bits) + " rho " +
                                      std::to_string(rho) + " x " + testbed::DescribeFloat(values[r]);
            const uint16_t min = Bf16FromF32(values[r] + 0.0f);
            for (size_t g = 0; g < groups; ++g) {
              ASSERT_EQ(q_scale[r * groups + g], 0x0000) << where;
              ASSERT_EQ(q_min[r * groups + g], min) << where;
            }
            for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(q_packed[r * bytes + i], 0) << where;
            const float xhat = 0.0f * 0.0f + F32FromBf16(min);
            for (size_t j = 0; j < dd; ++j) {
              ASSERT_EQ(q_codes[r * dd + j], 0) << where << " channel " << j;
              ASSERT_EQ(unpacked[r * dd + j], 0) << where << " channel " << j;
              ASSERT_EQ(F32Bits(q.dequantized[r * dd + j]), F32Bits(xhat)) << where;
            }
          }
        }
      }
    }
  }
}

// spec/differences.md, "scale floor". The authors' scale is max(hi - lo, 1e-8) / 3, so every
// code of a group whose range is below 1e-8 is 0 (the measurement's subnormal rows: all 1 153
// of their codes). kvq has no floor: s = (hi - lo) / L and ŝ = bf16(s), whose exponent range is
// fp32's, so a tiny range keeps its L + 1 levels; only where s rounds to a bf16 zero
// (s < 2^-134) is every code 0, by the ŝ = 0 rule. One group of G = d per row (G = 128 at
// d = 256: two groups), lo at its first channel, hi at its second, the other channels between
// them. Checked: ŝ and m̂ as the spec computes them, every code the spec's and in [0, L], the
// packed bytes unpack to the codes, and which cases keep their levels.
TEST_P(WriteGoldenTest, ScaleFloorTinyRangesKeepCodesInRange) {
  const Backend& backend = (*GetParam());
  const struct {
    float lo, hi;
    bool zero_scale;  // s < 2^-134: ŝ = 0 and every code 0
  } cases[] = {
      {0x1p-20f, 0x1p-20f + 0x1p-30f, false},      // normal values, range 9.3e-10
      {-0x1p-30f, -0x1p-30f + 0x1p-40f, false},    // negative, range 9.1e-13
      {0.0f, 3 * 0x1p-130f, false},                // subnormal range, ŝ a bf16 subnormal
      {-0x1p-141f, 0x1p-141f, true},               // s = 2^-140 / L rounds to a bf16 zero
  };
  for (const auto& c : cases) {
    for (int d : {64, 128, 256}) {
      for (int bits : {2, 4}) {
        const int group = std::min(d, 128);
        const WriteParams p = testbed::Write().head_dim(d).group(group).bits(bits).Build();
        const size_t dd = static_cast<size_t>(d);
        const size_t gs = static_cast<size_t>(group);
        std::vector<float> x(dd);
        for (size_t j = 0; j < dd; ++j) {
          x[j] = c.lo + (c.hi - c.lo) * (static_cast<float>(j % 7) / 7.0f);
          if (j % gs == 0) x[j] = c.lo;
          if (j % gs == 1) x[j] = c.hi;
        }
        const QuantizedRows q = QuantizeRows(backend, p, nullptr, x.data(), 1);
        const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
        const std::vector<uint8_t> q_packed = q.Values<uint8_t>("packed");
        const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
        const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
        const std::string where = "lo " + testbed::DescribeFloat(c.lo) + " hi " + testbed::DescribeFloat(c.hi) + " d " +
                                  std::to_string(d) + " bits " + std::to_string(bits);
        const int levels = p.levels();
        const uint16_t scale = Bf16FromF32((c.hi - c.lo) / static_cast<float>(levels));
        const uint16_t min = Bf16FromF32(c.lo + 0.0f);
        ASSERT_EQ(scale == 0, c.zero_scale) << where;
        for (int g = 0; g < p.num_groups(); ++g) {
          ASSERT_EQ(q_scale[g], scale) << where << " group " << g;
          ASSERT_EQ(q_min[g], min) << where << " group " << g;
        }
        std::vector<uint8_t> unpacked(dd, 0xff);
        backend.write.unpack(q_packed.data(), unpacked.data(), 1, p);
        for (size_t j = 0; j < dd; ++j) {
          ASSERT_LE(q_codes[j], levels) << where << " channel " << j;
          ASSERT_EQ(q_codes[j], SpecCode(x[j], scale, min, levels))
              << where << " channel " << j << " x " << testbed::DescribeFloat(x[j]);
          ASSERT_EQ(unpacked[j], q_codes[j]) << where << " channel " << j;
          if (c.zero_scale) {
            ASSERT_EQ(q_codes[j], 0) << where << " channel " << j;
          } else if (j % gs == 0) {
            EXPECT_EQ(q_codes[j], 0) << where << " channel " << j;
          } else if (j % gs == 1) {
            EXPECT_GT(q_codes[j], levels / 2)
                << where << " channel " << j << ": the top of a tiny range keeps its level";
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- dequantize

// code 3 * 0.333984375 (bf16 0x3EAB) = 1.001953125 exactly; + (-1.5) = -0.498046875 exactly.
// code 0 gives m̂ itself; code 2 gives 0.66796875 - 1.5 = -0.83203125.
TEST_P(WriteGoldenTest, DequantizeKnownValues) {
  const WriteParams p = testbed::Write().head_dim(64).group(64).bits(2).Build();
  std::vector<uint8_t> codes(64, 2);
  codes[0] = 3;
  codes[1] = 0;
  const uint16_t scale = 0x3EAB, min = 0xBFC0;
  std::vector<float> y(64);
  k().dequantize(codes.data(), &scale, &min, y.data(), 1, p);
  EXPECT_EQ(F32Bits(y[0]), F32Bits(-0.498046875f));
  EXPECT_EQ(F32Bits(y[1]), F32Bits(-1.5f));
  EXPECT_EQ(F32Bits(y[2]), F32Bits(-0.83203125f));
}

// ---------------------------------------------------------------- FWHT

// The FWHT of e_k is column k of H/sqrt(b): butterflies on a unit vector only ever add or
// subtract 0 and ±1, exactly, so every output is exactly ±s with s = fp32(1/sqrt(b)) and the
// sign (-1)^popcount(k & j). Checked for every k, for a full block and for blocks of 16.
TEST_P(WriteGoldenTest, FwhtOfUnitVectorIsHadamardColumn) {
  for (int d : {64, 128, 256}) {
    for (int block : {d, 16}) {
      WriteParams p = testbed::Write().head_dim(d).group(32).bits(2).Build();
      p.rotation = RotationKind::kHadamard;
      p.hadamard_block = block;
      const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
      std::vector<float> x(static_cast<size_t>(d) * d, 0.0f);
      for (int row = 0; row < d; ++row) x[static_cast<size_t>(row) * d + row] = 1.0f;
      k().fwht(x.data(), static_cast<size_t>(d), p);
      for (int row = 0; row < d; ++row) {
        for (int j = 0; j < d; ++j) {
          const float got = x[static_cast<size_t>(row) * d + j];
          float want = 0.0f;
          if (row / block == j / block) {
            const int kk = row % block, jj = j % block;
            want = (__builtin_popcount(static_cast<unsigned>(kk & jj)) % 2 == 0) ? s : -s;
          }
          ASSERT_EQ(F32Bits(got), F32Bits(want))
              << "d " << d << " block " << block << " unit " << row << " output " << j;
        }
      }
    }
  }
}

// s for b = 64 is 1/8 exactly; the FWHT of the all-ones block is 64*e_0 before scaling, so
// (8, +0, +0, ...) after. For b = 128, s = fp32(1/sqrt(128)) = 0x3DB504F3
// (1/sqrt(128) = 0.08838834764..., nearest fp32 0.0883883461356163).
TEST_P(WriteGoldenTest, FwhtOfConstantRow) {
  WriteParams p = testbed::Write().head_dim(64).group(32).bits(2).Build();
  p.rotation = RotationKind::kHadamard;
  std::vector<float> x(64, 1.0f);
  k().fwht(x.data(), 1, p);
  EXPECT_EQ(x[0], 8.0f);
  for (int j = 1; j < 64; ++j) EXPECT_EQ(F32Bits(x[j]), 0u) << "output " << j;
  p.head_dim = 128;
  std::vector<float> unit(128, 0.0f);
  unit[0] = 1.0f;
  k().fwht(unit.data(), 1, p);
  EXPECT_EQ(F32Bits(unit[5]), 0x3DB504F3u);
}

// ---------------------------------------------------------------- bit reversal

// d = 128 (7 bits): beta(1) = 1000000b = 64, beta(2) = 32, beta(3) = 96, beta(64) = 1,
// beta(127) = 127, beta(0) = 0, beta(5) = 1010000b = 80.
TEST_P(WriteGoldenTest, BitrevKnownIndices) {
  const WriteParams p = testbed::Write().head_dim(128).group(64).bits(2).Build();
  std::vector<float> x(128), y(128);
  for (int j = 0; j < 128; ++j) x[j] = static_cast<float>(j);
  k().bitrev(x.data(), y.data(), 1, p);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 64.0f);
  EXPECT_EQ(y[2], 32.0f);
  EXPECT_EQ(y[3], 96.0f);
  EXPECT_EQ(y[5], 80.0f);
  EXPECT_EQ(y[64], 1.0f);
  EXPECT_EQ(y[127], 127.0f);
  // d = 64 (6 bits): beta(1) = 32; d = 256 (8 bits): beta(1) = 128, beta(3) = 192.
  std::vector<float> x256(256), y256(256);
  for (int j = 0; j < 256; ++j) x256[j] = static_cast<float>(j);
  k().bitrev(x256.data(), y256.data(), 1, testbed::Write().head_dim(64).group(64).bits(2).Build());
  EXPECT_EQ(y256[1], 32.0f);
  k().bitrev(x256.data(), y256.data(), 1, testbed::Write().head_dim(256).group(64).bits(2).Build());
  EXPECT_EQ(y256[1], 128.0f);
  EXPECT_EQ(y256[3], 192.0f);
}

// ---------------------------------------------------------------- clip

// x[j] = ±(j + 1), d = 64: the sorted magnitudes are 1..64, so a[k] = k + 1.
// rho = 0.5: k = 32 -> tau = 33; rho = 0.96f (0.959999978...): 61.44 -> k = 61 -> tau = 62;
// rho = 0.92f: 58.88 -> k = 58 -> tau = 59; rho = 0.8f: 51.2 -> k = 51 -> tau = 52;
// rho = 1: k = min(64, 63) = 63 -> tau = 64 (spec/differences.md, "clip threshold" and "clip at
// ρ = 1": no interpolation, no bisection, and ρ = 1 leaves the largest value alone).
TEST_P(WriteGoldenTest, ClipOrderStatistic) {
  const struct {
    float rho;
    float tau;
  } cases[] = {{0.5f, 33.0f}, {0.96f, 62.0f}, {0.92f, 59.0f}, {0.8f, 52.0f}, {1.0f, 64.0f}};
  for (const auto& c : cases) {
    WriteParams p = testbed::Write().head_dim(64).group(32).bits(2).Build();
    p.clip = c.rho;
    std::vector<float> x(64);
    for (int j = 0; j < 64; ++j) x[j] = (j % 2 == 0 ? 1.0f : -1.0f) * static_cast<float>(j + 1);
    const std::vector<float> original = x;
    float tau = -1.0f;
    k().clip(x.data(), &tau, 1, p);
    EXPECT_EQ(tau, c.tau) << "rho " << c.rho;
    for (int j = 0; j < 64; ++j) {
      const float want = std::fabs(original[j]) > c.tau ? std::copysign(c.tau, original[j])
                                                        : original[j];
      EXPECT_EQ(x[j], want) << "rho " << c.rho << " channel " << j;
    }
  }
}

// Zeros: |−0| = +0, so tau = +0 (bits 0) and, as the clamp uses comparisons, every −0 and +0
// of the row keeps its sign; a row of ±1 with rho = 0.5 has tau = 1 and stays unchanged.
TEST_P(WriteGoldenTest, ClipKeepsSignedZerosAndTies) {
  WriteParams p = testbed::Write().head_dim(64).group(32).bits(2).Build();
  p.clip = 0.5f;
  std::vector<float> x(64);
  for (int j = 0; j < 64; ++j) x[j] = (j % 2 == 0) ? -0.0f : 0.0f;
  const std::vector<float> zeros = x;
  float tau = -1.0f;
  k().clip(x.data(), &tau, 1, p);
  EXPECT_EQ(F32Bits(tau), 0u);
  EXPECT_EQ(std::memcmp(x.data(), zeros.data(), 64 * sizeof(float)), 0);

  for (int j = 0; j < 64; ++j) x[j] = (j % 3 == 0) ? -1.0f : 1.0f;
  const std::vector<float> ones = x;
  k().clip(x.data(), &tau, 1, p);
  EXPECT_EQ(tau, 1.0f);
  EXPECT_EQ(std::memcmp(x.data(), ones.data(), 64 * sizeof(float)), 0);

  // 10 zeros, then ±3 alternating, one outlier 100; rho = 0.1: 6.4 -> k = 6 -> tau = +0.
  // Positive values become tau = +0 (x > tau), negative ones -tau = -0 (x < -tau).
  p.clip = 0.1f;
  for (int j = 0; j < 64; ++j) x[j] = j < 10 ? 0.0f : ((j % 2 == 0) ? 3.0f : -3.0f);
  x[63] = 100.0f;
  k().clip(x.data(), &tau, 1, p);
  EXPECT_EQ(F32Bits(tau), 0u);
  for (int j = 10; j < 64; ++j) {
    EXPECT_EQ(F32Bits(x[j]), (j % 2 == 0 || j == 63) ? 0u : 0x80000000u) << "channel " << j;
  }
}

// ---------------------------------------------------------------- dense rotation

// Summation order and no FMA. Column 0 of R is (1+2^-12, -(1+2^-11), 0, ...) and x starts
// (1+2^-12, 1): x0*R00 = 1 + 2^-11 + 2^-24 exactly, which rounds (a tie at 2^-24, even
// mantissa) to 1 + 2^-11; adding -(1+2^-11) gives +0. A fused multiply-add would give 2^-24.
// Column 1 is (1, 1, 1, 0...) with x = (1e8, 1, -1e8): ((0 + 1e8) + 1) + -1e8 = 0 in fp32
// (1 is below half an ulp of 1e8, which is 8), while summing from the other end gives 1.
// Column 2 picks 2*x[3] only: y[2] = 1.5 for x[3] = 0.75.
TEST_P(WriteGoldenTest, RotateDenseOrderAndNoFma) {
  const int d = 64;
  const WriteParams p = testbed::Write().head_dim(d).group(32).bits(2).Build();
  std::vector<float> r(d * d, 0.0f);
  auto at = [&](int i, int j) -> float& { return r[static_cast<size_t>(i) * d + j]; };
  const float a = 1.0f + 0x1p-12f;
  at(0, 0) = a;
  at(1, 0) = -(1.0f + 0x1p-11f);
  at(0, 1) = 1.0f;
  at(1, 1) = 1.0f;
  at(2, 1) = 1.0f;
  at(3, 2) = 2.0f;
  std::vector<float> x(2 * d, 0.0f);
  x[0] = a;
  x[1] = 1.0f;
  x[d + 0] = 1e8f;
  x[d + 1] = 1.0f;
  x[d + 2] = -1e8f;
  x[d + 3] = 0.75f;
  std::vector<float> y(2 * d, -1.0f);
  k().rotate_dense(x.data(), r.data(), y.data(), 2, p);
  EXPECT_EQ(F32Bits(y[0]), 0u) << "fused multiply-add or wrong rounding: y = " << y[0];
  EXPECT_EQ(F32Bits(y[d + 1]), 0u) << "summation order: y = " << y[d + 1];
  EXPECT_EQ(y[d + 2], 1.5f);
  for (int j = 3; j < d; ++j) EXPECT_EQ(F32Bits(y[d + j]), 0u) << "column " << j;
}

// ---------------------------------------------------------------- pack / unpack

// INT2, d = 64 (16 bytes): code c[j] = j / 16 (the quarter index) puts 0, 1, 2, 3 in bits
// [1:0], [3:2], [5:4], [7:6] of every byte: 0 | 1<<2 | 2<<4 | 3<<6 = 0xE4.
// Single 3s: c[0] -> byte 0 = 0x03; c[16+1] -> byte 1 = 0x0C; c[32+2] -> byte 2 = 0x30;
// c[48+3] -> byte 3 = 0xC0.
TEST_P(WriteGoldenTest, PackInt2KnownBytes) {
  const WriteParams p = testbed::Write().head_dim(64).group(32).bits(2).Build();
  std::vector<uint8_t> codes(64), packed(16);
  for (int j = 0; j < 64; ++j) codes[j] = static_cast<uint8_t>(j / 16);
  k().pack(codes.data(), packed.data(), 1, p);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(packed[i], 0xE4) << "byte " << i;
  std::fill(codes.begin(), codes.end(), 0);
  codes[0] = 3;
  codes[17] = 3;
  codes[34] = 3;
  codes[51] = 3;
  k().pack(codes.data(), packed.data(), 1, p);
  const uint8_t want[16] = {0x03, 0x0C, 0x30, 0xC0};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(packed[i], want[i]) << "byte " << i;
}

// INT4, d = 64 (32 bytes): byte i = c[i] | c[32+i] << 4; with c[i] = i % 16 and
// c[32+i] = 15 - i % 16: byte i = (i % 16) | (15 - i % 16) << 4, e.g. byte 0 = 0xF0, byte 5 = 0xA5.
TEST_P(WriteGoldenTest, PackInt4KnownBytes) {
  const WriteParams p = testbed::Write().head_dim(64).group(32).bits(4).Build();
  std::vector<uint8_t> codes(64), packed(32);
  for (int i = 0; i < 32; ++i) {
    codes[i] = static_cast<uint8_t>(i % 16);
    codes[32 + i] = static_cast<uint8_t>(15 - i % 16);
  }
  k().pack(codes.data(), packed.data(), 1, p);
  EXPECT_EQ(packed[0], 0xF0);
  EXPECT_EQ(packed[5], 0xA5);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(packed[i], static_cast<uint8_t>((i % 16) | (15 - i % 16) << 4)) << "byte " << i;
  }
}

// Exhaustive: every byte value unpacks to codes that pack back to the same byte, at every
// position of the row, for INT2 and INT4 and every head_dim; and the unpacked codes are the
// byte's fields.
TEST_P(WriteGoldenTest, UnpackPackIsIdentityOnAllBytes) {
  for (int d : {64, 128, 256}) {
    for (int bits : {2, 4}) {
      const WriteParams p = testbed::Write().head_dim(d).group(32).bits(bits).Build();
      const size_t bytes = static_cast<size_t>(p.packed_bytes());
      const size_t rows = 256;  // row r starts at byte value r, so every value visits every slot
      std::vector<uint8_t> packed(rows * bytes);
      for (size_t r = 0; r < rows; ++r) {
        for (size_t i = 0; i < bytes; ++i) packed[r * bytes + i] = static_cast<uint8_t>(r + i);
      }
      std::vector<uint8_t> codes(rows * d), repacked(rows * bytes);
      k().unpack(packed.data(), codes.data(), rows, p);
      k().pack(codes.data(), repacked.data(), rows, p);
      ASSERT_EQ(packed, repacked) << "d " << d << " bits " << bits;
      const size_t per_byte = 8 / bits;
      for (size_t r = 0; r < rows; ++r) {
        for (size_t i = 0; i < bytes; ++i) {
          for (size_t part = 0; part < per_byte; ++part) {
            const unsigned field = (packed[r * bytes + i] >> (part * bits)) & ((1u << bits) - 1);
            ASSERT_EQ(codes[r * d + part * bytes + i], field)
                << "d " << d << " bits " << bits << " row " << r << " byte " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, WriteGoldenTest,
                         ::testing::ValuesIn(testbed::TestBackends()), testbed::BackendTestName);

}  // namespace
}  // namespace kvq::cpu
