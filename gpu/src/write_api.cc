// Layer (c) of the CUDA write path: validation, launch and error reporting (write.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

float FwhtScale(int block) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
}

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
  if (status != cudaSuccess) ThrowCudaError(status, what, file, line);
}
#define KVQ_CHECK_LAUNCH(expr, what, p) CheckLaunch((expr), what, p, __FILE__, __LINE__)

int CheckedRows(size_t n, const char* what) {
  KVQ_CHECK(n <= static_cast<size_t>(INT_MAX), kInvalidArgument, what, ": row count ", n,
            " exceeds ", INT_MAX);
  return static_cast<int>(n);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

StageArgs BaseStageArgs(size_t n, const WriteParams& p, const char* what) {
  p.Validate();
  StageArgs a;
  a.rows = static_cast<int64_t>(n);
  KVQ_CHECK(a.rows >= 0 && n <= (static_cast<size_t>(INT64_MAX) / 256), kInvalidArgument, what,
            ": row count ", n, " is too large");
  a.head_dim = p.head_dim;
  a.group = p.group;
  a.bits = p.bits;
  a.clip = p.clip;
  a.fwht_block = p.fwht_block();
  a.fwht_scale = FwhtScale(p.fwht_block());
  return a;
}

void RunStage(Stage stage, const StageArgs& a, const WriteParams& p, cudaStream_t stream) {
  if (a.rows == 0) return;
  KVQ_CHECK_LAUNCH(DispatchStage(stage, a, stream), StageName(stage), p);
}

#define KVQ_REQUIRE_POINTER(ptr, what) \
  KVQ_CHECK((ptr) != nullptr, kInvalidArgument, what, ": " #ptr " is null")

// The fields of FusedWriteArgs that come from WriteParams and per-head data.
FusedWriteArgs WriteArgsFor(const WriteParams& p, const HeadData& heads, const char* what) {
  FusedWriteArgs a;
  a.rotation = static_cast<int>(p.rotation);
  if (p.rotation == RotationKind::kDense) {
    KVQ_CHECK(heads.rotation != nullptr, kInvalidArgument, what,
              ": dense rotation requested but the rotation matrices are null");
    KVQ_CHECK(Aligned16(heads.rotation), kInvalidArgument, what,
              ": the rotation matrices are not 16-byte aligned");
  }
  a.rotations = heads.rotation;
  a.fwht_block = p.fwht_block();
  a.fwht_scale = FwhtScale(p.fwht_block());
  a.bitrev = p.bitrev;
  a.clip = p.clip;
  a.clip_per_head = heads.clip;
  return a;
}

void WriteRowsImpl(const WriteParams& p, const float* rotation, const void* x, bool bf16,
                   size_t n, const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  constexpr const char* kWhat = "WriteRows";
  p.Validate();
  const int rows = CheckedRows(n, kWhat);
  if (rows == 0) return;
  KVQ_REQUIRE_POINTER(x, kWhat);
  KVQ_CHECK(Aligned16(x), kInvalidArgument, kWhat, ": input rows are not 16-byte aligned");
  KVQ_REQUIRE_POINTER(out.packed, kWhat);
  KVQ_REQUIRE_POINTER(out.scale, kWhat);
  KVQ_REQUIRE_POINTER(out.min, kWhat);
  HeadData heads;
  heads.rotation = rotation;
  FusedWriteArgs a = WriteArgsFor(p, heads, kWhat);
  a.x = x;
  a.x_is_bf16 = bf16;
  a.num_heads = 1;
  a.num_tokens = rows;
  a.token_stride = p.head_dim;
  a.mode = WriteMode::kRows;
  a.codes = out.packed;
  a.scale = out.scale;
  a.min = out.min;
  a.rotated = out.rotated;
  a.tau = out.tau;
  a.error_flags = error_flags;
  KVQ_CHECK_LAUNCH(DispatchFusedWrite(p.head_dim, p.group, p.bits, a, stream), kWhat, p);
}

void CheckPool(const PagePool& pool, const char* what) {
  KVQ_CHECK(pool.codes != nullptr && pool.scale != nullptr && pool.min != nullptr,
            kInvalidArgument, what, ": a page pool pointer is null");
  KVQ_CHECK(pool.num_pages > 0, kInvalidArgument, what, ": the page pool has ", pool.num_pages,
            " pages");
}

void CheckCacheParams(const CacheParams& c, const char* what) {
  c.Validate();
  KVQ_CHECK(c.quantized(), kInvalidArgument, what,
            ": the cache format is bf16; the bf16 baseline has no history pages to write");
  KVQ_CHECK(c.num_kv_heads <= 65535, kInvalidArgument, what, ": num_kv_heads ", c.num_kv_heads,
            " exceeds 65535");
}

// The arguments of a history write (prefill or demotion) of K or V: `a` with the rotation,
// clip and pool of that tensor (validated).
FusedWriteArgs HistoryArgs(const WriteParams& p, const HeadData& heads, const PagePool& pool,
                           FusedWriteArgs a, const char* what) {
  const FusedWriteArgs from_params = WriteArgsFor(p, heads, what);
  a.rotation = from_params.rotation;
  a.rotations = from_params.rotations;
  a.fwht_block = from_params.fwht_block;
  a.fwht_scale = from_params.fwht_scale;
  a.bitrev = from_params.bitrev;
  a.clip = from_params.clip;
  a.clip_per_head = from_params.clip_per_head;
  a.codes = pool.codes;
  a.scale = pool.scale;
  a.min = pool.min;
  a.num_pages = pool.num_pages;
  return a;
}

// The key and the value history writes of `base` (rows key_rows / value_rows). Both are
// validated before the key launch is queued, so a bad value argument writes nothing; the value
// launch overlaps the key launch's tail (they share nothing but the error flags' atomic OR).
void LaunchHistories(const CacheParams& c, const HeadData& key_heads, const HeadData& value_heads,
                     const PagePool& key_pool, const PagePool& value_pool, FusedWriteArgs base,
                     const void* key_rows, const void* value_rows, const char* what,
                     cudaStream_t stream) {
  const std::string key_what = std::string(what) + " (key)";
  const std::string value_what = std::string(what) + " (value)";
  base.x = key_rows;
  const FusedWriteArgs k = HistoryArgs(c.key, key_heads, key_pool, base, key_what.c_str());
  base.x = value_rows;
  base.overlap_previous = true;
  const FusedWriteArgs v = HistoryArgs(c.value, value_heads, value_pool, base, value_what.c_str());
  KVQ_CHECK_LAUNCH(DispatchFusedWrite(c.key.head_dim, c.key.group, c.key.bits, k, stream),
                   key_what.c_str(), c.key);
  KVQ_CHECK_LAUNCH(DispatchFusedWrite(c.value.head_dim, c.value.group, c.value.bits, v, stream),
                   value_what.c_str(), c.value);
}

}  // namespace

// ---- Stages ------------------------------------------------------------------------------------

void RotateDense(const float* x, const float* r, float* y, size_t n, const WriteParams& p,
                 cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "rotate_dense");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(x, "rotate_dense");
  KVQ_REQUIRE_POINTER(r, "rotate_dense");
  KVQ_REQUIRE_POINTER(y, "rotate_dense");
  a.x = x;
  a.r = r;
  a.y = y;
  RunStage(Stage::kRotateDense, a, p, stream);
}

void Fwht(float* x, size_t n, const WriteParams& p, cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "fwht");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(x, "fwht");
  a.y = x;
  RunStage(Stage::kFwht, a, p, stream);
}

void Bitrev(const float* x, float* y, size_t n, const WriteParams& p, cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "bitrev");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(x, "bitrev");
  KVQ_REQUIRE_POINTER(y, "bitrev");
  KVQ_CHECK(x != y, kInvalidArgument, "bitrev: input and output alias");
  a.x = x;
  a.y = y;
  RunStage(Stage::kBitrev, a, p, stream);
}

void Clip(float* x, float* tau, size_t n, const WriteParams& p, cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "clip");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(x, "clip");
  KVQ_REQUIRE_POINTER(tau, "clip");
  a.y = x;
  a.tau = tau;
  RunStage(Stage::kClip, a, p, stream);
}

void Quantize(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
              const WriteParams& p, cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "quantize");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(x, "quantize");
  KVQ_REQUIRE_POINTER(codes, "quantize");
  KVQ_REQUIRE_POINTER(scale, "quantize");
  KVQ_REQUIRE_POINTER(min, "quantize");
  a.x = x;
  a.codes = codes;
  a.scale = scale;
  a.min = min;
  RunStage(Stage::kQuantize, a, p, stream);
}

void Pack(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p,
          cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "pack");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(codes, "pack");
  KVQ_REQUIRE_POINTER(packed, "pack");
  a.codes_in = codes;
  a.packed = packed;
  RunStage(Stage::kPack, a, p, stream);
}

void Unpack(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p,
            cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "unpack");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(packed, "unpack");
  KVQ_REQUIRE_POINTER(codes, "unpack");
  a.packed_in = packed;
  a.codes = codes;
  RunStage(Stage::kUnpack, a, p, stream);
}

void Dequantize(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                size_t n, const WriteParams& p, cudaStream_t stream) {
  StageArgs a = BaseStageArgs(n, p, "dequantize");
  if (n == 0) return;
  KVQ_REQUIRE_POINTER(codes, "dequantize");
  KVQ_REQUIRE_POINTER(scale, "dequantize");
  KVQ_REQUIRE_POINTER(min, "dequantize");
  KVQ_REQUIRE_POINTER(y, "dequantize");
  a.codes_in = codes;
  a.scale_in = scale;
  a.min_in = min;
  a.y = y;
  RunStage(Stage::kDequantize, a, p, stream);
}

// ---- Fused writes ------------------------------------------------------------------------------

void WriteRows(const WriteParams& p, const float* rotation, const uint16_t* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  WriteRowsImpl(p, rotation, x, /*bf16=*/true, n, out, error_flags, stream);
}

void WriteRows(const WriteParams& p, const float* rotation, const float* x, size_t n,
               const RowOutputs& out, int* error_flags, cudaStream_t stream) {
  WriteRowsImpl(p, rotation, x, /*bf16=*/false, n, out, error_flags, stream);
}

TimedRowWrite TimeWriteRows(const WriteParams& p, const float* rotation, const float* x, size_t n,
                            int iters, int warmup) {
  constexpr const char* kWhat = "TimeWriteRows";
  p.Validate();
  KVQ_CHECK(HasCudaDevice(), kUnsupported, kWhat, ": no CUDA device");
  const int rows = CheckedRows(n, kWhat);
  KVQ_CHECK(rows > 0, kInvalidArgument, kWhat, ": no rows to write");
  KVQ_REQUIRE_POINTER(x, kWhat);
  const bool dense = p.rotation == RotationKind::kDense;
  if (dense) KVQ_REQUIRE_POINTER(rotation, kWhat);
  const size_t d = static_cast<size_t>(p.head_dim);
  DeviceArray<float> dx(x, n * d);
  DeviceArray<float> dr(dense ? rotation : nullptr, dense ? d * d : 0);
  DeviceArray<uint8_t> packed(n * static_cast<size_t>(p.code_bytes()));
  DeviceArray<uint16_t> scale(n * static_cast<size_t>(p.num_groups()));
  DeviceArray<uint16_t> min(n * static_cast<size_t>(p.num_groups()));
  DeviceArray<int> flags(1);
  KVQ_CUDA_CHECK(cudaMemset(flags.get(), 0, flags.bytes()));
  RowOutputs out;
  out.packed = packed.get();
  out.scale = scale.get();
  out.min = min.get();
  TimedRowWrite result;
  result.median_us = MedianDeviceMicros(
      [&] { WriteRows(p, dr.get(), dx.get(), n, out, flags.get()); }, iters, warmup, true);
  CheckErrorFlags(flags.get(), kWhat);
  result.packed = packed.Download();
  result.scale = scale.Download();
  result.min = min.Download();
  return result;
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
  // the window launch costs the stream no idle time.
  const int history = tokens - c.recent - c.sink;
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
  w.recent_begin = std::max(w.sink_tokens, tokens - c.recent);  // tokens when all are sink
  w.tokens = tokens;
  w.recent = c.recent;
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
    LaunchHistories(c, key_heads, value_heads, key_pool, value_pool, a, key, value, kWhat,
                    stream);
    w.overlap_previous = true;  // shares nothing with the value launch
  }

  KVQ_CUDA_CHECK(LaunchPrefillWindows(w, stream));
}

void AppendStep(const CacheParams& c, const uint16_t* key, const uint16_t* value, int batch,
                const int32_t* lengths, const int32_t* page_tables, int max_pages,
                const HeadData& key_heads, const HeadData& value_heads,
                const PagePool& key_pool, const PagePool& value_pool, const Windows& windows,
                int* error_flags, cudaStream_t stream) {
  constexpr const char* kWhat = "AppendStep";
  CheckCacheParams(c, kWhat);
  KVQ_CHECK(batch >= 0, kInvalidArgument, kWhat, ": batch ", batch, " is negative");
  KVQ_CHECK(max_pages >= 0, kInvalidArgument, kWhat, ": max_pages ", max_pages,
            " is negative");
  if (batch == 0) return;
  KVQ_REQUIRE_POINTER(key, kWhat);
  KVQ_REQUIRE_POINTER(value, kWhat);
  KVQ_REQUIRE_POINTER(lengths, kWhat);
  KVQ_REQUIRE_POINTER(windows.recent_key, kWhat);
  KVQ_REQUIRE_POINTER(windows.recent_value, kWhat);
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
  FusedWriteArgs a;
  a.x_is_bf16 = true;
  a.num_heads = c.num_kv_heads;
  a.num_tokens = batch;
  a.token_stride = row_elems;
  a.mode = WriteMode::kAppend;
  a.page_table = page_tables;
  a.page_table_stride = max_pages;
  a.page_size_log2 = Log2(c.page_size);
  a.seq_lengths = lengths;
  a.sink = c.sink;
  a.recent = c.recent;
  a.seq_stride = static_cast<int64_t>(c.recent) * row_elems;
  a.error_flags = error_flags;
  LaunchHistories(c, key_heads, value_heads, key_pool, value_pool, a, windows.recent_key,
                  windows.recent_value, kWhat, stream);

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
  copy.recent = c.recent;
  copy.error_flags = error_flags;
  copy.overlap_previous = true;  // starts in the demotions' tail, waits for them before a row
  KVQ_CHECK_LAUNCH(LaunchAppendCopy(copy, stream), kWhat, c.key);
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
