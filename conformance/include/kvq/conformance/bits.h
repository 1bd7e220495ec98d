// The one bit comparator of kvq: where the spec defines bits, outputs are compared as integers
// (-0 != +0, a NaN equals only the same NaN). The conformance runner reports its first mismatch
// as a case failure; the test testbed (kvq/testbed/compare.h) as a gtest failure that also
// dumps inputs, reference and result to a safetensors file named after the case.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "kvq/common/tensor.h"

namespace kvq::conformance {

struct BitMismatch {
  size_t index = 0;     // flat element index
  int64_t row = -1;     // index over every dimension but the last (the element for 1-D)
  int64_t column = -1;  // index in the last dimension (-1 for a 1-D tensor)
  std::string where;    // "[2, 1, 5, 7] of [4, 2, 16, 8]"
  std::string expected; // bits and value: "0x3f800000 (1)"
  std::string got;
  size_t count = 0;     // elements that differ in all
};

// The first element of `got` (bytes laid out as `expected`: same dtype and shape) whose bits
// differ, or nothing when all agree. A size mismatch is kvq::Error(kShapeMismatch).
std::optional<BitMismatch> FirstBitMismatch(const Tensor& expected, const void* got,
                                            size_t got_bytes);

// One element of t as "0x3f800000 (1)" (floats) or its integer value.
std::string FormatElement(const Tensor& t, size_t index);

}  // namespace kvq::conformance
