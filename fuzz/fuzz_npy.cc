// libFuzzer harness for the .npy reader: any input either fails with kvq::Error or parses to
// a tensor that serializes and parses back to the same tensor (and the same bytes again).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/tensor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::Tensor parsed;
  try {
    parsed = kvq::ParseNpy(data, size);
  } catch (const kvq::Error&) {
    return 0;  // rejected: fine, as long as nothing else escapes
  }
  std::vector<uint8_t> bytes;
  kvq::Tensor reparsed;
  try {
    bytes = kvq::SerializeNpy(parsed);
    reparsed = kvq::ParseNpy(bytes.data(), bytes.size());
  } catch (const kvq::Error&) {
    __builtin_trap();  // what the reader accepts, the writer must write and read back
  }
  if (reparsed != parsed) __builtin_trap();
  if (kvq::SerializeNpy(reparsed) != bytes) __builtin_trap();
  return 0;
}
