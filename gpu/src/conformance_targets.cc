// kvq::gpu::ConformanceTargets(): the CUDA path as a conformance target. Write-path cases run
// through CudaBackend()'s stage wrappers; attention cases upload the oracle's cache with
// DeviceCache and run the decode kernels, judged at the GPU tolerance (spec/cache.md §5).
#include "kvq/conformance/gpu_targets.h"

#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_cache.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {

std::vector<conformance::ConformanceTarget> ConformanceTargets() {
  RequireCudaDevice();
  conformance::ConformanceTarget target;
  target.name = "cuda";
  target.backend = &CudaBackend();
  target.attend = [](const cpu::PagedKVCache& cache, int seq, const float* q, float* out) {
    DeviceCache device(cache, {seq});
    device.Attend(q, out);
  };
  target.tolerance = conformance::ToleranceClass::kGpu;
  return {target};
}

}  // namespace kvq::gpu
