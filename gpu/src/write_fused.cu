// The fused write of the affine_token format (layer a) and its launcher (layer b); see write.h.
//
// Two fused kernels, one row per slice of d/16 lanes (write_row.cuh):
//  - FusedWriteStreamKernel (identity and FWHT rotations): every warp streams batches of
//    32/(d/16) rows of one KV head straight from global memory into registers, rotates,
//    clips, quantizes, packs and stores them; no shared memory, no barriers, a persistent
//    grid.
//  - FusedWriteTileKernel (dense rotation): a tile of rows of one KV head (blockIdx.y) is
//    staged in shared memory as fp32 (bf16 input double-buffered: the next tile's raw rows
//    arrive by cp.async while the block works on the current one, over a persistent grid),
//    multiplied by R (in shared memory, loaded once per block when it fits, streamed in chunks
//    of rows of R for d = 256) with each thread accumulating 4 channels x 4 rows in i order;
//    then each slice takes a row of the tile through the same steps.
// Both store codes and bf16 (scale, min) to flat rows or cache pages: the planes of
// LayoutOf(p) at the positions kvq/gpu/formats.h names (kAffine*Plane).
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/write.h"
#include "launch.cuh"
#include "write_launch.cuh"
#include "write_row.cuh"
#include "codebook.cuh"

namespace kvq::gpu {
namespace {

using detail::kFullMask;
using detail::LaneId;
using write_launch::FlushRange;
using write_launch::IsPowerOfTwo;
using write_launch::RaiseFlag;

constexpr int kThreads = 256;  // fused kernel block: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerThread = 4;  // dense rotation: rows accumulated per thread
constexpr int kRotationIdentity = static_cast<int>(RotationKind::kIdentity);
constexpr int kRotationDense = static_cast<int>(RotationKind::kDense);
constexpr int kRotationHadamard = static_cast<int>(RotationKind::kHadamard);

template <int D>
struct TileTraits {
  // A tile is what one pass of the dense product covers: kThreads threads x 4 channels x
  // kRowsPerThread rows = D x kTileRows.
  static constexpr int kTileRows = kThreads * 4 * kRowsPerThread / D;  // 64, 32, 16
  // Padded row: the slices of a half-warp (lanes reading 8-byte pairs of consecutive rows) hit
  // different banks.
  static constexpr int kStride = D + 2 * detail::SliceTraits<D>::kLanes;
  static constexpr int kTileFloats = kTileRows * kStride;
  static constexpr int kRChunk = D <= 128 ? D : 64;  // rows of R held in shared memory at once
  static constexpr bool kRResident = kRChunk == D;
  static constexpr size_t kTileBytes = sizeof(float) * kTileFloats;
  static constexpr size_t kRBytes = sizeof(float) * kRChunk * D;
  // bf16 input: the next tile's raw rows, copied asynchronously while this tile is processed.
  static constexpr int kStagingVectors = kTileRows * D / 8;  // 16-byte chunks
  static constexpr size_t kStagingBytes = 16 * kStagingVectors;
  static_assert(kStagingVectors % kThreads == 0, "every thread stages whole chunks");
};

// ---- Row addressing of the modes ----------------------------------------------------------------

// kFlush: the positions of sequence b's flush (write_launch.cuh).
__device__ __forceinline__ FlushRange FlushRangeOf(const FusedWriteArgs& a, int len) {
  return write_launch::FlushRangeOf(len, a.sink, a.recent, a.flush);
}

// Source of row (t, head), or null when the row is not written (append without demotion, bad
// length). Elements, not bytes. kMode: the write mode, when the caller knows it at compile time
// (the streaming kernel), so that the other modes' code and their 64-bit arithmetic go.
template <WriteMode kMode, typename T>
__device__ __forceinline__ const T* RowSourceIn(const FusedWriteArgs& a, int t, int head, int d) {
  const T* x = static_cast<const T*>(a.x);
  if constexpr (kMode == WriteMode::kRows) {
    return x + static_cast<int64_t>(t) * a.token_stride + static_cast<int64_t>(head) * d;
  } else if constexpr (kMode == WriteMode::kPrefill) {
    return x + (a.first_token + t) * a.token_stride + static_cast<int64_t>(head) * d;
  } else if constexpr (kMode == WriteMode::kAppend) {
    const int len = a.seq_lengths[t];
    if (len < 0 || len - a.recent < a.sink) return nullptr;
    return x + static_cast<int64_t>(t) * a.seq_stride +
           static_cast<int64_t>(len % a.recent) * a.token_stride +
           static_cast<int64_t>(head) * d;
  } else {
    const int b = t / a.flush;
    const FlushRange f = FlushRangeOf(a, a.seq_lengths[b]);
    const int64_t p = f.begin + t % a.flush;
    if (p >= f.end) return nullptr;
    if (p < f.len) {
      return x + static_cast<int64_t>(b) * a.seq_stride +
             (p % a.ring_slots) * a.token_stride + static_cast<int64_t>(head) * d;
    }
    return static_cast<const T*>(a.new_rows) + static_cast<int64_t>(b) * a.token_stride +
           static_cast<int64_t>(head) * d;
  }
}

template <typename T>
__device__ __forceinline__ const T* RowSource(const FusedWriteArgs& a, int t, int head, int d) {
  switch (a.mode) {
    case WriteMode::kRows: return RowSourceIn<WriteMode::kRows, T>(a, t, head, d);
    case WriteMode::kPrefill: return RowSourceIn<WriteMode::kPrefill, T>(a, t, head, d);
    case WriteMode::kAppend: return RowSourceIn<WriteMode::kAppend, T>(a, t, head, d);
    case WriteMode::kFlush: return RowSourceIn<WriteMode::kFlush, T>(a, t, head, d);
  }
  return nullptr;
}

struct RowDestination {
  int64_t row = -1;  // row index into the planes (codes [.., d*b/8], scale/min [.., d/G]); -1: skip
  int64_t flat_row = -1;  // kRows: index for the optional rotated / tau outputs
};

// Where row (t, head) is stored in mode kMode; `leader` raises the row's error flags.
template <WriteMode kMode>
__device__ __forceinline__ RowDestination ResolveDestinationIn(const FusedWriteArgs& a, int t,
                                                               int head, bool leader) {
  RowDestination dest;
  if constexpr (kMode == WriteMode::kRows) {
    dest.row = static_cast<int64_t>(t) * a.num_heads + head;
    dest.flat_row = dest.row;
    return dest;
  } else {
    int64_t history_index;
    const int32_t* table;
    if constexpr (kMode == WriteMode::kPrefill) {
      history_index = t;  // the caller sized the table ceil(history / P)
      table = a.page_table;
    } else if constexpr (kMode == WriteMode::kFlush) {
      const int b = t / a.flush;
      const int len = a.seq_lengths[b];
      if (len < 0) {
        RaiseFlag(a.error_flags, kErrorFlagBadLength, leader);
        return dest;
      }
      const FlushRange f = FlushRangeOf(a, len);
      const int64_t p = f.begin + t % a.flush;
      if (p >= f.end) return dest;  // nothing (or fewer rows) to flush in this step
      history_index = p - a.sink;
      table = a.page_table + static_cast<int64_t>(b) * a.page_table_stride;
    } else {
      const int len = a.seq_lengths[t];
      if (len < 0) {
        RaiseFlag(a.error_flags, kErrorFlagBadLength, leader);
        return dest;
      }
      if (len - a.recent < a.sink) return dest;  // nothing to demote in this step
      history_index = static_cast<int64_t>(len) - a.recent - a.sink;
      table = a.page_table + static_cast<int64_t>(t) * a.page_table_stride;
    }
    const int64_t page_index = history_index >> a.page_size_log2;
    if ((kMode == WriteMode::kAppend || kMode == WriteMode::kFlush) &&
        page_index >= a.page_table_stride) {
      RaiseFlag(a.error_flags, kErrorFlagBadPage, leader);
      return dest;
    }
    const int32_t page = table[page_index];
    if (page < 0 || page >= a.num_pages) {
      RaiseFlag(a.error_flags, kErrorFlagBadPage, leader);
      return dest;
    }
    const int64_t slot = history_index & ((int64_t{1} << a.page_size_log2) - 1);
    dest.row = ((static_cast<int64_t>(page) * a.num_heads + head) << a.page_size_log2) + slot;
    return dest;
  }
}

__device__ __forceinline__ RowDestination ResolveDestination(const FusedWriteArgs& a, int t,
                                                             int head, bool leader) {
  switch (a.mode) {
    case WriteMode::kRows: return ResolveDestinationIn<WriteMode::kRows>(a, t, head, leader);
    case WriteMode::kPrefill: return ResolveDestinationIn<WriteMode::kPrefill>(a, t, head, leader);
    case WriteMode::kAppend: return ResolveDestinationIn<WriteMode::kAppend>(a, t, head, leader);
    case WriteMode::kFlush: return ResolveDestinationIn<WriteMode::kFlush>(a, t, head, leader);
  }
  return RowDestination();
}

// ---- Tile staging ------------------------------------------------------------------------------

// Rows t0 .. t0 + kTileRows - 1 of `head` into the tile as fp32; rows that are not written
// become zeros (they are rotated with the rest but never stored).
template <int D>
__device__ __forceinline__ void LoadTile(const FusedWriteArgs& a, float* tile, int t0,
                                         int head) {
  using Tile = TileTraits<D>;
  if (a.x_is_bf16) {
    constexpr int kVectors = D / 8;  // 16 bytes = 8 bf16
    for (int idx = threadIdx.x; idx < Tile::kTileRows * kVectors; idx += kThreads) {
      const int r = idx / kVectors;
      const int vec = idx % kVectors;
      const int t = t0 + r;
      const uint16_t* src = t < a.num_tokens ? RowSource<uint16_t>(a, t, head, D) : nullptr;
      float4 lo = make_float4(0.f, 0.f, 0.f, 0.f);
      float4 hi = lo;
      if (src != nullptr) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src) + vec);
        // Little-endian: the low half of each word is the even element. bf16 -> fp32 exact.
        lo = make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                         __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
        hi = make_float4(__uint_as_float(raw.z << 16), __uint_as_float(raw.z & 0xffff0000u),
                         __uint_as_float(raw.w << 16), __uint_as_float(raw.w & 0xffff0000u));
      }
      float4* dst = reinterpret_cast<float4*>(tile + r * Tile::kStride + vec * 8);
      dst[0] = lo;
      dst[1] = hi;
    }
  } else {
    constexpr int kVectors = D / 4;
    for (int idx = threadIdx.x; idx < Tile::kTileRows * kVectors; idx += kThreads) {
      const int r = idx / kVectors;
      const int vec = idx % kVectors;
      const int t = t0 + r;
      const float* src = t < a.num_tokens ? RowSource<float>(a, t, head, D) : nullptr;
      float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
      if (src != nullptr) value = __ldg(reinterpret_cast<const float4*>(src) + vec);
      *reinterpret_cast<float4*>(tile + r * Tile::kStride + vec * 4) = value;
    }
  }
}

// bf16 input, double-buffered: thread i copies 16-byte chunks i, i + kThreads, ... of the
// tile's rows (row r = chunk / (D/8)) into `staging` with cp.async, zero-filled for rows that
// are not written; the caller commits. Each thread later converts exactly the chunks it copied
// (ConvertStagedTile), so the copy needs no barrier of its own: cp.async wait_all orders a
// thread's own copies before its reads.
template <int D>
__device__ __forceinline__ void StageTileAsync(const FusedWriteArgs& a, uint4* staging, int t0,
                                               int head) {
  constexpr int kVectors = D / 8;
#pragma unroll
  for (int i = 0; i < TileTraits<D>::kStagingVectors / kThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    const int t = t0 + idx / kVectors;
    const uint16_t* src = t < a.num_tokens ? RowSource<uint16_t>(a, t, head, D) : nullptr;
    if (src != nullptr) {
      __pipeline_memcpy_async(staging + idx, reinterpret_cast<const uint4*>(src) + idx % kVectors,
                              16);
    } else {
      __pipeline_memcpy_async(staging + idx, a.x, 16, 16);  // reads nothing, writes zeros
    }
  }
}

template <int D>
__device__ __forceinline__ void ConvertStagedTile(const uint4* staging, float* tile) {
  using Tile = TileTraits<D>;
  constexpr int kVectors = D / 8;
#pragma unroll
  for (int i = 0; i < Tile::kStagingVectors / kThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    const uint4 raw = staging[idx];
    // Little-endian: the low half of each word is the even element. bf16 -> fp32 exact.
    float4* dst = reinterpret_cast<float4*>(tile + (idx / kVectors) * Tile::kStride +
                                            (idx % kVectors) * 8);
    dst[0] = make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                         __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
    dst[1] = make_float4(__uint_as_float(raw.z << 16), __uint_as_float(raw.z & 0xffff0000u),
                         __uint_as_float(raw.w << 16), __uint_as_float(raw.w & 0xffff0000u));
  }
}

// Rows [first, first + kRChunk) of R into shared memory.
template <int D>
__device__ __forceinline__ void LoadRotationChunk(float* shared_r, const float* r, int first) {
  constexpr int kVectors = TileTraits<D>::kRChunk * D / 4;
  const float4* src = reinterpret_cast<const float4*>(r + static_cast<int64_t>(first) * D);
  float4* dst = reinterpret_cast<float4*>(shared_r);
  for (int idx = threadIdx.x; idx < kVectors; idx += kThreads) dst[idx] = __ldg(src + idx);
}

// The resident R (kRResident) copied asynchronously (cp.async: every copy in flight at once,
// no registers); the caller commits the group and waits for it before the first product.
template <int D>
__device__ __forceinline__ void LoadRotationAsync(float* shared_r, const float* r) {
  constexpr int kVectors = D * D / 4;
  static_assert(TileTraits<D>::kRResident && kVectors % kThreads == 0, "whole R, whole float4s");
  const float4* src = reinterpret_cast<const float4*>(r);
  float4* dst = reinterpret_cast<float4*>(shared_r);
#pragma unroll
  for (int k = 0; k < kVectors / kThreads; ++k) {
    const int idx = static_cast<int>(threadIdx.x) + k * kThreads;
    __pipeline_memcpy_async(dst + idx, src + idx, 16);
  }
}

__device__ __forceinline__ float Component(const float4& v, int c) {
  return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w));
}

// Rows [0, rows) of the tile <- row . R in place, for a tile of few rows (rows <= kFewRows: an
// append's demotions, one row a sequence). Thread t computes channel j = t % D of rows
// t / D + k kThreads / D: every thread has at most kRowsPerThread outputs, and a warp's lanes
// share their rows (D >= 64), so x[i] is a broadcast and R's row i a conflict-free read. The
// sums are RotateTileDense's, term for term, so the bits are too.
template <int D>
struct FewRows {
  static constexpr int kPerPass = kThreads / D;                  // rows a pass: 4, 2, 1
  static constexpr int kMax = kPerPass * kRowsPerThread;         // 16, 8, 4
};

template <int D>
__device__ __forceinline__ void RotateFewRowsDense(float* tile, float* shared_r, const float* r,
                                                   int rows) {
  using Tile = TileTraits<D>;
  const int j = static_cast<int>(threadIdx.x) % D;
  const int row0 = static_cast<int>(threadIdx.x) / D;
  float acc[kRowsPerThread];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) acc[k] = +0.0f;
  for (int chunk = 0; chunk < D; chunk += Tile::kRChunk) {
    if (!Tile::kRResident) {
      __syncthreads();  // every thread is done with the previous chunk
      LoadRotationChunk<D>(shared_r, r, chunk);
      __syncthreads();
    }
    if (row0 >= rows) continue;  // a warp without rows (uniform: its lanes share row0)
#pragma unroll 2
    for (int i = 0; i < Tile::kRChunk; i += 4) {
      float rv[4];
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) rv[ii] = shared_r[(i + ii) * D + j];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) {
        const int row = row0 + k * FewRows<D>::kPerPass;
        if (row >= rows) break;
        const float4 xv = *reinterpret_cast<const float4*>(tile + row * Tile::kStride + chunk + i);
        acc[k] = __fadd_rn(acc[k], __fmul_rn(xv.x, rv[0]));
        acc[k] = __fadd_rn(acc[k], __fmul_rn(xv.y, rv[1]));
        acc[k] = __fadd_rn(acc[k], __fmul_rn(xv.z, rv[2]));
        acc[k] = __fadd_rn(acc[k], __fmul_rn(xv.w, rv[3]));
      }
    }
  }
  __syncthreads();  // every thread has read its rows
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int row = row0 + k * FewRows<D>::kPerPass;
    if (row < rows) tile[row * Tile::kStride + j] = acc[k];
  }
  __syncthreads();
}

// tile <- tile . R in place. Thread (jg, rg) owns channels 4*jg .. 4*jg+3 of rows
// 4*rg .. 4*rg+3; every output is acc = +0, then acc = acc + x[i]*R[i][j] for i ascending,
// product and sum rounded separately (spec/numerics.md §3.1).
template <int D>
__device__ __forceinline__ void RotateTileDense(float* tile, float* shared_r, const float* r) {
  using Tile = TileTraits<D>;
  constexpr int kChannelGroups = D / 4;
  const int jg = static_cast<int>(threadIdx.x) % kChannelGroups;
  const int row0 = (static_cast<int>(threadIdx.x) / kChannelGroups) * kRowsPerThread;
  float acc[kRowsPerThread][4];
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[rr][c] = +0.0f;
  }
  for (int chunk = 0; chunk < D; chunk += Tile::kRChunk) {
    if (!Tile::kRResident) {
      __syncthreads();  // every thread is done with the previous chunk
      LoadRotationChunk<D>(shared_r, r, chunk);
      __syncthreads();
    }
#pragma unroll 2
    for (int i = 0; i < Tile::kRChunk; i += 4) {
      float4 xv[kRowsPerThread];
#pragma unroll
      for (int rr = 0; rr < kRowsPerThread; ++rr) {
        xv[rr] = *reinterpret_cast<const float4*>(tile + (row0 + rr) * Tile::kStride + chunk + i);
      }
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        const float4 rv = *reinterpret_cast<const float4*>(shared_r + (i + ii) * D + 4 * jg);
#pragma unroll
        for (int rr = 0; rr < kRowsPerThread; ++rr) {
          const float xi = Component(xv[rr], ii);
          acc[rr][0] = __fadd_rn(acc[rr][0], __fmul_rn(xi, rv.x));
          acc[rr][1] = __fadd_rn(acc[rr][1], __fmul_rn(xi, rv.y));
          acc[rr][2] = __fadd_rn(acc[rr][2], __fmul_rn(xi, rv.z));
          acc[rr][3] = __fadd_rn(acc[rr][3], __fmul_rn(xi, rv.w));
        }
      }
    }
  }
  __syncthreads();  // every thread has read the whole tile
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) {
    *reinterpret_cast<float4*>(tile + (row0 + rr) * Tile::kStride + 4 * jg) =
        make_float4(acc[rr][0], acc[rr][1], acc[rr][2], acc[rr][3]);
  }
  __syncthreads();
}

// ---- The codebook epilogue (spec 1.3, numerics.md §5.4) ----------------------------------------
// A slice's row goes through shared memory in natural channel order (the lanes' pair-strided
// registers scattered there), so that each segment's two trees (the squares of the row, then of
// the decoded centroids) run in the spec's order: slice lane r < L = min(M, kLanes) sums the
// M / L leaves r, r + L, r + 2L, ... as a balanced tree in bit-reversed order (a stack of
// partial sums), which is the subtree a[r] of the spec's a[j] += a[j + h] for h = M/2 .. L,
// and log2(L) shuffles finish it (h = L/2 .. 1). Every sum and product is an explicit
// round-to-nearest intrinsic (this library is compiled with contraction on).

// The block's view of its head's codebook row: the layout, each segment's table, and the
// slices' scratch (a row of fp32 values and a row of codes per slice).
template <int D>
struct CodebookBlock {
  static constexpr int kSlices = kThreads / detail::SliceTraits<D>::kLanes;
  CodebookLayout layout;
  const float* table[kCodebookMaxSegments];
  float values[kSlices][D];
  uint8_t codes[kSlices][D];
};

// The block's CodebookBlock (static shared memory: raw bytes, as __shared__ takes no
// constructor).
template <int D>
__device__ __forceinline__ CodebookBlock<D>& CodebookShared() {
  __shared__ __align__(16) unsigned char bytes[sizeof(CodebookBlock<D>)];
  return *reinterpret_cast<CodebookBlock<D>*>(bytes);
}

// Thread 0 lays head `head`'s row out; the caller's barrier publishes it.
template <int D>
__device__ __forceinline__ void PrepareCodebookBlock(const FusedWriteArgs& a, int head) {
  if (threadIdx.x != 0) return;
  CodebookBlock<D>& cb = CodebookShared<D>();
  cb.layout = codebook::HeadLayout(D, a.widths, a.bits, head);
  for (int s = 0; s < kCodebookMaxSegments; ++s) {
    cb.table[s] = s < cb.layout.count ? codebook::TableOf(a.codebook, cb.layout.segment[s].values,
                                                          cb.layout.segment[s].width)
                                      : nullptr;
  }
}

// The tree sum of the squares of row[o, o + m) padded with +0 to M = NormTreeSize(m), in every
// lane of the slice.
template <int D>
__device__ __forceinline__ float SliceTreeSquares(const float* row, int o, int m) {
  constexpr int kLanes = detail::SliceTraits<D>::kLanes;
  const int M = static_cast<int>(NormTreeSize(m));
  const int L = M < kLanes ? M : kLanes;
  const int leaves = M / L;
  int leaf_bits = 0;
  while ((1 << leaf_bits) < leaves) ++leaf_bits;
  const int r = detail::SliceLane<D>();
  float sum = 0.0f;
  if (r < L) {
    float stack[9];
    for (int i2 = 0; i2 < leaves; ++i2) {
      const int i = leaf_bits == 0 ? 0 : static_cast<int>(BitReverse(i2, leaf_bits));
      const int j = r + i * L;
      const float x = j < m ? row[o + j] : 0.0f;
      float v = __fmul_rn(x, x);
      int k = 0;
      for (int c = i2; c & 1; c >>= 1, ++k) v = __fadd_rn(stack[k], v);
      stack[k] = v;
    }
    sum = stack[leaf_bits];
  }
  for (int h = L / 2; h >= 1; h >>= 1) {
    const float other = __shfl_down_sync(kFullMask, sum, h, kLanes);
    if (r < h) sum = __fadd_rn(sum, other);
  }
  return __shfl_sync(kFullMask, sum, 0, kLanes);
}

// The codebook row of one slice: segment norms, codes, corrected norms, packing, the stores.
// v holds the rotated row (pair-strided, logical slice lane rho). Every lane of the warp calls
// it (shuffles); a row with dest.row < 0 stores nothing.
template <int D>
__device__ __forceinline__ void WriteCodebookRow(const FusedWriteArgs& a, const float (&v)[16],
                                                 int rho, const RowDestination& dest) {
  constexpr int kLanes = detail::SliceTraits<D>::kLanes;
  CodebookBlock<D>& cb = CodebookShared<D>();
  const CodebookLayout& layout = cb.layout;
  const int slice = static_cast<int>(threadIdx.x) / kLanes;
  const int r = detail::SliceLane<D>();
  const bool stored = dest.row >= 0;
  float* row = cb.values[slice];
  uint8_t* codes = cb.codes[slice];
#pragma unroll
  for (int k = 0; k < 16; k += 2) {
    *reinterpret_cast<float2*>(row + detail::RowPosition<D>(k, rho)) = make_float2(v[k], v[k + 1]);
  }
  __syncwarp();
  // §5.4.2: n^ = bf16(sqrtf(tree)), per segment.
  float norm_hat[kCodebookMaxSegments];
#pragma unroll
  for (int s = 0; s < kCodebookMaxSegments; ++s) {
    norm_hat[s] = 0.0f;
    if (s < layout.count) {
      const float n = __fsqrt_rn(
          SliceTreeSquares<D>(row, layout.segment[s].offset, layout.segment[s].values));
      norm_hat[s] = F32FromBf16(Bf16FromF32(n));
      if (stored && IsNonFinite(norm_hat[s])) RaiseFlag(a.error_flags, kErrorFlagNonFinite, r == 0);
    }
  }
  __syncwarp();  // the rows are read: the centroids replace them below
  // §5.4.3: u = x / n^, code = #{t < u}; the row becomes the decoded centroids.
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int c = detail::RowPosition<D>(k, rho);
    int seg = 0;
    float nh = norm_hat[0];
#pragma unroll
    for (int s = 1; s < kCodebookMaxSegments; ++s) {
      if (s < layout.count && c >= layout.segment[s].offset) {
        seg = s;
        nh = norm_hat[s];
      }
    }
    const float u = nh == 0.0f ? 0.0f : __fdiv_rn(v[k], nh);
    const int levels = 1 << layout.segment[seg].width;
    const float* table = cb.table[seg];
    const int code = codebook::CountBelow(table + levels, levels, u);
    codes[c] = static_cast<uint8_t>(code);
    row[c] = __ldg(table + code);
  }
  __syncwarp();
  // §5.4.4: N^ = bf16(n^ / r), r the tree length of the centroids.
  uint16_t corrected[kCodebookMaxSegments];
#pragma unroll
  for (int s = 0; s < kCodebookMaxSegments; ++s) {
    corrected[s] = 0;
    if (s < layout.count) {
      const float len = __fsqrt_rn(
          SliceTreeSquares<D>(row, layout.segment[s].offset, layout.segment[s].values));
      corrected[s] = Bf16FromF32(__fdiv_rn(norm_hat[s], len));
    }
  }
  if (stored) {
    // §8.2: byte i of the row's code plane from the codes of its segment (0x00 past them).
    uint8_t* out = a.planes[0] + dest.row * a.code_bytes;
    for (int i = r; i < a.code_bytes; i += kLanes) {
      unsigned byte = 0;
#pragma unroll 1
      for (int s = 0; s < layout.count; ++s) {
        const CodebookSegment& seg = layout.segment[s];
        const int local = i - seg.byte_offset;
        if (local < 0 || local >= seg.bytes) continue;
        const uint8_t* sc = codes + seg.offset;
        if (seg.width == 2 || seg.width == 4) {
          const int q = seg.width == 2 ? (seg.values + 3) / 4 : seg.values / 2;
          for (int part = 0; part * seg.width < 8; ++part) {
            const int j = part * q + local;
            if (j < seg.values) byte |= static_cast<unsigned>(sc[j]) << (seg.width * part);
          }
        } else {
          for (int t = 0; t < 8; ++t) {
            const int e = 8 * local + t;
            if (e < seg.values * seg.width) {
              byte |= ((static_cast<unsigned>(sc[e / seg.width]) >> (e % seg.width)) & 1u) << t;
            }
          }
        }
      }
      out[i] = static_cast<uint8_t>(byte);
    }
    uint16_t* norms = reinterpret_cast<uint16_t*>(a.planes[1]) + dest.row * a.segments;
#pragma unroll
    for (int s = 0; s < kCodebookMaxSegments; ++s) {
      if (s < a.segments && s % kLanes == r) norms[s] = corrected[s];
    }
  }
  __syncwarp();  // the scratch is free for the slice's next row
}

// Everything after the rotation for one row per slice: range check, the optional rotated /
// tau outputs, clip, quantize, pack and the stores. v is the rotated row in pair-strided order
// held by logical slice lane rho. Rows with dest.row < 0 (not written) go through the
// arithmetic with the rest of the warp, whose shuffles need every lane, but store nothing.
// kRowOutputs: whether the optional rotated / tau outputs may be asked for (flat rows only).
// BITS = 8 is the fp8_e4m3 format (G = D): code = e4m3(v / s^), s^ = fp8_scale, one byte per
// value at the value's column (spec/numerics.md §9; the quantize_fp8 stage's arithmetic).
template <int D, int G, int BITS, bool kRowOutputs = true>
__device__ __forceinline__ void WriteRotatedRow(const FusedWriteArgs& a, float (&v)[16], int rho,
                                                int clip_rank, float fp8_scale,
                                                const RowDestination& dest) {
  const bool leader = detail::SliceLane<D>() == 0;
  const bool stored = dest.row >= 0;
  const detail::GroupRanges<D, G> ranges = detail::ComputeGroupRanges<D, G>(v);
  if (stored && ranges.OutOfRange(kMaxRotatedAbs)) {
    RaiseFlag(a.error_flags, kErrorFlagNonFinite, leader);
  }
  if (kRowOutputs && a.rotated != nullptr && dest.flat_row >= 0) {
    float* out = a.rotated + dest.flat_row * D;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      *reinterpret_cast<float2*>(out + detail::RowPosition<D>(2 * s, rho)) =
          make_float2(v[2 * s], v[2 * s + 1]);
    }
  }
  const uint32_t max_bits = ranges.MaxMagnitudeBits();
  const uint32_t tau_bits = detail::ClipThresholdBits<D>(v, clip_rank, max_bits);
  const float tau = __uint_as_float(tau_bits);
  // tau = max |v| (rho = 1, or the rank of the maximum) changes no value: skip the clip.
  const bool clipped = __any_sync(kFullMask, tau_bits != max_bits);
  if (clipped) {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = detail::ClipValue(v[k], tau);
  }
  if (kRowOutputs && a.tau != nullptr && dest.flat_row >= 0 && leader) a.tau[dest.flat_row] = tau;
  if constexpr (BITS == kCodebookWrite) {
    WriteCodebookRow<D>(a, v, rho, dest);
    return;
  } else if constexpr (BITS == 8) {
    if (stored) {
      uint8_t* out = a.planes[kFp8CodesPlane] + dest.row * D;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t lo = E4m3FromF32(__fdiv_rn(v[2 * k], fp8_scale));
        const uint32_t hi = E4m3FromF32(__fdiv_rn(v[2 * k + 1], fp8_scale));
        *reinterpret_cast<uint16_t*>(out + detail::RowPosition<D>(2 * k, rho)) =
            static_cast<uint16_t>(lo | (hi << 8));
      }
    }
    return;
  } else {
  detail::QuantizedSlice<D, G> q;
  detail::QuantizeSlice<D, G, BITS>(v, ranges, clipped ? tau : -1.0f, q);
  if (stored) {
    detail::StorePackedSlice<D, BITS>(detail::PackCodes<BITS>(q.code), rho,
                                      a.planes[kAffineCodesPlane] + dest.row * (D * BITS / 8));
    detail::StoreMetadata<D, G>(
        q, reinterpret_cast<uint16_t*>(a.planes[kAffineScalePlane]) + dest.row * (D / G),
        reinterpret_cast<uint16_t*>(a.planes[kAffineMinPlane]) + dest.row * (D / G));
  }
  }
}

template <int D, int G, int BITS>
__global__ void __launch_bounds__(kThreads, 4)
    FusedWriteTileKernel(const __grid_constant__ FusedWriteArgs args) {
  using Tile = TileTraits<D>;
  extern __shared__ float4 shared_words[];
  // Shared memory: tile (fp32) | staging (bf16 chunks) | R (dense).
  float* tile = reinterpret_cast<float*>(shared_words);
  uint4* staging = reinterpret_cast<uint4*>(tile + Tile::kTileFloats);
  float* shared_r = tile + Tile::kTileFloats + Tile::kStagingBytes / sizeof(float);
  launch::LaunchDependents();  // the next write (FusedWriteArgs::overlap_previous) may start
  const int head = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if constexpr (BITS == kCodebookWrite) {
    PrepareCodebookBlock<D>(args, head);
    __syncthreads();
  }
  const bool dense = args.rotation.kind == kRotationDense;
  const float* r = dense ? args.rotation.matrices + static_cast<int64_t>(head) * D * D : nullptr;
  const float rho = args.clip_per_head != nullptr ? args.clip_per_head[head] : args.clip;
  const int clip_rank = detail::ClipRank(rho, D);
  const float fp8_scale =
      BITS == 8 && args.scale_per_head != nullptr ? args.scale_per_head[head] : args.head_scale;
  // bf16 tiles are prefetched (cp.async) while the previous one is processed. A macro, not a
  // local or a lambda: args lives in the constant bank, so re-reading the field costs no
  // register (both alternatives cost the d = 128 kernels a 4-byte spill under the 64-register
  // bound, ptxas -v).
#define KVQ_WRITE_PREFETCH (args.x_is_bf16 && args.rotation.kind == kRotationDense)

  const int num_tiles = (args.num_tokens + Tile::kTileRows - 1) / Tile::kTileRows;
  if (KVQ_WRITE_PREFETCH && static_cast<int>(blockIdx.x) < num_tiles) {
    StageTileAsync<D>(args, staging, static_cast<int>(blockIdx.x) * Tile::kTileRows, head);
    __pipeline_commit();
  }
  if constexpr (Tile::kRResident) {
    if (dense) {
      LoadRotationAsync<D>(shared_r, r);  // waited for with the first tile's rows
      __pipeline_commit();
    }
  }
  for (int tile_index = blockIdx.x; tile_index < num_tiles; tile_index += gridDim.x) {
    const int t0 = tile_index * Tile::kTileRows;
    __syncthreads();  // the previous tile's rows are consumed (and R is in place)
    if (KVQ_WRITE_PREFETCH) {
      __pipeline_wait_prior(0);
      ConvertStagedTile<D>(staging, tile);
      const int next = tile_index + static_cast<int>(gridDim.x);
      if (next < num_tiles) {
        StageTileAsync<D>(args, staging, next * Tile::kTileRows, head);
        __pipeline_commit();
      }
    } else {
      if (dense && Tile::kRResident) __pipeline_wait_prior(0);  // R
      LoadTile<D>(args, tile, t0, head);
    }
    __syncthreads();
    if (dense) {
      const int rows = min(Tile::kTileRows, args.num_tokens - t0);
      if (rows <= FewRows<D>::kMax) {
        RotateFewRowsDense<D>(tile, shared_r, r, rows);
      } else {
        RotateTileDense<D>(tile, shared_r, r);
      }
    }
    // Warp w takes rows w*R .. w*R + R - 1 of the tile, R = rows per warp, one per slice
    // (kWarps * R = kTileRows: one batch per warp and tile).
    constexpr int kRowsPerWarp = detail::SliceTraits<D>::kRowsPerWarp;
    static_assert(kWarps * kRowsPerWarp == Tile::kTileRows, "one slice row per tile row");
    const int rr = warp * kRowsPerWarp + detail::SliceIndex<D>();
    const int t = t0 + rr;
    RowDestination dest;
    if (t < args.num_tokens) {
      dest = ResolveDestination(args, t, head, detail::SliceLane<D>() == 0);
    }
    if (__any_sync(kFullMask, dest.row >= 0)) {
      float v[16];
      const int rho = detail::LoadRow<D>(
          static_cast<const float*>(tile + rr * Tile::kStride), args.rotation.bitrev != 0,
          args.rotation.kind == kRotationHadamard ? args.rotation.fwht_block : 0,
          args.rotation.fwht_scale, v);
      WriteRotatedRow<D, G, BITS>(args, v, rho, clip_rank, fp8_scale, dest);
    }
  }
#undef KVQ_WRITE_PREFETCH
  launch::WaitForPrerequisiteGrid();  // overlap_previous: complete only after the previous kernel
}

// Row `token` of the input (T: uint16_t bf16 bits or float), rotated into v (LoadRow); a token
// without a source row (append without demotion) reads the first row of x instead. Returns rho.
template <int D, WriteMode kMode, typename T>
__device__ __forceinline__ int LoadSourceRow(const FusedWriteArgs& a, int token, int head,
                                             int fwht_block, float (&v)[16]) {
  const T* src = RowSourceIn<kMode, T>(a, token, head, D);
  if (src == nullptr) src = static_cast<const T*>(a.x);
  return detail::LoadRow<D>(src, a.rotation.bitrev != 0, fwht_block, a.rotation.fwht_scale, v);
}

// Identity and FWHT rotations. Warp w of the grid takes batches w, w + W, ... (W = warps in
// the grid's row for this head) of R = 32/(d/16) consecutive tokens, one per slice, and loads
// each row straight into registers (pair-strided or reversal-source order: 32-bit or 16-byte
// loads of whole sectors). No shared memory and no barrier, so a warp whose rows take longer
// (clip rounds, the rare exact divisions) holds up nobody. 4 resident blocks at most.
template <int D, int G, int BITS, WriteMode kMode>
__global__ void __launch_bounds__(kThreads, 4)
    FusedWriteStreamKernel(const __grid_constant__ FusedWriteArgs args) {
  constexpr int kRowsPerWarp = detail::SliceTraits<D>::kRowsPerWarp;
  launch::LaunchDependents();  // the next write (FusedWriteArgs::overlap_previous) may start
  const int head = static_cast<int>(blockIdx.y);
  const float rho = args.clip_per_head != nullptr ? args.clip_per_head[head] : args.clip;
  const int clip_rank = detail::ClipRank(rho, D);
  const float fp8_scale =
      BITS == 8 && args.scale_per_head != nullptr ? args.scale_per_head[head] : args.head_scale;
  const int fwht_block = args.rotation.kind == kRotationHadamard ? args.rotation.fwht_block : 0;
  const bool leader = detail::SliceLane<D>() == 0;
  if constexpr (BITS == kCodebookWrite) {
    PrepareCodebookBlock<D>(args, head);
    __syncthreads();
  }
  const int64_t batches = (static_cast<int64_t>(args.num_tokens) + kRowsPerWarp - 1) / kRowsPerWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t batch = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
       batch < batches; batch += stride) {
    const int t = static_cast<int>(batch * kRowsPerWarp) + detail::SliceIndex<D>();
    RowDestination dest;
    if (t < args.num_tokens) dest = ResolveDestinationIn<kMode>(args, t, head, leader);
    if (!__any_sync(kFullMask, dest.row >= 0)) continue;
    // A row that is not stored reads token 0's row (always there) and computes on it.
    const int source_token = dest.row >= 0 ? t : 0;
    float v[16];
    const int lane_rho =
        args.x_is_bf16
            ? LoadSourceRow<D, kMode, uint16_t>(args, source_token, head, fwht_block, v)
            : LoadSourceRow<D, kMode, float>(args, source_token, head, fwht_block, v);
    WriteRotatedRow<D, G, BITS, kMode == WriteMode::kRows>(args, v, lane_rho, clip_rank,
                                                           fp8_scale, dest);
  }
  launch::WaitForPrerequisiteGrid();  // overlap_previous: complete only after the previous kernel
}

// ---- Launch helpers ----------------------------------------------------------------------------

int CurrentDevice() {
  int device = 0;
  cudaGetDevice(&device);
  return device;
}

constexpr int kMaxDevices = 64;

// Per kernel instantiation and device: raise the dynamic shared memory limit once and remember
// how many blocks fit on the device.
struct LaunchCache {
  std::once_flag once[kMaxDevices];
  cudaError_t status[kMaxDevices] = {};
  int resident_blocks[kMaxDevices] = {};
};

// `shared`: the dynamic shared memory of every launch of `kernel`; *resident_blocks: how many
// blocks of it fit on the device.
template <typename Kernel>
cudaError_t PrepareKernel(LaunchCache& cache, Kernel kernel, size_t shared,
                          int* resident_blocks) {
  const int device = CurrentDevice();
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(cache.once[device], [&] {
    cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    int sms = 0;
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    int per_sm = 0;
    if (status == cudaSuccess) {
      status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared);
    }
    cache.resident_blocks[device] = per_sm * sms;
    cache.status[device] = status;
  });
  *resident_blocks = cache.resident_blocks[device];
  return cache.status[device];
}

}  // namespace

// ---- Layer (b) ---------------------------------------------------------------------------------

template <int HEAD_DIM, int GROUP, int BITS>
cudaError_t LaunchFusedWrite(const FusedWriteArgs& args, cudaStream_t stream) {
  static_assert(GROUP <= HEAD_DIM, "group must not exceed head_dim");
  using Tile = TileTraits<HEAD_DIM>;
  if (args.num_tokens < 0 || args.num_heads < 1 || args.num_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0) return cudaSuccess;
  // Unsupported rotation, FWHT block or page size: refuse, never skip silently.
  const RotationArgs& rotation = args.rotation;
  if (rotation.kind != kRotationIdentity && rotation.kind != kRotationDense &&
      rotation.kind != kRotationHadamard) {
    return cudaErrorInvalidValue;
  }
  if (rotation.kind == kRotationDense && rotation.matrices == nullptr) return cudaErrorInvalidValue;
  if (rotation.kind == kRotationHadamard &&
      (!IsPowerOfTwo(rotation.fwht_block) || rotation.fwht_block < 16 ||
       rotation.fwht_block > HEAD_DIM)) {
    return cudaErrorInvalidValue;
  }
  if (args.mode != WriteMode::kRows && args.mode != WriteMode::kPrefill &&
      args.mode != WriteMode::kAppend && args.mode != WriteMode::kFlush) {
    return cudaErrorInvalidValue;
  }
  if (args.mode != WriteMode::kRows && (args.page_size_log2 < 4 || args.page_size_log2 > 10)) {
    return cudaErrorInvalidValue;
  }
  if (args.mode == WriteMode::kAppend && (args.seq_lengths == nullptr || args.recent < 1)) {
    return cudaErrorInvalidValue;
  }
  if (args.mode == WriteMode::kFlush &&
      (args.seq_lengths == nullptr || args.flush < 1 || args.recent < 0 || args.sink < 0 ||
       args.ring_slots != args.recent + args.flush - 1 ||
       (args.recent == 0 && (args.new_rows == nullptr ||
                             reinterpret_cast<uintptr_t>(args.new_rows) % 16 != 0)))) {
    return cudaErrorInvalidValue;
  }
  // 16-byte vector loads of the rows.
  const int64_t vector_elems = args.x_is_bf16 ? 8 : 4;
  if (args.x == nullptr || reinterpret_cast<uintptr_t>(args.x) % 16 != 0 ||
      args.token_stride % vector_elems != 0 || args.seq_stride % vector_elems != 0 ||
      args.planes[kAffineCodesPlane] == nullptr ||
      (BITS != 8 && BITS != kCodebookWrite &&
       (args.planes[kAffineScalePlane] == nullptr || args.planes[kAffineMinPlane] == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (BITS == kCodebookWrite &&
      (args.planes[kCodebookNormPlane] == nullptr || args.codebook == nullptr ||
       args.segments < 1 || args.segments > kCodebookMaxSegments || args.code_bytes < 1 ||
       args.code_bytes > HEAD_DIM || (args.widths == nullptr && (args.bits < 1 || args.bits > 8)))) {
    return cudaErrorInvalidValue;
  }
  if (BITS == 8 && !(args.head_scale > 0.0f)) return cudaErrorInvalidValue;

  const int64_t tiles = (static_cast<int64_t>(args.num_tokens) + Tile::kTileRows - 1) /
                        Tile::kTileRows;
  if (rotation.kind != kRotationDense) {
    auto kernel = FusedWriteStreamKernel<HEAD_DIM, GROUP, BITS, WriteMode::kRows>;
    if (args.mode == WriteMode::kPrefill) {
      kernel = FusedWriteStreamKernel<HEAD_DIM, GROUP, BITS, WriteMode::kPrefill>;
    } else if (args.mode == WriteMode::kAppend) {
      kernel = FusedWriteStreamKernel<HEAD_DIM, GROUP, BITS, WriteMode::kAppend>;
    } else if (args.mode == WriteMode::kFlush) {
      kernel = FusedWriteStreamKernel<HEAD_DIM, GROUP, BITS, WriteMode::kFlush>;
    }
    static LaunchCache caches[4];
    LaunchCache& cache = caches[static_cast<int>(args.mode)];
    int resident = 0;
    const cudaError_t prepared = PrepareKernel(cache, kernel, 0, &resident);
    if (prepared != cudaSuccess) return prepared;
    // Persistent: at most the resident warps, shared among the heads.
    const int64_t warps_needed =
        (args.num_tokens + detail::SliceTraits<HEAD_DIM>::kRowsPerWarp - 1) /
        detail::SliceTraits<HEAD_DIM>::kRowsPerWarp;
    const int64_t per_head = std::max<int64_t>(1, resident / args.num_heads);
    const int64_t blocks_x = std::min((warps_needed + kWarps - 1) / kWarps, per_head);
    const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(args.num_heads));
    return launch::LaunchKernel(kernel, grid, dim3(kThreads), 0, stream, args.overlap_previous,
                                args);
  }

  // The dense rotation: the tile kernel.
  auto kernel = FusedWriteTileKernel<HEAD_DIM, GROUP, BITS>;
  static LaunchCache cache;
  const size_t shared = Tile::kTileBytes + Tile::kStagingBytes + Tile::kRBytes;
  int resident = 0;
  const cudaError_t prepared = PrepareKernel(cache, kernel, shared, &resident);
  if (prepared != cudaSuccess) return prepared;

  int64_t blocks_x = tiles;
  if (Tile::kRResident || args.x_is_bf16) {
    // Persistent over tiles: R is loaded once per block, and bf16 tiles are prefetched while
    // the block works on the previous one, so keep the grid to what is resident.
    const int64_t per_head = std::max<int64_t>(1, resident / args.num_heads);
    blocks_x = std::min(tiles, per_head);
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_x, INT32_MAX)),
                  static_cast<unsigned>(args.num_heads));
  return launch::LaunchKernel(kernel, grid, dim3(kThreads), shared, stream, args.overlap_previous,
                              args);
}

namespace {
// Templates, so that `if constexpr` discards the group > head_dim combinations.
template <int D, int G, int B>
cudaError_t LaunchFusedWriteIfValid(const FusedWriteArgs& args, cudaStream_t stream) {
  if constexpr (G <= D) {
    return LaunchFusedWrite<D, G, B>(args, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}
}  // namespace

cudaError_t DispatchFusedWrite(int head_dim, int group, int bits, const FusedWriteArgs& args,
                               cudaStream_t stream) {
  KVQ_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, {
    KVQ_DISPATCH_GROUP(group, GROUP, {
      KVQ_DISPATCH_BITS(bits, BITS, {
        return LaunchFusedWriteIfValid<HEAD_DIM, GROUP, BITS>(args, stream);
      })
    })
  })
}

// The instantiations the Dispatch functions reach, for callers of layer (b) in other files.
#define KVQ_INSTANTIATE_FUSED(D, G, B) \
  template cudaError_t LaunchFusedWrite<D, G, B>(const FusedWriteArgs&, cudaStream_t);
#define KVQ_INSTANTIATE_FUSED_BITS(D, G) KVQ_INSTANTIATE_FUSED(D, G, 2) KVQ_INSTANTIATE_FUSED(D, G, 4)
KVQ_INSTANTIATE_FUSED_BITS(64, 32)
KVQ_INSTANTIATE_FUSED_BITS(64, 64)
KVQ_INSTANTIATE_FUSED_BITS(128, 32)
KVQ_INSTANTIATE_FUSED_BITS(128, 64)
KVQ_INSTANTIATE_FUSED_BITS(128, 128)
KVQ_INSTANTIATE_FUSED_BITS(256, 32)
KVQ_INSTANTIATE_FUSED_BITS(256, 64)
KVQ_INSTANTIATE_FUSED_BITS(256, 128)
KVQ_INSTANTIATE_FUSED_BITS(256, 256)  // G = d (SAW-INT4, spec 1.1)
KVQ_INSTANTIATE_FUSED(64, 64, 8)      // fp8_e4m3 (spec 1.2)
KVQ_INSTANTIATE_FUSED(128, 128, 8)
KVQ_INSTANTIATE_FUSED(256, 256, 8)
KVQ_INSTANTIATE_FUSED(64, 64, kCodebookWrite)  // codebook (spec 1.3)
KVQ_INSTANTIATE_FUSED(128, 128, kCodebookWrite)
KVQ_INSTANTIATE_FUSED(256, 256, kCodebookWrite)

cudaError_t DispatchFp8Write(int head_dim, const FusedWriteArgs& args, cudaStream_t stream) {
  KVQ_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, {
    return LaunchFusedWrite<HEAD_DIM, HEAD_DIM, 8>(args, stream);
  })
}

// The rows of KVQ_GPU_WRITE_FORMATS these kernels serve: affine_token (G of 32, 64, 128
// channels or G = d) and fp8_e4m3.
void CheckWriteAffineToken(const WriteParams& p, const char* what) {
  KVQ_CHECK(IsSupportedGroup(p.group, p.head_dim), kUnsupported, what, ": group ", p.group,
            " has no CUDA fused write (32, 64 or 128 channels, or G = d)");
}
cudaError_t WriteAffineToken(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream) {
  return DispatchFusedWrite(p.head_dim, p.group, p.bits, a, stream);
}
void CheckWriteFp8E4m3(const WriteParams& /*p*/, const char* /*what*/) {}
cudaError_t WriteFp8E4m3(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream) {
  return DispatchFp8Write(p.head_dim, a, stream);
}

cudaError_t DispatchCodebookWrite(int head_dim, const FusedWriteArgs& args, cudaStream_t stream) {
  KVQ_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, {
    return LaunchFusedWrite<HEAD_DIM, HEAD_DIM, kCodebookWrite>(args, stream);
  })
}
// codebook (spec 1.3): every width, density and segment layout the format allows.
void CheckWriteCodebook(const WriteParams& /*p*/, const char* /*what*/) {}
// The density's tables are fetched here, at launch (the first launch on a device uploads them),
// so that validating a configuration (no rows) never touches the device.
cudaError_t WriteCodebook(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream) {
  FusedWriteArgs args = a;
  args.codebook = DeviceCodebookTables(p.codebook);
  return DispatchCodebookWrite(p.head_dim, args, stream);
}

}  // namespace kvq::gpu