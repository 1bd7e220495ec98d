// `kvq qview`: what the INT-b quantizer sees on the rotated keys K̃ = K·R_K of every (layer, KV
// head), for several rotations and clip choices: seeds/000 table 10 (one layer, one head of
// Qwen3-4B) on every layer and head of a capture, plus the quantities that explain the
// end-to-end numbers (the C_Q-weighted residual, the key mean).
//
// Per (scheme variant, layer l, KV head h), with x the held-out key rows of the evaluated
// capture at positions ≥ S0 of each sequence (what the cache quantizes; a sequence's first S0
// rows stay bf16), x̃ = x·R_K the scheme's rotated row (its write path: dense R, FWHT, P_br),
// x̂ its dequantized value in the rotated space (clip ρ_K, then the per-token codec), e = x̃ − x̂:
//
//   max_abs          max |x̃| over rows and channels (before the clip)       table 10 col. 1
//   group_range      mean over rows and G-channel groups of max − min of clip(x̃)     col. 2
//   importance       max_i / mean_i of diag(R_Kᵀ·C_Q·R_K), C_Q of the calibration capture
//                    (the matrix kvq calibrate diagonalises; Lemma 1 makes U·H exactly 1)  col. 3
//   tr_ek            mean over rows of ‖e‖² (tr(E_K) / N)                              col. 4
//   weighted         mean over rows of e·(R_Kᵀ·C_Q'·R_K)·eᵀ with C_Q' the evaluated capture's
//                    own queries' second moment: the mean squared logit error q·(k̂ − k) (× d)
//   weighted_centred the same for the rows minus their mean μ (same R_K and ρ_K): what the
//                    residual would be if the keys carried no mean
//   mean_range       mean over the G-channel groups of max − min of μ·R_K: how much range
//                    the rotation gives the key mean in every row
//   mean_energy      ‖μ‖² / mean ‖x − μ‖² (the scheme does not enter)
//   rope_logit_mae   seeds/004 App. B.3 (rope_logit.h): mean over the rows, the g queries of
//                    each row's own token (evaluated capture) and the 50 offsets Δ of
//                    |qᵀR_Δ(k̂ − k)|, k̂ = x̂·R_Kᵀ back in the original space, q and k with RoPE
//                    undone at the token's position with the capture's rope_base; unscaled
//
// A scheme's clip ratio comes from its variant exactly as in `kvq ppl` (fair_clip.h: own, OSCAR's
// or none); NAME@none gives the unclipped view of table 10.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/fair_clip.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

struct QuantizerViewOptions {
  std::vector<SchemeVariant> schemes;  // per-token (affine_token, codebook) key formats only
  SchemeOptions scheme;                // G, bits, S0 (rows before S0 are skipped), saw_block
  std::vector<double> clip_grid;       // own clips; empty: DefaultClipGrid()
  int threads = 2;                     // any count gives the same numbers
};

struct KeyView {
  int layer = 0, kv_head = 0;
  float clip = 1.0f;  // ρ_K used
  int64_t rows = 0;   // N
  double max_abs = 0, group_range = 0, importance = 0, tr_ek = 0, weighted = 0,
         weighted_centred = 0, mean_range = 0, mean_energy = 0, rope_logit_mae = 0;
};

// The metric names in CSV and table order, and the value of metric `index` of `v`.
const std::vector<std::string>& KeyViewMetricNames();
double KeyViewMetric(const KeyView& v, size_t index);

struct QuantizerView {
  int num_layers = 0, num_kv_heads = 0, group = 0, bits = 0, sink = 0;
  int64_t rows_per_head = 0;
  std::vector<std::string> labels;          // one per variant
  std::vector<std::vector<KeyView>> views;  // [variant][layer·Hkv + h]
};

// Throws kvq::Error: captures of different shapes (kShapeMismatch); a scheme whose key format
// is not per token (kInvalidArgument naming it: the KIVI family's tiles, bf16, fp8); no row at
// positions ≥ S0; what BuildVariantLayers and the write path throw (a calibration missing for a
// calibrated scheme or @oscar).
// `progress(done, total)` is called from the calling thread as the work goes: first every
// (scheme, layer) built, then every (scheme, layer, KV head) viewed.
QuantizerView ComputeQuantizerView(const Activations& eval_acts, const Activations& calib_acts,
                                   const Calibration* cal, const QuantizerViewOptions& options,
                                   const cpu::Backend& backend,
                                   const std::function<void(int done, int total)>& progress = {});

// One line per (variant, layer, KV head): label,layer,kv_head,clip_k,rows,<metrics>.
std::string QuantizerViewCsv(const QuantizerView& view);

// A text table: one row per variant, each metric's mean over layers and KV heads.
std::string FormatQuantizerView(const QuantizerView& view);

// Writes `dir`/keys_<metric>.svg for every metric but mean_energy (one curve per variant over
// the layers, mean over KV heads) and keys_mean_energy.svg (one curve); returns the paths.
std::vector<std::string> WriteQuantizerViewPlots(const std::string& dir,
                                                 const QuantizerView& view);

}  // namespace kvq::calib
