// Golden attention cases of the scheme catalogue (calib/schemes.inc): one case per scheme,
// attention/scheme_<id>, whose cache is what calib::BuildLayerScheme makes of that scheme on
// one small shape. Calibrated schemes read a calibration of synthetic activations made here
// (calib::SyntheticCalibration, seeded from the global seed). The cases are ordinary attention
// cases (CacheParams in the metadata, dense rotations in a fixture of their own, per-head clip
// ratios, per-head arrays such as blockgtq's key widths), so the attention replay runs them
// unchanged.
#include <string>
#include <vector>

#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "generator_internal.h"

namespace kvq::conformance::internal {
namespace {

// One KV head of d = 64 with g = 2 query heads: a dense case's two matrices are 32 KiB.
calib::SchemeShape CaseShape() {
  calib::SchemeShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.head_dim = 64;
  return shape;
}

// G = 32, INT2 (saw_int4: INT4 with an FWHT block of 32 < d), S0 = 4, W = 8, P = 16: the
// script below leaves 28 history tokens over two pages.
calib::SchemeOptions CaseOptions() {
  calib::SchemeOptions o;
  o.group = 32;
  o.bits = 2;
  o.sink = 4;
  o.recent = 8;
  o.page = 16;
  o.seed = 0;
  o.saw_block = 32;
  return o;
}

constexpr int64_t kCalibrationTokens = 256;  // synthetic tokens; the first half calibrate

}  // namespace

void AddSchemeAttentionCases(VectorCollector* out) {
  const calib::SchemeShape shape = CaseShape();
  const calib::SchemeOptions options = CaseOptions();
  const std::string calibration_name = "attention/scheme_calibration";
  const uint64_t calibration_seed = CaseSeed(out->seed(), calibration_name);
  // The OSCAR calibration every calibrated scheme reads, an fp8 scheme's own (the same
  // synthetic activations, with that scheme's scales) and blockgtq's (its codebook calibration
  // of those activations at the options' K2V2: per-head key widths, R_K, R_V).
  calib::SyntheticCalibrations calibrations(shape, options, kCalibrationTokens, calibration_seed);
  for (const calib::SchemeInfo& info : calib::Schemes()) {
    const std::string kind = calib::CalibrationScheme(info.name);
    const calib::LayerScheme s = calib::BuildLayerScheme(
        info.name, shape, info.needs_calibration ? &calibrations.For(info.name) : nullptr, 0,
        options);
    CacheConfig c;
    c.name = std::string("scheme_") + info.name;
    c.params = s.params;
    // A scheme flushing more than the script's 40 tokens could reach (KIVI's F = 128) flushes
    // a tile at a time here, so the case has history.
    std::string overrides;
    if (c.params.flush > 32) {
      c.params.flush = c.params.key.tile_tokens();
      overrides = " F=" + std::to_string(c.params.flush) + " (the scheme's own F is " +
                  std::to_string(s.params.flush) + ")";
    }
    c.key = s.key;
    c.value = s.value;
    c.key.rotation.clear();  // dense rotations travel in the fixture below
    c.value.rotation.clear();
    const bool dense_k = s.params.key.rotation == RotationKind::kDense;
    const bool dense_v = s.params.value.rotation == RotationKind::kDense;
    if (s.params.quantized() && (dense_k || dense_v)) {
      // The fixture holds R_K for every KV head, then R_V.
      std::vector<float> matrices = s.key.rotation;
      matrices.insert(matrices.end(), s.value.rotation.begin(), s.value.rotation.end());
      c.rotation_fixture = out->AddRotationFixture(
          c.name, std::string("scheme ") + info.name +
                      ": R_K per KV head, then R_V (calib::BuildLayerScheme), row-major",
          shape.head_dim, matrices);
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        c.rotation_k.push_back(h);
        c.rotation_v.push_back(shape.num_kv_heads + h);
      }
    }
    c.script = [](Script* script) {
      const int a = script->Add();
      script->Prefill(a, 36);
      for (int i = 0; i < 4; ++i) script->Append(a);  // demotions into the second page
    };
    c.metadata["scheme"] = info.name;
    c.metadata["scheme_description"] = info.description;
    c.metadata["scheme_options"] =
        "G=" + std::to_string(options.group) + " b=" + std::to_string(options.bits) +
        " S0=" + std::to_string(options.sink) + " W=" + std::to_string(options.recent) +
        " P=" + std::to_string(options.page) + " seed=" + std::to_string(options.seed) +
        " saw_block=" + std::to_string(options.saw_block) + overrides;
    if (info.needs_calibration) {
      c.metadata["scheme_calibration"] =
          "calib::SyntheticCalibration(Hkv=1, Hq=2, d=64, " + std::to_string(kCalibrationTokens) +
          " tokens, seed " + std::to_string(calibration_seed) +
          (kind == "oscar" ? std::string(")") : ", scheme " + kind + ")");
    }
    AddAttentionCase(out, c);
  }
}

}  // namespace kvq::conformance::internal
