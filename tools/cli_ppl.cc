#include "cli_ppl.h"

#include "cli_common.h"
#include "cli_gpu.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/fair_clip.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/matmul.h"
#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cli {
namespace {

using Clock = std::chrono::steady_clock;

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

// --scheme-windows shared: the schemes whose own windows keep no sink take the shared ones
// (calib::ShareSchemeWindows), labelled NAME+w.
void ShareSchemeWindows(calib::PplOptions* options,
                        std::vector<std::vector<calib::LayerScheme>>* layers) {
  for (size_t i = 0; i < options->schemes.size(); ++i) {
    calib::SchemeVariant& v = options->schemes[i];
    if (!calib::ShareSchemeWindows(v, options->scheme, &(*layers)[i])) continue;
    v.label += "+w";
    std::printf("      %s: S0 = %d, W = %d, F = %d (--scheme-windows shared)\n", v.label.c_str(),
                options->scheme.sink, options->scheme.recent, (*layers)[i][0].params.flush);
  }
}

// Drops the schemes the CUDA path cannot serve (all: with a line each), or refuses one named.
void KeepGpuSchemes(const GpuModule& module, bool all, calib::PplOptions* options,
                    std::vector<std::vector<calib::LayerScheme>>* layers) {
  std::vector<calib::SchemeVariant> kept_variants;
  std::vector<std::vector<calib::LayerScheme>> kept_layers;
  for (size_t i = 0; i < options->schemes.size(); ++i) {
    const calib::SchemeVariant& v = options->schemes[i];
    const std::string why = module.PplUnsupported((*layers)[i]);
    if (why.empty()) {
      kept_variants.push_back(v);
      kept_layers.push_back(std::move((*layers)[i]));
      continue;
    }
    KVQ_CHECK(all, kUnsupported, "scheme '", v.label, "' has no CUDA path: ", why);
    std::printf("      not on the GPU: %s: %s\n", v.label.c_str(), why.c_str());
  }
  options->schemes = std::move(kept_variants);
  *layers = std::move(kept_layers);
  KVQ_CHECK(!options->schemes.empty(), kUnsupported, "no scheme left that the GPU serves");
}

// The GPU against the CPU, row by row: PPL (all and tail positions, and the largest per-window
// difference), KL and top-1 at the tail. Prints the table, adds it to j["comparison"] and
// returns whether every PPL difference is within max_rel.
bool CompareBackends(const calib::PplResult& cpu, const calib::PplResult& gpu, double max_rel,
                     nlohmann::ordered_json* j) {
  auto rel = [](double a, double b) { return b != 0 ? a / b - 1.0 : (a == 0 ? 0.0 : 1.0); };
  bool ok = true;
  double worst = 0, worst_kl = 0;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::printf("\nGPU vs CPU (relative differences: GPU / CPU - 1; KL and top-1 at the tail)\n");
  std::printf("  %-13s %-22s %9s %9s %10s %10s %11s %9s %9s %10s %7s %7s\n", "set", "row",
              "PPL cpu", "PPL gpu", "rel", "rel tail", "max rel win", "KL cpu", "KL gpu",
              "rel KL", "top1 c", "top1 g");
  for (const calib::WindowSetResult& set : gpu.sets) {
    const calib::WindowSetResult& cs = cpu.Get(set.name);
    for (const calib::RowResult& g : set.rows) {
      const calib::RowResult* c = cs.Find(g.label);
      if (c == nullptr) continue;
      const double r_all = rel(g.Ppl(false), c->Ppl(false));
      const double r_tail = rel(g.Ppl(true), c->Ppl(true));
      double r_win = 0;
      for (size_t w = 0; w < g.windows.size() && w < c->windows.size(); ++w) {
        const double d = rel(std::exp(g.windows[w].all.MeanNll()),
                             std::exp(c->windows[w].all.MeanNll()));
        if (std::abs(d) > std::abs(r_win)) r_win = d;
      }
      const double r_kl = rel(g.MeanKl(true), c->MeanKl(true));
      // The criterion: the set's PPL over all positions (the tail and the single windows, a
      // few thousand predictions, carry more of the INT2 codes that flip between two fp32
      // implementations: shown, not gated; docs/perplexity.md).
      const bool row_ok = std::abs(r_all) <= max_rel;
      ok = ok && row_ok;
      worst = std::max(worst, std::abs(r_all));
      if (c->MeanKl(true) > 0) worst_kl = std::max(worst_kl, std::abs(r_kl));
      std::printf("  %-13s %-22s %9.4f %9.4f %+10.2e %+10.2e %+11.2e %9.6f %9.6f %+10.2e %7.4f "
                  "%7.4f%s\n",
                  set.name.c_str(), g.label.c_str(), c->Ppl(false), g.Ppl(false), r_all, r_tail,
                  r_win, c->MeanKl(true), g.MeanKl(true), r_kl, c->Top1(true), g.Top1(true),
                  row_ok ? "" : "  <-- over");
      rows.push_back({{"set", set.name},
                      {"row", g.label},
                      {"ppl_cpu", c->Ppl(false)},
                      {"ppl_gpu", g.Ppl(false)},
                      {"rel_ppl", r_all},
                      {"ppl_tail_cpu", c->Ppl(true)},
                      {"ppl_tail_gpu", g.Ppl(true)},
                      {"rel_ppl_tail", r_tail},
                      {"max_rel_ppl_window", r_win},
                      {"kl_tail_cpu", c->MeanKl(true)},
                      {"kl_tail_gpu", g.MeanKl(true)},
                      {"rel_kl_tail", r_kl},
                      {"top1_tail_cpu", c->Top1(true)},
                      {"top1_tail_gpu", g.Top1(true)},
                      {"within", row_ok}});
    }
  }
  std::printf("largest |relative PPL difference| (all positions of a set) %.2e (tolerance %.0e): "
              "%s; largest |relative KL difference| %.2e\n",
              worst, max_rel, ok ? "within" : "OVER", worst_kl);
  (*j)["comparison"] = {{"max_rel_ppl", max_rel},
                        {"worst_rel_ppl", worst},
                        {"worst_rel_kl", worst_kl},
                        {"within", ok},
                        {"rows", rows}};
  return ok;
}

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
  const auto start = Clock::now();
  const int threads =
      cmd.threads > 0 ? cmd.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  KVQ_CHECK(cmd.threads >= 0, kInvalidArgument, "--threads ", cmd.threads, " must be >= 0");
  KVQ_CHECK(cmd.clip == "own" || cmd.clip == "oscar" || cmd.clip == "both", kInvalidArgument,
            "--clip '", cmd.clip, "' (own, oscar or both)");
  KVQ_CHECK(cmd.backend == "cpu" || cmd.backend == "gpu" || cmd.backend == "both",
            kInvalidArgument, "--backend '", cmd.backend, "' (cpu, gpu or both)");
  KVQ_CHECK(cmd.scheme_windows == "own" || cmd.scheme_windows == "shared", kInvalidArgument,
            "--scheme-windows '", cmd.scheme_windows, "' (own or shared)");
  const bool use_gpu = cmd.backend != "cpu";
  const GpuModule* module = use_gpu ? &RequireGpu("--backend " + cmd.backend) : nullptr;
  const gpu::GpuDecodeMode decode_mode =
      use_gpu ? module->ParseDecodeMode(cmd.gpu_decode) : gpu::GpuDecodeMode::kBatch;
  const cpu::Backend& backend = cpu::BestBackend();
  if (!cmd.banner.empty()) std::printf("%s\n", cmd.banner.c_str());

  for (const auto& [name, value] : {std::pair<const char*, int>{"--k-bits", cmd.k_bits},
                                    {"--v-bits", cmd.v_bits}}) {
    KVQ_CHECK(value == 0 || value == 2 || value == 4, kInvalidArgument, name, " ", value,
              " is not supported (2 or 4)");
  }
  // Scheme rows first: a typo fails before any work.
  std::vector<calib::SchemeVariant> variants =
      calib::ParseSchemeVariants(cmd.schemes, cmd.clip == "both");
  if (cmd.clip == "oscar") {
    for (calib::SchemeVariant& v : variants) {
      if (v.clip == calib::ClipChoice::kCatalogue && calib::SchemeClipsWithCalibration(v.scheme) &&
          v.scheme != "oscar") {
        v.clip = calib::ClipChoice::kOscar;
        v.label += "@oscar";
      }
    }
  }
  bool need_calibration = false, need_capture = false;
  for (const calib::SchemeVariant& v : variants) {
    const calib::ClipChoice clip = v.Resolved();
    need_calibration = need_calibration || calib::SchemeByName(v.scheme).needs_calibration ||
                       clip == calib::ClipChoice::kOscar;
    need_capture = need_capture || clip == calib::ClipChoice::kOwn || v.scheme == "raw_target" ||
                   calib::CalibrationScheme(v.scheme) != "oscar";
    // (raw_target: a format_version 1 calibration gets its raw rotations from the capture; the
    // fp8 schemes compute their scales on it unless the calibration file is their own)
  }
  need_capture = need_capture || (need_calibration && cmd.calibration.empty());
  // An option that the chosen schemes would leave unused is an error, not silence.
  KVQ_CHECK(cmd.save_calibration.empty() || cmd.calibration.empty(), kInvalidArgument,
            "--save-calibration ", cmd.save_calibration, " saves a calibration computed here, "
            "but --calibration ", cmd.calibration, " is given");
  KVQ_CHECK(cmd.save_calibration.empty() || need_calibration, kInvalidArgument,
            "--save-calibration ", cmd.save_calibration, ": no scheme of --schemes ", cmd.schemes,
            " (--clip ", cmd.clip, ") needs a calibration, so none is computed");
  KVQ_CHECK(cmd.calib_activations.empty() || need_capture, kInvalidArgument,
            "--calib-activations ", cmd.calib_activations, ": no scheme of --schemes ",
            cmd.schemes, " (--clip ", cmd.clip, ") needs calibration activations");
  const bool capture_here = need_capture && cmd.calib_activations.empty();

  auto t = Clock::now();
  std::printf("[1/4] loading %s ...\n", cmd.model.c_str());
  std::fflush(stdout);
  // The windows before the weights: the RoPE tables cover only the positions they hold.
  const calib::ModelConfig config = calib::ReadModelConfig(cmd.model);
  const std::string tokens_path =
      cmd.tokens.empty() ? calib::DefaultTokensPath(cmd.model) : cmd.tokens;
  const std::vector<calib::TokenWindows> sets = calib::ReadTokenWindows(
      tokens_path, calib::ParseWindowSelections(cmd.windows), cmd.length, config.vocab);
  std::vector<calib::TokenWindows> calib_sets;
  if (capture_here) {
    calib_sets = calib::ReadTokenWindows(tokens_path,
                                         calib::ParseWindowSelections(cmd.calib_windows),
                                         cmd.calib_length, config.vocab);
  }
  int64_t positions = 0;
  for (const calib::TokenWindows& s : sets) positions = std::max(positions, s.length);
  for (const calib::TokenWindows& s : calib_sets) positions = std::max(positions, s.length);
  const calib::Model model = calib::LoadModel(cmd.model, positions);
  const calib::ModelConfig& c = model.config;
  std::printf("      %s: %d layers, d_model %d, Hq %d x d %d, Hkv %d, vocab %d (%.1f s; "
              "kernels %s, %d threads)\n",
              calib::ModelArchName(c.arch), c.num_layers, c.hidden, c.num_q_heads, c.head_dim,
              c.num_kv_heads, c.vocab, SecondsSince(t), calib::MatMulTargetName(), threads);

  // A calibration file is read and checked against the model before any forward runs.
  calib::Calibration cal;
  bool have_cal = false;
  int group = cmd.group, bits = cmd.bits, sink = cmd.sink, recent = cmd.recent;
  auto given = [](const CLI::Option* o) { return o != nullptr && o->count() > 0; };
  if (!cmd.calibration.empty()) {
    cal = calib::ReadCalibration(cmd.calibration);
    have_cal = true;
    KVQ_CHECK(cal.info.num_layers == c.num_layers && cal.info.num_kv_heads == c.num_kv_heads &&
                  cal.info.head_dim == c.head_dim,
              kShapeMismatch, "calibration '", cmd.calibration, "' is ", cal.info.num_layers,
              " layers x ", cal.info.num_kv_heads, " KV heads x d=", cal.info.head_dim,
              ", the model ", c.num_layers, " x ", c.num_kv_heads, " x d=", c.head_dim);
    if (!given(cmd.group_option)) group = cal.info.group;
    if (!given(cmd.bits_option)) bits = cal.info.bits;
    if (!given(cmd.sink_option)) sink = cal.info.sink;
    if (!given(cmd.recent_option)) recent = cal.info.recent;
  }
  // Each side's width: --k-bits / --v-bits, else the calibration's (unless --bits is given),
  // else --bits.
  int k_bits = bits, v_bits = bits;
  if (have_cal && !given(cmd.bits_option) && cal.info.v_bits != 0) v_bits = cal.info.v_bits;
  if (cmd.k_bits != 0) k_bits = cmd.k_bits;
  if (cmd.v_bits != 0) v_bits = cmd.v_bits;

  // The calibration capture and the calibration.
  t = Clock::now();
  calib::Activations calib_acts;
  std::printf("[2/4] calibration: ");
  std::fflush(stdout);  // before a progress line on the same terminal
  if (need_capture) {
    if (!capture_here) {
      calib_acts = calib::ReadActivations(cmd.calib_activations);
      std::printf("capture %s", cmd.calib_activations.c_str());
    } else {
      calib_acts = calib::CaptureActivations(model, calib_sets, -1, threads,
                                             "kvq capture " + cmd.model + " " + cmd.calib_windows,
                                             StderrProgress("[2/4] capturing windows"));
      std::printf("captured %s (%lld tokens, fp32 forward)", cmd.calib_windows.c_str(),
                  static_cast<long long>(calib_acts.info.tokens));
    }
  } else {
    std::printf("no capture needed");
  }
  std::fflush(stdout);
  if (have_cal) {
    if (need_capture && !cal.layers.empty() && cal.layers[0].raw_k_rotation.empty()) {
      calib::AddRawTargetRotations(calib_acts, &cal);  // a format_version 1 file
    }
    std::printf("; calibration %s", cmd.calibration.c_str());
  } else if (need_calibration) {
    calib::CalibrationOptions options;
    options.group = group;
    options.bits = k_bits;
    options.v_bits = v_bits != k_bits ? v_bits : 0;
    options.sink = sink;
    options.recent = recent;
    options.threads = threads;
    options.source = calib_acts.info.source;
    cal = calib::Calibrate(calib_acts, options, backend,
                           StderrProgress("[2/4] calibrating OSCAR, layer x KV head units"));
    have_cal = true;
    std::printf("; OSCAR calibrated (R = U*H*P_br, value target %s)",
                cal.info.value_target.c_str());
    if (!cmd.save_calibration.empty()) calib::WriteCalibration(cmd.save_calibration, cal);
  }
  std::printf(" in %.1f s\n", SecondsSince(t));
  if (have_cal) {
    std::printf("      OSCAR clip ratios K/V per layer:");
    for (const calib::LayerCalibration& l : cal.layers) {
      std::printf(" %.2f/%.2f", l.k_clip[0], l.v_clip[0]);
    }
    std::printf("\n");
  }

  calib::PplOptions options;
  options.schemes = variants;
  options.scheme.group = group;
  options.scheme.bits = bits;
  options.scheme.k_bits = k_bits != bits ? k_bits : 0;
  options.scheme.v_bits = v_bits != bits ? v_bits : 0;
  options.scheme.sink = sink;
  options.scheme.recent = recent;
  options.scheme.page = cmd.page;
  options.scheme.seed = cmd.seed;
  options.scheme.saw_block = cmd.saw_block;
  options.clip_grid = cmd.clip_grid;
  options.threads = threads;
  options.share_prefix = !cmd.no_share_prefix;
  options.fp32_baseline = !cmd.no_fp32;
  options.per_position = cmd.per_position;
  options.tail_from = cmd.tail_from;

  t = Clock::now();
  std::printf("[3/4] building %zu schemes (own clip ratios by kvq calibrate's rule where they "
              "clip) ...\n",
              variants.size());
  std::fflush(stdout);
  std::vector<std::vector<calib::LayerScheme>> built = calib::BuildVariantLayers(
      c, need_capture ? &calib_acts : nullptr, have_cal ? &cal : nullptr, options, backend,
      StderrProgress("[3/4] building schemes x layers"));
  std::printf("      done in %.1f s\n", SecondsSince(t));
  std::vector<std::vector<calib::LayerScheme>> layers = std::move(built);
  if (cmd.scheme_windows == "shared") ShareSchemeWindows(&options, &layers);
  if (use_gpu) KeepGpuSchemes(*module, cmd.schemes == "all", &options, &layers);

  t = Clock::now();
  int64_t windows = 0;
  std::string what;
  for (const calib::TokenWindows& s : sets) {
    windows += static_cast<int64_t>(s.count());
    what += (what.empty() ? "" : ", ") + s.name + "[" + Join(s.rows) + "]";
  }
  std::printf("[4/4] teacher-forced evaluation: %lld windows (%s) x %lld tokens, %zu rows, "
              "S0=%d W=%d G=%d b=%s ...\n",
              static_cast<long long>(windows), what.c_str(),
              static_cast<long long>(sets.front().length), variants.size(), sink, recent, group,
              k_bits == v_bits ? std::to_string(k_bits).c_str()
                               : ("K" + std::to_string(k_bits) + "V" + std::to_string(v_bits)).c_str());
  std::fflush(stdout);
  if (!use_gpu) {
    calib::PplResult result = calib::EvaluatePerplexity(model, sets, layers, options, backend,
                                                        MakeProgress(cmd.quiet_progress));
    if (have_cal) result.calibration_source = cal.info.source;
    std::printf("      done in %.1f s\n\n", SecondsSince(t));
    std::printf("%s", calib::FormatPplTable(result).c_str());
    std::printf("%s", calib::SummarizePpl(result).c_str());
    if (!cmd.json.empty()) {
      calib::WritePplJson(cmd.json, result);
      std::printf("wrote %s\n", cmd.json.c_str());
    }
    std::printf("total %.1f s (%d threads)\n", SecondsSince(start), threads);
    return;
  }
  // The GPU: the same evaluation with the forwards on the device (no fp32 row there).
  calib::PplOptions gpu_options = options;
  if (gpu_options.fp32_baseline) {
    std::printf("      (no fp32 row on the GPU: a cache holds bf16 or quantized rows)\n");
    gpu_options.fp32_baseline = false;
  }
  KVQ_CHECK(cmd.gpu_qk == "int8" || cmd.gpu_qk == "bf16", kInvalidArgument, "--gpu-qk '",
            cmd.gpu_qk, "' (int8 or bf16)");
  const std::unique_ptr<GpuPpl> forwards =
      module->MakePpl(model, decode_mode, cmd.gpu_qk == "int8");
  std::printf("      GPU: %s, decode %s, QK %s, cuBLAS fp32 (pedantic math)\n",
              forwards->device_name().c_str(), module->DecodeModeName(decode_mode),
              cmd.gpu_qk.c_str());
  std::fflush(stdout);
  calib::PplResult gpu_result =
      calib::EvaluatePerplexity(model, sets, layers, gpu_options, backend,
                                MakeProgress(cmd.quiet_progress), &forwards->forwards());
  if (have_cal) gpu_result.calibration_source = cal.info.source;
  const double gpu_seconds = SecondsSince(t);
  const gpu::GpuPplStats stats = forwards->stats();
  std::printf("      GPU evaluation done in %.1f s: %d reference forwards %.2f s (%.1f ms each), "
              "%d scheme forwards %.2f s (%.1f ms each), %lld positions\n\n",
              gpu_seconds, stats.reference_forwards, stats.reference_seconds,
              1e3 * stats.reference_seconds / std::max(1, stats.reference_forwards),
              stats.scheme_forwards, stats.scheme_seconds,
              1e3 * stats.scheme_seconds / std::max(1, stats.scheme_forwards),
              static_cast<long long>(stats.positions));
  std::printf("GPU (%s):\n%s", forwards->device_name().c_str(),
              calib::FormatPplTable(gpu_result).c_str());
  std::printf("%s", calib::SummarizePpl(gpu_result).c_str());
  nlohmann::ordered_json j;
  j["format"] = "kvq-ppl-gpu";
  j["device"] = forwards->device_name();
  j["decode"] = module->DecodeModeName(decode_mode);
  j["qk"] = cmd.gpu_qk;
  j["gpu_seconds"] = gpu_seconds;
  j["gpu_forwards"] = {{"reference", stats.reference_forwards},
                       {"reference_seconds", stats.reference_seconds},
                       {"scheme", stats.scheme_forwards},
                       {"scheme_seconds", stats.scheme_seconds},
                       {"positions", stats.positions}};
  j["gpu"] = nlohmann::ordered_json::parse(calib::PplJson(gpu_result));
  bool ok = true;
  if (cmd.backend == "both") {
    t = Clock::now();
    std::printf("\n[4/4] the same on the CPU (%d threads) ...\n", threads);
    std::fflush(stdout);
    calib::PplResult cpu_result = calib::EvaluatePerplexity(
        model, sets, layers, options, backend, MakeProgress(cmd.quiet_progress));
    if (have_cal) cpu_result.calibration_source = cal.info.source;
    const double cpu_seconds = SecondsSince(t);
    std::printf("      CPU evaluation done in %.1f s\n\nCPU:\n%s", cpu_seconds,
                calib::FormatPplTable(cpu_result).c_str());
    j["cpu_seconds"] = cpu_seconds;
    j["cpu"] = nlohmann::ordered_json::parse(calib::PplJson(cpu_result));
    ok = CompareBackends(cpu_result, gpu_result, cmd.max_rel_ppl, &j);
  }
  if (!cmd.json.empty()) {
    const std::string text = j.dump(1) + "\n";
    WriteFile(cmd.json, std::vector<uint8_t>(text.begin(), text.end()));
    std::printf("wrote %s\n", cmd.json.c_str());
  }
  std::printf("total %.1f s (%d threads)\n", SecondsSince(start), threads);
  KVQ_CHECK(ok, kMismatch, "GPU and CPU perplexities differ by more than --max-rel-ppl ",
            cmd.max_rel_ppl, " (table above)");
}

}  // namespace kvq::cli
