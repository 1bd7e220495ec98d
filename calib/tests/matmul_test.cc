// The forward's kernels (matmul.h) against fp64 references: every tail of the register tiles
// and panels, leading dimensions, accumulation, k = 0; the softmax, log-sum-exp and SwiGLU; and
// the property the perplexity evaluation relies on (a row's result depends on that row only).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvq/calib/matmul.h"
#include "kvq/testbed/compare.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// max |C − A·B| / (Σ_k |a|·|b|) over the elements: the GEMM error relative to its condition.
void CheckMatMul(size_t m, size_t n, size_t k, size_t pad, bool accumulate) {
  SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k << " pad=" << pad
                                    << " accumulate=" << accumulate);
  const size_t lda = k + pad, ldb = n + pad, ldc = n + 2 * pad;
  const std::vector<float> a = Random(std::max<size_t>(1, m * lda), 1 + m);
  const std::vector<float> b = Random(std::max<size_t>(1, k * ldb), 2 + n);
  std::vector<float> c = Random(std::max<size_t>(1, m * ldc), 3 + k);
  const std::vector<float> before = c;
  MatMul(a.data(), lda, b.data(), ldb, c.data(), ldc, m, n, k, accumulate);
  double worst = 0;
  for (size_t i = 0; i < m; ++i) {
    for (size_t j = 0; j < ldc; ++j) {
      if (j >= n) {  // padding columns are never written
        ASSERT_EQ(c[i * ldc + j], before[i * ldc + j]) << i << "," << j;
        continue;
      }
      double sum = 0, scale = 0;
      for (size_t p = 0; p < k; ++p) {
        sum += double{a[i * lda + p]} * b[p * ldb + j];
        scale += std::abs(double{a[i * lda + p]} * b[p * ldb + j]);
      }
      if (accumulate) {
        sum += before[i * ldc + j];
        scale += std::abs(double{before[i * ldc + j]});
      }
      if (scale == 0) {
        ASSERT_EQ(c[i * ldc + j], 0.0f);
        continue;
      }
      worst = std::max(worst, std::abs(c[i * ldc + j] - sum) / scale);
    }
  }
  EXPECT_LE(worst, 4 * std::numeric_limits<float>::epsilon() * std::sqrt(double(k) + 1));
}

TEST(MatMul, MatchesFp64OnEveryTileAndPanelTail) {
  for (size_t m : {1, 3, 4, 7, 8, 9, 17, 130}) {
    for (size_t n : {1, 5, 16, 24, 47, 48, 49, 100}) {
      for (size_t k : {1, 2, 33, 128}) CheckMatMul(m, n, k, 0, false);
    }
  }
  CheckMatMul(19, 77, 64, 3, false);  // leading dimensions beyond the extents
  CheckMatMul(19, 77, 64, 3, true);   // C += A·B
  CheckMatMul(5, 9, 0, 1, false);     // k = 0: zeros
  CheckMatMul(5, 9, 0, 1, true);      // k = 0: C unchanged
}

// Rows computed alone, or at another offset of a larger product, give the same bits.
TEST(MatMul, RowsDoNotDependOnTheirNeighbours) {
  const size_t m = 37, n = 130, k = 96;
  const std::vector<float> a = Random(m * k, 5), b = Random(k * n, 6);
  std::vector<float> all(m * n);
  MatMul(a.data(), k, b.data(), n, all.data(), n, m, n, k);
  for (size_t first : {1u, 5u, 8u, 36u}) {
    std::vector<float> part((m - first) * n);
    MatMul(a.data() + first * k, k, b.data(), n, part.data(), n, m - first, n, k);
    EXPECT_TRUE(testbed::BitsEqual("matmul_rows_from_" + std::to_string(first),
                                   std::vector<float>(all.begin() + first * n, all.end()), part, n));
  }
  // And a column block computed alone matches too.
  std::vector<float> cols(m * 50);
  MatMul(a.data(), k, b.data() + 70, n, cols.data(), 50, m, 50, k);
  for (size_t i = 0; i < m; ++i) {
    for (size_t j = 0; j < 50; ++j) ASSERT_EQ(cols[i * 50 + j], all[i * n + 70 + j]);
  }
}

TEST(MatMul, SoftmaxLogSumExpAndSwiGlu) {
  for (size_t n : {1, 7, 16, 61, 8192}) {
    std::vector<float> x = Random(n, static_cast<uint32_t>(n));
    for (float& v : x) v *= 6.0f;
    if (n > 3) x[2] = -std::numeric_limits<float>::infinity();  // masked entry
    const double mx = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (float v : x) sum += std::exp(double{v} - mx);
    std::vector<float> p = x;
    SoftmaxInPlace(p.data(), n);
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(x[i])) continue;  // the masked entry, below
      const double want = std::exp(double{x[i]} - mx) / sum;
      // fp32 x − max is exact to 2^-24 relative, which exp turns into that much times |x − max|.
      const double tolerance = want * (6e-7 + 1.2e-7 * std::abs(double{x[i]} - mx)) + 1e-30;
      ASSERT_NEAR(p[i], want, tolerance) << n << " " << i;
    }
    if (n > 3) {
      EXPECT_EQ(p[2], 0.0f);
      x[2] = 0.0f;  // LogSumExp takes finite values
      sum = 0;
      for (float v : x) sum += std::exp(double{v} - mx);
    }
    EXPECT_NEAR(LogSumExp(x.data(), n), mx + std::log(sum), 1e-6 * (1 + std::abs(mx)));
  }
  const std::vector<float> gate = {-200.0f, -20.0f, -1.5f, 0.0f, 0.3f, 4.0f, 90.0f, 1e-3f, -7.0f};
  const std::vector<float> up = Random(gate.size(), 9);
  std::vector<float> out(gate.size());
  SwiGlu(gate.data(), up.data(), out.data(), gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = gate[i];
    const double want = g / (1.0 + std::exp(-g)) * up[i];
    ASSERT_NEAR(out[i], want, 1e-6 * std::abs(want) + 1e-30) << gate[i];
    ASSERT_TRUE(std::isfinite(out[i]));
  }
}

}  // namespace
}  // namespace kvq::calib
