// `kvq ppl` as a library: teacher-forced end-to-end evaluation of KV-cache schemes on a model
// (issue 16, item 3; shared/research/accuracy.md §2d is the methodology).
//
// For every window of T tokens and every scheme the model runs layer by layer; in layer l the
// T rows of k and v (computed from a layer input that already carries the scheme's error from
// the layers below) are prefilled into the scheme's real paged cache, and the query at
// position p reads the cache as it is at length p + 1 (CacheAttention: history rows
// dequantized in the rotated space, sink and recent rows in bf16). The masked full forward is
// teacher-forced decoding.
//
// The reference is the same forward with a bf16 cache (every row rounded to bf16); the `bf16`
// scheme runs through its own PagedKVCache and equals it bit for bit (KL exactly 0). The fp32
// forward (no cache rounding) is reported beside it. Metrics per scheme, over the next-token
// predictions at positions p ∈ [0, T − 1) ("all") and p ≥ tail_from (default S0 + W: where
// the history exists): NLL → perplexity, KL(p_bf16 ‖ p_scheme), top-1 agreement with the
// reference; and per window ΔKL against OSCAR (tail positions) with a paired 95 % interval
// (Student t over windows) and the count of windows where the scheme's KL is lower.
//
// Cost: positions before the first one whose cache holds a history (S0 + W for F = 1) see only
// bf16 rows, so every scheme equals the reference there, in every layer, bit for bit
// (matmul.h's per-row results, CacheAttention's rows independent of the first computed row).
// With share_prefix the reference keeps those rows' k and v and each scheme's forward runs
// positions [S0 + W, T) only (the bf16 scheme always runs in full: its KL = 0 is a live check).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/fair_clip.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/model.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

struct PplOptions {
  std::vector<SchemeVariant> schemes;  // table rows (ParseSchemeVariants); must include oscar
                                       // for the ΔKL columns (they are empty otherwise)
  SchemeOptions scheme;                // G, bits, S0, W, page, seed, saw_block
  std::vector<double> clip_grid;       // the own-clip grid; empty: DefaultClipGrid()
  int threads = 2;                     // any count gives the same numbers
  bool share_prefix = true;            // see above; false runs every scheme from position 0
  bool fp32_baseline = true;           // also run the fp32 forward (no cache rounding)
  bool per_position = false;           // keep per-position NLL and KL of every window
  int64_t tail_from = -1;              // the second position set: p ≥ tail_from; −1: S0 + W
};

// Sums over one set of prediction positions of one window.
struct PositionSums {
  int64_t count = 0;
  double nll = 0;    // Σ −log p(next token)
  double kl = 0;     // Σ KL(p_bf16 ‖ p)
  int64_t top1 = 0;  // predictions whose argmax equals the reference's
  double MeanNll() const { return count > 0 ? nll / count : 0.0; }
  double MeanKl() const { return count > 0 ? kl / count : 0.0; }
};

struct WindowScore {
  PositionSums all, tail;
  std::vector<float> nll, kl;  // [T − 1] per prediction position, when per_position
};

// One row of one window set: a scheme variant, the bf16 reference or the fp32 forward.
struct RowResult {
  std::string label;        // "oscar", "eigenbasis_only@oscar", "bf16 (reference)", "fp32 (no cache)"
  std::string scheme;       // catalogue name; "" for the fp32 row
  std::string clip;         // "own", "oscar", "none" ("" for the reference rows)
  std::vector<float> clip_k, clip_v;  // [L] ratios of KV head 0 (1 = no clip)
  double bits_per_element = 16;       // K and V at the window length, mean over layers
                                      // (the bf16 windows included)
  double history_bits = 16;           // K and V in the quantized history alone, mean over
                                      // layers (CacheParams::history_bits_per_element)
  std::vector<WindowScore> windows;   // one per window of the set

  PositionSums Total(bool tail) const;  // summed over windows
  double Ppl(bool tail) const;          // exp(Σ nll / Σ count)
  double MeanKl(bool tail) const;       // Σ kl / Σ count
  double Top1(bool tail) const;         // Σ top1 / Σ count
};

// Paired comparison of a row with OSCAR over the windows of a set (tail positions).
struct PairedDelta {
  int windows = 0;
  double mean = 0, low = 0, high = 0;  // ΔKL = KL(row) − KL(oscar); 95 % t interval
  int won = 0;                          // windows where the row's KL < OSCAR's
  bool valid = false;                   // false without an oscar row or with < 2 windows
};
PairedDelta CompareWithOscar(const RowResult& row, const RowResult& oscar);

// Two-sided Student t quantile: the t with P(|T_df| ≤ t) = level (level in (0, 1), df ≥ 1).
double StudentTQuantile(double level, int df);

struct WindowSetResult {
  std::string name;               // tensor name (heldout_en, ...)
  std::vector<int> windows;       // its windows (row indices of the tensor)
  int64_t length = 0;             // T
  std::vector<RowResult> rows;    // the reference, the fp32 forward (optional), then the
                                  // schemes in the order asked
  const RowResult* Find(const std::string& label) const;  // null when absent
};

struct PplResult {
  std::string model;              // the model folder
  ModelConfig config;
  PplOptions options;             // as run (tail_from resolved)
  std::string calibration_source; // the calibration's source, or ""
  std::vector<WindowSetResult> sets;
  double seconds = 0;
  const WindowSetResult& Get(const std::string& set) const;  // throws naming it
};

// done ≤ total work items (windows × rows), from the calling thread only.
using PplProgress = std::function<void(int done, int total)>;

// Builds every scheme's per-layer cache configuration: BuildLayerScheme on the model's shape,
// then the clip choice (fair_clip.h) per layer; (scheme, layer) units on options.threads
// threads. `calib_acts` (the calibration capture) is needed by own clips, `cal` by the
// calibrated schemes and @oscar (raw_target by its raw rotations: format_version 2, or
// AddRawTargetRotations). Returns [schemes][L]. `progress(done, schemes·L)` is called from the
// calling thread after each (scheme, layer).
std::vector<std::vector<LayerScheme>> BuildVariantLayers(const ModelConfig& config,
                                                         const Activations* calib_acts,
                                                         const Calibration* cal,
                                                         const PplOptions& options,
                                                         const cpu::Backend& backend,
                                                         const PplProgress& progress = {});

// `kvq ppl --scheme-windows shared`: a scheme whose own windows keep no sink (S0 = 0: the SAW
// family, KIVI and its variants, OScaR) takes the shared windows o.sink and o.recent instead
// (its flush F stays: tiles still fill whole). Returns false, leaving `layers` alone, for a
// scheme that has no own windows or keeps a sink. Callers label the result NAME+w.
bool ShareSchemeWindows(const SchemeVariant& variant, const SchemeOptions& o,
                        std::vector<LayerScheme>* layers);

// The forward passes an evaluation runs, as a hook: the CPU's (CpuPplForwards: Forward with
// DenseAttention / CacheAttention) by default; a GPU twin (gpu/ppl) runs the same requests on
// the device. Each returns logits [T − first, V] as Forward does, and honours request.first,
// .prefix and .keep the same way. Calls may come from several threads at once (the
// implementation serialises what it must).
class PplForwards {
 public:
  virtual ~PplForwards() = default;
  // The reference: K and V as a bf16 cache holds them.
  virtual std::vector<float> Reference(const ForwardRequest& request) = 0;
  // The fp32 forward (no cache rounding). May throw kUnsupported (the row is then not asked
  // for: the caller clears PplOptions::fp32_baseline).
  virtual std::vector<float> Fp32(const ForwardRequest& request) = 0;
  // Scheme `scheme` (index into PplOptions::schemes) through its caches, `layers` [L];
  // *bits_per_element (may be null): K and V at the window's length, mean over layers.
  virtual std::vector<float> Scheme(int scheme, const std::vector<LayerScheme>& layers,
                                    const ForwardRequest& request, double* bits_per_element) = 0;
};

// The CPU forwards (calib/forward.h): DenseAttention kBf16 / kNone and CacheAttention on
// `backend` (both must outlive this object).
class CpuPplForwards : public PplForwards {
 public:
  CpuPplForwards(const Model& model, const cpu::Backend& backend)
      : model_(&model), backend_(&backend) {}
  std::vector<float> Reference(const ForwardRequest& request) override;
  std::vector<float> Fp32(const ForwardRequest& request) override;
  std::vector<float> Scheme(int scheme, const std::vector<LayerScheme>& layers,
                            const ForwardRequest& request, double* bits_per_element) override;

 private:
  const Model* model_;
  const cpu::Backend* backend_;
};

// Runs the evaluation. `layers` from BuildVariantLayers (same order as options.schemes).
// `forwards`: where the forward passes run (null: CpuPplForwards(model, backend)); the
// scoring, the work order and the shared prefix are the same for every implementation.
// Throws kvq::Error(kInvalidArgument): windows longer than the model's context, shorter than 2
// tokens or with no prediction at positions ≥ tail_from, threads < 1, layers not matching the
// schemes; and what the forward and the caches throw.
PplResult EvaluatePerplexity(const Model& model, const std::vector<TokenWindows>& sets,
                             const std::vector<std::vector<LayerScheme>>& layers,
                             const PplOptions& options, const cpu::Backend& backend,
                             const PplProgress& progress = {}, PplForwards* forwards = nullptr);

// The end-to-end table, one block per window set: label, clip, bits/elem, PPL (all and
// tail), ΔPPL vs the reference, KL (tail), top-1 (tail), ΔKL vs OSCAR with its 95 % interval
// and windows won.
std::string FormatPplTable(const PplResult& result);

// A few sentences per window set computed from the table: the schemes ordered by KL at the
// tail positions, and OSCAR's KL against hadamard's and naive's (ratios, with whether the
// paired 95 % interval excludes 0). Rows missing from the result are left out.
std::string SummarizePpl(const PplResult& result);

// Everything as JSON (options, clip ratios per layer, per-window sums, paired deltas and, when
// kept, per-position NLL and KL).
std::string PplJson(const PplResult& result);
void WritePplJson(const std::string& path, const PplResult& result);

}  // namespace kvq::calib
