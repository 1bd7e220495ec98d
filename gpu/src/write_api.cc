// Layer (c) of the CUDA write path: validation, launch and error reporting (write.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/gpu/codebook.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"
#include "kvq/gpu/write.h"

#include "append_step.h"

namespace kvq::gpu {
namespace {

int Log2(int power_of_two) {
  int log = 0;
  while ((1 << log) < power_of_two) ++log;
  return log;
}

// A launcher's cudaErrorInvalidValue means it has no kernel for this configuration: say which.
void CheckLaunch(cudaError_t status, const char* what, const WriteParams& p, const char* file,
                 int line) {
  if (status == cudaErrorInvalidValue) {
    throw Error(ErrorCode::kInvalidArgument,
                kvq::detail::Concat(what, ": the CUDA launcher refused head_dim ", p.head_dim,
                               ", group ", p.group, ", bits ", p.bits, ", rotation ",
                               RotationKindName(p.rotation), ", FWHT block ", p.fwht_block(),
                               " (or a pointer that is null or not 16-byte aligned)"));
  }
  if (status == cudaErrorNotSupported) {
    throw Error(ErrorCode::kUnsupported,
                kvq::detail::Concat(what, ": no CUDA kernel for this stage yet (spec 1.1)"));
  }
  if (status != cudaSuccess) ThrowCudaError(status, what, file, line);
}
#define KVQ_CHECK_LAUNCH(expr, what, p) CheckLaunch((expr), what, p, __FILE__, __LINE__)

int CheckedRows(size_t n, const char* what) {
  KVQ_CHECK(n <= static_cast<size_t>(INT_MAX), kInvalidArgument, what, ": row count ", n,
            " exceeds ", INT_MAX);
  return static_cast<int>(n);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

#define KVQ_REQUIRE_POINTER(ptr, what) \
  KVQ_CHECK((ptr) != nullptr, kInvalidArgument, what, ": " #ptr " is null")

// The formats the CUDA write stores (KVQ_GPU_WRITE_FORMATS): each row's checks, then the
// kernels' plane layout; anything else is refused, naming it.
void CheckFusedFormat(const WriteParams& p, const char* what) {
#define KVQ_CHECK_WRITE_ROW(Name)    \
  if (p.format == Format::k##Name) { \
    CheckWrite##Name(p, what);       \
    CheckKernelLayout(p, what);      \
    return;                          \
  }
  KVQ_GPU_WRITE_FORMATS(KVQ_CHECK_WRITE_ROW)
#undef KVQ_CHECK_WRITE_ROW
  std::string served;
#define KVQ_WRITE_ROW_NAME(Name) served += std::string(served.empty() ? "" : ", ") + \
                                           FormatName(Format::k##Name);
  KVQ_GPU_WRITE_FORMATS(KVQ_WRITE_ROW_NAME)
#undef KVQ_WRITE_ROW_NAME
  KVQ_CHECK(false, kUnsupported, what, ": the CUDA fused write stores ", served, ", not ",
            FormatName(p.format));
}

// The launcher of p's format.
cudaError_t DispatchWrite(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t stream) {
#define KVQ_WRITE_ROW(Name) \
  if (p.format == Format::k##Name) return Write##Name(p, a, stream);
  KVQ_GPU_WRITE_FORMATS(KVQ_WRITE_ROW)
#undef KVQ_WRITE_ROW
  return cudaErrorInvalidValue;
}

// The fields of FusedWriteArgs that come from WriteParams and per-head data: `a` with the
// rotation and clip of `p` / `heads` and the destination planes `planes` (LayoutOf(p) order).
FusedWriteArgs WriteArgsFor(const WriteParams& p, const HeadData& heads,
                            uint8_t* const (&planes)[kMaxPlanes], FusedWriteArgs a,
                            const char* what) {
  CheckFusedFormat(p, what);
  if (p.rotation == RotationKind::kDense) {
    KVQ_CHECK(heads.rotation != nullptr, kInvalidArgument, what,
              ": dense rotation requested but the rotation matrices are null");
    KVQ_CHECK(Aligned16(heads.rotation), kInvalidArgument, what,
              ": the rotation matrices are not 16-byte aligned");
  }
  a.rotation = MakeRotationArgs(p, heads);
  a.clip = p.clip;
  a.clip_per_head = heads.clip;
  a.head_scale = p.head_scale;
  a.scale_per_head = heads.scale;
  if (p.format == Format::kCodebook) {
    a.widths = heads.widths;
    a.segments = p.segments;
    a.code_bytes = p.row_code_bytes();  // the tables: WriteCodebook, at launch
  }
  a.tile_tokens = p.format == Format::kAffineTile ? p.group : 0;
  a.bits = p.bits;
  a.norm = p.norm;
  a.norm_shared = p.norm && p.norm_heads > 1;  // the token scope (the cache checked Hkv)
  const FormatLayout layout = LayoutOf(p);
  for (int i = 0; i < kMaxPlanes; ++i) {
    KVQ_CHECK(i >= layout.num_planes || planes[i] != nullptr, kInvalidArgument, what,
              ": the destination plane '", layout.plane(i).name, "' is null");
    a.planes[i] = i < layout.num_planes ? planes[i] : nullptr;
  }
  return a;
}

void WriteRowsImpl(const WriteParams& p, const HeadData& heads, const void* x, bool bf16,
                   size_t n, const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  constexpr const char* kWhat = "WriteRows";
  p.Validate();
  const int rows = CheckedRows(n, kWhat);
  if (rows == 0) return;
  KVQ_REQUIRE_POINTER(x, kWhat);
  KVQ_CHECK(Aligned16(x), kInvalidArgument, kWhat, ": input rows are not 16-byte aligned");
  if (p.format == Format::kAffineTile) {
    KVQ_CHECK(rows % p.group == 0, kInvalidArgument, kWhat, ": ", rows,
              " rows is not a whole number of tiles of ", p.group, " tokens");
    KVQ_CHECK(out.rotated == nullptr && out.tau == nullptr, kInvalidArgument, kWhat,
              ": the tile write has no rotated / tau outputs (affine_token only)");
    KVQ_CHECK(!p.norm || p.norm_heads == 1, kInvalidArgument, kWhat, ": a norm over ",
              p.norm_heads, " KV heads needs every head's rows (the paged cache writes)");
  }
  KVQ_CHECK(p.format != Format::kCodebook || out.tau == nullptr, kInvalidArgument, kWhat,
            ": the codebook write has no tau output (its rows are not clipped)");
  FusedWriteArgs a = WriteArgsFor(p, heads, out.planes, FusedWriteArgs(), kWhat);
  a.x = x;
  a.x_is_bf16 = bf16;
  a.num_heads = 1;
  a.num_tokens = rows;
  a.token_stride = p.head_dim;
  a.mode = WriteMode::kRows;
  a.rotated = out.rotated;
  a.tau = out.tau;
  a.error_flags = error_flags;
  KVQ_CHECK_LAUNCH(DispatchWrite(p, a, stream), kWhat, p);
}

void CheckPool(const PagePool& pool, const char* what) {
  KVQ_CHECK(pool.num_pages > 0, kInvalidArgument, what, ": the page pool has ", pool.num_pages,
            " pages");
}

void CheckCacheParams(const CacheParams& c, const char* what) {
  c.Validate();
  KVQ_CHECK(c.quantized(), kInvalidArgument, what,
            ": the cache format is bf16 (not quantized); the bf16 baseline has no history "
            "pages to write");
  CheckFusedFormat(c.key, (std::string(what) + " (key)").c_str());
  CheckFusedFormat(c.value, (std::string(what) + " (value)").c_str());
  KVQ_CHECK(c.num_kv_heads <= 65535, kInvalidArgument, what, ": num_kv_heads ", c.num_kv_heads,
            " exceeds 65535");
}

// The arguments of a history write (prefill or demotion) of K or V: `a` with the rotation,
// clip and pool of that tensor (validated; a null plane is named).
// A flush (kFlush) takes the batch in num_tokens: a row of F per sequence for the per-token
// write, a tile of them for the tile write (F / G_k blocks a sequence, write.h).
FusedWriteArgs HistoryArgs(const WriteParams& p, const HeadData& heads, const PagePool& pool,
                           FusedWriteArgs a, const char* what) {
  a = WriteArgsFor(p, heads, pool.planes, a, what);
  a.num_pages = pool.num_pages;
  if (a.mode == WriteMode::kFlush && p.format != Format::kAffineTile) {
    KVQ_CHECK(static_cast<int64_t>(a.num_tokens) * a.flush <= INT_MAX, kInvalidArgument, what,
              ": batch ", a.num_tokens, " x flush ", a.flush, " rows exceed ", INT_MAX);
    a.num_tokens *= a.flush;
  }
  return a;
}

// The key and the value history writes of `base` (rows key_rows / value_rows). Both are
// validated before the key launch is queued, so a bad value argument writes nothing; the value
// launch overlaps the key launch's tail (they share nothing but the error flags' atomic OR).
// key_new / value_new: a flush's new rows (kFlush with W = 0), else null.
void LaunchHistories(const CacheParams& c, const HeadData& key_heads, const HeadData& value_heads,
                     const PagePool& key_pool, const PagePool& value_pool, FusedWriteArgs base,
                     const void* key_rows, const void* value_rows, const void* key_new,
                     const void* value_new, const char* what, cudaStream_t stream) {
  const std::string key_what = std::string(what) + " (key)";
  const std::string value_what = std::string(what) + " (value)";
  base.x = key_rows;
  base.new_rows = key_new;
  const FusedWriteArgs k = HistoryArgs(c.key, key_heads, key_pool, base, key_what.c_str());
  base.x = value_rows;
  base.new_rows = value_new;
  base.overlap_previous = true;
  const FusedWriteArgs v = HistoryArgs(c.value, value_heads, value_pool, base, value_what.c_str());
  KVQ_CHECK_LAUNCH(DispatchWrite(c.key, k, stream), key_what.c_str(), c.key);
  KVQ_CHECK_LAUNCH(DispatchWrite(c.value, v, stream), value_what.c_str(), c.value);
}

}  // namespace

// ---- Stages ------------------------------------------------------------------------------------

void RunStage(StageId stage, void* const* args, size_t n, const WriteParams& p,
              cudaStream_t stream) {
  const StageSpec& spec = GetStage(stage);
  KVQ_CHECK(spec.backends != StageBackends::kCpuOnly, kUnsupported, "stage '", spec.name,
            "' has no CUDA kernel yet (stages.inc: kCpuOnly)");
  p.Validate();
  KVQ_CHECK(StageApplies(spec, p), kUnsupported, spec.name, ": a stage of the ", spec.family,
            " format, not of ", FormatName(p.format));
  KVQ_CHECK(n <= static_cast<size_t>(INT64_MAX) / 256, kInvalidArgument, spec.name,
            ": row count ", n, " is too large");
  if (n == 0) return;
  StageArgs a;
  for (int i = 0; i < spec.num_args; ++i) {
    KVQ_CHECK(args[i] != nullptr, kInvalidArgument, spec.name, ": ", spec.args[i].name,
              " is null");
    for (int j = 0; j < i; ++j) {
      KVQ_CHECK(args[i] != args[j], kInvalidArgument, spec.name, ": ", spec.args[j].name,
                " and ", spec.args[i].name, " alias");
    }
    a.args[i] = args[i];
  }
  a.num_args = spec.num_args;
  a.rows = static_cast<int64_t>(n);
  a.params = p;
  a.fwht_block = p.fwht_block();
  a.fwht_scale = p.fwht_scale();
  if (!spec.transform && spec.format == Format::kCodebook) {
    a.codebook = DeviceCodebookTables(p.codebook);
  }
  KVQ_CHECK_LAUNCH(DispatchStage(stage, a, stream), spec.name, p);
}

// The stages of stages.inc: each passes its pointers, in order, to RunStage.
#define KVQ_GPU_STAGE_DEFINITION(...) (__VA_ARGS__, cudaStream_t stream)
#define KVQ_ARG(name, expect, dtype, dir, extent) const_cast<void*>(static_cast<const void*>(name)),
#define KVQ_STAGE(name, Name, family, backends, params, arg_list)  \
  void Name KVQ_GPU_STAGE_DEFINITION params {            \
    void* const list[] = {arg_list};                     \
    RunStage(StageId::k##Name, list, n, p, stream);      \
  }
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
#undef KVQ_ARG
#undef KVQ_GPU_STAGE_DEFINITION

// ---- Fused writes ------------------------------------------------------------------------------

void WriteRows(const WriteParams& p, const HeadData& head, const uint16_t* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  WriteRowsImpl(p, head, x, /*bf16=*/true, n, out, error_flags, stream);
}

void WriteRows(const WriteParams& p, const HeadData& head, const float* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  WriteRowsImpl(p, head, x, /*bf16=*/false, n, out, error_flags, stream);
}

void WriteRows(const WriteParams& p, const float* rotation, const uint16_t* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  HeadData head;
  head.rotation = rotation;
  WriteRows(p, head, x, n, out, error_flags, stream);
}

void WriteRows(const WriteParams& p, const float* rotation, const float* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  HeadData head;
  head.rotation = rotation;
  WriteRows(p, head, x, n, out, error_flags, stream);
}

void PrefillWrite(const CacheParams& c, const uint16_t* key, const uint16_t* value, int tokens,
                  const int32_t* page_table, const HeadData& key_heads,
                  const HeadData& value_heads, const PagePool& key_pool,
                  const PagePool& value_pool, const Windows& windows, int* error_flags,
                  cudaStream_t stream) {
  constexpr const char* kWhat = "PrefillWrite";
  CheckCacheParams(c, kWhat);
  KVQ_CHECK(tokens >= 0, kInvalidArgument, kWhat, ": token count ", tokens, " is negative");
  if (tokens == 0) return;
  KVQ_REQUIRE_POINTER(key, kWhat);
  KVQ_REQUIRE_POINTER(value, kWhat);
  KVQ_CHECK(Aligned16(key) && Aligned16(value), kInvalidArgument, kWhat,
            ": key / value rows are not 16-byte aligned");
  const size_t row_elems = static_cast<size_t>(c.num_kv_heads) * c.head_dim();

  // Everything is validated before the first launch. The history goes first (two long
  // launches), then both tensors' bf16 windows in one short one: queued behind the history,
  // the window launch costs the stream no idle time. The history is [S0, S0 + H(T)), whole
  // flushes (and so whole tiles).
  const int history = static_cast<int>(c.HistoryTokens(tokens));
  if (history > 0) {
    KVQ_REQUIRE_POINTER(page_table, kWhat);
    CheckPool(key_pool, kWhat);
    CheckPool(value_pool, kWhat);
  }
  PrefillWindowsArgs w;
  w.key = key;
  w.value = value;
  w.row_elems = static_cast<int64_t>(row_elems);
  w.sink_tokens = std::min(c.sink, tokens);
  w.recent_begin = static_cast<int>(c.RecentBegin(tokens));  // tokens when all are sink
  w.tokens = tokens;
  w.recent = c.ring_slots();
  if (w.sink_tokens > 0) {
    KVQ_REQUIRE_POINTER(windows.sink_key, kWhat);
    KVQ_REQUIRE_POINTER(windows.sink_value, kWhat);
    w.sink_key = windows.sink_key;
    w.sink_value = windows.sink_value;
  }
  if (w.recent_begin < tokens) {
    KVQ_REQUIRE_POINTER(windows.recent_key, kWhat);
    KVQ_REQUIRE_POINTER(windows.recent_value, kWhat);
    w.recent_key = windows.recent_key;
    w.recent_value = windows.recent_value;
  }
  KVQ_CHECK(Aligned16(w.sink_key) && Aligned16(w.sink_value) && Aligned16(w.recent_key) &&
                Aligned16(w.recent_value),
            kInvalidArgument, kWhat, ": sink / recent windows are not 16-byte aligned");
  if (history > 0) {
    FusedWriteArgs a;
    a.x_is_bf16 = true;
    a.num_heads = c.num_kv_heads;
    a.num_tokens = history;
    a.token_stride = static_cast<int64_t>(row_elems);
    a.first_token = c.sink;
    a.mode = WriteMode::kPrefill;
    a.page_table = page_table;
    a.page_size_log2 = Log2(c.page_size);
    a.error_flags = error_flags;
    LaunchHistories(c, key_heads, value_heads, key_pool, value_pool, a, key, value, nullptr,
                    nullptr, kWhat, stream);
    w.overlap_previous = true;  // shares nothing with the value launch
  }

  KVQ_CUDA_CHECK(LaunchPrefillWindows(w, stream));
}

void AppendStepLaunches(const CacheParams& c, const uint16_t* key, const uint16_t* value,
                        int batch, const int32_t* lengths, const int32_t* page_tables,
                        int max_pages, const HeadData& key_heads, const HeadData& value_heads,
                        const PagePool& key_pool, const PagePool& value_pool,
                        const Windows& windows, int* error_flags, bool overlap_previous,
                        cudaStream_t stream) {
  constexpr const char* kWhat = "AppendStep";
  CheckCacheParams(c, kWhat);
  KVQ_CHECK(batch >= 0, kInvalidArgument, kWhat, ": batch ", batch, " is negative");
  KVQ_CHECK(max_pages >= 0, kInvalidArgument, kWhat, ": max_pages ", max_pages,
            " is negative");
  if (batch == 0) return;
  KVQ_REQUIRE_POINTER(key, kWhat);
  KVQ_REQUIRE_POINTER(value, kWhat);
  KVQ_REQUIRE_POINTER(lengths, kWhat);
  const int ring = c.ring_slots();  // W + F - 1; 0 with W = 0 and F = 1 (no recent rows)
  if (ring > 0) {
    KVQ_REQUIRE_POINTER(windows.recent_key, kWhat);
    KVQ_REQUIRE_POINTER(windows.recent_value, kWhat);
  }
  if (c.sink > 0) {
    KVQ_REQUIRE_POINTER(windows.sink_key, kWhat);
    KVQ_REQUIRE_POINTER(windows.sink_value, kWhat);
  }
  KVQ_CHECK(Aligned16(key) && Aligned16(value) && Aligned16(windows.recent_key) &&
                Aligned16(windows.recent_value) && Aligned16(windows.sink_key) &&
                Aligned16(windows.sink_value),
            kInvalidArgument, kWhat, ": a bf16 buffer is not 16-byte aligned");
  const int64_t row_elems = static_cast<int64_t>(c.num_kv_heads) * c.head_dim();

  // Demotions first: they read ring slots that the new tokens overwrite. They always run: a
  // sequence that is due to demote with no page for it (max_pages == 0 included) raises
  // kErrorFlagBadPage instead of being skipped silently.
  KVQ_CHECK(max_pages == 0 || page_tables != nullptr, kInvalidArgument, kWhat,
            ": page_tables is null with max_pages ", max_pages);
  CheckPool(key_pool, kWhat);
  CheckPool(value_pool, kWhat);
  // F = 1 with W >= 1 demotes one ring row per sequence (kAppend, spec 1.0's rule); any other
  // window rule flushes F rows (or none), the step's own row among them when W = 0 (kFlush).
  const bool flush = c.flush > 1 || c.recent == 0;
  FusedWriteArgs a;
  a.x_is_bf16 = true;
  a.num_heads = c.num_kv_heads;
  a.num_tokens = batch;
  a.token_stride = row_elems;
  a.mode = flush ? WriteMode::kFlush : WriteMode::kAppend;
  a.page_table = page_tables;
  a.page_table_stride = max_pages;
  a.page_size_log2 = Log2(c.page_size);
  a.seq_lengths = lengths;
  a.sink = c.sink;
  a.recent = c.recent;
  a.seq_stride = static_cast<int64_t>(ring) * row_elems;
  a.flush = c.flush;
  a.ring_slots = ring;
  a.error_flags = error_flags;
  a.overlap_previous = overlap_previous;
  // With no ring (W = 0, F = 1) the rows read are the step's own: x names them too, so that
  // every pointer a kernel may touch is a real one.
  LaunchHistories(c, key_heads, value_heads, key_pool, value_pool, a,
                  ring > 0 ? windows.recent_key : key, ring > 0 ? windows.recent_value : value,
                  flush ? key : nullptr, flush ? value : nullptr, kWhat, stream);

  // With no sink and no ring (S0 = W = 0, F = 1: SAW-INT4, fp8, the codebook schemes) every
  // new token is history, which the launches above wrote: no window copy to launch.
  if (c.sink == 0 && ring == 0) return;
  AppendCopyArgs copy;
  copy.key = key;
  copy.value = value;
  copy.sink_key = windows.sink_key;
  copy.sink_value = windows.sink_value;
  copy.recent_key = windows.recent_key;
  copy.recent_value = windows.recent_value;
  copy.seq_lengths = lengths;
  copy.batch = batch;
  copy.num_heads = c.num_kv_heads;
  copy.head_dim = c.head_dim();
  copy.sink = c.sink;
  copy.recent = ring;
  copy.window = c.recent;
  copy.flush = c.flush;
  copy.error_flags = error_flags;
  copy.overlap_previous = true;  // starts in the demotions' tail, waits for them before a row
  KVQ_CHECK_LAUNCH(LaunchAppendCopy(copy, stream), kWhat, c.key);
}

void AppendStep(const CacheParams& c, const uint16_t* key, const uint16_t* value, int batch,
                const int32_t* lengths, const int32_t* page_tables, int max_pages,
                const HeadData& key_heads, const HeadData& value_heads,
                const PagePool& key_pool, const PagePool& value_pool, const Windows& windows,
                int* error_flags, cudaStream_t stream) {
  AppendStepLaunches(c, key, value, batch, lengths, page_tables, max_pages, key_heads,
                     value_heads, key_pool, value_pool, windows, error_flags,
                     /*overlap_previous=*/false, stream);
}

void CheckErrorFlags(const int* error_flags, const char* what, cudaStream_t stream) {
  KVQ_REQUIRE_POINTER(error_flags, what);
  int flags = 0;
  KVQ_CUDA_CHECK(cudaMemcpyAsync(&flags, error_flags, sizeof flags, cudaMemcpyDeviceToHost,
                                 stream));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  KVQ_CHECK((flags & kErrorFlagNonFinite) == 0, kNonFinite, what,
            ": an input row is not finite or rotates above 2^126 (error flags ", flags, ")");
  KVQ_CHECK((flags & kErrorFlagBadPage) == 0, kInvalidArgument, what,
            ": a page id is outside the pool or a page index is past the page table (error "
            "flags ", flags, ")");
  KVQ_CHECK((flags & kErrorFlagBadLength) == 0, kInvalidArgument, what,
            ": a sequence length is negative (error flags ", flags, ")");
  KVQ_CHECK(flags == 0, kInvalidArgument, what, ": unknown error flags ", flags);
}

}  // namespace kvq::gpu
