// Calibration of the codebook schemes (spec/numerics.md §9.1): TurboQuant-MSE's Haar rotations
// (`tq_mse`) and Block-GTQ's RoPE-block energies, greedy block widths and composed key rotation
// R_K = P·diag(A_w) (`blockgtq`; seeds/004, JIA-Lab-research/blockgtq). Everything is fp64 and
// a function of the capture's calibration tokens and the seed alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/lloyd_max.h"

namespace kvq::calib {

// Block-GTQ's energies of KV head `kv_head` of `layer` over tokens [0, tokens) (numerics.md
// §9.1), fp64 [d/2]: s_i = (e_Q[i] + e_K[i]) / 2 with e_K[i] = mean_t (k_t[i]² + k_t[i+L]²) and
// e_Q[i] = mean_{t, g} (q_{g,t}[i]² + q_{g,t}[i+L]²) over the KV head's query heads g, L = d/2
// (HF rotate_half pairs: RoPE turns each pair by an angle, so these are RoPE-invariant). Sums in
// token order, query heads ascending inside a token, then one division each.
// Throws kvq::Error(kInvalidArgument) for a layer or head out of range or tokens outside
// [1, calib_tokens] (held-out tokens never calibrate).
std::vector<double> BlockEnergies(const Activations& acts, int layer, int kv_head,
                                  int64_t tokens);

// ⌊L·b̄⌋ for L blocks at average width b̄ (L·b̄ in fp64). Throws kvq::Error(kInvalidArgument)
// naming b̄ unless it is finite and in [1, 8], and naming L unless it is ≥ 1.
int64_t WidthBudget(int blocks, double avg_bits);

// The greedy allocation (numerics.md §9.1): every block starts at width 1; while the widths sum
// to less than `budget`, the block with the largest scores[i]·4^(−w_i) (fp64) among those below
// width 8 gets one more bit, the lowest index on ties (a strict greater-than scan), also when the
// best priority is 0. U8 [L], each in 1..8, summing to `budget`. Throws kvq::Error
// (kInvalidArgument) for an empty `scores`, a negative or non-finite score (naming its index and
// value) or a budget outside [L, 8·L] (naming it).
std::vector<uint8_t> GreedyWidths(const std::vector<double>& scores, int64_t budget);

// Σ_i scores[i]·4^(−widths[i]) in fp64, the surrogate distortion the greedy allocation
// minimises (exactly, for fixed scores: the marginal gains s·4^(−w)·3/4 decrease in w).
double AllocationObjective(const std::vector<double>& scores, const std::vector<uint8_t>& widths);

// Block-GTQ's key rotation for block widths `widths` (U8 [d/2], each 1..8), fp64 [d, d]:
// R_K = P·diag(A_w) (numerics.md §9.1). P sends the blocks into segment order (widths ascending,
// then block index: block i_k of the segment of width w to columns o_w + 2k and o_w + 2k + 1 from
// rows i_k and i_k + d/2); A_w is RandomOrthogonal(m_w, DeriveSeed(seed, {layer, kv_head, 0, w}))
// for w ≥ rotation_threshold and the identity below it. Throws kvq::Error(kInvalidArgument) for
// an unsupported d, a width outside 1..8 (naming the block) or a threshold outside 1..9.
Eigen::MatrixXd BlockGtqKeyRotation(int head_dim, const std::vector<uint8_t>& widths,
                                    uint64_t seed, int layer, int kv_head,
                                    int rotation_threshold);

// TurboQuant-MSE's Haar rotation of (layer, KV head, side), side 0 = K, 1 = V:
// RandomOrthogonal(d, DeriveSeed(seed, {layer, kv_head, side})), fp64 [d, d].
Eigen::MatrixXd TurboQuantRotation(int head_dim, uint64_t seed, int layer, int kv_head,
                                   int side);

struct CodebookCalibrationOptions {
  std::string scheme = "blockgtq";  // tq_mse or blockgtq (tq_mse_fwht stores nothing)
  double k_avg_bits = 3.0;  // b̄: blockgtq's K average width in [1, 8] (fractional allowed);
                            //   tq_mse's K width (an integer 1..8)
  int v_bits = 0;           // V's width 1..8 (0: ⌈b̄⌉)
  uint64_t seed = 0;        // every Haar matrix derives from it
  int rotation_threshold = 1;  // blockgtq: segments of width ≥ this are rotated (1..9)
  CodebookDensity density = CodebookDensity::kBeta;  // recorded: the tables the codec reads
  int sink = 0;             // S0, W: recorded for the cache the file serves (the codebook
  int recent = 1;           //   schemes are buffer-free by default; the file's recent ≥ 1)
  int threads = 2;
  std::string source;       // recorded as the file's source
  // The calibration prefixes whose allocations the stability report compares with the full
  // one: token counts in [1, calib_tokens); empty means calib_tokens/8, /4, /2 (those ≥ 1).
  std::vector<int64_t> stability_prefixes;
};

// How the blockgtq allocation moves when calibrated on a prefix of the calibration tokens.
struct AllocationStability {
  std::vector<int64_t> prefixes;  // token counts, ascending
  // [prefix][layer][kv_head]: the number of blocks whose width differs from the full
  // calibration's (Hamming distance), and the regret J(w_prefix)/J(w_full) − 1 with J the
  // AllocationObjective under the full calibration's energies (≥ 0: w_full minimises J).
  std::vector<std::vector<std::vector<int>>> hamming;
  std::vector<std::vector<std::vector<double>>> regret;
};

// Calibrates a codebook scheme on tokens [0, calib_tokens) of `acts`: the file of
// spec/formats.md §5 (format_version 4). For blockgtq fills `stability` when given.
// Throws kvq::Error(kInvalidArgument) naming the offending value: a scheme other than tq_mse or
// blockgtq (tq_mse_fwht: nothing to calibrate), b̄ outside [1, 8] or (tq_mse) not an integer,
// v_bits outside 0..8, a threshold outside 1..9, threads < 1, sink < 0, recent < 1, a prefix
// outside [1, calib_tokens); invalid activations as ValidateActivations.
Calibration CalibrateCodebook(const Activations& acts, const CodebookCalibrationOptions& options,
                              AllocationStability* stability = nullptr);

}  // namespace kvq::calib
