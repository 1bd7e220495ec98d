// CUDA decode attention over the paged KV cache (spec/cache.md §5), layer (c): the runtime API.
// One query token per sequence, all Hq query heads, a batch of sequences of any lengths.
// Query head h reads KV head h / (Hq / Hkv).
//
// Quantized cache: sink and recent windows are bf16 (original space); history pages hold INT-b
// codes with bf16 (scale, min) per group in the rotated space. The query is rotated once
// (q~ = q·R_K then P_br, the write path's rotation rule bit for bit), history logits are
// q~·x^, history values accumulate in the rotated space and are mapped back once per head by
// RotateInverse of the value params (dense R_V^T, FWHT, bit reversal, identity).
// bf16 cache (key.format == value.format == bf16): every token [0, t) is a bf16 row in the
// pages (page pg holds bf16 [Hkv, P, d] for K and for V); no windows, no rotation.
//
// Accuracy (reduction order is free): per query head,
// max_j |out - ref| / max_j |ref| <= kGpuAttentionTolerance against the fp64 reference over the
// same stored rows (cpu::AttendReferenceF64). The tensor-core operands are exact (codes, bf16
// rows) or bf16 hi + lo pairs (queries, p, p * scale: 2^-17 relative); the largest remaining
// term is the fp32 cancellation of the codes' +128 bias in QK^T of the history (~1e-4 of the
// output at most): see gpu/tests/attention_test.cu.
//
// Spec 1.1: affine_tile keys (KIVI / OScaR: per-channel scale and min over tiles of G_k
// tokens, an optional norm per token) over per-token values; the flush F (the recent ring holds
// W + F - 1 slots), W = 0 and S0 = 0 (no window blocks at all when S0 + W + F - 1 = 0), G = d.
// A tile's scales are folded into the query (spec/cache.md §5.1: a = q~ o s^, c = q~ . m^,
// logits x n^) and the codes enter the tensor cores as exact integers against a.
//
// K and V apart: the INT-b keys (per token or tiled) and the per-token INT-b values each have
// their own width (K4V2, K2V4: kvq/gpu/formats.h's kind lists and DecodePair).
//
// Unsupported here (kvq::Error kUnsupported naming the value): a format (and bits) not in the
// kernels' kind lists (attention::IsKeyKind / IsValueKind: e.g. 3-bit codes), K and V kinds no
// loop pairs (attention::DecodePair: e.g. INT-b keys over fp8 values, tiled values), a group G
// smaller than d*b/8 of its side (d = 128: INT4 with G = 32; d = 256: INT2 with G = 32, INT4
// with G < 128), G = d = 256, a key tile G_k * b / 8 other than 8 or 16 bytes a channel
// (G_k = 128; INT4 with G_k = 64),
// g = Hq/Hkv above 8 that is not a multiple of 8.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/rotation.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {

using attention::QuantLoop;

inline constexpr double kGpuAttentionTolerance = 1e-3;

// Device pointers of one decode step. Pools follow spec/cache.md §4 (and kvq::gpu::PagePool):
// plane i of LayoutOf(c.key) / LayoutOf(c.value) at key_planes[i] / value_planes[i],
// [num_pages, Hkv, RowsPerPage(i), row_bytes(i)] (affine_token: codes u8 [.., P, d*b/8],
// scale / min bf16 [.., P, d/G]; bf16 cache: rows bf16 [.., P, d]). All pool and window
// pointers 16-byte aligned.
struct DecodeAttentionInputs {
  int batch = 0;                         // B >= 1
  int max_seq_len = 0;                   // host-side bound on every seq_lens[b]; sizes the grid
  const int32_t* seq_lens = nullptr;     // [B] t >= 1 (t < 1 or t > max_seq_len -> NaN output)
  const int32_t* page_tables = nullptr;  // [B, max_pages]: history token i of sequence b in
  int max_pages = 0;                     //   page page_tables[b*max_pages + i/P], slot i % P
  const uint8_t* key_planes[kMaxPlanes] = {};
  const uint8_t* value_planes[kMaxPlanes] = {};
  // Quantized cache: bf16 windows, batched as kvq::gpu::Windows: sink [B, S0, Hkv, d],
  // recent ring [B, W + F - 1, Hkv, d] (position p at slot p % (W + F - 1)). Ignored for a bf16 cache.
  const uint16_t* sink_key = nullptr;
  const uint16_t* sink_value = nullptr;
  const uint16_t* recent_key = nullptr;
  const uint16_t* recent_value = nullptr;
  // The per-head data of K and of V (head_data.inc): `rotation` fp32 [Hkv, d, d] row-major when
  // that side uses RotationKind::kDense, else ignored; `scale` fp32 [Hkv], the fp8 scales s^,
  // required for fp8_e4m3 history (spec 1.2), else ignored. The clip ratios are write data.
  HeadData key_heads;
  HeadData value_heads;
  const float* q = nullptr;              // [B, Hq, d] fp32 (bf16 values are the fast case)
  // Profiling, null in production: device u64 [4 * DecodeStepBlocks::total()] that receives one
  // record per block of the step's kernels, the rotation's blocks first, then the decode
  // kernel's, then the merge's (attention::BlockKind, DecodeKernelParams::timeline).
  uint64_t* timeline = nullptr;
};

// How the work is cut; PlanDecodeAttention picks it from the shapes and the device.
struct DecodeAttentionPlan {
  int hist_splits = 0;             // history (bf16 cache: all tokens) splits per sequence
  int hist_tokens_per_split = 0;   // multiple of 64
  int window_splits = 0;           // bf16 window splits (quantized cache)
  // Multiple of 64: 64 while the window blocks fit one wave of resident decode blocks, else
  // longer (the fewest splits that fit, at least one of the whole window).
  int window_tokens_per_split = 0;
  // The quantized history's loop, chosen here once (the launcher and the kernel obey it; a
  // bf16 cache ignores it). Every loop finishes QK^T once per quantization group (the group
  // size a compile-time value: one accumulator and one scale / min epilogue per group, 16%
  // fewer instructions and 8-17% faster than once per code field on the H100) and takes one
  // 16-token chunk per warp and loop step (two side by side measured 2-7% slower on the H100).
  //  - kInt8Qk, at most 4 query heads per block (g <= 4): QK^T on the int8 tensor cores
  //    (mma m16n8k32 u8 x s8): the codes enter as bytes masked out of the packed words, the
  //    query as two int8 digits of Q = round(q~ / sq) (|Q| <= 32512, sq = max|q~| / 32512 per
  //    head), the sums are exact int32. The plan's choice where it applies.
  //  - kPacked, g <= 4 where the keys' format has no int8 loop (tiled keys, codebook rows) or
  //    int8 is refused (allow_int8_qk = false): bf16 MMAs with the hi and lo parts of the query
  //    (QK^T) and of p * scale (PV) in the two halves of the MMA's N = 8 columns (heads h and
  //    h + 4), so each product is one MMA instead of two.
  //  - kTwoMma, g > 4: bf16 MMAs, hi and lo parts in two MMAs.
  QuantLoop quant_loop = QuantLoop::kTwoMma;
  // Query heads per block of the step's two small kernels, the query rotation and the merge:
  // 1 while the step has at most 2 query heads per multiprocessor (the lowest latency: the
  // rotation stands between the step's start and the history blocks' first logits, the merge
  // at its end), else min(g, 8), so that R_K and R_V are read from L2 once per KV head instead
  // of once per query head and the blocks fit one wave (H100, B = 32: 1024 merge blocks
  // reading 64 KB of R_V each took 16 us of a 303 us step).
  int aux_heads_per_block = 1;
  size_t workspace_bytes = 0;      // device scratch DecodeAttention needs
};

// Quantized cache: history splits in whole waves of resident decode blocks
// (attention::ResidentDecodeBlocksPerSm: 4 per SM, 2 at d = 256), the fewest waves with splits
// of at most 8192 tokens, and window splits as DecodeAttentionPlan says; bf16 cache: about 8
// blocks per SM over the grid (num_sms <= 0: ask the current device). allow_int8_qk = false
// plans for the bf16 QK loops (a baseline: kPacked at g <= 4). Throws kvq::Error like
// DecodeAttention.
DecodeAttentionPlan PlanDecodeAttention(const CacheParams& c, int batch, int max_seq_len,
                                        int num_sms = 0, bool allow_int8_qk = true);

// Device scratch a step with `plan` needs (q~, the partials of its splits, DecodeStep's words
// of the rotation blocks); the planner's
// plan.workspace_bytes. Call it again after changing a plan's splits.
size_t DecodeAttentionWorkspaceBytes(const CacheParams& c, int batch,
                                     const DecodeAttentionPlan& plan);

// Blocks of each kernel of a step (the rotation runs only for a quantized cache).
struct DecodeStepBlocks {
  int64_t rotate = 0;
  int64_t decode = 0;
  int64_t merge = 0;
  int64_t total() const { return rotate + decode + merge; }
};
DecodeStepBlocks DecodeAttentionBlocks(const CacheParams& c, int batch,
                                       const DecodeAttentionPlan& plan);

// out [B, Hq, d] fp32 = attention of q over each sequence's cache. `workspace` (device, at
// least plan.workspace_bytes, 256-byte aligned) holds q~ and the split partials. Queues three
// kernels on `stream`; does not synchronise. Throws kvq::Error: invalid CacheParams
// (kInvalidArgument), a configuration listed above (kUnsupported), null or misaligned pointers,
// batch < 1, max_seq_len < 1, workspace too small (kInvalidArgument), a CUDA error
// (KVQ_CUDA_CHECK).
void DecodeAttention(const CacheParams& c, const DecodeAttentionInputs& in,
                     const DecodeAttentionPlan& plan, void* workspace, size_t workspace_bytes,
                     float* out, cudaStream_t stream = nullptr);

// A layer's whole decode step as a serving engine runs it: AppendStep of each sequence's new
// token (key / value bf16 [B, Hkv, d], lengths [B] the lengths before the step, into the
// cache's pools and windows; write.h), then DecodeAttention over the cache (in.seq_lens: the
// lengths after it). The same bits as the two calls one after the other (the cache's and the
// output's), without the gap between them (programmatic dependent launch: each kernel starts
// while the one before it runs). Where a side has a dense rotation (its append is the longest)
// the query rotation goes first and marks each of its blocks done in the workspace, the append
// and the decode follow, and the history blocks wait for their rotation blocks, not for the
// append, before their first logit; otherwise the append goes first, the rotation completes
// after it, and the history blocks start their page copies at once and wait for the rotation
// before their first logit. Either way the one history split holding the tokens the append
// demotes or flushes waits for the append before it copies their tile, and the window splits
// (the new token's row) before they read anything. `in` must name the cache the append writes
// (its planes the pools', its windows the same buffers) and in.batch the append's batch.
// Queues the append's launches, the rotation, the decode and the merge; does not synchronise.
// Throws what AppendStep and DecodeAttention throw, and kUnsupported for a bf16 cache (which
// has no append).
void DecodeStep(const CacheParams& c, const uint16_t* key, const uint16_t* value,
                const int32_t* lengths, const PagePool& key_pool, const PagePool& value_pool,
                const Windows& windows, int* error_flags, const DecodeAttentionInputs& in,
                const DecodeAttentionPlan& plan, void* workspace, size_t workspace_bytes,
                float* out, cudaStream_t stream = nullptr);

}  // namespace kvq::gpu
