// Attention-level error metrics of a quantized KV cache (shared/DESIGN.md "Error metrics";
// docs/accuracy_synthetic.md defines each one), measured on HELD-OUT tokens through the real cache:
// the held-out K/V of one (layer, KV head) are prefilled into a kvq::cpu::PagedKVCache with its
// sink and recent windows, and every metric reads the rows back as the cache holds them (history
// rows dequantized and inverse-rotated, sink and recent rows bf16). All sums are fp64.
//
// Decode-time faithfulness: a query at held-out position p sees the cache at length p + 1, where
// position i is a history row iff S0 ≤ i < p + 1 − W. History codes are a pure function of the
// bf16 row (spec/cache.md §2), so one prefill to the full held-out length T gives every row's
// dequantized value, and each query uses it exactly for the rows that are history at its own
// length (the rest are the bf16 rows). No approximation is involved.
#pragma once

#include <Eigen/Dense>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

// ---- Building blocks (fp64) ----

// Σ (approx − ref)² and Σ ref² accumulated separately; Relative() = error / reference, 0 when
// both are 0 (nothing to compare), +inf when only the reference is 0.
struct ErrorSum {
  double error = 0.0;
  double reference = 0.0;
  void Add(double approx, double ref) {
    const double e = approx - ref;
    error += e * e;
    reference += ref * ref;
  }
  double Relative() const;
};

// p = softmax(logits) over n ≥ 1 finite logits (max-subtracted, fp64).
void SoftmaxF64(const double* logits, size_t n, double* p);

// KL(p ‖ q) = Σ p_i·log(p_i / q_i) in nats; terms with p_i = 0 are 0, a term with p_i > 0 and
// q_i = 0 makes it +inf. n ≥ 1.
double KlDivergence(const double* p, const double* q, size_t n);

// |top_k(p) ∩ top_k(q)| / k' with k' = min(k, n); top_k takes the k largest entries, ties
// going to the lower index (so equal distributions overlap fully). n ≥ 1, k ≥ 1.
double TopKOverlap(const double* p, const double* q, size_t n, int k);

// ---- Per (layer, KV head) evaluation ----

struct MetricOptions {
  // The first `prefix_tokens` tokens of the capture are prepended to the held-out tokens, so
  // the evaluated sequence starts as a real one does: with its attention sinks. kvq eval sets
  // this to S0, so exactly these rows fill the cache's bf16 sink window (they are never
  // quantized, so no calibration row is ever scored as a quantized row). 0: held-out only.
  int64_t prefix_tokens = 0;
  // Query positions: the last `query_positions` held-out positions (0 = all of them), each
  // attending causally over every earlier held-out position (all g query heads of the KV head).
  int64_t query_positions = 256;
  int top_k = 10;
  // Largest accepted relative difference between cpu::Attend on the cache and this file's fp64
  // path for the last query position (max|o − o_fp64| / max|o_fp64| per query head). The two
  // read the same stored rows; they differ by fp32 vs fp64 arithmetic and by where the rotation
  // is applied (q·R_K in fp32 vs x̂·R_Kᵀ), each ~1e-6 relative.
  double attend_tolerance = 1e-4;
};

// One KV head's held-out data and its fp64 reference (shared by every scheme).
struct HeldOutHead {
  int layer = 0, kv_head = 0;
  int64_t prefix = 0;          // capture tokens [0, prefix) lead the sequence
  int64_t tokens = 0;          // T: sequence length = prefix + held-out tokens
  int64_t first_query = 0;     // query positions are [first_query, T)
  int group = 0;               // g query heads
  int head_dim = 0;
  double scale = 0.0;          // softmax scale: fp32(1/√d) as the cache uses it
  std::vector<float> keys, values;  // [T, d] held-out rows as given (fp32)
  Eigen::MatrixXd k, v;             // [T, d] the bf16-rounded rows: the reference
  Eigen::MatrixXd q;                // [R, d] query rows, r = (p − first_query)·g + j
  Eigen::MatrixXd logits;           // [T, R] scale·k·q (column r = one query row)
  Eigen::MatrixXd probs;            // [T, R] causal softmax (0 above the diagonal)
  Eigen::MatrixXd output;           // [R, d] probsᵀ·v
  // For the RoPE-logit MAE (rope_logit.h): the capture's RoPE base, each sequence position's
  // RoPE position (its capture token minus the start of the token's segment) and the g query
  // rows of every position's own token (post-RoPE, as captured).
  double rope_base = 0.0;
  std::vector<double> rope_positions;  // [T]
  std::vector<double> token_queries;   // [T, g, d] row-major
  int64_t rows() const { return q.rows(); }
  int64_t position(int64_t r) const { return first_query + r / group; }
};

// Gathers tokens [0, prefix) then [calib_tokens, T_total) of (layer, kv_head) and computes the
// reference. Query positions are the last ones, all among the held-out tokens (at most the
// held-out count). Throws kvq::Error: layer or head out of range, no held-out token
// (calib_tokens == tokens), query_positions < 0, top_k < 1, prefix_tokens outside
// [0, calib_tokens].
HeldOutHead PrepareHeldOut(const Activations& acts, int layer, int kv_head,
                           const MetricOptions& options);

struct HeadMetrics {
  double k_rel_mse = 0;       // Σ‖k̂ − k‖² / Σ‖k‖² over all T cache rows, original space
  double v_rel_mse = 0;       // same for V
  double logit_rel_mse = 0;   // Σ(q·k̂ − q·k)² / Σ(q·k)² over the causal (query row, key) pairs
  double rope_logit_mae = 0;  // seeds/004 App. B.3 (rope_logit.h): mean over the T cache rows
                              // k, the g queries q of k's own token and the 50 offsets Δ of
                              // |qᵀR_Δk̂ − qᵀR_Δk|, q and k pre-RoPE (undone with rope_base),
                              // unscaled logits; bf16 rows contribute 0
  double sv_rel_mse = 0;      // ‖S·V̂ − S·V‖² / ‖S·V‖², S the fp64 reference probabilities
  double attn_kl = 0;         // mean over query rows of KL(p_ref ‖ p_q)
  double top10_overlap = 0;   // mean over query rows of TopKOverlap(p_ref, p_q, top_k)
  double output_rel_mse = 0;  // ‖softmax(qK̂ᵀ)V̂ − softmax(qKᵀ)V‖² / ‖softmax(qKᵀ)V‖²
  double tr_ek = 0;           // (1/N) Σ_history ‖x̃ − x̂‖², x̃ = k·R_K (before clip), x̂ dequantized
  double group_range = 0;     // mean over the quantizer's groups (per token and G channels, or
                              // per tile and channel) of max − min of its input: clip(x̃), or
                              // clip(x̃ / n̂) with a norm
  double bits_per_element = 0;  // PagedKVCache::Bytes at length T, K and V, slots in use
  int64_t history_tokens = 0;   // N: rows held quantized at length T
  double attend_check = 0;      // cpu::Attend vs this path at the last query (see MetricOptions)
};

// Evaluates one single-KV-head scheme (SliceKvHead) on one held-out head. history-based
// metrics (tr_ek, group_range) are NaN when no row is quantized (bf16 scheme, or T ≤ S0 + W).
// Throws kvq::Error: a scheme that is not single-head or whose d or g differ from the data
// (kShapeMismatch); kMismatch when the write path's dequantized rows differ from the cache's
// bits or the Attend cross-check exceeds options.attend_tolerance (naming layer, head, value).
HeadMetrics EvaluateHead(const HeldOutHead& data, const LayerScheme& head_scheme,
                         const cpu::Backend& backend, const MetricOptions& options);

}  // namespace kvq::calib
