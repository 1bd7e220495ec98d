// Cold L2 for the GPU benchmarks (bench_gpu_*.cu): before every timed run, a pass over a
// buffer several times the L2's size evicts whatever the previous run left there.
//
// The default pass reads the buffer, so the L2 it leaves holds clean lines, as when a
// benchmark rotates among input buffers larger than the L2. A pass that writes the buffer
// (FlushMode::kWrite, the method of runs before 2026-11-21 20:00 UTC) leaves the whole L2 dirty,
// and the timed kernel then pays the write-back of that many bytes of someone else's data:
// measured on an H100 in one call, 7.4 us of a 58.6 us INT2 decode step (B=1, T=128K) and
// 9.5 us of cuDNN's 192 us on the same shape, whatever either kernel reads itself
// (docs/performance.md).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/gpu/cuda_check.h"

namespace kvq::bench {

enum class FlushMode { kRead, kWrite };

// "read" / "write" -> the mode; false for any other name.
inline bool ParseFlushMode(const char* name, FlushMode* mode) {
  if (!std::strcmp(name, "read")) *mode = FlushMode::kRead;
  else if (!std::strcmp(name, "write")) *mode = FlushMode::kWrite;
  else return false;
  return true;
}

inline const char* FlushModeName(FlushMode mode) {
  return mode == FlushMode::kRead ? "read" : "write";
}

// The passes' kernels: internal to each benchmark program that includes this header.
namespace {

// XOR of a thread's words, stored only when it equals an arbitrary constant, so that the loads
// cannot be dropped; `sink` is a word of the flush buffer itself, so a (rare) store is harmless.
__global__ void ReadEvery(const uint32_t* p, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x ^= p[i];
  if (x == 0x9e3779b9u) *sink = x;
}

__global__ void WriteEvery(uint32_t* p, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = v + static_cast<uint32_t>(i);
}

}  // namespace

class L2Flusher {
 public:
  // A buffer `multiple` times the device's L2 (an H100's 50 MB: twice is enough; a read pass
  // over 4x measured the same decode times as 2x).
  explicit L2Flusher(FlushMode mode = FlushMode::kRead, int multiple = 2) : mode_(mode) {
    int device = 0, l2 = 0;
    KVQ_CUDA_CHECK(cudaGetDevice(&device));
    KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    words_ = static_cast<size_t>(multiple) * static_cast<size_t>(l2) / 4;
    KVQ_CUDA_CHECK(cudaMalloc(&buf_, words_ * 4));
    WriteEvery<<<1024, 256>>>(buf_, words_, 0);
    KVQ_CUDA_CHECK(cudaGetLastError());
  }
  ~L2Flusher() { cudaFree(buf_); }
  L2Flusher(const L2Flusher&) = delete;
  L2Flusher& operator=(const L2Flusher&) = delete;

  // Queues the pass on `stream` (outside the caller's timed region).
  void Flush(cudaStream_t stream) {
    if (mode_ == FlushMode::kRead) {
      ReadEvery<<<1024, 256, 0, stream>>>(buf_, words_, buf_);
    } else {
      WriteEvery<<<1024, 256, 0, stream>>>(buf_, words_, ++tick_);
    }
    KVQ_CUDA_CHECK(cudaGetLastError());
  }

 private:
  FlushMode mode_;
  uint32_t* buf_ = nullptr;
  size_t words_ = 0;
  uint32_t tick_ = 0;
};

}  // namespace kvq::bench
