// Every Highway backend against the scalar reference, bit for bit, for every stage of the
// write path and for the whole QuantizeRows pipeline. Test names end in the backend name, so
// --gtest_filter='*hwy_avx2*' selects one target.
//
// Rows: kRowsPerDistribution seeded random rows of each Distribution, then the EdgeRows of the
// configuration; on a mismatch the message names the seed, row and column (rows
// [0, 3*kinds) are random, row r of them of distribution r / 3; the rest are edge rows in
// the order of EdgeRows()).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "write_test_util.h"

namespace kvq::cpu::testing {
namespace {

constexpr size_t kRowsPerDistribution = 3;
constexpr int kHeadDims[] = {64, 128, 256};
constexpr int kGroups[] = {32, 64, 128};
constexpr int kBits[] = {2, 4};
constexpr float kClips[] = {1.0f, 0.96f, 0.92f, 0.8f, 0.5f};

// Random rows followed by edge rows; when `finite_rotation_only`, drops edge rows whose
// rotation could leave the range the write path accepts (|x| > 1e30).
std::vector<float> TestRows(const WriteParams& p, uint64_t seed, bool moderate_only = false) {
  const size_t d = static_cast<size_t>(p.head_dim);
  std::mt19937_64 rng(seed);
  std::vector<float> rows;
  for (int dist = 0; dist < static_cast<int>(Distribution::kCount); ++dist) {
    for (size_t r = 0; r < kRowsPerDistribution; ++r) {
      rows.resize(rows.size() + d);
      FillRow(static_cast<Distribution>(dist), rng, rows.data() + rows.size() - d, d);
    }
  }
  const std::vector<float> edge = EdgeRows(p, seed ^ 0x9e3779b97f4a7c15ull);
  for (size_t start = 0; start < edge.size(); start += d) {
    bool keep = true;
    for (size_t j = 0; j < d && moderate_only; ++j) keep = keep && std::fabs(edge[start + j]) <= 1e30f;
    if (keep) rows.insert(rows.end(), edge.begin() + start, edge.begin() + start + d);
  }
  return rows;
}

std::string Context(const char* stage, const WriteParams& p, uint64_t seed) {
  std::ostringstream os;
  os << stage << " seed=" << seed << " d=" << p.head_dim << " G=" << p.group
     << " bits=" << p.bits << " rho=" << p.clip << " rotation=" << RotationKindName(p.rotation)
     << " block=" << p.fwht_block() << " bitrev=" << p.bitrev;
  return os.str();
}

// Calls `test(p)` for every quantizer shape (d, G <= d, b) in a fixed order: the tests take one
// seed per call, so the order is part of what they check.
template <typename Test>
void ForEachQuantizerShape(Test test) {
  for (int d : kHeadDims) {
    for (int g : kGroups) {
      if (g > d) continue;
      for (int bits : kBits) test(ShapeParams(d, g, bits));
    }
  }
}

class WriteStepTest : public ::testing::TestWithParam<std::string> {
 protected:
  const Backend& backend() const { return BackendByName(GetParam()); }
  const Backend& scalar() const { return ScalarBackend(); }
};

TEST_P(WriteStepTest, RotateDenseMatchesScalar) {
  uint64_t seed = 1000;
  for (int d : kHeadDims) {
    const WriteParams p = ShapeParams(d, 32, 2);
    ++seed;
    const std::vector<float> r = RandomMatrix(d, seed);
    const std::vector<float> x = TestRows(p, seed);
    const size_t n = x.size() / d;
    // Row counts below, at and past the register tile of 4 rows.
    for (size_t rows : {size_t{1}, size_t{3}, size_t{4}, size_t{5}, n}) {
      std::vector<float> want(rows * d), got(rows * d);
      scalar().write.rotate_dense(x.data(), r.data(), want.data(), rows, p);
      backend().write.rotate_dense(x.data(), r.data(), got.data(), rows, p);
      EXPECT_TRUE(SameBits(want, got, d, Context("rotate_dense", p, seed) + " rows=" +
                                             std::to_string(rows)));
    }
  }
}

TEST_P(WriteStepTest, FwhtMatchesScalar) {
  uint64_t seed = 2000;
  for (int d : kHeadDims) {
    for (int block = 16; block <= d; block *= 2) {
      WriteParams p = ShapeParams(d, 32, 2);
      p.rotation = RotationKind::kHadamard;
      p.hadamard_block = block;
      ++seed;
      const std::vector<float> x = TestRows(p, seed);
      const size_t n = x.size() / d;
      std::vector<float> want(x), got(x);
      scalar().write.fwht(want.data(), n, p);
      backend().write.fwht(got.data(), n, p);
      EXPECT_TRUE(SameBits(want, got, d, Context("fwht", p, seed)));
    }
  }
}

TEST_P(WriteStepTest, BitrevMatchesScalar) {
  uint64_t seed = 3000;
  for (int d : kHeadDims) {
    const WriteParams p = ShapeParams(d, 32, 2);
    ++seed;
    const std::vector<float> x = TestRows(p, seed);
    const size_t n = x.size() / d;
    std::vector<float> want(x.size()), got(x.size());
    scalar().write.bitrev(x.data(), want.data(), n, p);
    backend().write.bitrev(x.data(), got.data(), n, p);
    EXPECT_TRUE(SameBits(want, got, d, Context("bitrev", p, seed)));
  }
}

TEST_P(WriteStepTest, ClipMatchesScalar) {
  uint64_t seed = 4000;
  for (int d : kHeadDims) {
    for (float rho : kClips) {
      WriteParams p = ShapeParams(d, 32, 2);
      p.clip = rho;
      ++seed;
      const std::vector<float> x = TestRows(p, seed);
      const size_t n = x.size() / d;
      std::vector<float> want(x), got(x);
      std::vector<float> want_tau(n), got_tau(n);
      scalar().write.clip(want.data(), want_tau.data(), n, p);
      backend().write.clip(got.data(), got_tau.data(), n, p);
      EXPECT_TRUE(SameBits(want_tau, got_tau, 1, Context("clip tau", p, seed)));
      EXPECT_TRUE(SameBits(want, got, d, Context("clip rows", p, seed)));
    }
  }
}

TEST_P(WriteStepTest, QuantizeMatchesScalar) {
  uint64_t seed = 5000;
  ForEachQuantizerShape([&](const WriteParams& p) {
    const int d = p.head_dim;
    ++seed;
    const std::vector<float> x = TestRows(p, seed);
    const size_t n = x.size() / d;
    const size_t groups = static_cast<size_t>(p.num_groups());
    std::vector<uint8_t> want_codes(n * d), got_codes(n * d);
    std::vector<uint16_t> want_scale(n * groups), got_scale(n * groups);
    std::vector<uint16_t> want_min(n * groups), got_min(n * groups);
    scalar().write.quantize(x.data(), want_codes.data(), want_scale.data(), want_min.data(), n, p);
    backend().write.quantize(x.data(), got_codes.data(), got_scale.data(), got_min.data(), n, p);
    EXPECT_TRUE(SameBits(want_scale, got_scale, groups, Context("quantize scale", p, seed)));
    EXPECT_TRUE(SameBits(want_min, got_min, groups, Context("quantize min", p, seed)));
    EXPECT_TRUE(SameBits(want_codes, got_codes, d, Context("quantize codes", p, seed)));
  });
}

TEST_P(WriteStepTest, PackAndUnpackMatchScalar) {
  uint64_t seed = 6000;
  for (int d : kHeadDims) {
    for (int bits : kBits) {
      const WriteParams p = ShapeParams(d, 32, bits);
      ++seed;
      std::mt19937_64 rng(seed);
      const size_t n = 37;
      const size_t bytes = static_cast<size_t>(p.code_bytes());
      std::vector<uint8_t> codes(n * d);
      for (auto& c : codes) c = static_cast<uint8_t>(rng() % (p.levels() + 1));
      std::vector<uint8_t> want(n * bytes), got(n * bytes);
      scalar().write.pack(codes.data(), want.data(), n, p);
      backend().write.pack(codes.data(), got.data(), n, p);
      EXPECT_TRUE(SameBits(want, got, bytes, Context("pack", p, seed)));

      std::vector<uint8_t> packed(n * bytes);
      for (auto& b : packed) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> want_codes(n * d), got_codes(n * d);
      scalar().write.unpack(packed.data(), want_codes.data(), n, p);
      backend().write.unpack(packed.data(), got_codes.data(), n, p);
      EXPECT_TRUE(SameBits(want_codes, got_codes, d, Context("unpack", p, seed)));
    }
  }
}

TEST_P(WriteStepTest, DequantizeMatchesScalar) {
  uint64_t seed = 7000;
  ForEachQuantizerShape([&](const WriteParams& p) {
    const int d = p.head_dim;
    ++seed;
    std::mt19937_64 rng(seed);
    const size_t n = 41;
    const size_t groups = static_cast<size_t>(p.num_groups());
    std::vector<uint8_t> codes(n * d);
    for (auto& c : codes) c = static_cast<uint8_t>(rng() % (p.levels() + 1));
    // Finite bf16 scale (non-negative, as the quantizer makes them) and min, over the whole
    // exponent range that keeps q*s + m finite; zeros and subnormals included.
    std::vector<uint16_t> scale(n * groups), min(n * groups);
    for (size_t i = 0; i < scale.size(); ++i) {
      const uint16_t exponent = static_cast<uint16_t>(rng() % 250);  // below 2^123
      scale[i] = static_cast<uint16_t>((exponent << 7) | (rng() & 0x7f));
      min[i] = static_cast<uint16_t>((rng() & 0x8000) | (rng() % 250) << 7 | (rng() & 0x7f));
      if (rng() % 16 == 0) scale[i] = 0;
    }
    std::vector<float> want(n * d), got(n * d);
    scalar().write.dequantize(codes.data(), scale.data(), min.data(), want.data(), n, p);
    backend().write.dequantize(codes.data(), scale.data(), min.data(), got.data(), n, p);
    EXPECT_TRUE(SameBits(want, got, d, Context("dequantize", p, seed)));
  });
}

// The whole pipeline, every field of QuantizedRows, over every supported configuration.
TEST_P(WriteStepTest, QuantizeRowsMatchesScalar) {
  uint64_t seed = 8000;
  for (int d : kHeadDims) {
    const std::vector<float> dense = RandomMatrix(d, 77 + d);
    std::vector<std::pair<RotationKind, int>> rotations = {{RotationKind::kIdentity, 0},
                                                          {RotationKind::kDense, 0}};
    for (int block = 16; block <= d; block *= 2) rotations.push_back({RotationKind::kHadamard, block});
    for (int g : kGroups) {
      if (g > d) continue;
      for (int bits : kBits) {
        for (float rho : kClips) {
          for (const auto& [kind, block] : rotations) {
            for (bool bitrev : {false, true}) {
              WriteParams p = ShapeParams(d, g, bits);
              p.clip = rho;
              p.rotation = kind;
              p.hadamard_block = block;
              p.bitrev = bitrev;
              ++seed;
              const std::vector<float> x = TestRows(p, seed, /*moderate_only=*/true);
              const size_t n = x.size() / d;
              const std::string context = Context("QuantizeRows", p, seed);
              const QuantizedRows want = QuantizeRows(scalar(), p, dense.data(), x.data(), n);
              const QuantizedRows got = QuantizeRows(backend(), p, dense.data(), x.data(), n);
              const size_t groups = static_cast<size_t>(p.num_groups());
              ASSERT_TRUE(SameBits(want.rotated, got.rotated, d, context + " rotated"));
              ASSERT_TRUE(SameBits(want.tau, got.tau, 1, context + " tau"));
              ASSERT_TRUE(SameBits(want.scale, got.scale, groups, context + " scale"));
              ASSERT_TRUE(SameBits(want.min, got.min, groups, context + " min"));
              ASSERT_TRUE(SameBits(want.codes, got.codes, d, context + " codes"));
              ASSERT_TRUE(SameBits(want.packed, got.packed,
                                   static_cast<size_t>(p.code_bytes()), context + " packed"));
              ASSERT_TRUE(SameBits(want.dequantized, got.dequantized, d,
                                   context + " dequantized"));
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Write, WriteStepTest,
                         ::testing::ValuesIn(BackendNames(/*include_scalar=*/false)), ParamName);

}  // namespace
}  // namespace kvq::cpu::testing
