// The decode kernel's loop over codebook history pages (spec 1.3, spec/cache.md §5.3):
// TurboQuant-MSE and Block-GTQ rows, K and V widths apart, each KV head its own segment layout.
//
// The pages stream through a 2-stage cp.async pipeline as they are stored (per 16-token chunk:
// its packed codes and its segment norms, contiguous in the page). Each warp then decodes its
// own 16 rows of a side into a private bf16 hi + lo tile, read by the bf16 loop's ldmatrix
// fragments:
//   QK^T: K_hi q_hi + K_hi q_lo + K_lo q_hi (q~ as bf16 hi + lo), the logit in the exp2 domain;
//   PV:   V_hi p_hi + V_hi p_lo + V_lo p_hi.
// A side of one segment a row (TurboQuant-MSE; Block-GTQ's values) takes spec/cache.md §5.3's
// folded form: the tile holds the centroids C[code] (looked up pre-split, hi | lo << 16, in a
// shared table), N^ multiplies the logit (keys) or p (values). A side of several segments (Block-
// GTQ's keys) holds x^ = N^_s * C_s[code] itself (§7.3, split as hi = bf16(x^), lo = bf16(x^ -
// hi)).
// The dropped lo * lo terms are 2^-16 relative; hi + lo holds x^ to 2^-17. What a lane decodes
// is fixed for the whole split: the channel pairs lane, lane + 32, ... of every row, each
// described by one word in shared memory (the code's byte and shift in the row, the segment's
// width, norm slot and centroid table), built from the head's widths (CodebookLayoutOf) when the
// split starts, beside the head's centroid tables (at most 2^1 + ... + 2^8 = 510 fp32 a side).
// Rows past the split's end never contribute: their logits are -inf, and their norms are taken
// as 0 (a several-segment tile holds zeros for them; a folded one its centroids, finite, whose
// p * N^ is 0), so a page's stale bytes never turn into NaN in the accumulators.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "codebook.cuh"
#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention::detail {

template <int D>
struct CodebookGeometry {
  static constexpr int kStages = 2;
  // A stage at the largest row: code bytes <= d and 8 norm slots, on each side.
  static constexpr int kMaxRowBytes = D + 2 * kCodebookMaxSegments;
  static constexpr int kStageBytes = 2 * kTileTokens * kMaxRowBytes;
  static constexpr int kRowStride = (D + 8) * 2;  // a decoded bf16 row; +16 bytes: ldmatrix
  static constexpr int kWarpTileBytes = 2 * kChunkTokens * kRowStride;  // hi, then lo
  static constexpr int kTableWords = 512;  // a side's centroid tables: <= 510 fp32
  static constexpr int kDecodedOffset = kStages * kStageBytes;
  static constexpr int kDescOffset = kDecodedOffset + kWarps * kWarpTileBytes;
  static constexpr int kTableOffset = kDescOffset + 2 * D * 4;
  static constexpr int kSplitOffset = kTableOffset + 2 * kTableWords * 4;
  static constexpr int kBytes = kSplitOffset + 2 * kTableWords * 4;
};

// One channel's decode descriptor: its code's first byte in the row and the bit shift, the
// segment's width, norm slot and centroid table (word offset in the side's tables).
__device__ __forceinline__ uint32_t CodebookDesc(int byte, int shift, int width, int slot,
                                                 int table) {
  return static_cast<uint32_t>(byte) | (static_cast<uint32_t>(shift) << 8) |
         (static_cast<uint32_t>(width) << 11) | (static_cast<uint32_t>(slot) << 15) |
         (static_cast<uint32_t>(table) << 18);
}

// What the loop knows of one side's rows: the head's layout in descriptors and tables, and the
// row's byte counts.
struct CodebookSide {
  const uint8_t* codes;   // plane 0 of the side's pool
  const uint8_t* norms;   // plane 1
  int64_t codes_page_stride, codes_head_stride, norms_page_stride, norms_head_stride;
  int code_bytes;  // a row's code bytes
  int slots;       // a row's norm slots
};

// The split loop (attention_skeleton.cuh) over codebook history rows [begin, end) of sequence
// b, KV head kvh.
template <int D>
struct CodebookRowsLoop {
  using Geo = CodebookGeometry<D>;
  using Scores = ChunkScores<1>;
  using Probs = ChunkProbs<1>;
  static constexpr int kTileStep = 1;

  const DecodeKernelParams& p;
  unsigned char* smem;
  int kvh, b, begin, end;
  int lane, warp, gi, t4;
  int first_page, n_tiles;
  int append_tile;  // FirstAppendedTile: Issue waits for the append from this tile on
  int* page_ids;
  // Stage offsets of the four regions (K codes, K norms, V codes, V norms).
  int k_codes_at, k_norms_at, v_codes_at, v_norms_at;
  uint32_t bq_hi[D / 16][2];
  uint32_t bq_lo[D / 16][2];
  bool use_lo;
  WarpState<D> st;

  __device__ __forceinline__ CodebookSide Side(bool value) const {
    const int i0 = kCodebookCodesPlane, i1 = kCodebookNormPlane;
    if (value) {
      return {p.v_planes[i0], p.v_planes[i1], p.v_page_stride[i0], p.v_head_stride[i0],
              p.v_page_stride[i1], p.v_head_stride[i1], p.v_code_bytes, p.v_segments};
    }
    return {p.k_planes[i0], p.k_planes[i1], p.k_page_stride[i0], p.k_head_stride[i0],
            p.k_page_stride[i1], p.k_head_stride[i1], p.k_code_bytes, p.k_segments};
  }

  // The head's descriptors and centroid tables of one side.
  __device__ __forceinline__ void PrepareSide(bool value) {
    const CodebookLayout layout = codebook::HeadLayout(
        D, value ? p.v_widths : p.k_widths, value ? p.v_bits : p.k_bits, kvh);
    const float* tables = value ? p.v_codebook : p.k_codebook;
    uint32_t* desc = reinterpret_cast<uint32_t*>(smem + Geo::kDescOffset) + (value ? D : 0);
    float* shared_tables =
        reinterpret_cast<float*>(smem + Geo::kTableOffset) + (value ? Geo::kTableWords : 0);
    uint32_t* split_tables =
        reinterpret_cast<uint32_t*>(smem + Geo::kSplitOffset) + (value ? Geo::kTableWords : 0);
    int table = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const int levels = 1 << seg.width;
      const float* src = codebook::TableOf(tables, seg.values, seg.width);
      for (int i = threadIdx.x; i < levels; i += kThreads) {
        const float c = src[i];
        shared_tables[table + i] = c;
        uint32_t hi, lo;
        SplitBf16(c, 0.0f, hi, lo);
        split_tables[table + i] = (hi & 0xffffu) | (lo << 16);  // bf16 hi | bf16 lo << 16
      }
      for (int j = threadIdx.x; j < seg.values; j += kThreads) {
        const codebook::CodePosition pos = codebook::CodePositionOf(j, seg.values, seg.width);
        desc[seg.offset + j] =
            CodebookDesc(seg.byte_offset + pos.byte, pos.shift, seg.width, s, table);
      }
      table += levels;
    }
  }

  __device__ __forceinline__ explicit CodebookRowsLoop(const SplitArgs& a)
      : p(a.p), smem(a.smem), kvh(a.kvh), b(a.b), begin(a.begin), end(a.end) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    page_ids = reinterpret_cast<int*>(smem + Geo::kBytes);
    first_page = begin >> p.page_size_log2;
    k_codes_at = 0;
    k_norms_at = k_codes_at + kTileTokens * p.k_code_bytes;
    v_codes_at = k_norms_at + kTileTokens * 2 * p.k_segments;
    v_norms_at = v_codes_at + kTileTokens * p.v_code_bytes;
    PrepareSide(false);
    PrepareSide(true);
    LoadSplitPages(p, b, begin, end, page_ids);
    append_tile = FirstAppendedTile(p, b, begin, end);
    __syncthreads();  // page ids, descriptors, tables
    n_tiles = (end - begin + kTileTokens - 1) / kTileTokens;
#pragma unroll
    for (int s = 0; s < Geo::kStages - 1; ++s) {
      if (s < n_tiles) Issue(s, s);
      CpAsyncCommit();
    }
  }

  // One plane of one side for the tile's 4 chunks of 16 tokens: 16 rows of `row_bytes` are
  // 16 * row_bytes contiguous bytes of a page (a chunk never straddles pages: P >= 16 and the
  // split starts on a tile), row_bytes 16-byte pieces.
  __device__ __forceinline__ void IssuePlane(unsigned char* dst, const uint8_t* plane,
                                             int64_t page_stride, int64_t head_stride,
                                             int row_bytes, int first) const {
    const int page_size = 1 << p.page_size_log2;
    for (int idx = threadIdx.x; idx < 4 * row_bytes; idx += kThreads) {
      const int chunk = idx / row_bytes;
      const int piece = idx - chunk * row_bytes;
      const int tok = first + chunk * kChunkTokens;
      const bool valid = tok < end;
      const uint8_t* src = plane;
      if (valid) {
        const int page = page_ids[(tok >> p.page_size_log2) - first_page];
        const int slot = tok & (page_size - 1);
        src += page * page_stride + kvh * head_stride + static_cast<int64_t>(slot) * row_bytes +
               piece * 16;
      }
      CpAsync16(dst + chunk * kChunkTokens * row_bytes + piece * 16, src, valid);
    }
  }

  __device__ __forceinline__ void Issue(int tile, int stage) const {
    if (tile >= append_tile) WaitForPrerequisiteGrid();
    unsigned char* dst = smem + stage * Geo::kStageBytes;
    const int first = begin + tile * kTileTokens;
    const CodebookSide k = Side(false), v = Side(true);
    IssuePlane(dst + k_codes_at, k.codes, k.codes_page_stride, k.codes_head_stride,
               k.code_bytes, first);
    IssuePlane(dst + k_norms_at, k.norms, k.norms_page_stride, k.norms_head_stride,
               2 * k.slots, first);
    IssuePlane(dst + v_codes_at, v.codes, v.codes_page_stride, v.codes_head_stride,
               v.code_bytes, first);
    IssuePlane(dst + v_norms_at, v.norms, v.norms_page_stride, v.norms_head_stride,
               2 * v.slots, first);
  }

  // q~ of head gi (the rotation kernel's output) as bf16 hi + lo B fragments, natural channel
  // order (the bf16 loop's).
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    WaitForQueries(p, b, a.head0);
    bool any_lo = false;
    {
      const bool real = gi < p.heads_per_block;
      const float* q =
          p.q_rot + (static_cast<int64_t>(b) * p.num_q_heads + a.head0 + (real ? gi : 0)) * D;
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
    use_lo = __syncthreads_or(any_lo) != 0;
    BlockTimeline::InputsReady(p.timeline);
    st.Init();
  }

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

  // Decodes the warp's 16 rows of one side of the stage into its hi / lo tiles.
  __device__ __forceinline__ void DecodeRows(const unsigned char* stage, int tile,
                                             bool value) const {
    const int code_bytes = value ? p.v_code_bytes : p.k_code_bytes;
    const int slots = value ? p.v_segments : p.k_segments;
    const unsigned char* codes =
        stage + (value ? v_codes_at : k_codes_at) + warp * kChunkTokens * code_bytes;
    const uint16_t* norms = reinterpret_cast<const uint16_t*>(
        stage + (value ? v_norms_at : k_norms_at) + warp * kChunkTokens * 2 * slots);
    const uint2* desc =
        reinterpret_cast<const uint2*>(smem + Geo::kDescOffset) + (value ? D / 2 : 0);
    const float* tables =
        reinterpret_cast<const float*>(smem + Geo::kTableOffset) + (value ? Geo::kTableWords : 0);
    unsigned char* hi = smem + Geo::kDecodedOffset + warp * Geo::kWarpTileBytes;
    unsigned char* lo = hi + kChunkTokens * Geo::kRowStride;
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    __syncwarp();  // the warp's previous reads of its tiles are done
    if (slots == 1) {
      // One segment a row: the tiles hold the centroids (pre-split bf16 hi + lo words), the
      // norm N^ multiplies the logit (keys) or p (values): spec/cache.md §5.3's folded form.
      const uint32_t* split = reinterpret_cast<const uint32_t*>(smem + Geo::kSplitOffset) +
                              (value ? Geo::kTableWords : 0);
#pragma unroll
      for (int k = 0; k < D / 64; ++k) {
        const int pair = lane + 32 * k;
        const uint2 dd = desc[pair];
        const uint32_t mask = (1u << ((dd.x >> 11) & 15)) - 1u;
        const uint32_t b0 = dd.x & 0xff, b1 = dd.y & 0xff;
        const uint32_t s0 = (dd.x >> 8) & 7, s1 = (dd.y >> 8) & 7;
#pragma unroll 8
        for (int r = 0; r < kChunkTokens; ++r) {
          const unsigned char* row = codes + r * code_bytes;
          const uint32_t w0 = static_cast<uint32_t>(row[b0]) | (static_cast<uint32_t>(row[b0 + 1]) << 8);
          const uint32_t w1 = static_cast<uint32_t>(row[b1]) | (static_cast<uint32_t>(row[b1 + 1]) << 8);
          const uint32_t h0 = split[(w0 >> s0) & mask], h1 = split[(w1 >> s1) & mask];
          *reinterpret_cast<uint32_t*>(hi + r * Geo::kRowStride + 4 * pair) =
              __byte_perm(h0, h1, 0x5410);
          *reinterpret_cast<uint32_t*>(lo + r * Geo::kRowStride + 4 * pair) =
              __byte_perm(h0, h1, 0x7632);
        }
      }
      __syncwarp();  // the tiles are written
      return;
    }
#pragma unroll
    for (int k = 0; k < D / 64; ++k) {
      const int pair = lane + 32 * k;
      const uint2 dd = desc[pair];
      const int slot = (dd.x >> 15) & 7;
      const uint32_t mask = (1u << ((dd.x >> 11) & 15)) - 1u;
      const float* table = tables + (dd.x >> 18);
#pragma unroll 4
      for (int r = 0; r < kChunkTokens; ++r) {
        const unsigned char* row = codes + r * code_bytes;
        const bool valid = chunk_first + r < end;
        const float norm = valid ? F32FromBf16(norms[r * slots + slot]) : 0.0f;
        const uint32_t b0 = dd.x & 0xff, b1 = dd.y & 0xff;
        const uint32_t w0 = static_cast<uint32_t>(row[b0]) | (static_cast<uint32_t>(row[b0 + 1]) << 8);
        const uint32_t w1 = static_cast<uint32_t>(row[b1]) | (static_cast<uint32_t>(row[b1 + 1]) << 8);
        const float x0 = __fmul_rn(table[(w0 >> ((dd.x >> 8) & 7)) & mask], norm);
        const float x1 = __fmul_rn(table[(w1 >> ((dd.y >> 8) & 7)) & mask], norm);
        uint32_t h, l;
        SplitBf16(x0, x1, h, l);
        *reinterpret_cast<uint32_t*>(hi + r * Geo::kRowStride + 4 * pair) = h;
        *reinterpret_cast<uint32_t*>(lo + r * Geo::kRowStride + 4 * pair) = l;
      }
    }
    __syncwarp();  // the tiles are written
  }

  // The stored norm N^ of row r of the warp's chunk on a one-segment side (0 past the split's
  // end, whose stale page bytes never reach the MMA); 1 on a side of several segments, whose
  // tiles hold x^ itself.
  __device__ __forceinline__ float RowNorm(const unsigned char* stage, int tile, bool value,
                                           int r) const {
    const int slots = value ? p.v_segments : p.k_segments;
    if (slots != 1) return 1.0f;
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    if (chunk_first + r >= end) return 0.0f;
    const uint16_t* norms = reinterpret_cast<const uint16_t*>(
        stage + (value ? v_norms_at : k_norms_at) + warp * kChunkTokens * 2);
    return F32FromBf16(norms[r]);
  }

  // QK^T: A = the warp's decoded K rows (hi, lo) by ldmatrix, B = q~ hi (+ lo).
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& s) const {
    DecodeRows(stage, tile, false);
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    const unsigned char* ka = smem + Geo::kDecodedOffset + warp * Geo::kWarpTileBytes +
                              ((lane & 7) + 8 * ((lane >> 3) & 1)) * Geo::kRowStride +
                              8 * (lane >> 4) * 2;
    const unsigned char* kl = ka + kChunkTokens * Geo::kRowStride;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4], al[4];
      LdMatrixX4(a, ka + 32 * kk);
      LdMatrixX4(al, kl + 32 * kk);
      MmaBf16(c, a[0], a[1], a[2], a[3], bq_hi[kk][0], bq_hi[kk][1]);
      MmaBf16(c, al[0], al[1], al[2], al[3], bq_hi[kk][0], bq_hi[kk][1]);
      if (use_lo) MmaBf16(c, a[0], a[1], a[2], a[3], bq_lo[kk][0], bq_lo[kk][1]);
    }
    const bool valid_a = chunk_first + gi < end;
    const bool valid_b = chunk_first + gi + 8 < end;
    const float fa = p.logit_scale_log2 * RowNorm(stage, tile, false, gi);
    const float fb = p.logit_scale_log2 * RowNorm(stage, tile, false, gi + 8);
    s.s[0][0] = valid_a ? c[0] * fa : -INFINITY;
    s.s[0][1] = valid_a ? c[1] * fa : -INFINITY;
    s.s[0][2] = valid_b ? c[2] * fb : -INFINITY;
    s.s[0][3] = valid_b ? c[3] * fb : -INFINITY;
  }

  __device__ __forceinline__ void Softmax(const Scores& s, Probs& pr) {
    NoRescale none;
    WarpSoftmax(st, none, s, pr);
  }

  // PV: A = the warp's decoded V rows transposed (ldmatrix.trans; hi, lo), B = p (times N^ of
  // its token on a one-segment side) as bf16 hi + lo.
  __device__ __forceinline__ void Values(const unsigned char* stage, int tile, const Scores&,
                                         const Probs& probs) {
    DecodeRows(stage, tile, true);
    Probs pr = probs;
    const float na = RowNorm(stage, tile, true, gi), nb = RowNorm(stage, tile, true, gi + 8);
    pr.p[0][0] *= na;
    pr.p[0][1] *= na;
    pr.p[0][2] *= nb;
    pr.p[0][3] *= nb;
    const unsigned char* va = smem + Geo::kDecodedOffset + warp * Geo::kWarpTileBytes +
                              ((lane & 7) + 8 * (lane >> 4)) * Geo::kRowStride +
                              8 * ((lane >> 3) & 1) * 2;
    const unsigned char* vl = va + kChunkTokens * Geo::kRowStride;
    uint32_t hi_a, lo_a, hi_b, lo_b;
    SplitBf16(pr.p[0][0], pr.p[0][1], hi_a, lo_a);
    SplitBf16(pr.p[0][2], pr.p[0][3], hi_b, lo_b);
    const uint32_t bh0 = Transpose8x8(hi_a), bh1 = Transpose8x8(hi_b);
    const uint32_t bl0 = Transpose8x8(lo_a), bl1 = Transpose8x8(lo_b);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      uint32_t a[4], al[4];
      LdMatrixX4Trans(a, va + 32 * mt);
      LdMatrixX4Trans(al, vl + 32 * mt);
      MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
      MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
      MmaBf16(st.acc[mt], al[0], al[1], al[2], al[3], bh0, bh1);
    }
  }

  __device__ __forceinline__ void ReleaseTile(int) const {}

  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    CpAsyncWait<0>();
    __syncthreads();
    const int g = gi;
    CombineAndStore<D>(
        p, st, [&](int mt, int upper) { return 16 * mt + g + 8 * upper; }, smem, b, a.head0,
        a.split);
  }
};

// codebook keys and values (spec 1.3): CodebookRowsLoop.
template <>
struct HistoryLoop<Format::kCodebook> {
  template <int D, class K, class V, QuantLoop LOOP>
  __device__ __forceinline__ static void Split(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
    SplitLoop<CodebookRowsLoop<D>>(SplitArgs{p, smem, kvh, head0, b, split, begin, end});
  }
  template <int D, class K, class V>
  static constexpr int SharedBytes() {
    return CodebookGeometry<D>::kBytes;
  }
};

}  // namespace kvq::gpu::attention::detail
