// kvq synth: writes the embedded synthetic activation capture (docs/synthetic_data.md).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli_common.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"

namespace {

struct SynthCommand {
  std::string out;
  std::string dtype = "bf16";
  kvq::calib::SynthOptions options;
};

kvq::DType ParseStorage(const std::string& text) {
  if (text == "bf16") return kvq::DType::kBF16;
  if (text == "f16") return kvq::DType::kF16;
  if (text == "f32") return kvq::DType::kF32;
  KVQ_CHECK(false, kInvalidArgument, "--dtype '", text, "' (bf16, f16 or f32)");
  return kvq::DType::kBF16;
}

void RunSynth(const SynthCommand& cmd) {
  const auto start = std::chrono::steady_clock::now();
  const kvq::DType storage = ParseStorage(cmd.dtype);
  const kvq::calib::Activations acts = kvq::calib::Synthesize(cmd.options);
  kvq::calib::WriteActivations(cmd.out, acts, storage);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const kvq::calib::ActivationsInfo& info = acts.info;
  std::printf("wrote %s: %d layers, %lld tokens (%lld calibration, %lld held out), Hq=%d Hkv=%d "
              "d=%d rope_base=%g, %s, seed %llu, %.2f s\n",
              cmd.out.c_str(), info.num_layers, static_cast<long long>(info.tokens),
              static_cast<long long>(info.calib_tokens),
              static_cast<long long>(info.tokens - info.calib_tokens), info.num_q_heads,
              info.num_kv_heads, info.head_dim, info.rope_base, cmd.dtype.c_str(),
              static_cast<unsigned long long>(cmd.options.seed), seconds);
}

}  // namespace

void setup_synth(CLI::App& app) {
  auto cmd = std::make_shared<SynthCommand>();
  CLI::App* sub = app.add_subcommand(
      "synth", "Write synthetic post-RoPE Q/K/V activations (deterministic by seed)");
  sub->add_option("--out", cmd->out, "Output safetensors file")
      ->required()
      ->check(kvq::cli::OutputFile());
  sub->add_option("--seed", cmd->options.seed, "Seed (same seed, same bytes)")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  sub->add_option("--layers", cmd->options.num_layers, "Layers")->capture_default_str();
  sub->add_option("--tokens", cmd->options.tokens, "Tokens T (first half calibrates)")
      ->capture_default_str();
  sub->add_option("--calib-tokens", cmd->options.calib_tokens,
                  "Calibration tokens (0: T/2; the rest are held out)")
      ->capture_default_str();
  sub->add_option("--q-heads", cmd->options.num_q_heads, "Query heads Hq")->capture_default_str();
  sub->add_option("--kv-heads", cmd->options.num_kv_heads, "KV heads Hkv")->capture_default_str();
  sub->add_option("--head-dim", cmd->options.head_dim, "Head dimension d (64, 128, 256)")
      ->capture_default_str();
  sub->add_option("--rope-base", cmd->options.rope_base, "RoPE base (1e6 Qwen3, 1e4 Llama-2)")
      ->capture_default_str();
  sub->add_option("--dtype", cmd->dtype, "Stored dtype: bf16, f16 or f32")->capture_default_str();
  sub->add_option("--threads", cmd->options.threads, "Worker threads (output does not depend on it)")
      ->capture_default_str();
  sub->callback([cmd]() { RunSynth(*cmd); });
}
