// The CUDA side of the conformance hook. Declared here, defined by gpu/ (kvq_gpu) in builds
// with CUDA: `kvq conform --backend gpu` replays the golden vectors against these targets.
#pragma once

#include <vector>

#include "kvq/conformance/runner.h"

namespace kvq::gpu {

// One target per CUDA backend: `backend` fills WriteKernels with host wrappers around the
// device stages (or is null), `attend` uploads the cache and runs the decode kernel, and
// `tolerance` is ToleranceClass::kGpu. Throws kvq::Error(kUnsupported) without a device.
std::vector<kvq::conformance::ConformanceTarget> ConformanceTargets();

}  // namespace kvq::gpu
