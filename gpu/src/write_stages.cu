// The write path's stages on the GPU (the CUDA side of cpu::WriteKernels), one kernel and one
// launcher per stage of kvq/common/stages.inc, and their dispatch (write.h, layers (a) and (b)).
// Every kernel takes the one StageArgs: the stage's pointer arguments as a buffer list in
// stages.inc order (stage_arg::<Name>::<arg> names the position) and the write params. These
// are the spec's loops, written plainly: the fused kernel (write_fused.cu) is checked against
// the same oracle separately.
#include <cuda_runtime.h>

#include <cstdint>

#include "codebook.cuh"
#include "kvq/common/codebook.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/gpu/write.h"
#include "write_launch.cuh"
#include "write_row.cuh"

namespace kvq::gpu {
namespace {

using detail::kFullMask;
using write_launch::Blocks;
using write_launch::IsPowerOfTwo;
using write_launch::kStageBlock;

// stage_arg::<Name>::<arg>: the position of a stage's argument in StageArgs::args.
namespace stage_arg {
#define KVQ_ARG(name, expect, dtype, dir, extent) name,
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  namespace Name {                                      \
  enum : int { arg_list };                              \
  }
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
#undef KVQ_ARG
}  // namespace stage_arg

// Argument `i` of the stage as T* (T const for inputs).
template <typename T>
__device__ __forceinline__ T* Arg(const StageArgs& a, int i) {
  return static_cast<T*>(a.args[i]);
}

// ---- Kernels ----------------------------------------------------------------------------------

// Thread per output element: acc over i ascending from global memory.
__global__ void RotateDenseKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::RotateDense;
  const int64_t d = a.params.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t row = idx / d;
  const int64_t j = idx % d;
  const float* x = Arg<const float>(a, arg::x) + row * d;
  const float* r = Arg<const float>(a, arg::r);
  float acc = +0.0f;
  for (int64_t i = 0; i < d; ++i) acc = __fadd_rn(acc, __fmul_rn(x[i], r[i * d + j]));
  Arg<float>(a, arg::y)[idx] = acc;
}

__global__ void BitrevKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Bitrev;
  const int64_t d = a.params.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int log2_d = d == 64 ? 6 : (d == 128 ? 7 : 8);
  const int64_t row = idx / d;
  const uint32_t j = static_cast<uint32_t>(idx % d);
  Arg<float>(a, arg::y)[idx] = Arg<const float>(a, arg::x)[row * d + BitReverse(j, log2_d)];
}

// Slice per row kernels (write_row.cuh): row = global slice index. Every lane of a warp takes
// part in the shuffles; the slices past the last row compute on zeros and store nothing.
template <int D>
__device__ __forceinline__ int64_t SliceRowIndex() {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  return warp * detail::SliceTraits<D>::kRowsPerWarp + detail::SliceIndex<D>();
}

// This lane's values of row `row` of x (pair-strided order, rho = slice lane); a row past the
// last one reads row 0 (its results are not stored).
template <int D>
__device__ __forceinline__ void LoadStageRow(const float* x, int64_t row, int64_t rows,
                                             float (&v)[16]) {
  detail::LoadRowValues<D>(x + (row < rows ? row : 0) * D, false, v);
}

template <int D>
__device__ __forceinline__ void StoreStageRow(const float (&v)[16], int64_t row, int64_t rows,
                                              float* y) {
  if (row >= rows) return;
  const int r = detail::SliceLane<D>();
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    *reinterpret_cast<float2*>(y + row * D + detail::RowPosition<D>(2 * s, r)) =
        make_float2(v[2 * s], v[2 * s + 1]);
  }
}

template <int D>
__global__ void FwhtKernel(const __grid_constant__ StageArgs a) {
  float* x = Arg<float>(a, stage_arg::Fwht::x);  // in place
  const int64_t row = SliceRowIndex<D>();
  if (__all_sync(kFullMask, row >= a.rows)) return;  // whole warps only
  float v[16];
  LoadStageRow<D>(x, row, a.rows, v);
  detail::Fwht<D, false>(v, a.fwht_block, a.fwht_scale);
  StoreStageRow<D>(v, row, a.rows, x);
}

template <int D>
__global__ void ClipKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Clip;
  float* x = Arg<float>(a, arg::x);  // in place
  const int64_t row = SliceRowIndex<D>();
  if (__all_sync(kFullMask, row >= a.rows)) return;
  float v[16];
  LoadStageRow<D>(x, row, a.rows, v);
  const float tau = __uint_as_float(detail::ClipThresholdBits<D>(
      v, detail::ClipRank(a.params.clip, D), detail::SliceMaxMagnitudeBits<D>(v)));
#pragma unroll
  for (int s = 0; s < 16; ++s) v[s] = detail::ClipValue(v[s], tau);
  StoreStageRow<D>(v, row, a.rows, x);
  if (row < a.rows && detail::SliceLane<D>() == 0) Arg<float>(a, arg::tau)[row] = tau;
}

// The quantize stage alone: its input is already clipped, so no tau.
template <int D, int G, int BITS>
__global__ void QuantizeKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Quantize;
  const int64_t row = SliceRowIndex<D>();
  if (__all_sync(kFullMask, row >= a.rows)) return;
  float v[16];
  LoadStageRow<D>(Arg<const float>(a, arg::x), row, a.rows, v);
  const detail::GroupRanges<D, G> ranges = detail::ComputeGroupRanges<D, G>(v);
  detail::QuantizedSlice<D, G> q;
  detail::QuantizeSlice<D, G, BITS>(v, ranges, -1.0f, q);
  if (row >= a.rows) return;
  const int r = detail::SliceLane<D>();
  uint8_t* codes = Arg<uint8_t>(a, arg::codes);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    codes[row * D + detail::RowPosition<D>(k, r)] = static_cast<uint8_t>(q.code[k]);
  }
  detail::StoreMetadata<D, G>(q, Arg<uint16_t>(a, arg::scale) + row * (D / G),
                              Arg<uint16_t>(a, arg::min) + row * (D / G));
}

// Thread per packed byte: the loop of the spec, independent of the fused kernel's lane packing.
__global__ void PackKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Pack;
  const int bits = a.params.bits;
  const int64_t bytes_per_row = a.params.head_dim * bits / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * bytes_per_row) return;
  const int64_t row = idx / bytes_per_row;
  const int64_t i = idx % bytes_per_row;
  const uint8_t* codes = Arg<const uint8_t>(a, arg::codes) + row * a.params.head_dim;
  unsigned byte = 0;
  for (int part = 0; part < 8 / bits; ++part) {
    byte |= static_cast<unsigned>(codes[part * bytes_per_row + i]) << (part * bits);
  }
  Arg<uint8_t>(a, arg::packed)[idx] = static_cast<uint8_t>(byte);
}

__global__ void UnpackKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Unpack;
  const int64_t d = a.params.head_dim;
  const int bits = a.params.bits;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t bytes_per_row = d * bits / 8;
  const int64_t row = idx / d;
  const int64_t c = idx % d;
  const int64_t part = c / bytes_per_row;
  const int64_t i = c % bytes_per_row;
  const unsigned byte = Arg<const uint8_t>(a, arg::packed)[row * bytes_per_row + i];
  Arg<uint8_t>(a, arg::codes)[idx] =
      static_cast<uint8_t>((byte >> (part * bits)) & ((1u << bits) - 1u));
}

__global__ void DequantizeKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Dequantize;
  const int64_t d = a.params.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const int64_t group = a.params.group;
  const int64_t groups = d / group;
  const int64_t row = idx / d;
  const int64_t g = row * groups + (idx % d) / group;
  const float sf = F32FromBf16(Arg<const uint16_t>(a, arg::scale)[g]);
  const float mf = F32FromBf16(Arg<const uint16_t>(a, arg::min)[g]);
  const float code = static_cast<float>(Arg<const uint8_t>(a, arg::codes)[idx]);
  Arg<float>(a, arg::y)[idx] = __fadd_rn(__fmul_rn(code, sf), mf);
}


// ---- Spec 1.1: the norm and the affine_tile codec ----------------------------------------------

// A block per span of m = d * norm_heads values (numerics.md §5.1): the squares into shared
// memory, padded with +0 to M = `padded` (a power of two), the spec's tree (BlockTreeSum),
// n^ = bf16(sqrtf(S)), and the span divided by n^ (IEEE), +0 everywhere when n^ = 0.
__global__ void NormKernel(const __grid_constant__ StageArgs a, int padded) {
  namespace arg = stage_arg::Norm;
  extern __shared__ float squares[];
  const int m = a.params.head_dim * a.params.norm_heads;
  float* x = Arg<float>(a, arg::x) + static_cast<int64_t>(blockIdx.x) * m;
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    squares[j] = j < m ? __fmul_rn(x[j], x[j]) : +0.0f;
  }
  __syncthreads();
  const uint16_t bits = Bf16FromF32(__fsqrt_rn(detail::BlockTreeSum(squares, padded)));
  const float stored = F32FromBf16(bits);
  if (threadIdx.x == 0) Arg<uint16_t>(a, arg::norm)[blockIdx.x] = bits;
  for (int j = threadIdx.x; j < m; j += blockDim.x) x[j] = detail::Normalize(x[j], stored);
}

// Thread per element: y <- y * n^ of its row, one rounding.
// fp8_e4m3 (spec 1.2): thread per element, code = e4m3(x / s^) and y = s^ * e4m3.
__global__ void QuantizeFp8Kernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::QuantizeFp8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * a.params.head_dim) return;
  Arg<uint8_t>(a, arg::codes)[idx] =
      E4m3FromF32(__fdiv_rn(Arg<const float>(a, arg::x)[idx], a.params.head_scale));
}

__global__ void DequantizeFp8Kernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::DequantizeFp8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * a.params.head_dim) return;
  Arg<float>(a, arg::y)[idx] =
      __fmul_rn(a.params.head_scale, F32FromE4m3(Arg<const uint8_t>(a, arg::codes)[idx]));
}

__global__ void DenormKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::Denorm;
  const int64_t d = a.params.head_dim;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * d) return;
  const float stored = F32FromBf16(Arg<const uint16_t>(a, arg::norm)[idx / d]);
  float* y = Arg<float>(a, arg::y);
  y[idx] = __fmul_rn(y[idx], stored);
}

// Thread per (tile, channel): spec §5's rule on the channel's G_k values of the tile (the
// transposed tile's row), as the scalar QuantizeGroup writes it; codes stay token-major.
__global__ void QuantizeTileKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::QuantizeTile;
  const int64_t d = a.params.head_dim;
  const int64_t tile = a.params.group;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows / tile * d) return;
  const int64_t t = idx / d;
  const int64_t j = idx % d;
  const float levels = static_cast<float>((1 << a.params.bits) - 1);
  const float* x = Arg<const float>(a, arg::x) + t * tile * d + j;
  uint8_t* codes = Arg<uint8_t>(a, arg::codes) + t * tile * d + j;
  const detail::StoredPair pair = detail::StridedGroupPair(x, static_cast<int>(tile), d, levels);
  Arg<uint16_t>(a, arg::scale)[idx] = pair.scale;
  Arg<uint16_t>(a, arg::min)[idx] = pair.min;
  const float sf = F32FromBf16(pair.scale);
  const float mf = F32FromBf16(pair.min);
  for (int64_t r = 0; r < tile; ++r) {
    uint8_t code = 0;
    if (sf != 0.0f) {
      float c = rintf(__fdiv_rn(__fsub_rn(x[r * d], mf), sf));  // half to even
      c = (c < 0.0f) ? 0.0f : ((c > levels) ? levels : c);
      code = static_cast<uint8_t>(c);
    }
    codes[r * d] = code;
  }
}

// Thread per packed byte (tile t, channel j, byte i): the split rule along the tokens.
__global__ void PackTileKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::PackTile;
  const int64_t d = a.params.head_dim;
  const int64_t tile = a.params.group;
  const int bits = a.params.bits;
  const int64_t slice = tile * bits / 8;  // bytes per channel of a tile
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows / tile * d * slice) return;
  const int64_t i = idx % slice;
  const int64_t j = (idx / slice) % d;
  const int64_t t = idx / (slice * d);
  const uint8_t* codes = Arg<const uint8_t>(a, arg::codes);
  unsigned byte = 0;
  for (int part = 0; part < 8 / bits; ++part) {
    const int64_t token = t * tile + part * slice + i;
    byte |= static_cast<unsigned>(codes[token * d + j]) << (part * bits);
  }
  Arg<uint8_t>(a, arg::packed)[idx] = static_cast<uint8_t>(byte);
}

// Thread per code (token row, channel j).
__global__ void UnpackTileKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::UnpackTile;
  const int64_t d = a.params.head_dim;
  const int64_t tile = a.params.group;
  const int bits = a.params.bits;
  const int64_t slice = tile * bits / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows / tile * tile * d) return;
  const int64_t row = idx / d;
  const int64_t j = idx % d;
  const int64_t t = row / tile;
  const int64_t r = row % tile;
  const unsigned byte = Arg<const uint8_t>(a, arg::packed)[(t * d + j) * slice + r % slice];
  Arg<uint8_t>(a, arg::codes)[idx] =
      static_cast<uint8_t>((byte >> ((r / slice) * bits)) & ((1u << bits) - 1u));
}

// Thread per element: y = q * sf + mf with the pair of the row's tile and the channel.
__global__ void DequantizeTileKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::DequantizeTile;
  const int64_t d = a.params.head_dim;
  const int64_t tile = a.params.group;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows / tile * tile * d) return;
  const int64_t pair = (idx / d) / tile * d + idx % d;
  const float sf = F32FromBf16(Arg<const uint16_t>(a, arg::scale)[pair]);
  const float mf = F32FromBf16(Arg<const uint16_t>(a, arg::min)[pair]);
  const float code = static_cast<float>(Arg<const uint8_t>(a, arg::codes)[idx]);
  Arg<float>(a, arg::y)[idx] = __fadd_rn(__fmul_rn(code, sf), mf);
}

// ---- Spec 1.3: the codebook codec (numerics.md §5.4, §8.2) -------------------------------------
// A block of kCodebookStageBlock threads per row. Each thread derives the row's segment layout
// from the head's block widths (CodebookLayoutOf, the function the CPU oracle calls) and walks
// its segments; slots past the layout's segments hold +0, and nothing past `segments` slots or
// `row_code_bytes()` bytes a row is written.

constexpr int kCodebookStageBlock = 128;
constexpr int kCodebookStageValues = 256;  // the largest head_dim: the longest segment's M

// The n^ of a segment: its m squares (fp32) into `squares`, +0 up to the power of two M, the
// spec's tree (BlockTreeSum), sqrtf. Every thread returns it; `squares` is free again after
// the caller's next __syncthreads().
__device__ __forceinline__ float SegmentTreeLength(const float* v, int m, float* squares) {
  const int padded = static_cast<int>(NormTreeSize(m));
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    squares[j] = j < m ? __fmul_rn(v[j], v[j]) : +0.0f;
  }
  __syncthreads();
  return __fsqrt_rn(detail::BlockTreeSum(squares, padded));
}

// +0 in the row's norm slots from `first` on (the slots no segment of the layout uses).
__device__ __forceinline__ void ZeroSlotsFrom(uint16_t* norms, int first, int slots) {
  for (int s = first + static_cast<int>(threadIdx.x); s < slots; s += blockDim.x) norms[s] = 0;
}

// n^ = bf16(tree length) per segment; u = x / n^ (IEEE), +0 everywhere when n^ = 0.
__global__ void SegmentNormKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::SegmentNorm;
  __shared__ float squares[kCodebookStageValues];
  const int d = a.params.head_dim;
  const int slots = a.params.segments;
  const int64_t row = blockIdx.x;
  const CodebookLayout layout = CodebookLayoutOf(d, Arg<const uint8_t>(a, arg::widths));
  const float* x = Arg<const float>(a, arg::x) + row * d;
  float* unit = Arg<float>(a, arg::unit) + row * d;
  uint16_t* norms = Arg<uint16_t>(a, arg::segment_norm) + row * slots;
  ZeroSlotsFrom(norms, layout.count, slots);
  for (int s = 0; s < layout.count && s < slots; ++s) {
    const CodebookSegment& seg = layout.segment[s];
    const uint16_t bits = Bf16FromF32(SegmentTreeLength(x + seg.offset, seg.values, squares));
    const float stored = F32FromBf16(bits);
    if (threadIdx.x == 0) norms[s] = bits;
    for (int j = threadIdx.x; j < seg.values; j += blockDim.x) {
      unit[seg.offset + j] = detail::Normalize(x[seg.offset + j], stored);
    }
    __syncthreads();  // every thread has read squares[0]
  }
}

// code = #{k : t_k < u} (CountBelow: ties to the lower centroid); N^ = bf16(n^ / r), r the
// tree length of the fp32 centroids the codes pick.
__global__ void QuantizeCodebookKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::QuantizeCodebook;
  __shared__ float decoded[kCodebookStageValues];
  const int d = a.params.head_dim;
  const int slots = a.params.segments;
  const int64_t row = blockIdx.x;
  const CodebookLayout layout = CodebookLayoutOf(d, Arg<const uint8_t>(a, arg::widths));
  const float* unit = Arg<const float>(a, arg::unit) + row * d;
  const uint16_t* segment_norm = Arg<const uint16_t>(a, arg::segment_norm) + row * slots;
  uint8_t* codes = Arg<uint8_t>(a, arg::codes) + row * d;
  uint16_t* norms = Arg<uint16_t>(a, arg::norm) + row * slots;
  ZeroSlotsFrom(norms, layout.count, slots);
  for (int s = 0; s < layout.count && s < slots; ++s) {
    const CodebookSegment& seg = layout.segment[s];
    const int levels = 1 << seg.width;
    const float* table = codebook::TableOf(a.codebook, seg.values, seg.width);
    for (int j = threadIdx.x; j < seg.values; j += blockDim.x) {
      const int code = codebook::CountBelow(table + levels, levels, unit[seg.offset + j]);
      codes[seg.offset + j] = static_cast<uint8_t>(code);
      decoded[j] = __ldg(table + code);
    }
    __syncthreads();
    // The centroids' squares go to the tree in place of the centroids (each thread its own j).
    const float r = SegmentTreeLength(decoded, seg.values, decoded);
    if (threadIdx.x == 0) norms[s] = Bf16FromF32(__fdiv_rn(F32FromBf16(segment_norm[s]), r));
    __syncthreads();
  }
}

// The segment of the row's layout that holds channel j (the segments tile [0, d)).
__device__ __forceinline__ int SegmentOfChannel(const CodebookLayout& layout, int j) {
  int s = 0;
  while (s + 1 < layout.count && j >= layout.segment[s + 1].offset) ++s;
  return s;
}

// Byte i of a segment of m codes c at width w, as the scalar PackSegment lays it out:
// split-quarter at 2 bits, split-half at 4, the LSB-first bit stream otherwise.
__device__ __forceinline__ uint8_t PackedByte(const uint8_t* c, int m, int w, int i) {
  unsigned byte = 0;
  if (w == 2) {
    const int q = (m + 3) / 4;
    for (int part = 0; part < 4; ++part) {
      const int k = part * q + i;
      if (k < m) byte |= (c[k] & 3u) << (2 * part);
    }
  } else if (w == 4) {
    const int q = m / 2;
    byte = (c[i] & 15u) | ((c[q + i] & 15u) << 4);
  } else {
    for (int t = 0; t < 8; ++t) {
      const int e = 8 * i + t;
      if (e < m * w) byte |= ((c[e / w] >> (e % w)) & 1u) << t;
    }
  }
  return static_cast<uint8_t>(byte);
}

// Thread per byte of the row's code plane: its segment's byte, 0x00 past code_bytes.
__global__ void PackCodebookKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::PackCodebook;
  const int d = a.params.head_dim;
  const int row_bytes = a.params.row_code_bytes();
  const int64_t row = blockIdx.x;
  const CodebookLayout layout = CodebookLayoutOf(d, Arg<const uint8_t>(a, arg::widths));
  const uint8_t* codes = Arg<const uint8_t>(a, arg::codes) + row * d;
  uint8_t* packed = Arg<uint8_t>(a, arg::packed) + row * row_bytes;
  for (int i = threadIdx.x; i < row_bytes; i += blockDim.x) {
    uint8_t byte = 0;
    if (i < layout.code_bytes) {
      int s = 0;
      while (s + 1 < layout.count && i >= layout.segment[s + 1].byte_offset) ++s;
      const CodebookSegment& seg = layout.segment[s];
      byte = PackedByte(codes + seg.offset, seg.values, seg.width, i - seg.byte_offset);
    }
    packed[i] = byte;
  }
}

// Thread per channel: its code from the segment's bytes (codebook::CodePositionOf; a
// bit-stream code may span two bytes).
__global__ void UnpackCodebookKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::UnpackCodebook;
  const int d = a.params.head_dim;
  const int row_bytes = a.params.row_code_bytes();
  const int64_t row = blockIdx.x;
  const CodebookLayout layout = CodebookLayoutOf(d, Arg<const uint8_t>(a, arg::widths));
  const uint8_t* packed = Arg<const uint8_t>(a, arg::packed) + row * row_bytes;
  uint8_t* codes = Arg<uint8_t>(a, arg::codes) + row * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const CodebookSegment& seg = layout.segment[SegmentOfChannel(layout, j)];
    if (seg.byte_offset + seg.bytes > row_bytes) continue;  // widths that overrun the plane
    const uint8_t* bytes = packed + seg.byte_offset;
    const codebook::CodePosition at =
        codebook::CodePositionOf(j - seg.offset, seg.values, seg.width);
    unsigned word = bytes[at.byte];
    if (at.shift + seg.width > 8) word |= static_cast<unsigned>(bytes[at.byte + 1]) << 8;
    codes[j] = static_cast<uint8_t>((word >> at.shift) & ((1u << seg.width) - 1u));
  }
}

// Thread per channel: y = c[code & (2^w - 1)] * N^f, one rounding.
__global__ void DequantizeCodebookKernel(const __grid_constant__ StageArgs a) {
  namespace arg = stage_arg::DequantizeCodebook;
  const int d = a.params.head_dim;
  const int slots = a.params.segments;
  const int64_t row = blockIdx.x;
  const CodebookLayout layout = CodebookLayoutOf(d, Arg<const uint8_t>(a, arg::widths));
  const uint8_t* codes = Arg<const uint8_t>(a, arg::codes) + row * d;
  const uint16_t* norms = Arg<const uint16_t>(a, arg::norm) + row * slots;
  float* y = Arg<float>(a, arg::y) + row * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const int s = SegmentOfChannel(layout, j);
    if (s >= slots) continue;
    const CodebookSegment& seg = layout.segment[s];
    const float* table = codebook::TableOf(a.codebook, seg.values, seg.width);
    const float centroid = __ldg(table + (codes[j] & ((1u << seg.width) - 1u)));
    y[j] = __fmul_rn(centroid, F32FromBf16(norms[s]));
  }
}

// ---- Launch checks ----------------------------------------------------------------------------

// What every stage needs: rows >= 0, a supported head_dim and a grid that fits.
cudaError_t CheckRows(const StageArgs& a) {
  const int d = a.params.head_dim;
  if (a.rows < 0 || (d != 64 && d != 128 && d != 256)) return cudaErrorInvalidValue;
  if (Blocks(a.rows * d, kStageBlock) > INT32_MAX) return cudaErrorInvalidValue;
  return cudaSuccess;
}
bool SupportedBits(const StageArgs& a) { return a.params.bits == 2 || a.params.bits == 4; }
// 32, 64 or 128 channels (at most d), or G = d (one pair a row, spec 1.1).
bool SupportedGroup(const StageArgs& a) {
  const int g = a.params.group;
  return ((g == 32 || g == 64 || g == 128) && g <= a.params.head_dim) || g == a.params.head_dim;
}
// affine_tile: G_k tokens a tile (32, 64 or 128), and whole tiles (StageRowMultiple).
bool SupportedTile(const StageArgs& a) {
  const int64_t g = a.params.group;
  return (g == 32 || g == 64 || g == 128) && a.rows % g == 0;
}
// Blocks of a thread-per-element kernel, and of a slice-per-row kernel (d/16 threads a row).
int64_t ElementBlocks(const StageArgs& a) {
  return Blocks(a.rows * a.params.head_dim, kStageBlock);
}
int64_t SliceBlocks(const StageArgs& a) {
  return Blocks(a.rows * (a.params.head_dim / 16), kStageBlock);
}

template <int D, int G, int B>
cudaError_t LaunchQuantizeIfValid(const StageArgs& a, cudaStream_t stream) {
  if constexpr (G <= D) {
    QuantizeKernel<D, G, B><<<SliceBlocks(a), kStageBlock, 0, stream>>>(a);
    return cudaGetLastError();
  } else {
    return cudaErrorInvalidValue;
  }
}

}  // namespace

// ---- Layer (b): one launcher per stage of stages.inc ------------------------------------------

#define KVQ_STAGE_PROLOGUE(a)                           \
  if (const cudaError_t e = CheckRows(a); e != cudaSuccess) return e; \
  if ((a).rows == 0) return cudaSuccess

cudaError_t LaunchRotateDenseStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  RotateDenseKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchFwhtStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!IsPowerOfTwo(a.fwht_block) || a.fwht_block < 16 || a.fwht_block > a.params.head_dim) {
    return cudaErrorInvalidValue;
  }
  KVQ_DISPATCH_HEAD_DIM(a.params.head_dim, HEAD_DIM, {
    FwhtKernel<HEAD_DIM><<<SliceBlocks(a), kStageBlock, 0, stream>>>(a);
    return cudaGetLastError();
  })
}

cudaError_t LaunchBitrevStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  BitrevKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchClipStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!(a.params.clip > 0.0f && a.params.clip <= 1.0f)) return cudaErrorInvalidValue;
  KVQ_DISPATCH_HEAD_DIM(a.params.head_dim, HEAD_DIM, {
    ClipKernel<HEAD_DIM><<<SliceBlocks(a), kStageBlock, 0, stream>>>(a);
    return cudaGetLastError();
  })
}

cudaError_t LaunchQuantizeStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a) || !SupportedGroup(a)) return cudaErrorInvalidValue;
  KVQ_DISPATCH_HEAD_DIM(a.params.head_dim, HEAD_DIM, {
    KVQ_DISPATCH_GROUP(a.params.group, GROUP, {
      KVQ_DISPATCH_BITS(a.params.bits, BITS, {
        return LaunchQuantizeIfValid<HEAD_DIM, GROUP, BITS>(a, stream);
      })
    })
  })
}

cudaError_t LaunchPackStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a)) return cudaErrorInvalidValue;
  PackKernel<<<Blocks(a.rows * a.params.head_dim * a.params.bits / 8, kStageBlock), kStageBlock,
               0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchUnpackStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a)) return cudaErrorInvalidValue;
  UnpackKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedGroup(a)) return cudaErrorInvalidValue;
  DequantizeKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchNormStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  const int64_t m = static_cast<int64_t>(a.params.head_dim) * a.params.norm_heads;
  if (a.params.norm_heads < 1 || a.rows > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t padded = NormTreeSize(m);
  if (padded > kMaxNormSpan) return cudaErrorInvalidValue;
  const size_t shared = static_cast<size_t>(padded) * sizeof(float);
  if (shared > 48 * 1024) {
    const cudaError_t raised = cudaFuncSetAttribute(
        NormKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (raised != cudaSuccess) return raised;
  }
  NormKernel<<<static_cast<unsigned>(a.rows), kStageBlock, shared, stream>>>(
      a, static_cast<int>(padded));
  return cudaGetLastError();
}

cudaError_t LaunchDenormStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  DenormKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeTileStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a) || !SupportedTile(a)) return cudaErrorInvalidValue;
  QuantizeTileKernel<<<Blocks(a.rows / a.params.group * a.params.head_dim, kStageBlock),
                       kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchPackTileStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a) || !SupportedTile(a)) return cudaErrorInvalidValue;
  PackTileKernel<<<Blocks(a.rows * a.params.head_dim * a.params.bits / 8, kStageBlock),
                   kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchUnpackTileStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedBits(a) || !SupportedTile(a)) return cudaErrorInvalidValue;
  UnpackTileKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeTileStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!SupportedTile(a)) return cudaErrorInvalidValue;
  DequantizeTileKernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeFp8Stage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  if (!(a.params.head_scale > 0.0f)) return cudaErrorInvalidValue;
  QuantizeFp8Kernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeFp8Stage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  DequantizeFp8Kernel<<<ElementBlocks(a), kStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

// codebook: a block a row (so at most INT32_MAX rows), a head's norm slots in 1..8, and the
// density's tables for the stages that read centroids or boundaries.
cudaError_t LaunchCodebookRows(void (*kernel)(StageArgs), const StageArgs& a, bool tables,
                               cudaStream_t stream) {
  if (a.rows > INT32_MAX || a.params.segments < 1 ||
      a.params.segments > kCodebookMaxSegments || (tables && a.codebook == nullptr)) {
    return cudaErrorInvalidValue;
  }
  kernel<<<static_cast<unsigned>(a.rows), kCodebookStageBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchSegmentNormStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  return LaunchCodebookRows(SegmentNormKernel, a, /*tables=*/false, stream);
}

cudaError_t LaunchQuantizeCodebookStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  return LaunchCodebookRows(QuantizeCodebookKernel, a, /*tables=*/true, stream);
}

cudaError_t LaunchPackCodebookStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  return LaunchCodebookRows(PackCodebookKernel, a, /*tables=*/false, stream);
}

cudaError_t LaunchUnpackCodebookStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  return LaunchCodebookRows(UnpackCodebookKernel, a, /*tables=*/false, stream);
}

cudaError_t LaunchDequantizeCodebookStage(const StageArgs& a, cudaStream_t stream) {
  KVQ_STAGE_PROLOGUE(a);
  return LaunchCodebookRows(DequantizeCodebookKernel, a, /*tables=*/true, stream);
}

#undef KVQ_STAGE_PROLOGUE

// Every stage of stages.inc that the CUDA path implements (backends column kEveryBackend): its
// launcher above (such a stage without one does not link).
cudaError_t DispatchStage(StageId stage, const StageArgs& a, cudaStream_t stream) {
  switch (stage) {
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  KVQ_IF_CUDA_STAGE(backends, case StageId::k##Name : return Launch##Name##Stage(a, stream);)
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
    default:  // a kCpuOnly stage (RunStage refuses it first, naming it)
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvq::gpu
