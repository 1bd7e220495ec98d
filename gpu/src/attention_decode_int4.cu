// Instantiations of the decode-attention kernel for kInt4 history pages (one file per format
// so the three compile in parallel). The kernel itself is attention_decode.cuh.
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

#define KVQ_INSTANTIATE_DECODE(D, FMT) \
  template cudaError_t LaunchDecodeAttention<D, HistoryFormat::FMT>(const DecodeKernelParams&, \
                                                                    cudaStream_t);
KVQ_GPU_HEAD_DIMS(KVQ_INSTANTIATE_DECODE, kInt4)
#undef KVQ_INSTANTIATE_DECODE

}  // namespace kvq::gpu::attention
