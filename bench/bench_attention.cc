// CPU decode attention over the paged cache: one query token, Hq/Hkv = 32/8, d = 128, G = 64,
// S0 = 64, W = 256, P = 64, at T in {4K, 32K}; the INT2 cache (OSCAR: dense per-head
// rotations) and the bf16 cache, for the scalar reference and every Highway backend.
// Names: attend_int2__hwy_avx3/T:32768, attend_bf16__scalar/T:4096, ...
// Counters: cache_bytes/s = bytes the cache holds for the sequence (K and V: sink, history
// codes and metadata, recent) per second; FLOP/s = 4·T·Hq·d (QK and PV) plus, for INT2, the
// query and output rotations 4·Hq·d² per step. Single thread; rates use CPU time (the
// build machine is shared, so wall time is inflated by other processes).
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/calib/rotation.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

constexpr int kQHeads = 32, kKVHeads = 8, kHeadDim = 128;

std::vector<float> RandomOrthogonal(int d, std::mt19937_64& rng) {
  return kvq::calib::ToRowMajorF32(kvq::calib::RandomOrthogonal(d, rng()));
}

struct Fixture {
  std::unique_ptr<kvq::cpu::PagedKVCache> cache;
  int seq = 0;
  std::vector<float> q;
};

// One cache per (quantized, T), built on first use with the best backend's write path.
const Fixture& GetFixture(bool quantized, int tokens) {
  static std::map<std::pair<bool, int>, Fixture> fixtures;
  Fixture& f = fixtures[{quantized, tokens}];
  if (f.cache) return f;
  std::mt19937_64 rng(static_cast<uint64_t>(tokens) * 2 + quantized);
  kvq::CacheParams p;  // defaults: Hkv 8, Hq 32, S0 64, W 256, P 64, d 128, G 64, INT2
  if (!quantized) p.key.format = p.value.format = kvq::Format::kBf16;
  std::vector<float> rk, rv;
  if (quantized) {
    p.key.rotation = p.value.rotation = kvq::RotationKind::kDense;
    p.key.clip = 0.96f;
    p.value.clip = 0.92f;
    for (int h = 0; h < kKVHeads; ++h) {
      const std::vector<float> a = RandomOrthogonal(kHeadDim, rng);
      const std::vector<float> b = RandomOrthogonal(kHeadDim, rng);
      rk.insert(rk.end(), a.begin(), a.end());
      rv.insert(rv.end(), b.begin(), b.end());
    }
  }
  f.cache = std::make_unique<kvq::cpu::PagedKVCache>(p, rk, rv);
  f.seq = f.cache->AddSequence();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t row = static_cast<size_t>(kKVHeads) * kHeadDim;
  std::vector<float> k(static_cast<size_t>(tokens) * row), v(k.size());
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  f.cache->Prefill(f.seq, k.data(), v.data(), static_cast<size_t>(tokens));
  f.q.resize(static_cast<size_t>(kQHeads) * kHeadDim);
  for (float& x : f.q) x = normal(rng);
  return f;
}

void BM_Attend(benchmark::State& state, const kvq::cpu::Backend* backend, bool quantized) {
  const int tokens = static_cast<int>(state.range(0));
  const Fixture& f = GetFixture(quantized, tokens);
  std::vector<float> out(f.q.size());
  for (auto _ : state) {
    kvq::cpu::Attend(*backend, *f.cache, f.seq, f.q.data(), out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const kvq::cpu::CacheBytes bytes = f.cache->Bytes(f.seq);
  double flops = 4.0 * tokens * kQHeads * kHeadDim;
  if (quantized) flops += 4.0 * kQHeads * kHeadDim * kHeadDim;
  state.counters["cache_bytes/s"] = benchmark::Counter(
      static_cast<double>(bytes.total()), benchmark::Counter::kIsIterationInvariantRate,
      benchmark::Counter::OneK::kIs1000);
  state.counters["FLOP/s"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::OneK::kIs1000);
  state.counters["bits/elem"] = bytes.bits_per_element();
}

}  // namespace

int main(int argc, char** argv) {
  for (const kvq::cpu::Backend& backend : kvq::cpu::Backends()) {
    for (bool quantized : {true, false}) {
      const std::string name =
          std::string(quantized ? "attend_int2__" : "attend_bf16__") + backend.name;
      benchmark::RegisterBenchmark(name.c_str(), BM_Attend, &backend, quantized)
          ->ArgName("T")
          ->Arg(4096)
          ->Arg(32768)
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
