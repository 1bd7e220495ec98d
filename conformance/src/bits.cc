#include "kvq/conformance/bits.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"

namespace kvq::conformance {
namespace {

std::string IndexString(const std::vector<int64_t>& shape, size_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t k = shape.size(); k-- > 0;) {
    index[k] = static_cast<int64_t>(flat % static_cast<size_t>(shape[k]));
    flat /= static_cast<size_t>(shape[k]);
  }
  std::ostringstream os;
  os << "[";
  for (size_t k = 0; k < index.size(); ++k) os << (k ? ", " : "") << index[k];
  os << "] of [";
  for (size_t k = 0; k < shape.size(); ++k) os << (k ? ", " : "") << shape[k];
  os << "]";
  return os.str();
}

}  // namespace

std::string FormatElement(const Tensor& t, size_t i) {
  char text[96];
  switch (t.dtype) {
    case DType::kF32: {
      uint32_t bits;
      std::memcpy(&bits, t.bytes.data() + 4 * i, 4);
      std::snprintf(text, sizeof text, "0x%08" PRIx32 " (%.9g)", bits,
                    static_cast<double>(F32FromBits(bits)));
      break;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t bits;
      std::memcpy(&bits, t.bytes.data() + 2 * i, 2);
      const float value = t.dtype == DType::kBF16 ? F32FromBf16(bits) : F32FromF16(bits);
      std::snprintf(text, sizeof text, "0x%04x (%.9g)", static_cast<unsigned>(bits),
                    static_cast<double>(value));
      break;
    }
    case DType::kU8:
      std::snprintf(text, sizeof text, "%u", static_cast<unsigned>(t.bytes[i]));
      break;
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, t.bytes.data() + 4 * i, 4);
      std::snprintf(text, sizeof text, "%" PRId32, v);
      break;
    }
    case DType::kI8:
      std::snprintf(text, sizeof text, "%d", static_cast<int>(static_cast<int8_t>(t.bytes[i])));
      break;
  }
  return text;
}

std::optional<BitMismatch> FirstBitMismatch(const Tensor& expected, const void* got_data,
                                            size_t got_bytes) {
  KVQ_CHECK(got_bytes == expected.bytes.size(), kShapeMismatch, "the result has ", got_bytes,
            " bytes, the reference ", expected.bytes.size());
  const uint8_t* got = static_cast<const uint8_t*>(got_data);
  // Empty tensors (e.g. a page table with no page) may have null data: nothing to compare.
  if (got_bytes == 0 || std::memcmp(got, expected.bytes.data(), got_bytes) == 0) return {};
  const size_t item = DTypeSize(expected.dtype);
  BitMismatch m;
  bool found = false;
  for (size_t i = 0; i * item < got_bytes; ++i) {
    if (std::memcmp(got + i * item, expected.bytes.data() + i * item, item) == 0) continue;
    ++m.count;
    if (found) continue;
    found = true;
    m.index = i;
  }
  if (expected.shape.size() <= 1) {
    m.row = static_cast<int64_t>(m.index);
  } else {
    const int64_t last = expected.shape.back();
    m.row = static_cast<int64_t>(m.index) / last;
    m.column = static_cast<int64_t>(m.index) % last;
  }
  m.where = IndexString(expected.shape, m.index);
  Tensor got_tensor;
  got_tensor.dtype = expected.dtype;
  got_tensor.shape = expected.shape;
  got_tensor.bytes.assign(got, got + got_bytes);
  m.expected = FormatElement(expected, m.index);
  m.got = FormatElement(got_tensor, m.index);
  return m;
}

}  // namespace kvq::conformance
