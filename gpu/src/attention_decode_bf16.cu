// Instantiations of the decode-attention kernel for kBf16 history pages (one file per format
// so the three compile in parallel). The kernel itself is attention_decode.cuh.
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

template cudaError_t LaunchDecodeAttention<64, HistoryFormat::kBf16>(const DecodeKernelParams&,
                                                                   cudaStream_t);
template cudaError_t LaunchDecodeAttention<128, HistoryFormat::kBf16>(const DecodeKernelParams&,
                                                                    cudaStream_t);
template cudaError_t LaunchDecodeAttention<256, HistoryFormat::kBf16>(const DecodeKernelParams&,
                                                                    cudaStream_t);

}  // namespace kvq::gpu::attention
