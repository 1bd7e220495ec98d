// A batch of sequences' caches on the device, laid out as DecodeAttention reads them
// (spec/cache.md §4), and the decode step over them. It is built from a host image of the
// cache; the CUDA adapter (gpu/adapter/cache_upload.h) makes that image from a CPU
// cpu::PagedKVCache, for `kvq conform --backend gpu`, `kvq bench` and the tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvq/common/format.h"
#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/gpu/attention.h"

namespace kvq::gpu {

// The host image of a batch of B sequences. K is [0], V is [1].
struct CacheImage {
  CacheParams params;                // validated by DeviceCache
  std::vector<int32_t> lengths;      // [B], t >= 1 each
  int max_pages = 1;                 // page-table entries per sequence (>= 1)
  std::vector<int32_t> page_tables;  // [B, max_pages]: history token i of sequence b (every
                                     // token of a bf16 cache) in page [b][i / P], slot i % P
  // The history pool per plane of LayoutOf(key) / LayoutOf(value) (a bf16 cache: the rows
  // plane), [num_pages, Hkv, RowsPerPage(i), row_bytes(i)]; the same page count for every
  // plane.
  std::vector<uint8_t> pool[2][kMaxPlanes];
  // Quantized cache: the bf16 windows batched as kvq::gpu::Windows, sink [B, S0, Hkv, d] and
  // recent ring [B, W + F - 1, Hkv, d] (position p at slot p % (W + F - 1)). Empty for a bf16 cache.
  std::vector<uint16_t> sink[2];
  std::vector<uint16_t> recent[2];
  // The per-head data of K and V (kvq::HeadData, as PagedKVCache::Heads holds it; uploaded as
  // gpu::DeviceHeadData): the rotations [Hkv, d, d] when the write path is dense, and each
  // per-head scalar [Hkv] (clip ratio, fp8 scale s^), empty when every head takes the params'
  // value.
  kvq::HeadData heads[2];
  size_t bytes_per_step = 0;         // K and V bytes a decode step reads (BytesPerStep)
};

class DeviceCache {
 public:
  // Uploads `image` to the current device and plans its decode step. Throws kvq::Error: no
  // device (kUnsupported), an empty batch, a length below 1, sizes that disagree with the
  // params and layout (kInvalidArgument), what PlanDecodeAttention refuses, a CUDA failure.
  explicit DeviceCache(const CacheImage& image);
  ~DeviceCache();
  DeviceCache(DeviceCache&&) noexcept;
  DeviceCache& operator=(DeviceCache&&) noexcept;
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  int batch() const;
  const CacheParams& params() const;
  const DecodeAttentionPlan& plan() const;
  // Bytes of K and V the decode step reads (history planes, windows or bf16 pages).
  size_t BytesPerStep() const;

  // out [B, Hq, d] fp32 (host) = decode attention of q [B, Hq, d] fp32 (host); synchronous.
  // The device output is poisoned first, so an element the kernels skip shows as NaN.
  void Attend(const float* q, float* out);

  // The step without host copies (for timing): SetQuery copies q [B, Hq, d] fp32 (host) to the
  // device once; Step queues one decode step over it on `stream` and does not synchronise.
  void SetQuery(const float* q);
  void Step(cudaStream_t stream = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::gpu
