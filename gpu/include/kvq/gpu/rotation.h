// The rotation of a write path as the CUDA kernels take it (spec/numerics.md §3): one struct,
// filled in one place from the WriteParams, shared by every kernel that rotates: the fused
// write (x~ = x·R, then P_br), the decode step's query rotation (q~ = q·R_K, then P_br) and its
// merge (the inverse map of the value rotation, o = y·R_Vᵀ).
#pragma once

#include "kvq/common/params.h"

namespace kvq::gpu {

// Per-KV-head write data of K or of V (device pointers).
struct HeadData {
  const float* rotation = nullptr;  // [Hkv, d, d] fp32 when the params' rotation is kDense
  const float* clip = nullptr;      // [Hkv] clip ratios in (0, 1], or null: the params' clip
};

// Layer (a): the rotation fields of a kernel's parameter struct.
struct RotationArgs {
  int kind = 0;                     // kvq::RotationKind as int
  const float* matrices = nullptr;  // [Hkv, d, d] fp32, KV head h at + h*d*d (kDense only)
  int fwht_block = 0;               // WriteParams::fwht_block() (kHadamard)
  float fwht_scale = 0.0f;          // WriteParams::fwht_scale(): fp32(1/sqrt(block))
  bool bitrev = false;              // P_br after the rotation
};

// The rotation of `p` with the matrices of `heads` (used only when p.rotation is kDense).
// Checks nothing: the runtime API that calls it validates p and the pointers.
RotationArgs MakeRotationArgs(const WriteParams& p, const HeadData& heads);

}  // namespace kvq::gpu
