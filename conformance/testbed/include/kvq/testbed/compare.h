// Bit comparisons for tests (CUTLASS TensorEquals style): the first mismatch is named, and the
// inputs, the reference and the result are written to a safetensors file named after the case
// so the failure can be replayed and inspected (`kvq info FILE`).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/tensor.h"

namespace kvq::testbed {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Where failure dumps go: $KVQ_TEST_DUMP_DIR, else <gtest temp dir>/kvq_failures.
std::string DumpDir();

// `got` equals `expected` bit for bit (same dtype, shape and bytes). On failure the message
// names the case, the output, the first differing element (index, row, column, both values in
// bits and decimal) and how many differ, and the file <DumpDir()>/<case>.safetensors holds
// in.<name> for each input, expect.<what> and got.<what>.
::testing::AssertionResult BitsEqual(const std::string& case_name, const std::string& what,
                                     const Tensor& expected, const Tensor& got,
                                     const NamedTensors& inputs = {});

// A vector as a [size / columns, columns] tensor (1-D when columns is 0): float -> F32,
// uint16_t -> BF16 bits, uint8_t -> U8, int32_t -> I32.
template <typename T>
Tensor AsTensor(const std::vector<T>& v, int64_t columns = 0) {
  std::vector<int64_t> shape;
  if (columns > 0) {
    shape = {static_cast<int64_t>(v.size()) / columns, columns};
  } else {
    shape = {static_cast<int64_t>(v.size())};
  }
  if constexpr (std::is_same_v<T, float>) return Tensor::F32(shape, v);
  else if constexpr (std::is_same_v<T, uint16_t>) return Tensor::BF16(shape, v);
  else if constexpr (std::is_same_v<T, uint8_t>) return Tensor::U8(shape, v);
  else return Tensor::I32(shape, v);
}

// Two vectors laid out as [rows, columns], bit for bit (a size mismatch fails too).
template <typename T>
::testing::AssertionResult BitsEqual(const std::string& case_name, const std::vector<T>& expected,
                                     const std::vector<T>& got, int64_t columns = 0) {
  if (expected.size() != got.size()) {
    return ::testing::AssertionFailure() << case_name << ": " << expected.size()
                                         << " reference elements, " << got.size() << " results";
  }
  return BitsEqual(case_name, "values", AsTensor(expected, columns), AsTensor(got, columns));
}

// A float for messages: "1.5 (0x3fc00000)".
std::string DescribeFloat(float v);

// Expects fn() to throw kvq::Error with `code` and every one of `needles` in its message.
template <typename Fn>
void ExpectError(Fn&& fn, ErrorCode code, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no kvq::Error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message '" << e.what() << "' lacks '" << needle << "'";
    }
  }
}

// The same for several outputs at once (all are compared and all go into one dump).
::testing::AssertionResult AllBitsEqual(const std::string& case_name, const NamedTensors& expected,
                                        const NamedTensors& got, const NamedTensors& inputs = {});

}  // namespace kvq::testbed
