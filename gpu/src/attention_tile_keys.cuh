// The decode kernel's loop over tiled keys (affine_tile, spec 1.1: KIVI / OScaR) with per-token
// values (TileKeysLoop, the history kinds of affine_tile keys).
//
// The decode algebra of a tile (spec/cache.md §5.1): with x^[t][j] = n^_t (code[t][j] s^[j] +
// m^[j]) over the tile's per-channel scale s^ and min m^,
//   q~ . x^_t = n^_t (sum_j a[j] code[t][j] + c),  a = q~ o s^,  c = q~ . m^,
// so a warp folds its key tile's scales into the query once (a, c per query head) and QK^T runs
// on the tensor cores with the codes as exact integers against a (bf16 hi + lo, 2^-17
// relative): mma.sync m16n8k16, M = 16 tokens, N = 8 (heads; with PACK their hi and lo parts in
// the column halves, as QuantRowsLoop), K = channels. The logit is then n^ (acc + c).
//
// Operands. A tile row of codes is channel-major: channel j's G_k codes are SLICE = G_k * b / 8
// bytes, token r of the tile at byte r % SLICE, field r / SLICE (numerics.md §8.1). The MMA row
// i of the warp's m-tile m (tokens [16 m, 16 m + 16) of the key tile) is token 16 m + ChunkRow(i)
// (the order PV reads the value rows in), so lane (gi, t4) needs, per channel, the byte of
// position pos_a = (16 m + ChunkRow(gi)) % SLICE (row gi) and pos_a + 8 (row gi + 8) when
// SLICE = 16, or the next field of the same byte when SLICE = 8. A k-step's 16 channels map to
// lanes as j = 16 ks + 4 t4 + {0, 1} (k = 2 t4, 2 t4 + 1) and + {2, 3} (k = 2 t4 + 8, + 9): a
// dot product may visit the channels in any order as long as A and B agree. One byte
// permutation puts the bytes of two channels into bytes 0 and 2 of a word; the field, masked in
// place at bit position f (one AND), is 2^f * code as a bf16 subnormal or first-binade value
// (2^f * code * 2^-133, exact: below 256; kept by the tensor cores:
// GpuAttention.TensorCoresKeepBf16Subnormals), against B = a * 2^64, so the accumulator row is
// 2^(f - 69) sum_j a[j] code[j] (TileQkUnscale(f) undoes it per row): no bias to cancel. The
// products stay in fp32's normal range for |a| in [2^-57, 2^63]; a smaller |a| contributes
// below 2^-55 to its logit.
//
// PACK: the hi and lo columns of one head (lanes gi and gi + 4, lane ^ 16) need the same four
// products q~[j] s^[j] a k-step; each lane forms two of them and one shuffle trades the parts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_quant_rows.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/formats.h"

namespace kvq::gpu::attention::detail {

// 2^(69 - shift): the QK^T accumulator of tile keys is 2^(shift - 69) times the
// integer-weighted dot product, shift = the bit position of the row's code field (in place).
__device__ __forceinline__ float TileQkUnscale(int shift) {
  return __int_as_float((127 + 69 - shift) << 23);
}

// The split loop (attention_skeleton.cuh) over tiled keys (SLICE bytes a channel of a key
// tile: 8 or 16, so G_k = SLICE * 8 / BITS) and per-token values (FPGV fields per V group), with
// the bf16 MMAs (PACK: hi and lo in the column halves, heads_per_block <= 4; else two MMAs). A
// warp takes a whole key tile (G_k / 16 m-tiles) at a time, so the tile's folded query (B) and
// its code words (A: the m-tiles are other fields, or other bytes, of the same words) are
// formed once per tile: the 64 / G_k warps of a group read one pipeline tile, and the
// kWarps * G_k / 64 groups take the pipeline tiles in turn (QuantTilePipeline's
// warps_per_tile). The stage also holds the keys' norms (QuantStage<.., true>). BITS: the keys'
// width; VBITS: the values' (PvLoop).
template <int D, int BITS, int VBITS, bool PACK, int SLICE, int FPGV>
struct TileKeysLoop {
  using Stage = QuantStage<D, BITS, VBITS, true>;
  static constexpr int GK = SLICE * 8 / BITS;          // tokens of a key tile
  static constexpr int kMTiles = GK / kChunkTokens;    // m-tiles (16-token chunks) of a key tile
  static constexpr int kWarpsPerTile = kTileTokens / GK;
  static constexpr int kGroups = kWarps / kWarpsPerTile;
  static constexpr int kTileStep = kGroups;
  static constexpr uint32_t kFieldMask = ((1u << BITS) - 1u) * 0x00010001u;
  static_assert(SLICE == 8 || SLICE == 16, "8 or 16 bytes a channel of a key tile");
  static_assert(GK >= 32 && kTileTokens % GK == 0, "key tiles inside a pipeline tile");
  using Scores = ChunkScores<kMTiles>;
  using Probs = ChunkProbs<kMTiles>;
  // The bit position of the code field of m-tile m's row a (row = 0) or b (row = 1).
  __device__ __forceinline__ static constexpr int FieldShift(int m, int row) {
    return (SLICE == 8 ? 2 * m + row : m) * BITS;
  }

  const DecodeKernelParams& p;
  int begin, end;
  int lane, warp, gi, t4;
  QuantTilePipeline<Stage> pipe;
  int n_tiles;
  float* q_s;
  float fac;
  int row_a, row_b;
  int vrow[4];
  int group, key_tile;
  int word_a, word_b;
  uint32_t byte_select;
  bool lo_column;
  const float* qh;
  WarpState<D> st;
  PvLoop<Stage, PACK, FPGV> pv;

  __device__ __forceinline__ explicit TileKeysLoop(const SplitArgs& a)
      : p(a.p), begin(a.begin), end(a.end),
        pipe(a.p, a.smem, a.kvh, a.b, a.begin, a.end, kWarpsPerTile) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    n_tiles = pipe.n_tiles;
    q_s = reinterpret_cast<float*>(a.smem + Stage::kQueryOffset);
    pipe.Start(Stage::kStages - 1);
  }

  // q~ * 2^64 (exact) in shared memory: the B operand a * 2^64 is then one product a channel
  // (a = q~ o s^, folded per key tile in Logits); c comes out scaled by 2^64 as well and is
  // unscaled once a tile.
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    LoadRotatedQueries<D>(p, a.b, a.head0, q_s);
    for (int i = threadIdx.x; i < kMaxHeadsPerBlock * D; i += kThreads) q_s[i] *= kPvOperandScale;
    __syncthreads();
    fac = p.logit_scale_log2;
    st.Init();
    row_a = ChunkRow(gi);
    row_b = ChunkRow(gi + 8);  // row_a + 8
    vrow[0] = ChunkRow(2 * t4);
    vrow[1] = ChunkRow(2 * t4 + 1);
    vrow[2] = ChunkRow(2 * t4 + 8);
    vrow[3] = ChunkRow(2 * t4 + 9);
    // This warp's group (the pipeline tiles it reads) and key tile inside a pipeline tile.
    group = warp / kWarpsPerTile;
    key_tile = warp % kWarpsPerTile;
    // Bytes of rows a and b of every m-tile: token r = 16 m + row of the key tile lives at byte
    // r % SLICE, field r / SLICE. SLICE = 8: row a at byte row_a, field 2 m, row b the same
    // byte, field 2 m + 1; SLICE = 16: rows a and b at bytes row_a and row_a + 8, field m.
    word_a = row_a & ~3;
    word_b = (row_a + 8) % SLICE & ~3;
    byte_select = (row_a & 3) | ((4 + (row_a & 3)) << 8);
    // The B column of this lane: head bh, the lo part (PACK, gi >= 4) or both parts.
    const int bh = PACK ? (gi & 3) : gi;
    lo_column = PACK && gi >= 4;
    qh = q_s + bh * D;
  }

  // The warp's key tile starts at begin + 64 tile + G_k key_tile.
  __device__ __forceinline__ bool HasRows(int tile) const {
    return begin + tile * kTileTokens + key_tile * GK < end;
  }

  __device__ __forceinline__ int FirstTile() const { return group; }

  __device__ __forceinline__ const unsigned char* LoadTile(int tile) const {
    pipe.WaitFull(tile);
    return pipe.Stage(tile);
  }

  // QK^T of the warp's key tile: A = codes (bf16 subnormals, exact), B = (q~ o s^) * 2^64 hi
  // and lo; then n^ (acc + c) per row.
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& sc) const {
    const int first = begin + tile * kTileTokens + key_tile * GK;  // the key tile's first token
    const unsigned char* kc = stage + key_tile * D * SLICE;  // codes [D][SLICE]
    const uint16_t* ks =
        reinterpret_cast<const uint16_t*>(stage + Stage::kMetaOffset) + key_tile * D;
    const uint16_t* km =
        reinterpret_cast<const uint16_t*>(stage + Stage::kMetaOffset + Stage::kMetaBytes) +
        key_tile * D;

    float c[kMTiles][4];
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
    float cq = 0.0f;  // 2^64 q~ . m^ over this lane's channels, head bh
#pragma unroll
    for (int kstep = 0; kstep < D / 16; ++kstep) {
      const int j0 = 16 * kstep + 4 * t4;
      uint32_t b0, b1, bl0 = 0u, bl1 = 0u;  // B: k 2 t4, 2 t4 + 1 (b0) and + 8, + 9 (b1)
      if constexpr (PACK) {
        // Lanes gi and gi + 4 (lane ^ 16) hold the hi and lo columns of one head, the same
        // four products: each forms two of them (the hi lane channels j0, j0 + 1, the lo lane
        // j0 + 2, j0 + 3) and one shuffle trades the part the other lane's column needs.
        const int jh = j0 + (lo_column ? 2 : 0);
        const float2 q2 = *reinterpret_cast<const float2*>(qh + jh);
        const uint32_t s2 = *reinterpret_cast<const uint32_t*>(ks + jh);
        const uint32_t m2 = *reinterpret_cast<const uint32_t*>(km + jh);
        cq = fmaf(q2.x, __uint_as_float(m2 << 16), cq);
        cq = fmaf(q2.y, __uint_as_float(m2 & 0xffff0000u), cq);
        uint32_t hi, lo;
        SplitBf16(q2.x * __uint_as_float(s2 << 16), q2.y * __uint_as_float(s2 & 0xffff0000u),
                  hi, lo);
        const uint32_t keep = lo_column ? lo : hi;
        const uint32_t got = __shfl_xor_sync(0xffffffffu, lo_column ? hi : lo, 16);
        b0 = lo_column ? got : keep;
        b1 = lo_column ? keep : got;
      } else {
        const float4 q4 = *reinterpret_cast<const float4*>(qh + j0);
        const uint2 s4 = *reinterpret_cast<const uint2*>(ks + j0);
        const uint2 m4 = *reinterpret_cast<const uint2*>(km + j0);
        cq = fmaf(q4.x, __uint_as_float(m4.x << 16), cq);
        cq = fmaf(q4.y, __uint_as_float(m4.x & 0xffff0000u), cq);
        cq = fmaf(q4.z, __uint_as_float(m4.y << 16), cq);
        cq = fmaf(q4.w, __uint_as_float(m4.y & 0xffff0000u), cq);
        SplitBf16(q4.x * __uint_as_float(s4.x << 16), q4.y * __uint_as_float(s4.x & 0xffff0000u),
                  b0, bl0);
        SplitBf16(q4.z * __uint_as_float(s4.y << 16), q4.w * __uint_as_float(s4.y & 0xffff0000u),
                  b1, bl1);
      }
      // Channels j0 .. j0 + 3: bytes row_a (and row_a + 8) of each one's slice, two channels
      // a word (bytes 0 and 2).
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
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        // The fields stay in place (one AND): row a's operand is 2^FieldShift(m, 0) times the
        // code, row b's 2^FieldShift(m, 1), undone per accumulator row below.
        const uint32_t a0 = xa01 & (kFieldMask << FieldShift(m, 0));
        const uint32_t a1 = xb01 & (kFieldMask << FieldShift(m, 1));
        const uint32_t a2 = xa23 & (kFieldMask << FieldShift(m, 0));
        const uint32_t a3 = xb23 & (kFieldMask << FieldShift(m, 1));
        MmaBf16(c[m], a0, a1, a2, a3, b0, b1);
        if constexpr (!PACK) MmaBf16(c[m], a0, a1, a2, a3, bl0, bl1);
      }
    }
    // c = q~ . m^ of head bh over the lane's quad, then of the accumulator's heads 2 t4 and
    // 2 t4 + 1 (lane 4 h holds head h's: bh = h for gi = h < 4, and for every gi without PACK).
    if constexpr (PACK) cq += __shfl_xor_sync(0xffffffffu, cq, 16);  // the hi and lo lanes' halves
    cq += __shfl_xor_sync(0xffffffffu, cq, 1);
    cq += __shfl_xor_sync(0xffffffffu, cq, 2);
    const float c0 = __shfl_sync(0xffffffffu, cq, (8 * t4) & 31) * (1.0f / kPvOperandScale);
    const float c1 = __shfl_sync(0xffffffffu, cq, (8 * t4 + 4) & 31) * (1.0f / kPvOperandScale);
    const uint16_t* norms =
        reinterpret_cast<const uint16_t*>(stage + Stage::kNormOffset) + key_tile * GK;
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      if constexpr (PACK) {
        // Head h = column h (hi part) + column h + 4 (lo part).
#pragma unroll
        for (int i = 0; i < 4; ++i) c[m][i] += __shfl_xor_sync(0xffffffffu, c[m][i], 2);
      }
      const int chunk_first = first + m * kChunkTokens;
      sc.valid[m][0] = chunk_first + row_a < end;
      sc.valid[m][1] = chunk_first + row_b < end;
      const float n_a = p.key_norm ? Bf16ToFloat(norms[m * kChunkTokens + row_a]) : 1.0f;
      const float n_b = p.key_norm ? Bf16ToFloat(norms[m * kChunkTokens + row_b]) : 1.0f;
      const float u_a = TileQkUnscale(FieldShift(m, 0));
      const float u_b = TileQkUnscale(FieldShift(m, 1));
      sc.s[m][0] = sc.valid[m][0] ? n_a * fmaf(c[m][0], u_a, c0) * fac : -INFINITY;
      sc.s[m][1] = sc.valid[m][0] ? n_a * fmaf(c[m][1], u_a, c1) * fac : -INFINITY;
      sc.s[m][2] = sc.valid[m][1] ? n_b * fmaf(c[m][2], u_b, c0) * fac : -INFINITY;
      sc.s[m][3] = sc.valid[m][1] ? n_b * fmaf(c[m][3], u_b, c1) * fac : -INFINITY;
    }
  }

  // One softmax update for the key tile (its first chunk holds valid tokens: the history holds
  // whole tiles).
  __device__ __forceinline__ void Softmax(const Scores& s, Probs& pr) {
    WarpSoftmax(st, pv, s, pr);
  }

  __device__ __forceinline__ void Values(const unsigned char* stage, int, const Scores& s,
                                         const Probs& pr) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      pv.Step(stage, key_tile * kMTiles + m, gi, t4, row_a, row_b, vrow, pr.p[m], s.valid[m][0],
              s.valid[m][1], st);
    }
  }

  __device__ __forceinline__ void ReleaseTile(int tile) const { pipe.Done(tile); }

  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    FinishQuantSplit(p, pv, st, a.smem, gi, a.b, a.head0, a.split);
  }
};

// The tiled-key split (TileKeysLoop) with SLICE = G_k * b_k / 8 (8 or 16) and FPGV = fpg_v as
// compile-time values (the launcher admits only those).
template <int D, int KBITS, int VBITS, bool PACK, int SLICE = 8, int FPGV = 1>
__device__ __forceinline__ void TileSplitGrouped(const DecodeKernelParams& p, unsigned char* smem,
                                                 int kvh, int head0, int b, int split, int begin,
                                                 int end) {
  constexpr int RBV = QuantGeometry<D, VBITS>::kRowBytes;
  if (p.key_group * KBITS / 8 == SLICE) {
    if constexpr (kFieldsPerGroupValid<D, VBITS, FPGV> && SLICE * 8 / KBITS >= 32) {
      if (p.value_group == FPGV * RBV) {
        SplitLoop<TileKeysLoop<D, KBITS, VBITS, PACK, SLICE, FPGV>>(
            SplitArgs{p, smem, kvh, head0, b, split, begin, end});
        return;
      }
    }
    if constexpr (FPGV < 4) {
      TileSplitGrouped<D, KBITS, VBITS, PACK, SLICE, 2 * FPGV>(p, smem, kvh, head0, b, split,
                                                               begin, end);
      return;
    }
  } else if constexpr (SLICE < 16) {
    TileSplitGrouped<D, KBITS, VBITS, PACK, 2 * SLICE, FPGV>(p, smem, kvh, head0, b, split,
                                                             begin, end);
    return;
  }
  __trap();  // unreachable: the launcher refuses other tiles and groups
}

// affine_tile keys (spec 1.1): TileKeysLoop over per-token values.
template <>
struct HistoryLoop<Format::kAffineTile> {
  template <int D, class K, class V, QuantLoop LOOP>
  __device__ __forceinline__ static void Split(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
    TileSplitGrouped<D, K::kBits, V::kBits, LOOP == QuantLoop::kPacked>(p, smem, kvh, head0, b,
                                                                        split, begin, end);
  }
  template <int D, class K, class V>
  static constexpr int SharedBytes() {
    return QuantStage<D, K::kBits, V::kBits, true>::kSharedBytes;
  }
};

}  // namespace kvq::gpu::attention::detail
