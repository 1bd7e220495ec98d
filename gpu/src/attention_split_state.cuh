// The online softmax of a split and the partial it leaves: WarpState (m, l and the
// accumulator of one thread), the 4 warps' combine into the block's partial, the empty
// partial, and the split's page ids. Shared by every loop of the decode kernel.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "attention_common.cuh"
#include "kvq/gpu/attention_launch.h"

namespace kvq::gpu::attention::detail {

// Online-softmax state of one thread: heads h0 = 2*(lane%4) and h0 + 1 (accumulator columns),
// acc rows as the channel map of the path says.
template <int D>
struct WarpState {
  float acc[D / 16][4];
  float m[2];
  float l[2];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }

  // Takes the logits sl (exp2 domain; -inf for masked tokens) of rows (gi, gi+8) x heads
  // (h0, h0+1) in accumulator layout, rescales the state and returns p = exp2(sl - m) in pr
  // (m: the running max, moved lazily, see kRescaleThresholdLog2).
  // The max reduces over the 8 lanes that share lane % 4. Requires a finite logit per head in
  // the 16 rows (the caller skips chunks without a valid token).
  // Returns whether any lane rescaled (alpha != 1 somewhere in the warp).
  //
  // The max reduction (three dependent shuffles) runs only when some lane of the warp holds a
  // logit above its head's running max + kRescaleThresholdLog2: otherwise no head's max could
  // move (the reduced max would not exceed the threshold either), alpha = 1 and p follows
  // directly. The result is bit-identical to reducing on every chunk; after the first chunks
  // of a split the vote is almost always false, which takes the reduction's latency off the
  // chunk's critical path.
  __device__ __forceinline__ bool Update(const float (&sl)[4], float (&pr)[4], float (&alpha)[2]) {
    return UpdateN<1>(reinterpret_cast<const float(&)[1][4]>(sl),
                      reinterpret_cast<float(&)[1][4]>(pr), alpha);
  }
  // The same over N chunks of 16 rows at once (one max reduction and rescale for all).
  // Requires a finite logit per head in the first chunk.
  template <int N>
  __device__ __forceinline__ bool UpdateN(const float (&sl)[N][4], float (&pr)[N][4],
                                          float (&alpha)[2]) {
    float mx0 = fmaxf(sl[0][0], sl[0][2]);
    float mx1 = fmaxf(sl[0][1], sl[0][3]);
#pragma unroll
    for (int n = 1; n < N; ++n) {
      mx0 = fmaxf(mx0, fmaxf(sl[n][0], sl[n][2]));
      mx1 = fmaxf(mx1, fmaxf(sl[n][1], sl[n][3]));
    }
    // m = -inf before the first chunk: -inf + 8 = -inf, so the first finite max is taken.
    const bool above = mx0 > m[0] + kRescaleThresholdLog2 || mx1 > m[1] + kRescaleThresholdLog2;
    alpha[0] = alpha[1] = 1.0f;
    const bool rescale = __any_sync(0xffffffffu, above);
    if (rescale) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      const float mn0 = mx0 > m[0] + kRescaleThresholdLog2 ? mx0 : m[0];
      const float mn1 = mx1 > m[1] + kRescaleThresholdLog2 ? mx1 : m[1];
      alpha[0] = Exp2(m[0] - mn0);  // m = -inf on the first chunk: alpha = 0
      alpha[1] = Exp2(m[1] - mn1);
      m[0] = mn0;
      m[1] = mn1;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        acc[i][0] *= alpha[0];
        acc[i][1] *= alpha[1];
        acc[i][2] *= alpha[0];
        acc[i][3] *= alpha[1];
      }
    }
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      pr[n][0] = Exp2(sl[n][0] - m[0]);
      pr[n][1] = Exp2(sl[n][1] - m[1]);
      pr[n][2] = Exp2(sl[n][2] - m[0]);
      pr[n][3] = Exp2(sl[n][3] - m[1]);
      sum0 += pr[n][0] + pr[n][2];
      sum1 += pr[n][1] + pr[n][3];
    }
    l[0] = l[0] * alpha[0] + sum0;
    l[1] = l[1] * alpha[1] + sum1;
    return rescale;
  }
};

// Sums v over the 8 lanes sharing lane % 4.
__device__ __forceinline__ float SumOverRows(float v) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Writes the m = -inf, l = 0 partial of an empty split for the block's heads.
__device__ __forceinline__ void StoreEmptyPartial(const DecodeKernelParams& p, int b, int head0,
                                                  int split) {
  const int splits = static_cast<int>(gridDim.z);
  for (int h = threadIdx.x; h < p.heads_per_block; h += kThreads) {
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * splits + split;
    p.part_ml[2 * row] = -INFINITY;
    p.part_ml[2 * row + 1] = 0.0f;
  }
}

// Page ids of history tokens [begin, end) into shared memory: ids[i] is the page of the
// split's page-relative index i (page index begin/P + i); at most kSplitPageIdBytes (P >= 16).
inline constexpr int kSplitPageIdBytes = (kMaxSplitTokens / 16 + 1) * 4;
__device__ __forceinline__ void LoadSplitPages(const DecodeKernelParams& p, int b, int begin,
                                               int end, int* ids) {
  const int32_t* table = p.page_tables + static_cast<int64_t>(b) * p.page_table_stride;
  const int first = begin >> p.page_size_log2;
  const int n = ((end - 1) >> p.page_size_log2) - first + 1;
  for (int i = threadIdx.x; i < n; i += kThreads) ids[i] = table[first + i];
}

// ---- A DecodeStep's two waits (DecodeKernelParams::append_lengths, query_ready) -----------

// Waits until the rotated queries of the block's heads (sequence b, heads head0 ..
// head0 + heads_per_block - 1) are written: with query_ready, until the rotation blocks of
// those heads have marked their words (a thread a word spins; the block's barrier orders every
// thread's reads after the acquires), else until the kernel before this one has finished.
// Called by every thread of the block.
__device__ __forceinline__ void WaitForQueries(const DecodeKernelParams& p, int b, int head0) {
  if (p.query_ready == nullptr) {
    WaitForPrerequisiteGrid();
    return;
  }
  const int per_sequence = p.num_q_heads / p.query_ready_heads;
  const int first = head0 / p.query_ready_heads;
  const int words = (head0 + p.heads_per_block - 1) / p.query_ready_heads - first + 1;
  if (static_cast<int>(threadIdx.x) < words) {
    const int* word = p.query_ready + static_cast<int64_t>(b) * per_sequence + first +
                      static_cast<int>(threadIdx.x);
    int done = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(done) : "l"(word) : "memory");
      if (done != 0) break;
      __nanosleep(64);
    }
  }
  __syncthreads();
}

// H(t) = F * floor(max(0, t - S0 - W) / F): the history tokens of a sequence of length t
// (spec/cache.md §2; CacheParams::HistoryTokens).
__device__ __forceinline__ int HistoryTokensAt(const DecodeKernelParams& p, int t) {
  return max(0, t - p.recent - p.sink) / p.flush * p.flush;
}

// The first tile (split-relative) of the history split [begin, end) of sequence b that holds
// tokens a DecodeStep's append writes (history tokens [H(L), H(L + 1)), L = append_lengths[b]:
// the demoted or flushed ones, at the end of the history): the split's pipeline waits for the
// kernel before this one (which completes after the append) before it issues that tile's
// copy, and copies the tiles before it at once. INT_MAX when no append runs or the split
// holds none of them; 0 for a length the append flags (< 0: read nothing early).
__device__ __forceinline__ int FirstAppendedTile(const DecodeKernelParams& p, int b, int begin,
                                                 int end) {
  if (p.append_lengths == nullptr) return INT_MAX;
  const int length = p.append_lengths[b];
  if (length < 0) return 0;
  const int first = HistoryTokensAt(p, length);
  const int last = HistoryTokensAt(p, length + 1);
  if (first >= last || first >= end || last <= begin) return INT_MAX;
  return (max(first, begin) - begin) / kTileTokens;
}

// The partial of one (head, channel) i of the block, from the warps' states in shared
// memory (CombineAndStore's loop body, written once for both of its loops).
#define KVQ_COMBINE_STORE_COLUMN(i)                                                              \
    const int h = i / D;                                                                         \
    const int c = i - h * D;                                                                     \
    float big = -INFINITY;                                                                       \
_Pragma("unroll")                                                                                \
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, wm[w * kMaxHeadsPerBlock + h]);            \
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * splits + split;  \
    if (big == -INFINITY) {                                                                      \
      if (c == 0) {                                                                              \
        p.part_ml[2 * row] = -INFINITY;                                                          \
        p.part_ml[2 * row + 1] = 0.0f;                                                           \
      }                                                                                          \
      continue;                                                                                  \
    }                                                                                            \
    float a = 0.0f;                                                                              \
    float l = 0.0f;                                                                              \
_Pragma("unroll")                                                                                \
    for (int w = 0; w < kWarps; ++w) {                                                           \
      const float mw = wm[w * kMaxHeadsPerBlock + h];                                            \
      if (mw == -INFINITY) continue;                                                             \
      const float f = exp2f(mw - big);                                                           \
      a += wacc[(w * kMaxHeadsPerBlock + h) * D + c] * f;                                        \
      l += wl[w * kMaxHeadsPerBlock + h] * f;                                                    \
    }                                                                                            \
    p.part_acc[row * D + c] = a;                                                                 \
    if (c == 0) {                                                                                \
      p.part_ml[2 * row] = big;                                                                  \
      p.part_ml[2 * row + 1] = l;                                                                \
    }

// Combines the 4 warps' states through shared memory and writes the block's partial.
// channel(mt, upper) maps accumulator row gi (+8 when upper) of m-tile mt to a channel.
// Call after every warp finished its last chunk and the shared stages are free. UNROLL: the
// unroll factor of the store loop, or 0 for the compiler's choice. That choice moves with the
// code around the call: the bf16 cache's loop asks for 4 (with the compiler's, 4-5% slower
// since the split-loop hooks); the others keep the compiler's (measured no better with 4).
template <int D, int UNROLL = 0, typename ChannelMap>
__device__ __forceinline__ void CombineAndStore(const DecodeKernelParams& p, WarpState<D>& st,
                                                ChannelMap channel, unsigned char* smem, int b,
                                                int head0, int split) {
  float* wacc = reinterpret_cast<float*>(smem);          // [kWarps][8][D]
  float* wm = wacc + kWarps * kMaxHeadsPerBlock * D;     // [kWarps][8]
  float* wl = wm + kWarps * kMaxHeadsPerBlock;           // [kWarps][8]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int h0 = 2 * (lane & 3);
  const float l0 = SumOverRows(st.l[0]);
  const float l1 = SumOverRows(st.l[1]);
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
    for (int upper = 0; upper < 2; ++upper) {
      const int c = channel(mt, upper);
      wacc[(warp * kMaxHeadsPerBlock + h0) * D + c] = st.acc[mt][2 * upper];
      wacc[(warp * kMaxHeadsPerBlock + h0 + 1) * D + c] = st.acc[mt][2 * upper + 1];
    }
  }
  if (lane < 4) {
    wm[warp * kMaxHeadsPerBlock + h0] = st.m[0];
    wm[warp * kMaxHeadsPerBlock + h0 + 1] = st.m[1];
    wl[warp * kMaxHeadsPerBlock + h0] = l0;
    wl[warp * kMaxHeadsPerBlock + h0 + 1] = l1;
  }
  __syncthreads();
  const int splits = static_cast<int>(gridDim.z);
  if constexpr (UNROLL == 0) {  // the compiler's choice
    for (int i = threadIdx.x; i < p.heads_per_block * D; i += kThreads) {
      KVQ_COMBINE_STORE_COLUMN(i)
    }
  } else {
#pragma unroll UNROLL
    for (int i = threadIdx.x; i < p.heads_per_block * D; i += kThreads) {
      KVQ_COMBINE_STORE_COLUMN(i)
    }
  }
}

#undef KVQ_COMBINE_STORE_COLUMN

}  // namespace kvq::gpu::attention::detail
