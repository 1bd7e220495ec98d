// The scheme catalogue: names, errors, and the CacheParams / rotations / clips each entry makes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/codebook_calibration.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/codebook.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params_builder.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/compare.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testbed::BitsEqual;
using testing::SmallSchemeOptions;

struct Fixture {
  Activations acts;
  Calibration cal;                          // oscar's
  // Each scheme's own: an fp8 scheme's (its scales), blockgtq's (its widths, at
  // SmallSchemeOptions' bits: K2V2).
  std::map<std::string, Calibration> own;

  // The calibration scheme `name` reads (kvq calibrate --scheme CalibrationScheme(name)).
  const Calibration& For(const std::string& name) const {
    const auto it = own.find(CalibrationScheme(name));
    return it == own.end() ? cal : it->second;
  }
};

const Fixture& Small() {
  static const Fixture f = [] {
    Fixture fx;
    fx.acts = Synthesize(testing::SmallSynthOptions(2, 512, 11));
    CalibrationOptions c;
    c.sink = 16;
    c.recent = 32;
    fx.cal = Calibrate(fx.acts, c, cpu::BestBackend());
    for (const SchemeInfo& s : Schemes()) {
      if (CalibrationScheme(s.name) != "oscar") {
        fx.own[s.name] = CalibrationForScheme(s.name, fx.cal, &fx.acts, cpu::BestBackend(),
                                              SmallSchemeOptions());
      }
    }
    return fx;
  }();
  return f;
}

std::vector<float> PerHead(int hkv, const std::function<MatrixXd(int)>& make) {
  std::vector<float> all;
  for (int h = 0; h < hkv; ++h) {
    const std::vector<float> m = ToRowMajorF32(make(h));
    all.insert(all.end(), m.begin(), m.end());
  }
  return all;
}

// Every row of head_data.inc of both sides, bit for bit.
::testing::AssertionResult HeadsBitsEqual(const LayerScheme& a, const LayerScheme& b) {
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  auto compare = [&](const std::string& what, const auto& x, const auto& y) {
    if (result) result = BitsEqual(what, x, y);
  };
  for (int side = 0; side < 2; ++side) {
    const std::string prefix = side == 0 ? "key " : "value ";
#define KVQ_HEAD_ARRAY(name, ...) compare(prefix + #name, a.heads(side).name, b.heads(side).name);
#define KVQ_HEAD_SCALAR(name, ...) compare(prefix + #name, a.heads(side).name, b.heads(side).name);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
  }
  return result;
}

TEST(Schemes, UnknownNameIsRejectedNamingItAndTheValidNames) {
  try {
    SchemeByName("osCar");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("'osCar'"), std::string::npos) << what;
    for (const SchemeInfo& s : Schemes()) EXPECT_NE(what.find(s.name), std::string::npos) << what;
  }
  EXPECT_THROW(BuildLayerScheme("kivi2", Small().acts, &Small().cal, 0, SmallSchemeOptions()),
               Error);
}

TEST(Schemes, ListParsing) {
  const std::vector<std::string> all = ParseSchemeList("all");
  ASSERT_EQ(all.size(), Schemes().size());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], Schemes()[i].name);
  EXPECT_EQ(ParseSchemeList("oscar,naive"), (std::vector<std::string>{"oscar", "naive"}));
  EXPECT_THROW(ParseSchemeList("oscar,oscar"), Error);
  EXPECT_THROW(ParseSchemeList("oscar,,naive"), Error);
  EXPECT_THROW(ParseSchemeList(""), Error);
  EXPECT_THROW(ParseSchemeList("oscar,nope"), Error);
}

TEST(Schemes, EveryNameBuildsAValidCacheConfiguration) {
  const Fixture& f = Small();
  for (const SchemeInfo& s : Schemes()) {
    for (int layer = 0; layer < 2; ++layer) {
      const LayerScheme ls =
          BuildLayerScheme(s.name, f.acts, &f.For(s.name), layer, SmallSchemeOptions());
      EXPECT_NO_THROW(ls.params.Validate()) << s.name;
      EXPECT_EQ(ls.params.num_kv_heads, 2) << s.name;
      EXPECT_EQ(ls.params.num_q_heads, 4) << s.name;
      EXPECT_EQ(ls.params.head_dim(), 64) << s.name;
      // The shared windows, or the scheme's own (KIVI's, SAW-INT4's).
      const SchemeWindows w = s.windows.shared() ? SchemeWindows(16, 32, 1) : s.windows;
      EXPECT_EQ(ls.params.sink, w.sink) << s.name;
      EXPECT_EQ(ls.params.recent, w.recent) << s.name;
      EXPECT_EQ(ls.params.flush, w.flush) << s.name;
      // P = 16, raised to the tile (32) for a tiled side.
      const bool tiled = s.format_k == Format::kAffineTile || s.format_v == Format::kAffineTile;
      EXPECT_EQ(ls.params.page_size, tiled ? 32 : 16) << s.name;
      // Each side's per-head data fits its params (a matrix per head exactly when dense).
      for (int side = 0; side < 2; ++side) {
        const WriteParams& w = side == 0 ? ls.params.key : ls.params.value;
        const bool dense = w.rotation == RotationKind::kDense;
        EXPECT_EQ(ls.heads(side).rotation.size(), dense ? 2u * 64 * 64 : 0u) << s.name;
        EXPECT_NO_THROW(ls.heads(side).Validate(w, 2, side == 0 ? "key" : "value")) << s.name;
      }
    }
  }
}

TEST(Schemes, BaselinesHaveTheirDefiningParameters) {
  const Fixture& f = Small();
  const SchemeOptions o = SmallSchemeOptions();
  const LayerScheme bf16 = BuildLayerScheme("bf16", f.acts, nullptr, 0, o);
  EXPECT_FALSE(bf16.params.quantized());

  const LayerScheme naive = BuildLayerScheme("naive", f.acts, nullptr, 0, o);
  EXPECT_TRUE(naive.params.quantized());
  for (const WriteParams& w : {naive.params.key, naive.params.value}) {
    EXPECT_EQ(w.rotation, RotationKind::kIdentity);
    EXPECT_EQ(w.bits, 2);
    EXPECT_EQ(w.group, 32);
    EXPECT_EQ(w.clip, 1.0f);
    EXPECT_FALSE(w.bitrev);
  }
  EXPECT_TRUE(naive.key.clip.empty() && naive.value.clip.empty());

  const LayerScheme had = BuildLayerScheme("hadamard", f.acts, nullptr, 0, o);
  EXPECT_EQ(had.params.key.rotation, RotationKind::kHadamard);
  EXPECT_EQ(had.params.key.fwht_block(), 64);
  EXPECT_FALSE(had.params.key.bitrev);
  EXPECT_EQ(had.params.value.clip, 1.0f);
  const LayerScheme hb = BuildLayerScheme("hadamard_bitrev", f.acts, nullptr, 0, o);
  EXPECT_EQ(hb.params.value.rotation, RotationKind::kHadamard);
  EXPECT_TRUE(hb.params.key.bitrev && hb.params.value.bitrev);

  SchemeOptions saw_options = o;
  saw_options.saw_block = 16;
  const LayerScheme saw = BuildLayerScheme("saw_int4", f.acts, nullptr, 0, saw_options);
  EXPECT_EQ(saw.params.key.bits, 4);
  EXPECT_EQ(saw.params.value.bits, 4);
  EXPECT_EQ(saw.params.key.fwht_block(), 16);
  EXPECT_EQ(saw.params.value.fwht_block(), 16);
  saw_options.saw_block = 48;
  EXPECT_THROW(BuildLayerScheme("saw_int4", f.acts, nullptr, 0, saw_options), Error);

  EXPECT_THROW(BuildLayerScheme("oscar", f.acts, nullptr, 0, o), Error);
  EXPECT_THROW(BuildLayerScheme("naive", f.acts, nullptr, 2, o), Error);
  SchemeOptions bad = o;
  bad.group = 48;
  EXPECT_THROW(BuildLayerScheme("naive", f.acts, nullptr, 0, bad), Error);
}

TEST(Schemes, CalibratedSchemesUseTheCalibrationsMatricesAndClips) {
  const Fixture& f = Small();
  const SchemeOptions o = SmallSchemeOptions();
  const int d = 64;
  for (int layer = 0; layer < 2; ++layer) {
    const LayerCalibration& lc = f.cal.layers[layer];
    auto basis = [&](const std::vector<float>& all, int h) {
      return FromRowMajorF32(all.data() + static_cast<size_t>(h) * d * d, d, d);
    };
    const LayerScheme oscar = BuildLayerScheme("oscar", f.acts, &f.cal, layer, o);
    EXPECT_EQ(oscar.params.key.rotation, RotationKind::kDense);
    EXPECT_TRUE(BitsEqual("rotation_k", oscar.key.rotation, lc.key.rotation));
    EXPECT_TRUE(BitsEqual("rotation_v", oscar.value.rotation, lc.value.rotation));
    EXPECT_TRUE(BitsEqual("clip_k", oscar.key.clip, lc.key.clip));
    EXPECT_TRUE(BitsEqual("clip_v", oscar.value.clip, lc.value.clip));

    const LayerScheme nb = BuildLayerScheme("oscar_no_bitrev", f.acts, &f.cal, layer, o);
    EXPECT_TRUE(BitsEqual("rotation_k", nb.key.rotation, PerHead(2, [&](int h) {
                           return BasisHadamard(basis(lc.k_basis, h));
                         })));
    EXPECT_TRUE(BitsEqual("rotation_v", nb.value.rotation, PerHead(2, [&](int h) {
                           return BasisHadamard(basis(lc.v_basis, h));
                         })));
    EXPECT_TRUE(BitsEqual("clip_k", nb.key.clip, lc.key.clip));
    const LayerScheme nh = BuildLayerScheme("oscar_no_hadamard", f.acts, &f.cal, layer, o);
    EXPECT_TRUE(BitsEqual("rotation_k", nh.key.rotation, PerHead(2, [&](int h) {
                           return BasisBitReversal(basis(lc.k_basis, h));
                         })));
    const LayerScheme raw = BuildLayerScheme("raw_target", f.acts, &f.cal, layer, o);
    EXPECT_TRUE(BitsEqual("rotation_v", raw.value.rotation, PerHead(2, [&](int h) {
                           return OscarRotation(
                               SortedEigenBasis(RawCovariance(f.acts, layer, h, false,
                                                              f.acts.info.calib_tokens))
                                   .vectors);
                         })));
    EXPECT_TRUE(BitsEqual("clip_v", raw.value.clip, lc.value.clip));
    const LayerScheme clip = BuildLayerScheme("clip_only", f.acts, &f.cal, layer, o);
    EXPECT_EQ(clip.params.key.rotation, RotationKind::kIdentity);
    EXPECT_TRUE(BitsEqual("clip_k", clip.key.clip, lc.key.clip));
    EXPECT_TRUE(BitsEqual("clip_v", clip.value.clip, lc.value.clip));
  }
}

// The catalogue's columns (schemes.inc) decide what BuildLayerScheme makes: the format, the
// bits (shared or the scheme's own), the clip policy and whether a calibration is needed.
TEST(Schemes, CatalogueColumnsDecideTheBuild) {
  const Fixture& f = Small();
  ASSERT_EQ(Schemes().size(), ParseSchemeList("all").size());
  for (const SchemeInfo& s : Schemes()) {
    EXPECT_EQ(&SchemeByName(s.name), &s) << s.name;
    EXPECT_NE(SchemeNames().find(s.name), std::string::npos);
    EXPECT_GT(std::string(s.description).size(), 10u) << s.name;
    for (int bits : {2, 4}) {
      SchemeOptions o = SmallSchemeOptions();
      o.bits = bits;
      const LayerScheme ls = BuildLayerScheme(s.name, f.acts, &f.For(s.name), 1, o);
      EXPECT_EQ(ls.params.key.format, s.format_k) << s.name;
      EXPECT_EQ(ls.params.value.format, s.format_v) << s.name;
      EXPECT_EQ(ls.params.quantized(), s.quantized()) << s.name;
      if (s.quantized()) {
        const int expected = s.bits == kSharedBits ? bits : s.bits;
        // Calibrated widths: the keys' bits are the calibration's budget width (K2 here).
        EXPECT_EQ(ls.params.key.bits,
                  s.widths == WidthsPolicy::kCalibration ? f.For(s.name).info.bits : expected)
            << s.name;
        EXPECT_EQ(ls.params.value.bits, expected) << s.name;
        EXPECT_EQ(s.BitsUnder(o), expected) << s.name;
      }
      switch (s.clip) {
        case ClipPolicy::kNone:
          EXPECT_TRUE(ls.key.clip.empty() && ls.value.clip.empty()) << s.name;
          EXPECT_EQ(ls.params.key.clip, 1.0f) << s.name;
          break;
        case ClipPolicy::kCalibration:
          EXPECT_TRUE(BitsEqual("clip_k", ls.key.clip, f.cal.layers[1].key.clip)) << s.name;
          EXPECT_TRUE(BitsEqual("clip_v", ls.value.clip, f.cal.layers[1].value.clip)) << s.name;
          break;
      }
      switch (s.scale) {
        case ScalePolicy::kNone:
          EXPECT_TRUE(ls.key.scale.empty() && ls.value.scale.empty()) << s.name;
          EXPECT_EQ(ls.params.key.head_scale, 1.0f) << s.name;
          break;
        case ScalePolicy::kCalibration:
          ASSERT_FALSE(ls.key.scale.empty()) << s.name;
          EXPECT_TRUE(BitsEqual("scale_k", ls.key.scale, f.For(s.name).layers[1].key.scale))
              << s.name;
          EXPECT_TRUE(BitsEqual("scale_v", ls.value.scale, f.For(s.name).layers[1].value.scale))
              << s.name;
          break;
      }
      switch (s.widths) {
        case WidthsPolicy::kNone:
          EXPECT_TRUE(ls.key.widths.empty() && ls.value.widths.empty()) << s.name;
          break;
        case WidthsPolicy::kCalibration:
          EXPECT_EQ(ls.key.widths, f.For(s.name).layers[1].key.widths) << s.name;
          EXPECT_TRUE(ls.value.widths.empty()) << s.name;  // K-only allocation
          break;
      }
    }
    // A calibration is needed exactly when the row says so.
    if (s.needs_calibration) {
      testing::ExpectError(
          [&] { BuildLayerScheme(s.name, f.acts, nullptr, 0, SmallSchemeOptions()); },
          ErrorCode::kInvalidArgument, "needs a calibration");
    } else {
      const LayerScheme without = BuildLayerScheme(s.name, f.acts, nullptr, 0, SmallSchemeOptions());
      const LayerScheme with = BuildLayerScheme(s.name, f.acts, &f.cal, 0, SmallSchemeOptions());
      EXPECT_TRUE(BitsEqual("rotation_k", without.key.rotation, with.key.rotation)) << s.name;
      EXPECT_TRUE(without.key.clip.empty()) << s.name;
    }
  }
  EXPECT_STREQ(ClipPolicyName(ClipPolicy::kNone), "none");
  EXPECT_STREQ(ClipPolicyName(ClipPolicy::kCalibration), "calibration");
}

// Spec 1.2's rows: FP8 e4m3 on K and V, no windows, 8 bits; fp8 reads per-head scales of the
// unrotated rows, fp8_hadamard of the FWHT'd ones (each from a calibration made for it),
// fp8_unscaled none. A calibration made for another scheme is refused naming both.
TEST(Schemes, Spec12RowsHaveTheirDefiningParameters) {
  const Fixture& f = Small();
  const SchemeOptions o = SmallSchemeOptions();
  for (const char* name : {"fp8", "fp8_unscaled", "fp8_hadamard"}) {
    const bool calibrated = std::string(name) != "fp8_unscaled";
    const LayerScheme ls =
        BuildLayerScheme(name, f.acts, calibrated ? &f.For(name) : nullptr, 1, o);
    EXPECT_EQ(ls.params.sink, 0) << name;
    EXPECT_EQ(ls.params.recent, 0) << name;
    for (const WriteParams& w : {ls.params.key, ls.params.value}) {
      EXPECT_EQ(w.format, Format::kFp8E4m3) << name;
      EXPECT_EQ(w.bits, 8) << name;
      EXPECT_EQ(w.clip, 1.0f) << name;
      EXPECT_EQ(w.rotation, std::string(name) == "fp8_hadamard" ? RotationKind::kHadamard
                                                                : RotationKind::kIdentity)
          << name;
      EXPECT_EQ(w.fwht_block(), 64) << name;
    }
    EXPECT_EQ(ls.key.scale.size(), calibrated ? 2u : 0u) << name;
    if (!calibrated) continue;
    // The scales are each head's amax / 448 after the scheme's own rotation.
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(ls.key.scale[h],
                Fp8Scales(f.acts, 1, true, ls.params.key, cpu::ScalarBackend())[h]) << name;
      EXPECT_EQ(ls.value.scale[h],
                Fp8Scales(f.acts, 1, false, ls.params.value, cpu::ScalarBackend())[h]) << name;
      EXPECT_GT(ls.key.scale[h], 0.0f);
    }
  }
  EXPECT_NE(f.For("fp8").layers[0].key.scale, f.For("fp8_hadamard").layers[0].key.scale);
  EXPECT_TRUE(CalibrationServes(f.cal, "oscar"));
  EXPECT_FALSE(CalibrationServes(f.cal, "fp8"));
  EXPECT_TRUE(CalibrationServes(f.For("fp8"), "fp8"));
  EXPECT_FALSE(CalibrationServes(f.For("fp8"), "fp8_hadamard"));
  testing::ExpectError([&] { BuildLayerScheme("fp8", f.acts, &f.cal, 0, o); },
                       ErrorCode::kInvalidArgument, "layers.0.k_scale");
  testing::ExpectError([&] { BuildLayerScheme("fp8_hadamard", f.acts, &f.For("fp8"), 0, o); },
                       ErrorCode::kInvalidArgument, "for scheme 'fp8'");
  testing::ExpectError(
      [&] { CalibrationForScheme("fp8", f.cal, nullptr, cpu::ScalarBackend(), o); },
      ErrorCode::kInvalidArgument, "scheme 'fp8' needs fp8 scales");
  // A zero head stores s^ = 1; a dense rotation is refused.
  Activations zero = f.acts;
  for (float& x : zero.layers[0].k) x = 0.0f;
  const WriteParams identity = params::Write().head_dim(64).fp8();
  EXPECT_EQ(Fp8Scales(zero, 0, true, identity, cpu::ScalarBackend()),
            (std::vector<float>{1.0f, 1.0f}));
  testing::ExpectError(
      [&] {
        Fp8Scales(f.acts, 0, true, params::Write().head_dim(64).fp8().rotation(RotationKind::kDense),
                  cpu::ScalarBackend());
      },
      ErrorCode::kUnsupported, "dense rotation");
}

// Spec 1.1's rows (issue 17) against DESIGN.md's defaults: KIVI-family keys per channel over
// tiles of 32 (SchemeOptions::tile) and values per token in groups of 32 (at d = 256 too),
// S0 = 0, W = 1, F = 128; kivi_norm's norm on the original keys, ots's on the FWHT'd keys
// (per head, or per token over every KV head); SAW-INT4 with G = d, the block FWHT min(128, d)
// on K and V (K only for saw_int4_k), S0 = W = 0; saw_hessian's dense H_bd*U.
TEST(Schemes, Spec11RowsHaveTheirDefiningParameters) {
  const Fixture& f = Small();
  const SchemeOptions o = SmallSchemeOptions();
  for (const char* name : {"kivi", "kivi_hadamard", "kivi_norm", "ots"}) {
    const LayerScheme ls = BuildLayerScheme(name, f.acts, nullptr, 0, o);
    const CacheParams& p = ls.params;
    EXPECT_EQ(p.sink, 0) << name;
    EXPECT_EQ(p.recent, 1) << name;
    EXPECT_EQ(p.flush, 128) << name;
    EXPECT_EQ(p.key.format, Format::kAffineTile) << name;
    EXPECT_EQ(p.key.tile_tokens(), 32) << name;
    EXPECT_EQ(p.value.format, Format::kAffineToken) << name;
    EXPECT_EQ(p.value.group, 32) << name;
    EXPECT_EQ(p.key.bits, 2) << name;
    EXPECT_EQ(p.key.clip, 1.0f) << name;
    const bool fwht = std::string(name) == "kivi_hadamard" || std::string(name) == "ots";
    const bool norm = std::string(name) == "kivi_norm" || std::string(name) == "ots";
    for (const WriteParams& w : {p.key, p.value}) {
      EXPECT_EQ(w.rotation, fwht ? RotationKind::kHadamard : RotationKind::kIdentity) << name;
      EXPECT_EQ(w.fwht_block(), 64);
      EXPECT_FALSE(w.bitrev);
    }
    EXPECT_EQ(p.key.norm, norm) << name;
    EXPECT_FALSE(p.value.norm) << name;
    EXPECT_EQ(p.key.norm_heads, 1) << name;
  }
  SchemeOptions token = o;
  token.norm_scope = NormScope::kToken;
  token.tile = 64;
  const LayerScheme ots = BuildLayerScheme("ots", f.acts, nullptr, 0, token);
  EXPECT_EQ(ots.params.key.norm_heads, 2);
  EXPECT_EQ(ots.params.key.group, 64);
  EXPECT_EQ(ots.params.page_size, 64);
  testing::ExpectError([&] { SliceKvHead(ots, 1); }, ErrorCode::kUnsupported, "norm scope token");
  EXPECT_EQ(ParseNormScope("token"), NormScope::kToken);
  EXPECT_STREQ(NormScopeName(NormScope::kHead), "head");
  testing::ExpectError([] { ParseNormScope("layer"); }, ErrorCode::kInvalidArgument, "layer");

  for (const char* name : {"saw_int4", "saw_int4_k", "saw_hessian"}) {
    const LayerScheme ls = BuildLayerScheme(name, f.acts, &f.cal, 1, o);
    const CacheParams& p = ls.params;
    EXPECT_EQ(p.sink, 0) << name;
    EXPECT_EQ(p.recent, 0) << name;
    EXPECT_EQ(p.flush, 1) << name;
    for (const WriteParams& w : {p.key, p.value}) {
      EXPECT_EQ(w.format, Format::kAffineToken) << name;
      EXPECT_EQ(w.bits, 4) << name;
      EXPECT_EQ(w.group, 64) << name;  // G = d
      EXPECT_EQ(w.clip, 1.0f) << name;
    }
  }
  const LayerScheme saw = BuildLayerScheme("saw_int4", f.acts, nullptr, 0, o);
  EXPECT_EQ(saw.params.key.rotation, RotationKind::kHadamard);
  EXPECT_EQ(saw.params.value.rotation, RotationKind::kHadamard);
  EXPECT_EQ(saw.params.key.fwht_block(), 64);  // min(128, d)
  const LayerScheme k_only = BuildLayerScheme("saw_int4_k", f.acts, nullptr, 0, o);
  EXPECT_EQ(k_only.params.key.rotation, RotationKind::kHadamard);
  EXPECT_EQ(k_only.params.value.rotation, RotationKind::kIdentity);

  // saw_hessian: one dense R = H_bd*U' for every head and both sides, orthogonal, U' the
  // eigenbasis of the block-rotated, damped, layer-pooled C_Q (rebuilt from U diag(λ) U^T).
  SchemeOptions block = o;
  block.saw_block = 16;
  const LayerScheme hess = BuildLayerScheme("saw_hessian", f.acts, &f.cal, 1, block);
  ASSERT_EQ(hess.params.key.rotation, RotationKind::kDense);
  ASSERT_EQ(hess.key.rotation.size(), 2u * 64 * 64);
  EXPECT_TRUE(BitsEqual("rotation_v", hess.value.rotation, hess.key.rotation));
  const MatrixXd r = FromRowMajorF32(hess.key.rotation.data(), 64, 64);
  const MatrixXd r1 = FromRowMajorF32(hess.key.rotation.data() + 64 * 64, 64, 64);
  EXPECT_EQ(r, r1);
  EXPECT_LT((r.transpose() * r - MatrixXd::Identity(64, 64)).cwiseAbs().maxCoeff(), 1e-5);
  const LayerCalibration& lc = f.cal.layers[1];
  MatrixXd m = MatrixXd::Zero(64, 64);
  for (int h = 0; h < 2; ++h) {
    const MatrixXd u = FromRowMajorF32(lc.k_basis.data() + h * 64 * 64, 64, 64);
    VectorXd lambda(64);
    for (int i = 0; i < 64; ++i) lambda(i) = lc.k_eigenvalues[h * 64 + i];
    m += 0.5 * u * lambda.asDiagonal() * u.transpose();
  }
  MatrixXd hbd = MatrixXd::Zero(64, 64);
  for (int b = 0; b < 64; b += 16) hbd.block(b, b, 16, 16) = HadamardMatrix(16);
  // R^T (H M H) R... in the rotated frame: U'^T (H M H + damping) U' is diagonal, descending.
  const MatrixXd u_prime = hbd.transpose() * r;
  const MatrixXd target = hbd * m * hbd;
  const MatrixXd diag = u_prime.transpose() * target * u_prime;
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j) {
      if (i != j) {
        EXPECT_LT(std::fabs(diag(i, j)), 1e-4 * diag(0, 0)) << i << " " << j;
      }
    }
    if (i > 0) {
      EXPECT_LE(diag(i, i), diag(i - 1, i - 1) * (1 + 1e-6)) << i;
    }
  }
  testing::ExpectError([&] { BuildLayerScheme("saw_hessian", f.acts, nullptr, 1, o); },
                       ErrorCode::kInvalidArgument, "needs a calibration");
  Calibration raw = f.cal;
  raw.info.rotation = "raw_target";
  testing::ExpectError([&] { BuildLayerScheme("saw_hessian", f.acts, &raw, 1, o); },
                       ErrorCode::kInvalidArgument, "K^T K");
}

// BuildLayerScheme on a shape gives what it gives on a capture of that shape.
// K and V apart: --k-bits / --v-bits set the shared-width schemes' sides; the schemes with
// their own width (saw_int4: 4, fp8: 8) keep it.
TEST(Schemes, KeyAndValueWidthsApart) {
  SchemeShape shape;
  shape.num_kv_heads = 2;
  shape.num_q_heads = 4;
  shape.head_dim = 128;
  SchemeOptions o;
  o.k_bits = 4;
  o.v_bits = 2;
  for (const char* name : {"naive", "hadamard", "kivi", "ots"}) {
    const LayerScheme s = BuildLayerScheme(name, shape, nullptr, 0, o);
    EXPECT_EQ(s.params.key.bits, 4) << name;
    EXPECT_EQ(s.params.value.bits, 2) << name;
  }
  o.k_bits = 0;  // only V given: K takes --bits
  o.bits = 4;
  const LayerScheme k4v2 = BuildLayerScheme("naive", shape, nullptr, 0, o);
  EXPECT_EQ(k4v2.params.key.bits, 4);
  EXPECT_EQ(k4v2.params.value.bits, 2);
  // History bits: K 4 + 32/64, V 2 + 32/64, per element of K and V.
  EXPECT_EQ(k4v2.params.history_bits_per_element(), (4.5 + 2.5) / 2);
  for (const char* own : {"saw_int4", "fp8_unscaled"}) {
    const LayerScheme s = BuildLayerScheme(own, shape, nullptr, 0, o);
    EXPECT_EQ(s.params.key.bits, s.params.value.bits) << own;
    EXPECT_EQ(s.params.key.bits, SchemeByName(own).bits) << own;
  }
}

TEST(Schemes, ShapeAndActivationsOverloadsAgree) {
  const Fixture& f = Small();
  const SchemeShape shape = ShapeOf(f.acts.info);
  EXPECT_EQ(shape.num_layers, 2);
  EXPECT_EQ(shape.num_kv_heads, 2);
  EXPECT_EQ(shape.num_q_heads, 4);
  EXPECT_EQ(shape.head_dim, 64);
  for (const SchemeInfo& s : Schemes()) {
    const LayerScheme a = BuildLayerScheme(s.name, f.acts, &f.For(s.name), 1, SmallSchemeOptions());
    const LayerScheme b = BuildLayerScheme(s.name, shape, &f.For(s.name), 1, SmallSchemeOptions());
    EXPECT_TRUE(HeadsBitsEqual(a, b)) << s.name;
  }
  SchemeShape other = shape;
  other.num_kv_heads = 1;
  testing::ExpectError([&] { BuildLayerScheme("oscar", other, &f.cal, 0, SmallSchemeOptions()); },
                       ErrorCode::kShapeMismatch, "calibration has 2 layers x 2 KV heads");
}

// raw_target reads the calibration's raw-target rotations; a format_version 1 calibration
// lacks them, and the error says which tensor and why.
TEST(Schemes, RawTargetNamesTheMissingRotations) {
  Calibration old = Small().cal;
  for (LayerCalibration& l : old.layers) {
    l.raw_k_rotation.clear();
    l.raw_v_rotation.clear();
  }
  testing::ExpectError(
      [&] { BuildLayerScheme("raw_target", Small().acts, &old, 1, SmallSchemeOptions()); },
      ErrorCode::kInvalidArgument, "layers.1.raw_k_rotation");
  testing::ExpectError(
      [&] { BuildLayerScheme("raw_target", Small().acts, &old, 1, SmallSchemeOptions()); },
      ErrorCode::kInvalidArgument, "format_version 1");
  // Every other calibrated scheme is served by it.
  for (const SchemeInfo& s : Schemes()) {
    if (s.rotation_k == SchemeRotation::kRawTarget) continue;
    if (CalibrationScheme(s.name) != "oscar") continue;  // reads its own calibration's scales
    EXPECT_NO_THROW(BuildLayerScheme(s.name, Small().acts, &old, 1, SmallSchemeOptions()))
        << s.name;
  }
}

TEST(Schemes, SyntheticCalibrationIsSeeded) {
  SchemeShape shape;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.head_dim = 64;
  SchemeOptions o = SmallSchemeOptions();
  const Calibration a = SyntheticCalibration(shape, o, 128, 3);
  const Calibration b = SyntheticCalibration(shape, o, 128, 3, 1);
  const Calibration c = SyntheticCalibration(shape, o, 128, 4);
  EXPECT_EQ(a.info.num_layers, 1);
  EXPECT_EQ(a.info.group, 32);
  EXPECT_EQ(a.info.sink, 16);
  EXPECT_TRUE(a.HasRawTargetRotations());
  EXPECT_TRUE(BitsEqual("k_rotation", a.layers[0].key.rotation, b.layers[0].key.rotation));
  EXPECT_TRUE(BitsEqual("raw_v_rotation", a.layers[0].raw_v_rotation, b.layers[0].raw_v_rotation));
  EXPECT_FALSE(BitsEqual("k_rotation", a.layers[0].key.rotation, c.layers[0].key.rotation));
  o.sink = 64;  // = the calibration tokens: no clip rows
  EXPECT_THROW(SyntheticCalibration(shape, o, 128, 3), Error);
}

// spec 1.3 (numerics.md §9.1): TurboQuant-MSE's rows, K and V widths apart, the protected
// windows, and Block-GTQ's row (per-head key widths from the calibration).
TEST(Schemes, Spec13RowsHaveTheirDefiningParameters) {
  SchemeShape shape;
  shape.num_layers = 3;
  shape.num_kv_heads = 2;
  shape.num_q_heads = 4;
  shape.head_dim = 64;
  SchemeOptions o;
  o.k_bits = 3;
  o.v_bits = 2;
  o.seed = 5;
  for (const char* name : {"tq_mse", "tq_mse_fwht"}) {
    const bool fwht = std::string(name) == "tq_mse_fwht";
    const LayerScheme s = BuildLayerScheme(name, shape, nullptr, 2, o);
    EXPECT_EQ(s.params.sink, 0) << name;
    EXPECT_EQ(s.params.recent, 0) << name;
    EXPECT_EQ(s.params.key.bits, 3) << name;
    EXPECT_EQ(s.params.value.bits, 2) << name;
    for (int side = 0; side < 2; ++side) {
      const WriteParams& w = side == 0 ? s.params.key : s.params.value;
      EXPECT_EQ(w.format, Format::kCodebook) << name;
      EXPECT_EQ(w.group, 64) << name;
      EXPECT_EQ(w.clip, 1.0f) << name;
      EXPECT_EQ(w.segments, 1) << name;
      EXPECT_EQ(w.code_bytes, 0) << name;
      EXPECT_EQ(w.codebook, CodebookDensity::kBeta) << name;
      EXPECT_TRUE(s.heads(side).widths.empty()) << name;
      EXPECT_EQ(w.rotation, fwht ? RotationKind::kHadamard : RotationKind::kDense) << name;
      if (fwht) continue;
      // The Haar matrix of (layer, KV head, side), rounded once (§9.1).
      for (int h = 0; h < 2; ++h) {
        const std::vector<float> want = ToRowMajorF32(RandomOrthogonal(
            64, DeriveSeed(5, {2u, static_cast<uint64_t>(h), static_cast<uint64_t>(side)})));
        const std::vector<float> got(s.heads(side).rotation.begin() + h * 64 * 64,
                                     s.heads(side).rotation.begin() + (h + 1) * 64 * 64);
        EXPECT_TRUE(BitsEqual(std::string(name) + " rotation", got, want)) << side << h;
      }
    }
    // K3V2 at d = 64: 24 + 2 and 16 + 2 bytes a token and KV head over 64 + 64 values.
    EXPECT_EQ(s.params.history_bits_per_element(), 8.0 * (26 + 18) / 128) << name;
  }
  SchemeOptions protect = o;
  protect.protect = true;
  const LayerScheme p = BuildLayerScheme("tq_mse", shape, nullptr, 0, protect);
  EXPECT_EQ(p.params.sink, 4);
  EXPECT_EQ(p.params.recent, 128);
  EXPECT_EQ(p.params.flush, 1);

  // blockgtq is tq_mse's row with the calibration's rotations and key widths: K-only allocation,
  // V TurboQuant-MSE at b_v, buffer-free unless protected.
  const SchemeInfo& gtq = SchemeByName("blockgtq");
  const SchemeInfo& tq = SchemeByName("tq_mse");
  EXPECT_TRUE(gtq.needs_calibration);
  EXPECT_EQ(gtq.rotation_k, SchemeRotation::kCalibrated);
  EXPECT_EQ(gtq.rotation_v, SchemeRotation::kCalibrated);
  EXPECT_EQ(gtq.widths, WidthsPolicy::kCalibration);
  EXPECT_EQ(gtq.format_k, tq.format_k);
  EXPECT_EQ(gtq.format_v, tq.format_v);
  EXPECT_EQ(gtq.norm, tq.norm);
  EXPECT_EQ(gtq.bits, tq.bits);
  EXPECT_EQ(gtq.group, tq.group);
  EXPECT_EQ(gtq.windows.sink, 0);
  EXPECT_EQ(gtq.windows.recent, 0);
  EXPECT_EQ(gtq.windows.flush, 1);
  EXPECT_EQ(gtq.clip, ClipPolicy::kNone);
  EXPECT_EQ(gtq.scale, ScalePolicy::kNone);
  EXPECT_EQ(CalibrationScheme("blockgtq"), "blockgtq");
  // Over a calibration whose layers hold per-head widths of budget 2.5 and 3 bits.
  Calibration cal;
  cal.info.num_layers = 3;
  cal.info.num_kv_heads = 2;
  cal.info.head_dim = 64;
  cal.info.scheme = "blockgtq";
  cal.layers.resize(3);
  std::vector<float> eye(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) eye[i * 64 + i] = 1.0f;
  for (int l = 0; l < 3; ++l) {
    for (int side = 0; side < 2; ++side) {
      cal.layers[l].heads(side).rotation = eye;
      cal.layers[l].heads(side).rotation.insert(cal.layers[l].heads(side).rotation.end(),
                                                eye.begin(), eye.end());
    }
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 32; ++i) {
        // layer 0: 1..4 (4 segments, 20 code bytes, sum 80 = 2.5 * 32); layer 1: 3s (one
        // segment, 24 bytes); layer 2: 2 and 3 (16 blocks each: 8 + 12 = 20 bytes).
        const int w = l == 0 ? 1 + (i + h) % 4 : (l == 1 ? 3 : (i < 16 ? 2 : 3));
        cal.layers[l].key.widths.push_back(static_cast<uint8_t>(w));
      }
    }
  }
  const LayerScheme b = BuildLayerScheme(gtq, shape, &cal, 0, o);
  EXPECT_EQ(b.key.widths, cal.layers[0].key.widths);
  EXPECT_TRUE(b.value.widths.empty());
  EXPECT_EQ(b.params.key.segments, 4);     // the most over every (layer, KV head): layer 0's
  EXPECT_EQ(b.params.key.code_bytes, 24);  // layer 1's
  EXPECT_EQ(b.params.key.bits, 3);         // 2.5 rounded up
  EXPECT_EQ(b.params.value.bits, 2);       // b_v
  EXPECT_EQ(b.params.value.segments, 1);
  EXPECT_EQ(BuildLayerScheme(gtq, shape, &cal, 1, o).params.key.bits, 3);
  EXPECT_EQ(b.params.sink, 0);
  EXPECT_EQ(b.params.recent, 0);
  EXPECT_EQ(BuildLayerScheme("blockgtq", shape, &cal, 0, protect).params.sink, 4);
  EXPECT_EQ(BuildLayerScheme("blockgtq", shape, &cal, 0, protect).params.recent, 128);
  EXPECT_TRUE(CalibrationServes(cal, "oscar"));
  EXPECT_TRUE(CalibrationServes(cal, "blockgtq"));
  // The codebook sides are coded by the tables the file records (kvq calibrate --codebook):
  // beta by default, gaussian where the file says so, for tq_mse given the file too.
  EXPECT_EQ(b.params.key.codebook, CodebookDensity::kBeta);
  EXPECT_EQ(b.params.value.codebook, CodebookDensity::kBeta);
  EXPECT_EQ(BuildLayerScheme("tq_mse", shape, nullptr, 0, o).params.key.codebook,
            CodebookDensity::kBeta);
  Calibration gaussian = cal;
  gaussian.info.codebook.density = "gaussian";
  for (const char* name : {"blockgtq", "tq_mse", "tq_mse_fwht"}) {
    const LayerScheme g = BuildLayerScheme(name, shape, &gaussian, 0, o);
    EXPECT_EQ(g.params.key.codebook, CodebookDensity::kGaussian) << name;
    EXPECT_EQ(g.params.value.codebook, CodebookDensity::kGaussian) << name;
  }
  gaussian.info.codebook.density = "laplace";
  try {
    BuildLayerScheme(gtq, shape, &gaussian, 0, o);
    ADD_FAILURE() << "built with an unknown density";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("laplace"), std::string::npos) << e.what();
  }
  // Without widths the row names what it needs.
  Calibration bare = cal;
  for (LayerCalibration& l : bare.layers) l.key.widths.clear();
  try {
    BuildLayerScheme(gtq, shape, &bare, 1, o);
    ADD_FAILURE() << "built without widths";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("layers.1.k_bits"), std::string::npos) << e.what();
  }
  // Widths a head cannot hold under the side's limits are HeadData::Validate's error.
  cal.layers[0].key.widths[5] = 9;
  EXPECT_THROW(BuildLayerScheme(gtq, shape, &cal, 0, o), Error);
}

// Block-GTQ's cache rows are laid out as each KV head's own widths say: two heads of one layer
// with different allocations (head 0: 16 blocks of 2 bits and 16 of 3, two segments; head 1:
// 8 blocks each of 1..4 bits, four segments) store, token by token, the encoding of the row
// under that head's widths (cpu::EncodeRows with the head's arrays), not under the other's.
TEST(Schemes, BlockGtqRowsAreLaidOutByEachHeadsWidths) {
  constexpr int d = 64, hkv = 2, blocks = d / 2;
  constexpr size_t tokens = 12;
  SchemeShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = hkv;
  shape.num_q_heads = 4;
  shape.head_dim = d;
  Calibration cal;
  cal.info.num_layers = 1;
  cal.info.num_kv_heads = hkv;
  cal.info.head_dim = d;
  cal.info.scheme = "blockgtq";
  cal.layers.resize(1);
  LayerCalibration& layer = cal.layers[0];
  for (int side = 0; side < 2; ++side) {
    for (int h = 0; h < hkv; ++h) {
      const std::vector<float> r = ToRowMajorF32(RandomOrthogonal(d, 100 + 2 * h + side));
      layer.heads(side).rotation.insert(layer.heads(side).rotation.end(), r.begin(), r.end());
    }
  }
  for (int i = 0; i < blocks; ++i) layer.key.widths.push_back(i < 16 ? 2 : 3);
  for (int i = 0; i < blocks; ++i) layer.key.widths.push_back(static_cast<uint8_t>(1 + i % 4));
  SchemeOptions o;
  o.v_bits = 2;
  const LayerScheme s = BuildLayerScheme("blockgtq", shape, &cal, 0, o);
  EXPECT_EQ(s.params.key.segments, 4);
  EXPECT_EQ(s.params.key.code_bytes, 20);  // 8 + 12 bytes (head 0) = 2 + 4 + 6 + 8 (head 1)
  EXPECT_EQ(s.key.widths, layer.key.widths);

  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(tokens * hkv * d), v(k.size());
  for (float& x : k) x = F32FromBf16(Bf16FromF32(normal(rng)));
  for (float& x : v) x = F32FromBf16(Bf16FromF32(normal(rng)));
  cpu::PagedKVCache cache(s.params, s.key, s.value, cpu::ScalarBackend());
  const int seq = cache.AddSequence();
  cache.Prefill(seq, k.data(), v.data(), tokens);
  ASSERT_EQ(cache.HistoryLength(seq), tokens);  // buffer-free: every token is history
  const FormatLayout& plane_layout = cache.Layout(cpu::KV::kKey);
  ASSERT_EQ(plane_layout.num_planes, 2);
  ASSERT_STREQ(plane_layout.plane(0).name, "codes");
  ASSERT_STREQ(plane_layout.plane(1).name, "norm");

  for (int h = 0; h < hkv; ++h) {
    std::vector<float> rows(tokens * d);
    for (size_t t = 0; t < tokens; ++t) {
      std::copy_n(&k[(t * hkv + h) * d], d, &rows[t * d]);
    }
    auto encode = [&](int widths_of) {
      HeadArrays arrays;
      arrays.rotation = layer.key.rotation.data() + static_cast<size_t>(h) * d * d;
      arrays.widths = layer.key.widths.data() + static_cast<size_t>(widths_of) * blocks;
      return cpu::EncodeRows(cpu::ScalarBackend(), s.params.key, arrays, rows.data(), tokens);
    };
    const cpu::EncodedRows own = encode(h);
    const cpu::EncodedRows other = encode(1 - h);
    const CodebookLayout layout = CodebookLayoutOf(d, &layer.key.widths[h * blocks]);
    EXPECT_EQ(layout.count, h == 0 ? 2 : 4);
    bool differs_from_other = false;
    for (size_t t = 0; t < tokens; ++t) {
      const cpu::HistoryRunView got = cache.HistoryRow(seq, t, h, cpu::KV::kKey);
      for (int plane = 0; plane < 2; ++plane) {
        const size_t bytes = plane_layout.plane(plane).row_bytes();
        EXPECT_EQ(0, std::memcmp(got.plane[plane], &own.plane[plane][t * bytes], bytes))
            << "KV head " << h << " token " << t << " plane " << plane_layout.plane(plane).name;
        differs_from_other = differs_from_other ||
                             std::memcmp(got.plane[plane], &other.plane[plane][t * bytes], bytes);
      }
      // One corrected norm per segment of this head's layout, the slots after them 0.
      const uint16_t* norms = reinterpret_cast<const uint16_t*>(got.plane[1]);
      for (int slot = 0; slot < s.params.key.segments; ++slot) {
        EXPECT_EQ(norms[slot] != 0, slot < layout.count) << "KV head " << h << " slot " << slot;
      }
    }
    EXPECT_TRUE(differs_from_other) << "KV head " << h << " reads the same under both layouts";
  }
}

// kvq eval / kvq ppl serve blockgtq from an OSCAR calibration and its capture: the calibration
// CalibrationForScheme makes is the one `kvq calibrate --scheme blockgtq --k-bits K --v-bits V
// --seed S` makes of that capture (CalibrateCodebook with those options), K and V the widths the
// scheme's options give (SchemeOptions' default: K2V2, as tq_mse's). Without the capture it
// names the tensors it misses.
TEST(Schemes, BlockGtqCalibrationFromACaptureIsKvqCalibrates) {
  const Fixture& f = Small();
  EXPECT_FALSE(CalibrationServes(f.cal, "blockgtq"));
  for (const auto& [k_bits, v_bits, seed] :
       {std::tuple<int, int, uint64_t>{0, 0, 0}, {3, 2, 7}}) {
    SchemeOptions o = SmallSchemeOptions();
    o.k_bits = k_bits;
    o.v_bits = v_bits;
    o.seed = seed;
    const Calibration made =
        CalibrationForScheme("blockgtq", f.cal, &f.acts, cpu::ScalarBackend(), o);
    CodebookCalibrationOptions c;  // RunCodebookCalibrate's translation of the flags
    c.scheme = "blockgtq";
    c.k_avg_bits = k_bits != 0 ? k_bits : 2;
    c.v_bits = v_bits != 0 ? v_bits : 2;
    c.seed = seed;
    c.sink = f.cal.info.sink;
    c.recent = f.cal.info.recent;
    c.source = f.cal.info.source;
    const Calibration want = CalibrateCodebook(f.acts, c);
    EXPECT_EQ(made.info.scheme, "blockgtq");
    EXPECT_EQ(made.info.bits, want.info.bits);
    EXPECT_EQ(made.info.v_bits, want.info.v_bits);
    EXPECT_EQ(made.info.codebook.k_avg_bits, c.k_avg_bits);
    EXPECT_EQ(made.info.codebook.k_segments, want.info.codebook.k_segments);
    EXPECT_EQ(made.info.codebook.k_code_bytes, want.info.codebook.k_code_bytes);
    EXPECT_EQ(made.info.codebook.seed, seed);
    ASSERT_EQ(made.layers.size(), 2u);
    for (int l = 0; l < 2; ++l) {
      const LayerCalibration& a = made.layers[l];
      const LayerCalibration& b = want.layers[l];
      EXPECT_EQ(a.key.widths, b.key.widths) << "layer " << l;
      EXPECT_TRUE(BitsEqual("k_scores", a.k_scores, b.k_scores)) << "layer " << l;
      EXPECT_TRUE(BitsEqual("k_rotation", a.key.rotation, b.key.rotation)) << "layer " << l;
      EXPECT_TRUE(BitsEqual("v_rotation", a.value.rotation, b.value.rotation)) << "layer " << l;
      int sum = 0;
      for (uint8_t w : a.key.widths) sum += w;
      EXPECT_EQ(sum, 2 * 32 * static_cast<int>(c.k_avg_bits)) << "layer " << l;  // 2 heads
    }
    EXPECT_TRUE(CalibrationServes(made, "blockgtq"));
    // The scheme built on it reads its widths and V's width from the options.
    const LayerScheme built = BuildLayerScheme("blockgtq", f.acts, &made, 1, o);
    EXPECT_EQ(built.key.widths, want.layers[1].key.widths);
    EXPECT_EQ(built.params.key.bits, static_cast<int>(c.k_avg_bits));
    EXPECT_EQ(built.params.value.bits, c.v_bits);
  }
  // A calibration that serves it comes back as it is.
  const Calibration& own = f.For("blockgtq");
  const Calibration again =
      CalibrationForScheme("blockgtq", own, nullptr, cpu::ScalarBackend(), SmallSchemeOptions());
  EXPECT_EQ(again.layers[0].key.widths, own.layers[0].key.widths);
  // Without widths and without a capture: the missing tensors by name.
  testing::ExpectError(
      [&] {
        CalibrationForScheme("blockgtq", f.cal, nullptr, cpu::ScalarBackend(),
                             SmallSchemeOptions());
      },
      ErrorCode::kInvalidArgument, "layers.{l}.k_bits");
  testing::ExpectError(
      [&] { BuildLayerScheme("blockgtq", f.acts, &f.cal, 1, SmallSchemeOptions()); },
      ErrorCode::kInvalidArgument, "layers.1.k_bits");
  // A capture of another shape is refused.
  Activations other = f.acts;
  other.info.num_kv_heads = 1;
  testing::ExpectError(
      [&] {
        CalibrationForScheme("blockgtq", f.cal, &other, cpu::ScalarBackend(),
                             SmallSchemeOptions());
      },
      ErrorCode::kShapeMismatch, "calibration has 2 layers x 2 KV heads");
}

// The synthetic calibration of blockgtq (kvq bench, the benchmarks, the scheme vectors) is its
// codebook calibration of the synthetic capture, independent of the threads.
TEST(Schemes, SyntheticBlockGtqCalibration) {
  SchemeShape shape;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.head_dim = 64;
  SchemeOptions o = SmallSchemeOptions();
  o.k_bits = 3;
  const Calibration a = SyntheticCalibration(shape, o, 128, 3, 2, "blockgtq");
  const Calibration b = SyntheticCalibration(shape, o, 128, 3, 1, "blockgtq");
  EXPECT_EQ(a.info.scheme, "blockgtq");
  EXPECT_EQ(a.info.codebook.k_avg_bits, 3.0);
  EXPECT_EQ(a.info.v_bits, 2);
  ASSERT_EQ(a.layers[0].key.widths.size(), 32u);
  EXPECT_EQ(a.layers[0].key.widths, b.layers[0].key.widths);
  EXPECT_TRUE(BitsEqual("k_rotation", a.layers[0].key.rotation, b.layers[0].key.rotation));
  SyntheticCalibrations made(shape, o, 128, 3);
  EXPECT_EQ(made.For("blockgtq").layers[0].key.widths, a.layers[0].key.widths);
  EXPECT_NO_THROW(BuildLayerScheme("blockgtq", shape, &made.For("blockgtq"), 0, o));
}

TEST(Schemes, RandomOrthogonalIsSeededOrthogonalAndPerHead) {
  const Fixture& f = Small();
  SchemeOptions o = SmallSchemeOptions();
  const LayerScheme a = BuildLayerScheme("random_orthogonal", f.acts, &f.cal, 1, o);
  const LayerScheme b = BuildLayerScheme("random_orthogonal", f.acts, &f.cal, 1, o);
  EXPECT_TRUE(BitsEqual("rotation_k", a.key.rotation, b.key.rotation));
  o.seed = 1;
  const LayerScheme c = BuildLayerScheme("random_orthogonal", f.acts, &f.cal, 1, o);
  EXPECT_FALSE(BitsEqual("rotation_k", a.key.rotation, c.key.rotation));
  const int d = 64;
  const MatrixXd k0 = FromRowMajorF32(a.key.rotation.data(), d, d);
  const MatrixXd k1 = FromRowMajorF32(a.key.rotation.data() + d * d, d, d);
  const MatrixXd v0 = FromRowMajorF32(a.value.rotation.data(), d, d);
  EXPECT_LT((k0.transpose() * k0 - MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff(), 1e-5);
  EXPECT_GT((k0 - k1).cwiseAbs().maxCoeff(), 0.1);
  EXPECT_GT((k0 - v0).cwiseAbs().maxCoeff(), 0.1);
}

TEST(Schemes, SliceKvHeadKeepsOneHeadsData) {
  const Fixture& f = Small();
  const LayerScheme oscar = BuildLayerScheme("oscar", f.acts, &f.cal, 0, SmallSchemeOptions());
  const LayerScheme one = SliceKvHead(oscar, 1);
  EXPECT_EQ(one.params.num_kv_heads, 1);
  EXPECT_EQ(one.params.num_q_heads, 2);
  ASSERT_EQ(one.key.rotation.size(), 64u * 64);
  EXPECT_EQ(0, std::memcmp(one.key.rotation.data(), oscar.key.rotation.data() + 64 * 64,
                           64 * 64 * sizeof(float)));
  ASSERT_EQ(one.value.clip.size(), 1u);
  EXPECT_EQ(one.value.clip[0], oscar.value.clip[1]);
  EXPECT_THROW(SliceKvHead(oscar, 2), Error);
  const LayerScheme naive_one =
      SliceKvHead(BuildLayerScheme("naive", f.acts, nullptr, 0, SmallSchemeOptions()), 0);
  EXPECT_TRUE(naive_one.key.rotation.empty() && naive_one.key.clip.empty());
  // Every row is sliced: fp8's scales too.
  const LayerScheme fp8 =
      BuildLayerScheme("fp8", f.acts, &f.For("fp8"), 0, SmallSchemeOptions());
  const LayerScheme fp8_one = SliceKvHead(fp8, 1);
  ASSERT_EQ(fp8_one.key.scale.size(), 1u);
  ASSERT_EQ(fp8_one.value.scale.size(), 1u);
  EXPECT_EQ(fp8_one.key.scale[0], fp8.key.scale[1]);
  EXPECT_EQ(fp8_one.value.scale[0], fp8.value.scale[1]);
  // A row too short for the head is refused naming it.
  HeadData short_clip;
  short_clip.clip = {0.9f};
  testing::ExpectError([&] { short_clip.Slice(oscar.params.key, 1, "key"); },
                       ErrorCode::kShapeMismatch, "key clip ratios: 1 values, none for KV head 1");
}

}  // namespace
}  // namespace kvq::calib
