// Shared by the decode-attention kernels (attention_decode.cuh) and the rotation and merge
// kernels (attention_merge.cu): the block shape, PTX wrappers (cp.async, mbarrier, bulk copies,
// mma.sync, movmatrix, ldmatrix), the per-block timeline hook, bf16 row loads and small
// compile-time helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
// An L2 policy for data a step reads once (the history pages): their lines go first when the L2
// needs room, so the stream does not push out what is read again (the split partials, q~, the
// rotations). H100, against no hint: about 1% faster where a step streams more than the L2
// holds (B=1 T=128K, B >= 8 T >= 32K), about 1% slower at B=1 T=32K, and B=1 T=128K behind a
// dirty L2 58.6 -> 53.3 us (2026-11-21; docs/performance.md).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared by the copy engine
// under the L2 policy `policy`; completion is counted on bar.
__device__ __forceinline__ void BulkCopy(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                         uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(SmemAddress(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(SmemAddress(bar)), "l"(policy)
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

// The fp16 forms of the above (the fp8 loop: e4m3 codes enter the MMA as exact fp16).
// x0, x1 as fp16 hi + lo (x - hi rounded again): about 22 significant bits for |x| in the
// normal range of fp16.
__device__ __forceinline__ void SplitF16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(__fsub_rn(x0, hf.x), __fsub_rn(x1, hf.y));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

__device__ __forceinline__ void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// The history loop of keys in format F (a row of kvq/gpu/formats.h's KVQ_GPU_DECODE_FORMATS other
// than the bf16 cache): the header of each loop defines a split-loop struct of the hooks
// SplitLoop calls (attention_skeleton.cuh) and specializes this with
//   template <int D, class K, class V, QuantLoop LOOP>
//   static void Split(const DecodeKernelParams& p, unsigned char* smem, int kvh, int head0,
//                     int b, int split, int begin, int end);   // SplitLoop<its loop struct>
//   template <int D, class K, class V>
//   static constexpr int SharedBytes();                        // its pipeline and query area
// for keys of kind K over values of kind V (DecodePair) and the loops its row lists. The decode
// kernel (attention_decode.cuh) calls it for the history blocks; a format's instantiation file
// includes its loop's header, so a new loop is a new header and its rows, not an edit here.
template <Format F>
struct HistoryLoop;

}  // namespace kvq::gpu::attention::detail
