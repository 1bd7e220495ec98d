// Instantiations of the decode-attention kernel for the bf16 cache, over every value kind
// and head dimension (attention_decode.cuh).
#include "attention_decode.cuh"

namespace kvq::gpu::attention {

KVQ_INSTANTIATE_DECODE_KEY(kBf16, 16)

}  // namespace kvq::gpu::attention
