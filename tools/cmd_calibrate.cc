// kvq calibrate: OSCAR calibration of an activation capture into a calibration file.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

struct CalibrateCommand {
  std::string activations;
  std::string out;
  std::string granularity = "kv_head";
  std::string value_target = "attn_output";
  std::string rotation = "oscar";
  std::string backend;
  std::vector<double> clip_grid;
  kvq::calib::CalibrationOptions options;
};

// A one-line bar redrawn in place; only when stderr is a terminal, so logs stay clean.
void DrawProgress(int done, int total) {
  const int width = 30;
  const int filled = total > 0 ? done * width / total : width;
  std::fprintf(stderr, "\rcalibrating [%.*s%*s] %d/%d", filled,
               "##############################", width - filled, "", done, total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

void RunCalibrate(CalibrateCommand& cmd) {
  const auto start = std::chrono::steady_clock::now();
  kvq::calib::CalibrationOptions options = cmd.options;
  options.granularity = kvq::calib::ParseGranularity(cmd.granularity);
  options.value_target = kvq::calib::ParseValueTarget(cmd.value_target);
  options.rotation = kvq::calib::ParseRotationRecipe(cmd.rotation);
  options.clip_grid = cmd.clip_grid;
  options.source = cmd.activations;
  const kvq::cpu::Backend& backend =
      cmd.backend.empty() ? kvq::cpu::BestBackend() : kvq::cpu::BackendByName(cmd.backend);
  const kvq::calib::Activations acts = kvq::calib::ReadActivations(cmd.activations);
  const bool terminal = isatty(fileno(stderr)) != 0;
  const kvq::calib::Calibration cal = kvq::calib::Calibrate(
      acts, options, backend, terminal ? kvq::calib::ProgressCallback(DrawProgress) : nullptr);
  kvq::calib::WriteCalibration(cmd.out, cal);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s: %d layers x %d kv heads, d=%d, G=%d, %d-bit, rotation %s, granularity "
              "%s, value target %s, backend %s, %.2f s\n",
              cmd.out.c_str(), cal.info.num_layers, cal.info.num_kv_heads, cal.info.head_dim,
              cal.info.group, cal.info.bits, cal.info.rotation.c_str(),
              cal.info.granularity.c_str(), cal.info.value_target.c_str(),
              backend.name.c_str(), seconds);
  for (int l = 0; l < cal.info.num_layers; ++l) {
    const kvq::calib::LayerCalibration& layer = cal.layers[l];
    std::printf("  layer %d: clip K %.2f  V %.2f", l, layer.key.clip[0], layer.value.clip[0]);
    if (!layer.key.scale.empty()) {
      std::printf("  %s scale", cal.info.scheme.c_str());
      for (int side = 0; side < 2; ++side) {
        const std::vector<float>& scale = layer.heads(side).scale;
        const auto [lo, hi] = std::minmax_element(scale.begin(), scale.end());
        std::printf("%s %c %.4g..%.4g", side == 0 ? "" : " ", "KV"[side], *lo, *hi);
      }
    }
    std::printf("\n");
  }
}

}  // namespace

void setup_calibrate(CLI::App& app) {
  auto cmd = std::make_shared<CalibrateCommand>();
  CLI::App* sub = app.add_subcommand(
      "calibrate", "OSCAR calibration: rotations R = U*H*P_br and clip ratios from activations");
  sub->add_option("--activations", cmd->activations, "Activation capture (kvq synth output)")
      ->required();
  sub->add_option("--out", cmd->out, "Output calibration safetensors file")
      ->required()
      ->check(kvq::cli::OutputFile());
  sub->add_option("--granularity", cmd->granularity, "kv_head or layer")->capture_default_str();
  sub->add_option("--value-target", cmd->value_target, "attn_output, key_weighted or raw")
      ->capture_default_str();
  sub->add_option("--rotation", cmd->rotation,
                  "oscar, no_bitrev, no_hadamard, eigenbasis_only, raw_target, "
                  "hadamard_bitrev, hadamard, random_orthogonal, identity")
      ->capture_default_str();
  sub->add_option("--clip-grid", cmd->clip_grid,
                  "Comma-separated clip ratios in (0, 1] (default 0.80,0.82,...,1.00)")
      ->delimiter(',');
  sub->add_option("--group", cmd->options.group, "Quantization group G")->capture_default_str();
  sub->add_option("--bits", cmd->options.bits, "Bits b (2 or 4)")->capture_default_str();
  sub->add_option("--k-bits", cmd->options.bits, "K's bits (the same as --bits)")
      ->check(CLI::IsMember({2, 4}));
  sub->add_option("--v-bits", cmd->options.v_bits,
                  "V's bits when they differ from K's (the V clip is searched at this width)")
      ->check(CLI::IsMember({2, 4}));
  sub->add_option("--damping", cmd->options.damping, "alpha: C + alpha*mean(diag C)*I")
      ->capture_default_str();
  sub->add_option("--sink", cmd->options.sink, "BF16 sink tokens S0 (not clip rows)")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--recent", cmd->options.recent, "BF16 recent window W")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--seed", cmd->options.random_seed, "Seed of --rotation random_orthogonal")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  sub->add_option("--threads", cmd->options.threads, "Worker threads")->capture_default_str();
  sub->add_option("--backend", cmd->backend, "Write-path backend (default: best of this CPU)");
  sub->add_option("--scheme", cmd->options.scheme,
                  "oscar; or fp8 / fp8_hadamard: also that scheme's per-head fp8 scales "
                  "(layers.L.k_scale / v_scale = max |x| / 448 after its rotation)")
      ->capture_default_str();
  sub->callback([cmd]() { RunCalibrate(*cmd); });
}
