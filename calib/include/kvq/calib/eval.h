// `kvq eval` as a library: every requested scheme on every (layer, KV head) of a capture's
// held-out tokens (metrics.h), per-head results plus the means the table and the JSON show.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/metrics.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

struct EvalOptions {
  std::vector<std::string> schemes;  // names (ParseSchemeList); empty means all
  SchemeOptions scheme;
  MetricOptions metrics;   // prefix_tokens is set from sink_prefix
  // Lead the evaluated sequence with the capture's first S0 tokens (its attention sinks), so
  // the cache's sink window holds what it holds in serving (metrics.h, MetricOptions).
  bool sink_prefix = true;
  int threads = 2;  // work split by (layer, KV head); any count gives the same numbers
};

// The metric names, in table and JSON order: k_rel_mse, v_rel_mse, logit_rel_mse,
// rope_logit_mae, sv_rel_mse, attn_kl, top10_overlap, output_rel_mse, tr_ek, group_range,
// bits_per_element.
const std::vector<std::string>& MetricNames();
// The value of metric `index` (MetricNames order) of `m`.
double MetricValue(const HeadMetrics& m, size_t index);

struct SchemeResult {
  std::string name;
  std::vector<HeadMetrics> heads;  // [L·Hkv], index layer·Hkv + kv_head
  HeadMetrics mean;                // each field the mean over heads (NaN if any head is NaN)
};

struct EvalResult {
  ActivationsInfo info;
  int64_t heldout_tokens = 0;   // T
  int64_t query_positions = 0;  // last positions evaluated per head
  int64_t prefix_tokens = 0;    // capture tokens leading the sequence (the sink window)
  SchemeOptions options;
  std::vector<SchemeResult> schemes;  // in the requested order
  double attend_check_max = 0;        // worst cpu::Attend cross-check over everything
  // The calibration was a format_version 1 file, so raw_target's rotations were made from the
  // capture's calibration tokens (AddRawTargetRotations) rather than read from it.
  bool raw_target_from_activations = false;
  const SchemeResult& Get(const std::string& name) const;  // throws naming the name
};

using EvalProgress = std::function<void(int done, int total)>;

// Throws kvq::Error: invalid activations; unknown schemes; a calibration needed by a scheme but
// null or not matching; threads < 1; whatever metrics.h and schemes.h reject. A calibration
// without raw-target rotations (format_version 1) gets them from `acts` when raw_target is
// evaluated (EvalResult::raw_target_from_activations).
EvalResult Evaluate(const Activations& acts, const Calibration* cal, const EvalOptions& options,
                    const cpu::Backend& backend, const EvalProgress& progress = {});

// A fixed-width text table, one row per scheme, one column per metric (means over layers and
// heads), preceded by a line giving T, query positions, S0, W, G and bits.
std::string FormatTable(const EvalResult& result);

// One or two sentences on what the table shows, computed from it: OSCAR's attention-output
// error against hadamard and naive (as ratios), and the ordering of the schemes by that error.
// Schemes missing from the result are left out of the sentence.
std::string Summarize(const EvalResult& result);

}  // namespace kvq::calib
