// The rotation of a write path as the CUDA kernels take it (spec/numerics.md §3): one struct,
// filled in one place from the WriteParams, shared by every kernel that rotates: the fused
// write (x~ = x·R, then P_br), the decode step's query rotation (q~ = q·R_K, then P_br) and its
// merge (the inverse map of the value rotation, o = y·R_Vᵀ).
#pragma once

#include "kvq/common/params.h"

namespace kvq::gpu {

// The per-KV-head data of K or of V on the device (head_data.inc, as kvq::HeadData on the
// host): one pointer per array row (the dense rotations; null when absent) and one [Hkv] fp32
// array per per-head scalar (clip ratio, fp8 scale, ...), null when every head takes its
// WriteParams value. The write kernels,
// the decode step and the GPU forward take it whole.
struct HeadData {
  // [Hkv, extent] per array row when present (rotation: [Hkv, d, d] fp32 when the params'
  // rotation is kDense), [Hkv] fp32 per scalar row.
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  const Type* name = nullptr;
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) const float* name = nullptr;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
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
