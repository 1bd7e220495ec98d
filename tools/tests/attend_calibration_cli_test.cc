// kvq attend --calibration C --layer L: the cache takes layer L's per-KV-head R_K, R_V and clip
// ratios (and the file's group, bits, sink, recent) from a `kvq calibrate` file. The output must
// equal the library called with those arrays bit for bit; misuse fails with one line naming it.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cli_test_util.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::RunKvq;
using cli_testing::ScratchDir;

std::vector<float> Normal(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

class AttendCalibrationCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("kvq_attend_cal");
    // A small capture (2 layers, Hq/Hkv = 32/8, d = 128) and its calibration, through the CLI.
    ASSERT_EQ(RunKvq(*dir_, "synth --out a.safetensors --layers 2 --tokens 512").exit_code, 0);
    ASSERT_EQ(RunKvq(*dir_, "calibrate --activations a.safetensors --out c.safetensors").exit_code,
              0);
    std::mt19937_64 rng(7);
    WriteNpy(dir_->File("q.npy"), Tensor::F32({32, 128}, Normal(32 * 128, rng)));
    WriteNpy(dir_->File("k.npy"), Tensor::F32({kTokens, 8, 128}, Normal(kTokens * 8 * 128, rng)));
    WriteNpy(dir_->File("v.npy"), Tensor::F32({kTokens, 8, 128}, Normal(kTokens * 8 * 128, rng)));
    WriteNpy(dir_->File("k4.npy"), Tensor::F32({kTokens, 4, 128}, Normal(kTokens * 4 * 128, rng)));
  }
  static void TearDownTestSuite() { delete dir_; }

  static constexpr int64_t kTokens = 400;  // > S0 + W = 320: the history holds 80 tokens
  static ScratchDir* dir_;
};
ScratchDir* AttendCalibrationCli::dir_ = nullptr;

TEST_F(AttendCalibrationCli, MatchesLibraryWithTheLayersRotationsAndClips) {
  const ScratchDir& dir = *dir_;
  const calib::Calibration cal = calib::ReadCalibration(dir.File("c.safetensors"));
  for (int layer : {0, 1}) {
    const std::string out = "o" + std::to_string(layer) + ".npy";
    const auto r = RunKvq(dir, "attend --q q.npy --k k.npy --v v.npy --calibration c.safetensors"
                               " --layer " + std::to_string(layer) + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;

    CacheParams p;
    p.num_q_heads = 32;
    p.num_kv_heads = 8;
    p.sink = cal.info.sink;
    p.recent = cal.info.recent;
    for (WriteParams* w : {&p.key, &p.value}) {
      w->head_dim = cal.info.head_dim;
      w->group = cal.info.group;
      w->bits = cal.info.bits;
      w->rotation = RotationKind::kDense;
    }
    const calib::LayerCalibration& l = cal.layers[layer];
    cpu::PagedKVCache cache(p, l.key, l.value, cpu::BestBackend());
    const int seq = cache.AddSequence();
    const std::vector<float> k = ReadNpy(dir.File("k.npy")).ToF32();
    const std::vector<float> v = ReadNpy(dir.File("v.npy")).ToF32();
    const std::vector<float> q = ReadNpy(dir.File("q.npy")).ToF32();
    cache.Prefill(seq, k.data(), v.data(), kTokens);
    ASSERT_GT(cache.HistoryLength(seq), 0u);
    std::vector<float> expected(q.size());
    cpu::Attend(cpu::BestBackend(), cache, seq, q.data(), expected.data());
    const Tensor got = ReadNpy(dir.File(out));
    ASSERT_EQ(got.numel(), expected.size());
    EXPECT_EQ(std::memcmp(got.data<float>(), expected.data(), expected.size() * sizeof(float)), 0)
        << "layer " << layer;
  }
  // The two layers' rotations differ, so the outputs must too (the layer is really used).
  const Tensor o0 = ReadNpy(dir.File("o0.npy")), o1 = ReadNpy(dir.File("o1.npy"));
  EXPECT_NE(std::memcmp(o0.data<float>(), o1.data<float>(), o0.bytes.size()), 0);
}

TEST_F(AttendCalibrationCli, MisuseFailsNamingTheProblem) {
  const ScratchDir& dir = *dir_;
  const std::string base = "attend --q q.npy --k k.npy --v v.npy --out bad.npy ";
  ExpectFailure(dir, base + "--calibration c.safetensors", dir.File("bad.npy"), {"--layer"});
  ExpectFailure(dir, base + "--layer 0 --hadamard", dir.File("bad.npy"), {"--calibration"});
  ExpectFailure(dir, base + "--calibration c.safetensors --layer 2", dir.File("bad.npy"),
                {"--layer 2", "2 layers"});
  ExpectFailure(dir, base + "--calibration c.safetensors --layer 0 --hadamard",
                dir.File("bad.npy"), {"--hadamard"});
  ExpectFailure(dir, base + "--calibration c.safetensors --layer 0 --clip-k 0.9",
                dir.File("bad.npy"), {"--clip-k"});
  ExpectFailure(dir,
                "attend --q q.npy --k k4.npy --v k4.npy --out bad.npy --calibration c.safetensors"
                " --layer 0",
                dir.File("bad.npy"), {"Hkv = 8"});
}

}  // namespace
}  // namespace kvq
