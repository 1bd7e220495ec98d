// Google Benchmark of every write-path stage of kvq/common/stages.inc on every CPU backend, and
// of the whole write path per format. Names read "<stage>__<backend>/d:<head_dim>/rows:<n>", so
// --benchmark_filter=__hwy_avx3 selects a target. Inputs come from the stage's spec
// (testbed::MakeStageBuffers: the same valid inputs the stage tests use). Bytes/s counts every
// argument the stage reads or writes except the rotation matrix (it stays in cache); rows/s is
// the throughput in rows. The CUDA kernels have their own program (bench_gpu_write.cu): the
// CUDA backend's host wrappers would time transfers.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/params_builder.h"
#include "kvq/common/stages.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/backends.h"
#include "kvq/testbed/stage_tester.h"

namespace kvq {
namespace {

constexpr int64_t kRows = 4096;

// The parameters each stage is timed with: INT2, G = 64 (or d), clip 0.92, full FWHT; the
// codebook format as TurboQuant-MSE at 2 bits (one group a row, no clip).
WriteParams BenchParams(int d, Format format = Format::kAffineToken) {
  if (format == Format::kCodebook) return params::Write().head_dim(d).codebook_rows(2).hadamard();
  return params::Write().head_dim(d).format(format).group(64 <= d ? 64 : d).bits(2).clip(0.92f)
      .hadamard();
}

void Report(benchmark::State& state, size_t rows, size_t bytes_per_call) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(bytes_per_call));
  state.counters["rows/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(rows),
      benchmark::Counter::kIsRate);
}

void Stage(benchmark::State& state, const StageSpec& stage, const cpu::Backend& backend) {
  const WriteParams p = BenchParams(static_cast<int>(state.range(0)), stage.transform
                                                                          ? Format::kAffineToken
                                                                          : stage.format);
  const size_t n = static_cast<size_t>(state.range(1));
  testbed::StageBuffers buffers = testbed::MakeStageBuffers(stage, n, p, /*seed=*/12345);
  // In-place arguments are restored before each call (a memcpy, the same for every backend),
  // so every call sees the same input.
  std::vector<Tensor> originals = buffers.args;
  std::vector<void*> args = buffers.Pointers();
  size_t bytes = 0;
  for (int i = 0; i < stage.num_args; ++i) {
    if (stage.args[i].extent != Extent::kMatrix) bytes += buffers.args[i].bytes.size();
  }
  for (auto _ : state) {
    for (int i = 0; i < stage.num_args; ++i) {
      if (stage.args[i].dir != ArgDir::kInOut) continue;
      std::memcpy(args[i], originals[i].bytes.data(), originals[i].bytes.size());
    }
    cpu::RunStage(backend.write, stage.id, args.data(), n, p);
    benchmark::DoNotOptimize(args.data());
    benchmark::ClobberMemory();
  }
  Report(state, n, bytes);
}

// The validating write path of one format (EncodeRows: the transforms, then the codec), from
// fp32 rows to the stored planes.
void WritePath(benchmark::State& state, Format format, const cpu::Backend& backend) {
  const WriteParams p = BenchParams(static_cast<int>(state.range(0)), format);
  const size_t n = static_cast<size_t>(state.range(1));
  conformance::SplitMix64 rng(12345);
  const std::vector<float> x = conformance::MakeRows(
      std::vector<conformance::RowKind>(n, conformance::RowKind::kHeavyTail), p, &rng, nullptr);
  size_t bytes = 0;
  for (auto _ : state) {
    const cpu::EncodedRows out = cpu::EncodeRows(backend, p, nullptr, x.data(), n);
    benchmark::DoNotOptimize(out.plane[0].data());
    bytes = x.size() * sizeof(float);
    for (const std::vector<uint8_t>& plane : out.plane) bytes += plane.size();
  }
  Report(state, n, bytes);
}

void RegisterAll() {
  const auto add = [](const std::string& name, auto run) {
    auto* bench = benchmark::RegisterBenchmark(name.c_str(), run);
    bench->ArgNames({"d", "rows"})->MinTime(0.2)->Unit(benchmark::kMicrosecond);
    for (int d : {64, 128, 256}) bench->Args({d, kRows});
  };
  for (const cpu::Backend* backend : testbed::TestBackends({.scalar = true, .cuda = false})) {
    for (const StageSpec& stage : AllStages()) {
      add(std::string(stage.name) + "__" + backend->name,
          [&stage, backend](benchmark::State& state) { Stage(state, stage, *backend); });
    }
    for (Format format : AllFormats()) {
      add(std::string("write_path_") + FormatName(format) + "__" + backend->name,
          [format, backend](benchmark::State& state) { WritePath(state, format, *backend); });
    }
  }
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
