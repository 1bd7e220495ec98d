// The decode kernel's loop over codebook history pages (spec 1.3, spec/cache.md §5.3):
// TurboQuant-MSE and Block-GTQ rows, K and V widths apart, each KV head its own segment layout.
//
// The pages stream through a cp.async pipeline of 2 to 4 stages as they are stored (per 16-token
// chunk: its packed codes and its segment norms, contiguous in the page): each warp copies its
// own 16 rows of a tile and waits for its own copies. The tensor cores take the centroids as
// bf16 hi + lo pairs:
//   QK^T: K_hi q_hi + K_hi q_lo + K_lo q_hi (q~ as bf16 hi + lo), the logit in the exp2 domain;
//   PV:   V_hi p_hi + V_hi p_lo + V_lo p_hi.
// The dropped lo * lo terms are 2^-16 relative; hi + lo holds a centroid to 2^-17.
//
// Two ways to build those operands, chosen per side when the split starts:
// - A side of one segment at b <= 4 bits, every head alike (TurboQuant-MSE; Block-GTQ's
//   values): register fragments. A lane owns whole code bits of a row (QK: lane t4 = lane % 4
//   the bits [t4 d b / 4, (t4 + 1) d b / 4) of its rows gi, gi + 8; PV: lane gi = lane / 4 the
//   bits [gi d b / 8, (gi + 1) d b / 8) of its tokens 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9), and
//   each 2b-bit field of two adjacent codes is one index into the side's pair table: the two
//   centroids' bf16 hi words and lo words, i.e. an MMA operand register each. A dot product
//   may visit the channels in any order both operands share, so the query is gathered in that
//   order (FoldQuery) and the accumulator rows are stored back through the same map
//   (Epilogue); in PV a register holds one channel of two tokens, one byte permute from two
//   tokens' pairs. The folded form of §5.3: N^ multiplies the logit (keys) or p (values).
// - Otherwise (Block-GTQ's keys of several segments, widths above 4 bits) each warp decodes
//   its 16 rows into a private bf16 hi + lo tile read by the bf16 loop's ldmatrix fragments,
//   every channel pair described by one word in shared memory (the code's byte and shift in
//   the row, the segment's width, norm slot and centroid table), built from the head's widths
//   (CodebookLayoutOf) when the split starts, beside the head's centroid tables (at most
//   2^1 + ... + 2^8 = 510 fp32 a side). A one-segment side holds the pre-split centroids and
//   folds N^ as above; a side of several segments holds x^ = N^_s * C_s[code] itself (§7.3,
//   split as hi = bf16(x^), lo = bf16(x^ - hi)).
// Rows past the split's end never contribute: their logits are -inf, and their norms are taken
// as 0 (a several-segment tile holds zeros for them; a folded operand its centroids, finite,
// whose p * N^ is 0), so a page's stale bytes never turn into NaN in the accumulators.
//
// Shared memory is sized by the cache's rows at launch (CodebookGeometry::Bytes): the pair or
// centroid tables and the descriptors, two stages of 64 real rows a side, and the decoded
// tiles only where a side needs them; a K3V2 TurboQuant-MSE split takes about 27 KB.
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

// Whether a side takes the register-fragment path: one segment a row at b <= 4 bits for every
// head (no per-head widths), so its pair table has at most 2^8 entries.
__host__ __device__ inline bool CodebookFragmentSide(const uint8_t* widths, int bits) {
  return widths == nullptr && bits >= 1 && bits <= 4;
}

// The split's shared memory: per side a 2 KB table region (the pair table of a fragment side,
// else the pre-split one-segment centroids or the fp32 tables of every segment), the channel
// descriptors, 2 to 4 pipeline stages of 64 rows a side at the cache's row sizes, and the warps'
// decoded tiles if a side is decoded through them; the page ids follow (Bytes). As many
// stages as keep a block within a quarter of a multiprocessor's shared memory (four resident
// blocks, as the plan assumes), at least two.
template <int D>
struct CodebookGeometry {
  static constexpr int kMinStages = 2, kMaxStages = 4;
  // A quarter of an sm_90 multiprocessor's 228 KB less the 1 KB a block reserves, less the
  // page ids that follow (attention_decode.cuh's SharedBytesAround).
  static constexpr int kQuarter = 228 * 1024 / 4 - 1024 - kSplitPageIdBytes;
  static constexpr int kMaxRowBytes = D + 2 * kCodebookMaxSegments;  // d code bytes, 8 norms
  static constexpr int kRowStride = (D + 8) * 2;  // a decoded bf16 row; +16 bytes: ldmatrix
  static constexpr int kWarpTileBytes = 2 * kChunkTokens * kRowStride;  // hi, then lo
  static constexpr int kTableWords = 512;  // <= 510 fp32, or 2 x <= 256 pair-table words
  static constexpr int kDescOffset = 2 * kTableWords * 4;
  static constexpr int kStagesOffset = kDescOffset + 2 * D * 4;

  __host__ __device__ static int RowBytes(int code_bytes, int segments) {
    return code_bytes + 2 * segments;
  }
  // One stage: 64 key rows, then 64 value rows (16-byte aligned for the copies).
  __host__ __device__ static int StageBytes(const DecodeKernelParams& p) {
    const int rows = kTileTokens * (RowBytes(p.k_code_bytes, p.k_segments) +
                                    RowBytes(p.v_code_bytes, p.v_segments));
    return (rows + 15) / 16 * 16;
  }
  // Whether a side goes through the decoded tiles, and their bytes.
  __host__ __device__ static bool Tiles(const DecodeKernelParams& p) {
    return !CodebookFragmentSide(p.k_widths, p.k_bits) ||
           !CodebookFragmentSide(p.v_widths, p.v_bits);
  }
  __host__ __device__ static int TileBytes(const DecodeKernelParams& p) {
    return Tiles(p) ? kWarps * kWarpTileBytes : 0;
  }
  __host__ __device__ static int Stages(const DecodeKernelParams& p) {
    const int fit = (kQuarter - kStagesOffset - TileBytes(p)) / StageBytes(p);
    return fit < kMinStages ? kMinStages : fit > kMaxStages ? kMaxStages : fit;
  }
  // Where the decoded tiles (if any) start, and the whole region before the page ids.
  __host__ __device__ static int DecodedOffset(const DecodeKernelParams& p) {
    return kStagesOffset + Stages(p) * StageBytes(p);
  }
  __host__ __device__ static int Bytes(const DecodeKernelParams& p) {
    return DecodedOffset(p) + TileBytes(p);
  }
  // The most any cache takes (the kernel's attribute): two stages of the largest rows and the
  // tiles, or the quarter that more stages never pass.
  static constexpr int kLargestRows =
      kStagesOffset + kMinStages * kTileTokens * 2 * kMaxRowBytes + kWarps * kWarpTileBytes;
  static constexpr int kMaxBytes = kLargestRows > kQuarter ? kLargestRows : kQuarter;
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

// The bits [bit0, bit0 + BITS) of a row in shared memory as ceil(BITS / 32) words, LSB first
// (the packing's order: numerics.md §8.2). The row starts on a 4-byte boundary and is whole
// words long; bit0 is the lane's share of it, a multiple of BITS. When BITS is a multiple of 32
// the words are read as they lie (one vector load at 64 and 128 bits); otherwise (d = 64 or
// d = 128 at odd widths) the words holding the range are read, and no other (the word after it
// may be the next warp's rows, copied in meanwhile), and funnel-shifted into place.
template <int BITS>
__device__ __forceinline__ void LaneBits(const unsigned char* row, int bit0,
                                         uint32_t (&w)[(BITS + 31) / 32]) {
  constexpr int N = (BITS + 31) / 32;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(row) + (bit0 >> 5);
  if constexpr (BITS == 64) {
    const uint2 v = *reinterpret_cast<const uint2*>(words);
    w[0] = v.x;
    w[1] = v.y;
  } else if constexpr (BITS == 128) {
    const uint4 v = *reinterpret_cast<const uint4*>(words);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else if constexpr (BITS % 32 == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = words[i];
  } else {
    const int off = bit0 & 31;
    uint32_t raw[N + 1];
#pragma unroll
    for (int i = 0; i <= N; ++i) raw[i] = 32 * i < off + BITS ? words[i] : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], off);
  }
}

// A side's pair table: entry c0 | c1 << w holds the bf16 hi parts of C[c0] and C[c1] in one
// word (an MMA operand register) at byte 4 * entry, and their lo parts at kPairLoBytes + 4 *
// entry: two 32-bit loads land each part in the register its MMA reads, where one 64-bit load
// of both would need register moves to build the operands.
inline constexpr int kPairLoBytes = 256 * 4;

__device__ __forceinline__ uint2 PairWords(const unsigned char* table, uint32_t at) {
  return make_uint2(*reinterpret_cast<const uint32_t*>(table + at),
                    *reinterpret_cast<const uint32_t*>(table + kPairLoBytes + at));
}

// The pair-table words of the P-th field of 2W bits in a lane's bits (two adjacent codes: the
// index c0 | c1 << W).
template <int W, int P, int N>
__device__ __forceinline__ uint2 PairEntry(const unsigned char* table, const uint32_t (&w)[N]) {
  constexpr int kPos = 2 * W * P;
  constexpr int kWord = kPos / 32, kShift = kPos % 32;
  constexpr uint32_t kMask4 = ((1u << (2 * W)) - 1u) << 2;  // the index times 4
  uint32_t at;
  if constexpr (kShift + 2 * W > 32) {
    at = (__funnelshift_r(w[kWord], w[kWord + 1], kShift) << 2) & kMask4;
  } else if constexpr (kShift >= 2) {
    at = (w[kWord] >> (kShift - 2)) & kMask4;
  } else {
    at = (w[kWord] << (2 - kShift)) & kMask4;
  }
  return PairWords(table, at);
}

// The pair-table words of two tokens' codes of one channel: the P-th code of W bits in the
// lane's bits of token t (w0) and of token t + 1 (w1): index c_t | c_(t+1) << W, i.e. the
// words are that channel's two tokens (one PV operand register each).
template <int W, int P, int N>
__device__ __forceinline__ uint2 TokenPairEntry(const unsigned char* table, const uint32_t (&w0)[N],
                                                const uint32_t (&w1)[N]) {
  // Code P of W bits of a lane's bits (funnel-shifted where it straddles two words).
  auto code = [](const uint32_t (&w)[N]) {
    constexpr int kPos = W * P;
    constexpr int kWord = kPos / 32, kShift = kPos % 32;
    constexpr uint32_t kMask = (1u << W) - 1u;
    if constexpr (kShift + W > 32) {
      return __funnelshift_r(w[kWord], w[kWord + 1], kShift) & kMask;
    } else {
      return (w[kWord] >> kShift) & kMask;
    }
  };
  return PairWords(table, 4 * (code(w0) | (code(w1) << W)));
}

// Calls f(IntC<w>{}) for a fragment side's width w (1..4) and returns true; false for 0 (the
// side goes through the decoded tiles).
template <class F>
__device__ __forceinline__ bool WithFragmentWidth(int w, F&& f) {
  switch (w) {
    case 1: f(IntC<1>{}); return true;
    case 2: f(IntC<2>{}); return true;
    case 3: f(IntC<3>{}); return true;
    case 4: f(IntC<4>{}); return true;
    default: return false;
  }
}

// Two tokens' lane bits zipped code by code (W = 1, 2, 4, whose 2W-bit fields tile a word):
// even[i] holds, in its k-th 2W-bit field, code 2k of token t then code 2k of token t + 1, odd[i]
// code 2k + 1 of both, so each field indexes the pair table as one channel of the two tokens.
// Two operations a word and zip (a shift, then a bitwise select).
template <int W, int N>
__device__ __forceinline__ void ZipTokens(const uint32_t (&t0)[N], const uint32_t (&t1)[N],
                                          uint32_t (&even)[N], uint32_t (&odd)[N]) {
  static_assert(W == 1 || W == 2 || W == 4, "2W-bit fields that tile a word");
  constexpr uint32_t kLow = W == 1 ? 0x55555555u : W == 2 ? 0x33333333u : 0x0f0f0f0fu;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    even[i] = (t0[i] & kLow) | ((t1[i] << W) & ~kLow);
    odd[i] = ((t0[i] >> W) & kLow) | (t1[i] & ~kLow);
  }
}

// The split loop (attention_skeleton.cuh) over codebook history rows [begin, end) of sequence
// b, KV head kvh. PACK (kPacked, at most 4 query heads a block): the MMA's columns h and h + 4
// carry the hi and the lo part of head h's query and of its p, so a k-step or m-tile takes two
// MMAs (A_hi, A_lo against both parts: the lo * lo term included) instead of three; the
// column halves' sums are added by one shuffle (lane ^ 2), as QuantRowsLoop does.
template <int D, bool PACK>
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
  int stages, stage_bytes, decoded_at;
  int read_stage = 0;  // the stage of the next tile LoadTile returns
  // Stage offsets of the four regions (K codes, K norms, V codes, V norms).
  int k_codes_at, k_norms_at, v_codes_at, v_norms_at;
  // The sides' widths where they take register fragments, else 0.
  int k_fragments, v_fragments;
  uint32_t bq_hi[D / 16][2];  // PACK: the column's part (hi of head gi, or lo of head gi - 4)
  uint32_t bq_lo[D / 16][2];  // unused with PACK
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

  __device__ __forceinline__ unsigned char* TableOfSide(bool value) const {
    return smem + (value ? Geo::kTableWords * 4 : 0);
  }

  // The head's tables of one side: the pair table of a fragment side (entry c0 | c1 << w: the
  // bf16 hi of C[c0] and C[c1] in one word, their lo in the next); else the descriptors and the
  // pre-split centroids (one segment) or the fp32 tables of every segment.
  __device__ __forceinline__ void PrepareSide(bool value) {
    const float* tables = value ? p.v_codebook : p.k_codebook;
    unsigned char* region = TableOfSide(value);
    if (const int w = value ? v_fragments : k_fragments; w != 0) {
      const float* c = codebook::TableOf(tables, D, w);
      const int levels = 1 << w;
      uint32_t* hi = reinterpret_cast<uint32_t*>(region);
      uint32_t* lo = reinterpret_cast<uint32_t*>(region + kPairLoBytes);
      for (int e = threadIdx.x; e < levels * levels; e += kThreads) {
        SplitBf16(c[e & (levels - 1)], c[e >> w], hi[e], lo[e]);
      }
      return;
    }
    const CodebookLayout layout = codebook::HeadLayout(
        D, value ? p.v_widths : p.k_widths, value ? p.v_bits : p.k_bits, kvh);
    const int slots = value ? p.v_segments : p.k_segments;
    uint32_t* desc = reinterpret_cast<uint32_t*>(smem + Geo::kDescOffset) + (value ? D : 0);
    int table = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const int levels = 1 << seg.width;
      const float* src = codebook::TableOf(tables, seg.values, seg.width);
      for (int i = threadIdx.x; i < levels; i += kThreads) {
        const float c = src[i];
        if (slots == 1) {
          uint32_t hi, lo;
          SplitBf16(c, 0.0f, hi, lo);
          reinterpret_cast<uint32_t*>(region)[table + i] = (hi & 0xffffu) | (lo << 16);
        } else {
          reinterpret_cast<float*>(region)[table + i] = c;
        }
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
    stages = Geo::Stages(p);
    stage_bytes = Geo::StageBytes(p);
    decoded_at = Geo::DecodedOffset(p);
    page_ids = reinterpret_cast<int*>(smem + Geo::Bytes(p));
    first_page = begin >> p.page_size_log2;
    k_codes_at = 0;
    k_norms_at = k_codes_at + kTileTokens * p.k_code_bytes;
    v_codes_at = k_norms_at + kTileTokens * 2 * p.k_segments;
    v_norms_at = v_codes_at + kTileTokens * p.v_code_bytes;
    k_fragments = CodebookFragmentSide(p.k_widths, p.k_bits) ? p.k_bits : 0;
    v_fragments = CodebookFragmentSide(p.v_widths, p.v_bits) ? p.v_bits : 0;
    PrepareSide(false);
    PrepareSide(true);
    LoadSplitPages(p, b, begin, end, page_ids);
    append_tile = FirstAppendedTile(p, b, begin, end);
    __syncthreads();  // page ids, descriptors, tables
    n_tiles = (end - begin + kTileTokens - 1) / kTileTokens;
    for (int s = 0; s < stages - 1; ++s) {
      if (s < n_tiles) Issue(s, s);
      CpAsyncCommit();
    }
  }

  // The warp's chunk of a tile (tokens first + 16 warp ..) of every plane: each warp copies
  // the rows it reads and waits for its own copies (cp.async groups, then a warp barrier), so
  // the pipeline needs no block barrier. 16 rows of row_bytes are 16 * row_bytes contiguous
  // bytes of a page (a chunk never straddles pages: P >= 16 and the split starts on a tile),
  // row_bytes 16-byte pieces, a lane a piece. A chunk past `end` is zero-filled.
  __device__ __forceinline__ void Issue(int tile, int stage) const {
    if (tile >= append_tile) WaitForPrerequisiteGrid();
    const int tok = begin + tile * kTileTokens + warp * kChunkTokens;
    const bool valid = tok < end;
    int64_t page = 0;
    int slot = 0;
    if (valid) {
      page = page_ids[(tok >> p.page_size_log2) - first_page];
      slot = tok & ((1 << p.page_size_log2) - 1);
    }
    unsigned char* dst = smem + Geo::kStagesOffset + stage * stage_bytes;
    auto plane = [&](int at, const uint8_t* base, int64_t page_stride, int64_t head_stride,
                     int row_bytes) {
      const uint8_t* src = valid ? base + page * page_stride + kvh * head_stride +
                                       static_cast<int64_t>(slot) * row_bytes
                                 : base;
      unsigned char* to = dst + at + warp * kChunkTokens * row_bytes;
      for (int piece = lane; piece < row_bytes; piece += 32) {
        CpAsync16(to + piece * 16, src + piece * 16, valid);
      }
    };
    const CodebookSide k = Side(false), v = Side(true);
    plane(k_codes_at, k.codes, k.codes_page_stride, k.codes_head_stride, k.code_bytes);
    plane(k_norms_at, k.norms, k.norms_page_stride, k.norms_head_stride, 2 * k.slots);
    plane(v_codes_at, v.codes, v.codes_page_stride, v.codes_head_stride, v.code_bytes);
    plane(v_norms_at, v.norms, v.norms_page_stride, v.norms_head_stride, 2 * v.slots);
  }

  // The channel of the e-th code (e = 0, 1) of a fragment side's P-th pair in a lane's bits
  // starting at bit0 (one segment of d values at w bits).
  __device__ __forceinline__ static int FragmentChannel(int w, int bit0, int pair, int e) {
    return codebook::ChannelAt(bit0 + 2 * w * pair + e * w, w, D);
  }

  // q~ of head gi (the rotation kernel's output; PACK: column gi, the hi or lo part of head
  // gi & 3) as bf16 hi + lo B fragments: natural channel order, or the keys' fragment order
  // (lane t4's pair 2 kk + half at k-step kk).
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    WaitForQueries(p, b, a.head0);
    bool any_lo = false;
    {
      const int head = PACK ? (gi & 3) : gi;
      const bool lo_column = PACK && gi >= 4;
      const bool real = head < p.heads_per_block;
      const float* q =
          p.q_rot + (static_cast<int64_t>(b) * p.num_q_heads + a.head0 + (real ? head : 0)) * D;
      const int kw = k_fragments;
      const int bit0 = t4 * (D * kw / 4);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float2 v = make_float2(0.f, 0.f);
          if (real) {
            if (kw != 0) {
              v.x = q[FragmentChannel(kw, bit0, 2 * kk + half, 0)];
              v.y = q[FragmentChannel(kw, bit0, 2 * kk + half, 1)];
            } else {
              v = *reinterpret_cast<const float2*>(q + 16 * kk + 8 * half + 2 * t4);
            }
          }
          SplitBf16(v.x, v.y, bq_hi[kk][half], bq_lo[kk][half]);
          any_lo |= (bq_lo[kk][half] & 0x7fff7fffu) != 0u;
          if (lo_column) bq_hi[kk][half] = bq_lo[kk][half];
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

  // Tile t's copies are the warp's (t + 1)-th group committed; stages - 2 later groups may
  // still run. The stage of tile t is t % stages (read_stage); the copy issued here refills the
  // stage of tile t - 1, which this warp has done with.
  __device__ __forceinline__ const unsigned char* LoadTile(int tile) {
    if (stages >= 4) {
      CpAsyncWait<2>();
    } else if (stages == 3) {
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncwarp();  // every lane's copies of the warp's rows are in
    const int stage = read_stage;
    const int next = tile + stages - 1;
    if (next < n_tiles) Issue(next, stage == 0 ? stages - 1 : stage - 1);
    CpAsyncCommit();
    read_stage = stage + 1 == stages ? 0 : stage + 1;
    return smem + Geo::kStagesOffset + stage * stage_bytes;
  }

  // Decodes the warp's 16 rows of one side of the stage into its hi / lo tiles (a side that
  // does not take register fragments).
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
    unsigned char* hi = smem + decoded_at + warp * Geo::kWarpTileBytes;
    unsigned char* lo = hi + kChunkTokens * Geo::kRowStride;
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    __syncwarp();  // the warp's previous reads of its tiles are done
    if (slots == 1) {
      // One segment a row: the tiles hold the centroids (pre-split bf16 hi + lo words), the
      // norm N^ multiplies the logit (keys) or p (values): spec/cache.md §5.3's folded form.
      const uint32_t* split = reinterpret_cast<const uint32_t*>(TableOfSide(value));
#pragma unroll
      for (int k = 0; k < D / 64; ++k) {
        const int pair = lane + 32 * k;
        const uint2 dd = desc[pair];
        const uint32_t width = (dd.x >> 11) & 15;
        const uint32_t mask = (1u << width) - 1u;
        const uint32_t b0 = dd.x & 0xff, b1 = dd.y & 0xff;
        const uint32_t s0 = (dd.x >> 8) & 7, s1 = (dd.y >> 8) & 7;
        // The byte after a code's first only where the code spans it: the byte after a row's
        // last may be the next warp's rows, copied in meanwhile.
        const bool span0 = s0 + width > 8, span1 = s1 + width > 8;
#pragma unroll 8
        for (int r = 0; r < kChunkTokens; ++r) {
          const unsigned char* row = codes + r * code_bytes;
          const uint32_t w0 =
              static_cast<uint32_t>(row[b0]) | (span0 ? static_cast<uint32_t>(row[b0 + 1]) << 8 : 0u);
          const uint32_t w1 =
              static_cast<uint32_t>(row[b1]) | (span1 ? static_cast<uint32_t>(row[b1 + 1]) << 8 : 0u);
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
    const float* tables = reinterpret_cast<const float*>(TableOfSide(value));
#pragma unroll
    for (int k = 0; k < D / 64; ++k) {
      const int pair = lane + 32 * k;
      const uint2 dd = desc[pair];
      const int slot = (dd.x >> 15) & 7;
      const uint32_t width = (dd.x >> 11) & 15;
      const uint32_t mask = (1u << width) - 1u;
      const float* table = tables + (dd.x >> 18);
      const bool span0 = ((dd.x >> 8) & 7) + width > 8, span1 = ((dd.y >> 8) & 7) + width > 8;
#pragma unroll 4
      for (int r = 0; r < kChunkTokens; ++r) {
        const unsigned char* row = codes + r * code_bytes;
        const bool valid = chunk_first + r < end;
        const float norm = valid ? F32FromBf16(norms[r * slots + slot]) : 0.0f;
        const uint32_t b0 = dd.x & 0xff, b1 = dd.y & 0xff;
        const uint32_t w0 =
            static_cast<uint32_t>(row[b0]) | (span0 ? static_cast<uint32_t>(row[b0 + 1]) << 8 : 0u);
        const uint32_t w1 =
            static_cast<uint32_t>(row[b1]) | (span1 ? static_cast<uint32_t>(row[b1 + 1]) << 8 : 0u);
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

  // QK^T from register fragments (keys of one segment at W bits): A of k-step kk = the pair
  // entries of pairs 2 kk (a0, a1: rows gi, gi + 8) and 2 kk + 1 (a2, a3) of lane t4's bits.
  template <int W>
  __device__ __forceinline__ void FragmentLogits(const unsigned char* stage, float (&c)[4]) const {
    constexpr int kBits = D * W / 4;
    constexpr int kWords = (kBits + 31) / 32;
    const int code_bytes = D * W / 8;
    const unsigned char* rows = stage + k_codes_at + warp * kChunkTokens * code_bytes;
    const unsigned char* table = TableOfSide(false);
    uint32_t r0[kWords], r8[kWords];
    LaneBits<kBits>(rows + gi * code_bytes, t4 * kBits, r0);
    LaneBits<kBits>(rows + (gi + 8) * code_bytes, t4 * kBits, r8);
    // The hi products and the lo corrections in two accumulators: two MMA chains, not one.
    float cl[4] = {0.f, 0.f, 0.f, 0.f};
    StaticFor<D / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      const uint2 e0 = PairEntry<W, 2 * kk>(table, r0), e1 = PairEntry<W, 2 * kk>(table, r8);
      const uint2 e2 = PairEntry<W, 2 * kk + 1>(table, r0);
      const uint2 e3 = PairEntry<W, 2 * kk + 1>(table, r8);
      MmaBf16(c, e0.x, e1.x, e2.x, e3.x, bq_hi[kk][0], bq_hi[kk][1]);
      MmaBf16(cl, e0.y, e1.y, e2.y, e3.y, bq_hi[kk][0], bq_hi[kk][1]);
      if (!PACK && use_lo) MmaBf16(cl, e0.x, e1.x, e2.x, e3.x, bq_lo[kk][0], bq_lo[kk][1]);
    });
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] += cl[i];
  }

  // QK^T: A = the warp's K rows (register fragments, or the decoded hi, lo tiles by
  // ldmatrix), B = q~ hi (+ lo).
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& s) const {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const bool fragments = WithFragmentWidth(
        k_fragments, [&](auto w) { FragmentLogits<decltype(w)::value>(stage, c); });
    if (!fragments) {
      DecodeRows(stage, tile, false);
      const unsigned char* ka = smem + decoded_at + warp * Geo::kWarpTileBytes +
                                ((lane & 7) + 8 * ((lane >> 3) & 1)) * Geo::kRowStride +
                                8 * (lane >> 4) * 2;
      const unsigned char* kl = ka + kChunkTokens * Geo::kRowStride;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4], al[4];
        LdMatrixX4(a, ka + 32 * kk);
        LdMatrixX4(al, kl + 32 * kk);
        MmaBf16(c, a[0], a[1], a[2], a[3], bq_hi[kk][0], bq_hi[kk][1]);
        MmaBf16(c, al[0], al[1], al[2], al[3], bq_hi[kk][0], bq_hi[kk][1]);
        if (!PACK && use_lo) MmaBf16(c, a[0], a[1], a[2], a[3], bq_lo[kk][0], bq_lo[kk][1]);
      }
    }
    if constexpr (PACK) {
      // Head h's logit = column h (hi part of q~) + column h + 4 (lo part).
#pragma unroll
      for (int i = 0; i < 4; ++i) c[i] += __shfl_xor_sync(0xffffffffu, c[i], 2);
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

  // PV from register fragments (values of one segment at W bits): m-tile mt is lane gi's pair
  // mt (its channel rows gi and gi + 8) of tokens 2 t4, 2 t4 + 1 (a0, a1) and 2 t4 + 8, 2 t4 + 9
  // (a2, a3), one channel of two tokens a register.
  template <int W>
  __device__ __forceinline__ void FragmentValues(const unsigned char* stage, uint32_t bh0,
                                                 uint32_t bh1, uint32_t bl0, uint32_t bl1) {
    constexpr int kBits = D * W / 8;
    constexpr int kWords = (kBits + 31) / 32;
    const int code_bytes = D * W / 8;
    const unsigned char* rows = stage + v_codes_at + warp * kChunkTokens * code_bytes;
    const unsigned char* table = TableOfSide(true);
    uint32_t r0[kWords], r1[kWords], r8[kWords], r9[kWords];
    LaneBits<kBits>(rows + (2 * t4) * code_bytes, gi * kBits, r0);
    LaneBits<kBits>(rows + (2 * t4 + 1) * code_bytes, gi * kBits, r1);
    LaneBits<kBits>(rows + (2 * t4 + 8) * code_bytes, gi * kBits, r8);
    LaneBits<kBits>(rows + (2 * t4 + 9) * code_bytes, gi * kBits, r9);
    if constexpr (W == 3) {
      StaticFor<D / 16>([&](auto mt_) {
        constexpr int mt = decltype(mt_)::value;
        const uint2 e0 = TokenPairEntry<W, 2 * mt>(table, r0, r1);
        const uint2 e1 = TokenPairEntry<W, 2 * mt + 1>(table, r0, r1);
        const uint2 e2 = TokenPairEntry<W, 2 * mt>(table, r8, r9);
        const uint2 e3 = TokenPairEntry<W, 2 * mt + 1>(table, r8, r9);
        MmaBf16(st.acc[mt], e0.x, e1.x, e2.x, e3.x, bh0, bh1);
        if constexpr (!PACK) MmaBf16(st.acc[mt], e0.x, e1.x, e2.x, e3.x, bl0, bl1);
        MmaBf16(st.acc[mt], e0.y, e1.y, e2.y, e3.y, bh0, bh1);
      });
    } else {
      uint32_t even_a[kWords], odd_a[kWords], even_b[kWords], odd_b[kWords];
      ZipTokens<W>(r0, r1, even_a, odd_a);
      ZipTokens<W>(r8, r9, even_b, odd_b);
      StaticFor<D / 16>([&](auto mt_) {
        constexpr int mt = decltype(mt_)::value;
        const uint2 e0 = PairEntry<W, mt>(table, even_a), e1 = PairEntry<W, mt>(table, odd_a);
        const uint2 e2 = PairEntry<W, mt>(table, even_b), e3 = PairEntry<W, mt>(table, odd_b);
        MmaBf16(st.acc[mt], e0.x, e1.x, e2.x, e3.x, bh0, bh1);
        if constexpr (!PACK) MmaBf16(st.acc[mt], e0.x, e1.x, e2.x, e3.x, bl0, bl1);
        MmaBf16(st.acc[mt], e0.y, e1.y, e2.y, e3.y, bh0, bh1);
      });
    }
  }

  // PV: A = the warp's V rows transposed (register fragments, or the decoded hi, lo tiles by
  // ldmatrix.trans), B = p (times N^ of its token on a one-segment side) as bf16 hi + lo.
  __device__ __forceinline__ void Values(const unsigned char* stage, int tile, const Scores&,
                                         const Probs& probs) {
    Probs pr = probs;
    const float na = RowNorm(stage, tile, true, gi), nb = RowNorm(stage, tile, true, gi + 8);
    pr.p[0][0] *= na;
    pr.p[0][1] *= na;
    pr.p[0][2] *= nb;
    pr.p[0][3] *= nb;
    uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
    if constexpr (PACK) {
      // Lanes t4 and t4 ^ 2 hold the same p (the same logits); the hi columns (t4 < 2) take the
      // hi parts of rows gi and gi + 8, the lo columns the lo parts: each lane splits one row
      // (t4 < 2: gi, else gi + 8) and one shuffle trades the part the other lane needs.
      const bool lo_lane = t4 >= 2;
      uint32_t hi, lo;
      SplitBf16(lo_lane ? pr.p[0][2] : pr.p[0][0], lo_lane ? pr.p[0][3] : pr.p[0][1], hi, lo);
      const uint32_t keep = lo_lane ? lo : hi;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, lo_lane ? hi : lo, 2);
      bh0 = Transpose8x8(lo_lane ? got : keep);  // row gi
      bh1 = Transpose8x8(lo_lane ? keep : got);  // row gi + 8
    } else {
      uint32_t hi_a, lo_a, hi_b, lo_b;
      SplitBf16(pr.p[0][0], pr.p[0][1], hi_a, lo_a);
      SplitBf16(pr.p[0][2], pr.p[0][3], hi_b, lo_b);
      bh0 = Transpose8x8(hi_a);
      bh1 = Transpose8x8(hi_b);
      bl0 = Transpose8x8(lo_a);
      bl1 = Transpose8x8(lo_b);
    }
    const bool fragments = WithFragmentWidth(v_fragments, [&](auto w) {
      FragmentValues<decltype(w)::value>(stage, bh0, bh1, bl0, bl1);
    });
    if (!fragments) {
      DecodeRows(stage, tile, true);
      const unsigned char* va = smem + decoded_at + warp * Geo::kWarpTileBytes +
                                ((lane & 7) + 8 * (lane >> 4)) * Geo::kRowStride +
                                8 * ((lane >> 3) & 1) * 2;
      const unsigned char* vl = va + kChunkTokens * Geo::kRowStride;
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        uint32_t a[4], al[4];
        LdMatrixX4Trans(a, va + 32 * mt);
        LdMatrixX4Trans(al, vl + 32 * mt);
        MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bh0, bh1);
        if constexpr (!PACK) MmaBf16(st.acc[mt], a[0], a[1], a[2], a[3], bl0, bl1);
        MmaBf16(st.acc[mt], al[0], al[1], al[2], al[3], bh0, bh1);
      }
    }
  }

  __device__ __forceinline__ void ReleaseTile(int) const {}

  // The accumulator rows are channels 16 mt + gi (+ 8), or a fragment side's lane gi pair mt.
  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    if constexpr (PACK) {
      // Head h's accumulator = column h (p hi) + column h + 4 (p lo); lanes t4 >= 2 then hold
      // copies for the unused heads 4..7, which CombineAndStore never writes out.
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st.acc[mt][i] += __shfl_xor_sync(0xffffffffu, st.acc[mt][i], 2);
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // every warp is done with the stages (the partials reuse them)
    const int g = gi;
    const int vw = v_fragments;
    const int bit0 = g * (D * vw / 8);
    CombineAndStore<D>(
        p, st,
        [&](int mt, int upper) {
          return vw != 0 ? FragmentChannel(vw, bit0, mt, upper) : 16 * mt + g + 8 * upper;
        },
        smem, b, a.head0, a.split);
  }
};

// codebook keys and values (spec 1.3): CodebookRowsLoop.
template <>
struct HistoryLoop<Format::kCodebook> {
  template <int D, class K, class V, QuantLoop LOOP>
  __device__ __forceinline__ static void Split(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
    SplitLoop<CodebookRowsLoop<D, LOOP == QuantLoop::kPacked>>(
        SplitArgs{p, smem, kvh, head0, b, split, begin, end});
  }
  template <int D, class K, class V>
  static constexpr int SharedBytes() {
    return CodebookGeometry<D>::kMaxBytes;
  }
  // A launch takes what the cache's rows need (CodebookGeometry::Bytes), not the largest.
  template <int D>
  static int LaunchSharedBytes(const DecodeKernelParams& p) {
    return CodebookGeometry<D>::Bytes(p);
  }
};

}  // namespace kvq::gpu::attention::detail
