// RoPE-logit MAE (seeds/004 App. B.3, research/schemes.md §6.6): how far a key's quantization
// error moves its RoPE attention logits with a query of the same token, over a grid of relative
// offsets. docs/accuracy_synthetic.md ("RoPE-logit MAE") states the definition `kvq eval` and
// `kvq qview` report.
//
// RoPE is rotate-half (Llama/Qwen, HF `rotate_half`; kvq's captures are): pair i = channels
// (i, i + d/2), i < d/2, turns by the angle a·θ_i with θ_i = rope_base^(−2i/d):
//   x'_i = x_i cos − x_{i+d/2} sin,  x'_{i+d/2} = x_{i+d/2} cos + x_i sin.
// R_a is that rotation; R_a is orthogonal, R_a⁻¹ = R_{−a}, and all R_a commute.
//
// For one sample pair, with q and k the pre-RoPE query and key (a capture stores them post-RoPE
// at RoPE position p, so q = R_{−p}·q_post, k = R_{−p}·k_post) and k̂ the dequantized key undone
// the same way, the pair contributes mean_{Δ∈D} |qᵀ·R_Δ·k − qᵀ·R_Δ·k̂| = mean_Δ |qᵀ·R_Δ·(k − k̂)|.
// D: the 50 evenly spaced offsets of [−1024, 1024] (numpy linspace, not integers). Logits are
// unscaled (no 1/√d), as in the paper's formula. All arithmetic is fp64.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::calib {

// Δ_j = −1024 + 2048·j / 49, j = 0..49 (seeds/004 App. B.3's grid 𝒟).
const std::vector<double>& RopeLogitOffsets();

// x [d] ← R_{−position}·x: undoes rotate-half RoPE applied at `position` with `rope_base`.
// Throws kvq::Error (kInvalidArgument) for d not even and ≥ 2, or rope_base not finite and > 0
// (naming the value).
void UndoRope(double* x, int head_dim, double rope_base, double position);

// qᵀ·R_Δ·k for one Δ, directly from the rotation's definition (what the accumulator computes
// for every Δ at once; the tests hold the two together). Throws as UndoRope.
double RotatedLogit(const double* q, const double* k, int head_dim, double rope_base,
                    double delta);

// Accumulates Σ_{pairs} Σ_{Δ∈D} |qᵀ·R_Δ·e| and the term count for one head dimension and base.
class RopeLogitMae {
 public:
  // Throws kvq::Error (kInvalidArgument): d not even and ≥ 2, rope_base not finite and > 0
  // ("rope_base <value>": a capture without a usable base cannot give this metric), offsets
  // empty or not finite.
  RopeLogitMae(int head_dim, double rope_base,
               const std::vector<double>& offsets = RopeLogitOffsets());

  // One key and the `queries` query rows of its token, all post-RoPE at RoPE `position`:
  // key_error [d] = k̂ − k (or k − k̂: |·| ignores the sign), query [queries, d] row-major.
  // Undoes RoPE on both, then adds |qᵀ·R_Δ·e| for every query row and Δ (queries · |D| terms).
  void Add(const double* key_error, const double* query, int queries, double position);
  // Adds `count` sample pairs whose key error is zero (rows the cache keeps in bf16).
  void AddExact(int64_t pairs) { terms_ += pairs * static_cast<int64_t>(cos_.size() / half_); }

  double sum() const { return sum_; }
  int64_t terms() const { return terms_; }
  // sum / terms; 0 when nothing was added.
  double Mean() const { return terms_ > 0 ? sum_ / static_cast<double>(terms_) : 0.0; }

 private:
  int head_dim_ = 0, half_ = 0;
  std::vector<double> theta_;     // [d/2]
  std::vector<double> cos_, sin_; // [|D|, d/2]: cos(Δ·θ_i), sin(Δ·θ_i)
  std::vector<double> e_, q_, a_, b_;
  double sum_ = 0;
  int64_t terms_ = 0;
};

}  // namespace kvq::calib
