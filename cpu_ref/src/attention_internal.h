// Internal to kvq_cpu_ref: where the decode-attention tables of the backend list come from
// (backends.cc merges them into each Backend next to the write-path table).
#pragma once

#include <vector>

#include <cstdint>

#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::internal {

// The scalar reference (attention_scalar.cc).
AttentionKernels ScalarAttentionKernels();

// The table of Highway target `hwy_target` (one bit, e.g. HWY_AVX3) compiled into
// attention_hwy.cc. Throws kvq::Error(kUnsupported) for a target that file was not built for.
AttentionKernels HwyAttentionKernels(int64_t hwy_target);
// The Highway targets whose decode tables registered themselves (attention_hwy.cc).
std::vector<int64_t> HwyAttentionTargets();

// Most (scale, min) groups a row can have: d / G with d <= 256, G >= 32.
inline constexpr int kMaxGroupsPerRow = 8;

}  // namespace kvq::cpu::internal
