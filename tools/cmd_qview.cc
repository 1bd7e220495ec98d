// kvq qview: what the quantizer sees on the rotated keys of every (layer, KV head) for several
// rotations and clip choices (seeds/000 table 10 per layer and head; calib/quantizer_view.h).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "cli_common.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/quantizer_view.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

// seeds/000 table 10's rows without a clip, then the same rotations with their own clip.
constexpr const char* kDefaultSchemes =
    "naive,hadamard,eigenbasis_only@none,oscar_no_bitrev@none,oscar@none,raw_target@none,"
    "clip_only,hadamard@own,eigenbasis_only,oscar_no_bitrev,oscar,raw_target";

struct QviewCommand {
  std::string activations, calib_activations, calibration;
  std::string schemes = kDefaultSchemes;
  std::string csv, plots;
  std::vector<double> clip_grid;
  int group = 64, bits = 2, sink = 64, recent = 256, saw_block = 128, threads = 0;
};

void RunQview(const QviewCommand& cmd) {
  const auto start = std::chrono::steady_clock::now();
  KVQ_CHECK(cmd.threads >= 0, kInvalidArgument, "--threads ", cmd.threads, " must be >= 0");
  const int threads = cmd.threads > 0
                          ? cmd.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  kvq::calib::QuantizerViewOptions options;
  options.schemes = kvq::calib::ParseSchemeVariants(cmd.schemes, false);
  options.scheme.group = cmd.group;
  options.scheme.bits = cmd.bits;
  options.scheme.sink = cmd.sink;
  options.scheme.recent = cmd.recent;
  options.scheme.saw_block = cmd.saw_block;
  options.clip_grid = cmd.clip_grid;
  options.threads = threads;
  const kvq::cpu::Backend& backend = kvq::cpu::BestBackend();
  const kvq::calib::Activations eval_acts = kvq::calib::ReadActivations(cmd.activations);
  const kvq::calib::Activations calib_acts = kvq::calib::ReadActivations(cmd.calib_activations);
  bool need_calibration = false;
  for (const kvq::calib::SchemeVariant& v : options.schemes) {
    need_calibration = need_calibration ||
                       kvq::calib::SchemeByName(v.scheme).needs_calibration ||
                       v.Resolved() == kvq::calib::ClipChoice::kOscar;
  }
  std::unique_ptr<kvq::calib::Calibration> cal;
  if (!cmd.calibration.empty()) {
    cal = std::make_unique<kvq::calib::Calibration>(kvq::calib::ReadCalibration(cmd.calibration));
    if (!cal->layers.empty() && cal->layers[0].raw_k_rotation.empty()) {
      kvq::calib::AddRawTargetRotations(calib_acts, cal.get());  // a format_version 1 file
    }
  } else if (need_calibration) {
    kvq::calib::CalibrationOptions c;
    c.group = cmd.group;
    c.bits = cmd.bits;
    c.sink = cmd.sink;
    c.recent = cmd.recent;
    c.threads = threads;
    c.source = calib_acts.info.source;
    std::printf("calibrating OSCAR on %s (%lld tokens, %d layers x %d KV heads) ...\n",
                cmd.calib_activations.c_str(),
                static_cast<long long>(calib_acts.info.calib_tokens), calib_acts.info.num_layers,
                calib_acts.info.num_kv_heads);
    std::fflush(stdout);
    cal = std::make_unique<kvq::calib::Calibration>(kvq::calib::Calibrate(
        calib_acts, c, backend, kvq::cli::StderrProgress("qview: calibrating OSCAR, units")));
    std::printf("calibrated OSCAR on %s (%lld tokens)\n", cmd.calib_activations.c_str(),
                static_cast<long long>(calib_acts.info.calib_tokens));
  }
  std::printf("viewing %zu schemes x %d layers x %d KV heads on %s (%lld tokens, %d threads) "
              "...\n",
              options.schemes.size(), eval_acts.info.num_layers, eval_acts.info.num_kv_heads,
              cmd.activations.c_str(), static_cast<long long>(eval_acts.info.tokens), threads);
  std::fflush(stdout);
  const kvq::calib::QuantizerView view = kvq::calib::ComputeQuantizerView(
      eval_acts, calib_acts, cal.get(), options, backend,
      kvq::cli::StderrProgress("qview: schemes x layers built, then x KV heads viewed"));
  std::printf("%s", kvq::calib::FormatQuantizerView(view).c_str());
  if (!cmd.csv.empty()) {
    const std::string text = kvq::calib::QuantizerViewCsv(view);
    kvq::WriteFile(cmd.csv, std::vector<uint8_t>(text.begin(), text.end()));
    std::printf("wrote %s\n", cmd.csv.c_str());
  }
  if (!cmd.plots.empty()) {
    for (const std::string& path : kvq::calib::WriteQuantizerViewPlots(cmd.plots, view)) {
      std::printf("wrote %s\n", path.c_str());
    }
  }
  std::printf("%.1f s (%d threads)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              threads);
}

}  // namespace

void setup_qview(CLI::App& app) {
  auto cmd = std::make_shared<QviewCommand>();
  CLI::App* sub = app.add_subcommand(
      "qview",
      "What the quantizer sees on the rotated keys, per layer and KV head (seeds/000 table 10): "
      "max|K~|, group range, importance max/mean, tr(E_K), C_Q-weighted residual, key mean, "
      "RoPE-logit MAE");
  sub->add_option("--activations", cmd->activations,
                  "Evaluated capture (kvq capture of held-out windows): every token is used")
      ->required();
  sub->add_option("--calib-activations", cmd->calib_activations,
                  "Calibration capture: C_Q of the importance column, the own clips' rows")
      ->required();
  sub->add_option("--calibration", cmd->calibration,
                  "OSCAR calibration (default: calibrate on --calib-activations when a scheme "
                  "needs one)");
  sub->add_option("--schemes", cmd->schemes,
                  "NAME[@own|@oscar|@none],... with per-token key formats (affine_token or "
                  "codebook; as kvq ppl)")
      ->capture_default_str();
  sub->add_option("--group", cmd->group, "Group G")->capture_default_str();
  sub->add_option("--bits", cmd->bits, "Bits b")->capture_default_str();
  sub->add_option("--sink", cmd->sink,
                  "S0: each sequence's first S0 rows are left out (the cache keeps them bf16)")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--recent", cmd->recent, "W (only for a calibration made here)")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--saw-block", cmd->saw_block, "The SAW schemes' FWHT block")
      ->capture_default_str();
  sub->add_option("--clip-grid", cmd->clip_grid, "Own-clip grid (default 0.80,...,1.00)")
      ->delimiter(',');
  sub->add_option("--threads", cmd->threads, "Worker threads (0 = every core)")
      ->capture_default_str();
  sub->add_option("--csv", cmd->csv, "Write one line per scheme x layer x KV head")
      ->check(kvq::cli::OutputFile());
  sub->add_option("--plots", cmd->plots, "Write keys_<metric>.svg per-layer plots here")
      ->check(kvq::cli::OutputFolder());
  sub->footer(
      "Columns (calib/quantizer_view.h): max_abs, group_range, importance, tr_ek, weighted, "
      "weighted_centred, mean_range, mean_energy, rope_logit_mae.\n"
      "rope_logit_mae (seeds/004 App. B.3): mean over the viewed key rows k (positions >= S0 "
      "of each sequence), the g query heads q of k's own token in --activations and the 50 "
      "offsets D = -1024 + 2048 j/49 (j = 0..49) of |q^T R_D k^ - q^T R_D k|, k^ the "
      "dequantized row rotated back to the original space, q, k, k^ pre-RoPE (rotate-half RoPE "
      "undone at the token's RoPE position with the capture's rope_base), R_D the RoPE rotation "
      "by D; logits unscaled (no 1/sqrt(d)). The table shows the mean over layers and KV "
      "heads; --csv gives it per layer and head, --plots keys_rope_logit_mae.svg per layer.");
  sub->callback([cmd]() { RunQview(*cmd); });
}
