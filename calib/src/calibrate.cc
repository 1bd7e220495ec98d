#include "kvq/calib/calibrate.h"


#include "kvq/calib/clip_search.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/parallel.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;

struct NamedRecipe {
  RotationRecipe recipe;
  const char* name;
};
constexpr NamedRecipe kRecipes[] = {
    {RotationRecipe::kOscar, "oscar"},
    {RotationRecipe::kNoBitReversal, "no_bitrev"},
    {RotationRecipe::kNoHadamard, "no_hadamard"},
    {RotationRecipe::kEigenbasisOnly, "eigenbasis_only"},
    {RotationRecipe::kRawTarget, "raw_target"},
    {RotationRecipe::kHadamardBitrev, "hadamard_bitrev"},
    {RotationRecipe::kHadamard, "hadamard"},
    {RotationRecipe::kRandomOrthogonal, "random_orthogonal"},
    {RotationRecipe::kIdentity, "identity"},
};

// The rows of the token ranges (RowsAfterSink) of one KV head's keys or values, in order,
// contiguous [n, d].
std::vector<float> GatherRows(const Activations& acts, int layer, int kv_head, bool keys,
                              const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const int d = acts.info.head_dim;
  std::vector<float> rows;
  for (const auto& [first, last] : ranges) {
    for (int64_t t = first; t < last; ++t) {
      const float* src = keys ? acts.k(layer, t, kv_head) : acts.v(layer, t, kv_head);
      rows.insert(rows.end(), src, src + d);
    }
  }
  return rows;
}

struct HeadTargets {
  MatrixXd query, value;          // C_Q and the chosen value target
  MatrixXd raw_key, raw_value;    // KᵀK/N and VᵀV/N (the raw-target rotations and recipe)
};

// One side's raw-target rotations [Hkv, d, d] from its per-KV-head raw covariances: each
// head's own (per KV head) or the mean over the heads, summed in head order (per layer).
std::vector<float> RawRotationsFrom(const std::vector<const MatrixXd*>& per_head,
                                    Granularity granularity, int d) {
  const int hkv = static_cast<int>(per_head.size());
  std::vector<float> out;
  out.reserve(static_cast<size_t>(hkv) * d * d);
  auto append = [&](const MatrixXd& target) {
    const std::vector<float> r = ToRowMajorF32(OscarRotation(SortedEigenBasis(target).vectors));
    out.insert(out.end(), r.begin(), r.end());
  };
  if (granularity == Granularity::kLayer) {
    MatrixXd mean = MatrixXd::Zero(d, d);
    for (const MatrixXd* target : per_head) mean += *target;
    mean /= hkv;
    for (int h = 0; h < hkv; ++h) append(mean);
  } else {
    for (const MatrixXd* target : per_head) append(*target);
  }
  return out;
}

struct SideResult {
  EigenBasis basis;
  MatrixXd rotation;
};

SideResult BuildSide(const MatrixXd& target, const CalibrationOptions& o, uint64_t seed_path,
                     int d) {
  SideResult side;
  side.basis = SortedEigenBasis(target, o.damping);
  const MatrixXd& u = side.basis.vectors;
  switch (o.rotation) {
    case RotationRecipe::kOscar:
    case RotationRecipe::kRawTarget: side.rotation = OscarRotation(u); break;
    case RotationRecipe::kNoBitReversal: side.rotation = BasisHadamard(u); break;
    case RotationRecipe::kNoHadamard: side.rotation = BasisBitReversal(u); break;
    case RotationRecipe::kEigenbasisOnly: side.rotation = u; break;
    case RotationRecipe::kHadamardBitrev: side.rotation = HadamardBitReversal(d); break;
    case RotationRecipe::kHadamard: side.rotation = HadamardMatrix(d); break;
    case RotationRecipe::kRandomOrthogonal:
      side.rotation = RandomOrthogonal(d, DeriveSeed(o.random_seed, {seed_path}));
      break;
    case RotationRecipe::kIdentity: side.rotation = MatrixXd::Identity(d, d); break;
  }
  return side;
}

void Store(const SideResult& side, int head, int d, std::vector<float>& rotation,
           std::vector<float>& basis, std::vector<float>& eigenvalues) {
  const std::vector<float> r = ToRowMajorF32(side.rotation);
  const std::vector<float> u = ToRowMajorF32(side.basis.vectors);
  std::copy(r.begin(), r.end(), rotation.begin() + static_cast<size_t>(head) * d * d);
  std::copy(u.begin(), u.end(), basis.begin() + static_cast<size_t>(head) * d * d);
  for (int i = 0; i < d; ++i) {
    eigenvalues[static_cast<size_t>(head) * d + i] = static_cast<float>(side.basis.values(i));
  }
}

}  // namespace

const char* GranularityName(Granularity g) {
  return g == Granularity::kLayer ? "layer" : "kv_head";
}

const char* ValueTargetName(ValueTarget t) {
  switch (t) {
    case ValueTarget::kAttnOutput: return "attn_output";
    case ValueTarget::kKeyWeighted: return "key_weighted";
    case ValueTarget::kRaw: return "raw";
  }
  return "unknown";
}

const char* RotationRecipeName(RotationRecipe r) {
  for (const NamedRecipe& named : kRecipes) {
    if (named.recipe == r) return named.name;
  }
  return "unknown";
}

Granularity ParseGranularity(const std::string& text) {
  if (text == "kv_head") return Granularity::kKvHead;
  if (text == "layer") return Granularity::kLayer;
  KVQ_CHECK(false, kInvalidArgument, "granularity '", text, "' (kv_head or layer)");
  return Granularity::kKvHead;
}

ValueTarget ParseValueTarget(const std::string& text) {
  if (text == "attn_output") return ValueTarget::kAttnOutput;
  if (text == "key_weighted") return ValueTarget::kKeyWeighted;
  if (text == "raw") return ValueTarget::kRaw;
  KVQ_CHECK(false, kInvalidArgument, "value target '", text,
            "' (attn_output, key_weighted or raw)");
  return ValueTarget::kAttnOutput;
}

RotationRecipe ParseRotationRecipe(const std::string& text) {
  std::string names;
  for (const NamedRecipe& named : kRecipes) {
    if (text == named.name) return named.recipe;
    names += names.empty() ? named.name : std::string(", ") + named.name;
  }
  KVQ_CHECK(false, kInvalidArgument, "rotation '", text, "' (", names, ")");
  return RotationRecipe::kOscar;
}

void RawTargetRotations(const Activations& acts, int layer, Granularity granularity,
                        std::vector<float>* keys, std::vector<float>* values) {
  ValidateActivations(acts);
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", info.num_layers, ")");
  std::vector<MatrixXd> k(info.num_kv_heads), v(info.num_kv_heads);
  std::vector<const MatrixXd*> kp, vp;
  for (int h = 0; h < info.num_kv_heads; ++h) {
    k[h] = RawCovariance(acts, layer, h, true, info.calib_tokens);
    v[h] = RawCovariance(acts, layer, h, false, info.calib_tokens);
    kp.push_back(&k[h]);
    vp.push_back(&v[h]);
  }
  *keys = RawRotationsFrom(kp, granularity, info.head_dim);
  *values = RawRotationsFrom(vp, granularity, info.head_dim);
}

void AddRawTargetRotations(const Activations& acts, Calibration* cal) {
  const ActivationsInfo& a = acts.info;
  const CalibrationInfo& c = cal->info;
  KVQ_CHECK(c.num_layers == a.num_layers && c.num_kv_heads == a.num_kv_heads &&
                c.head_dim == a.head_dim,
            kShapeMismatch, "calibration has ", c.num_layers, " layers x ", c.num_kv_heads,
            " KV heads x d=", c.head_dim, " but the activations have ", a.num_layers,
            " layers x ", a.num_kv_heads, " KV heads x d=", a.head_dim);
  const Granularity granularity = ParseGranularity(c.granularity);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerCalibration& layer = cal->layers[l];
    RawTargetRotations(acts, l, granularity, &layer.raw_k_rotation, &layer.raw_v_rotation);
  }
  ValidateCalibration(*cal);
}

std::vector<float> Fp8Scales(const Activations& acts, int layer, bool keys,
                             const WriteParams& side, const cpu::Backend& backend) {
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", info.num_layers, ")");
  KVQ_CHECK(side.rotation != RotationKind::kDense, kUnsupported,
            "fp8 scales after a dense rotation are not supported (identity or FWHT)");
  const int d = info.head_dim;
  std::vector<float> scales(static_cast<size_t>(info.num_kv_heads));
  for (int h = 0; h < info.num_kv_heads; ++h) {
    std::vector<float> rows = GatherRows(acts, layer, h, keys, {{0, info.calib_tokens}});
    for (float& x : rows) x = RoundToBf16(x);
    const size_t n = rows.size() / static_cast<size_t>(d);
    std::vector<float> rotated(rows.size());
    cpu::Rotate(backend, side, nullptr, rows.data(), rotated.data(), n);
    float amax = 0.0f;
    for (float x : rotated) amax = std::fabs(x) > amax ? std::fabs(x) : amax;
    scales[static_cast<size_t>(h)] = amax == 0.0f ? 1.0f : amax / kE4m3Max;
  }
  return scales;
}

Calibration Calibrate(const Activations& acts, const CalibrationOptions& o,
                      const cpu::Backend& backend, const ProgressCallback& progress,
                      ClipReport* report) {
  ValidateActivations(acts);
  // Besides oscar: the schemes whose fp8 scales come from a calibration (CalibrationForScheme
  // adds them at the end).
  KVQ_CHECK(o.scheme == "oscar" || SchemeByName(o.scheme).scale == ScalePolicy::kCalibration,
            kInvalidArgument, "calibration scheme '", o.scheme, "': kvq calibrate makes oscar's "
            "rotations and clip ratios, plus the fp8 scales of the schemes that read them (",
            "fp8, fp8_hadamard)");
  const ActivationsInfo& info = acts.info;
  // The clip searches' parameters, K's and V's (validated: names an unsupported d, G or b).
  const params::Write search = params::Write().head_dim(info.head_dim).group(o.group);
  const WriteParams key_params = params::Write(search).bits(o.bits);
  const WriteParams value_params = params::Write(search).bits(o.v_bits != 0 ? o.v_bits : o.bits);
  KVQ_CHECK(std::isfinite(o.damping) && o.damping >= 0, kInvalidArgument, "damping ", o.damping,
            " must be finite and >= 0");
  KVQ_CHECK(o.threads >= 1, kInvalidArgument, "threads ", o.threads, " must be >= 1");
  const int64_t tokens = info.calib_tokens;
  const int64_t sequence = info.segment_tokens > 0 ? info.segment_tokens : tokens;
  KVQ_CHECK(o.sink >= 0 && o.sink < sequence, kInvalidArgument, "sink ", o.sink,
            " must lie in [0, ", info.segment_tokens > 0 ? "segment_tokens" : "calib_tokens",
            " = ", sequence, ") so that clip rows remain");
  // Clip rows: every calibration token outside its sequence's BF16 sink.
  const std::vector<std::pair<int64_t, int64_t>> clip_ranges = RowsAfterSink(info, tokens, o.sink);
  KVQ_CHECK(o.recent >= 1, kInvalidArgument, "recent ", o.recent, " must be >= 1");
  const std::vector<double> grid = o.clip_grid.empty() ? DefaultClipGrid() : o.clip_grid;
  ValidateClipGrid(grid);

  const int layers = info.num_layers;
  const int hkv = info.num_kv_heads;
  const int d = info.head_dim;
  const int total = layers * hkv + layers;
  int done = 0;
  auto tick = [&]() {
    ++done;
    if (progress) progress(done, total);
  };

  // Stage 1: targets per (layer, KV head).
  std::vector<HeadTargets> targets(static_cast<size_t>(layers) * hkv);
  ParallelItems(
      layers * hkv, o.threads,
      [&](int unit) {
        const int l = unit / hkv;
        const int h = unit % hkv;
        HeadTargets& t = targets[unit];
        t.query = QueryCovariance(acts, l, h, tokens);
        switch (o.value_target) {
          case ValueTarget::kAttnOutput:
            t.value = ComputeAttentionStatistics(acts, l, h, tokens, false).output_covariance;
            break;
          case ValueTarget::kKeyWeighted: {
            const AttentionStatistics stats = ComputeAttentionStatistics(acts, l, h, tokens, true);
            t.value = KeyWeightedValueCovariance(acts, l, h, tokens, stats.key_weight);
            break;
          }
          case ValueTarget::kRaw: t.value = RawCovariance(acts, l, h, false, tokens); break;
        }
        t.raw_key = RawCovariance(acts, l, h, true, tokens);
        t.raw_value = RawCovariance(acts, l, h, false, tokens);
      },
      tick);

  // Stage 2: eigenbases, rotations and clip ratios per layer.
  Calibration cal;
  CalibrationInfo& out = cal.info;
  out.num_layers = layers;
  out.num_kv_heads = hkv;
  out.head_dim = d;
  out.group = o.group;
  out.bits = o.bits;
  out.v_bits = o.v_bits != 0 && o.v_bits != o.bits ? o.v_bits : 0;
  out.sink = o.sink;
  out.recent = o.recent;
  out.scheme = "oscar";
  out.rotation = RotationRecipeName(o.rotation);
  out.granularity = GranularityName(o.granularity);
  out.value_target = ValueTargetName(o.value_target);
  out.source = o.source;
  cal.layers.resize(layers);
  if (report) {
    report->grid = grid;
    report->key_objectives.assign(layers, {});
    report->value_objectives.assign(layers, {});
  }
  ParallelItems(
      layers, o.threads,
      [&](int l) {
        LayerCalibration& layer = cal.layers[l];
        const size_t matrices = static_cast<size_t>(hkv) * d * d;
        const bool raw = o.rotation == RotationRecipe::kRawTarget;
        const HeadTargets* layer_targets = &targets[static_cast<size_t>(l) * hkv];
        for (int side = 0; side < 2; ++side) {
          const bool keys = side == 0;
          std::vector<float>& rotation = layer.heads(side).rotation;
          std::vector<float>& basis = keys ? layer.k_basis : layer.v_basis;
          std::vector<float>& eigenvalues = keys ? layer.k_eigenvalues : layer.v_eigenvalues;
          rotation.resize(matrices);
          basis.resize(matrices);
          eigenvalues.resize(static_cast<size_t>(hkv) * d);
          // What R diagonalises: C_Q (keys) or the value target, or KᵀK/N / VᵀV/N (raw_target).
          auto target = [&](int h) -> const MatrixXd& {
            const HeadTargets& t = layer_targets[h];
            return keys ? (raw ? t.raw_key : t.query) : (raw ? t.raw_value : t.value);
          };
          if (o.granularity == Granularity::kLayer) {
            MatrixXd mean = MatrixXd::Zero(d, d);
            for (int h = 0; h < hkv; ++h) mean += target(h);
            mean /= hkv;
            const SideResult built = BuildSide(mean, o, static_cast<uint64_t>(l) * 2 + side, d);
            for (int h = 0; h < hkv; ++h) Store(built, h, d, rotation, basis, eigenvalues);
          } else {
            for (int h = 0; h < hkv; ++h) {
              const uint64_t path = (static_cast<uint64_t>(l) * hkv + h) * 2 + side;
              Store(BuildSide(target(h), o, path, d), h, d, rotation, basis, eigenvalues);
            }
          }
          std::vector<const MatrixXd*> raw_targets;
          for (int h = 0; h < hkv; ++h) {
            raw_targets.push_back(keys ? &layer_targets[h].raw_key : &layer_targets[h].raw_value);
          }
          (keys ? layer.raw_k_rotation : layer.raw_v_rotation) =
              RawRotationsFrom(raw_targets, o.granularity, d);
          // Clip: the error of each head's rows weighted by that head's own attention-aware
          // target (C_Q for K, the chosen value target for V), summed over the layer's heads.
          std::vector<std::vector<float>> rows(hkv);
          std::vector<ClipRows> heads(hkv);
          for (int h = 0; h < hkv; ++h) {
            const HeadTargets& t = layer_targets[h];
            rows[h] = GatherRows(acts, l, h, keys, clip_ranges);
            const size_t n = rows[h].size() / static_cast<size_t>(d);
            const float* r = layer.rotation_of(side, h, d);
            heads[h] = {r, rows[h].data(), n, RotatedMetric(r, keys ? t.query : t.value)};
          }
          const std::vector<double> objectives =
              ClipObjectives(backend, keys ? key_params : value_params, heads, grid);
          layer.heads(side).clip.assign(hkv,
                                        static_cast<float>(grid[ArgMinObjective(objectives)]));
          if (report) (keys ? report->key_objectives : report->value_objectives)[l] = objectives;
        }
      },
      tick);
  // Only fp8 scales come here (checked above): they depend on no scheme option.
  if (o.scheme != "oscar") {
    cal = CalibrationForScheme(o.scheme, cal, &acts, backend, SchemeOptions());
  }
  ValidateCalibration(cal);
  return cal;
}

}  // namespace kvq::calib
