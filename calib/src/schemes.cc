#include "kvq/calib/schemes.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "kvq/calib/covariance.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

// How a scheme's rotation is made (per KV head and side).
enum class Recipe {
  kBf16,             // no quantization at all
  kIdentity,         // naive INT-b
  kHadamard,         // FWHT (full block)
  kHadamardBitrev,   // FWHT then P_br
  kClipOnly,         // identity with the calibrated clip
  kRandomOrthogonal, // seeded Haar-random dense matrix, calibrated clip
  kRawTarget,        // U'·H·P_br, U' from KᵀK / VᵀV of the calibration tokens, calibrated clip
  kEigenbasisOnly,   // U, calibrated clip
  kNoHadamard,       // U·P_br, calibrated clip
  kNoBitrev,         // U·H, calibrated clip
  kOscar,            // the calibration's R and clip
  kSawInt4,          // INT4, block-diagonal FWHT, no clip
};

struct Entry {
  SchemeInfo info;
  Recipe recipe;
};

const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = {
      {{"bf16", "BF16 cache, nothing quantized (the reference's storage)", false}, Recipe::kBf16},
      {{"naive", "INT-b per-token groups, no rotation, no clip", false}, Recipe::kIdentity},
      {{"hadamard", "QuaRot-style: FWHT then INT-b, no clip", false}, Recipe::kHadamard},
      {{"hadamard_bitrev", "FWHT then P_br then INT-b, no clip (H*P_br, table 4 'w/o U')", false},
       Recipe::kHadamardBitrev},
      {{"clip_only", "no rotation, the calibrated clip (table 4 'no rotation')", true},
       Recipe::kClipOnly},
      {{"random_orthogonal", "seeded Haar-random orthogonal R, the calibrated clip", true},
       Recipe::kRandomOrthogonal},
      {{"raw_target", "U'*H*P_br with U' from K^T K / V^T V, the calibrated clip", true},
       Recipe::kRawTarget},
      {{"eigenbasis_only", "U alone (table 10 row U_Q), the calibrated clip", true},
       Recipe::kEigenbasisOnly},
      {{"oscar_no_hadamard", "U*P_br (table 4 'w/o H'), the calibrated clip", true},
       Recipe::kNoHadamard},
      {{"oscar_no_bitrev", "U*H (table 4 'w/o P_br'), the calibrated clip", true},
       Recipe::kNoBitrev},
      {{"oscar", "the calibration's R_K, R_V and clip ratios (U*H*P_br)", true}, Recipe::kOscar},
      {{"saw_int4", "SAW-INT4: block-diagonal FWHT then INT4, no clip", false}, Recipe::kSawInt4},
  };
  return entries;
}

const Entry& EntryByName(const std::string& name) {
  std::string names;
  for (const Entry& e : Entries()) {
    if (name == e.info.name) return e;
    names += names.empty() ? e.info.name : std::string(", ") + e.info.name;
  }
  KVQ_CHECK(false, kInvalidArgument, "unknown scheme '", name, "' (valid: ", names, ")");
  return Entries().front();
}

void CheckCalibrationMatches(const Activations& acts, const Calibration& cal) {
  const ActivationsInfo& a = acts.info;
  const CalibrationInfo& c = cal.info;
  KVQ_CHECK(c.num_layers == a.num_layers && c.num_kv_heads == a.num_kv_heads &&
                c.head_dim == a.head_dim && static_cast<int>(cal.layers.size()) == c.num_layers,
            kShapeMismatch, "calibration has ", c.num_layers, " layers x ", c.num_kv_heads,
            " KV heads x d=", c.head_dim, " but the activations have ", a.num_layers,
            " layers x ", a.num_kv_heads, " KV heads x d=", a.head_dim);
}

// Appends one d×d fp64 matrix as fp32 row-major.
void AppendMatrix(const MatrixXd& m, std::vector<float>& out) {
  const std::vector<float> f = ToRowMajorF32(m);
  out.insert(out.end(), f.begin(), f.end());
}

MatrixXd StoredMatrix(const std::vector<float>& all, int head, int d) {
  return FromRowMajorF32(all.data() + static_cast<size_t>(head) * d * d, d, d);
}

// U' of the raw target (KᵀK / VᵀV over the calibration tokens), honouring the calibration's
// granularity (per layer: the mean over the layer's KV heads, as calibrate does).
MatrixXd RawTargetBasis(const Activations& acts, const Calibration& cal, int layer, int head,
                        bool keys) {
  const int64_t tokens = acts.info.calib_tokens;
  if (cal.info.granularity == "layer") {
    const int d = acts.info.head_dim;
    MatrixXd mean = MatrixXd::Zero(d, d);
    for (int h = 0; h < acts.info.num_kv_heads; ++h) {
      mean += RawCovariance(acts, layer, h, keys, tokens);
    }
    mean /= acts.info.num_kv_heads;
    return SortedEigenBasis(mean).vectors;
  }
  return SortedEigenBasis(RawCovariance(acts, layer, head, keys, tokens)).vectors;
}

}  // namespace

const std::vector<SchemeInfo>& Schemes() {
  static const std::vector<SchemeInfo> infos = [] {
    std::vector<SchemeInfo> v;
    for (const Entry& e : Entries()) v.push_back(e.info);
    return v;
  }();
  return infos;
}

const SchemeInfo& SchemeByName(const std::string& name) { return EntryByName(name).info; }

bool SchemeClipsWithCalibration(const std::string& name) {
  switch (EntryByName(name).recipe) {
    case Recipe::kClipOnly:
    case Recipe::kRandomOrthogonal:
    case Recipe::kRawTarget:
    case Recipe::kEigenbasisOnly:
    case Recipe::kNoHadamard:
    case Recipe::kNoBitrev:
    case Recipe::kOscar: return true;
    case Recipe::kBf16:
    case Recipe::kIdentity:
    case Recipe::kHadamard:
    case Recipe::kHadamardBitrev:
    case Recipe::kSawInt4: return false;
  }
  return false;
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

LayerScheme BuildLayerScheme(const std::string& name, const Activations& acts,
                             const Calibration* cal, int layer, const SchemeOptions& o) {
  const Entry& entry = EntryByName(name);
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", info.num_layers, ")");
  if (entry.info.needs_calibration) {
    KVQ_CHECK(cal != nullptr, kInvalidArgument, "scheme '", name,
              "' needs a calibration (kvq calibrate; kvq eval --calibration FILE)");
    CheckCalibrationMatches(acts, *cal);
  }
  const int d = info.head_dim;
  const int hkv = info.num_kv_heads;

  LayerScheme s;
  CacheParams& p = s.params;
  p.num_kv_heads = hkv;
  p.num_q_heads = info.num_q_heads;
  p.sink = o.sink;
  p.recent = o.recent;
  p.page_size = o.page;
  if (entry.recipe == Recipe::kBf16) p.key.format = p.value.format = Format::kBf16;
  for (WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = d;
    w->group = o.group;
    w->bits = o.bits;
    w->clip = 1.0f;
    w->rotation = RotationKind::kIdentity;
    w->hadamard_block = 0;
    w->bitrev = false;
  }
  const LayerCalibration* lc = cal != nullptr && entry.info.needs_calibration
                                   ? &cal->layers[layer]
                                   : nullptr;
  auto use_calibrated_clip = [&]() {
    s.clip_k = lc->k_clip;
    s.clip_v = lc->v_clip;
  };
  auto dense = [&](auto&& make /* (head, keys) -> MatrixXd */) {
    p.key.rotation = p.value.rotation = RotationKind::kDense;
    for (int h = 0; h < hkv; ++h) {
      AppendMatrix(make(h, true), s.rotation_k);
      AppendMatrix(make(h, false), s.rotation_v);
    }
  };
  auto basis = [&](int h, bool keys) {
    return StoredMatrix(keys ? lc->k_basis : lc->v_basis, h, d);
  };

  switch (entry.recipe) {
    case Recipe::kBf16:
    case Recipe::kIdentity: break;
    case Recipe::kHadamard:
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      break;
    case Recipe::kHadamardBitrev:
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      p.key.bitrev = p.value.bitrev = true;
      break;
    case Recipe::kClipOnly: use_calibrated_clip(); break;
    case Recipe::kRandomOrthogonal:
      dense([&](int h, bool keys) {
        const uint64_t key = DeriveSeed(o.seed, {static_cast<uint64_t>(layer),
                                                 static_cast<uint64_t>(h), keys ? 0u : 1u});
        return RandomOrthogonal(d, key);
      });
      use_calibrated_clip();
      break;
    case Recipe::kRawTarget:
      dense([&](int h, bool keys) {
        return OscarRotation(RawTargetBasis(acts, *cal, layer, h, keys));
      });
      use_calibrated_clip();
      break;
    case Recipe::kEigenbasisOnly:
      dense([&](int h, bool keys) { return basis(h, keys); });
      use_calibrated_clip();
      break;
    case Recipe::kNoHadamard:
      dense([&](int h, bool keys) { return BasisBitReversal(basis(h, keys)); });
      use_calibrated_clip();
      break;
    case Recipe::kNoBitrev:
      dense([&](int h, bool keys) { return BasisHadamard(basis(h, keys)); });
      use_calibrated_clip();
      break;
    case Recipe::kOscar:
      p.key.rotation = p.value.rotation = RotationKind::kDense;
      s.rotation_k = lc->k_rotation;
      s.rotation_v = lc->v_rotation;
      use_calibrated_clip();
      break;
    case Recipe::kSawInt4: {
      KVQ_CHECK(o.saw_block >= 16 && o.saw_block <= 256 && (o.saw_block & (o.saw_block - 1)) == 0,
                kInvalidArgument, "saw_block ", o.saw_block,
                " must be a power of two in [16, 256]");
      p.key.rotation = p.value.rotation = RotationKind::kHadamard;
      p.key.bits = p.value.bits = 4;
      const int block = std::min(o.saw_block, d);
      p.key.hadamard_block = p.value.hadamard_block = block == d ? 0 : block;
      break;
    }
  }
  p.Validate();
  return s;
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
