// Properties of spec 1.1's write path (RapidCheck), on every CPU backend:
//  - the norm: n^ is the bf16 of the row's length within the bound spec/numerics.md §5.1
//    derives, and n^·u reconstructs every element within its bound;
//  - the tile round trip: codes in range, (scale, min) of each (tile, channel) group exactly the
//    spec's, every unclipped element reconstructed within the quantizer's bound, unpack_tile of
//    pack_tile the identity, and the stored planes decode to the dequantized rows.
// Replay a failure with RC_PARAMS="seed=<seed printed by RapidCheck>".
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/common/params_builder.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/rapidcheck.h"

namespace kvq::cpu {
namespace {

constexpr double kU = 0x1p-24;  // fp32 unit roundoff
constexpr double kUBf16 = 0x1p-8;  // bf16 unit roundoff (8 significant bits)

// A finite value 2^e * m with e in [lo, hi], m in [1, 2), either sign; sometimes +-0.
rc::Gen<float> Value(int lo, int hi) {
  return rc::gen::exec([lo, hi] {
    if (*rc::gen::inRange(0, 16) == 0) return *rc::gen::element(0.0f, -0.0f);
    const int e = *rc::gen::inRange(lo, hi + 1);
    const float m = 1.0f + static_cast<float>(*rc::gen::inRange(0, 1 << 23)) * 0x1p-23f;
    return (*rc::gen::arbitrary<bool>() ? -1.0f : 1.0f) * std::ldexp(m, e);
  });
}

// Rows of m values whose exponents lie in a window of `spread` binades inside [-100, 60]
// (tiny rows whose squares underflow included; |x| < 2^61 keeps the square sum finite).
std::vector<float> Rows(size_t n, size_t m) {
  const int spread = *rc::gen::inRange(0, 40);
  const int lo = *rc::gen::inRange(-100, 60 - spread + 1);
  std::vector<float> x;
  for (size_t r = 0; r < n; ++r) {
    const bool constant = *rc::gen::inRange(0, 8) == 0;
    const float c = *Value(lo, lo + spread);
    for (size_t j = 0; j < m; ++j) x.push_back(constant ? c : *Value(lo, lo + spread));
  }
  return x;
}

// spec/numerics.md §5.1. S is the fp32 tree sum of M = 2^ceil(log2 m) squares (m of them real):
// each square carries a relative rounding error <= u and an absolute one <= 2^-150 (subnormal
// results), and each of the log2(M) levels of the tree adds a relative error <= u, so
// |S - ||x||^2| <= ((1+u)^(log2 M + 1) - 1) ||x||^2 + M 2^-150. Then n = sqrtf(S) adds u
// relative and n^ = bf16(n) u_bf16 relative (or 2^-134 absolute below bf16's normal range):
//   |n^ - ||x||| <= (u_bf16 + (log2 M + 3) u / 2 + u) ||x|| + sqrt(M) 2^-75 + 2^-134.
// And u = x / n^ is one IEEE division, so n^ u_j = x_j (1 + e), |e| <= u, unless u_j is
// subnormal (absolute error 2^-150 n^): |n^ u_j - x_j| <= u |x_j| + 2^-150 n^. n^ = 0 happens
// exactly when S = 0, i.e. when every square underflows: |x_j| <= 2^-75.
RC_GTEST_PROP(NormProps, StoredNormAndNormalizedRowWithinTheSpecsBound, ()) {
  const int d = *rc::gen::element(64, 128, 256);
  const int heads = *rc::gen::element(1, 2, 3, 8);
  const WriteParams p = params::Write().head_dim(d).tile(32).norm().norm_heads(heads);
  const size_t m = static_cast<size_t>(p.norm_span());
  const size_t n = static_cast<size_t>(*rc::gen::inRange(1, 4));
  const std::vector<float> x = Rows(n, m);
  size_t padded = 1;
  int levels = 0;
  while (padded < m) {
    padded *= 2;
    ++levels;
  }
  for (const Backend& backend : Backends()) {
    std::vector<float> u = x;
    std::vector<uint16_t> norms(n);
    backend.write.norm(u.data(), norms.data(), n, p);
    for (size_t r = 0; r < n; ++r) {
      double sum = 0.0, max_abs = 0.0;
      for (size_t j = 0; j < m; ++j) {
        sum += static_cast<double>(x[r * m + j]) * x[r * m + j];
        max_abs = std::max(max_abs, std::fabs(static_cast<double>(x[r * m + j])));
      }
      const double length = std::sqrt(sum);
      const double stored = F32FromBf16(norms[r]);
      const double bound = (kUBf16 + (levels + 3) * kU / 2 + kU) * length +
                           std::sqrt(static_cast<double>(padded)) * 0x1p-75 + 0x1p-134;
      RC_ASSERT(std::fabs(stored - length) <= bound);
      if (stored == 0.0) {
        RC_ASSERT(max_abs <= 0x1p-75);
        for (size_t j = 0; j < m; ++j) RC_ASSERT(F32Bits(u[r * m + j]) == 0u);
        continue;
      }
      for (size_t j = 0; j < m; ++j) {
        const double xj = x[r * m + j];
        const double err = std::fabs(stored * static_cast<double>(u[r * m + j]) - xj);
        if (!(err <= kU * std::fabs(xj) + 0x1p-150 * stored)) {
          RC_FAIL(backend.name + ": element " + std::to_string(j) + " of row " +
                  std::to_string(r) + " reconstructs with error " + std::to_string(err));
        }
      }
    }
  }
}

// The quantizer's bound (fuzz/write_props_test.cc, CodesInRangeAndUnclippedElementsReconstruct-
// WithinBound) for each (tile, channel) group: |x^ - x| <= max(s^/2, |hi - lo - L s| +
// L |s - s^| + |lo - m^|) + 2.0001 u (|x| + |m^|) + u |x^|, where x is the normalized, clipped
// value and x^ = q s^ + m^; with a norm the stored row is fl(n^ x^) (checked bit for bit).
RC_GTEST_PROP(TileProps, RoundTripWithinTheQuantizersBound, ()) {
  const WriteParams p = *testbed::ArbitraryTileParams();
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t n = tile * static_cast<size_t>(*rc::gen::inRange(1, 3));
  const std::vector<float> x = Rows(n, d);
  const double levels = p.levels();
  std::vector<float> rotation;
  if (p.rotation == RotationKind::kDense) {
    rotation.assign(d * d, 0.0f);  // a signed permutation: orthogonal, exact
    for (size_t i = 0; i < d; ++i) rotation[i * d + (i * 5 + 3) % d] = (i % 3 == 0) ? -1.0f : 1.0f;
  }
  for (const Backend& backend : Backends()) {
    const QuantizedRows q =
        QuantizeRows(backend, p, rotation.empty() ? nullptr : rotation.data(), x.data(), n);
    const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
    const std::vector<uint8_t> q_packed = q.Values<uint8_t>("packed");
    const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
    const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
    const std::vector<uint16_t> q_norm = p.norm ? q.Values<uint16_t>("norm") : q_min;
    const std::vector<float>& input = p.norm ? q.normalized : q.rotated;
    for (size_t t = 0; t < n / tile; ++t) {
      for (size_t j = 0; j < d; ++j) {
        std::vector<float> group(tile);
        std::vector<bool> clipped(tile);
        for (size_t r = 0; r < tile; ++r) {
          const size_t row = t * tile + r;
          const float v = input[row * d + j], tau = q.tau[row];
          group[r] = v > tau ? tau : (v < -tau ? -tau : v);
          clipped[r] = !(v <= tau && v >= -tau);
        }
        const float lo = *std::min_element(group.begin(), group.end()) + 0.0f;
        const float hi = *std::max_element(group.begin(), group.end()) + 0.0f;
        const float s = (hi - lo) / static_cast<float>(levels);
        RC_ASSERT(q_scale[t * d + j] == Bf16FromF32(s));
        RC_ASSERT(q_min[t * d + j] == Bf16FromF32(lo));
        const double sf = F32FromBf16(q_scale[t * d + j]);
        const double mf = F32FromBf16(q_min[t * d + j]);
        const double top = std::fabs(static_cast<double>(hi) - lo - levels * s) +
                           levels * std::fabs(static_cast<double>(s) - sf) +
                           std::fabs(static_cast<double>(lo) - mf);
        const double main_term = std::max(sf / 2, top);
        for (size_t r = 0; r < tile; ++r) {
          const size_t row = t * tile + r;
          const uint8_t code = q_codes[row * d + j];
          RC_ASSERT(code <= p.levels());
          const float xhat = static_cast<float>(code) * static_cast<float>(sf) +
                             static_cast<float>(mf);
          const float stored = p.norm ? xhat * F32FromBf16(q_norm[row]) : xhat;
          RC_ASSERT(F32Bits(stored) == F32Bits(q.dequantized[row * d + j]));
          if (clipped[r]) continue;
          const double v = group[r];
          const double bound =
              main_term + 2.0001 * kU * (std::fabs(v) + std::fabs(mf)) + kU * std::fabs(xhat);
          if (!(std::fabs(xhat - v) <= bound)) {
            RC_FAIL(backend.name + " tile " + std::to_string(t) + " channel " +
                    std::to_string(j) + " token " + std::to_string(r) + ": error " +
                    std::to_string(std::fabs(xhat - v)) + " > bound " + std::to_string(bound));
          }
        }
      }
    }
    // The packed tiles unpack to the codes; the stored planes decode to the dequantized rows.
    std::vector<uint8_t> codes(n * d);
    backend.write.unpack_tile(q_packed.data(), codes.data(), n, p);
    RC_ASSERT(codes == q_codes);
    const EncodedRows e =
        EncodeRows(backend, p, rotation.empty() ? nullptr : rotation.data(), x.data(), n);
    HistoryRunView view;
    for (int i = 0; i < kMaxPlanes; ++i) view.plane[i] = e.plane[i].data();
    std::vector<float> y(n * d);
    DecodeRows(backend, p, view, n, y.data());
    RC_ASSERT(std::memcmp(y.data(), q.dequantized.data(), y.size() * sizeof(float)) == 0);
  }
}

}  // namespace
}  // namespace kvq::cpu
