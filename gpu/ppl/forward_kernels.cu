#include "forward_kernels.h"

#include <cuda_bf16.h>

namespace kvq::gpu::ppl {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t work, int threads = kThreads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > (1 << 30) ? (1 << 30) : blocks));
}

__device__ double WarpSum(double x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  return x;
}

// Σ over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the sum.
__device__ double BlockSum(double x) {
  __shared__ double partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  x = WarpSum(x);
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += partial[w];
    partial[0] = total;
  }
  __syncthreads();
  total = partial[0];
  __syncthreads();
  return total;
}

__global__ void EmbedKernel(const float* table, const int32_t* ids, int64_t rows, int width,
                            float* x) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    x[i] = table[static_cast<int64_t>(ids[r]) * width + (i - r * width)];
  }
}

// One block per row.
__global__ void RmsNormKernel(const float* x, const float* w, int width, float eps, float* out) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * width;
  double sum = 0.0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    sum += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
  }
  sum = BlockSum(sum);
  const float variance = static_cast<float>(sum / width);
  const float inv = 1.0f / sqrtf(variance + eps);
  float* o = out + r * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = w[i] * (xr[i] * inv);
}

// One block per row; dynamic shared memory: (Hq + Hkv)·d floats, then Hq + Hkv floats.
__global__ void QkvRopeKernel(const float* qkv, int64_t first, int hq, int hkv, int d,
                              const float* q_norm, const float* k_norm, float eps,
                              const float* cos, const float* sin, float* q, float* k_rows,
                              float* v_rows) {
  extern __shared__ float smem[];
  const int64_t r = blockIdx.x;
  const int heads = hq + hkv;
  const int qw = hq * d, kvw = hkv * d, fused = qw + 2 * kvw;
  const int qk = heads * d;
  float* vals = smem;
  float* inv = smem + qk;
  const float* src = qkv + r * fused;
  for (int i = threadIdx.x; i < qk; i += blockDim.x) vals[i] = src[i];
  for (int i = threadIdx.x; i < kvw; i += blockDim.x) v_rows[r * kvw + i] = src[qk + i];
  __syncthreads();
  if (q_norm != nullptr) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int h = warp; h < heads; h += warps) {
      double sum = 0.0;
      for (int i = lane; i < d; i += 32) {
        const double v = vals[h * d + i];
        sum += v * v;
      }
      sum = WarpSum(sum);
      if (lane == 0) inv[h] = 1.0f / sqrtf(static_cast<float>(sum / d) + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < qk; i += blockDim.x) {
      const int h = i / d, c = i - h * d;
      const float* wn = h < hq ? q_norm : k_norm;
      vals[i] = wn[c] * (vals[i] * inv[h]);
    }
    __syncthreads();
  }
  const int half = d / 2;
  const float* cr = cos + (first + r) * half;
  const float* sr = sin + (first + r) * half;
  for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
    const int h = j / half, i = j - h * half;
    const float a = vals[h * d + i], b = vals[h * d + i + half];
    const float lo = a * cr[i] + (-b) * sr[i];
    const float hi = b * cr[i] + a * sr[i];
    float* dst = h < hq ? q + r * qw + h * d : k_rows + r * kvw + (h - hq) * d;
    dst[i] = lo;
    dst[i + half] = hi;
  }
}

__global__ void SwiGluKernel(const float* gu, int64_t rows, int inter, float* act) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i - r * inter;
    const float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
    act[i] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void RoundBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  }
}

// 16-byte vectors: rows [tokens, Hkv, d] -> pool [pages, Hkv, P, d].
__global__ void PageBf16Kernel(const uint4* rows, int64_t tokens, int hkv, int vecs, int page,
                               uint4* pool) {
  const int64_t n = tokens * hkv * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = i / (static_cast<int64_t>(hkv) * vecs);
    const int64_t rest = i - token * hkv * vecs;
    const int64_t h = rest / vecs, c = rest - h * vecs;
    const int64_t pg = token / page, slot = token - pg * page;
    pool[((pg * hkv + h) * page + slot) * vecs + c] = rows[i];
  }
}

__global__ void GatherWindowsKernel(const uint4* k, const uint4* v, int64_t first, int batch,
                                    int row_vecs, int sink, int recent, uint4* sink_k,
                                    uint4* sink_v, uint4* recent_k, uint4* recent_v) {
  const int slots = sink + recent;
  const int64_t n = static_cast<int64_t>(batch) * slots * row_vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / (static_cast<int64_t>(slots) * row_vecs);
    const int64_t rest = i - b * slots * row_vecs;
    const int slot = static_cast<int>(rest / row_vecs);
    const int c = static_cast<int>(rest - static_cast<int64_t>(slot) * row_vecs);
    const int64_t t = first + b + 1;  // the cache length of sequence b
    int64_t pos;
    uint4 *dk, *dv;
    if (slot < sink) {
      pos = slot;
      if (pos >= t) continue;
      const int64_t at = (b * sink + slot) * row_vecs + c;
      dk = sink_k + at;
      dv = sink_v + at;
    } else {
      const int s = slot - sink;
      const int64_t begin = t <= sink ? t : (t - recent > sink ? t - recent : sink);
      const int64_t m = ((t - 1 - s) % recent + recent) % recent;
      pos = t - 1 - m;
      if (pos < begin) continue;
      const int64_t at = (b * recent + s) * row_vecs + c;
      dk = recent_k + at;
      dv = recent_v + at;
    }
    *dk = k[pos * row_vecs + c];
    *dv = v[pos * row_vecs + c];
  }
}

__global__ void IotaKernel(int32_t* lengths, int n, int offset) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    lengths[i] = offset + i;
  }
}

}  // namespace

cudaError_t LaunchEmbed(const float* table, const int32_t* ids, int64_t rows, int width,
                        float* x, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  EmbedKernel<<<Blocks(rows * width), kThreads, 0, stream>>>(table, ids, rows, width, x);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const float* x, const float* w, int64_t rows, int width, float eps,
                          float* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > (1LL << 31) - 1) return cudaErrorInvalidValue;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, w, width, eps, out);
  return cudaGetLastError();
}

cudaError_t LaunchQkvRope(const float* qkv, int64_t rows, int64_t first, int hq, int hkv, int d,
                          const float* q_norm, const float* k_norm, float eps, const float* cos,
                          const float* sin, float* q, float* k_rows, float* v_rows,
                          cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if ((q_norm == nullptr) != (k_norm == nullptr) || d % 2 != 0) return cudaErrorInvalidValue;
  const size_t bytes = (static_cast<size_t>(hq + hkv) * d + (hq + hkv)) * sizeof(float);
  if (bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        QkvRopeKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (status != cudaSuccess) return status;
  }
  QkvRopeKernel<<<static_cast<unsigned>(rows), kThreads, bytes, stream>>>(
      qkv, first, hq, hkv, d, q_norm, k_norm, eps, cos, sin, q, k_rows, v_rows);
  return cudaGetLastError();
}

cudaError_t LaunchSwiGlu(const float* gu, int64_t rows, int inter, float* act,
                         cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  SwiGluKernel<<<Blocks(rows * inter), kThreads, 0, stream>>>(gu, rows, inter, act);
  return cudaGetLastError();
}

cudaError_t LaunchRoundBf16(const float* x, int64_t n, uint16_t* y, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  RoundBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t LaunchPageBf16(const uint16_t* rows, int64_t tokens, int hkv, int d, int page_size,
                           uint16_t* pool, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (d % 8 != 0 || page_size < 1) return cudaErrorInvalidValue;
  const int vecs = d / 8;
  PageBf16Kernel<<<Blocks(tokens * hkv * vecs), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(rows), tokens, hkv, vecs, page_size,
      reinterpret_cast<uint4*>(pool));
  return cudaGetLastError();
}

cudaError_t LaunchGatherWindows(const uint16_t* k, const uint16_t* v, int64_t first, int batch,
                                int hkv, int d, int sink, int recent, uint16_t* sink_k,
                                uint16_t* sink_v, uint16_t* recent_k, uint16_t* recent_v,
                                cudaStream_t stream) {
  if (batch <= 0 || sink + recent <= 0) return cudaSuccess;
  if ((hkv * d) % 8 != 0 || recent < 1) return cudaErrorInvalidValue;
  const int row_vecs = hkv * d / 8;
  GatherWindowsKernel<<<Blocks(static_cast<int64_t>(batch) * (sink + recent) * row_vecs),
                        kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v), first, batch,
      row_vecs, sink, recent, reinterpret_cast<uint4*>(sink_k), reinterpret_cast<uint4*>(sink_v),
      reinterpret_cast<uint4*>(recent_k), reinterpret_cast<uint4*>(recent_v));
  return cudaGetLastError();
}

cudaError_t LaunchIota(int32_t* lengths, int n, int offset, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  IotaKernel<<<Blocks(n), kThreads, 0, stream>>>(lengths, n, offset);
  return cudaGetLastError();
}

}  // namespace kvq::gpu::ppl
