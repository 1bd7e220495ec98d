// The decode kernel's loops over INT-b history pages with bf16 MMAs (QuantRowsLoop: the two-MMA
// and packed loops), and what every quantized loop shares: the code fields as MMA operands,
// the tile geometry, the copy pipeline of 64-token tiles, the rotated queries and PV's codes.
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
// Code fields as MMA operands.

// Field f of the codes (bits [f*BITS, (f+1)*BITS) of a byte) of bytes 0 and 2 of x, as bf16
// 128 + 2^kShift * q (exact), kShift = f*BITS when that still fits the 7-bit mantissa (no
// shift instruction: the field stays in place and the caller scales its other operand or its
// result by 2^-kShift), else 0 (shifted down).
template <int BITS, int FIELD>
struct CodeField {
  static constexpr int kBitPos = FIELD * BITS;
  static constexpr bool kInPlace = kBitPos + BITS <= 7;
  static constexpr int kShift = kInPlace ? kBitPos : 0;
  static constexpr uint32_t kMask = ((1u << BITS) - 1u) * 0x00010001u;
  // bias = 0x43004300 in a register: one LOP3 computes (x & mask) | bias (with both as
  // immediates the compiler emits two).
  __device__ __forceinline__ static uint32_t Biased(uint32_t x, uint32_t bias) {
    uint32_t y;
    if constexpr (kInPlace) {
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(y) : "r"(x), "n"(kMask << kBitPos), "r"(bias));
    } else {
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(y) : "r"(x >> kBitPos), "n"(kMask), "r"(bias));
    }
    return y;
  }
  // PV's A operand: the field in place in the low byte of each 16-bit half, everything else
  // masked: one AND, no bias. As a bf16 pattern a value v < 256 is exactly v * 2^-133
  // (exponent field 0 holds the subnormals, exponent field 1 the first normal binade, whose
  // spacing is the subnormals'), so the operand is 2^(FIELD*BITS) * q * 2^-133 for every field
  // (FIELD*BITS + BITS <= 8). The tensor cores keep bf16 subnormal inputs exactly
  // (GpuAttention.TensorCoresKeepBf16Subnormals checks it on the device); the B operand
  // carries kPvOperandScale and the accumulator is unscaled by PvUnscale<BITS, FIELD>().
  __device__ __forceinline__ static uint32_t InPlace(uint32_t x) {
    return x & (kMask << kBitPos);
  }
};

// PV on in-place code fields (CodeField::InPlace): the B operand is p * scale * 2^64, so with
// A = 2^(f*b) q * 2^-133 each product is 2^(f*b - 69) * p * scale * q: far inside fp32's normal
// range for p * scale in [2^-57, 2^56] (p <= 2^8; the kernel's range for V group scales), and
// the field's accumulator is 2^(f*b - 69) times the value sum.
inline constexpr float kPvOperandScale = 0x1p64f;
inline constexpr int kPvUnscaleLog2 = 133 - 64;
template <int BITS, int FIELD>
__host__ __device__ constexpr float PvUnscale() {
  float x = 1.0f;
  for (int i = 0; i < kPvUnscaleLog2 - FIELD * BITS; ++i) x *= 2.0f;
  return x;
}

// ------------------------------------------------------------------------------------------
// INT-b history pages.

// A side's INT-b rows of codes (BITS-bit fields, spec packing) as the loops take them apart.
template <int D, int BITS>
struct QuantGeometry {
  static constexpr int kFields = 8 / BITS;            // codes per byte
  static constexpr int kRowBytes = D * BITS / 8;      // RB
  static constexpr int kQkWords = kRowBytes / 16;     // u32 words of a row per QK thread
  static constexpr int kPvBytes = kRowBytes / 8;      // bytes of a row per PV thread
  static constexpr int kPvWords = kPvBytes >= 4 ? kPvBytes / 4 : 1;
  static constexpr int kPvPairs = kPvBytes / 2;       // m-tiles per field
  static_assert(kFields * kQkWords == D / 16, "QK k-steps");
  static_assert(kFields * kPvPairs == D / 16, "PV m-tiles");
};

// The shared memory of a quantized-history split: kStages pipeline stages of one 64-token tile
// each, then the query's area and the stages' barriers. A stage holds the K codes (KBITS-bit
// rows), the V codes (VBITS-bit rows), K scale, K min, V scale, V min (at most D / 32 groups a
// token each) and, with KEY_TILE (tile keys, affine_tile), the K norms (bf16 [64]); the tile
// keys' codes, scales and mins take the places of the per-token ones (a tile row of codes is
// G_k * RB bytes, its scale and min rows 2 D bytes: at most 2 D / 32 bytes a token, what
// kMetaBytes holds). K and V are apart: the key loop reads KeyRow's fields, PV ValueRow's.
template <int D, int KBITS, int VBITS, bool KEY_TILE = false>
struct QuantStage {
  using KeyRow = QuantGeometry<D, KBITS>;
  using ValueRow = QuantGeometry<D, VBITS>;
  static constexpr int kHeadDim = D;
  static constexpr int kValueBits = VBITS;
  static constexpr bool kKeyTile = KEY_TILE;
  static constexpr int kStages = 4;
  static constexpr int kMaxGroups = D / 32;
  static constexpr int kKeyCodesBytes = kTileTokens * KeyRow::kRowBytes;
  static constexpr int kValueCodesOffset = kKeyCodesBytes;
  static constexpr int kMetaOffset = kValueCodesOffset + kTileTokens * ValueRow::kRowBytes;
  static constexpr int kMetaBytes = kTileTokens * kMaxGroups * 2;  // one metadata array
  static constexpr int kValueMetaOffset = kMetaOffset + 2 * kMetaBytes;
  static constexpr int kNormOffset = kMetaOffset + 4 * kMetaBytes;
  static constexpr int kNormBytes = KEY_TILE ? kTileTokens * 2 : 0;
  static constexpr int kBytes = kNormOffset + kNormBytes;  // one stage
  static constexpr int kQueryOffset = kStages * kBytes;
  static constexpr int kBarrierBytes = 16 * kStages;  // full + empty mbarrier per stage
  // q~ [8][D] fp32, then per (key field, head) the sums of the represented q~ and of its scaled
  // parts: [2][kFields][8] fp32, and the B fragments of the query, uint4 {hi k-lo, hi k-hi,
  // lo k-lo, lo k-hi} per (k-step, lane): [D/16][32].
  static constexpr int kQueryBytes = kMaxHeadsPerBlock * D * 4 +
                                     2 * KeyRow::kFields * kMaxHeadsPerBlock * 4 +
                                     (D / 16) * 32 * 16;
  // Everything: the stages, the query's area, the barriers.
  static constexpr int kSharedBytes = kQueryOffset + kQueryBytes + kBarrierBytes;
  static_assert(kBytes % 16 == 0 && kQueryBytes % 16 == 0, "bulk copy alignment");
};

// Fields per group F' is usable when the group G = F' * RB is one of 32, 64, 128 and <= D.
template <int D, int BITS, int FPG>
inline constexpr bool kFieldsPerGroupValid =
    FPG * QuantGeometry<D, BITS>::kRowBytes >= 32 && FPG * QuantGeometry<D, BITS>::kRowBytes <= 128 &&
    FPG <= QuantGeometry<D, BITS>::kFields;

// The copy pipeline of a quantized-history split: kStages shared-memory stages of one 64-token
// tile each (K and V codes, K scale / min, V scale / min, and with KEY_TILE the K norms), filled
// by the copy engine and released without a block-wide barrier. stage_full[s] completes when a
// tile's bytes arrived; stage_empty[s] when every thread of the block read the stage, and the
// stage's refill waits for that phase.
//
// A tile's rows live in at most 64 / P pages; inside one page the tile's codes, scales, mins
// (and norms) of this KV head are contiguous runs ([Hkv, P, row] layout; a tile plane's rows
// [Hkv, P / G_k, row] are as contiguous, and runs start on whole key tiles: P and the splits
// are multiples of G_k), so a tile is kKinds bulk copies per page run ({K, V} codes, K scale,
// K min, V scale, V min, K norm), issued by lanes of one warp (lane = kKinds * run + kind) and
// counted on the stage's mbarrier. Rows are copied in whole 16-token chunks (a page holds whole
// chunks: P >= 16); rows past `end` in the last chunk are read but masked by the loop.
template <class STAGE>
struct QuantTilePipeline {
  static constexpr int D = STAGE::kHeadDim;
  static constexpr bool KEY_TILE = STAGE::kKeyTile;
  static constexpr int kKinds = KEY_TILE ? 7 : 6;
  static_assert(kKinds * (kTileTokens / 16) <= 32, "one copy lane per kind and page run");
  static constexpr int kFullOffset = STAGE::kQueryOffset + STAGE::kQueryBytes;
  const DecodeKernelParams& p;
  unsigned char* smem;
  const unsigned char* copy_src;  // this lane's pool, advanced to KV head kvh's rows of page 0
  int64_t copy_page_stride;
  int copy_row_bytes;             // bytes a token of this lane's plane (0: nothing to copy)
  int copy_dst;
  int begin;
  int end16;
  int n_tiles;
  uint32_t bytes_per_token;
  uint64_t l2_policy;  // EvictFirstPolicy(): the pages are read once a step
  int append_tile;     // FirstAppendedTile: Issue waits for the append from this tile on

  __device__ __forceinline__ uint64_t* Full(int stage) const {
    return reinterpret_cast<uint64_t*>(smem + kFullOffset) + stage;
  }
  __device__ __forceinline__ uint64_t* Empty(int stage) const {
    return reinterpret_cast<uint64_t*>(smem + kFullOffset) + STAGE::kStages + stage;
  }
  __device__ __forceinline__ int* PageIds() const {
    return reinterpret_cast<int*>(smem + kFullOffset + STAGE::kBarrierBytes);
  }

  // Warps that read each tile (kWarps: every warp reads every tile; fewer: the warps form
  // kWarps / warps_per_tile groups, group j reading the tiles i with i % groups == j).
  int warps_per_tile;

  // Loads the split's page ids and initialises the barriers; Start() publishes them.
  __device__ __forceinline__ QuantTilePipeline(const DecodeKernelParams& params,
                                               unsigned char* smem_base, int kvh, int b,
                                               int split_begin, int split_end,
                                               int tile_warps = kWarps)
      : p(params), smem(smem_base), begin(split_begin), warps_per_tile(tile_warps) {
    constexpr int RBK = STAGE::KeyRow::kRowBytes;
    constexpr int RBV = STAGE::ValueRow::kRowBytes;
    LoadSplitPages(p, b, split_begin, split_end, PageIds());
    append_tile = FirstAppendedTile(p, b, split_begin, split_end);
    n_tiles = (split_end - split_begin + kTileTokens - 1) / kTileTokens;
    end16 = (split_end + kChunkTokens - 1) & ~(kChunkTokens - 1);
    // Metadata bytes a token: per-token groups (D / G pairs) or a tile's row over its G_k tokens.
    const int meta_k = KEY_TILE ? 2 * D / p.key_group : 2 * (D / p.key_group);
    const int meta_v = 2 * (D / p.value_group);
    const int norm_k = KEY_TILE && p.key_norm ? 2 : 0;
    bytes_per_token = RBK + RBV + 2 * meta_k + 2 * meta_v + norm_k;
    l2_policy = EvictFirstPolicy();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < STAGE::kStages; ++s) {
        MbarrierInit(Full(s), 1);
        MbarrierInit(Empty(s), 32 * warps_per_tile);
      }
      FenceMbarrierInit();
    }
    const int kind = (threadIdx.x & 31) % kKinds;
    // kind -> (K or V, plane, bytes a token, destination in the stage). The affine_tile planes
    // codes / scale / min sit where affine_token's do (kTile*Plane == kAffine*Plane).
    static_assert(kTileCodesPlane == kAffineCodesPlane && kTileScalePlane == kAffineScalePlane &&
                      kTileMinPlane == kAffineMinPlane,
                  "tile and token planes share positions");
    const bool value = kind == 1 || kind == 4 || kind == 5;
    const int plane = kind < 2 ? kAffineCodesPlane
                      : kind == 6 ? kTileNormPlane
                      : (kind == 2 || kind == 4) ? kAffineScalePlane
                                                 : kAffineMinPlane;
    copy_row_bytes = kind < 2 ? (kind == 0 ? RBK : RBV)
                     : kind == 6 ? norm_k : (value ? meta_v : meta_k);
    copy_dst = kind < 2 ? kind * STAGE::kValueCodesOffset
               : kind == 6 ? STAGE::kNormOffset
                           : STAGE::kMetaOffset + (kind - 2) * STAGE::kMetaBytes;
    const unsigned char* pool = value ? p.v_planes[plane] : p.k_planes[plane];
    copy_page_stride = value ? p.v_page_stride[plane] : p.k_page_stride[plane];
    copy_src = pool + kvh * (value ? p.v_head_stride[plane] : p.k_head_stride[plane]);
  }

  // Tile `tile` (< n_tiles) into stage `stage`; called by a whole warp.
  __device__ __forceinline__ void Issue(int tile, int stage) const {
    const int lane = threadIdx.x & 31;
    const int page_size = 1 << p.page_size_log2;
    const int run_tokens = min(page_size, kTileTokens);
    if (tile >= append_tile) WaitForPrerequisiteGrid();
    const int first = begin + tile * kTileTokens;
    const int n_tok = min(kTileTokens, end16 - first);
    if (lane == 0) MbarrierArriveExpectTx(Full(stage), n_tok * bytes_per_token);
    __syncwarp();
    const int r0 = (lane / kKinds) * run_tokens;
    if (lane < kKinds * (kTileTokens / 16) && r0 < n_tok && copy_row_bytes > 0) {
      const int n = min(run_tokens, n_tok - r0);
      const int tok = first + r0;
      const int page = PageIds()[(tok >> p.page_size_log2) - (begin >> p.page_size_log2)];
      const int slot = tok & (page_size - 1);
      const unsigned char* src = copy_src + page * copy_page_stride + slot * copy_row_bytes;
      BulkCopy(smem + stage * STAGE::kBytes + copy_dst + r0 * copy_row_bytes, src,
               n * copy_row_bytes, Full(stage), l2_policy);
    }
  }

  // Publishes the page ids and barriers, then warp 0 issues the first `tiles` tiles (the pages
  // were written before the rotation kernel started, or Issue waits for what a DecodeStep's
  // append writes, so this may run before the query wait).
  __device__ __forceinline__ void Start(int tiles) const {
    __syncthreads();
    if ((threadIdx.x >> 5) == 0) {
#pragma unroll
      for (int s = 0; s < STAGE::kStages; ++s) {
        if (s < tiles && s < n_tiles) Issue(s, s);
      }
    }
  }

  __device__ __forceinline__ const unsigned char* Stage(int tile) const {
    return smem + (tile % STAGE::kStages) * STAGE::kBytes;
  }
  __device__ __forceinline__ void WaitFull(int tile) const {
    MbarrierWait(Full(tile % STAGE::kStages), (tile / STAGE::kStages) & 1);
  }
  // This thread is done reading tile's stage.
  __device__ __forceinline__ void Release(int tile) const {
    MbarrierArrive(Empty(tile % STAGE::kStages));
  }
  // This thread is done with `tile`: its stage released, and the tile's producer warp issues
  // the refill (Release, then Produce).
  __device__ __forceinline__ void Done(int tile) const {
    Release(tile);
    Produce(tile);
  }
  // Refill at the end of step `tile`, called by the warps that read it: the producer is one of
  // them, the role rotating among them (every warp reading every tile: warp tile % 4, so no
  // warp carries it every step). It issues tile + 3, needed two steps later (the others have
  // usually released tile - 1 by then), into the stage of tile + 3 - kStages, which every
  // reader of that tile must have released.
  __device__ __forceinline__ void Produce(int tile) const {
    const int groups = kWarps / warps_per_tile;
    const int producer = (tile % groups) * warps_per_tile + (tile / groups) % warps_per_tile;
    if ((threadIdx.x >> 5) != producer) return;
    const int next = tile + STAGE::kStages - 1;
    if (next < n_tiles) {
      if (next >= STAGE::kStages) {
        MbarrierWait(Empty(next % STAGE::kStages), ((next / STAGE::kStages) - 1) & 1);
      }
      Issue(next, next % STAGE::kStages);
    }
  }
};

// q~ of the block's heads (0 past heads_per_block) into q_s [kMaxHeadsPerBlock][D]; waits for
// the rotation kernel first (q_rot is its output: WaitForQueries) and ends with a block barrier.
template <int D>
__device__ __forceinline__ void LoadRotatedQueries(const DecodeKernelParams& p, int b, int head0,
                                                   float* q_s) {
  WaitForQueries(p, b, head0);
  for (int i = threadIdx.x; i < kMaxHeadsPerBlock * D; i += kThreads) {
    const int h = i / D;
    q_s[i] = h < p.heads_per_block
                 ? p.q_rot[(static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * D + (i - h * D)]
                 : 0.0f;
  }
  __syncthreads();
  BlockTimeline::InputsReady(p.timeline);
}

// PV's A operands (V^T, exact codes) of a thread for one 16-token chunk: the code bytes
// [gi * kPvBytes, (gi + 1) * kPvBytes) of chunk rows vrow = (2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9)
// (ChunkRow order), interleaved by token pair so that one CodeField extraction gives the bf16
// pair (token 2 t4, token 2 t4 + 1) of a channel: m-tile pair jp takes bytes 2 jp (x) and
// 2 jp + 1 (y) of the thread's slice.
template <int D, int BITS>
struct PvCodes {
  using Geo = QuantGeometry<D, BITS>;
  uint32_t x01[Geo::kPvPairs], x89[Geo::kPvPairs], y01[Geo::kPvPairs], y89[Geo::kPvPairs];

  __device__ __forceinline__ PvCodes(const unsigned char* vc, const int (&vrow)[4], int gi) {
    uint32_t vw[4][Geo::kPvWords];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned char* src = vc + vrow[r] * Geo::kRowBytes + gi * Geo::kPvBytes;
      if constexpr (Geo::kPvBytes == 2) {
        vw[r][0] = *reinterpret_cast<const uint16_t*>(src);
      } else {
        LoadWords<Geo::kPvWords>(src, vw[r]);
      }
    }
#pragma unroll
    for (int jp = 0; jp < Geo::kPvPairs; ++jp) {
      const int wi = jp >> 1;
      const uint32_t sel = (jp & 1) ? 0x7632u : 0x5410u;
      x01[jp] = __byte_perm(vw[0][wi], vw[1][wi], sel);
      x89[jp] = __byte_perm(vw[2][wi], vw[3][wi], sel);
      y01[jp] = x01[jp] >> 8;
      y89[jp] = x89[jp] >> 8;
    }
  }
  // The A fragment of m-tile (FIELD, jp): 2^(FIELD*BITS) * q * 2^-133, exact (CodeField::InPlace).
  template <int FIELD>
  __device__ __forceinline__ void A(int jp, uint32_t (&a)[4]) const {
    using Field = CodeField<BITS, FIELD>;
    a[0] = Field::InPlace(x01[jp]);
    a[1] = Field::InPlace(y01[jp]);
    a[2] = Field::InPlace(x89[jp]);
    a[3] = Field::InPlace(y89[jp]);
  }
};

// The partial's channel of accumulator row gi (+ 8 when upper) of PV m-tile mt.
template <int D, int BITS>
__device__ __forceinline__ int PvChannel(int mt, int upper, int gi) {
  using Geo = QuantGeometry<D, BITS>;
  const int f = mt / Geo::kPvPairs;
  const int jp = mt - f * Geo::kPvPairs;
  return f * Geo::kRowBytes + gi * Geo::kPvBytes + 2 * jp + upper;
}

// QK^T of field FIELD into c over a thread's NW code words of rows a and b (bytes 0 and 2 in
// ka / kb, bytes 1 and 3 moved down in ka8 / kb8): per word one MMA with the query's hi and lo
// parts in the column halves (PACK), or two (hi, then lo). bq_s holds the query's B fragments
// (uint2 a lane with PACK, uint4 without).
template <int BITS, int FIELD, int NW, bool PACK>
__device__ __forceinline__ void QkField(float (&c)[4], const uint32_t (&ka)[NW],
                                        const uint32_t (&kb)[NW], const uint32_t (&ka8)[NW],
                                        const uint32_t (&kb8)[NW], uint32_t code_bias,
                                        const uint4* bq_s, int lane) {
  using Field = CodeField<BITS, FIELD>;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const uint32_t a0 = Field::Biased(ka[w], code_bias);
    const uint32_t a1 = Field::Biased(kb[w], code_bias);
    const uint32_t a2 = Field::Biased(ka8[w], code_bias);
    const uint32_t a3 = Field::Biased(kb8[w], code_bias);
    if constexpr (PACK) {
      const uint2 bq = reinterpret_cast<const uint2*>(bq_s)[(FIELD * NW + w) * 32 + lane];
      MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
    } else {
      const uint4 bq = bq_s[(FIELD * NW + w) * 32 + lane];
      MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
      MmaBf16(c, a0, a1, a2, a3, bq.z, bq.w);
    }
  }
}

// The epilogue of one group's (or one field's) QK^T sums c: the codes carried +128 against the
// scaled query parts, so 128 * bias sum (qb) comes off; then scale * c + min * q~ sum (qs) is
// added to the logits of rows a (s[0], s[1]) and b (s[2], s[3]), heads h0 and h0 + 1.
__device__ __forceinline__ void QkEpilogue(float (&s)[4], const float (&c)[4], float2 qb,
                                           float2 qs, float sfa, float sfb, float mfa, float mfb) {
  const float c0 = c[0] - 128.0f * qb.x, c1 = c[1] - 128.0f * qb.y;
  const float c2 = c[2] - 128.0f * qb.x, c3 = c[3] - 128.0f * qb.y;
  s[0] += sfa * c0 + mfa * qs.x;
  s[1] += sfa * c1 + mfa * qs.y;
  s[2] += sfb * c2 + mfb * qs.x;
  s[3] += sfb * c3 + mfb * qs.y;
}

// PV of a quantized history's chunk with the bf16 MMAs over per-token (affine_token) value rows,
// shared by the loops whose softmax is WarpState's (QuantRowsLoop, TileKeysLoop): A = the V^T code
// fields in place (exact), B = p * scale * 2^64 as bf16 hi and lo (PACK: in the column halves,
// as QuantRowsLoop says); the min term sum_t p_t * min_t per field's group on the side.
// STAGE: the split's QuantStage (V codes of STAGE::kValueBits bits); FPGV: fields per V group.
template <class STAGE, bool PACK, int FPGV>
struct PvLoop {
  static constexpr int D = STAGE::kHeadDim;
  static constexpr int BITS = STAGE::kValueBits;
  using Geo = typename STAGE::ValueRow;
  static constexpr int F = Geo::kFields;
  float min_sum[F][2];

  __device__ __forceinline__ PvLoop() {
#pragma unroll
    for (int f = 0; f < F; ++f) min_sum[f][0] = min_sum[f][1] = 0.0f;
  }
  // The softmax moved its max: alpha[i] for head column i (WarpState::Update).
  __device__ __forceinline__ void Rescale(const float (&alpha)[2]) {
#pragma unroll
    for (int f = 0; f < F; ++f) {
      min_sum[f][0] *= alpha[0];
      min_sum[f][1] *= alpha[1];
    }
  }
  // The 16-token chunk `chunk` (0..3) of `stage` (rows row_a, row_b of the accumulator layout;
  // V rows vrow for PV's k index) with p = pr (WarpState::Update's layout).
  __device__ __forceinline__ void Step(const unsigned char* stage, int chunk, int gi, int t4,
                                       int row_a, int row_b, const int (&vrow)[4],
                                       const float (&pr)[4], bool valid_a, bool valid_b,
                                       WarpState<D>& st) {
    constexpr int RB = Geo::kRowBytes;
    const int ngv = D / (FPGV * RB);
    // ---- PV: A = code (bf16, exact), B = p * scale hi and lo; min term on the side ----
    const unsigned char* vc = stage + STAGE::kValueCodesOffset + chunk * kChunkTokens * RB;
    const uint16_t* vsc = reinterpret_cast<const uint16_t*>(stage + STAGE::kValueMetaOffset) +
                          chunk * kChunkTokens * ngv;
    const uint16_t* vmn = reinterpret_cast<const uint16_t*>(stage + STAGE::kValueMetaOffset +
                                                            STAGE::kMetaBytes) +
                          chunk * kChunkTokens * ngv;
    const PvCodes<D, BITS> codes(vc, vrow, gi);
    // The row's NGV scales and mins, one load each.
    constexpr int NGV = F / FPGV;
    // PACK: lanes t4 and t4 ^ 2 hold the same p (QuantRowsLoop: the same logits, bit for bit); the
    // hi columns (t4 < 2) need the hi parts of rows a and b, the lo columns (t4 >= 2) the lo
    // parts. Each lane forms one row's p * scale (t4 < 2: row a, else row b) and one shuffle
    // (lane ^ 2) trades the part the other lane needs: the same B operands, half the work.
    const bool lo_lane = PACK && t4 >= 2;
    const int s_row = lo_lane ? row_b : row_a;  // PACK: the row whose scales this lane reads
    const bool s_valid = lo_lane ? valid_b : valid_a;
    const float p0 = lo_lane ? pr[2] : pr[0], p1 = lo_lane ? pr[3] : pr[1];
    uint32_t vsa[(NGV + 1) / 2], vsb[(NGV + 1) / 2], vma[(NGV + 1) / 2], vmb[(NGV + 1) / 2];
    LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vsc + (PACK ? s_row : row_a) * NGV),
                     vsa);
    if constexpr (!PACK) {
      LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vsc + row_b * NGV), vsb);
    }
    LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vmn + row_a * NGV), vma);
    LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vmn + row_b * NGV), vmb);
    uint32_t bh0 = 0, bh1 = 0, bl0 = 0, bl1 = 0;
    float mfa = 0.0f, mfb = 0.0f;
    StaticFor<F>([&](auto fc) {
      constexpr int f = decltype(fc)::value;
      if constexpr (f % FPGV == 0) {
        // Select, not multiply: rows past the end may hold any bits.
        constexpr int g = f / FPGV;
        mfa = valid_a ? Bf16OfRow<g>(vma) : 0.0f;
        mfb = valid_b ? Bf16OfRow<g>(vmb) : 0.0f;
        // B = p * scale * 2^64 against the in-place (subnormal) code fields.
        if constexpr (PACK) {
          const float sf_v = (s_valid ? Bf16OfRow<g>(vsa) : 0.0f) * kPvOperandScale;
          uint32_t hi, lo;
          SplitBf16(p0 * sf_v, p1 * sf_v, hi, lo);
          const uint32_t keep = lo_lane ? lo : hi;
          const uint32_t got = __shfl_xor_sync(0xffffffffu, lo_lane ? hi : lo, 2);
          // Columns 2*t4, 2*t4 + 1 >= 4 (t4 >= 2) take the lo part.
          bh0 = Transpose8x8(lo_lane ? got : keep);  // row a
          bh1 = Transpose8x8(lo_lane ? keep : got);  // row b
        } else {
          const float sfa = valid_a ? Bf16OfRow<g>(vsa) : 0.0f;
          const float sfb = valid_b ? Bf16OfRow<g>(vsb) : 0.0f;
          uint32_t hi_a, lo_a, hi_b, lo_b;
          const float sfa_v = sfa * kPvOperandScale, sfb_v = sfb * kPvOperandScale;
          SplitBf16(pr[0] * sfa_v, pr[1] * sfa_v, hi_a, lo_a);
          SplitBf16(pr[2] * sfb_v, pr[3] * sfb_v, hi_b, lo_b);
          bh0 = Transpose8x8(hi_a);
          bh1 = Transpose8x8(hi_b);
          bl0 = Transpose8x8(lo_a);
          bl1 = Transpose8x8(lo_b);
        }
      }
      min_sum[f][0] += pr[0] * mfa + pr[2] * mfb;
      min_sum[f][1] += pr[1] * mfa + pr[3] * mfb;
#pragma unroll
      for (int jp = 0; jp < Geo::kPvPairs; ++jp) {
        uint32_t a[4];
        codes.template A<f>(jp, a);
        const int mt = f * Geo::kPvPairs + jp;
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
        if constexpr (!PACK) MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
      }
    });
  }
  // Ends the split: the PACK columns added, each field unscaled, the min term added.
  __device__ __forceinline__ void Finish(WarpState<D>& st) {
    if constexpr (PACK) {
      // Head h's accumulator = column h (p * scale hi) + column h + 4 (lo); lanes t4 >= 2 then
      // hold copies for the unused heads 4..7, which CombineAndStore never writes out.
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st.acc[mt][i] += __shfl_xor_sync(0xffffffffu, st.acc[mt][i], 2);
      }
    }
    // Field f accumulated 2^(f*b - 69) * sum p * scale * q (PvUnscale); then the min term:
    // sum_t p_t * min_t of each field's group, the same for every channel of it.
    StaticFor<F>([&](auto fc) {
      constexpr int f = decltype(fc)::value;
      constexpr float kUnscale = PvUnscale<BITS, f>();
      const float m0 = SumOverRows(min_sum[f][0]);
      const float m1 = SumOverRows(min_sum[f][1]);
#pragma unroll
      for (int jp = 0; jp < Geo::kPvPairs; ++jp) {
        const int mt = f * Geo::kPvPairs + jp;
        st.acc[mt][0] = st.acc[mt][0] * kUnscale + m0;
        st.acc[mt][1] = st.acc[mt][1] * kUnscale + m1;
        st.acc[mt][2] = st.acc[mt][2] * kUnscale + m0;
        st.acc[mt][3] = st.acc[mt][3] * kUnscale + m1;
      }
    });
  }
};

// The end of a split whose PV is PvLoop's (QuantRowsLoop, TileKeysLoop): PV's unscale and min
// term, then the block's warps combine their states and store the split's partials.
template <class STAGE, bool PACK, int FPGV>
__device__ __forceinline__ void FinishQuantSplit(const DecodeKernelParams& p,
                                                 PvLoop<STAGE, PACK, FPGV>& pv,
                                                 WarpState<STAGE::kHeadDim>& st,
                                                 unsigned char* smem, int gi, int b, int head0,
                                                 int split) {
  constexpr int D = STAGE::kHeadDim;
  pv.Finish(st);
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return PvChannel<D, STAGE::kValueBits>(mt, upper, gi); },
      smem, b, head0, split);
}

// The split loop (attention_skeleton.cuh) over INT-b pages with the bf16 MMAs (QuantLoop
// kTwoMma, kPacked): each warp takes one 16-token chunk of every 64-token tile: QK^T, one
// softmax update, PV.
// PACK (heads_per_block <= 4, kPacked): the bf16 hi and lo parts of the query and of p * scale
// use the two halves of the MMA's N = 8 columns: column h < 4 carries head h's hi part, column
// h + 4 its lo part. QK^T and PV are one MMA each instead of two; the hi and lo columns are
// added by one shuffle (lane ^ 2: columns 2*t4 and 2*t4 + 4) after QK^T of a chunk, and once at
// the end of the split for the PV accumulators. Lanes t4 and t4 ^ 2 then hold the same logits
// and run the same softmax, so their m, l and p agree bit for bit.
// KBITS, VBITS: the widths of the K and V codes. FPGK, FPGV: fields per quantization group of K
// and of V (G / RB of that side: 1, 2 or 4) as compile-time values (the group epilogue): the
// fields of a group share one accumulator and one epilogue, and a row's scales / mins (D / G
// bf16) are one 2-, 4- or 8-byte load each.
template <int D, int KBITS, int VBITS, bool PACK, int FPGK, int FPGV>
struct QuantRowsLoop {
  using Stage = QuantStage<D, KBITS, VBITS>;
  using Geo = typename Stage::KeyRow;
  using Scores = ChunkScores<1>;
  using Probs = ChunkProbs<1>;
  static constexpr int kTileStep = 1;
  static constexpr int F = Geo::kFields;
  static constexpr int RB = Geo::kRowBytes;
  static constexpr int NW = Geo::kQkWords;
  static_assert(FPGK > 0 && FPGV > 0, "fields per group of K and of V");

  const DecodeKernelParams& p;
  int begin, end;
  int lane, warp, gi, t4, h0;
  uint32_t code_bias;  // 0x43004300, kept in a register
  QuantTilePipeline<Stage> pipe;
  int n_tiles;
  float* q_s;
  uint4* bq_s;
  float* qsum_s;
  float* bias_s;
  float fac;
  int row_a, row_b;
  int vrow[4];
  WarpState<D> st;
  PvLoop<Stage, PACK, FPGV> pv;

  __device__ __forceinline__ explicit QuantRowsLoop(const SplitArgs& a)
      : p(a.p), begin(a.begin), end(a.end), pipe(a.p, a.smem, a.kvh, a.b, a.begin, a.end) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    h0 = 2 * t4;
    code_bias = p.code_bias;
    n_tiles = pipe.n_tiles;
    q_s = reinterpret_cast<float*>(a.smem + Stage::kQueryOffset);
    pipe.Start(Stage::kStages - 1);
  }

  // q~ of the block's heads into shared memory, then bf16 hi + lo B fragments of head gi
  // (QK^T runs twice, once per part: the query keeps ~16 significant bits), and per group the
  // sum of the represented q~ (hi + lo) over the group's channels (min term).
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    LoadRotatedQueries<D>(p, a.b, a.head0, q_s);

    // Field f's codes enter the MMA as 128 + 2^shift(f) * q, so its query part is scaled by
    // 2^-shift(f) (exact) and the bias removed in the epilogue through bias_sum.
    // The query fragments live in shared memory (read once per k-step, 16 bytes a lane) rather
    // than in 4*D/16 registers, which keeps the kernel under 128 registers without spills.
    bq_s = reinterpret_cast<uint4*>(q_s + kMaxHeadsPerBlock * D + 2 * F * kMaxHeadsPerBlock);
    // qsum_s[g][h]: sum of the represented q~ (hi + lo) of head h over group g's channels;
    // bias_s[g][h]: the same over the scaled parts (128 * bias_s is the codes' bias).
    qsum_s = q_s + kMaxHeadsPerBlock * D;
    bias_s = qsum_s + F * kMaxHeadsPerBlock;
    uint2* bq2_s = reinterpret_cast<uint2*>(bq_s);  // PACK: {part k-lo, part k-hi} per lane
    {
      // PACK: column gi carries the hi (gi < 4) or lo (gi >= 4) part of head gi & 3.
      const float* qh = q_s + (PACK ? (gi & 3) : gi) * D;
      const bool lo_column = PACK && gi >= 4;
      float group_bias = 0.0f, group_qsum = 0.0f;
      StaticFor<F>([&](auto fc) {
        constexpr int f = decltype(fc)::value;
        constexpr float kScale = 1.0f / static_cast<float>(1 << CodeField<KBITS, f>::kShift);
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          const int c = f * RB + t4 * NW * 4 + 4 * w;  // channels of bytes c .. c+3 of field f
          // k 2t4, 2t4+1 <- bytes 0, 2; k 2t4+8, 2t4+9 <- bytes 1, 3.
          uint32_t hi[2], lo[2];
          SplitBf16(qh[c] * kScale, qh[c + 2] * kScale, hi[0], lo[0]);
          SplitBf16(qh[c + 1] * kScale, qh[c + 3] * kScale, hi[1], lo[1]);
          if constexpr (PACK) {
            const uint32_t part0 = lo_column ? lo[0] : hi[0];
            const uint32_t part1 = lo_column ? lo[1] : hi[1];
            if (warp == 0) bq2_s[(f * NW + w) * 32 + lane] = make_uint2(part0, part1);
            // The column's own part: the sums of columns h and h + 4 add up to head h's.
            const uint32_t part[2] = {part0, part1};
#pragma unroll
            for (int k = 0; k < 2; ++k) {
              const float2 pf =
                  __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&part[k]));
              sum += pf.x + pf.y;
            }
          } else {
            if (warp == 0) bq_s[(f * NW + w) * 32 + lane] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
#pragma unroll
            for (int k = 0; k < 2; ++k) {
              const float2 hf =
                  __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi[k]));
              const float2 lf =
                  __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&lo[k]));
              sum += (hf.x + lf.x) + (hf.y + lf.y);
            }
          }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        // The sums over the fields of group f / FPGK.
        group_bias += sum;
        group_qsum += sum / kScale;  // exact: a power of two
        if (f % FPGK == FPGK - 1) {
          if (warp == 0 && t4 == 0) {  // one writer per column; read after the barrier below
            const int at = (f / FPGK) * kMaxHeadsPerBlock + gi;
            bias_s[at] = group_bias;
            qsum_s[at] = group_qsum;
          }
          group_bias = group_qsum = 0.0f;
        }
      });
    }
    fac = p.logit_scale_log2;
    st.Init();
    row_a = ChunkRow(gi);
    row_b = ChunkRow(gi + 8);
    vrow[0] = ChunkRow(2 * t4);
    vrow[1] = ChunkRow(2 * t4 + 1);
    vrow[2] = ChunkRow(2 * t4 + 8);
    vrow[3] = ChunkRow(2 * t4 + 9);
    // Publishes the query fragments and sums (written by warp 0) before the loop; the loop
    // itself has no block-wide barrier (QuantTilePipeline), so warps drift apart by up to the
    // pipeline depth instead of meeting every tile.
    __syncthreads();
  }

  // The warp's 16 rows of the tile start at begin + 64 tile + 16 warp.
  __device__ __forceinline__ bool HasRows(int tile) const {
    return begin + tile * kTileTokens + warp * kChunkTokens < end;
  }

  __device__ __forceinline__ int FirstTile() const { return 0; }

  __device__ __forceinline__ const unsigned char* LoadTile(int tile) const {
    pipe.WaitFull(tile);
    return pipe.Stage(tile);
  }

  // QK^T: A = 128 + code (bf16, exact), B = q~ hi and lo; per group one epilogue.
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& sc) const {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    sc.valid[0][0] = chunk_first + row_a < end;
    sc.valid[0][1] = chunk_first + row_b < end;
    float s[4];
    {
      uint32_t ka[NW], kb[NW], ka8[NW], kb8[NW];  // 8: bytes 1, 3 moved down
      const unsigned char* kc = stage + warp * kChunkTokens * RB;
      LoadWords<NW>(kc + row_a * RB + t4 * NW * 4, ka);
      LoadWords<NW>(kc + row_b * RB + t4 * NW * 4, kb);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        ka8[w] = ka[w] >> 8;
        kb8[w] = kb[w] >> 8;
      }
      s[0] = s[1] = s[2] = s[3] = 0.0f;
      // One accumulator per group: the fields of a group add up before one epilogue with the
      // group's scale and min; NGK = D / G scales (mins) of a row in one load.
      constexpr int NGK = F / FPGK;
      const unsigned char* meta = stage + Stage::kMetaOffset + warp * kChunkTokens * NGK * 2;
      uint32_t sa[(NGK + 1) / 2], sb[(NGK + 1) / 2], ma[(NGK + 1) / 2], mb[(NGK + 1) / 2];
      LoadBf16Row<NGK>(meta + row_a * NGK * 2, sa);
      LoadBf16Row<NGK>(meta + row_b * NGK * 2, sb);
      LoadBf16Row<NGK>(meta + Stage::kMetaBytes + row_a * NGK * 2, ma);
      LoadBf16Row<NGK>(meta + Stage::kMetaBytes + row_b * NGK * 2, mb);
      StaticFor<NGK>([&](auto gc) {
        constexpr int g = decltype(gc)::value;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        StaticFor<FPGK>([&](auto jc) {
          constexpr int f = g * FPGK + decltype(jc)::value;
          QkField<KBITS, f, NW, PACK>(c, ka, kb, ka8, kb8, code_bias, bq_s, lane);
        });
        const float2 qs = *reinterpret_cast<const float2*>(qsum_s + g * kMaxHeadsPerBlock + h0);
        const float2 qb = *reinterpret_cast<const float2*>(bias_s + g * kMaxHeadsPerBlock + h0);
        QkEpilogue(s, c, qb, qs, Bf16OfRow<g>(sa), Bf16OfRow<g>(sb), Bf16OfRow<g>(ma),
                   Bf16OfRow<g>(mb));
      });
      if constexpr (PACK) {
        // Head h's logit = column h (hi part) + column h + 4 (lo part).
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], 2);
      }
    }
    sc.s[0][0] = sc.valid[0][0] ? s[0] * fac : -INFINITY;
    sc.s[0][1] = sc.valid[0][0] ? s[1] * fac : -INFINITY;
    sc.s[0][2] = sc.valid[0][1] ? s[2] * fac : -INFINITY;
    sc.s[0][3] = sc.valid[0][1] ? s[3] * fac : -INFINITY;
  }

  __device__ __forceinline__ void Softmax(const Scores& s, Probs& pr) {
    WarpSoftmax(st, pv, s, pr);
  }

  __device__ __forceinline__ void Values(const unsigned char* stage, int, const Scores& s,
                                         const Probs& pr) {
    pv.Step(stage, warp, gi, t4, row_a, row_b, vrow, pr.p[0], s.valid[0][0], s.valid[0][1], st);
  }

  __device__ __forceinline__ void ReleaseTile(int tile) const { pipe.Done(tile); }

  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    FinishQuantSplit(p, pv, st, a.smem, gi, a.b, a.head0, a.split);
  }
};

}  // namespace kvq::gpu::attention::detail
