// OSCAR calibration end to end (seeds/000 §3 and Algorithm 1; shared/DESIGN.md "Calibration"):
// activations → targets (C_Q; C_S, key-weighted or raw V) → sorted eigenbases → R = U·H·P_br
// → per-layer clip ratios → a Calibration (calibration_file.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

enum class Granularity { kKvHead, kLayer };
enum class ValueTarget { kAttnOutput, kKeyWeighted, kRaw };

// How R is built from the target's eigenbasis U (seeds/000 table 4 and table 10 ablations).
enum class RotationRecipe {
  kOscar,             // U·H·P_br
  kNoBitReversal,     // U·H
  kNoHadamard,        // U·P_br
  kEigenbasisOnly,    // U
  kRawTarget,         // U'·H·P_br with U' from KᵀK / VᵀV (the raw-cache PCA targets)
  kHadamardBitrev,    // H·P_br (QuaRot + P_br: no eigenbasis)
  kHadamard,          // H
  kRandomOrthogonal,  // a seeded Haar-random orthogonal matrix per (layer, head, K/V)
  kIdentity,          // I (clip only)
};

const char* GranularityName(Granularity g);     // "kv_head", "layer"
const char* ValueTargetName(ValueTarget t);     // "attn_output", "key_weighted", "raw"
const char* RotationRecipeName(RotationRecipe r);  // "oscar", "no_bitrev", ...
// Parsers: throw kvq::Error(kInvalidArgument) naming the text and the accepted names.
Granularity ParseGranularity(const std::string& text);
ValueTarget ParseValueTarget(const std::string& text);
RotationRecipe ParseRotationRecipe(const std::string& text);

struct CalibrationOptions {
  Granularity granularity = Granularity::kKvHead;
  ValueTarget value_target = ValueTarget::kAttnOutput;
  RotationRecipe rotation = RotationRecipe::kOscar;
  std::vector<double> clip_grid;  // empty means DefaultClipGrid()
  int group = 64;
  int bits = 2;    // b of K's clip search (and V's unless v_bits)
  int v_bits = 0;  // b of V's clip search when it differs (0: bits)
  double damping = 0.0;   // α: eigendecomposition of C + α·mean(diag C)·I
  int sink = 64;          // S0: the first S0 tokens are never quantized, so not clip rows
  int recent = 256;       // W (recorded in the file)
  uint64_t random_seed = 0;  // for RotationRecipe::kRandomOrthogonal
  int threads = 2;
  std::string source;     // recorded as the file's source
  // "oscar", or a scheme of the catalogue whose `scale` column is kCalibration (fp8,
  // fp8_hadamard): the file then also holds that scheme's per-head fp8 scales (Fp8Scales).
  std::string scheme = "oscar";
};

// Per layer and side, the objective of every grid point (for reports and tests).
struct ClipReport {
  std::vector<double> grid;
  std::vector<std::vector<double>> key_objectives;    // [L][grid]
  std::vector<std::vector<double>> value_objectives;  // [L][grid]
};

// Called after each finished unit of work (done ≤ total), from the calling thread only.
using ProgressCallback = std::function<void(int done, int total)>;

// The raw_target scheme's rotations of one layer (LayerCalibration::raw_k_rotation /
// raw_v_rotation, fp32 [Hkv, d, d]): R' = U'·H·P_br composed in fp64 and rounded once, U' the
// sorted eigenbasis (undamped) of KᵀK/N for the keys and VᵀV/N for the values over tokens
// [0, calib_tokens) of `acts`, per KV head or, at per-layer granularity, of the mean over the
// layer's KV heads (replicated). Calibrate stores exactly these; `kvq eval` computes them with
// this function for a calibration read from a format_version 1 file.
void RawTargetRotations(const Activations& acts, int layer, Granularity granularity,
                        std::vector<float>* keys, std::vector<float>* values);
// Fills in every layer's raw-target rotations of `cal` from `acts` at cal's granularity.
// Throws kvq::Error(kShapeMismatch) when cal's shape (layers, Hkv, d) is not the capture's.
void AddRawTargetRotations(const Activations& acts, Calibration* cal);

// The fp8 scales s^ of layer `layer` for the side whose write params are `side` (its
// rotation: identity, or the FWHT; a dense rotation is refused with kUnsupported), per KV head:
// the rows of tokens [0, calib_tokens) rounded to bf16 as the cache stores them, rotated by
// `backend`'s write path, then fp32(max |x| / 448) (IEEE division); 1 for a head whose rows are
// all zero (any scale stores them exactly). Returns [Hkv].
std::vector<float> Fp8Scales(const Activations& acts, int layer, bool keys,
                             const WriteParams& side, const cpu::Backend& backend);

// Calibrates on tokens [0, calib_tokens) of `acts`: targets and eigenbases use all of them,
// clip rows are tokens [sink, calib_tokens) (the sink stays BF16 in the cache); in a
// segmented capture, every segment's tokens after its own first `sink` ones. Per-layer
// granularity averages the per-KV-head targets over the layer's KV heads; the clip ratio is
// always chosen per layer (summing the objective over KV heads) and stored replicated.
// With options.scheme an fp8 scheme, every layer also gets that scheme's k_scale / v_scale
// (Fp8Scales after the scheme's K and V rotations) and the file records the scheme.
// Throws kvq::Error: invalid activations, options (group/bits/d via WriteParams, damping < 0,
// grid outside (0, 1], threads < 1, sink outside [0, calib_tokens) or [0, segment_tokens), a
// scheme that is neither oscar nor one with calibrated fp8 scales).
Calibration Calibrate(const Activations& acts, const CalibrationOptions& options,
                      const cpu::Backend& backend, const ProgressCallback& progress = {},
                      ClipReport* report = nullptr);

}  // namespace kvq::calib
