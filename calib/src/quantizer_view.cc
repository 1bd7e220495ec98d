#include "kvq/calib/quantizer_view.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <filesystem>

#include "kvq/calib/clip_search.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/model.h"
#include "kvq/calib/parallel.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/report.h"
#include "kvq/calib/rope_logit.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {
namespace {

// Mean over rows of e·M·eᵀ, e = rotated − dequantized (both [n, d]).
double WeightedResidual(const std::vector<float>& rotated, const std::vector<float>& dequantized,
                        const Eigen::MatrixXd& metric, size_t n, int d) {
  Eigen::MatrixXd e(static_cast<Eigen::Index>(n), d);
  for (size_t r = 0; r < n; ++r) {
    for (int c = 0; c < d; ++c) {
      const size_t i = r * d + c;
      e(static_cast<Eigen::Index>(r), c) =
          static_cast<double>(rotated[i]) - static_cast<double>(dequantized[i]);
    }
  }
  const Eigen::MatrixXd em = e * metric;
  return (em.array() * e.array()).sum() / static_cast<double>(n);
}

double GroupRange(const float* row, int d, int group) {
  double sum = 0;
  for (int g = 0; g < d / group; ++g) {
    const float* x = row + g * group;
    const auto [lo, hi] = std::minmax_element(x, x + group);
    sum += static_cast<double>(*hi) - static_cast<double>(*lo);
  }
  return sum / (d / group);
}

KeyView ViewOneHead(const Activations& eval_acts, const Activations& calib_acts,
                    const LayerScheme& scheme, int layer, int h,
                    const std::vector<std::pair<int64_t, int64_t>>& ranges,
                    const cpu::Backend& backend) {
  const int d = eval_acts.info.head_dim;
  WriteParams w = scheme.params.key;
  if (!scheme.key.clip.empty()) w.clip = scheme.key.clip[h];
  const float* dense = scheme.key.rotation.empty()
                           ? nullptr
                           : scheme.key.rotation.data() + static_cast<size_t>(h) * d * d;
  KeyView v;
  v.layer = layer;
  v.kv_head = h;
  v.clip = w.clip;

  std::vector<float> x;
  for (const auto& [first, last] : ranges) {
    for (int64_t t = first; t < last; ++t) {
      const float* k = eval_acts.k(layer, t, h);
      x.insert(x.end(), k, k + d);
    }
  }
  const size_t n = x.size() / d;
  v.rows = static_cast<int64_t>(n);

  // The key mean and what is left around it.
  std::vector<double> mu(d, 0.0);
  for (size_t r = 0; r < n; ++r) {
    for (int c = 0; c < d; ++c) mu[c] += x[r * d + c];
  }
  for (double& m : mu) m /= static_cast<double>(n);
  std::vector<float> centred(x.size()), mu_f(d);
  double spread = 0, mean_norm = 0;
  for (int c = 0; c < d; ++c) {
    mu_f[c] = static_cast<float>(mu[c]);
    mean_norm += mu[c] * mu[c];
  }
  for (size_t r = 0; r < n; ++r) {
    for (int c = 0; c < d; ++c) {
      const double dev = x[r * d + c] - mu[c];
      spread += dev * dev;
      centred[r * d + c] = static_cast<float>(dev);
    }
  }
  v.mean_energy = mean_norm / (spread / static_cast<double>(n));

  // The rotation as a matrix, the two C_Q's in its coordinates.
  const std::vector<float> map = EffectiveRotation(w, dense, backend);
  const Eigen::MatrixXd calib_metric = RotatedMetric(
      map.data(), QueryCovariance(calib_acts, layer, h, calib_acts.info.calib_tokens));
  const Eigen::MatrixXd eval_metric =
      RotatedMetric(map.data(), QueryCovariance(eval_acts, layer, h, eval_acts.info.tokens));
  const Eigen::VectorXd diag = calib_metric.diagonal();
  v.importance = diag.maxCoeff() / diag.mean();

  // (with the head's arrays: a codebook head's widths, Block-GTQ's allocation)
  const HeadArrays arrays = scheme.key.Arrays(w, h);
  const cpu::QuantizedRows q = cpu::QuantizeRows(backend, w, arrays, x.data(), n);
  double max_abs = 0, range = 0, tr = 0;
  std::vector<float> clipped(d);
  for (size_t r = 0; r < n; ++r) {
    const float* row = q.rotated.data() + r * d;
    // A format whose rows are not clipped records no tau (codebook): the row as it is.
    const float tau = q.tau.empty() ? std::numeric_limits<float>::infinity() : q.tau[r];
    for (int c = 0; c < d; ++c) {
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(row[c])));
      clipped[c] = row[c] > tau ? tau : (row[c] < -tau ? -tau : row[c]);
      const double e = static_cast<double>(row[c]) - q.dequantized[r * d + c];
      tr += e * e;
    }
    range += GroupRange(clipped.data(), d, w.group);
  }
  v.max_abs = max_abs;
  v.group_range = range / static_cast<double>(n);
  v.tr_ek = tr / static_cast<double>(n);
  v.weighted = WeightedResidual(q.rotated, q.dequantized, eval_metric, n, d);

  // RoPE-logit MAE: the dequantized rows back in the original (post-RoPE) space, each with
  // the evaluated capture's queries of its own token.
  {
    std::vector<float> restored(q.dequantized.size());
    cpu::RotateInverse(backend, w, dense, q.dequantized.data(), restored.data(), n);
    const ActivationsInfo& info = eval_acts.info;
    const int g = info.group_size();
    RopeLogitMae mae(d, info.rope_base);
    std::vector<double> error(d), queries(static_cast<size_t>(g) * d);
    size_t r = 0;
    for (const auto& [first, last] : ranges) {
      for (int64_t t = first; t < last; ++t, ++r) {
        for (int c = 0; c < d; ++c) {
          error[c] = static_cast<double>(restored[r * d + c]) - x[r * d + c];
        }
        for (int j = 0; j < g; ++j) {
          const float* qr = eval_acts.q(layer, t, h * g + j);
          std::copy(qr, qr + d, queries.begin() + static_cast<size_t>(j) * d);
        }
        mae.Add(error.data(), queries.data(), g,
                static_cast<double>(t - info.SegmentStart(t)));
      }
    }
    v.rope_logit_mae = mae.Mean();
  }

  const cpu::QuantizedRows qc = cpu::QuantizeRows(backend, w, arrays, centred.data(), n);
  v.weighted_centred = WeightedResidual(qc.rotated, qc.dequantized, eval_metric, n, d);

  std::vector<float> mu_rotated(d);
  WriteParams rotate_only = w;
  rotate_only.clip = 1.0f;
  cpu::Rotate(backend, rotate_only, dense, mu_f.data(), mu_rotated.data(), 1);
  v.mean_range = GroupRange(mu_rotated.data(), d, w.group);
  return v;
}

std::string Number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

const std::vector<std::string>& KeyViewMetricNames() {
  static const std::vector<std::string> names = {
      "max_abs", "group_range", "importance", "tr_ek", "weighted", "weighted_centred",
      "mean_range", "mean_energy", "rope_logit_mae"};
  return names;
}

double KeyViewMetric(const KeyView& v, size_t index) {
  switch (index) {
    case 0: return v.max_abs;
    case 1: return v.group_range;
    case 2: return v.importance;
    case 3: return v.tr_ek;
    case 4: return v.weighted;
    case 5: return v.weighted_centred;
    case 6: return v.mean_range;
    case 7: return v.mean_energy;
    case 8: return v.rope_logit_mae;
  }
  KVQ_CHECK(false, kInvalidArgument, "key view metric index ", index, " out of range");
  return 0;
}

QuantizerView ComputeQuantizerView(const Activations& eval_acts, const Activations& calib_acts,
                                   const Calibration* cal, const QuantizerViewOptions& options,
                                   const cpu::Backend& backend,
                                   const std::function<void(int done, int total)>& progress) {
  ValidateActivations(eval_acts);
  ValidateActivations(calib_acts);
  const ActivationsInfo& e = eval_acts.info;
  const ActivationsInfo& c = calib_acts.info;
  KVQ_CHECK(e.num_layers == c.num_layers && e.num_q_heads == c.num_q_heads &&
                e.num_kv_heads == c.num_kv_heads && e.head_dim == c.head_dim,
            kShapeMismatch, "qview: the evaluated capture has ", e.num_layers, " layers, Hq=",
            e.num_q_heads, ", Hkv=", e.num_kv_heads, ", d=", e.head_dim,
            "; the calibration capture ", c.num_layers, ", ", c.num_q_heads, ", ",
            c.num_kv_heads, ", ", c.head_dim);
  KVQ_CHECK(!options.schemes.empty(), kInvalidArgument, "qview: no scheme to view");
  for (const SchemeVariant& v : options.schemes) {
    const Format f = SchemeByName(v.scheme).format_k;
    KVQ_CHECK(f == Format::kAffineToken || f == Format::kCodebook, kInvalidArgument,
              "qview: scheme '", v.label,
              "' does not store its keys per token (affine_token or codebook); the view is "
              "per-token");
  }
  const int64_t sequence = e.segment_tokens > 0 ? e.segment_tokens : e.tokens;
  KVQ_CHECK(options.scheme.sink >= 0 && options.scheme.sink < sequence, kInvalidArgument,
            "qview: sink ", options.scheme.sink, " leaves no row in sequences of ", sequence,
            " tokens");

  ModelConfig config;
  config.num_layers = e.num_layers;
  config.num_q_heads = e.num_q_heads;
  config.num_kv_heads = e.num_kv_heads;
  config.head_dim = e.head_dim;
  PplOptions ppl;
  ppl.schemes = options.schemes;
  ppl.scheme = options.scheme;
  ppl.clip_grid = options.clip_grid;
  ppl.threads = options.threads;
  const int units = e.num_layers * e.num_kv_heads;
  const int variants = static_cast<int>(options.schemes.size());
  const int built_units = variants * e.num_layers;
  const int total = built_units + variants * units;
  const std::vector<std::vector<LayerScheme>> layers = BuildVariantLayers(
      config, &calib_acts, cal, ppl, backend,
      progress ? PplProgress([&](int done, int) { progress(done, total); }) : nullptr);

  QuantizerView view;
  view.num_layers = e.num_layers;
  view.num_kv_heads = e.num_kv_heads;
  view.group = options.scheme.group;
  view.bits = options.scheme.bits;
  view.sink = options.scheme.sink;
  const auto ranges = RowsAfterSink(e, e.tokens, options.scheme.sink);
  view.views.assign(variants, std::vector<KeyView>(units));
  for (const SchemeVariant& v : options.schemes) view.labels.push_back(v.label);
  int done = built_units;
  ParallelItems(
      variants * units, options.threads,
      [&](int item) {
        const int s = item / units, unit = item % units;
        const int l = unit / e.num_kv_heads, h = unit % e.num_kv_heads;
        view.views[s][unit] =
            ViewOneHead(eval_acts, calib_acts, layers[s][l], l, h, ranges, backend);
      },
      progress ? std::function<void()>([&] { progress(++done, total); }) : nullptr);
  view.rows_per_head = view.views[0][0].rows;
  // The group the per-token codec used (saw's G = d beats options.group).
  view.group = layers[0][0].params.key.group;
  return view;
}

std::string QuantizerViewCsv(const QuantizerView& view) {
  std::string out = "label,layer,kv_head,clip_k,rows";
  for (const std::string& m : KeyViewMetricNames()) out += "," + m;
  out += "\n";
  for (size_t s = 0; s < view.labels.size(); ++s) {
    for (const KeyView& v : view.views[s]) {
      out += view.labels[s] + "," + std::to_string(v.layer) + "," + std::to_string(v.kv_head) +
             "," + Number(v.clip) + "," + std::to_string(v.rows);
      for (size_t m = 0; m < KeyViewMetricNames().size(); ++m) {
        out += "," + Number(KeyViewMetric(v, m));
      }
      out += "\n";
    }
  }
  return out;
}

std::string FormatQuantizerView(const QuantizerView& view) {
  std::string out;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "keys: %d layers x %d KV heads, %lld rows per head (positions >= S0=%d of each "
                "sequence), INT%d, G=%d; means over layers and heads\n",
                view.num_layers, view.num_kv_heads, static_cast<long long>(view.rows_per_head),
                view.sink, view.bits, view.group);
  out += buf;
  std::snprintf(buf, sizeof buf, "  %-26s %6s", "scheme", "rho_K");
  out += buf;
  for (const std::string& m : KeyViewMetricNames()) {
    std::snprintf(buf, sizeof buf, " %16s", m.c_str());
    out += buf;
  }
  out += "\n";
  for (size_t s = 0; s < view.labels.size(); ++s) {
    const std::vector<KeyView>& vs = view.views[s];
    double clip = 0;
    for (const KeyView& v : vs) clip += v.clip / vs.size();
    std::snprintf(buf, sizeof buf, "  %-26s %6.3f", view.labels[s].c_str(), clip);
    out += buf;
    for (size_t m = 0; m < KeyViewMetricNames().size(); ++m) {
      double mean = 0;
      for (const KeyView& v : vs) mean += KeyViewMetric(v, m) / vs.size();
      std::snprintf(buf, sizeof buf, " %16.4g", mean);
      out += buf;
    }
    out += "\n";
  }
  return out;
}

std::vector<std::string> WriteQuantizerViewPlots(const std::string& dir,
                                                 const QuantizerView& view) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KVQ_CHECK(!ec, kIoError, "cannot create plot directory '", dir, "': ", ec.message());
  std::vector<std::string> written;
  const int L = view.num_layers, hkv = view.num_kv_heads;
  const std::vector<std::string>& names = KeyViewMetricNames();
  for (size_t m = 0; m < names.size(); ++m) {
    std::vector<PlotSeries> series;
    const bool scheme_free = names[m] == "mean_energy";
    for (size_t s = 0; s < (scheme_free ? 1 : view.labels.size()); ++s) {
      PlotSeries p{scheme_free ? "keys" : view.labels[s], std::vector<double>(L, 0.0)};
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < hkv; ++h) p.y[l] += KeyViewMetric(view.views[s][l * hkv + h], m) / hkv;
      }
      series.push_back(std::move(p));
    }
    bool drawable = false;
    for (const PlotSeries& p : series) {
      for (double y : p.y) drawable = drawable || (std::isfinite(y) && y > 0);
    }
    if (!drawable) continue;
    const std::string path = (std::filesystem::path(dir) / ("keys_" + names[m] + ".svg")).string();
    const std::string svg = LinePlotSvg(
        "keys: " + names[m] + " per layer (INT" + std::to_string(view.bits) + ", G=" +
            std::to_string(view.group) + ", mean over KV heads; log scale)",
        "layer", names[m], series);
    WriteFile(path, std::vector<uint8_t>(svg.begin(), svg.end()));
    written.push_back(path);
  }
  return written;
}

}  // namespace kvq::calib
