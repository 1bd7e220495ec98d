// The fused CUDA write kernels (WriteRows) against cpu::QuantizeRows on the scalar backend,
// bit for bit: rotated rows, clip thresholds, packed codes, bf16 scale and min, over the full
// grid d x G x bits x rotation variant x clip ratio x input type (bf16, fp32); and the tile
// write of affine_tile (codes, scale, min, the per-head norm) over d x G_k x bits x rotation x
// norm x clip.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "gpu_timing.h"  // bench/
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/gpu/write.h"
#include "kvq/testbed/cache_checks.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"

namespace kvq::gpu {
namespace {

using namespace kvq::gpu::testing;
using conformance::MixedRows;
using conformance::SplitMix64;
using conformance::TestRowKinds;
using testbed::AllBitsEqual;
using testbed::AsTensor;
using testbed::Describe;
using testbed::FromBf16;
using testbed::NamedTensors;
using testbed::ToBf16;
using testbed::Write;

struct FusedCase {
  Shape shape;
  int bits;
  size_t variant;  // index into RotationVariants()
};

// Runs WriteRows on n rows once per poison byte and compares every output with the oracle
// (a failure dumps the rows, the rotation, the oracle's outputs and the kernel's): the rotated
// rows, the clip thresholds, and each plane of LayoutOf(p) against the write-path output it
// stores (affine_token: packed, scale, min; fp8_e4m3: codes).
// widths: a codebook row's block widths (d/2), or empty for none.
void ExpectFusedMatchesOracle(const WriteParams& p, const std::vector<float>& rotation,
                              const std::vector<float>& x_f32, const std::vector<uint16_t>* x_bf16,
                              size_t n, const std::string& context,
                              const std::vector<uint8_t>& widths = {}) {
  const int d = p.head_dim;
  HeadArrays head_arrays;
  head_arrays.rotation = p.rotation == RotationKind::kDense ? rotation.data() : nullptr;
  head_arrays.widths = widths.empty() ? nullptr : widths.data();
  const cpu::QuantizedRows want =
      cpu::QuantizeRows(cpu::ScalarBackend(), p, head_arrays, x_f32.data(), n);
  const FormatLayout layout = LayoutOf(p);
  NamedTensors expected = {{"rotated", AsTensor(want.rotated, d)}, {"tau", AsTensor(want.tau)}};
  std::vector<DeviceBuffer<uint8_t>> planes;
  for (int i = 0; i < layout.num_planes; ++i) {
    const Tensor& stored = want.Output(layout.plane(i).source);
    expected.emplace_back(layout.plane(i).source, stored);
    planes.emplace_back(stored.bytes.size());
  }
  const NamedTensors inputs = {
      {"x", x_bf16 != nullptr ? AsTensor(*x_bf16, d) : AsTensor(x_f32, d)},
      {"rotation", AsTensor(rotation, d)}};
  DeviceBuffer<float> dr(rotation);
  DeviceBuffer<uint8_t> dwidths(widths);
  HeadData head;
  head.rotation = dr.get();
  head.widths = widths.empty() ? nullptr : dwidths.get();
  DeviceBuffer<float> dx_f32(x_f32);
  DeviceBuffer<uint16_t> dx_bf16(x_bf16 != nullptr ? *x_bf16 : std::vector<uint16_t>());
  DeviceBuffer<float> rotated(n * d), tau(n);
  DeviceBuffer<int> flags(1);
  for (uint8_t poison : kPoisons) {
    for (const DeviceBuffer<uint8_t>& plane : planes) plane.Fill(poison);
    rotated.Fill(poison);
    tau.Fill(poison);
    flags.Fill(0);
    RowOutputs out;
    for (size_t i = 0; i < planes.size(); ++i) out.planes[i] = planes[i].get();
    out.rotated = rotated.get();
    out.tau = want.tau.empty() ? nullptr : tau.get();  // codebook rows are not clipped
    if (x_bf16 != nullptr) {
      WriteRows(p, head, dx_bf16.get(), n, out, flags.get());
    } else {
      WriteRows(p, head, dx_f32.get(), n, out, flags.get());
    }
    const std::string ctx = context + " poison " + std::to_string(poison);
    NamedTensors got = {{"rotated", AsTensor(rotated.Download(), d)},
                        {"tau", AsTensor(want.tau.empty() ? std::vector<float>() : tau.Download())}};
    for (size_t i = 0; i < planes.size(); ++i) {
      Tensor t = expected[2 + i].second;  // the oracle's dtype and shape, the kernel's bytes
      t.bytes = planes[i].Download();
      got.emplace_back(expected[2 + i].first, std::move(t));
    }
    EXPECT_TRUE(AllBitsEqual(ctx, expected, got, inputs));
    EXPECT_EQ(flags.Download()[0], 0) << ctx;
  }
}

class FusedWriteTest : public ::testing::TestWithParam<FusedCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

TEST_P(FusedWriteTest, MatchesScalarOracleBitForBit) {
  const FusedCase& c = GetParam();
  const RotationVariant& v = RotationVariants()[c.variant];
  const int d = c.shape.d;
  const uint32_t seed = 7919u * d + 131u * c.shape.group + 17u * c.bits + c.variant;
  SplitMix64 rng(seed);
  // Several tiles, the last one partial; the rows take every test row kind in turn (each kind
  // six times).
  constexpr size_t kRows = 150;
  for (float clip : ClipRatios(d)) {
    const WriteParams p = v.Params(d).group(c.shape.group).bits(c.bits).clip(clip);
    const std::vector<float> rotation = testbed::RandomMatrix(d, &rng);
    const std::string context = "FusedWrite " + Describe(p) + " " + v.name + " seed " +
                                std::to_string(seed);
    // bf16 input (what the cache stores): the oracle sees the same values widened exactly.
    const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(kRows, p, &rng));
    ExpectFusedMatchesOracle(p, rotation, FromBf16(x_bf16), &x_bf16, kRows, context + " bf16");
    // fp32 input.
    const std::vector<float> x_f32 = MixedRows(kRows, p, &rng);
    ExpectFusedMatchesOracle(p, rotation, x_f32, nullptr, kRows, context + " f32");
  }
}

// A dense rotation over few rows (an append step's demotions: one row a sequence) takes the
// tile kernel's few-rows product (FewRows: at most 16, 8, 4 rows at d = 64, 128, 256); one
// more row takes the whole-tile product. Both sides of that edge, one row, and a tile plus a
// few rows, against the oracle's bits.
TEST(FusedWriteFewRows, DenseRotationMatchesScalarOracleBitForBit) {
  KVQ_SKIP_WITHOUT_CUDA();
  for (const Shape& s : Shapes()) {
    const int d = s.d;
    const size_t few = static_cast<size_t>(4 * 256 / d);  // the few-rows limit at this d
    const size_t tile = 4 * few;                          // the tile's rows
    for (size_t v = 0; v < RotationVariants().size(); ++v) {
      const RotationVariant& variant = RotationVariants()[v];
      if (variant.kind != RotationKind::kDense) continue;
      SplitMix64 rng(104729u * d + 31u * s.group + v);
      const WriteParams p = variant.Params(d).group(s.group).bits(2);
      const std::vector<float> rotation = testbed::RandomMatrix(d, &rng);
      for (size_t rows : {size_t{1}, size_t{3}, few - 1, few, few + 1, tile + few}) {
        const std::string context = "FusedWriteFewRows " + Describe(p) + " " + variant.name +
                                    " rows " + std::to_string(rows);
        const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(rows, p, &rng));
        ExpectFusedMatchesOracle(p, rotation, FromBf16(x_bf16), &x_bf16, rows, context + " bf16");
        const std::vector<float> x_f32 = MixedRows(rows, p, &rng);
        ExpectFusedMatchesOracle(p, rotation, x_f32, nullptr, rows, context + " f32");
      }
    }
  }
}

std::vector<FusedCase> AllFusedCases() {
  std::vector<FusedCase> cases;
  for (const Shape& s : Shapes()) {
    for (int bits : {2, 4}) {
      for (size_t v = 0; v < RotationVariants().size(); ++v) cases.push_back({s, bits, v});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, FusedWriteTest, ::testing::ValuesIn(AllFusedCases()),
    [](const ::testing::TestParamInfo<FusedCase>& info) {
      return "d" + std::to_string(info.param.shape.d) + "_g" +
             std::to_string(info.param.shape.group) + "_int" + std::to_string(info.param.bits) +
             "_" + RotationVariants()[info.param.variant].name + "__cuda";
    });

// The fp8_e4m3 write (the fused kernels' e4m3 epilogue): rotated rows, clip thresholds and
// the e4m3 codes, bit for bit against the scalar oracle, for every d and rotation variant,
// clip ratios below 1 and scales that make codes saturate (s^ small: |x / s^| > 448) or go
// subnormal (s^ large), bf16 and fp32 input, under every poison byte.
class Fp8FusedWriteTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

TEST_P(Fp8FusedWriteTest, MatchesScalarOracleBitForBit) {
  const int d = std::get<0>(GetParam());
  const RotationVariant& v = RotationVariants()[std::get<1>(GetParam())];
  const uint32_t seed = 104729u * d + 31u * static_cast<uint32_t>(std::get<1>(GetParam()));
  SplitMix64 rng(seed);
  constexpr size_t kRows = 150;
  for (float clip : {1.0f, 0.96f}) {
    for (float scale : {1.0f, 0.0371f, 37.5f, 1.0f / 448.0f}) {
      const WriteParams p = v.Params(d).fp8(scale).clip(clip);
      const std::vector<float> rotation = testbed::RandomMatrix(d, &rng);
      const std::string context = "Fp8Write " + Describe(p) + " " + v.name + " seed " +
                                  std::to_string(seed);
      const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(kRows, p, &rng));
      ExpectFusedMatchesOracle(p, rotation, FromBf16(x_bf16), &x_bf16, kRows, context + " bf16");
      const std::vector<float> x_f32 = MixedRows(kRows, p, &rng);
      ExpectFusedMatchesOracle(p, rotation, x_f32, nullptr, kRows, context + " f32");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, Fp8FusedWriteTest,
    ::testing::Combine(::testing::Values(64, 128, 256),
                       ::testing::Range(size_t{0}, RotationVariants().size())),
    [](const ::testing::TestParamInfo<std::tuple<int, size_t>>& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_fp8_" +
             RotationVariants()[std::get<1>(info.param)].name + "__cuda";
    });

// The codebook write (the fused kernels' codebook epilogue, spec 1.3): rotated rows, packed
// codes and corrected segment norms, bit for bit against the scalar oracle, for every d and
// rotation variant, both densities, uniform rows at every width and rows with per-head widths
// (every width 1..8 present, the rest random: eight segments, a code spanning two bytes),
// bf16 and fp32 input, under every poison byte. Rows of every kind the write path accepts
// (zero segments, subnormal squares, outliers, ties), several tiles and a partial one.
class CodebookFusedWriteTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

std::vector<uint8_t> MixedCodebookWidths(int d, SplitMix64* rng) {
  std::vector<uint8_t> w(static_cast<size_t>(d / 2));
  for (uint8_t& v : w) v = static_cast<uint8_t>(1 + rng->Below(8));
  for (int k = 0; k < 8; ++k) w[static_cast<size_t>(3 * k)] = static_cast<uint8_t>(8 - k);
  return w;
}

TEST_P(CodebookFusedWriteTest, MatchesScalarOracleBitForBit) {
  const int d = std::get<0>(GetParam());
  const RotationVariant& v = RotationVariants()[std::get<1>(GetParam())];
  const uint32_t seed = 7907u * d + 53u * static_cast<uint32_t>(std::get<1>(GetParam()));
  SplitMix64 rng(seed);
  constexpr size_t kRows = 150;
  for (CodebookDensity density : {CodebookDensity::kBeta, CodebookDensity::kGaussian}) {
    // Uniform rows at b = 1..8 (b = 2 and 4: the split layouts; the others the bit stream),
    // then per-head widths in a side sized for any (segments 8, code_bytes d).
    for (int bits = 1; bits <= 9; ++bits) {
      const bool mixed = bits == 9;
      testbed::Write w = v.Params(d).codebook_rows(mixed ? 3 : bits).codebook(density);
      if (mixed) w.segments(8).code_bytes(d);
      const WriteParams p = w;
      const std::vector<uint8_t> widths = mixed ? MixedCodebookWidths(d, &rng) : std::vector<uint8_t>();
      const std::vector<float> rotation = testbed::RandomMatrix(d, &rng);
      const std::string context = "CodebookWrite " + Describe(p) + " " + v.name +
                                  (mixed ? " mixed widths" : "") + " seed " + std::to_string(seed);
      const std::vector<conformance::RowKind> kinds = conformance::TestRowKinds(p);
      const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(kRows, p, &rng, kinds));
      ExpectFusedMatchesOracle(p, rotation, FromBf16(x_bf16), &x_bf16, kRows, context + " bf16",
                               widths);
      const std::vector<float> x_f32 = MixedRows(kRows, p, &rng, kinds);
      ExpectFusedMatchesOracle(p, rotation, x_f32, nullptr, kRows, context + " f32", widths);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CodebookFusedWriteTest,
    ::testing::Combine(::testing::Values(64, 128, 256),
                       ::testing::Range(size_t{0}, RotationVariants().size())),
    [](const ::testing::TestParamInfo<std::tuple<int, size_t>>& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_codebook_" +
             RotationVariants()[std::get<1>(info.param)].name + "__cuda";
    });

// A segment whose square sum overflows fp32 (the rows the validating write path rejects,
// numerics.md §5.4.2) raises kErrorFlagNonFinite; a row the path accepts raises nothing.
TEST(CodebookFusedWrite, OverflowingSegmentNormRaisesTheFlag) {
  KVQ_SKIP_WITHOUT_CUDA();
  const WriteParams p = testbed::Write().head_dim(128).codebook_rows(3);
  std::vector<float> x(2 * 128, 0.5f);
  x[128 + 5] = 1e30f;  // row 1: 1e60 does not fit fp32
  DeviceBuffer<float> dx(x);
  DeviceBuffer<uint8_t> codes(2 * static_cast<size_t>(p.row_code_bytes()));
  DeviceBuffer<uint8_t> norms(2 * 2 * static_cast<size_t>(p.segments));
  DeviceBuffer<int> flags(1);
  for (size_t rows : {size_t{1}, size_t{2}}) {
    flags.Fill(0);
    RowOutputs out;
    out.planes[0] = codes.get();
    out.planes[1] = norms.get();
    WriteRows(p, static_cast<const float*>(nullptr), dx.get(), rows, out, flags.get());
    EXPECT_EQ(flags.Download()[0], rows == 2 ? kErrorFlagNonFinite : 0) << rows << " rows";
  }
}

// The tile write (affine_tile) of n rows, n a whole number of tiles: packed tiles, per-tile
// (scale, min) and with a norm the per-row norm, once per poison byte.
void ExpectTileWriteMatchesOracle(const WriteParams& p, const std::vector<float>& x_f32,
                                  const std::vector<uint16_t>* x_bf16, size_t n,
                                  const std::string& context) {
  const int d = p.head_dim;
  const cpu::QuantizedRows want =
      cpu::QuantizeRows(cpu::ScalarBackend(), p, nullptr, x_f32.data(), n);
  const int64_t tile_bytes = static_cast<int64_t>(d) * p.tile_channel_bytes();
  NamedTensors expected = {{"packed", AsTensor(want.Values<uint8_t>("packed"), tile_bytes)},
                           {"scale", AsTensor(want.Values<uint16_t>("scale"), d)},
                           {"min", AsTensor(want.Values<uint16_t>("min"), d)}};
  if (p.norm) expected.emplace_back("norm", AsTensor(want.Values<uint16_t>("norm")));
  const NamedTensors inputs = {
      {"x", x_bf16 != nullptr ? AsTensor(*x_bf16, d) : AsTensor(x_f32, d)}};
  const size_t tiles = n / static_cast<size_t>(p.group);
  DeviceBuffer<float> dx_f32(x_f32);
  DeviceBuffer<uint16_t> dx_bf16(x_bf16 != nullptr ? *x_bf16 : std::vector<uint16_t>());
  DeviceBuffer<uint8_t> packed(tiles * tile_bytes);
  DeviceBuffer<uint16_t> scale(tiles * d), min(tiles * d), norm(p.norm ? n : 0);
  DeviceBuffer<int> flags(1);
  for (uint8_t poison : kPoisons) {
    packed.Fill(poison);
    scale.Fill(poison);
    min.Fill(poison);
    if (p.norm) norm.Fill(poison);
    flags.Fill(0);
    RowOutputs out;
    out.planes[kTileCodesPlane] = packed.get();
    out.planes[kTileScalePlane] = reinterpret_cast<uint8_t*>(scale.get());
    out.planes[kTileMinPlane] = reinterpret_cast<uint8_t*>(min.get());
    if (p.norm) out.planes[kTileNormPlane] = reinterpret_cast<uint8_t*>(norm.get());
    if (x_bf16 != nullptr) {
      WriteRows(p, nullptr, dx_bf16.get(), n, out, flags.get());
    } else {
      WriteRows(p, nullptr, dx_f32.get(), n, out, flags.get());
    }
    const std::string ctx = context + " poison " + std::to_string(poison);
    NamedTensors got = {{"packed", AsTensor(packed.Download(), tile_bytes)},
                        {"scale", AsTensor(scale.Download(), d)},
                        {"min", AsTensor(min.Download(), d)}};
    if (p.norm) got.emplace_back("norm", AsTensor(norm.Download()));
    EXPECT_TRUE(AllBitsEqual(ctx, expected, got, inputs));
    EXPECT_EQ(flags.Download()[0], 0) << ctx;
  }
}

struct TileCase {
  int d;
  int tile;
  int bits;
  size_t variant;  // index into RotationVariants() (not the dense ones: no tile kernel)
  bool norm;
};

class TileWriteTest : public ::testing::TestWithParam<TileCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

TEST_P(TileWriteTest, MatchesScalarOracleBitForBit) {
  const TileCase& c = GetParam();
  const RotationVariant& v = RotationVariants()[c.variant];
  const uint32_t seed = 6007u * c.d + 257u * c.tile + 31u * c.bits + 7u * c.variant + c.norm;
  SplitMix64 rng(seed);
  for (float clip : {1.0f, 0.92f, 0.001f}) {
    const WriteParams p = v.Params(c.d).tile(c.tile).bits(c.bits).clip(clip).norm(c.norm);
    // Three tiles of rows of every test row kind the write path accepts, in turn.
    const size_t n = 3 * static_cast<size_t>(c.tile);
    const std::string context = "TileWrite " + Describe(p) + " " + v.name + " seed " +
                                std::to_string(seed);
    const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(n, p, &rng, TestRowKinds(p)));
    ExpectTileWriteMatchesOracle(p, FromBf16(x_bf16), &x_bf16, n, context + " bf16");
    const std::vector<float> x_f32 = MixedRows(n, p, &rng, TestRowKinds(p));
    ExpectTileWriteMatchesOracle(p, x_f32, nullptr, n, context + " f32");
  }
}

std::vector<TileCase> AllTileCases() {
  std::vector<TileCase> cases;
  for (int d : {64, 128, 256}) {
    for (int tile : {32, 64, 128}) {
      for (int bits : {2, 4}) {
        for (size_t v = 0; v < RotationVariants().size(); ++v) {
          if (RotationVariants()[v].kind == RotationKind::kDense) continue;
          for (bool norm : {false, true}) cases.push_back({d, tile, bits, v, norm});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, TileWriteTest, ::testing::ValuesIn(AllTileCases()),
    [](const ::testing::TestParamInfo<TileCase>& info) {
      const TileCase& c = info.param;
      return "d" + std::to_string(c.d) + "_tile" + std::to_string(c.tile) + "_int" +
             std::to_string(c.bits) + "_" + RotationVariants()[c.variant].name +
             (c.norm ? "_norm" : "") + "__cuda";
    });

// The tile write refuses what it has no kernel for, naming it: a dense rotation, a row count
// that is not a whole number of tiles, the token-scope norm on one head's flat rows.
TEST(TileWriteRefuses, DenseRowsOfPartialTilesAndTheTokenScope) {
  KVQ_SKIP_WITHOUT_CUDA();
  DeviceBuffer<float> x(64 * 64), rotation(64 * 64);
  DeviceBuffer<uint8_t> planes(1 << 16);
  RowOutputs out;
  for (int i = 0; i < 4; ++i) out.planes[i] = planes.get() + i * 16384;
  testbed::ExpectError(
      [&] { WriteRows(Write().head_dim(64).tile(32).rotation(RotationKind::kDense), rotation.get(),
                      x.get(), 64, out); },
      ErrorCode::kUnsupported, {"dense"});
  testbed::ExpectError([&] { WriteRows(Write().head_dim(64).tile(32), nullptr, x.get(), 48, out); },
                       ErrorCode::kInvalidArgument, {"48 rows", "32 tokens"});
  testbed::ExpectError(
      [&] { WriteRows(Write().head_dim(64).tile(32).norm().norm_heads(2), nullptr, x.get(), 32, out); },
      ErrorCode::kInvalidArgument, {"norm over 2 KV heads"});
}

// Many more tiles than resident blocks: the dense kernel's persistent loop over tiles (R kept
// in shared memory across tiles) and the streamed-R path of d = 256.
TEST(FusedWriteLarge, PersistentTilesMatchScalar) {
  KVQ_SKIP_WITHOUT_CUDA();
  SplitMix64 rng(42);
  for (int d : {128, 256}) {
    const WriteParams p = Write().head_dim(d).group(64).bits(2).clip(0.96f)
                              .rotation(RotationKind::kDense).bitrev();
    const size_t rows = d == 128 ? 20000 : 3000;
    const std::vector<uint16_t> x_bf16 = ToBf16(testbed::KvRows(rows, 1, d, &rng));
    ExpectFusedMatchesOracle(p, testbed::RandomMatrix(d, &rng), FromBf16(x_bf16), &x_bf16, rows,
                             "FusedWriteLarge " + Describe(p) + " persistent");
  }
}

// bf16 input on the non-dense paths: the streaming kernel's grid is persistent and each warp
// loops over batches of rows. Enough rows for every resident warp (at most 4 blocks of 8 per
// SM) to take at least three batches, the last one partial.
TEST(FusedWriteLarge, PrefetchedTilesMatchScalar) {
  KVQ_SKIP_WITHOUT_CUDA();
  int device = 0;
  int sms = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&device));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SplitMix64 rng(4242);
  for (int d : {64, 128, 256}) {
    for (size_t variant : {size_t{0}, size_t{5}}) {  // identity; fwht_bitrev
      const RotationVariant& v = RotationVariants()[variant];
      const WriteParams p = v.Params(d).group(32).bits(4).clip(0.92f);
      const size_t tile_rows = 4096 / d;
      const size_t rows = 3 * 4 * static_cast<size_t>(sms) * tile_rows + 7;
      const std::vector<uint16_t> x_bf16 = ToBf16(MixedRows(rows, p, &rng));
      ExpectFusedMatchesOracle(p, testbed::RandomMatrix(d, &rng), FromBf16(x_bf16), &x_bf16, rows,
                               "FusedWriteLarge " + Describe(p) + " " + v.name + " prefetched");
    }
  }
}

// Rows the validating CPU path rejects raise kErrorFlagNonFinite instead of passing silently.
TEST(FusedWriteFlags, NonFiniteAndOutOfRangeRowsRaiseTheFlag) {
  KVQ_SKIP_WITHOUT_CUDA();
  const WriteParams p = Write().head_dim(128).group(64).bits(2);  // identity, no clip
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(), 1.0e38f};
  for (float bad : bad_values) {
    std::vector<float> x(4 * 128, 1.0f);
    x[2 * 128 + 5] = bad;
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint8_t> packed(4 * p.packed_bytes());
    DeviceBuffer<uint16_t> scale(4 * p.num_groups()), min(4 * p.num_groups());
    DeviceBuffer<int> flags(1);
    flags.Fill(0);
    RowOutputs out;
    out.planes[kAffineCodesPlane] = packed.get();
    out.planes[kAffineScalePlane] = reinterpret_cast<uint8_t*>(scale.get());
    out.planes[kAffineMinPlane] = reinterpret_cast<uint8_t*>(min.get());
    WriteRows(p, nullptr, dx.get(), 4, out, flags.get());
    EXPECT_EQ(flags.Download()[0], kErrorFlagNonFinite) << "value " << bad;
    EXPECT_THROW(CheckErrorFlags(flags.get(), "WriteRows"), Error);
  }
}

// bf16 bits out of a plane's bytes.
std::vector<uint16_t> Bf16Plane(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> out(bytes.size() / 2);
  std::memcpy(out.data(), bytes.data(), out.size() * 2);
  return out;
}

// The timing helper of `kvq bench` (bench/gpu_timing.h) returns the write's outputs: the
// oracle's bits.
TEST(TimeWriteRowsTest, ReturnsTheOraclesBits) {
  using bench::TimedRowWrite;
  using bench::TimeWriteRows;
  KVQ_SKIP_WITHOUT_CUDA();
  SplitMix64 rng(77);
  for (size_t variant : {size_t{3}, size_t{5}}) {  // dense_bitrev; fwht_bitrev
    const RotationVariant& v = RotationVariants()[variant];
    const WriteParams p = v.Params(128).group(64).bits(2).clip(0.96f);
    const std::vector<float> rotation = testbed::RandomMatrix(128, &rng);
    const size_t rows = 1000;
    const std::vector<float> x = MixedRows(rows, p, &rng);
    const cpu::QuantizedRows want =
        cpu::QuantizeRows(cpu::ScalarBackend(), p, rotation.data(), x.data(), rows);
    const TimedRowWrite got = TimeWriteRows(p, rotation.data(), x.data(), rows, 3, 1);
    const std::string ctx = "TimeWriteRows " + Describe(p) + " " + v.name;
    EXPECT_GT(got.median_us, 0.0) << ctx;
    EXPECT_TRUE(AllBitsEqual(
        ctx,
        {{"packed", AsTensor(want.Values<uint8_t>("packed"), p.packed_bytes())},
         {"scale", AsTensor(want.Values<uint16_t>("scale"), p.num_groups())},
         {"min", AsTensor(want.Values<uint16_t>("min"), p.num_groups())}},
        {{"packed", AsTensor(got.planes[kAffineCodesPlane], p.packed_bytes())},
         {"scale", AsTensor(Bf16Plane(got.planes[kAffineScalePlane]), p.num_groups())},
         {"min", AsTensor(Bf16Plane(got.planes[kAffineMinPlane]), p.num_groups())}},
        {{"x", AsTensor(x, 128)}, {"rotation", AsTensor(rotation, 128)}}));
  }
  const WriteParams p = Write().head_dim(128).group(64).bits(2);  // identity, no clip
  const std::vector<float> x(128, 1.0f);
  EXPECT_THROW(TimeWriteRows(p, nullptr, x.data(), 0, 3, 1), Error);  // no rows
  EXPECT_THROW(TimeWriteRows(p, nullptr, x.data(), 1, 0, 1), Error);  // no timed run
  std::vector<float> bad = x;
  bad[7] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(TimeWriteRows(p, nullptr, bad.data(), 1, 3, 1), Error);  // kNonFinite
}

}  // namespace
}  // namespace kvq::gpu
