#include "kvq/calib/calibration_file.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <set>
#include <type_traits>
#include <utility>

#include "kvq/common/codebook.h"
#include "kvq/common/lloyd_max.h"
#include "kvq/common/metadata.h"
#include "kvq/common/orthogonality.h"
#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"

namespace kvq::calib {
namespace {

// What must be equal across the KV heads of a layer.
enum class Replicated {
  kNever,           // each head's own (the fp8 scales: each head's amax)
  kWhenLayerWide,   // only at granularity "layer" (rotations, bases, eigenvalues)
  kAlways,          // chosen per layer, so equal at any granularity (the clip ratios)
};

// What each KV head's block must be beyond its values' own rules.
enum class HeadCheck {
  kNone,
  kOrthogonal,  // [d, d]: max |MᵀM − I| ≤ kOrthogonalityTolerance in fp64
  kDescending,  // [d]: non-increasing
};

// One KV head's block as the file shapes it (the tensor is [Hkv, ...these]), from the side's
// write parameters.
std::vector<int64_t> OneValue(const WriteParams&) { return {}; }
std::vector<int64_t> Vector(const WriteParams& p) { return {p.head_dim}; }
std::vector<int64_t> Matrix(const WriteParams& p) { return {p.head_dim, p.head_dim}; }

// Whether a calibration's file holds a tensor: by the cumulative versions (the schemes of
// versions 1 to 3), or exactly when its scheme and side say so.
enum class Holding {
  kByVersion,  // held when the file's version is at least the pair's `since`
  kHeld,       // held (whatever the version)
  kAbsent,     // not held
};

// How the file stores a K / V pair of tensors (layers.{l}.<K name> and <V name>).
struct FileRule {
  const char* row;  // the head_data.inc row or artifact it stores
  int since;        // the format_version that added the pair
  // Whether a calibration may lack the pair (then in every layer). A calibration is written as
  // the highest `since` of the optional pairs it holds and must hold every pair up to that
  // version: the versions are cumulative (spec/formats.md §5), except for a pair whose
  // `holding` keys it to the scheme.
  bool optional;
  Replicated replicated;
  HeadCheck check;
  // One KV head's block's shape: OneValue, Vector, Matrix or a captureless lambda.
  std::vector<int64_t> (*head_dims)(const WriteParams& p);
  // A head_data.inc row's tensor stem (tensors k_<stem>, v_<stem>; nullptr: the row's name).
  const char* stem = nullptr;
  // Whether a calibration of `scheme` holds side `side`'s tensor (nullptr: kByVersion).
  Holding (*holding)(const std::string& scheme, int side) = nullptr;
};

// The pairs of the fitted calibrations (versions 1 to 3), which a codebook calibration lacks.
Holding FittedOnly(const std::string& scheme, int) {
  return IsCodebookScheme(scheme) ? Holding::kAbsent : Holding::kByVersion;
}
// Block-GTQ's key widths and energies: the K side of a calibration that allocates widths.
Holding AllocatedKeys(const std::string& scheme, int side) {
  return AllocatesWidths(scheme) && side == 0 ? Holding::kHeld : Holding::kAbsent;
}

// How the file stores each row of head_data.inc: tensors layers.{l}.k_<row> / v_<row> of the
// row's element type (F32 for float: FileType), one line per row. A row that lacks its line
// is a compile error (the static_asserts below).
constexpr FileRule kHeadRowTensors[] = {
    // row, since format_version, optional, replicated, per-head check, per-head shape
    {"rotation", kCalibrationFormatVersionWithoutRawTarget, false, Replicated::kWhenLayerWide,
     HeadCheck::kOrthogonal, Matrix},
    {"clip", kCalibrationFormatVersionWithoutRawTarget, false, Replicated::kAlways,
     HeadCheck::kNone, OneValue, nullptr, FittedOnly},
    {"scale", kCalibrationFormatVersionWithScales, true, Replicated::kNever, HeadCheck::kNone,
     OneValue, nullptr, FittedOnly},
    // The contract's name: layers.{l}.k_bits (a V side without widths codes every block at b).
    {"widths", kCalibrationFormatVersionWithWidths, true, Replicated::kWhenLayerWide,
     HeadCheck::kNone, [](const WriteParams& p) { return std::vector<int64_t>{p.head_dim / 2}; },
     "bits", AllocatedKeys},
};

// The calibration-only artifacts (not per-head scheme data), named fields of LayerCalibration.
struct Artifact {
  FileRule rule;
  const char* names[2];                                 // K, V tensor names (nullptr: none)
  std::vector<float> LayerCalibration::*fields[2];      // K, V
  const char* what;                                     // in messages
};

const Artifact kArtifacts[] = {
    {{"basis", kCalibrationFormatVersionWithoutRawTarget, false, Replicated::kWhenLayerWide,
      HeadCheck::kOrthogonal, Matrix, nullptr, FittedOnly},
     {"k_basis", "v_basis"},
     {&LayerCalibration::k_basis, &LayerCalibration::v_basis},
     "eigenbases"},
    {{"eigenvalues", kCalibrationFormatVersionWithoutRawTarget, false,
      Replicated::kWhenLayerWide, HeadCheck::kDescending, Vector, nullptr, FittedOnly},
     {"k_eigenvalues", "v_eigenvalues"},
     {&LayerCalibration::k_eigenvalues, &LayerCalibration::v_eigenvalues},
     "eigenvalues"},
    {{"raw_rotation", kCalibrationFormatVersion, true, Replicated::kWhenLayerWide,
      HeadCheck::kOrthogonal, Matrix, nullptr, FittedOnly},
     {"raw_k_rotation", "raw_v_rotation"},
     {&LayerCalibration::raw_k_rotation, &LayerCalibration::raw_v_rotation},
     "raw-target rotations"},
    // Block-GTQ's key energies s_i (numerics.md §9.1), fp32 roundings of the fp64 values.
    {{"scores", kCalibrationFormatVersionCodebook, true, Replicated::kWhenLayerWide,
      HeadCheck::kNone, [](const WriteParams& p) { return std::vector<int64_t>{p.head_dim / 2}; },
      nullptr, AllocatedKeys},
     {"k_scores", nullptr},
     {&LayerCalibration::k_scores, nullptr},
     "block energies"},
};

constexpr bool SameName(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || SameName(a + 1, b + 1));
}

constexpr int HeadRowIndex(const char* row) {
  for (size_t i = 0; i < std::size(kHeadRowTensors); ++i) {
    if (SameName(kHeadRowTensors[i].row, row)) return static_cast<int>(i);
  }
  return -1;
}

#define KVQ_HEAD_ARRAY(name, ...)                                                           \
  static_assert(HeadRowIndex(#name) >= 0, "head_data.inc row '" #name                        \
                "' has no line in kHeadRowTensors (how the calibration file stores it)");
#define KVQ_HEAD_SCALAR(name, ...) KVQ_HEAD_ARRAY(name)
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_ARRAY(...) +1
#define KVQ_HEAD_SCALAR(...) +1
static_assert(std::size(kHeadRowTensors) == 0
#include "kvq/common/head_data.inc"
              , "kHeadRowTensors has a line for a row head_data.inc does not have");
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY

// The file's dtype of a row's element type, and the tensor holding a row's values (another
// element type is one more specialization).
template <typename T>
struct FileType;
template <>
struct FileType<float> {
  static constexpr DType kDType = DType::kF32;
  static Tensor Make(std::vector<int64_t> shape, const std::vector<float>& v) {
    return Tensor::F32(std::move(shape), v);
  }
};
template <>
struct FileType<uint8_t> {
  static constexpr DType kDType = DType::kU8;
  static Tensor Make(std::vector<int64_t> shape, const std::vector<uint8_t>& v) {
    return Tensor::U8(std::move(shape), v);
  }
};

// The write parameters a side of the calibration was made for (its d, G and b, dense R):
// what head_data.inc's message parts and rules are expressions of.
WriteParams SideParams(const CalibrationInfo& info, int side) {
  const int bits = side == 1 && info.v_bits != 0 ? info.v_bits : info.bits;
  params::Write p = params::Write()
                        .head_dim(info.head_dim)
                        .group(info.group)
                        .bits(bits)
                        .rotation(RotationKind::kDense);
  if (IsCodebookScheme(info.scheme)) {
    const CodebookCalibrationInfo& cb = info.codebook;
    CodebookDensity density = CodebookDensity::kBeta;
    if (info.codebook.density == "gaussian") density = CodebookDensity::kGaussian;
    p.format(Format::kCodebook)
        .codebook(density)
        .segments(side == 0 ? cb.k_segments : cb.v_segments)
        .code_bytes(side == 0 ? cb.k_code_bytes : cb.v_code_bytes);
  }
  return p.Unchecked();
}

// One tensor of a layer as the file stores it.
struct FileTensor {
  const FileRule& rule;        // its pair's rule
  int side;                    // 0: K, 1: V
  const char* what;            // what its pair is called in messages (plural)
  std::string id;              // its name in layer l (layers.{l}.<id>): k_<row> / v_<row>, or
                               // the artifact's name
  std::vector<int64_t> shape;  // [Hkv, ...rule.head_dims]
};

// Calls visit(tensor, values, check_value) for each tensor of `layer` (a LayerCalibration,
// const or not): both sides of every head_data.inc row (what: the row's noun, plural), then of
// every artifact. values is the side's std::vector<T>; check_value(l, h, i, v) throws
// kvq::Error when value `i` of KV head `h` breaks the row's own rule (head_data.inc's `valid`;
// artifacts have none).
template <typename Layer, typename Visit>
void ForEachTensor(Layer& layer, const CalibrationInfo& info, Visit&& visit) {
  auto shape = [&](const FileRule& rule, int side) {
    std::vector<int64_t> dims = rule.head_dims(SideParams(info, side));
    dims.insert(dims.begin(), info.num_kv_heads);
    return dims;
  };
  for (int side = 0; side < 2; ++side) {
    auto& heads = layer.heads(side);
    const WriteParams p = SideParams(info, side);  // what a row's message parts may name
    const std::string prefix = side == 0 ? "k_" : "v_";
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...)                     \
  {                                                                                                \
    const FileRule& row_rule = kHeadRowTensors[HeadRowIndex(#name)];                               \
    const FileTensor tensor{row_rule, side, noun "s",                                              \
                            prefix + (row_rule.stem ? row_rule.stem : #name),                      \
                            shape(row_rule, side)};                                                \
    visit(tensor, heads.name, [&](int l, size_t h, size_t i, Type v) {                             \
      KVQ_CHECK(valid, code, "calibration layer ", l, " ", tensor.id, " kv head ", h,              \
                " has ", +v, " at ", __VA_ARGS__);                                                 \
    });                                                                                            \
  }
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                            \
  {                                                                                                \
    const FileRule& row_rule = kHeadRowTensors[HeadRowIndex(#name)];                               \
    const FileTensor tensor{row_rule, side, noun "s",                                              \
                            prefix + (row_rule.stem ? row_rule.stem : #name),                      \
                            shape(row_rule, side)};                                                \
    visit(tensor, heads.name, [&](int l, size_t h, size_t, float v) {                              \
      KVQ_CHECK(valid, kInvalidArgument, "calibration layer ", l, " ", tensor.id,                  \
                " kv head ", h, " = ", v, " is not " rule);                                        \
    });                                                                                            \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
    (void)p;  // a row whose message parts do not name a position leaves it unread
  }
  for (const Artifact& a : kArtifacts) {
    for (int side = 0; side < 2; ++side) {
      if (a.names[side] == nullptr) continue;
      const FileTensor tensor{a.rule, side, a.what, a.names[side], shape(a.rule, side)};
      visit(tensor, layer.*(a.fields[side]), [](int, size_t, size_t, float) {});
    }
  }
}

// Every pair's rule and what it is called, in ForEachTensor's order.
std::vector<std::pair<FileRule, std::string>> Pairs(const CalibrationInfo& info) {
  std::vector<std::pair<FileRule, std::string>> pairs;
  const LayerCalibration none;
  ForEachTensor(none, info, [&](const FileTensor& tensor, const auto&, const auto&) {
    for (const auto& pair : pairs) {
      if (SameName(pair.first.row, tensor.rule.row)) return;
    }
    pairs.push_back({tensor.rule, tensor.what});
  });
  return pairs;
}

// Whether every layer holds both tensors of the pair (false without layers).
bool Holds(const Calibration& cal, const FileRule& pair) {
  if (cal.layers.empty()) return false;
  bool held = true;
  for (const LayerCalibration& layer : cal.layers) {
    ForEachTensor(layer, cal.info, [&](const FileTensor& tensor, const auto& values, const auto&) {
      if (SameName(tensor.rule.row, pair.row)) held = held && !values.empty();
    });
  }
  return held;
}

Holding HoldingOf(const FileRule& rule, const std::string& scheme, int side) {
  return rule.holding ? rule.holding(scheme, side) : Holding::kByVersion;
}

std::string TensorName(int layer, const std::string& tensor) {
  return "layers." + std::to_string(layer) + "." + tensor;
}

// The version a calibration is written as: 4 for a codebook calibration, else the highest
// `since` of the optional cumulative pairs it holds (3 with fp8 scales, 2 with the raw-target
// rotations, else 1).
int VersionOf(const Calibration& cal) {
  if (IsCodebookScheme(cal.info.scheme)) return kCalibrationFormatVersionCodebook;
  int version = kCalibrationFormatVersionWithoutRawTarget;
  for (const auto& pair : Pairs(cal.info)) {
    const FileRule& rule = pair.first;
    const bool cumulative = HoldingOf(rule, cal.info.scheme, 0) == Holding::kByVersion;
    if (rule.optional && cumulative && Holds(cal, rule)) version = std::max(version, rule.since);
  }
  return version;
}

// Whether a file of `version` for `info` stores side `side`'s tensor of the pair of `rule`.
bool InFile(const FileRule& rule, int side, const CalibrationInfo& info, int version) {
  switch (HoldingOf(rule, info.scheme, side)) {
    case Holding::kByVersion: return rule.since <= version;
    case Holding::kHeld: return true;
    case Holding::kAbsent: return false;
  }
  return false;
}

// The newest format_version this reader knows: the highest `since` of any pair.
int NewestVersion() {
  int newest = kCalibrationFormatVersionCodebook;
  for (const auto& pair : Pairs(CalibrationInfo())) newest = std::max(newest, pair.first.since);
  return newest;
}

// The codebook calibration's own rules (numerics.md §9.1, formats.md §5), after the shapes:
// its fixed metadata, its row limits as codebook write parameters, and every head's widths
// spending the budget and fitting the limits.
void ValidateCodebookCalibration(const Calibration& cal) {
  const CalibrationInfo& info = cal.info;
  const CodebookCalibrationInfo& cb = info.codebook;
  KVQ_CHECK(info.scheme != "tq_mse_fwht", kInvalidArgument,
            "calibration: scheme 'tq_mse_fwht' has no calibration (its rotation is the FWHT, "
            "its rows uniform)");
  KVQ_CHECK(info.group == info.head_dim, kInvalidArgument, "calibration: group ", info.group,
            " of a codebook calibration must be head_dim ", info.head_dim,
            " (a codebook row is one group)");
  KVQ_CHECK(info.granularity == "kv_head", kInvalidArgument, "calibration: granularity '",
            info.granularity, "' of a codebook calibration must be kv_head (a Haar rotation "
            "per KV head)");
  KVQ_CHECK(info.rotation.empty() && info.value_target.empty(), kInvalidArgument,
            "calibration: a codebook calibration fits nothing, but has rotation recipe '",
            info.rotation, "' and value target '", info.value_target, "' (both empty)");
  KVQ_CHECK(cb.density == "beta" || cb.density == "gaussian", kInvalidArgument,
            "calibration: codebook '", cb.density, "' (beta or gaussian)");
  for (int side = 0; side < 2; ++side) {
    const WriteParams p = SideParams(info, side);
    try {
      p.Validate();
    } catch (const Error& e) {
      throw Error(e.code(), std::string("calibration: ") + (side == 0 ? "key" : "value") +
                                " row limits: " + e.what());
    }
  }
  const bool allocates = AllocatesWidths(info.scheme);
  if (!allocates) {
    KVQ_CHECK(cb.k_segments == 1 && cb.k_code_bytes == 0, kInvalidArgument,
              "calibration: scheme '", info.scheme, "' has uniform keys, but k_segments ",
              cb.k_segments, " and k_code_bytes ", cb.k_code_bytes, " (1 and 0)");
  }
  KVQ_CHECK(cb.v_segments == 1 && cb.v_code_bytes == 0, kInvalidArgument,
            "calibration: values are uniform rows, but v_segments ", cb.v_segments,
            " and v_code_bytes ", cb.v_code_bytes, " (1 and 0)");
  if (!allocates) {
    KVQ_CHECK(cb.k_avg_bits == 0 && cb.rotation_threshold == 1, kInvalidArgument,
              "calibration: scheme '", info.scheme, "' allocates no widths, but k_avg_bits ",
              cb.k_avg_bits, " and rotation_threshold ", cb.rotation_threshold,
              " (blockgtq only)");
    return;
  }
  KVQ_CHECK(std::isfinite(cb.k_avg_bits) && cb.k_avg_bits >= 1 &&
                cb.k_avg_bits <= kCodebookMaxWidth,
            kInvalidArgument, "calibration: k_avg_bits ", cb.k_avg_bits, " is not in [1, 8]");
  KVQ_CHECK(info.bits == static_cast<int>(std::ceil(cb.k_avg_bits)), kInvalidArgument,
            "calibration: bits ", info.bits, " must be k_avg_bits ", cb.k_avg_bits,
            " rounded up");
  KVQ_CHECK(cb.rotation_threshold >= 1 && cb.rotation_threshold <= kCodebookMaxWidth + 1,
            kInvalidArgument, "calibration: rotation_threshold ", cb.rotation_threshold,
            " is not in 1..9");
  const int blocks = info.head_dim / 2;
  const int64_t budget =
      static_cast<int64_t>(std::floor(static_cast<double>(blocks) * cb.k_avg_bits));
  const WriteParams keys = SideParams(info, 0);
  for (int l = 0; l < info.num_layers; ++l) {
    const LayerCalibration& layer = cal.layers[l];
    for (int h = 0; h < info.num_kv_heads; ++h) {
      const uint8_t* widths = layer.key.widths.data() + static_cast<size_t>(h) * blocks;
      int64_t sum = 0;
      for (int i = 0; i < blocks; ++i) sum += widths[i];
      KVQ_CHECK(sum == budget, kInvalidArgument, "calibration layer ", l, " k_bits kv head ", h,
                " sums to ", sum, ", not the budget floor(", blocks, " * ", cb.k_avg_bits,
                ") = ", budget);
      const CodebookLayout layout = CodebookLayoutOf(info.head_dim, widths);
      KVQ_CHECK(layout.count <= keys.segments, kInvalidArgument, "calibration layer ", l,
                " k_bits kv head ", h, " lay a row out in ", layout.count,
                " segments, more than k_segments ", keys.segments);
      KVQ_CHECK(layout.code_bytes <= keys.row_code_bytes(), kInvalidArgument,
                "calibration layer ", l, " k_bits kv head ", h, " lay a row out in ",
                layout.code_bytes, " code bytes, more than k_code_bytes ", keys.code_bytes);
      for (int i = 0; i < blocks; ++i) {
        const float s = layer.k_scores[static_cast<size_t>(h) * blocks + i];
        KVQ_CHECK(s >= 0.0f, kInvalidArgument, "calibration layer ", l, " k_scores kv head ",
                  h, " has ", s, " at block ", i, " (energies are >= 0)");
      }
    }
  }
}

bool IsScaleScheme(const std::string& scheme) {
  return scheme == "fp8" || scheme == "fp8_hadamard";
}

size_t Product(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t e : shape) n *= static_cast<size_t>(e);
  return n;
}

// The per-head checks of one tensor of layer `l` (its size and finiteness already checked):
// the pair's HeadCheck, the row's own rule for every value, and the replication the pair and
// the granularity call for.
template <typename T, typename CheckValue>
void CheckHeads(const FileTensor& tensor, int l, const std::vector<T>& values,
                const CalibrationInfo& info, const CheckValue& check_value) {
  const FileRule& rule = tensor.rule;
  const int hkv = info.num_kv_heads;
  const size_t per_head = values.size() / static_cast<size_t>(hkv);
  for (int h = 0; h < hkv; ++h) {
    const T* head = values.data() + static_cast<size_t>(h) * per_head;
    switch (rule.check) {
      case HeadCheck::kNone: break;
      case HeadCheck::kOrthogonal:
        if constexpr (std::is_same_v<T, float>) {
          const int n = static_cast<int>(tensor.shape.back());  // each head's block is [n, n]
          const double deviation = OrthogonalityError(head, n);
          KVQ_CHECK(deviation <= kOrthogonalityTolerance, kInvalidArgument, "calibration layer ",
                    l, " ", tensor.id, " kv head ", h, " is not orthogonal: max |MᵀM − I| = ",
                    deviation);
        } else {
          KVQ_CHECK(false, kUnsupported, "calibration ", tensor.id,
                    ": orthogonality is checked on fp32 matrices only");
        }
        break;
      case HeadCheck::kDescending:
        for (size_t i = 1; i < per_head; ++i) {
          KVQ_CHECK(head[i] <= head[i - 1], kInvalidArgument, "calibration layer ", l, " ",
                    tensor.id, " kv head ", h, " is not descending at index ", i, ": ",
                    +head[i - 1], " then ", +head[i]);
        }
        break;
    }
    for (size_t i = 0; i < per_head; ++i) check_value(l, static_cast<size_t>(h), i, head[i]);
  }
  const bool replicated = rule.replicated == Replicated::kAlways ||
                          (rule.replicated == Replicated::kWhenLayerWide &&
                           info.granularity == "layer");
  if (!replicated) return;
  for (int h = 1; h < hkv; ++h) {
    for (size_t i = 0; i < per_head; ++i) {
      KVQ_CHECK(values[h * per_head + i] == values[i], kInvalidArgument, "calibration layer ", l,
                " ", tensor.id, " differs between kv head 0 and ", h, " at element ", i, " (",
                +values[i], " vs ", +values[h * per_head + i], ") but must be replicated");
    }
  }
}

}  // namespace

bool IsCodebookScheme(const std::string& scheme) {
  return scheme == "tq_mse" || scheme == "tq_mse_fwht" || scheme == "blockgtq";
}

bool AllocatesWidths(const std::string& scheme) { return scheme == "blockgtq"; }

bool Calibration::HasScales() const {
  if (layers.empty()) return false;
  for (const LayerCalibration& layer : layers) {
    if (layer.key.scale.empty() || layer.value.scale.empty()) return false;
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
  const bool codebook = IsCodebookScheme(info.scheme);
  KVQ_CHECK(info.v_bits == 0 || info.v_bits != info.bits, kInvalidArgument, "calibration: v_bits ",
            info.v_bits, " equals bits (0 means the same width)");
  if (!codebook) {  // a codebook calibration's parameters: ValidateCodebookCalibration
    const params::Write widths = params::Write().head_dim(info.head_dim).group(info.group);
    params::Write(widths).bits(info.bits).Build();  // names an unsupported d, G or b
    if (info.v_bits != 0) params::Write(widths).bits(info.v_bits).Build();
  }
  KVQ_CHECK(info.sink >= 0, kInvalidArgument, "calibration: sink ", info.sink, " must be >= 0");
  KVQ_CHECK(info.recent >= 1, kInvalidArgument, "calibration: recent ", info.recent,
            " must be >= 1");
  KVQ_CHECK(info.scheme == "oscar" || IsScaleScheme(info.scheme) ||
                (codebook && info.scheme != "tq_mse_fwht"),
            kInvalidArgument, "calibration: scheme '", info.scheme,
            "' is not supported (oscar, fp8, fp8_hadamard, tq_mse, blockgtq)");
  const bool scales = cal.HasScales();
  KVQ_CHECK(scales == IsScaleScheme(info.scheme), kInvalidArgument, "calibration: scheme '",
            info.scheme, "' ", scales ? "holds fp8 scales (only fp8 and fp8_hadamard do)"
                                      : "needs the fp8 scales k_scale / v_scale in every layer");
  // The versions are cumulative: a calibration of version v holds every optional pair up to
  // v (a required pair missing from a layer is named by the size check below).
  const int version = VersionOf(cal);
  const std::vector<std::pair<FileRule, std::string>> pairs = Pairs(info);
  std::string newest;  // what the pair that sets the version is called
  for (const auto& [rule, what] : pairs) {
    if (rule.optional && rule.since == version && Holds(cal, rule)) newest = what;
  }
  // A tensor its scheme keys (holding) is in every layer or none, as the scheme says.
  for (const LayerCalibration& layer : cal.layers) {
    ForEachTensor(layer, info, [&](const FileTensor& tensor, const auto& values, const auto&) {
      const Holding holding = HoldingOf(tensor.rule, info.scheme, tensor.side);
      if (holding == Holding::kByVersion) return;
      const bool held = !values.empty();
      KVQ_CHECK(held == (holding == Holding::kHeld), kInvalidArgument, "calibration: scheme '",
                info.scheme, "' ", held ? "holds " : "needs ", tensor.id,
                held ? ", which its calibration does not" : " in every layer");
    });
  }
  for (const auto& [rule, what] : pairs) {
    KVQ_CHECK(!rule.optional || HoldingOf(rule, info.scheme, 0) != Holding::kByVersion ||
                  rule.since > version || Holds(cal, rule),
              kInvalidArgument,
              "calibration: ", newest, " need the ", what, " too (format_version ", version,
              " holds every tensor of version ", rule.since, ")");
  }
  KVQ_CHECK(info.granularity == "kv_head" || info.granularity == "layer", kInvalidArgument,
            "calibration: granularity '", info.granularity, "' (kv_head or layer)");
  if (!codebook) {  // a codebook calibration has neither (ValidateCodebookCalibration)
    KVQ_CHECK(!info.rotation.empty(), kInvalidArgument, "calibration: rotation recipe is empty");
    KVQ_CHECK(info.value_target == "attn_output" || info.value_target == "key_weighted" ||
                  info.value_target == "raw",
              kInvalidArgument, "calibration: value_target '", info.value_target,
              "' (attn_output, key_weighted or raw)");
  }
  KVQ_CHECK(static_cast<int>(cal.layers.size()) == info.num_layers, kShapeMismatch,
            "calibration: ", cal.layers.size(), " layers present, metadata says ",
            info.num_layers);
  for (int l = 0; l < info.num_layers; ++l) {
    const LayerCalibration& layer = cal.layers[l];
    // A pair the calibration does not hold (an optional one: above) is absent from every layer.
    ForEachTensor(layer, info, [&](const FileTensor& tensor, const auto& values, const auto&) {
      KVQ_CHECK(InFile(tensor.rule, tensor.side, info, version) || values.empty(), kShapeMismatch,
                "calibration layer ", l, " holds ", tensor.id, " but another layer lacks the ",
                tensor.what, " (all layers or none)");
    });
    ForEachTensor(layer, info, [&](const FileTensor& tensor, const auto& values, const auto&) {
      if (!InFile(tensor.rule, tensor.side, info, version)) return;
      const size_t expected = Product(tensor.shape);
      KVQ_CHECK(values.size() == expected, kShapeMismatch, "calibration layer ", l, " ",
                tensor.id, " holds ", values.size(), " values, expected ", expected);
      for (size_t i = 0; i < values.size(); ++i) {
        KVQ_CHECK(std::isfinite(values[i]), kNonFinite, "calibration layer ", l, " ",
                  tensor.id, " element ", i, " = ", +values[i], " is not finite");
      }
    });
    ForEachTensor(layer, info, [&](const FileTensor& tensor, const auto& values,
                                   const auto& check_value) {
      if (InFile(tensor.rule, tensor.side, info, version)) {
        CheckHeads(tensor, l, values, info, check_value);
      }
    });
  }
  if (codebook) ValidateCodebookCalibration(cal);
}

Calibration CalibrationFromSafetensors(const Safetensors& file) {
  const MetadataReader meta(file.metadata, "calibration");
  KVQ_CHECK(meta.String("format") == kCalibrationFormat, kMalformedFile,
            "calibration: format is '", meta.String("format"), "', expected '",
            kCalibrationFormat, "'");
  const int64_t version = meta.Int("format_version");
  const int newest = NewestVersion();
  std::string versions;  // "1, 2, 3 or 4"
  for (int v = kCalibrationFormatVersionWithoutRawTarget; v <= newest; ++v) {
    if (v > kCalibrationFormatVersionWithoutRawTarget) versions += v == newest ? " or " : ", ";
    versions += std::to_string(v);
  }
  KVQ_CHECK(version >= kCalibrationFormatVersionWithoutRawTarget && version <= newest,
            kMalformedFile, "calibration: format_version ", version,
            " is not supported (expected ", versions, ")");
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
  // Version 4 is exactly the codebook calibrations (not cumulative: formats.md §5).
  const bool codebook = IsCodebookScheme(info.scheme);
  KVQ_CHECK(codebook == (version == kCalibrationFormatVersionCodebook), kMalformedFile,
            "calibration: scheme '", info.scheme, "' with format_version ", version, " (",
            kCalibrationFormatVersionCodebook, " is the codebook calibrations' version, and ",
            "only theirs)");
  if (codebook) {
    info.rotation.clear();
    info.value_target.clear();
    CodebookCalibrationInfo& cb = info.codebook;
    cb.density = meta.String("codebook");
    cb.seed = meta.U64("seed");
    cb.k_segments = static_cast<int>(meta.Int("k_segments", 1, kCodebookMaxSegments));
    cb.k_code_bytes = static_cast<int>(meta.Int("k_code_bytes", 0, 1 << 16));
    cb.v_segments = static_cast<int>(meta.Int("v_segments", 1, kCodebookMaxSegments));
    cb.v_code_bytes = static_cast<int>(meta.Int("v_code_bytes", 0, 1 << 16));
    if (AllocatesWidths(info.scheme)) {
      cb.k_avg_bits = meta.Double("k_avg_bits");
      cb.rotation_threshold = static_cast<int>(meta.Int("rotation_threshold", 1, 64));
    }
  } else {
    info.rotation = meta.String("rotation");
    info.value_target = meta.String("value_target");
  }
  info.granularity = meta.String("granularity");
  info.source = meta.String("source");

  // A file of format_version v holds every pair up to v, in every layer.
  cal.layers.resize(info.num_layers);
  std::set<std::string> expected;
  for (int l = 0; l < info.num_layers; ++l) {
    ForEachTensor(cal.layers[l], info, [&](const FileTensor& tensor, const auto&, const auto&) {
      if (InFile(tensor.rule, tensor.side, info, version)) {
        expected.insert(TensorName(l, tensor.id));
      }
    });
  }
  for (const auto& [name, tensor] : file.tensors) {
    KVQ_CHECK(expected.count(name) == 1, kMalformedFile, "calibration: unexpected tensor '",
              name, "' (num_layers = ", info.num_layers, ", format_version ", version, ")");
  }
  for (int l = 0; l < info.num_layers; ++l) {
    ForEachTensor(cal.layers[l], info, [&](const FileTensor& tensor, auto& values, const auto&) {
      if (!InFile(tensor.rule, tensor.side, info, version)) return;
      using T = typename std::decay_t<decltype(values)>::value_type;
      const std::string name = TensorName(l, tensor.id);
      const Tensor* t = file.Find(name);
      KVQ_CHECK(t != nullptr, kMalformedFile, "calibration: tensor '", name, "' is missing");
      KVQ_CHECK(t->dtype == FileType<T>::kDType, kMalformedFile, "calibration: tensor '", name,
                "' has dtype ", DTypeName(t->dtype), ", expected ",
                DTypeName(FileType<T>::kDType));
      ExpectShape(*t, tensor.shape, "calibration tensor '" + name + "'");
      values.assign(t->data<T>(), t->data<T>() + t->numel());
    });
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
  if (IsCodebookScheme(info.scheme)) {
    const CodebookCalibrationInfo& cb = info.codebook;
    file.metadata["codebook"] = cb.density;
    file.metadata["seed"] = std::to_string(cb.seed);
    file.metadata["k_segments"] = std::to_string(cb.k_segments);
    file.metadata["k_code_bytes"] = std::to_string(cb.k_code_bytes);
    file.metadata["v_segments"] = std::to_string(cb.v_segments);
    file.metadata["v_code_bytes"] = std::to_string(cb.v_code_bytes);
    if (AllocatesWidths(info.scheme)) {
      file.metadata["k_avg_bits"] = ShortestDouble(cb.k_avg_bits);
      file.metadata["rotation_threshold"] = std::to_string(cb.rotation_threshold);
    }
  } else {
    file.metadata["rotation"] = info.rotation;
    file.metadata["value_target"] = info.value_target;
  }
  file.metadata["granularity"] = info.granularity;
  file.metadata["source"] = info.source;
  for (int l = 0; l < info.num_layers; ++l) {
    ForEachTensor(cal.layers[l], info, [&](const FileTensor& tensor, const auto& values,
                                           const auto&) {
      using T = typename std::decay_t<decltype(values)>::value_type;
      if (InFile(tensor.rule, tensor.side, info, version)) {
        file.Add(TensorName(l, tensor.id), FileType<T>::Make(tensor.shape, values));
      }
    });
  }
  return file;
}

void WriteCalibration(const std::string& path, const Calibration& cal) {
  WriteSafetensors(path, CalibrationToSafetensors(cal));
}

}  // namespace kvq::calib
