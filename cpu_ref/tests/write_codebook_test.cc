// Spec 1.3's codebook format (numerics.md §5.4, §7.3, §8.2) with known answers and properties,
// on every CPU backend (write_backends_test.cc holds each backend to the scalar bits; these
// hold the scalar to the spec's text): the segment layout, the encoder (the nearest centroid,
// ties to the lower), the corrected norm and its bounds, a zero segment, the packing of every
// width (identity over random codes, every byte value of an unpadded segment), the decode,
// the write path with per-head widths (EncodeRows / DecodeRows), and what it rejects.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::cpu {
namespace {

using conformance::RowKind;
using conformance::SplitMix64;
using testbed::ExpectError;
using testbed::Write;

constexpr float kEpsilon = 5.9604645e-08f;  // 2^-24, fp32's unit roundoff

// sqrtf of the tree sum of squares, numerics.md §5.1 steps 1-3 read literally (fp32).
float TreeLength(const std::vector<float>& v) {
  size_t padded = 1;
  while (padded < v.size()) padded *= 2;
  std::vector<float> a(padded, 0.0f);
  for (size_t j = 0; j < v.size(); ++j) a[j] = v[j] * v[j];
  for (size_t h = padded / 2; h >= 1; h /= 2) {
    for (size_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
  }
  return std::sqrt(a[0]);
}

std::vector<const Backend*> CpuBackends() {
  return testbed::TestBackends({.scalar = true, .cuda = false});
}

// Params whose row limits admit any widths (segments 8, code_bytes d).
WriteParams Slack(int d, int bits = 3) {
  return Write().head_dim(d).codebook_rows(bits).segments(8).code_bytes(d).Build();
}

// Widths with every width 1..8 present, some once (m = 2), the rest random.
std::vector<uint8_t> MixedWidths(int d, SplitMix64* rng) {
  std::vector<uint8_t> w(static_cast<size_t>(d / 2));
  for (uint8_t& v : w) v = static_cast<uint8_t>(1 + rng->Below(8));
  for (int k = 0; k < 8; ++k) w[static_cast<size_t>(k)] = static_cast<uint8_t>(8 - k);
  return w;
}

TEST(CodebookLayout, SegmentsByAscendingWidthThenBlock) {
  // d = 16: blocks 0..7 with widths 3, 1, 3, 8, 1, 3, 2, 3.
  const std::vector<uint8_t> widths = {3, 1, 3, 8, 1, 3, 2, 3};
  const CodebookLayout layout = CodebookLayoutOf(16, widths.data());
  ASSERT_EQ(layout.count, 4);
  const int want[4][5] = {
      // width, m, channel offset, byte offset, bytes
      {1, 4, 0, 0, 1},    // 2 blocks: ceil(4*1/8) = 1
      {2, 2, 4, 1, 1},    // 1 block: split-quarter q = 1
      {3, 8, 6, 2, 3},    // 4 blocks: 24 bits
      {8, 2, 14, 5, 2}};  // 1 block
  for (int s = 0; s < 4; ++s) {
    const CodebookSegment& g = layout.segment[s];
    EXPECT_EQ(g.width, want[s][0]) << s;
    EXPECT_EQ(g.values, want[s][1]) << s;
    EXPECT_EQ(g.offset, want[s][2]) << s;
    EXPECT_EQ(g.byte_offset, want[s][3]) << s;
    EXPECT_EQ(g.bytes, want[s][4]) << s;
  }
  EXPECT_EQ(layout.code_bytes, 7);
  // A uniform row is one segment of d values and d*b/8 bytes.
  for (int d : {64, 128, 256}) {
    for (int b = 1; b <= 8; ++b) {
      const std::vector<uint8_t> uniform(static_cast<size_t>(d / 2), static_cast<uint8_t>(b));
      const CodebookLayout u = CodebookLayoutOf(d, uniform.data());
      ASSERT_EQ(u.count, 1);
      EXPECT_EQ(u.segment[0].values, d);
      EXPECT_EQ(u.code_bytes, d * b / 8);
    }
  }
  // Any widths fit d code bytes: ceil(m*w/8) <= m for w <= 8.
  SplitMix64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<uint8_t> w = MixedWidths(64, &rng);
    EXPECT_LE(CodebookLayoutOf(64, w.data()).code_bytes, 64);
  }
}

// code_j = #{k : t_k < u_j} picks a nearest centroid, a tie (u on a boundary) the lower one;
// checked against the fp64 midpoints the boundaries round (a value between the fp32 and the
// fp64 midpoint may go either way: the spec's "up to the rounding of the boundaries").
TEST(CodebookEncoder, NearestCentroidTiesToTheLower) {
  for (const Backend* backend : CpuBackends()) {
    for (int m : {2, 6, 64}) {
      for (int w = 1; w <= 8; ++w) {
        WriteParams p = Write().head_dim(64).codebook_rows(w).segments(8).code_bytes(64).Build();
        // One segment of m values at width w, padded to d = 64 by a second segment at another
        // width: the whole row is laid out as widths[] then the rest at width (w % 8) + 1.
        std::vector<uint8_t> row_widths(32, static_cast<uint8_t>(w % 8 + 1));
        for (int i = 0; i < m / 2; ++i) row_widths[static_cast<size_t>(i)] = static_cast<uint8_t>(w);
        const CodebookLayout layout = CodebookLayoutOf(64, row_widths.data());
        int seg = 0;
        while (layout.segment[seg].width != w) ++seg;
        const CodebookSegment& g = layout.segment[seg];
        const tables::CodebookTable t = tables::Codebook(g.values, w);
        // Probe values: every boundary, its neighbours, +-0, +-1 and random values.
        SplitMix64 rng(1000 * static_cast<uint64_t>(m) + static_cast<uint64_t>(w));
        std::vector<float> probes;
        for (int k = 0; k + 1 < t.levels; ++k) {
          probes.push_back(t.boundaries[k]);
          probes.push_back(std::nextafter(t.boundaries[k], 2.0f));
          probes.push_back(std::nextafter(t.boundaries[k], -2.0f));
        }
        for (float v : {0.0f, -0.0f, 1.0f, -1.0f, 1.25f, -1.25f}) probes.push_back(v);
        for (int k = 0; k < 64; ++k) probes.push_back(rng.Uniform());
        const size_t rows = (probes.size() + static_cast<size_t>(g.values) - 1) / g.values;
        std::vector<float> unit(rows * 64, 0.25f);
        for (size_t i = 0; i < probes.size(); ++i) {
          unit[(i / g.values) * 64 + static_cast<size_t>(g.offset) + i % g.values] = probes[i];
        }
        std::vector<uint16_t> norms(rows * 8, Bf16FromF32(1.0f));
        std::vector<uint8_t> codes(rows * 64);
        std::vector<uint16_t> corrected(rows * 8);
        backend->write.quantize_codebook(unit.data(), row_widths.data(), norms.data(),
                                         codes.data(), corrected.data(), rows, p);
        for (size_t i = 0; i < probes.size(); ++i) {
          const float u = probes[i];
          const int code = codes[(i / g.values) * 64 + static_cast<size_t>(g.offset) + i % g.values];
          const std::string where = backend->name + " m " + std::to_string(g.values) + " w " +
                                    std::to_string(w) + " u " + testbed::DescribeFloat(u);
          ASSERT_LT(code, t.levels) << where;
          // The count itself: boundaries strictly below u (a tie is not below).
          int below = 0;
          for (int k = 0; k + 1 < t.levels; ++k) below += t.boundaries[k] < u ? 1 : 0;
          ASSERT_EQ(code, below) << where;
          // A nearest centroid, up to the boundaries' fp32 rounding: a boundary lies within
          // one fp32 ulp of the midpoint of the fp32 centroids it separates, so on it the two
          // distances differ by at most two ulps (2^-23 for |u| < 1).
          const double distance = std::fabs(static_cast<double>(u) - t.centroids[code]);
          const double slack = std::ldexp(1.0, -22) * std::max(1.0, std::fabs(double{u}));
          for (int k = 0; k < t.levels; ++k) {
            const double other = std::fabs(static_cast<double>(u) - t.centroids[k]);
            ASSERT_LE(distance, other + slack) << where << " code " << code << " vs " << k;
          }
          // On a boundary: the lower of its two centroids.
          for (int k = 0; k + 1 < t.levels; ++k) {
            if (u == t.boundaries[k]) ASSERT_EQ(code, k) << where << " on boundary " << k;
          }
        }
      }
    }
  }
}

// A zero segment (or one whose squares all underflow) stores n^ = 0, u = +0, codes
// 2^(w-1) - 1 and N^ = +0, and decodes to +-0; the other segments are untouched by it.
TEST(CodebookStages, ZeroSegmentStoresZero) {
  for (const Backend* backend : CpuBackends()) {
    const WriteParams p = Slack(64);
    SplitMix64 rng(3);
    const std::vector<uint8_t> widths = MixedWidths(64, &rng);
    const CodebookLayout layout = CodebookLayoutOf(64, widths.data());
    std::vector<float> x(64);
    for (float& v : x) v = rng.Uniform();
    // Zero the first segment (width 1), make the second tiny (squares underflow).
    const CodebookSegment& zero = layout.segment[0];
    const CodebookSegment& tiny = layout.segment[1];
    for (int j = 0; j < zero.values; ++j) x[static_cast<size_t>(zero.offset + j)] = j % 2 ? -0.0f : 0.0f;
    for (int j = 0; j < tiny.values; ++j) x[static_cast<size_t>(tiny.offset + j)] = 1e-30f;
    HeadArrays head;
    head.widths = widths.data();
    const QuantizedRows q = QuantizeRows(*backend, p, head, x.data(), 1);
    const std::vector<uint16_t> n_hat = q.Values<uint16_t>("segment_norm");
    const std::vector<uint16_t> n_corrected = q.Values<uint16_t>("norm");
    const std::vector<float> unit = q.Values<float>("unit");
    const std::vector<uint8_t> codes = q.Values<uint8_t>("codes");
    for (const CodebookSegment* g : {&zero, &tiny}) {
      const int s = g == &zero ? 0 : 1;
      EXPECT_EQ(n_hat[static_cast<size_t>(s)], 0) << backend->name << " segment " << s;
      EXPECT_EQ(n_corrected[static_cast<size_t>(s)], 0) << backend->name << " segment " << s;
      for (int j = 0; j < g->values; ++j) {
        const size_t c = static_cast<size_t>(g->offset + j);
        EXPECT_EQ(F32Bits(unit[c]), 0u) << backend->name << " channel " << c;
        EXPECT_EQ(codes[c], (1 << (g->width - 1)) - 1) << backend->name << " channel " << c;
        EXPECT_EQ(std::fabs(q.dequantized[c]), 0.0f) << backend->name << " channel " << c;
      }
    }
    for (int s = 2; s < layout.count; ++s) {
      EXPECT_NE(n_corrected[static_cast<size_t>(s)], 0) << backend->name << " segment " << s;
    }
    // Slots past the head's segments hold +0.
    for (int s = layout.count; s < 8; ++s) {
      EXPECT_EQ(n_hat[static_cast<size_t>(s)], 0);
      EXPECT_EQ(n_corrected[static_cast<size_t>(s)], 0);
    }
  }
}

// §5.4.4-5's bounds per segment: N^ = bf16(n^ / r) with r the tree length of the centroids,
// |N^·r - n^| <= (2^-8 + 2ε)·n^, the decoded segment's tree length within
// (2^-8 + (log2 M + 6)ε)·n^ of n^, and x^ = fp32(c[code]·N^f) element by element.
TEST(CodebookStages, CorrectedNormAndDecodeFollowTheSpec) {
  SplitMix64 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int d = trial % 2 ? 128 : 64;
    const WriteParams p = Slack(d);
    const std::vector<uint8_t> widths = MixedWidths(d, &rng);
    const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
    const std::vector<float> x = conformance::MakeRows(
        std::vector<RowKind>{RowKind::kRandom, RowKind::kHeavyTail, RowKind::kOutlier}, p, &rng,
        nullptr);
    HeadArrays head;
    head.widths = widths.data();
    const QuantizedRows q = QuantizeRows(ScalarBackend(), p, head, x.data(), 3);
    const std::vector<uint16_t> n_hat = q.Values<uint16_t>("segment_norm");
    const std::vector<uint16_t> corrected = q.Values<uint16_t>("norm");
    const std::vector<uint8_t> codes = q.Values<uint8_t>("codes");
    for (size_t r = 0; r < 3; ++r) {
      for (int s = 0; s < layout.count; ++s) {
        const CodebookSegment& g = layout.segment[s];
        const tables::CodebookTable t = tables::Codebook(g.values, g.width);
        const double nf = F32FromBf16(n_hat[r * 8 + static_cast<size_t>(s)]);
        const float big_n = F32FromBf16(corrected[r * 8 + static_cast<size_t>(s)]);
        std::vector<float> centroids, decoded;
        for (int j = 0; j < g.values; ++j) {
          const size_t c = r * static_cast<size_t>(d) + static_cast<size_t>(g.offset + j);
          const float centroid = t.centroids[codes[c]];
          centroids.push_back(centroid);
          decoded.push_back(q.dequantized[c]);
          ASSERT_EQ(F32Bits(q.dequantized[c]), F32Bits(centroid * big_n)) << "channel " << c;
        }
        const float r_tree = TreeLength(centroids);
        const std::string where = "row " + std::to_string(r) + " segment " + std::to_string(s);
        // N^ = bf16(fp32(n^ / r)) with the fp32 tree length r of the chosen centroids.
        EXPECT_EQ(corrected[r * 8 + static_cast<size_t>(s)],
                  Bf16FromF32(static_cast<float>(nf) / r_tree))
            << where;
        // One fp32 division and one bf16 rounding (relative 2^-8, bf16's unit roundoff).
        EXPECT_LE(std::fabs(big_n * static_cast<double>(r_tree) - nf),
                  (std::ldexp(1.0, -8) + 2 * kEpsilon) * nf)
            << where;
        // The decoded segment's tree length: that, plus the products' and the two trees' fp32
        // roundings.
        const double log2_m = std::ceil(std::log2(static_cast<double>(g.values)));
        EXPECT_LE(std::fabs(TreeLength(decoded) - nf),
                  (std::ldexp(1.0, -8) + (log2_m + 6) * kEpsilon) * nf)
            << where;
      }
    }
  }
}

// Every width's packing: codes pack and unpack to themselves for segments of any even size
// (padded split bytes included), and every byte value of an unpadded segment unpacks to codes
// that pack back to it; at w = 8 byte k is code k, at w = 3 eight codes fill three bytes.
TEST(CodebookPacking, EveryWidthRoundTrips) {
  for (const Backend* backend : CpuBackends()) {
    for (int w = 1; w <= 8; ++w) {
      for (int m : {2, 4, 6, 8, 10, 30, 64}) {
        // The segment under test first (width w, m values), the rest of d = 64 at another width.
        std::vector<uint8_t> widths(32, static_cast<uint8_t>(w % 8 + 1));
        for (int i = 0; i < m / 2; ++i) widths[static_cast<size_t>(i)] = static_cast<uint8_t>(w);
        const WriteParams p = Slack(64);
        const CodebookLayout layout = CodebookLayoutOf(64, widths.data());
        SplitMix64 rng(static_cast<uint64_t>(100 * w + m));
        const size_t n = 5;
        std::vector<uint8_t> codes(n * 64);
        for (size_t r = 0; r < n; ++r) {
          for (int s = 0; s < layout.count; ++s) {
            const CodebookSegment& g = layout.segment[s];
            for (int j = 0; j < g.values; ++j) {
              codes[r * 64 + static_cast<size_t>(g.offset + j)] =
                  static_cast<uint8_t>(rng.Below(1u << g.width));
            }
          }
        }
        std::vector<uint8_t> packed(n * 64, 0xA5), back(n * 64, 0xA5);
        backend->write.pack_codebook(codes.data(), widths.data(), packed.data(), n, p);
        backend->write.unpack_codebook(packed.data(), widths.data(), back.data(), n, p);
        ASSERT_EQ(codes, back) << backend->name << " w " << w << " m " << m;
        // Bytes past the segments are 0x00.
        for (size_t r = 0; r < n; ++r) {
          for (size_t i = static_cast<size_t>(layout.code_bytes); i < 64; ++i) {
            ASSERT_EQ(packed[r * 64 + i], 0) << backend->name << " w " << w << " byte " << i;
          }
        }
      }
      // Every byte value through a uniform row of width w (d = 64: m*w/8 whole, no padding).
      const WriteParams u = Write().head_dim(64).codebook_rows(w).Build();
      const std::vector<uint8_t> uniform(32, static_cast<uint8_t>(w));
      const size_t cb = static_cast<size_t>(u.row_code_bytes());
      const size_t n = (256 + cb - 1) / cb;
      std::vector<uint8_t> bytes(n * cb), codes(n * 64), again(n * cb);
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i % 256);
      backend->write.unpack_codebook(bytes.data(), uniform.data(), codes.data(), n, u);
      backend->write.pack_codebook(codes.data(), uniform.data(), again.data(), n, u);
      ASSERT_EQ(bytes, again) << backend->name << " w " << w;
    }
    // Known layouts: w = 8 is the codes themselves, w = 3 the LSB-first stream (codes 0..7
    // fill bytes 0x88 0xC6 0xFA), w = 1 bit k of byte 0 is code k.
    const std::vector<uint8_t> eights(32, 8), threes(32, 3), ones(32, 1);
    std::vector<uint8_t> codes(64);
    for (int k = 0; k < 64; ++k) codes[static_cast<size_t>(k)] = static_cast<uint8_t>(k % 8);
    std::vector<uint8_t> packed(64);
    backend->write.pack_codebook(codes.data(), eights.data(), packed.data(), 1,
                                 Write().head_dim(64).codebook_rows(8).Build());
    EXPECT_EQ(packed, codes) << backend->name;
    backend->write.pack_codebook(codes.data(), threes.data(), packed.data(), 1,
                                 Write().head_dim(64).codebook_rows(3).Build());
    EXPECT_EQ(packed[0], 0x88) << backend->name;
    EXPECT_EQ(packed[1], 0xC6) << backend->name;
    EXPECT_EQ(packed[2], 0xFA) << backend->name;
    std::vector<uint8_t> bits(64, 0);
    bits[0] = bits[3] = bits[9] = 1;
    backend->write.pack_codebook(bits.data(), ones.data(), packed.data(), 1,
                                 Write().head_dim(64).codebook_rows(1).Build());
    EXPECT_EQ(packed[0], 0x09) << backend->name;
    EXPECT_EQ(packed[1], 0x02) << backend->name;
  }
}

// The uniform row at width 2 and 4 is spec 1.0's INT2 / INT4 packing (the affine pack stage).
TEST(CodebookPacking, UniformTwoAndFourBitsAreTheAffinePacking) {
  SplitMix64 rng(21);
  for (int d : {64, 128, 256}) {
    for (int b : {2, 4}) {
      const size_t n = 3;
      std::vector<uint8_t> codes(n * static_cast<size_t>(d));
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng.Below(1u << b));
      const WriteParams affine = Write().head_dim(d).group(32).bits(b).Build();
      const WriteParams codebook = Write().head_dim(d).codebook_rows(b).Build();
      const std::vector<uint8_t> widths(static_cast<size_t>(d / 2), static_cast<uint8_t>(b));
      std::vector<uint8_t> want(n * static_cast<size_t>(affine.packed_bytes()));
      std::vector<uint8_t> got(want.size());
      ScalarBackend().write.pack(codes.data(), want.data(), n, affine);
      ScalarBackend().write.pack_codebook(codes.data(), widths.data(), got.data(), n, codebook);
      EXPECT_EQ(want, got) << "d " << d << " b " << b;
    }
  }
}

// The write path binds a head's widths to the codec (EncodeRows / DecodeRows through the
// generic codec); a head without widths is the uniform row, and widths all equal to b give the
// same bits; the stored planes decode to the write path's dequantized rows.
TEST(CodebookWritePath, PerHeadWidthsThroughEncodeAndDecode) {
  SplitMix64 rng(31);
  for (const Backend* backend : CpuBackends()) {
    for (int d : {64, 128, 256}) {
      const std::vector<float> x = conformance::MakeRows(
          conformance::TestRowKinds(Slack(d)), Slack(d), &rng, nullptr);
      const size_t n = x.size() / static_cast<size_t>(d);
      // Uniform: no widths, or widths all b, the same bits.
      const WriteParams uniform = Write().head_dim(d).codebook_rows(3).hadamard().Build();
      const std::vector<uint8_t> threes(static_cast<size_t>(d / 2), 3);
      HeadArrays given;
      given.widths = threes.data();
      const QuantizedRows a = QuantizeRows(*backend, uniform, HeadArrays{}, x.data(), n);
      const QuantizedRows b = QuantizeRows(*backend, uniform, given, x.data(), n);
      ASSERT_EQ(a.Values<uint8_t>("packed"), b.Values<uint8_t>("packed")) << backend->name;
      ASSERT_EQ(a.Values<uint16_t>("norm"), b.Values<uint16_t>("norm")) << backend->name;
      EXPECT_EQ(a.Output("packed").shape, (std::vector<int64_t>{static_cast<int64_t>(n), d * 3 / 8}));
      // Per-head widths, tight limits.
      const std::vector<uint8_t> widths = MixedWidths(d, &rng);
      const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
      const WriteParams p = Write().head_dim(d).codebook_rows(4).hadamard().segments(layout.count)
                                .code_bytes(layout.code_bytes).Build();
      HeadArrays head;
      head.widths = widths.data();
      const QuantizedRows q = QuantizeRows(*backend, p, head, x.data(), n);
      const EncodedRows e = EncodeRows(*backend, p, head, x.data(), n);
      const FormatLayout planes = LayoutOf(p);
      ASSERT_EQ(planes.num_planes, 2);
      EXPECT_EQ(e.plane[0], q.Output("packed").bytes);
      EXPECT_EQ(e.plane[1], q.Output("norm").bytes);
      HistoryRunView run;
      run.plane[0] = e.plane[0].data();
      run.plane[1] = e.plane[1].data();
      run.heads = head;
      std::vector<float> y(n * static_cast<size_t>(d));
      DecodeRows(*backend, p, run, n, y.data());
      ASSERT_TRUE(testbed::BitsEqual(backend->name, q.dequantized, y, d));
      // Without its widths the same planes decode otherwise: the widths are bound, not ignored.
      run.heads = HeadArrays{};
      const WriteParams wide = Write().head_dim(d).codebook_rows(4).segments(layout.count)
                                   .code_bytes(layout.code_bytes).hadamard().Build();
      if (layout.code_bytes >= d / 2) {
        DecodeRows(*backend, wide, run, n, y.data());
        EXPECT_NE(q.dequantized, y) << backend->name;
      }
      // No tau: a codebook row is not clipped.
      for (const auto& [name, tensor] : q.Tensors(p)) EXPECT_NE(name, "tau");
    }
  }
}

TEST(CodebookWritePath, RejectsBadParamsWidthsAndOverflowNamingThem) {
  const std::vector<float> x(64, 0.5f);
  const auto run = [&](const WriteParams& p, const std::vector<uint8_t>* widths) {
    HeadArrays head;
    if (widths != nullptr) head.widths = widths->data();
    QuantizeRows(BestBackend(), p, head, x.data(), 1);
  };
  const WriteParams good = Write().head_dim(64).codebook_rows(3).Build();
  const auto with = [&](auto&& change) {
    WriteParams p = good;
    change(p);
    return p;
  };
  ExpectError([&] { run(with([](WriteParams& p) { p.bits = 0; }), nullptr); },
              ErrorCode::kInvalidArgument, {"bits 0", "1..8"});
  ExpectError([&] { run(with([](WriteParams& p) { p.bits = 9; }), nullptr); },
              ErrorCode::kInvalidArgument, {"bits 9"});
  ExpectError([&] { run(with([](WriteParams& p) { p.group = 32; }), nullptr); },
              ErrorCode::kInvalidArgument, {"group size 32", "head_dim 64"});
  ExpectError([&] { run(with([](WriteParams& p) { p.clip = 0.9f; }), nullptr); },
              ErrorCode::kInvalidArgument, {"clip ratio 0.9"});
  ExpectError([&] { run(with([](WriteParams& p) { p.norm = true; }), nullptr); },
              ErrorCode::kInvalidArgument, {"norm"});
  ExpectError([&] { run(with([](WriteParams& p) { p.segments = 9; }), nullptr); },
              ErrorCode::kInvalidArgument, {"segments 9", "1..8"});
  ExpectError([&] { run(with([](WriteParams& p) { p.segments = 0; }), nullptr); },
              ErrorCode::kInvalidArgument, {"segments 0"});
  ExpectError([&] { run(with([](WriteParams& p) { p.code_bytes = 65; }), nullptr); },
              ErrorCode::kInvalidArgument, {"code_bytes 65", "head_dim 64"});
  ExpectError([&] { run(with([](WriteParams& p) { p.code_bytes = -1; }), nullptr); },
              ErrorCode::kInvalidArgument, {"code_bytes -1"});
  ExpectError([&] { run(with([](WriteParams& p) { p.head_scale = 2.0f; }), nullptr); },
              ErrorCode::kInvalidArgument, {"head scale 2"});
  // Codebook fields on another format.
  ExpectError([&] { Write().head_dim(64).group(32).bits(2).segments(2).Build(); },
              ErrorCode::kInvalidArgument, {"segments 2", "codebook only"});
  // Widths outside 1..8, naming the block and the value.
  std::vector<uint8_t> widths(32, 3);
  widths[7] = 9;
  const WriteParams slack = Slack(64);
  ExpectError([&] { run(slack, &widths); }, ErrorCode::kInvalidArgument,
              {"block widths of KV head 0", "has 9", "block 7"});
  widths[7] = 0;
  ExpectError([&] { run(slack, &widths); }, ErrorCode::kInvalidArgument, {"has 0", "block 7"});
  // A layout needing more segments or code bytes than the params allow, naming both counts.
  for (size_t i = 0; i < widths.size(); ++i) widths[i] = static_cast<uint8_t>(1 + i % 3);
  ExpectError([&] { run(with([](WriteParams& p) { p.segments = 2; p.code_bytes = 64; }), &widths); },
              ErrorCode::kInvalidArgument, {"3 segments", "side's 2"});
  // widths 1, 2, 3 over 32 blocks: 11 + 11 + 10 blocks -> 3 + 6 + 8 = 17 bytes.
  ExpectError([&] { run(with([](WriteParams& p) { p.segments = 3; p.code_bytes = 16; }), &widths); },
              ErrorCode::kInvalidArgument, {"17 code bytes", "side's 16"});
  // A uniform head (no widths) must fit the row limits too: d*b/8 = 24 > 16.
  ExpectError([&] { run(with([](WriteParams& p) { p.code_bytes = 16; }), nullptr); },
              ErrorCode::kInvalidArgument, {"24 code bytes", "side's 16"});
  // A segment whose square sum overflows: kNonFinite naming the row and the segment.
  std::vector<float> huge(2 * 64, 0.5f);
  huge[64 + 5] = 3e30f;
  ExpectError([&] { QuantizeRows(BestBackend(), good, HeadArrays{}, huge.data(), 2); },
              ErrorCode::kNonFinite, {"row 1", "segment 0", "overflows"});
  // Per-head widths in a cache-like HeadData: a side that is not codebook rejects them.
  HeadData heads;
  heads.widths.assign(2 * 32, 3);
  ExpectError([&] { heads.Validate(Write().head_dim(64).group(32).bits(2).Build(), 2, "key"); },
              ErrorCode::kInvalidArgument, {"key block widths given"});
  heads.widths[32 + 4] = 12;
  ExpectError([&] { heads.Validate(slack, 2, "value"); }, ErrorCode::kInvalidArgument,
              {"value block widths of KV head 1", "has 12", "block 4"});
  heads.widths.resize(10);
  ExpectError([&] { heads.Validate(slack, 2, "key"); }, ErrorCode::kShapeMismatch,
              {"key block widths has 10 values"});
}

}  // namespace
}  // namespace kvq::cpu
