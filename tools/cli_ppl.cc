#include "cli_ppl.h"

#include "cli_common.h"
#include "cli_gpu.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "kvq/calib/matmul.h"
#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/ppl_pipeline.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cli {
namespace {

using Clock = std::chrono::steady_clock;
using calib::PplPhase;
using calib::PplPipelineResult;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A bar redrawn in place on stderr (a terminal), or a line per quarter on stdout.
calib::PplProgress MakeProgress(bool lines) {
  if (lines) {
    auto last = std::make_shared<int>(0);
    return [last](int done, int total) {
      const int quarter = done * 4 / total;
      if (quarter > *last) {
        *last = quarter;
        std::printf("      %d/%d forward passes\n", done, total);
        std::fflush(stdout);
      }
    };
  }
  if (isatty(fileno(stderr)) == 0) return {};
  auto start = std::make_shared<Clock::time_point>(Clock::now());
  return [start](int done, int total) {
    const int width = 30;
    const int filled = total > 0 ? done * width / total : width;
    const double elapsed = SecondsSince(*start);
    const double eta = done > 0 ? elapsed * (total - done) / done : 0.0;
    std::fprintf(stderr, "\rppl [%.*s%*s] %d/%d forward passes, %.0f s, ~%.0f s left ", filled,
                 "##############################", width - filled, "", done, total, elapsed,
                 eta);
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

std::string Join(const std::vector<int>& rows) {
  if (rows.empty()) return "";
  if (rows.back() - rows.front() + 1 == static_cast<int>(rows.size()) && rows.size() > 1) {
    return std::to_string(rows.front()) + "-" + std::to_string(rows.back());
  }
  std::string out;
  for (int r : rows) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

// The library's options: the same names, the cache options the user gave (the others follow
// a calibration file's when one is given).
calib::PplPipelineOptions PipelineOptions(const PplCommand& cmd) {
  auto given = [](const CLI::Option* o) { return o != nullptr && o->count() > 0; };
  calib::PplPipelineOptions o;
  o.model = cmd.model;
  o.tokens = cmd.tokens;
  o.windows = cmd.windows;
  o.length = cmd.length;
  o.calibration = cmd.calibration;
  o.calib_activations = cmd.calib_activations;
  o.calib_windows = cmd.calib_windows;
  o.calib_length = cmd.calib_length;
  o.save_calibration = cmd.save_calibration;
  o.schemes = cmd.schemes;
  o.clip = cmd.clip;
  o.clip_grid = cmd.clip_grid;
  if (given(cmd.group_option)) o.group = cmd.group;
  if (given(cmd.bits_option)) o.bits = cmd.bits;
  if (given(cmd.sink_option)) o.sink = cmd.sink;
  if (given(cmd.recent_option)) o.recent = cmd.recent;
  o.k_bits = cmd.k_bits;
  o.v_bits = cmd.v_bits;
  o.page = cmd.page;
  o.seed = cmd.seed;
  o.saw_block = cmd.saw_block;
  o.tail_from = cmd.tail_from;
  o.threads = cmd.threads;
  o.per_position = cmd.per_position;
  o.share_prefix = !cmd.no_share_prefix;
  o.fp32_baseline = !cmd.no_fp32;
  o.backend = cmd.backend;
  o.scheme_windows = cmd.scheme_windows;
  o.max_rel_ppl = cmd.max_rel_ppl;
  return o;
}

// The comparison's table, and its JSON in j["comparison"].
void PrintComparison(const calib::PplBackendComparison& cmp, nlohmann::ordered_json* j) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::printf("\nGPU vs CPU (relative differences: GPU / CPU - 1; KL and top-1 at the tail)\n");
  std::printf("  %-13s %-22s %9s %9s %10s %10s %11s %9s %9s %10s %7s %7s\n", "set", "row",
              "PPL cpu", "PPL gpu", "rel", "rel tail", "max rel win", "KL cpu", "KL gpu",
              "rel KL", "top1 c", "top1 g");
  for (const calib::PplBackendRow& r : cmp.rows) {
    std::printf("  %-13s %-22s %9.4f %9.4f %+10.2e %+10.2e %+11.2e %9.6f %9.6f %+10.2e %7.4f "
                "%7.4f%s\n",
                r.set.c_str(), r.row.c_str(), r.ppl_cpu, r.ppl_gpu, r.rel_ppl, r.rel_ppl_tail,
                r.max_rel_ppl_window, r.kl_tail_cpu, r.kl_tail_gpu, r.rel_kl_tail,
                r.top1_tail_cpu, r.top1_tail_gpu, r.within ? "" : "  <-- over");
    rows.push_back({{"set", r.set},
                    {"row", r.row},
                    {"ppl_cpu", r.ppl_cpu},
                    {"ppl_gpu", r.ppl_gpu},
                    {"rel_ppl", r.rel_ppl},
                    {"ppl_tail_cpu", r.ppl_tail_cpu},
                    {"ppl_tail_gpu", r.ppl_tail_gpu},
                    {"rel_ppl_tail", r.rel_ppl_tail},
                    {"max_rel_ppl_window", r.max_rel_ppl_window},
                    {"kl_tail_cpu", r.kl_tail_cpu},
                    {"kl_tail_gpu", r.kl_tail_gpu},
                    {"rel_kl_tail", r.rel_kl_tail},
                    {"top1_tail_cpu", r.top1_tail_cpu},
                    {"top1_tail_gpu", r.top1_tail_gpu},
                    {"within", r.within}});
  }
  std::printf("largest |relative PPL difference| (all positions of a set) %.2e (tolerance %.0e): "
              "%s; largest |relative KL difference| %.2e\n",
              cmp.worst_rel_ppl, cmp.max_rel_ppl, cmp.within ? "within" : "OVER",
              cmp.worst_rel_kl);
  (*j)["comparison"] = {{"max_rel_ppl", cmp.max_rel_ppl},
                        {"worst_rel_ppl", cmp.worst_rel_ppl},
                        {"worst_rel_kl", cmp.worst_rel_kl},
                        {"within", cmp.within},
                        {"rows", rows}};
}

// Prints the run as it goes (steps, timings, tables on stdout; progress as the command asks)
// and, for a GPU run, makes the GPU module's forwards.
class PplPrinter {
 public:
  PplPrinter(const PplCommand& cmd, const GpuModule* module, gpu::GpuDecodeMode decode_mode)
      : cmd_(cmd), module_(module), decode_mode_(decode_mode) {}

  calib::PplPipelineHooks Hooks() {
    calib::PplPipelineHooks hooks;
    hooks.begin = [this](PplPhase phase, const PplPipelineResult& r) { Begin(phase, r); };
    hooks.end = [this](PplPhase phase, const PplPipelineResult& r) { End(phase, r); };
    hooks.progress = [this](PplPhase phase) { return Progress(phase); };
    if (module_ != nullptr) {
      hooks.gpu.unsupported = [this](const std::vector<calib::LayerScheme>& layers) {
        return module_->PplUnsupported(layers);
      };
      hooks.gpu.forwards = [this](const calib::Model& model) -> calib::PplForwards& {
        return GpuForwards(model);
      };
    }
    return hooks;
  }

  // What the run leaves to print: the JSON, the total, and for --backend both the verdict.
  void Finish(const PplPipelineResult& r) const {
    if (!r.gpu) {
      if (!cmd_.json.empty()) {
        calib::WritePplJson(cmd_.json, *r.cpu);
        std::printf("wrote %s\n", cmd_.json.c_str());
      }
      std::printf("total %.1f s (%d threads)\n", r.seconds, r.threads);
      return;
    }
    const gpu::GpuPplStats stats = gpu_->stats();
    nlohmann::ordered_json j;
    j["format"] = "kvq-ppl-gpu";
    j["device"] = gpu_->device_name();
    j["decode"] = module_->DecodeModeName(decode_mode_);
    j["qk"] = cmd_.gpu_qk;
    j["gpu_seconds"] = r.gpu_seconds;
    j["gpu_forwards"] = {{"reference", stats.reference_forwards},
                         {"reference_seconds", stats.reference_seconds},
                         {"scheme", stats.scheme_forwards},
                         {"scheme_seconds", stats.scheme_seconds},
                         {"positions", stats.positions}};
    j["gpu"] = nlohmann::ordered_json::parse(calib::PplJson(*r.gpu));
    if (r.comparison) {
      j["cpu_seconds"] = r.cpu_seconds;
      j["cpu"] = nlohmann::ordered_json::parse(calib::PplJson(*r.cpu));
      PrintComparison(*r.comparison, &j);
    }
    if (!cmd_.json.empty()) {
      const std::string text = j.dump(1) + "\n";
      WriteFile(cmd_.json, std::vector<uint8_t>(text.begin(), text.end()));
      std::printf("wrote %s\n", cmd_.json.c_str());
    }
    std::printf("total %.1f s (%d threads)\n", r.seconds, r.threads);
    KVQ_CHECK(!r.comparison || r.comparison->within, kMismatch,
              "GPU and CPU perplexities differ by more than --max-rel-ppl ", cmd_.max_rel_ppl,
              " (table above)");
  }

 private:
  void Begin(PplPhase phase, const PplPipelineResult& r) const {
    switch (phase) {
      case PplPhase::kLoad:
        std::printf("[1/4] loading %s ...\n", cmd_.model.c_str());
        break;
      case PplPhase::kCapture:
        std::printf("[2/4] calibration: ");
        break;  // flushed before a progress line on the same terminal
      case PplPhase::kBuild:
        std::printf("[3/4] building %zu schemes (own clip ratios by kvq calibrate's rule where "
                    "they clip) ...\n",
                    r.requested.size());
        break;
      case PplPhase::kEvaluate:
        PrintEvaluationHeader(r);
        break;
      case PplPhase::kCompare:
        std::printf("\n[4/4] the same on the CPU (%d threads) ...\n", r.threads);
        break;
      case PplPhase::kCalibrate:
      case PplPhase::kGpuSelect:
        return;
    }
    std::fflush(stdout);
  }

  void End(PplPhase phase, const PplPipelineResult& r) const {
    switch (phase) {
      case PplPhase::kLoad: {
        const calib::ModelConfig& c = r.config;
        std::printf("      %s: %d layers, d_model %d, Hq %d x d %d, Hkv %d, vocab %d (%.1f s; "
                    "kernels %s, %d threads)\n",
                    calib::ModelArchName(c.arch), c.num_layers, c.hidden, c.num_q_heads,
                    c.head_dim, c.num_kv_heads, c.vocab, r.load_seconds,
                    calib::MatMulTargetName(), r.threads);
        break;
      }
      case PplPhase::kCapture:
        if (r.capture == calib::PplOrigin::kFile) {
          std::printf("capture %s", cmd_.calib_activations.c_str());
        } else if (r.capture == calib::PplOrigin::kComputed) {
          std::printf("captured %s (%lld tokens, fp32 forward)", cmd_.calib_windows.c_str(),
                      static_cast<long long>(r.capture_tokens));
        } else {
          std::printf("no capture needed");
        }
        break;
      case PplPhase::kCalibrate:
        PrintCalibration(r);
        break;
      case PplPhase::kBuild:
        std::printf("      done in %.1f s\n", r.build_seconds);
        for (const calib::PplSharedWindows& s : r.shared_windows) {
          std::printf("      %s: S0 = %d, W = %d, F = %d (--scheme-windows shared)\n",
                      s.label.c_str(), r.evaluation.scheme.sink, r.evaluation.scheme.recent,
                      s.flush);
        }
        break;
      case PplPhase::kGpuSelect:
        for (const calib::PplUnsupported& u : r.gpu_unsupported) {
          std::printf("      not on the GPU: %s: %s\n", u.label.c_str(), u.why.c_str());
        }
        break;
      case PplPhase::kEvaluate:
        if (r.gpu) {
          PrintGpuEvaluation(r);
        } else {
          std::printf("      done in %.1f s\n\n", r.cpu_seconds);
          std::printf("%s", calib::FormatPplTable(*r.cpu).c_str());
          std::printf("%s", calib::SummarizePpl(*r.cpu).c_str());
        }
        break;
      case PplPhase::kCompare:
        std::printf("      CPU evaluation done in %.1f s\n\nCPU:\n%s", r.cpu_seconds,
                    calib::FormatPplTable(*r.cpu).c_str());
        break;
    }
    std::fflush(stdout);
  }

  calib::PplProgress Progress(PplPhase phase) const {
    switch (phase) {
      case PplPhase::kCapture:
        return StderrProgress("[2/4] capturing windows");
      case PplPhase::kCalibrate:
        return StderrProgress("[2/4] calibrating OSCAR, layer x KV head units");
      case PplPhase::kBuild:
        return StderrProgress("[3/4] building schemes x layers");
      case PplPhase::kEvaluate:
      case PplPhase::kCompare:
        return MakeProgress(cmd_.quiet_progress);
      case PplPhase::kLoad:
      case PplPhase::kGpuSelect:
        break;
    }
    return {};
  }

  void PrintCalibration(const PplPipelineResult& r) const {
    const calib::Calibration& cal = r.calibration;
    if (r.calibration_origin == calib::PplOrigin::kFile) {
      std::printf("; calibration %s", cmd_.calibration.c_str());
    } else if (r.calibration_origin == calib::PplOrigin::kComputed) {
      std::printf("; OSCAR calibrated (R = U*H*P_br, value target %s)",
                  cal.info.value_target.c_str());
    }
    std::printf(" in %.1f s\n", r.capture_seconds + r.calibrate_seconds);
    if (r.calibration_origin == calib::PplOrigin::kUnneeded) return;
    if (cal.layers.empty() || cal.layers[0].key.clip.empty()) {  // a codebook file: no clips
      std::printf("      %s calibration (no clip ratios)\n", cal.info.scheme.c_str());
      return;
    }
    std::printf("      OSCAR clip ratios K/V per layer:");
    for (const calib::LayerCalibration& l : cal.layers) {
      std::printf(" %.2f/%.2f", l.key.clip[0], l.value.clip[0]);
    }
    std::printf("\n");
  }

  void PrintEvaluationHeader(const PplPipelineResult& r) const {
    int64_t windows = 0;
    std::string what;
    for (const calib::TokenWindows& s : r.sets) {
      windows += static_cast<int64_t>(s.count());
      what += (what.empty() ? "" : ", ") + s.name + "[" + Join(s.rows) + "]";
    }
    const calib::SchemeOptions& scheme = r.evaluation.scheme;
    const int k_bits = scheme.k_bits != 0 ? scheme.k_bits : scheme.bits;
    const int v_bits = scheme.v_bits != 0 ? scheme.v_bits : scheme.bits;
    std::printf("[4/4] teacher-forced evaluation: %lld windows (%s) x %lld tokens, %zu rows, "
                "S0=%d W=%d G=%d b=%s ...\n",
                static_cast<long long>(windows), what.c_str(),
                static_cast<long long>(r.sets.front().length), r.requested.size(), scheme.sink,
                scheme.recent, scheme.group,
                k_bits == v_bits
                    ? std::to_string(k_bits).c_str()
                    : ("K" + std::to_string(k_bits) + "V" + std::to_string(v_bits)).c_str());
    if (module_ != nullptr && r.evaluation.fp32_baseline) {
      std::printf("      (no fp32 row on the GPU: a cache holds bf16 or quantized rows)\n");
    }
  }

  calib::PplForwards& GpuForwards(const calib::Model& model) {
    KVQ_CHECK(cmd_.gpu_qk == "int8" || cmd_.gpu_qk == "bf16", kInvalidArgument, "--gpu-qk '",
              cmd_.gpu_qk, "' (int8 or bf16)");
    gpu_ = module_->MakePpl(model, decode_mode_, cmd_.gpu_qk == "int8");
    std::printf("      GPU: %s, decode %s, QK %s, cuBLAS fp32 (pedantic math)\n",
                gpu_->device_name().c_str(), module_->DecodeModeName(decode_mode_),
                cmd_.gpu_qk.c_str());
    std::fflush(stdout);
    return gpu_->forwards();
  }

  void PrintGpuEvaluation(const PplPipelineResult& r) const {
    const gpu::GpuPplStats stats = gpu_->stats();
    std::printf("      GPU evaluation done in %.1f s: %d reference forwards %.2f s (%.1f ms "
                "each), %d scheme forwards %.2f s (%.1f ms each), %lld positions\n\n",
                r.gpu_seconds, stats.reference_forwards, stats.reference_seconds,
                1e3 * stats.reference_seconds / std::max(1, stats.reference_forwards),
                stats.scheme_forwards, stats.scheme_seconds,
                1e3 * stats.scheme_seconds / std::max(1, stats.scheme_forwards),
                static_cast<long long>(stats.positions));
    std::printf("GPU (%s):\n%s", gpu_->device_name().c_str(),
                calib::FormatPplTable(*r.gpu).c_str());
    std::printf("%s", calib::SummarizePpl(*r.gpu).c_str());
  }

  const PplCommand& cmd_;
  const GpuModule* module_;
  gpu::GpuDecodeMode decode_mode_;
  std::unique_ptr<GpuPpl> gpu_;  // the GPU's forwards, once made
};

}  // namespace

void AddPplOptions(CLI::App* sub, PplCommand* cmd, bool demo) {
  sub->add_option("--model", cmd->model, "Model folder (config.json, model.safetensors)")
      ->capture_default_str();
  if (!demo) sub->get_option("--model")->required();
  sub->add_option("--tokens", cmd->tokens,
                  "Token windows file (default: the model folder's tokens.safetensors)");
  sub->add_option("--windows", cmd->windows,
                  "Evaluated windows: NAME[:i|:a-b],... tensors of the tokens file")
      ->capture_default_str();
  sub->add_option("--length", cmd->length, "Tokens per evaluated window (0 = whole windows)")
      ->capture_default_str();
  sub->add_option("--calib-windows", cmd->calib_windows,
                  "Calibration windows (captured with the fp32 forward)")
      ->capture_default_str();
  sub->add_option("--calib-length", cmd->calib_length,
                  "Tokens per calibration window (0 = whole windows)")
      ->capture_default_str();
  sub->add_option("--schemes", cmd->schemes,
                  "all, or NAME[@own|@oscar|@none],... (" + [] {
                    std::string names;
                    for (const calib::SchemeInfo& s : calib::Schemes()) {
                      names += (names.empty() ? "" : ", ") + std::string(s.name);
                    }
                    return names;
                  }() + ")")
      ->capture_default_str();
  sub->add_option("--clip", cmd->clip,
                  "Clip ratios of the schemes that clip: own (chosen for each scheme's rotation "
                  "on the calibration tokens, by kvq calibrate's rule), oscar (OSCAR's reused; "
                  "rows labelled NAME@oscar), both")
      ->capture_default_str();
  sub->add_option("--threads", cmd->threads, "Worker threads (0 = every core)")
      ->capture_default_str();
  sub->add_option("--json", cmd->json, "Write every number (per window, clip ratios) as JSON")
      ->check(OutputFile());
  if (demo) return;
  sub->add_option("--calibration", cmd->calibration,
                  "OSCAR calibration file (default: calibrate on the calibration windows)");
  sub->add_option("--calib-activations", cmd->calib_activations,
                  "Calibration capture (kvq capture; default: capture the calibration windows)");
  sub->add_option("--save-calibration", cmd->save_calibration,
                  "Write the calibration computed here (only when a chosen scheme needs one and "
                  "no --calibration is given)")
      ->check(OutputFile());
  sub->add_option("--clip-grid", cmd->clip_grid,
                  "Own-clip grid, comma-separated ratios in (0, 1] (default 0.80,...,1.00)")
      ->delimiter(',');
  cmd->group_option =
      sub->add_option("--group", cmd->group, "Quantization group G")->capture_default_str();
  cmd->bits_option = sub->add_option("--bits", cmd->bits, "Bits b (2 or 4)")->capture_default_str();
  sub->add_option("--k-bits", cmd->k_bits, "K's bits when they differ from --bits (K4V2: "
                  "--k-bits 4 --v-bits 2; the schemes with their own width keep it)");
  sub->add_option("--v-bits", cmd->v_bits, "V's bits when they differ from --bits");
  cmd->sink_option = sub->add_option("--sink", cmd->sink, "BF16 sink tokens S0")
                         ->capture_default_str()
                         ->check(WindowTokens());
  cmd->recent_option = sub->add_option("--recent", cmd->recent, "BF16 recent window W")
                           ->capture_default_str()
                           ->check(WindowTokens());
  sub->add_option("--page", cmd->page, "History page size P")->capture_default_str();
  sub->add_option("--seed", cmd->seed, "random_orthogonal's seed")
      ->capture_default_str()
      ->check(Seed());
  sub->add_option("--saw-block", cmd->saw_block,
                  "FWHT block of saw_int4, saw_int4_k, saw_hessian (BDR-h: 16..256, a power of "
                  "two, clamped to d)")
      ->capture_default_str();
  sub->add_option("--tail-from", cmd->tail_from,
                  "Second position set: predictions at p >= this (default S0 + W)")
      ->capture_default_str();
  sub->add_flag("--per-position", cmd->per_position, "Per-position NLL and KL in the JSON");
  sub->add_flag("--no-share-prefix", cmd->no_share_prefix,
                "Run every scheme from position 0 (the shared prefix is bit-identical anyway)");
  sub->add_flag("--no-fp32", cmd->no_fp32, "Skip the fp32 (no cache rounding) forward");
  sub->add_option("--backend", cmd->backend,
                  "Where the forwards run: cpu; gpu (cuBLAS projections, kvq's CUDA cache "
                  "writes and decode attention; the schemes the CUDA path serves); both (the "
                  "same schemes on each, compared: fails when a PPL differs by more than "
                  "--max-rel-ppl)")
      ->capture_default_str();
  sub->add_option("--gpu-decode", cmd->gpu_decode,
                  "GPU attention: batch (one decode call per layer, a sequence per position "
                  "sharing the pages) or steps (AppendStep + a decode step per position)")
      ->capture_default_str();
  sub->add_option("--gpu-qk", cmd->gpu_qk,
                  "GPU attention: the quantized history's QK^T loop: int8 (the decode plan's "
                  "choice, int8 tensor cores) or bf16 (bf16 hi + lo tensor-core loops)")
      ->capture_default_str();
  sub->add_option("--scheme-windows", cmd->scheme_windows,
                  "own, or shared: the schemes whose own windows keep no sink (SAW, KIVI, "
                  "OScaR) take --sink and --recent (their F stays), labelled NAME+w")
      ->capture_default_str();
  sub->add_option("--max-rel-ppl", cmd->max_rel_ppl,
                  "--backend both: largest |PPL_gpu / PPL_cpu - 1| accepted (every row, PPL "
                  "over all positions of each window set)")
      ->capture_default_str();
}

void RunPplCommand(const PplCommand& cmd) {
  const calib::PplPipelineOptions options = PipelineOptions(cmd);
  calib::CheckPplPipelineOptions(options);
  const bool use_gpu = cmd.backend != "cpu";
  const GpuModule* module = use_gpu ? &RequireGpu("--backend " + cmd.backend) : nullptr;
  const gpu::GpuDecodeMode decode_mode =
      use_gpu ? module->ParseDecodeMode(cmd.gpu_decode) : gpu::GpuDecodeMode::kBatch;
  if (!cmd.banner.empty()) std::printf("%s\n", cmd.banner.c_str());
  PplPrinter printer(cmd, module, decode_mode);
  const PplPipelineResult result =
      calib::RunPplPipeline(options, cpu::BestBackend(), printer.Hooks());
  printer.Finish(result);
}

}  // namespace kvq::cli
