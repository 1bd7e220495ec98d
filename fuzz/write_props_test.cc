// Properties of the write path (RapidCheck), each checked on every backend of Backends().
// Inputs are edge-biased: zeros of both signs, subnormals, huge values, constant rows and rows
// of a few repeated values (ties for the clip's order statistic and the quantizer's rounding).
// Replay a failure with RC_PARAMS="seed=<seed printed by RapidCheck>".
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params_builder.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/rapidcheck.h"

namespace kvq::cpu {
namespace {

constexpr double kU = 0x1p-24;  // fp32 unit roundoff

// ---------------------------------------------------------------- generators

// A finite float with |x| < 2^(max_exponent + 1), biased towards the cases that break code.
rc::Gen<float> EdgeFloat(int max_exponent) {
  const uint32_t max_biased = static_cast<uint32_t>(max_exponent + 127);
  auto from_parts = [](const std::tuple<bool, uint32_t, uint32_t>& parts) {
    const uint32_t sign = std::get<0>(parts) ? 0x80000000u : 0u;
    return F32FromBits(sign | (std::get<1>(parts) << 23) | std::get<2>(parts));
  };
  return rc::gen::weightedOneOf<float>({
      // Multiples of 1/100 in [-40, 40]: many equal magnitudes and quantizer ties.
      {4, rc::gen::map(rc::gen::inRange<int>(-4000, 4001),
                       [](int i) { return static_cast<float>(i) * 0.01f; })},
      // Any finite value up to the bound.
      {3, rc::gen::map(rc::gen::tuple(rc::gen::arbitrary<bool>(),
                                      rc::gen::inRange<uint32_t>(0, max_biased + 1),
                                      rc::gen::inRange<uint32_t>(0, 1u << 23)),
                       from_parts)},
      {1, rc::gen::element(0.0f, -0.0f)},
      // Subnormals.
      {1, rc::gen::map(rc::gen::tuple(rc::gen::arbitrary<bool>(), rc::gen::just(0u),
                                      rc::gen::inRange<uint32_t>(1, 1u << 23)),
                       from_parts)},
      // Huge: the top four binades allowed.
      {1, rc::gen::map(rc::gen::tuple(rc::gen::arbitrary<bool>(),
                                      rc::gen::inRange<uint32_t>(max_biased - 3, max_biased + 1),
                                      rc::gen::inRange<uint32_t>(0, 1u << 23)),
                       from_parts)},
  });
}

// A row of d finite values below 2^(max_exponent + 1) in magnitude.
rc::Gen<std::vector<float>> EdgeRow(size_t d, int max_exponent) {
  return rc::gen::weightedOneOf<std::vector<float>>({
      {4, rc::gen::container<std::vector<float>>(d, EdgeFloat(max_exponent))},
      // Constant rows.
      {1, rc::gen::map(EdgeFloat(max_exponent), [d](float v) { return std::vector<float>(d, v); })},
      // A few distinct values with random signs: ties straddle every order statistic and
      // both +tau and -tau occur.
      {2, rc::gen::exec([d, max_exponent] {
         const auto values = *rc::gen::container<std::vector<float>>(3, EdgeFloat(max_exponent));
         const auto picks = *rc::gen::container<std::vector<int>>(d, rc::gen::inRange(0, 6));
         std::vector<float> row(d);
         for (size_t j = 0; j < d; ++j) {
           const float v = values[static_cast<size_t>(picks[j] % 3)];
           row[j] = picks[j] >= 3 ? -v : v;
         }
         return row;
       })},
  });
}

// n rows (1..5) of d values.
std::vector<float> GenRows(size_t d, int max_exponent, size_t* n) {
  *n = static_cast<size_t>(*rc::gen::inRange(1, 6));
  std::vector<float> rows;
  for (size_t r = 0; r < *n; ++r) {
    const auto row = *EdgeRow(d, max_exponent);
    rows.insert(rows.end(), row.begin(), row.end());
  }
  return rows;
}

double Norm(const float* x, size_t d) {
  double sum = 0;
  for (size_t j = 0; j < d; ++j) sum += static_cast<double>(x[j]) * x[j];
  return std::sqrt(sum);
}

// ---------------------------------------------------------------- pack / unpack

RC_GTEST_PROP(WriteProps, UnpackOfPackIsIdentity, ()) {
  const WriteParams p = params::Write()
                            .head_dim(*rc::gen::element(64, 128, 256))
                            .group(32)
                            .bits(*rc::gen::element(2, 4));
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t n = static_cast<size_t>(*rc::gen::inRange(1, 5));
  const auto codes = *rc::gen::container<std::vector<uint8_t>>(
      n * d, rc::gen::inRange<uint8_t>(0, static_cast<uint8_t>(p.levels() + 1)));
  for (const Backend& backend : Backends()) {
    std::vector<uint8_t> packed(n * static_cast<size_t>(p.packed_bytes()));
    std::vector<uint8_t> unpacked(n * d);
    backend.write.pack(codes.data(), packed.data(), n, p);
    backend.write.unpack(packed.data(), unpacked.data(), n, p);
    RC_ASSERT(unpacked == codes);
  }
}

// ---------------------------------------------------------------- quantize

// Reconstruction bound for an element x of a group with exact lo, hi (of the clipped row),
// s = fl((hi - lo)/L), ŝ = bf16(s), m̂ = bf16(lo), x̂ = fl(q ŝ + m̂):
//   t = fl(fl(x - m̂)/ŝ) = (x - m̂)/ŝ · (1+e1)(1+e2), so |t ŝ - (x - m̂)| <= 2.0001 u |x - m̂|.
//   (a) 0 <= t <= L: q = rint(t), |q - t| <= 1/2, |q ŝ + m̂ - x| <= ŝ/2 + 2.0001 u |x - m̂|.
//   (b) t > L, q = L: the error is (x - m̂) - L ŝ <= (hi - lo) + (lo - m̂) - L ŝ
//       <= |hi - lo - L s| + L |s - ŝ| + |lo - m̂| (when x - m̂ <= L ŝ, t > L only through
//       rounding and the error is below the rounding term).
//   (c) t < 0, q = 0: the error is m̂ - x <= m̂ - lo <= |lo - m̂| (plus the rounding term).
//   (d) ŝ == 0: q = 0 and |x - m̂| <= (hi - lo) + |lo - m̂|, which (b)'s bound covers since
//       then L |s - ŝ| = L s and |hi - lo - L s| + L s >= hi - lo.
// The final sum rounds once more: + u |x̂|. So
//   |x̂ - x| <= max(ŝ/2, |hi - lo - L s| + L |s - ŝ| + |lo - m̂|)
//              + 2.0001 u (|x| + |m̂|) + u |x̂|.
// ŝ rounding down (ŝ < s) is what case (b) pays for: the top of the range sits above L ŝ.
// All terms are evaluated in double, where they are exact or carry relative error ~1e-16.
RC_GTEST_PROP(WriteProps, CodesInRangeAndUnclippedElementsReconstructWithinBound, ()) {
  WriteParams p = *testbed::ArbitraryQuantizerParams();
  p.rotation = *rc::gen::element(RotationKind::kIdentity, RotationKind::kHadamard);
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  // Identity rows up to 2^126 (the accepted maximum); Hadamard rows small enough to stay there.
  const std::vector<float> x = GenRows(d, p.rotation == RotationKind::kIdentity ? 125 : 110, &n);
  const double levels = p.levels();
  const size_t group = static_cast<size_t>(p.group);
  for (const Backend& backend : Backends()) {
    const QuantizedRows q = QuantizeRows(backend, p, nullptr, x.data(), n);
    const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
    const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
    const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
    for (size_t r = 0; r < n; ++r) {
      const float tau = q.tau[r];
      for (size_t g = 0; g < d / group; ++g) {
        const size_t base = r * d + g * group;
        // The clipped group, as the quantizer saw it.
        std::vector<float> clipped(group);
        for (size_t j = 0; j < group; ++j) {
          const float v = q.rotated[base + j];
          clipped[j] = v > tau ? tau : (v < -tau ? -tau : v);
        }
        const float lo = *std::min_element(clipped.begin(), clipped.end()) + 0.0f;
        const float hi = *std::max_element(clipped.begin(), clipped.end()) + 0.0f;
        const float s = (hi - lo) / static_cast<float>(levels);
        const size_t gi = r * (d / group) + g;
        RC_ASSERT(q_scale[gi] == Bf16FromF32(s));
        RC_ASSERT(q_min[gi] == Bf16FromF32(lo));
        const double sf = F32FromBf16(q_scale[gi]);
        const double mf = F32FromBf16(q_min[gi]);
        const double top = std::fabs(static_cast<double>(hi) - lo - levels * s) +
                           levels * std::fabs(static_cast<double>(s) - sf) +
                           std::fabs(static_cast<double>(lo) - mf);
        const double main_term = std::max(sf / 2, top);
        for (size_t j = 0; j < group; ++j) {
          RC_ASSERT(q_codes[base + j] <= p.levels());
          const float v = q.rotated[base + j];
          if (!(v <= tau && v >= -tau)) continue;  // clipped: not covered by the bound
          const double xhat = q.dequantized[base + j];
          const double bound =
              main_term + 2.0001 * kU * (std::fabs(v) + std::fabs(mf)) + kU * std::fabs(xhat);
          if (!(std::fabs(xhat - v) <= bound)) {
            RC_FAIL("backend " + backend.name + " row " + std::to_string(r) + " column " +
                    std::to_string(g * group + j) + ": x " + std::to_string(v) + " x^ " +
                    std::to_string(xhat) + " error " + std::to_string(std::fabs(xhat - v)) +
                    " > bound " + std::to_string(bound));
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- FWHT

// Forward error of one normalised FWHT of a block of b = 2^m values (fl(z) = z(1+δ), |δ| <= u):
// each of the m butterfly stages maps ĉ to B ĉ with ‖B‖ = √2 and adds an error of norm
// <= u ‖B ĉ‖, so after m stages ‖ĉ_m - H̃ x‖ <= m u 2^{m/2} (1+u)^{m-1} ‖x‖; the scale
// s̃ = fl(1/√b) = (1+ε)/√b and the final product add 2u, so ‖ŷ - Hx‖ <= (m+2) u ‖x‖ (1 + 1e-5).
// Applying it to ŷ again (H·H = I, H orthogonal): ‖ẑ - x‖ <= ‖ẑ - Hŷ‖ + ‖ŷ - Hx‖
// <= 2 (m+2) u ‖x‖ (1 + 1e-5). Underflow: only the scale product can underflow inexactly
// (sums of floats in the subnormal range are exact); each adds at most 2^-150 per element:
// + 2 √d 2^-150 (1 + 1e-5). Blocks add in quadrature, so the bound holds for the whole row.
RC_GTEST_PROP(WriteProps, FwhtTwiceIsIdentityWithinBound, ()) {
  const int head_dim = *rc::gen::element(64, 128, 256);
  const int block = *rc::gen::element(16, 32, 64, 128, 256);
  RC_PRE(block <= head_dim);
  const WriteParams p = params::Write().head_dim(head_dim).group(32).hadamard(block);
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  const std::vector<float> x = GenRows(d, 100, &n);  // no overflow: b * 2^101 < 2^128
  const double m = std::log2(static_cast<double>(p.hadamard_block));
  for (const Backend& backend : Backends()) {
    std::vector<float> y = x;
    backend.write.fwht(y.data(), n, p);
    backend.write.fwht(y.data(), n, p);
    for (size_t r = 0; r < n; ++r) {
      double err = 0;
      for (size_t j = 0; j < d; ++j) {
        const double e = static_cast<double>(y[r * d + j]) - x[r * d + j];
        err += e * e;
      }
      const double bound = 2 * (m + 2) * kU * Norm(x.data() + r * d, d) * (1 + 1e-5) +
                           2 * std::sqrt(static_cast<double>(d)) * 0x1p-150 * (1 + 1e-5);
      RC_ASSERT(std::sqrt(err) <= bound);
    }
  }
}

// ---------------------------------------------------------------- bit reversal

RC_GTEST_PROP(WriteProps, BitrevIsAnInvolution, ()) {
  const WriteParams p = params::Write().head_dim(*rc::gen::element(64, 128, 256)).group(32);
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  const std::vector<float> x = GenRows(d, 127, &n);
  for (const Backend& backend : Backends()) {
    std::vector<float> y(x.size()), z(x.size());
    backend.write.bitrev(x.data(), y.data(), n, p);
    backend.write.bitrev(y.data(), z.data(), n, p);
    RC_ASSERT(std::memcmp(x.data(), z.data(), x.size() * sizeof(float)) == 0);
  }
}

// ---------------------------------------------------------------- dense rotation

// A random orthogonal Q (modified Gram-Schmidt, twice, in double) rounded to fp32 R.
// Bound: ŷ_j = fl(Σ_i x_i R_ij) with d rounded products and d-1 rounded sums:
//   |ŷ_j - (xR)_j| <= γ_d Σ_i |x_i| |R_ij|,  γ_d = d u / (1 - d u);
// R - Q has |R_ij - Q_ij| <= u |Q_ij| <= u (1+u) |R_ij|;  ‖xQ‖ = ‖x‖ up to
// ε_Q = ‖QᵀQ - I‖_F (measured). Hence
//   |‖ŷ‖ - ‖x‖| <= (γ_d + u (1+u)) ‖ |x| |R| ‖ + ε_Q ‖x‖ + (underflowing products:
//   <= d 2^-150 per output) √d d 2^-150, plus 1e-12 ‖x‖ for the double arithmetic here.
RC_GTEST_PROP(WriteProps, OrthogonalRotationPreservesNorms, ()) {
  const WriteParams p = params::Write().head_dim(*rc::gen::element(64, 128, 256)).group(32);
  const size_t d = static_cast<size_t>(p.head_dim);
  const uint64_t seed = *rc::gen::arbitrary<uint64_t>();
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> q(d * d);  // rows are the orthonormal vectors
  for (double& v : q) v = normal(rng);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < d; ++i) {
      double* qi = q.data() + i * d;
      for (size_t k = 0; k < i; ++k) {
        const double* qk = q.data() + k * d;
        double dot = 0;
        for (size_t j = 0; j < d; ++j) dot += qi[j] * qk[j];
        for (size_t j = 0; j < d; ++j) qi[j] -= dot * qk[j];
      }
      double norm = 0;
      for (size_t j = 0; j < d; ++j) norm += qi[j] * qi[j];
      norm = std::sqrt(norm);
      for (size_t j = 0; j < d; ++j) qi[j] /= norm;
    }
  }
  double eps_q = 0;
  for (size_t a = 0; a < d; ++a) {
    for (size_t b = 0; b < d; ++b) {
      double dot = 0;
      for (size_t j = 0; j < d; ++j) dot += q[a * d + j] * q[b * d + j];
      eps_q += (dot - (a == b ? 1.0 : 0.0)) * (dot - (a == b ? 1.0 : 0.0));
    }
  }
  eps_q = std::sqrt(eps_q);
  std::vector<float> r(d * d);
  for (size_t i = 0; i < d * d; ++i) r[i] = static_cast<float>(q[i]);

  size_t n = 0;
  const std::vector<float> x = GenRows(d, 100, &n);
  const double gamma = d * kU / (1 - d * kU);
  for (const Backend& backend : Backends()) {
    std::vector<float> y(x.size());
    backend.write.rotate_dense(x.data(), r.data(), y.data(), n, p);
    for (size_t row = 0; row < n; ++row) {
      const float* xr = x.data() + row * d;
      double abs_norm = 0;  // ‖ |x| |R| ‖
      for (size_t j = 0; j < d; ++j) {
        double sum = 0;
        for (size_t i = 0; i < d; ++i) sum += std::fabs(static_cast<double>(xr[i])) * std::fabs(r[i * d + j]);
        abs_norm += sum * sum;
      }
      abs_norm = std::sqrt(abs_norm);
      const double nx = Norm(xr, d);
      const double bound = (gamma + kU * (1 + kU)) * abs_norm + (eps_q + 1e-12) * nx +
                           std::sqrt(static_cast<double>(d)) * d * 0x1p-150;
      const double ny = Norm(y.data() + row * d, d);
      RC_ASSERT(std::fabs(ny - nx) <= bound);
    }
  }
}

// ---------------------------------------------------------------- clip

// tau is one of the row's magnitudes and exactly the order statistic at
// k = min(floor(rho d), d-1): #{|x| < tau} <= k < #{|x| <= tau} (spec/differences.md, "clip
// threshold": no interpolation, no bisection).
RC_GTEST_PROP(WriteProps, TauIsTheOrderStatisticOfTheMagnitudes, ()) {
  const WriteParams p = *testbed::ArbitraryQuantizerParams();
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  const std::vector<float> x = GenRows(d, 127, &n);
  const size_t k = std::min(static_cast<size_t>(std::floor(static_cast<double>(p.clip) * d)), d - 1);
  for (const Backend& backend : Backends()) {
    std::vector<float> y = x;
    std::vector<float> tau(n);
    backend.write.clip(y.data(), tau.data(), n, p);
    for (size_t r = 0; r < n; ++r) {
      size_t below = 0, at_or_below = 0;
      bool found = false;
      for (size_t j = 0; j < d; ++j) {
        const float a = std::fabs(x[r * d + j]);
        below += a < tau[r];
        at_or_below += a <= tau[r];
        found = found || F32Bits(a) == F32Bits(tau[r]);
      }
      RC_ASSERT(found);
      RC_ASSERT(below <= k);
      RC_ASSERT(k < at_or_below);
    }
  }
}

// spec/differences.md, "clip at ρ = 1": the authors' decode flush clips the largest value at
// ρ = 1; kvq's τ is max|x̃| and the row is unchanged.
RC_GTEST_PROP(WriteProps, ClipWithRhoOneChangesNothing, ()) {
  const WriteParams p =
      params::Write().head_dim(*rc::gen::element(64, 128, 256)).group(32).clip(1.0f);
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  const std::vector<float> x = GenRows(d, 127, &n);
  for (const Backend& backend : Backends()) {
    std::vector<float> y = x;
    std::vector<float> tau(n);
    backend.write.clip(y.data(), tau.data(), n, p);
    RC_ASSERT(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
    for (size_t r = 0; r < n; ++r) {
      float max_abs = 0.0f;
      for (size_t j = 0; j < d; ++j) max_abs = std::max(max_abs, std::fabs(x[r * d + j]));
      RC_ASSERT(F32Bits(tau[r]) == F32Bits(max_abs));
    }
  }
}

// ---------------------------------------------------------------- validation

RC_GTEST_PROP(WriteProps, NonFiniteInputIsRejected, ()) {
  WriteParams p = *testbed::ArbitraryQuantizerParams();
  p.rotation = *rc::gen::element(RotationKind::kIdentity, RotationKind::kHadamard);
  const size_t d = static_cast<size_t>(p.head_dim);
  size_t n = 0;
  std::vector<float> x = GenRows(d, 60, &n);
  const size_t where = static_cast<size_t>(*rc::gen::inRange<size_t>(0, n * d));
  x[where] = *rc::gen::element(std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               F32FromBits(0xffc00001u));  // a negative NaN with payload
  for (const Backend& backend : Backends()) {
    bool rejected = false;
    try {
      QuantizeRows(backend, p, nullptr, x.data(), n);
    } catch (const Error& e) {
      rejected = e.code() == ErrorCode::kNonFinite &&
                 std::string(e.what()).find("row " + std::to_string(where / d)) !=
                     std::string::npos &&
                 std::string(e.what()).find("column " + std::to_string(where % d)) !=
                     std::string::npos;
    }
    RC_ASSERT(rejected);
  }
}

}  // namespace
}  // namespace kvq::cpu
