// The decode kernel's loop over tiled keys (affine_tile, spec 1.1: KIVI / OScaR) with per-token
// values (TileKeySplit, the history kinds kTileInt2 / kTileInt4).
//
// The decode algebra of a tile (spec/cache.md §5.1): with x^[t][j] = n^_t (code[t][j] s^[j] +
// m^[j]) over the tile's per-channel scale s^ and min m^,
//   q~ . x^_t = n^_t (sum_j a[j] code[t][j] + c),  a = q~ o s^,  c = q~ . m^,
// so a warp folds its key tile's scales into the query once (a, c per query head) and QK^T runs
// on the tensor cores with the codes as exact integers against a (bf16 hi + lo, 2^-17
// relative): mma.sync m16n8k16, M = 16 tokens, N = 8 (heads; with PACK their hi and lo parts in
// the column halves, as QuantSplit), K = channels. The logit is then n^ (acc + c).
//
// Operands. A tile row of codes is channel-major: channel j's G_k codes are SLICE = G_k * b / 8
// bytes, token r of the tile at byte r % SLICE, field r / SLICE (numerics.md §8.1). The MMA row
// i of the warp's m-tile m (tokens [16 m, 16 m + 16) of the key tile) is token 16 m + ChunkRow(i)
// (the order PV reads the value rows in), so lane (gi, t4) needs, per channel, the byte of
// position pos_a = (16 m + ChunkRow(gi)) % SLICE (row gi) and pos_a + 8 (row gi + 8) when
// SLICE = 16, or the next field of the same byte when SLICE = 8. A k-step's 16 channels map to
// lanes as j = 16 ks + 4 t4 + {0, 1} (k = 2 t4, 2 t4 + 1) and + {2, 3} (k = 2 t4 + 8, + 9): a
// dot product may visit the channels in any order as long as A and B agree. One byte
// permutation puts the bytes of two channels into bytes 0 and 2 of a word; the field, shifted
// down and masked, is the code as a bf16 subnormal (code * 2^-133, exact, kept by the tensor
// cores: GpuAttention.TensorCoresKeepBf16Subnormals), against B = a * 2^64, so the accumulator
// is 2^-69 sum_j a[j] code[j] (kTileQkUnscale undoes it): no bias to cancel. The products stay
// in fp32's normal range for |a| in [2^-57, 2^63]; a smaller |a| contributes below 2^-55 to
// its logit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_quant_rows.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/formats.h"

namespace kvq::gpu::attention::detail {

// 2^69: the QK^T accumulator of tile keys is 2^-69 times the integer-weighted dot product.
inline constexpr float kTileQkUnscale = 0x1p69f;

// One history split over tiled keys (SLICE bytes a channel of a key tile: 8 or 16, so G_k =
// SLICE * 8 / BITS) and per-token values (FPGV fields per V group), with the bf16 MMAs (PACK:
// hi and lo in the column halves, heads_per_block <= 4; else two MMAs). Each warp takes one
// 16-token chunk of every 64-token pipeline tile, as QuantSplit does; the pipeline's stage also
// holds the keys' norms (QuantGeometry<.., true>).
template <int D, int BITS, bool PACK, int SLICE, int FPGV>
__device__ __forceinline__ void TileKeySplit(const DecodeKernelParams& p, unsigned char* smem,
                                             int kvh, int head0, int b, int split, int begin,
                                             int end) {
  using Geo = QuantGeometry<D, BITS, true>;
  constexpr int GK = SLICE * 8 / BITS;           // tokens of a key tile
  constexpr int kChunksPerKeyTile = GK / kChunkTokens;
  constexpr uint32_t kFieldMask = ((1u << BITS) - 1u) * 0x00010001u;
  static_assert(SLICE == 8 || SLICE == 16, "8 or 16 bytes a channel of a key tile");
  static_assert(GK >= kChunkTokens && kTileTokens % GK == 0, "key tiles inside a pipeline tile");
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gi = lane >> 2;
  const int t4 = lane & 3;

  using Pipeline = QuantTilePipeline<D, BITS, true>;
  const Pipeline pipe(p, smem, kvh, b, begin, end);
  const int n_tiles = pipe.n_tiles;
  float* q_s = reinterpret_cast<float*>(smem + Geo::kStages * Geo::kStageBytes);
  pipe.Start(Geo::kStages - 1);
  LoadRotatedQueries<D>(p, b, head0, q_s);
  const float fac = p.logit_scale_log2;

  WarpState<D> st;
  st.Init();
  PvLoop<D, BITS, PACK, FPGV> pv;

  const int row_a = ChunkRow(gi);
  const int row_b = ChunkRow(gi + 8);  // row_a + 8
  const int vrow[4] = {ChunkRow(2 * t4), ChunkRow(2 * t4 + 1), ChunkRow(2 * t4 + 8),
                       ChunkRow(2 * t4 + 9)};
  // This warp's key tile in a pipeline tile and its m-tile inside the key tile (fixed: each
  // warp always takes chunk `warp` of a pipeline tile).
  const int key_tile = warp / kChunksPerKeyTile;
  const int m = warp % kChunksPerKeyTile;
  // Bytes and field shifts of rows a and b (token 16 m + row of the key tile).
  const int r_a = 16 * m + row_a;
  const int pos_a = r_a % SLICE;
  const int shift_a = (r_a / SLICE) * BITS;
  const int shift_b = ((r_a + 8) / SLICE) * BITS;
  const int word_a = pos_a & ~3;
  const int word_b = (r_a + 8) % SLICE & ~3;  // SLICE = 8: the same word as row a
  const uint32_t byte_select = (pos_a & 3) | ((4 + (pos_a & 3)) << 8);
  // The B column of this lane: head bh, the lo part (PACK, gi >= 4) or both parts.
  const int bh = PACK ? (gi & 3) : gi;
  const bool lo_column = PACK && gi >= 4;
  const float* qh = q_s + bh * D;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    pipe.WaitFull(tile);
    const unsigned char* stage = pipe.Stage(tile);
    if (chunk_first < end) {
      const bool valid_a = chunk_first + row_a < end;
      const bool valid_b = chunk_first + row_b < end;
      const unsigned char* kc = stage + key_tile * D * SLICE;  // codes [D][SLICE]
      const uint16_t* ks =
          reinterpret_cast<const uint16_t*>(stage + 2 * Geo::kCodesBytes) + key_tile * D;
      const uint16_t* km = reinterpret_cast<const uint16_t*>(stage + 2 * Geo::kCodesBytes +
                                                             Geo::kMetaBytes) +
                           key_tile * D;

      // ---- QK^T: A = codes (bf16 subnormals, exact), B = (q~ o s^) * 2^64 hi and lo ----
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      float cq = 0.0f;  // q~ . m^ over this lane's channels, head bh
#pragma unroll
      for (int kstep = 0; kstep < D / 16; ++kstep) {
        const int j0 = 16 * kstep + 4 * t4;
        const float4 q4 = *reinterpret_cast<const float4*>(qh + j0);
        const uint2 s4 = *reinterpret_cast<const uint2*>(ks + j0);
        const uint2 m4 = *reinterpret_cast<const uint2*>(km + j0);
        const float a0 = q4.x * __uint_as_float(s4.x << 16) * kPvOperandScale;
        const float a1 = q4.y * __uint_as_float(s4.x & 0xffff0000u) * kPvOperandScale;
        const float a2 = q4.z * __uint_as_float(s4.y << 16) * kPvOperandScale;
        const float a3 = q4.w * __uint_as_float(s4.y & 0xffff0000u) * kPvOperandScale;
        cq = fmaf(q4.x, __uint_as_float(m4.x << 16), cq);
        cq = fmaf(q4.y, __uint_as_float(m4.x & 0xffff0000u), cq);
        cq = fmaf(q4.z, __uint_as_float(m4.y << 16), cq);
        cq = fmaf(q4.w, __uint_as_float(m4.y & 0xffff0000u), cq);
        uint32_t hi01, lo01, hi23, lo23;
        SplitBf16(a0, a1, hi01, lo01);
        SplitBf16(a2, a3, hi23, lo23);
        // Channels j0 .. j0 + 3: bytes pos_a (and pos_a + 8) of each one's slice.
        uint32_t wa[4], wb[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          wa[e] = *reinterpret_cast<const uint32_t*>(kc + (j0 + e) * SLICE + word_a);
          if constexpr (SLICE == 16) {
            wb[e] = *reinterpret_cast<const uint32_t*>(kc + (j0 + e) * SLICE + word_b);
          }
        }
        const uint32_t xa01 = __byte_perm(wa[0], wa[1], byte_select);
        const uint32_t xa23 = __byte_perm(wa[2], wa[3], byte_select);
        const uint32_t xb01 = SLICE == 16 ? __byte_perm(wb[0], wb[1], byte_select) : xa01;
        const uint32_t xb23 = SLICE == 16 ? __byte_perm(wb[2], wb[3], byte_select) : xa23;
        const uint32_t a_0 = (xa01 >> shift_a) & kFieldMask;
        const uint32_t a_1 = (xb01 >> shift_b) & kFieldMask;
        const uint32_t a_2 = (xa23 >> shift_a) & kFieldMask;
        const uint32_t a_3 = (xb23 >> shift_b) & kFieldMask;
        if constexpr (PACK) {
          MmaBf16(c, a_0, a_1, a_2, a_3, lo_column ? lo01 : hi01, lo_column ? lo23 : hi23);
        } else {
          MmaBf16(c, a_0, a_1, a_2, a_3, hi01, hi23);
          MmaBf16(c, a_0, a_1, a_2, a_3, lo01, lo23);
        }
      }
      if constexpr (PACK) {
        // Head h = column h (hi part) + column h + 4 (lo part).
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] += __shfl_xor_sync(0xffffffffu, c[i], 2);
      }
      // c = q~ . m^ of head bh over the lane's quad, then of the accumulator's heads 2 t4 and
      // 2 t4 + 1 (lane 4 h holds head h's: bh = h for gi = h < 4, and for every gi without PACK).
      cq += __shfl_xor_sync(0xffffffffu, cq, 1);
      cq += __shfl_xor_sync(0xffffffffu, cq, 2);
      const float c0 = __shfl_sync(0xffffffffu, cq, (8 * t4) & 31);
      const float c1 = __shfl_sync(0xffffffffu, cq, (8 * t4 + 4) & 31);
      float n_a = 1.0f, n_b = 1.0f;
      if (p.key_norm) {
        const uint16_t* norms =
            reinterpret_cast<const uint16_t*>(stage + Geo::kNormOffset) + warp * kChunkTokens;
        n_a = Bf16ToFloat(norms[row_a]);
        n_b = Bf16ToFloat(norms[row_b]);
      }
      float sl[4];
      sl[0] = valid_a ? n_a * fmaf(c[0], kTileQkUnscale, c0) * fac : -INFINITY;
      sl[1] = valid_a ? n_a * fmaf(c[1], kTileQkUnscale, c1) * fac : -INFINITY;
      sl[2] = valid_b ? n_b * fmaf(c[2], kTileQkUnscale, c0) * fac : -INFINITY;
      sl[3] = valid_b ? n_b * fmaf(c[3], kTileQkUnscale, c1) * fac : -INFINITY;
      float pr[4];
      float alpha[2];
      if (st.Update(sl, pr, alpha)) pv.Rescale(alpha);  // alpha == 1 where the max stayed

      pv.Step(stage, warp, gi, t4, row_a, row_b, vrow, pr, valid_a, valid_b, st);
    }
    pipe.Release(tile);
    pipe.Produce(tile);
  }
  pv.Finish(st);
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return PvChannel<D, BITS>(mt, upper, gi); }, smem, b,
      head0, split);
}

}  // namespace kvq::gpu::attention::detail
