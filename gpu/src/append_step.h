// Inside the library: AppendStep (kvq/gpu/write.h) launched right after a kernel it may
// overlap. DecodeStep (attention.cu) queues its query rotation first and the append after it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvq/common/params.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {

// AppendStep's checks and launches; with overlap_previous its first kernel is launched with
// programmatic dependent launch: it starts while the kernel before it on the stream runs,
// shares no memory with it, and completes only after it (as every later kernel of the append
// does after the one before it). AppendStep is this with overlap_previous = false.
void AppendStepLaunches(const CacheParams& c, const uint16_t* key, const uint16_t* value,
                        int batch, const int32_t* lengths, const int32_t* page_tables,
                        int max_pages, const HeadData& key_heads, const HeadData& value_heads,
                        const PagePool& key_pool, const PagePool& value_pool,
                        const Windows& windows, int* error_flags, bool overlap_previous,
                        cudaStream_t stream);

}  // namespace kvq::gpu
