// Timing helpers for programs that time the CUDA path (`kvq bench`, the GPU tests of these
// helpers): CUDA events around each run, warm-up runs first, the median, and optionally a cold
// L2 (a buffer twice the L2 size overwritten before each run). Kept out of the library's public
// headers: production code does not time itself. Every CUDA call is checked (kvq::Error).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/gpu/device_cache.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/write.h"

namespace kvq::bench {

// Median time in microseconds of `iters` runs of `step` (which enqueues work on the default
// stream), CUDA events around each run, `warmup` untimed runs first. When `cold_l2` is set, a
// buffer twice the L2 size is overwritten before every run.
template <typename Step>
double MedianDeviceMicros(Step&& step, int iters, int warmup, bool cold_l2) {
  KVQ_CHECK(iters >= 1 && warmup >= 0, kInvalidArgument, "iters ", iters, " / warmup ", warmup);
  int device = 0, l2_bytes = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&device));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  gpu::DeviceArray<unsigned char> flush(cold_l2 ? 2 * static_cast<size_t>(l2_bytes) : 0);
  cudaEvent_t start, stop;
  KVQ_CUDA_CHECK(cudaEventCreate(&start));
  KVQ_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < warmup + iters; ++i) {
    if (cold_l2) KVQ_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes()));
    KVQ_CUDA_CHECK(cudaEventRecord(start));
    step();
    KVQ_CUDA_CHECK(cudaEventRecord(stop));
    KVQ_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KVQ_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= warmup) times.push_back(ms * 1000.0f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  KVQ_CUDA_CHECK(cudaGetLastError());
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Median time in microseconds of `iters` decode steps of `cache` on the device over q
// [B, Hq, d] fp32 (host; copied once), as MedianDeviceMicros times them.
inline double MedianAttendMicros(gpu::DeviceCache& cache, const float* q, int iters, int warmup,
                                 bool cold_l2) {
  cache.SetQuery(q);
  return MedianDeviceMicros([&cache] { cache.Step(nullptr); }, iters, warmup, cold_l2);
}

// The fused write of flat rows timed, with its outputs (host pointers): uploads x [n, d] fp32
// and the rotation ([d, d] for kDense, else ignored), runs gpu::WriteRows `warmup` untimed and
// `iters` timed times with a cold L2, checks the non-finite flag (kNonFinite), and returns the
// median with the last run's output planes (LayoutOf(p): plane i [n, row_bytes(i)]). Throws
// kvq::Error as WriteRows does, or kUnsupported without a device.
struct TimedRowWrite {
  double median_us = 0;
  std::vector<uint8_t> planes[kMaxPlanes];  // the planes of LayoutOf(p), as EncodeRows gives them
};
inline TimedRowWrite TimeWriteRows(const WriteParams& p, const float* rotation, const float* x,
                                   size_t n, int iters, int warmup) {
  constexpr const char* kWhat = "TimeWriteRows";
  p.Validate();
  KVQ_CHECK(gpu::HasCudaDevice(), kUnsupported, kWhat, ": no CUDA device");
  KVQ_CHECK(n > 0 && n <= static_cast<size_t>(INT_MAX), kInvalidArgument, kWhat, ": row count ",
            n, " is outside [1, ", INT_MAX, "]");
  KVQ_CHECK(x != nullptr, kInvalidArgument, kWhat, ": x is null");
  const bool dense = p.rotation == RotationKind::kDense;
  KVQ_CHECK(!dense || rotation != nullptr, kInvalidArgument, kWhat, ": rotation is null");
  const size_t d = static_cast<size_t>(p.head_dim);
  gpu::DeviceArray<float> dx(x, n * d);
  gpu::DeviceArray<float> dr(dense ? rotation : nullptr, dense ? d * d : 0);
  const FormatLayout layout = LayoutOf(p);
  gpu::DeviceArray<uint8_t> planes[kMaxPlanes];
  gpu::RowOutputs out;
  for (int i = 0; i < layout.num_planes; ++i) {
    // n rows of a token plane, n / G_k of a tile plane (FormatLayout::RowsPerPage over n).
    planes[i] = gpu::DeviceArray<uint8_t>(static_cast<size_t>(layout.RowsPerPage(i, n)) *
                                          layout.plane(i).row_bytes());
    out.planes[i] = planes[i].get();
  }
  gpu::DeviceArray<int> flags(1);
  KVQ_CUDA_CHECK(cudaMemset(flags.get(), 0, flags.bytes()));
  TimedRowWrite result;
  result.median_us = MedianDeviceMicros(
      [&] { gpu::WriteRows(p, dr.get(), dx.get(), n, out, flags.get()); }, iters, warmup, true);
  gpu::CheckErrorFlags(flags.get(), kWhat);
  for (int i = 0; i < layout.num_planes; ++i) result.planes[i] = planes[i].Download();
  return result;
}

}  // namespace kvq::bench
