// Spec 1.1's write-path rules with known answers, on every backend, CUDA included where a
// device is present (the stage tests of write_backends_test.cc hold each backend to the scalar
// bits; these hold the scalar to the spec's text): the tree order of the norm, the zero row and
// the overflow, the tile quantizer as spec 1.0's quantizer on the transposed tile, the
// channel-major packing along tokens, and the decode of a tile row with its norm.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

using testbed::ExpectError;
using testbed::Write;

// spec/numerics.md §5.1 read literally: squares, +0 padding to a power of two, the stride-halving
// tree, sqrtf, bf16.
uint16_t LiteralTreeNorm(const float* x, size_t m) {
  size_t padded = 1;
  while (padded < m) padded *= 2;
  std::vector<float> a(padded, 0.0f);
  for (size_t j = 0; j < m; ++j) a[j] = x[j] * x[j];
  for (size_t h = padded / 2; h >= 1; h /= 2) {
    for (size_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
  }
  return Bf16FromF32(std::sqrt(a[0]));
}

uint16_t SequentialNorm(const float* x, size_t m) {
  float s = 0.0f;
  for (size_t j = 0; j < m; ++j) s = s + x[j] * x[j];
  return Bf16FromF32(std::sqrt(s));
}

// The order of the sum is part of the spec: rows on which a sequential sum would store another
// n^ exist (found by a seeded search), and every backend stores the tree's, for spans of 1, 2
// and 3 heads (3: padded with +0 to 4).
TEST(NormStage, FollowsTheTreeOrderOfTheSpec) {
  for (int heads : {1, 2, 3}) {
    const WriteParams p = Write().head_dim(64).tile(32).norm().norm_heads(heads);
    const size_t m = static_cast<size_t>(p.norm_span());
    conformance::SplitMix64 rng(17 + heads);
    std::vector<float> row(m);
    bool found = false;
    for (int attempt = 0; attempt < 2000000 && !found; ++attempt) {
      for (float& v : row) v = rng.Uniform() * 4.0f;
      found = LiteralTreeNorm(row.data(), m) != SequentialNorm(row.data(), m);
    }
    ASSERT_TRUE(found) << "no row found where the summation order changes n^ (m = " << m << ")";
    for (const Backend* backend : testbed::TestBackends()) {
      std::vector<float> x = row;
      uint16_t norm = 0;
      backend->write.norm(x.data(), &norm, 1, p);
      EXPECT_EQ(norm, LiteralTreeNorm(row.data(), m)) << backend->name << " span " << m;
      const float stored = F32FromBf16(norm);
      for (size_t j = 0; j < m; ++j) {
        ASSERT_EQ(F32Bits(x[j]), F32Bits(row[j] / stored)) << backend->name << " column " << j;
      }
    }
  }
}

// n^ = 0 gives a row of +0 (from +0, -0 and squares that underflow alike); a norm of 1 leaves
// the row as it is; an overflowing square sum stores +Inf (the stage is total) and the
// validating write path rejects it.
TEST(NormStage, ZeroRowOneAndOverflow) {
  const WriteParams p = Write().head_dim(64).tile(32).norm();
  const size_t d = 64;
  std::vector<float> rows(4 * d);
  for (size_t j = 0; j < d; ++j) {
    rows[j] = (j % 2 == 0) ? 0.0f : -0.0f;
    rows[d + j] = (j % 3 == 0 ? -1.0f : 1.0f) * 0x1p-76f;  // squares underflow to +0
    rows[2 * d + j] = j == 5 ? -1.0f : 0.0f;              // norm exactly 1
    rows[3 * d + j] = j == 9 ? 0x1p64f : 1.0f;            // square 2^128 overflows
  }
  for (const Backend* backend : testbed::TestBackends()) {
    std::vector<float> x = rows;
    uint16_t norm[4];
    backend->write.norm(x.data(), norm, 4, p);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(norm[r], 0u) << backend->name;
      for (size_t j = 0; j < d; ++j) ASSERT_EQ(F32Bits(x[r * d + j]), 0u) << backend->name;
    }
    EXPECT_EQ(norm[2], Bf16FromF32(1.0f));
    EXPECT_EQ(std::memcmp(&x[2 * d], &rows[2 * d], d * sizeof(float)), 0) << backend->name;
    EXPECT_EQ(norm[3], 0x7f80u) << backend->name;  // +Inf
    EXPECT_EQ(F32Bits(x[3 * d + 9]), 0u);           // 2^64 / Inf = +0
    // A whole tile whose row 7 is the overflowing one.
    std::vector<float> tile(32 * d, 0.5f);
    std::memcpy(&tile[7 * d], &rows[3 * d], d * sizeof(float));
    ExpectError([&] { QuantizeRows(*backend, p, nullptr, tile.data(), 32); },
                ErrorCode::kNonFinite, {"norm of row 7", "overflows"});
  }
}

// The norm multiplies back exactly as stored: denorm(y, n^) = fl(y * n^).
TEST(NormStage, DenormMultipliesByTheStoredNorm) {
  const WriteParams p = Write().head_dim(128).tile(32).norm();
  conformance::SplitMix64 rng(3);
  std::vector<float> y(3 * 128);
  for (float& v : y) v = rng.Uniform();
  const uint16_t norms[3] = {Bf16FromF32(3.5f), 0, Bf16FromF32(1e-30f)};
  for (const Backend* backend : testbed::TestBackends()) {
    std::vector<float> got = y;
    backend->write.denorm(got.data(), norms, 3, p);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(F32Bits(got[i]), F32Bits(y[i] * F32FromBf16(norms[i / 128]))) << backend->name;
    }
  }
}

// "The tile quantizer is spec 1.0's rule on the transposed tile": channel j of a tile of G_k
// tokens, laid out as a row, quantized by the affine_token stage with G = G_k gives the same
// (scale, min) and codes, on every backend, for every row kind the golden vectors use.
TEST(TileQuantizer, IsTheTokenQuantizerOnTheTransposedTile) {
  for (int d : {64, 128, 256}) {
    for (int gk : {32, 64, 128}) {
      for (int bits : {2, 4}) {
        const WriteParams tile = Write().head_dim(d).tile(gk).bits(bits);
        // Rows of max(64, G_k) values: 64 / G_k channels of the transposed tile per row.
        const int width = gk < 64 ? 64 : gk;
        const WriteParams token = Write().head_dim(width).group(gk).bits(bits);
        const size_t n = 2 * static_cast<size_t>(gk);  // two tiles
        conformance::SplitMix64 rng(static_cast<uint64_t>(d * 1000 + gk * 10 + bits));
        std::vector<float> x(n * d);
        const std::vector<conformance::RowKind>& kinds = conformance::AllRowKinds();
        for (size_t r = 0; r < n; ++r) {
          conformance::FillRow(kinds[r % kinds.size()], tile, &rng, &x[r * d]);
        }
        // The second tile repeats its first row: every channel constant (scale 0).
        for (size_t r = static_cast<size_t>(gk) + 1; r < n; ++r) {
          std::memcpy(&x[r * d], &x[static_cast<size_t>(gk) * d], d * sizeof(float));
        }
        // Transposed: [tiles * d * G_k] = for each tile, for each channel, its G_k values.
        std::vector<float> t(n * d);
        for (size_t tt = 0; tt < n / gk; ++tt) {
          for (size_t j = 0; j < static_cast<size_t>(d); ++j) {
            for (size_t r = 0; r < static_cast<size_t>(gk); ++r) {
              t[(tt * d + j) * gk + r] = x[(tt * gk + r) * d + j];
            }
          }
        }
        const size_t token_rows = n * d / static_cast<size_t>(width);
        std::vector<uint8_t> want_codes(n * d);
        std::vector<uint16_t> want_scale(n * d / gk), want_min(n * d / gk);
        ScalarBackend().write.quantize(t.data(), want_codes.data(), want_scale.data(),
                                       want_min.data(), token_rows, token);
        for (const Backend* backend : testbed::TestBackends()) {
          std::vector<uint8_t> codes(n * d);
          std::vector<uint16_t> scale(n * d / gk), min(n * d / gk);
          backend->write.quantize_tile(x.data(), codes.data(), scale.data(), min.data(), n, tile);
          const std::string what = backend->name + " " + testbed::Describe(tile);
          ASSERT_EQ(scale, want_scale) << what;
          ASSERT_EQ(min, want_min) << what;
          for (size_t tt = 0; tt < n / gk; ++tt) {
            for (size_t j = 0; j < static_cast<size_t>(d); ++j) {
              EXPECT_EQ(scale[tt * d + j] == 0, tt == 1 || scale[tt * d + j] == 0);
              for (size_t r = 0; r < static_cast<size_t>(gk); ++r) {
                ASSERT_EQ(codes[(tt * gk + r) * d + j], want_codes[(tt * d + j) * gk + r])
                    << what << " tile " << tt << " channel " << j << " token " << r;
              }
            }
          }
        }
      }
    }
  }
}

// Packing along the tokens, channel-major (spec/numerics.md §8.1): with code(r, j) =
// (3r + j) mod (L + 1), byte i of channel j of a tile is
//   INT2: code(i, j) | code(G/4+i, j) << 2 | code(G/2+i, j) << 4 | code(3G/4+i, j) << 6
//   INT4: code(i, j) | code(G/2+i, j) << 4
// at offset (tile * d + j) * G*b/8 + i; and unpack inverts it for every byte value.
TEST(TilePacking, ChannelMajorSplitAlongTokens) {
  for (int d : {64, 256}) {
    for (int gk : {32, 64, 128}) {
      for (int bits : {2, 4}) {
        const WriteParams p = Write().head_dim(d).tile(gk).bits(bits);
        const size_t n = 2 * static_cast<size_t>(gk);
        const int levels = p.levels();
        std::vector<uint8_t> codes(n * d);
        for (size_t r = 0; r < n; ++r) {
          for (size_t j = 0; j < static_cast<size_t>(d); ++j) {
            codes[r * d + j] = static_cast<uint8_t>((3 * r + j) % static_cast<size_t>(levels + 1));
          }
        }
        const size_t slice = static_cast<size_t>(p.tile_channel_bytes());
        std::vector<uint8_t> want(n * d * bits / 8);
        for (size_t tt = 0; tt < n / gk; ++tt) {
          for (size_t j = 0; j < static_cast<size_t>(d); ++j) {
            for (size_t i = 0; i < slice; ++i) {
              unsigned byte = 0;
              for (size_t part = 0; part < static_cast<size_t>(8 / bits); ++part) {
                byte |= static_cast<unsigned>(codes[(tt * gk + part * slice + i) * d + j])
                        << (part * bits);
              }
              want[(tt * d + j) * slice + i] = static_cast<uint8_t>(byte);
            }
          }
        }
        for (const Backend* backend : testbed::TestBackends()) {
          std::vector<uint8_t> packed(want.size()), back(codes.size());
          backend->write.pack_tile(codes.data(), packed.data(), n, p);
          ASSERT_EQ(packed, want) << backend->name << " " << testbed::Describe(p);
          backend->write.unpack_tile(packed.data(), back.data(), n, p);
          ASSERT_EQ(back, codes) << backend->name;
          // Every byte value unpacks to codes that pack back to it.
          std::vector<uint8_t> every(want.size());
          for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint8_t>(i * 7 % 256);
          backend->write.unpack_tile(every.data(), back.data(), n, p);
          backend->write.pack_tile(back.data(), packed.data(), n, p);
          ASSERT_EQ(packed, every) << backend->name;
        }
      }
    }
  }
}

// A tile row decodes to n^ * (code * scale[tile][j] + min[tile][j]) (two roundings), for a run
// that starts inside a tile too (tile_offset), identical to QuantizeRows' dequantized rows.
TEST(TileDecode, RowsMidTileAndTheNorm) {
  const WriteParams p = Write().head_dim(128).tile(32).bits(2).hadamard().norm();
  conformance::SplitMix64 rng(8);
  const size_t n = 64;
  std::vector<float> x(n * 128);
  for (float& v : x) v = rng.Bell() * 3.0f;
  for (const Backend* backend : testbed::TestBackends()) {
    const QuantizedRows q = QuantizeRows(*backend, p, nullptr, x.data(), n);
    const std::vector<uint8_t> q_codes = q.Values<uint8_t>("codes");
    const std::vector<uint8_t> q_packed = q.Values<uint8_t>("packed");
    const std::vector<uint16_t> q_scale = q.Values<uint16_t>("scale");
    const std::vector<uint16_t> q_min = q.Values<uint16_t>("min");
    const std::vector<uint16_t> q_norm = q.Values<uint16_t>("norm");
    const EncodedRows e = EncodeRows(*backend, p, nullptr, x.data(), n);
    ASSERT_EQ(e.plane[0], q_packed);
    for (size_t first : {size_t{0}, size_t{5}, size_t{31}, size_t{33}}) {
      const size_t count = n - first;
      HistoryRunView view;
      const size_t tile = first / 32;
      view.plane[0] = e.plane[0].data() + tile * 128 * 8;
      view.plane[1] = e.plane[1].data() + tile * 128 * 2;
      view.plane[2] = e.plane[2].data() + tile * 128 * 2;
      view.plane[3] = e.plane[3].data() + first * 2;
      view.tile_offset = static_cast<int>(first % 32);
      std::vector<float> y(count * 128);
      DecodeRows(*backend, p, view, count, y.data());
      for (size_t i = 0; i < count * 128; ++i) {
        const size_t r = first + i / 128, j = i % 128;
        const float sf = F32FromBf16(q_scale[(r / 32) * 128 + j]);
        const float mf = F32FromBf16(q_min[(r / 32) * 128 + j]);
        const float literal = (static_cast<float>(q_codes[r * 128 + j]) * sf + mf) *
                              F32FromBf16(q_norm[r]);
        ASSERT_EQ(F32Bits(y[i]), F32Bits(literal)) << backend->name << " row " << r;
        ASSERT_EQ(F32Bits(y[i]), F32Bits(q.dequantized[r * 128 + j]));
      }
    }
  }
}

// The token-scope norm is one tree norm over the token's H rotated rows laid end to end; every
// head stores it, and each head's normalized row is its rotated row divided by it.
TEST(TokenScopeNorm, OneNormOverTheHeadsRowsEndToEnd) {
  const int heads = 3;
  const WriteParams p = Write().head_dim(64).tile(32).hadamard().norm().norm_heads(heads);
  conformance::SplitMix64 rng(12);
  const size_t n = 32, d = 64;
  std::vector<float> x(n * heads * d);
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng.Bell() * (i % (heads * d) < d ? 10.0f : 1.0f);
  const std::vector<WriteParams> params(heads, p);
  const std::vector<const float*> rotations(heads, nullptr);
  for (const Backend* backend : testbed::TestBackends()) {
    const std::vector<QuantizedRows> q = QuantizeTokens(*backend, params, rotations, x.data(), n);
    bool differs_from_per_head = false;
    for (size_t r = 0; r < n; ++r) {
      std::vector<float> span;
      for (int h = 0; h < heads; ++h) {
        span.insert(span.end(), &q[h].rotated[r * d], &q[h].rotated[(r + 1) * d]);
      }
      const uint16_t want = LiteralTreeNorm(span.data(), span.size());
      for (int h = 0; h < heads; ++h) {
        ASSERT_EQ(q[h].Values<uint16_t>("norm")[r], want) << backend->name << " row " << r << " head " << h;
        for (size_t j = 0; j < d; ++j) {
          ASSERT_EQ(F32Bits(q[h].normalized[r * d + j]),
                    F32Bits(q[h].rotated[r * d + j] / F32FromBf16(want)));
        }
      }
      differs_from_per_head |= LiteralTreeNorm(&q[0].rotated[r * d], d) != want;
    }
    EXPECT_TRUE(differs_from_per_head);
  }
  // One head's rows alone cannot take a norm over three.
  ExpectError([&] { QuantizeRows(ScalarBackend(), p, nullptr, x.data(), n); },
              ErrorCode::kInvalidArgument, {"norm over 3 KV heads"});
  ExpectError([&] { QuantizeTokens(ScalarBackend(), {p, p}, {nullptr, nullptr}, x.data(), n); },
              ErrorCode::kInvalidArgument, {"norm over 3 KV heads", "got 2"});
  ExpectError([&] { QuantizeRows(ScalarBackend(), Write().head_dim(64).tile(32), nullptr,
                                 x.data(), 31); },
              ErrorCode::kInvalidArgument, {"tiles of 32 tokens", "31 rows"});
}

}  // namespace
}  // namespace kvq::cpu
