// The codebook calibration contract (issue 22): `kvq calibrate --activations A --scheme blockgtq
// --k-bits B [--v-bits B] --out C` writes, per layer l, layers.{l}.k_bits U8 [Hkv, d/2] and
// layers.{l}.k_rotation / v_rotation F32 [Hkv, d, d]; misuse fails naming the offending value
// and creates nothing outside --out.
#include <dirent.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::RunKvq;
using cli_testing::ScratchDir;

std::set<std::string> Listing(const ScratchDir& dir) {
  std::set<std::string> names;
  DIR* d = ::opendir(dir.File("").c_str());
  while (const dirent* e = d ? ::readdir(d) : nullptr) {
    const std::string name = e->d_name;
    if (name != "." && name != ".." && name != "stdout.txt" && name != "stderr.txt") {
      names.insert(name);
    }
  }
  if (d) ::closedir(d);
  return names;
}

class CodebookCalibrateCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("kvq_cbcal");
    ASSERT_EQ(RunKvq(*dir_, "synth --out a.safetensors --layers 2 --tokens 256 --q-heads 8 "
                            "--kv-heads 2 --head-dim 128 --seed 3")
                  .exit_code,
              0);
  }
  static void TearDownTestSuite() { delete dir_; }
  static ScratchDir* dir_;
};
ScratchDir* CodebookCalibrateCli::dir_ = nullptr;

TEST_F(CodebookCalibrateCli, BlockGtqWritesTheContractsTensors) {
  const ScratchDir& dir = *dir_;
  const std::set<std::string> before = Listing(dir);
  const auto r = RunKvq(dir, "calibrate --activations a.safetensors --scheme blockgtq "
                             "--k-bits 2.5 --v-bits 2 --out c.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> after = Listing(dir);
  after.erase("c.safetensors");
  EXPECT_EQ(after, before);  // nothing outside --out
  EXPECT_NE(r.out.find("budget 160 of 64 blocks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("allocation stability"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hamming mean"), std::string::npos) << r.out;
  const Safetensors file = ReadSafetensors(dir.File("c.safetensors"));
  EXPECT_EQ(file.metadata.at("scheme"), "blockgtq");
  EXPECT_EQ(file.metadata.at("format_version"), "4");
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const Tensor& bits = file.Get(p + "k_bits");
    EXPECT_EQ(bits.dtype, DType::kU8);
    EXPECT_EQ(bits.shape, (std::vector<int64_t>{2, 64}));
    for (int h = 0; h < 2; ++h) {
      int sum = 0;
      for (int i = 0; i < 64; ++i) {
        const int w = bits.data<uint8_t>()[h * 64 + i];
        EXPECT_TRUE(w >= 1 && w <= 8);
        sum += w;
      }
      EXPECT_EQ(sum, 160);
    }
    for (const char* side : {"k_rotation", "v_rotation"}) {
      EXPECT_EQ(file.Get(p + side).dtype, DType::kF32);
      EXPECT_EQ(file.Get(p + side).shape, (std::vector<int64_t>{2, 128, 128}));
    }
  }
  const calib::Calibration cal = calib::ReadCalibration(dir.File("c.safetensors"));
  EXPECT_EQ(cal.info.v_bits, 2);
  // tq_mse: Haar rotations only.
  ASSERT_EQ(RunKvq(dir, "calibrate --activations a.safetensors --scheme tq_mse --k-bits 3 "
                        "--out t.safetensors")
                .exit_code,
            0);
  const Safetensors t = ReadSafetensors(dir.File("t.safetensors"));
  EXPECT_EQ(t.tensors.size(), 4u);
  EXPECT_EQ(t.Find("layers.0.k_bits"), nullptr);
  // They are the tq_mse scheme's own rotations (BuildLayerScheme: the same seed, derived per
  // layer, KV head and side), bit for bit, so a program that reads rotations from a file (the
  // torch path) can run tq_mse from this one.
  const calib::Calibration tq = calib::ReadCalibration(dir.File("t.safetensors"));
  const calib::Activations acts = calib::ReadActivations(dir.File("a.safetensors"));
  for (int l = 0; l < 2; ++l) {
    const calib::LayerScheme scheme =
        calib::BuildLayerScheme("tq_mse", acts, nullptr, l, calib::SchemeOptions());
    for (int side = 0; side < 2; ++side) {
      const std::vector<float>& built = scheme.heads(side).rotation;
      const std::vector<float>& stored = tq.layers[l].heads(side).rotation;
      ASSERT_EQ(built.size(), stored.size()) << "layer " << l << " side " << side;
      EXPECT_EQ(std::memcmp(built.data(), stored.data(), built.size() * sizeof(float)), 0)
          << "layer " << l << " side " << side;
    }
  }
}

// kvq eval and kvq ppl serve blockgtq from an OSCAR calibration and the capture
// (calib::CalibrationForScheme at the schemes' options): what they compute is the file kvq
// calibrate --scheme blockgtq writes for the same K and V widths and seed, tensor for tensor;
// and kvq eval runs the scheme on such a calibration.
TEST_F(CodebookCalibrateCli, EvalsBlockGtqCalibrationIsKvqCalibrates) {
  const ScratchDir& dir = *dir_;
  ASSERT_EQ(RunKvq(dir, "calibrate --activations a.safetensors --out oscar.safetensors").exit_code,
            0);
  const auto r = RunKvq(dir, "calibrate --activations a.safetensors --scheme blockgtq "
                             "--k-bits 3 --v-bits 2 --seed 9 --out g.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const calib::Calibration file = calib::ReadCalibration(dir.File("g.safetensors"));
  const calib::Calibration oscar = calib::ReadCalibration(dir.File("oscar.safetensors"));
  const calib::Activations acts = calib::ReadActivations(dir.File("a.safetensors"));
  calib::SchemeOptions options;
  options.k_bits = 3;
  options.v_bits = 2;
  options.seed = 9;
  const calib::Calibration made =
      calib::CalibrationForScheme("blockgtq", oscar, &acts, cpu::ScalarBackend(), options);
  EXPECT_EQ(made.info.scheme, "blockgtq");
  EXPECT_EQ(made.info.bits, file.info.bits);
  EXPECT_EQ(made.info.v_bits, file.info.v_bits);
  EXPECT_EQ(made.info.codebook.k_avg_bits, file.info.codebook.k_avg_bits);
  EXPECT_EQ(made.info.codebook.k_segments, file.info.codebook.k_segments);
  EXPECT_EQ(made.info.codebook.k_code_bytes, file.info.codebook.k_code_bytes);
  EXPECT_EQ(made.info.codebook.seed, file.info.codebook.seed);
  ASSERT_EQ(made.layers.size(), file.layers.size());
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (size_t l = 0; l < made.layers.size(); ++l) {
    EXPECT_EQ(made.layers[l].key.widths, file.layers[l].key.widths) << "layer " << l;
    EXPECT_TRUE(same_bits(made.layers[l].k_scores, file.layers[l].k_scores)) << "layer " << l;
    EXPECT_TRUE(same_bits(made.layers[l].key.rotation, file.layers[l].key.rotation)) << l;
    EXPECT_TRUE(same_bits(made.layers[l].value.rotation, file.layers[l].value.rotation)) << l;
  }
  // kvq eval of blockgtq with the OSCAR calibration: its widths made from the capture (at
  // --bits 2; kvq eval's --k-bits takes 2 or 4 only).
  const auto e = RunKvq(dir, "eval --activations a.safetensors --calibration oscar.safetensors "
                             "--schemes tq_mse,blockgtq");
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(e.out.find("\nblockgtq "), std::string::npos) << e.out;
}

// kvq eval --report with a codebook calibration (no eigenvalues, so no spectrum plots) writes
// the per-head table and the per-layer plots (it read past the empty spectra before).
TEST_F(CodebookCalibrateCli, EvalReportWithACodebookCalibrationHasNoSpectra) {
  const ScratchDir& dir = *dir_;
  ASSERT_EQ(RunKvq(dir, "calibrate --activations a.safetensors --scheme blockgtq --k-bits 2 "
                        "--out g2.safetensors")
                .exit_code,
            0);
  const auto e = RunKvq(dir, "eval --activations a.safetensors --calibration g2.safetensors "
                             "--schemes blockgtq --report rep");
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(e.out.find("rep/per_head.csv"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("rep/layer_rope_logit_mae.svg"), std::string::npos) << e.out;
  EXPECT_EQ(e.out.find("spectrum_keys.svg"), std::string::npos) << e.out;
}

TEST_F(CodebookCalibrateCli, MisuseFailsNamingTheValue) {
  const ScratchDir& dir = *dir_;
  const std::string base = "calibrate --activations a.safetensors --out bad.safetensors ";
  const std::string out = dir.File("bad.safetensors");
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 0", out, {"average width 0"});
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 9", out, {"average width 9"});
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 2.5x", out, {"--k-bits '2.5x'"});
  ExpectFailure(dir, base + "--scheme blockgtq", out, {"--k-bits"});
  ExpectFailure(dir, base + "--scheme tq_mse --k-bits 2.5", out, {"2.5", "tq_mse"});
  ExpectFailure(dir, base + "--scheme tq_mse_fwht --k-bits 2", out, {"tq_mse_fwht"});
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 3 --v-bits 9", out, {"V width 9"});
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 3 --rotation-threshold 0", out,
                {"rotation threshold 0"});
  ExpectFailure(dir, base + "--scheme blockgtq --k-bits 3 --codebook laplace", out,
                {"laplace"});
  ExpectFailure(dir, base + "--k-bits 3", out, {"--k-bits 3", "(2 or 4)"});
  // A capture without its RoPE base is refused by name.
  {
    Safetensors a = ReadSafetensors(dir.File("a.safetensors"));
    a.metadata.erase("rope_base");
    WriteSafetensors(dir.File("norope.safetensors"), a);
  }
  ExpectFailure(dir, "calibrate --activations norope.safetensors --scheme blockgtq --k-bits 3 "
                     "--out bad.safetensors",
                out, {"rope_base"});
}

}  // namespace
}  // namespace kvq
