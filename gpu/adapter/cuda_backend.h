// The CUDA path as an entry of the backend list (kvq/backends.h): a cpu::Backend above both
// cpu_ref and gpu, so tests, benchmarks and `kvq conform` that expand the list run the GPU too.
#pragma once

#include "kvq/cpu_ref/kernels.h"

namespace kvq::gpu {

// The backend named "cuda" (device = Device::kCuda, hwy_target 0), or null when this process has
// no CUDA device (never throws). Its WriteKernels are host wrappers generated from the stage
// list (kvq/common/stages.inc): each uploads its inputs, runs the device stage (gpu::RunStage)
// on poisoned outputs (0xFF bytes: NaN floats and bf16, code 255, so an element the kernel
// forgets cannot pass for a right answer) and downloads the outputs, synchronously. Its
// AttentionKernels are null; `attend` uploads the cache's sequences (UploadCache) and runs the
// CUDA decode step. Meant for conformance, not speed.
const cpu::Backend* CudaBackend();

}  // namespace kvq::gpu
