// kvq demo: the main job in one command, on the embedded default data: synthetic activations
// (kvq synth defaults) -> OSCAR calibration (kvq calibrate defaults) -> every scheme evaluated
// on the held-out tokens (kvq eval defaults), with progress lines, the table and what it shows.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/eval.h"
#include "kvq/calib/report.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

struct DemoCommand {
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
    std::printf(" %.2f/%.2f", cal.layers[l].k_clip[0], cal.layers[l].v_clip[0]);
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

}  // namespace

void setup_demo(CLI::App& app) {
  auto cmd = std::make_shared<DemoCommand>();
  CLI::App* sub = app.add_subcommand(
      "demo", "synth -> calibrate -> eval of every scheme on the embedded default data");
  sub->add_option("--seed", cmd->seed, "Seed of the synthetic data")->capture_default_str();
  sub->add_option("--out", cmd->out,
                  "Folder for activations, calibration, eval.json and report/ (default: none)");
  sub->add_option("--threads", cmd->threads, "Worker threads")->capture_default_str();
  sub->add_option("--queries", cmd->queries,
                  "Query positions per head: the last N held-out positions (0 = all)")
      ->capture_default_str();
  sub->callback([cmd]() { RunDemo(*cmd); });
}
