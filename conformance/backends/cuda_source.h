// Where the backend list (kvq/backends.h) gets its CUDA backend: one definition per program.
// Tests and benchmarks link kvq_backends, whose cuda_linked.cc returns the adapter's backend
// (gpu/adapter) in a CUDA build; the kvq CLI defines it in tools/cli_gpu.cc, from its loadable
// GPU module, so the binary itself links no CUDA code.
#pragma once

#include <string>

#include "kvq/cpu_ref/kernels.h"

namespace kvq {

// The CUDA backend, or null with *why_not saying why (a build without CUDA, no device, ...).
const cpu::Backend* CudaBackendOrNull(std::string* why_not);

}  // namespace kvq
