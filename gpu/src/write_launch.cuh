// Launch helpers shared by the write path's kernel files (write_fused.cu, write_stages.cu,
// write_windows.cu): grid sizing of the thread-per-element kernels and the compile-time
// dispatch of head_dim / group / bits. Every dispatch ends in cudaErrorInvalidValue for a value
// it has no kernel for, never a silent no-op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launch.cuh"

namespace kvq::gpu::write_launch {

inline bool IsPowerOfTwo(int v) { return v > 0 && (v & (v - 1)) == 0; }

inline int64_t Blocks(int64_t threads, int block) { return (threads + block - 1) / block; }

// Block size of the stage and window kernels.
inline constexpr int kStageBlock = 256;

// kernel(args) over `threads` threads in blocks of kStageBlock (programmatic: launch.cuh).
template <typename Args>
cudaError_t LaunchThreads(void (*kernel)(Args), int64_t threads, cudaStream_t stream,
                          bool programmatic, const Args& args) {
  const dim3 grid(static_cast<unsigned>(Blocks(threads, kStageBlock)));
  return launch::LaunchKernel(kernel, grid, dim3(kStageBlock), 0, stream, programmatic, args);
}

// ---- Device helpers of the write kernels -------------------------------------------------------

// ORs `bit` into *flags (when there are flags and the caller is the row's leader lane).
__device__ __forceinline__ void RaiseFlag(int* flags, int bit, bool leader = true) {
  if (flags != nullptr && leader) atomicOr(flags, bit);
}

// The window rule (spec/cache.md §2, CacheParams::HistoryTokens): H(t) =
// F * floor(max(0, t - S0 - W) / F) history tokens at length t.
__device__ __forceinline__ int64_t HistoryTokensAt(int64_t t, int sink, int recent, int flush) {
  const int64_t over = t - sink - recent;
  return over <= 0 ? 0 : over / flush * flush;
}

// The positions [begin, end) that enter the history in the decode step of a sequence of length
// `len` (before the append): [S0 + H(len), S0 + H(len + 1)), F of them or none.
struct FlushRange {
  int64_t len = 0;
  int64_t begin = 0;
  int64_t end = 0;
};
__device__ __forceinline__ FlushRange FlushRangeOf(int len, int sink, int recent, int flush) {
  FlushRange f;
  f.len = len;
  if (len < 0) return f;
  f.begin = sink + HistoryTokensAt(len, sink, recent, flush);
  f.end = sink + HistoryTokensAt(static_cast<int64_t>(len) + 1, sink, recent, flush);
  return f;
}

}  // namespace kvq::gpu::write_launch

// KVQ_DISPATCH_*: map a runtime value onto a constexpr one; anything else returns
// cudaErrorInvalidValue from the enclosing function.
#define KVQ_DISPATCH_HEAD_DIM(value, NAME, ...)    \
  switch (value) {                                 \
    case 64: { constexpr int NAME = 64; __VA_ARGS__ }   \
    case 128: { constexpr int NAME = 128; __VA_ARGS__ } \
    case 256: { constexpr int NAME = 256; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }
// 256: G = d at d = 256 (spec 1.1); the launchers refuse a group above their head_dim.
#define KVQ_DISPATCH_GROUP(value, NAME, ...)       \
  switch (value) {                                 \
    case 32: { constexpr int NAME = 32; __VA_ARGS__ }   \
    case 64: { constexpr int NAME = 64; __VA_ARGS__ }   \
    case 128: { constexpr int NAME = 128; __VA_ARGS__ } \
    case 256: { constexpr int NAME = 256; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }
#define KVQ_DISPATCH_BITS(value, NAME, ...)        \
  switch (value) {                                 \
    case 2: { constexpr int NAME = 2; __VA_ARGS__ } \
    case 4: { constexpr int NAME = 4; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }
