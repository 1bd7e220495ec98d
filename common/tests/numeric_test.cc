// bf16 and fp16 conversions (numeric.h) against a reference that rounds in double: find the
// two neighbouring representable values by value, pick the nearer, ties to the even pattern.
#include "kvq/common/numeric.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <random>
#include <vector>

namespace kvq {
namespace {

// A binary format with `man_bits` stored mantissa bits and exponent bias `bias`; positive
// patterns up to its +Inf pattern.
struct Format {
  int man_bits;
  int bias;
  uint32_t inf_pattern;
  uint32_t sign_bit;
  const char* name;
};
constexpr Format kBf16{7, 127, 0x7f80, 0x8000, "bf16"};
constexpr Format kF16{10, 15, 0x7c00, 0x8000, "fp16"};

// Value of a positive pattern in double. For the Inf pattern the formula gives 2^(emax+1),
// the value that rounding to nearest compares against at the top of the range.
double Value(const Format& f, uint32_t pattern) {
  const int e = static_cast<int>(pattern >> f.man_bits);
  const double m = static_cast<double>(pattern & ((1u << f.man_bits) - 1));
  if (e == 0) return std::ldexp(m, 1 - f.bias - f.man_bits);
  return std::ldexp(1.0 + std::ldexp(m, -f.man_bits), e - f.bias);
}

// Round-to-nearest-even of a non-NaN fp32 value into `f`, computed in double.
uint32_t ReferenceRound(const Format& f, float value) {
  const uint32_t sign = std::signbit(value) ? f.sign_bit : 0;
  const double x = std::fabs(static_cast<double>(value));
  if (std::isinf(x)) return sign | f.inf_pattern;
  uint32_t lo = 0, hi = f.inf_pattern;  // largest pattern with Value <= x lies in [lo, hi]
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (Value(f, mid) <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo == f.inf_pattern) return sign | f.inf_pattern;
  const double below = x - Value(f, lo);  // exact: both lie on a grid finer than 2^-53 relative
  const double above = Value(f, lo + 1) - x;
  uint32_t pick;
  if (below < above)
    pick = lo;
  else if (above < below)
    pick = lo + 1;
  else
    pick = (lo & 1u) ? lo + 1 : lo;
  return sign | pick;
}

bool IsNanF32(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

void CheckBf16(uint32_t u) {
  const float f = F32FromBits(u);
  const uint16_t got = Bf16FromF32(f);
  if (IsNanF32(u)) {
    ASSERT_TRUE((got & 0x7f80u) == 0x7f80u && (got & 0x7fu) != 0) << "NaN 0x" << std::hex << u;
    ASSERT_EQ(got & 0x8000u, (u >> 16) & 0x8000u) << "NaN sign 0x" << std::hex << u;
    ASSERT_NE(got & 0x40u, 0u) << "NaN not quiet 0x" << std::hex << u;
    return;
  }
  ASSERT_EQ(got, ReferenceRound(kBf16, f))
      << "fp32 0x" << std::hex << u << " (" << std::scientific << f << ")";
}

void CheckF16(uint32_t u) {
  const float f = F32FromBits(u);
  const uint16_t got = F16FromF32(f);
  if (IsNanF32(u)) {
    ASSERT_TRUE((got & 0x7c00u) == 0x7c00u && (got & 0x3ffu) != 0) << "NaN 0x" << std::hex << u;
    ASSERT_EQ(got & 0x8000u, (u >> 16) & 0x8000u) << "NaN sign 0x" << std::hex << u;
    return;
  }
  ASSERT_EQ(got, ReferenceRound(kF16, f))
      << "fp32 0x" << std::hex << u << " (" << std::scientific << f << ")";
}

TEST(NumericBf16, EveryBf16ValueAndItsNeighbourhood) {
  std::mt19937 rng(42);
  const uint32_t offsets[] = {0,      1,      2,      0x3fff, 0x7ffe, 0x7fff,
                              0x8000, 0x8001, 0xbfff, 0xfffe, 0xffff};
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t base = h << 16;
    for (uint32_t off : offsets) CheckBf16(base | off);
    CheckBf16(base | (rng() & 0xffffu));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(NumericBf16, SweepOfFp32Patterns) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4093) {
    CheckBf16(static_cast<uint32_t>(u));
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Every subnormal below 2^-133 (all round to 0 or the smallest subnormal bf16s), sampled.
  for (uint32_t u = 0; u < 0x00800000u; u += 97) CheckBf16(u);
  for (uint32_t u :
       {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x7fc00000u,
        0xffc00001u, 0x7f800001u, 0x00000001u, 0x80008000u, 0x00018000u}) {
    CheckBf16(u);
  }
}

TEST(NumericBf16, GoldenBoundaryCases) {
  EXPECT_EQ(Bf16FromF32(1.0f), 0x3f80);
  EXPECT_EQ(Bf16FromF32(1.0f + 0x1p-8f), 0x3f80);      // tie, even stays
  EXPECT_EQ(Bf16FromF32(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(Bf16FromF32(1.0f + 0x1p-8f + 0x1p-23f), 0x3f81);
  EXPECT_EQ(Bf16FromF32(F32FromBits(0x7f7fffffu)), 0x7f80);  // FLT_MAX overflows to Inf
  EXPECT_EQ(Bf16FromF32(F32FromBits(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(Bf16FromF32(-0.0f), 0x8000);
  EXPECT_EQ(Bf16FromF32(F32FromBits(0x00008000u)), 0x0000);  // subnormal tie to even (0)
  EXPECT_EQ(Bf16FromF32(F32FromBits(0x00018000u)), 0x0002);  // subnormal tie to even (2)
  EXPECT_EQ(Bf16FromF32(F32FromBits(0x7f800001u)), 0x7fc0);  // signalling NaN made quiet
}

TEST(NumericBf16, EveryBf16RoundTripsExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F32FromBf16(static_cast<uint16_t>(h));
    ASSERT_EQ(F32Bits(f), h << 16);
    const bool nan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
    if (nan) continue;
    const double expect = ((h & 0x7f80u) == 0x7f80u) ? INFINITY : Value(kBf16, h & 0x7fffu);
    ASSERT_EQ(std::fabs(static_cast<double>(f)), expect) << std::hex << h;
    ASSERT_EQ(Bf16FromF32(f), h) << std::hex << h;
    ASSERT_EQ(RoundToBf16(f), f);
  }
}

TEST(NumericF16, EveryF16ConvertsExactlyAndRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = F32FromF16(bits);
    const bool sign = (h & 0x8000u) != 0;
    ASSERT_EQ(std::signbit(f), sign) << std::hex << h;
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(F32Bits(f) & 0x007fe000u, (h & 0x3ffu) << 13) << "payload " << std::hex << h;
      const uint16_t back = F16FromF32(f);
      ASSERT_TRUE((back & 0x7c00u) == 0x7c00u && (back & 0x3ffu) != 0) << std::hex << h;
      continue;
    }
    const double expect = (h & 0x7fffu) == 0x7c00u ? INFINITY : Value(kF16, h & 0x7fffu);
    ASSERT_EQ(std::fabs(static_cast<double>(f)), expect) << std::hex << h;
    ASSERT_EQ(F16FromF32(f), bits) << std::hex << h;
  }
}

TEST(NumericF16, MidpointsRoundToEven) {
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const double lo = Value(kF16, h), hi = Value(kF16, h + 1);  // h + 1 == Inf: 65536
    const double mid_d = (lo + hi) / 2;
    const float mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoint not exact in fp32 " << std::hex << h;
    const uint16_t even = static_cast<uint16_t>((h & 1u) ? h + 1 : h);
    for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(F16FromF32(s * mid), sign | even) << "midpoint above 0x" << std::hex << h;
      ASSERT_EQ(F16FromF32(s * std::nextafter(mid, 0.0f)), sign | h)
          << "below mid " << std::hex << h;
      ASSERT_EQ(F16FromF32(s * std::nextafter(mid, INFINITY)), sign | (h + 1))
          << "above mid " << std::hex << h;
    }
  }
}

TEST(NumericF16, SweepOfFp32Patterns) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4093) {
    CheckF16(static_cast<uint32_t>(u));
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Dense around the fp16 subnormal range and the overflow threshold.
  for (uint32_t u = 0x32f00000u; u < 0x38900000u; u += 61) {
    CheckF16(u);
    CheckF16(u | 0x80000000u);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (uint32_t u = 0x477f0000u; u < 0x47810000u; ++u) CheckF16(u);
}

TEST(NumericF16, GoldenBoundaryCases) {
  EXPECT_EQ(F16FromF32(65504.0f), 0x7bff);
  EXPECT_EQ(F16FromF32(65519.996f), 0x7bff);
  EXPECT_EQ(F16FromF32(65520.0f), 0x7c00);  // tie between 65504 (odd) and 65536: Inf
  EXPECT_EQ(F16FromF32(-1e10f), 0xfc00);
  EXPECT_EQ(F16FromF32(0x1p-25f), 0x0000);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(F16FromF32(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(F16FromF32(3 * 0x1p-25f), 0x0002);  // tie between 1 and 2 units: even
  EXPECT_EQ(F16FromF32(0x1p-24f), 0x0001);
  EXPECT_EQ(F16FromF32(0x1p-14f), 0x0400);
  EXPECT_EQ(F16FromF32(0x1p-14f - 0x1p-25f), 0x0400);  // tie between 0x3ff and 0x400: even
  EXPECT_EQ(F16FromF32(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(F16FromF32(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(F16FromF32(-0.0f), 0x8000);
  EXPECT_EQ(F32FromF16(0x0001), 0x1p-24f);
  EXPECT_EQ(F32FromF16(0x7bff), 65504.0f);
  EXPECT_TRUE(IsNonFinite(F32FromF16(0x7c00)));
  EXPECT_TRUE(IsNonFinite(F32FromF16(0x7e00)));
  EXPECT_FALSE(IsNonFinite(65504.0f));
}

// ---- OCP e4m3 (spec/numerics.md §9) against an independent reference ----

// The value of an e4m3 code from the OCP definition, in double.
double E4m3Value(int code) {
  const int sign = code >> 7, exponent = (code >> 3) & 0xf, mantissa = code & 7;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                         : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

// Nearest finite e4m3 to v in double arithmetic by scanning the 127 magnitudes, ties to the
// even code, saturating at 448; the sign of v kept (-0 and negative values that round to zero
// give 0x80). Written without the implementation's bit tricks.
uint8_t ReferenceE4m3(float v) {
  static const std::vector<double> magnitudes = [] {
    std::vector<double> m;
    for (int code = 0; code <= 0x7e; ++code) m.push_back(E4m3Value(code));  // ascending
    return m;
  }();
  const double a = std::fabs(static_cast<double>(v));
  int best = 0x7e;
  if (a < 448.0) {
    // The two neighbours of a, then the nearer (the even code on a tie).
    const int above = static_cast<int>(
        std::lower_bound(magnitudes.begin(), magnitudes.end(), a) - magnitudes.begin());
    const int below = above == 0 ? 0 : above - 1;
    const double down = a - magnitudes[below], up = magnitudes[above] - a;
    best = down < up ? below : (up < down ? above : ((above & 1) == 0 ? above : below));
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 0x80 : 0));
}

TEST(NumericE4m3, EveryCodeDecodesToItsOcpValue) {
  for (int code = 0; code < 256; ++code) {
    const float v = F32FromE4m3(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), E4m3Value(code)) << code;
    EXPECT_EQ(std::signbit(v), code >= 0x80) << code;
    EXPECT_EQ(E4m3FromF32(v), code) << "round trip of code " << code;
  }
}

TEST(NumericE4m3, SweepOfFp32PatternsMatchesTheReference) {
  // Every 61st fp32 pattern from 0 to past the saturation edge (~18M values), both signs.
  for (uint32_t u = 0; u < 0x44000000u; u += 61) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float f = F32FromBits(u | sign);
      ASSERT_EQ(E4m3FromF32(f), ReferenceE4m3(f))
          << "fp32 0x" << std::hex << (u | sign) << " (" << std::scientific << f << ")";
    }
  }
}

TEST(NumericE4m3, EveryTieAndItsNeighbours) {
  for (int code = 1; code <= 0x7e; ++code) {
    const float lo = static_cast<float>(E4m3Value(code - 1));
    const float hi = static_cast<float>(E4m3Value(code));
    const float mid = (lo + hi) / 2;  // exact
    const int even = (code & 1) == 0 ? code : code - 1;
    EXPECT_EQ(E4m3FromF32(mid), even) << "tie between codes " << code - 1 << " and " << code;
    EXPECT_EQ(E4m3FromF32(-mid), even | 0x80);
    EXPECT_EQ(E4m3FromF32(std::nextafter(mid, 0.0f)), code - 1);
    EXPECT_EQ(E4m3FromF32(std::nextafter(mid, 1e9f)), code);
  }
}

TEST(NumericE4m3, GoldenBoundaryCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(E4m3FromF32(448.0f), 0x7e);
  EXPECT_EQ(E4m3FromF32(464.0f), 0x7e);   // would round to 480: saturates
  EXPECT_EQ(E4m3FromF32(1e30f), 0x7e);
  EXPECT_EQ(E4m3FromF32(inf), 0x7e);
  EXPECT_EQ(E4m3FromF32(-inf), 0xfe);
  EXPECT_EQ(E4m3FromF32(-448.5f), 0xfe);
  EXPECT_EQ(E4m3FromF32(0.0f), 0x00);
  EXPECT_EQ(E4m3FromF32(-0.0f), 0x80);
  EXPECT_EQ(E4m3FromF32(0x1p-10f), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(E4m3FromF32(-0x1p-10f), 0x80);
  EXPECT_EQ(E4m3FromF32(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(E4m3FromF32(3 * 0x1p-10f), 0x02);  // tie between 1 and 2 units: even
  EXPECT_EQ(E4m3FromF32(0x1p-9f), 0x01);
  EXPECT_EQ(E4m3FromF32(15 * 0x1p-10f), 0x08);  // tie between 7 units and 2^-6: even (8)
  EXPECT_EQ(E4m3FromF32(0x1p-6f), 0x08);
  EXPECT_EQ(E4m3FromF32(1.0f), 0x38);
  EXPECT_EQ(E4m3FromF32(1.0625f), 0x38);  // tie between 1 and 1.125: even
  EXPECT_EQ(E4m3FromF32(1.1875f), 0x3a);  // tie between 1.125 and 1.25: even
  EXPECT_EQ(E4m3FromF32(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(F32FromE4m3(0x7e), 448.0f);
  EXPECT_EQ(F32FromE4m3(0x01), 0x1p-9f);
  EXPECT_EQ(F32FromE4m3(0x80), -0.0f);
}

}  // namespace
}  // namespace kvq
