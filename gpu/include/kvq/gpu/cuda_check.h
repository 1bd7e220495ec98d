// CUDA error handling for the runtime layer of gpu/: every CUDA call is checked, and a failure
// becomes a kvq::Error carrying cudaGetErrorString and the call site (spec/errors.md).
#pragma once

#include <cuda_runtime_api.h>

#include "kvq/common/error.h"

namespace kvq::gpu {

// Throws kvq::Error(kUnsupported for "no device"-type errors, else kInvalidArgument when the
// launcher refused a configuration, else kIoError) naming the failed expression and location.
[[noreturn]] void ThrowCudaError(cudaError_t status, const char* expression, const char* file,
                                 int line);

// True when the CUDA runtime finds at least one device. Never throws: a machine without a
// driver (CI) answers false. Tests call this and GTEST_SKIP() when it is false.
bool HasCudaDevice();

// Throws kvq::Error(kUnsupported) when no CUDA device is usable.
void RequireCudaDevice();

}  // namespace kvq::gpu

// KVQ_CUDA_CHECK(cudaMemcpy(...)): throws kvq::Error unless the call returns cudaSuccess.
#define KVQ_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    const cudaError_t kvq_cuda_status_ = (expr);                               \
    if (kvq_cuda_status_ != cudaSuccess) {                                     \
      ::kvq::gpu::ThrowCudaError(kvq_cuda_status_, #expr, __FILE__, __LINE__); \
    }                                                                          \
  } while (0)
