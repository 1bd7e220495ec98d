// Seeds/000 appendix A.4 (Qwen3-4B layer 10, d = 128, G = 64): the printed rows, run through
// our stages on every backend. The rows are printed with 2 decimals, so comparisons of
// computed values with printed ones carry the print's rounding; the permutation is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "a4_worked_example_data.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

class A4WorkedExampleTest : public ::testing::TestWithParam<const Backend*> {
 protected:
  const WriteKernels& k() const { return (*GetParam()).write; }
  static WriteParams Params() {
    WriteParams p;
    p.head_dim = 128;
    p.group = 64;
    p.bits = 2;
    return p;
  }
};

// K·H_Had with H the normalised Sylvester matrix in natural order: our FWHT of the printed raw
// row. Each printed input is off by up to 0.005, each printed output by up to 0.005; 0.011
// per element covers both for this row (the largest difference, 0.0109, is at an output
// where the input roundings happen to add up).
TEST_P(A4WorkedExampleTest, FwhtOfRawRowMatchesPrintedHadamardRow) {
  WriteParams p = Params();
  p.rotation = RotationKind::kHadamard;
  std::vector<float> x(a4::kRawKeyRow, a4::kRawKeyRow + 128);
  k().fwht(x.data(), 1, p);
  for (int j = 0; j < 128; ++j) {
    EXPECT_NEAR(x[j], a4::kKHRow[j], 0.011f) << "channel " << j;
  }
}

// Step 3 of the example: P_K is our bit reversal (output 1 = input 64), so it maps the printed
// U_Q·H row onto the printed U_Q·H·P_K row exactly, value for value.
TEST_P(A4WorkedExampleTest, BitrevOfPrintedRowIsPrintedPermutedRow) {
  const WriteParams p = Params();
  std::vector<float> y(128);
  k().bitrev(a4::kKUqHRow, y.data(), 1, p);
  for (int j = 0; j < 128; ++j) {
    EXPECT_EQ(F32Bits(y[j]), F32Bits(a4::kKUqHPRow[j])) << "channel " << j;
  }
  // And back: the permutation is an involution.
  std::vector<float> back(128);
  k().bitrev(y.data(), back.data(), 1, p);
  EXPECT_EQ(std::memcmp(back.data(), a4::kKUqHRow, sizeof(float) * 128), 0);
}

// The per-group max - min printed under each matrix, recomputed from the printed rows (the
// printed range was computed from unrounded values, hence up to 0.01 apart; 0.02 bounds it).
// The ranges also match the quantizer's view: 3 * ŝ is the range to within bf16 rounding.
TEST_P(A4WorkedExampleTest, PrintedGroupRanges) {
  const struct {
    const char* name;
    const float* row;
    const float* range;
  } rows[] = {{"K", a4::kRawKeyRow, a4::kRawGroupRange},
              {"K U_Q", a4::kKUqRow, a4::kKUqGroupRange},
              {"K U_Q H", a4::kKUqHRow, a4::kKUqHGroupRange},
              {"K U_Q H P_K", a4::kKUqHPRow, a4::kKUqHPGroupRange},
              {"K H", a4::kKHRow, a4::kKHGroupRange}};
  const WriteParams p = Params();
  for (const auto& r : rows) {
    std::vector<uint8_t> codes(128);
    uint16_t scale[2], min[2];
    k().quantize(r.row, codes.data(), scale, min, 1, p);
    for (int g = 0; g < 2; ++g) {
      const float* begin = r.row + 64 * g;
      const float range = *std::max_element(begin, begin + 64) - *std::min_element(begin, begin + 64);
      EXPECT_NEAR(range, r.range[g], 0.02f) << r.name << " group " << g;
      EXPECT_EQ(F32FromBf16(min[g]), RoundToBf16(*std::min_element(begin, begin + 64)))
          << r.name << " group " << g;
      // |ŝ - s| <= 2^-8 s (bf16 keeps 8 significant bits) and s = range/3 up to fp32
      // rounding, so |3ŝ - range| <= 2^-8 range + 1e-5.
      EXPECT_NEAR(3.0f * F32FromBf16(scale[g]), range, range / 256.0f + 1e-5f)
          << r.name << " group " << g;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(A4, A4WorkedExampleTest,
                         ::testing::ValuesIn(testbed::TestBackends()), testbed::BackendTestName);

}  // namespace
}  // namespace kvq::cpu
