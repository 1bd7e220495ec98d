#include "kvq/calib/ppl_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <tuple>
#include <utility>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/forward.h"
#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The hooks, each optional.
class Observer {
 public:
  Observer(const PplPipelineHooks& hooks, const PplPipelineResult& result)
      : hooks_(hooks), result_(result) {}
  void Begin(PplPhase phase) const {
    if (hooks_.begin) hooks_.begin(phase, result_);
  }
  void End(PplPhase phase) const {
    if (hooks_.end) hooks_.end(phase, result_);
  }
  PplProgress Progress(PplPhase phase) const {
    return hooks_.progress ? hooks_.progress(phase) : PplProgress();
  }

 private:
  const PplPipelineHooks& hooks_;
  const PplPipelineResult& result_;
};

// The rows of --schemes, with --clip oscar moving every scheme that clips by the calibration's
// rule to OSCAR's ratios (labelled NAME@oscar).
std::vector<SchemeVariant> RequestedRows(const PplPipelineOptions& o) {
  std::vector<SchemeVariant> variants = ParseSchemeVariants(o.schemes, o.clip == "both");
  if (o.clip == "oscar") {
    for (SchemeVariant& v : variants) {
      if (v.clip == ClipChoice::kCatalogue && SchemeClipsWithCalibration(v.scheme) &&
          v.scheme != "oscar") {
        v.clip = ClipChoice::kOscar;
        v.label += "@oscar";
      }
    }
  }
  return variants;
}

// What the rows need: a calibration (the calibrated schemes, @oscar clips), a capture (own
// clips; raw_target, whose format_version 1 calibration gets its raw rotations from the capture;
// the fp8 schemes, which compute their scales on it unless the calibration file is their own;
// and a calibration computed here).
struct Needs {
  bool calibration = false, capture = false;
};

Needs NeedsOf(const std::vector<SchemeVariant>& variants, const PplPipelineOptions& o) {
  Needs needs;
  for (const SchemeVariant& v : variants) {
    const ClipChoice clip = v.Resolved();
    needs.calibration = needs.calibration || SchemeByName(v.scheme).needs_calibration ||
                        clip == ClipChoice::kOscar;
    needs.capture = needs.capture || clip == ClipChoice::kOwn || v.scheme == "raw_target" ||
                    CalibrationScheme(v.scheme) != "oscar";
  }
  needs.capture = needs.capture || (needs.calibration && o.calibration.empty());
  return needs;
}

// An option that the chosen schemes would leave unused is an error, not silence.
void CheckUsed(const PplPipelineOptions& o, const Needs& needs) {
  KVQ_CHECK(o.save_calibration.empty() || o.calibration.empty(), kInvalidArgument,
            "--save-calibration ", o.save_calibration, " saves a calibration computed here, "
            "but --calibration ", o.calibration, " is given");
  KVQ_CHECK(o.save_calibration.empty() || needs.calibration, kInvalidArgument,
            "--save-calibration ", o.save_calibration, ": no scheme of --schemes ", o.schemes,
            " (--clip ", o.clip, ") needs a calibration, so none is computed");
  KVQ_CHECK(o.calib_activations.empty() || needs.capture, kInvalidArgument,
            "--calib-activations ", o.calib_activations, ": no scheme of --schemes ", o.schemes,
            " (--clip ", o.clip, ") needs calibration activations");
}

// The cache options: each of G, b, S0, W given, else the calibration file's, else the default;
// each side's width --k-bits / --v-bits, else the calibration's (unless --bits is given), else
// b. The file's (when read) must match the model's shape.
SchemeOptions CacheOptions(const PplPipelineOptions& o, const ModelConfig& c,
                           const Calibration* file) {
  SchemeOptions s;
  if (file != nullptr) {
    KVQ_CHECK(file->info.num_layers == c.num_layers && file->info.num_kv_heads == c.num_kv_heads &&
                  file->info.head_dim == c.head_dim,
              kShapeMismatch, "calibration '", o.calibration, "' is ", file->info.num_layers,
              " layers x ", file->info.num_kv_heads, " KV heads x d=", file->info.head_dim,
              ", the model ", c.num_layers, " x ", c.num_kv_heads, " x d=", c.head_dim);
    s.group = file->info.group;
    s.bits = file->info.bits;
    s.sink = file->info.sink;
    s.recent = file->info.recent;
  }
  s.group = o.group.value_or(s.group);
  s.bits = o.bits.value_or(s.bits);
  s.sink = o.sink.value_or(s.sink);
  s.recent = o.recent.value_or(s.recent);
  int k_bits = s.bits, v_bits = s.bits;
  if (file != nullptr && !o.bits && file->info.v_bits != 0) v_bits = file->info.v_bits;
  if (o.k_bits != 0) k_bits = o.k_bits;
  if (o.v_bits != 0) v_bits = o.v_bits;
  s.k_bits = k_bits != s.bits ? k_bits : 0;
  s.v_bits = v_bits != s.bits ? v_bits : 0;
  s.page = o.page;
  s.seed = o.seed;
  s.saw_block = o.saw_block;
  return s;
}

// --scheme-windows shared: the schemes whose own windows keep no sink take the shared ones
// (ShareSchemeWindows), labelled NAME+w.
void ShareWindows(PplOptions* options, std::vector<std::vector<LayerScheme>>* layers,
                  std::vector<PplSharedWindows>* shared) {
  for (size_t i = 0; i < options->schemes.size(); ++i) {
    SchemeVariant& v = options->schemes[i];
    if (!ShareSchemeWindows(v, options->scheme, &(*layers)[i])) continue;
    v.label += "+w";
    shared->push_back({v.label, (*layers)[i][0].params.flush});
  }
}

// Drops the schemes the GPU cannot serve (all: each noted), or refuses one named.
void KeepGpuSchemes(const PplGpuHooks& gpu, bool all, PplOptions* options,
                    std::vector<std::vector<LayerScheme>>* layers,
                    std::vector<PplUnsupported>* dropped) {
  std::vector<SchemeVariant> kept_variants;
  std::vector<std::vector<LayerScheme>> kept_layers;
  for (size_t i = 0; i < options->schemes.size(); ++i) {
    const SchemeVariant& v = options->schemes[i];
    const std::string why = gpu.unsupported((*layers)[i]);
    if (why.empty()) {
      kept_variants.push_back(v);
      kept_layers.push_back(std::move((*layers)[i]));
      continue;
    }
    KVQ_CHECK(all, kUnsupported, "scheme '", v.label, "' has no CUDA path: ", why);
    dropped->push_back({v.label, why});
  }
  options->schemes = std::move(kept_variants);
  *layers = std::move(kept_layers);
}

}  // namespace

PplBackendComparison CompareBackends(const PplResult& cpu, const PplResult& gpu,
                                     double max_rel_ppl) {
  auto rel = [](double a, double b) { return b != 0 ? a / b - 1.0 : (a == 0 ? 0.0 : 1.0); };
  PplBackendComparison out;
  out.max_rel_ppl = max_rel_ppl;
  for (const WindowSetResult& set : gpu.sets) {
    const WindowSetResult& cs = cpu.Get(set.name);
    for (const RowResult& g : set.rows) {
      const RowResult* c = cs.Find(g.label);
      if (c == nullptr) continue;
      PplBackendRow row;
      row.set = set.name;
      row.row = g.label;
      row.ppl_cpu = c->Ppl(false);
      row.ppl_gpu = g.Ppl(false);
      row.rel_ppl = rel(row.ppl_gpu, row.ppl_cpu);
      row.ppl_tail_cpu = c->Ppl(true);
      row.ppl_tail_gpu = g.Ppl(true);
      row.rel_ppl_tail = rel(row.ppl_tail_gpu, row.ppl_tail_cpu);
      for (size_t w = 0; w < g.windows.size() && w < c->windows.size(); ++w) {
        const double d = rel(std::exp(g.windows[w].all.MeanNll()),
                             std::exp(c->windows[w].all.MeanNll()));
        if (std::abs(d) > std::abs(row.max_rel_ppl_window)) row.max_rel_ppl_window = d;
      }
      row.kl_tail_cpu = c->MeanKl(true);
      row.kl_tail_gpu = g.MeanKl(true);
      row.rel_kl_tail = rel(row.kl_tail_gpu, row.kl_tail_cpu);
      row.top1_tail_cpu = c->Top1(true);
      row.top1_tail_gpu = g.Top1(true);
      row.within = std::abs(row.rel_ppl) <= max_rel_ppl;
      out.within = out.within && row.within;
      out.worst_rel_ppl = std::max(out.worst_rel_ppl, std::abs(row.rel_ppl));
      if (row.kl_tail_cpu > 0) out.worst_rel_kl = std::max(out.worst_rel_kl, std::abs(row.rel_kl_tail));
      out.rows.push_back(std::move(row));
    }
  }
  return out;
}

void CheckPplPipelineOptions(const PplPipelineOptions& o) {
  KVQ_CHECK(o.threads >= 0, kInvalidArgument, "--threads ", o.threads, " must be >= 0");
  KVQ_CHECK(o.clip == "own" || o.clip == "oscar" || o.clip == "both", kInvalidArgument,
            "--clip '", o.clip, "' (own, oscar or both)");
  KVQ_CHECK(o.backend == "cpu" || o.backend == "gpu" || o.backend == "both", kInvalidArgument,
            "--backend '", o.backend, "' (cpu, gpu or both)");
  KVQ_CHECK(o.scheme_windows == "own" || o.scheme_windows == "shared", kInvalidArgument,
            "--scheme-windows '", o.scheme_windows, "' (own or shared)");
}

PplPipelineResult RunPplPipeline(const PplPipelineOptions& o, const cpu::Backend& backend,
                                 const PplPipelineHooks& hooks) {
  const auto start = Clock::now();
  CheckPplPipelineOptions(o);
  const bool use_gpu = o.backend != "cpu";
  KVQ_CHECK(!use_gpu || (hooks.gpu.unsupported && hooks.gpu.forwards), kInvalidArgument,
            "--backend ", o.backend, ": no GPU forwards given (PplPipelineHooks::gpu)");
  PplPipelineResult r;
  const Observer observer(hooks, r);
  r.threads = o.threads > 0 ? o.threads
                            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // Scheme rows first: a typo fails before any work.
  r.requested = RequestedRows(o);
  // --k-bits / --v-bits reach the schemes of shared width: INT-b sides take 2 or 4, codebook
  // sides 1..8 (Block-GTQ's K average may not be an integer there: kvq calibrate's --k-bits).
  for (const SchemeVariant& v : r.requested) {
    const SchemeInfo& info = SchemeByName(v.scheme);
    if (info.bits != kSharedBits || !info.quantized()) continue;
    for (const auto& [name, value, format] :
         {std::tuple<const char*, int, Format>{"--k-bits", o.k_bits, info.format_k},
          {"--v-bits", o.v_bits, info.format_v}}) {
      const bool codebook = format == Format::kCodebook;
      KVQ_CHECK(value == 0 || (codebook ? value >= 1 && value <= 8 : value == 2 || value == 4),
                kInvalidArgument, name, " ", value, " is not supported by scheme '", v.scheme,
                "' (", codebook ? "1..8" : "2 or 4", ")");
    }
  }
  const Needs needs = NeedsOf(r.requested, o);
  CheckUsed(o, needs);
  const bool capture_here = needs.capture && o.calib_activations.empty();

  // The windows before the weights: the RoPE tables cover only the positions they hold.
  auto t = Clock::now();
  observer.Begin(PplPhase::kLoad);
  const ModelConfig config = ReadModelConfig(o.model);
  const std::string tokens_path = o.tokens.empty() ? DefaultTokensPath(o.model) : o.tokens;
  r.sets = ReadTokenWindows(tokens_path, ParseWindowSelections(o.windows), o.length,
                            config.vocab);
  std::vector<TokenWindows> calib_sets;
  if (capture_here) {
    calib_sets = ReadTokenWindows(tokens_path, ParseWindowSelections(o.calib_windows),
                                  o.calib_length, config.vocab);
  }
  int64_t positions = 0;
  for (const TokenWindows& s : r.sets) positions = std::max(positions, s.length);
  for (const TokenWindows& s : calib_sets) positions = std::max(positions, s.length);
  const Model model = LoadModel(o.model, positions);
  r.config = model.config;
  r.load_seconds = SecondsSince(t);
  observer.End(PplPhase::kLoad);

  // A calibration file is read and checked against the model before any forward runs.
  const bool have_file = !o.calibration.empty();
  if (have_file) {
    r.calibration = ReadCalibration(o.calibration);
    r.calibration_origin = PplOrigin::kFile;
  }
  PplOptions& options = r.evaluation;
  options.scheme = CacheOptions(o, r.config, have_file ? &r.calibration : nullptr);

  t = Clock::now();
  observer.Begin(PplPhase::kCapture);
  Activations calib_acts;
  if (needs.capture) {
    if (!capture_here) {
      calib_acts = ReadActivations(o.calib_activations);
      r.capture = PplOrigin::kFile;
    } else {
      calib_acts = CaptureActivations(model, calib_sets, -1, r.threads,
                                      "kvq capture " + o.model + " " + o.calib_windows,
                                      observer.Progress(PplPhase::kCapture));
      r.capture = PplOrigin::kComputed;
    }
    r.capture_tokens = calib_acts.info.tokens;
  }
  r.capture_seconds = SecondsSince(t);
  observer.End(PplPhase::kCapture);

  t = Clock::now();
  observer.Begin(PplPhase::kCalibrate);
  if (have_file) {
    // Only an OSCAR file can be a format_version 1 file; a codebook file (kvq calibrate
    // --scheme tq_mse | blockgtq) holds no raw-target rotations by design.
    if (needs.capture && !r.calibration.layers.empty() && r.calibration.info.scheme == "oscar" &&
        r.calibration.layers[0].raw_k_rotation.empty()) {
      AddRawTargetRotations(calib_acts, &r.calibration);  // a format_version 1 file
    }
  } else if (needs.calibration) {
    CalibrationOptions calibrate;
    calibrate.group = options.scheme.group;
    // The clip ratios are chosen for an INT-b width (2 or 4); a codebook width (the codebook
    // schemes make their own calibration from the capture: CalibrationForScheme) leaves them
    // at --bits.
    const auto affine = [&](int b) { return b == 2 || b == 4 ? b : options.scheme.bits; };
    const int k_bits =
        affine(options.scheme.k_bits != 0 ? options.scheme.k_bits : options.scheme.bits);
    const int v_bits =
        affine(options.scheme.v_bits != 0 ? options.scheme.v_bits : options.scheme.bits);
    calibrate.bits = k_bits;
    calibrate.v_bits = v_bits != k_bits ? v_bits : 0;
    calibrate.sink = options.scheme.sink;
    calibrate.recent = options.scheme.recent;
    calibrate.threads = r.threads;
    calibrate.source = calib_acts.info.source;
    r.calibration =
        Calibrate(calib_acts, calibrate, backend, observer.Progress(PplPhase::kCalibrate));
    r.calibration_origin = PplOrigin::kComputed;
    if (!o.save_calibration.empty()) WriteCalibration(o.save_calibration, r.calibration);
  }
  const bool have_cal = r.calibration_origin != PplOrigin::kUnneeded;
  r.calibrate_seconds = SecondsSince(t);
  observer.End(PplPhase::kCalibrate);

  options.schemes = r.requested;
  options.clip_grid = o.clip_grid;
  options.threads = r.threads;
  options.share_prefix = o.share_prefix;
  options.fp32_baseline = o.fp32_baseline;
  options.per_position = o.per_position;
  options.tail_from = o.tail_from;

  t = Clock::now();
  observer.Begin(PplPhase::kBuild);
  std::vector<std::vector<LayerScheme>> layers = BuildVariantLayers(
      r.config, needs.capture ? &calib_acts : nullptr, have_cal ? &r.calibration : nullptr,
      options, backend, observer.Progress(PplPhase::kBuild));
  r.build_seconds = SecondsSince(t);
  if (o.scheme_windows == "shared") ShareWindows(&options, &layers, &r.shared_windows);
  observer.End(PplPhase::kBuild);
  if (use_gpu) {
    observer.Begin(PplPhase::kGpuSelect);
    KeepGpuSchemes(hooks.gpu, o.schemes == "all", &options, &layers, &r.gpu_unsupported);
    observer.End(PplPhase::kGpuSelect);
    KVQ_CHECK(!options.schemes.empty(), kUnsupported, "no scheme left that the GPU serves");
  }

  auto evaluate = [&](const PplOptions& run, PplPhase phase, PplForwards* forwards) {
    PplResult result = EvaluatePerplexity(model, r.sets, layers, run, backend,
                                          observer.Progress(phase), forwards);
    if (have_cal) result.calibration_source = r.calibration.info.source;
    return result;
  };
  t = Clock::now();
  observer.Begin(PplPhase::kEvaluate);
  if (!use_gpu) {
    r.cpu = evaluate(options, PplPhase::kEvaluate, nullptr);
    r.cpu_seconds = SecondsSince(t);
    observer.End(PplPhase::kEvaluate);
    r.seconds = SecondsSince(start);
    return r;
  }
  // The GPU: the same evaluation with the forwards on the device (no fp32 row there: a cache
  // holds bf16 or quantized rows).
  PplOptions gpu_options = options;
  gpu_options.fp32_baseline = false;
  PplForwards& forwards = hooks.gpu.forwards(model);
  r.gpu = evaluate(gpu_options, PplPhase::kEvaluate, &forwards);
  r.gpu_seconds = SecondsSince(t);
  observer.End(PplPhase::kEvaluate);
  if (o.backend == "both") {
    t = Clock::now();
    observer.Begin(PplPhase::kCompare);
    r.cpu = evaluate(options, PplPhase::kCompare, nullptr);
    r.cpu_seconds = SecondsSince(t);
    r.comparison = CompareBackends(*r.cpu, *r.gpu, o.max_rel_ppl);
    observer.End(PplPhase::kCompare);
  }
  r.seconds = SecondsSince(start);
  return r;
}

}  // namespace kvq::calib
