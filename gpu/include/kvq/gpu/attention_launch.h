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

namespace kvq::gpu::attention {

// Storage of the history pages. kInt2 / kInt4: codes + bf16 (scale, min) per group;
// kBf16: the bf16 baseline cache, every token a bf16 row in the pages (no sink / recent).
enum class HistoryFormat : int { kInt2 = 2, kInt4 = 4, kBf16 = 16 };

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

  // Cache geometry. A quantized cache: sink [0, min(S0,t)), history [S0, t-W), recent
  // [max(S0, t-W), t). A bf16 cache (format kBf16): every token [0, t) is a paged row.
  int sink = 0;
  int recent = 1;
  int page_size_log2 = 6;
  int key_group = 64;        // G of K and of V (quantized formats)
  int value_group = 64;

  // Work partition: history split z covers history tokens [z*T, (z+1)*T), T =
  // hist_tokens_per_split (a multiple of kTileTokens); window split w covers window tokens
  // [w*T', (w+1)*T') in the order sink rows then recent positions ascending.
  // hist_tokens_per_split <= kMaxSplitTokens.
  int hist_splits = 0;
  int hist_tokens_per_split = kTileTokens;
  int window_splits = 0;
  int window_tokens_per_split = kTileTokens;

  // Quantized history: 16-token chunks a warp takes per loop step (1 or 2; see QuantSplit).
  int chunks_per_warp = 1;
  // Quantized history, heads_per_block <= 4: hi / lo parts in MMA columns h / h + 4 (one MMA
  // per product; see DecodeAttentionPlan::pack_hi_lo).
  bool pack_hi_lo = false;
  // Quantized history: QK^T finished once per quantization group with G as a compile-time
  // value (chunks_per_warp must be 1); false: once per code field.
  bool group_epilogue = false;
  // Quantized history, heads_per_block <= 4: QK^T on the int8 tensor cores (codes as u8, the
  // query as two int8 digits; see DecodeAttentionPlan::int8_qk). Takes precedence over
  // pack_hi_lo, chunks_per_warp and group_epilogue (it has one loop shape: the group epilogue,
  // one chunk per warp step).
  bool int8_qk = false;

  float logit_scale_log2 = 0.0f;  // softmax scale * log2(e): logits in the exp2 domain
  uint32_t code_bias = 0x43004300u;  // two bf16 128.0: codes enter the MMA as 128 + q

  const int32_t* seq_lens = nullptr;     // [B] t per sequence
  const int32_t* page_tables = nullptr;  // [B, page_table_stride]
  int64_t page_table_stride = 0;

  const float* q = nullptr;      // [B, Hq, d] fp32, original space (bf16 rows)
  const float* q_rot = nullptr;  // [B, Hq, d] fp32, q·R_K (then P_br) (quantized history)

  // bf16 windows in the batched layout of the write path (kvq::gpu::Windows): sink
  // [B, S0, Hkv, d], recent ring [B, W, Hkv, d] (position p of sequence b at slot p % W).
  const uint16_t* sink_k = nullptr;
  const uint16_t* sink_v = nullptr;
  const uint16_t* recent_k = nullptr;
  const uint16_t* recent_v = nullptr;

  // History pools. Page pg of K codes starts at k_codes + pg * k_codes_page_stride (bytes) and
  // holds [Hkv, P, row] (row = d*b/8 code bytes, or d bf16 for kBf16); scale / min of page pg
  // start at k_scale / k_min + pg * k_meta_page_stride bytes and hold bf16 [Hkv, P, d/G].
  const uint8_t* k_codes = nullptr;
  const uint8_t* v_codes = nullptr;
  const uint16_t* k_scale = nullptr;
  const uint16_t* k_min = nullptr;
  const uint16_t* v_scale = nullptr;
  const uint16_t* v_min = nullptr;
  int64_t k_codes_page_stride = 0;
  int64_t v_codes_page_stride = 0;
  int64_t k_meta_page_stride = 0;
  int64_t v_meta_page_stride = 0;

  // Partials, split s = z of the grid: part_ml [B, Hq, splits, 2] (m in the exp2 domain, l),
  // part_acc [B, Hq, splits, d]. An empty split writes m = -inf, l = 0 and no acc.
  float* part_ml = nullptr;
  float* part_acc = nullptr;

  // Profiling, null in production: block i (x fastest, then y, then z) writes BlockTimeline's
  // record to timeline[4 i .. 4 i + 3] (entry, inputs ready: a history block's rotated queries, exit, SM and kind).
  uint64_t* timeline = nullptr;

  // Launch with programmatic dependent launch after RotateQueries on the same stream: blocks
  // set up and start their page copies while the rotation finishes, and wait for it before
  // reading q_rot. Only when that kernel is the one launched just before on the stream (and
  // everything the pages, tables and windows depend on finished before it started).
  bool programmatic_launch = false;
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
  int rotation = 0;                 // kvq::RotationKind as int
  const float* rotations = nullptr; // [Hkv, d, d] (kDense)
  int fwht_block = 0;
  float fwht_scale = 0.0f;          // fp32(1/sqrt(fwht_block)) computed in double
  bool bitrev = false;
  const float* q = nullptr;         // [B, Hq, d]
  float* q_rot = nullptr;           // [B, Hq, d]
  uint64_t* timeline = nullptr;     // profiling, as DecodeKernelParams::timeline
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
  // RotateInverse of the value write path, applied to the history partial (quantized cache).
  bool rotate_history = false;
  int rotation = 0;                  // kvq::RotationKind as int
  const float* rotations = nullptr;  // [Hkv, d, d] (kDense): o = y · R_Vᵀ
  int fwht_block = 0;
  float fwht_scale = 0.0f;
  bool bitrev = false;
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
template <int HEAD_DIM, HistoryFormat FORMAT>
cudaError_t LaunchDecodeAttention(const DecodeKernelParams& p, cudaStream_t stream);
template <int HEAD_DIM>
cudaError_t LaunchRotateQueries(const RotateQueriesParams& p, cudaStream_t stream);
template <int HEAD_DIM>
cudaError_t LaunchMergePartials(const MergeParams& p, cudaStream_t stream);

// Dispatch on runtime values; unsupported head_dim / format returns cudaErrorInvalidValue.
cudaError_t DispatchDecodeAttention(int head_dim, HistoryFormat format,
                                    const DecodeKernelParams& p, cudaStream_t stream);
cudaError_t DispatchRotateQueries(int head_dim, const RotateQueriesParams& p,
                                  cudaStream_t stream);
cudaError_t DispatchMergePartials(int head_dim, const MergeParams& p, cudaStream_t stream);

// Dynamic shared memory the decode kernel of (head_dim, format) needs, in bytes.
int DecodeSharedBytes(int head_dim, HistoryFormat format);

}  // namespace kvq::gpu::attention
