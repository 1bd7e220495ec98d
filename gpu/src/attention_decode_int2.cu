// Instantiations of the decode-attention kernel for affine_token keys, 2-bit codes, over every value kind
// and head dimension (attention_decode.cuh).
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

KVQ_INSTANTIATE_DECODE_KEY(kAffineToken, 2)

}  // namespace kvq::gpu::attention
