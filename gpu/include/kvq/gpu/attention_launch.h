// Layers (a) and (b) of the CUDA decode attention (spec/cache.md §5): the kernel parameter
// structs and the launchers templated on HEAD_DIM / history format. The runtime API that
// validates CacheParams and sizes the grid is kvq/gpu/attention.h; use that unless you are a
// test or a benchmark that needs one kernel alone.
//
// One decode step is three kernels on one stream (the second and third launched with
// programmatic dependent launch, so each starts while its predecessor drains):
//   1. RotateQueries: q~ = q·R_K (then P_br), fp32, the spec's rotation rule bit for bit; a
//      block per query head, or per 2-8 heads of one KV head at large batches (they share R_K).
//   2. DecodeAttention: grid (Hkv * head_chunks, B, hist_splits + window_splits). A block owns
//      one KV head, one sequence and one split, and serves all (up to 8) query heads that read
//      the KV head, so every K/V byte is loaded once per step. History splits stream INT-b pages
//      (or bf16 pages for the bf16 cache) through a copy pipeline (INT-b: cp.async.bulk page runs
//      completing on one mbarrier per stage, released by a second one once every thread read
//      the stage, so the INT-b loop has no block-wide barrier; bf16: cp.async) and run QK^T and PV on the
//      tensor cores (mma.sync m16n8k16); window splits do the same over the bf16 sink + recent
//      rows. Each block writes one partial (m, l, acc[d]) per query head.
//      Every block lets the merge launch as it starts, so the merge's blocks take the slots
//      the decode blocks leave and wait there.
//   3. MergePartials: log-sum-exp over the splits, R_V^T (RotateInverse of the value params)
//      applied once to the history partial, plus the bf16 partial, divided by the sum; blocks
//      as the rotation's.
// DecodeKernelParams::timeline (and the other two kernels' timeline) records when each block
// ran, for profiling (kvq_bench_gpu_attention --timeline).
//
// All pointers are device pointers. Launchers launch and return cudaGetLastError(); they do
// not synchronise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvq/common/format.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"

namespace kvq::gpu::attention {

// The history kinds (HistoryKind, the per-side lists, DecodePair) are in kvq/gpu/formats.h.

// The loops of a quantized history's decode blocks, a kernel instantiation each. The planner
// (PlanDecodeAttention) picks one per step; the launcher and the kernel obey it.
enum class QuantLoop : int {
  kTwoMma = 0,  // bf16 MMAs, the hi and lo parts of the query and of p * scale in two MMAs
  kPacked = 1,  // bf16 MMAs, hi and lo in the column halves h and h + 4 (heads per block <= 4)
  kInt8Qk = 2,  // QK^T on the int8 tensor cores (heads per block <= 4)
};
// The loop bits of kvq/gpu/formats.h's DecodeFormat::loops.
constexpr unsigned LoopBit(QuantLoop loop) { return 1u << static_cast<int>(loop); }
static_assert(LoopBit(QuantLoop::kTwoMma) == kTwoMmaLoop &&
                  LoopBit(QuantLoop::kPacked) == kPackedLoop &&
                  LoopBit(QuantLoop::kInt8Qk) == kInt8QkLoop,
              "formats.h's loop bits");

// Tokens per pipeline stage of the decode kernel (4 warps x 16 tokens); split lengths are
// multiples of it.
inline constexpr int kTileTokens = 64;
// Longest split (tokens); a block keeps the split's page ids in shared memory.
inline constexpr int kMaxSplitTokens = 8192;
// Most query heads one block serves (the N = 8 side of the tensor-core tiles).
inline constexpr int kMaxHeadsPerBlock = 8;

// Decode blocks a multiprocessor holds at once, which the kernel's register cap guarantees
// (__launch_bounds__: <= 128 registers a thread at d <= 128) and the planner sizes its waves
// with. (Five blocks of the int8 QK loop, <= 102 registers, spilled and measured no faster.)
constexpr int ResidentDecodeBlocksPerSm(int head_dim) { return head_dim >= 256 ? 2 : 4; }

// What a block of a decode step's kernels did, in BlockTimeline records (profiling).
enum class BlockKind : uint32_t { kRotate = 0, kHistory = 1, kWindow = 2, kEmpty = 3, kMerge = 4 };

struct DecodeKernelParams {
  int batch = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int q_per_kv = 1;          // g = Hq / Hkv
  int heads_per_block = 1;   // min(g, 8); g % heads_per_block == 0
  int head_chunks = 1;       // g / heads_per_block

  // Cache geometry (spec/cache.md §2). A quantized cache: sink [0, min(S0, t)), history
  // [S0, S0 + H(t)) with H(t) = F * floor(max(0, t - S0 - W) / F), recent [S0 + H(t), t) in a
  // ring of W + F - 1 slots. A bf16 cache (format kBf16): every token [0, t) is a paged row.
  int sink = 0;
  int recent = 1;            // W >= 0
  int flush = 1;             // F >= 1
  int ring_slots = 1;        // W + F - 1 (position p at slot p % ring_slots)
  int page_size_log2 = 6;
  int key_group = 64;        // G of K (affine_token: channels; affine_tile: G_k tokens) and of V
  int value_group = 64;
  bool key_norm = false;     // tile keys: the norm plane (kTileNormPlane) multiplies the logits

  // Work partition: history split z covers history tokens [z*T, (z+1)*T), T =
  // hist_tokens_per_split (a multiple of kTileTokens); window split w covers window tokens
  // [w*T', (w+1)*T') in the order sink rows then recent positions ascending.
  // hist_tokens_per_split <= kMaxSplitTokens.
  int hist_splits = 0;
  int hist_tokens_per_split = kTileTokens;
  int window_splits = 0;
  int window_tokens_per_split = kTileTokens;

  // Quantized history: the loop (DecodeAttentionPlan::quant_loop), which selects the kernel
  // instantiation; kTwoMma for a bf16 cache.
  QuantLoop quant_loop = QuantLoop::kTwoMma;

  float logit_scale_log2 = 0.0f;  // softmax scale * log2(e): logits in the exp2 domain
  uint32_t code_bias = 0x43004300u;  // two bf16 128.0: codes enter the MMA as 128 + q

  const int32_t* seq_lens = nullptr;     // [B] t per sequence
  const int32_t* page_tables = nullptr;  // [B, page_table_stride]
  int64_t page_table_stride = 0;

  const float* q = nullptr;      // [B, Hq, d] fp32, original space (bf16 rows)
  const float* q_rot = nullptr;  // [B, Hq, d] fp32, q·R_K (then P_br) (quantized history)

  // bf16 windows in the batched layout of the write path (kvq::gpu::Windows): sink
  // [B, S0, Hkv, d], recent ring [B, W + F - 1, Hkv, d] (position p of sequence b at slot
  // p % (W + F - 1)).
  const uint16_t* sink_k = nullptr;
  const uint16_t* sink_v = nullptr;
  const uint16_t* recent_k = nullptr;
  const uint16_t* recent_v = nullptr;

  // History pools, one per plane of LayoutOf(key) / LayoutOf(value) (kvq/gpu/formats.h says
  // where the kernels find each: affine_token codes, scale, min; bf16 rows). Page pg of plane i
  // starts at k_planes[i] + pg * k_page_stride[i] bytes (FormatLayout::PageBytes(i, P, Hkv))
  // and holds [Hkv, P, row_bytes(i)].
  // Inside a page, KV head kvh's rows of plane i start kvh * k_head_stride[i] bytes in
  // (RowsPerPage(i) * row_bytes(i); 0 for a plane shared by the KV heads).
  const uint8_t* k_planes[kMaxPlanes] = {};
  const uint8_t* v_planes[kMaxPlanes] = {};
  int64_t k_page_stride[kMaxPlanes] = {};
  int64_t v_page_stride[kMaxPlanes] = {};
  int64_t k_head_stride[kMaxPlanes] = {};
  int64_t v_head_stride[kMaxPlanes] = {};

  // Partials, split s = z of the grid: part_ml [B, Hq, splits, 2] (m in the exp2 domain, l),
  // part_acc [B, Hq, splits, d]. An empty split writes m = -inf, l = 0 and no acc.
  float* part_ml = nullptr;
  float* part_acc = nullptr;

  // Profiling, null in production: block i (x fastest, then y, then z) writes BlockTimeline's
  // record to timeline[4 i .. 4 i + 3] (entry, inputs ready: a history block's rotated queries, exit, SM and kind).
  uint64_t* timeline = nullptr;

  // Launch with programmatic dependent launch after the kernel before it on the stream
  // (RotateQueries, or a DecodeStep's last append kernel): blocks set up and start their page
  // copies while it finishes, and wait for it (or for query_ready) before reading q_rot. Only
  // when everything the pages, tables and windows depend on finished before that kernel
  // started, or append_lengths names what did not.
  bool programmatic_launch = false;
  // A decode step whose append still runs (kvq::gpu::DecodeStep): the append took these
  // lengths [B] (each sequence's length before it: its new token is position
  // append_lengths[b]) and the kernel before this one completes only after it. A window split
  // (it reads the new token's sink or ring row) waits for that kernel before it reads anything;
  // the history split holding the tokens the append demotes or flushes (history tokens
  // [H(L), H(L + 1)) for L = append_lengths[b]) waits for it before it copies their tile, and
  // copies the tiles before it at once. Null: no append runs (every page was written before
  // the rotation kernel started).
  const int32_t* append_lengths = nullptr;
  // A DecodeStep's rotation, launched before its append, marks each of its blocks done in
  // query_ready (RotateQueriesParams::ready, its blocks of query_ready_heads heads): a block
  // waits for the words of the rotation blocks of its heads before it reads q_rot, not for the
  // kernel before it, so the history never waits for the append. Null: every block waits for
  // the kernel before it.
  const int* query_ready = nullptr;
  int query_ready_heads = 1;

  // fp8_e4m3 history (kFp8): the per-KV-head scales s^ of K and V, [Hkv] fp32 (null otherwise).
  const float* k_head_scale = nullptr;
  const float* v_head_scale = nullptr;

  // codebook history (spec 1.3), per side: the block widths of KV head h at widths + h * d/2
  // (null: every block at `bits`), a row's code bytes and norm slots, and the density's tables
  // (kvq/gpu/codebook.h).
  const uint8_t* k_widths = nullptr;
  const uint8_t* v_widths = nullptr;
  int k_bits = 0, v_bits = 0;
  int k_code_bytes = 0, v_code_bytes = 0;
  int k_segments = 1, v_segments = 1;
  const float* k_codebook = nullptr;
  const float* v_codebook = nullptr;
};

// Most query heads one block of the rotation or of the merge takes (heads of one KV head,
// which share its R_K / R_V): 8, and at most kAuxMaxThreads / d (a rotation block has a
// thread per channel and head).
inline constexpr int kAuxMaxHeads = 8;
inline constexpr int kAuxMaxThreads = 1024;
constexpr int MaxAuxHeads(int head_dim) {
  return kAuxMaxThreads / head_dim < kAuxMaxHeads ? kAuxMaxThreads / head_dim : kAuxMaxHeads;
}
// The most heads of one KV head a rotation / merge block can take: the largest divisor of g
// within MaxAuxHeads(head_dim).
constexpr int WidestAuxHeads(int g, int head_dim) {
  int h = MaxAuxHeads(head_dim) < g ? MaxAuxHeads(head_dim) : g;
  while (g % h != 0) --h;
  return h;
}

struct RotateQueriesParams {
  int batch = 0;
  int num_q_heads = 0;
  int q_per_kv = 1;
  // Query heads a block rotates (consecutive heads of one KV head): 1 (the most blocks, the
  // lowest latency) .. MaxAuxHeads(d); q_per_kv % heads_per_block == 0.
  int heads_per_block = 1;
  RotationArgs rotation;            // of the key write path (MakeRotationArgs)
  const float* q = nullptr;         // [B, Hq, d]
  float* q_rot = nullptr;           // [B, Hq, d]
  uint64_t* timeline = nullptr;     // profiling, as DecodeKernelParams::timeline
  // Launch with programmatic dependent launch after the kernel before it on the stream (a
  // DecodeStep's append, where it goes after it): it rotates at once, and completes only after
  // that kernel.
  bool programmatic_launch = false;
  // A word a block, [B, num_q_heads / heads_per_block] (block (x, y) at y * gridDim.x + x),
  // null: none (DecodeKernelParams::query_ready). A block sets its word to 0 before it lets
  // the kernel after it launch, and to 1 once its rows of q_rot are written and visible; so a
  // kernel launched after it (directly, or behind kernels launched the same way) never sees
  // an earlier value, whatever the workspace held.
  int* ready = nullptr;
};

struct MergeParams {
  int batch = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int q_per_kv = 1;
  // Query heads a block merges, as RotateQueriesParams::heads_per_block.
  int heads_per_block = 1;
  int hist_splits = 0;    // partials [0, hist_splits) are history partials
  int total_splits = 0;   // then window partials up to total_splits
  int max_seq_len = 0;    // a sequence with t < 1 or t > max_seq_len gets NaN outputs
  const int32_t* seq_lens = nullptr;  // [B]
  // RotateInverse of the value write path, applied to the history partial (quantized cache):
  // dense o = y · R_Vᵀ, the FWHT (its own inverse), the bit reversal (an involution).
  bool rotate_history = false;
  RotationArgs rotation;             // of the value write path (MakeRotationArgs)
  const float* part_ml = nullptr;
  const float* part_acc = nullptr;
  float* out = nullptr;              // [B, Hq, d] fp32
  uint64_t* timeline = nullptr;      // profiling, as DecodeKernelParams::timeline
  // Launch with programmatic dependent launch after the decode kernel on the same stream (the
  // merge waits for it before reading anything).
  bool programmatic_launch = false;
};

// Layer (b). HEAD_DIM in {64, 128, 256}; the launchers trust their parameters (the runtime API
// validates) and return cudaErrorInvalidValue only for a grid they cannot form.
// K, V: the keys' and the values' HistoryKind (kvq/gpu/formats.h); a pair DecodePair refuses
// returns cudaErrorInvalidValue.
template <int HEAD_DIM, class K, class V>
cudaError_t LaunchDecodeAttention(const DecodeKernelParams& p, cudaStream_t stream);
// The dynamic shared memory LaunchDecodeAttention<HEAD_DIM, K, V> asks for (0: no kernel).
template <int HEAD_DIM, class K, class V>
int DecodeSharedBytesOf();
template <int HEAD_DIM>
cudaError_t LaunchRotateQueries(const RotateQueriesParams& p, cudaStream_t stream);
template <int HEAD_DIM>
cudaError_t LaunchMergePartials(const MergeParams& p, cudaStream_t stream);

// Dispatch on runtime values; unsupported head_dim / kinds return cudaErrorInvalidValue.
cudaError_t DispatchDecodeAttention(int head_dim, const DecodeKinds& kinds,
                                    const DecodeKernelParams& p, cudaStream_t stream);
cudaError_t DispatchRotateQueries(int head_dim, const RotateQueriesParams& p,
                                  cudaStream_t stream);
cudaError_t DispatchMergePartials(int head_dim, const MergeParams& p, cudaStream_t stream);

// Dynamic shared memory the decode kernel of (head_dim, kinds) needs, in bytes (0: no kernel).
int DecodeSharedBytes(int head_dim, const DecodeKinds& kinds);

}  // namespace kvq::gpu::attention
