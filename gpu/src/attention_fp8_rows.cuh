// The decode kernel's loop over fp8_e4m3 history pages (spec 1.2, spec/cache.md §5.2): the bf16
// loop of attention_bf16_rows.cuh over rows stored as one e4m3 byte per value. A stage's bytes
// arrive by cp.async, are converted exactly to bf16 in shared memory (e4m3 ⊂ fp16 ⊂ fp32, and
// 3 mantissa bits fit bf16) and then run the bf16 loop's tensor-core QK^T and PV unchanged.
// The per-head scales fold into the step: the logits take s^_K (times the softmax scale), the
// accumulator s^_V once at the end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_bf16_rows.cuh"
#include "attention_common.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention::detail {

template <int D>
struct Fp8Geometry {
  static constexpr int kRawStride = D + 16;                     // bytes a raw row (16-aligned)
  static constexpr int kRawStageBytes = 2 * kTileTokens * kRawStride;  // K then V
  static constexpr int kPieces = D / 16;                        // 16-byte pieces a row
  static constexpr int kStages = 2;                             // raw stages in flight
  // Raw stages, then the bf16 rows of the stage being computed (Bf16Geometry's layout).
  static constexpr int kConvOffset = kStages * kRawStageBytes;
  static constexpr int kBytes = kConvOffset + Bf16Geometry<D>::kStageBytes;
};

// Four e4m3 bytes (little-endian in `v`) to four bf16 values (two bf16x2 words), exactly.
__device__ __forceinline__ uint2 E4m3x4ToBf16(uint32_t v) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(v >> 16), __NV_E4M3);
  const __nv_bfloat162 a = __float22bfloat162_rn(__half22float2(__half2(lo)));
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(hi)));
  return make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}

// History rows [begin, end) of sequence b, KV head kvh, for the block's query heads.
template <int D>
__device__ __forceinline__ void Fp8Split(const DecodeKernelParams& p, unsigned char* smem,
                                         int kvh, int head0, int b, int split, int begin,
                                         int end) {
  using Geo = Fp8Geometry<D>;
  using Bf16 = Bf16Geometry<D>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gi = lane >> 2;
  const int t4 = lane & 3;

  int* page_ids = reinterpret_cast<int*>(smem + Geo::kBytes);
  const int first_page = begin >> p.page_size_log2;
  LoadSplitPages(p, b, begin, end, page_ids);
  __syncthreads();  // page ids

  const int n_tokens = end - begin;
  const int n_tiles = (n_tokens + kTileTokens - 1) / kTileTokens;
  const int page_size = 1 << p.page_size_log2;
  const uint8_t* pools[2] = {p.k_planes[kFp8CodesPlane], p.v_planes[kFp8CodesPlane]};
  const int64_t page_strides[2] = {p.k_page_stride[kFp8CodesPlane],
                                   p.v_page_stride[kFp8CodesPlane]};
  const int64_t head_offsets[2] = {kvh * p.k_head_stride[kFp8CodesPlane],
                                   kvh * p.v_head_stride[kFp8CodesPlane]};

  auto issue = [&](int tile, int stage) {
    unsigned char* dst_stage = smem + stage * Geo::kRawStageBytes;
    const int first = begin + tile * kTileTokens;
    for (int idx = threadIdx.x; idx < 2 * kTileTokens * Geo::kPieces; idx += kThreads) {
      const int kv = idx / (kTileTokens * Geo::kPieces);
      const int rem = idx - kv * kTileTokens * Geo::kPieces;
      const int r = rem / Geo::kPieces;
      const int piece = rem - r * Geo::kPieces;
      const int tok = first + r;
      const bool valid = tok < end;
      const uint8_t* src = pools[kv];
      if (valid) {
        const int page = page_ids[(tok >> p.page_size_log2) - first_page];
        const int slot = tok & (page_size - 1);
        src += page * page_strides[kv] + head_offsets[kv] + static_cast<int64_t>(slot) * D;
      }
      CpAsync16(dst_stage + kv * kTileTokens * Geo::kRawStride + r * Geo::kRawStride + piece * 16,
                src + piece * 16, valid);
    }
  };
  issue(0, 0);
  CpAsyncCommit();

  // The rotated queries (the rotation kernel's output) of head gi as bf16 hi + lo, and the
  // logit scale with s^_K folded in.
  WaitForPrerequisiteGrid();
  uint32_t bq_hi[D / 16][2];
  uint32_t bq_lo[D / 16][2];
  bool any_lo = false;
  {
    const bool real = gi < p.heads_per_block;
    const float* q =
        p.q_rot + (static_cast<int64_t>(b) * p.num_q_heads + head0 + (real ? gi : 0)) * D;
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
  const bool use_lo = __syncthreads_or(any_lo) != 0;
  BlockTimeline::InputsReady(p.timeline);
  const float f = p.logit_scale_log2 * p.k_head_scale[kvh];

  WarpState<D> st;
  st.Init();
  unsigned char* conv = smem + Geo::kConvOffset;
  for (int tile = 0; tile < n_tiles; ++tile) {
    CpAsyncWait<0>();
    __syncthreads();  // the stage is in; every warp is done with conv and the other stage
    if (tile + 1 < n_tiles) issue(tile + 1, (tile + 1) % Geo::kStages);
    CpAsyncCommit();
    // e4m3 -> bf16, 4 values a step: raw [2][64][D] bytes to conv [2][64][D] bf16.
    const unsigned char* raw = smem + (tile % Geo::kStages) * Geo::kRawStageBytes;
    for (int idx = threadIdx.x; idx < 2 * kTileTokens * (D / 4); idx += kThreads) {
      const int row = idx / (D / 4);  // K rows then V rows
      const int j = 4 * (idx - row * (D / 4));
      const uint32_t v = *reinterpret_cast<const uint32_t*>(raw + row * Geo::kRawStride + j);
      *reinterpret_cast<uint2*>(conv + row * Bf16::kRowStride + j * 2) = E4m3x4ToBf16(v);
    }
    __syncthreads();
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    if (chunk_first < end) {
      const unsigned char* ks = conv + warp * kChunkTokens * Bf16::kRowStride;
      const unsigned char* vs = ks + kTileTokens * Bf16::kRowStride;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        LdMatrixX4(a, ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * Bf16::kRowStride +
                          (16 * kk + 8 * (lane >> 4)) * 2);
        MmaBf16(c, a[0], a[1], a[2], a[3], bq_hi[kk][0], bq_hi[kk][1]);
        if (use_lo) MmaBf16(c, a[0], a[1], a[2], a[3], bq_lo[kk][0], bq_lo[kk][1]);
      }
      const bool valid_a = chunk_first + gi < end;
      const bool valid_b = chunk_first + gi + 8 < end;
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
        LdMatrixX4Trans(a, vs + ((lane & 7) + 8 * (lane >> 4)) * Bf16::kRowStride +
                               (16 * mt + 8 * ((lane >> 3) & 1)) * 2);
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
      }
    }
  }
  CpAsyncWait<0>();
  // s^_V once: the accumulator is sum_t p_t * e(v_t).
  const float vs_scale = p.v_head_scale[kvh];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) st.acc[mt][i] *= vs_scale;
  }
  __syncthreads();
  CombineAndStore<D>(
      p, st, [&](int mt, int upper) { return 16 * mt + gi + 8 * upper; }, smem, b, head0, split);
}

}  // namespace kvq::gpu::attention::detail
