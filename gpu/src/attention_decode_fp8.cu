// Instantiations of the decode-attention kernel for kFp8 history pages (spec 1.2; one file per
// format so they compile in parallel). The kernel itself is attention_decode.cuh.
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

#define KVQ_INSTANTIATE_DECODE(D, FMT) \
  template cudaError_t LaunchDecodeAttention<D, HistoryFormat::FMT>(const DecodeKernelParams&, \
                                                                    cudaStream_t);
KVQ_GPU_HEAD_DIMS(KVQ_INSTANTIATE_DECODE, kFp8)
#undef KVQ_INSTANTIATE_DECODE

}  // namespace kvq::gpu::attention
