// Outputs of `kvq eval`: the JSON summary, per-head CSV, and hand-written SVG plots a person can
// open in a browser (per-layer error curves per scheme, eigenvalue spectra of the calibration).
#pragma once

#include <string>
#include <vector>

#include "kvq/calib/calibration_file.h"
#include "kvq/calib/eval.h"

namespace kvq::calib {

// {"schemes": {NAME: {"k_rel_mse": x, ..., "bits_per_element": x}}}: exactly the keys of
// MetricNames(), means over layers and heads; a NaN mean (nothing quantized) is written as null.
std::string EvalJson(const EvalResult& result);
void WriteEvalJson(const std::string& path, const EvalResult& result);

// One row per scheme × layer × KV head: scheme,layer,kv_head,<MetricNames()>,history_tokens,
// attend_check. The first line is the header.
std::string EvalCsv(const EvalResult& result);

// One series of a line plot: y[i] at x = i (layers), drawn on a log10 axis; non-positive or
// NaN points are skipped.
struct PlotSeries {
  std::string name;
  std::vector<double> y;
};

// A complete standalone SVG document (width × height px): title, axes with ticks and labels,
// log10 y axis over the data's decades, one coloured polyline with markers per series, legend.
// Throws kvq::Error(kInvalidArgument) when no series has a positive finite point.
std::string LinePlotSvg(const std::string& title, const std::string& x_label,
                        const std::string& y_label, const std::vector<PlotSeries>& series,
                        int width = 900, int height = 560);

// Writes into `dir` (created if missing): per_head.csv; layer_<metric>.svg for output_rel_mse,
// attn_kl, k_rel_mse, v_rel_mse, logit_rel_mse, rope_logit_mae, sv_rel_mse (y = mean over KV
// heads per layer, one curve per scheme); and, when `cal` is given, spectrum_keys.svg / spectrum_values.svg
// (eigenvalues, mean over KV heads, one curve per layer). Returns the paths written.
std::vector<std::string> WriteReport(const std::string& dir, const EvalResult& result,
                                     const Calibration* cal);

}  // namespace kvq::calib
