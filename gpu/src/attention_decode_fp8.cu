// Instantiations of the decode-attention kernel for fp8_e4m3 keys (spec 1.2), over every value kind
// and head dimension (attention_decode.cuh).
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

KVQ_INSTANTIATE_DECODE_KEY(kFp8E4m3, 8)

}  // namespace kvq::gpu::attention
