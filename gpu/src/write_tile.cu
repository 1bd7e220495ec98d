// The fused write of the affine_tile format (layer a) and its launcher (layer b); see write.h.
//
// A block of 256 threads per (tile of G_k tokens, KV head), in every mode (flat rows, prefill,
// decode-time flush). Two phases:
//  1. Rows: a slice of d/16 lanes per row (write_row.cuh): the load with the FWHT and P_br
//     (P_br by relabelling the lanes), the range check, the norm (spec/numerics.md §5.1,
//     SliceTreeSquareSum: the spec's tree over the slice's registers and lanes), the clip's
//     order statistic; each row lands in shared memory as fp32 and its norm in the norm plane.
//  2. Channels: a thread per channel runs spec 1.0's quantizer on the channel's G_k values
//     (the transposed tile's row, §5.2: exact min / max, the code by QuantizeCode) and stores
//     the channel's (scale, min) and its packed bytes, channel-major with the split rule along
//     the tokens (§8.1), one 32-bit store per four bytes.
// The token-scope norm (one norm over the rows of every KV head of a token) needs every head's
// rows: TokenNormKernel, a block per tile, stores those norms in the shared norm plane first
// (the squares of a token's Hkv rows in shared memory, BlockTreeSum), and the tile kernel,
// launched behind it in stream order, divides by the stored n^.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/write.h"
#include "launch.cuh"
#include "write_launch.cuh"
#include "write_row.cuh"

namespace kvq::gpu {
namespace {

using detail::kFullMask;
using write_launch::IsPowerOfTwo;
using write_launch::RaiseFlag;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 128;
constexpr uint32_t kMaxRotatedAbsBits = 0x7E800000u;  // 2^126 (kMaxRotatedAbs)
constexpr uint16_t kBf16InfBits = 0x7F80u;
constexpr int kRotationHadamard = static_cast<int>(RotationKind::kHadamard);

template <int D>
struct TileWriteTraits {
  static constexpr int kLanes = detail::SliceTraits<D>::kLanes;
  static constexpr int kRowsPerWarp = detail::SliceTraits<D>::kRowsPerWarp;
  static constexpr int kRowsPerPass = kWarps * kRowsPerWarp;  // 64, 32, 16
  static constexpr int kStride = D + 2 * kLanes;               // padded fp32 row
  static size_t SharedBytes(int tile) { return sizeof(float) * tile * kStride; }
};

// Where one block's tile comes from and goes to; `active` is false for a flush slot with
// nothing to flush and for a tile whose page is invalid (flagged).
struct TileJob {
  bool active = false;
  int64_t tile_row = 0;  // row index into the tile planes (codes, scale, min)
  int64_t norm_row = 0;     // row index into the norm plane of the tile's first token
  int64_t norm_stride = 1;  // rows of the norm plane between consecutive tokens
  // kPrefill / kRows: first row of x (token index); kFlush: sequence, first position, length.
  int64_t first = 0;
  int b = 0;
  int64_t len = 0;
};

// The block's job (thread 0 raises the flags; every thread computes the same answer).
__device__ __forceinline__ TileJob ResolveTileJob(const FusedWriteArgs& a, int head) {
  TileJob job;
  const int tile = a.tile_tokens;
  const int64_t j = blockIdx.x;
  const bool leader = threadIdx.x == 0;
  if (a.mode == WriteMode::kRows) {
    job.active = true;
    job.first = j * tile;
    job.tile_row = j * a.num_heads + head;
    job.norm_row = job.first * a.num_heads + head;  // the token scope is refused here
    job.norm_stride = a.num_heads;
    return job;
  }
  int64_t history_index;
  const int32_t* table;
  if (a.mode == WriteMode::kPrefill) {
    history_index = j * tile;
    job.first = a.first_token + history_index;
    table = a.page_table;
  } else {  // kFlush: tile k of sequence b's flush
    const int per_flush = a.flush / tile;
    job.b = static_cast<int>(j / per_flush);
    const int k = static_cast<int>(j % per_flush);
    const int len = a.seq_lengths[job.b];
    if (len < 0) {
      RaiseFlag(a.error_flags, kErrorFlagBadLength, leader);
      return job;
    }
    const write_launch::FlushRange f = write_launch::FlushRangeOf(len, a.sink, a.recent, a.flush);
    job.len = len;
    job.first = f.begin + static_cast<int64_t>(k) * tile;
    if (job.first >= f.end) return job;  // nothing to flush in this step
    history_index = job.first - a.sink;
    const int64_t page_index = history_index >> a.page_size_log2;
    if (page_index >= a.page_table_stride) {
      RaiseFlag(a.error_flags, kErrorFlagBadPage, leader);
      return job;
    }
    table = a.page_table + static_cast<int64_t>(job.b) * a.page_table_stride;
  }
  const int32_t page = table[history_index >> a.page_size_log2];
  if (page < 0 || page >= a.num_pages) {
    RaiseFlag(a.error_flags, kErrorFlagBadPage, leader);
    return job;
  }
  const int64_t page_size = int64_t{1} << a.page_size_log2;
  const int64_t slot = history_index & (page_size - 1);
  const int64_t head_page = static_cast<int64_t>(page) * a.num_heads + head;
  job.tile_row = head_page * (page_size / tile) + slot / tile;
  // The norm plane: [num_pages, Hkv, P], or [num_pages, 1, P] for the token scope.
  job.norm_row = (a.norm_shared ? page : head_page) * page_size + slot;
  job.active = true;
  return job;
}

// Source row r of the job's tile (T: uint16_t bf16 bits or float; a token's rows [Hkv, D]).
template <int D, typename T>
__device__ __forceinline__ const T* TileRowSource(const FusedWriteArgs& a, const TileJob& job,
                                                  int head, int r) {
  const int64_t h = static_cast<int64_t>(head) * D;
  const T* x = static_cast<const T*>(a.x);
  if (a.mode != WriteMode::kFlush) return x + (job.first + r) * a.token_stride + h;
  const int64_t p = job.first + r;
  if (p < job.len) {
    return x + static_cast<int64_t>(job.b) * a.seq_stride + (p % a.ring_slots) * a.token_stride +
           h;
  }
  return static_cast<const T*>(a.new_rows) + static_cast<int64_t>(job.b) * a.token_stride + h;
}

// Phase 2 of the tile write: thread j quantizes channel j of the tile (rows: the block's
// clipped fp32 rows, [G_k][kStride]) by spec §5's rule with G = G_k and stores its (scale,
// min) and its G_k*b/8 packed bytes (byte i: tokens i + q * G_k*b/8, q < 8/b, in bits q*b).
template <int D, int BITS>
__device__ __forceinline__ void QuantizeTileChannels(const FusedWriteArgs& a, const TileJob& job,
                                                     const float* rows) {
  using Traits = TileWriteTraits<D>;
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const int tile = a.tile_tokens;
  const int slice = tile * BITS / 8;  // packed bytes a channel: 8 .. 64
  uint8_t* codes = a.planes[kTileCodesPlane] + job.tile_row * (static_cast<int64_t>(D) * slice);
  uint16_t* scale = reinterpret_cast<uint16_t*>(a.planes[kTileScalePlane]) + job.tile_row * D;
  uint16_t* min = reinterpret_cast<uint16_t*>(a.planes[kTileMinPlane]) + job.tile_row * D;
  for (int j = threadIdx.x; j < D; j += kThreads) {
    const float* column = rows + j;
    const detail::StoredPair pair =
        detail::StridedGroupPair(column, tile, Traits::kStride, kLevels);
    scale[j] = pair.scale;
    min[j] = pair.min;
    const float sf = F32FromBf16(pair.scale);
    const float mf = F32FromBf16(pair.min);
    const float inv = detail::QuantizeReciprocal(sf);
    uint32_t* out = reinterpret_cast<uint32_t*>(codes + static_cast<int64_t>(j) * slice);
    for (int w = 0; w < slice / 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b4 = 0; b4 < 4; ++b4) {
        const int i = 4 * w + b4;
#pragma unroll
        for (int part = 0; part < 8 / BITS; ++part) {
          const float x = column[(part * slice + i) * Traits::kStride];
          // sf = 0: every code of the group is 0 (spec §5).
          const uint32_t code =
              sf != 0.0f ? detail::QuantizeCode<BITS>(__fsub_rn(x, mf), sf, inv) : 0u;
          word |= code << (8 * b4 + part * BITS);
        }
      }
      out[w] = word;
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    TileWriteKernel(const __grid_constant__ FusedWriteArgs a) {
  using Traits = TileWriteTraits<D>;
  extern __shared__ float4 shared_words[];
  float* rows = reinterpret_cast<float*>(shared_words);  // [G_k][kStride] fp32, clipped
  launch::LaunchDependents();  // the next write (overlap_previous) may start
  const int head = static_cast<int>(blockIdx.y);
  const TileJob job = ResolveTileJob(a, head);
  if (!job.active) {
    launch::WaitForPrerequisiteGrid();
    return;
  }
  const int tile = a.tile_tokens;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const bool leader = detail::SliceLane<D>() == 0;
  const bool bitrev = a.rotation.bitrev;
  const int fwht_block = a.rotation.kind == kRotationHadamard ? a.rotation.fwht_block : 0;
  const float rho_clip = a.clip_per_head != nullptr ? a.clip_per_head[head] : a.clip;
  const int clip_rank = detail::ClipRank(rho_clip, D);
  uint16_t* norm_plane = a.norm ? reinterpret_cast<uint16_t*>(a.planes[kTileNormPlane]) : nullptr;

  // ---- 1. Rows: a slice per row; whole warps are in or out (G_k is a multiple of 32) ----
  for (int pass = 0; pass < tile; pass += Traits::kRowsPerPass) {
    const int r = pass + warp * Traits::kRowsPerWarp + detail::SliceIndex<D>();
    if (__all_sync(kFullMask, r >= tile)) continue;
    float v[16];
    int rho;
    if (a.x_is_bf16) {
      rho = detail::LoadRow<D>(TileRowSource<D, uint16_t>(a, job, head, r), bitrev, fwht_block,
                               a.rotation.fwht_scale, v);
    } else {
      rho = detail::LoadRow<D>(TileRowSource<D, float>(a, job, head, r), bitrev, fwht_block,
                               a.rotation.fwht_scale, v);
    }
    // |x~| > 2^126, Inf or NaN: the validating CPU path rejects the row (kNonFinite).
    if (detail::SliceMaxMagnitudeBits<D>(v) > kMaxRotatedAbsBits) {
      RaiseFlag(a.error_flags, kErrorFlagNonFinite, leader);
    }
    if (a.norm) {
      uint16_t* norm = norm_plane + job.norm_row + static_cast<int64_t>(r) * job.norm_stride;
      // The token scope's n^ is TokenNormKernel's (this launch runs behind it).
      const uint16_t bits = a.norm_shared
                                ? *norm
                                : Bf16FromF32(__fsqrt_rn(detail::SliceTreeSquareSum<D>(v, bitrev)));
      const float stored = F32FromBf16(bits);
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = detail::Normalize(v[k], stored);
      if (leader && !a.norm_shared) {
        *norm = bits;
        // A stored infinite norm cannot be multiplied back: the CPU path rejects the row.
        if ((bits & 0x7fffu) >= kBf16InfBits) RaiseFlag(a.error_flags, kErrorFlagNonFinite);
      }
    }
    const uint32_t max_bits = detail::SliceMaxMagnitudeBits<D>(v);
    const uint32_t tau_bits = detail::ClipThresholdBits<D>(v, clip_rank, max_bits);
    // tau = max |v| changes no value (rho = 1, or the rank of the maximum).
    if (__any_sync(kFullMask, tau_bits != max_bits)) {
      const float tau = __uint_as_float(tau_bits);
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = detail::ClipValue(v[k], tau);
    }
    float* row = rows + r * Traits::kStride;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      *reinterpret_cast<float2*>(row + detail::RowPosition<D>(2 * s, rho)) =
          make_float2(v[2 * s], v[2 * s + 1]);
    }
  }
  __syncthreads();

  // ---- 2. Channels: spec 1.0's quantizer on each column of the tile ----
  if (a.bits == 2) {
    QuantizeTileChannels<D, 2>(a, job, rows);
  } else {
    QuantizeTileChannels<D, 4>(a, job, rows);
  }
  launch::WaitForPrerequisiteGrid();  // overlap_previous: complete only after the previous kernel
}

// The token-scope norms of a tile (numerics.md §5.1 with m = Hkv * d): a block per tile, the
// tile's tokens one after the other. For each token the slices load the rows of every KV head
// (FWHT, P_br), store their squares at position h * D + j of the padded span in shared memory,
// and BlockTreeSum folds the span; thread 0 stores n^ = bf16(sqrtf(S)) in the shared norm
// plane, which the tile kernel reads.
template <int D>
__global__ void __launch_bounds__(kThreads)
    TokenNormKernel(const __grid_constant__ FusedWriteArgs a) {
  using Traits = TileWriteTraits<D>;
  extern __shared__ float4 shared_words[];
  float* squares = reinterpret_cast<float*>(shared_words);  // [padded]
  launch::LaunchDependents();
  const TileJob job = ResolveTileJob(a, 0);
  if (!job.active) {
    launch::WaitForPrerequisiteGrid();
    return;
  }
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const bool bitrev = a.rotation.bitrev;
  const int fwht_block = a.rotation.kind == kRotationHadamard ? a.rotation.fwht_block : 0;
  const int span = a.num_heads * D;
  const int padded = static_cast<int>(NormTreeSize(span));  // the launcher's size
  uint16_t* norm_plane = reinterpret_cast<uint16_t*>(a.planes[kTileNormPlane]);
  for (int r = 0; r < a.tile_tokens; ++r) {
    for (int j = span + static_cast<int>(threadIdx.x); j < padded; j += kThreads) {
      squares[j] = +0.0f;
    }
    // Whole warps are in or out; a slice past the last head loads head 0 and stores nothing.
    for (int pass = 0; pass < a.num_heads; pass += Traits::kRowsPerPass) {
      const int head = pass + warp * Traits::kRowsPerWarp + detail::SliceIndex<D>();
      if (__all_sync(kFullMask, head >= a.num_heads)) continue;
      const int source_head = head < a.num_heads ? head : 0;
      float v[16];
      const int rho = detail::LoadRow<D>(TileRowSource<D, uint16_t>(a, job, source_head, r),
                                         bitrev, fwht_block, a.rotation.fwht_scale, v);
      if (head < a.num_heads) {
        float* row = squares + head * D;
#pragma unroll
        for (int k = 0; k < 16; ++k) row[detail::RowPosition<D>(k, rho)] = __fmul_rn(v[k], v[k]);
      }
    }
    __syncthreads();
    const uint16_t bits = Bf16FromF32(__fsqrt_rn(detail::BlockTreeSum(squares, padded)));
    if (threadIdx.x == 0) {
      norm_plane[job.norm_row + static_cast<int64_t>(r) * job.norm_stride] = bits;
      // A stored infinite norm cannot be multiplied back: the CPU path rejects the token.
      if ((bits & 0x7fffu) >= kBf16InfBits) RaiseFlag(a.error_flags, kErrorFlagNonFinite);
    }
    __syncthreads();  // squares[0] is read before the next token overwrites it
  }
  launch::WaitForPrerequisiteGrid();  // overlap_previous: complete only after the previous kernel
}

}  // namespace

// ---- Layer (b) ---------------------------------------------------------------------------------

template <int HEAD_DIM>
cudaError_t LaunchTileWrite(const FusedWriteArgs& a, cudaStream_t stream) {
  using Traits = TileWriteTraits<HEAD_DIM>;
  const int tile = a.tile_tokens;
  if (tile != 32 && tile != 64 && tile != kMaxTile) return cudaErrorInvalidValue;
  if ((a.bits != 2 && a.bits != 4) || a.num_tokens < 0 || a.num_heads < 1 ||
      a.num_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  const RotationArgs& rotation = a.rotation;
  if (rotation.kind != static_cast<int>(RotationKind::kIdentity) &&
      rotation.kind != kRotationHadamard) {
    return cudaErrorInvalidValue;  // a dense rotation has no tile kernel
  }
  if (rotation.kind == kRotationHadamard &&
      (!IsPowerOfTwo(rotation.fwht_block) || rotation.fwht_block < 16 ||
       rotation.fwht_block > HEAD_DIM)) {
    return cudaErrorInvalidValue;
  }
  if (a.x == nullptr || reinterpret_cast<uintptr_t>(a.x) % 16 != 0 ||
      a.token_stride % (a.x_is_bf16 ? 8 : 4) != 0 || a.planes[kTileCodesPlane] == nullptr ||
      a.planes[kTileScalePlane] == nullptr || a.planes[kTileMinPlane] == nullptr ||
      (a.norm && a.planes[kTileNormPlane] == nullptr) || (a.norm_shared && !a.norm)) {
    return cudaErrorInvalidValue;
  }
  // The token scope: bf16 rows of a cache (the flat rows of one head hold no other heads).
  const int64_t norm_padded = NormTreeSize(static_cast<int64_t>(a.num_heads) * HEAD_DIM);
  if (a.norm_shared &&
      (a.mode == WriteMode::kRows || !a.x_is_bf16 || norm_padded > kMaxNormSpan)) {
    return cudaErrorInvalidValue;
  }
  int64_t jobs = 0;
  switch (a.mode) {
    case WriteMode::kRows:
      if (a.num_tokens % tile != 0) return cudaErrorInvalidValue;
      jobs = a.num_tokens / tile;
      break;
    case WriteMode::kPrefill:
      if (a.num_tokens % tile != 0 || !a.x_is_bf16 || a.page_table == nullptr ||
          a.page_size_log2 < 4 || a.page_size_log2 > 10 || (1 << a.page_size_log2) % tile != 0) {
        return cudaErrorInvalidValue;
      }
      jobs = a.num_tokens / tile;
      break;
    case WriteMode::kFlush:
      // num_tokens: the batch. The ring holds W + F - 1 slots; W = 0 reads the step's rows.
      if (!a.x_is_bf16 || a.seq_lengths == nullptr || a.flush < tile || a.flush % tile != 0 ||
          a.recent < 0 || a.sink < 0 || a.ring_slots != a.recent + a.flush - 1 ||
          a.seq_stride % 8 != 0 || a.page_size_log2 < 4 || a.page_size_log2 > 10 ||
          (1 << a.page_size_log2) % tile != 0 ||
          (a.recent == 0 && (a.new_rows == nullptr ||
                             reinterpret_cast<uintptr_t>(a.new_rows) % 16 != 0))) {
        return cudaErrorInvalidValue;
      }
      jobs = static_cast<int64_t>(a.num_tokens) * (a.flush / tile);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (jobs == 0) return cudaSuccess;
  if (jobs > INT32_MAX) return cudaErrorInvalidValue;
  const size_t shared = Traits::SharedBytes(tile);
  static const cudaError_t raised = cudaFuncSetAttribute(
      TileWriteKernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(Traits::SharedBytes(kMaxTile)));
  if (raised != cudaSuccess) return raised;
  if (!a.norm_shared) {
    const dim3 grid(static_cast<unsigned>(jobs), static_cast<unsigned>(a.num_heads));
    return launch::LaunchKernel(TileWriteKernel<HEAD_DIM>, grid, dim3(kThreads), shared, stream,
                                a.overlap_previous, a);
  }
  // The token scope: the norms first (overlapping the previous kernel as the tile kernel
  // would), then the tile kernel in plain stream order, which reads them.
  static const cudaError_t raised_norm = cudaFuncSetAttribute(
      TokenNormKernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(kMaxNormSpan * sizeof(float)));
  if (raised_norm != cudaSuccess) return raised_norm;
  const cudaError_t norms = launch::LaunchKernel(
      TokenNormKernel<HEAD_DIM>, dim3(static_cast<unsigned>(jobs)), dim3(kThreads),
      static_cast<size_t>(norm_padded) * sizeof(float), stream, a.overlap_previous, a);
  if (norms != cudaSuccess) return norms;
  const dim3 grid(static_cast<unsigned>(jobs), static_cast<unsigned>(a.num_heads));
  return launch::LaunchKernel(TileWriteKernel<HEAD_DIM>, grid, dim3(kThreads), shared, stream,
                              /*programmatic=*/false, a);
}

cudaError_t DispatchTileWrite(int head_dim, const FusedWriteArgs& args, cudaStream_t stream) {
  KVQ_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, { return LaunchTileWrite<HEAD_DIM>(args, stream); })
}

// The row of KVQ_GPU_WRITE_FORMATS these kernels serve: affine_tile with identity or FWHT
// rotations and a norm per KV head or per token over at most kMaxNormSpan values.
void CheckWriteAffineTile(const WriteParams& p, const char* what) {
  KVQ_CHECK(p.rotation != RotationKind::kDense, kUnsupported, what,
            ": the CUDA tile write takes identity or FWHT rotations, not a dense one");
  KVQ_CHECK(!p.norm || static_cast<int64_t>(p.norm_span()) <= kMaxNormSpan, kUnsupported, what,
            ": a norm over ", p.norm_heads, " KV heads of d = ", p.head_dim,
            " spans more than the CUDA limit of ", kMaxNormSpan, " values");
}
cudaError_t WriteAffineTile(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream) {
  return DispatchTileWrite(p.head_dim, a, stream);
}

template cudaError_t LaunchTileWrite<64>(const FusedWriteArgs&, cudaStream_t);
template cudaError_t LaunchTileWrite<128>(const FusedWriteArgs&, cudaStream_t);
template cudaError_t LaunchTileWrite<256>(const FusedWriteArgs&, cudaStream_t);

}  // namespace kvq::gpu
