// Calibration files: end-to-end calibration checked against its definition, the file round
// trip, and each validation error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/clip_search.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/testbed/compare.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;
using testing::ExpectError;
using testbed::BitsEqual;

const Activations& Capture() {
  static const Activations* acts = [] {
    return new Activations(Synthesize(testing::SynthShape(2, 8, 2, 128, 384, 9)));
  }();
  return *acts;
}

CalibrationOptions SmallOptions() {
  CalibrationOptions o;
  o.sink = 4;
  o.source = "capture.safetensors";
  return o;
}

// Layer l of two calibrations, bit for bit: every head_data.inc row of K and V, then the
// calibration-only artifacts.
void ExpectLayerBitsEqual(const Calibration& a, const Calibration& b, int l) {
  const LayerCalibration& x = a.layers[l];
  const LayerCalibration& y = b.layers[l];
  for (int side = 0; side < 2; ++side) {
    const std::string prefix = side == 0 ? "k_" : "v_";
#define KVQ_HEAD_ARRAY(name, ...) \
  EXPECT_TRUE(BitsEqual(prefix + #name, x.heads(side).name, y.heads(side).name)) << "layer " << l;
#define KVQ_HEAD_SCALAR(name, ...) KVQ_HEAD_ARRAY(name)
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
  }
  EXPECT_TRUE(BitsEqual("k_basis", x.k_basis, y.k_basis)) << "layer " << l;
  EXPECT_TRUE(BitsEqual("v_basis", x.v_basis, y.v_basis)) << "layer " << l;
  EXPECT_TRUE(BitsEqual("k_eigenvalues", x.k_eigenvalues, y.k_eigenvalues)) << "layer " << l;
  EXPECT_TRUE(BitsEqual("v_eigenvalues", x.v_eigenvalues, y.v_eigenvalues)) << "layer " << l;
  EXPECT_TRUE(BitsEqual("raw_k_rotation", x.raw_k_rotation, y.raw_k_rotation)) << "layer " << l;
  EXPECT_TRUE(BitsEqual("raw_v_rotation", x.raw_v_rotation, y.raw_v_rotation)) << "layer " << l;
}

TEST(Calibrate, PerKvHeadMatchesItsDefinition) {
  const Activations& acts = Capture();
  ClipReport report;
  const Calibration cal = Calibrate(acts, SmallOptions(), cpu::BestBackend(), {}, &report);
  EXPECT_EQ(cal.info.rotation, "oscar");
  EXPECT_EQ(cal.info.granularity, "kv_head");
  EXPECT_EQ(cal.info.value_target, "attn_output");
  const int64_t n = acts.info.calib_tokens;
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      const MatrixXd cq = QueryCovariance(acts, l, h, n);
      const EigenBasis k = SortedEigenBasis(cq);
      const std::vector<float> r = ToRowMajorF32(OscarRotation(k.vectors));
      const std::vector<float> u = ToRowMajorF32(k.vectors);
      EXPECT_EQ(0, std::memcmp(r.data(), cal.layers[l].rotation_of(0, h, 128), r.size() * 4))
          << "layer " << l << " head " << h;
      EXPECT_EQ(0, std::memcmp(u.data(), cal.layers[l].k_basis.data() + h * 128 * 128, u.size() * 4));
      EXPECT_EQ(cal.layers[l].k_eigenvalues[h * 128], static_cast<float>(k.values(0)));
      const EigenBasis v =
          SortedEigenBasis(ComputeAttentionStatistics(acts, l, h, n, false).output_covariance);
      const std::vector<float> rv = ToRowMajorF32(OscarRotation(v.vectors));
      EXPECT_EQ(0, std::memcmp(rv.data(), cal.layers[l].rotation_of(1, h, 128), rv.size() * 4));
      // Lemma 1 on the stored R.
      const MatrixXd rd = FromRowMajorF32(cal.layers[l].rotation_of(0, h, 128), 128, 128);
      const Eigen::VectorXd diag = (rd.transpose() * cq * rd).diagonal();
      EXPECT_LE(diag.maxCoeff() / diag.mean(), 1 + 1e-5);
    }
    // The stored clip is the argmin of the reported objectives, replicated over heads.
    const double k_rho = report.grid[ArgMinObjective(report.key_objectives[l])];
    const double v_rho = report.grid[ArgMinObjective(report.value_objectives[l])];
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(cal.layers[l].key.clip[h], static_cast<float>(k_rho));
      EXPECT_EQ(cal.layers[l].value.clip[h], static_cast<float>(v_rho));
    }
  }
}

TEST(Calibrate, ThreadCountDoesNotChangeTheBits) {
  CalibrationOptions one = SmallOptions();
  one.threads = 1;
  CalibrationOptions two = SmallOptions();
  two.threads = 2;
  const Calibration a = Calibrate(Capture(), one, cpu::BestBackend());
  const Calibration b = Calibrate(Capture(), two, cpu::BestBackend());
  for (int l = 0; l < 2; ++l) ExpectLayerBitsEqual(a, b, l);
}

TEST(Calibrate, LayerGranularityAndValueTargets) {
  const Activations& acts = Capture();
  const int64_t n = acts.info.calib_tokens;
  CalibrationOptions o = SmallOptions();
  o.granularity = Granularity::kLayer;
  o.value_target = ValueTarget::kKeyWeighted;
  const Calibration cal = Calibrate(acts, o, cpu::BestBackend());
  EXPECT_EQ(cal.info.granularity, "layer");
  EXPECT_EQ(cal.info.value_target, "key_weighted");
  const MatrixXd layer_cq = (QueryCovariance(acts, 1, 0, n) + QueryCovariance(acts, 1, 1, n)) / 2;
  const std::vector<float> r = ToRowMajorF32(OscarRotation(SortedEigenBasis(layer_cq).vectors));
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(0, std::memcmp(r.data(), cal.layers[1].rotation_of(0, h, 128), r.size() * 4));
  }
  MatrixXd layer_kw = MatrixXd::Zero(128, 128);
  for (int h = 0; h < 2; ++h) {
    const AttentionStatistics s = ComputeAttentionStatistics(acts, 1, h, n, true);
    layer_kw += KeyWeightedValueCovariance(acts, 1, h, n, s.key_weight) / 2;
  }
  const std::vector<float> rv = ToRowMajorF32(OscarRotation(SortedEigenBasis(layer_kw).vectors));
  EXPECT_EQ(0, std::memcmp(rv.data(), cal.layers[1].rotation_of(1, 1, 128), rv.size() * 4));

  o.value_target = ValueTarget::kRaw;
  o.granularity = Granularity::kKvHead;
  const Calibration raw = Calibrate(acts, o, cpu::BestBackend());
  const std::vector<float> rr =
      ToRowMajorF32(OscarRotation(SortedEigenBasis(RawCovariance(acts, 0, 1, false, n)).vectors));
  EXPECT_EQ(0, std::memcmp(rr.data(), raw.layers[0].rotation_of(1, 1, 128), rr.size() * 4));
}

TEST(Calibrate, RotationRecipes) {
  CalibrationOptions o = SmallOptions();
  for (RotationRecipe recipe :
       {RotationRecipe::kNoBitReversal, RotationRecipe::kNoHadamard, RotationRecipe::kEigenbasisOnly,
        RotationRecipe::kRawTarget, RotationRecipe::kHadamardBitrev, RotationRecipe::kHadamard,
        RotationRecipe::kRandomOrthogonal, RotationRecipe::kIdentity}) {
    o.rotation = recipe;
    const Calibration cal = Calibrate(Capture(), o, cpu::BestBackend());
    EXPECT_EQ(cal.info.rotation, RotationRecipeName(recipe));
    EXPECT_EQ(ParseRotationRecipe(RotationRecipeName(recipe)), recipe);
    const MatrixXd r = FromRowMajorF32(cal.layers[0].rotation_of(0, 1, 128), 128, 128);
    const MatrixXd u = FromRowMajorF32(cal.layers[0].k_basis.data() + 128 * 128, 128, 128);
    MatrixXd expected;
    switch (recipe) {
      case RotationRecipe::kNoBitReversal: expected = BasisHadamard(u); break;
      case RotationRecipe::kNoHadamard: expected = BasisBitReversal(u); break;
      case RotationRecipe::kEigenbasisOnly: expected = u; break;
      case RotationRecipe::kRawTarget: expected = OscarRotation(u); break;
      case RotationRecipe::kHadamardBitrev: expected = HadamardBitReversal(128); break;
      case RotationRecipe::kHadamard: expected = HadamardMatrix(128); break;
      case RotationRecipe::kIdentity: expected = MatrixXd::Identity(128, 128); break;
      default: expected = r; break;
    }
    EXPECT_LT((r - expected).cwiseAbs().maxCoeff(), 1e-6) << RotationRecipeName(recipe);
  }
  EXPECT_THROW(ParseRotationRecipe("quarot"), Error);
}

TEST(Calibrate, RejectsBadOptions) {
  CalibrationOptions o = SmallOptions();
  o.bits = 3;
  EXPECT_THROW(Calibrate(Capture(), o, cpu::BestBackend()), Error);
  o = SmallOptions();
  o.clip_grid = {0.9, 1.2};
  EXPECT_THROW(Calibrate(Capture(), o, cpu::BestBackend()), Error);
  o = SmallOptions();
  o.sink = 192;  // = calib_tokens: no clip rows left
  EXPECT_THROW(Calibrate(Capture(), o, cpu::BestBackend()), Error);
  o = SmallOptions();
  o.damping = -0.1;
  EXPECT_THROW(Calibrate(Capture(), o, cpu::BestBackend()), Error);
  EXPECT_THROW(ParseGranularity("head"), Error);
  EXPECT_THROW(ParseValueTarget("sv"), Error);
}

const Calibration& Reference() {
  static const Calibration* cal =
      new Calibration(Calibrate(Capture(), SmallOptions(), cpu::BestBackend()));
  return *cal;
}

TEST(CalibrationFile, RoundTrip) {
  const Calibration& cal = Reference();
  const std::string path = ::testing::TempDir() + "/calibration_roundtrip.safetensors";
  WriteCalibration(path, cal);
  const Calibration back = ReadCalibration(path);
  std::remove(path.c_str());
  EXPECT_EQ(back.info.num_layers, 2);
  EXPECT_EQ(back.info.num_kv_heads, 2);
  EXPECT_EQ(back.info.head_dim, 128);
  EXPECT_EQ(back.info.group, 64);
  EXPECT_EQ(back.info.bits, 2);
  EXPECT_EQ(back.info.sink, 4);
  EXPECT_EQ(back.info.recent, 256);
  EXPECT_EQ(back.info.scheme, "oscar");
  EXPECT_EQ(back.info.rotation, "oscar");
  EXPECT_EQ(back.info.granularity, "kv_head");
  EXPECT_EQ(back.info.value_target, "attn_output");
  EXPECT_EQ(back.info.source, "capture.safetensors");
  for (int l = 0; l < 2; ++l) ExpectLayerBitsEqual(back, cal, l);
  EXPECT_TRUE(back.HasRawTargetRotations());
  const Safetensors file = CalibrationToSafetensors(cal);
  EXPECT_EQ(file.metadata.at("format"), "kvq-calibration");
  EXPECT_EQ(file.metadata.at("format_version"), "2");
  EXPECT_EQ(file.Get("layers.1.raw_v_rotation").shape, (std::vector<int64_t>{2, 128, 128}));
  EXPECT_EQ(file.Get("layers.1.k_rotation").shape, (std::vector<int64_t>{2, 128, 128}));
  EXPECT_EQ(file.Get("layers.1.v_eigenvalues").shape, (std::vector<int64_t>{2, 128}));
  EXPECT_EQ(file.Get("layers.0.k_clip").shape, (std::vector<int64_t>{2}));
}

// K and V apart: --v-bits searches V's clip at V's width. Each side's ratio is the one a
// calibration at that side's width alone selects (the rotations do not depend on the width),
// and the file keeps V's width under v_bits (written only when it differs from bits).
TEST(Calibrate, ValueWidthApartSearchesEachSideAtItsOwnWidth) {
  CalibrationOptions k2v4 = SmallOptions();
  k2v4.bits = 2;
  k2v4.v_bits = 4;
  CalibrationOptions all2 = SmallOptions(), all4 = SmallOptions();
  all2.bits = 2;
  all4.bits = 4;
  const Calibration apart = Calibrate(Capture(), k2v4, cpu::BestBackend());
  const Calibration two = Calibrate(Capture(), all2, cpu::BestBackend());
  const Calibration four = Calibrate(Capture(), all4, cpu::BestBackend());
  bool v_width_matters = false;
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(BitsEqual("k_clip", apart.layers[l].key.clip, two.layers[l].key.clip));
    EXPECT_TRUE(BitsEqual("v_clip", apart.layers[l].value.clip, four.layers[l].value.clip));
    EXPECT_TRUE(
        BitsEqual("v_rotation", apart.layers[l].value.rotation, two.layers[l].value.rotation));
    v_width_matters = v_width_matters || two.layers[l].value.clip != four.layers[l].value.clip;
  }
  EXPECT_TRUE(v_width_matters) << "INT2 and INT4 chose the same V clip everywhere: no evidence";
  EXPECT_EQ(apart.info.bits, 2);
  EXPECT_EQ(apart.info.v_bits, 4);
  EXPECT_EQ(two.info.v_bits, 0);
  EXPECT_EQ(CalibrationToSafetensors(apart).metadata.at("v_bits"), "4");
  EXPECT_EQ(CalibrationToSafetensors(two).metadata.count("v_bits"), 0u);
  const std::string path = ::testing::TempDir() + "/calibration_k2v4.safetensors";
  WriteCalibration(path, apart);
  const Calibration back = ReadCalibration(path);
  std::remove(path.c_str());
  EXPECT_EQ(back.info.bits, 2);
  EXPECT_EQ(back.info.v_bits, 4);
  Calibration bad = two;
  bad.info.v_bits = 3;
  ExpectError([&] { ValidateCalibration(bad); }, ErrorCode::kInvalidArgument, "bits 3");
  bad.info.v_bits = 2;
  ExpectError([&] { ValidateCalibration(bad); }, ErrorCode::kInvalidArgument, "v_bits 2");
}

// The raw_target scheme's rotations: U'·H·P_br of KᵀK/N and VᵀV/N over the calibration tokens,
// undamped, per head or of the layer mean; RawTargetRotations gives the same bits from a capture.
TEST(Calibrate, RawTargetRotationsMatchTheirDefinition) {
  const Activations& acts = Capture();
  const int64_t n = acts.info.calib_tokens;
  const size_t dd = 128 * 128;
  CalibrationOptions o = SmallOptions();
  o.damping = 0.5;  // damps the OSCAR targets only
  const Calibration cal = Calibrate(acts, o, cpu::BestBackend());
  ASSERT_TRUE(cal.HasRawTargetRotations());
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      for (bool keys : {true, false}) {
        const std::vector<float> r = ToRowMajorF32(
            OscarRotation(SortedEigenBasis(RawCovariance(acts, l, h, keys, n)).vectors));
        const std::vector<float>& got =
            keys ? cal.layers[l].raw_k_rotation : cal.layers[l].raw_v_rotation;
        EXPECT_EQ(0, std::memcmp(r.data(), got.data() + h * dd, dd * 4))
            << "layer " << l << " head " << h << (keys ? " keys" : " values");
      }
    }
    std::vector<float> k, v;
    RawTargetRotations(acts, l, Granularity::kKvHead, &k, &v);
    EXPECT_TRUE(BitsEqual("k", k, cal.layers[l].raw_k_rotation));
    EXPECT_TRUE(BitsEqual("v", v, cal.layers[l].raw_v_rotation));
  }
  o.granularity = Granularity::kLayer;
  const Calibration layer = Calibrate(acts, o, cpu::BestBackend());
  const MatrixXd mean = (RawCovariance(acts, 1, 0, false, n) + RawCovariance(acts, 1, 1, false, n)) / 2;
  const std::vector<float> r = ToRowMajorF32(OscarRotation(SortedEigenBasis(mean).vectors));
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(0, std::memcmp(r.data(), layer.layers[1].raw_v_rotation.data() + h * dd, dd * 4));
  }
  std::vector<float> k, v;
  RawTargetRotations(acts, 1, Granularity::kLayer, &k, &v);
  EXPECT_TRUE(BitsEqual("v", v, layer.layers[1].raw_v_rotation));
  EXPECT_TRUE(BitsEqual("k", k, layer.layers[1].raw_k_rotation));
}

// A format_version 1 file (no raw-target rotations) still reads, and writes back as version 1;
// AddRawTargetRotations completes it to what kvq calibrate writes now.
TEST(CalibrationFile, VersionOneFilesStillRead) {
  Calibration old = Reference();
  for (LayerCalibration& l : old.layers) {
    l.raw_k_rotation.clear();
    l.raw_v_rotation.clear();
  }
  const Safetensors file = CalibrationToSafetensors(old);
  EXPECT_EQ(file.metadata.at("format_version"), "1");
  EXPECT_EQ(file.Find("layers.0.raw_k_rotation"), nullptr);
  const Calibration back = CalibrationFromSafetensors(file);
  EXPECT_FALSE(back.HasRawTargetRotations());
  EXPECT_TRUE(
      BitsEqual("k_rotation", back.layers[1].key.rotation, Reference().layers[1].key.rotation));
  Calibration completed = back;
  AddRawTargetRotations(Capture(), &completed);
  ASSERT_TRUE(completed.HasRawTargetRotations());
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(BitsEqual("raw_k_rotation", completed.layers[l].raw_k_rotation,
                          Reference().layers[l].raw_k_rotation));
    EXPECT_TRUE(BitsEqual("raw_v_rotation", completed.layers[l].raw_v_rotation,
                          Reference().layers[l].raw_v_rotation));
  }
  {
    // A version 2 file must hold them.
    Safetensors f;
    f.metadata = CalibrationToSafetensors(Reference()).metadata;
    for (const auto& [name, t] : CalibrationToSafetensors(Reference()).tensors) {
      if (name != "layers.1.raw_k_rotation") f.Add(name, t);
    }
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "layers.1.raw_k_rotation");
  }
  {
    // A version 1 file must not.
    Safetensors f = file;
    f.Add("layers.0.raw_k_rotation", CalibrationToSafetensors(Reference()).Get("layers.0.raw_k_rotation"));
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "layers.0.raw_k_rotation");
  }
  {
    // All layers or none.
    Calibration c = Reference();
    c.layers[1].raw_v_rotation.clear();
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kShapeMismatch, "raw_k_rotation");
  }
  {
    Calibration c = Reference();
    c.layers[0].raw_v_rotation[7] += 0.01f;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "layer 0 raw_v_rotation kv head 0 is not orthogonal");
  }
}

// The fp8 scales (head_data.inc's `scale` row, format_version 3) travel the file by the same
// rules as every row: tensors k_scale / v_scale [Hkv] F32, the row's own value rule, all
// layers or none, and only beside the version 2 tensors.
TEST(CalibrationFile, ScaleRowFollowsItsRules) {
  Calibration scaled = Reference();
  scaled.info.scheme = "fp8";
  for (LayerCalibration& l : scaled.layers) {
    l.key.scale = {0.5f, 0.25f};
    l.value.scale = {0.125f, 2.0f};
  }
  const Safetensors file = CalibrationToSafetensors(scaled);
  EXPECT_EQ(file.metadata.at("format_version"), "3");
  EXPECT_EQ(file.Get("layers.1.v_scale").shape, (std::vector<int64_t>{2}));
  const Calibration back = CalibrationFromSafetensors(file);
  EXPECT_TRUE(back.HasScales());
  for (int l = 0; l < 2; ++l) ExpectLayerBitsEqual(back, scaled, l);
  {
    Calibration c = scaled;
    c.layers[1].value.scale[1] = 0.0f;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "layer 1 v_scale kv head 1 = 0 is not a finite value > 0");
  }
  {
    Calibration c = scaled;
    c.layers[1].key.scale.clear();
    c.info.scheme = "oscar";
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kShapeMismatch,
                "layer 0 holds k_scale but another layer lacks the fp8 scales");
  }
  {
    Calibration c = scaled;
    for (LayerCalibration& l : c.layers) l.raw_k_rotation.clear();
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "fp8 scales need the raw-target rotations too (format_version 3");
  }
  {
    Safetensors f = file;
    for (auto& [name, t] : f.tensors) {
      if (name == "layers.0.k_scale") t = Tensor::I32({2}, {1, 1});
    }
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "'layers.0.k_scale' has dtype I32, expected F32");
  }
  {
    Safetensors f;
    f.metadata = file.metadata;
    f.metadata["format_version"] = "2";
    for (const auto& [name, t] : file.tensors) f.Add(name, t);
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "unexpected tensor 'layers.0.k_scale'");
  }
}

// The block widths (head_data.inc's `widths` row, format_version 4) are keyed to the scheme:
// tensors k_bits / v_bits [Hkv, d/2] U8 exactly when the scheme allocates widths (blockgtq,
// whose calibration is issue 22's next step); every scheme read today refuses them by name,
// and a file holding them is not of an older version.
TEST(CalibrationFile, WidthsRowIsKeyedToItsScheme) {
  Calibration c = Reference();
  for (LayerCalibration& l : c.layers) {
    l.key.widths.assign(2 * 64, 3);
    l.value.widths.assign(2 * 64, 2);
  }
  ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
              "calibration: scheme 'oscar' holds k_bits, which its calibration does not");
  const Safetensors file = CalibrationToSafetensors(Reference());
  Safetensors f;
  f.metadata = file.metadata;
  for (const auto& [name, t] : file.tensors) f.Add(name, t);
  f.Add("layers.0.k_bits", Tensor::U8({2, 64}, std::vector<uint8_t>(128, 3)));
  ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
              "unexpected tensor 'layers.0.k_bits'");
  f.metadata["format_version"] = "5";
  ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
              "format_version 5 is not supported (expected 1, 2, 3 or 4)");
}

TEST(CalibrationFile, ValidationErrors) {
  const Calibration& good = Reference();
  {
    Calibration c = good;
    c.layers[1].value.rotation[5 * 128 + 3] += 0.01f;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument,
                "layer 1 v_rotation kv head 0 is not orthogonal");
  }
  {
    Calibration c = good;
    c.layers[0].key.clip[1] = 0.0f;
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument, "k_clip kv head 1");
  }
  {
    Calibration c = good;
    c.layers[0].key.clip = {0.9f, 0.92f};
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument, "replicated");
  }
  {
    Calibration c = good;
    std::swap(c.layers[0].v_eigenvalues[0], c.layers[0].v_eigenvalues[1]);
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument, "not descending");
  }
  {
    Calibration c = good;
    c.layers[1].k_eigenvalues[7] = std::nanf("");
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kNonFinite, "layer 1 k_eigenvalues");
  }
  {
    Calibration c = good;
    c.layers[0].v_basis.resize(10);
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kShapeMismatch, "layer 0 v_basis");
  }
  {
    Calibration c = good;
    c.info.granularity = "layer";  // heads carry different rotations
    ExpectError([&] { ValidateCalibration(c); }, ErrorCode::kInvalidArgument, "replicated");
  }
  {
    Calibration c = good;
    c.info.group = 48;
    EXPECT_THROW(ValidateCalibration(c), Error);
  }
  const Safetensors file = CalibrationToSafetensors(good);
  {
    Safetensors f = file;
    f.metadata["format"] = "kvq-activations";
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile, "format");
  }
  {
    Safetensors f = file;
    f.metadata["format_version"] = "9";
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile,
                "format_version 9");
  }
  {
    Safetensors f = file;
    f.metadata.erase("value_target");
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile, "value_target");
  }
  {
    Safetensors f;
    f.metadata = file.metadata;
    for (const auto& [name, t] : file.tensors) {
      if (name != "layers.1.v_clip") f.Add(name, t);
    }
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile, "layers.1.v_clip");
  }
  {
    Safetensors f = file;
    f.Add("layers.2.k_clip", Tensor::F32({2}, {1.0f, 1.0f}));
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kMalformedFile, "layers.2.k_clip");
  }
  {
    Safetensors f = file;
    for (auto& [name, t] : f.tensors) {
      if (name == "layers.0.k_eigenvalues") t = Tensor::F32({2, 64}, std::vector<float>(128, 1.0f));
    }
    ExpectError([&] { CalibrationFromSafetensors(f); }, ErrorCode::kShapeMismatch,
                "layers.0.k_eigenvalues");
  }
}

}  // namespace
}  // namespace kvq::calib

namespace kvq::calib {
namespace {

// A calibration of version 1, 2 or 3 from fixed values (no fitting, so its bytes depend on the
// file code alone): 2 layers, 2 KV heads, d = 64; rotations are signed permutations, bases the
// identity, the raw-target rotations (version ≥ 2) and fp8 scales (version 3) likewise fixed.
Calibration FixedCalibration(int version) {
  const int d = 64, hkv = 2;
  Calibration c;
  c.info.num_layers = 2;
  c.info.num_kv_heads = hkv;
  c.info.head_dim = d;
  c.info.group = 32;
  c.info.bits = 2;
  c.info.v_bits = version == 2 ? 4 : 0;
  c.info.sink = 8;
  c.info.recent = 128;
  c.info.scheme = version == 3 ? "fp8_hadamard" : "oscar";
  c.info.granularity = "kv_head";
  c.info.source = "fixed";
  c.layers.resize(2);
  for (int l = 0; l < 2; ++l) {
    LayerCalibration& layer = c.layers[l];
    auto permutation = [&](int salt) {
      std::vector<float> m(static_cast<size_t>(hkv) * d * d, 0.0f);
      for (int h = 0; h < hkv; ++h) {
        for (int i = 0; i < d; ++i) {
          const int j = (i * 5 + l + h + salt) % d;  // 5 is odd: a bijection of 0..63
          m[(static_cast<size_t>(h) * d + i) * d + j] = (i + h + salt) % 3 == 0 ? -1.0f : 1.0f;
        }
      }
      return m;
    };
    layer.key.rotation = permutation(1);
    layer.value.rotation = permutation(2);
    layer.k_basis = permutation(3);
    layer.v_basis = permutation(4);
    for (int h = 0; h < hkv; ++h) {
      for (int i = 0; i < d; ++i) {
        layer.k_eigenvalues.push_back(static_cast<float>(d - i) * 0.375f + static_cast<float>(l));
        layer.v_eigenvalues.push_back(static_cast<float>(d - i) * 0.125f + static_cast<float>(h));
      }
    }
    layer.key.clip.assign(hkv, l == 0 ? 0.875f : 0.9f);
    layer.value.clip.assign(hkv, 0.95f);
    if (version >= 2) {
      layer.raw_k_rotation = permutation(5);
      layer.raw_v_rotation = permutation(6);
    }
    if (version == 3) {
      layer.key.scale = {0.0625f, 1.5f};
      layer.value.scale = {3.0f, 0.01f};
    }
  }
  return c;
}

uint64_t Fnv1a64(const std::vector<uint8_t>& bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) hash = (hash ^ b) * 0x100000001b3ull;
  return hash;
}

// The bytes of every calibration file of versions 1 to 3, pinned with the writer of commit
// 8af53c9 (before format_version 4 became the codebook calibration; the size and FNV-1a of
// FixedCalibration's bytes printed by a program linked against that commit's
// calibration_file.cc.o): the file code may change, these files may not. A file read back and
// written again is the same bytes.
TEST(CalibrationFile, OlderVersionsKeepTheirBytes) {
  struct Pinned {
    int version;
    size_t size;
    uint64_t fnv1a;
  };
  const Pinned pinned[] = {
      {1, 265832, 0xbc79b445e385e4f4ull},
      {2, 397280, 0x76b032ff61046b0bull},
      {3, 397616, 0x40b36a74158dd045ull},
  };
  for (const Pinned& p : pinned) {
    const Calibration c = FixedCalibration(p.version);
    const std::vector<uint8_t> bytes = SerializeSafetensors(CalibrationToSafetensors(c));
    EXPECT_EQ(CalibrationToSafetensors(c).metadata.at("format_version"),
              std::to_string(p.version));
    EXPECT_EQ(bytes.size(), p.size) << "version " << p.version;
    EXPECT_EQ(Fnv1a64(bytes), p.fnv1a) << "version " << p.version << std::hex << " fnv1a 0x"
                                       << Fnv1a64(bytes);
    const Calibration back = CalibrationFromSafetensors(CalibrationToSafetensors(c));
    EXPECT_EQ(SerializeSafetensors(CalibrationToSafetensors(back)), bytes)
        << "version " << p.version;
  }
}

}  // namespace
}  // namespace kvq::calib
