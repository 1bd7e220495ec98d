#include "kvq/calib/metadata.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "kvq/common/error.h"

namespace kvq::calib {

const std::string& MetadataReader::String(const std::string& key) const {
  auto it = metadata_.find(key);
  KVQ_CHECK(it != metadata_.end(), kMalformedFile, kind_, ": metadata key '", key,
            "' is missing");
  return it->second;
}

int64_t MetadataReader::Int(const std::string& key, int64_t lo, int64_t hi) const {
  const std::string& text = String(key);
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  KVQ_CHECK(!text.empty() && errno == 0 && end == text.c_str() + text.size(), kMalformedFile,
            kind_, ": metadata '", key, "' = '", text, "' is not an integer");
  KVQ_CHECK(value >= lo && value <= hi, kMalformedFile, kind_, ": metadata '", key, "' = ",
            value, " is outside [", lo, ", ", hi, "]");
  return value;
}

double MetadataReader::Double(const std::string& key) const {
  const std::string& text = String(key);
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  KVQ_CHECK(!text.empty() && errno == 0 && end == text.c_str() + text.size() &&
                std::isfinite(value),
            kMalformedFile, kind_, ": metadata '", key, "' = '", text,
            "' is not a finite number");
  return value;
}

std::string FormatDouble(double value) {
  char buffer[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

}  // namespace kvq::calib
