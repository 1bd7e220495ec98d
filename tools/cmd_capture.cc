// kvq capture: the model's own post-RoPE q, k, v over token windows, as an activation file
// (spec/formats.md §4; several windows make a segmented capture), from the C++ fp32 forward:
// real activations for kvq calibrate / eval without PyTorch.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "cli_common.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/model.h"
#include "kvq/common/error.h"

namespace {

struct CaptureCommand {
  std::string model;
  std::string tokens;
  std::string windows = "calib";
  int64_t length = 0;
  int calib_windows = -1;
  std::string out;
  std::string dtype = "bf16";
  int threads = 0;
};

void RunCapture(const CaptureCommand& cmd) {
  const auto start = std::chrono::steady_clock::now();
  KVQ_CHECK(cmd.threads >= 0, kInvalidArgument, "--threads ", cmd.threads, " must be >= 0");
  kvq::DType storage;
  if (cmd.dtype == "bf16") {
    storage = kvq::DType::kBF16;
  } else if (cmd.dtype == "f16") {
    storage = kvq::DType::kF16;
  } else if (cmd.dtype == "f32") {
    storage = kvq::DType::kF32;
  } else {
    KVQ_CHECK(false, kInvalidArgument, "--dtype '", cmd.dtype, "' (bf16, f16 or f32)");
  }
  const int threads =
      cmd.threads > 0 ? cmd.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // The windows first: the model's RoPE tables cover only the positions they hold.
  const kvq::calib::ModelConfig config = kvq::calib::ReadModelConfig(cmd.model);
  const std::string tokens =
      cmd.tokens.empty() ? kvq::calib::DefaultTokensPath(cmd.model) : cmd.tokens;
  const std::vector<kvq::calib::TokenWindows> windows = kvq::calib::ReadTokenWindows(
      tokens, kvq::calib::ParseWindowSelections(cmd.windows), cmd.length, config.vocab);
  int64_t positions = 0;
  for (const auto& w : windows) positions = std::max(positions, w.length);
  const kvq::calib::Model model = kvq::calib::LoadModel(cmd.model, positions);
  int count = 0;
  for (const auto& w : windows) count += static_cast<int>(w.count());
  KVQ_CHECK(cmd.calib_windows == -1 || (cmd.calib_windows >= 1 && cmd.calib_windows <= count),
            kInvalidArgument, "--calib-windows ", cmd.calib_windows, " must lie in [1, ", count,
            "] (the windows captured)");
  const kvq::calib::Activations acts = kvq::calib::CaptureActivations(
      model, windows, cmd.calib_windows, threads,
      "kvq capture " + cmd.model + " " + cmd.windows +
          (cmd.length > 0 ? " length " + std::to_string(cmd.length) : ""),
      kvq::cli::StderrProgress("capture: fp32 forward, windows"));
  kvq::calib::WriteActivations(cmd.out, acts, storage);
  const auto& info = acts.info;
  std::printf("wrote %s: %d layers, Hq=%d, Hkv=%d, d=%d, %d windows x %lld tokens (%lld "
              "calibrate), %s, %.1f s\n",
              cmd.out.c_str(), info.num_layers, info.num_q_heads, info.num_kv_heads,
              info.head_dim, count, static_cast<long long>(info.tokens / count),
              static_cast<long long>(info.calib_tokens), cmd.dtype.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace

void setup_capture(CLI::App& app) {
  auto cmd = std::make_shared<CaptureCommand>();
  CLI::App* sub = app.add_subcommand(
      "capture", "A model's own post-RoPE q/k/v over token windows, as an activation file");
  sub->add_option("--model", cmd->model, "Model folder (config.json, model.safetensors)")
      ->required();
  sub->add_option("--tokens", cmd->tokens,
                  "Token windows file (default: the model folder's tokens.safetensors)");
  sub->add_option("--windows", cmd->windows, "Windows: NAME[:i|:a-b],... tensors of the file")
      ->capture_default_str();
  sub->add_option("--length", cmd->length, "Tokens per window (0 = whole windows)")
      ->capture_default_str();
  sub->add_option("--calib-windows", cmd->calib_windows,
                  "The first N windows calibrate, the rest are held out (default: all calibrate)");
  sub->add_option("--out", cmd->out, "Output activation file (.safetensors)")
      ->required()
      ->check(kvq::cli::OutputFile());
  sub->add_option("--dtype", cmd->dtype, "Storage: bf16, f16 or f32")->capture_default_str();
  sub->add_option("--threads", cmd->threads, "Worker threads (0 = every core)")
      ->capture_default_str();
  sub->callback([cmd]() { RunCapture(*cmd); });
}
