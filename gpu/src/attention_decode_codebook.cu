// Instantiations of the decode-attention kernel for codebook keys (spec 1.3), over every value
// kind and head dimension (attention_decode.cuh).
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

KVQ_INSTANTIATE_DECODE_KEY(kCodebook, 0)

}  // namespace kvq::gpu::attention
