#include "kvq/gpu/cuda_check.h"

#include <cuda_runtime_api.h>

#include <string>

namespace kvq::gpu {

void ThrowCudaError(cudaError_t status, const char* expression, const char* file, int line) {
  ErrorCode code = ErrorCode::kIoError;  // the device refused or failed an operation
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
      status == cudaErrorNotSupported || status == cudaErrorUnsupportedPtxVersion ||
      status == cudaErrorNoKernelImageForDevice) {
    code = ErrorCode::kUnsupported;
  } else if (status == cudaErrorInvalidValue) {
    code = ErrorCode::kInvalidArgument;  // a launcher refused the configuration
  }
  throw Error(code, detail::Concat("CUDA error ", cudaGetErrorName(status), " (",
                                   cudaGetErrorString(status), ") from ", expression, " at ",
                                   file, ":", line));
}

bool HasCudaDevice() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for the next call
    return false;
  }
  return count > 0;
}

void RequireCudaDevice() {
  KVQ_CHECK(HasCudaDevice(), kUnsupported, "no CUDA device is available to this process");
}

}  // namespace kvq::gpu
