#include "kvq/common/metadata.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kvq/common/error.h"

namespace kvq {

std::string ShortestFloat(float v) {
  char text[64];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(v));
    const float back = std::strtof(text, nullptr);
    if (std::memcmp(&back, &v, sizeof v) == 0) break;
  }
  return text;
}

std::string ShortestDouble(double v) {
  char text[64];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    const double back = std::strtod(text, nullptr);
    if (std::memcmp(&back, &v, sizeof v) == 0) break;
  }
  return text;
}

void MetadataReader::Bad(const std::string& key, const std::string& text,
                         const char* expected) const {
  throw Error(ErrorCode::kMalformedFile,
              detail::Concat(what_, ": metadata '", key, "' = '", text, "' is not ", expected));
}

const std::string& MetadataReader::String(const std::string& key) const {
  auto it = metadata_.find(key);
  KVQ_CHECK(it != metadata_.end(), kMalformedFile, what_, ": metadata key '", key,
            "' is missing");
  return it->second;
}

int64_t MetadataReader::Int(const std::string& key, int64_t lo, int64_t hi) const {
  const std::string& text = String(key);
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0') Bad(key, text, "an integer");
  KVQ_CHECK(value >= lo && value <= hi, kMalformedFile, what_, ": metadata '", key, "' = ",
            value, " is outside [", lo, ", ", hi, "]");
  return value;
}

uint64_t MetadataReader::U64(const std::string& key) const {
  const std::string& text = String(key);
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || errno != 0 || *end != '\0') {
    Bad(key, text, "an unsigned integer");
  }
  return value;
}

float MetadataReader::Float(const std::string& key) const {
  const std::string& text = String(key);
  char* end = nullptr;
  const float value = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0') Bad(key, text, "a number");
  return value;
}

double MetadataReader::Double(const std::string& key, bool allow_non_finite) const {
  const std::string& text = String(key);
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || (!allow_non_finite && !std::isfinite(value))) {
    Bad(key, text, allow_non_finite ? "a number" : "a finite number");
  }
  return value;
}

bool MetadataReader::Bool(const std::string& key) const {
  const std::string& text = String(key);
  if (text == "1") return true;
  if (text == "0") return false;
  Bad(key, text, "0 or 1");
}

void PutWriteParams(const WriteParams& p, const std::string& prefix, Metadata* metadata) {
  Metadata& m = *metadata;
  if (p.format != Format::kAffineToken && p.format != Format::kBf16) {
    m[prefix + "row_format"] = FormatName(p.format);
  }
  m[prefix + "head_dim"] = std::to_string(p.head_dim);
  m[prefix + "group"] = std::to_string(p.group);
  m[prefix + "bits"] = std::to_string(p.bits);
  m[prefix + "clip"] = ShortestFloat(p.clip);
  m[prefix + "rotation"] = RotationKindName(p.rotation);
  m[prefix + "hadamard_block"] = std::to_string(p.hadamard_block);
  m[prefix + "bitrev"] = p.bitrev ? "1" : "0";
  // Spec 1.1: written only when set (a file without them has no norm).
  if (p.norm) {
    m[prefix + "norm"] = "1";
    m[prefix + "norm_heads"] = std::to_string(p.norm_heads);
  }
  // Spec 1.2: the fp8 formats' s^ (other formats store none and keep 1).
  if (p.format == Format::kFp8E4m3) m[prefix + "head_scale"] = ShortestFloat(p.head_scale);
}

namespace {

WriteParams ReadWriteParams(const MetadataReader& meta, const std::string& prefix,
                            Format fallback) {
  WriteParams p;
  p.format = fallback;
  if (meta.Has(prefix + "row_format")) {
    try {
      p.format = ParseFormat(meta.String(prefix + "row_format"));
    } catch (const Error& e) {
      throw Error(ErrorCode::kMalformedFile, detail::Concat(meta.what(), ": ", e.what()));
    }
  }
  p.head_dim = static_cast<int>(meta.Int(prefix + "head_dim", 0, 1 << 20));
  p.group = static_cast<int>(meta.Int(prefix + "group", 0, 1 << 20));
  p.bits = static_cast<int>(meta.Int(prefix + "bits", 0, 64));
  p.clip = meta.Float(prefix + "clip");
  const std::string& rotation = meta.String(prefix + "rotation");
  bool known = false;
  for (RotationKind kind :
       {RotationKind::kIdentity, RotationKind::kDense, RotationKind::kHadamard}) {
    if (rotation == RotationKindName(kind)) {
      p.rotation = kind;
      known = true;
    }
  }
  KVQ_CHECK(known, kMalformedFile, meta.what(), ": metadata '", prefix, "rotation' = '",
            rotation, "' is not identity, dense or hadamard");
  p.hadamard_block = static_cast<int>(meta.Int(prefix + "hadamard_block", 0, 1 << 20));
  p.bitrev = meta.Bool(prefix + "bitrev");
  if (meta.Has(prefix + "norm")) p.norm = meta.Bool(prefix + "norm");
  if (meta.Has(prefix + "norm_heads")) {
    p.norm_heads = static_cast<int>(meta.Int(prefix + "norm_heads", 0, 1 << 20));
  }
  if (meta.Has(prefix + "head_scale")) p.head_scale = meta.Float(prefix + "head_scale");
  return p;
}

template <typename Params>
void ValidateAsFile(const Params& p, const MetadataReader& meta, const std::string& what) {
  try {
    p.Validate();
  } catch (const Error& e) {
    throw Error(ErrorCode::kMalformedFile,
                detail::Concat(meta.what(), ": ", what, "parameters: ", e.what()));
  }
}

}  // namespace

WriteParams GetWriteParams(const MetadataReader& meta, const std::string& prefix) {
  const WriteParams p = ReadWriteParams(meta, prefix, Format::kAffineToken);
  ValidateAsFile(p, meta, prefix);
  return p;
}

void PutCacheParams(const CacheParams& p, Metadata* metadata) {
  Metadata& m = *metadata;
  m["num_kv_heads"] = std::to_string(p.num_kv_heads);
  m["num_q_heads"] = std::to_string(p.num_q_heads);
  m["sink"] = std::to_string(p.sink);
  m["recent"] = std::to_string(p.recent);
  if (p.flush != 1) m["flush"] = std::to_string(p.flush);
  m["page_size"] = std::to_string(p.page_size);
  m["quantized"] = p.quantized() ? "1" : "0";
  m["softmax_scale"] = ShortestFloat(p.softmax_scale);
  PutWriteParams(p.key, "key.", metadata);
  PutWriteParams(p.value, "value.", metadata);
}

CacheParams GetCacheParams(const MetadataReader& meta) {
  CacheParams p;
  p.num_kv_heads = static_cast<int>(meta.Int("num_kv_heads", 0, 1 << 20));
  p.num_q_heads = static_cast<int>(meta.Int("num_q_heads", 0, 1 << 20));
  p.sink = static_cast<int>(meta.Int("sink", -1, 1 << 30));
  p.recent = static_cast<int>(meta.Int("recent", -1, 1 << 30));
  p.flush = meta.Has("flush") ? static_cast<int>(meta.Int("flush", 0, 1 << 30)) : 1;
  p.page_size = static_cast<int>(meta.Int("page_size", 0, 1 << 30));
  const bool quantized = meta.Bool("quantized");
  const Format fallback = quantized ? Format::kAffineToken : Format::kBf16;
  p.softmax_scale = meta.Float("softmax_scale");
  p.key = ReadWriteParams(meta, "key.", fallback);
  p.value = ReadWriteParams(meta, "value.", fallback);
  ValidateAsFile(p, meta, "");
  KVQ_CHECK(p.quantized() == quantized, kMalformedFile, meta.what(), ": metadata 'quantized' = ",
            quantized ? 1 : 0, " contradicts key format '", FormatName(p.key.format), "'");
  return p;
}

}  // namespace kvq
