// bf16 and fp16 conversions (numeric.h) against a reference that rounds in double: find the
// two neighbouring representable values by value, pick the nearer, ties to the even pattern.
#include "kvq/common/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

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

}  // namespace
}  // namespace kvq
