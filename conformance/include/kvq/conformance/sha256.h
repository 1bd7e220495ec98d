// SHA-256 (FIPS 180-4), used to pin every golden-vector file in manifest.json. Self-contained
// so the conformance tools depend on nothing outside the project.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvq::conformance {

// Incremental hashing: Update() any number of times, then Final() once (further calls to
// Update or Final after Final throw kvq::Error(kInvalidArgument)).
class Sha256 {
 public:
  Sha256();
  void Update(const uint8_t* data, size_t size);
  std::array<uint8_t, 32> Final();

 private:
  void Compress(const uint8_t block[64]);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_;
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// The digest of size bytes at data (data may be null when size is 0).
std::array<uint8_t, 32> Sha256Digest(const uint8_t* data, size_t size);
// The same as 64 lowercase hex characters.
std::string Sha256Hex(const uint8_t* data, size_t size);
std::string Sha256Hex(const std::vector<uint8_t>& bytes);
std::string HexString(const uint8_t* data, size_t size);

}  // namespace kvq::conformance
