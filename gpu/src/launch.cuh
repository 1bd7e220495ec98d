// Programmatic dependent launch (PDL, sm_90), shared by the attention and write kernels.
//
// A kernel launched with LaunchKernel(..., programmatic = true, ...) may start while the kernel
// before it on the stream is still running, as soon as every block of that kernel has called
// LaunchDependents() (or exited). It must call WaitForPrerequisiteGrid() before it touches
// memory the previous kernel writes or reads; a kernel that shares no memory with it calls it
// just before it exits, so that its completion still implies the previous kernel's.
// Both device calls are no-ops in a kernel launched without the attribute.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <utility>

namespace kvq::gpu::launch {

// The kernel launched after this one on the stream (with the programmatic attribute) may start.
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// Waits until the grid this one depends on has finished and its writes are visible.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Sets, once per device and kernel, the kernel's preferred shared-memory carveout to the
// largest. A multiprocessor holds blocks of one L1 / shared-memory split at a time, so a kernel
// that asks for little shared memory (a DecodeStep's append, the query rotation) would set
// multiprocessors to a split the decode's blocks cannot join until it leaves them (H200,
// saw_int4 at B = 1, T = 128K: history blocks entering up to 7 us late without it, all within
// 0.5 us with it).
inline cudaError_t PreferMaxShared(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<int, const void*>> done;
  int device = 0;
  const cudaError_t got = cudaGetDevice(&device);
  if (got != cudaSuccess) return got;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!done.insert({device, kernel}).second) return cudaSuccess;
  const cudaError_t set = cudaFuncSetAttribute(
      kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (set != cudaSuccess) done.erase({device, kernel});
  return set;
}

// Launches kernel(p) (PreferMaxShared first); with `programmatic` the launch may overlap the tail of the previous
// kernel on the stream (see above).
template <typename Params>
cudaError_t LaunchKernel(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, bool programmatic, const Params& p) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t preferred = PreferMaxShared(reinterpret_cast<const void*>(kernel));
  if (preferred != cudaSuccess) return preferred;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace kvq::gpu::launch
