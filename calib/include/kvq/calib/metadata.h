// Typed, validating reads of safetensors string metadata (shared by the activation and
// calibration file readers): a missing key or an unparsable value is kMalformedFile naming the
// file kind, the key and the text.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>

namespace kvq::calib {

class MetadataReader {
 public:
  // `kind` names the file in messages ("activations", "calibration").
  MetadataReader(const std::map<std::string, std::string>& metadata, std::string kind)
      : metadata_(metadata), kind_(std::move(kind)) {}

  const std::string& String(const std::string& key) const;
  // A whole decimal integer in [lo, hi].
  int64_t Int(const std::string& key, int64_t lo = std::numeric_limits<int64_t>::min(),
              int64_t hi = std::numeric_limits<int64_t>::max()) const;
  // A whole finite decimal number.
  double Double(const std::string& key) const;

 private:
  const std::map<std::string, std::string>& metadata_;
  std::string kind_;
};

// Shortest text that reads back to the same double ("%.17g" trimmed by round trip).
std::string FormatDouble(double value);

}  // namespace kvq::calib
