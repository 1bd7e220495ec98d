#include "kvq/calib/eval.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/parallel.h"
#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

double* Field(HeadMetrics& m, size_t index) {
  double* fields[] = {&m.k_rel_mse,      &m.v_rel_mse,     &m.logit_rel_mse,
                      &m.rope_logit_mae, &m.sv_rel_mse,    &m.attn_kl,
                      &m.top10_overlap,  &m.output_rel_mse, &m.tr_ek,
                      &m.group_range,    &m.bits_per_element};
  return fields[index];
}

HeadMetrics MeanOf(const std::vector<HeadMetrics>& heads) {
  HeadMetrics mean;
  const size_t metrics = MetricNames().size();
  for (size_t f = 0; f < metrics; ++f) {
    double sum = 0.0;
    for (const HeadMetrics& h : heads) sum += MetricValue(h, f);
    *Field(mean, f) = sum / static_cast<double>(heads.size());
  }
  double history = 0.0;
  for (const HeadMetrics& h : heads) {
    history += static_cast<double>(h.history_tokens);
    mean.attend_check = std::max(mean.attend_check, h.attend_check);
  }
  mean.history_tokens = static_cast<int64_t>(std::llround(history / heads.size()));
  return mean;
}

std::string Format(double v) {
  char buf[32];
  if (std::isnan(v)) return "-";
  if (v == 0.0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e-2 && a < 1e4) {
    std::snprintf(buf, sizeof buf, "%.4g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.3e", v);
  }
  return buf;
}

}  // namespace

const std::vector<std::string>& MetricNames() {
  static const std::vector<std::string> names = {
      "k_rel_mse",     "v_rel_mse",      "logit_rel_mse", "rope_logit_mae",
      "sv_rel_mse",    "attn_kl",        "top10_overlap", "output_rel_mse",
      "tr_ek",         "group_range",    "bits_per_element"};
  return names;
}

double MetricValue(const HeadMetrics& m, size_t index) {
  KVQ_CHECK(index < MetricNames().size(), kInvalidArgument, "metric index ", index,
            " out of range");
  return *Field(const_cast<HeadMetrics&>(m), index);
}

const SchemeResult& EvalResult::Get(const std::string& name) const {
  for (const SchemeResult& s : schemes) {
    if (s.name == name) return s;
  }
  KVQ_CHECK(false, kInvalidArgument, "scheme '", name, "' is not in this evaluation");
  return schemes.front();
}

namespace {

// The capture tokens that lead the evaluated sequence (MetricOptions::prefix_tokens).
int64_t PrefixTokens(const ActivationsInfo& info, const EvalOptions& options) {
  if (info.segment_tokens > 0) {
    // A segmented capture (kvq capture of several windows): the held-out part must be one
    // window, which starts with its own sink, so nothing is prepended.
    KVQ_CHECK(info.tokens - info.calib_tokens == info.segment_tokens, kInvalidArgument,
              "kvq eval scores one held-out sequence, but the capture holds ",
              (info.tokens - info.calib_tokens) / info.segment_tokens,
              " held-out windows of segment_tokens = ", info.segment_tokens,
              " (capture with exactly one window after the calibration windows)");
    return 0;
  }
  return options.sink_prefix ? std::min<int64_t>(options.scheme.sink, info.calib_tokens) : 0;
}

// Refuses an evaluation in which some quantized scheme holds no token quantized even at the
// last query position (history H(T) = 0, CacheParams::HistoryTokens): every row of its cache
// would be the bf16 reference, and its table row would read as an exact INT-b scheme. Names
// the schemes by their windows, the sequence and its parts.
void CheckHistoryReached(const std::vector<std::string>& names,
                         const std::vector<LayerScheme>& built, int layers, int64_t prefix,
                         int64_t heldout) {
  const int64_t t = prefix + heldout;
  std::string unreached;  // "oscar, naive (S0 = 64, W = 256, F = 1); kivi (...)"
  std::string last_windows;
  for (size_t s = 0; s < names.size(); ++s) {
    const CacheParams& p = built[s * static_cast<size_t>(layers)].params;
    if (!p.quantized() || p.HistoryTokens(t) > 0) continue;
    const std::string windows = detail::Concat(" (S0 = ", p.sink, ", W = ", p.recent,
                                               ", F = ", p.flush, ")");
    if (!unreached.empty() && windows != last_windows) unreached += last_windows + "; ";
    else if (!unreached.empty()) unreached += ", ";
    unreached += names[s];
    last_windows = windows;
  }
  KVQ_CHECK(unreached.empty(), kInvalidArgument,
            "no token reaches the quantized history of ", unreached, last_windows,
            ": the evaluated sequence has ", t, " tokens (", prefix,
            " capture tokens as its sink + ", heldout, " held out) and all of them stay in "
            "the bf16 windows, so these rows would read as exact; evaluate a capture with more "
            "held-out tokens, or give a smaller --sink / --recent");
}

}  // namespace

EvalResult Evaluate(const Activations& acts, const Calibration* cal, const EvalOptions& options,
                    const cpu::Backend& backend, const EvalProgress& progress) {
  ValidateActivations(acts);
  KVQ_CHECK(options.threads >= 1, kInvalidArgument, "threads ", options.threads,
            " must be >= 1");
  std::vector<std::string> names = options.schemes;
  if (names.empty()) names = ParseSchemeList("all");
  bool wants_raw_target = false;
  for (const std::string& n : names) {
    wants_raw_target = wants_raw_target || SchemeByName(n).rotation_k == SchemeRotation::kRawTarget;
  }
  // A format_version 1 calibration lacks the raw-target rotations: make them from this
  // capture's calibration tokens exactly as kvq calibrate would have.
  std::unique_ptr<Calibration> completed;
  if (cal != nullptr && wants_raw_target && !cal->HasRawTargetRotations()) {
    completed = std::make_unique<Calibration>(*cal);
    AddRawTargetRotations(acts, completed.get());
    cal = completed.get();
  }

  const ActivationsInfo& info = acts.info;
  PrefixTokens(info, options);  // a capture eval cannot score fails before any work
  const int layers = info.num_layers;
  const int hkv = info.num_kv_heads;
  const int num_schemes = static_cast<int>(names.size());
  const int total = num_schemes * layers + layers * hkv;
  int done = 0;
  auto tick = [&]() {
    ++done;
    if (progress) progress(done, total);
  };

  // The fp8 schemes' scales and blockgtq's widths from this capture's calibration tokens where
  // the calibration has none of theirs (CalibrationForScheme, at the options the schemes are
  // built with): one calibration per scheme that needs its own.
  std::vector<Calibration> own(static_cast<size_t>(num_schemes));
  std::vector<const Calibration*> cal_of(static_cast<size_t>(num_schemes), cal);
  for (int s = 0; s < num_schemes; ++s) {
    if (cal != nullptr && !CalibrationServes(*cal, names[s])) {
      own[s] = CalibrationForScheme(names[s], *cal, &acts, backend, options.scheme);
      cal_of[s] = &own[s];
    }
  }

  // Stage 1: each scheme's per-layer cache configuration (raw_target runs eigensolvers here).
  std::vector<LayerScheme> built(static_cast<size_t>(num_schemes) * layers);
  ParallelItems(
      num_schemes * layers, options.threads,
      [&](int unit) {
        built[unit] = BuildLayerScheme(names[unit / layers], acts, cal_of[unit / layers],
                                       unit % layers, options.scheme);
      },
      tick);

  // Before stage 2: every quantized scheme must hold some token quantized at the last query.
  const int64_t prefix = PrefixTokens(info, options);
  CheckHistoryReached(names, built, layers, prefix, info.tokens - info.calib_tokens);

  // Stage 2: per (layer, KV head) the reference once, then every scheme through its cache.
  EvalResult result;
  result.info = info;
  result.options = options.scheme;
  result.raw_target_from_activations = completed != nullptr;
  result.schemes.resize(num_schemes);
  for (int s = 0; s < num_schemes; ++s) {
    result.schemes[s].name = names[s];
    result.schemes[s].heads.resize(static_cast<size_t>(layers) * hkv);
  }
  std::vector<int64_t> query_positions(static_cast<size_t>(layers) * hkv);
  MetricOptions metric_options = options.metrics;
  metric_options.prefix_tokens = prefix;
  result.prefix_tokens = prefix;
  ParallelItems(
      layers * hkv, options.threads,
      [&](int unit) {
        const int l = unit / hkv;
        const int h = unit % hkv;
        const HeldOutHead data = PrepareHeldOut(acts, l, h, metric_options);
        query_positions[unit] = data.tokens - data.first_query;
        for (int s = 0; s < num_schemes; ++s) {
          const LayerScheme head = SliceKvHead(built[static_cast<size_t>(s) * layers + l], h);
          result.schemes[s].heads[unit] = EvaluateHead(data, head, backend, options.metrics);
        }
      },
      tick);

  result.heldout_tokens = info.tokens - info.calib_tokens;
  result.query_positions = query_positions.front();
  for (SchemeResult& s : result.schemes) {
    s.mean = MeanOf(s.heads);
    result.attend_check_max = std::max(result.attend_check_max, s.mean.attend_check);
  }
  return result;
}

std::string FormatTable(const EvalResult& r) {
  const std::vector<std::string>& metrics = MetricNames();
  std::string out;
  char line[512];
  // The shared width the schemes of shared width take: "2-bit", or K and V apart ("K3V2").
  const int k_bits = r.options.k_bits != 0 ? r.options.k_bits : r.options.bits;
  const int v_bits = r.options.v_bits != 0 ? r.options.v_bits : r.options.bits;
  const std::string width = k_bits == v_bits ? std::to_string(k_bits) + "-bit"
                                             : "K" + std::to_string(k_bits) + "V" +
                                                   std::to_string(v_bits);
  std::snprintf(line, sizeof line,
                "sequence: first %lld capture tokens (sink) + %lld held-out tokens; queries: last "
                "%lld positions x %d query heads per KV head; %d layers x %d KV heads, d=%d, "
                "S0=%d, W=%d, G=%d, %s; means over layers and heads\n",
                static_cast<long long>(r.prefix_tokens), static_cast<long long>(r.heldout_tokens),
                static_cast<long long>(r.query_positions), r.info.group_size(),
                r.info.num_layers, r.info.num_kv_heads, r.info.head_dim, r.options.sink,
                r.options.recent, r.options.group, width.c_str());
  out += line;
  size_t name_width = 6;
  for (const SchemeResult& s : r.schemes) name_width = std::max(name_width, s.name.size());
  std::vector<size_t> widths;
  for (const std::string& m : metrics) widths.push_back(std::max<size_t>(m.size(), 10));
  std::snprintf(line, sizeof line, "%-*s", static_cast<int>(name_width), "scheme");
  out += line;
  for (size_t f = 0; f < metrics.size(); ++f) {
    std::snprintf(line, sizeof line, "  %*s", static_cast<int>(widths[f]), metrics[f].c_str());
    out += line;
  }
  out += "\n";
  for (const SchemeResult& s : r.schemes) {
    std::snprintf(line, sizeof line, "%-*s", static_cast<int>(name_width), s.name.c_str());
    out += line;
    for (size_t f = 0; f < metrics.size(); ++f) {
      std::snprintf(line, sizeof line, "  %*s", static_cast<int>(widths[f]),
                    Format(MetricValue(s.mean, f)).c_str());
      out += line;
    }
    out += "\n";
  }
  return out;
}

std::string Summarize(const EvalResult& r) {
  auto find = [&](const std::string& name) -> const SchemeResult* {
    for (const SchemeResult& s : r.schemes) {
      if (s.name == name) return &s;
    }
    return nullptr;
  };
  std::string out;
  char line[512];
  const SchemeResult* oscar = find("oscar");
  if (oscar != nullptr) {
    const double o = oscar->mean.output_rel_mse;
    std::string versus;
    for (const char* other : {"hadamard", "naive"}) {
      const SchemeResult* s = find(other);
      if (s == nullptr) continue;
      const double e = s->mean.output_rel_mse;
      if (o > 0 && e > 0 && std::isfinite(o) && std::isfinite(e)) {
        const double ratio = e / o;
        const bool lower = ratio >= 1.0;
        std::snprintf(line, sizeof line, "%s%.3gx %s than %s's (%.3g)",
                      versus.empty() ? "" : ", ", lower ? ratio : 1.0 / ratio,
                      lower ? "lower" : "higher", other, e);
      } else {
        // No ratio of a zero or non-finite error.
        std::snprintf(line, sizeof line, "%s%s's is %.3g", versus.empty() ? "" : ", ", other, e);
      }
      versus += line;
    }
    std::snprintf(line, sizeof line,
                  "OSCAR's attention-output relative MSE is %.3g at %.2f bits per element%s%s.\n",
                  o, oscar->mean.bits_per_element, versus.empty() ? "" : ": ", versus.c_str());
    out += line;
  }
  // Ordering of the quantized schemes (the catalogue's format column) by attention-output error.
  std::vector<const SchemeResult*> order;
  for (const SchemeResult& s : r.schemes) {
    if (SchemeByName(s.name).quantized()) order.push_back(&s);
  }
  std::stable_sort(order.begin(), order.end(), [](const SchemeResult* a, const SchemeResult* b) {
    return a->mean.output_rel_mse < b->mean.output_rel_mse;
  });
  if (!order.empty()) {
    out += "Attention-output error, best to worst: ";
    for (size_t i = 0; i < order.size(); ++i) {
      std::snprintf(line, sizeof line, "%s%s %.3g", i == 0 ? "" : ", ", order[i]->name.c_str(),
                    order[i]->mean.output_rel_mse);
      out += line;
    }
    out += ".\n";
  }
  return out;
}

}  // namespace kvq::calib
