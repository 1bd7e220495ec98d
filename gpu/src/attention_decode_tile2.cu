// Instantiations of the decode-attention kernel for kTileInt2 history (tiled keys, INT2
// values; one file per kind so they compile in parallel). The kernel itself is
// attention_decode.cuh.
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

#define KVQ_INSTANTIATE_DECODE(D, FMT) \
  template cudaError_t LaunchDecodeAttention<D, HistoryFormat::FMT>(const DecodeKernelParams&, \
                                                                    cudaStream_t);
KVQ_GPU_HEAD_DIMS(KVQ_INSTANTIATE_DECODE, kTileInt2)
#undef KVQ_INSTANTIATE_DECODE

}  // namespace kvq::gpu::attention
