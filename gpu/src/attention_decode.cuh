// The decode-attention kernel family (layer (a) of kvq/gpu/attention_launch.h). Included by
// one .cu file per key kind (KVQ_INSTANTIATE_DECODE_KEY) so the instantiations compile in
// parallel. The keys' and the values' history kinds (kvq/gpu/formats.h) are separate template
// parameters: HistorySplit picks the loop that reads the pair.
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
//
// The pieces, in the order they build on each other:
//   attention_common.cuh       block shape, PTX wrappers, timeline hook, bf16 row loads
//   attention_split_state.cuh  online softmax state, the block's partial
//   attention_skeleton.cuh     the split loop every split runs (SplitLoop) and its hooks: load
//                              tile, fold query, logits, softmax, values, epilogue
//   attention_bf16_rows.cuh    Bf16RowsLoop (window rows; the bf16 cache's pages)
//   attention_quant_rows.cuh   INT-b pages: code fields, tile pipeline, PvLoop, QuantRowsLoop
//                              (bf16 MMAs)
//   attention_quant_int8.cuh   QuantInt8Loop: INT-b pages with QK^T on the int8 tensor cores
//   attention_tile_keys.cuh    TileKeysLoop: tiled keys (scales folded into the query) + INT-b
//                              values
//   attention_fp8_rows.cuh     Fp8RowsLoop: fp8_e4m3 pages, codes converted exactly to fp16 in
//                              registers
//   this file                  the kernel (windows, empty splits, the history loop of the keys'
//                              format: HistoryLoop), its launcher
// Each loop header defines its loop's hooks and specializes HistoryLoop (attention_common.cuh)
// for the key format it reads, with the dispatch over its groups and tiles to SplitLoop.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>
#include <utility>

#include "attention_bf16_rows.cuh"
#include "attention_codebook_rows.cuh"
#include "attention_common.cuh"
#include "attention_fp8_rows.cuh"
#include "attention_quant_int8.cuh"
#include "attention_quant_rows.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "attention_tile_keys.cuh"
#include "kvq/gpu/attention_launch.h"
#include "launch.cuh"

namespace kvq::gpu::attention::detail {

// ------------------------------------------------------------------------------------------
// The kernel.

// The bf16 cache: every token a bf16 row in the pages (no windows).
template <class K>
inline constexpr bool kBf16Cache = K::kFormat == Format::kBf16;

// One block's split: history (quantized or bf16 pages), bf16 window, or an empty partial.
template <int D, class K, class V, QuantLoop LOOP>
__device__ __forceinline__ void DecodeBlock(const DecodeKernelParams& p, unsigned char* smem) {
  const int kvh = blockIdx.x / p.head_chunks;
  const int chunk = blockIdx.x - kvh * p.head_chunks;
  const int b = blockIdx.y;
  const int z = blockIdx.z;
  const int head0 = kvh * p.q_per_kv + chunk * p.heads_per_block;
  const int t = p.seq_lens[b];
  if constexpr (kBf16Cache<K>) {
    const int begin = z * p.hist_tokens_per_split;
    const int end = min(begin + p.hist_tokens_per_split, t);
    if (begin >= end) {
      BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
      StoreEmptyPartial(p, b, head0, z);
      return;
    }
    SplitLoop<Bf16RowsLoop<D, true, 2>>(SplitArgs{p, smem, kvh, head0, b, z, begin, end});
  } else {
    const int n_hist = HistoryTokensAt(p, t);
    if (z < p.hist_splits) {
      const int begin = z * p.hist_tokens_per_split;
      const int end = min(begin + p.hist_tokens_per_split, n_hist);
      if (begin >= end) {
        BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
        StoreEmptyPartial(p, b, head0, z);
        return;
      }
      HistoryLoop<K::kFormat>::template Split<D, K, V, LOOP>(p, smem, kvh, head0, b, z, begin,
                                                              end);
    } else {
      const int n_sink = min(p.sink, t);
      const int recent_begin = min(t, p.sink + n_hist);
      const int n_window = n_sink + max(0, t - recent_begin);
      const int begin = (z - p.hist_splits) * p.window_tokens_per_split;
      const int end = min(begin + p.window_tokens_per_split, n_window);
      if (begin >= end) {
        BlockTimeline::SetKind(p.timeline, BlockKind::kEmpty);
        StoreEmptyPartial(p, b, head0, z);
        return;
      }
      SplitLoop<Bf16RowsLoop<D, false, 1>>(
          SplitArgs{p, smem, kvh, head0, b, z, begin, end, n_sink, recent_begin});
    }
  }
}

// K, V: the keys' and the values' history kinds (HistoryKind); LOOP: the quantized history's
// loop (DecodeAttentionPlan::quant_loop); a kernel per loop so that each gets its own register
// allocation. The bf16 cache takes kTwoMma.
template <int D, class K, class V, QuantLoop LOOP>
__global__ void __launch_bounds__(kThreads, ResidentDecodeBlocksPerSm(D))
    DecodeAttentionKernel(const __grid_constant__ DecodeKernelParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  // The merge launched after this grid may launch once every block of it has started: its
  // blocks take the slots this grid's blocks leave, load R_V and wait for the partials.
  LaunchDependents();
  BlockTimeline::Enter(p.timeline, kBf16Cache<K> || blockIdx.z < p.hist_splits
                                       ? BlockKind::kHistory
                                       : BlockKind::kWindow);
  // A decode step whose append still runs (DecodeKernelParams::append_lengths): a window
  // split reads the new token's sink or ring row, so it waits for the kernel before this one
  // (which completes after the append) before it reads anything. A history split waits only
  // for its rotated queries (WaitForQueries) and, if it holds tokens the append demotes or
  // flushes, for the append before it copies their tile (FirstAppendedTile).
  if (!kBf16Cache<K> && p.append_lengths != nullptr && static_cast<int>(blockIdx.z) >= p.hist_splits) {
    WaitForPrerequisiteGrid();
  }
  DecodeBlock<D, K, V, LOOP>(p, smem);
  BlockTimeline::Exit(p.timeline);
}

using launch::LaunchKernel;

// The kernel's shared memory around a history loop's `history` bytes: the split's page ids
// after them, and no less than a window split's stage or the warps' combine area.
template <int D, class K>
constexpr int SharedBytesAround(int history) {
  constexpr int combine = (kWarps * kMaxHeadsPerBlock * D + 2 * kWarps * kMaxHeadsPerBlock) * 4;
  constexpr int page_ids = kSplitPageIdBytes;
  if constexpr (kBf16Cache<K>) {
    constexpr int pipeline = 2 * Bf16Geometry<D>::kStageBytes + page_ids;
    return pipeline > combine ? pipeline : combine;
  } else {
    const int with_ids = history + page_ids;
    constexpr int window = Bf16Geometry<D>::kStageBytes;
    const int m = with_ids > window ? with_ids : window;
    return m > combine ? m : combine;
  }
}
template <int D, class K, class V>
constexpr int PairSharedBytes() {
  if constexpr (kBf16Cache<K>) {
    return SharedBytesAround<D, K>(0);
  } else {
    return SharedBytesAround<D, K>(HistoryLoop<K::kFormat>::template SharedBytes<D, K, V>());
  }
}
// What one launch takes: PairSharedBytes, or less where the history loop sizes its shared
// memory by the cache's rows (a static LaunchSharedBytes<D>(p) beside its SharedBytes, at most
// that).
template <class H, int D, class = void>
struct SizesByRows : std::false_type {};
template <class H, int D>
struct SizesByRows<H, D,
                   std::void_t<decltype(H::template LaunchSharedBytes<D>(
                       std::declval<const DecodeKernelParams&>()))>> : std::true_type {};
template <int D, class K, class V>
int LaunchSharedBytes(const DecodeKernelParams& p) {
  if constexpr (!kBf16Cache<K>) {
    using H = HistoryLoop<K::kFormat>;
    if constexpr (SizesByRows<H, D>::value) {
      return SharedBytesAround<D, K>(H::template LaunchSharedBytes<D>(p));
    }
  }
  return PairSharedBytes<D, K, V>();
}
// The dynamic shared memory of the decode kernel of (D, K, V); 0 for a pair DecodePair refuses
// (no kernel).
template <int D, class K, class V>
constexpr int DecodeSharedBytesFor() {
  if constexpr (DecodePair<K, V>()) {
    return PairSharedBytes<D, K, V>();
  } else {
    return 0;
  }
}

}  // namespace kvq::gpu::attention::detail

namespace kvq::gpu::attention {

template <int HEAD_DIM, class K, class V>
cudaError_t LaunchDecodeAttention(const DecodeKernelParams& p, cudaStream_t stream) {
  if constexpr (!DecodePair<K, V>()) {
    return cudaErrorInvalidValue;  // no loop reads this pair
  } else {
    constexpr int kSmem = detail::DecodeSharedBytesFor<HEAD_DIM, K, V>();
      // The loops of the keys' row (kvq/gpu/formats.h), each a kernel; only those are
    // instantiated, and the plan's loop must be one of them, never run as another loop.
    constexpr unsigned kLoops = DecodeFormatOf(K::kFormat).loops;
    constexpr QuantLoop kPacked = (kLoops & kPackedLoop) ? QuantLoop::kPacked : QuantLoop::kTwoMma;
    constexpr QuantLoop kInt8Qk = (kLoops & kInt8QkLoop) ? QuantLoop::kInt8Qk : kPacked;
    if (p.quant_loop != QuantLoop::kTwoMma && p.quant_loop != QuantLoop::kPacked &&
        p.quant_loop != QuantLoop::kInt8Qk) {
      return cudaErrorInvalidValue;
    }
    if ((kLoops & LoopBit(p.quant_loop)) == 0) return cudaErrorInvalidValue;
    auto kernel = p.quant_loop == QuantLoop::kInt8Qk
                      ? detail::DecodeAttentionKernel<HEAD_DIM, K, V, kInt8Qk>
                  : p.quant_loop == QuantLoop::kPacked
                      ? detail::DecodeAttentionKernel<HEAD_DIM, K, V, kPacked>
                      : detail::DecodeAttentionKernel<HEAD_DIM, K, V, QuantLoop::kTwoMma>;
    if (kSmem > 48 * 1024) {
      // Once per process and kernel (device 0's limit is the same on every Hopper part).
      static const cudaError_t raised = [] {
        cudaError_t e = cudaSuccess;
        for (auto k : {detail::DecodeAttentionKernel<HEAD_DIM, K, V, QuantLoop::kTwoMma>,
                       detail::DecodeAttentionKernel<HEAD_DIM, K, V, kPacked>,
                       detail::DecodeAttentionKernel<HEAD_DIM, K, V, kInt8Qk>}) {
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
    const int smem = detail::LaunchSharedBytes<HEAD_DIM, K, V>(p);
    if (smem > kSmem) return cudaErrorInvalidValue;
    const dim3 grid(p.num_kv_heads * p.head_chunks, p.batch, splits);
    const cudaError_t launched = detail::LaunchKernel(kernel, grid, dim3(detail::kThreads), smem,
                                                      stream, p.programmatic_launch, p);
    if (launched != cudaSuccess) return launched;
    return cudaGetLastError();
  }
}

template <int HEAD_DIM, class K, class V>
int DecodeSharedBytesOf() {
  return detail::DecodeSharedBytesFor<HEAD_DIM, K, V>();
}

}  // namespace kvq::gpu::attention

// The instantiations of the launcher for keys of kind (KF, KB) over every value kind and head
// dimension of the lists (kvq/gpu/formats.h): one attention_decode_<key kind>.cu each, so they
// compile in parallel. A pair DecodePair refuses instantiates a launcher that returns
// cudaErrorInvalidValue and no kernel.
#define KVQ_DECODE_INSTANCE(VF, VB, KF, KB, D)                                            \
  template cudaError_t LaunchDecodeAttention<D, HistoryKind<Format::KF, KB>,              \
                                             HistoryKind<Format::VF, VB>>(                \
      const DecodeKernelParams&, cudaStream_t);                                           \
  template int DecodeSharedBytesOf<D, HistoryKind<Format::KF, KB>, HistoryKind<Format::VF, VB>>();
#define KVQ_DECODE_INSTANCES_OF_DIM(D, KF, KB) KVQ_GPU_VALUE_KINDS(KVQ_DECODE_INSTANCE, KF, KB, D)
#define KVQ_INSTANTIATE_DECODE_KEY(KF, KB) KVQ_GPU_HEAD_DIMS(KVQ_DECODE_INSTANCES_OF_DIM, KF, KB)
