// kvq::tables::Codebook: the full sorted codebooks, mirrored from the stored positive halves
// (tables.inc: CodebookBeta, CodebookGaussian).
#include <cmath>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"

namespace kvq::tables {
namespace {

// Per m, per width b: 2^b centroids then 2^b − 1 boundaries, at FullOffset(b) within the m.
constexpr size_t FullOffset(int bits) { return (size_t{2} << bits) - bits - 3; }
constexpr size_t kFullWordsPerSize = FullOffset(kCodebookMaxBits + 1);

size_t SizeIndex(int m) { return static_cast<size_t>(m / 2 - 1); }

// Writes the full codebook of a width from its positive half (`half`: 2^(b−1) centroids, then
// 2^(b−1) − 1 boundaries): negation is exact, so the antisymmetry is too.
void Mirror(const float* half, int bits, float* full) {
  const int n = 1 << (bits - 1), levels = 2 * n;
  float* centroids = full;
  float* boundaries = full + levels;
  for (int i = 0; i < n; ++i) {
    centroids[n + i] = half[i];
    centroids[n - 1 - i] = -half[i];
  }
  boundaries[n - 1] = 0.0f;
  for (int i = 0; i + 1 < n; ++i) {
    boundaries[n + i] = half[n + i];
    boundaries[n - 2 - i] = -half[n + i];
  }
}

std::vector<float> ExpandBeta() {
  std::vector<float> full(kCodebookSizes * kFullWordsPerSize);
  for (size_t s = 0; s < kCodebookSizes; ++s) {
    for (int bits = 1; bits <= kCodebookMaxBits; ++bits) {
      const uint32_t* words = kCodebookBeta + s * kCodebookWordsPerSize + CodebookHalfOffset(bits);
      std::vector<float> half((size_t{1} << bits) - 1);
      for (size_t i = 0; i < half.size(); ++i) half[i] = F32FromBits(words[i]);
      Mirror(half.data(), bits, full.data() + s * kFullWordsPerSize + FullOffset(bits));
    }
  }
  return full;
}

std::vector<float> ExpandGaussian() {
  std::vector<float> full(kCodebookSizes * kFullWordsPerSize);
  for (size_t s = 0; s < kCodebookSizes; ++s) {
    const double sqrt_m = std::sqrt(static_cast<double>(2 * (s + 1)));
    for (int bits = 1; bits <= kCodebookMaxBits; ++bits) {
      const size_t n = size_t{1} << (bits - 1);
      std::vector<double> centroids(n);
      for (size_t i = 0; i < n; ++i) {
        const size_t v = n - 1 + i;
        const uint64_t word = (static_cast<uint64_t>(kCodebookGaussian[2 * v]) << 32) |
                              kCodebookGaussian[2 * v + 1];
        double unit;
        std::memcpy(&unit, &word, sizeof unit);
        centroids[i] = unit / sqrt_m;
      }
      Mirror(CodebookHalf(centroids).data(), bits,
             full.data() + s * kFullWordsPerSize + FullOffset(bits));
    }
  }
  return full;
}

}  // namespace

std::vector<float> CodebookHalf(const std::vector<double>& centroids) {
  std::vector<float> half;
  for (double c : centroids) half.push_back(static_cast<float>(c));
  for (size_t i = 0; i + 1 < centroids.size(); ++i) {
    half.push_back(static_cast<float>(0.5 * (centroids[i] + centroids[i + 1])));
  }
  return half;
}

bool IsSupportedCodebook(int m, int bits) {
  return m >= 2 && m <= kCodebookMaxSize && m % 2 == 0 && bits >= 1 &&
         bits <= kCodebookMaxBits;
}

CodebookTable Codebook(int m, int bits, CodebookDensity density) {
  KVQ_CHECK(m >= 2 && m <= kCodebookMaxSize && m % 2 == 0, kInvalidArgument,
            "codebook segment size m ", m, " is not supported (even, 2..", kCodebookMaxSize, ")");
  KVQ_CHECK(bits >= 1 && bits <= kCodebookMaxBits, kInvalidArgument, "codebook width ", bits,
            " is not supported (1..", kCodebookMaxBits, ")");
  const float* full;
  if (density == CodebookDensity::kGaussian) {
    static const std::vector<float> gaussian = ExpandGaussian();
    full = gaussian.data();
  } else {
    static const std::vector<float> beta = ExpandBeta();
    full = beta.data();
  }
  const float* base = full + SizeIndex(m) * kFullWordsPerSize + FullOffset(bits);
  return {1 << bits, base, base + (1 << bits)};
}

}  // namespace kvq::tables
