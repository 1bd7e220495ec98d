// The decode benchmarks' shared rows (bench_gpu_attention.cu, bench_gpu_step.cu): the shapes of
// seqs/000 §5.4, random device contents, event timing with a cold L2, the read-floor kernel,
// the step's buffers besides the cache, and the scheme rows with their device caches.
//
// Internal to each benchmark program that includes it (its kernels sit in an anonymous
// namespace, as bench/l2_flush.cuh's do); every CUDA call is checked (KVQ_CUDA_CHECK).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvq/calib/schemes.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"
#include "l2_flush.cuh"

namespace kvq::bench {

inline constexpr int kHeadDim = 128;
inline constexpr int kHq = 32;
inline constexpr int kHkv = 8;
inline constexpr int kGroup = 64;
inline constexpr int kSink = 64;
inline constexpr int kRecent = 256;
inline constexpr int kPage = 64;

// The floor of a step: one kernel that reads the same cache bytes as the INT2 step (its pools,
// whole and in address order, 16-byte loads, 4 in flight a thread) and does nothing else,
// timed like the step (cold L2, events around the launch). Its time is the launch, the ramp and
// the bytes at the rate one streaming kernel gets: a decode step that reads these bytes once
// cannot expect less. The empty kernel's time is the launch and the events alone. (Not the
// L2 flush's ReadEvery: these loads are streaming (__ldcs), as the step's copies are, which a
// flush must not be.)
struct ReadRanges {
  static constexpr int kMax = 20;
  const uint4* p[kMax];
  size_t n[kMax];  // uint4s
  int count = 0;
  void Add(const void* ptr, size_t bytes) {
    if (ptr == nullptr || bytes == 0) return;
    if (count == kMax) {
      std::fprintf(stderr, "ReadRanges: more than %d ranges\n", kMax);
      std::exit(1);
    }
    p[count] = static_cast<const uint4*>(ptr);
    n[count++] = bytes / 16;
  }
};

namespace {

__global__ void FillRandomBytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = static_cast<uint8_t>(x);
  }
}

__global__ void AndBytes(uint8_t* p, size_t n, uint8_t mask) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    p[i] &= mask;
  }
}

// bf16 values lo + (hi - lo) * u, u uniform from a hash: realistic, finite, never all zero.
__global__ void FillBf16(uint16_t* p, size_t n, float lo, float hi, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    x ^= x >> 16;
    x *= 2246822519u;
    x ^= x >> 13;
    const float u = (x >> 8) * (1.0f / 16777216.0f);
    const float v = lo + (hi - lo) * u;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

__global__ void FillFloatBf16Valued(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 16;
    x *= 2246822519u;
    x ^= x >> 13;
    const float v = ((x >> 8) * (1.0f / 16777216.0f) - 0.5f) * 2.0f;
    p[i] = __uint_as_float(__float_as_uint(v) & 0xffff0000u);
  }
}

// The XOR of every 16-byte word of the ranges of `r` this thread reads: words first, first +
// stride, ... of each range, four streaming loads in flight (what a floor kernel reads; its
// caller keeps the loads alive by storing the XOR only when it equals a constant).
__device__ __forceinline__ uint32_t XorOfRanges(const ReadRanges& r, size_t first,
                                                size_t stride) {
  uint32_t x = 0;
  for (int k = 0; k < r.count; ++k) {
    const uint4* p = r.p[k];
    const size_t n = r.n[k];
    size_t i = first;
    for (; i + 3 * stride < n; i += 4 * stride) {
      const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                  d = __ldcs(p + i + 3 * stride);
      x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
    }
    for (; i < n; i += stride) {
      const uint4 a = __ldcs(p + i);
      x ^= a.x ^ a.y ^ a.z ^ a.w;
    }
  }
  return x;
}

__global__ void __launch_bounds__(256) ReadRangesKernel(const __grid_constant__ ReadRanges r,
                                                        uint32_t* sink) {
  const uint32_t x = XorOfRanges(r, blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x,
                                 static_cast<size_t>(gridDim.x) * blockDim.x);
  if (x == 0x9e3779b9u) *sink = x;
}

__global__ void EmptyKernel() {}

}  // namespace

template <typename T>
T* Alloc(size_t count) {
  T* p = nullptr;
  KVQ_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return p;
}

inline void RandomBytes(void* p, size_t n, uint32_t seed) {
  FillRandomBytes<<<2048, 256>>>(static_cast<uint8_t*>(p), n, seed);
  KVQ_CUDA_CHECK(cudaGetLastError());
}
inline void RandomBf16(uint16_t* p, size_t n, float lo, float hi, uint32_t seed) {
  FillBf16<<<2048, 256>>>(p, n, lo, hi, seed);
  KVQ_CUDA_CHECK(cudaGetLastError());
}

// Median time in microseconds of `iters` runs of `step` (which queues its work on `stream`):
// 3 untimed runs first, then before each timed run the L2 pass of `flusher`, CUDA events on
// `stream` around the run.
template <typename F>
double MedianMicros(F&& step, L2Flusher& flusher, int iters, cudaStream_t stream = nullptr) {
  cudaEvent_t start, stop;
  KVQ_CUDA_CHECK(cudaEventCreate(&start));
  KVQ_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) step();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    flusher.Flush(stream);
    KVQ_CUDA_CHECK(cudaEventRecord(start, stream));
    step();
    KVQ_CUDA_CHECK(cudaEventRecord(stop, stream));
    KVQ_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0.0f;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  KVQ_CUDA_CHECK(cudaEventDestroy(start));
  KVQ_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

// The read floor of `ranges`: ReadRangesKernel over them, timed like a step (its sink is the
// workspace `ws`, which every step rewrites before reading).
inline double FloorMicros(const ReadRanges& ranges, void* ws, L2Flusher& flusher, int iters) {
  int sms = 0;
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return MedianMicros(
      [&] {
        ReadRangesKernel<<<8 * sms, 256>>>(ranges, static_cast<uint32_t*>(ws));
        KVQ_CUDA_CHECK(cudaGetLastError());
      },
      flusher, iters);
}

// Exits unless every one of the step's n outputs is finite.
inline void CheckFinite(const float* out, size_t n, const std::string& what) {
  std::vector<float> host(n);
  KVQ_CUDA_CHECK(cudaMemcpy(host.data(), out, n * 4, cudaMemcpyDeviceToHost));
  for (float v : host) {
    if (!std::isfinite(v)) {
      std::fprintf(stderr, "non-finite output (%s)\n", what.c_str());
      std::exit(1);
    }
  }
}

// Device-to-device copy bandwidth, bytes read + written per second.
inline double CopyBandwidth(L2Flusher& flusher) {
  const size_t bytes = size_t{1} << 30;
  void* a = Alloc<uint8_t>(bytes);
  void* b = Alloc<uint8_t>(bytes);
  RandomBytes(a, bytes, 1);
  const double us = MedianMicros(
      [&] { KVQ_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, flusher, 20);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (us * 1e-6);
}

// A step's inputs besides the cache: page tables (a random permutation of the pool's `pages`
// pages), every sequence at seq_len, random bf16-valued queries, the output and the workspace.
struct StepBuffers {
  int32_t* tables = nullptr;
  int32_t* lens = nullptr;
  float* q = nullptr;
  float* out = nullptr;
  void* ws = nullptr;
  size_t q_elems = 0;

  StepBuffers(int batch, int seq_len, int64_t pages, size_t workspace_bytes) {
    std::vector<int32_t> perm(std::max<int64_t>(pages, 1));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(5));
    const std::vector<int32_t> seq_lens(batch, seq_len);
    tables = Alloc<int32_t>(perm.size());
    lens = Alloc<int32_t>(batch);
    KVQ_CUDA_CHECK(cudaMemcpy(tables, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    KVQ_CUDA_CHECK(cudaMemcpy(lens, seq_lens.data(), seq_lens.size() * 4, cudaMemcpyHostToDevice));
    q_elems = static_cast<size_t>(batch) * kHq * kHeadDim;
    q = Alloc<float>(q_elems);
    out = Alloc<float>(q_elems);
    FillFloatBf16Valued<<<256, 256>>>(q, q_elems, 51);
    ws = Alloc<uint8_t>(workspace_bytes);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // The decode inputs' sequences, page tables and queries.
  void Attach(kvq::gpu::DecodeAttentionInputs& in, int batch, int seq_len,
              int pages_per_seq) const {
    in.batch = batch;
    in.max_seq_len = seq_len;
    in.seq_lens = lens;
    in.page_tables = tables;
    in.max_pages = std::max(pages_per_seq, 1);
    in.q = q;
  }
  void Free() const {
    for (void* p : {static_cast<void*>(tables), static_cast<void*>(lens), static_cast<void*>(q),
                    static_cast<void*>(out), ws}) {
      cudaFree(p);
    }
  }
};

// The attention benchmark's own cache: INT2 with a dense rotation + P_br on K and V (OSCAR's
// layout: G = 64, S0 = 64, W = 256, P = 64), or the bf16 cache.
inline CacheParams MakeParams(bool quantized) {
  namespace params = kvq::params;
  params::Cache c =
      params::Cache().q_heads(kHq).kv_heads(kHkv).sink(kSink).recent(kRecent).page(kPage).both(
          params::Write().head_dim(kHeadDim).group(kGroup).bits(2)
              .rotation(kvq::RotationKind::kDense).bitrev());
  if (!quantized) c.bf16();
  return c;
}

// ---- Scheme rows (issue 17): the spec 1.1 schemes of the catalogue (calib/schemes.inc) ----
//
// A row is a scheme's own configuration (BuildLayerScheme at d = 128, Hq/Hkv = 32/8, default
// options: KIVI / OScaR keys in tiles of 32 tokens, V in groups of 32, S0 = 0, W = 1, F = 128;
// SAW-INT4 at G = d, S0 = W = 0), its pools allocated and filled from the formats' plane lists
// (LayoutOf), random contents (codes random bytes, scales and mins in realistic ranges, norms
// around 1), shuffled page tables, and the sequence at length T. The plain rows (kPlainRows) are
// kvq's `hadamard` cache (G = 64, S0 = 64, W = 256) at other widths: "int4" beside SAW, and K
// and V apart ("k4v2", "k2v4"), and TurboQuant-MSE at K3V3 and K3V2 (its own row is K2V2). A
// named scheme whose only calibrated data is its fp8 scales
// (fp8, fp8_hadamard) is built without them: the cache's per-head scales (SchemeCache) stand in.
struct SchemeRow {
  std::string label;
  CacheParams params;
};

struct PlainRow {
  const char* label;
  const char* scheme;
  int k_bits, v_bits;
};
inline constexpr PlainRow kPlainRows[] = {{"int4", "hadamard", 4, 4},
                                          {"k4v2", "hadamard", 4, 2},
                                          {"k2v4", "hadamard", 2, 4},
                                          {"tq_mse_k3v3", "tq_mse", 3, 3},
                                          {"tq_mse_k3v2", "tq_mse", 3, 2}};

inline std::vector<SchemeRow> SchemeRows(const std::string& list) {
  namespace calib = kvq::calib;
  calib::SchemeShape shape;
  shape.num_kv_heads = kHkv;
  shape.num_q_heads = kHq;
  shape.head_dim = kHeadDim;
  std::vector<SchemeRow> rows;
  std::vector<std::string> names;
  if (list.empty()) {
    // Every scheme the GPU decode serves (formats its kernels read) without a calibration:
    // tiled keys or its own windows (the KIVI family, OScaR, SAW), in catalogue order, then
    // the plain INT4 baseline.
    for (const calib::SchemeInfo& info : calib::Schemes()) {
      if (info.needs_calibration || !info.quantized()) continue;
      // A format the decode kernels do not read.
      if (!kvq::gpu::attention::DecodeFormatOf(info.format_k).listed ||
          !kvq::gpu::attention::DecodeFormatOf(info.format_v).listed) {
        continue;
      }
      if (info.format_k != kvq::Format::kAffineTile && info.windows.shared()) continue;
      names.push_back(info.name);
    }
    for (const PlainRow& plain : kPlainRows) names.push_back(plain.label);
  } else {
    size_t at = 0;
    while (at <= list.size()) {
      const size_t comma = std::min(list.find(',', at), list.size());
      names.push_back(list.substr(at, comma - at));
      at = comma + 1;
    }
  }
  for (const std::string& name : names) {
    calib::SchemeOptions options;
    std::string scheme = name;
    for (const PlainRow& plain : kPlainRows) {
      if (name == plain.label) {
        scheme = plain.scheme;
        options.k_bits = plain.k_bits;
        options.v_bits = plain.v_bits;
      }
    }
    calib::SchemeInfo info = calib::SchemeByName(scheme);
    if (info.scale == calib::ScalePolicy::kCalibration && info.clip == calib::ClipPolicy::kNone) {
      info.scale = calib::ScalePolicy::kNone;  // the scales alone: the cache's stand in
      info.needs_calibration = false;
    }
    rows.push_back({name, calib::BuildLayerScheme(info, shape, nullptr, 0, options).params});
  }
  return rows;
}

// Bytes that `tokens` history tokens of every KV head take in plane `i` of `layout` (a tile
// plane per started tile, a shared plane once for the KV heads): FormatLayout::Bytes for one
// plane.
inline size_t PlaneBytes(const kvq::FormatLayout& layout, int i, int64_t tokens,
                         int num_kv_heads) {
  const kvq::PlaneSpec& plane = layout.plane(i);
  const int64_t rows = plane.scope == kvq::PlaneScope::kTile
                           ? (tokens + layout.tile_tokens - 1) / layout.tile_tokens
                           : tokens;
  return static_cast<size_t>(layout.HeadsPerPage(i, num_kv_heads) * rows) * plane.row_bytes();
}

// The device cache of one scheme at (batch, seq_len), every sequence at seq_len: the history
// pools (plane i of LayoutOf(c.key) / LayoutOf(c.value) at planes[0][i] / planes[1][i],
// [pages, Hkv, RowsPerPage(i), row_bytes(i)], pages_per_seq pages a sequence for
// HistoryTokens(seq_len) tokens; a bf16 cache: its rows plane for all seq_len tokens), random
// contents (codes random bytes, fp8 codes below 2 in magnitude, scales 0.2..0.8, mins
// -1.5..-0.5, norms 0.5..2, bf16 rows -2..2), the bf16 windows of a quantized cache (sink
// [B, S0, Hkv, d], ring [B, W + F - 1, Hkv, d], -2..2), the dense rotations [Hkv, d, d] of a
// quantized side whose write is kDense (bf16-valued in [-1, 1]) and an fp8 scale per KV head (0.05:
// calibrated-looking; no step's time depends on it). `fits` is false, and nothing is
// allocated, when the pools and windows would leave less than 3 GB of device memory.
struct SchemeCache {
  bool fits = false;
  int64_t hist = 0;       // history tokens a sequence (bf16 cache: seq_len)
  int64_t window = 0;     // sink + recent rows a sequence (0 for a bf16 cache)
  int pages_per_seq = 0;
  int64_t pages = 0;
  kvq::FormatLayout layouts[2];
  uint8_t* planes[2][kvq::kMaxPlanes] = {};
  size_t sink_elems = 0;  // bf16 elements of one sink buffer [B, S0, Hkv, d]
  size_t ring_elems = 0;  // of one ring buffer [B, W + F - 1, Hkv, d]
  uint16_t* windows[4] = {};   // sink K, sink V, recent K, recent V (quantized cache)
  float* rotations[2] = {};    // R_K, R_V [Hkv, d, d] where that side is kDense
  float* head_scales = nullptr;  // [2 * Hkv]: K's, then V's
  ReadRanges ranges;  // the pools and windows whole (the attention benchmark's read floor)
  std::vector<void*> owned;

  SchemeCache(const CacheParams& c, int batch, int seq_len) {
    const bool quantized = c.quantized();
    hist = quantized ? c.HistoryTokens(seq_len) : seq_len;
    window = quantized ? seq_len - hist : 0;
    pages_per_seq = static_cast<int>((hist + c.page_size - 1) / c.page_size);
    pages = static_cast<int64_t>(pages_per_seq) * batch;
    layouts[0] = kvq::LayoutOf(c.key);
    layouts[1] = kvq::LayoutOf(c.value);
    size_t pool_bytes = 0;
    for (const kvq::FormatLayout& layout : layouts) {
      for (int i = 0; i < layout.num_planes; ++i) {
        pool_bytes += pages * layout.PageBytes(i, c.page_size, c.num_kv_heads);
      }
    }
    const size_t row_elems = static_cast<size_t>(kHkv) * kHeadDim;
    sink_elems = quantized ? static_cast<size_t>(batch) * c.sink * row_elems : 0;
    ring_elems = quantized ? static_cast<size_t>(batch) * c.ring_slots() * row_elems : 0;
    size_t free_bytes = 0, total_bytes = 0;
    KVQ_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (pool_bytes + 4 * (sink_elems + ring_elems) + (size_t{3} << 30) > free_bytes) return;
    fits = true;

    uint32_t seed = 100;
    for (int kv = 0; kv < 2; ++kv) {
      const kvq::FormatLayout& layout = layouts[kv];
      for (int i = 0; i < layout.num_planes; ++i) {
        const kvq::PlaneSpec& plane = layout.plane(i);
        const size_t bytes = pages * layout.PageBytes(i, c.page_size, c.num_kv_heads);
        uint8_t* pool = Alloc<uint8_t>(bytes / 2 * 2 + 16);
        owned.push_back(pool);
        const std::string name = plane.name;
        if (plane.dtype != kvq::DType::kBF16) {
          RandomBytes(pool, bytes, ++seed);
          if ((kv ? c.value : c.key).format == kvq::Format::kFp8E4m3) {
            // e4m3 codes with exponent field <= 7: |value| < 2, never the NaN codes 0x7f / 0xff.
            AndBytes<<<2048, 256>>>(pool, bytes, 0xbf);
            KVQ_CUDA_CHECK(cudaGetLastError());
          }
        } else {
          const float lo = name == "scale" ? 0.2f
                           : name == "min" ? -1.5f
                           : name == "rows" ? -2.f  // a bf16 cache's rows
                                            : 0.5f;
          const float hi = name == "scale" ? 0.8f : name == "min" ? -0.5f : 2.0f;
          RandomBf16(reinterpret_cast<uint16_t*>(pool), bytes / 2, lo, hi, ++seed);
        }
        planes[kv][i] = pool;
        ranges.Add(pool, bytes);
      }
    }
    if (quantized) {
      for (int w = 0; w < 4; ++w) {
        const size_t elems = w < 2 ? sink_elems : ring_elems;
        windows[w] = Alloc<uint16_t>(elems);
        owned.push_back(windows[w]);
        RandomBf16(windows[w], elems, -2.f, 2.f, ++seed);
        ranges.Add(windows[w], elems * 2);
      }
    }
    head_scales = Alloc<float>(2 * kHkv);
    owned.push_back(head_scales);
    const std::vector<float> scales(2 * kHkv, 0.05f);
    KVQ_CUDA_CHECK(cudaMemcpy(head_scales, scales.data(), scales.size() * sizeof(float),
                              cudaMemcpyHostToDevice));
    const kvq::WriteParams* sides[2] = {&c.key, &c.value};
    for (int kv = 0; kv < 2; ++kv) {
      if (!quantized || sides[kv]->rotation != kvq::RotationKind::kDense) continue;
      const size_t elems = static_cast<size_t>(kHkv) * kHeadDim * kHeadDim;
      rotations[kv] = Alloc<float>(elems);
      owned.push_back(rotations[kv]);
      FillFloatBf16Valued<<<256, 256>>>(rotations[kv], elems, 41 + kv);
      KVQ_CUDA_CHECK(cudaGetLastError());
    }
  }

  // The per-head data of K (side 0) or V (side 1): its rotations and fp8 scales.
  kvq::gpu::HeadData Heads(int side) const {
    kvq::gpu::HeadData heads;
    heads.rotation = rotations[side];
    heads.scale = head_scales + side * kHkv;
    return heads;
  }

  // The decode inputs' pools, windows and per-head data.
  void Attach(kvq::gpu::DecodeAttentionInputs& in) const {
    for (int i = 0; i < kvq::kMaxPlanes; ++i) {
      in.key_planes[i] = planes[0][i];
      in.value_planes[i] = planes[1][i];
    }
    in.sink_key = windows[0];
    in.sink_value = windows[1];
    in.recent_key = windows[2];
    in.recent_value = windows[3];
    in.key_heads = Heads(0);
    in.value_heads = Heads(1);
  }

  void Free() {
    for (void* p : owned) cudaFree(p);
    owned.clear();
  }
};

}  // namespace kvq::bench
