// CUDA kernels of the write path (layer a) and their launchers (layer b); see write.h.
//
// The fused kernel works on tiles of rows of one KV head (blockIdx.y). A tile is staged in
// shared memory as fp32 (16-byte loads, bf16 widened exactly; bf16 input is double-buffered:
// the next tile's raw rows arrive by cp.async while the block works on the current one, over
// a persistent grid); a dense rotation multiplies the tile by R (also in shared memory, loaded
// once per block when it fits, streamed in chunks of rows of R for d = 256) with each thread
// accumulating 4 channels x 4 rows in i order; then each warp takes whole rows and runs FWHT /
// bit reversal / clip / quantize / pack in registers (write_row.cuh) and stores codes and bf16
// (scale, min) to flat rows or cache pages.
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/gpu/write.h"
#include "write_row.cuh"
#include "write_row_baseline.cuh"

namespace kvq::gpu {
namespace {

using detail::kFullMask;
using detail::LaneId;

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
  static constexpr int kStride = D + 4;  // padded row: the two row groups of a warp at d = 64
                                         // read different banks
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

// ---- Row addressing of the three modes --------------------------------------------------------

// Source of row (t, head), or null when the row is not written (append without demotion, bad
// length). Elements, not bytes.
template <typename T>
__device__ __forceinline__ const T* RowSource(const FusedWriteArgs& a, int t, int head, int d) {
  const T* x = static_cast<const T*>(a.x);
  switch (a.mode) {
    case WriteMode::kRows:
      return x + static_cast<int64_t>(t) * a.token_stride + static_cast<int64_t>(head) * d;
    case WriteMode::kPrefill:
      return x + (a.first_token + t) * a.token_stride + static_cast<int64_t>(head) * d;
    case WriteMode::kAppend: {
      const int len = a.seq_lengths[t];
      if (len < 0 || len - a.recent < a.sink) return nullptr;
      return x + static_cast<int64_t>(t) * a.seq_stride +
             static_cast<int64_t>(len % a.recent) * a.token_stride +
             static_cast<int64_t>(head) * d;
    }
  }
  return nullptr;
}

struct RowDestination {
  int64_t row = -1;  // row index into codes [.., d*b/8] and scale/min [.., d/G]; -1: skip
  int64_t flat_row = -1;  // kRows: index for the optional rotated / tau outputs
};

__device__ __forceinline__ void RaiseFlag(int* flags, int bit) {
  if (flags != nullptr && LaneId() == 0) atomicOr(flags, bit);
}

// Where row (t, head) is stored; uniform across the warp.
__device__ __forceinline__ RowDestination ResolveDestination(const FusedWriteArgs& a, int t,
                                                             int head) {
  RowDestination dest;
  if (a.mode == WriteMode::kRows) {
    dest.row = static_cast<int64_t>(t) * a.num_heads + head;
    dest.flat_row = dest.row;
    return dest;
  }
  int64_t history_index;
  const int32_t* table;
  int64_t table_size;
  if (a.mode == WriteMode::kPrefill) {
    history_index = t;
    table = a.page_table;
    table_size = INT64_MAX;  // the caller sized it ceil(history / P)
  } else {
    const int len = a.seq_lengths[t];
    if (len < 0) {
      RaiseFlag(a.error_flags, kErrorFlagBadLength);
      return dest;
    }
    if (len - a.recent < a.sink) return dest;  // nothing to demote in this step
    history_index = static_cast<int64_t>(len) - a.recent - a.sink;
    table = a.page_table + static_cast<int64_t>(t) * a.page_table_stride;
    table_size = a.page_table_stride;
  }
  const int64_t page_index = history_index >> a.page_size_log2;
  if (page_index >= table_size) {
    RaiseFlag(a.error_flags, kErrorFlagBadPage);
    return dest;
  }
  const int32_t page = table[page_index];
  if (page < 0 || page >= a.num_pages) {
    RaiseFlag(a.error_flags, kErrorFlagBadPage);
    return dest;
  }
  const int64_t slot = history_index & ((int64_t{1} << a.page_size_log2) - 1);
  dest.row = ((static_cast<int64_t>(page) * a.num_heads + head) << a.page_size_log2) + slot;
  return dest;
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

__device__ __forceinline__ float Component(const float4& v, int c) {
  return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w));
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

// One staged row (already rotated when dense) through FWHT / P_br / clip / quantize / pack.
// kBaseline: the row functions as they were before the 2026-11-21 speed-up (benchmark only).
template <int D, int G, int BITS, bool kBaseline>
__device__ __forceinline__ void WriteRow(const FusedWriteArgs& a, float* row, int clip_rank,
                                         const RowDestination& dest) {
  constexpr int kPer = D / 32;
  const int lane = LaneId();
  float v[kPer];
  if (a.rotation == kRotationHadamard) {
#pragma unroll
    for (int s = 0; s < kPer; ++s) v[s] = row[lane + 32 * s];
    if constexpr (kBaseline) {
      detail::baseline::FwhtRow<D>(v, a.fwht_block, a.fwht_scale);
    } else {
      detail::FwhtRow<D>(v, a.fwht_block, a.fwht_scale);
    }
    if (a.bitrev) {
#pragma unroll
      for (int s = 0; s < kPer; ++s) row[lane + 32 * s] = v[s];
      __syncwarp();
#pragma unroll
      for (int s = 0; s < kPer; ++s) v[s] = row[detail::BitReverse<D>(lane + 32 * s)];
    }
  } else if (a.bitrev) {
#pragma unroll
    for (int s = 0; s < kPer; ++s) v[s] = row[detail::BitReverse<D>(lane + 32 * s)];
  } else {
#pragma unroll
    for (int s = 0; s < kPer; ++s) v[s] = row[lane + 32 * s];
  }

  // |x| > 2^126, Inf or NaN anywhere in the row <=> the largest magnitude's bits exceed those
  // of 2^126 (unsigned order of non-negative floats; NaN and Inf rank above). The maximum is
  // also tau when rho = 1.
  const uint32_t max_bits = detail::MaxMagnitudeBits<D>(v);
  if constexpr (kBaseline) {
    bool out_of_range = false;
#pragma unroll
    for (int s = 0; s < kPer; ++s) out_of_range |= !(fabsf(v[s]) <= kMaxRotatedAbs);
    if (__any_sync(kFullMask, out_of_range)) RaiseFlag(a.error_flags, kErrorFlagNonFinite);
  } else {
    if (max_bits > __float_as_uint(kMaxRotatedAbs)) RaiseFlag(a.error_flags, kErrorFlagNonFinite);
  }

  if (a.rotated != nullptr && dest.flat_row >= 0) {
    float* out = a.rotated + dest.flat_row * D;
#pragma unroll
    for (int s = 0; s < kPer; ++s) out[lane + 32 * s] = v[s];
  }
  if constexpr (kBaseline) {
    const float tau = detail::baseline::ClipRow<D>(v, clip_rank);
    if (a.tau != nullptr && dest.flat_row >= 0 && lane == 0) a.tau[dest.flat_row] = tau;
    detail::baseline::QuantizedRow<D, G> q;
    detail::baseline::QuantizeRow<D, G, BITS>(v, q);
    detail::baseline::StorePackedRow<D, BITS>(q.code, a.codes + dest.row * (D * BITS / 8));
    detail::baseline::StoreMetadata<D, G>(q, a.scale + dest.row * (D / G),
                                          a.min + dest.row * (D / G));
  } else {
    const float tau = detail::ClipRow<D>(v, clip_rank, max_bits);
    if (a.tau != nullptr && dest.flat_row >= 0 && lane == 0) a.tau[dest.flat_row] = tau;
    detail::QuantizedRow<D, G> q;
    detail::QuantizeRow<D, G, BITS>(v, q);
    detail::StorePackedRow<D, BITS>(q.code, a.codes + dest.row * (D * BITS / 8));
    detail::StoreMetadata<D, G>(q, a.scale + dest.row * (D / G), a.min + dest.row * (D / G));
  }
}

// 4 resident blocks (64 registers, no spills: ptxas -v) so that the non-dense paths keep 50 %
// occupancy whatever the instantiation needs.
template <int D, int G, int BITS, bool kBaseline>
__global__ void __launch_bounds__(kThreads, 4)
    FusedWriteKernel(const __grid_constant__ FusedWriteArgs args) {
  using Tile = TileTraits<D>;
  extern __shared__ float4 shared_words[];
  // Shared memory: tile (fp32) | staging (bf16 chunks; unused by the baseline) | R (dense).
  float* tile = reinterpret_cast<float*>(shared_words);
  uint4* staging = reinterpret_cast<uint4*>(tile + Tile::kTileFloats);
  float* shared_r = tile + Tile::kTileFloats + Tile::kStagingBytes / sizeof(float);
  const int head = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const bool dense = args.rotation == kRotationDense;
  const float* r = dense ? args.rotations + static_cast<int64_t>(head) * D * D : nullptr;
  const float rho = args.clip_per_head != nullptr ? args.clip_per_head[head] : args.clip;
  const int clip_rank = detail::ClipRank(rho, D);
  // bf16 tiles are prefetched (cp.async) while the previous one is processed. A macro, not a
  // local or a lambda: args lives in the constant bank, so re-reading the field costs no
  // register (both alternatives cost the d = 128 kernels a 4-byte spill under the 64-register
  // bound, ptxas -v).
#define KVQ_WRITE_PREFETCH (!kBaseline && args.x_is_bf16 && args.rotation == kRotationDense)

  const int num_tiles = (args.num_tokens + Tile::kTileRows - 1) / Tile::kTileRows;
  if (KVQ_WRITE_PREFETCH && static_cast<int>(blockIdx.x) < num_tiles) {
    StageTileAsync<D>(args, staging, static_cast<int>(blockIdx.x) * Tile::kTileRows, head);
    __pipeline_commit();
  }
  if (dense && Tile::kRResident) LoadRotationChunk<D>(shared_r, r, 0);
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
      LoadTile<D>(args, tile, t0, head);
    }
    __syncthreads();
    if (args.rotation == kRotationDense) RotateTileDense<D>(tile, shared_r, r);
    for (int rr = warp; rr < Tile::kTileRows; rr += kWarps) {
      const int t = t0 + rr;
      if (t >= args.num_tokens) break;
      const RowDestination dest = ResolveDestination(args, t, head);
      if (dest.row < 0) continue;
      WriteRow<D, G, BITS, kBaseline>(args, tile + rr * Tile::kStride, clip_rank, dest);
    }
  }
#undef KVQ_WRITE_PREFETCH
}

// ---- Stage kernels (the CUDA side of cpu::WriteKernels) ----------------------------------------

// Thread per output element: acc over i ascending from global memory. Deliberately the plain
// loop: the fused kernel's tiled product is checked against the same oracle separately.
__global__ void RotateDenseKernel(const __grid_constant__ StageArgs a) {
  const int64_t d = a.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t row = idx / d;
  const int64_t j = idx % d;
  const float* x = a.x + row * d;
  float acc = +0.0f;
  for (int64_t i = 0; i < d; ++i) acc = __fadd_rn(acc, __fmul_rn(x[i], a.r[i * d + j]));
  a.y[idx] = acc;
}

__global__ void BitrevKernel(const __grid_constant__ StageArgs a) {
  const int64_t d = a.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int log2_d = d == 64 ? 6 : (d == 128 ? 7 : 8);
  const int64_t row = idx / d;
  const int j = static_cast<int>(idx % d);
  const int source = static_cast<int>(__brev(static_cast<unsigned>(j)) >> (32 - log2_d));
  a.y[idx] = a.x[row * d + source];
}

// Warp per row kernels: row = global warp index.
__device__ __forceinline__ int64_t WarpRow() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

template <int D>
__global__ void FwhtKernel(const __grid_constant__ StageArgs a) {
  const int64_t row = WarpRow();
  if (row >= a.rows) return;  // uniform per warp
  float* x = a.y + row * D;
  float v[D / 32];
#pragma unroll
  for (int s = 0; s < D / 32; ++s) v[s] = x[LaneId() + 32 * s];
  detail::FwhtRow<D>(v, a.fwht_block, a.fwht_scale);
#pragma unroll
  for (int s = 0; s < D / 32; ++s) x[LaneId() + 32 * s] = v[s];
}

template <int D>
__global__ void ClipKernel(const __grid_constant__ StageArgs a) {
  const int64_t row = WarpRow();
  if (row >= a.rows) return;
  float* x = a.y + row * D;
  float v[D / 32];
#pragma unroll
  for (int s = 0; s < D / 32; ++s) v[s] = x[LaneId() + 32 * s];
  const float tau = detail::ClipRow<D>(v, detail::ClipRank(a.clip, D));
#pragma unroll
  for (int s = 0; s < D / 32; ++s) x[LaneId() + 32 * s] = v[s];
  if (LaneId() == 0) a.tau[row] = tau;
}

template <int D, int G, int BITS>
__global__ void QuantizeKernel(const __grid_constant__ StageArgs a) {
  const int64_t row = WarpRow();
  if (row >= a.rows) return;
  const float* x = a.x + row * D;
  float v[D / 32];
#pragma unroll
  for (int s = 0; s < D / 32; ++s) v[s] = x[LaneId() + 32 * s];
  detail::QuantizedRow<D, G> q;
  detail::QuantizeRow<D, G, BITS>(v, q);
#pragma unroll
  for (int s = 0; s < D / 32; ++s) {
    a.codes[row * D + LaneId() + 32 * s] = static_cast<uint8_t>(q.code[s]);
  }
  detail::StoreMetadata<D, G>(q, a.scale + row * (D / G), a.min + row * (D / G));
}

// Thread per packed byte: the loop of the spec, independent of the fused kernel's lane packing.
__global__ void PackKernel(const __grid_constant__ StageArgs a) {
  const int64_t bytes_per_row = a.head_dim * a.bits / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * bytes_per_row) return;
  const int64_t row = idx / bytes_per_row;
  const int64_t i = idx % bytes_per_row;
  const uint8_t* codes = a.codes_in + row * a.head_dim;
  unsigned byte = 0;
  for (int part = 0; part < 8 / a.bits; ++part) {
    byte |= static_cast<unsigned>(codes[part * bytes_per_row + i]) << (part * a.bits);
  }
  a.packed[idx] = static_cast<uint8_t>(byte);
}

__global__ void UnpackKernel(const __grid_constant__ StageArgs a) {
  const int64_t d = a.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t bytes_per_row = d * a.bits / 8;
  const int64_t row = idx / d;
  const int64_t c = idx % d;
  const int64_t part = c / bytes_per_row;
  const int64_t i = c % bytes_per_row;
  const unsigned byte = a.packed_in[row * bytes_per_row + i];
  a.codes[idx] = static_cast<uint8_t>((byte >> (part * a.bits)) & ((1u << a.bits) - 1u));
}

__global__ void DequantizeKernel(const __grid_constant__ StageArgs a) {
  const int64_t d = a.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t groups = d / a.group;
  const int64_t row = idx / d;
  const int64_t g = row * groups + (idx % d) / a.group;
  const float sf = F32FromBf16(a.scale_in[g]);
  const float mf = F32FromBf16(a.min_in[g]);
  a.y[idx] = __fadd_rn(__fmul_rn(static_cast<float>(a.codes_in[idx]), sf), mf);
}

// Thread per 16 bytes of a new token row: into the sink (position < S0) or the ring.
__global__ void AppendCopyKernel(const __grid_constant__ AppendCopyArgs a) {
  const int vectors_per_row = a.head_dim / 8;
  const int64_t per_kv = static_cast<int64_t>(a.batch) * a.num_heads * vectors_per_row;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= 2 * per_kv) return;
  const bool is_value = idx >= per_kv;
  const int64_t rest = is_value ? idx - per_kv : idx;
  const int vec = static_cast<int>(rest % vectors_per_row);
  const int64_t row = rest / vectors_per_row;  // b * Hkv + h
  const int b = static_cast<int>(row / a.num_heads);
  const int h = static_cast<int>(row % a.num_heads);
  const int len = a.seq_lengths[b];
  if (len < 0) {
    if (a.error_flags != nullptr) atomicOr(a.error_flags, kErrorFlagBadLength);
    return;
  }
  const int64_t row_elems = static_cast<int64_t>(a.num_heads) * a.head_dim;
  uint16_t* dst;
  if (len < a.sink) {
    uint16_t* sink = is_value ? a.sink_value : a.sink_key;
    dst = sink + (static_cast<int64_t>(b) * a.sink + len) * row_elems;
  } else {
    uint16_t* ring = is_value ? a.recent_value : a.recent_key;
    dst = ring + (static_cast<int64_t>(b) * a.recent + len % a.recent) * row_elems;
  }
  const uint16_t* src = (is_value ? a.value : a.key) + row * a.head_dim;
  reinterpret_cast<uint4*>(dst + static_cast<int64_t>(h) * a.head_dim)[vec] =
      __ldg(reinterpret_cast<const uint4*>(src) + vec);
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
  int resident_blocks[kMaxDevices][2] = {};  // with [0] the light, [1] the full shared memory
};

// shared[0], shared[1]: the two dynamic shared memory sizes a launch may ask for (the larger is
// the limit); *resident_blocks: how many blocks of size shared[which] fit on the device.
template <typename Kernel>
cudaError_t PrepareKernel(LaunchCache& cache, Kernel kernel, const size_t (&shared)[2], int which,
                          int* resident_blocks) {
  const int device = CurrentDevice();
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(cache.once[device], [&] {
    cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared[1]));
    int sms = 0;
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    for (int k = 0; k < 2 && status == cudaSuccess; ++k) {
      int per_sm = 0;
      status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                            shared[k]);
      cache.resident_blocks[device][k] = per_sm * sms;
    }
    cache.status[device] = status;
  });
  *resident_blocks = cache.resident_blocks[device][which];
  return cache.status[device];
}

bool IsPowerOfTwo(int v) { return v > 0 && (v & (v - 1)) == 0; }

int64_t Blocks(int64_t threads, int block) { return (threads + block - 1) / block; }

constexpr int kStageBlock = 256;

}  // namespace

// ---- Benchmark-only switch -------------------------------------------------------------------

namespace {
bool g_use_baseline_fused_write = false;
}  // namespace

namespace benchmark_only {
// Selects the fused kernel as it was before the 2026-11-21 speed-up for (d 128, G 64, INT2), so
// that kvq_bench_gpu_write times old and new in one device run. Not thread safe; declared by the
// benchmark itself, not in write.h. Remove with write_row_baseline.cuh.
void UseBaselineFusedWrite(bool use) { g_use_baseline_fused_write = use; }
}  // namespace benchmark_only

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
  if (args.rotation != kRotationIdentity && args.rotation != kRotationDense &&
      args.rotation != kRotationHadamard) {
    return cudaErrorInvalidValue;
  }
  if (args.rotation == kRotationDense && args.rotations == nullptr) return cudaErrorInvalidValue;
  if (args.rotation == kRotationHadamard &&
      (!IsPowerOfTwo(args.fwht_block) || args.fwht_block < 16 || args.fwht_block > HEAD_DIM)) {
    return cudaErrorInvalidValue;
  }
  if (args.mode != WriteMode::kRows && (args.page_size_log2 < 4 || args.page_size_log2 > 10)) {
    return cudaErrorInvalidValue;
  }
  if (args.mode == WriteMode::kAppend && (args.seq_lengths == nullptr || args.recent < 1)) {
    return cudaErrorInvalidValue;
  }
  // 16-byte vector loads of the rows.
  const int64_t vector_elems = args.x_is_bf16 ? 8 : 4;
  if (args.x == nullptr || reinterpret_cast<uintptr_t>(args.x) % 16 != 0 ||
      args.token_stride % vector_elems != 0 || args.seq_stride % vector_elems != 0 ||
      args.codes == nullptr || args.scale == nullptr || args.min == nullptr) {
    return cudaErrorInvalidValue;
  }

  // The pre-speed-up kernel exists for the benchmark's configuration only (d 128, G 64, INT2).
  constexpr bool kHasBaseline = HEAD_DIM == 128 && GROUP == 64 && BITS == 2;
  const bool baseline = kHasBaseline && g_use_baseline_fused_write;
  auto kernel = FusedWriteKernel<HEAD_DIM, GROUP, BITS, false>;
  if constexpr (kHasBaseline) {
    if (baseline) kernel = FusedWriteKernel<HEAD_DIM, GROUP, BITS, true>;
  }
  static LaunchCache caches[2];
  LaunchCache& cache = caches[baseline ? 1 : 0];
  const bool dense = args.rotation == kRotationDense;
  const size_t shared_sizes[2] = {Tile::kTileBytes + Tile::kStagingBytes,
                                  Tile::kTileBytes + Tile::kStagingBytes + Tile::kRBytes};
  const size_t shared = shared_sizes[dense ? 1 : 0];
  int resident = 0;
  const cudaError_t prepared = PrepareKernel(cache, kernel, shared_sizes, dense ? 1 : 0,
                                             &resident);
  if (prepared != cudaSuccess) return prepared;

  const int64_t tiles = (static_cast<int64_t>(args.num_tokens) + Tile::kTileRows - 1) /
                        Tile::kTileRows;
  int64_t blocks_x = tiles;
  if (dense && (Tile::kRResident || (!baseline && args.x_is_bf16))) {
    // Persistent over tiles: R is loaded once per block, and bf16 tiles are prefetched while
    // the block works on the previous one, so keep the grid to what is resident.
    const int64_t per_head = std::max<int64_t>(1, resident / args.num_heads);
    blocks_x = std::min(tiles, per_head);
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_x, INT32_MAX)),
                  static_cast<unsigned>(args.num_heads));
  kernel<<<grid, kThreads, shared, stream>>>(args);
  return cudaGetLastError();
}

// KVQ_DISPATCH_*: map a runtime value onto a constexpr one; anything else returns
// cudaErrorInvalidValue from the enclosing function.
#define KVQ_DISPATCH_HEAD_DIM(value, NAME, ...)    \
  switch (value) {                                 \
    case 64: { constexpr int NAME = 64; __VA_ARGS__ }   \
    case 128: { constexpr int NAME = 128; __VA_ARGS__ } \
    case 256: { constexpr int NAME = 256; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }
#define KVQ_DISPATCH_GROUP(value, NAME, ...)       \
  switch (value) {                                 \
    case 32: { constexpr int NAME = 32; __VA_ARGS__ }   \
    case 64: { constexpr int NAME = 64; __VA_ARGS__ }   \
    case 128: { constexpr int NAME = 128; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }
#define KVQ_DISPATCH_BITS(value, NAME, ...)        \
  switch (value) {                                 \
    case 2: { constexpr int NAME = 2; __VA_ARGS__ } \
    case 4: { constexpr int NAME = 4; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
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
template <int D, int G, int B>
cudaError_t LaunchQuantizeIfValid(const StageArgs& a, int64_t blocks, cudaStream_t stream) {
  if constexpr (G <= D) {
    QuantizeKernel<D, G, B><<<blocks, kStageBlock, 0, stream>>>(a);
    return cudaGetLastError();
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

const char* StageName(Stage stage) {
  switch (stage) {
    case Stage::kRotateDense: return "rotate_dense";
    case Stage::kFwht: return "fwht";
    case Stage::kBitrev: return "bitrev";
    case Stage::kClip: return "clip";
    case Stage::kQuantize: return "quantize";
    case Stage::kPack: return "pack";
    case Stage::kUnpack: return "unpack";
    case Stage::kDequantize: return "dequantize";
  }
  return "unknown";
}

cudaError_t DispatchStage(Stage stage, const StageArgs& a, cudaStream_t stream) {
  if (a.rows < 0) return cudaErrorInvalidValue;
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const int64_t elements = a.rows * a.head_dim;
  const int64_t warp_blocks = Blocks(a.rows * 32, kStageBlock);
  if (Blocks(elements, kStageBlock) > INT32_MAX) return cudaErrorInvalidValue;
  const bool packing = stage == Stage::kPack || stage == Stage::kUnpack;
  if ((packing || stage == Stage::kQuantize) && a.bits != 2 && a.bits != 4) {
    return cudaErrorInvalidValue;
  }
  if ((stage == Stage::kQuantize || stage == Stage::kDequantize) &&
      ((a.group != 32 && a.group != 64 && a.group != 128) || a.group > a.head_dim)) {
    return cudaErrorInvalidValue;
  }
  switch (stage) {
    case Stage::kRotateDense:
      RotateDenseKernel<<<Blocks(elements, kStageBlock), kStageBlock, 0, stream>>>(a);
      return cudaGetLastError();
    case Stage::kBitrev:
      BitrevKernel<<<Blocks(elements, kStageBlock), kStageBlock, 0, stream>>>(a);
      return cudaGetLastError();
    case Stage::kPack:
      PackKernel<<<Blocks(a.rows * a.head_dim * a.bits / 8, kStageBlock), kStageBlock, 0,
                   stream>>>(a);
      return cudaGetLastError();
    case Stage::kUnpack:
      UnpackKernel<<<Blocks(elements, kStageBlock), kStageBlock, 0, stream>>>(a);
      return cudaGetLastError();
    case Stage::kDequantize:
      DequantizeKernel<<<Blocks(elements, kStageBlock), kStageBlock, 0, stream>>>(a);
      return cudaGetLastError();
    case Stage::kFwht:
      if (!IsPowerOfTwo(a.fwht_block) || a.fwht_block < 16 || a.fwht_block > a.head_dim) {
        return cudaErrorInvalidValue;
      }
      KVQ_DISPATCH_HEAD_DIM(a.head_dim, HEAD_DIM, {
        FwhtKernel<HEAD_DIM><<<warp_blocks, kStageBlock, 0, stream>>>(a);
        return cudaGetLastError();
      })
    case Stage::kClip:
      if (!(a.clip > 0.0f && a.clip <= 1.0f)) return cudaErrorInvalidValue;
      KVQ_DISPATCH_HEAD_DIM(a.head_dim, HEAD_DIM, {
        ClipKernel<HEAD_DIM><<<warp_blocks, kStageBlock, 0, stream>>>(a);
        return cudaGetLastError();
      })
    case Stage::kQuantize:
      KVQ_DISPATCH_HEAD_DIM(a.head_dim, HEAD_DIM, {
        KVQ_DISPATCH_GROUP(a.group, GROUP, {
          KVQ_DISPATCH_BITS(a.bits, BITS, {
            return LaunchQuantizeIfValid<HEAD_DIM, GROUP, BITS>(a, warp_blocks, stream);
          })
        })
      })
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAppendCopy(const AppendCopyArgs& a, cudaStream_t stream) {
  if (a.batch < 0 || a.num_heads < 1 || a.recent < 1 || a.sink < 0 ||
      (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)) {
    return cudaErrorInvalidValue;
  }
  if (a.batch == 0) return cudaSuccess;
  const int64_t threads = 2 * static_cast<int64_t>(a.batch) * a.num_heads * (a.head_dim / 8);
  AppendCopyKernel<<<Blocks(threads, kStageBlock), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
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

}  // namespace kvq::gpu
