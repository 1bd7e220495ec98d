// Calibration artifacts (spec/formats.md §5): per layer and KV head the per-head data of K and
// V (the head_data.inc rows: rotations R, clip ratios, since format_version 3 the fp8 scales),
// the eigenbases U and eigenvalues and (since format_version 2) the raw_target scheme's
// rotations, in one safetensors file.
#pragma once

#include <string>
#include <vector>

#include "kvq/common/head_data.h"
#include "kvq/common/io.h"

namespace kvq::calib {

inline constexpr const char* kCalibrationFormat = "kvq-calibration";
// Version 2 added raw_k_rotation / raw_v_rotation. Readers accept version 1 files (every other
// tensor is the same); such a calibration serves every scheme but raw_target.
inline constexpr int kCalibrationFormatVersion = 2;
inline constexpr int kCalibrationFormatVersionWithoutRawTarget = 1;
// Version 3 adds the fp8 schemes' per-head scales k_scale / v_scale (written only when a
// calibration holds them: kvq calibrate --scheme fp8 | fp8_hadamard).
inline constexpr int kCalibrationFormatVersionWithScales = 3;
// Version 4 is a codebook calibration (spec/formats.md §5; numerics.md §9.1; kvq calibrate
// --scheme tq_mse | blockgtq), and only that: not cumulative, it holds the Haar rotations
// k_rotation / v_rotation and, for blockgtq, the key block widths k_bits (U8 [Hkv, d/2]) and
// their energies k_scores, and none of the other schemes' tensors (clip ratios, bases,
// eigenvalues, raw-target rotations, fp8 scales). The versions up to 3 are cumulative.
inline constexpr int kCalibrationFormatVersionWithWidths = 4;
inline constexpr int kCalibrationFormatVersionCodebook = 4;

// The codebook schemes (numerics.md §5.4): tq_mse, tq_mse_fwht, blockgtq. Keyed on the names:
// the calibration file does not depend on the scheme catalogue.
bool IsCodebookScheme(const std::string& scheme);
// The codebook schemes whose calibration allocates block widths (blockgtq).
bool AllocatesWidths(const std::string& scheme);

// What a codebook calibration adds to the metadata (written only for a codebook scheme).
struct CodebookCalibrationInfo {
  std::string density = "beta";  // `codebook`: beta | gaussian, the tables the rows are coded by
  double k_avg_bits = 0;         // `k_avg_bits` (blockgtq only): b̄, the keys' average width
  int rotation_threshold = 1;    // `rotation_threshold` (blockgtq only): segments of width ≥ it
                                 //   are rotated (1..9; 9 rotates none)
  uint64_t seed = 0;             // `seed`: every Haar matrix of the file derives from it
  // The row limits of numerics.md §5.4.1 for K and V: norm slots (1..8) and code bytes (0 is
  // the uniform row's d·b/8) a row; the maxima over the side's (layer, KV head) pairs.
  int k_segments = 1, k_code_bytes = 0;
  int v_segments = 1, v_code_bytes = 0;
};

struct CalibrationInfo {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 128;        // d: 64, 128 or 256
  int group = 64;            // G the clip was selected for
  int bits = 2;              // b K's clip was selected for (and V's unless v_bits); a codebook
                             //   calibration: K's integer width (blockgtq: ⌈b̄⌉)
  int v_bits = 0;            // b V's clip was selected for (a codebook calibration: V's
                             //   width) when it differs (0: bits); the metadata key v_bits is
                             //   written only then
  int sink = 64;             // S0 (BF16 sink tokens; not quantized, so not in the clip rows)
  int recent = 256;          // W
  // oscar, the fp8 scheme whose scales it holds, or the codebook scheme it calibrates
  std::string scheme = "oscar";
  // How R was built from U (rotation recipes) and what V's R diagonalises; both empty in a
  // codebook calibration (nothing is fitted; no metadata keys).
  std::string rotation = "oscar";
  std::string value_target = "attn_output"; // attn_output | key_weighted | raw
  std::string granularity = "kv_head";      // kv_head | layer (a codebook calibration: kv_head)
  std::string source;                       // the activation file calibrated on
  CodebookCalibrationInfo codebook;         // read and written for a codebook scheme only
};

// One layer; every array row-major fp32.
struct LayerCalibration {
  // The per-head data of K and of V (kvq/common/head_data.h: every row of head_data.inc),
  // stored as tensors layers.{l}.k_<row> / v_<row> (calibration_file.cc's kHeadRowTensors says
  // how): rotation R [Hkv, d, d] (x~ = x·R); clip ρ [Hkv] in (0, 1], the same for every KV
  // head (chosen per layer); fp8 scale s^ [Hkv] (format_version 3): the largest |x| over the
  // head's calibration rows (tokens [0, calib_tokens), after the scheme's rotation) / 448 in
  // fp32, or 1 for a head whose rows are all zero; empty when the calibration has none.
  HeadData key, value;
  std::vector<float> k_basis, v_basis;              // [Hkv, d, d]  U, columns = eigenvectors
  std::vector<float> k_eigenvalues, v_eigenvalues;  // [Hkv, d]     descending
  // The raw_target scheme's R' = U'·H·P_br, U' the sorted eigenbasis of KᵀK/N (keys) or VᵀV/N
  // (values) over the calibration tokens, undamped, at the file's granularity. [Hkv, d, d], or
  // empty in a calibration read from a format_version 1 file.
  std::vector<float> raw_k_rotation, raw_v_rotation;
  // blockgtq (format_version 4): the energies s_i the key widths were allocated from
  // (numerics.md §9.1), computed in fp64 and stored fp32 (a diagnostic: the widths are in
  // key.widths), [Hkv, d/2]; empty otherwise.
  std::vector<float> k_scores;

  // `key` (side 0) or `value` (side 1), for code that does the same for both sides.
  HeadData& heads(int side) { return side == 0 ? key : value; }
  const HeadData& heads(int side) const { return side == 0 ? key : value; }
  // KV head `kv_head`'s R ([d, d]) of side `side` (0: K, 1: V).
  const float* rotation_of(int side, int kv_head, int d) const {
    return heads(side).rotation.data() + static_cast<size_t>(kv_head) * d * d;
  }
};

struct Calibration {
  CalibrationInfo info;
  std::vector<LayerCalibration> layers;

  // Whether every layer holds raw_k_rotation / raw_v_rotation (false for a version 1 file).
  bool HasRawTargetRotations() const;
  // Whether every layer holds k_scale / v_scale (a version 3 file).
  bool HasScales() const;
};

// Throws kvq::Error unless: L ≥ 1, Hkv ≥ 1, d/G/bits supported (WriteParams rules), sink ≥ 0,
// recent ≥ 1, granularity and value_target from their lists, every tensor of its exact size
// (kShapeMismatch naming layer and tensor), every value finite (kNonFinite), every value of a
// head_data.inc row within that row's rule (clip ratios in (0, 1], fp8 scales > 0;
// kInvalidArgument naming layer, tensor, KV head and value), every rotation and basis
// orthogonal (max |MᵀM − I| ≤ 1e-4 in fp64; kInvalidArgument naming layer, tensor, head and
// the deviation), eigenvalues descending, the clip ratios equal on every KV head (chosen per
// layer), and for per-layer granularity the same R, U, eigenvalues and raw-target R' on every
// KV head. The raw-target rotations are either absent from every layer or present in every
// layer, under the same rules as R; the fp8 scales likewise (each KV head its own at any
// granularity, only beside the raw-target rotations, and only with scheme fp8 or
// fp8_hadamard). A codebook calibration (scheme tq_mse or blockgtq; tq_mse_fwht has nothing to
// store) holds the rotations and, for blockgtq, the key widths (each 1..8, summing to
// ⌊(d/2)·k_avg_bits⌋, fitting k_segments and k_code_bytes) and k_scores (finite, ≥ 0), and no
// other tensor; its group is d, its granularity kv_head, its rotation recipe and value target
// empty, its row limits valid codebook write parameters (segments 1..8, code_bytes 0 or in
// [Σ_s B_s, d]).
void ValidateCalibration(const Calibration& cal);

// Parses (validating as above plus: format and format_version 1, 2, 3 or 4, every metadata key,
// every tensor of that version for layers 0..L−1 present with the right dtype (a head_data.inc
// row's element type: F32, U8 for the widths) and shape, no stray tensors; version 4 exactly
// for a codebook scheme). The writer stores format_version 4 for a codebook calibration, 3 when
// the calibration holds fp8 scales, 2 without them, or 1 when the raw-target rotations are
// absent too (a file read and written again keeps its version and its bytes).
Calibration CalibrationFromSafetensors(const Safetensors& file);
Calibration ReadCalibration(const std::string& path);
Safetensors CalibrationToSafetensors(const Calibration& cal);  // validates first
void WriteCalibration(const std::string& path, const Calibration& cal);

}  // namespace kvq::calib
