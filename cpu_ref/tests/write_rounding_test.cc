// Round half to even at the code boundaries, on every backend (the scalar reference included).
// One 64-channel group with lo = +0 and hi = 3 stores scale 1 and min 0 exactly (bf16), so the
// code of x is rint(x): the quotient (x - 0) / 1 is x itself. The values sit on and next to the
// half-integers, where an implementation that rounds with (int)(t + 0.5f) goes wrong:
// 0.49999997f + 0.5f rounds to 1.0f in fp32, but rint(0.49999997f) is 0.
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

INSTANTIATE_TEST_SUITE_P(Write, WriteRoundingTest,
                         ::testing::ValuesIn(testbed::TestBackends()), testbed::BackendTestName);

}  // namespace
}  // namespace kvq::cpu
