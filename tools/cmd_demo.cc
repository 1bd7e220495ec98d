// kvq demo: the main job in one command. By default on the real reference model
// (calib/models/tiny-llama-a): the fp32 forward captures the calibration windows, OSCAR is
// calibrated on them, and every scheme of the catalogue runs teacher-forced through its real
// paged cache on held-out English and code windows (kvq ppl), printing the end-to-end table.
// --synthetic keeps the former demo: synthetic activations (kvq synth defaults) -> OSCAR
// calibration -> per-layer attention errors of every scheme (kvq eval defaults).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli_common.h"
#include "cli_cost.h"
#include "cli_gpu.h"
#include "cli_ppl.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/eval.h"
#include "kvq/calib/report.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

#ifndef KVQ_DEFAULT_MODEL_DIR
#define KVQ_DEFAULT_MODEL_DIR "calib/models/tiny-llama-a"
#endif

// The demo's real-data defaults (docs/perplexity.md explains the choice): 2 English + 2 code
// held-out windows of 1024 tokens (703 predictions each where the history exists, at S0 = 64,
// W = 256), calibrated on 2 + 2 calibration windows of 1024 tokens: ~30 s on 2 idle cores.
constexpr const char* kDemoWindows = "heldout_en:0-1,heldout_code:0-1";
constexpr const char* kDemoCalibWindows = "calib:0-1,calib:4-5";
constexpr int64_t kDemoLength = 1024;

struct DemoCommand {
  bool synthetic = false;
  kvq::cli::PplCommand real;
  uint64_t seed = 0;
  std::string out;
  int threads = 2;
  int64_t queries = kvq::calib::MetricOptions().query_positions;
};

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Prints a line whenever another quarter of the work is done (stdout, so logs keep it).
kvq::calib::ProgressCallback QuarterLines(const char* what) {
  auto last = std::make_shared<int>(0);
  return [what, last](int done, int total) {
    const int quarter = done * 4 / total;
    if (quarter > *last) {
      *last = quarter;
      std::printf("      %s %d/%d\n", what, done, total);
      std::fflush(stdout);
    }
  };
}

void RunDemo(const DemoCommand& cmd) {
  const auto start = Clock::now();
  const kvq::cpu::Backend& backend = kvq::cpu::BestBackend();
  if (!cmd.out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(cmd.out, ec);
    KVQ_CHECK(!ec, kIoError, "cannot create --out directory '", cmd.out, "': ", ec.message());
  }
  auto path = [&](const char* name) {
    return (std::filesystem::path(cmd.out) / name).string();
  };

  kvq::calib::SynthOptions synth;
  synth.seed = cmd.seed;
  synth.threads = cmd.threads;
  auto t = Clock::now();
  std::printf("[1/3] synthesizing activations (kvq synth defaults, seed %llu) ...\n",
              static_cast<unsigned long long>(cmd.seed));
  std::fflush(stdout);
  const kvq::calib::Activations acts = kvq::calib::Synthesize(synth);
  const kvq::calib::ActivationsInfo& info = acts.info;
  std::printf("      %d layers, Hq=%d, Hkv=%d, d=%d, %lld tokens (%lld calibrate, %lld held out)"
              " in %.1f s\n",
              info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim,
              static_cast<long long>(info.tokens), static_cast<long long>(info.calib_tokens),
              static_cast<long long>(info.tokens - info.calib_tokens), SecondsSince(t));
  if (!cmd.out.empty()) kvq::calib::WriteActivations(path("activations.safetensors"), acts);

  kvq::calib::CalibrationOptions calibration;
  calibration.threads = cmd.threads;
  calibration.source = "kvq demo seed=" + std::to_string(cmd.seed);
  t = Clock::now();
  std::printf("[2/3] calibrating OSCAR (R = U*H*P_br per KV head, value target %s, clip grid "
              "0.80..1.00) on the calibration tokens ...\n",
              kvq::calib::ValueTargetName(calibration.value_target));
  std::fflush(stdout);
  const kvq::calib::Calibration cal =
      kvq::calib::Calibrate(acts, calibration, backend, QuarterLines("calibrated units"));
  std::printf("      done in %.1f s; clip ratios K/V per layer:", SecondsSince(t));
  for (int l = 0; l < cal.info.num_layers; ++l) {
    std::printf(" %.2f/%.2f", cal.layers[l].key.clip[0], cal.layers[l].value.clip[0]);
  }
  std::printf("\n");
  if (!cmd.out.empty()) kvq::calib::WriteCalibration(path("calibration.safetensors"), cal);

  kvq::calib::EvalOptions eval;
  eval.threads = cmd.threads;
  eval.metrics.query_positions = cmd.queries;
  eval.scheme.group = cal.info.group;
  eval.scheme.bits = cal.info.bits;
  eval.scheme.sink = cal.info.sink;
  eval.scheme.recent = cal.info.recent;
  t = Clock::now();
  std::printf("[3/3] evaluating %zu schemes through the paged cache on the held-out tokens ...\n",
              kvq::calib::Schemes().size());
  std::fflush(stdout);
  const kvq::calib::EvalResult result =
      kvq::calib::Evaluate(acts, &cal, eval, backend, QuarterLines("evaluated units"));
  std::printf("      done in %.1f s (cpu::Attend cross-check: max relative difference %.2g)\n\n",
              SecondsSince(t), result.attend_check_max);
  std::printf("%s\n", kvq::calib::FormatTable(result).c_str());
  std::printf("%s", kvq::calib::Summarize(result).c_str());
  if (!cmd.out.empty()) {
    kvq::calib::WriteEvalJson(path("eval.json"), result);
    kvq::calib::WriteReport(path("report"), result, &cal);
    std::printf("wrote %s/{activations,calibration}.safetensors, eval.json, report/\n",
                cmd.out.c_str());
  }
  std::printf("total %.1f s (backend %s, %d threads)\n", SecondsSince(start),
              backend.name.c_str(), cmd.threads);
}

// The closing lines: what each storage family's kernels cost (cli_cost.h), with GPU step times
// when this machine has a device and the GPU module is built.
void PrintKernelCosts() {
  std::string why_not;
  const kvq::cli::GpuModule* gpu = kvq::cli::GpuOrNull(&why_not);
  if (gpu != nullptr && !gpu->HasDevice()) {
    why_not = "no CUDA device on this machine";
    gpu = nullptr;
  }
  const auto t = Clock::now();
  std::printf("\n%s",
              kvq::cli::KernelCostLines(kvq::cli::CostShape(), gpu, why_not).c_str());
  if (gpu != nullptr) std::printf("(timed in %.1f s)\n", SecondsSince(t));
}

// The model folder: --model, else calib/models/tiny-llama-a under the current directory (the
// README's command runs from the repository root), else the one this binary was built from.
std::string DefaultModel() {
  const std::string relative = "calib/models/tiny-llama-a";
  if (std::filesystem::exists(relative + "/model.safetensors")) return relative;
  return KVQ_DEFAULT_MODEL_DIR;
}

}  // namespace

void setup_demo(CLI::App& app) {
  auto cmd = std::make_shared<DemoCommand>();
  CLI::App* sub = app.add_subcommand(
      "demo",
      "The main job: end-to-end perplexity / KL of every scheme on the reference model "
      "(capture -> calibrate -> teacher-forced evaluation); --synthetic: the synthetic "
      "per-layer demo");
  sub->add_flag("--synthetic", cmd->synthetic,
                "The former demo: synth -> calibrate -> eval on synthetic activations");
  cmd->real.windows = kDemoWindows;
  cmd->real.calib_windows = kDemoCalibWindows;
  cmd->real.length = kDemoLength;
  cmd->real.calib_length = kDemoLength;
  cmd->real.quiet_progress = true;
  kvq::cli::AddPplOptions(sub, &cmd->real, /*demo=*/true);
  sub->add_option("--seed", cmd->seed, "Seed of the synthetic data (--synthetic)")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  sub->add_option("--out", cmd->out,
                  "Folder for activations, calibration, eval.json and report/ (--synthetic)")
      ->check(kvq::cli::OutputFolder());
  sub->add_option("--queries", cmd->queries,
                  "Query positions per head: the last N held-out positions, 0 = all (--synthetic)")
      ->capture_default_str();
  sub->callback([cmd]() {
    if (cmd->synthetic) {
      if (cmd->real.threads > 0) cmd->threads = cmd->real.threads;
      RunDemo(*cmd);
      return;
    }
    kvq::cli::PplCommand real = cmd->real;
    if (real.model.empty()) real.model = DefaultModel();
    real.banner = "kvq demo: every KV-cache scheme end to end on the reference model " +
                  real.model + " (kvq ppl; --synthetic for the synthetic per-layer demo)";
    kvq::cli::RunPplCommand(real);
    PrintKernelCosts();
  });
}
