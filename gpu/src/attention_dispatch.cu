// The runtime dispatch of a decode step's three kernels (kvq/gpu/attention_launch.h, layer
// (b)): head_dim and the keys' and values' kinds onto the launchers' compile-time values, over
// the lists of kvq/gpu/formats.h (KVQ_GPU_HEAD_DIMS x KVQ_GPU_KEY_KINDS x KVQ_GPU_VALUE_KINDS).
// A value with no kernel returns cudaErrorInvalidValue.
#include <cuda_runtime.h>

#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/formats.h"

namespace kvq::gpu::attention {

// The product of the kind lists: X(key format, key bits, value format, value bits, head_dim).
#define KVQ_DECODE_PAIR(VF, VB, KF, KB, D, X) X(KF, KB, VF, VB, D)
#define KVQ_DECODE_KEY(KF, KB, D, X) KVQ_GPU_VALUE_KINDS(KVQ_DECODE_PAIR, KF, KB, D, X)
#define KVQ_DECODE_DIM(D, X) KVQ_GPU_KEY_KINDS(KVQ_DECODE_KEY, D, X)
#define KVQ_DECODE_KINDS(X) KVQ_GPU_HEAD_DIMS(KVQ_DECODE_DIM, X)
#define KVQ_KIND_TYPES(KF, KB, VF, VB) \
  HistoryKind<Format::KF, KB>, HistoryKind<Format::VF, VB>

// The decode kernel's instantiations live in attention_decode_<key kind>.cu.
#define KVQ_ATTENTION_EXTERN(KF, KB, VF, VB, D)                                               \
  extern template cudaError_t LaunchDecodeAttention<D, KVQ_KIND_TYPES(KF, KB, VF, VB)>(       \
      const DecodeKernelParams&, cudaStream_t);                                              \
  extern template int DecodeSharedBytesOf<D, KVQ_KIND_TYPES(KF, KB, VF, VB)>();
KVQ_DECODE_KINDS(KVQ_ATTENTION_EXTERN)
#undef KVQ_ATTENTION_EXTERN

namespace {
bool Is(const DecodeKinds& kinds, Format kf, int kb, Format vf, int vb) {
  return kinds.key_format == kf && kinds.key_bits == kb && kinds.value_format == vf &&
         kinds.value_bits == vb;
}
}  // namespace

cudaError_t DispatchDecodeAttention(int head_dim, const DecodeKinds& kinds,
                                    const DecodeKernelParams& p, cudaStream_t stream) {
#define KVQ_ATTENTION_CASE(KF, KB, VF, VB, D)                                          \
  if (head_dim == D && Is(kinds, Format::KF, KB, Format::VF, VB)) {                    \
    return LaunchDecodeAttention<D, KVQ_KIND_TYPES(KF, KB, VF, VB)>(p, stream);        \
  }
  KVQ_DECODE_KINDS(KVQ_ATTENTION_CASE)
#undef KVQ_ATTENTION_CASE
  return cudaErrorInvalidValue;
}

int DecodeSharedBytes(int head_dim, const DecodeKinds& kinds) {
#define KVQ_ATTENTION_SMEM(KF, KB, VF, VB, D)                                          \
  if (head_dim == D && Is(kinds, Format::KF, KB, Format::VF, VB)) {                    \
    return DecodeSharedBytesOf<D, KVQ_KIND_TYPES(KF, KB, VF, VB)>();                   \
  }
  KVQ_DECODE_KINDS(KVQ_ATTENTION_SMEM)
#undef KVQ_ATTENTION_SMEM
  return 0;
}

cudaError_t DispatchRotateQueries(int head_dim, const RotateQueriesParams& p,
                                  cudaStream_t stream) {
#define KVQ_ROTATE_CASE(D, ...) \
  if (head_dim == D) return LaunchRotateQueries<D>(p, stream);
  KVQ_GPU_HEAD_DIMS(KVQ_ROTATE_CASE)
#undef KVQ_ROTATE_CASE
  return cudaErrorInvalidValue;
}

cudaError_t DispatchMergePartials(int head_dim, const MergeParams& p, cudaStream_t stream) {
#define KVQ_MERGE_CASE(D, ...) \
  if (head_dim == D) return LaunchMergePartials<D>(p, stream);
  KVQ_GPU_HEAD_DIMS(KVQ_MERGE_CASE)
#undef KVQ_MERGE_CASE
  return cudaErrorInvalidValue;
}

}  // namespace kvq::gpu::attention
