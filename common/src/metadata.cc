#include "kvq/common/metadata.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

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

std::string ParamText(int v) { return std::to_string(v); }
std::string ParamText(float v) { return ShortestFloat(v); }
std::string ParamText(bool v) { return v ? "1" : "0"; }
std::string ParamText(Format v) { return FormatName(v); }
std::string ParamText(RotationKind v) { return RotationKindName(v); }
std::string ParamText(CodebookDensity v) { return CodebookDensityName(v); }

void PutWriteParams(const WriteParams& p, const std::string& prefix, Metadata* metadata) {
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  if (stored) (*metadata)[prefix + key] = ParamText(p.name);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
}

namespace {

// One parameter's value from its text; Validate bounds it afterwards.
void ReadParam(const MetadataReader& meta, const std::string& key, int* v) {
  *v = static_cast<int>(
      meta.Int(key, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
}
void ReadParam(const MetadataReader& meta, const std::string& key, float* v) {
  *v = meta.Float(key);
}
void ReadParam(const MetadataReader& meta, const std::string& key, bool* v) {
  *v = meta.Bool(key);
}
void ReadParam(const MetadataReader& meta, const std::string& key, Format* v) {
  try {
    *v = ParseFormat(meta.String(key));
  } catch (const Error& e) {
    throw Error(ErrorCode::kMalformedFile, detail::Concat(meta.what(), ": ", e.what()));
  }
}
void ReadParam(const MetadataReader& meta, const std::string& key, RotationKind* v) {
  const std::string& text = meta.String(key);
  try {
    *v = ParseRotationKind(text);
  } catch (const Error&) {
    throw Error(ErrorCode::kMalformedFile, detail::Concat(meta.what(), ": metadata '", key,
                                                         "' = '", text,
                                                         "' is not identity, dense or hadamard"));
  }
}

void ReadParam(const MetadataReader& meta, const std::string& key, CodebookDensity* v) {
  const std::string& text = meta.String(key);
  try {
    *v = ParseCodebookDensity(text);
  } catch (const Error&) {
    throw Error(ErrorCode::kMalformedFile, detail::Concat(meta.what(), ": metadata '", key,
                                                         "' = '", text,
                                                         "' is not beta or gaussian"));
  }
}

// The parameters under `prefix`: every 1.0 key is required; a later one keeps its default
// (the format: `fallback`) when absent.
WriteParams ReadWriteParams(const MetadataReader& meta, const std::string& prefix,
                            Format fallback) {
  WriteParams p;
  p.format = fallback;
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  if (std::strcmp(spec, "1.0") == 0 || meta.Has(prefix + key)) {         \
    ReadParam(meta, prefix + key, &p.name);                              \
  }
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
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
