#include "kvq/calib/schemes.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/codebook_calibration.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/lloyd_max.h"

namespace kvq::calib {
namespace {

// The catalogue (schemes.inc) as a table.
const std::vector<SchemeInfo>& Table() {
  static const std::vector<SchemeInfo> table = {
#define KVQ_SCHEME(id, rotation_k, rotation_v, format_k, format_v, norm, bits, group, windows,  \
                   clip, scale, widths, calibration, summary)                                 \
  SchemeInfo{#id,                          summary,                                          \
             calibration,                  SchemeRotation::k##rotation_k,                    \
             SchemeRotation::k##rotation_v, Format::k##format_k,                             \
             Format::k##format_v,          SchemeNorm::norm,                                 \
             bits,                         group,                                            \
             windows,                      ClipPolicy::clip,                                 \
             ScalePolicy::scale,           WidthsPolicy::widths},
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

// The block-diagonal normalised Hadamard matrix of blocks of `block` (fp64).
MatrixXd BlockHadamard(int d, int block) {
  MatrixXd h = MatrixXd::Zero(d, d);
  const MatrixXd b = HadamardMatrix(block);
  for (int start = 0; start < d; start += block) h.block(start, start, block, block) = b;
  return h;
}

// saw_hessian's rotation (seeds/003 App. A.3, kvq's reading): M = the layer-pooled query second
// moment, the mean over the layer's KV heads of C_Q rebuilt as U·diag(λ)·Uᵀ from the
// calibration (each KV head's C_Q is the mean over its g query heads, so this pools every query
// head of the layer); M' = H_bd·M·H_bd, the second moment of the block-rotated queries;
// U' its sorted eigenbasis after damping M' + α·mean(diag M')·I; R = H_bd·U' in fp64.
MatrixXd HessianBlockRotation(const LayerCalibration& lc, int hkv, int d, int block,
                              double damping) {
  MatrixXd m = MatrixXd::Zero(d, d);
  for (int h = 0; h < hkv; ++h) {
    const MatrixXd u = StoredMatrix(lc.k_basis, h, d);
    VectorXd lambda(d);
    for (int i = 0; i < d; ++i) lambda(i) = lc.k_eigenvalues[static_cast<size_t>(h) * d + i];
    m += u * lambda.asDiagonal() * u.transpose();
  }
  m /= hkv;
  const MatrixXd hbd = BlockHadamard(d, block);
  MatrixXd rotated = hbd.transpose() * m * hbd;
  rotated = 0.5 * (rotated + rotated.transpose());  // exactly symmetric for the eigensolver
  return hbd * SortedEigenBasis(rotated, damping).vectors;
}

// A codebook side with per-head widths (spec/numerics.md §5.4.1): its row limits are the most
// segments and code bytes any head of `all_widths` ([heads, d/2], every layer's) lays a row out
// in, and its bits the budget width Σ w_i / (d/2) of `layer_widths` rounded up, the largest
// over the layer's heads.
void FitCodebookRows(const std::vector<uint8_t>& all_widths,
                     const std::vector<uint8_t>& layer_widths, WriteParams* w) {
  const size_t blocks = static_cast<size_t>(w->head_dim / 2);
  w->segments = 1;
  w->code_bytes = 0;
  for (size_t h = 0; h * blocks < all_widths.size(); ++h) {
    const CodebookLayout layout = CodebookLayoutOf(w->head_dim, &all_widths[h * blocks]);
    w->segments = std::max(w->segments, layout.count);
    w->code_bytes = std::max(w->code_bytes, layout.code_bytes);
  }
  int bits = 1;
  for (size_t h = 0; h * blocks < layer_widths.size(); ++h) {
    size_t sum = 0;
    for (size_t i = 0; i < blocks; ++i) sum += layer_widths[h * blocks + i];
    bits = std::max(bits, static_cast<int>((sum + blocks - 1) / blocks));
  }
  w->bits = bits;
}

// The codebook calibration of a widths scheme (blockgtq) on the calibration tokens of `acts`,
// as `kvq calibrate --scheme <name> --k-bits K --v-bits V --seed S` makes it, K and V the
// widths `options` give the scheme's sides (SchemeInfo::BitsUnder), S its seed.
Calibration WidthsCalibration(const std::string& name, const Activations& acts,
                              const SchemeOptions& options, int sink, int recent, int threads,
                              const std::string& source) {
  const SchemeInfo& info = SchemeByName(name);
  CodebookCalibrationOptions c;
  c.scheme = name;
  c.k_avg_bits = info.BitsUnder(options, 0);
  c.v_bits = info.BitsUnder(options, 1);
  c.seed = options.seed;
  c.sink = sink;
  c.recent = std::max(recent, 1);  // a codebook file records W >= 1 (the scheme's own is 0)
  c.threads = threads;
  c.source = source;
  return CalibrateCodebook(acts, c);
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

const char* NormScopeName(NormScope scope) {
  switch (scope) {
    case NormScope::kHead: return "head";
    case NormScope::kToken: return "token";
  }
  return "unknown";
}

NormScope ParseNormScope(const std::string& name) {
  if (name == "head") return NormScope::kHead;
  if (name == "token") return NormScope::kToken;
  KVQ_CHECK(false, kInvalidArgument, "norm scope '", name, "' (head or token)");
  return NormScope::kHead;
}

LayerScheme BuildLayerScheme(const std::string& name, const SchemeShape& shape,
                             const Calibration* cal, int layer, const SchemeOptions& o) {
  return BuildLayerScheme(SchemeByName(name), shape, cal, layer, o);
}

LayerScheme BuildLayerScheme(const SchemeInfo& info, const SchemeShape& shape,
                             const Calibration* cal, int layer, const SchemeOptions& o) {
  const std::string name = info.name;
  KVQ_CHECK(layer >= 0 && layer < shape.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", shape.num_layers, ")");
  if (info.needs_calibration) {
    KVQ_CHECK(cal != nullptr, kInvalidArgument, "scheme '", name,
              "' needs a calibration (kvq calibrate; kvq eval --calibration FILE)");
    // A codebook calibration (format_version 4) holds Haar rotations and widths, none of the
    // fitted tensors (clip ratios, bases) these schemes read.
    KVQ_CHECK(!IsCodebookScheme(cal->info.scheme) || IsCodebookScheme(name), kInvalidArgument,
              "scheme '", name, "' cannot use a calibration made for scheme '",
              cal->info.scheme, "' (a codebook calibration: make one with kvq calibrate "
              "--scheme oscar)");
    CheckCalibrationMatches(shape, *cal);
  }
  const int d = shape.head_dim;
  const int hkv = shape.num_kv_heads;

  LayerScheme s;
  CacheParams& p = s.params;
  p.num_kv_heads = hkv;
  p.num_q_heads = shape.num_q_heads;
  const SchemeWindows windows = o.protect ? kProtectedWindows
                                : info.windows.shared() ? SchemeWindows(o.sink, o.recent, o.flush)
                                                        : info.windows;
  p.sink = windows.sink;
  p.recent = windows.recent;
  p.flush = windows.flush;
  p.page_size = o.page;
  const Format formats[2] = {info.format_k, info.format_v};
  WriteParams* sides[2] = {&p.key, &p.value};
  for (int side = 0; side < 2; ++side) {
    WriteParams* w = sides[side];
    w->head_dim = d;
    w->format = formats[side];
    w->group = w->format == Format::kAffineTile ? o.tile : info.GroupUnder(o, d);
    w->bits = info.BitsUnder(o, side);
    w->clip = 1.0f;
    w->rotation = RotationKind::kIdentity;
    w->hadamard_block = 0;
    w->bitrev = false;
    w->norm = false;
    w->norm_heads = 1;
    w->head_scale = 1.0f;
  }
  // A codebook calibration records the tables its rows are to be coded by (kvq calibrate
  // --codebook beta|gaussian): the scheme's codebook sides take them.
  if (cal != nullptr && IsCodebookScheme(cal->info.scheme)) {
    const CodebookDensity density = ParseCodebookDensity(cal->info.codebook.density);
    for (WriteParams* w : sides) {
      if (w->format == Format::kCodebook) w->codebook = density;
    }
  }
  // A page holds whole tiles: P (a power of two, as G_k is) rises to G_k when it is smaller. The
  // page size only places rows in memory; no stored bit or output depends on it.
  for (const WriteParams* w : sides) p.page_size = std::max(p.page_size, w->tile_tokens());
  if (info.norm == SchemeNorm::kKeys) {
    p.key.norm = true;
    p.key.norm_heads = o.norm_scope == NormScope::kToken ? hkv : 1;
  }
  const LayerCalibration* lc = info.needs_calibration ? &cal->layers[layer] : nullptr;
  switch (info.clip) {
    case ClipPolicy::kNone: break;
    case ClipPolicy::kCalibration:
      s.key.clip = lc->key.clip;
      s.value.clip = lc->value.clip;
      break;
  }
  switch (info.scale) {
    case ScalePolicy::kNone: break;
    case ScalePolicy::kCalibration:
      KVQ_CHECK(!lc->key.scale.empty() && !lc->value.scale.empty(), kInvalidArgument, "scheme '",
                name, "' needs the calibration's fp8 scales (tensors layers.", layer,
                ".k_scale and layers.", layer, ".v_scale), which this calibration (scheme '",
                cal->info.scheme, "') lacks: make one with kvq calibrate --scheme ", name);
      KVQ_CHECK(cal->info.scheme == name, kInvalidArgument, "scheme '", name,
                "' needs fp8 scales computed after its own rotation, but this calibration's "
                "were computed for scheme '", cal->info.scheme, "' (kvq calibrate --scheme ",
                name, ")");
      s.key.scale = lc->key.scale;
      s.value.scale = lc->value.scale;
      break;
  }
  switch (info.widths) {
    case WidthsPolicy::kNone: break;
    case WidthsPolicy::kCalibration: {
      KVQ_CHECK(!lc->key.widths.empty(), kInvalidArgument, "scheme '", name,
                "' needs the calibration's per-head block widths (tensor layers.", layer,
                ".k_bits, the allocation kvq calibrate --scheme ", name, " makes), which this "
                "calibration (scheme '", cal->info.scheme, "') lacks");
      std::vector<uint8_t> all;
      for (const LayerCalibration& l : cal->layers) {
        all.insert(all.end(), l.key.widths.begin(), l.key.widths.end());
      }
      FitCodebookRows(all, lc->key.widths, &p.key);
      s.key.widths = lc->key.widths;
      break;
    }
  }
  auto basis = [&](int h, bool keys) {
    return StoredMatrix(keys ? lc->k_basis : lc->v_basis, h, d);
  };
  const auto saw_block = [&]() {
    KVQ_CHECK(o.saw_block >= 16 && o.saw_block <= 256 && (o.saw_block & (o.saw_block - 1)) == 0,
              kInvalidArgument, "saw_block ", o.saw_block,
              " must be a power of two in [16, 256]");
    return std::min(o.saw_block, d);
  };

  // The one place that turns a catalogue row's rotation into matrices and flags, per side.
  for (int side = 0; side < 2; ++side) {
    const bool keys = side == 0;
    WriteParams* w = sides[side];
    std::vector<float>& matrices = s.heads(side).rotation;
    auto dense = [&](auto&& make /* (head) -> MatrixXd */) {
      w->rotation = RotationKind::kDense;
      for (int h = 0; h < hkv; ++h) AppendMatrix(make(h), matrices);
    };
    auto stored = [&](const std::vector<float>& all) {
      w->rotation = RotationKind::kDense;
      matrices = all;
    };
    switch (keys ? info.rotation_k : info.rotation_v) {
      case SchemeRotation::kIdentity: break;
      case SchemeRotation::kHadamard:
        w->rotation = RotationKind::kHadamard;
        break;
      case SchemeRotation::kHadamardBitrev:
        w->rotation = RotationKind::kHadamard;
        w->bitrev = true;
        break;
      case SchemeRotation::kBlockHadamard: {
        const int block = saw_block();
        w->rotation = RotationKind::kHadamard;
        w->hadamard_block = block == d ? 0 : block;
        break;
      }
      case SchemeRotation::kRandomOrthogonal:
        dense([&](int h) {
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
        stored(keys ? lc->raw_k_rotation : lc->raw_v_rotation);
        break;
      case SchemeRotation::kEigenbasis:
        dense([&](int h) { return basis(h, keys); });
        break;
      case SchemeRotation::kEigenbasisBitrev:
        dense([&](int h) { return BasisBitReversal(basis(h, keys)); });
        break;
      case SchemeRotation::kEigenbasisHadamard:
        dense([&](int h) { return BasisHadamard(basis(h, keys)); });
        break;
      case SchemeRotation::kCalibrated:
        stored(lc->heads(side).rotation);
        break;
      case SchemeRotation::kHessianBlock: {
        KVQ_CHECK(cal->info.rotation != "raw_target", kInvalidArgument, "scheme '", name,
                  "' rebuilds C_Q from the calibration's key bases, but this calibration's "
                  "(rotation recipe raw_target) are those of K^T K");
        KVQ_CHECK(std::isfinite(o.hessian_damping) && o.hessian_damping >= 0, kInvalidArgument,
                  "hessian damping ", o.hessian_damping, " must be finite and >= 0");
        const MatrixXd r = HessianBlockRotation(*lc, hkv, d, saw_block(), o.hessian_damping);
        dense([&](int) { return r; });
        break;
      }
    }
  }
  p.Validate();
  s.key.Validate(p.key, hkv, "key");
  s.value.Validate(p.value, hkv, "value");
  return s;
}

LayerScheme BuildLayerScheme(const std::string& name, const Activations& acts,
                             const Calibration* cal, int layer, const SchemeOptions& options) {
  return BuildLayerScheme(name, ShapeOf(acts.info), cal, layer, options);
}

bool CalibrationServes(const Calibration& cal, const std::string& name) {
  const SchemeInfo& info = SchemeByName(name);
  if (info.widths == WidthsPolicy::kCalibration) {
    if (cal.info.scheme != name) return false;
    for (const LayerCalibration& l : cal.layers) {
      if (l.key.widths.empty()) return false;
    }
  }
  return info.scale != ScalePolicy::kCalibration || (cal.info.scheme == name && cal.HasScales());
}

Calibration CalibrationForScheme(const std::string& name, const Calibration& cal,
                                 const Activations* acts, const cpu::Backend& backend,
                                 const SchemeOptions& options) {
  if (CalibrationServes(cal, name)) return cal;
  if (SchemeByName(name).widths == WidthsPolicy::kCalibration) {
    KVQ_CHECK(acts != nullptr, kInvalidArgument, "scheme '", name, "' needs the per-head block "
              "widths (tensors layers.{l}.k_bits) of a calibration made by kvq calibrate "
              "--scheme ", name, "; this calibration (scheme '", cal.info.scheme,
              "') has none: give a calibration capture, or a file of kvq calibrate --scheme ",
              name);
    CheckCalibrationMatches(ShapeOf(acts->info), cal);
    return WidthsCalibration(name, *acts, options, cal.info.sink, cal.info.recent, 1,
                             cal.info.source);
  }
  KVQ_CHECK(acts != nullptr, kInvalidArgument, "scheme '", name, "' needs fp8 scales computed "
            "after its own rotation; this calibration (scheme '", cal.info.scheme,
            "') has none: give a calibration capture, or a file of kvq calibrate --scheme ",
            name);
  CheckCalibrationMatches(ShapeOf(acts->info), cal);
  // The scheme's side params (its rotations) without the scales it is about to get.
  SchemeInfo bare = SchemeByName(name);
  bare.scale = ScalePolicy::kNone;
  bare.needs_calibration = false;
  const LayerScheme sides = BuildLayerScheme(bare, ShapeOf(acts->info), nullptr, 0,
                                             SchemeOptions());
  Calibration out = cal;
  out.info.scheme = name;
  for (int l = 0; l < out.info.num_layers; ++l) {
    for (int side = 0; side < 2; ++side) {
      out.layers[l].heads(side).scale =
          Fp8Scales(*acts, l, side == 0, side == 0 ? sides.params.key : sides.params.value,
                    backend);
    }
  }
  return out;
}

const Calibration& SyntheticCalibrations::For(const std::string& name) {
  const std::string kind = CalibrationScheme(name);
  auto it = made_.find(kind);
  if (it == made_.end()) {
    it = made_.emplace(kind, SyntheticCalibration(shape_, options_, tokens_, seed_, threads_, kind))
             .first;
  }
  return it->second;
}

std::string CalibrationScheme(const std::string& name) {
  const SchemeInfo& info = SchemeByName(name);
  return info.scale == ScalePolicy::kCalibration || info.widths == WidthsPolicy::kCalibration
             ? name
             : "oscar";
}

Calibration SyntheticCalibration(const SchemeShape& shape, const SchemeOptions& options,
                                 int64_t tokens, uint64_t seed, int threads,
                                 const std::string& scheme) {
  SynthOptions synth;
  synth.seed = seed;
  synth.num_layers = shape.num_layers;
  synth.num_q_heads = shape.num_q_heads;
  synth.num_kv_heads = shape.num_kv_heads;
  synth.head_dim = shape.head_dim;
  synth.tokens = tokens;
  synth.threads = threads;
  const Activations acts = Synthesize(synth);
  const std::string source = "kvq synth seed=" + std::to_string(seed) + " (SyntheticCalibration)";
  if (SchemeByName(scheme).widths == WidthsPolicy::kCalibration) {
    return WidthsCalibration(scheme, acts, options, options.sink, options.recent, threads,
                             source);
  }
  CalibrationOptions c;
  c.group = options.group;
  c.bits = options.k_bits != 0 ? options.k_bits : options.bits;
  c.v_bits = options.v_bits != 0 ? options.v_bits : options.bits;
  c.sink = options.sink;
  c.recent = options.recent;
  c.threads = threads;
  c.scheme = CalibrationScheme(scheme);
  c.source = source;
  return Calibrate(acts, c, cpu::ScalarBackend());
}

LayerScheme SliceKvHead(const LayerScheme& scheme, int kv_head) {
  const CacheParams& p = scheme.params;
  KVQ_CHECK(kv_head >= 0 && kv_head < p.num_kv_heads, kInvalidArgument, "KV head ", kv_head,
            " out of range [0, ", p.num_kv_heads, ")");
  for (const WriteParams* w : {&p.key, &p.value}) {
    KVQ_CHECK(!w->quantized() || !w->norm || w->norm_heads == 1 || p.num_kv_heads == 1,
              kUnsupported, "a norm over every KV head of a token (norm scope token) couples the "
              "heads: one KV head cannot be taken alone (evaluate the whole layer, e.g. kvq "
              "attend)");
  }
  LayerScheme s;
  s.params = p;
  s.params.num_kv_heads = 1;
  s.params.num_q_heads = p.group_size();
  s.key = scheme.key.Slice(p.key, kv_head, "key");
  s.value = scheme.value.Slice(p.value, kv_head, "value");
  return s;
}

}  // namespace kvq::calib
