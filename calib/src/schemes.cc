#include "kvq/calib/schemes.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

// The catalogue (schemes.inc) as a table.
const std::vector<SchemeInfo>& Table() {
  static const std::vector<SchemeInfo> table = {
#define KVQ_SCHEME(id, rotation, format, bits, clip, calibration, summary)                   \
  SchemeInfo{#id, summary, calibration, SchemeRotation::k##rotation, Format::k##format, bits, \
             ClipPolicy::clip},
#include "kvq/calib/schemes.inc"
#undef KVQ_SCHEME
  };
  return table;
}

void CheckCalibrationMatches(const SchemeShape& shape, const Calibration& cal) {
  const CalibrationInfo& c = cal.info;
  KVQ_CHECK(c.num_layers == shape.num_layers && c.num_kv_heads == shape.num_kv_heads &&
                c.head_dim == shape.head_dim && static_cast<int>(cal.layers.size()) == c.num_layers,
            kShapeMismatch, "calibration has ", c.num_layers, " layers x ", c.num_kv_heads,
            " KV heads x d=", c.head_dim, " but the scheme is built for ", shape.num_layers,
            " layers x ", shape.num_kv_heads, " KV heads x d=", shape.head_dim);
}

// Appends one d×d fp64 matrix as fp32 row-major.
void AppendMatrix(const MatrixXd& m, std::vector<float>& out) {
  const std::vector<float> f = ToRowMajorF32(m);
  out.insert(out.end(), f.begin(), f.end());
}

MatrixXd StoredMatrix(const std::vector<float>& all, int head, int d) {
  return FromRowMajorF32(all.data() + static_cast<size_t>(head) * d * d, d, d);
}

}  // namespace

const char* ClipPolicyName(ClipPolicy policy) {
  switch (policy) {
    case ClipPolicy::kNone: return "none";
    case ClipPolicy::kCalibration: return "calibration";
  }
  return "unknown";
}

const std::vector<SchemeInfo>& Schemes() { return Table(); }

const SchemeInfo& SchemeByName(const std::string& name) {
  for (const SchemeInfo& s : Table()) {
    if (name == s.name) return s;
  }
  KVQ_CHECK(false, kInvalidArgument, "unknown scheme '", name, "' (valid: ", SchemeNames(), ")");
  return Table().front();
}

std::string SchemeNames(const std::string& separator) {
  std::string names;
  for (const SchemeInfo& s : Table()) names += (names.empty() ? "" : separator) + s.name;
  return names;
}

SchemeShape ShapeOf(const ActivationsInfo& info) {
  SchemeShape shape;
  shape.num_layers = info.num_layers;
  shape.num_kv_heads = info.num_kv_heads;
  shape.num_q_heads = info.num_q_heads;
  shape.head_dim = info.head_dim;
  return shape;
}

bool SchemeClipsWithCalibration(const std::string& name) {
  return SchemeByName(name).clip == ClipPolicy::kCalibration;
}

std::vector<std::string> ParseSchemeList(const std::string& list) {
  std::vector<std::string> names;
  if (list == "all") {
    for (const SchemeInfo& s : Schemes()) names.push_back(s.name);
    return names;
  }
  std::set<std::string> seen;
  std::stringstream stream(list);
  std::string item;
  while (std::getline(stream, item, ',')) {
    KVQ_CHECK(!item.empty(), kInvalidArgument, "empty scheme name in list '", list, "'");
    SchemeByName(item);
    KVQ_CHECK(seen.insert(item).second, kInvalidArgument, "scheme '", item,
              "' appears twice in list '", list, "'");
    names.push_back(item);
  }
  KVQ_CHECK(!names.empty(), kInvalidArgument, "empty scheme list '", list, "'");
  return names;
}

LayerScheme BuildLayerScheme(const std::string& name, const SchemeShape& shape,
                             const Calibration* cal, int layer, const SchemeOptions& o) {
  const SchemeInfo& info = SchemeByName(name);
  KVQ_CHECK(layer >= 0 && layer < shape.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", shape.num_layers, ")");
  if (info.needs_calibration) {
    KVQ_CHECK(cal != nullptr, kInvalidArgument, "scheme '", name,
              "' needs a calibration (kvq calibrate; kvq eval --calibration FILE)");
    CheckCalibrationMatches(shape, *cal);
  }
  const int d = shape.head_dim;
  const int hkv = shape.num_kv_heads;

  LayerScheme s;
  CacheParams& p = s.params;
  p.num_kv_heads = hkv;
  p.num_q_heads = shape.num_q_heads;
  p.sink = o.sink;
  p.recent = o.recent;
  p.page_size = o.page;
  for (WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = d;
    w->format = info.format;
    w->group = o.group;
    w->bits = info.BitsUnder(o);
    w->clip = 1.0f;
    w->rotation = RotationKind::kIdentity;
    w->hadamard_block = 0;
    w->bitrev = false;
  }
  const LayerCalibration* lc = info.needs_calibration ? &cal->layers[layer] : nullptr;
  switch (info.clip) {
    case ClipPolicy::kNone: break;
    case ClipPolicy::kCalibration:
      s.clip_k = lc->k_clip;
      s.clip_v = lc->v_clip;
      break;
  }
  auto dense = [&](auto&& make /* (head, keys) -> MatrixXd */) {
    p.key.rotation = p.value.rotation = RotationKind::kDense;
    for (int h = 0; h < hkv; ++h) {
      AppendMatrix(make(h, true), s.rotation_k);
      AppendMatrix(make(h, false), s.rotation_v);
    }
  };
  auto stored = [&](const std::vector<float>& k, const std::vector<float>& v) {
    p.key.rotation = p.value.rotation = RotationKind::kDense;
    s.rotation_k = k;
    s.rotation_v = v;
  };
  auto basis = [&](int h, bool keys) {
    return StoredMatrix(keys ? lc->k_basis : lc->v_basis, h, d);
  };

  // The one place that turns a catalogue row's rotation into matrices and flags.
  switch (info.rotation) {
    case SchemeRotation::kIdentity: break;
    case SchemeRotation::kHadamard:
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      break;
    case SchemeRotation::kHadamardBitrev:
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      p.key.bitrev = p.value.bitrev = true;
      break;
    case SchemeRotation::kBlockHadamard: {
      KVQ_CHECK(o.saw_block >= 16 && o.saw_block <= 256 && (o.saw_block & (o.saw_block - 1)) == 0,
                kInvalidArgument, "saw_block ", o.saw_block,
                " must be a power of two in [16, 256]");
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      const int block = std::min(o.saw_block, d);
      p.key.hadamard_block = p.value.hadamard_block = block == d ? 0 : block;
      break;
    }
    case SchemeRotation::kRandomOrthogonal:
      dense([&](int h, bool keys) {
        const uint64_t key = DeriveSeed(o.seed, {static_cast<uint64_t>(layer),
                                                 static_cast<uint64_t>(h), keys ? 0u : 1u});
        return RandomOrthogonal(d, key);
      });
      break;
    case SchemeRotation::kRawTarget:
      KVQ_CHECK(!lc->raw_k_rotation.empty() && !lc->raw_v_rotation.empty(), kInvalidArgument,
                "scheme '", name, "' needs the calibration's raw-target rotations (tensors "
                "layers.", layer, ".raw_k_rotation and layers.", layer,
                ".raw_v_rotation), which this calibration lacks: it is a format_version ",
                kCalibrationFormatVersionWithoutRawTarget, " file; re-run kvq calibrate to get "
                "format_version ", kCalibrationFormatVersion);
      stored(lc->raw_k_rotation, lc->raw_v_rotation);
      break;
    case SchemeRotation::kEigenbasis:
      dense([&](int h, bool keys) { return basis(h, keys); });
      break;
    case SchemeRotation::kEigenbasisBitrev:
      dense([&](int h, bool keys) { return BasisBitReversal(basis(h, keys)); });
      break;
    case SchemeRotation::kEigenbasisHadamard:
      dense([&](int h, bool keys) { return BasisHadamard(basis(h, keys)); });
      break;
    case SchemeRotation::kCalibrated:
      stored(lc->k_rotation, lc->v_rotation);
      break;
  }
  p.Validate();
  return s;
}

LayerScheme BuildLayerScheme(const std::string& name, const Activations& acts,
                             const Calibration* cal, int layer, const SchemeOptions& options) {
  return BuildLayerScheme(name, ShapeOf(acts.info), cal, layer, options);
}

Calibration SyntheticCalibration(const SchemeShape& shape, const SchemeOptions& options,
                                 int64_t tokens, uint64_t seed, int threads) {
  SynthOptions synth;
  synth.seed = seed;
  synth.num_layers = shape.num_layers;
  synth.num_q_heads = shape.num_q_heads;
  synth.num_kv_heads = shape.num_kv_heads;
  synth.head_dim = shape.head_dim;
  synth.tokens = tokens;
  synth.threads = threads;
  const Activations acts = Synthesize(synth);
  CalibrationOptions c;
  c.group = options.group;
  c.bits = options.bits;
  c.sink = options.sink;
  c.recent = options.recent;
  c.threads = threads;
  c.source = "kvq synth seed=" + std::to_string(seed) + " (SyntheticCalibration)";
  return Calibrate(acts, c, cpu::ScalarBackend());
}

LayerScheme SliceKvHead(const LayerScheme& scheme, int kv_head) {
  const CacheParams& p = scheme.params;
  KVQ_CHECK(kv_head >= 0 && kv_head < p.num_kv_heads, kInvalidArgument, "KV head ", kv_head,
            " out of range [0, ", p.num_kv_heads, ")");
  LayerScheme s;
  s.params = p;
  s.params.num_kv_heads = 1;
  s.params.num_q_heads = p.group_size();
  const size_t dd = static_cast<size_t>(p.head_dim()) * p.head_dim();
  auto slice = [&](const std::vector<float>& all, size_t per_head) {
    if (all.empty()) return std::vector<float>();
    return std::vector<float>(all.begin() + kv_head * per_head,
                              all.begin() + (kv_head + 1) * per_head);
  };
  s.rotation_k = slice(scheme.rotation_k, dd);
  s.rotation_v = slice(scheme.rotation_v, dd);
  s.clip_k = slice(scheme.clip_k, 1);
  s.clip_v = slice(scheme.clip_v, 1);
  return s;
}

}  // namespace kvq::calib
