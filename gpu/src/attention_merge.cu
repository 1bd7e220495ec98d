// The two small kernels around the decode kernel (kvq/gpu/attention_launch.h): the query
// rotation q~ = q·R_K (then P_br) before it, and the log-sum-exp merge of the split partials
// with R_V^T after it; plus the runtime dispatch of all three.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_decode.cuh"
#include "kvq/gpu/attention_launch.h"

namespace kvq::gpu::attention {

// Compiled in attention_decode_{int2,int4,bf16}.cu.
#define KVQ_ATTENTION_EXTERN(D, FMT) \
  extern template cudaError_t LaunchDecodeAttention<D, HistoryFormat::FMT>( \
      const DecodeKernelParams&, cudaStream_t);
KVQ_ATTENTION_EXTERN(64, kInt2)
KVQ_ATTENTION_EXTERN(128, kInt2)
KVQ_ATTENTION_EXTERN(256, kInt2)
KVQ_ATTENTION_EXTERN(64, kInt4)
KVQ_ATTENTION_EXTERN(128, kInt4)
KVQ_ATTENTION_EXTERN(256, kInt4)
KVQ_ATTENTION_EXTERN(64, kBf16)
KVQ_ATTENTION_EXTERN(128, kBf16)
KVQ_ATTENTION_EXTERN(256, kBf16)
#undef KVQ_ATTENTION_EXTERN

namespace {

constexpr int kRotationDense = 1;     // kvq::RotationKind::kDense
constexpr int kRotationHadamard = 2;  // kvq::RotationKind::kHadamard

template <int D>
__device__ __forceinline__ int BitReverse(int c) {
  constexpr int kBits = D == 64 ? 6 : (D == 128 ? 7 : 8);
  return static_cast<int>(__brev(static_cast<unsigned>(c)) >> (32 - kBits));
}

// One block per (query head, sequence), thread j computes channel j. The spec's rules bit for
// bit (spec/numerics.md §2-3): dense y[j] = sum_i x[i]*R[i][j], i ascending from +0, each
// product and sum rounded separately; FWHT butterflies with strides 1, 2, ..., block/2 then one
// multiply by fp32(1/sqrt(block)); then y[j] = x[beta(j)].
template <int D>
__global__ void __launch_bounds__(D) RotateQueriesKernel(const __grid_constant__ RotateQueriesParams p) {
  // Rows of R staged per pass: 32 KB, and never more than the D rows R has.
  constexpr int kRows = 8192 / D < D ? 8192 / D : D;
  __shared__ float x[D];
  __shared__ float y[D];
  __shared__ __align__(16) float rows[kRows][D];
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int j = threadIdx.x;
  const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h) * D;
  // The decode kernel after this one may launch now: its blocks set up and start their page
  // copies, then wait for this grid to finish before reading q_rot.
  detail::LaunchDependents();
  x[j] = p.q[row + j];
  __syncthreads();
  float v = x[j];
  if (p.rotation == kRotationDense) {
    // All loads of a pass are issued before the first use: one memory latency per pass, then
    // the spec's sequential sum over i from shared memory.
    const float4* r = reinterpret_cast<const float4*>(p.rotations + static_cast<int64_t>(h / p.q_per_kv) * D * D);
    float acc = 0.0f;
    for (int i0 = 0; i0 < D; i0 += kRows) {
      float4 stage[kRows / 4];
#pragma unroll
      for (int k = 0; k < kRows / 4; ++k) stage[k] = r[(i0 * D) / 4 + j + D * k];
#pragma unroll
      for (int k = 0; k < kRows / 4; ++k) reinterpret_cast<float4*>(&rows[0][0])[j + D * k] = stage[k];
      __syncthreads();
#pragma unroll 16
      for (int i = 0; i < kRows; ++i) acc = __fadd_rn(acc, __fmul_rn(x[i0 + i], rows[i][j]));
      __syncthreads();
    }
    v = acc;
  } else if (p.rotation == kRotationHadamard) {
    for (int s = 1; s < p.fwht_block; s <<= 1) {
      if ((j & s) == 0) {
        const float a = x[j];
        const float c = x[j + s];
        x[j] = __fadd_rn(a, c);
        x[j + s] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    v = __fmul_rn(x[j], p.fwht_scale);
  }
  if (p.bitrev) {
    y[j] = v;
    __syncthreads();
    v = y[BitReverse<D>(j)];
  }
  p.q_rot[row + j] = v;
}

// One block per (query head, sequence); 16 warps, so at B = 1 the few blocks still have many
// loads in flight: warp w reads splits 4w .. 4w+3, 4w+64, ... and rows 8w .. 8w+7 of R_V.
// The split weights 2^(m_s - M) go through shared memory, so the loop over splits issues
// independent loads; R_V^T is applied warp per output row (coalesced rows of R_V).
constexpr int kMergeThreads = 512;
constexpr int kMergeSplitChunk = 1024;  // splits whose weights are staged at a time

template <int D>
__global__ void __launch_bounds__(kMergeThreads) MergePartialsKernel(const __grid_constant__ MergeParams p) {
  __shared__ float weight[kMergeSplitChunk];
  __shared__ float y[D];      // history sum, un-bit-reversed
  __shared__ float back[D];   // mapped back to the original space
  __shared__ float red[kMergeThreads / 32];
  // Everything below reads the decode kernel's partials.
  detail::WaitForPrerequisiteGrid();
  const int hq = blockIdx.x;
  const int b = blockIdx.y;
  const int kvh = hq / p.q_per_kv;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int splits = p.total_splits;
  const int t = p.seq_lens[b];
  const bool bad_length = t < 1 || t > p.max_seq_len;
  const int64_t base = (static_cast<int64_t>(b) * p.num_q_heads + hq) * splits;

  // M = max_s m_s, then L = sum_s l_s 2^(m_s - M).
  float big = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += kMergeThreads) big = fmaxf(big, p.part_ml[2 * (base + s)]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  if (lane == 0) red[warp] = big;
  __syncthreads();
  big = red[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) big = fmaxf(big, red[w]);
  __syncthreads();

  // Warp w takes splits w, w + 4, ... (4 at a time, loads issued unconditionally: an empty
  // split's weight is 0 and its unwritten values are selected away), lane takes channels
  // lane + 32k; the 4 warps' sums then meet in shared memory.
  constexpr int kWarpsM = kMergeThreads / 32;
  constexpr int kPerLane = D / 32;
  float hist[kPerLane], win[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) hist[k] = win[k] = 0.0f;
  float sum = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += kMergeSplitChunk) {
    const int n = min(kMergeSplitChunk, splits - s0);
    for (int s = threadIdx.x; s < n; s += kMergeThreads) {
      const float l = p.part_ml[2 * (base + s0 + s) + 1];
      const float w = l > 0.0f ? exp2f(p.part_ml[2 * (base + s0 + s)] - big) : 0.0f;
      weight[s] = w;
      sum += l > 0.0f ? l * w : 0.0f;
    }
    __syncthreads();
    const float* acc = p.part_acc + (base + s0) * D + lane;
    for (int s = 4 * warp; s < n; s += 4 * kWarpsM) {
      float v[4][kPerLane];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int su = min(s + u, n - 1);
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) v[u][k] = acc[static_cast<int64_t>(su) * D + 32 * k];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const bool in = s + u < n;
        const float w = in ? weight[s + u] : 0.0f;
        const bool is_hist = s0 + s + u < p.hist_splits;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const float a = w != 0.0f ? v[u][k] * w : 0.0f;
          hist[k] += is_hist ? a : 0.0f;
          win[k] += is_hist ? 0.0f : a;
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) red[warp] = sum;
  // Cross-warp sums: back[] holds the window part for now, y[] the history part.
  __shared__ float part_hist[kWarpsM][D];
  __shared__ float part_win[kWarpsM][D];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    part_hist[warp][lane + 32 * k] = hist[k];
    part_win[warp][lane + 32 * k] = win[k];
  }
  __syncthreads();
  float win_c[D / kMergeThreads > 0 ? D / kMergeThreads : 1];
  for (int c = threadIdx.x, k = 0; c < D; c += kMergeThreads, ++k) {
    float h = 0.0f, w = 0.0f;
#pragma unroll
    for (int u = 0; u < kWarpsM; ++u) {
      h += part_hist[u][c];
      w += part_win[u][c];
    }
    // The history accumulated in the bit-reversed space: y[beta(c)] = o~[c].
    y[(p.rotate_history && p.bitrev) ? BitReverse<D>(c) : c] = h;
    win_c[k] = w;
  }
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarpsM; ++w) sum += red[w];

  if (p.rotate_history && p.rotation == kRotationDense) {
    // back[j] = sum_i y[i] * R[j][i]  (o = y · R^T)
    // kRows rows per warp step, their loads issued together (one latency per step).
    const float* r = p.rotations + static_cast<int64_t>(kvh) * D * D;
    constexpr int kRows = D >= 256 ? 4 : 8;
    float yv[D / 32];
#pragma unroll
    for (int k = 0; k < D / 32; ++k) yv[k] = y[lane + 32 * k];
    for (int j0 = warp * kRows; j0 < D; j0 += kWarpsM * kRows) {
      float rv[kRows][D / 32];
#pragma unroll
      for (int jj = 0; jj < kRows; ++jj)
#pragma unroll
        for (int k = 0; k < D / 32; ++k) rv[jj][k] = r[(j0 + jj) * D + lane + 32 * k];
#pragma unroll
      for (int jj = 0; jj < kRows; ++jj) {
        float part = 0.0f;
#pragma unroll
        for (int k = 0; k < D / 32; ++k) part += yv[k] * rv[jj][k];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if (lane == 0) back[j0 + jj] = part;
      }
    }
  } else if (p.rotate_history && p.rotation == kRotationHadamard) {
    // The normalised (block) Hadamard transform is its own inverse.
    for (int s = 1; s < p.fwht_block; s <<= 1) {
      for (int c = threadIdx.x; c < D; c += kMergeThreads) {
        if ((c & s) == 0) {
          const float a = y[c];
          const float e = y[c + s];
          y[c] = a + e;
          y[c + s] = a - e;
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < D; c += kMergeThreads) back[c] = y[c] * p.fwht_scale;
  } else {
    for (int c = threadIdx.x; c < D; c += kMergeThreads) back[c] = y[c];
  }
  __syncthreads();
  for (int c = threadIdx.x, k = 0; c < D; c += kMergeThreads, ++k) {
    const float o = (back[c] + win_c[k]) / sum;
    p.out[(static_cast<int64_t>(b) * p.num_q_heads + hq) * D + c] = bad_length ? NAN : o;
  }
}

}  // namespace

template <int HEAD_DIM>
cudaError_t LaunchRotateQueries(const RotateQueriesParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.batch > 65535 || p.num_q_heads < 1) return cudaErrorInvalidValue;
  RotateQueriesKernel<HEAD_DIM><<<dim3(p.num_q_heads, p.batch), HEAD_DIM, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int HEAD_DIM>
cudaError_t LaunchMergePartials(const MergeParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.batch > 65535 || p.num_kv_heads < 1 || p.total_splits < 1)
    return cudaErrorInvalidValue;
  const cudaError_t launched =
      detail::LaunchKernel(MergePartialsKernel<HEAD_DIM>, dim3(p.num_q_heads, p.batch),
                           dim3(kMergeThreads), 0, stream, p.programmatic_launch, p);
  if (launched != cudaSuccess) return launched;
  return cudaGetLastError();
}

template cudaError_t LaunchRotateQueries<64>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchRotateQueries<128>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchRotateQueries<256>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<64>(const MergeParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<128>(const MergeParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<256>(const MergeParams&, cudaStream_t);

cudaError_t DispatchDecodeAttention(int head_dim, HistoryFormat format,
                                    const DecodeKernelParams& p, cudaStream_t stream) {
#define KVQ_ATTENTION_CASE(D, FMT) \
  if (head_dim == D && format == HistoryFormat::FMT) return LaunchDecodeAttention<D, HistoryFormat::FMT>(p, stream);
  KVQ_ATTENTION_CASE(64, kInt2)
  KVQ_ATTENTION_CASE(128, kInt2)
  KVQ_ATTENTION_CASE(256, kInt2)
  KVQ_ATTENTION_CASE(64, kInt4)
  KVQ_ATTENTION_CASE(128, kInt4)
  KVQ_ATTENTION_CASE(256, kInt4)
  KVQ_ATTENTION_CASE(64, kBf16)
  KVQ_ATTENTION_CASE(128, kBf16)
  KVQ_ATTENTION_CASE(256, kBf16)
#undef KVQ_ATTENTION_CASE
  return cudaErrorInvalidValue;
}

cudaError_t DispatchRotateQueries(int head_dim, const RotateQueriesParams& p,
                                  cudaStream_t stream) {
  switch (head_dim) {
    case 64: return LaunchRotateQueries<64>(p, stream);
    case 128: return LaunchRotateQueries<128>(p, stream);
    case 256: return LaunchRotateQueries<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t DispatchMergePartials(int head_dim, const MergeParams& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return LaunchMergePartials<64>(p, stream);
    case 128: return LaunchMergePartials<128>(p, stream);
    case 256: return LaunchMergePartials<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

int DecodeSharedBytes(int head_dim, HistoryFormat format) {
#define KVQ_ATTENTION_SMEM(D, FMT) \
  if (head_dim == D && format == HistoryFormat::FMT) return detail::DecodeSharedBytesFor<D, HistoryFormat::FMT>();
  KVQ_ATTENTION_SMEM(64, kInt2)
  KVQ_ATTENTION_SMEM(128, kInt2)
  KVQ_ATTENTION_SMEM(256, kInt2)
  KVQ_ATTENTION_SMEM(64, kInt4)
  KVQ_ATTENTION_SMEM(128, kInt4)
  KVQ_ATTENTION_SMEM(256, kInt4)
  KVQ_ATTENTION_SMEM(64, kBf16)
  KVQ_ATTENTION_SMEM(128, kBf16)
  KVQ_ATTENTION_SMEM(256, kBf16)
#undef KVQ_ATTENTION_SMEM
  return 0;
}

}  // namespace kvq::gpu::attention
