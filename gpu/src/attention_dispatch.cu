// The runtime dispatch of a decode step's three kernels (kvq/gpu/attention_launch.h, layer
// (b)): head_dim and history format onto the launchers' compile-time values, over the lists of
// kvq/gpu/formats.h (KVQ_GPU_HEAD_DIMS x KVQ_GPU_HISTORY_FORMATS). A value with no kernel
// returns cudaErrorInvalidValue.
#include <cuda_runtime.h>

#include "attention_decode.cuh"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/formats.h"

namespace kvq::gpu::attention {

// The decode kernel's instantiations live in attention_decode_{int2,int4,bf16,tile2,tile4,fp8}.cu.
#define KVQ_ATTENTION_EXTERN(D, FMT) \
  extern template cudaError_t LaunchDecodeAttention<D, HistoryFormat::FMT>( \
      const DecodeKernelParams&, cudaStream_t);
#define KVQ_ATTENTION_EXTERN_FORMAT(FMT) KVQ_GPU_HEAD_DIMS(KVQ_ATTENTION_EXTERN, FMT)
KVQ_GPU_HISTORY_FORMATS(KVQ_ATTENTION_EXTERN_FORMAT)
#undef KVQ_ATTENTION_EXTERN_FORMAT
#undef KVQ_ATTENTION_EXTERN

cudaError_t DispatchDecodeAttention(int head_dim, HistoryFormat format,
                                    const DecodeKernelParams& p, cudaStream_t stream) {
#define KVQ_ATTENTION_CASE(D, FMT)                        \
  if (head_dim == D && format == HistoryFormat::FMT) {    \
    return LaunchDecodeAttention<D, HistoryFormat::FMT>(p, stream); \
  }
#define KVQ_ATTENTION_CASE_FORMAT(FMT) KVQ_GPU_HEAD_DIMS(KVQ_ATTENTION_CASE, FMT)
  KVQ_GPU_HISTORY_FORMATS(KVQ_ATTENTION_CASE_FORMAT)
#undef KVQ_ATTENTION_CASE_FORMAT
#undef KVQ_ATTENTION_CASE
  return cudaErrorInvalidValue;
}

int DecodeSharedBytes(int head_dim, HistoryFormat format) {
#define KVQ_ATTENTION_SMEM(D, FMT)                     \
  if (head_dim == D && format == HistoryFormat::FMT) { \
    return detail::DecodeSharedBytesFor<D, HistoryFormat::FMT>(); \
  }
#define KVQ_ATTENTION_SMEM_FORMAT(FMT) KVQ_GPU_HEAD_DIMS(KVQ_ATTENTION_SMEM, FMT)
  KVQ_GPU_HISTORY_FORMATS(KVQ_ATTENTION_SMEM_FORMAT)
#undef KVQ_ATTENTION_SMEM_FORMAT
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
