// The decode kernel's loops over INT-b history pages with bf16 MMAs (QuantSplit: the two-MMA
// and packed loops), and what every quantized loop shares: the code fields as MMA operands,
// the tile geometry, the copy pipeline of 64-token tiles, the rotated queries and PV's codes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
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

// The loops of the quantized history (a kernel instantiation each).
enum class QuantLoop : int {
  kTwoMma = 0,  // bf16 MMAs, the hi and lo parts of the query and of p * scale in two MMAs
  kPacked = 1,  // bf16 MMAs, hi and lo in columns h and h + 4 (heads per block <= 4)
  kInt8Qk = 2,  // QK^T on the int8 tensor cores (QuantSplitInt8; heads per block <= 4)
};

template <int D, int BITS>
struct QuantGeometry {
  static constexpr int kFields = 8 / BITS;            // codes per byte
  static constexpr int kRowBytes = D * BITS / 8;      // RB
  static constexpr int kQkWords = kRowBytes / 16;     // u32 words of a row per QK thread
  static constexpr int kPvBytes = kRowBytes / 8;      // bytes of a row per PV thread
  static constexpr int kPvWords = kPvBytes >= 4 ? kPvBytes / 4 : 1;
  static constexpr int kPvPairs = kPvBytes / 2;       // m-tiles per field
  static constexpr int kMaxGroups = D / 32;
  static constexpr int kStages = 4;
  static constexpr int kCodesBytes = kTileTokens * kRowBytes;      // K or V codes of a stage
  static constexpr int kMetaBytes = kTileTokens * kMaxGroups * 2;  // one metadata array
  static constexpr int kStageBytes = 2 * kCodesBytes + 4 * kMetaBytes;
  static constexpr int kBarrierBytes = 16 * kStages;  // full + empty mbarrier per stage
  // q~ [8][D] fp32, then per (field, head) the sums of the represented q~ and of its scaled
  // parts: [2][kFields][8] fp32, and the B fragments of the query, uint4 {hi k-lo, hi k-hi,
  // lo k-lo, lo k-hi} per (k-step, lane): [D/16][32].
  static constexpr int kQueryBytes = kMaxHeadsPerBlock * D * 4 +
                                     2 * kFields * kMaxHeadsPerBlock * 4 + (D / 16) * 32 * 16;
  static_assert(kFields * kQkWords == D / 16, "QK k-steps");
  static_assert(kFields * kPvPairs == D / 16, "PV m-tiles");
  static_assert(kStageBytes % 16 == 0 && kQueryBytes % 16 == 0, "bulk copy alignment");
};

// The copy pipeline of a quantized-history split: kStages shared-memory stages of one 64-token
// tile each (K and V codes, K scale / min, V scale / min), filled by the copy engine and
// released without a block-wide barrier. stage_full[s] completes when a tile's bytes arrived;
// stage_empty[s] when every thread of the block read the stage, and the stage's refill waits for
// that phase.
//
// A tile's rows live in at most 64 / P pages; inside one page the tile's codes, scales and mins
// of this KV head are contiguous runs ([Hkv, P, row] layout), so a tile is 6 bulk copies per
// page run ({K, V} codes, K scale, K min, V scale, V min), issued by lanes of one warp
// (lane = 6 * run + kind) and counted on the stage's mbarrier. Rows are copied in whole
// 16-token chunks (a page holds whole chunks: P >= 16); rows past `end` in the last chunk are
// read but masked by the loop.
template <int D, int BITS>
struct QuantTilePipeline {
  using Geo = QuantGeometry<D, BITS>;
  static constexpr int kFullOffset = Geo::kStages * Geo::kStageBytes + Geo::kQueryBytes;
  const DecodeKernelParams& p;
  unsigned char* smem;
  const unsigned char* copy_src;  // this lane's pool, advanced to KV head kvh's rows of page 0
  int64_t copy_page_stride;
  int copy_row_bytes;
  int copy_dst;
  int begin;
  int end16;
  int n_tiles;
  uint32_t bytes_per_token;
  uint64_t l2_policy;  // EvictFirstPolicy(): the pages are read once a step

  __device__ __forceinline__ uint64_t* Full(int stage) const {
    return reinterpret_cast<uint64_t*>(smem + kFullOffset) + stage;
  }
  __device__ __forceinline__ uint64_t* Empty(int stage) const {
    return reinterpret_cast<uint64_t*>(smem + kFullOffset) + Geo::kStages + stage;
  }
  __device__ __forceinline__ int* PageIds() const {
    return reinterpret_cast<int*>(smem + kFullOffset + Geo::kBarrierBytes);
  }

  // Loads the split's page ids and initialises the barriers; Start() publishes them.
  __device__ __forceinline__ QuantTilePipeline(const DecodeKernelParams& params,
                                               unsigned char* smem_base, int kvh, int b,
                                               int split_begin, int split_end)
      : p(params), smem(smem_base), begin(split_begin) {
    constexpr int RB = Geo::kRowBytes;
    LoadSplitPages(p, b, split_begin, split_end, PageIds());
    n_tiles = (split_end - split_begin + kTileTokens - 1) / kTileTokens;
    end16 = (split_end + kChunkTokens - 1) & ~(kChunkTokens - 1);
    const int ngk = D / p.key_group;
    const int ngv = D / p.value_group;
    bytes_per_token = 2 * RB + 4 * (ngk + ngv);
    l2_policy = EvictFirstPolicy();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < Geo::kStages; ++s) {
        MbarrierInit(Full(s), 1);
        MbarrierInit(Empty(s), kThreads);
      }
      FenceMbarrierInit();
    }
    const int kind = (threadIdx.x & 31) % 6;
    const int ng = kind < 2 ? 0 : (kind < 4 ? ngk : ngv);
    const unsigned char* pool;
    switch (kind) {
      case 0: pool = p.k_codes; copy_page_stride = p.k_codes_page_stride; break;
      case 1: pool = p.v_codes; copy_page_stride = p.v_codes_page_stride; break;
      case 2: pool = reinterpret_cast<const unsigned char*>(p.k_scale); copy_page_stride = p.k_meta_page_stride; break;
      case 3: pool = reinterpret_cast<const unsigned char*>(p.k_min); copy_page_stride = p.k_meta_page_stride; break;
      case 4: pool = reinterpret_cast<const unsigned char*>(p.v_scale); copy_page_stride = p.v_meta_page_stride; break;
      default: pool = reinterpret_cast<const unsigned char*>(p.v_min); copy_page_stride = p.v_meta_page_stride; break;
    }
    copy_row_bytes = kind < 2 ? RB : 2 * ng;
    copy_dst = kind < 2 ? kind * Geo::kCodesBytes : 2 * Geo::kCodesBytes + (kind - 2) * Geo::kMetaBytes;
    copy_src = pool + (static_cast<int64_t>(kvh) << p.page_size_log2) * copy_row_bytes;
  }

  // Tile `tile` (< n_tiles) into stage `stage`; called by a whole warp.
  __device__ __forceinline__ void Issue(int tile, int stage) const {
    const int lane = threadIdx.x & 31;
    const int page_size = 1 << p.page_size_log2;
    const int run_tokens = min(page_size, kTileTokens);
    const int first = begin + tile * kTileTokens;
    const int n_tok = min(kTileTokens, end16 - first);
    if (lane == 0) MbarrierArriveExpectTx(Full(stage), n_tok * bytes_per_token);
    __syncwarp();
    const int r0 = (lane / 6) * run_tokens;
    if (lane < 6 * (kTileTokens / 16) && r0 < n_tok) {
      const int n = min(run_tokens, n_tok - r0);
      const int tok = first + r0;
      const int page = PageIds()[(tok >> p.page_size_log2) - (begin >> p.page_size_log2)];
      const int slot = tok & (page_size - 1);
      const unsigned char* src = copy_src + page * copy_page_stride + slot * copy_row_bytes;
      BulkCopy(smem + stage * Geo::kStageBytes + copy_dst + r0 * copy_row_bytes, src,
               n * copy_row_bytes, Full(stage), l2_policy);
    }
  }

  // Publishes the page ids and barriers, then warp 0 issues the first `tiles` tiles (the pages
  // were written before the rotation kernel started, so this may run before the query wait).
  __device__ __forceinline__ void Start(int tiles) const {
    __syncthreads();
    if ((threadIdx.x >> 5) == 0) {
#pragma unroll
      for (int s = 0; s < Geo::kStages; ++s) {
        if (s < tiles && s < n_tiles) Issue(s, s);
      }
    }
  }

  __device__ __forceinline__ const unsigned char* Stage(int tile) const {
    return smem + (tile % Geo::kStages) * Geo::kStageBytes;
  }
  __device__ __forceinline__ void WaitFull(int tile) const {
    MbarrierWait(Full(tile % Geo::kStages), (tile / Geo::kStages) & 1);
  }
  // This thread is done reading tile's stage.
  __device__ __forceinline__ void Release(int tile) const {
    MbarrierArrive(Empty(tile % Geo::kStages));
  }
  // Refill of the stages of step `tile`'s predecessors: step i's producer is warp (i / cpw) % 4
  // (the role rotates, so no warp carries it every step). Tile `next` goes into the stage of
  // tile next - kStages, which every thread must have released. With cpw = 1 the producer
  // issues at the end of its step (tile + 3, needed two steps later; the others have usually
  // released tile - 1 by then); with cpw = 2 at the start (the tiles are needed next step).
  __device__ __forceinline__ void Produce(int tile, int cpw) const {
    if ((threadIdx.x >> 5) != (tile / cpw) % kWarps) return;
    for (int u = 0; u < cpw; ++u) {
      const int next = tile + Geo::kStages - cpw + u;
      if (next < n_tiles) {
        if (next >= Geo::kStages) {
          MbarrierWait(Empty(next % Geo::kStages), ((next / Geo::kStages) - 1) & 1);
        }
        Issue(next, next % Geo::kStages);
      }
    }
  }
};

// q~ of the block's heads (0 past heads_per_block) into q_s [kMaxHeadsPerBlock][D]; waits for
// the rotation kernel first (q_rot is its output) and ends with a block barrier.
template <int D>
__device__ __forceinline__ void LoadRotatedQueries(const DecodeKernelParams& p, int b, int head0,
                                                   float* q_s) {
  WaitForPrerequisiteGrid();
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

// CPW: 16-token chunks per warp and loop step (1 or 2). With 2, a warp runs QK^T of two
// chunks (from two consecutive tiles) side by side, one softmax update for both, then both PVs:
// twice the independent work between the dependent steps, half the barriers and reductions.
// PACK (heads_per_block <= 4): the bf16 hi and lo parts of the query and of p * scale use the
// two halves of the MMA's N = 8 columns: column h < 4 carries head h's hi part, column h + 4
// its lo part. QK^T and PV are one MMA each instead of two; the hi and lo columns are added by
// one shuffle (lane ^ 2: columns 2*t4 and 2*t4 + 4) after QK^T of a chunk, and once at the end
// of the split for the PV accumulators. Lanes t4 and t4 ^ 2 then hold the same logits and run
// the same softmax, so their m, l and p agree bit for bit.
// FPGK, FPGV: fields per quantization group of K and of V (G / RB) as compile-time values
// (1, 2 or 4; the group epilogue), or 0: the group of a field looked up at run time and QK^T
// finished per field (the per-field epilogue). With FPGK > 0 the fields of a group share one
// accumulator and one epilogue, and a row's scales / mins (D / G bf16) are one 2-, 4- or
// 8-byte load each.
template <int D, int BITS, int CPW, bool PACK, int FPGK = 0, int FPGV = 0>
__device__ __forceinline__ void QuantSplit(const DecodeKernelParams& p, unsigned char* smem,
                                           int kvh, int head0, int b, int split, int begin,
                                           int end) {
  using Geo = QuantGeometry<D, BITS>;
  constexpr int F = Geo::kFields;
  constexpr int RB = Geo::kRowBytes;
  constexpr int NW = Geo::kQkWords;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gi = lane >> 2;
  const int t4 = lane & 3;
  const int h0 = 2 * t4;
  const int ngk = D / p.key_group;
  const int ngv = D / p.value_group;
  const int fpg_k = p.key_group / RB;    // fields per group (>= 1, a power of two)
  const int fpg_v = p.value_group / RB;
  const int fpg_k_log2 = __ffs(fpg_k) - 1;  // group of field f: f >> log2 (no division)
  const int fpg_v_log2 = __ffs(fpg_v) - 1;
  const uint32_t code_bias = p.code_bias;   // 0x43004300, kept in a register

  using Pipeline = QuantTilePipeline<D, BITS>;
  const Pipeline pipe(p, smem, kvh, b, begin, end);
  const int n_tiles = pipe.n_tiles;
  float* q_s = reinterpret_cast<float*>(smem + Geo::kStages * Geo::kStageBytes);

  // Query prologue: q~ of the block's heads into shared memory, then bf16 hi + lo B fragments
  // of head gi (QK^T runs twice, once per part: the query keeps ~16 significant bits), and per
  // field the sum of the represented q~ (hi + lo) over the field's channels (min term).
  static_assert(CPW == 1 || CPW == 2, "chunks per warp step");
  pipe.Start(Geo::kStages - CPW);
  LoadRotatedQueries<D>(p, b, head0, q_s);

  // Field f's codes enter the MMA as 128 + 2^shift(f) * q, so its query part is scaled by
  // 2^-shift(f) (exact) and the bias removed in the epilogue through bias_sum.
  // The query fragments live in shared memory (read once per k-step, 16 bytes a lane) rather
  // than in 4*D/16 registers, which keeps the kernel under 128 registers without spills.
  uint4* bq_s = reinterpret_cast<uint4*>(q_s + kMaxHeadsPerBlock * D + 2 * F * kMaxHeadsPerBlock);
  // qsum_s[f][h]: sum of the represented q~ (hi + lo) of head h over field f's channels;
  // bias_s[f][h]: the same over the scaled parts (128 * bias_s is the codes' bias).
  float* qsum_s = q_s + kMaxHeadsPerBlock * D;
  float* bias_s = qsum_s + F * kMaxHeadsPerBlock;
  uint2* bq2_s = reinterpret_cast<uint2*>(bq_s);  // PACK: {part k-lo, part k-hi} per lane
  {
    // PACK: column gi carries the hi (gi < 4) or lo (gi >= 4) part of head gi & 3.
    const float* qh = q_s + (PACK ? (gi & 3) : gi) * D;
    const bool lo_column = PACK && gi >= 4;
    float group_bias = 0.0f, group_qsum = 0.0f;  // FPGK > 0
    StaticFor<F>([&](auto fc) {
      constexpr int f = decltype(fc)::value;
      constexpr float kScale = 1.0f / static_cast<float>(1 << CodeField<BITS, f>::kShift);
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
            const float2 pf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&part[k]));
            sum += pf.x + pf.y;
          }
        } else {
          if (warp == 0) bq_s[(f * NW + w) * 32 + lane] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float2 hf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi[k]));
            const float2 lf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&lo[k]));
            sum += (hf.x + lf.x) + (hf.y + lf.y);
          }
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if constexpr (FPGK > 0) {
        // Group epilogue: the sums over the fields of group f / FPGK.
        group_bias += sum;
        group_qsum += sum / kScale;  // exact: a power of two
        if (f % FPGK == FPGK - 1) {
          if (warp == 0 && t4 == 0) {
            const int at = (f / FPGK) * kMaxHeadsPerBlock + gi;
            bias_s[at] = group_bias;
            qsum_s[at] = group_qsum;
          }
          group_bias = group_qsum = 0.0f;
        }
      } else if (warp == 0 && t4 == 0) {  // one writer per column; read after the loop's first barrier
        const int at = f * kMaxHeadsPerBlock + gi;
        bias_s[at] = sum;
        qsum_s[at] = sum / kScale;  // exact: a power of two
      }
    });
  }
  const float fac = p.logit_scale_log2;

  WarpState<D> st;
  st.Init();
  float min_sum[F][2];
#pragma unroll
  for (int f = 0; f < F; ++f) min_sum[f][0] = min_sum[f][1] = 0.0f;

  const int row_a = ChunkRow(gi);
  const int row_b = ChunkRow(gi + 8);
  const int vrow[4] = {ChunkRow(2 * t4), ChunkRow(2 * t4 + 1), ChunkRow(2 * t4 + 8),
                       ChunkRow(2 * t4 + 9)};

  // Publishes the query fragments and sums (written by warp 0) before the loop; the loop itself
  // has no block-wide barrier (QuantTilePipeline), so warps drift apart by up to the pipeline
  // depth instead of meeting every tile.
  __syncthreads();
  for (int tile = 0; tile < n_tiles; tile += CPW) {
    if constexpr (CPW > 1) pipe.Produce(tile, CPW);
    // Sub-chunk u: this warp's 16 rows of tile + u.
    const unsigned char* stage[CPW];
    int chunk_first[CPW];
    bool has[CPW];
#pragma unroll
    for (int u = 0; u < CPW; ++u) {
      const int t = tile + u;
      chunk_first[u] = begin + t * kTileTokens + warp * kChunkTokens;
      has[u] = t < n_tiles && chunk_first[u] < end;
      if (t < n_tiles) pipe.WaitFull(t);
      // A sub-chunk without rows reads the first one's (loaded) rows, all masked.
      stage[u] = pipe.Stage(has[u] ? t : tile);
    }
    do {
    if (!has[0]) break;  // has[u] implies has[0]
    bool valid_a[CPW], valid_b[CPW];
#pragma unroll
    for (int u = 0; u < CPW; ++u) {
      valid_a[u] = has[u] && chunk_first[u] + row_a < end;
      valid_b[u] = has[u] && chunk_first[u] + row_b < end;
    }

    // ---- QK^T: A = 128 + code (bf16, exact), B = q~ hi and lo ----
    float s[CPW][4];
    {
      uint32_t ka[CPW][NW], kb[CPW][NW], ka8[CPW][NW], kb8[CPW][NW];  // 8: bytes 1, 3 moved down
#pragma unroll
      for (int u = 0; u < CPW; ++u) {
        const unsigned char* kc = stage[u] + warp * kChunkTokens * RB;
        LoadWords<NW>(kc + row_a * RB + t4 * NW * 4, ka[u]);
        LoadWords<NW>(kc + row_b * RB + t4 * NW * 4, kb[u]);
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          ka8[u][w] = ka[u][w] >> 8;
          kb8[u][w] = kb[u][w] >> 8;
        }
        s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.0f;
      }
      if constexpr (FPGK > 0) {
        // One accumulator per (group, sub-chunk): the fields of a group add up before one
        // epilogue with the group's scale and min; NGK = D / G scales (mins) of a row in one load.
        constexpr int NGK = F / FPGK;
#pragma unroll
        for (int u = 0; u < CPW; ++u) {
          const unsigned char* meta = stage[u] + 2 * Geo::kCodesBytes + warp * kChunkTokens * NGK * 2;
          uint32_t sa[(NGK + 1) / 2], sb[(NGK + 1) / 2], ma[(NGK + 1) / 2], mb[(NGK + 1) / 2];
          LoadBf16Row<NGK>(meta + row_a * NGK * 2, sa);
          LoadBf16Row<NGK>(meta + row_b * NGK * 2, sb);
          LoadBf16Row<NGK>(meta + Geo::kMetaBytes + row_a * NGK * 2, ma);
          LoadBf16Row<NGK>(meta + Geo::kMetaBytes + row_b * NGK * 2, mb);
          StaticFor<NGK>([&](auto gc) {
            constexpr int g = decltype(gc)::value;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            StaticFor<FPGK>([&](auto jc) {
              constexpr int f = g * FPGK + decltype(jc)::value;
              QkField<BITS, f, NW, PACK>(c, ka[u], kb[u], ka8[u], kb8[u], code_bias, bq_s, lane);
            });
            const float2 qs = *reinterpret_cast<const float2*>(qsum_s + g * kMaxHeadsPerBlock + h0);
            const float2 qb = *reinterpret_cast<const float2*>(bias_s + g * kMaxHeadsPerBlock + h0);
            QkEpilogue(s[u], c, qb, qs, Bf16OfRow<g>(sa), Bf16OfRow<g>(sb), Bf16OfRow<g>(ma),
                       Bf16OfRow<g>(mb));
          });
        }
      } else {
      // One accumulator per (field, sub-chunk), finished by its own epilogue with its group's
      // scale and min (the sum over the fields of a group is the group's term): no run-time
      // branch on the group size, and F * CPW independent HMMA chains of 2*NW.
      StaticFor<F>([&](auto fc) {
        constexpr int f = decltype(fc)::value;
        const int g = f >> fpg_k_log2;
        const float2 qs = *reinterpret_cast<const float2*>(qsum_s + f * kMaxHeadsPerBlock + h0);
        const float2 qb = *reinterpret_cast<const float2*>(bias_s + f * kMaxHeadsPerBlock + h0);
#pragma unroll
        for (int u = 0; u < CPW; ++u) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          QkField<BITS, f, NW, PACK>(c, ka[u], kb[u], ka8[u], kb8[u], code_bias, bq_s, lane);
          const uint16_t* ks = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes) +
                               warp * kChunkTokens * ngk;
          const uint16_t* km = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes +
                                                                 Geo::kMetaBytes) +
                               warp * kChunkTokens * ngk;
          QkEpilogue(s[u], c, qb, qs, Bf16ToFloat(ks[row_a * ngk + g]),
                     Bf16ToFloat(ks[row_b * ngk + g]), Bf16ToFloat(km[row_a * ngk + g]),
                     Bf16ToFloat(km[row_b * ngk + g]));
        }
      });
      }  // FPGK == 0
      if constexpr (PACK) {
        // Head h's logit = column h (hi part) + column h + 4 (lo part).
#pragma unroll
        for (int u = 0; u < CPW; ++u) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[u][i] += __shfl_xor_sync(0xffffffffu, s[u][i], 2);
        }
      }
    }
    float sl[CPW][4];
#pragma unroll
    for (int u = 0; u < CPW; ++u) {
      sl[u][0] = valid_a[u] ? s[u][0] * fac : -INFINITY;
      sl[u][1] = valid_a[u] ? s[u][1] * fac : -INFINITY;
      sl[u][2] = valid_b[u] ? s[u][2] * fac : -INFINITY;
      sl[u][3] = valid_b[u] ? s[u][3] * fac : -INFINITY;
    }
    float pr[CPW][4];
    float alpha[2];
    if (st.template UpdateN<CPW>(sl, pr, alpha)) {  // alpha == 1 on lanes whose max did not move
#pragma unroll
      for (int f = 0; f < F; ++f) {
        min_sum[f][0] *= alpha[0];
        min_sum[f][1] *= alpha[1];
      }
    }

    // ---- PV: A = code (bf16, exact), B = p * scale hi and lo; min term on the side ----
#pragma unroll
    for (int u = 0; u < CPW; ++u) {
      const unsigned char* vc = stage[u] + Geo::kCodesBytes + warp * kChunkTokens * RB;
      const uint16_t* vsc = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes +
                                                              2 * Geo::kMetaBytes) +
                            warp * kChunkTokens * ngv;
      const uint16_t* vmn = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes +
                                                              3 * Geo::kMetaBytes) +
                            warp * kChunkTokens * ngv;
      const bool va = valid_a[u], vb = valid_b[u];
      const float(&pu)[4] = pr[u];
      const PvCodes<D, BITS> codes(vc, vrow, gi);
      // FPGV > 0: the row's NGV scales and mins, one load each.
      constexpr int NGV = FPGV > 0 ? F / FPGV : 1;
      uint32_t vsa[(NGV + 1) / 2], vsb[(NGV + 1) / 2], vma[(NGV + 1) / 2], vmb[(NGV + 1) / 2];
      if constexpr (FPGV > 0) {
        LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vsc + row_a * NGV), vsa);
        LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vsc + row_b * NGV), vsb);
        LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vmn + row_a * NGV), vma);
        LoadBf16Row<NGV>(reinterpret_cast<const unsigned char*>(vmn + row_b * NGV), vmb);
      }
      uint32_t bh0 = 0, bh1 = 0, bl0 = 0, bl1 = 0;
      float mfa = 0.0f, mfb = 0.0f;
      StaticFor<F>([&](auto fc) {
        constexpr int f = decltype(fc)::value;
        if (FPGV > 0 ? f % (FPGV > 0 ? FPGV : 1) == 0 : (f & (fpg_v - 1)) == 0) {
          float sfa, sfb;
          // Select, not multiply: rows past the end may hold any bits.
          if constexpr (FPGV > 0) {
            constexpr int g = f / (FPGV > 0 ? FPGV : 1);
            sfa = va ? Bf16OfRow<g>(vsa) : 0.0f;
            sfb = vb ? Bf16OfRow<g>(vsb) : 0.0f;
            mfa = va ? Bf16OfRow<g>(vma) : 0.0f;
            mfb = vb ? Bf16OfRow<g>(vmb) : 0.0f;
          } else {
            const int g = f >> fpg_v_log2;
            sfa = va ? Bf16ToFloat(vsc[row_a * ngv + g]) : 0.0f;
            sfb = vb ? Bf16ToFloat(vsc[row_b * ngv + g]) : 0.0f;
            mfa = va ? Bf16ToFloat(vmn[row_a * ngv + g]) : 0.0f;
            mfb = vb ? Bf16ToFloat(vmn[row_b * ngv + g]) : 0.0f;
          }
          uint32_t hi_a, lo_a, hi_b, lo_b;
          // B = p * scale * 2^64 against the in-place (subnormal) code fields.
          const float sfa_v = sfa * kPvOperandScale, sfb_v = sfb * kPvOperandScale;
          SplitBf16(pu[0] * sfa_v, pu[1] * sfa_v, hi_a, lo_a);
          SplitBf16(pu[2] * sfb_v, pu[3] * sfb_v, hi_b, lo_b);
          if constexpr (PACK) {
            // Columns 2*t4, 2*t4 + 1 >= 4 (t4 >= 2) take the lo part.
            bh0 = Transpose8x8(t4 >= 2 ? lo_a : hi_a);
            bh1 = Transpose8x8(t4 >= 2 ? lo_b : hi_b);
          } else {
            bh0 = Transpose8x8(hi_a);
            bh1 = Transpose8x8(hi_b);
            bl0 = Transpose8x8(lo_a);
            bl1 = Transpose8x8(lo_b);
          }
        }
        min_sum[f][0] += pu[0] * mfa + pu[2] * mfb;
        min_sum[f][1] += pu[1] * mfa + pu[3] * mfb;
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
    } while (false);
    // This thread is done reading the step's stages (tile + u).
#pragma unroll
    for (int u = 0; u < CPW; ++u) {
      if (tile + u < n_tiles) pipe.Release(tile + u);
    }
    if constexpr (CPW == 1) pipe.Produce(tile, CPW);
  }
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
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return PvChannel<D, BITS>(mt, upper, gi); }, smem, b,
      head0, split);
}

}  // namespace kvq::gpu::attention::detail
