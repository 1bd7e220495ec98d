// kvq eval: attention-level error metrics of every scheme on a capture's held-out tokens,
// through the real paged cache (calib/metrics.h); a table, optionally JSON, CSV and SVG plots.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli_common.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/eval.h"
#include "kvq/calib/report.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

struct EvalCommand {
  std::string activations;
  std::string calibration;
  std::string schemes = "all";
  std::string json;
  std::string report;
  std::string backend;
  int group = 0;   // 0: the calibration's (64 without one)
  int sink = -1;   // -1: the calibration's (64 without one)
  int recent = 0;  // 0: the calibration's (256 without one)
  bool no_sink_prefix = false;
  kvq::calib::EvalOptions options;
};

// Both from the scheme catalogue (calib/schemes.inc).
std::string SchemeHelp() {
  std::string text = "Comma-separated schemes or 'all' (* needs --calibration):";
  for (const kvq::calib::SchemeInfo& s : kvq::calib::Schemes()) {
    text += std::string("\n  ") + s.name + (s.needs_calibration ? "*" : "") + ": " +
            s.description;
  }
  return text;
}

std::string BitsHelp() {
  std::string own;
  for (const kvq::calib::SchemeInfo& s : kvq::calib::Schemes()) {
    if (s.bits == kvq::calib::kSharedBits) continue;
    own += (own.empty() ? "" : ", ") + std::string(s.name) + " is always " +
           std::to_string(s.bits);
  }
  return "Bits b" + (own.empty() ? std::string() : " (" + own + ")");
}

void RunEval(EvalCommand& cmd) {
  const auto start = std::chrono::steady_clock::now();
  kvq::calib::EvalOptions options = cmd.options;
  options.schemes = kvq::calib::ParseSchemeList(cmd.schemes);
  options.sink_prefix = !cmd.no_sink_prefix;
  const kvq::cpu::Backend& backend =
      cmd.backend.empty() ? kvq::cpu::BestBackend() : kvq::cpu::BackendByName(cmd.backend);
  const kvq::calib::Activations acts = kvq::calib::ReadActivations(cmd.activations);
  std::unique_ptr<kvq::calib::Calibration> cal;
  if (!cmd.calibration.empty()) {
    cal = std::make_unique<kvq::calib::Calibration>(
        kvq::calib::ReadCalibration(cmd.calibration));
  }
  options.scheme.group = cmd.group != 0 ? cmd.group : (cal ? cal->info.group : 64);
  options.scheme.sink = cmd.sink >= 0 ? cmd.sink : (cal ? cal->info.sink : 64);
  options.scheme.recent = cmd.recent != 0 ? cmd.recent : (cal ? cal->info.recent : 256);
  if (cal && (options.scheme.group != cal->info.group || options.scheme.bits != cal->info.bits)) {
    std::fprintf(stderr,
                 "kvq eval: note: the calibration's clip ratios were chosen for G=%d, %d-bit; "
                 "evaluating G=%d, %d-bit\n",
                 cal->info.group, cal->info.bits, options.scheme.group, options.scheme.bits);
  }
  const kvq::calib::EvalResult result = kvq::calib::Evaluate(
      acts, cal.get(), options, backend,
      kvq::cli::StderrProgress("evaluating schemes x layers, then layers x KV heads"));
  if (result.raw_target_from_activations) {
    std::fprintf(stderr,
                 "kvq eval: note: %s is a format_version 1 calibration without raw-target "
                 "rotations; raw_target's were made from the capture's calibration tokens\n",
                 cmd.calibration.c_str());
  }
  std::printf("%s", kvq::calib::FormatTable(result).c_str());
  std::printf("%s", kvq::calib::Summarize(result).c_str());
  if (!cmd.json.empty()) {
    kvq::calib::WriteEvalJson(cmd.json, result);
    std::printf("wrote %s\n", cmd.json.c_str());
  }
  if (!cmd.report.empty()) {
    for (const std::string& path : kvq::calib::WriteReport(cmd.report, result, cal.get())) {
      std::printf("wrote %s\n", path.c_str());
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("cpu::Attend cross-check: max relative difference %.2g; backend %s; %.1f s\n",
              result.attend_check_max, backend.name.c_str(), seconds);
}

}  // namespace

void setup_eval(CLI::App& app) {
  auto cmd = std::make_shared<EvalCommand>();
  CLI::App* sub = app.add_subcommand(
      "eval", "Attention-level error metrics of every scheme on held-out activations");
  sub->add_option("--activations", cmd->activations, "Activation capture (kvq synth output)")
      ->required();
  sub->add_option("--calibration", cmd->calibration,
                  "Calibration file (kvq calibrate output); needed by the calibrated schemes");
  sub->add_option("--schemes", cmd->schemes, SchemeHelp())->capture_default_str();
  sub->add_option("--group", cmd->group, "Group G (default: the calibration's, else 64)");
  sub->add_option("--bits", cmd->options.scheme.bits, BitsHelp())
      ->capture_default_str();
  sub->add_option("--k-bits", cmd->options.scheme.k_bits,
                  "K's bits when they differ from --bits (K4V2: --k-bits 4 --v-bits 2; 2 or 4, "
                  "a codebook scheme 1..8)")
      ->check(CLI::Range(1, 8));
  sub->add_option("--v-bits", cmd->options.scheme.v_bits,
                  "V's bits when they differ from --bits (2 or 4, a codebook scheme 1..8)")
      ->check(CLI::Range(1, 8));
  sub->add_option("--sink", cmd->sink, "BF16 sink S0 (default: the calibration's, else 64)")
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--recent", cmd->recent,
                  "BF16 recent window W (default: the calibration's, else 256)")
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--page", cmd->options.scheme.page, "Page size P")->capture_default_str();
  sub->add_option("--seed", cmd->options.scheme.seed, "Seed of random_orthogonal")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  sub->add_option("--saw-block", cmd->options.scheme.saw_block, "saw_int4 FWHT block")
      ->capture_default_str();
  sub->add_option("--queries", cmd->options.metrics.query_positions,
                  "Query positions: the last N held-out positions (0 = all)")
      ->capture_default_str();
  sub->add_flag("--no-sink-prefix", cmd->no_sink_prefix,
                "Evaluate the held-out tokens alone (default: the capture's first S0 tokens "
                "lead the sequence, as its attention sinks)");
  sub->add_option("--threads", cmd->options.threads, "Worker threads")->capture_default_str();
  sub->add_option("--backend", cmd->backend, "CPU backend (default: best of this CPU)");
  sub->add_option("--json", cmd->json, "Write the means as JSON to this file")
      ->check(kvq::cli::OutputFile());
  sub->add_option("--report", cmd->report, "Write per-head CSV and SVG plots into this folder")
      ->check(kvq::cli::OutputFolder());
  sub->footer(
      "Metrics (docs/accuracy_synthetic.md defines each): k_rel_mse, v_rel_mse, logit_rel_mse, "
      "rope_logit_mae, sv_rel_mse, attn_kl, top10_overlap, output_rel_mse, tr_ek, group_range, "
      "bits_per_element.\n"
      "rope_logit_mae (seeds/004 App. B.3): mean over the sequence's T cache rows k (as the "
      "cache holds them at length T; bf16 sink/recent rows add 0), the g query heads q of k's "
      "own token and the 50 offsets D = -1024 + 2048 j/49 (j = 0..49) of |q^T R_D k^ - q^T R_D "
      "k|, with q, k, k^ pre-RoPE (rotate-half RoPE undone at the token's RoPE position with the "
      "capture's rope_base) and R_D the RoPE rotation by D; logits unscaled (no 1/sqrt(d)). "
      "The table shows its mean over layers and KV heads; --report's per_head.csv and "
      "layer_rope_logit_mae.svg give it per layer.");
  sub->callback([cmd]() { RunEval(*cmd); });
}
