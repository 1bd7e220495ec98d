#include "kvq/calib/calibration_file.h"

#include <cmath>
#include <iterator>
#include <set>

#include "kvq/common/metadata.h"
#include "kvq/common/orthogonality.h"
#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"

namespace kvq::calib {
namespace {

constexpr const char* kMatrixTensors[] = {"k_rotation", "v_rotation", "k_basis", "v_basis"};
constexpr const char* kVectorTensors[] = {"k_eigenvalues", "v_eigenvalues"};
constexpr const char* kScalarTensors[] = {"k_clip", "v_clip"};
// Added by format_version 2: absent from version 1 files (and then from every layer).
constexpr const char* kRawTargetTensors[] = {"raw_k_rotation", "raw_v_rotation"};
// Added by format_version 3: the fp8 schemes' per-head scales.
constexpr const char* kScaleTensors[] = {"k_scale", "v_scale"};

std::vector<float>& Field(LayerCalibration& layer, const std::string& name) {
  if (name == "k_rotation") return layer.k_rotation;
  if (name == "v_rotation") return layer.v_rotation;
  if (name == "k_basis") return layer.k_basis;
  if (name == "v_basis") return layer.v_basis;
  if (name == "k_eigenvalues") return layer.k_eigenvalues;
  if (name == "v_eigenvalues") return layer.v_eigenvalues;
  if (name == "k_clip") return layer.k_clip;
  if (name == "raw_k_rotation") return layer.raw_k_rotation;
  if (name == "raw_v_rotation") return layer.raw_v_rotation;
  if (name == "k_scale") return layer.k_scale;
  if (name == "v_scale") return layer.v_scale;
  return layer.v_clip;
}

const std::vector<float>& Field(const LayerCalibration& layer, const std::string& name) {
  return Field(const_cast<LayerCalibration&>(layer), name);
}

std::string TensorName(int layer, const std::string& field) {
  return "layers." + std::to_string(layer) + "." + field;
}

std::vector<int64_t> FieldShape(const std::string& field, int hkv, int d) {
  for (const char* m : kMatrixTensors) {
    if (field == m) return {hkv, d, d};
  }
  for (const char* m : kRawTargetTensors) {
    if (field == m) return {hkv, d, d};
  }
  for (const char* v : kVectorTensors) {
    if (field == v) return {hkv, d};
  }
  return {hkv};
}

// The tensors of one layer in a file of format_version `version` (the raw-target rotations
// since version 2).
std::vector<std::string> FieldsOf(int64_t version) {
  std::vector<std::string> fields;
  for (const char* m : kMatrixTensors) fields.push_back(m);
  for (const char* v : kVectorTensors) fields.push_back(v);
  for (const char* s : kScalarTensors) fields.push_back(s);
  if (version >= 2) {
    for (const char* r : kRawTargetTensors) fields.push_back(r);
  }
  if (version >= 3) {
    for (const char* r : kScaleTensors) fields.push_back(r);
  }
  return fields;
}

// The version a calibration is written as: 3 with fp8 scales, 1 without the raw-target
// rotations, else 2.
int VersionOf(const Calibration& cal) {
  if (cal.HasScales()) return kCalibrationFormatVersionWithScales;
  return cal.HasRawTargetRotations() ? kCalibrationFormatVersion
                                     : kCalibrationFormatVersionWithoutRawTarget;
}

bool IsScaleScheme(const std::string& scheme) {
  return scheme == "fp8" || scheme == "fp8_hadamard";
}

size_t Product(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t e : shape) n *= static_cast<size_t>(e);
  return n;
}

}  // namespace

bool Calibration::HasScales() const {
  if (layers.empty()) return false;
  for (const LayerCalibration& layer : layers) {
    if (layer.k_scale.empty() || layer.v_scale.empty()) return false;
  }
  return true;
}

bool Calibration::HasRawTargetRotations() const {
  if (layers.empty()) return false;
  for (const LayerCalibration& layer : layers) {
    if (layer.raw_k_rotation.empty() || layer.raw_v_rotation.empty()) return false;
  }
  return true;
}

void ValidateCalibration(const Calibration& cal) {
  const CalibrationInfo& info = cal.info;
  KVQ_CHECK(info.num_layers >= 1, kInvalidArgument, "calibration: num_layers ", info.num_layers,
            " must be at least 1");
  KVQ_CHECK(info.num_kv_heads >= 1, kInvalidArgument, "calibration: num_kv_heads ",
            info.num_kv_heads, " must be at least 1");
  const params::Write widths = params::Write().head_dim(info.head_dim).group(info.group);
  params::Write(widths).bits(info.bits).Build();  // names an unsupported d, G or b
  if (info.v_bits != 0) {
    KVQ_CHECK(info.v_bits != info.bits, kInvalidArgument, "calibration: v_bits ", info.v_bits,
              " equals bits (0 means the same width)");
    params::Write(widths).bits(info.v_bits).Build();
  }
  KVQ_CHECK(info.sink >= 0, kInvalidArgument, "calibration: sink ", info.sink, " must be >= 0");
  KVQ_CHECK(info.recent >= 1, kInvalidArgument, "calibration: recent ", info.recent,
            " must be >= 1");
  KVQ_CHECK(info.scheme == "oscar" || IsScaleScheme(info.scheme), kInvalidArgument,
            "calibration: scheme '", info.scheme, "' is not supported (oscar, fp8, fp8_hadamard)");
  const bool scales = cal.HasScales();
  KVQ_CHECK(scales == IsScaleScheme(info.scheme), kInvalidArgument, "calibration: scheme '",
            info.scheme, "' ", scales ? "holds fp8 scales (only fp8 and fp8_hadamard do)"
                                      : "needs the fp8 scales k_scale / v_scale in every layer");
  KVQ_CHECK(!scales || cal.HasRawTargetRotations(), kInvalidArgument,
            "calibration: fp8 scales need the raw-target rotations too (format_version 3 holds "
            "every tensor of version 2)");
  KVQ_CHECK(!info.rotation.empty(), kInvalidArgument, "calibration: rotation recipe is empty");
  KVQ_CHECK(info.granularity == "kv_head" || info.granularity == "layer", kInvalidArgument,
            "calibration: granularity '", info.granularity, "' (kv_head or layer)");
  KVQ_CHECK(info.value_target == "attn_output" || info.value_target == "key_weighted" ||
                info.value_target == "raw",
            kInvalidArgument, "calibration: value_target '", info.value_target,
            "' (attn_output, key_weighted or raw)");
  KVQ_CHECK(static_cast<int>(cal.layers.size()) == info.num_layers, kShapeMismatch,
            "calibration: ", cal.layers.size(), " layers present, metadata says ",
            info.num_layers);
  const int d = info.head_dim;
  const int hkv = info.num_kv_heads;
  const bool raw_target = cal.HasRawTargetRotations();
  const std::vector<std::string> fields = FieldsOf(VersionOf(cal));
  for (int l = 0; l < info.num_layers; ++l) {
    const LayerCalibration& layer = cal.layers[l];
    if (!raw_target) {
      for (const char* field : kRawTargetTensors) {
        KVQ_CHECK(Field(layer, field).empty(), kShapeMismatch, "calibration layer ", l, " holds ",
                  field, " but another layer lacks the raw-target rotations (all layers or none)");
      }
    }
    if (!scales) {
      for (const char* field : kScaleTensors) {
        KVQ_CHECK(Field(layer, field).empty(), kShapeMismatch, "calibration layer ", l, " holds ",
                  field, " but another layer lacks the fp8 scales (all layers or none)");
      }
    }
    for (const std::string& field : fields) {
      const std::vector<float>& values = Field(layer, field);
      const size_t expected = Product(FieldShape(field, hkv, d));
      KVQ_CHECK(values.size() == expected, kShapeMismatch, "calibration layer ", l, " ", field,
                " holds ", values.size(), " values, expected ", expected);
      for (size_t i = 0; i < values.size(); ++i) {
        KVQ_CHECK(std::isfinite(values[i]), kNonFinite, "calibration layer ", l, " ", field,
                  " element ", i, " = ", values[i], " is not finite");
      }
    }
    std::vector<std::string> matrices(std::begin(kMatrixTensors), std::end(kMatrixTensors));
    if (raw_target) matrices.insert(matrices.end(), std::begin(kRawTargetTensors),
                                    std::end(kRawTargetTensors));
    for (int h = 0; h < hkv; ++h) {
      for (const std::string& field : matrices) {
        const float* m = Field(layer, field).data() + static_cast<size_t>(h) * d * d;
        const double deviation = OrthogonalityError(m, d);
        KVQ_CHECK(deviation <= kOrthogonalityTolerance, kInvalidArgument, "calibration layer ", l, " ", field,
                  " kv head ", h, " is not orthogonal: max |MᵀM − I| = ", deviation);
      }
      for (const char* field : kVectorTensors) {
        const float* e = Field(layer, field).data() + static_cast<size_t>(h) * d;
        for (int i = 1; i < d; ++i) {
          KVQ_CHECK(e[i] <= e[i - 1], kInvalidArgument, "calibration layer ", l, " ", field,
                    " kv head ", h, " is not descending at index ", i, ": ", e[i - 1], " then ",
                    e[i]);
        }
      }
      for (const char* field : kScalarTensors) {
        const float rho = Field(layer, field)[h];
        KVQ_CHECK(rho > 0 && rho <= 1, kInvalidArgument, "calibration layer ", l, " ", field,
                  " kv head ", h, " = ", rho, " is outside (0, 1]");
      }
      if (scales) {
        for (const char* field : kScaleTensors) {
          const float scale = Field(layer, field)[h];
          KVQ_CHECK(scale > 0, kInvalidArgument, "calibration layer ", l, " ", field,
                    " kv head ", h, " = ", scale, " is not > 0");
        }
      }
    }
    for (const std::string& field : fields) {
      const std::vector<float>& values = Field(layer, field);
      const size_t per_head = values.size() / hkv;
      // Clip ratios are chosen per layer, so they are equal across heads at any granularity;
      // everything else only for per-layer rotations.
      const bool shared = info.granularity == "layer" || field == "k_clip" || field == "v_clip";
      const bool own = field == "k_scale" || field == "v_scale";  // each head's own amax
      if (!shared || own) continue;
      for (int h = 1; h < hkv; ++h) {
        for (size_t i = 0; i < per_head; ++i) {
          KVQ_CHECK(values[h * per_head + i] == values[i], kInvalidArgument,
                    "calibration layer ", l, " ", field, " differs between kv head 0 and ", h,
                    " at element ", i, " (", values[i], " vs ", values[h * per_head + i],
                    ") but must be replicated");
        }
      }
    }
  }
}

Calibration CalibrationFromSafetensors(const Safetensors& file) {
  const MetadataReader meta(file.metadata, "calibration");
  KVQ_CHECK(meta.String("format") == kCalibrationFormat, kMalformedFile,
            "calibration: format is '", meta.String("format"), "', expected '",
            kCalibrationFormat, "'");
  const int64_t version = meta.Int("format_version");
  KVQ_CHECK(version >= kCalibrationFormatVersionWithoutRawTarget &&
                version <= kCalibrationFormatVersionWithScales,
            kMalformedFile, "calibration: format_version ", version, " is not supported (expected ",
            kCalibrationFormatVersionWithoutRawTarget, ", ", kCalibrationFormatVersion, " or ",
            kCalibrationFormatVersionWithScales, ")");
  Calibration cal;
  CalibrationInfo& info = cal.info;
  info.num_layers = static_cast<int>(meta.Int("num_layers", 1, 1 << 16));
  info.num_kv_heads = static_cast<int>(meta.Int("num_kv_heads", 1, 1 << 16));
  info.head_dim = static_cast<int>(meta.Int("head_dim", 1, 1 << 16));
  info.group = static_cast<int>(meta.Int("group", 1, 1 << 16));
  info.bits = static_cast<int>(meta.Int("bits", 1, 64));
  if (meta.Has("v_bits")) info.v_bits = static_cast<int>(meta.Int("v_bits", 1, 64));
  info.sink = static_cast<int>(meta.Int("sink", 0, 1 << 30));
  info.recent = static_cast<int>(meta.Int("recent", 1, 1 << 30));
  info.scheme = meta.String("scheme");
  info.rotation = meta.String("rotation");
  info.granularity = meta.String("granularity");
  info.value_target = meta.String("value_target");
  info.source = meta.String("source");

  const std::vector<std::string> fields = FieldsOf(version);
  std::set<std::string> expected;
  for (int l = 0; l < info.num_layers; ++l) {
    for (const std::string& field : fields) expected.insert(TensorName(l, field));
  }
  for (const auto& [name, tensor] : file.tensors) {
    KVQ_CHECK(expected.count(name) == 1, kMalformedFile, "calibration: unexpected tensor '",
              name, "' (num_layers = ", info.num_layers, ", format_version ", version, ")");
  }
  cal.layers.resize(info.num_layers);
  for (int l = 0; l < info.num_layers; ++l) {
    for (const std::string& field : fields) {
      const std::string name = TensorName(l, field);
      const Tensor* t = file.Find(name);
      KVQ_CHECK(t != nullptr, kMalformedFile, "calibration: tensor '", name, "' is missing");
      KVQ_CHECK(t->dtype == DType::kF32, kMalformedFile, "calibration: tensor '", name,
                "' has dtype ", DTypeName(t->dtype), ", expected F32");
      ExpectShape(*t, FieldShape(field, info.num_kv_heads, info.head_dim),
                  "calibration tensor '" + name + "'");
      Field(cal.layers[l], field) = t->ToF32();
    }
  }
  ValidateCalibration(cal);
  return cal;
}

Calibration ReadCalibration(const std::string& path) {
  return CalibrationFromSafetensors(ReadSafetensors(path));
}

Safetensors CalibrationToSafetensors(const Calibration& cal) {
  ValidateCalibration(cal);
  const CalibrationInfo& info = cal.info;
  Safetensors file;
  file.metadata["format"] = kCalibrationFormat;
  const int version = VersionOf(cal);
  file.metadata["format_version"] = std::to_string(version);
  file.metadata["num_layers"] = std::to_string(info.num_layers);
  file.metadata["num_kv_heads"] = std::to_string(info.num_kv_heads);
  file.metadata["head_dim"] = std::to_string(info.head_dim);
  file.metadata["group"] = std::to_string(info.group);
  file.metadata["bits"] = std::to_string(info.bits);
  if (info.v_bits != 0) file.metadata["v_bits"] = std::to_string(info.v_bits);
  file.metadata["sink"] = std::to_string(info.sink);
  file.metadata["recent"] = std::to_string(info.recent);
  file.metadata["scheme"] = info.scheme;
  file.metadata["rotation"] = info.rotation;
  file.metadata["granularity"] = info.granularity;
  file.metadata["value_target"] = info.value_target;
  file.metadata["source"] = info.source;
  for (int l = 0; l < info.num_layers; ++l) {
    for (const std::string& field : FieldsOf(version)) {
      file.Add(TensorName(l, field),
               Tensor::F32(FieldShape(field, info.num_kv_heads, info.head_dim),
                           Field(cal.layers[l], field)));
    }
  }
  return file;
}

void WriteCalibration(const std::string& path, const Calibration& cal) {
  WriteSafetensors(path, CalibrationToSafetensors(cal));
}

}  // namespace kvq::calib
