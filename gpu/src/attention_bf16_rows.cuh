// The decode kernel's loop over bf16 rows: the sink + recent window of a quantized cache and
// the pages of the bf16 cache (Bf16RowsLoop).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"

namespace kvq::gpu::attention::detail {

// ------------------------------------------------------------------------------------------
// bf16 rows: the sink + recent window of a quantized cache (PAGED = false) or the pages of the
// bf16 cache (PAGED = true). Rows [begin, end) of the segment.

template <int D>
struct Bf16Geometry {
  static constexpr int kRowStride = (D + 8) * 2;  // bytes; +16 keeps ldmatrix conflict-free
  static constexpr int kStageBytes = 2 * kTileTokens * kRowStride;
  static constexpr int kPieces = D / 8;           // 16-byte pieces a row
};

// The split loop (attention_skeleton.cuh) over bf16 rows: the query as bf16 hi + lo fragments
// of head gi (natural channel order), K rows by ldmatrix, V^T by ldmatrix.trans, p as bf16
// hi + lo. STAGES pipeline stages (1: the window's few tiles, loaded one at a time).
template <int D, bool PAGED, int STAGES>
struct Bf16RowsLoop {
  using Geo = Bf16Geometry<D>;
  using Scores = ChunkScores<1>;
  using Probs = ChunkProbs<1>;
  static constexpr int kTileStep = 1;

  const DecodeKernelParams& p;
  unsigned char* smem;
  int kvh, b, begin, end, n_sink, recent_begin;
  int lane, warp, gi, t4;
  int first_page, n_tiles;
  int* page_ids;
  uint32_t bq_hi[D / 16][2];
  uint32_t bq_lo[D / 16][2];
  bool use_lo;
  WarpState<D> st;

  __device__ __forceinline__ explicit Bf16RowsLoop(const SplitArgs& a)
      : p(a.p), smem(a.smem), kvh(a.kvh), b(a.b), begin(a.begin), end(a.end),
        n_sink(a.n_sink), recent_begin(a.recent_begin) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    n_tiles = (end - begin + kTileTokens - 1) / kTileTokens;
    page_ids = reinterpret_cast<int*>(smem + STAGES * Geo::kStageBytes);
    first_page = begin >> p.page_size_log2;
  }

  // Query fragments of head gi (B operand of QK, natural channel order), as bf16 hi + lo; the
  // page ids published by the same barrier, then the first tiles in flight.
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    bool any_lo = false;
    {
      const bool real = gi < p.heads_per_block;
      const float* q =
          p.q + (static_cast<int64_t>(b) * p.num_q_heads + a.head0 + (real ? gi : 0)) * D;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int c = 16 * kk + 8 * half + 2 * t4;
          const float2 v = real ? *reinterpret_cast<const float2*>(q + c) : make_float2(0.f, 0.f);
          SplitBf16(v.x, v.y, bq_hi[kk][half], bq_lo[kk][half]);
          any_lo |= (bq_lo[kk][half] & 0x7fff7fffu) != 0u;
        }
      }
    }
    if constexpr (PAGED) LoadSplitPages(p, b, begin, end, page_ids);
    use_lo = __syncthreads_or(any_lo) != 0;  // also publishes page_ids
    st.Init();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) Issue(s, s);
      CpAsyncCommit();
    }
  }

  __device__ __forceinline__ void Issue(int tile, int stage) const {
    const int64_t row_elems = static_cast<int64_t>(p.num_kv_heads) * D;
    const int page_size = 1 << p.page_size_log2;
    unsigned char* dst_stage = smem + stage * Geo::kStageBytes;
    const int first = begin + tile * kTileTokens;
    // A fixed trip count unrolled by 4: the copies' address arithmetic of four pieces in
    // flight at once (the loop as `idx += kThreads` up to a bound left the unroll factor to the
    // compiler's cost model, which took 2 here and 4 before the split-loop hooks: 4-6% on the
    // bf16 cache's decode).
    constexpr int kCopies = 2 * kTileTokens * Geo::kPieces / kThreads;
    static_assert(2 * kTileTokens * Geo::kPieces % kThreads == 0, "whole copy rounds");
#pragma unroll 4
    for (int i = 0; i < kCopies; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
      const int kv = idx / (kTileTokens * Geo::kPieces);
      const int rem = idx - kv * kTileTokens * Geo::kPieces;
      const int r = rem / Geo::kPieces;
      const int piece = rem - r * Geo::kPieces;
      const int tok = first + r;
      const bool valid = tok < end;
      const uint16_t* src;
      if constexpr (PAGED) {
        const uint8_t* pool = kv ? p.v_planes[kBf16RowsPlane] : p.k_planes[kBf16RowsPlane];
        const int64_t stride =
            kv ? p.v_page_stride[kBf16RowsPlane] : p.k_page_stride[kBf16RowsPlane];
        if (valid) {
          const int page = page_ids[(tok >> p.page_size_log2) - first_page];
          const int slot = tok & (page_size - 1);
          src = reinterpret_cast<const uint16_t*>(pool + page * stride) +
                (static_cast<int64_t>(kvh) * page_size + slot) * D;
        } else {
          src = reinterpret_cast<const uint16_t*>(pool);
        }
      } else {
        if (tok < n_sink) {
          const uint16_t* sink = kv ? p.sink_v : p.sink_k;
          src = sink + (static_cast<int64_t>(b) * p.sink + tok) * row_elems + kvh * D;
        } else {
          const uint16_t* ring = kv ? p.recent_v : p.recent_k;
          const int pos = valid ? recent_begin + (tok - n_sink) : 0;
          const int slot = pos % p.ring_slots;
          src = ring + (static_cast<int64_t>(b) * p.ring_slots + slot) * row_elems + kvh * D;
        }
      }
      CpAsync16(dst_stage + kv * kTileTokens * Geo::kRowStride + r * Geo::kRowStride + piece * 16,
                src + piece * 8, valid);
    }
  }

  // The warp's 16 rows of the tile start at begin + 64 tile + 16 warp.
  __device__ __forceinline__ bool HasRows(int tile) const {
    return begin + tile * kTileTokens + warp * kChunkTokens < end;
  }

  __device__ __forceinline__ int FirstTile() const { return 0; }

  __device__ __forceinline__ const unsigned char* LoadTile(int tile) {
    if constexpr (STAGES == 1) {
      // No pipeline (the window is a few tiles): load, wait, compute, and keep the buffer
      // until every warp is done with it.
      if (tile > 0) __syncthreads();
      Issue(tile, 0);
      CpAsyncCommit();
      CpAsyncWait<0>();
      __syncthreads();
    } else {
      CpAsyncWait<STAGES - 2>();
      __syncthreads();
      const int next = tile + STAGES - 1;
      if (next < n_tiles) Issue(next, next % STAGES);
      CpAsyncCommit();
    }
    return smem + (tile % STAGES) * Geo::kStageBytes;
  }

  // QK^T: A = K rows (ldmatrix), B = q hi (+ lo when some query needs it).
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& s) const {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    // This lane's ldmatrix row address, formed once: k-step kk is 32 bytes further. (Written
    // out: left to the compiler, the lane terms were re-derived from %tid at every k-step.)
    const unsigned char* ka = stage + warp * kChunkTokens * Geo::kRowStride +
                              ((lane & 7) + 8 * ((lane >> 3) & 1)) * Geo::kRowStride +
                              8 * (lane >> 4) * 2;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      LdMatrixX4(a, ka + 32 * kk);
      MmaBf16(c, a[0], a[1], a[2], a[3], bq_hi[kk][0], bq_hi[kk][1]);
      if (use_lo) MmaBf16(c, a[0], a[1], a[2], a[3], bq_lo[kk][0], bq_lo[kk][1]);
    }
    const bool valid_a = chunk_first + gi < end;
    const bool valid_b = chunk_first + gi + 8 < end;
    const float f = p.logit_scale_log2;
    s.s[0][0] = valid_a ? c[0] * f : -INFINITY;
    s.s[0][1] = valid_a ? c[1] * f : -INFINITY;
    s.s[0][2] = valid_b ? c[2] * f : -INFINITY;
    s.s[0][3] = valid_b ? c[3] * f : -INFINITY;
  }

  __device__ __forceinline__ void Softmax(const Scores& s, Probs& pr) {
    NoRescale none;
    WarpSoftmax(st, none, s, pr);
  }

  // PV: A = V^T (ldmatrix.trans), B = p as bf16 hi + lo.
  __device__ __forceinline__ void Values(const unsigned char* stage, int, const Scores&,
                                         const Probs& pr) {
    // This lane's ldmatrix.trans row address, formed once: m-tile mt is 32 bytes further.
    const unsigned char* va = stage + (kTileTokens + warp * kChunkTokens) * Geo::kRowStride +
                              ((lane & 7) + 8 * (lane >> 4)) * Geo::kRowStride +
                              8 * ((lane >> 3) & 1) * 2;
    uint32_t hi_a, lo_a, hi_b, lo_b;
    SplitBf16(pr.p[0][0], pr.p[0][1], hi_a, lo_a);
    SplitBf16(pr.p[0][2], pr.p[0][3], hi_b, lo_b);
    const uint32_t bh0 = Transpose8x8(hi_a), bh1 = Transpose8x8(hi_b);
    const uint32_t bl0 = Transpose8x8(lo_a), bl1 = Transpose8x8(lo_b);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      uint32_t a[4];
      LdMatrixX4Trans(a, va + 32 * mt);
      MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
      MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
    }
  }

  __device__ __forceinline__ void ReleaseTile(int) const {}

  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    CpAsyncWait<0>();
    __syncthreads();
    const int g = gi;
    CombineAndStore<D, PAGED ? 4 : 0>(
        p, st, [&](int mt, int upper) { return 16 * mt + g + 8 * upper; }, smem, b, a.head0,
        a.split);
  }
};

}  // namespace kvq::gpu::attention::detail
