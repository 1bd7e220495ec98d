// Instantiations of the decode-attention kernel for affine_tile keys (spec 1.1), 4-bit codes, over every value kind
// and head dimension (attention_decode.cuh).
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

KVQ_INSTANTIATE_DECODE_KEY(kAffineTile, 4)

}  // namespace kvq::gpu::attention
