// The validating layer (write_path.h): what it rejects, with which error and message, and
// that it runs the stages in the spec's order.
#include "kvq/cpu_ref/write_path.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

using conformance::RowKind;
using testbed::BitsEqual;
using testbed::ExpectError;

// Validation order matters here, so Unchecked(): Build() would reject the bad values itself.
WriteParams Params(RotationKind kind = RotationKind::kIdentity, int d = 64) {
  return testbed::Write().head_dim(d).group(32).bits(2).clip(0.92f).rotation(kind).Unchecked();
}

// n rows of one kind.
std::vector<float> Rows(RowKind kind, const WriteParams& p, size_t n, uint64_t seed) {
  conformance::SplitMix64 rng(seed);
  return conformance::MakeRows(std::vector<RowKind>(n, kind), p, &rng, nullptr);
}

TEST(WritePathTest, RejectsInvalidParams) {
  const std::vector<float> x(64, 1.0f);
  WriteParams p = Params();
  p.head_dim = 96;
  ExpectError([&] { QuantizeRows(BestBackend(), p, nullptr, x.data(), 1); },
              ErrorCode::kInvalidArgument, {"96"});
  p = Params();
  p.clip = 0.0f;
  ExpectError([&] { QuantizeRows(BestBackend(), p, nullptr, x.data(), 1); },
              ErrorCode::kInvalidArgument, {"clip"});
  p = Params();
  p.group = 128;  // > head_dim 64
  ExpectError([&] { QuantizeRows(BestBackend(), p, nullptr, x.data(), 1); },
              ErrorCode::kInvalidArgument, {"128"});
  p = Params(RotationKind::kHadamard);
  p.hadamard_block = 8;
  std::vector<float> y(64);
  ExpectError([&] { Rotate(BestBackend(), p, nullptr, x.data(), y.data(), 1); },
              ErrorCode::kInvalidArgument, {"8"});
}

TEST(WritePathTest, RejectsNullPointers) {
  const std::vector<float> x(64, 1.0f);
  std::vector<float> y(64);
  ExpectError([&] { QuantizeRows(BestBackend(), Params(), nullptr, nullptr, 1); },
              ErrorCode::kInvalidArgument, {"null"});
  ExpectError([&] { Rotate(BestBackend(), Params(), nullptr, x.data(), nullptr, 1); },
              ErrorCode::kInvalidArgument, {"null"});
  ExpectError([&] { Rotate(BestBackend(), Params(RotationKind::kDense), nullptr, x.data(),
                           y.data(), 1); },
              ErrorCode::kInvalidArgument, {"null"});
  ExpectError([&] { RotateInverse(BestBackend(), Params(RotationKind::kDense), nullptr, x.data(),
                                  y.data(), 1); },
              ErrorCode::kInvalidArgument, {"null"});
  // Zero rows need no buffers.
  const QuantizedRows empty = QuantizeRows(BestBackend(), Params(), nullptr, nullptr, 0);
  EXPECT_EQ(empty.rows, 0u);
  EXPECT_TRUE(empty.Output("codes").bytes.empty());
}

TEST(WritePathTest, RejectsNonFiniteInputNamingRowColumnAndValue) {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(3 * 64, 0.5f);
    x[2 * 64 + 17] = bad;
    std::vector<float> y(x.size());
    ExpectError([&] { QuantizeRows(BestBackend(), Params(), nullptr, x.data(), 3); },
                ErrorCode::kNonFinite, {"row 2", "column 17"});
    ExpectError([&] { Rotate(ScalarBackend(), Params(RotationKind::kHadamard), nullptr, x.data(),
                             y.data(), 3); },
                ErrorCode::kNonFinite, {"row 2", "column 17"});
    ExpectError([&] { RotateInverse(ScalarBackend(), Params(), nullptr, x.data(), y.data(), 3); },
                ErrorCode::kNonFinite, {"row 2", "column 17"});
  }
  // The message names the value itself.
  std::vector<float> x(64, 0.5f);
  x[5] = std::numeric_limits<float>::infinity();
  ExpectError([&] { QuantizeRows(BestBackend(), Params(), nullptr, x.data(), 1); },
              ErrorCode::kNonFinite, {"inf", "row 0", "column 5"});
}

TEST(WritePathTest, RejectsNonFiniteRotationMatrix) {
  std::vector<float> r(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) r[i * 64 + i] = 1.0f;
  r[3 * 64 + 9] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x(64, 1.0f);
  ExpectError([&] { QuantizeRows(BestBackend(), Params(RotationKind::kDense), r.data(), x.data(),
                                 1); },
              ErrorCode::kNonFinite, {"R[3][9]"});
}

// Finite inputs whose rotation leaves |x~| <= 2^126 are accepted; above, rejected with the
// rotated value's row and column. Identity: the rotated value is the input.
TEST(WritePathTest, RejectsRotatedMagnitudeAbove2To126) {
  std::vector<float> x(2 * 64, 1.0f);
  x[64 + 33] = kMaxRotatedAbs;  // exactly 2^126: accepted
  EXPECT_NO_THROW(QuantizeRows(BestBackend(), Params(), nullptr, x.data(), 2));
  x[64 + 33] = -std::nextafter(kMaxRotatedAbs, std::numeric_limits<float>::infinity());
  ExpectError([&] { QuantizeRows(BestBackend(), Params(), nullptr, x.data(), 2); },
              ErrorCode::kNonFinite, {"row 1", "column 33"});
  // A dense rotation that overflows to Inf from finite input is rejected the same way.
  std::vector<float> r(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) r[i * 64] = 1.0f;  // y[0] = sum of x
  std::vector<float> big(64, 3e38f);
  ExpectError([&] { QuantizeRows(BestBackend(), Params(RotationKind::kDense), r.data(),
                                 big.data(), 1); },
              ErrorCode::kNonFinite, {"row 0", "column 0"});
}

TEST(WritePathTest, BackendByNameRejectsUnknownNames) {
  EXPECT_EQ(BackendByName("scalar").hwy_target, 0);
  ExpectError([] { BackendByName("hwy_quantum"); }, ErrorCode::kInvalidArgument,
              {"hwy_quantum", "scalar"});
  EXPECT_GE(Backends().size(), 2u);
  EXPECT_EQ(Backends().front().name, "scalar");
  EXPECT_NE(BestBackend().hwy_target, 0);
}

// QuantizeRows is exactly the stages in the spec's order: rotate, bit reversal, clip,
// quantize, pack, dequantize (here on the scalar kernels, called one by one).
TEST(WritePathTest, QuantizeRowsRunsTheStagesInOrder) {
  for (RotationKind kind : {RotationKind::kIdentity, RotationKind::kDense,
                            RotationKind::kHadamard}) {
    WriteParams p = Params(kind, 128);
    p.bitrev = true;
    p.group = 64;
    const size_t n = 9, d = 128;
    const std::vector<float> x = Rows(RowKind::kSparseSpikes, p, n, 42);
    conformance::SplitMix64 matrix_rng(5);
    const std::vector<float> rot = testbed::RandomMatrix(128, &matrix_rng);
    const WriteKernels& k = ScalarBackend().write;
    std::vector<float> rotated(n * d), permuted(n * d);
    if (kind == RotationKind::kDense) {
      k.rotate_dense(x.data(), rot.data(), rotated.data(), n, p);
    } else {
      rotated = x;
      if (kind == RotationKind::kHadamard) k.fwht(rotated.data(), n, p);
    }
    k.bitrev(rotated.data(), permuted.data(), n, p);
    std::vector<float> clipped = permuted, tau(n);
    k.clip(clipped.data(), tau.data(), n, p);
    std::vector<uint8_t> codes(n * d), packed(n * 32);
    std::vector<uint16_t> scale(n * 2), min(n * 2);
    k.quantize(clipped.data(), codes.data(), scale.data(), min.data(), n, p);
    k.pack(codes.data(), packed.data(), n, p);
    std::vector<float> deq(n * d);
    k.dequantize(codes.data(), scale.data(), min.data(), deq.data(), n, p);

    const QuantizedRows q = QuantizeRows(ScalarBackend(), p, rot.data(), x.data(), n);
    const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
    const std::vector<uint8_t> q_packed = q.Values<uint8_t>("packed");
    const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
    const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
    const std::string kind_name = RotationKindName(kind);
    EXPECT_TRUE(BitsEqual(kind_name + " rotated", permuted, q.rotated, d));
    EXPECT_TRUE(BitsEqual(kind_name + " tau", tau, q.tau, 1));
    EXPECT_TRUE(BitsEqual(kind_name + " codes", codes, q_codes, d));
    EXPECT_TRUE(BitsEqual(kind_name + " packed", packed, q_packed, 32));
    EXPECT_TRUE(BitsEqual(kind_name + " scale", scale, q_scale, 2));
    EXPECT_TRUE(BitsEqual(kind_name + " min", min, q_min, 2));
    EXPECT_TRUE(BitsEqual(kind_name + " dequantized", deq, q.dequantized, d));
    // Rotate() alone gives the same rotated rows, in place too.
    std::vector<float> y(n * d);
    Rotate(ScalarBackend(), p, rot.data(), x.data(), y.data(), n);
    EXPECT_TRUE(BitsEqual(kind_name + " Rotate", permuted, y, d));
    std::vector<float> in_place = x;
    Rotate(ScalarBackend(), p, rot.data(), in_place.data(), in_place.data(), n);
    EXPECT_TRUE(BitsEqual(kind_name + " Rotate in place", permuted, in_place, d));
  }
}

// RotateInverse undoes Rotate: exactly for identity and bit reversal (permutations), within
// fp32 rounding for FWHT and for an orthogonal dense matrix (here a signed permutation
// scaled by 1: exact too) and a Hadamard-like dense matrix.
TEST(WritePathTest, RotateInverseUndoesRotate) {
  const size_t n = 5, d = 128;
  const std::vector<float> x = Rows(RowKind::kHeavyTail, Params(RotationKind::kIdentity, 128), n, 7);
  // Signed permutation: R[i][pi(i)] = ±1.
  std::vector<float> perm(d * d, 0.0f);
  for (size_t i = 0; i < d; ++i) perm[i * d + (i * 37 + 11) % d] = (i % 3 == 0) ? -1.0f : 1.0f;
  for (const Backend& backend : Backends()) {
    for (bool bitrev : {false, true}) {
      for (RotationKind kind : {RotationKind::kIdentity, RotationKind::kDense,
                                RotationKind::kHadamard}) {
        WriteParams p = Params(kind, static_cast<int>(d));
        p.bitrev = bitrev;
        std::vector<float> y(n * d), back(n * d);
        Rotate(backend, p, perm.data(), x.data(), y.data(), n);
        RotateInverse(backend, p, perm.data(), y.data(), back.data(), n);
        const std::string context = backend.name + " " + RotationKindName(kind) +
                                    (bitrev ? " +bitrev" : "");
        if (kind != RotationKind::kHadamard) {
          EXPECT_TRUE(BitsEqual(context, x, back, d));
        } else {
          // Two normalised FWHTs: relative error <= 2 (log2 b + 2) 2^-24 in norm (the
          // derivation is in fuzz/write_props_test.cc).
          for (size_t r = 0; r < n; ++r) {
            double err = 0, norm = 0;
            for (size_t j = 0; j < d; ++j) {
              const double e = static_cast<double>(back[r * d + j]) - x[r * d + j];
              err += e * e;
              norm += static_cast<double>(x[r * d + j]) * x[r * d + j];
            }
            EXPECT_LE(std::sqrt(err), 2.0 * (7 + 2) * 0x1p-24 * std::sqrt(norm) * (1 + 1e-5))
                << context << " row " << r;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvq::cpu
