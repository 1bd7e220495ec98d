// The decode-attention kernel family (layer (a) of kvq/gpu/attention_launch.h). Included by
// one .cu file per history format so the instantiations compile in parallel.
//
// Tensor-core tiling (mma.sync m16n8k16 bf16, fp32 accumulators). A block is 4 warps; a
// pipeline stage holds 64 tokens, 16 per warp. Per warp and 16 tokens:
//   QK^T: M = 16 tokens, N = 8 query heads, K = channels. A = the K rows, B = the queries.
//         INT-b: A holds the codes as bf16 128 + 2^s*q (exact; s puts a field in place when it
//         fits the mantissa, saving a shift), B = q~ * 2^-s split into bf16 hi + lo (two MMAs,
//         ~16 significant bits); per (token, group) the fp32 epilogue applies
//         s = scale * (C - 128 * sum q~') + min * sum q~. bf16 rows: A = K (ldmatrix),
//         B = q split into hi + lo (lo = 0 for bf16 queries is skipped).
//   PV:   M = 16 channels, N = 8 heads, K = 16 tokens. A = V^T (INT-b: each code field in
//         place, exactly 2^(f*b) * q * 2^-133 as a bf16 subnormal, one AND a register),
//         B = p * scale * 2^64 (INT-b) or p (bf16 rows) split into bf16 hi + lo; the min term
//         sum_t p_t * min_t is a per-group scalar added at the end. The S accumulator
//         (tokens x heads) becomes the B operand of PV through movmatrix (an 8x8 transpose in
//         registers).
//
// Channel maps. A dot product over channels may visit them in any order as long as both
// operands agree, so each thread takes whole code bytes: in QK, thread t4 = lane % 4 owns bytes
// [t4*RB/4, (t4+1)*RB/4) of its token rows (RB = d*b/8 bytes a row) and one k-step consumes the
// same field (2-bit or 4-bit slot) of four consecutive bytes; in PV, thread gi = lane / 4 owns
// bytes [gi*RB/8, (gi+1)*RB/8) and one m-tile takes one field of two consecutive bytes. A field
// of a byte covers RB consecutive channels (spec packing), so with G >= RB every k-step and
// m-tile lies inside one quantization group. The launcher refuses G < RB.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention::detail {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kChunkTokens = 16;  // tokens per warp per stage


// ------------------------------------------------------------------------------------------
// PTX helpers.

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; valid == false writes 16 zero bytes and reads
// nothing (src must still be a mapped address).
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(smem_dst)),
               "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarrier (one arrival + a transaction count) completed by cp.async.bulk copies.
__device__ __forceinline__ void MbarrierInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddress(bar)), "r"(count)
               : "memory");
}
// Makes the initialised barriers visible to the async proxy (the bulk copies).
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
}
// One arrival of this thread (release: its earlier shared-memory reads are ordered before the
// phase completes).
__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddress(bar)) : "memory");
}
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddress(bar)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared by the copy engine;
// completion is counted on bar.
__device__ __forceinline__ void BulkCopy(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          SmemAddress(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(SmemAddress(bar))
      : "memory");
}

// Programmatic dependent launch (launch.cuh).
using launch::LaunchDependents;
using launch::WaitForPrerequisiteGrid;

// Profiling record of one block (DecodeKernelParams::timeline; null: nothing is written):
// {globaltimer ns at entry, when its inputs from the previous kernel were ready (a history
// block's rotated queries, a merge block's partials; 0: not stamped), at exit,
// SM id | BlockKind << 32}, written by thread 0. Static calls that keep nothing live between
// them, so a kernel's register allocation does not change.
struct BlockTimeline {
  __device__ __forceinline__ static void Enter(uint64_t* timeline, BlockKind kind) {
    if (timeline && threadIdx.x == 0) {
      uint64_t* r = Record(timeline);
      r[0] = Now();
      r[1] = 0;
      r[2] = 0;
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      r[3] = sm | static_cast<uint64_t>(kind) << 32;
    }
  }
  __device__ __forceinline__ static void SetKind(uint64_t* timeline, BlockKind kind) {
    if (timeline && threadIdx.x == 0) {
      uint64_t* r = Record(timeline);
      r[3] = (r[3] & 0xffffffffu) | static_cast<uint64_t>(kind) << 32;
    }
  }
  __device__ __forceinline__ static void InputsReady(uint64_t* timeline) {
    if (timeline && threadIdx.x == 0) Record(timeline)[1] = Now();
  }
  __device__ __forceinline__ static void Exit(uint64_t* timeline) {
    if (timeline && threadIdx.x == 0) Record(timeline)[2] = Now();
  }

 private:
  __device__ __forceinline__ static uint64_t* Record(uint64_t* timeline) {
    const uint64_t block =
        blockIdx.x + static_cast<uint64_t>(gridDim.x) *
                         (blockIdx.y + static_cast<uint64_t>(gridDim.y) * blockIdx.z);
    return timeline + 4 * block;
  }
  __device__ __forceinline__ static uint64_t Now() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
};

__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 8x8 b16 transpose across the warp: thread (r = lane/4, c = lane%4) holds row r, columns
// 2c, 2c+1 before and after.
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

__device__ __forceinline__ uint32_t BitsOf(__nv_bfloat162 h) {
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float Bf16ToFloat(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
// The N bf16 of a row (N = 1, 2, 4; 2N-byte aligned) in one shared-memory load, two a word.
template <int N>
__device__ __forceinline__ void LoadBf16Row(const unsigned char* p, uint32_t (&w)[(N + 1) / 2]) {
  if constexpr (N == 1) {
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (N == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(N == 4, "bf16 values a row");
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  }
}
// Value I of a row loaded by LoadBf16Row, as fp32 (low half: shift; high half: mask).
template <int I, int W>
__device__ __forceinline__ float Bf16OfRow(const uint32_t (&w)[W]) {
  return (I & 1) ? __uint_as_float(w[I / 2] & 0xffff0000u) : __uint_as_float(w[I / 2] << 16);
}

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

template <int N>
struct IntC {
  static constexpr int value = N;
};
// Calls body(IntC<0>{}), ..., body(IntC<N-1>{}): a loop with a compile-time index.
template <int N, int I = 0, typename Body>
__device__ __forceinline__ void StaticFor(Body&& body) {
  if constexpr (I < N) {
    body(IntC<I>{});
    StaticFor<N, I + 1>(body);
  }
}

// x = hi + lo with hi = bf16(x), lo = bf16(x - hi): about 16 significant bits in two bf16.
__device__ __forceinline__ void SplitBf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(__fsub_rn(x0, hf.x), __fsub_rn(x1, hf.y));
  hi = BitsOf(h);
  lo = BitsOf(l);
}

// Token order inside a 16-token chunk: M-row r of the QK tile (= k index r of the PV tile)
// reads chunk row Perm(r). Swapping neighbours in rows 4..7 and 12..15 makes the 4-byte V loads
// of PV (rows 2c, 2c+1, 2c+8, 2c+9 across c) bank-conflict-free for 32-byte rows.
__device__ __forceinline__ int ChunkRow(int r) { return r ^ ((r >> 2) & 1); }

template <int N>
__device__ __forceinline__ void LoadWords(const unsigned char* p, uint32_t (&w)[N]) {
  if constexpr (N == 1) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
    static_assert(N % 4 == 0, "word count");
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + 4 * i);
      w[i] = v.x;
      w[i + 1] = v.y;
      w[i + 2] = v.z;
      w[i + 3] = v.w;
    }
  }
}

// 2^x by the SFU (relative error below 2^-22; -inf gives +0).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The running max moves only when a chunk's max exceeds it by more than this (exp2 domain), so
// after the first chunks the accumulator rescale (D/4 + 8 FMUL and a warp vote) is rare. The
// max is only a stabiliser: p = exp2(s - m) <= 2^8 stays exact to fp32 rounding, l and acc stay
// far inside the fp32 range, and the merge uses each partial's own m.
inline constexpr float kRescaleThresholdLog2 = 8.0f;

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
// split's page-relative index i (page index begin/P + i).
__device__ __forceinline__ void LoadSplitPages(const DecodeKernelParams& p, int b, int begin,
                                               int end, int* ids) {
  const int32_t* table = p.page_tables + static_cast<int64_t>(b) * p.page_table_stride;
  const int first = begin >> p.page_size_log2;
  const int n = ((end - 1) >> p.page_size_log2) - first + 1;
  for (int i = threadIdx.x; i < n; i += kThreads) ids[i] = table[first + i];
}

// Combines the 4 warps' states through shared memory and writes the block's partial.
// channel(mt, upper) maps accumulator row gi (+8 when upper) of m-tile mt to a channel.
// Call after every warp finished its last chunk and the shared stages are free.
template <int D, typename ChannelMap>
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
  for (int i = threadIdx.x; i < p.heads_per_block * D; i += kThreads) {
    const int h = i / D;
    const int c = i - h * D;
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, wm[w * kMaxHeadsPerBlock + h]);
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * splits + split;
    if (big == -INFINITY) {
      if (c == 0) {
        p.part_ml[2 * row] = -INFINITY;
        p.part_ml[2 * row + 1] = 0.0f;
      }
      continue;
    }
    float a = 0.0f;
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wm[w * kMaxHeadsPerBlock + h];
      if (mw == -INFINITY) continue;
      const float f = exp2f(mw - big);
      a += wacc[(w * kMaxHeadsPerBlock + h) * D + c] * f;
      l += wl[w * kMaxHeadsPerBlock + h] * f;
    }
    p.part_acc[row * D + c] = a;
    if (c == 0) {
      p.part_ml[2 * row] = big;
      p.part_ml[2 * row + 1] = l;
    }
  }
}

// ------------------------------------------------------------------------------------------
// bf16 rows: the sink + recent window of a quantized cache (PAGED = false) or the pages of the
// bf16 cache (PAGED = true). Rows [begin, end) of the segment.

template <int D>
struct Bf16Geometry {
  static constexpr int kRowStride = (D + 8) * 2;  // bytes; +16 keeps ldmatrix conflict-free
  static constexpr int kStageBytes = 2 * kTileTokens * kRowStride;
  static constexpr int kPieces = D / 8;           // 16-byte pieces a row
};

template <int D, bool PAGED, int STAGES>
__device__ __forceinline__ void Bf16Split(const DecodeKernelParams& p, unsigned char* smem,
                                          int kvh, int head0, int b, int split, int begin,
                                          int end, int n_sink, int recent_begin) {
  using Geo = Bf16Geometry<D>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gi = lane >> 2;
  const int t4 = lane & 3;

  // Query fragments of head gi (B operand of QK, natural channel order), as bf16 hi + lo.
  uint32_t bq_hi[D / 16][2];
  uint32_t bq_lo[D / 16][2];
  bool any_lo = false;
  {
    const bool real = gi < p.heads_per_block;
    const float* q = p.q + (static_cast<int64_t>(b) * p.num_q_heads + head0 + (real ? gi : 0)) * D;
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
  int* page_ids = reinterpret_cast<int*>(smem + STAGES * Geo::kStageBytes);
  const int first_page = begin >> p.page_size_log2;
  if constexpr (PAGED) LoadSplitPages(p, b, begin, end, page_ids);
  const bool use_lo = __syncthreads_or(any_lo) != 0;  // also publishes page_ids

  WarpState<D> st;
  st.Init();

  const int n_tokens = end - begin;
  const int n_tiles = (n_tokens + kTileTokens - 1) / kTileTokens;
  const int64_t row_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int page_size = 1 << p.page_size_log2;

  auto issue = [&](int tile, int stage) {
    unsigned char* dst_stage = smem + stage * Geo::kStageBytes;
    const int first = begin + tile * kTileTokens;
    for (int idx = threadIdx.x; idx < 2 * kTileTokens * Geo::kPieces; idx += kThreads) {
      const int kv = idx / (kTileTokens * Geo::kPieces);
      const int rem = idx - kv * kTileTokens * Geo::kPieces;
      const int r = rem / Geo::kPieces;
      const int piece = rem - r * Geo::kPieces;
      const int tok = first + r;
      const bool valid = tok < end;
      const uint16_t* src;
      if constexpr (PAGED) {
        const uint8_t* pool = kv ? p.v_codes : p.k_codes;
        const int64_t stride = kv ? p.v_codes_page_stride : p.k_codes_page_stride;
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
          const int slot = pos % p.recent;
          src = ring + (static_cast<int64_t>(b) * p.recent + slot) * row_elems + kvh * D;
        }
      }
      CpAsync16(dst_stage + kv * kTileTokens * Geo::kRowStride + r * Geo::kRowStride + piece * 16,
                src + piece * 8, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) issue(s, s);
    CpAsyncCommit();
  }
  for (int tile = 0; tile < n_tiles; ++tile) {
    if constexpr (STAGES == 1) {
      // No pipeline (the window is a few tiles): load, wait, compute, and keep the buffer
      // until every warp is done with it.
      if (tile > 0) __syncthreads();
      issue(tile, 0);
      CpAsyncCommit();
      CpAsyncWait<0>();
      __syncthreads();
    } else {
      CpAsyncWait<STAGES - 2>();
      __syncthreads();
      const int next = tile + STAGES - 1;
      if (next < n_tiles) issue(next, next % STAGES);
      CpAsyncCommit();
    }
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    if (chunk_first < end) {
      const unsigned char* ks =
          smem + (tile % STAGES) * Geo::kStageBytes + warp * kChunkTokens * Geo::kRowStride;
      const unsigned char* vs = ks + kTileTokens * Geo::kRowStride;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        LdMatrixX4(a, ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * Geo::kRowStride +
                          (16 * kk + 8 * (lane >> 4)) * 2);
        MmaBf16(c, a[0], a[1], a[2], a[3], bq_hi[kk][0], bq_hi[kk][1]);
        if (use_lo) MmaBf16(c, a[0], a[1], a[2], a[3], bq_lo[kk][0], bq_lo[kk][1]);
      }
      const bool valid_a = chunk_first + gi < end;
      const bool valid_b = chunk_first + gi + 8 < end;
      const float f = p.logit_scale_log2;
      const float sl[4] = {valid_a ? c[0] * f : -INFINITY, valid_a ? c[1] * f : -INFINITY,
                           valid_b ? c[2] * f : -INFINITY, valid_b ? c[3] * f : -INFINITY};
      float pr[4];
      float alpha[2];
      st.Update(sl, pr, alpha);
      uint32_t hi_a, lo_a, hi_b, lo_b;
      SplitBf16(pr[0], pr[1], hi_a, lo_a);
      SplitBf16(pr[2], pr[3], hi_b, lo_b);
      const uint32_t bh0 = Transpose8x8(hi_a), bh1 = Transpose8x8(hi_b);
      const uint32_t bl0 = Transpose8x8(lo_a), bl1 = Transpose8x8(lo_b);
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        uint32_t a[4];
        LdMatrixX4Trans(a, vs + ((lane & 7) + 8 * (lane >> 4)) * Geo::kRowStride +
                               (16 * mt + 8 * ((lane >> 3) & 1)) * 2);
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return 16 * mt + gi + 8 * upper; }, smem, b, head0, split);
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
               n * copy_row_bytes, Full(stage));
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
              using Field = CodeField<BITS, f>;
#pragma unroll
              for (int w = 0; w < NW; ++w) {
                const uint32_t a0 = Field::Biased(ka[u][w], code_bias);
                const uint32_t a1 = Field::Biased(kb[u][w], code_bias);
                const uint32_t a2 = Field::Biased(ka8[u][w], code_bias);
                const uint32_t a3 = Field::Biased(kb8[u][w], code_bias);
                if constexpr (PACK) {
                  const uint2 bq = bq2_s[(f * NW + w) * 32 + lane];
                  MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
                } else {
                  const uint4 bq = bq_s[(f * NW + w) * 32 + lane];
                  MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
                  MmaBf16(c, a0, a1, a2, a3, bq.z, bq.w);
                }
              }
            });
            const float2 qs = *reinterpret_cast<const float2*>(qsum_s + g * kMaxHeadsPerBlock + h0);
            const float2 qb = *reinterpret_cast<const float2*>(bias_s + g * kMaxHeadsPerBlock + h0);
            const float sfa = Bf16OfRow<g>(sa), sfb = Bf16OfRow<g>(sb);
            const float mfa = Bf16OfRow<g>(ma), mfb = Bf16OfRow<g>(mb);
            const float c0 = c[0] - 128.0f * qb.x, c1 = c[1] - 128.0f * qb.y;
            const float c2 = c[2] - 128.0f * qb.x, c3 = c[3] - 128.0f * qb.y;
            s[u][0] += sfa * c0 + mfa * qs.x;
            s[u][1] += sfa * c1 + mfa * qs.y;
            s[u][2] += sfb * c2 + mfb * qs.x;
            s[u][3] += sfb * c3 + mfb * qs.y;
          });
        }
      } else {
      // One accumulator per (field, sub-chunk), finished by its own epilogue with its group's
      // scale and min (the sum over the fields of a group is the group's term): no run-time
      // branch on the group size, and F * CPW independent HMMA chains of 2*NW.
      StaticFor<F>([&](auto fc) {
        constexpr int f = decltype(fc)::value;
        using Field = CodeField<BITS, f>;
        const int g = f >> fpg_k_log2;
        const float2 qs = *reinterpret_cast<const float2*>(qsum_s + f * kMaxHeadsPerBlock + h0);
        const float2 qb = *reinterpret_cast<const float2*>(bias_s + f * kMaxHeadsPerBlock + h0);
#pragma unroll
        for (int u = 0; u < CPW; ++u) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int w = 0; w < NW; ++w) {
            const uint32_t a0 = Field::Biased(ka[u][w], code_bias);
            const uint32_t a1 = Field::Biased(kb[u][w], code_bias);
            const uint32_t a2 = Field::Biased(ka8[u][w], code_bias);
            const uint32_t a3 = Field::Biased(kb8[u][w], code_bias);
            if constexpr (PACK) {
              const uint2 bq = bq2_s[(f * NW + w) * 32 + lane];
              MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
            } else {
              const uint4 bq = bq_s[(f * NW + w) * 32 + lane];
              MmaBf16(c, a0, a1, a2, a3, bq.x, bq.y);
              MmaBf16(c, a0, a1, a2, a3, bq.z, bq.w);
            }
          }
          const uint16_t* ks = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes) +
                               warp * kChunkTokens * ngk;
          const uint16_t* km = reinterpret_cast<const uint16_t*>(stage[u] + 2 * Geo::kCodesBytes +
                                                                 Geo::kMetaBytes) +
                               warp * kChunkTokens * ngk;
          const float sfa = Bf16ToFloat(ks[row_a * ngk + g]);
          const float sfb = Bf16ToFloat(ks[row_b * ngk + g]);
          const float mfa = Bf16ToFloat(km[row_a * ngk + g]);
          const float mfb = Bf16ToFloat(km[row_b * ngk + g]);
          // The codes carried +128 against the scaled query parts: remove 128 * bias sum.
          const float c0 = c[0] - 128.0f * qb.x, c1 = c[1] - 128.0f * qb.y;
          const float c2 = c[2] - 128.0f * qb.x, c3 = c[3] - 128.0f * qb.y;
          s[u][0] += sfa * c0 + mfa * qs.x;
          s[u][1] += sfa * c1 + mfa * qs.y;
          s[u][2] += sfb * c2 + mfb * qs.x;
          s[u][3] += sfb * c3 + mfb * qs.y;
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

// ------------------------------------------------------------------------------------------
// INT-b history with QK^T on the integer tensor cores (DecodeAttentionPlan::int8_qk; at most 4
// query heads per block).
//
// QK^T: mma.sync m16n8k32, A = code bytes as u8, B = the query as int8 digits, int32
// accumulators (exact). A k-step of 32 takes one field of 32 code bytes straight from the
// packed words with one mask: INT2 fields 0 and 1 as q (field 1 from the word shifted by 2),
// fields 2 and 3 as 16 q; INT4 field 0 as q, field 1 as 16 q ("class" 0 and 1). On the
// channels of K group g, the query of head h is q~ ~ sq * Q with Q = round(q~ / sq),
// sq = max over the group of |q~_h| / 32512 (so |Q| <= 127 * 256), and Q = 256 * hi + lo with
// int8 digits hi, lo: column 2h of the MMA carries hi, column 2h + 1 lo, so a thread
// (lane % 4 = h) ends up with both digit sums of head h for its two rows and adds them exactly:
// sum_c code_c * Q_c. Per (token, group) the fp32 epilogue is
// s = scale * sq * sum + min * sum_c sq * Q_c. Logits keep ~15 significant bits of the query
// relative to the largest channel of each group (the bf16 loops: ~16 bits per channel); the
// tolerance the tests hold is unchanged.
//
// PV is the bf16 loop's (A = V^T codes, exact), but the hi and lo parts of p * scale ride in
// columns 2h and 2h + 1, so a thread's softmax covers one head for two rows and the two columns
// add up in-thread at the end of the split.

// mma.sync m16n8k32, u8 x s8 -> s32.
__device__ __forceinline__ void MmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Field f of the four code bytes of a word as u8 16^kClass * q: one mask of the word (w) or of
// the word shifted right by 2 (w2, INT2 odd fields).
template <int BITS, int FIELD>
struct CodeByteField {
  static constexpr int kClass = BITS == 2 ? FIELD / 2 : FIELD;
  static constexpr bool kShifted = BITS == 2 && (FIELD & 1);
  static constexpr uint32_t kMask =
      (BITS == 2 ? 0x03030303u : 0x0F0F0F0Fu) << (4 * kClass);
  __device__ __forceinline__ static uint32_t Get(uint32_t w, uint32_t w2) {
    return (kShifted ? w2 : w) & kMask;
  }
};

// The largest |Q| of the int8-digit query (127 * 256: the hi digit stays in int8).
inline constexpr float kQueryIntMax = 32512.0f;

// The int8 MMAs of a 16-token chunk: MMA i takes slots (word, field) s0 into a0 / a1 (rows gi,
// gi + 8) and s1 into a2 / a3. A thread holds NW words of a row (bytes [4 NW t4, 4 NW (t4 + 1))).
// NW >= 2: MMA (f, j) takes words 2j and 2j + 1 of field f; NW = 1 (d = 64 INT2): fields 2i and
// 2i + 1 of the one word (same group: G >= 32 = 2 RB, and the same class).
template <int D, int BITS>
struct Int8QkSlots {
  using Geo = QuantGeometry<D, BITS>;
  static constexpr int kFields = Geo::kFields;
  static constexpr int kWords = Geo::kQkWords;
  static constexpr int kMmas = kWords * kFields / 2;
  static_assert(kWords >= 2 || BITS == 2, "one word a thread only for INT2 (d = 64)");
  static constexpr int Word(int mma, int half) {
    return kWords >= 2 ? 2 * (mma % (kWords / 2)) + half : 0;
  }
  static constexpr int Field(int mma, int half) {
    return kWords >= 2 ? mma / (kWords / 2) : 2 * mma + half;
  }
  // Channel of byte i (0..3) of slot `half` of MMA `mma` for thread t4.
  __device__ __forceinline__ static int Channel(int mma, int half, int t4, int i) {
    return Field(mma, half) * Geo::kRowBytes + 4 * (t4 * kWords + Word(mma, half)) + i;
  }
};

// Packs x into bf16x2 {hi = bf16(x), lo = bf16(x - hi)} (low half: hi).
__device__ __forceinline__ uint32_t PackHiLo(float x) {
  const float hi = __bfloat162float(__float2bfloat16_rn(x));
  return BitsOf(__floats2bfloat162_rn(x, __fsub_rn(x, hi)));
}

template <int D, int BITS, int FPGK, int FPGV>
__device__ __forceinline__ void QuantSplitInt8(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
  using Geo = QuantGeometry<D, BITS>;
  using Slots = Int8QkSlots<D, BITS>;
  constexpr int F = Geo::kFields;
  constexpr int RB = Geo::kRowBytes;
  constexpr int NW = Geo::kQkWords;
  constexpr int NGK = F / FPGK;
  constexpr int NGV = F / FPGV;
  static_assert(FPGK >= 1 && FPGV >= 1 && F % FPGK == 0 && F % FPGV == 0, "fields per group");
  static_assert(NW >= 2 || FPGK >= 2, "d = 64: an MMA's two fields share a group");
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gi = lane >> 2;
  const int t4 = lane & 3;

  using Pipeline = QuantTilePipeline<D, BITS>;
  const Pipeline pipe(p, smem, kvh, b, begin, end);
  const int n_tiles = pipe.n_tiles;
  float* q_s = reinterpret_cast<float*>(smem + Geo::kStages * Geo::kStageBytes);
  pipe.Start(Geo::kStages - 1);
  LoadRotatedQueries<D>(p, b, head0, q_s);

  // ---- Query prologue (every warp for itself: no barrier) ----
  // Per head h and K group g the scale sq = max|q~| / kQueryIntMax over the group's channels
  // (a group's sum has its own epilogue, so its query needs no common scale with the others).
  constexpr int G = FPGK * RB;  // channels of a K group: [g G, (g + 1) G)
  // A lane keeps the inverse scales of head gi >> 1 (its B column) and the scales of head t4
  // (its epilogue).
  const int hb = gi >> 1;
  float inv_b[NGK], inv_t[NGK], sq_t[NGK];
#pragma unroll
  for (int h = 0; h < 4; ++h) {
#pragma unroll
    for (int g = 0; g < NGK; ++g) {
      float m = 0.0f;
#pragma unroll
      for (int c = lane; c < G; c += 32) m = fmaxf(m, fabsf(q_s[h * D + g * G + c]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float inv = m > 0.0f ? kQueryIntMax / m : 0.0f;
      if (h == hb) inv_b[g] = inv;
      if (h == t4) {
        inv_t[g] = inv;
        sq_t[g] = m / kQueryIntMax;
      }
    }
  }
  // Q of head h, channel c (the same rounding wherever it is formed).
  auto q_int = [&](int h, float inv, int c) { return __float2int_rn(q_s[h * D + c] * inv); };
  // B fragments: column gi = digit (gi & 1: 0 hi, 1 lo) of head gi >> 1.
  uint32_t bq[Slots::kMmas][2];
  {
    const bool lo_digit = gi & 1;
#pragma unroll
    for (int m = 0; m < Slots::kMmas; ++m) {
      const float inv = inv_b[Slots::Field(m, 0) / FPGK];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int qi = q_int(hb, inv, Slots::Channel(m, half, t4, i));
          const int lo = ((qi + 128) & 255) - 128;
          const int digit = lo_digit ? lo : (qi - lo) >> 8;
          word |= (static_cast<uint32_t>(digit) & 0xffu) << (8 * i);
        }
        bq[m][half] = word;
      }
    }
  }
  // Epilogue factors of head t4 per K group, with the logit scale (exp2 domain) folded in:
  // sqg = sq * 16^-class (classes mixed in a group: the sum is formed as 16 * class 0 + class 1),
  // qsg = sum over the group's channels of sq * Q.
  const float fac = p.logit_scale_log2;
  float sqg[NGK], qsg[NGK];
  {
    int qsum[NGK];
#pragma unroll
    for (int g = 0; g < NGK; ++g) qsum[g] = 0;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      // Channel gi + 8 i lies in group 8 i / G (G is a multiple of 16).
      qsum[(8 * i) / G] += q_int(t4, inv_t[(8 * i) / G], gi + 8 * i);
    }
    StaticFor<NGK>([&](auto gc) {
      constexpr int g = decltype(gc)::value;
      constexpr int kLo = CodeByteField<BITS, g * FPGK>::kClass;
      constexpr int kHi = CodeByteField<BITS, g * FPGK + FPGK - 1>::kClass;
      constexpr float kUnscale = kHi == 0 ? 1.0f : 1.0f / 16.0f;  // kLo != kHi: 16 * c0 + c1
      static_assert(kLo == kHi || (kLo == 0 && kHi == 1), "classes of a group");
      int s = qsum[g];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      sqg[g] = sq_t[g] * kUnscale * fac;
      qsg[g] = static_cast<float>(s) * sq_t[g] * fac;
    });
  }

  // Online softmax of head t4 over rows (gi, gi + 8); acc columns 2 t4 (hi part of p * scale)
  // and 2 t4 + 1 (lo part), rows as the PV channel map says.
  float acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;
  float min_sum[NGV];
#pragma unroll
  for (int g = 0; g < NGV; ++g) min_sum[g] = 0.0f;

  const int row_a = ChunkRow(gi);
  const int row_b = ChunkRow(gi + 8);
  const int vrow[4] = {ChunkRow(2 * t4), ChunkRow(2 * t4 + 1), ChunkRow(2 * t4 + 8),
                       ChunkRow(2 * t4 + 9)};

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    pipe.WaitFull(tile);
    if (chunk_first < end) {
      const unsigned char* stage = pipe.Stage(tile);
      const bool va = chunk_first + row_a < end;
      const bool vb = chunk_first + row_b < end;

      // ---- QK^T ----
      float s_a = 0.0f, s_b = 0.0f;
      {
        uint32_t ka[NW], kb[NW], ka2[NW], kb2[NW];
        const unsigned char* kc = stage + warp * kChunkTokens * RB;
        LoadWords<NW>(kc + row_a * RB + t4 * NW * 4, ka);
        LoadWords<NW>(kc + row_b * RB + t4 * NW * 4, kb);
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          ka2[w] = ka[w] >> 2;
          kb2[w] = kb[w] >> 2;
        }
        const unsigned char* meta = stage + 2 * Geo::kCodesBytes + warp * kChunkTokens * NGK * 2;
        uint32_t sa[(NGK + 1) / 2], sb[(NGK + 1) / 2], ma[(NGK + 1) / 2], mb[(NGK + 1) / 2];
        LoadBf16Row<NGK>(meta + row_a * NGK * 2, sa);
        LoadBf16Row<NGK>(meta + row_b * NGK * 2, sb);
        LoadBf16Row<NGK>(meta + Geo::kMetaBytes + row_a * NGK * 2, ma);
        LoadBf16Row<NGK>(meta + Geo::kMetaBytes + row_b * NGK * 2, mb);
        // c[g][class]: the group's digit sums per class.
        int c[NGK][2][4];
#pragma unroll
        for (int g = 0; g < NGK; ++g) {
#pragma unroll
          for (int k = 0; k < 2; ++k) c[g][k][0] = c[g][k][1] = c[g][k][2] = c[g][k][3] = 0;
        }
        StaticFor<Slots::kMmas>([&](auto mc) {
          constexpr int m = decltype(mc)::value;
          constexpr int w0 = Slots::Word(m, 0), w1 = Slots::Word(m, 1);
          using F0 = CodeByteField<BITS, Slots::Field(m, 0)>;
          using F1 = CodeByteField<BITS, Slots::Field(m, 1)>;
          static_assert(F0::kClass == F1::kClass, "an MMA's slots share a class");
          constexpr int g = Slots::Field(m, 0) / FPGK;
          MmaU8S8(c[g][F0::kClass], F0::Get(ka[w0], ka2[w0]), F0::Get(kb[w0], kb2[w0]),
                  F1::Get(ka[w1], ka2[w1]), F1::Get(kb[w1], kb2[w1]), bq[m][0], bq[m][1]);
        });
        StaticFor<NGK>([&](auto gc) {
          constexpr int g = decltype(gc)::value;
          constexpr int kLo = CodeByteField<BITS, g * FPGK>::kClass;
          constexpr int kHi = CodeByteField<BITS, g * FPGK + FPGK - 1>::kClass;
          int v[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] = kLo == kHi ? c[g][kLo][i] : 16 * c[g][0][i] + c[g][1][i];
          // Columns 2 t4 (hi digit) and 2 t4 + 1 (lo digit) of head t4: sum_c code_c * Q_c.
          const float dot_a = static_cast<float>(v[0] * 256 + v[1]);
          const float dot_b = static_cast<float>(v[2] * 256 + v[3]);
          s_a = fmaf(Bf16OfRow<g>(sa), dot_a * sqg[g], fmaf(Bf16OfRow<g>(ma), qsg[g], s_a));
          s_b = fmaf(Bf16OfRow<g>(sb), dot_b * sqg[g], fmaf(Bf16OfRow<g>(mb), qsg[g], s_b));
        });
      }

      // ---- Online softmax (head t4, rows a and b) ----
      // Lazy max as in WarpState::UpdateN (m = -inf before the first chunk): the reduction
      // runs only when some lane's logit is above its head's max + the threshold.
      const float sl_a = va ? s_a : -INFINITY;
      const float sl_b = vb ? s_b : -INFINITY;
      float mx = fmaxf(sl_a, sl_b);
      float alpha = 1.0f;
      if (__any_sync(0xffffffffu, mx > m_run + kRescaleThresholdLog2)) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = mx > m_run + kRescaleThresholdLog2 ? mx : m_run;
        alpha = Exp2(m_run - m_new);
        m_run = m_new;
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          acc[i][0] *= alpha;
          acc[i][1] *= alpha;
          acc[i][2] *= alpha;
          acc[i][3] *= alpha;
        }
#pragma unroll
        for (int g = 0; g < NGV; ++g) min_sum[g] *= alpha;
      }
      const float pa = Exp2(sl_a - m_run);
      const float pb = Exp2(sl_b - m_run);
      l_run = fmaf(l_run, alpha, pa + pb);

      // ---- PV: A = code (bf16, exact), B = p * scale hi | lo; min term on the side ----
      const unsigned char* vc = stage + Geo::kCodesBytes + warp * kChunkTokens * RB;
      const unsigned char* vmeta = stage + 2 * Geo::kCodesBytes + 2 * Geo::kMetaBytes +
                                   warp * kChunkTokens * NGV * 2;
      const PvCodes<D, BITS> codes(vc, vrow, gi);
      // B = p * scale * 2^64 against the in-place (subnormal) code fields.
      const float pa_v = pa * kPvOperandScale, pb_v = pb * kPvOperandScale;
      uint32_t vsa[(NGV + 1) / 2], vsb[(NGV + 1) / 2], vma[(NGV + 1) / 2], vmb[(NGV + 1) / 2];
      LoadBf16Row<NGV>(vmeta + row_a * NGV * 2, vsa);
      LoadBf16Row<NGV>(vmeta + row_b * NGV * 2, vsb);
      LoadBf16Row<NGV>(vmeta + Geo::kMetaBytes + row_a * NGV * 2, vma);
      LoadBf16Row<NGV>(vmeta + Geo::kMetaBytes + row_b * NGV * 2, vmb);
      uint32_t b0 = 0, b1 = 0;
      StaticFor<F>([&](auto fc) {
        constexpr int f = decltype(fc)::value;
        if constexpr (f % FPGV == 0) {
          constexpr int g = f / FPGV;
          // Select, not multiply: rows past the end may hold any bits.
          const float sfa = va ? Bf16OfRow<g>(vsa) : 0.0f;
          const float sfb = vb ? Bf16OfRow<g>(vsb) : 0.0f;
          const float mfa = va ? Bf16OfRow<g>(vma) : 0.0f;
          const float mfb = vb ? Bf16OfRow<g>(vmb) : 0.0f;
          b0 = Transpose8x8(PackHiLo(pa_v * sfa));
          b1 = Transpose8x8(PackHiLo(pb_v * sfb));
          min_sum[g] = fmaf(pa, mfa, fmaf(pb, mfb, min_sum[g]));
        }
#pragma unroll
        for (int jp = 0; jp < Geo::kPvPairs; ++jp) {
          uint32_t a[4];
          codes.template A<f>(jp, a);
          MmaBf16(acc[f * Geo::kPvPairs + jp], a[0], a[1], a[2], a[3], b0, b1);
        }
      });
    }
    pipe.Release(tile);
    pipe.Produce(tile, 1);
  }

  // Head t4's accumulator = column 2 t4 (hi part) + column 2 t4 + 1 (lo part); field f
  // accumulated 2^(f*b - 69) * sum p * scale * q (PvUnscale); then the min term of each field's
  // group. Then into the
  // bf16 loops' layout (heads 2 t4', 2 t4' + 1 in lane t4' < 2) for CombineAndStore.
  float msum[NGV];
#pragma unroll
  for (int g = 0; g < NGV; ++g) msum[g] = SumOverRows(min_sum[g]);
  const int src0 = (lane & ~3) | ((2 * t4) & 3);
  const int src1 = src0 + 1;
  WarpState<D> st;
  StaticFor<F>([&](auto fc) {
    constexpr int f = decltype(fc)::value;
    constexpr float kUnscale = PvUnscale<BITS, f>();
#pragma unroll
    for (int jp = 0; jp < Geo::kPvPairs; ++jp) {
      const int mt = f * Geo::kPvPairs + jp;
      const float ra = (acc[mt][0] + acc[mt][1]) * kUnscale + msum[f / FPGV];
      const float rb = (acc[mt][2] + acc[mt][3]) * kUnscale + msum[f / FPGV];
      st.acc[mt][0] = __shfl_sync(0xffffffffu, ra, src0);
      st.acc[mt][1] = __shfl_sync(0xffffffffu, ra, src1);
      st.acc[mt][2] = __shfl_sync(0xffffffffu, rb, src0);
      st.acc[mt][3] = __shfl_sync(0xffffffffu, rb, src1);
    }
  });
  st.m[0] = __shfl_sync(0xffffffffu, m_run, src0);
  st.m[1] = __shfl_sync(0xffffffffu, m_run, src1);
  st.l[0] = __shfl_sync(0xffffffffu, l_run, src0);
  st.l[1] = __shfl_sync(0xffffffffu, l_run, src1);
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return PvChannel<D, BITS>(mt, upper, gi); }, smem, b,
      head0, split);
}

// Fields per group F' is usable when the group G = F' * RB is one of 32, 64, 128 and <= D.
template <int D, int BITS, int FPG>
inline constexpr bool kFieldsPerGroupValid =
    FPG * QuantGeometry<D, BITS>::kRowBytes >= 32 && FPG * QuantGeometry<D, BITS>::kRowBytes <= 128 &&
    FPG <= QuantGeometry<D, BITS>::kFields;

// QuantSplit with the group epilogue: FPGK = fpg_k and FPGV = fpg_v as compile-time values
// (fields per group of K and of V; the launcher admits only valid groups).
template <int D, int BITS, QuantLoop LOOP, int FPGK, int FPGV = 1>
__device__ __forceinline__ void QuantSplitGroupedV(const DecodeKernelParams& p, unsigned char* smem,
                                                   int kvh, int head0, int b, int split,
                                                   int begin, int end, int fpg_v) {
  if constexpr (kFieldsPerGroupValid<D, BITS, FPGV>) {
    if (fpg_v == FPGV) {
      if constexpr (LOOP == QuantLoop::kInt8Qk) {
        QuantSplitInt8<D, BITS, FPGK, FPGV>(p, smem, kvh, head0, b, split, begin, end);
      } else {
        QuantSplit<D, BITS, 1, LOOP == QuantLoop::kPacked, FPGK, FPGV>(p, smem, kvh, head0, b,
                                                                       split, begin, end);
      }
      return;
    }
  }
  if constexpr (FPGV < 4) {
    QuantSplitGroupedV<D, BITS, LOOP, FPGK, 2 * FPGV>(p, smem, kvh, head0, b, split, begin, end,
                                                      fpg_v);
  } else {
    __trap();  // unreachable: the launcher refuses other groups
  }
}
template <int D, int BITS, QuantLoop LOOP, int FPGK = 1>
__device__ __forceinline__ void QuantSplitGrouped(const DecodeKernelParams& p, unsigned char* smem,
                                                  int kvh, int head0, int b, int split, int begin,
                                                  int end) {
  constexpr int RB = QuantGeometry<D, BITS>::kRowBytes;
  if constexpr (kFieldsPerGroupValid<D, BITS, FPGK>) {
    if (p.key_group == FPGK * RB) {
      QuantSplitGroupedV<D, BITS, LOOP, FPGK>(p, smem, kvh, head0, b, split, begin, end,
                                              p.value_group / RB);
      return;
    }
  }
  if constexpr (FPGK < 4) {
    QuantSplitGrouped<D, BITS, LOOP, 2 * FPGK>(p, smem, kvh, head0, b, split, begin, end);
  } else {
    __trap();  // unreachable: the launcher refuses other groups
  }
}

// ------------------------------------------------------------------------------------------
// The kernel.

// One block's split: history (INT-b or bf16 pages), bf16 window, or an empty partial.
template <int D, HistoryFormat FORMAT, QuantLoop LOOP>
__device__ __forceinline__ void DecodeBlock(const DecodeKernelParams& p, unsigned char* smem) {
  const int kvh = blockIdx.x / p.head_chunks;
  const int chunk = blockIdx.x - kvh * p.head_chunks;
  const int b = blockIdx.y;
  const int z = blockIdx.z;
  const int head0 = kvh * p.q_per_kv + chunk * p.heads_per_block;
  const int t = p.seq_lens[b];
  if constexpr (FORMAT == HistoryFormat::kBf16) {
    const int begin = z * p.hist_tokens_per_split;
    const int end = min(begin + p.hist_tokens_per_split, t);
    if (begin >= end) {
      BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
      StoreEmptyPartial(p, b, head0, z);
      return;
    }
    Bf16Split<D, true, 2>(p, smem, kvh, head0, b, z, begin, end, 0, 0);
  } else {
    if (z < p.hist_splits) {
      const int n_hist = max(0, t - p.recent - p.sink);
      const int begin = z * p.hist_tokens_per_split;
      const int end = min(begin + p.hist_tokens_per_split, n_hist);
      if (begin >= end) {
        BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
        StoreEmptyPartial(p, b, head0, z);
        return;
      }
      constexpr int kBits = static_cast<int>(FORMAT);
      constexpr bool PACK = LOOP == QuantLoop::kPacked;
      if constexpr (LOOP == QuantLoop::kInt8Qk) {
        QuantSplitGrouped<D, kBits, LOOP>(p, smem, kvh, head0, b, z, begin, end);
      } else if (p.group_epilogue) {
        QuantSplitGrouped<D, kBits, LOOP>(p, smem, kvh, head0, b, z, begin, end);
      } else if (p.chunks_per_warp == 2) {
        QuantSplit<D, kBits, 2, PACK>(p, smem, kvh, head0, b, z, begin, end);
      } else {
        QuantSplit<D, kBits, 1, PACK>(p, smem, kvh, head0, b, z, begin, end);
      }
    } else {
      const int n_sink = min(p.sink, t);
      const int recent_begin = max(p.sink, t - p.recent);
      const int n_window = n_sink + max(0, t - recent_begin);
      const int begin = (z - p.hist_splits) * p.window_tokens_per_split;
      const int end = min(begin + p.window_tokens_per_split, n_window);
      if (begin >= end) {
        BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
        StoreEmptyPartial(p, b, head0, z);
        return;
      }
      Bf16Split<D, false, 1>(p, smem, kvh, head0, b, z, begin, end, n_sink, recent_begin);
    }
  }
}

// LOOP: the quantized history's loop (DecodeAttentionPlan: int8_qk, pack_hi_lo); a kernel per
// loop so that each gets its own register allocation. The bf16 cache takes kTwoMma.
template <int D, HistoryFormat FORMAT, QuantLoop LOOP>
__global__ void __launch_bounds__(kThreads, ResidentDecodeBlocksPerSm(D))
    DecodeAttentionKernel(const __grid_constant__ DecodeKernelParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  // The merge launched after this grid may launch once every block of it has started: its
  // blocks take the slots this grid's blocks leave, load R_V and wait for the partials.
  LaunchDependents();
  BlockTimeline::Enter(p.timeline, FORMAT == HistoryFormat::kBf16 || blockIdx.z < p.hist_splits
                                       ? BlockKind::kHistory
                                       : BlockKind::kWindow);
  DecodeBlock<D, FORMAT, LOOP>(p, smem);
  BlockTimeline::Exit(p.timeline);
}

using launch::LaunchKernel;

template <int D, HistoryFormat FORMAT>
constexpr int DecodeSharedBytesFor() {
  constexpr int combine = (kWarps * kMaxHeadsPerBlock * D + 2 * kWarps * kMaxHeadsPerBlock) * 4;
  constexpr int page_ids = (kMaxSplitTokens / 16 + 1) * 4;
  if constexpr (FORMAT == HistoryFormat::kBf16) {
    constexpr int pipeline = 2 * Bf16Geometry<D>::kStageBytes + page_ids;
    return pipeline > combine ? pipeline : combine;
  } else {
    using Geo = QuantGeometry<D, static_cast<int>(FORMAT)>;
    constexpr int quant =
        Geo::kStages * Geo::kStageBytes + Geo::kQueryBytes + Geo::kBarrierBytes + page_ids;
    constexpr int window = Bf16Geometry<D>::kStageBytes;
    constexpr int m = quant > window ? quant : window;
    return m > combine ? m : combine;
  }
}

}  // namespace kvq::gpu::attention::detail

namespace kvq::gpu::attention {

template <int HEAD_DIM, HistoryFormat FORMAT>
cudaError_t LaunchDecodeAttention(const DecodeKernelParams& p, cudaStream_t stream) {
  constexpr int kSmem = detail::DecodeSharedBytesFor<HEAD_DIM, FORMAT>();
  using detail::QuantLoop;
  constexpr bool kQuantized = FORMAT != HistoryFormat::kBf16;
  // The bf16 cache has one loop; a quantized cache's loops are instantiated only for it.
  constexpr QuantLoop kPacked = kQuantized ? QuantLoop::kPacked : QuantLoop::kTwoMma;
  constexpr QuantLoop kInt8Qk = kQuantized ? QuantLoop::kInt8Qk : QuantLoop::kTwoMma;
  auto kernel = !kQuantized     ? detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, QuantLoop::kTwoMma>
                : p.int8_qk     ? detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, kInt8Qk>
                : p.pack_hi_lo  ? detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, kPacked>
                                : detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, QuantLoop::kTwoMma>;
  if (kSmem > 48 * 1024) {
    // Once per process and kernel (device 0's limit is the same on every Hopper part).
    static const cudaError_t raised = [] {
      cudaError_t e = cudaSuccess;
      for (auto k : {detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, QuantLoop::kTwoMma>,
                     detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, kPacked>,
                     detail::DecodeAttentionKernel<HEAD_DIM, FORMAT, kInt8Qk>}) {
        if (e == cudaSuccess) {
          e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        }
      }
      return e;
    }();
    if (raised != cudaSuccess) return raised;
  }
  const int splits = p.hist_splits + p.window_splits;
  if (p.batch < 1 || p.batch > 65535 || splits < 1 || splits > 65535 || p.num_kv_heads < 1)
    return cudaErrorInvalidValue;
  const dim3 grid(p.num_kv_heads * p.head_chunks, p.batch, splits);
  const cudaError_t launched = detail::LaunchKernel(kernel, grid, dim3(detail::kThreads), kSmem,
                                                    stream, p.programmatic_launch, p);
  if (launched != cudaSuccess) return launched;
  return cudaGetLastError();
}

}  // namespace kvq::gpu::attention
