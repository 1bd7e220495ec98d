// Google Benchmark of every write-path stage on every backend of Backends(). Names read
// "<stage>__<backend>/d:<head_dim>/rows:<n>", so --benchmark_filter=__hwy_avx3 selects a target.
// Bytes/s counts the row data each stage reads and writes (the rotation matrix, which stays in
// cache, is not counted); rows/s is the throughput in rows.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {
namespace {

constexpr int64_t kRows = 4096;

struct Inputs {
  WriteParams p;
  size_t n = 0;
  std::vector<float> x;         // [n, d] normal rows with a few outliers
  std::vector<float> rotation;  // [d, d]
  std::vector<uint8_t> codes;   // [n, d]
  std::vector<uint8_t> packed;  // [n, d*b/8]
  std::vector<uint16_t> scale, min;
};

Inputs MakeInputs(int d, size_t n) {
  Inputs in;
  in.p.head_dim = d;
  in.p.group = 64 <= d ? 64 : d;
  in.p.bits = 2;
  in.p.clip = 0.92f;
  in.p.rotation = RotationKind::kHadamard;
  in.n = n;
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  in.x.resize(n * d);
  for (float& v : in.x) v = normal(rng) * (rng() % 64 == 0 ? 20.0f : 1.0f);
  in.rotation.resize(static_cast<size_t>(d) * d);
  for (float& v : in.rotation) v = normal(rng) / 16.0f;
  in.codes.resize(n * d);
  in.packed.resize(n * static_cast<size_t>(in.p.code_bytes()));
  in.scale.resize(n * static_cast<size_t>(in.p.num_groups()));
  in.min.resize(in.scale.size());
  ScalarBackend().write.quantize(in.x.data(), in.codes.data(), in.scale.data(), in.min.data(), n,
                                 in.p);
  ScalarBackend().write.pack(in.codes.data(), in.packed.data(), n, in.p);
  return in;
}

void Report(benchmark::State& state, size_t n, size_t bytes_per_row) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * bytes_per_row));
  state.counters["rows/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(n),
      benchmark::Counter::kIsRate);
}

using Stage = void (*)(benchmark::State&, const Backend&);

void RotateDense(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> y(in.x.size());
  for (auto _ : state) {
    b.write.rotate_dense(in.x.data(), in.rotation.data(), y.data(), in.n, in.p);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 8u);
}

// In place; the FWHT is orthogonal, so repeating it keeps the data in range.
void Fwht(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    b.write.fwht(in.x.data(), in.n, in.p);
    benchmark::DoNotOptimize(in.x.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 8u);
}

void Bitrev(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> y(in.x.size());
  for (auto _ : state) {
    b.write.bitrev(in.x.data(), y.data(), in.n, in.p);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 8u);
}

// Clip works in place, so each iteration first restores the input (a memcpy, counted in the
// time of every backend alike).
void Clip(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> work(in.x.size()), tau(in.n);
  for (auto _ : state) {
    std::memcpy(work.data(), in.x.data(), in.x.size() * sizeof(float));
    b.write.clip(work.data(), tau.data(), in.n, in.p);
    benchmark::DoNotOptimize(work.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 8u);
}

void Quantize(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    b.write.quantize(in.x.data(), in.codes.data(), in.scale.data(), in.min.data(), in.n, in.p);
    benchmark::DoNotOptimize(in.codes.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 5u + in.p.num_groups() * 4u);
}

void QuantizePack(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    b.write.quantize(in.x.data(), in.codes.data(), in.scale.data(), in.min.data(), in.n, in.p);
    b.write.pack(in.codes.data(), in.packed.data(), in.n, in.p);
    benchmark::DoNotOptimize(in.packed.data());
    benchmark::ClobberMemory();
  }
  // Reads fp32 rows, writes the stored form (packed codes + bf16 scale/min).
  Report(state, in.n, in.p.head_dim * 4u + in.p.code_bytes() + in.p.num_groups() * 4u);
}

void Pack(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    b.write.pack(in.codes.data(), in.packed.data(), in.n, in.p);
    benchmark::DoNotOptimize(in.packed.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim + in.p.code_bytes());
}

void Unpack(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    b.write.unpack(in.packed.data(), in.codes.data(), in.n, in.p);
    benchmark::DoNotOptimize(in.codes.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim + in.p.code_bytes());
}

void Dequantize(benchmark::State& state, const Backend& b) {
  Inputs in = MakeInputs(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> y(in.x.size());
  for (auto _ : state) {
    b.write.dequantize(in.codes.data(), in.scale.data(), in.min.data(), y.data(), in.n, in.p);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  Report(state, in.n, in.p.head_dim * 5u + in.p.num_groups() * 4u);
}

void RegisterAll() {
  const struct {
    const char* name;
    Stage stage;
  } stages[] = {{"rotate_dense", RotateDense}, {"fwht", Fwht},         {"bitrev", Bitrev},
                {"clip", Clip},                {"quantize", Quantize}, {"pack", Pack},
                {"unpack", Unpack},            {"dequantize", Dequantize},
                {"quantize_pack", QuantizePack}};
  for (const auto& s : stages) {
    for (const Backend& backend : Backends()) {
      const std::string name = std::string(s.name) + "__" + backend.name;
      const Stage stage = s.stage;
      const Backend* b = &backend;
      auto* bench = benchmark::RegisterBenchmark(
          name.c_str(), [stage, b](benchmark::State& state) { stage(state, *b); });
      bench->ArgNames({"d", "rows"})->MinTime(0.2)->Unit(benchmark::kMicrosecond);
      for (int d : {64, 128, 256}) bench->Args({d, kRows});
    }
  }
}

}  // namespace
}  // namespace kvq::cpu

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq::cpu::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
