// The scheme catalogue: every KV-cache quantization scheme kvq evaluates, one row each in
// schemes.inc, each turning (shape, calibration, layer, options) into what a
// kvq::cpu::PagedKVCache of that layer needs: CacheParams plus the per-head data (HeadData:
// rotation matrices, clip ratios, fp8 scales) of K and of V. `kvq eval`, `kvq attend --scheme`,
// `kvq bench`, the benchmarks and the golden vectors all read it.
//
// The OSCAR ablations (seeds/000 table 4) change ONE thing relative to `oscar`: the rotation.
// They keep the calibration's clip ratios (selected for R = U·H·P_br), so a difference in the
// metrics is the rotation's doing alone (docs/accuracy_synthetic.md discusses what that means). That
// reuse is the catalogue's `clip` column (ClipPolicy::kCalibration), not a hidden default.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

// Where a key norm spans (the `norm` column's scope): one norm per token and KV head (kvq's
// default, the seed's reading), or one per token over every KV head's rotated row laid end to
// end (the OScaR authors' code; couples the heads, so per-head evaluation refuses it).
enum class NormScope : int { kHead, kToken };
const char* NormScopeName(NormScope scope);      // "head", "token"
NormScope ParseNormScope(const std::string& name);  // throws kInvalidArgument naming it

// The knobs every scheme shares. A catalogue column that says "shared" takes these; a scheme's
// own value (saw_int4's INT4 and G = d, KIVI's windows) beats them.
struct SchemeOptions {
  int group = 64;     // G (per-token groups of the schemes whose group column is kSharedGroup)
  int bits = 2;       // b (K and V)
  int k_bits = 0;     // K's b when it differs (`--k-bits`; 0: bits)
  int v_bits = 0;     // V's b when it differs (`--v-bits`; 0: bits)
  int sink = 64;      // S0 (BF16 sink tokens)
  int recent = 256;   // W (BF16 recent window)
  int flush = 1;      // F (history flush granularity)
  int page = 64;      // P (history tokens per page; raised to G_k for a tiled side)
  int tile = 32;      // G_k: tokens per tile of an affine_tile side (KIVI, OScaR keys)
  NormScope norm_scope = NormScope::kHead;  // the key norm's scope (kivi_norm, ots)
  uint64_t seed = 0;  // random_orthogonal's seed
  int saw_block = 128;  // the SAW schemes' FWHT block (16..256, a power of two; clamped to d)
  double hessian_damping = 0.01;  // saw_hessian: M + α·mean(diag M)·I (seeds/003 App. A.3)
  // `--protected`: the windows kProtectedWindows (S0 = 4, W = 128, F = 1; seeds/004 App. D) in
  // place of the scheme's own or the shared ones (the codebook schemes run without windows).
  bool protect = false;
};

// The `bits` column's "use SchemeOptions::bits".
inline constexpr int kSharedBits = 0;
// The `group` column's "use SchemeOptions::group" and "G = d".
inline constexpr int kSharedGroup = 0;
inline constexpr int kRowGroup = -1;

// The `windows` column: a scheme's own (S0, W, F), or kSharedWindows (SchemeOptions').
struct SchemeWindows {
  int sink, recent, flush;
  constexpr SchemeWindows(int s, int w, int f) : sink(s), recent(w), flush(f) {}
  constexpr bool shared() const { return sink < 0; }
};
inline constexpr SchemeWindows kSharedWindows(-1, -1, -1);
// The "protected" windows of Block-GTQ's paper (seeds/004 App. D): 4 bf16 sink tokens and the
// 128 most recent tokens in bf16 (SchemeOptions::protect).
inline constexpr SchemeWindows kProtectedWindows(4, 128, 1);

// Whether the keys are divided by their norm (the `norm` column).
enum class SchemeNorm : int { kNone, kKeys };

// How a scheme's K and V rotations are made (the `rotation` column).
enum class SchemeRotation : int {
  kIdentity,            // none
  kHadamard,            // FWHT over the whole row
  kHadamardBitrev,      // FWHT then P_br
  kBlockHadamard,       // block-diagonal FWHT of SchemeOptions::saw_block (clamped to d)
  kRandomOrthogonal,    // seeded Haar-random dense matrix per (layer, KV head, K/V)
  kRawTarget,           // the calibration's U'·H·P_br, U' from KᵀK / VᵀV (raw_*_rotation)
  kEigenbasis,          // the calibration's U
  kEigenbasisBitrev,    // U·P_br
  kEigenbasisHadamard,  // U·H
  kCalibrated,          // the calibration's R (k_rotation / v_rotation)
  kHessianBlock,        // H_bd·U', U' the sorted eigenbasis of H_bd·M·H_bd + α·mean(diag)·I,
                        // M the layer-pooled C_Q rebuilt from the calibration's U·diag(λ)·Uᵀ
};

// Where a scheme's clip ratios come from (the `clip` column).
enum class ClipPolicy : int {
  kNone,         // ρ = 1: never clips
  kCalibration,  // the calibration file's per-layer ρ, selected by kvq calibrate for its R
};
const char* ClipPolicyName(ClipPolicy policy);  // "none", "calibration"

// Where a scheme's per-head fp8 scales s^ come from (the `scale` column; fp8 formats only).
enum class ScalePolicy : int {
  kNone,         // s^ = 1
  kCalibration,  // the calibration file's k_scale / v_scale, made by kvq calibrate --scheme <id>
};

// Where a codebook side's per-head block widths come from (the `widths` column; keys only).
enum class WidthsPolicy : int {
  kNone,         // no widths: every block at the side's bits (TurboQuant-MSE's uniform row)
  kCalibration,  // the calibration file's k_bits [Hkv, d/2] (kvq calibrate --scheme <id>)
};

struct SchemeInfo {
  const char* name;
  const char* description;  // one line naming the paper or seed, for --help and reports
  bool needs_calibration;   // reads R, U, U', C_Q or ρ from the calibration
  SchemeRotation rotation_k, rotation_v;
  Format format_k, format_v;  // the history formats (bf16: nothing quantized)
  SchemeNorm norm;
  int bits;                 // kSharedBits, or the scheme's own width
  int group;                // kSharedGroup, kRowGroup, or the scheme's own G
  SchemeWindows windows;    // kSharedWindows, or the scheme's own (S0, W, F)
  ClipPolicy clip;
  ScalePolicy scale;
  WidthsPolicy widths;

  bool quantized() const { return format_k != Format::kBf16; }
  // The bits the scheme quantizes `side` (0: K, 1: V) with under `options`: its own, or
  // options.k_bits / v_bits when given, else options.bits.
  int BitsUnder(const SchemeOptions& options, int side = 0) const {
    if (bits != kSharedBits) return bits;
    const int given = side == 0 ? options.k_bits : options.v_bits;
    return given != 0 ? given : options.bits;
  }
  // The per-token group at head_dim d under `options`.
  int GroupUnder(const SchemeOptions& options, int d) const {
    return group == kSharedGroup ? options.group : (group == kRowGroup ? d : group);
  }
};

// Every scheme in catalogue order (schemes.inc), the order tables list them.
const std::vector<SchemeInfo>& Schemes();
// Throws kvq::Error(kInvalidArgument) naming `name` and listing every valid name.
const SchemeInfo& SchemeByName(const std::string& name);
// The ids in catalogue order, joined by `separator` (for --help texts and error messages).
std::string SchemeNames(const std::string& separator = ", ");
// "all" or a comma-separated list of names (each checked as SchemeByName does; duplicates and
// empty entries rejected naming them). Keeps the order given.
std::vector<std::string> ParseSchemeList(const std::string& list);

// What a scheme is built for: the model's shape (an activation capture's, or a query's and a
// cache's; num_layers bounds the layer index).
struct SchemeShape {
  int num_layers = 1;
  int num_kv_heads = 0;  // Hkv
  int num_q_heads = 0;   // Hq
  int head_dim = 0;      // d
};
SchemeShape ShapeOf(const ActivationsInfo& info);

// Whether the scheme's catalogue row clips with the calibration's ratios (its `clip` column is
// ClipPolicy::kCalibration: clip_only, the rotation ablations, oscar). The fair-clip policy of
// kvq ppl (fair_clip.h) re-chooses ρ for exactly these. Throws as SchemeByName does.
bool SchemeClipsWithCalibration(const std::string& name);

// One layer of one scheme: what PagedKVCache's constructor takes.
struct LayerScheme {
  CacheParams params;  // Hkv, Hq, d from the shape
  // The per-head data of K and of V (kvq/common/head_data.h: every row of head_data.inc):
  // rotation [Hkv, d, d] fp32 row-major when that side is dense, else empty; clip ρ [Hkv] or
  // empty (params' clip); fp8 scale s^ [Hkv] or empty (1); ...
  HeadData key, value;

  // `key` (side 0) or `value` (side 1), for code that does the same for both sides.
  HeadData& heads(int side) { return side == 0 ? key : value; }
  const HeadData& heads(int side) const { return side == 0 ? key : value; }
};

// Builds scheme `name` for layer `layer`. `cal` may be null only for schemes that do not need
// a calibration (it is ignored by those). Throws kvq::Error: unknown name (kInvalidArgument,
// listing the names), layer out of range, a calibration missing where needed or whose shape
// (layers, Hkv, d) differs from `shape` (kShapeMismatch naming both), raw_target with a
// calibration that lacks the raw-target rotations (a format_version 1 file; kInvalidArgument
// naming the missing tensor), options the cache rejects (group, bits, sink, recent, page;
// kInvalidArgument from CacheParams::Validate), a saw_block that is not a power of two in
// [16, 256], saw_hessian with a calibration whose key bases are not C_Q's (rotation recipe
// raw_target) or a damping < 0, a scheme whose widths come from the calibration (blockgtq) with
// a calibration that holds none (kInvalidArgument naming the tensor layers.{l}.k_bits) or
// widths the side cannot hold (HeadData::Validate's errors).
// A codebook side is one group a row (G = d); with per-head widths its row limits `segments`
// and `code_bytes` are the most any (layer, KV head) of the calibration needs (spec/numerics.md
// §5.4.1) and its `bits` the layer's budget width rounded up (what Describe shows; the codec
// reads the widths).
LayerScheme BuildLayerScheme(const std::string& name, const SchemeShape& shape,
                             const Calibration* cal, int layer, const SchemeOptions& options);
// The same for a catalogue row given as it is (e.g. a row with some columns changed).
LayerScheme BuildLayerScheme(const SchemeInfo& info, const SchemeShape& shape,
                             const Calibration* cal, int layer, const SchemeOptions& options);
// The same with the shape of an activation capture.
LayerScheme BuildLayerScheme(const std::string& name, const Activations& acts,
                             const Calibration* cal, int layer, const SchemeOptions& options);

// A calibration for consumers that need a calibrated scheme's configuration without a model
// capture (kvq bench, the benchmarks, the golden vectors): `tokens` tokens of kvq synth's model
// (SynthOptions: seed, shape; the first half calibrates) calibrated with kvq calibrate's
// defaults at options' group, bits, sink and recent. The same arguments give the same bits
// (the synthetic data is portable; the eigensolver's bits follow the build). Throws what
// Synthesize and Calibrate throw (e.g. a sink that leaves no calibration rows).
// `scheme` names the scheme it is for: a scheme with calibrated fp8 scales gets them too
// (CalibrationScheme); a scheme whose key widths come from the calibration (blockgtq) gets its
// own codebook calibration of those activations instead (CalibrateCodebook at K's average width
// options.k_bits, else options.bits, V's width options.v_bits, else options.bits, and the Haar
// seed options.seed; the widths come from the first half, as OSCAR's calibration does).
Calibration SyntheticCalibration(const SchemeShape& shape, const SchemeOptions& options,
                                 int64_t tokens, uint64_t seed, int threads = 2,
                                 const std::string& scheme = "oscar");

// SyntheticCalibration per calibration kind (CalibrationScheme), each made on first use: what
// the consumers that build several schemes without a capture (kvq bench, the benchmarks, the
// golden vectors) hand BuildLayerScheme.
class SyntheticCalibrations {
 public:
  SyntheticCalibrations(const SchemeShape& shape, const SchemeOptions& options, int64_t tokens,
                        uint64_t seed, int threads = 2)
      : shape_(shape), options_(options), tokens_(tokens), seed_(seed), threads_(threads) {}
  // The calibration scheme `name` reads. Throws what SyntheticCalibration throws.
  const Calibration& For(const std::string& name);

 private:
  SchemeShape shape_;
  SchemeOptions options_;
  int64_t tokens_;
  uint64_t seed_;
  int threads_;
  std::map<std::string, Calibration> made_;
};

// Whether `cal` serves scheme `name` as it is: every calibration serves the schemes without
// calibrated fp8 scales or widths; those need a calibration made for them (its scheme is
// `name`, holding the scales, or the widths of every layer).
bool CalibrationServes(const Calibration& cal, const std::string& name);
// The calibration scheme `name` reads: `cal` when it serves it; for a scheme with calibrated
// fp8 scales a copy of `cal` with `name`'s scales computed on the calibration tokens of `acts`
// (Fp8Scales after the scheme's rotations, as kvq calibrate --scheme does); for a scheme whose
// key widths come from the calibration (blockgtq) the codebook calibration of `acts` that
// `kvq calibrate --scheme <name> --k-bits K --v-bits V --seed S` makes (CalibrateCodebook: the
// same widths, rotations and row limits), K = options.k_bits or else options.bits (SchemeOptions'
// default: 2, as tq_mse's K under the same options), V = options.v_bits or else options.bits,
// S = options.seed, the rest kvq calibrate's defaults (rotation threshold 1, Beta tables) and
// `cal`'s windows and source recorded. `options` are the options the scheme will be built with.
// Throws kInvalidArgument naming the scheme and what is missing (the fp8 scales; the widths as
// tensors layers.{l}.k_bits) when `acts` is null and `cal` does not serve it; kShapeMismatch
// when the shapes differ; what CalibrateCodebook throws (e.g. a K width outside [1, 8]).
Calibration CalibrationForScheme(const std::string& name, const Calibration& cal,
                                 const Activations* acts, const cpu::Backend& backend,
                                 const SchemeOptions& options);

// What `kvq calibrate --scheme` makes the calibration of scheme `name` with: the name itself
// for a scheme whose fp8 scales or block widths come from the calibration (its `scale` or
// `widths` column), else "oscar" (every other calibrated scheme reads the OSCAR calibration).
// Throws as SchemeByName does.
std::string CalibrationScheme(const std::string& name);

// The same scheme restricted to one KV head (Hkv = 1, Hq = the head's g query heads): the
// per-head data of `kv_head` only (HeadData::Slice: every row of head_data.inc). Throws
// kInvalidArgument for a head out of range, kUnsupported for a token-scope norm over several KV
// heads (it couples them).
LayerScheme SliceKvHead(const LayerScheme& scheme, int kv_head);

}  // namespace kvq::calib
