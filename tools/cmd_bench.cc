// kvq bench: the CPU oracle (best Highway target) and the CUDA path side by side on the same
// inputs, for cache configurations of the scheme catalogue (calib/schemes.inc; --schemes,
// default oscar,saw_int4,bf16; calibrated schemes use a synthetic calibration of the shape).
//  - Decode attention on the same caches, one row per (scheme, B, T). GB/s counts the K and V
//    bytes the cache holds for the batch (what a decode step must read).
//  - The write path (rotate, clip, quantize, pack) of the same fp32 rows, T tokens x Hkv heads,
//    with each quantized scheme's key write parameters (its KV head 0 rotation and clip):
//    cpu::QuantizeRows against gpu::WriteRows. GB/s counts the fp32 input. The two outputs
//    (codes, scales, mins) must be identical: a difference is reported and fails the command.
// Times: CPU wall clock (median of --iters), GPU CUDA events with a cold L2 (median of at
// least 20).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_cost.h"
#include "cli_gpu.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/memory.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"

namespace {

struct BenchOptions {
  std::string backend = "all";  // cpu | gpu | all
  std::string schemes = "oscar,saw_int4,bf16";
  std::vector<int> batches{1};
  std::vector<int> lengths{4096, 32768};
  int iters = 5;
  int head_dim = 128;
  int q_heads = 32;
  int kv_heads = 8;
  int group = 64;
  int bits = 2;
  int sink = 64;
  int recent = 256;
  int page = 64;
  uint64_t seed = 1;
};

// One scheme's cache configuration at the bench's shape and options (layer 0).
struct BenchScheme {
  std::string name;
  kvq::calib::LayerScheme layer;
};

std::vector<BenchScheme> BuildSchemes(const BenchOptions& o) {
  const std::vector<std::string> names = kvq::calib::ParseSchemeList(o.schemes);
  kvq::calib::SchemeShape shape;
  shape.num_kv_heads = o.kv_heads;
  shape.num_q_heads = o.q_heads;
  shape.head_dim = o.head_dim;
  kvq::calib::SchemeOptions options;
  options.group = o.group;
  options.bits = o.bits;
  options.sink = o.sink;
  options.recent = o.recent;
  options.page = o.page;
  options.seed = o.seed;
  // Enough calibration tokens past the sink for the clip search; one calibration per kind the
  // schemes read (oscar, or an fp8 scheme's or blockgtq's own).
  kvq::calib::SyntheticCalibrations calibrations(shape, options,
                                                 2 * (static_cast<int64_t>(o.sink) + 256), o.seed);
  std::vector<BenchScheme> schemes;
  for (const std::string& name : names) {
    const kvq::calib::SchemeInfo& info = kvq::calib::SchemeByName(name);
    const kvq::calib::Calibration* cal = info.needs_calibration ? &calibrations.For(name) : nullptr;
    schemes.push_back({name, kvq::calib::BuildLayerScheme(name, shape, cal, 0, options)});
  }
  return schemes;
}

// Median wall time in microseconds of `iters` calls of run, after one untimed call.
template <typename F>
double MedianHostMicros(F&& run, int iters) {
  run();  // warm-up
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const auto stop = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

std::string Format(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* format, ...) {
  char text[128];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

// The timing columns of a table: CPU time and bandwidth, GPU time and bandwidth, their ratio,
// each only where that side runs (without a GPU no GPU column at all, rather than zeros). A
// point that a side could not run (a configuration without CUDA kernels) shows "-".
struct TimingColumns {
  bool cpu, gpu;

  std::string Header() const {
    std::string text;
    if (cpu) text += Format(" %12s %9s", "cpu_us", "cpu_GB/s");
    if (gpu) text += Format(" %12s %9s", "gpu_us", "gpu_GB/s");
    if (cpu && gpu) text += Format(" %9s", "gpu/cpu");
    return text;
  }

  // Times in microseconds (0: not run), `megabytes` moved per run.
  std::string Cells(double cpu_us, double gpu_us, double megabytes) const {
    auto side = [megabytes](double us) {
      return us > 0 ? Format(" %12.1f %9.2f", us, megabytes / us * 1e3)
                    : Format(" %12s %9s", "-", "-");
    };
    std::string text;
    if (cpu) text += side(cpu_us);
    if (gpu) text += side(gpu_us);
    if (cpu && gpu) {
      text += cpu_us > 0 && gpu_us > 0
                  ? Format(" %8dx", static_cast<int>(cpu_us / gpu_us))
                  : Format(" %9s", "-");
    }
    return text;
  }

};

// The write path of T x Hkv fp32 rows per length, with each quantized scheme's key write
// parameters; returns how many (length, scheme) points had CPU and GPU outputs that differ.
int RunWriteBench(const BenchOptions& o, const std::vector<BenchScheme>& schemes, bool run_cpu,
                  bool run_gpu) {
  size_t name_width = 8;
  for (const BenchScheme& s : schemes) name_width = std::max(name_width, s.name.size());
  const int w = static_cast<int>(name_width);
  std::printf("\nwrite path (rotate, clip, quantize, pack) of each scheme's keys (KV head 0), "
              "d=%d G=%d, T x Hkv=%d fp32 rows; CPU backend %s\n",
              o.head_dim, o.group, o.kv_heads, kvq::cpu::BestBackend().name.c_str());
  const TimingColumns timing{run_cpu, run_gpu};
  std::printf("%-*s %8s %5s %6s %10s%s%s\n", w, "scheme", "T", "INT", "clip", "MB",
              timing.Header().c_str(), run_cpu && run_gpu ? "   bits" : "");
  int differing = 0;
  for (int length : o.lengths) {
    const size_t rows = static_cast<size_t>(length) * o.kv_heads;
    std::mt19937_64 rng(o.seed + 104729u * length);
    const std::vector<float> x = kvq::cli::NormalValues(rows * o.head_dim, rng);
    const double megabytes = static_cast<double>(x.size() * sizeof(float)) / 1e6;
    for (const BenchScheme& scheme : schemes) {
      if (!scheme.layer.params.quantized()) continue;  // the bf16 cache writes no codes
      const kvq::HeadData& heads = scheme.layer.key;
      kvq::WriteParams p = scheme.layer.params.key;
      if (!heads.clip.empty()) p.clip = heads.clip[0];
      p.Validate();
      // KV head 0's matrix: the first [d, d] of [Hkv, d, d].
      const float* rotation =
          p.rotation == kvq::RotationKind::kDense ? heads.rotation.data() : nullptr;
      const kvq::cpu::Backend& backend = kvq::cpu::BestBackend();
      kvq::cpu::EncodedRows cpu_out;  // the stored planes (LayoutOf(p)), what a page holds
      double cpu_us = 0, gpu_us = 0;
      if (run_cpu) {
        cpu_us = MedianHostMicros(
            [&] { cpu_out = kvq::cpu::EncodeRows(backend, p, rotation, x.data(), rows); },
            o.iters);
      }
      std::string bits = "-";
      // A configuration the CUDA path refuses gets no GPU column; the refusal is the
      // kUnsupported error the GPU code raises.
      bool gpu_supported = run_gpu;
      kvq::cli::TimedWrite gpu_out;
      if (run_gpu) {
        try {
          gpu_out = kvq::cli::RequireGpu("kvq bench")
                        .TimeWriteRows(p, rotation, x.data(), rows, std::max(o.iters, 20), 3);
        } catch (const kvq::Error& e) {
          if (e.code() != kvq::ErrorCode::kUnsupported) throw;
          gpu_supported = false;
          bits = "no GPU";
        }
      }
      if (gpu_supported) {
        gpu_us = gpu_out.median_us;
        if (run_cpu) {
          // Every plane of LayoutOf(p), the GPU's bytes against the oracle's.
          bool same = true;
          for (int i = 0; i < kvq::LayoutOf(p).num_planes; ++i) {
            same = same && gpu_out.planes[i] == cpu_out.plane[i];
          }
          bits = same ? "equal" : "DIFFER";
          differing += same ? 0 : 1;
        }
      }
      std::printf("%-*s %8d %5d %6.3g %10.1f%s", w, scheme.name.c_str(), length, p.bits, p.clip,
                  megabytes, timing.Cells(cpu_us, gpu_us, megabytes).c_str());
      if (run_cpu && run_gpu) std::printf(" %6s", bits.c_str());
      std::printf("\n");
    }
  }
  return differing;
}

void RunBench(const BenchOptions& o) {
  KVQ_CHECK(o.backend == "cpu" || o.backend == "gpu" || o.backend == "all", kInvalidArgument,
            "--backend '", o.backend, "' is not one of cpu, gpu, all");
  KVQ_CHECK(o.iters >= 1, kInvalidArgument, "--iters ", o.iters, " must be at least 1");
  const bool run_cpu = o.backend != "gpu";
  bool run_gpu = o.backend != "cpu";
  if (run_gpu) {
    // --backend gpu needs the GPU; `all` runs the CPU alone without one, with a line saying so.
    std::string why_not;
    const kvq::cli::GpuModule* gpu = kvq::cli::GpuOrNull(&why_not);
    if (gpu != nullptr && !gpu->HasDevice()) why_not = "no CUDA device on this machine";
    if (!why_not.empty()) {
      KVQ_CHECK(o.backend != "gpu", kUnsupported, "--backend gpu: ", why_not);
      std::fprintf(stderr, "kvq bench: GPU columns omitted: %s\n", why_not.c_str());
      run_gpu = false;
    }
  }
  KVQ_CHECK(!o.batches.empty() && !o.lengths.empty(), kInvalidArgument,
            "--batch and --seq-len need at least one value each");
  for (int batch : o.batches) {
    KVQ_CHECK(batch >= 1, kInvalidArgument, "--batch ", batch, " must be positive");
  }
  for (int length : o.lengths) {
    KVQ_CHECK(length >= 1, kInvalidArgument, "--seq-len ", length, " must be positive");
  }
  // Every point holds one sequence's fp32 keys and values while its cache is filled.
  const int longest = *std::max_element(o.lengths.begin(), o.lengths.end());
  kvq::CheckFitsInMemory(
      kvq::detail::Concat("the fp32 keys and values of one sequence: --seq-len ", longest,
                          " x --kv-heads ", o.kv_heads, " x --head-dim ", o.head_dim,
                          " x 2 x 4 bytes"),
      8.0 * longest * o.kv_heads * o.head_dim);
  const std::vector<BenchScheme> schemes = BuildSchemes(o);
  size_t name_width = 6;
  for (const BenchScheme& s : schemes) name_width = std::max(name_width, s.name.size());
  const int w = static_cast<int>(name_width);
  std::printf("decode attention, d=%d Hq/Hkv=%d/%d G=%d S0=%d W=%d P=%d; CPU backend %s\n",
              o.head_dim, o.q_heads, o.kv_heads, o.group, o.sink, o.recent, o.page,
              kvq::cpu::BestBackend().name.c_str());
  const TimingColumns timing{run_cpu, run_gpu};
  std::printf("%-*s %5s %8s %10s%s\n", w, "scheme", "B", "T", "MB", timing.Header().c_str());
  for (int batch : o.batches) {
    for (int length : o.lengths) {
      for (const BenchScheme& scheme : schemes) {
        const kvq::calib::LayerScheme& layer = scheme.layer;
        std::mt19937_64 rng(o.seed + batch * 7919 + length);
        const kvq::cli::FilledCache filled = kvq::cli::FillCache(layer, batch, length, rng);
        const kvq::cpu::PagedKVCache& cache = *filled.cache;
        const std::vector<int>& seqs = filled.seqs;
        const std::vector<float>& q = filled.q;
        const size_t bytes = filled.bytes;
        double cpu_us = 0, gpu_us = 0;
        if (run_cpu) {
          std::vector<float> out(q.size());
          cpu_us = MedianHostMicros(
              [&] {
                kvq::cpu::AttendBatch(kvq::cpu::BestBackend(), cache, seqs, q.data(), out.data());
              },
              o.iters);
        }
        if (run_gpu) {
          try {
            gpu_us = kvq::cli::RequireGpu("kvq bench")
                         .AttendMicros(cache, seqs, q.data(), std::max(o.iters, 20), 3,
                                       /*cold_l2=*/true);
          } catch (const kvq::Error& e) {
            // No CUDA decode for this configuration yet (spec 1.1): no GPU column.
            if (e.code() != kvq::ErrorCode::kUnsupported) throw;
            gpu_us = 0;
          }
        }
        std::printf("%-*s %5d %8d %10.1f%s\n", w, scheme.name.c_str(), batch, length,
                    bytes / 1e6, timing.Cells(cpu_us, gpu_us, bytes / 1e6).c_str());
      }
    }
  }
  const int differing = RunWriteBench(o, schemes, run_cpu, run_gpu);
  KVQ_CHECK(differing == 0, kMismatch, "kvq bench: the CPU and GPU write paths gave different "
            "bits at ", differing, " point(s) (rows marked DIFFER)");
}

}  // namespace

void setup_bench(CLI::App& app) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "CPU oracle and CUDA path side by side: decode attention on the same caches, and the write "
      "path on the same rows (checked bit for bit)");
  cmd->add_option("--backend", options->backend, "cpu, gpu or all (default all)");
  cmd->add_option("--schemes", options->schemes,
                  "comma-separated schemes of the catalogue or 'all' (default "
                  "oscar,saw_int4,bf16): " + kvq::calib::SchemeNames());
  cmd->add_option("--batch", options->batches, "batch sizes B (default 1)")->delimiter(',');
  cmd->add_option("--seq-len", options->lengths, "sequence lengths T (default 4096,32768)")
      ->delimiter(',');
  cmd->add_option("--iters", options->iters, "timed runs per point (median; default 5)");
  cmd->add_option("--head-dim", options->head_dim, "d (default 128)");
  cmd->add_option("--q-heads", options->q_heads, "Hq (default 32)");
  cmd->add_option("--kv-heads", options->kv_heads, "Hkv (default 8)");
  cmd->add_option("--group", options->group, "G (default 64)");
  cmd->add_option("--bits", options->bits, "2 or 4 (default 2; a scheme's own bits win)");
  cmd->add_option("--sink", options->sink, "S0 (default 64)")->check(kvq::cli::WindowTokens());
  cmd->add_option("--recent", options->recent, "W (default 256)")
      ->check(kvq::cli::WindowTokens());
  cmd->add_option("--page", options->page, "P (default 64)");
  cmd->add_option("--seed", options->seed,
                  "seed of the data, the synthetic calibration and random_orthogonal (default 1)")
      ->check(kvq::cli::Seed());
  cmd->callback([options] { RunBench(*options); });
}
