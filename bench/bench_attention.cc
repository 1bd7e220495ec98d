// Decode attention over the paged cache, one benchmark per (catalogue scheme, backend):
// one query token, Hq/Hkv = 32/8, d = 128, G = 64, S0 = 64, W = 256, P = 64, at T in {4K, 32K}.
// The cache configurations come from the scheme catalogue (calib/schemes.inc, built by
// calib::BuildLayerScheme; calibrated schemes on a synthetic calibration of this shape), the
// backends from kvq::AllBackends() (every one with a whole decode step).
// Names: attend__<scheme>__<backend>/T:<T>, e.g. attend__oscar__hwy_avx3/T:32768.
// Flags besides Google Benchmark's: --schemes=LIST (comma-separated ids or `all`; default
// oscar,saw_int4,bf16). Select a backend or scheme with --benchmark_filter=__scalar or =__oscar__.
// Counters: cache_bytes/s = bytes the cache holds for the sequence (K and V: sink, history
// codes and metadata, recent) per second; FLOP/s = 4·T·Hq·d (QK and PV) plus, for a dense
// rotation, the query and output rotations 4·Hq·d² per step. Single thread; rates use CPU time
// (the build machine is shared, so wall time is inflated by other processes).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvq/backends.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

constexpr int kQHeads = 32, kKVHeads = 8, kHeadDim = 128;
constexpr char kDefaultSchemes[] = "oscar,saw_int4,bf16";

kvq::calib::SchemeShape Shape() {
  kvq::calib::SchemeShape shape;
  shape.num_kv_heads = kKVHeads;
  shape.num_q_heads = kQHeads;
  shape.head_dim = kHeadDim;
  return shape;
}

// The calibration a calibrated scheme reads (oscar's, or an fp8 scheme's or blockgtq's own):
// synthetic, made once per kind.
const kvq::calib::Calibration& BenchCalibration(const std::string& scheme) {
  static kvq::calib::SyntheticCalibrations calibrations(Shape(), kvq::calib::SchemeOptions(),
                                                        512, 1);
  return calibrations.For(scheme);
}

struct Fixture {
  std::unique_ptr<kvq::cpu::PagedKVCache> cache;
  int seq = 0;
  std::vector<float> q;
};

// One cache per (scheme, T), built on first use with the best backend's write path.
const Fixture& GetFixture(const std::string& scheme, int tokens) {
  static std::map<std::pair<std::string, int>, Fixture> fixtures;
  Fixture& f = fixtures[{scheme, tokens}];
  if (f.cache) return f;
  const kvq::calib::SchemeInfo& info = kvq::calib::SchemeByName(scheme);
  const kvq::calib::LayerScheme s = kvq::calib::BuildLayerScheme(
      scheme, Shape(), info.needs_calibration ? &BenchCalibration(scheme) : nullptr, 0,
      kvq::calib::SchemeOptions());
  f.cache = std::make_unique<kvq::cpu::PagedKVCache>(s.params, s.key, s.value,
                                                     kvq::cpu::BestBackend());
  f.seq = f.cache->AddSequence();
  std::mt19937_64 rng(static_cast<uint64_t>(tokens) * 2 + 1);
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

void BM_Attend(benchmark::State& state, const kvq::cpu::Backend* backend, std::string scheme) {
  const int tokens = static_cast<int>(state.range(0));
  const Fixture& f = GetFixture(scheme, tokens);
  std::vector<float> out(f.q.size());
  for (auto _ : state) {
    backend->attend(*f.cache, {f.seq}, f.q.data(), out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const kvq::cpu::CacheBytes bytes = f.cache->Bytes(f.seq);
  double flops = 4.0 * tokens * kQHeads * kHeadDim;
  if (f.cache->params().quantized() &&
      f.cache->params().key.rotation == kvq::RotationKind::kDense) {
    flops += 4.0 * kQHeads * kHeadDim * kHeadDim;
  }
  state.counters["cache_bytes/s"] = benchmark::Counter(
      static_cast<double>(bytes.total()), benchmark::Counter::kIsIterationInvariantRate,
      benchmark::Counter::OneK::kIs1000);
  state.counters["FLOP/s"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::OneK::kIs1000);
  state.counters["bits/elem"] = bytes.bits_per_element();
}

// Takes --schemes=LIST out of argv (Google Benchmark rejects flags it does not know).
std::string TakeSchemesFlag(int* argc, char** argv) {
  std::string schemes = kDefaultSchemes;
  const char prefix[] = "--schemes=";
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], prefix, sizeof prefix - 1) == 0) {
      schemes = argv[i] + sizeof prefix - 1;
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return schemes;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> schemes;
  try {
    schemes = kvq::calib::ParseSchemeList(TakeSchemesFlag(&argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: error: --schemes: %s\n", e.what());
    return 1;
  }
  for (const std::string& scheme : schemes) {
    for (const kvq::cpu::Backend* backend : kvq::AllBackends()) {
      if (!backend->attend) continue;
      const std::string name = "attend__" + scheme + "__" + backend->name;
      benchmark::RegisterBenchmark(name.c_str(), BM_Attend, backend, scheme)
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
