#include "kvq/calib/fair_clip.h"

#include <set>
#include <sstream>

#include "kvq/calib/clip_search.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/parallel.h"
#include "kvq/common/error.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {

const char* ClipChoiceName(ClipChoice choice) {
  switch (choice) {
    case ClipChoice::kCatalogue: return "catalogue";
    case ClipChoice::kOwn: return "own";
    case ClipChoice::kOscar: return "oscar";
    case ClipChoice::kNone: return "none";
  }
  return "unknown";
}

ClipChoice SchemeVariant::Resolved() const {
  if (clip != ClipChoice::kCatalogue) return clip;
  return SchemeClipsWithCalibration(scheme) ? ClipChoice::kOwn : ClipChoice::kNone;
}

std::vector<SchemeVariant> ParseSchemeVariants(const std::string& list, bool with_oscar_clip) {
  std::vector<SchemeVariant> out;
  std::set<std::string> labels;
  auto add = [&](SchemeVariant v) {
    KVQ_CHECK(labels.insert(v.label).second, kInvalidArgument, "scheme '", v.label,
              "' appears twice in list '", list, "'");
    out.push_back(std::move(v));
  };
  std::vector<std::string> items;
  if (list == "all") {
    for (const SchemeInfo& s : Schemes()) items.push_back(s.name);
  } else {
    std::stringstream stream(list);
    std::string item;
    while (std::getline(stream, item, ',')) {
      KVQ_CHECK(!item.empty(), kInvalidArgument, "empty scheme name in list '", list, "'");
      items.push_back(item);
    }
    KVQ_CHECK(!items.empty(), kInvalidArgument, "empty scheme list '", list, "'");
  }
  for (const std::string& item : items) {
    SchemeVariant v;
    const size_t at = item.find('@');
    v.scheme = item.substr(0, at);
    SchemeByName(v.scheme);  // throws naming the valid names
    v.label = item;
    if (at != std::string::npos) {
      const std::string suffix = item.substr(at + 1);
      if (suffix == "own") {
        v.clip = ClipChoice::kOwn;
      } else if (suffix == "oscar") {
        v.clip = ClipChoice::kOscar;
      } else if (suffix == "none") {
        v.clip = ClipChoice::kNone;
      } else {
        KVQ_CHECK(false, kInvalidArgument, "scheme '", item, "': unknown clip suffix '@", suffix,
                  "' (@own, @oscar or @none)");
      }
    }
    const bool clips = SchemeClipsWithCalibration(v.scheme);
    add(v);
    if (with_oscar_clip && at == std::string::npos && clips && v.scheme != "oscar") {
      SchemeVariant oscar_clip{v.scheme, ClipChoice::kOscar, v.scheme + "@oscar"};
      add(oscar_clip);
    }
  }
  return out;
}

ClipTargets ComputeClipTargets(const Activations& acts, ValueTarget value_target, int sink,
                               int threads) {
  ValidateActivations(acts);
  const ActivationsInfo& info = acts.info;
  const int64_t tokens = info.calib_tokens;
  const int64_t sequence = info.segment_tokens > 0 ? info.segment_tokens : tokens;
  KVQ_CHECK(sink >= 0 && sink < sequence, kInvalidArgument, "clip targets: sink ", sink,
            " leaves no clip rows in sequences of ", sequence, " tokens");
  ClipTargets t;
  t.num_layers = info.num_layers;
  t.num_kv_heads = info.num_kv_heads;
  const int units = info.num_layers * info.num_kv_heads;
  t.query.resize(units);
  t.value.resize(units);
  t.rows = RowsAfterSink(info, tokens, sink);
  ParallelItems(units, threads, [&](int unit) {
    const int l = unit / info.num_kv_heads, h = unit % info.num_kv_heads;
    t.query[unit] = QueryCovariance(acts, l, h, tokens);
    switch (value_target) {
      case ValueTarget::kAttnOutput:
        t.value[unit] = ComputeAttentionStatistics(acts, l, h, tokens, false).output_covariance;
        break;
      case ValueTarget::kKeyWeighted: {
        const AttentionStatistics stats = ComputeAttentionStatistics(acts, l, h, tokens, true);
        t.value[unit] = KeyWeightedValueCovariance(acts, l, h, tokens, stats.key_weight);
        break;
      }
      case ValueTarget::kRaw: t.value[unit] = RawCovariance(acts, l, h, false, tokens); break;
    }
  });
  return t;
}

std::vector<float> EffectiveRotation(const WriteParams& p, const float* dense,
                                     const cpu::Backend& backend) {
  const int d = p.head_dim;
  std::vector<float> identity(static_cast<size_t>(d) * d, 0.0f), r(identity.size());
  for (int i = 0; i < d; ++i) identity[static_cast<size_t>(i) * d + i] = 1.0f;
  WriteParams rotate_only = p;
  rotate_only.clip = 1.0f;
  cpu::Rotate(backend, rotate_only, dense, identity.data(), r.data(), d);
  return r;
}

namespace {


std::vector<float> GatherRowsOf(const Activations& acts, int layer, int head, bool keys,
                                const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const int d = acts.info.head_dim;
  std::vector<float> rows;
  for (const auto& [first, last] : ranges) {
    for (int64_t t = first; t < last; ++t) {
      const float* src = keys ? acts.k(layer, t, head) : acts.v(layer, t, head);
      rows.insert(rows.end(), src, src + d);
    }
  }
  return rows;
}

}  // namespace

std::pair<float, float> OwnClipRatios(const LayerScheme& scheme, const Activations& acts,
                                      const ClipTargets& targets, int layer,
                                      const std::vector<double>& grid,
                                      const cpu::Backend& backend) {
  const CacheParams& p = scheme.params;
  const int d = p.head_dim(), hkv = p.num_kv_heads;
  KVQ_CHECK(targets.num_layers == acts.info.num_layers && targets.num_kv_heads == hkv &&
                acts.info.num_kv_heads == hkv && acts.info.head_dim == d,
            kShapeMismatch, "own clip: the scheme (Hkv=", hkv, ", d=", d,
            "), the capture (Hkv=", acts.info.num_kv_heads, ", d=", acts.info.head_dim,
            ") and the targets (Hkv=", targets.num_kv_heads, ") disagree");
  KVQ_CHECK(layer >= 0 && layer < targets.num_layers, kInvalidArgument, "own clip: layer ", layer,
            " is outside [0, ", targets.num_layers, ")");
  KVQ_CHECK(p.quantized(), kInvalidArgument, "own clip: a bf16 scheme has nothing to clip");
  float ratio[2] = {1.0f, 1.0f};
  for (int side = 0; side < 2; ++side) {
    const bool keys = side == 0;
    const WriteParams& w = keys ? p.key : p.value;
    std::vector<std::vector<float>> rotations(hkv), rows(hkv);
    std::vector<ClipRows> heads(hkv);
    for (int h = 0; h < hkv; ++h) {
      const std::vector<float>& dense = scheme.heads(side).rotation;
      rotations[h] = EffectiveRotation(
          w, dense.empty() ? nullptr : dense.data() + static_cast<size_t>(h) * d * d, backend);
      rows[h] = GatherRowsOf(acts, layer, h, keys, targets.rows);
      const size_t unit = static_cast<size_t>(layer) * hkv + h;
      heads[h] = {rotations[h].data(), rows[h].data(), rows[h].size() / d,
                  RotatedMetric(rotations[h].data(),
                                keys ? targets.query[unit] : targets.value[unit])};
    }
    ratio[side] = static_cast<float>(grid[ArgMinObjective(ClipObjectives(backend, w, heads, grid))]);
  }
  return {ratio[0], ratio[1]};
}

void ApplyClipChoice(const SchemeVariant& variant, const Calibration* cal,
                     const Activations* acts, const ClipTargets* targets, int layer,
                     const std::vector<double>& grid, const cpu::Backend& backend,
                     LayerScheme* scheme) {
  if (!scheme->params.quantized()) return;
  const int hkv = scheme->params.num_kv_heads;
  switch (variant.Resolved()) {
    case ClipChoice::kOwn: {
      KVQ_CHECK(acts != nullptr && targets != nullptr, kInvalidArgument, "scheme '",
                variant.label, "' chooses its own clip: it needs the calibration capture");
      const auto [k, v] = OwnClipRatios(*scheme, *acts, *targets, layer, grid, backend);
      scheme->key.clip.assign(hkv, k);
      scheme->value.clip.assign(hkv, v);
      break;
    }
    case ClipChoice::kOscar:
      KVQ_CHECK(cal != nullptr, kInvalidArgument, "scheme '", variant.label,
                "' reuses OSCAR's clip ratios: it needs a calibration");
      KVQ_CHECK(layer < static_cast<int>(cal->layers.size()) &&
                    static_cast<int>(cal->layers[layer].key.clip.size()) == hkv,
                kShapeMismatch, "scheme '", variant.label, "': the calibration has no layer ",
                layer, " of ", hkv, " KV heads");
      scheme->key.clip = cal->layers[layer].key.clip;
      scheme->value.clip = cal->layers[layer].value.clip;
      break;
    case ClipChoice::kNone:
    case ClipChoice::kCatalogue:
      scheme->key.clip.clear();
      scheme->value.clip.clear();
      scheme->params.key.clip = scheme->params.value.clip = 1.0f;
      break;
  }
}

}  // namespace kvq::calib
