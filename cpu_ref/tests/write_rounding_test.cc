// Round half to even at the code boundaries, on every backend (the scalar reference included).
// One 64-channel group with lo = +0 and hi = 3 stores scale 1 and min 0 exactly (bf16), so the
// code of x is rint(x): the quotient (x - 0) / 1 is x itself. The values sit on and next to the
// half-integers, where an implementation that rounds with (int)(t + 0.5f) goes wrong:
// 0.49999997f + 0.5f rounds to 1.0f in fp32, but rint(0.49999997f) is 0. The authors' kernels
// round half up, trunc(t + 0.5) (spec/differences.md, "code rounding"): 0.5 and 2.5 below
// would give 1 and 3.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

struct RoundingCase {
  float x;
  uint8_t code;  // rint(x), ties to even
};

// Each line derived by hand: below a half-integer rounds down, on it rounds to even, above it
// rounds up.
const RoundingCase kCases[] = {
    {0.0f, 0},           {0.49999997f, 0},    {0.5f, 0},        {0.50000006f, 1},
    {1.0f, 1},           {1.4999999f, 1},     {1.5f, 2},        {1.5000001f, 2},
    {2.4999998f, 2},     {2.5f, 2},           {2.5000002f, 3},  {3.0f, 3},
    {0.25f, 0},          {0.75f, 1},          {2.75f, 3},       {1e-30f, 0},
};

class WriteRoundingTest : public ::testing::TestWithParam<const Backend*> {};

TEST_P(WriteRoundingTest, CodesRoundHalfToEvenAtEveryBoundary) {
  const Backend& backend = (*GetParam());
  WriteParams p;
  p.head_dim = 64;
  p.group = 64;
  p.bits = 2;
  std::vector<float> row(64, 0.0f);  // lo = +0
  row[63] = 3.0f;                    // hi = 3: scale (3 - 0) / 3 = 1, min 0
  const size_t num_cases = sizeof(kCases) / sizeof(kCases[0]);
  for (size_t i = 0; i < num_cases; ++i) row[i] = kCases[i].x;

  std::vector<uint8_t> codes(64, 0xff);
  uint16_t scale = 0, min = 0xffff;
  backend.write.quantize(row.data(), codes.data(), &scale, &min, 1, p);
  ASSERT_EQ(scale, Bf16FromF32(1.0f)) << backend.name;
  ASSERT_EQ(min, Bf16FromF32(0.0f)) << backend.name;
  for (size_t i = 0; i < num_cases; ++i) {
    EXPECT_EQ(codes[i], kCases[i].code)
        << backend.name << ": x = " << kCases[i].x << " (bits 0x" << std::hex
        << F32Bits(kCases[i].x) << ")";
  }
  EXPECT_EQ(codes[63], 3) << backend.name;
}

// spec/differences.md, "code rounding". The authors' kernels store fp32 (s, z = -lo / s) and
// take trunc(x / s + z + 0.5): half up, against values kvq does not store. kvq rounds half to
// even against the stored bf16 ŝ and m̂. Two groups of 32 (d = 64, INT2) whose ŝ and m̂ differ
// from s and lo, with x placed on the half-integers of (x - m̂) / ŝ; every subtraction and
// division below is exact in fp32.
//  Group 0: lo = 1 + 2^-9 = 1.001953125, hi = lo + 1. s = fp32(1/3) = 0x3EAAAAAB, whose low half
//  0xAAAB rounds the bf16 up: ŝ = 0x3EAB = 0.333984375; m̂ = bf16(lo) = 1.0 (2^-9 is below half
//  a bf16 ulp), 0x3F80. x = 1 + 0.5 ŝ = 1.1669921875: (x - 1) / ŝ = 0.5 -> 0 (half up: 1);
//  x = 1 + 1.5 ŝ = 1.5009765625: 1.5 -> 2 (against fp32 lo and s: (x - lo) / s = 1.497 -> 1);
//  x = 1 + 2.5 ŝ = 1.8349609375: 2.5 -> 2 (half up: 3); x = lo -> 0; x = hi = 1 + 3 ŝ -> 3.
//  Group 1 (the measurement's example): lo = -2, hi = 2. s = fp32(4/3) = 0x3FAAAAAB ->
//  ŝ = 0x3FAB = 1.3359375; m̂ = -2 = 0xC000. x = 0: 2 / ŝ = 1.497 -> 1, where the authors'
//  0 / s + 1.5 + 0.5 = 2.0 gives 2; x = -2 + 0.5 ŝ = -1.33203125: 0.5 -> 0 (the authors': 1);
//  x = -2 + 2.5 ŝ = 1.33984375: 2.5 -> 2 (the authors': 3.005 -> 3).
TEST_P(WriteRoundingTest, CodeRoundingTiesAgainstStoredScaleAndMinGoToEven) {
  const Backend& backend = (*GetParam());
  WriteParams p;
  p.head_dim = 64;
  p.group = 32;
  p.bits = 2;
  const float lo0 = 1.001953125f, hi0 = 2.001953125f;
  std::vector<float> row(64);
  for (int j = 0; j < 32; ++j) row[j] = lo0;
  for (int j = 32; j < 64; ++j) row[j] = -2.0f;
  const struct {
    int channel;
    float x;
    uint8_t code;
  } cases[] = {
      {1, hi0, 3},          {2, 1.1669921875f, 0}, {3, 1.5009765625f, 2}, {4, 1.8349609375f, 2},
      {5, lo0, 0},          {33, 2.0f, 3},         {34, 0.0f, 1},         {35, -1.33203125f, 0},
      {36, 1.33984375f, 2}, {37, -2.0f, 0},
  };
  for (const auto& c : cases) row[c.channel] = c.x;
  std::vector<uint8_t> codes(64, 0xff);
  uint16_t scale[2] = {0, 0}, min[2] = {0, 0};
  backend.write.quantize(row.data(), codes.data(), scale, min, 1, p);
  ASSERT_EQ(scale[0], 0x3EAB) << backend.name;
  ASSERT_EQ(min[0], 0x3F80) << backend.name;
  ASSERT_EQ(scale[1], 0x3FAB) << backend.name;
  ASSERT_EQ(min[1], 0xC000) << backend.name;
  for (const auto& c : cases) {
    EXPECT_EQ(codes[c.channel], c.code)
        << backend.name << ": channel " << c.channel << " x = " << c.x;
  }
}

INSTANTIATE_TEST_SUITE_P(Write, WriteRoundingTest,
                         ::testing::ValuesIn(testbed::TestBackends()), testbed::BackendTestName);

}  // namespace
}  // namespace kvq::cpu
