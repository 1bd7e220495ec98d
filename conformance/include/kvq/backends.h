// The one backend list of this build, above the CPU oracle and the CUDA path: every entry of
// cpu::Backends() (the scalar reference, then each Highway target this CPU runs), then, in a
// build with CUDA and on a machine with a device, the CUDA backend (gpu/adapter: stage host
// wrappers and a whole decode step). Tests, benchmarks and `kvq conform` expand this list, so a
// new backend is tested, benchmarked and conformance-checked by being in it.
#pragma once

#include <string>
#include <vector>

#include "kvq/cpu_ref/kernels.h"

namespace kvq {

const std::vector<const cpu::Backend*>& AllBackends();

// "all" (AllBackends()), "cpu" (every CPU backend), "gpu" or "cuda" (the CUDA backend), or one
// backend by name. Throws kvq::Error: kUnsupported for gpu without a CUDA build or device,
// kInvalidArgument for an unknown name (listing the names).
std::vector<const cpu::Backend*> SelectBackends(const std::string& which);

}  // namespace kvq
