// Each named stage of the CUDA write path against cpu_ref's scalar backend, bit for bit, over
// the (d, G, bits) grid; plus the whole QuantizeRows pipeline run through CudaBackend().
// Device outputs are poisoned with two different bytes before two runs, so an element a kernel
// never writes cannot match.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

using namespace kvq::gpu::testing;

struct StageCase {
  Shape shape;
  int bits;
};

class WriteStagesTest : public ::testing::TestWithParam<StageCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
  WriteParams Params(const RotationVariant& v, float clip = 1.0f) const {
    return MakeParams(GetParam().shape.d, GetParam().shape.group, GetParam().bits, v, clip);
  }
  WriteParams Plain() const { return Params(RotationVariants()[0]); }
  uint32_t Seed() const {
    return 1000u * GetParam().shape.d + 10u * GetParam().shape.group + GetParam().bits;
  }
  const cpu::WriteKernels& Oracle() const { return cpu::ScalarBackend().write; }
};

constexpr size_t kRows = 77;  // not a multiple of any block or tile size

TEST_P(WriteStagesTest, RotateDenseMatchesScalar) {
  const WriteParams p = Params(RotationVariants()[2]);
  const int d = p.head_dim;
  std::mt19937 rng(Seed());
  const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
  const std::vector<float> r = RandomRotations(1, d, rng);
  std::vector<float> expected(x.size());
  Oracle().rotate_dense(x.data(), r.data(), expected.data(), kRows, p);
  DeviceBuffer<float> dx(x), dr(r), dy(x.size());
  for (uint8_t poison : kPoisons) {
    dy.Fill(poison);
    RotateDense(dx.get(), dr.get(), dy.get(), kRows, p);
    EXPECT_TRUE(BitsEqual(expected, dy.Download(), d, "rotate_dense",
                          ParamsString(p) + " seed=" + std::to_string(Seed())));
  }
}

TEST_P(WriteStagesTest, FwhtMatchesScalarForEveryBlock) {
  const int d = GetParam().shape.d;
  std::mt19937 rng(Seed());
  for (int block = 16; block <= d; block *= 2) {
    WriteParams p = Plain();
    p.rotation = RotationKind::kHadamard;
    p.hadamard_block = block;
    const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
    std::vector<float> expected = x;
    Oracle().fwht(expected.data(), kRows, p);
    DeviceBuffer<float> dx(x);
    Fwht(dx.get(), kRows, p);
    EXPECT_TRUE(BitsEqual(expected, dx.Download(), d, "fwht", ParamsString(p)));
  }
}

TEST_P(WriteStagesTest, BitrevMatchesScalar) {
  const WriteParams p = Plain();
  std::mt19937 rng(Seed());
  const std::vector<float> x = MixedRows(kRows, p.head_dim, p.group, p.levels(), rng);
  std::vector<float> expected(x.size());
  Oracle().bitrev(x.data(), expected.data(), kRows, p);
  DeviceBuffer<float> dx(x), dy(x.size());
  for (uint8_t poison : kPoisons) {
    dy.Fill(poison);
    Bitrev(dx.get(), dy.get(), kRows, p);
    EXPECT_TRUE(BitsEqual(expected, dy.Download(), p.head_dim, "bitrev", ParamsString(p)));
  }
}

TEST_P(WriteStagesTest, ClipMatchesScalarOnEverySelectionPath) {
  const int d = GetParam().shape.d;
  std::mt19937 rng(Seed());
  for (float clip : ClipRatios(d)) {
    const WriteParams p = Params(RotationVariants()[0], clip);
    const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
    std::vector<float> expected = x;
    std::vector<float> expected_tau(kRows);
    Oracle().clip(expected.data(), expected_tau.data(), kRows, p);
    DeviceBuffer<float> dx(x.size()), dtau(kRows);
    for (uint8_t poison : kPoisons) {
      dx.Upload(x);
      dtau.Fill(poison);
      Clip(dx.get(), dtau.get(), kRows, p);
      EXPECT_TRUE(BitsEqual(expected_tau, dtau.Download(), 1, "clip tau", ParamsString(p)));
      EXPECT_TRUE(BitsEqual(expected, dx.Download(), d, "clip x", ParamsString(p)));
    }
  }
}

TEST_P(WriteStagesTest, QuantizeMatchesScalar) {
  const WriteParams p = Plain();
  const int d = p.head_dim;
  std::mt19937 rng(Seed());
  const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
  const size_t groups = kRows * p.num_groups();
  std::vector<uint8_t> codes(x.size());
  std::vector<uint16_t> scale(groups), min(groups);
  Oracle().quantize(x.data(), codes.data(), scale.data(), min.data(), kRows, p);
  DeviceBuffer<float> dx(x);
  DeviceBuffer<uint8_t> dcodes(x.size());
  DeviceBuffer<uint16_t> dscale(groups), dmin(groups);
  for (uint8_t poison : kPoisons) {
    dcodes.Fill(poison);
    dscale.Fill(poison);
    dmin.Fill(poison);
    Quantize(dx.get(), dcodes.get(), dscale.get(), dmin.get(), kRows, p);
    const std::string context = ParamsString(p);
    EXPECT_TRUE(BitsEqual(codes, dcodes.Download(), d, "quantize codes", context));
    EXPECT_TRUE(BitsEqual(scale, dscale.Download(), p.num_groups(), "quantize scale", context));
    EXPECT_TRUE(BitsEqual(min, dmin.Download(), p.num_groups(), "quantize min", context));
  }
}

TEST_P(WriteStagesTest, PackAndUnpackMatchScalarExhaustively) {
  const WriteParams p = Plain();
  const int d = p.head_dim;
  const size_t bytes_per_row = static_cast<size_t>(p.code_bytes());
  // Packed rows holding every byte value 0..255 (then random codes for pack).
  const size_t rows = (256 + bytes_per_row - 1) / bytes_per_row + 3;
  std::vector<uint8_t> packed(rows * bytes_per_row);
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<uint8_t>(i * 37 % 256);
  std::vector<uint8_t> codes(rows * d);
  Oracle().unpack(packed.data(), codes.data(), rows, p);
  DeviceBuffer<uint8_t> dpacked(packed), dcodes(codes.size());
  for (uint8_t poison : kPoisons) {
    dcodes.Fill(poison);
    Unpack(dpacked.get(), dcodes.get(), rows, p);
    EXPECT_TRUE(BitsEqual(codes, dcodes.Download(), d, "unpack", ParamsString(p)));
  }
  std::mt19937 rng(Seed());
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % (p.levels() + 1));
  std::vector<uint8_t> expected(packed.size());
  Oracle().pack(codes.data(), expected.data(), rows, p);
  DeviceBuffer<uint8_t> dcodes_in(codes), dout(packed.size());
  for (uint8_t poison : kPoisons) {
    dout.Fill(poison);
    Pack(dcodes_in.get(), dout.get(), rows, p);
    EXPECT_TRUE(BitsEqual(expected, dout.Download(), bytes_per_row, "pack", ParamsString(p)));
  }
}

TEST_P(WriteStagesTest, DequantizeMatchesScalar) {
  const WriteParams p = Plain();
  const int d = p.head_dim;
  std::mt19937 rng(Seed());
  const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
  const size_t groups = kRows * p.num_groups();
  std::vector<uint8_t> codes(x.size());
  std::vector<uint16_t> scale(groups), min(groups);
  Oracle().quantize(x.data(), codes.data(), scale.data(), min.data(), kRows, p);
  std::vector<float> expected(x.size());
  Oracle().dequantize(codes.data(), scale.data(), min.data(), expected.data(), kRows, p);
  DeviceBuffer<uint8_t> dcodes(codes);
  DeviceBuffer<uint16_t> dscale(scale), dmin(min);
  DeviceBuffer<float> dy(x.size());
  for (uint8_t poison : kPoisons) {
    dy.Fill(poison);
    Dequantize(dcodes.get(), dscale.get(), dmin.get(), dy.get(), kRows, p);
    EXPECT_TRUE(BitsEqual(expected, dy.Download(), d, "dequantize", ParamsString(p)));
  }
}

// cpu::QuantizeRows through the CUDA backend's host wrappers: every stage output of the whole
// pipeline, for every rotation variant.
TEST_P(WriteStagesTest, QuantizeRowsThroughCudaBackendMatchesScalar) {
  const int d = GetParam().shape.d;
  std::mt19937 rng(Seed() + 7);
  for (const RotationVariant& v : RotationVariants()) {
    const WriteParams p = Params(v, 0.96f);
    const std::vector<float> x = MixedRows(kRows, d, p.group, p.levels(), rng);
    const std::vector<float> r = RandomRotations(1, d, rng);
    const cpu::QuantizedRows want = cpu::QuantizeRows(cpu::ScalarBackend(), p, r.data(), x.data(), kRows);
    const cpu::QuantizedRows got = cpu::QuantizeRows(CudaBackend(), p, r.data(), x.data(), kRows);
    const std::string context = ParamsString(p) + " variant=" + v.name;
    EXPECT_TRUE(BitsEqual(want.rotated, got.rotated, d, "rotated", context));
    EXPECT_TRUE(BitsEqual(want.tau, got.tau, 1, "tau", context));
    EXPECT_TRUE(BitsEqual(want.codes, got.codes, d, "codes", context));
    EXPECT_TRUE(BitsEqual(want.packed, got.packed, p.code_bytes(), "packed", context));
    EXPECT_TRUE(BitsEqual(want.scale, got.scale, p.num_groups(), "scale", context));
    EXPECT_TRUE(BitsEqual(want.min, got.min, p.num_groups(), "min", context));
    EXPECT_TRUE(BitsEqual(want.dequantized, got.dequantized, d, "dequantized", context));
  }
}

std::vector<StageCase> AllStageCases() {
  std::vector<StageCase> cases;
  for (const Shape& s : Shapes()) {
    for (int bits : {2, 4}) cases.push_back({s, bits});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Grid, WriteStagesTest, ::testing::ValuesIn(AllStageCases()),
    [](const ::testing::TestParamInfo<StageCase>& info) {
      return "d" + std::to_string(info.param.shape.d) + "_g" +
             std::to_string(info.param.shape.group) + "_int" + std::to_string(info.param.bits) +
             "__cuda";
    });

}  // namespace
}  // namespace kvq::gpu
