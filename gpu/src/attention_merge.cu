// The two small kernels around the decode kernel (kvq/gpu/attention_launch.h): the query
// rotation q~ = q·R_K (then P_br) before it, and the log-sum-exp merge of the split partials
// with R_V^T after it. Their dispatch (with the decode kernel's) is attention_dispatch.cu.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention {

namespace {

constexpr int kRotationDense = static_cast<int>(RotationKind::kDense);
constexpr int kRotationHadamard = static_cast<int>(RotationKind::kHadamard);

// beta(c) over the log2(D) bits of a channel (kvq::BitReverse).
template <int D>
__device__ __forceinline__ int ChannelBitReverse(int c) {
  constexpr int kBits = D == 64 ? 6 : (D == 128 ? 7 : 8);
  return static_cast<int>(BitReverse(static_cast<uint32_t>(c), kBits));
}

// One block per (head chunk, sequence) and D x H threads: heads [blockIdx.x * H,
// (blockIdx.x + 1) * H), H = p.heads_per_block, all of one KV head (they share R_K, which the
// block stages once); thread (h, j) = threadIdx.x / D, % D computes channel j of head h.
// The spec's rules bit for bit (spec/numerics.md §2-3): dense y[j] = sum_i x[i]*R[i][j], i
// ascending from +0, each product and sum rounded separately; FWHT butterflies with strides
// 1, 2, ..., block/2 then one multiply by fp32(1/sqrt(block)); then y[j] = x[beta(j)].
template <int D>
__device__ __forceinline__ void RotateQuery(const RotateQueriesParams& p) {
  // Rows of R staged per pass: 32 KB, and never more than the D rows R has.
  constexpr int kRows = 8192 / D < D ? 8192 / D : D;
  __shared__ float x[kAuxMaxThreads / D][D];
  __shared__ __align__(16) float rows[kRows][D];
  const int heads = p.heads_per_block;
  const int threads = heads * D;
  const int h = threadIdx.x / D;
  const int j = threadIdx.x - h * D;
  const int head0 = blockIdx.x * heads;
  const int b = blockIdx.y;
  const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * D;
  // The kernel after this one may launch now: the decode kernel's blocks set up and start
  // their page copies, then wait for this grid to finish (or for this block's word in
  // p.ready) before reading q_rot. The word is reset first, visibly, so that nothing launched
  // after this point reads what the workspace held before.
  int* ready = p.ready != nullptr ? p.ready + blockIdx.y * gridDim.x + blockIdx.x : nullptr;
  if (ready != nullptr) {
    if (threadIdx.x == 0) {
      *ready = 0;
      __threadfence();
    }
    __syncthreads();
  }
  detail::LaunchDependents();
  const bool dense = p.rotation.kind == kRotationDense;
  const float4* r =
      dense ? reinterpret_cast<const float4*>(p.rotation.matrices +
                                              static_cast<int64_t>(head0 / p.q_per_kv) * D * D)
            : nullptr;
  constexpr int kChunk4 = kRows * D / 4;  // float4s of a pass
  // A pass's rows are copied in together (one memory latency a pass), then each thread runs the
  // spec's sequential sum over i from shared memory. The first pass's copy and an L2 prefetch
  // of the later passes' rows are issued before the query's own load, so that the query and R
  // share one memory latency and the later passes read L2.
  auto copy_pass = [&](int i0) {
    for (int e = threadIdx.x; e < kChunk4; e += threads) {
      detail::CpAsync16(reinterpret_cast<float4*>(&rows[0][0]) + e, r + (i0 * D) / 4 + e, true);
    }
    detail::CpAsyncCommit();
  };
  if (dense) {
    copy_pass(0);
    const char* later = reinterpret_cast<const char*>(r + kChunk4);
    for (int line = threadIdx.x; line < (D - kRows) * D * 4 / 128; line += threads) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(later + 128 * line)));
    }
  }
  x[h][j] = p.q[row + j];
  __syncthreads();
  float v = x[h][j];
  if (dense) {
    float acc = 0.0f;
    for (int i0 = 0; i0 < D; i0 += kRows) {
      if (i0 > 0) copy_pass(i0);
      detail::CpAsyncWait<0>();
      __syncthreads();
#pragma unroll 16
      for (int i = 0; i < kRows; ++i) acc = __fadd_rn(acc, __fmul_rn(x[h][i0 + i], rows[i][j]));
      __syncthreads();
    }
    v = acc;
  } else if (p.rotation.kind == kRotationHadamard) {
    for (int s = 1; s < p.rotation.fwht_block; s <<= 1) {
      if ((j & s) == 0) {
        const float a = x[h][j];
        const float c = x[h][j + s];
        x[h][j] = __fadd_rn(a, c);
        x[h][j + s] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    v = __fmul_rn(x[h][j], p.rotation.fwht_scale);
  }
  if (p.rotation.bitrev) {
    __syncthreads();  // every read of x above is done
    x[h][j] = v;
    __syncthreads();
    v = x[h][ChannelBitReverse<D>(j)];
  }
  p.q_rot[row + j] = v;
  if (ready != nullptr) {
    // Every thread's row is written; made visible to the device before the word says so.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicExch(ready, 1);
    }
  }
  // programmatic_launch: complete only after the kernel before this one.
  detail::WaitForPrerequisiteGrid();
}

template <int D>
__global__ void __launch_bounds__(kAuxMaxThreads) RotateQueriesKernel(const __grid_constant__ RotateQueriesParams p) {
  detail::BlockTimeline::Enter(p.timeline, BlockKind::kRotate);
  RotateQuery<D>(p);
  detail::BlockTimeline::Exit(p.timeline);
}

// Sums N values a lane over the warp (N a power of two <= 32) by recursive halving: N - 1 +
// 5 - log2(N) shuffles instead of 5 N. Returns, in v[0], the total of value
// i = lane >> (5 - log2 N) on the lanes whose low 5 - log2 N bits are 0, and their i (-1 on the
// other lanes, which hold a copy).
template <int N, int O = 16>
__device__ __forceinline__ int WarpReduceScatter(float (&v)[N], int lane) {
  if constexpr (O == 0) {
    return 0;
  } else if constexpr (N > 1) {
    // Lanes with bit O set keep the upper half of the values, the others the lower half.
    const bool upper = (lane & O) != 0;
    float half[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float send = upper ? v[i] : v[i + N / 2];
      const float keep = upper ? v[i + N / 2] : v[i];
      half[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    const int rest = WarpReduceScatter<N / 2, O / 2>(half, lane);
    v[0] = half[0];
    if (rest < 0) return -1;
    return (upper ? N / 2 : 0) + rest;
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    const int rest = WarpReduceScatter<1, O / 2>(v, lane);
    return ((lane & O) != 0 || rest < 0) ? -1 : 0;
  }
}

constexpr int kMergeThreads = 512;
constexpr int kMergeWarps = kMergeThreads / 32;

template <int D, int MAX_HEADS>
__device__ __forceinline__ void MergeHeads(const MergeParams& p) {
  constexpr int kWarpsPerHead = kMergeWarps / MAX_HEADS;
  constexpr int kSplitChunk = 1024 / MAX_HEADS;  // splits whose weights are staged at a time
  constexpr int kPerLane = D / 32;
  static_assert(kMergeWarps % MAX_HEADS == 0, "warps per head");
  __shared__ float weight[MAX_HEADS][kSplitChunk];
  __shared__ float y[MAX_HEADS][D];     // history sum, un-bit-reversed
  __shared__ float back[MAX_HEADS][D];  // the history sum mapped back to the original space
  __shared__ float win[MAX_HEADS][D];   // window sum
  __shared__ float part[kMergeWarps][D];
  __shared__ float red[kMergeWarps];
  const int heads = MAX_HEADS == 1 ? 1 : p.heads_per_block;
  const int head0 = blockIdx.x * heads;
  const int b = blockIdx.y;
  const int kvh = head0 / p.q_per_kv;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // R_V^T (dense): a warp takes kRows rows of R_V a step. R_V is not the decode kernel's
  // output, so the first step's rows load before the wait, while the decode grid drains (the
  // decode blocks let this grid launch early).
  const bool dense = p.rotate_history && p.rotation.kind == kRotationDense;
  const float* r = p.rotation.matrices + static_cast<int64_t>(kvh) * D * D;
  constexpr int kRows = 4;
  float rv[kRows][kPerLane];
  auto load_rows = [&](int j0) {
#pragma unroll
    for (int jj = 0; jj < kRows; ++jj)
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) rv[jj][k] = r[(j0 + jj) * D + lane + 32 * k];
  };
  if (dense && warp * kRows < D) load_rows(warp * kRows);
  const int t = p.seq_lens[b];  // not the decode kernel's output either
  const bool bad_length = t < 1 || t > p.max_seq_len;
  // Everything below reads the decode kernel's partials.
  detail::WaitForPrerequisiteGrid();
  detail::BlockTimeline::InputsReady(p.timeline);
  const int hw = warp / kWarpsPerHead;  // this warp's head
  const int wi = warp % kWarpsPerHead;  // and its index among the head's warps
  const bool active = hw < heads;
  const int splits = p.total_splits;
  const int64_t base = (static_cast<int64_t>(b) * p.num_q_heads + head0 + (active ? hw : 0)) * splits;
  // Sum (or max) over the head's warps of a per-warp value (through red[]; ends with a barrier).
  auto head_reduce = [&](float v, bool is_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float total = red[hw * kWarpsPerHead];
#pragma unroll
    for (int u = 1; u < kWarpsPerHead; ++u) {
      const float other = red[hw * kWarpsPerHead + u];
      total = is_max ? fmaxf(total, other) : total + other;
    }
    __syncthreads();
    return total;
  };

  // Lane takes channels lane + 32k; warp wi of a head takes splits 4 wi .. 4 wi + 3, then every
  // 4 * kWarpsPerHead-th, and weighs splits wi * 32 + lane, then every 32 * kWarpsPerHead-th.
  // The first chunk's (m, l) load once, for the max and for the weights.
  const int n0 = min(kSplitChunk, splits);
  const int s_ml = wi * 32 + lane;
  float2 ml0 = make_float2(-INFINITY, 0.0f);
  if (active && s_ml < n0) ml0 = reinterpret_cast<const float2*>(p.part_ml)[base + s_ml];

  // M = max_s m_s of the warp's head, then L = sum_s l_s 2^(m_s - M).
  float big = ml0.x;
  if (active) {
    for (int s = s_ml + kWarpsPerHead * 32; s < splits; s += kWarpsPerHead * 32) {
      big = fmaxf(big, p.part_ml[2 * (base + s)]);
    }
  }
  big = head_reduce(big, true);

  float hist[kPerLane], wsum[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) hist[k] = wsum[k] = 0.0f;
  float sum = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += kSplitChunk) {
    const int n = min(kSplitChunk, splits - s0);
    if (active) {
      for (int s = s_ml; s < n; s += kWarpsPerHead * 32) {
        const float2 ml = s0 == 0 && s == s_ml
                              ? ml0
                              : reinterpret_cast<const float2*>(p.part_ml)[base + s0 + s];
        const float w = ml.y > 0.0f ? exp2f(ml.x - big) : 0.0f;
        weight[hw][s] = w;
        sum += ml.y > 0.0f ? ml.y * w : 0.0f;
      }
    }
    __syncthreads();
    if (active) {
      const float* acc = p.part_acc + (base + s0) * D + lane;
      for (int s = 4 * wi; s < n; s += 4 * kWarpsPerHead) {
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
          const float w = in ? weight[hw][s + u] : 0.0f;
          const bool is_hist = s0 + s + u < p.hist_splits;
#pragma unroll
          for (int k = 0; k < kPerLane; ++k) {
            const float a = w != 0.0f ? v[u][k] * w : 0.0f;
            hist[k] += is_hist ? a : 0.0f;
            wsum[k] += is_hist ? 0.0f : a;
          }
        }
      }
    }
    __syncthreads();
  }
  sum = head_reduce(sum, false);

  // The head's warps' sums meet in part[]: the history part (into y, in the bit-reversed
  // space the history accumulated in: y[beta(c)] = o~[c]), then the window part.
  for (int round = 0; round < 2; ++round) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) part[warp][lane + 32 * k] = round == 0 ? hist[k] : wsum[k];
    __syncthreads();
    for (int i = threadIdx.x; i < heads * D; i += kMergeThreads) {
      const int h = i / D;
      const int c = i - h * D;
      float v = 0.0f;
#pragma unroll
      for (int u = 0; u < kWarpsPerHead; ++u) v += part[h * kWarpsPerHead + u][c];
      if (round == 0) {
        y[h][(p.rotate_history && p.rotation.bitrev) ? ChannelBitReverse<D>(c) : c] = v;
      } else {
        win[h][c] = v;
      }
    }
    __syncthreads();
  }

  if (dense) {
    // back[h][j] = sum_i y[h][i] * R[j][i]  (o = y · R^T). A step's row loads are issued
    // together (one latency a step); a lane forms its partial dot of every (head, row) pair
    // and one reduce-scatter leaves each pair's sum on one lane.
    constexpr int kPairs = MAX_HEADS * kRows;
    static_assert(kPairs <= 32 && (kPairs & (kPairs - 1)) == 0, "pairs of a warp step");
    for (int j0 = warp * kRows; j0 < D; j0 += kMergeWarps * kRows) {
      if (j0 != warp * kRows) load_rows(j0);
      float dot[kPairs];
#pragma unroll
      for (int h = 0; h < MAX_HEADS; ++h) {
        float yv[kPerLane];
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) yv[k] = h < heads ? y[h][lane + 32 * k] : 0.0f;
#pragma unroll
        for (int jj = 0; jj < kRows; ++jj) {
          float d = 0.0f;
#pragma unroll
          for (int k = 0; k < kPerLane; ++k) d += yv[k] * rv[jj][k];
          dot[h * kRows + jj] = d;
        }
      }
      const int pair = WarpReduceScatter(dot, lane);
      if (pair >= 0 && pair / kRows < heads) back[pair / kRows][j0 + pair % kRows] = dot[0];
    }
  } else if (p.rotate_history && p.rotation.kind == kRotationHadamard) {
    // The normalised (block) Hadamard transform is its own inverse.
    for (int s = 1; s < p.rotation.fwht_block; s <<= 1) {
      for (int i = threadIdx.x; i < heads * D; i += kMergeThreads) {
        const int h = i / D;
        const int c = i - h * D;
        if ((c & s) == 0) {
          const float a = y[h][c];
          const float e = y[h][c + s];
          y[h][c] = a + e;
          y[h][c + s] = a - e;
        }
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < heads * D; i += kMergeThreads) {
      back[i / D][i % D] = y[i / D][i % D] * p.rotation.fwht_scale;
    }
  } else {
    for (int i = threadIdx.x; i < heads * D; i += kMergeThreads) back[i / D][i % D] = y[i / D][i % D];
  }
  // The head sums L, one a head (red[] still holds the last head_reduce's per-warp values).
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D; i += kMergeThreads) {
    const int h = i / D;
    const int c = i - h * D;
    const float o = (back[h][c] + win[h][c]) / red[h * kWarpsPerHead];
    p.out[(static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * D + c] = bad_length ? NAN : o;
  }
}

// Two blocks a multiprocessor at d <= 128 (<= 64 registers): with one, as 98 registers gave,
// the 256 blocks of a B = 32 step ran in two rounds after the decode grid.
template <int D, int MAX_HEADS>
__global__ void __launch_bounds__(kMergeThreads, D >= 256 ? 1 : 2)
    MergePartialsKernel(const __grid_constant__ MergeParams p) {
  detail::BlockTimeline::Enter(p.timeline, BlockKind::kMerge);
  MergeHeads<D, MAX_HEADS>(p);
  detail::BlockTimeline::Exit(p.timeline);
}

}  // namespace

template <int HEAD_DIM>
cudaError_t LaunchRotateQueries(const RotateQueriesParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.batch > 65535 || p.num_q_heads < 1) return cudaErrorInvalidValue;
  const int heads = p.heads_per_block;
  if (p.q_per_kv < 1 || p.num_q_heads % p.q_per_kv != 0 || heads < 1 ||
      heads > MaxAuxHeads(HEAD_DIM) || p.q_per_kv % heads != 0)
    return cudaErrorInvalidValue;
  const cudaError_t launched =
      launch::LaunchKernel(RotateQueriesKernel<HEAD_DIM>, dim3(p.num_q_heads / heads, p.batch),
                           dim3(heads * HEAD_DIM), 0, stream, p.programmatic_launch, p);
  if (launched != cudaSuccess) return launched;
  return cudaGetLastError();
}

template <int HEAD_DIM>
cudaError_t LaunchMergePartials(const MergeParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.batch > 65535 || p.num_kv_heads < 1 || p.total_splits < 1)
    return cudaErrorInvalidValue;
  const int heads = p.heads_per_block;
  if (p.q_per_kv < 1 || p.num_q_heads % p.q_per_kv != 0 || heads < 1 ||
      heads > MaxAuxHeads(HEAD_DIM) || p.q_per_kv % heads != 0)
    return cudaErrorInvalidValue;
  const dim3 grid(p.num_q_heads / heads, p.batch);
  // The narrowest instantiation that holds the block's heads: its warps split over exactly
  // that many heads (a 4-head block on the 8-head one would leave half its warps idle).
  auto kernel = heads == 1   ? MergePartialsKernel<HEAD_DIM, 1>
                : heads <= 4 ? MergePartialsKernel<HEAD_DIM, 4>
                             : MergePartialsKernel<HEAD_DIM, kAuxMaxHeads>;
  const cudaError_t launched = launch::LaunchKernel(kernel, grid, dim3(kMergeThreads), 0, stream,
                                                    p.programmatic_launch, p);
  if (launched != cudaSuccess) return launched;
  return cudaGetLastError();
}

template cudaError_t LaunchRotateQueries<64>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchRotateQueries<128>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchRotateQueries<256>(const RotateQueriesParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<64>(const MergeParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<128>(const MergeParams&, cudaStream_t);
template cudaError_t LaunchMergePartials<256>(const MergeParams&, cudaStream_t);

}  // namespace kvq::gpu::attention
