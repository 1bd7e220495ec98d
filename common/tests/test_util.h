// Helpers shared by the common/ tests (header only; not a test file itself).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/tensor.h"

namespace kvq::testing {

inline std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// Runs `body`, expects a kvq::Error with `code` whose message contains every `needle`
// (the offending value must be named).
inline void ExpectError(const std::function<void()>& body, ErrorCode code,
                        const std::vector<std::string>& needles) {
  try {
    body();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code))
        << "code " << ErrorCodeName(e.code()) << ", message: " << e.what();
    const std::string message = e.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message \"" << message << "\" does not name \"" << needle << "\"";
    }
    EXPECT_EQ(message.find('\n'), std::string::npos) << "message spans lines: " << message;
    return;
  }
  ADD_FAILURE() << "no kvq::Error thrown; expected " << ErrorCodeName(code);
}

// A tensor of `dtype` and `shape` filled with seeded random bytes (any bit pattern, NaNs
// included: the file formats carry bytes, not values).
inline Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(t.numel() * DTypeSize(dtype));
  std::mt19937 rng(seed);
  for (uint8_t& b : t.bytes) b = static_cast<uint8_t>(rng());
  return t;
}

// A unique scratch directory under /tmp, removed with its contents at scope exit.
class ScratchDir {
 public:
  ScratchDir() {
    char pattern[] = "/tmp/kvq_test_XXXXXX";
    path_ = ::mkdtemp(pattern);
  }
  ~ScratchDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace kvq::testing
