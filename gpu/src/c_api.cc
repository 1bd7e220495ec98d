// The C ABI of libkvq_gpu.so (kvq/gpu/c_api.h): translation only. Each function turns its plain
// arguments into the runtime API's structs (CacheParams, HeadData, PagePool, Windows,
// DecodeAttentionInputs), calls PrefillWrite / AppendStep / DecodeAttention, and turns a thrown
// kvq::Error into a status and a thread-local message. The validation that matters is the
// runtime API's; what is checked here is what only the C signature carries (a handle, a side,
// a plane index, the counts beside the pointers).
#include "kvq/gpu/c_api.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <exception>
#include <new>
#include <set>
#include <string>
#include <type_traits>

#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/head_data.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/rotation.h"
#include "kvq/gpu/write.h"

struct kvq_cache {
  kvq::CacheParams params;
};

namespace kvq::gpu {
namespace {

std::string& LastError() {
  thread_local std::string message;
  return message;
}

// Runs `fn`, turning every exception into a status and LastError(); `what` (the C function's
// name) starts the message.
template <class Fn>
int Guard(const char* what, Fn&& fn) {
  LastError().clear();
  try {
    fn();
    return KVQ_OK;
  } catch (const Error& e) {
    LastError() = std::string(what) + ": " + e.what();
    return static_cast<int>(e.code()) + 1;
  } catch (const std::bad_alloc&) {
    LastError() = std::string(what) + ": out of host memory";
    return KVQ_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    LastError() = std::string(what) + ": " + e.what();
    return KVQ_ERROR_INTERNAL;
  } catch (...) {
    LastError() = std::string(what) + ": an unknown exception";
    return KVQ_ERROR_INTERNAL;
  }
}

#define KVQ_C_REQUIRE(ptr) KVQ_CHECK((ptr) != nullptr, kInvalidArgument, #ptr " is null")

const CacheParams& ParamsOf(const kvq_cache* cache) {
  KVQ_C_REQUIRE(cache);
  return cache->params;
}

const WriteParams& SideOf(const CacheParams& c, int side) {
  KVQ_CHECK(side == KVQ_SIDE_KEY || side == KVQ_SIDE_VALUE, kInvalidArgument, "side ", side,
            " is neither KVQ_SIDE_KEY (0) nor KVQ_SIDE_VALUE (1)");
  return side == KVQ_SIDE_KEY ? c.key : c.value;
}

// The keys kvq_cache_create accepts: PutCacheParams' cache keys and every write_params.inc row's
// key under "key." and "value.".
const std::set<std::string>& KnownKeys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = {"num_kv_heads", "num_q_heads", "sink",     "recent",
                               "flush",        "page_size",   "quantized", "softmax_scale"};
    for (const char* prefix : {"key.", "value."}) {
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  k.insert(std::string(prefix) + key);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
    }
    return k;
  }();
  return keys;
}

std::string Trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") - begin + 1);
}

// "name=value" entries separated by ';' or newlines; empty entries are skipped.
Metadata ParseParamsText(const char* params) {
  KVQ_C_REQUIRE(params);
  Metadata metadata;
  std::string entry;
  const std::string all(params);
  size_t begin = 0;
  while (begin <= all.size()) {
    const size_t end = all.find_first_of(";\n", begin);
    entry = Trim(all.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    begin = end == std::string::npos ? all.size() + 1 : end + 1;
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    KVQ_CHECK(eq != std::string::npos, kInvalidArgument, "entry '", entry,
              "' is not name=value");
    const std::string name = Trim(entry.substr(0, eq));
    const std::string value = Trim(entry.substr(eq + 1));
    KVQ_CHECK(KnownKeys().count(name) != 0, kInvalidArgument, "unknown parameter '", name,
              "' (the keys of spec/formats.md's cache metadata: num_kv_heads, key.bits, ...)");
    KVQ_CHECK(metadata.count(name) == 0, kInvalidArgument, "parameter '", name,
              "' is given twice");
    metadata[name] = value;
  }
  return metadata;
}

int32_t DTypeCode(DType dtype, const char* what) {
  switch (dtype) {
    case DType::kU8: return KVQ_DTYPE_U8;
    case DType::kBF16: return KVQ_DTYPE_BF16;
    case DType::kF32: return KVQ_DTYPE_F32;
    default: break;
  }
  KVQ_CHECK(false, kUnsupported, what, " has dtype ", DTypeName(dtype),
            ", which the C ABI does not name");
  return -1;
}

// The per-head rows in kvq_head_row_name's order: head_data.inc's arrays, then its scalars.
struct HeadRow {
  const char* name;
  DType dtype;
  bool scalar;
};
constexpr HeadRow kHeadRows[] = {
#define KVQ_HEAD_ARRAY(name, Type, ...) \
  {#name, std::is_same<Type, float>::value ? DType::kF32 : DType::kU8, false},
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) {#name, DType::kF32, true},
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
};
constexpr int kNumHeadRows = static_cast<int>(sizeof(kHeadRows) / sizeof(kHeadRows[0]));

// How a side's parameters use row `row`: an array as head_data.inc's `use` says; a scalar is
// required where the decode kernels read it per head (the fp8 scales), else optional for a
// quantized side whose format reads its field.
int32_t HeadRowUse(const WriteParams& p, int row) {
  int index = 0;
#define KVQ_HEAD_ARRAY(name, Type, extent, use, ...)                                 \
  if (index++ == row) {                                                             \
    const HeadArrayUse u = (use);                                                   \
    return u == HeadArrayUse::kRequired   ? KVQ_HEAD_ROW_REQUIRED                   \
           : u == HeadArrayUse::kOptional ? KVQ_HEAD_ROW_OPTIONAL                   \
                                          : KVQ_HEAD_ROW_ABSENT;                    \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                  \
  if (index++ == row) {                                                                \
    if (std::string(#field) == "head_scale" && !FormatReads(p.format, "head_scale")) { \
      return KVQ_HEAD_ROW_ABSENT;                                                      \
    }                                                                                  \
    if (std::string(#field) == "head_scale" &&                                         \
        attention::DecodeFormatOf(p.format).head_scale) {                              \
      return KVQ_HEAD_ROW_REQUIRED;                                                    \
    }                                                                                  \
    return p.quantized() ? KVQ_HEAD_ROW_OPTIONAL : KVQ_HEAD_ROW_ABSENT;                \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  return KVQ_HEAD_ROW_ABSENT;
}

int64_t HeadRowElements(const WriteParams& p, int row) {
  int index = 0;
#define KVQ_HEAD_ARRAY(name, Type, extent, ...) \
  if (index++ == row) return static_cast<int64_t>(extent);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return 1;  // a scalar: one value per KV head
}

// One side's device HeadData from an array of kNumHeadRows pointers (null: none given). A row
// the side requires must be given; a row it does not use must not be (a caller's mix-up).
HeadData HeadsOf(const WriteParams& p, const void* const* rows, const char* side) {
  HeadData heads;
  for (int r = 0; r < kNumHeadRows; ++r) {
    const void* ptr = rows != nullptr ? rows[r] : nullptr;
    const int32_t use = HeadRowUse(p, r);
    KVQ_CHECK(use != KVQ_HEAD_ROW_REQUIRED || ptr != nullptr, kInvalidArgument, side,
              " per-head row '", kHeadRows[r].name, "' is required by format ",
              FormatName(p.format), " (rotation ", RotationKindName(p.rotation),
              ") but is null");
    KVQ_CHECK(use != KVQ_HEAD_ROW_ABSENT || ptr == nullptr, kInvalidArgument, side,
              " per-head row '", kHeadRows[r].name, "' is given but format ",
              FormatName(p.format), " (rotation ", RotationKindName(p.rotation),
              ") does not read it");
    KVQ_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0 || kHeadRows[r].scalar,
              kInvalidArgument, side, " per-head row '", kHeadRows[r].name,
              "' is not 16-byte aligned");
    KVQ_CHECK(reinterpret_cast<uintptr_t>(ptr) % 4 == 0, kInvalidArgument, side,
              " per-head row '", kHeadRows[r].name, "' is not 4-byte aligned");
  }
  int index = 0;
#define KVQ_HEAD_ARRAY(name, Type, ...) \
  heads.name = rows != nullptr ? static_cast<const Type*>(rows[index]) : nullptr; \
  ++index;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                              \
  heads.name = rows != nullptr ? static_cast<const float*>(rows[index]) : nullptr; \
  ++index;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  return heads;
}

PagePool PoolOf(const WriteParams& p, void* const* planes, int64_t num_pages, const char* side) {
  KVQ_CHECK(planes != nullptr, kInvalidArgument, side, " pool planes are null");
  KVQ_CHECK(num_pages >= 1 && num_pages <= INT_MAX, kInvalidArgument, side, " pool of ",
            num_pages, " pages is outside [1, ", INT_MAX, "]");
  PagePool pool;
  const FormatLayout layout = LayoutOf(p);
  for (int i = 0; i < layout.num_planes; ++i) {
    pool.planes[i] = static_cast<uint8_t*>(planes[i]);
    KVQ_CHECK(pool.planes[i] != nullptr, kInvalidArgument, side, " pool plane ", i, " ('",
              layout.plane(i).name, "') is null");
  }
  pool.num_pages = static_cast<int>(num_pages);
  return pool;
}

cudaStream_t StreamOf(void* stream) { return static_cast<cudaStream_t>(stream); }

DecodeAttentionPlan PlanOf(const CacheParams& c, int32_t batch, int32_t max_seq_len) {
  KVQ_CHECK(batch >= 1, kInvalidArgument, "batch ", batch, " is below 1");
  KVQ_CHECK(max_seq_len >= 1, kInvalidArgument, "max_seq_len ", max_seq_len, " is below 1");
  return PlanDecodeAttention(c, batch, max_seq_len);
}

// The writes' refusal of the bf16 baseline cache, whose pages hold the rows as given.
void RequireKvqWrite(const CacheParams& c) {
  KVQ_CHECK(c.quantized(), kUnsupported,
            "the bf16 baseline cache has no kvq write (its pages hold the rows as given: the "
            "caller copies them)");
}

// The bf16 windows a write fills (kvq::gpu::Windows).
Windows WindowsOf(void* sink_key, void* sink_value, void* recent_key, void* recent_value) {
  return Windows{static_cast<uint16_t*>(sink_key), static_cast<uint16_t*>(sink_value),
                 static_cast<uint16_t*>(recent_key), static_cast<uint16_t*>(recent_value)};
}

// kvq_decode's and kvq_decode_step's view of the cache they attend over, checked.
DecodeAttentionInputs DecodeInputsOf(const CacheParams& c, const float* q, int32_t batch,
                                     int32_t max_seq_len, const int32_t* seq_lens,
                                     const int32_t* page_tables, int32_t max_pages,
                                     const void* const* key_heads, const void* const* value_heads,
                                     const void* const* key_planes,
                                     const void* const* value_planes, const void* sink_key,
                                     const void* sink_value, const void* recent_key,
                                     const void* recent_value, const float* out,
                                     int64_t workspace_bytes) {
  KVQ_CHECK(workspace_bytes >= 0, kInvalidArgument, "workspace of ", workspace_bytes,
            " bytes is negative");
  KVQ_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
            kInvalidArgument, "q or out is not 16-byte aligned");
  KVQ_CHECK(key_planes != nullptr && value_planes != nullptr, kInvalidArgument,
            "key_planes or value_planes is null");
  DecodeAttentionInputs in;
  in.batch = batch;
  in.max_seq_len = max_seq_len;
  in.seq_lens = seq_lens;
  in.page_tables = page_tables;
  in.max_pages = max_pages;
  for (int kv = 0; kv < 2; ++kv) {
    const kvq::FormatLayout layout = kvq::LayoutOf(kv == 0 ? c.key : c.value);
    const void* const* planes = kv == 0 ? key_planes : value_planes;
    for (int i = 0; i < layout.num_planes; ++i) {
      KVQ_CHECK(planes[i] != nullptr, kInvalidArgument, kv == 0 ? "key" : "value",
                " pool plane ", i, " ('", layout.plane(i).name, "') is null");
      (kv == 0 ? in.key_planes : in.value_planes)[i] = static_cast<const uint8_t*>(planes[i]);
    }
  }
  in.sink_key = static_cast<const uint16_t*>(sink_key);
  in.sink_value = static_cast<const uint16_t*>(sink_value);
  in.recent_key = static_cast<const uint16_t*>(recent_key);
  in.recent_value = static_cast<const uint16_t*>(recent_value);
  in.key_heads = HeadsOf(c.key, key_heads, "key");
  in.value_heads = HeadsOf(c.value, value_heads, "value");
  in.q = q;
  return in;
}

}  // namespace
}  // namespace kvq::gpu

using kvq::ErrorCode;
using namespace kvq::gpu;  // NOLINT: the C functions below are one translation layer

extern "C" {

int kvq_c_api_version(void) { return KVQ_C_API_VERSION; }

const char* kvq_last_error(void) { return LastError().c_str(); }

int kvq_cache_create(const char* params, kvq_cache** out) {
  return Guard("kvq_cache_create", [&] {
    KVQ_C_REQUIRE(out);
    *out = nullptr;
    const kvq::Metadata metadata = ParseParamsText(params);
    const kvq::MetadataReader reader(metadata, "cache parameters");
    kvq::CacheParams c;
    try {
      c = kvq::GetCacheParams(reader);
    } catch (const kvq::Error& e) {
      // The codec reads files (kMalformedFile); here the text is an argument.
      if (e.code() != ErrorCode::kMalformedFile) throw;
      throw kvq::Error(ErrorCode::kInvalidArgument, e.what());
    }
    // The decode step's planner refuses what its kernels do not serve, naming it; one
    // multiprocessor stands for the device (the plan itself is made per call).
    (void)PlanDecodeAttention(c, 1, 1, /*num_sms=*/1);
    *out = new kvq_cache{c};
  });
}

void kvq_cache_destroy(kvq_cache* cache) { delete cache; }

int kvq_cache_dims(const kvq_cache* cache, int32_t* dims) {
  return Guard("kvq_cache_dims", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    KVQ_C_REQUIRE(dims);
    dims[KVQ_DIM_HEAD_DIM] = c.head_dim();
    dims[KVQ_DIM_KV_HEADS] = c.num_kv_heads;
    dims[KVQ_DIM_Q_HEADS] = c.num_q_heads;
    dims[KVQ_DIM_SINK] = c.sink;
    dims[KVQ_DIM_RECENT] = c.recent;
    dims[KVQ_DIM_FLUSH] = c.flush;
    dims[KVQ_DIM_PAGE_SIZE] = c.page_size;
    dims[KVQ_DIM_RING_SLOTS] = c.ring_slots();
    dims[KVQ_DIM_QUANTIZED] = c.quantized() ? 1 : 0;
  });
}

int kvq_cache_history_tokens(const kvq_cache* cache, int64_t t, int64_t* out) {
  return Guard("kvq_cache_history_tokens", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    KVQ_C_REQUIRE(out);
    KVQ_CHECK(t >= 0, kInvalidArgument, "length ", t, " is negative");
    *out = c.HistoryTokens(t);
  });
}

int kvq_pool_num_planes(const kvq_cache* cache, int side, int32_t* out) {
  return Guard("kvq_pool_num_planes", [&] {
    const kvq::WriteParams& p = SideOf(ParamsOf(cache), side);
    KVQ_C_REQUIRE(out);
    *out = kvq::LayoutOf(p).num_planes;
  });
}

int kvq_pool_plane(const kvq_cache* cache, int side, int32_t plane, int64_t num_pages,
                   int64_t* shape, int32_t* dtype, int64_t* bytes, const char** name) {
  return Guard("kvq_pool_plane", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    const kvq::FormatLayout layout = kvq::LayoutOf(SideOf(c, side));
    KVQ_CHECK(plane >= 0 && plane < layout.num_planes, kInvalidArgument, "plane ", plane,
              " is outside [0, ", layout.num_planes, ") of format ", kvq::FormatName(layout.format));
    KVQ_CHECK(num_pages >= 0, kInvalidArgument, "page count ", num_pages, " is negative");
    const kvq::PlaneSpec& spec = layout.plane(plane);
    const int64_t heads = layout.HeadsPerPage(plane, c.num_kv_heads);
    const int64_t rows = layout.RowsPerPage(plane, c.page_size);
    if (shape != nullptr) {
      shape[0] = num_pages;
      shape[1] = heads;
      shape[2] = rows;
      shape[3] = spec.elements;
    }
    if (dtype != nullptr) *dtype = DTypeCode(spec.dtype, spec.name);
    if (bytes != nullptr) {
      *bytes = num_pages * static_cast<int64_t>(layout.PageBytes(plane, c.page_size, c.num_kv_heads));
    }
    if (name != nullptr) *name = spec.name;
  });
}

int kvq_head_rows(void) { return kNumHeadRows; }

const char* kvq_head_row_name(int32_t row) {
  return row >= 0 && row < kNumHeadRows ? kHeadRows[row].name : nullptr;
}

int kvq_head_row_shape(const kvq_cache* cache, int side, int32_t row, int64_t* elements,
                       int32_t* dtype, int32_t* use) {
  return Guard("kvq_head_row_shape", [&] {
    const kvq::WriteParams& p = SideOf(ParamsOf(cache), side);
    KVQ_CHECK(row >= 0 && row < kNumHeadRows, kInvalidArgument, "per-head row ", row,
              " is outside [0, ", kNumHeadRows, ")");
    if (elements != nullptr) *elements = HeadRowElements(p, row);
    if (dtype != nullptr) *dtype = DTypeCode(kHeadRows[row].dtype, kHeadRows[row].name);
    if (use != nullptr) *use = HeadRowUse(p, row);
  });
}

int kvq_write_prefill(const kvq_cache* cache, const void* key, const void* value, int32_t tokens,
                      const int32_t* page_table, int64_t page_table_len,
                      const void* const* key_heads, const void* const* value_heads,
                      void* const* key_planes, void* const* value_planes, int64_t num_pages,
                      void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                      int32_t* error_flags, void* stream) {
  return Guard("kvq_write_prefill", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    RequireKvqWrite(c);
    KVQ_CHECK(tokens >= 0, kInvalidArgument, "token count ", tokens, " is negative");
    const int64_t history = c.HistoryTokens(tokens);
    const int64_t pages_needed = (history + c.page_size - 1) / c.page_size;
    KVQ_CHECK(page_table_len >= pages_needed, kInvalidArgument, "page table of ",
              page_table_len, " entries: ", tokens, " tokens put ", history,
              " in the history, which needs ", pages_needed, " pages of ", c.page_size);
    const HeadData kh = HeadsOf(c.key, key_heads, "key");
    const HeadData vh = HeadsOf(c.value, value_heads, "value");
    const PagePool kp = PoolOf(c.key, key_planes, num_pages, "key");
    const PagePool vp = PoolOf(c.value, value_planes, num_pages, "value");
    const Windows windows = WindowsOf(sink_key, sink_value, recent_key, recent_value);
    PrefillWrite(c, static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value),
                 tokens, page_table, kh, vh, kp, vp, windows, error_flags, StreamOf(stream));
  });
}

int kvq_write_append(const kvq_cache* cache, const void* key, const void* value, int32_t batch,
                     const int32_t* lengths, const int32_t* page_tables, int32_t max_pages,
                     const void* const* key_heads, const void* const* value_heads,
                     void* const* key_planes, void* const* value_planes, int64_t num_pages,
                     void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                     int32_t* error_flags, void* stream) {
  return Guard("kvq_write_append", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    RequireKvqWrite(c);
    const HeadData kh = HeadsOf(c.key, key_heads, "key");
    const HeadData vh = HeadsOf(c.value, value_heads, "value");
    const PagePool kp = PoolOf(c.key, key_planes, num_pages, "key");
    const PagePool vp = PoolOf(c.value, value_planes, num_pages, "value");
    const Windows windows = WindowsOf(sink_key, sink_value, recent_key, recent_value);
    AppendStep(c, static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value), batch,
               lengths, page_tables, max_pages, kh, vh, kp, vp, windows, error_flags,
               StreamOf(stream));
  });
}

int kvq_decode_workspace_bytes(const kvq_cache* cache, int32_t batch, int32_t max_seq_len,
                               int64_t* bytes) {
  return Guard("kvq_decode_workspace_bytes", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    KVQ_C_REQUIRE(bytes);
    *bytes = static_cast<int64_t>(PlanOf(c, batch, max_seq_len).workspace_bytes);
  });
}

int kvq_decode(const kvq_cache* cache, const float* q, int32_t batch, int32_t max_seq_len,
               const int32_t* seq_lens, const int32_t* page_tables, int32_t max_pages,
               const void* const* key_heads, const void* const* value_heads,
               const void* const* key_planes, const void* const* value_planes,
               const void* sink_key, const void* sink_value, const void* recent_key,
               const void* recent_value, float* out, void* workspace, int64_t workspace_bytes,
               void* stream) {
  return Guard("kvq_decode", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    const DecodeAttentionInputs in =
        DecodeInputsOf(c, q, batch, max_seq_len, seq_lens, page_tables, max_pages, key_heads,
                       value_heads, key_planes, value_planes, sink_key, sink_value, recent_key,
                       recent_value, out, workspace_bytes);
    const DecodeAttentionPlan plan = PlanOf(c, batch, max_seq_len);
    DecodeAttention(c, in, plan, workspace, static_cast<size_t>(workspace_bytes), out,
                    StreamOf(stream));
  });
}

int kvq_decode_step(const kvq_cache* cache, const void* key, const void* value,
                    const int32_t* lengths, const float* q, int32_t batch, int32_t max_seq_len,
                    const int32_t* seq_lens, const int32_t* page_tables, int32_t max_pages,
                    const void* const* key_heads, const void* const* value_heads,
                    void* const* key_planes, void* const* value_planes, int64_t num_pages,
                    void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                    int32_t* error_flags, float* out, void* workspace, int64_t workspace_bytes,
                    void* stream) {
  return Guard("kvq_decode_step", [&] {
    const kvq::CacheParams& c = ParamsOf(cache);
    RequireKvqWrite(c);
    const PagePool kp = PoolOf(c.key, key_planes, num_pages, "key");
    const PagePool vp = PoolOf(c.value, value_planes, num_pages, "value");
    const Windows windows = WindowsOf(sink_key, sink_value, recent_key, recent_value);
    const DecodeAttentionInputs in = DecodeInputsOf(
        c, q, batch, max_seq_len, seq_lens, page_tables, max_pages, key_heads, value_heads,
        key_planes, value_planes, sink_key, sink_value, recent_key, recent_value, out,
        workspace_bytes);
    const DecodeAttentionPlan plan = PlanOf(c, batch, max_seq_len);
    DecodeStep(c, static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value), lengths,
               kp, vp, windows, error_flags, in, plan, workspace,
               static_cast<size_t>(workspace_bytes), out, StreamOf(stream));
  });
}

}  // extern "C"
