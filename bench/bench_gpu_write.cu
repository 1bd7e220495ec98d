// Benchmark of the CUDA write path (gpu/): K+V prefill write of T = 32K tokens (Hkv = 8,
// d = 128, G = 64, INT2) with a dense rotation per head and with the FWHT, and of fp8_e4m3
// (identity and FWHT, s^ = 1), in GB/s of bf16 input; per-step append latency for B in {1, 32, 128} sequences; and the device-to-device
// copy bandwidth of the same run (bytes read + written) as the ceiling.
//
// Timing: CUDA events around each call, median of many runs after warm-up. Cold L2: prefill
// rotates among input sets whose total exceeds L2 several times; before every timed append
// step a buffer twice the L2 is read (bench/l2_flush.cuh; outside the timed region). GPU time:
// before each timed call the GPU is kept busy (a 100 us spin before every prefill, the L2
// pass before every append) while the host queues the call's launches, so the host's
// enqueue time stays off the clock, as nvbench's blocking kernel does; one extra prefill row
// is timed without the spin to show what the enqueue costs an idle GPU.
//
// Usage: kvq_bench_gpu_write [--quick]  (prints a markdown table; --quick: fewer runs)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "kvq/common/format.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/write.h"
#include "l2_flush.cuh"

namespace {

using kvq::CacheParams;
using kvq::RotationKind;

// Keeps one warp of the GPU busy for `ns` nanoseconds (%globaltimer).
__global__ void HoldGpu(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

template <typename T>
T* DeviceAlloc(size_t count) {
  T* p = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T)));
  return p;
}

template <typename T>
void Upload(T* dst, const std::vector<T>& src) {
  KVQ_CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times `body` (queued on stream 0) with events: `warmup` untimed runs, then `runs` timed ones;
// `before` runs outside the timed region before each. Returns the median in milliseconds.
template <typename Body, typename Before>
double TimeMedianMs(int warmup, int runs, Body body, Before before) {
  cudaEvent_t start, stop;
  KVQ_CUDA_CHECK(cudaEventCreate(&start));
  KVQ_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < warmup + runs; ++i) {
    before(i);
    KVQ_CUDA_CHECK(cudaEventRecord(start));
    body(i);
    KVQ_CUDA_CHECK(cudaEventRecord(stop));
    KVQ_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0.0f;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    if (i >= warmup) ms.push_back(elapsed);
  }
  KVQ_CUDA_CHECK(cudaEventDestroy(start));
  KVQ_CUDA_CHECK(cudaEventDestroy(stop));
  return Median(ms);
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) v = kvq::Bf16FromF32(normal(rng));
  return out;
}

std::vector<float> RandomRotations(int heads, int d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
  std::vector<float> r(static_cast<size_t>(heads) * d * d);
  for (float& v : r) v = normal(rng);
  return r;
}

struct Row {
  std::string what;
  std::string config;
  double ms = 0;
  std::string metric;
};

void Print(const std::vector<Row>& rows) {
  std::printf("| benchmark | configuration | median time | result |\n");
  std::printf("| --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %s | %.4f ms | %s |\n", r.what.c_str(), r.config.c_str(), r.ms,
                r.metric.c_str());
  }
  std::fflush(stdout);
}

std::string Format(const char* fmt, double v) {
  char buf[128];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// Hkv 8, Hq 32, S0 64, W 256, P 64; K and V: d 128, G 64, INT2 with the given rotation and clip.
CacheParams BenchCache(RotationKind kind, float clip, bool bitrev = false) {
  namespace params = kvq::params;
  return params::Cache().kv_heads(8).q_heads(32).sink(64).recent(256).page(64).both(
      params::Write().head_dim(128).group(64).bits(2).rotation(kind).clip(clip).bitrev(bitrev));
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  try {
    kvq::gpu::RequireCudaDevice();
    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    const std::time_t now = std::time(nullptr);
    char date[64];
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
    std::printf("# kvq GPU write benchmark\n\ndevice: %s, %d SMs, L2 %d MB, driver %d, "
                "runtime %d; %s%s\n\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, driver, runtime,
                date, quick ? " (quick)" : "");
    const int runs = quick ? 10 : 50;
    std::vector<Row> rows;
    std::mt19937 rng(2024);

    // ---- Ceiling: device-to-device copy, 1 GiB, read + write counted. ----
    {
      const size_t bytes = size_t{1} << 30;
      uint8_t* a = DeviceAlloc<uint8_t>(bytes);
      uint8_t* b = DeviceAlloc<uint8_t>(bytes);
      KVQ_CUDA_CHECK(cudaMemset(a, 1, bytes));
      const double ms = TimeMedianMs(
          3, runs, [&](int) { KVQ_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); },
          [](int) {});
      rows.push_back({"cudaMemcpy D2D", "1 GiB", ms,
                      Format("%.0f GB/s (read + write)", 2.0 * bytes / (ms * 1e-3) / 1e9)});
      KVQ_CUDA_CHECK(cudaFree(a));
      KVQ_CUDA_CHECK(cudaFree(b));
    }

    // ---- Prefill: T = 32K tokens of K and V. ----
    const int tokens = 32768;
    const int hkv = 8, d = 128;
    const size_t row_elems = static_cast<size_t>(hkv) * d;
    const size_t input_elems = static_cast<size_t>(tokens) * row_elems;  // per K or V
    const double input_bytes = 2.0 * input_elems * sizeof(uint16_t);     // K + V bf16
    // Input sets rotated so that each run reads cold memory: 3 x 128 MiB > 2 x L2.
    constexpr int kSets = 3;
    std::vector<uint16_t*> keys(kSets), values(kSets);
    for (int s = 0; s < kSets; ++s) {
      keys[s] = DeviceAlloc<uint16_t>(input_elems);
      values[s] = DeviceAlloc<uint16_t>(input_elems);
      Upload(keys[s], RandomBf16(input_elems, rng));
      Upload(values[s], RandomBf16(input_elems, rng));
    }
    const std::vector<float> rot_k = RandomRotations(hkv, d, rng);
    const std::vector<float> rot_v = RandomRotations(hkv, d, rng);
    float* d_rot_k = DeviceAlloc<float>(rot_k.size());
    float* d_rot_v = DeviceAlloc<float>(rot_v.size());
    Upload(d_rot_k, rot_k);
    Upload(d_rot_v, rot_v);

    const CacheParams base = BenchCache(RotationKind::kDense, 1.0f);
    const int history = tokens - base.recent - base.sink;
    const int pages = (history + base.page_size - 1) / base.page_size;
    std::vector<int32_t> table(pages);
    for (int i = 0; i < pages; ++i) table[i] = (i * 7919) % pages;  // scattered page ids
    // (7919 is prime and pages = 507 is not a multiple of it: a permutation.)
    int32_t* d_table = DeviceAlloc<int32_t>(pages);
    Upload(d_table, table);
    const size_t pool_rows = static_cast<size_t>(pages) * hkv * base.page_size;
    kvq::gpu::PagePool pool[2];
    const kvq::FormatLayout layout = kvq::LayoutOf(base.key);
    for (auto& p : pool) {
      for (int i = 0; i < layout.num_planes; ++i) {
        p.planes[i] = DeviceAlloc<uint8_t>(pool_rows * layout.plane(i).row_bytes());
      }
      p.num_pages = pages;
    }
    kvq::gpu::Windows windows;
    windows.sink_key = DeviceAlloc<uint16_t>(base.sink * row_elems);
    windows.sink_value = DeviceAlloc<uint16_t>(base.sink * row_elems);
    windows.recent_key = DeviceAlloc<uint16_t>(base.recent * row_elems);
    windows.recent_value = DeviceAlloc<uint16_t>(base.recent * row_elems);
    int* flags = DeviceAlloc<int>(1);
    KVQ_CUDA_CHECK(cudaMemset(flags, 0, sizeof(int)));

    struct Variant {
      const char* name;
      RotationKind kind;
      float clip;
      bool bitrev = false;
    };
    const Variant variants[] = {{"dense R per head, rho=1", RotationKind::kDense, 1.0f},
                                {"dense R per head, rho=0.96", RotationKind::kDense, 0.96f},
                                {"FWHT, rho=1", RotationKind::kHadamard, 1.0f},
                                {"FWHT, rho=0.96", RotationKind::kHadamard, 0.96f},
                                {"FWHT, rho=0.92", RotationKind::kHadamard, 0.92f},
                                {"FWHT, rho=0.80", RotationKind::kHadamard, 0.80f},
                                {"identity, rho=1", RotationKind::kIdentity, 1.0f},
                                {"FWHT + P_br, rho=1", RotationKind::kHadamard, 1.0f, true},
                                {"FWHT + P_br, rho=0.96", RotationKind::kHadamard, 0.96f, true}};
    // Each variant; the FWHT variant is timed once more at the end to show the run-to-run spread.
    auto time_prefill = [&](const Variant& v, bool hold = true) {
      const CacheParams c = BenchCache(v.kind, v.clip, v.bitrev);
      kvq::gpu::HeadData hk, hv;
      if (v.kind == RotationKind::kDense) {
        hk.rotation = d_rot_k;
        hv.rotation = d_rot_v;
      }
      const double ms = TimeMedianMs(
          3, runs,
          [&](int i) {
            kvq::gpu::PrefillWrite(c, keys[i % kSets], values[i % kSets], tokens, d_table, hk, hv,
                                   pool[0], pool[1], windows, flags);
          },
          [&](int) {
            if (!hold) return;
            HoldGpu<<<1, 32>>>(100000);
            KVQ_CUDA_CHECK(cudaGetLastError());
          });
      return ms;
    };
    for (const Variant& v : variants) {
      const double ms = time_prefill(v);
      rows.push_back({"prefill K+V write", std::string(v.name) + ", T=32768 Hkv=8 d=128 G=64 INT2",
                      ms, Format("%.0f GB/s of bf16 input", input_bytes / (ms * 1e-3) / 1e9)});
    }
    {
      const double ms = time_prefill(variants[2]);
      rows.push_back({"prefill K+V write (repeat)", std::string(variants[2].name), ms,
                      Format("%.0f GB/s of bf16 input", input_bytes / (ms * 1e-3) / 1e9)});
      const double idle = time_prefill(variants[2], /*hold=*/false);
      rows.push_back({"prefill K+V write (no spin: host enqueue on the clock)",
                      std::string(variants[2].name), idle,
                      Format("%.0f GB/s of bf16 input", input_bytes / (idle * 1e-3) / 1e9)});
    }
    // ---- fp8_e4m3 (spec 1.2): the same prefill into fp8 pools (one e4m3 byte a value, no
    // metadata), s^ = 1 (fp8_unscaled) and with the FWHT (fp8_hadamard). ----
    {
      const auto fp8_cache = [](RotationKind kind) -> CacheParams {
        namespace params = kvq::params;
        return params::Cache().kv_heads(8).q_heads(32).sink(64).recent(256).page(64).both(
            params::Write().head_dim(128).group(128).fp8().rotation(kind));
      };
      const kvq::FormatLayout fp8_layout = kvq::LayoutOf(fp8_cache(RotationKind::kIdentity).key);
      kvq::gpu::PagePool fp8_pool[2];
      for (auto& p : fp8_pool) {
        for (int i = 0; i < fp8_layout.num_planes; ++i) {
          p.planes[i] = DeviceAlloc<uint8_t>(pool_rows * fp8_layout.plane(i).row_bytes());
        }
        p.num_pages = pages;
      }
      for (RotationKind kind : {RotationKind::kIdentity, RotationKind::kHadamard}) {
        const CacheParams c = fp8_cache(kind);
        const double ms = TimeMedianMs(
            3, runs,
            [&](int i) {
              kvq::gpu::PrefillWrite(c, keys[i % kSets], values[i % kSets], tokens, d_table,
                                     kvq::gpu::HeadData{}, kvq::gpu::HeadData{}, fp8_pool[0],
                                     fp8_pool[1], windows, flags);
            },
            [&](int) {
              HoldGpu<<<1, 32>>>(100000);
              KVQ_CUDA_CHECK(cudaGetLastError());
            });
        rows.push_back({"prefill K+V write",
                        std::string(kind == RotationKind::kIdentity ? "fp8_e4m3 identity"
                                                                    : "fp8_e4m3 FWHT") +
                            ", s^=1, T=32768 Hkv=8 d=128",
                        ms, Format("%.0f GB/s of bf16 input", input_bytes / (ms * 1e-3) / 1e9)});
      }
      for (auto& p : fp8_pool) {
        for (int i = 0; i < fp8_layout.num_planes; ++i) KVQ_CUDA_CHECK(cudaFree(p.planes[i]));
      }
    }
    kvq::gpu::CheckErrorFlags(flags, "prefill benchmark");

    // ---- Append: one decode step for B sequences, each demoting one token. ----
    kvq::bench::L2Flusher flusher;  // a read pass: clean lines (bench/l2_flush.cuh)
    for (int batch : {1, 32, 128}) {
      for (RotationKind kind : {RotationKind::kDense, RotationKind::kHadamard}) {
        const CacheParams c = BenchCache(kind, 0.96f);
        const int length = 4096;  // every sequence demotes position length - W
        const int max_pages = (length - c.recent - c.sink) / c.page_size + 2;
        std::vector<int32_t> tables(static_cast<size_t>(batch) * max_pages);
        for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i % pages);
        int32_t* d_tables = DeviceAlloc<int32_t>(tables.size());
        Upload(d_tables, tables);
        std::vector<int32_t> lengths(batch, length);
        int32_t* d_lengths = DeviceAlloc<int32_t>(batch);
        Upload(d_lengths, lengths);
        kvq::gpu::Windows bw;
        bw.sink_key = DeviceAlloc<uint16_t>(batch * c.sink * row_elems);
        bw.sink_value = DeviceAlloc<uint16_t>(batch * c.sink * row_elems);
        bw.recent_key = DeviceAlloc<uint16_t>(batch * c.recent * row_elems);
        bw.recent_value = DeviceAlloc<uint16_t>(batch * c.recent * row_elems);
        Upload(bw.recent_key, RandomBf16(batch * c.recent * row_elems, rng));
        Upload(bw.recent_value, RandomBf16(batch * c.recent * row_elems, rng));
        uint16_t* new_k = DeviceAlloc<uint16_t>(batch * row_elems);
        uint16_t* new_v = DeviceAlloc<uint16_t>(batch * row_elems);
        Upload(new_k, RandomBf16(batch * row_elems, rng));
        Upload(new_v, RandomBf16(batch * row_elems, rng));
        kvq::gpu::HeadData hk, hv;
        if (kind == RotationKind::kDense) {
          hk.rotation = d_rot_k;
          hv.rotation = d_rot_v;
        }
        const double ms = TimeMedianMs(
            5, quick ? 50 : 200,
            [&](int) {
              kvq::gpu::AppendStep(c, new_k, new_v, batch, d_lengths, d_tables, max_pages, hk,
                                   hv, pool[0], pool[1], bw, flags);
            },
            [&](int) { flusher.Flush(nullptr); });
        rows.push_back({"append step (3 launches)",
                        std::string(kind == RotationKind::kDense ? "dense" : "FWHT") +
                            ", B=" + std::to_string(batch) + ", Hkv=8 d=128 G=64 INT2, rho=0.96",
                        ms, Format("%.1f us per step", ms * 1e3)});
        for (void* p : {static_cast<void*>(d_tables), static_cast<void*>(d_lengths),
                        static_cast<void*>(bw.sink_key), static_cast<void*>(bw.sink_value),
                        static_cast<void*>(bw.recent_key), static_cast<void*>(bw.recent_value),
                        static_cast<void*>(new_k), static_cast<void*>(new_v)}) {
          KVQ_CUDA_CHECK(cudaFree(p));
        }
      }
    }
    kvq::gpu::CheckErrorFlags(flags, "append benchmark");
    Print(rows);
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq_bench_gpu_write: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
