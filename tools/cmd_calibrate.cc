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
#include "kvq/calib/codebook_calibration.h"
#include "kvq/common/error.h"
#include "kvq/common/lloyd_max.h"
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
  std::string k_bits;          // --k-bits: an integer, or blockgtq's average (e.g. 2.5)
  int rotation_threshold = 1;  // blockgtq
  std::string codebook = "beta";
  kvq::calib::CalibrationOptions options;
};

// --k-bits as a number: the whole text must parse (no "2.5x"), naming it otherwise.
double ParseKBits(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KVQ_CHECK(used == text.size() && used > 0, kInvalidArgument, "--k-bits '", text,
            "' is not a number");
  return value;
}

// kvq calibrate --scheme tq_mse | tq_mse_fwht | blockgtq (spec/numerics.md §9.1).
void RunCodebookCalibrate(const CalibrateCommand& cmd,
                          std::chrono::steady_clock::time_point start) {
  kvq::calib::CodebookCalibrationOptions o;
  o.scheme = cmd.options.scheme;
  KVQ_CHECK(!cmd.k_bits.empty(), kInvalidArgument, "--scheme ", o.scheme,
            " needs --k-bits (blockgtq: the keys' average width in [1, 8], e.g. 2.5)");
  o.k_avg_bits = ParseKBits(cmd.k_bits);
  o.v_bits = cmd.options.v_bits;
  o.seed = cmd.options.random_seed;
  o.rotation_threshold = cmd.rotation_threshold;
  o.density = kvq::ParseCodebookDensity(cmd.codebook);
  o.sink = cmd.options.sink;
  o.recent = cmd.options.recent;
  o.threads = cmd.options.threads;
  o.source = cmd.activations;
  const kvq::calib::Activations acts = kvq::calib::ReadActivations(cmd.activations);
  kvq::calib::AllocationStability stability;
  const kvq::calib::Calibration cal = kvq::calib::CalibrateCodebook(acts, o, &stability);
  kvq::calib::WriteCalibration(cmd.out, cal);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const kvq::calib::CalibrationInfo& info = cal.info;
  const kvq::calib::CodebookCalibrationInfo& cb = info.codebook;
  const int blocks = info.head_dim / 2;
  const int v_bits = info.v_bits != 0 ? info.v_bits : info.bits;
  std::printf("wrote %s: %d layers x %d kv heads, d=%d, scheme %s, K %s, V %d-bit, codebook %s, "
              "seed %llu, calibration tokens %lld, %.2f s\n",
              cmd.out.c_str(), info.num_layers, info.num_kv_heads, info.head_dim,
              info.scheme.c_str(),
              kvq::calib::AllocatesWidths(info.scheme)
                  ? (cmd.k_bits + " bits a block on average (budget " +
                     std::to_string(kvq::calib::WidthBudget(blocks, cb.k_avg_bits)) + " of " +
                     std::to_string(blocks) + " blocks), rows of " +
                     std::to_string(cb.k_segments) + " segments / " +
                     std::to_string(cb.k_code_bytes) + " code bytes at most")
                        .c_str()
                  : (std::to_string(info.bits) + "-bit").c_str(),
              v_bits, cb.density.c_str(), static_cast<unsigned long long>(cb.seed),
              static_cast<long long>(acts.info.calib_tokens), seconds);
  if (!kvq::calib::AllocatesWidths(info.scheme)) return;
  for (int l = 0; l < info.num_layers; ++l) {
    const kvq::calib::LayerCalibration& layer = cal.layers[l];
    std::printf("  layer %d: K widths", l);
    for (int h = 0; h < info.num_kv_heads; ++h) {
      int count[9] = {};
      for (int i = 0; i < blocks; ++i) ++count[layer.key.widths[h * blocks + i]];
      std::printf(" | head %d", h);
      for (int w = 1; w <= 8; ++w) {
        if (count[w] != 0) std::printf(" %dx%db", count[w], w);
      }
    }
    std::printf("\n");
  }
  // Stability of the allocation across calibration prefixes: blocks whose width differs from
  // the full calibration's (Hamming distance, out of d/2) and the surrogate's regret
  // J(w_prefix)/J(w_full) - 1 under the full energies.
  std::printf("  allocation stability (vs all %lld calibration tokens, over %d layers x %d kv "
              "heads):\n",
              static_cast<long long>(acts.info.calib_tokens), info.num_layers,
              info.num_kv_heads);
  for (size_t p = 0; p < stability.prefixes.size(); ++p) {
    int max_distance = 0;
    double sum_distance = 0, max_regret = 0, sum_regret = 0;
    int n = 0;
    for (const auto& layer : stability.hamming[p]) {
      for (int d : layer) {
        max_distance = std::max(max_distance, d);
        sum_distance += d;
        ++n;
      }
    }
    for (const auto& layer : stability.regret[p]) {
      for (double r : layer) {
        max_regret = std::max(max_regret, r);
        sum_regret += r;
      }
    }
    std::printf("    first %lld tokens: hamming mean %.2f max %d of %d blocks, regret mean %.3g "
                "max %.3g\n",
                static_cast<long long>(stability.prefixes[p]), sum_distance / n, max_distance,
                blocks, sum_regret / n, max_regret);
  }
}

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
  if (kvq::calib::IsCodebookScheme(cmd.options.scheme)) return RunCodebookCalibrate(cmd, start);
  kvq::calib::CalibrationOptions options = cmd.options;
  if (!cmd.k_bits.empty()) {
    const double k_bits = ParseKBits(cmd.k_bits);
    KVQ_CHECK(k_bits == 2 || k_bits == 4, kInvalidArgument, "--k-bits ", cmd.k_bits,
              " is not supported by scheme '", options.scheme, "' (2 or 4)");
    options.bits = static_cast<int>(k_bits);
  }
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
  sub->add_option("--k-bits", cmd->k_bits,
                  "K's bits: 2 or 4 (the same as --bits); for a codebook scheme 1..8, and for "
                  "blockgtq the keys' average width in [1, 8] (e.g. 2.5: floor(d/2 * 2.5) bits "
                  "over the d/2 RoPE blocks)");
  sub->add_option("--v-bits", cmd->options.v_bits,
                  "V's bits when they differ from K's (the V clip is searched at this width; "
                  "a codebook scheme's V width, 1..8, default K's rounded up)");
  sub->add_option("--rotation-threshold", cmd->rotation_threshold,
                  "blockgtq: segments of width >= this get a Haar rotation (1..9)")
      ->capture_default_str();
  sub->add_option("--codebook", cmd->codebook,
                  "Codebook schemes: the Lloyd-Max tables the rows will be coded by (beta or "
                  "gaussian), recorded in the file")
      ->capture_default_str();
  sub->add_option("--damping", cmd->options.damping, "alpha: C + alpha*mean(diag C)*I")
      ->capture_default_str();
  sub->add_option("--sink", cmd->options.sink, "BF16 sink tokens S0 (not clip rows)")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--recent", cmd->options.recent, "BF16 recent window W")
      ->capture_default_str()
      ->check(kvq::cli::WindowTokens());
  sub->add_option("--seed", cmd->options.random_seed,
                  "Seed of --rotation random_orthogonal and of the codebook schemes' Haar "
                  "rotations")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  sub->add_option("--threads", cmd->options.threads, "Worker threads")->capture_default_str();
  sub->add_option("--backend", cmd->backend, "Write-path backend (default: best of this CPU)");
  sub->add_option("--scheme", cmd->options.scheme,
                  "oscar; or fp8 / fp8_hadamard: also that scheme's per-head fp8 scales "
                  "(layers.L.k_scale / v_scale = max |x| / 448 after its rotation); or tq_mse "
                  "(seeded Haar rotations) / blockgtq (RoPE-block energies, greedy key widths "
                  "layers.L.k_bits, R_K = P*diag(A_w), Haar R_V)")
      ->capture_default_str();
  sub->callback([cmd]() { RunCalibrate(*cmd); });
}
