// The decode kernel's loop over fp8_e4m3 history pages (spec 1.2, spec/cache.md §5.2).
//
// The pages stream through a 3-stage cp.async pipeline as bytes; the tensor cores take the
// codes as fp16 (e4m3 ⊂ fp16, converted exactly in registers by cvt.rn.f16x2.e4m3x2), so no
// stage is ever widened in shared memory and four blocks fit a multiprocessor at d = 128.
// Rows are stored unpadded with their 16-byte pieces XOR-swizzled by the row (Fp8Offset), which
// keeps both loads below free of bank conflicts at d = 128 and 256.
//   QK^T: M = 16 tokens, N = 8 query heads, K = 16 channels a step. A = the key codes: thread
//         (gi, t4) loads one 32-bit word of row gi and of row gi + 8 at channels
//         [16 kk + 4 t4, 16 kk + 4 t4 + 4), its k positions (2 t4, 2 t4 + 1) taking the first
//         two and (2 t4 + 8, 2 t4 + 9) the last two (a channel order both operands share).
//         B = q~ * 2^e (e per head: max|q~| * 2^e in [2^11, 2^12), exact) as fp16 hi + lo;
//         the logit is c * 2^-e * s^_K * softmax scale * log2(e).
//   PV:   M = 16 channels, N = 8 heads, K = 16 tokens. A = V^T: thread gi loads one word of
//         each of its token rows (2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9) at channels
//         [32 mp + 4 gi, 32 mp + 4 gi + 4) and byte-permutes them into the fragments of two
//         m-tiles (m-tile 2 mp: M rows gi, gi + 8 = channels 32 mp + 4 gi + 0, + 1; m-tile
//         2 mp + 1: + 2, + 3). B = p * 2^7 as fp16 hi + lo (p <= 2^8: the running max moves
//         lazily); the accumulator is scaled by s^_V * 2^-7 once at the end.
// Reduction order is free on this path; the errors are the bf16 loop's (hi + lo operands).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention::detail {

template <int D>
struct Fp8Geometry {
  static constexpr int kRowBytes = D;
  static constexpr int kStageBytes = 2 * kTileTokens * kRowBytes;  // K rows then V rows
  static constexpr int kPieces = D / 16;     // 16-byte pieces a row
  static constexpr int kSwizzle = (kPieces < 8 ? kPieces : 8) - 1;
  static constexpr int kStages = 3;          // two tiles in flight while one is computed
  static constexpr int kBytes = kStages * kStageBytes;
};

// Byte offset of byte `c` of row `row` in a stage's rows: piece c / 16 stored at piece
// (c / 16) ^ (row & kSwizzle).
template <int D>
__device__ __forceinline__ int Fp8Offset(int row, int c) {
  using Geo = Fp8Geometry<D>;
  return row * Geo::kRowBytes + ((((c >> 4) ^ (row & Geo::kSwizzle))) << 4) + (c & 15);
}

// Two e4m3 bytes (the low 16 bits of v) to fp16x2, exactly.
__device__ __forceinline__ uint32_t E4m3x2ToF16x2(uint32_t v) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The split loop (attention_skeleton.cuh) over fp8_e4m3 history rows [begin, end) of sequence
// b, KV head kvh, for the block's query heads.
template <int D>
struct Fp8RowsLoop {
  using Geo = Fp8Geometry<D>;
  using Scores = ChunkScores<1>;
  using Probs = ChunkProbs<1>;
  static constexpr int kTileStep = 1;
  // p <= 2^kRescaleThresholdLog2 = 2^8 (the running max moves lazily), so p * 2^7 <= 2^15
  // stays inside fp16's range; values of p below 2^-31 are lost (at most 2^-31 a token of
  // the sum, against l >= 1).
  static constexpr float kPvScale = 128.0f;  // 2^7
  static_assert(kRescaleThresholdLog2 <= 8.0f, "p * kPvScale must stay below 65504");

  const DecodeKernelParams& p;
  unsigned char* smem;
  int kvh, b, begin, end;
  int lane, warp, gi, t4;
  int first_page, n_tiles;
  int append_tile;  // FirstAppendedTile: Issue waits for the append from this tile on
  int* page_ids;
  uint32_t bq_hi[D / 16][2];
  uint32_t bq_lo[D / 16][2];
  bool use_lo;
  float f0, f1;  // the logit factors of this thread's accumulator columns, heads 2 t4, 2 t4 + 1
  WarpState<D> st;

  // The page ids, then the first tiles in flight (before the query: the pages were written
  // before the rotation kernel started).
  __device__ __forceinline__ explicit Fp8RowsLoop(const SplitArgs& a)
      : p(a.p), smem(a.smem), kvh(a.kvh), b(a.b), begin(a.begin), end(a.end) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    page_ids = reinterpret_cast<int*>(smem + Geo::kBytes);
    first_page = begin >> p.page_size_log2;
    LoadSplitPages(p, b, begin, end, page_ids);
    append_tile = FirstAppendedTile(p, b, begin, end);
    __syncthreads();  // page ids
    n_tiles = (end - begin + kTileTokens - 1) / kTileTokens;
#pragma unroll
    for (int s = 0; s < Geo::kStages - 1; ++s) {
      if (s < n_tiles) Issue(s, s);
      CpAsyncCommit();
    }
  }

  __device__ __forceinline__ void Issue(int tile, int stage) const {
    if (tile >= append_tile) WaitForPrerequisiteGrid();
    const int page_size = 1 << p.page_size_log2;
    unsigned char* dst_stage = smem + stage * Geo::kStageBytes;
    const int first = begin + tile * kTileTokens;
    for (int idx = threadIdx.x; idx < 2 * kTileTokens * Geo::kPieces; idx += kThreads) {
      const int kv = idx / (kTileTokens * Geo::kPieces);
      const int rem = idx - kv * kTileTokens * Geo::kPieces;
      const int r = rem / Geo::kPieces;
      const int piece = rem - r * Geo::kPieces;
      const int tok = first + r;
      const bool valid = tok < end;
      const uint8_t* src = kv ? p.v_planes[kFp8CodesPlane] : p.k_planes[kFp8CodesPlane];
      if (valid) {
        const int page = page_ids[(tok >> p.page_size_log2) - first_page];
        const int slot = tok & (page_size - 1);
        src += page * (kv ? p.v_page_stride[kFp8CodesPlane] : p.k_page_stride[kFp8CodesPlane]) +
               kvh * (kv ? p.v_head_stride[kFp8CodesPlane] : p.k_head_stride[kFp8CodesPlane]) +
               static_cast<int64_t>(slot) * D;
      }
      CpAsync16(dst_stage + Fp8Offset<D>(kv * kTileTokens + r, piece * 16), src + piece * 16,
                valid);
    }
  }

  // q~ of head gi (the rotation kernel's output) times 2^e, as fp16 hi + lo, in the channel
  // order of the key loads: b0 of step kk takes channels 16 kk + 4 t4 + {0, 1}, b1 + {2, 3}.
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    WaitForQueries(p, b, a.head0);
    bool any_lo = false;
    int exponent = 0;  // e of head gi
    {
      const bool real = gi < p.heads_per_block;
      const float* q =
          p.q_rot + (static_cast<int64_t>(b) * p.num_q_heads + a.head0 + (real ? gi : 0)) * D;
      float2 v[D / 16][2];
      float mx = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          v[kk][half] = real ? *reinterpret_cast<const float2*>(q + 16 * kk + 4 * t4 + 2 * half)
                             : make_float2(0.f, 0.f);
          mx = fmaxf(mx, fmaxf(fabsf(v[kk][half].x), fabsf(v[kk][half].y)));
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (mx > 0.0f) exponent = 11 - ilogbf(mx);  // mx * 2^e in [2^11, 2^12)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          SplitF16(ldexpf(v[kk][half].x, exponent), ldexpf(v[kk][half].y, exponent),
                   bq_hi[kk][half], bq_lo[kk][half]);
          any_lo |= (bq_lo[kk][half] & 0x7fff7fffu) != 0u;
        }
      }
    }
    use_lo = __syncthreads_or(any_lo) != 0;
    BlockTimeline::InputsReady(p.timeline);
    // The logit factors of this thread's accumulator columns, heads 2 t4 and 2 t4 + 1.
    const float base = p.logit_scale_log2 * p.k_head_scale[kvh];
    f0 = ldexpf(base, -__shfl_sync(0xffffffffu, exponent, 8 * t4));
    f1 = ldexpf(base, -__shfl_sync(0xffffffffu, exponent, 8 * t4 + 4));
    st.Init();
  }

  // The warp's 16 rows of the tile start at begin + 64 tile + 16 warp.
  __device__ __forceinline__ bool HasRows(int tile) const {
    return begin + tile * kTileTokens + warp * kChunkTokens < end;
  }

  __device__ __forceinline__ int FirstTile() const { return 0; }

  __device__ __forceinline__ const unsigned char* LoadTile(int tile) const {
    CpAsyncWait<Geo::kStages - 2>();
    __syncthreads();  // the stage is in; every warp is done with the stage the next copy fills
    const int next = tile + Geo::kStages - 1;
    if (next < n_tiles) Issue(next, next % Geo::kStages);
    CpAsyncCommit();
    return smem + (tile % Geo::kStages) * Geo::kStageBytes;
  }

  // QK^T: the warp's 16 key rows start at row r0 = 16 warp of the stage.
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& s) const {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    const int r0 = warp * kChunkTokens;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int col = 16 * kk + 4 * t4;
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(r0 + gi, col));
      const uint32_t w8 =
          *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(r0 + gi + 8, col));
      const uint32_t a0 = E4m3x2ToF16x2(w0), a2 = E4m3x2ToF16x2(w0 >> 16);
      const uint32_t a1 = E4m3x2ToF16x2(w8), a3 = E4m3x2ToF16x2(w8 >> 16);
      MmaF16(c, a0, a1, a2, a3, bq_hi[kk][0], bq_hi[kk][1]);
      if (use_lo) MmaF16(c, a0, a1, a2, a3, bq_lo[kk][0], bq_lo[kk][1]);
    }
    const bool valid_a = chunk_first + gi < end;
    const bool valid_b = chunk_first + gi + 8 < end;
    s.s[0][0] = valid_a ? c[0] * f0 : -INFINITY;
    s.s[0][1] = valid_a ? c[1] * f1 : -INFINITY;
    s.s[0][2] = valid_b ? c[2] * f0 : -INFINITY;
    s.s[0][3] = valid_b ? c[3] * f1 : -INFINITY;
  }

  __device__ __forceinline__ void Softmax(const Scores& s, Probs& pr) {
    NoRescale none;
    WarpSoftmax(st, none, s, pr);
  }

  // PV: the warp's value rows start at row kTileTokens + 16 warp of the stage.
  __device__ __forceinline__ void Values(const unsigned char* stage, int, const Scores&,
                                         const Probs& pr) {
    const int r0 = warp * kChunkTokens;
    uint32_t hi_a, lo_a, hi_b, lo_b;
    SplitF16(pr.p[0][0] * kPvScale, pr.p[0][1] * kPvScale, hi_a, lo_a);
    SplitF16(pr.p[0][2] * kPvScale, pr.p[0][3] * kPvScale, hi_b, lo_b);
    const uint32_t bh0 = Transpose8x8(hi_a), bh1 = Transpose8x8(hi_b);
    const uint32_t bl0 = Transpose8x8(lo_a), bl1 = Transpose8x8(lo_b);
#pragma unroll
    for (int mp = 0; mp < D / 32; ++mp) {
      const int col = 32 * mp + 4 * gi;
      const int vr = kTileTokens + r0 + 2 * t4;
      const uint32_t v0 = *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(vr, col));
      const uint32_t v1 = *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(vr + 1, col));
      const uint32_t v8 = *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(vr + 8, col));
      const uint32_t v9 = *reinterpret_cast<const uint32_t*>(stage + Fp8Offset<D>(vr + 9, col));
      // (token 2 t4, token 2 t4 + 1) pairs of channel bytes 0, 1 and of 2, 3.
      const uint32_t p01_lo = __byte_perm(v0, v1, 0x5140), p01_hi = __byte_perm(v0, v1, 0x7362);
      const uint32_t p89_lo = __byte_perm(v8, v9, 0x5140), p89_hi = __byte_perm(v8, v9, 0x7362);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t x01 = j == 0 ? p01_lo : p01_hi, x89 = j == 0 ? p89_lo : p89_hi;
        const uint32_t a0 = E4m3x2ToF16x2(x01), a1 = E4m3x2ToF16x2(x01 >> 16);
        const uint32_t a2 = E4m3x2ToF16x2(x89), a3 = E4m3x2ToF16x2(x89 >> 16);
        MmaF16(st.acc[2 * mp + j], a0, a1, a2, a3, bh0, bh1);
        MmaF16(st.acc[2 * mp + j], a0, a1, a2, a3, bl0, bl1);
      }
    }
  }

  __device__ __forceinline__ void ReleaseTile(int) const {}

  // s^_V * 2^-7 once: the accumulator is sum_t p_t * 2^7 * e(v_t).
  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    CpAsyncWait<0>();
    const float vs_scale = p.v_head_scale[kvh] / kPvScale;
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[mt][i] *= vs_scale;
    }
    __syncthreads();
    const int g = gi;
    CombineAndStore<D>(
        p, st,
        [&](int mt, int upper) { return 32 * (mt >> 1) + 4 * g + 2 * (mt & 1) + upper; }, smem,
        b, a.head0, a.split);
  }
};

// fp8_e4m3 keys and values (spec 1.2): Fp8RowsLoop.
template <>
struct HistoryLoop<Format::kFp8E4m3> {
  template <int D, class K, class V, QuantLoop LOOP>
  __device__ __forceinline__ static void Split(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
    SplitLoop<Fp8RowsLoop<D>>(SplitArgs{p, smem, kvh, head0, b, split, begin, end});
  }
  template <int D, class K, class V>
  static constexpr int SharedBytes() {
    return Fp8Geometry<D>::kBytes;
  }
};

}  // namespace kvq::gpu::attention::detail
