// Calibration targets in fp64 (seeds/000 §3, appendix A.3; shared/DESIGN.md "Calibration").
// Every function reads the first `tokens` tokens of one layer and one KV head of a validated
// capture (Activations, post-RoPE) and returns a d×d symmetric matrix.
#pragma once

#include <Eigen/Dense>
#include <cstdint>

#include "kvq/calib/activations.h"

namespace kvq::calib {

// C_Q = mean over the KV head's g = Hq/Hkv query heads (h·g .. h·g+g−1) and tokens [0, tokens)
// of qᵀq (uncentred second moment). Throws kvq::Error on a layer, head or token count out of
// range.
Eigen::MatrixXd QueryCovariance(const Activations& acts, int layer, int kv_head, int64_t tokens);

// (1/N)·XᵀX over tokens [0, tokens) of the KV head's keys (`keys` = true) or values.
Eigen::MatrixXd RawCovariance(const Activations& acts, int layer, int kv_head, bool keys,
                              int64_t tokens);

// What one streaming pass of causal attention over tokens [0, tokens) yields for one KV head,
// with S = softmax(q·Kᵀ/√d + causal mask) per row, rows of all g query heads of the KV head.
// In a segmented capture (ActivationsInfo::segment_tokens) a row attends to the keys of its
// own segment only, and the sink is counted from its segment's start.
struct AttentionStatistics {
  // C_S = (1/N)·OᵀO, O = S·V, N = g·tokens rows (the paper's Vᵀ Sᵀ S V / N).
  Eigen::MatrixXd output_covariance;
  // key_weight[s] = Σ over all N rows of S[row, s]: the attention mass token s receives
  // (Σ_s key_weight[s] = N). Filled only when requested (a second pass).
  Eigen::VectorXd key_weight;
  double mean_entropy = 0.0;    // mean over rows of −Σ_s S log S (nats)
  double mean_sink_mass = 0.0;  // mean over rows of Σ_{s < sink_tokens} S[row, s]
};

// Flash-style: query and key blocks of `block` rows, a running max, sum and accumulator per
// row, so no tokens×tokens matrix ever exists; the logits, exponentials and sums are fp64.
// `sink_tokens` (≥ 0) only chooses which keys mean_sink_mass counts.
AttentionStatistics ComputeAttentionStatistics(const Activations& acts, int layer, int kv_head,
                                               int64_t tokens, bool want_key_weight,
                                               int sink_tokens = 1, int block = 128);

// The authors' released-code value target: Σ_s w_s v_sᵀ v_s / Σ_s w_s over tokens [0, tokens)
// with w_s = key_weight[s] from ComputeAttentionStatistics (the attention mass each key
// receives from all query rows of its KV head). Throws unless key_weight has `tokens` entries,
// all ≥ 0 and finite, with a positive sum.
Eigen::MatrixXd KeyWeightedValueCovariance(const Activations& acts, int layer, int kv_head,
                                           int64_t tokens, const Eigen::VectorXd& key_weight);

}  // namespace kvq::calib
