#include "kvq/common/params.h"

#include <cmath>

#include "kvq/common/error.h"
#include "kvq/common/format.h"

namespace kvq {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kShapeMismatch: return "shape mismatch";
    case ErrorCode::kNonFinite: return "non-finite value";
    case ErrorCode::kMalformedFile: return "malformed file";
    case ErrorCode::kIoError: return "i/o error";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kMismatch: return "mismatch";
  }
  return "unknown error";
}

const char* RotationKindName(RotationKind kind) {
  switch (kind) {
    case RotationKind::kIdentity: return "identity";
    case RotationKind::kDense: return "dense";
    case RotationKind::kHadamard: return "hadamard";
  }
  return "unknown";
}

RotationKind ParseRotationKind(const std::string& name) {
  for (RotationKind kind :
       {RotationKind::kIdentity, RotationKind::kDense, RotationKind::kHadamard}) {
    if (name == RotationKindName(kind)) return kind;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "rotation '" + name + "' is not identity, dense or hadamard");
}

bool IsSupportedHeadDim(int d) { return d == 64 || d == 128 || d == 256; }
bool IsSupportedGroup(int g) { return g == 32 || g == 64 || g == 128; }
bool IsSupportedGroup(int g, int d) { return (IsSupportedGroup(g) && g <= d) || g == d; }

void WriteParams::Validate() const {
  KVQ_CHECK(IsSupportedHeadDim(head_dim), kInvalidArgument, "head_dim ", head_dim,
            " is not supported (64, 128 or 256)");
  if (!quantized()) return;  // the original row is stored; nothing else applies
  KVQ_CHECK(std::isfinite(head_scale) && head_scale > 0.0f, kInvalidArgument, "head scale ",
            head_scale, " is not a finite value > 0");
  const WriteParams& p = *this;
  bool known = false;
#define KVQ_FORMAT(id, Name, tile_tokens, spec, summary) known = known || format == Format::k##Name;
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  KVQ_CHECK(known, kInvalidArgument, "format ", static_cast<int>(format), " is unknown");
#define KVQ_FORMAT_RULE(Fmt, valid, ...) \
  KVQ_CHECK(p.format != Format::k##Fmt || (valid), kInvalidArgument, __VA_ARGS__);
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT_RULE
#define KVQ_WRITE_RULE(valid, ...) KVQ_CHECK(valid, kInvalidArgument, __VA_ARGS__);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_RULE
}

void CacheParams::Validate() const {
  KVQ_CHECK(num_kv_heads >= 1, kInvalidArgument, "num_kv_heads ", num_kv_heads,
            " must be at least 1");
  KVQ_CHECK(num_q_heads >= 1 && num_q_heads % num_kv_heads == 0, kInvalidArgument,
            "num_q_heads ", num_q_heads, " is not a positive multiple of num_kv_heads ",
            num_kv_heads);
  KVQ_CHECK(sink >= 0, kInvalidArgument, "sink length ", sink, " is negative");
  KVQ_CHECK(recent >= 0, kInvalidArgument, "recent window ", recent, " is negative");
  KVQ_CHECK(flush >= 1, kInvalidArgument, "flush granularity ", flush, " must be at least 1");
  KVQ_CHECK(page_size >= 16 && page_size <= 1024 && (page_size & (page_size - 1)) == 0,
            kInvalidArgument, "page size ", page_size,
            " is not a power of two in [16, 1024]");
  try {
    key.Validate();
  } catch (const Error& e) {
    throw Error(e.code(), std::string("key: ") + e.what());
  }
  try {
    value.Validate();
  } catch (const Error& e) {
    throw Error(e.code(), std::string("value: ") + e.what());
  }
  KVQ_CHECK(key.head_dim == value.head_dim, kInvalidArgument, "key head_dim ", key.head_dim,
            " differs from value head_dim ", value.head_dim);
  KVQ_CHECK(key.quantized() == value.quantized(), kInvalidArgument, "key format '",
            FormatName(key.format), "' and value format '", FormatName(value.format),
            "' mix a bf16 and a quantized history (not supported: the bf16 cache keeps both)");
  for (const WriteParams* wp : {&key, &value}) {
    const char* half = wp == &key ? "key" : "value";
    const int tile = wp->quantized() ? wp->tile_tokens() : 1;
    KVQ_CHECK(flush % tile == 0, kInvalidArgument, "flush granularity ", flush,
              " is not a multiple of the ", half, " tile of ", tile, " tokens");
    KVQ_CHECK(page_size % tile == 0, kInvalidArgument, "page size ", page_size,
              " is not a multiple of the ", half, " tile of ", tile, " tokens");
    KVQ_CHECK(!wp->quantized() || !wp->norm || wp->norm_heads == 1 ||
                  wp->norm_heads == num_kv_heads,
              kInvalidArgument, half, " norm spans ", wp->norm_heads, " KV heads: 1 (per head) or ",
              num_kv_heads, " (the token scope, every KV head)");
  }
  KVQ_CHECK(std::isfinite(softmax_scale) && softmax_scale >= 0.0f, kInvalidArgument,
            "softmax scale ", softmax_scale, " is not a finite value >= 0 (0 means 1/sqrt(d))");
}

float WriteParams::fwht_scale() const {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(fwht_block())));
}

int64_t CacheParams::HistoryTokens(int64_t t) const {
  if (!quantized()) return 0;
  const int64_t over = t - sink - recent;
  return over <= 0 ? 0 : over / flush * flush;
}

double CacheParams::history_bits_per_element() const {
  if (!quantized()) return 16.0;
  size_t bytes = 0;
  for (const WriteParams* side : {&key, &value}) {
    const FormatLayout layout = LayoutOf(*side);
    bytes += layout.Bytes(PlaneRole::kCodes, page_size, num_kv_heads) +
             layout.Bytes(PlaneRole::kMetadata, page_size, num_kv_heads);
  }
  return 8.0 * static_cast<double>(bytes) /
         (2.0 * page_size * num_kv_heads * static_cast<double>(head_dim()));
}

int64_t CacheParams::RecentBegin(int64_t t) const {
  const int64_t begin = static_cast<int64_t>(sink) + HistoryTokens(t);
  return t < begin ? t : begin;
}

float CacheParams::scale() const {
  if (softmax_scale != 0.0f) return softmax_scale;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(key.head_dim)));
}

}  // namespace kvq
