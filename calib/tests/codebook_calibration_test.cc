// The codebook calibration (spec/numerics.md §9.1, formats.md §5 version 4): Block-GTQ's
// energies against an independent fp64 computation, the greedy allocation's properties, the
// composed key rotation, the file round trip and the contract's tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvq/calib/codebook_calibration.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/testbed/compare.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;
using testing::ExpectError;
using testbed::BitsEqual;

// 2 layers, 8 query heads over 2 KV heads, d = 64, 256 tokens of which 192 calibrate.
const Activations& Capture() {
  static const Activations* acts = [] {
    SynthOptions o = testing::SynthShape(2, 8, 2, 64, 256, 11);
    o.calib_tokens = 192;
    return new Activations(Synthesize(o));
  }();
  return *acts;
}

CodebookCalibrationOptions BlockGtq(double k_avg_bits) {
  CodebookCalibrationOptions o;
  o.scheme = "blockgtq";
  o.k_avg_bits = k_avg_bits;
  o.seed = 5;
  o.source = "capture.safetensors";
  return o;
}

// The energies by a different route: per block, gather every key pair and every query pair of
// the KV head's group as long double squares, sum, divide.
TEST(BlockEnergies, MatchAnIndependentComputation) {
  const Activations& acts = Capture();
  const int d = 64, blocks = 32, group = 4;
  for (int layer = 0; layer < 2; ++layer) {
    for (int h = 0; h < 2; ++h) {
      for (int64_t tokens : {int64_t{1}, int64_t{37}, int64_t{192}}) {
        const std::vector<double> got = BlockEnergies(acts, layer, h, tokens);
        ASSERT_EQ(got.size(), static_cast<size_t>(blocks));
        for (int i = 0; i < blocks; ++i) {
          long double k = 0, q = 0;
          for (int64_t t = 0; t < tokens; ++t) {
            const float* key = acts.layers[layer].k.data() + (t * 2 + h) * d;
            k += static_cast<long double>(key[i]) * key[i] +
                 static_cast<long double>(key[i + blocks]) * key[i + blocks];
            for (int g = 0; g < group; ++g) {
              const float* query = acts.layers[layer].q.data() + (t * 8 + h * group + g) * d;
              q += static_cast<long double>(query[i]) * query[i] +
                   static_cast<long double>(query[i + blocks]) * query[i + blocks];
            }
          }
          const long double want = (q / (tokens * group) + k / tokens) / 2;
          EXPECT_NEAR(got[i], static_cast<double>(want), 1e-13 * static_cast<double>(want) + 1e-300)
              << "layer " << layer << " head " << h << " block " << i << " tokens " << tokens;
        }
      }
    }
  }
  // Held-out tokens never calibrate.
  ExpectError([&] { BlockEnergies(acts, 0, 0, 193); }, ErrorCode::kInvalidArgument,
              "energies over 193 tokens: calibration uses 1 to calib_tokens = 192");
  ExpectError([&] { BlockEnergies(acts, 0, 2, 10); }, ErrorCode::kInvalidArgument, "kv head 2");
}

TEST(BlockEnergies, AreRopeInvariant) {
  // Turning each pair (x_i, x_{i+L}) by any angle leaves its block's energy unchanged.
  Activations turned = Capture();
  const int d = 64, blocks = 32;
  for (LayerActivations& layer : turned.layers) {
    for (std::vector<float>* rows : {&layer.q, &layer.k}) {
      for (size_t r = 0; r < rows->size() / d; ++r) {
        float* x = rows->data() + r * d;
        for (int i = 0; i < blocks; ++i) {
          const double angle = 0.37 * static_cast<double>(r) + 0.11 * i;
          const double c = std::cos(angle), s = std::sin(angle);
          const double a = x[i], b = x[i + blocks];
          x[i] = static_cast<float>(a * c - b * s);
          x[i + blocks] = static_cast<float>(a * s + b * c);
        }
      }
    }
  }
  const std::vector<double> before = BlockEnergies(Capture(), 1, 1, 192);
  const std::vector<double> after = BlockEnergies(turned, 1, 1, 192);
  for (int i = 0; i < blocks; ++i) EXPECT_NEAR(after[i], before[i], 1e-5 * before[i]) << i;
}

TEST(WidthBudget, FloorsTheProductAndNamesBadAverages) {
  EXPECT_EQ(WidthBudget(64, 2.5), 160);
  EXPECT_EQ(WidthBudget(64, 2.55), 163);  // 163.2: floor, as the authors' int()
  EXPECT_EQ(WidthBudget(32, 1.0), 32);
  EXPECT_EQ(WidthBudget(128, 8.0), 1024);
  EXPECT_EQ(WidthBudget(64, 3.0), 192);
  for (double bad : {0.0, 0.99, 8.01, 9.0, -1.0}) {
    ExpectError([&] { WidthBudget(64, bad); }, ErrorCode::kInvalidArgument, "is not in [1, 8]");
  }
  ExpectError([&] { WidthBudget(64, std::nan("")); }, ErrorCode::kInvalidArgument,
              "average width nan");
}

// The greedy allocation's properties over random scores (zeros, ties and huge ranges
// included): spends exactly the budget, widths in 1..8, and it is the exact minimiser of the
// surrogate: no single move of one bit from block j to block i lowers Σ s·4^(−w).
TEST(GreedyWidths, SpendsExactlyTheBudgetAndIsOptimal) {
  Xoshiro256 rng(123);
  for (int trial = 0; trial < 400; ++trial) {
    const int blocks = trial % 3 == 0 ? 32 : (trial % 3 == 1 ? 64 : 128);
    std::vector<double> scores(blocks);
    const int kind = trial % 5;
    for (double& s : scores) {
      const double u = rng.Uniform();
      s = kind == 0 ? u : kind == 1 ? std::floor(u * 4) : kind == 2 ? std::pow(10.0, 12 * u - 6)
                                     : kind == 3 ? 0.0 : (u < 0.5 ? 1.0 : 2.0);
    }
    const int64_t budget = blocks + static_cast<int64_t>(rng.Uniform() * (7 * blocks + 1));
    const std::vector<uint8_t> w = GreedyWidths(scores, budget);
    ASSERT_EQ(w.size(), scores.size());
    EXPECT_EQ(std::accumulate(w.begin(), w.end(), int64_t{0}), budget) << "trial " << trial;
    for (uint8_t x : w) ASSERT_TRUE(x >= 1 && x <= 8) << "trial " << trial;
    const double j = AllocationObjective(scores, w);
    for (int a = 0; a < blocks; ++a) {
      for (int b = 0; b < blocks; ++b) {
        if (a == b || w[a] >= 8 || w[b] <= 1) continue;
        std::vector<uint8_t> moved = w;
        ++moved[a];
        --moved[b];
        ASSERT_GE(AllocationObjective(scores, moved), j * (1 - 1e-12))
            << "trial " << trial << ": moving a bit from block " << b << " to " << a;
      }
    }
  }
}

TEST(GreedyWidths, TiesGoToTheLowestIndexAndWidthsAreMonotoneInEnergy) {
  // Equal scores: the bits go in ascending block order, round after round.
  EXPECT_EQ(GreedyWidths(std::vector<double>(4, 1.0), 6), (std::vector<uint8_t>{2, 2, 1, 1}));
  EXPECT_EQ(GreedyWidths(std::vector<double>(4, 1.0), 9), (std::vector<uint8_t>{3, 2, 2, 2}));
  // All zero: the budget is still spent; every priority ties at 0 forever, so block 0 takes
  // the bits up to 8 before block 1 gets one (numerics.md §9.1: the lowest index on ties,
  // also when the best priority is 0).
  EXPECT_EQ(GreedyWidths(std::vector<double>(4, 0.0), 7), (std::vector<uint8_t>{4, 1, 1, 1}));
  EXPECT_EQ(GreedyWidths(std::vector<double>(4, 0.0), 13), (std::vector<uint8_t>{8, 3, 1, 1}));
  // A 4x larger score is worth exactly one bit: s·4^-(w+1) ties s/4·4^-w, lowest index wins.
  EXPECT_EQ(GreedyWidths({1.0, 4.0}, 3), (std::vector<uint8_t>{1, 2}));
  EXPECT_EQ(GreedyWidths({1.0, 4.0}, 4), (std::vector<uint8_t>{2, 2}));
  EXPECT_EQ(GreedyWidths({4.0, 1.0}, 4), (std::vector<uint8_t>{3, 1}));  // the tie, block 0 first
  EXPECT_EQ(GreedyWidths({1.0, 4.0}, 5), (std::vector<uint8_t>{2, 3}));
  // Saturation at 8: the rest goes to the next block.
  EXPECT_EQ(GreedyWidths({1e30, 1.0}, 10), (std::vector<uint8_t>{8, 2}));
  // Monotone in energy: a larger score never gets fewer bits.
  Xoshiro256 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<double> scores(64);
    for (double& s : scores) s = std::exp(8 * rng.Uniform());
    const std::vector<uint8_t> w = GreedyWidths(scores, 64 + trial * 4);
    for (int a = 0; a < 64; ++a) {
      for (int b = 0; b < 64; ++b) {
        if (scores[a] > scores[b]) {
          ASSERT_GE(w[a], w[b]) << "trial " << trial;
        }
      }
    }
  }
  ExpectError([] { GreedyWidths({1.0, -2.0}, 3); }, ErrorCode::kInvalidArgument,
              "block 1 has score -2");
  ExpectError([] { GreedyWidths({1.0, 2.0}, 17); }, ErrorCode::kInvalidArgument,
              "width budget 17 is not in [2, 16]");
  ExpectError([] { GreedyWidths({1.0, 2.0}, 1); }, ErrorCode::kInvalidArgument,
              "width budget 1 is not in [2, 16]");
}

// R_K = P·diag(A_w), entry by entry: row i (and i + L) of R is row 2k (and 2k + 1) of the
// segment's A_w placed at the segment's columns, every other entry exactly 0.
TEST(BlockGtqKeyRotation, IsPTimesTheBlockDiagonalAndOrthogonal) {
  const int d = 64, blocks = 32;
  std::vector<uint8_t> widths(blocks);
  for (int i = 0; i < blocks; ++i) widths[i] = static_cast<uint8_t>(1 + (i * 7) % 5);
  widths[3] = 8;
  for (int threshold : {1, 3, 9}) {
    const MatrixXd r = BlockGtqKeyRotation(d, widths, 99, 1, 0, threshold);
    EXPECT_LT((r.transpose() * r - MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff(), 1e-12);
    const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
    MatrixXd expected = MatrixXd::Zero(d, d);
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const MatrixXd a = seg.width >= threshold
                             ? RandomOrthogonal(seg.values, DeriveSeed(99, {1, 0, 0,
                                                   static_cast<uint64_t>(seg.width)}))
                             : MatrixXd::Identity(seg.values, seg.values);
      int k = 0;
      for (int i = 0; i < blocks; ++i) {
        if (widths[i] != seg.width) continue;
        for (int c = 0; c < seg.values; ++c) {
          expected(i, seg.offset + c) = a(2 * k, c);
          expected(i + blocks, seg.offset + c) = a(2 * k + 1, c);
        }
        ++k;
      }
    }
    EXPECT_EQ((r - expected).cwiseAbs().maxCoeff(), 0.0) << "threshold " << threshold;
    if (threshold == 9) {
      EXPECT_EQ((r.cwiseAbs().array() == 1.0).count(), d);  // a permutation
    }
  }
  ExpectError([&] { BlockGtqKeyRotation(d, std::vector<uint8_t>(blocks, 9), 1, 0, 0, 1); },
              ErrorCode::kInvalidArgument, "block 0 has width 9");
  ExpectError([&] { BlockGtqKeyRotation(d, widths, 1, 0, 0, 0); }, ErrorCode::kInvalidArgument,
              "rotation threshold 0");
}

TEST(CalibrateCodebook, BlockGtqLayersMatchTheirDefinition) {
  const Activations& acts = Capture();
  AllocationStability stability;
  const Calibration cal = CalibrateCodebook(acts, BlockGtq(2.5), &stability);
  const int d = 64, blocks = 32, hkv = 2;
  EXPECT_EQ(cal.info.scheme, "blockgtq");
  EXPECT_EQ(cal.info.bits, 3);
  EXPECT_EQ(cal.info.v_bits, 0);  // V at ⌈2.5⌉ = 3 = bits
  EXPECT_EQ(cal.info.group, d);
  EXPECT_EQ(cal.info.codebook.k_avg_bits, 2.5);
  int max_segments = 0, max_bytes = 0;
  for (int l = 0; l < 2; ++l) {
    const LayerCalibration& layer = cal.layers[l];
    ASSERT_EQ(layer.key.widths.size(), static_cast<size_t>(hkv * blocks));
    EXPECT_TRUE(layer.value.widths.empty());  // V: uniform rows at b_v
    EXPECT_TRUE(layer.key.clip.empty() && layer.k_basis.empty() && layer.raw_k_rotation.empty());
    for (int h = 0; h < hkv; ++h) {
      const std::vector<double> scores = BlockEnergies(acts, l, h, 192);
      const std::vector<uint8_t> widths = GreedyWidths(scores, 80);
      EXPECT_TRUE(BitsEqual("k_bits", std::vector<uint8_t>(layer.key.widths.begin() + h * blocks,
                                                           layer.key.widths.begin() + (h + 1) * blocks),
                            widths));
      for (int i = 0; i < blocks; ++i) {
        EXPECT_EQ(layer.k_scores[h * blocks + i], static_cast<float>(scores[i]));
      }
      EXPECT_TRUE(BitsEqual("k_rotation",
                            std::vector<float>(layer.key.rotation.begin() + h * d * d,
                                               layer.key.rotation.begin() + (h + 1) * d * d),
                            ToRowMajorF32(BlockGtqKeyRotation(d, widths, 5, l, h, 1))));
      EXPECT_TRUE(BitsEqual("v_rotation",
                            std::vector<float>(layer.value.rotation.begin() + h * d * d,
                                               layer.value.rotation.begin() + (h + 1) * d * d),
                            ToRowMajorF32(TurboQuantRotation(d, 5, l, h, 1))));
      const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
      max_segments = std::max(max_segments, layout.count);
      max_bytes = std::max(max_bytes, layout.code_bytes);
    }
  }
  EXPECT_EQ(cal.info.codebook.k_segments, max_segments);
  EXPECT_EQ(cal.info.codebook.k_code_bytes, max_bytes);
  EXPECT_EQ(cal.info.codebook.v_segments, 1);
  EXPECT_EQ(cal.info.codebook.v_code_bytes, 0);
  // Stability: prefixes 24, 48, 96 of 192; distances in [0, 32], regret ≥ 0.
  EXPECT_EQ(stability.prefixes, (std::vector<int64_t>{24, 48, 96}));
  for (size_t p = 0; p < 3; ++p) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < hkv; ++h) {
        EXPECT_GE(stability.hamming[p][l][h], 0);
        EXPECT_LE(stability.hamming[p][l][h], blocks);
        EXPECT_GE(stability.regret[p][l][h], -1e-15);
        const std::vector<uint8_t> early = GreedyWidths(BlockEnergies(acts, l, h, stability.prefixes[p]), 80);
        const std::vector<uint8_t> full = GreedyWidths(BlockEnergies(acts, l, h, 192), 80);
        int distance = 0;
        for (int i = 0; i < blocks; ++i) distance += early[i] != full[i];
        EXPECT_EQ(stability.hamming[p][l][h], distance);
      }
    }
  }
  // The threads never change the bits.
  CodebookCalibrationOptions one = BlockGtq(2.5);
  one.threads = 1;
  const Calibration serial = CalibrateCodebook(acts, one);
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(BitsEqual("k_rotation", serial.layers[l].key.rotation, cal.layers[l].key.rotation));
    EXPECT_TRUE(BitsEqual("k_bits", serial.layers[l].key.widths, cal.layers[l].key.widths));
  }
}

// The contract: per layer, k_bits U8 [Hkv, d/2], k_rotation and v_rotation F32 [Hkv, d, d]; and
// nothing of the fitted calibrations. Written and read back, the same bytes.
TEST(CalibrateCodebook, FileHoldsTheContractsTensorsAndRoundTrips) {
  CodebookCalibrationOptions o = BlockGtq(2.5);
  o.v_bits = 2;
  const Calibration cal = CalibrateCodebook(Capture(), o);
  const Safetensors file = CalibrationToSafetensors(cal);
  EXPECT_EQ(file.metadata.at("format_version"), "4");
  EXPECT_EQ(file.metadata.at("scheme"), "blockgtq");
  EXPECT_EQ(file.metadata.at("k_avg_bits"), "2.5");
  EXPECT_EQ(file.metadata.at("bits"), "3");
  EXPECT_EQ(file.metadata.at("v_bits"), "2");
  EXPECT_EQ(file.metadata.at("codebook"), "beta");
  EXPECT_EQ(file.metadata.at("seed"), "5");
  EXPECT_EQ(file.metadata.at("rotation_threshold"), "1");
  EXPECT_EQ(file.metadata.count("rotation"), 0u);
  EXPECT_EQ(file.metadata.count("value_target"), 0u);
  std::set<std::string> names;
  for (const auto& [name, t] : file.tensors) names.insert(name);
  std::set<std::string> expected;
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    expected.insert({p + "k_bits", p + "k_rotation", p + "v_rotation", p + "k_scores"});
    EXPECT_EQ(file.Get(p + "k_bits").dtype, DType::kU8);
    EXPECT_EQ(file.Get(p + "k_bits").shape, (std::vector<int64_t>{2, 32}));
    EXPECT_EQ(file.Get(p + "k_rotation").dtype, DType::kF32);
    EXPECT_EQ(file.Get(p + "k_rotation").shape, (std::vector<int64_t>{2, 64, 64}));
    EXPECT_EQ(file.Get(p + "v_rotation").dtype, DType::kF32);
    EXPECT_EQ(file.Get(p + "v_rotation").shape, (std::vector<int64_t>{2, 64, 64}));
    EXPECT_EQ(file.Get(p + "k_scores").shape, (std::vector<int64_t>{2, 32}));
    const Tensor& bits = file.Get(p + "k_bits");
    for (int h = 0; h < 2; ++h) {
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += bits.data<uint8_t>()[h * 32 + i];
      EXPECT_EQ(sum, 80) << "layer " << l << " head " << h;  // floor(32 * 2.5)
    }
  }
  EXPECT_EQ(names, expected);
  const Calibration back = CalibrationFromSafetensors(file);
  EXPECT_EQ(SerializeSafetensors(CalibrationToSafetensors(back)), SerializeSafetensors(file));
  EXPECT_EQ(back.info.codebook.k_avg_bits, 2.5);
  EXPECT_EQ(back.info.v_bits, 2);
  EXPECT_TRUE(back.info.rotation.empty());
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(BitsEqual("k_bits", back.layers[l].key.widths, cal.layers[l].key.widths));
  }
}

TEST(CalibrateCodebook, TurboQuantHoldsHaarRotationsOnly) {
  CodebookCalibrationOptions o;
  o.scheme = "tq_mse";
  o.k_avg_bits = 3;
  o.v_bits = 4;
  o.seed = 17;
  const Calibration cal = CalibrateCodebook(Capture(), o);
  const Safetensors file = CalibrationToSafetensors(cal);
  EXPECT_EQ(file.metadata.at("format_version"), "4");
  EXPECT_EQ(file.metadata.count("k_avg_bits"), 0u);
  EXPECT_EQ(file.tensors.size(), 4u);  // k_rotation, v_rotation of 2 layers
  for (int side = 0; side < 2; ++side) {
    const std::vector<float> want = ToRowMajorF32(TurboQuantRotation(64, 17, 1, 1, side));
    const std::vector<float>& got = cal.layers[1].heads(side).rotation;
    EXPECT_TRUE(BitsEqual("rotation", std::vector<float>(got.begin() + 64 * 64, got.end()), want));
  }
  const Calibration back = CalibrationFromSafetensors(file);
  EXPECT_EQ(back.info.scheme, "tq_mse");
  EXPECT_EQ(back.info.bits, 3);
  EXPECT_EQ(back.info.v_bits, 4);
}

TEST(CalibrateCodebook, RejectsBadOptionsNamingTheValue) {
  const Activations& acts = Capture();
  ExpectError([&] { CalibrateCodebook(acts, BlockGtq(0)); }, ErrorCode::kInvalidArgument,
              "average width 0 is not in [1, 8]");
  ExpectError([&] { CalibrateCodebook(acts, BlockGtq(9)); }, ErrorCode::kInvalidArgument,
              "average width 9 is not in [1, 8]");
  CodebookCalibrationOptions tq = BlockGtq(2.5);
  tq.scheme = "tq_mse";
  ExpectError([&] { CalibrateCodebook(acts, tq); }, ErrorCode::kInvalidArgument,
              "K width 2.5 of scheme 'tq_mse' is not an integer");
  CodebookCalibrationOptions fwht = BlockGtq(2);
  fwht.scheme = "tq_mse_fwht";
  ExpectError([&] { CalibrateCodebook(acts, fwht); }, ErrorCode::kInvalidArgument,
              "'tq_mse_fwht' has nothing to calibrate");
  CodebookCalibrationOptions v = BlockGtq(2);
  v.v_bits = 9;
  ExpectError([&] { CalibrateCodebook(acts, v); }, ErrorCode::kInvalidArgument,
              "V width 9 is not in 1..8");
  CodebookCalibrationOptions prefix = BlockGtq(2);
  prefix.stability_prefixes = {192};
  ExpectError([&] { CalibrateCodebook(acts, prefix); }, ErrorCode::kInvalidArgument,
              "stability prefix of 192 tokens");
}

// The reader's rules for a version-4 file: the widths must spend the budget, fit the row
// limits, and the file is exactly the codebook calibration's tensors.
TEST(CalibrateCodebook, FileValidationNamesTheOffence) {
  const Calibration good = CalibrateCodebook(Capture(), BlockGtq(2.5));
  {
    Calibration c = good;
    c.layers[1].key.widths[33] += 1;  // head 1 now sums to 81
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "calibration layer 1 k_bits kv head 1 sums to 81, not the budget floor(32 * 2.5) = 80");
  }
  {
    Calibration c = good;
    c.layers[0].key.widths[0] = 0;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "calibration layer 0 k_bits kv head 0 has 0 at block 0");
  }
  {
    Calibration c = good;
    c.layers[0].key.clip.assign(2, 1.0f);
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "scheme 'blockgtq' holds k_clip, which its calibration does not");
  }
  {
    Calibration c = good;
    c.layers[0].value.widths.assign(64, 3);
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "scheme 'blockgtq' holds v_bits");
  }
  {
    Calibration c = good;
    c.info.codebook.k_segments = 1;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "segments, more than k_segments 1");
  }
  {
    Safetensors f = CalibrationToSafetensors(good);
    f.metadata["format_version"] = "3";
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "scheme 'blockgtq' with format_version 3");
  }
  {
    const Safetensors full = CalibrationToSafetensors(good);
    Safetensors f;
    f.metadata = full.metadata;
    for (const auto& [name, t] : full.tensors) {
      if (name != "layers.1.k_bits") f.Add(name, t);
    }
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "tensor 'layers.1.k_bits' is missing");
  }
}

}  // namespace
}  // namespace kvq::calib
