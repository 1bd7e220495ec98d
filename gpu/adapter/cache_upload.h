// A CPU cache (cpu::PagedKVCache) on the device: the image DeviceCache uploads, made from the
// cache's raw storage (kvq/gpu/device_cache.h), for `kvq conform --backend gpu`, `kvq bench`,
// the CUDA backend's `attend` and the tests.
#pragma once

#include <vector>

#include "kvq/cpu_ref/cache.h"
#include "kvq/gpu/device_cache.h"

namespace kvq::gpu {

// Sequences `seqs` (a batch, in this order; repeats allowed) of `cache` as DeviceCache's host
// image. A quantized cache's pool planes, page tables, windows and rotations are copied as they
// are (same page ids; unused window rows NaN); a bf16 cache's dense rows are paged into bf16
// pages [num_pages, Hkv, P, d] (sequence b owns pages [b * max_pages, (b + 1) * max_pages)).
// Throws kvq::Error: an unknown or empty sequence, an empty batch (kInvalidArgument).
CacheImage ImageOf(const cpu::PagedKVCache& cache, const std::vector<int>& seqs);

// DeviceCache(ImageOf(cache, seqs)); throws as both do (kUnsupported without a device).
DeviceCache UploadCache(const cpu::PagedKVCache& cache, const std::vector<int>& seqs);

}  // namespace kvq::gpu
