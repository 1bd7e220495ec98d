// The FP8 contract (spec 1.2; issue 21): `kvq calibrate --scheme fp8|fp8_hadamard` writes per
// layer k_scale / v_scale = max |x| over each KV head's calibration rows (after the scheme's
// rotation) / 448 in fp32, and `kvq attend --scheme fp8_unscaled|fp8|fp8_hadamard` stores
// code = e4m3(bf16 row / s^) and attends over s^ * e4m3 values. Both are checked here against
// references written from the spec alone (an fp64 nearest-e4m3 search, a plain fp32 FWHT, fp64
// attention), not against kvq's own conversion; misuse fails with one line naming the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/io.h"
#include "kvq/common/numeric.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::RunKvq;
using cli_testing::ScratchDir;

constexpr int kQHeads = 8, kKvHeads = 2, kHeadDim = 64;
constexpr int64_t kTokens = 96;

// ---- the references, from the spec's words ----

// The magnitude of e4m3 code c (0 <= c <= 0x7e): bias 7, subnormals m * 2^-9.
double E4m3Magnitude(int c) {
  const int e = c >> 3, m = c & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// s^ * e4m3(v): the nearest e4m3 value to v (ties to the even code), saturating at 448, sign
// kept; then multiplied by s^ in fp32 (the stored row's value).
float Fp8Dequantized(float v, float s) {
  const double a = std::fabs(static_cast<double>(v));
  int best = 0x7e;
  if (a < 448.0) {
    double best_error = a;
    best = 0;
    for (int c = 1; c <= 0x7e; ++c) {
      const double error = std::fabs(E4m3Magnitude(c) - a);
      if (error < best_error || (error == best_error && c % 2 == 0)) {
        best = c;
        best_error = error;
      }
    }
  }
  const float magnitude = static_cast<float>(E4m3Magnitude(best));
  return s * (std::signbit(v) ? -magnitude : magnitude);
}

// The spec's FWHT of one fp32 row: butterflies of strides 1, 2, ..., d/2, then one multiply
// by fp32(1/sqrt(d)).
void FwhtF32(float* x, int d) {
  for (int h = 1; h < d; h *= 2) {
    for (int k = 0; k < d; ++k) {
      if (k & h) continue;
      const float a = x[k], b = x[k + h];
      x[k] = a + b;
      x[k + h] = a - b;
    }
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int k = 0; k < d; ++k) x[k] = x[k] * scale;
}

// The normalised FWHT in double (its own inverse).
void FwhtF64(double* x, int d) {
  for (int h = 1; h < d; h *= 2) {
    for (int k = 0; k < d; ++k) {
      if (k & h) continue;
      const double a = x[k], b = x[k + h];
      x[k] = a + b;
      x[k + h] = a - b;
    }
  }
  for (int k = 0; k < d; ++k) x[k] /= std::sqrt(static_cast<double>(d));
}

// out [Hq, d] of one decode step over t tokens, fp64: every row of k and v [t, Hkv, d] stored
// as bf16, then (hadamard) rotated by the fp32 FWHT, quantized with its head's s^ and mapped
// back by the fp64 FWHT; the first `sink` and last `recent` positions kept as bf16.
std::vector<double> ReferenceAttention(const std::vector<float>& q, const std::vector<float>& k,
                                       const std::vector<float>& v, const std::vector<float>& sk,
                                       const std::vector<float>& sv, bool hadamard, int sink,
                                       int recent) {
  const int d = kHeadDim, g = kQHeads / kKvHeads;
  const int64_t t = kTokens;
  auto stored = [&](const std::vector<float>& x, const std::vector<float>& s, int64_t pos,
                    int head, std::vector<double>* out) {
    std::vector<float> row(d);
    for (int j = 0; j < d; ++j) row[j] = RoundToBf16(x[(pos * kKvHeads + head) * d + j]);
    out->assign(d, 0.0);
    const bool window = pos < sink || pos >= t - recent;
    if (window) {
      for (int j = 0; j < d; ++j) (*out)[j] = row[j];
      return;
    }
    if (hadamard) FwhtF32(row.data(), d);
    for (int j = 0; j < d; ++j) {
      (*out)[j] = Fp8Dequantized(row[j] / s[head], s[head]);  // IEEE fp32 division
    }
    if (hadamard) FwhtF64(out->data(), d);
  };
  std::vector<double> out(static_cast<size_t>(kQHeads) * d, 0.0);
  std::vector<double> kr, vr;
  for (int h = 0; h < kQHeads; ++h) {
    const int kv = h / g;
    std::vector<double> logits(t);
    double mx = -1e300;
    for (int64_t p = 0; p < t; ++p) {
      stored(k, sk, p, kv, &kr);
      double dot = 0;
      for (int j = 0; j < d; ++j) dot += static_cast<double>(q[h * d + j]) * kr[j];
      logits[p] = dot / std::sqrt(static_cast<double>(d));
      mx = std::max(mx, logits[p]);
    }
    double sum = 0;
    for (int64_t p = 0; p < t; ++p) sum += std::exp(logits[p] - mx);
    for (int64_t p = 0; p < t; ++p) {
      stored(v, sv, p, kv, &vr);
      const double w = std::exp(logits[p] - mx) / sum;
      for (int j = 0; j < d; ++j) out[h * d + j] += w * vr[j];
    }
  }
  return out;
}

std::vector<float> Normal(size_t n, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

class Fp8Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("kvq_fp8");
    ASSERT_EQ(RunKvq(*dir_, "synth --out a.safetensors --layers 2 --tokens 512 --q-heads 8 "
                            "--kv-heads 2 --head-dim 64").exit_code, 0);
    for (const char* scheme : {"fp8", "fp8_hadamard"}) {
      const auto r = RunKvq(*dir_, std::string("calibrate --activations a.safetensors --scheme ") +
                                       scheme + " --out " + scheme + ".safetensors");
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
    ASSERT_EQ(RunKvq(*dir_, "calibrate --activations a.safetensors --out oscar.safetensors")
                  .exit_code, 0);
    std::mt19937_64 rng(5);
    const size_t kv = static_cast<size_t>(kTokens) * kKvHeads * kHeadDim;
    q_ = Normal(static_cast<size_t>(kQHeads) * kHeadDim, rng, 0.5f);
    // Key head 1 has a channel 40x larger (and some rows beyond the calibrated amax, which
    // saturate); values are small, so part of them are e4m3 subnormals after the division.
    k_ = Normal(kv, rng, 1.0f);
    for (int64_t t = 0; t < kTokens; ++t) k_[(t * kKvHeads + 1) * kHeadDim + 7] *= 40.0f;
    v_ = Normal(kv, rng, 0.05f);
    WriteNpy(dir_->File("q.npy"), Tensor::F32({kQHeads, kHeadDim}, q_));
    WriteNpy(dir_->File("k.npy"), Tensor::F32({kTokens, kKvHeads, kHeadDim}, k_));
    WriteNpy(dir_->File("v.npy"), Tensor::F32({kTokens, kKvHeads, kHeadDim}, v_));
  }
  static void TearDownTestSuite() { delete dir_; }

  // kvq attend's output against the reference: max relative error per head <= 1e-5.
  static void ExpectAttendMatches(const std::string& flags, const std::vector<float>& sk,
                                  const std::vector<float>& sv, bool hadamard, int sink = 0,
                                  int recent = 0) {
    const auto r =
        RunKvq(*dir_, "attend --q q.npy --k k.npy --v v.npy --out o.npy " + flags);
    ASSERT_EQ(r.exit_code, 0) << flags << "\n" << r.err;
    const std::vector<float> got = ReadNpy(dir_->File("o.npy")).ToF32();
    const std::vector<double> want =
        ReferenceAttention(q_, k_, v_, sk, sv, hadamard, sink, recent);
    ASSERT_EQ(got.size(), want.size());
    for (int h = 0; h < kQHeads; ++h) {
      double error = 0, norm = 0;
      for (int j = 0; j < kHeadDim; ++j) {
        error = std::max(error, std::fabs(got[h * kHeadDim + j] - want[h * kHeadDim + j]));
        norm = std::max(norm, std::fabs(want[h * kHeadDim + j]));
      }
      EXPECT_LE(error / norm, 1e-5) << flags << ", query head " << h;
    }
  }

  static ScratchDir* dir_;
  static std::vector<float> q_, k_, v_;
};
ScratchDir* Fp8Cli::dir_ = nullptr;
std::vector<float> Fp8Cli::q_, Fp8Cli::k_, Fp8Cli::v_;

TEST_F(Fp8Cli, CalibrateWritesEachHeadsAmaxOver448) {
  const calib::Activations acts = calib::ReadActivations(dir_->File("a.safetensors"));
  const int64_t n = acts.info.calib_tokens;
  ASSERT_GT(n, 0);
  for (const bool hadamard : {false, true}) {
    const std::string scheme = hadamard ? "fp8_hadamard" : "fp8";
    const calib::Calibration cal = calib::ReadCalibration(dir_->File(scheme + ".safetensors"));
    EXPECT_EQ(cal.info.scheme, scheme);
    const Safetensors file = ReadSafetensors(dir_->File(scheme + ".safetensors"));
    EXPECT_EQ(file.metadata.at("format_version"), "3");
    for (int l = 0; l < 2; ++l) {
      for (const bool keys : {true, false}) {
        const Tensor& t =
            file.Get("layers." + std::to_string(l) + (keys ? ".k_scale" : ".v_scale"));
        ASSERT_EQ(t.dtype, DType::kF32);
        ASSERT_EQ(t.shape, (std::vector<int64_t>{kKvHeads}));
        const std::vector<float> scales = t.ToF32();
        for (int h = 0; h < kKvHeads; ++h) {
          float amax = 0;
          double amax64 = 0;
          for (int64_t tok = 0; tok < n; ++tok) {
            const float* src = keys ? acts.k(l, tok, h) : acts.v(l, tok, h);
            std::vector<float> row(src, src + kHeadDim);
            std::vector<double> row64(kHeadDim);
            for (int j = 0; j < kHeadDim; ++j) row64[j] = row[j] = RoundToBf16(row[j]);
            if (hadamard) {
              FwhtF32(row.data(), kHeadDim);
              FwhtF64(row64.data(), kHeadDim);
            }
            for (int j = 0; j < kHeadDim; ++j) {
              amax = std::max(amax, std::fabs(row[j]));
              amax64 = std::max(amax64, std::fabs(row64[j]));
            }
          }
          const std::string where = scheme + " layer " + std::to_string(l) +
                                    (keys ? " key" : " value") + " head " + std::to_string(h);
          EXPECT_EQ(scales[h], amax / 448.0f) << where;
          EXPECT_NEAR(scales[h], amax64 / 448.0, 1e-6 * amax64 / 448.0) << where;
        }
      }
    }
  }
}

TEST_F(Fp8Cli, AttendMatchesTheSpecsReference) {
  const std::vector<float> ones(kKvHeads, 1.0f);
  ExpectAttendMatches("--scheme fp8_unscaled", ones, ones, false);
  for (const bool hadamard : {false, true}) {
    const std::string scheme = hadamard ? "fp8_hadamard" : "fp8";
    const calib::Calibration cal = calib::ReadCalibration(dir_->File(scheme + ".safetensors"));
    for (int layer : {0, 1}) {
      const calib::LayerCalibration& l = cal.layers[layer];
      const std::string flags = "--scheme " + scheme + " --calibration " + scheme +
                                ".safetensors --layer " + std::to_string(layer);
      ExpectAttendMatches(flags, l.key.scale, l.value.scale, hadamard);
    }
  }
  // Windows only when asked for: a bf16 sink and recent window around the fp8 history.
  const calib::Calibration cal = calib::ReadCalibration(dir_->File("fp8.safetensors"));
  ExpectAttendMatches("--scheme fp8 --calibration fp8.safetensors --layer 1 --sink 4 --recent 8",
                      cal.layers[1].key.scale, cal.layers[1].value.scale, false, 4, 8);
}

TEST_F(Fp8Cli, TheScalesAreReallyUsed) {
  // s^ = 1 stores these small values in e4m3 subnormals; the calibrated scale does not: the
  // outputs must differ.
  ASSERT_EQ(RunKvq(*dir_, "attend --q q.npy --k k.npy --v v.npy --out o1.npy --scheme "
                          "fp8_unscaled").exit_code, 0);
  ASSERT_EQ(RunKvq(*dir_, "attend --q q.npy --k k.npy --v v.npy --out o2.npy --scheme fp8 "
                          "--calibration fp8.safetensors --layer 0").exit_code, 0);
  const Tensor a = ReadNpy(dir_->File("o1.npy")), b = ReadNpy(dir_->File("o2.npy"));
  EXPECT_NE(std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()), 0);
}

TEST_F(Fp8Cli, MisuseFailsNamingTheProblem) {
  const ScratchDir& dir = *dir_;
  const std::string base = "attend --q q.npy --k k.npy --v v.npy --out bad.npy ";
  ExpectFailure(dir, base + "--scheme fp8", dir.File("bad.npy"), {"--scheme fp8", "--calibration"});
  ExpectFailure(dir, base + "--scheme fp8 --calibration oscar.safetensors --layer 0",
                dir.File("bad.npy"), {"k_scale", "kvq calibrate --scheme fp8"});
  ExpectFailure(dir, base + "--scheme fp8_hadamard --calibration fp8.safetensors --layer 0",
                dir.File("bad.npy"), {"'fp8_hadamard'", "'fp8'"});
  ExpectFailure(dir, "calibrate --activations a.safetensors --scheme kivi --out bad.npy",
                dir.File("bad.npy"), {"'kivi'"});
  ExpectFailure(dir, "calibrate --activations a.safetensors --scheme fp9 --out bad.npy",
                dir.File("bad.npy"), {"'fp9'"});
}

}  // namespace
}  // namespace kvq
