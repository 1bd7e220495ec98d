// The pipeline behind `kvq ppl` and `kvq demo`, as a library call: load a model folder and its
// token windows, capture the calibration windows with the fp32 forward (or read a capture),
// calibrate OSCAR (or read a calibration), build every scheme with its clip choice, run the
// teacher-forced evaluation (ppl.h) on the CPU, on a GPU the caller supplies, or on both and
// compare them.
//
// It prints nothing: the caller follows it through hooks (a phase begins, a phase ends, the
// progress of a phase's work items) and reads the result. It links no CUDA code: a GPU run
// takes the device's forwards from PplGpuHooks (kvq's CLI supplies its GPU module's).
//
// The options are `kvq ppl`'s, and so are the errors: each kvq::Error names the option
// (as the CLI spells it: `--clip 'x' (own, oscar or both)`), the file or the value at fault.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvq/calib/calibration_file.h"
#include "kvq/calib/fair_clip.h"
#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

struct PplPipelineOptions {
  std::string model;                 // --model: folder with config.json and model.safetensors
  std::string tokens;                // --tokens: token windows file; "": the model folder's
  std::string windows = "heldout_en:0-3,heldout_code:0-3";  // --windows NAME[:i|:a-b],...
  int64_t length = 0;                // --length: tokens per evaluated window (0 = whole)
  std::string calibration;           // --calibration: OSCAR calibration file; "": calibrate here
  std::string calib_activations;     // --calib-activations: a capture; "": capture here
  std::string calib_windows = "calib";  // --calib-windows (captured with the fp32 forward)
  int64_t calib_length = 0;          // --calib-length (0 = whole windows)
  std::string save_calibration;      // --save-calibration: write the calibration computed here
  std::string schemes = "all";       // --schemes: all, or NAME[@own|@oscar|@none],...
  std::string clip = "own";          // --clip: own, oscar or both
  std::vector<double> clip_grid;     // --clip-grid; empty: DefaultClipGrid()
  // --group, --bits, --sink, --recent: those left unset follow a calibration file's when one is
  // read, else SchemeOptions' defaults (64, 2, 64, 256).
  std::optional<int> group, bits, sink, recent;
  int k_bits = 0, v_bits = 0;        // --k-bits / --v-bits: one side's b, 2 or 4 (0: bits)
  int page = 64;                     // --page
  uint64_t seed = 0;                 // --seed: random_orthogonal's
  int saw_block = 128;               // --saw-block: the SAW schemes' FWHT block (BDR-h)
  int64_t tail_from = -1;            // --tail-from (-1: S0 + W)
  int threads = 0;                   // --threads (0: every core)
  bool per_position = false;         // --per-position
  bool share_prefix = true;          // false: --no-share-prefix
  bool fp32_baseline = true;         // false: --no-fp32 (never on the GPU)
  std::string backend = "cpu";       // --backend: cpu, gpu or both (PplGpuHooks)
  std::string scheme_windows = "own";  // --scheme-windows: own or shared
  double max_rel_ppl = 1e-3;         // --max-rel-ppl: both's largest |PPL_gpu / PPL_cpu - 1|
};

// The phases of a run, in order; kGpuSelect runs with --backend gpu or both, kCompare (the
// same evaluation on the CPU, compared with the GPU's) with both.
enum class PplPhase {
  kLoad,       // the model and the windows (ends with config, sets)
  kCapture,    // the calibration activations (ends with capture)
  kCalibrate,  // the calibration (ends with calibration_origin, calibration)
  kBuild,      // every scheme's layers; --scheme-windows shared (ends with evaluation,
               // shared_windows)
  kGpuSelect,  // the schemes the GPU serves (ends with gpu_unsupported; evaluation keeps the
               // rest). Then kUnsupported when none is left
  kEvaluate,   // on the GPU when it is used, else on the CPU (ends with gpu or cpu)
  kCompare,    // --backend both: the CPU (ends with cpu, comparison)
};

// Where an input of the run came from.
enum class PplOrigin {
  kUnneeded,  // no chosen scheme needs it
  kFile,      // read (--calib-activations, --calibration)
  kComputed,  // captured or calibrated here
};

// A scheme that took the shared windows (--scheme-windows shared), labelled NAME+w.
struct PplSharedWindows {
  std::string label;
  int flush = 1;  // its own F, kept
};

// A scheme the GPU cannot serve (--schemes all: dropped from the GPU run).
struct PplUnsupported {
  std::string label;
  std::string why;  // PplGpuHooks::unsupported's answer
};

// One row of one window set, GPU against CPU: relative differences GPU / CPU - 1.
struct PplBackendRow {
  std::string set, row;  // window set, row label
  double ppl_cpu = 0, ppl_gpu = 0, rel_ppl = 0;            // all positions
  double ppl_tail_cpu = 0, ppl_tail_gpu = 0, rel_ppl_tail = 0;
  double max_rel_ppl_window = 0;                           // the largest per window, signed
  double kl_tail_cpu = 0, kl_tail_gpu = 0, rel_kl_tail = 0;
  double top1_tail_cpu = 0, top1_tail_gpu = 0;
  bool within = true;                                      // |rel_ppl| <= max_rel_ppl
};

struct PplBackendComparison {
  double max_rel_ppl = 0;    // the tolerance
  double worst_rel_ppl = 0;  // largest |rel_ppl|
  double worst_rel_kl = 0;   // largest |rel_kl_tail| over rows whose CPU KL is > 0
  bool within = true;        // every row within
  std::vector<PplBackendRow> rows;  // the GPU's rows that the CPU has, in the GPU's order
};

// The GPU against the CPU, row by row. The criterion is the PPL over all positions of a set;
// the tail and the single windows (fewer predictions, more of the INT2 codes that flip between
// two fp32 implementations) are shown, not gated (docs/perplexity.md).
PplBackendComparison CompareBackends(const PplResult& cpu, const PplResult& gpu,
                                     double max_rel_ppl);

// Everything a run found, filled phase by phase (a hook sees it as far as the run got).
struct PplPipelineResult {
  int threads = 0;                      // options.threads resolved
  std::vector<SchemeVariant> requested;  // the rows --schemes and --clip ask for, in order
  // kLoad
  ModelConfig config;
  std::vector<TokenWindows> sets;       // the evaluated windows
  double load_seconds = 0;
  // kCapture
  PplOrigin capture = PplOrigin::kUnneeded;
  int64_t capture_tokens = 0;           // tokens of the capture
  double capture_seconds = 0;
  // kCalibrate
  PplOrigin calibration_origin = PplOrigin::kUnneeded;
  Calibration calibration;              // the one used (empty when unneeded)
  double calibrate_seconds = 0;
  // kBuild (kGpuSelect drops from evaluation.schemes what the GPU does not serve)
  PplOptions evaluation;                // the rows and the cache options evaluated (the GPU's
                                        // run has no fp32 row)
  std::vector<PplSharedWindows> shared_windows;
  double build_seconds = 0;
  // kGpuSelect
  std::vector<PplUnsupported> gpu_unsupported;
  // kEvaluate, kCompare
  std::optional<PplResult> gpu, cpu;
  double gpu_seconds = 0, cpu_seconds = 0;  // each evaluation, its forwards' setup included
  std::optional<PplBackendComparison> comparison;  // both
  double seconds = 0;                   // the whole run
};

// The GPU's side of --backend gpu and both (kvq's CLI: its GPU module, tools/cli_gpu.h).
struct PplGpuHooks {
  // Why the GPU cannot run a scheme (its layers [L]), or "" when it can.
  std::function<std::string(const std::vector<LayerScheme>& layers)> unsupported;
  // The GPU's forwards of `model`, asked for once, after kGpuSelect; the caller owns them and
  // keeps them alive until RunPplPipeline returns.
  std::function<PplForwards&(const Model& model)> forwards;
};

struct PplPipelineHooks {
  // Called as each phase begins and as it ends (not when it throws), with the result so far.
  std::function<void(PplPhase, const PplPipelineResult&)> begin, end;
  // The progress callback of a phase's work items (capture windows, calibration units, schemes
  // x layers, forward passes), asked for as the work starts; null or empty: none.
  std::function<PplProgress(PplPhase)> progress;
  PplGpuHooks gpu;  // needed by --backend gpu and both
};

// The checks that need nothing read: --threads >= 0 and the values of --clip, --backend and
// --scheme-windows. A caller runs them before it acquires a GPU; RunPplPipeline runs them
// first too. Throws kvq::Error(kInvalidArgument) naming the option and its value.
void CheckPplPipelineOptions(const PplPipelineOptions& options);

// Runs the pipeline with the CPU kernels of `backend` (the calibration, the caches, the CPU
// forwards). Throws kvq::Error naming the offending option, file or value: the checks above;
// --k-bits / --v-bits other than 2 or 4; an unknown scheme (before any work); an option the
// chosen schemes would leave unused (--save-calibration, --calib-activations); a calibration
// of another shape than the model; --backend gpu or both without PplGpuHooks; a scheme named
// in --schemes that the GPU cannot serve, or none left of all (kUnsupported); and what loading,
// calibrating and evaluating throw. A GPU / CPU difference over max_rel_ppl is not an error:
// comparison->within says so.
PplPipelineResult RunPplPipeline(const PplPipelineOptions& options, const cpu::Backend& backend,
                                 const PplPipelineHooks& hooks = {});

}  // namespace kvq::calib
