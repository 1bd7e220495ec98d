// A device mirror of sequences of a CPU PagedKVCache (spec/cache.md §4), for replaying the CPU
// oracle's caches on the GPU: `kvq conform --backend gpu`, `kvq bench` and tests.
// The quantized pool, page tables, windows and rotations are copied as they are (same page ids);
// a bf16 cache's dense rows are paged into bf16 pages [num_pages, Hkv, P, d] as the CUDA
// decode path expects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvq/cpu_ref/cache.h"
#include "kvq/gpu/attention.h"

namespace kvq::gpu {

class DeviceCache {
 public:
  // Copies sequences `seqs` (a batch, in this order; repeats allowed) of `cache` to the current
  // device. Throws kvq::Error: no device (kUnsupported), an unknown or empty sequence
  // (kInvalidArgument), a CUDA failure.
  DeviceCache(const cpu::PagedKVCache& cache, const std::vector<int>& seqs);
  ~DeviceCache();
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  int batch() const;
  const CacheParams& params() const;
  // Bytes of K and V the decode step reads (history codes + metadata, windows or bf16 pages).
  size_t BytesPerStep() const;

  // out [B, Hq, d] fp32 (host) = decode attention of q [B, Hq, d] fp32 (host); synchronous.
  void Attend(const float* q, float* out);

  // Median time in microseconds of `iters` decode steps on the device (CUDA events around each
  // step, `warmup` untimed steps first, q copied once). When `cold_l2` is set, a buffer twice
  // the L2 size is overwritten before every timed step.
  double MedianAttendMicros(const float* q, int iters, int warmup, bool cold_l2);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::gpu
