// Dense rotations given on the command line are rotations (issue 25, item 3): kvq quantize,
// rotate and attend refuse a matrix that is not orthogonal (max |RᵀR − I| > 1e-4), naming the
// file and the deviation; kvq quantize records the SHA-256 of its R and kvq dequantize refuses
// another R, naming both fingerprints. Nothing is written on a refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/common/io.h"
#include "kvq/common/orthogonality.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::RunKvq;
using cli_testing::ScratchDir;

constexpr int kD = 64;

// A random orthogonal matrix (Gram-Schmidt on Gaussian columns, fp64, rounded to fp32).
std::vector<float> RandomOrthogonal(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<std::vector<double>> cols(kD, std::vector<double>(kD));
  for (int c = 0; c < kD; ++c) {
    for (double& x : cols[c]) x = normal(rng);
    for (int p = 0; p < c; ++p) {
      double dot = 0;
      for (int i = 0; i < kD; ++i) dot += cols[c][i] * cols[p][i];
      for (int i = 0; i < kD; ++i) cols[c][i] -= dot * cols[p][i];
    }
    double norm = 0;
    for (double x : cols[c]) norm += x * x;
    for (double& x : cols[c]) x /= std::sqrt(norm);
  }
  std::vector<float> m(kD * kD);
  for (int i = 0; i < kD; ++i) {
    for (int j = 0; j < kD; ++j) m[i * kD + j] = static_cast<float>(cols[j][i]);
  }
  return m;
}

class RotationCheckCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>("kvq_rotation_check");
    std::mt19937_64 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> x(16 * kD);
    for (float& v : x) v = normal(rng);
    WriteNpy(dir_->File("x.npy"), Tensor::F32({16, kD}, x));
    r1_ = RandomOrthogonal(1);
    r2_ = RandomOrthogonal(2);
    ASSERT_LE(OrthogonalityError(r1_.data(), kD), 1e-6);
    WriteNpy(dir_->File("r1.npy"), Tensor::F32({kD, kD}, r1_));
    WriteNpy(dir_->File("r2.npy"), Tensor::F32({kD, kD}, r2_));
    std::vector<float> skewed = r1_;
    skewed[5 * kD + 7] += 0.01f;  // one entry off: |RᵀR − I| ~ 1e-2
    WriteNpy(dir_->File("skewed.npy"), Tensor::F32({kD, kD}, skewed));
    std::vector<float> twice(kD * kD, 0.0f);
    for (int i = 0; i < kD; ++i) twice[i * kD + i] = 2.0f;
    WriteNpy(dir_->File("twice.npy"), Tensor::F32({kD, kD}, twice));
  }

  std::unique_ptr<ScratchDir> dir_;
  std::vector<float> r1_, r2_;
};

TEST_F(RotationCheckCli, NonOrthogonalMatricesAreRefusedNamingTheDeviation) {
  const ScratchDir& dir = *dir_;
  const std::string q = "quantize --in x.npy --clip 1 --bits 2 --group 32 --out q.safetensors ";
  ExpectFailure(dir, q + "--rotation twice.npy", dir.File("q.safetensors"),
                {"'twice.npy'", "not orthogonal", "max |RᵀR − I| = 3"});
  ExpectFailure(dir, q + "--rotation skewed.npy", dir.File("q.safetensors"),
                {"'skewed.npy'", "not orthogonal", "tolerance 0.0001"});
  ExpectFailure(dir, "rotate --in x.npy --rotation twice.npy --out y.npy", dir.File("y.npy"),
                {"'twice.npy'", "not orthogonal"});
  // kvq attend's per-side matrices, shared or per KV head.
  std::vector<float> k(40 * 1 * kD), qv(2 * kD);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.1f * static_cast<float>(i));
  for (size_t i = 0; i < qv.size(); ++i) qv[i] = std::cos(0.3f * static_cast<float>(i));
  WriteNpy(dir.File("k.npy"), Tensor::F32({40, 1, kD}, k));
  WriteNpy(dir.File("q.npy"), Tensor::F32({2, kD}, qv));
  ExpectFailure(dir,
                "attend --q q.npy --k k.npy --v k.npy --rotation-k r1.npy --rotation-v twice.npy "
                "--group 32 --sink 4 --recent 8 --out o.npy",
                dir.File("o.npy"), {"value rotation", "twice.npy", "not orthogonal"});
}

TEST_F(RotationCheckCli, DequantizeRefusesAnotherRotationNamingBothFingerprints) {
  const ScratchDir& dir = *dir_;
  ASSERT_EQ(RunKvq(dir, "quantize --in x.npy --clip 0.96 --bits 2 --group 32 --rotation r1.npy "
                        "--out q.safetensors").exit_code, 0);
  const Safetensors file = ReadSafetensors(dir.File("q.safetensors"));
  const std::string recorded = file.metadata.at("rotation_sha256");
  EXPECT_EQ(recorded.size(), 64u);
  ExpectFailure(dir, "dequantize --in q.safetensors --rotation r2.npy --out back.npy",
                dir.File("back.npy"),
                {"'r2.npy'", "is not the one 'q.safetensors' was quantized with",
                 recorded.substr(0, 16)});
  // The same R maps back: within the quantizer's error of the input.
  const auto r = RunKvq(dir, "dequantize --in q.safetensors --rotation r1.npy --out back.npy");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<float> x = ReadNpy(dir.File("x.npy")).ToF32();
  const std::vector<float> back = ReadNpy(dir.File("back.npy")).ToF32();
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (x[i] - back[i]) * (x[i] - back[i]);
    norm += x[i] * x[i];
  }
  EXPECT_LT(err / norm, 0.2);  // INT2, G = 32: the relative MSE is about 0.1
}

}  // namespace
}  // namespace kvq
