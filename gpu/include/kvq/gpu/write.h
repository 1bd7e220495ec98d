// The CUDA write path (sm_90): the named stages of cpu_ref's WriteKernels on the GPU, and the
// fused kernels (rotate -> P_br -> [norm] -> clip -> quantize -> pack -> store) for flat rows
// and for the paged cache of spec/cache.md: one per history format (affine_token: a row at a
// time; affine_tile: a tile of G_k rows a block). Every output bit equals cpu_ref's scalar
// backend.
//
// The stages are those of kvq/common/stages.inc: their runtime functions, launchers and
// dispatch below are generated from that list, so a stage added there does not link here until
// its launcher exists. The fused kernels serve the affine_token and affine_tile formats
// (kvq/gpu/formats.h); their destinations are the planes of LayoutOf(WriteParams).
//
// Three layers, as FlashInfer names them:
//   (a) `__global__` kernels taking one `__grid_constant__` parameter struct (FusedWriteArgs,
//       StageArgs below; the kernels live in gpu/src/write_fused.cu, write_stages.cu and
//       write_windows.cu);
//   (b) launchers templated on HEAD_DIM / GROUP / BITS returning cudaError_t, and Dispatch*
//       functions mapping runtime values onto them: an unsupported head_dim, group, bits or page
//       size returns cudaErrorInvalidValue, never a silent no-op;
//   (c) the runtime API (namespace kvq::gpu, below the launchers): validates WriteParams /
//       CacheParams and shapes, checks every CUDA call and throws kvq::Error.
// All pointers of layers (a)-(c) are device pointers unless a comment says otherwise; work is
// queued on `stream` and nothing synchronises unless stated.
//
// The kernels assume finite input (spec/numerics.md §1). They cannot throw, so the runtime API
// takes an optional device word `error_flags` into which kernels OR the kErrorFlag* bits below;
// a caller that wants the spec's kNonFinite check reads it back (CheckErrorFlags does).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"

namespace kvq::gpu {

// Bits a kernel ORs into *error_flags (when the pointer is not null).
inline constexpr int kErrorFlagNonFinite = 1;      // a rotated value is NaN/Inf or > 2^126
inline constexpr int kErrorFlagBadPage = 2;        // a page id outside [0, num_pages) or a page
                                                   // index past the page table: row skipped
inline constexpr int kErrorFlagBadLength = 4;      // a negative sequence length: row skipped

// The CUDA norm's span limit: a norm spans at most this many values padded to a power of two
// (d = 256 over 128 KV heads; the tree runs in 128 KB of shared memory). Larger spans are
// refused (cudaErrorInvalidValue; the runtime API says kUnsupported).
inline constexpr int kMaxNormSpan = 32768;

// ----------------------------------------------------------------------------------------------
// Layer (a): kernel parameter structs.

// Where the fused kernel reads its rows and where it stores them.
enum class WriteMode : int {
  // Row (t, h) at x + t*token_stride + h*d -> flat outputs: row index t*num_heads + h.
  kRows = 0,
  // Prefill of one sequence: history token i (0 <= i < num_tokens) is position first_token + i
  // of x; stored in page page_table[i / P], slot i % P.
  kPrefill = 1,
  // Decode-step demotion for a batch: "token" t is sequence b = t; with len = seq_lengths[b]
  // (before the append), position len - W is demoted when len - W >= S0: its bf16 row is read
  // from the ring x + b*seq_stride + (len % W)*token_stride + h*d and stored at history index
  // i = len - W - S0 through page_table + b*page_table_stride. Other sequences are skipped.
  // F = 1 and W >= 1 only (kFlush is the general rule).
  kAppend = 2,
  // Decode-step flush for a batch under the general window rule (spec/cache.md §3: any F and
  // W >= 0): "token" t is row r = t % F of sequence b = t / F. With len = seq_lengths[b]
  // (before the append), the positions [S0 + H(len), S0 + H(len + 1)) enter the history, F of
  // them or none; position p = S0 + H(len) + r (history index H(len) + r) is read from the ring
  // x + b*seq_stride + (p % ring_slots)*token_stride + h*d when p < len, and from the step's
  // new rows new_rows + b*token_stride + h*d when p == len (W = 0). The tile write takes one
  // tile of G_k of those rows a block ("token" t = tile t % (F / G_k) of sequence t / (F / G_k)).
  kFlush = 3,
};

struct FusedWriteArgs {
  // Source rows, d = HEAD_DIM channels each.
  const void* x = nullptr;        // bf16 bits (uint16_t) when x_is_bf16, else fp32
  bool x_is_bf16 = true;
  int num_heads = 1;              // rows per token (Hkv); head h uses rotation.matrices + h*d*d
  int num_tokens = 0;             // tokens (kAppend: sequences) to process
  int64_t token_stride = 0;       // elements between consecutive tokens of x
  int64_t first_token = 0;        // kPrefill: position of history token 0 (S0)

  RotationArgs rotation;  // MakeRotationArgs of the write params

  // Clip ratio rho of head h: clip_per_head[h] when not null, else clip.
  float clip = 1.0f;
  const float* clip_per_head = nullptr;  // [num_heads]

  // Destination: the planes of LayoutOf(p) in its order (affine_token: kAffine*Plane).
  // kRows: plane i [rows, row_bytes(i)]. Paged modes: the pool, plane i
  // [num_pages, num_heads, P, row_bytes(i)] (PagePool).
  WriteMode mode = WriteMode::kRows;
  uint8_t* planes[kMaxPlanes] = {};
  float* rotated = nullptr;  // kRows only, optional: [rows, d] after rotation and P_br
  float* tau = nullptr;      // kRows only, optional: [rows] clip thresholds

  // Paged modes.
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;  // kAppend: entries per sequence (max pages)
  int page_size_log2 = 0;
  int num_pages = 0;

  // kAppend.
  const int32_t* seq_lengths = nullptr;  // [num_tokens]
  int sink = 0;
  int recent = 1;
  int64_t seq_stride = 0;  // elements per sequence of the ring buffer (W * Hkv * d)

  int* error_flags = nullptr;  // optional, kErrorFlag* bits

  // The launch may start in the tail of the kernel before it on the stream (programmatic
  // dependent launch), which must then write nothing this one reads or writes, apart from the
  // error flags' atomic OR (PrefillWrite: the value launch after the key launch). The kernel's
  // completion still implies the previous one's.
  bool overlap_previous = false;

  // kFlush (fields after the others, so the affine_token kernels' parameter offsets stay).
  int flush = 1;                   // F
  int ring_slots = 0;              // W + F - 1: the ring's slots (position p at p % ring_slots)
  const void* new_rows = nullptr;  // the step's rows, [batch, Hkv, d] bf16 (W = 0)

  // The tile write (affine_tile): G_k tokens a tile, code width and the norm. Tile planes:
  // kRows [n / G_k, row_bytes], paged [num_pages, Hkv, P / G_k, row_bytes]. The norm plane:
  // per token and KV head ([n] / [num_pages, Hkv, P]), or with norm_shared one norm per token
  // over the rows of all num_heads KV heads laid end to end (the token scope: paged
  // [num_pages, 1, P]; not in kRows). kRows writes n / G_k tiles of rows t = tile * G_k + r;
  // kPrefill the tiles of history tokens [0, num_tokens) (a multiple of G_k).
  int tile_tokens = 0;
  int bits = 2;
  bool norm = false;
  bool norm_shared = false;

  // fp8_e4m3 (spec 1.2; the fused write with BITS = 8): the divisor s^ of head h,
  // scale_per_head[h] when not null, else head_scale; one plane, the e4m3 codes [.., d].
  float head_scale = 1.0f;
  const float* scale_per_head = nullptr;  // [num_heads]

  // codebook (spec 1.3; the fused write with BITS = kCodebookWrite): the block widths of head h
  // at widths + h * d/2 (null: every block at `bits`), the side's norm slots and code bytes a
  // row (WriteParams::segments, row_code_bytes()) and its density's tables
  // (DeviceCodebookTables). Planes: the codes [.., code_bytes], the norms bf16 [.., segments].
  const uint8_t* widths = nullptr;
  int segments = 1;
  int code_bytes = 0;
  const float* codebook = nullptr;
};

// The BITS of the fused write's codebook epilogue: the widths are per-head data, read at run
// time (numerics.md §5.4: segment norms, boundary counts, corrected norms, packing).
inline constexpr int kCodebookWrite = 0;

// Parameters of every stage kernel: the stage's pointer arguments as a buffer list, in the
// order of its KVQ_ARG list in stages.inc (shapes there), and the write params.
struct StageArgs {
  void* args[kMaxStageArgs] = {};  // device pointers
  int num_args = 0;
  int64_t rows = 0;                // n
  WriteParams params;              // validated by layer (c)
  int fwht_block = 0;              // params.fwht_block()
  float fwht_scale = 0.0f;         // params.fwht_scale()
  const float* codebook = nullptr;  // codebook stages: DeviceCodebookTables(params.codebook)
};

// ----------------------------------------------------------------------------------------------
// Layer (b): launchers. Instantiated for head_dim {64, 128, 256}, group {32, 64, 128} <= head_dim
// and bits {2, 4}; anything else is refused by the Dispatch* functions with cudaErrorInvalidValue.
// They launch and return cudaGetLastError(); they do not synchronise.

template <int HEAD_DIM, int GROUP, int BITS>
cudaError_t LaunchFusedWrite(const FusedWriteArgs& args, cudaStream_t stream);
cudaError_t DispatchFusedWrite(int head_dim, int group, int bits, const FusedWriteArgs& args,
                               cudaStream_t stream);
// The fp8_e4m3 write: the same kernels with the e4m3 epilogue (LaunchFusedWrite<d, d, 8>):
// code = e4m3(x / s^) of the rotated, clipped row, one byte per value in plane 0.
cudaError_t DispatchFp8Write(int head_dim, const FusedWriteArgs& args, cudaStream_t stream);
// The codebook write (spec 1.3): the same kernels with the codebook epilogue
// (LaunchFusedWrite<d, d, kCodebookWrite>): segment norms, codes, corrected norms, packed codes
// in plane 0 and the norms in plane 1.
cudaError_t DispatchCodebookWrite(int head_dim, const FusedWriteArgs& args, cudaStream_t stream);

// The tile write of the affine_tile format (gpu/src/write_tile.cu): a block per (tile, KV head)
// in every mode (for kFlush a block per possible tile of each sequence's flush), 256 threads;
// with norm_shared, a block per tile first stores the token-scope norms. Rotations identity
// and FWHT (with or without P_br); args.tile_tokens in {32, 64, 128}, args.bits in {2, 4}; a
// shared norm over num_heads * d <= kMaxNormSpan values. Anything else (a dense rotation
// included) returns cudaErrorInvalidValue.
template <int HEAD_DIM>
cudaError_t LaunchTileWrite(const FusedWriteArgs& args, cudaStream_t stream);
cudaError_t DispatchTileWrite(int head_dim, const FusedWriteArgs& args, cudaStream_t stream);

// Per format of KVQ_GPU_WRITE_FORMATS (kvq/gpu/formats.h): its checks and its launcher.
#define KVQ_GPU_WRITE_DECLARE(Name)                                                \
  void CheckWrite##Name(const WriteParams& p, const char* what);                   \
  cudaError_t Write##Name(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream);
KVQ_GPU_WRITE_FORMATS(KVQ_GPU_WRITE_DECLARE)
#undef KVQ_GPU_WRITE_DECLARE

// One launcher per stage of stages.inc (Launch<Name>Stage, gpu/src/write_stages.cu), and the
// dispatch over all of them: an unsupported head_dim, group, bits, clip or FWHT block returns
// cudaErrorInvalidValue.
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  KVQ_IF_CUDA_STAGE(backends,                                      \
                    cudaError_t Launch##Name##Stage(const StageArgs& args, cudaStream_t stream);)
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
cudaError_t DispatchStage(StageId stage, const StageArgs& args, cudaStream_t stream);

// Writes the new token of each of `batch` sequences (bf16 [batch, Hkv, d] for K and V) into the
// sink (position < S0) or the recent ring (when it stays recent: len >= S0 + H(len + 1)). Run
// after the demotions of the same step.
struct AppendCopyArgs {
  const uint16_t* key = nullptr;
  const uint16_t* value = nullptr;
  uint16_t* sink_key = nullptr;    // [batch, S0, Hkv, d]
  uint16_t* sink_value = nullptr;
  uint16_t* recent_key = nullptr;  // [batch, ring_slots, Hkv, d]
  uint16_t* recent_value = nullptr;
  const int32_t* seq_lengths = nullptr;  // [batch], before the append
  int batch = 0;
  int num_heads = 0;
  int head_dim = 0;
  int sink = 0;
  int recent = 1;      // the ring's slots W + F - 1 (position p at slot p % recent)
  int* error_flags = nullptr;
  // Launched to overlap the demotions' tail (programmatic dependent launch): the kernel waits
  // for the previous grid (and through it every earlier demotion) before it touches a row.
  bool overlap_previous = false;
  int window = 1;  // W
  int flush = 1;   // F
};
cudaError_t LaunchAppendCopy(const AppendCopyArgs& args, cudaStream_t stream);

// The bf16 windows of a prefill, K and V in one launch: positions [0, sink_tokens) of x
// [T, Hkv, d] into the sink [S0, Hkv, d], positions [recent_begin, tokens) into the recent ring
// [W + F - 1, Hkv, d] at slot p % (W + F - 1) (`recent` holds the slot count). Rows are copied
// in 16-byte vectors (row_elems a multiple of 8, every pointer 16-byte aligned).
struct PrefillWindowsArgs {
  const uint16_t* key = nullptr;
  const uint16_t* value = nullptr;
  uint16_t* sink_key = nullptr;
  uint16_t* sink_value = nullptr;
  uint16_t* recent_key = nullptr;
  uint16_t* recent_value = nullptr;
  int64_t row_elems = 0;  // Hkv * d
  int sink_tokens = 0;
  int recent_begin = 0;
  int tokens = 0;
  int recent = 1;
  bool overlap_previous = false;  // as FusedWriteArgs::overlap_previous
};
cudaError_t LaunchPrefillWindows(const PrefillWindowsArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// Layer (c): runtime API. Every function validates its parameters (kvq::Error kInvalidArgument
// naming the value), checks each CUDA call (KVQ_CUDA_CHECK) and queues work on `stream`.

// The stages of stages.inc on device pointers: cpu::WriteKernels' signatures (the shapes are
// in stages.inc) plus a stream, e.g.
//   void RotateDense(const float* x, const float* r, float* y, size_t n, const WriteParams& p,
//                    cudaStream_t stream = nullptr);   // x [n, d], r [d, d], y [n, d] fp32
// Each validates p (and that a codec stage belongs to p.format), the row count and its pointers
// (none null, no two the same), then runs RunStage.
#define KVQ_GPU_STAGE_PARAMS(...) (__VA_ARGS__, cudaStream_t stream = nullptr)
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) void Name KVQ_GPU_STAGE_PARAMS params;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
#undef KVQ_GPU_STAGE_PARAMS

// Stage `stage` with its device pointer arguments in args[] (stages.inc order): the generic
// entry point the functions above and the CUDA adapter's host wrappers call. Throws kvq::Error
// (kInvalidArgument: invalid params, a null or repeated pointer, a configuration the launcher
// refuses; kUnsupported: a codec stage of another format than p.format).
void RunStage(StageId stage, void* const* args, size_t n, const WriteParams& p,
              cudaStream_t stream = nullptr);

// Outputs of the fused write of flat rows (device pointers).
struct RowOutputs {
  uint8_t* planes[kMaxPlanes] = {};  // plane i of LayoutOf(p): [n, row_bytes(i)] (affine_token:
                                     // packed codes [n, d*b/8], scale / min bf16 [n, d/G])
  float* rotated = nullptr;    // optional [n, d]: after rotation and P_br, before the clip
  float* tau = nullptr;        // optional [n]: clip thresholds (none for codebook rows)
};

// The fused write path of n rows: the same bits as cpu::QuantizeRows (packed, scale, min,
// rotated, tau). x is 16-byte aligned. rotation: [d, d] fp32 for kDense, else ignored.
// p.format must be one the fused kernel serves (affine_token; kUnsupported otherwise).
// \param x [n, d] bf16 bits or fp32
// error_flags: optional device int; kErrorFlagNonFinite is ORed in for a row the validating
// CPU path would reject (its outputs are then unspecified).
void WriteRows(const WriteParams& p, const float* rotation, const uint16_t* x, size_t n,
               const RowOutputs& out, int* error_flags = nullptr, cudaStream_t stream = nullptr);
void WriteRows(const WriteParams& p, const float* rotation, const float* x, size_t n,
               const RowOutputs& out, int* error_flags = nullptr, cudaStream_t stream = nullptr);
// The same with one KV head's per-head data: its rotation and, for a codebook row, its block
// widths (head.widths, d/2 values; null: every block at p.bits).
void WriteRows(const WriteParams& p, const HeadData& head, const uint16_t* x, size_t n,
               const RowOutputs& out, int* error_flags = nullptr, cudaStream_t stream = nullptr);
void WriteRows(const WriteParams& p, const HeadData& head, const float* x, size_t n,
               const RowOutputs& out, int* error_flags = nullptr, cudaStream_t stream = nullptr);

// The history page pool of K or of V (device pointers), spec/cache.md §4: plane i of
// LayoutOf(p) at planes[i], [num_pages, Hkv, RowsPerPage(i), row_bytes(i)]
// (FormatLayout::PageBytes(i, P, Hkv) bytes a page; affine_token: codes [.., P, d*b/8],
// scale / min bf16 [.., P, d/G]).
struct PagePool {
  uint8_t* planes[kMaxPlanes] = {};
  int num_pages = 0;
};

// bf16 windows (device pointers). One sequence: sink [S0, Hkv, d], recent ring [W, Hkv, d].
// A batch of B sequences: the same with a leading [B] (sequence b at offset b * one sequence).
struct Windows {
  uint16_t* sink_key = nullptr;
  uint16_t* sink_value = nullptr;
  uint16_t* recent_key = nullptr;
  uint16_t* recent_value = nullptr;
};

// Prefill of one empty sequence with `tokens` tokens (spec/cache.md §2): copies positions
// [0, min(S0, T)) into the sink, [RecentBegin(T), T) into the ring (slot p % (W + F - 1)) and
// writes history tokens i = 0 .. H(T) - 1 (whole flushes, so whole tiles) into pages
// page_table[i / P], slot i % P. Three launches (four with a token-scope norm): the key
// history, the value history (overlapping the key launch's tail) and both windows; everything
// is validated before the first.
// \param key, value [T, Hkv, d] bf16 bits, 16-byte aligned
// \param page_table [ceil(H(T) / P)] int32 page ids (device)
// Throws kvq::Error: invalid CacheParams, a bf16 cache (kInvalidArgument), a format the kernels
// do not serve (kUnsupported: a dense rotation on affine_tile, a norm span above kMaxNormSpan),
// null pointers, T < 0, windows or rows that are not 16-byte aligned, a null rotation for a
// dense write path.
void PrefillWrite(const CacheParams& c, const uint16_t* key, const uint16_t* value,
                  int tokens, const int32_t* page_table, const HeadData& key_heads,
                  const HeadData& value_heads, const PagePool& key_pool,
                  const PagePool& value_pool, const Windows& windows,
                  int* error_flags = nullptr, cudaStream_t stream = nullptr);

// One decode step for `batch` sequences: sequence b has length lengths[b] before the step
// (device int32 [batch]); its token at that position (key/value [batch, Hkv, d] bf16) goes to the
// sink or ring, and the positions [S0 + H(len), S0 + H(len + 1)) enter the history (F = 1,
// W >= 1: position len - W when len - W >= S0; otherwise F of them or none, read from the ring
// before the new token overwrites a slot, and with W = 0 the new token itself, which then
// skips the ring). The caller advances lengths afterwards.
// \param page_tables [batch, max_pages] int32 (device); row b is sequence b's page table
// windows: batched layout ([B, S0, Hkv, d] and [B, W + F - 1, Hkv, d]; no ring when W + F - 1
// is 0).
void AppendStep(const CacheParams& c, const uint16_t* key, const uint16_t* value, int batch,
                const int32_t* lengths, const int32_t* page_tables, int max_pages,
                const HeadData& key_heads, const HeadData& value_heads,
                const PagePool& key_pool, const PagePool& value_pool, const Windows& windows,
                int* error_flags = nullptr, cudaStream_t stream = nullptr);

// Synchronises `stream`, reads *error_flags (device) and throws kvq::Error (kNonFinite for
// kErrorFlagNonFinite, kInvalidArgument for page / length errors) when any bit is set.
// `what` names the call in the message.
void CheckErrorFlags(const int* error_flags, const char* what, cudaStream_t stream = nullptr);

}  // namespace kvq::gpu
