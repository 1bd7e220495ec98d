// The bf16 windows of the write path (write.h, layers (a) and (b)): the new token of each
// sequence of a decode step into its sink or recent ring (AppendCopyKernel), and a prefill's
// sink and recent rows (PrefillWindowsKernel). Plain 16-byte copies, launched to overlap the
// tail of the history writes before them (programmatic dependent launch, launch.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/gpu/write.h"
#include "launch.cuh"
#include "write_launch.cuh"

namespace kvq::gpu {
namespace {

// Thread per 16 bytes of a new token row: into the sink (position < S0) or the ring (slots
// W + F - 1), unless the step's flush took it into the history (W = 0).
__global__ void AppendCopyKernel(const __grid_constant__ AppendCopyArgs a) {
  // The query rotation DecodeStep launches after the append may start now (it completes only
  // after this grid; the decode's blocks that read the windows wait for it).
  launch::LaunchDependents();
  // overlap_previous: the demotions read the ring slots this kernel overwrites.
  launch::WaitForPrerequisiteGrid();
  const int vectors_per_row = a.head_dim / 8;
  const int64_t per_kv = static_cast<int64_t>(a.batch) * a.num_heads * vectors_per_row;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= 2 * per_kv) return;
  const bool is_value = idx >= per_kv;
  const int64_t rest = is_value ? idx - per_kv : idx;
  const int vec = static_cast<int>(rest % vectors_per_row);
  const int64_t row = rest / vectors_per_row;  // b * Hkv + h
  const int b = static_cast<int>(row / a.num_heads);
  const int h = static_cast<int>(row % a.num_heads);
  const int len = a.seq_lengths[b];
  if (len < 0) {
    if (a.error_flags != nullptr) atomicOr(a.error_flags, kErrorFlagBadLength);
    return;
  }
  const int64_t row_elems = static_cast<int64_t>(a.num_heads) * a.head_dim;
  uint16_t* dst;
  if (len < a.sink) {
    uint16_t* sink = is_value ? a.sink_value : a.sink_key;
    dst = sink + (static_cast<int64_t>(b) * a.sink + len) * row_elems;
  } else {
    // The new token stays recent unless this step's flush took it (W = 0): len >= S0 + H(len+1).
    if (len < a.sink + write_launch::HistoryTokensAt(static_cast<int64_t>(len) + 1, a.sink,
                                                      a.window, a.flush)) {
      return;
    }
    uint16_t* ring = is_value ? a.recent_value : a.recent_key;
    dst = ring + (static_cast<int64_t>(b) * a.recent + len % a.recent) * row_elems;
  }
  const uint16_t* src = (is_value ? a.value : a.key) + row * a.head_dim;
  reinterpret_cast<uint4*>(dst + static_cast<int64_t>(h) * a.head_dim)[vec] =
      __ldg(reinterpret_cast<const uint4*>(src) + vec);
}

// Thread per 16 bytes of a window row of a prefill: K rows, then V rows; each tensor's rows
// are the sink positions, then the recent ones.
__global__ void PrefillWindowsKernel(const __grid_constant__ PrefillWindowsArgs a) {
  const int64_t vectors_per_row = a.row_elems / 8;
  const int recent_rows = a.tokens - a.recent_begin;
  const int64_t per_tensor = static_cast<int64_t>(a.sink_tokens + recent_rows) * vectors_per_row;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= 2 * per_tensor) return;  // thread 0 always copies, and waits below
  const bool is_value = idx >= per_tensor;
  const int64_t rest = is_value ? idx - per_tensor : idx;
  const int row = static_cast<int>(rest / vectors_per_row);
  const int64_t vec = rest - static_cast<int64_t>(row) * vectors_per_row;
  int position;
  uint16_t* dst;
  if (row < a.sink_tokens) {
    position = row;
    dst = (is_value ? a.sink_value : a.sink_key) + static_cast<int64_t>(position) * a.row_elems;
  } else {
    position = a.recent_begin + (row - a.sink_tokens);
    dst = (is_value ? a.recent_value : a.recent_key) +
          static_cast<int64_t>(position % a.recent) * a.row_elems;
  }
  const uint16_t* src = (is_value ? a.value : a.key) + static_cast<int64_t>(position) * a.row_elems;
  reinterpret_cast<uint4*>(dst)[vec] = __ldg(reinterpret_cast<const uint4*>(src) + vec);
  launch::WaitForPrerequisiteGrid();  // overlap_previous: complete only after the previous kernel
}

}  // namespace

cudaError_t LaunchAppendCopy(const AppendCopyArgs& a, cudaStream_t stream) {
  if (a.batch < 0 || a.num_heads < 1 || a.window < 0 || a.flush < 1 ||
      a.recent != a.window + a.flush - 1 || a.sink < 0 ||
      (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)) {
    return cudaErrorInvalidValue;
  }
  if (a.batch == 0) return cudaSuccess;
  const int64_t threads = 2 * static_cast<int64_t>(a.batch) * a.num_heads * (a.head_dim / 8);
  return write_launch::LaunchThreads(AppendCopyKernel, threads, stream, a.overlap_previous, a);
}

cudaError_t LaunchPrefillWindows(const PrefillWindowsArgs& a, cudaStream_t stream) {
  const bool sink = a.sink_tokens > 0;
  const bool recent = a.recent_begin < a.tokens;
  if (a.sink_tokens < 0 || a.recent < 0 || a.row_elems < 8 || a.row_elems % 8 != 0 ||
      a.recent_begin < a.sink_tokens || a.tokens < a.recent_begin ||
      a.tokens - a.recent_begin > a.recent || a.key == nullptr || a.value == nullptr ||
      (sink && (a.sink_key == nullptr || a.sink_value == nullptr)) ||
      (recent && (a.recent_key == nullptr || a.recent_value == nullptr))) {
    return cudaErrorInvalidValue;
  }
  for (const void* ptr : {static_cast<const void*>(a.key), static_cast<const void*>(a.value),
                          static_cast<const void*>(a.sink_key),
                          static_cast<const void*>(a.sink_value),
                          static_cast<const void*>(a.recent_key),
                          static_cast<const void*>(a.recent_value)}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(a.sink_tokens) + (a.tokens - a.recent_begin);
  if (rows == 0) return cudaSuccess;
  const int64_t threads = 2 * rows * (a.row_elems / 8);
  return write_launch::LaunchThreads(PrefillWindowsKernel, threads, stream, a.overlap_previous, a);
}

}  // namespace kvq::gpu
