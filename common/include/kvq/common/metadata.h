// Safetensors string metadata (spec/formats.md): exact decimal writes, typed and validating
// reads, and the one codec of the parameter structs, shared by the quantized-rows files, the
// golden vectors and the calibration files.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>

#include "kvq/common/params.h"

namespace kvq {

using Metadata = std::map<std::string, std::string>;

// The shortest decimal (at most 9 / 17 significant digits) that strtof / strtod reads back to
// v exactly.
std::string ShortestFloat(float v);
std::string ShortestDouble(double v);

// The text of a write parameter's value in files (write_params.inc's types): decimal integers,
// ShortestFloat, "1" / "0", the format's, the rotation kind's and the codebook density's names.
std::string ParamText(int v);
std::string ParamText(float v);
std::string ParamText(bool v);
std::string ParamText(Format v);
std::string ParamText(RotationKind v);
std::string ParamText(CodebookDensity v);

// Typed reads of one metadata map. A missing key, or a value that does not parse completely,
// throws kvq::Error(kMalformedFile) starting with `what` (names the file or case) and naming
// the key and the text.
class MetadataReader {
 public:
  MetadataReader(const Metadata& metadata, std::string what)
      : metadata_(metadata), what_(std::move(what)) {}

  bool Has(const std::string& key) const { return metadata_.count(key) != 0; }
  const std::string& String(const std::string& key) const;
  // A whole decimal integer in [lo, hi].
  int64_t Int(const std::string& key, int64_t lo = std::numeric_limits<int64_t>::min(),
              int64_t hi = std::numeric_limits<int64_t>::max()) const;
  uint64_t U64(const std::string& key) const;
  float Float(const std::string& key) const;
  // A whole decimal number; finite unless allow_non_finite.
  double Double(const std::string& key, bool allow_non_finite = false) const;
  bool Bool(const std::string& key) const;  // "1" or "0"
  const std::string& what() const { return what_; }

 private:
  [[noreturn]] void Bad(const std::string& key, const std::string& text,
                        const char* expected) const;
  const Metadata& metadata_;
  std::string what_;
};

// WriteParams as keys prefix + each row's key of write_params.inc, in ParamText, when the row's
// `stored` holds (row_format for every format but affine_token and bf16, the norm keys only
// with a norm, head_scale for fp8 alone: the rules the spec 1.0 / 1.1 files were written by).
void PutWriteParams(const WriteParams& p, const std::string& prefix, Metadata* metadata);
// Reads and validates; an unparsable or unsupported value is kMalformedFile. Keys of spec
// 1.0 are required, later ones optional (absent: the default).
WriteParams GetWriteParams(const MetadataReader& meta, const std::string& prefix);

// CacheParams as keys num_kv_heads, num_q_heads, sink, recent, flush (when not 1), page_size,
// quantized (1 | 0: 0 is the bf16 cache, whose write params carry format bf16), softmax_scale,
// and the key / value write params with prefixes "key." / "value.".
void PutCacheParams(const CacheParams& p, Metadata* metadata);
CacheParams GetCacheParams(const MetadataReader& meta);

}  // namespace kvq
