// libFuzzer harness for the safetensors reader: any input either fails with kvq::Error or
// parses to a file that serializes and parses back to the same metadata and tensors (the
// writer sorts by name, so compare by name) and to the same bytes again.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/tensor.h"

namespace {

bool SameContents(const kvq::Safetensors& a, const kvq::Safetensors& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, tensor] : a.tensors) {
    const kvq::Tensor* other = b.Find(name);
    if (other == nullptr || *other != tensor) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::Safetensors parsed;
  try {
    parsed = kvq::ParseSafetensors(data, size);
  } catch (const kvq::Error&) {
    return 0;  // rejected: fine, as long as nothing else escapes
  }
  std::vector<uint8_t> bytes;
  kvq::Safetensors reparsed;
  try {
    bytes = kvq::SerializeSafetensors(parsed);
    reparsed = kvq::ParseSafetensors(bytes.data(), bytes.size());
  } catch (const kvq::Error&) {
    __builtin_trap();  // what the reader accepts, the writer must write and read back
  }
  if (!SameContents(parsed, reparsed)) __builtin_trap();
  if (kvq::SerializeSafetensors(reparsed) != bytes) __builtin_trap();
  return 0;
}
