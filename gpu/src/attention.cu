// Runtime API of the CUDA decode attention (kvq/gpu/attention.h): validation, planning and the
// three launches.
#include "kvq/gpu/attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/codebook.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"

#include "append_step.h"

namespace kvq::gpu {
namespace {

using attention::DecodeFormatOf;
using attention::DecodeKinds;
using attention::RowGeometry;
using attention::kInt8QkLoop;
using attention::kPackedLoop;
using attention::kTileTokens;

// The window's tokens per split: a multiple of this, and this many while the window blocks
// fit one wave of resident decode blocks. Window blocks are latency-bound (H100: 64 bf16
// tokens took 7.7-9.5 us, 128 about 11.5 us), so short splits finish first; but beyond a wave
// they queue behind one another in the step's tail, and fewer, longer splits measured faster
// (H100, against 64-token splits: B = 16 T = 8K -4.6% with 128, B = 32 T = 32K -1.7% and
// B = 128 T = 8K -5.2% with 320; B = 8 T = 32K, one wave of 320 window blocks, +3% with 128).
constexpr int kWindowTokensPerSplit = 64;
// A window block (64 bf16 tokens) takes about as long as a history block needs for this many
// INT-b tokens (H100, B = 1: ~7.7 us against ~44 history tokens a microsecond per block; with
// 128 tokens a window block took ~11.5 us and the B = 8, T = 32K step was 2.4% slower).
constexpr int64_t kWindowBlockTokens = 320;
// The rotation and merge take a block per query head while there are at most this many query
// heads a multiprocessor (H200, B = 8 with 32 heads: a block per KV head made both 2x longer).
constexpr int64_t kAuxHeadBlocksPerSm = 2;
constexpr int kMinHistTokensPerSplit = 4 * kTileTokens;
// bf16 cache: blocks per multiprocessor over the grid the planner aims at (its pipeline is
// shallow; the quantized cache sizes waves by attention::ResidentDecodeBlocksPerSm instead).
constexpr int kBf16BlocksPerSm = 8;

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Validates what the kernels rely on and returns the cache's history kinds: the one place
// where the cache's formats and widths meet the kernels' kind lists (kvq/gpu/formats.h).
DecodeKinds CheckSupported(const CacheParams& c) {
  c.Validate();
  const int d = c.head_dim();
  const int g = c.group_size();
  KVQ_CHECK(g <= attention::kMaxHeadsPerBlock || g % attention::kMaxHeadsPerBlock == 0,
            kUnsupported, "GQA group Hq/Hkv = ", g,
            " is not supported by the CUDA decode attention (at most 8, or a multiple of 8)");
  const DecodeKinds kinds{c.key.format, attention::KindBits(c.key), c.value.format,
                          attention::KindBits(c.value)};
  KVQ_CHECK(attention::IsKeyKind(kinds.key_format, kinds.key_bits), kUnsupported,
            "key format ", FormatName(kinds.key_format), " with ", kinds.key_bits,
            " bits is not supported by the CUDA decode attention");
  KVQ_CHECK(attention::IsValueKind(kinds.value_format, kinds.value_bits), kUnsupported,
            "value format ", FormatName(kinds.value_format), " with ", kinds.value_bits,
            " bits is not supported by the CUDA decode attention");
  KVQ_CHECK(attention::DecodeKindsServed(kinds), kUnsupported, "key ",
            FormatName(kinds.key_format), " (bits ", kinds.key_bits, ") and value ",
            FormatName(kinds.value_format), " (bits ", kinds.value_bits,
            ") are not a pair the CUDA decode attention serves (bf16 or fp8_e4m3 on both "
            "sides, or affine_token / affine_tile keys over affine_token values)");
  CheckKernelLayout(c.key, "CUDA decode attention (key)");
  CheckKernelLayout(c.value, "CUDA decode attention (value)");
  // What each side's row geometry asks of its groups and tiles (whole rows: nothing).
  const RowGeometry keys = DecodeFormatOf(c.key.format).geometry;
  const RowGeometry values = DecodeFormatOf(c.value.format).geometry;
  if (keys == RowGeometry::kKeyTiles) {
    const int slice = c.key.tile_channel_bytes();
    KVQ_CHECK(slice == 8 || slice == 16, kUnsupported, "key tile of ", c.key.group,
              " tokens at ", c.key.bits, " bits (", slice,
              " bytes a channel) is not supported by the CUDA decode attention (8 or 16: "
              "INT2 with G_k = 32 or 64, INT4 with G_k = 32)");
  }
  for (const WriteParams* side : {&c.key, &c.value}) {
    if ((side == &c.key ? keys : values) != RowGeometry::kChannelGroups) continue;
    const char* name = side == &c.key ? "key" : "value";
    const int row_bytes = d * side->bits / 8;
    KVQ_CHECK(side->group >= row_bytes, kUnsupported, name, " group ", side->group,
              " is below d*b/8 = ", row_bytes, " (not supported by the CUDA decode attention)");
    KVQ_CHECK(IsSupportedGroup(side->group), kUnsupported, name, " group ", side->group,
              " (G = d = 256, spec 1.1) is not supported by the CUDA decode attention (32, 64 "
              "or 128)");
  }
  return kinds;
}

// Tokens of the windows a step of max_seq_len reads at most (sink + recent ring), and history
// tokens at most: H(max_seq_len); a bf16 cache pages every token.
int64_t WindowTokens(const CacheParams& c, int64_t max_seq_len) {
  return c.quantized() ? std::min<int64_t>(max_seq_len, static_cast<int64_t>(c.sink) + c.ring_slots())
                       : 0;
}
int64_t PagedTokens(const CacheParams& c, int64_t max_seq_len) {
  return c.quantized() ? c.HistoryTokens(max_seq_len) : max_seq_len;
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The workspace of a step: q~ [rows, d] fp32, then the partials' (m, l) [rows, splits, 2] and
// acc [rows, splits, d], then DecodeStep's words of the rotation blocks (int32, [rows] at most:
// RotateQueriesParams::ready), each 256-byte aligned.
struct WorkspaceLayout {
  size_t part_ml = 0, part_acc = 0, query_ready = 0, bytes = 0;
  WorkspaceLayout(const CacheParams& c, int64_t batch, const DecodeAttentionPlan& plan) {
    const int64_t rows = batch * c.num_q_heads;
    const int64_t splits = plan.hist_splits + plan.window_splits;
    const int64_t d = c.head_dim();
    part_ml = AlignUp(rows * d * 4, 256);
    part_acc = part_ml + AlignUp(rows * splits * 2 * 4, 256);
    query_ready = part_acc + AlignUp(rows * splits * d * 4, 256);
    bytes = query_ready + AlignUp(rows * 4, 256);
  }
};

}  // namespace

DecodeAttentionPlan PlanDecodeAttention(const CacheParams& c, int batch, int max_seq_len,
                                        int num_sms, bool allow_int8_qk) {
  const DecodeKinds kinds = CheckSupported(c);
  KVQ_CHECK(batch >= 1 && batch <= 65535, kInvalidArgument, "batch ", batch,
            " is outside [1, 65535]");
  KVQ_CHECK(max_seq_len >= 1, kInvalidArgument, "max_seq_len ", max_seq_len, " is below 1");
  if (num_sms <= 0) {
    int device = 0;
    KVQ_CUDA_CHECK(cudaGetDevice(&device));
    KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  }
  const int g = c.group_size();
  const int heads_per_block = std::min(g, attention::kMaxHeadsPerBlock);
  const int64_t blocks_per_split = static_cast<int64_t>(c.num_kv_heads) * (g / heads_per_block) * batch;

  DecodeAttentionPlan plan;
  // Quantized cache: sink + recent rows (bf16, the window blocks) and paged history rows.
  const int64_t window_tokens = WindowTokens(c, max_seq_len);
  const int64_t paged_tokens = PagedTokens(c, max_seq_len);
  // Decode blocks resident at once: a wave.
  const int64_t resident =
      static_cast<int64_t>(attention::ResidentDecodeBlocksPerSm(c.head_dim())) * num_sms;
  // Window splits: 64 tokens each while the window blocks fit one wave, else the fewest that
  // do (at least one split: the whole window, in multiples of 64 tokens).
  int64_t window_split_tokens = kWindowTokensPerSplit;
  if (window_tokens > 0) {
    const int64_t splits = std::max<int64_t>(
        1, std::min<int64_t>(CeilDiv(window_tokens, kWindowTokensPerSplit), resident / blocks_per_split));
    window_split_tokens = CeilDiv(CeilDiv(window_tokens, splits), kWindowTokensPerSplit) *
                          static_cast<int64_t>(kWindowTokensPerSplit);
  }
  if (paged_tokens > 0 && !c.quantized()) {
    // bf16 cache: memory-bound with a 2-stage pipeline, it wants many blocks in flight: about
    // kBf16BlocksPerSm blocks per multiprocessor over the grid (on an H100, one wave of long
    // splits measured 10-17% slower for it).
    const int64_t target_splits = std::max<int64_t>(
        1, (static_cast<int64_t>(kBf16BlocksPerSm) * num_sms + blocks_per_split - 1) /
               blocks_per_split);
    int64_t tokens = (paged_tokens + target_splits - 1) / target_splits;
    tokens = (tokens + kTileTokens - 1) / kTileTokens * kTileTokens;
    tokens = std::max<int64_t>(tokens, kMinHistTokensPerSplit);
    tokens = std::min<int64_t>(tokens, attention::kMaxSplitTokens);
    plan.hist_tokens_per_split = static_cast<int>(tokens);
    plan.hist_splits = CeilDiv(paged_tokens, tokens);
  } else if (paged_tokens > 0) {
    // Quantized history: whole waves of history blocks: the fewest waves w (w * resident
    // blocks) whose splits stay within kMaxSplitTokens. Every history block of a step does
    // about the same work, so a partial last wave would cost a whole block time. The window
    // blocks (highest blockIdx.z, so dispatched last) take the slots that free up first, i.e.
    // they run after a one-wave history unless it leaves them their own slots; it does when
    // that lengthens its splits by less than the history tokens a window block's time is worth
    // (kWindowBlockTokens).
    const int64_t window_blocks = blocks_per_split * CeilDiv(window_tokens, window_split_tokens);
    // Tokens per split when `slots` history blocks share the paged tokens (0: none fits).
    auto split_tokens = [&](int64_t slots) -> int64_t {
      const int64_t splits = slots / blocks_per_split;
      if (splits < 1) return 0;
      int64_t tokens = (paged_tokens + splits - 1) / splits;
      tokens = (tokens + kTileTokens - 1) / kTileTokens * kTileTokens;
      return std::max<int64_t>(tokens, kMinHistTokensPerSplit);
    };
    const int64_t min_splits = (paged_tokens + attention::kMaxSplitTokens - 1) /
                               attention::kMaxSplitTokens;
    int64_t waves = std::max<int64_t>(1, (min_splits * blocks_per_split + resident - 1) / resident);
    int64_t tokens = 0;
    for (;; ++waves) {
      tokens = split_tokens(waves * resident);
      if (tokens > 0 && tokens <= attention::kMaxSplitTokens) break;
    }
    if (waves == 1 && window_blocks < resident) {
      const int64_t beside = split_tokens(resident - window_blocks);
      if (beside > 0 && beside <= attention::kMaxSplitTokens &&
          beside - tokens < kWindowBlockTokens) {
        tokens = beside;
      }
    }
    plan.hist_tokens_per_split = static_cast<int>(tokens);
    plan.hist_splits = CeilDiv(paged_tokens, tokens);
  } else {
    plan.hist_tokens_per_split = kTileTokens;
  }
  if (c.quantized()) {
    plan.window_tokens_per_split = static_cast<int>(window_split_tokens);
    plan.window_splits = CeilDiv(window_tokens, window_split_tokens);
  }
  // The loop: int8 QK^T where a block serves at most 4 query heads, else the bf16 MMAs with the
  // hi / lo parts packed into the column halves (g <= 4) or in two MMAs. Tile keys have the
  // bf16 loops only (their folded query changes every tile).
  const unsigned loops = DecodeFormatOf(kinds.key_format).loops;
  if (heads_per_block <= 4 && allow_int8_qk && (loops & kInt8QkLoop)) {
    plan.quant_loop = QuantLoop::kInt8Qk;
  } else if (heads_per_block <= 4 && (loops & kPackedLoop)) {
    plan.quant_loop = QuantLoop::kPacked;
  } else {
    plan.quant_loop = QuantLoop::kTwoMma;
  }
  plan.aux_heads_per_block = static_cast<int64_t>(batch) * c.num_q_heads <= kAuxHeadBlocksPerSm * num_sms
                                    ? 1
                                    : attention::WidestAuxHeads(g, c.head_dim());
  const int splits = plan.hist_splits + plan.window_splits;
  KVQ_CHECK(splits <= 65535, kUnsupported, "max_seq_len ", max_seq_len, " needs ", splits,
            " splits (at most 65535)");
  plan.workspace_bytes = DecodeAttentionWorkspaceBytes(c, batch, plan);
  return plan;
}

size_t DecodeAttentionWorkspaceBytes(const CacheParams& c, int batch,
                                     const DecodeAttentionPlan& plan) {
  return WorkspaceLayout(c, batch, plan).bytes;
}

DecodeStepBlocks DecodeAttentionBlocks(const CacheParams& c, int batch,
                                       const DecodeAttentionPlan& plan) {
  const int g = c.group_size();
  const int64_t rows = static_cast<int64_t>(batch) * c.num_q_heads;
  DecodeStepBlocks n;
  n.rotate = c.quantized() ? rows / std::max(plan.aux_heads_per_block, 1) : 0;
  n.decode = static_cast<int64_t>(c.num_kv_heads) * (g / std::min(g, attention::kMaxHeadsPerBlock)) *
             batch * (plan.hist_splits + (c.quantized() ? plan.window_splits : 0));
  n.merge = rows / std::max(plan.aux_heads_per_block, 1);
  return n;
}

namespace {

// Everything DecodeAttention checks before its first launch; returns the kinds it dispatches on.
DecodeKinds CheckDecode(const CacheParams& c, const DecodeAttentionInputs& in,
                        const DecodeAttentionPlan& plan, const void* workspace,
                        size_t workspace_bytes, const float* out) {
  const DecodeKinds kinds = CheckSupported(c);
  const int d = c.head_dim();
  const int g = c.group_size();
  KVQ_CHECK(in.batch >= 1 && in.batch <= 65535, kInvalidArgument, "batch ", in.batch,
            " is outside [1, 65535]");
  KVQ_CHECK(in.max_seq_len >= 1, kInvalidArgument, "max_seq_len ", in.max_seq_len,
            " is below 1");
  KVQ_CHECK(in.seq_lens && in.q && out && workspace, kInvalidArgument,
            "null seq_lens, q, out or workspace");
  KVQ_CHECK((reinterpret_cast<uintptr_t>(workspace) & 255u) == 0, kInvalidArgument,
            "workspace is not 256-byte aligned");
  const int splits = plan.hist_splits + plan.window_splits;
  KVQ_CHECK(splits >= 1 && plan.hist_tokens_per_split % kTileTokens == 0 &&
                plan.hist_tokens_per_split > 0 &&
                plan.hist_tokens_per_split <= attention::kMaxSplitTokens,
            kInvalidArgument, "invalid plan: ", plan.hist_splits, " history splits of ",
            plan.hist_tokens_per_split, " tokens");
  const int loop = static_cast<int>(plan.quant_loop);
  KVQ_CHECK(plan.quant_loop == QuantLoop::kTwoMma || plan.quant_loop == QuantLoop::kPacked ||
                plan.quant_loop == QuantLoop::kInt8Qk,
            kInvalidArgument, "invalid plan: quant_loop ", loop);
  KVQ_CHECK(plan.quant_loop == QuantLoop::kTwoMma ||
                (c.quantized() && std::min(g, attention::kMaxHeadsPerBlock) <= 4),
            kInvalidArgument, "invalid plan: quant_loop ", loop,
            " (packed or int8) needs a quantized cache and at most 4 query heads per block, g = ",
            g);
  KVQ_CHECK(DecodeFormatOf(kinds.key_format).loops & attention::LoopBit(plan.quant_loop),
            kInvalidArgument, "invalid plan: quant_loop ", loop, " is not a loop of ",
            FormatName(kinds.key_format), " keys");
  KVQ_CHECK(!DecodeFormatOf(kinds.key_format).head_scale || in.key_heads.scale, kInvalidArgument,
            FormatName(kinds.key_format), " keys need the per-head scales (key_heads.scale)");
  KVQ_CHECK(!DecodeFormatOf(kinds.value_format).head_scale || in.value_heads.scale,
            kInvalidArgument, FormatName(kinds.value_format),
            " values need the per-head scales (value_heads.scale)");
  KVQ_CHECK(plan.aux_heads_per_block >= 1 &&
                plan.aux_heads_per_block <= attention::MaxAuxHeads(d) &&
                g % plan.aux_heads_per_block == 0,
            kInvalidArgument, "invalid plan: aux_heads_per_block ", plan.aux_heads_per_block,
            " (1 .. ", attention::MaxAuxHeads(d), " at d = ", d, ", dividing g = ", g, ")");
  // The plan must cover the longest sequence.
  const int64_t paged_tokens = PagedTokens(c, in.max_seq_len);
  KVQ_CHECK(static_cast<int64_t>(plan.hist_splits) * plan.hist_tokens_per_split >= paged_tokens,
            kInvalidArgument, "plan covers ", plan.hist_splits * plan.hist_tokens_per_split,
            " paged tokens, max_seq_len ", in.max_seq_len, " needs ", paged_tokens);
  if (c.quantized()) {
    const int64_t window = WindowTokens(c, in.max_seq_len);
    KVQ_CHECK(static_cast<int64_t>(plan.window_splits) * plan.window_tokens_per_split >= window,
              kInvalidArgument, "plan covers ", plan.window_splits * plan.window_tokens_per_split,
              " window tokens, ", window, " needed");
  }
  // The layout follows the plan's splits (plan.workspace_bytes may predate a change to them).
  const WorkspaceLayout layout(c, in.batch, plan);
  KVQ_CHECK(workspace_bytes >= plan.workspace_bytes && workspace_bytes >= layout.bytes,
            kInvalidArgument, "workspace of ", workspace_bytes, " bytes is below the plan's ",
            std::max(plan.workspace_bytes, layout.bytes));
  const FormatLayout key_layout = LayoutOf(c.key);
  const FormatLayout value_layout = LayoutOf(c.value);
  if (paged_tokens > 0) {
    KVQ_CHECK(in.page_tables && in.max_pages >= CeilDiv(paged_tokens, c.page_size),
              kInvalidArgument, "page tables: null or max_pages ", in.max_pages, " below ",
              CeilDiv(paged_tokens, c.page_size));
    for (int i = 0; i < key_layout.num_planes; ++i) {
      KVQ_CHECK(in.key_planes[i] && Aligned16(in.key_planes[i]), kInvalidArgument,
                "null or misaligned key page pool plane '", key_layout.plane(i).name, "'");
    }
    for (int i = 0; i < value_layout.num_planes; ++i) {
      KVQ_CHECK(in.value_planes[i] && Aligned16(in.value_planes[i]), kInvalidArgument,
                "null or misaligned value page pool plane '", value_layout.plane(i).name, "'");
    }
  }
  if (c.quantized()) {
    KVQ_CHECK((c.sink == 0 || (in.sink_key && in.sink_value && Aligned16(in.sink_key) &&
                               Aligned16(in.sink_value))) &&
                  (c.ring_slots() == 0 || (in.recent_key && in.recent_value &&
                                           Aligned16(in.recent_key) && Aligned16(in.recent_value))),
              kInvalidArgument, "null or misaligned sink / recent windows");
    KVQ_CHECK(c.key.rotation != RotationKind::kDense || (in.key_heads.rotation && Aligned16(in.key_heads.rotation)),
              kInvalidArgument, "null or misaligned key rotation for a dense key write path");
    KVQ_CHECK(c.value.rotation != RotationKind::kDense || in.value_heads.rotation, kInvalidArgument,
              "null value rotation for a dense value write path");
  }

  return kinds;
}

// The query rotation q~ = q·R_K (then P_br) into the workspace; with `ready` (DecodeStep) each
// block marks its word there once its rows are written (RotateQueriesParams::ready).
void RotateQueries(const CacheParams& c, const DecodeAttentionInputs& in,
                   const DecodeAttentionPlan& plan, void* workspace, int* ready,
                   cudaStream_t stream, bool after_kernel = false) {
  attention::RotateQueriesParams rq;
  rq.batch = in.batch;
  rq.num_q_heads = c.num_q_heads;
  rq.q_per_kv = c.group_size();
  rq.heads_per_block = plan.aux_heads_per_block;
  rq.rotation = MakeRotationArgs(c.key, in.key_heads);
  rq.q = in.q;
  rq.q_rot = static_cast<float*>(workspace);
  rq.timeline = in.timeline;
  rq.ready = ready;
  rq.programmatic_launch = after_kernel;
  KVQ_CUDA_CHECK(attention::DispatchRotateQueries(c.head_dim(), rq, stream));
}

// What a DecodeStep's decode learns of the append before it: the lengths it took
// (DecodeKernelParams::append_lengths) and the rotation's words (query_ready).
struct AfterAppend {
  const int32_t* lengths = nullptr;
  const int* query_ready = nullptr;
};

// Whether DecodeStep queues the query rotation before the append (else after it). Either way
// the history blocks start their page copies at once; rotation first, they also start their
// first logits without waiting for the append, which pays where the append is longer than
// their first tiles take to arrive: the dense rotation's write (H200, B = 1 T = 128K and B = 8
// T = 32K: OSCAR's step 6.6 us shorter; its append alone 12.6-15.1 us). Where the append takes
// 7-9 us (FWHT, identity, the tiled keys' and fp8's writes) the rotation after it measured
// 1-2 us faster: the history blocks' streaming slows the append and with it the window blocks
// and the split that waits for the demoted tokens.
bool RotationFirst(const CacheParams& c) {
  return c.key.rotation == RotationKind::kDense || c.value.rotation == RotationKind::kDense;
}

// DecodeAttention (the rotation, then the decode and the merge), and DecodeStep's decode and
// merge after its rotation and append (`append`).
void Decode(const CacheParams& c, const DecodeAttentionInputs& in, const DecodeAttentionPlan& plan,
            void* workspace, size_t workspace_bytes, float* out, const AfterAppend& append,
            cudaStream_t stream) {
  const DecodeKinds kinds = CheckDecode(c, in, plan, workspace, workspace_bytes, out);
  const int d = c.head_dim();
  const int g = c.group_size();
  const int splits = plan.hist_splits + plan.window_splits;
  const WorkspaceLayout layout(c, in.batch, plan);
  const FormatLayout key_layout = LayoutOf(c.key);
  const FormatLayout value_layout = LayoutOf(c.value);
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  float* q_rot = reinterpret_cast<float*>(ws);
  float* part_ml = reinterpret_cast<float*>(ws + layout.part_ml);
  float* part_acc = reinterpret_cast<float*>(ws + layout.part_acc);

  if (c.quantized() && append.lengths == nullptr) {
    RotateQueries(c, in, plan, workspace, /*ready=*/nullptr, stream);
  }

  attention::DecodeKernelParams kp;
  kp.batch = in.batch;
  kp.num_kv_heads = c.num_kv_heads;
  kp.num_q_heads = c.num_q_heads;
  kp.q_per_kv = g;
  kp.heads_per_block = std::min(g, attention::kMaxHeadsPerBlock);
  kp.head_chunks = g / kp.heads_per_block;
  kp.sink = c.sink;
  kp.recent = c.recent;
  kp.flush = c.flush;
  kp.ring_slots = std::max(c.ring_slots(), 1);
  kp.key_norm = c.key.format == Format::kAffineTile && c.key.norm;
  kp.page_size_log2 = 0;
  while ((1 << kp.page_size_log2) < c.page_size) ++kp.page_size_log2;
  kp.key_group = c.key.group;
  kp.value_group = c.value.group;
  kp.hist_splits = plan.hist_splits;
  kp.hist_tokens_per_split = plan.hist_tokens_per_split;
  kp.window_splits = c.quantized() ? plan.window_splits : 0;
  kp.window_tokens_per_split = std::max(plan.window_tokens_per_split, 1);
  kp.quant_loop = c.quantized() ? plan.quant_loop : QuantLoop::kTwoMma;
  kp.logit_scale_log2 = static_cast<float>(static_cast<double>(c.scale()) * 1.4426950408889634);
  kp.seq_lens = in.seq_lens;
  kp.page_tables = in.page_tables;
  kp.page_table_stride = in.max_pages;
  kp.q = in.q;
  kp.q_rot = q_rot;
  kp.sink_k = in.sink_key;
  kp.sink_v = in.sink_value;
  kp.recent_k = in.recent_key;
  kp.recent_v = in.recent_value;
  const auto set_planes = [&](const FormatLayout& layout, const uint8_t* const* pools,
                              const uint8_t** planes, int64_t* page_stride, int64_t* head_stride) {
    for (int i = 0; i < layout.num_planes; ++i) {
      planes[i] = pools[i];
      page_stride[i] = static_cast<int64_t>(layout.PageBytes(i, c.page_size, c.num_kv_heads));
      head_stride[i] = layout.HeadsPerPage(i, c.num_kv_heads) > 1 || c.num_kv_heads == 1
                           ? layout.RowsPerPage(i, c.page_size) *
                                 static_cast<int64_t>(layout.plane(i).row_bytes())
                           : 0;
    }
  };
  set_planes(key_layout, in.key_planes, kp.k_planes, kp.k_page_stride, kp.k_head_stride);
  set_planes(value_layout, in.value_planes, kp.v_planes, kp.v_page_stride, kp.v_head_stride);
  kp.part_ml = part_ml;
  kp.part_acc = part_acc;
  kp.k_head_scale = in.key_heads.scale;
  kp.v_head_scale = in.value_heads.scale;
  if (c.key.format == Format::kCodebook) {
    kp.k_widths = in.key_heads.widths;
    kp.k_bits = c.key.bits;
    kp.k_code_bytes = c.key.row_code_bytes();
    kp.k_segments = c.key.segments;
    kp.k_codebook = DeviceCodebookTables(c.key.codebook);
  }
  if (c.value.format == Format::kCodebook) {
    kp.v_widths = in.value_heads.widths;
    kp.v_bits = c.value.bits;
    kp.v_code_bytes = c.value.row_code_bytes();
    kp.v_segments = c.value.segments;
    kp.v_codebook = DeviceCodebookTables(c.value.codebook);
  }
  const DecodeStepBlocks blocks = DecodeAttentionBlocks(c, in.batch, plan);
  kp.timeline = in.timeline ? in.timeline + 4 * blocks.rotate : nullptr;
  // Right after the query rotation, or after the append's last kernel (DecodeStep).
  kp.programmatic_launch = c.quantized();
  kp.append_lengths = append.lengths;
  kp.query_ready = append.query_ready;
  kp.query_ready_heads = plan.aux_heads_per_block;
  // The kernels never read a null pool when no sequence has history (no valid tile), but
  // cp.async needs a mapped address for its zero-fill form: give it the queries.
  for (const uint8_t** first_plane : {&kp.k_planes[0], &kp.v_planes[0]}) {
    if (!*first_plane) *first_plane = reinterpret_cast<const uint8_t*>(in.q);
  }
  KVQ_CUDA_CHECK(attention::DispatchDecodeAttention(d, kinds, kp, stream));

  attention::MergeParams mp;
  mp.batch = in.batch;
  mp.num_kv_heads = c.num_kv_heads;
  mp.num_q_heads = c.num_q_heads;
  mp.q_per_kv = g;
  mp.heads_per_block = plan.aux_heads_per_block;
  mp.hist_splits = plan.hist_splits;
  mp.total_splits = splits;
  mp.max_seq_len = in.max_seq_len;
  mp.seq_lens = in.seq_lens;
  mp.rotate_history = c.quantized();
  mp.rotation = MakeRotationArgs(c.value, in.value_heads);
  mp.part_ml = part_ml;
  mp.part_acc = part_acc;
  mp.out = out;
  mp.timeline = in.timeline ? in.timeline + 4 * (blocks.rotate + blocks.decode) : nullptr;
  mp.programmatic_launch = true;
  KVQ_CUDA_CHECK(attention::DispatchMergePartials(d, mp, stream));
}

}  // namespace

void DecodeAttention(const CacheParams& c, const DecodeAttentionInputs& in,
                     const DecodeAttentionPlan& plan, void* workspace, size_t workspace_bytes,
                     float* out, cudaStream_t stream) {
  Decode(c, in, plan, workspace, workspace_bytes, out, AfterAppend{}, stream);
}

void DecodeStep(const CacheParams& c, const uint16_t* key, const uint16_t* value,
                const int32_t* lengths, const PagePool& key_pool, const PagePool& value_pool,
                const Windows& windows, int* error_flags, const DecodeAttentionInputs& in,
                const DecodeAttentionPlan& plan, void* workspace, size_t workspace_bytes,
                float* out, cudaStream_t stream) {
  KVQ_CHECK(c.quantized(), kUnsupported, "DecodeStep: a bf16 cache has no append step");
  // The decode's checks first: a refused decode leaves the cache as it was.
  CheckDecode(c, in, plan, workspace, workspace_bytes, out);
  if (RotationFirst(c)) {
    // The rotation first (it reads only q and R_K), marking its blocks done for the history
    // blocks, which then never wait for the append; the append launched while it runs; the
    // decode while the append runs.
    int* ready = reinterpret_cast<int*>(static_cast<unsigned char*>(workspace) +
                                        WorkspaceLayout(c, in.batch, plan).query_ready);
    RotateQueries(c, in, plan, workspace, ready, stream);
    AppendStepLaunches(c, key, value, in.batch, lengths, in.page_tables, in.max_pages,
                       in.key_heads, in.value_heads, key_pool, value_pool, windows, error_flags,
                       /*overlap_previous=*/true, stream);
    Decode(c, in, plan, workspace, workspace_bytes, out, AfterAppend{lengths, ready},
           stream);
    return;
  }
  // The append first; the rotation launched while it runs and complete after it, the decode
  // while the rotation runs: the history blocks start their page copies at once and wait for
  // the rotation (so for the append) before their first logit.
  AppendStep(c, key, value, in.batch, lengths, in.page_tables, in.max_pages, in.key_heads,
             in.value_heads, key_pool, value_pool, windows, error_flags, stream);
  RotateQueries(c, in, plan, workspace, /*ready=*/nullptr, stream, /*after_kernel=*/true);
  Decode(c, in, plan, workspace, workspace_bytes, out, AfterAppend{lengths, nullptr}, stream);
}

}  // namespace kvq::gpu
