#include "kvq/common/tensor.h"

#include <cstring>
#include <limits>
#include <sstream>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"

namespace kvq {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kU8:
      return "U8";
    case DType::kI32:
      return "I32";
    case DType::kI8:
      return "I8";
  }
  return "unknown";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kU8:
      return 1;
    case DType::kI32:
      return 4;
    case DType::kI8:
      return 1;
  }
  throw Error(ErrorCode::kInvalidArgument,
              detail::Concat("unknown dtype ", static_cast<int>(dtype)));
}

size_t CheckedNumel(const std::vector<int64_t>& shape, size_t item_size) {
  bool has_zero = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    KVQ_CHECK(shape[i] >= 0, kInvalidArgument, "extent ", shape[i], " of dimension ", i,
              " is negative");
    has_zero = has_zero || shape[i] == 0;
  }
  if (has_zero) return 0;
  size_t product = item_size;
  for (size_t i = 0; i < shape.size(); ++i) {
    const uint64_t extent = static_cast<uint64_t>(shape[i]);
    KVQ_CHECK(extent <= std::numeric_limits<size_t>::max() &&
                  !__builtin_mul_overflow(product, static_cast<size_t>(extent), &product),
              kInvalidArgument, "shape with extent ", shape[i], " in dimension ", i,
              " overflows the element count");
  }
  return product;
}

size_t Tensor::numel() const { return CheckedNumel(shape); }

std::string Tensor::ShapeString() const {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

// The byte count must match numel * item size, so data<T>() stays in bounds.
void ValidateTensor(const Tensor& t) {
  const size_t expected = CheckedNumel(t.shape, DTypeSize(t.dtype));
  KVQ_CHECK(t.bytes.size() == expected, kShapeMismatch, DTypeName(t.dtype), " tensor of shape ",
            t.ShapeString(), " holds ", t.bytes.size(), " bytes, expected ", expected);
}

namespace {

template <typename T>
Tensor Make(DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const size_t n = t.numel();
  KVQ_CHECK(values.size() == n, kShapeMismatch, "shape ", t.ShapeString(), " needs ", n,
            " values, got ", values.size());
  t.bytes.resize(n * sizeof(T));
  if (n != 0) std::memcpy(t.bytes.data(), values.data(), n * sizeof(T));
  return t;
}

}  // namespace

std::vector<float> Tensor::ToF32() const {
  ValidateTensor(*this);
  const size_t n = numel();
  std::vector<float> out(n);
  switch (dtype) {
    case DType::kF32:
      if (n != 0) std::memcpy(out.data(), bytes.data(), n * sizeof(float));
      return out;
    case DType::kF16:
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = dtype == DType::kF16 ? F32FromF16(h) : F32FromBf16(h);
      }
      return out;
    case DType::kU8:
    case DType::kI32:
    case DType::kI8:
      break;
  }
  throw Error(ErrorCode::kInvalidArgument,
              detail::Concat("cannot convert ", DTypeName(dtype), " tensor to fp32"));
}

Tensor Tensor::F32(std::vector<int64_t> shape, const std::vector<float>& values) {
  return Make(DType::kF32, std::move(shape), values);
}
Tensor Tensor::BF16(std::vector<int64_t> shape, const std::vector<uint16_t>& bits) {
  return Make(DType::kBF16, std::move(shape), bits);
}
Tensor Tensor::F16(std::vector<int64_t> shape, const std::vector<uint16_t>& bits) {
  return Make(DType::kF16, std::move(shape), bits);
}
Tensor Tensor::U8(std::vector<int64_t> shape, const std::vector<uint8_t>& values) {
  return Make(DType::kU8, std::move(shape), values);
}
Tensor Tensor::I32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
  return Make(DType::kI32, std::move(shape), values);
}
Tensor Tensor::I8(std::vector<int64_t> shape, const std::vector<int8_t>& values) {
  return Make(DType::kI8, std::move(shape), values);
}

bool operator==(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

void ExpectShape(const Tensor& t, const std::vector<int64_t>& expected, const std::string& what) {
  bool match = t.shape.size() == expected.size();
  for (size_t i = 0; match && i < expected.size(); ++i) {
    match = expected[i] == -1 || expected[i] == t.shape[i];
  }
  if (!match) {
    Tensor want;
    want.shape = expected;
    bool has_wildcard = false;
    for (int64_t e : expected) has_wildcard = has_wildcard || e == -1;
    throw Error(ErrorCode::kShapeMismatch,
                detail::Concat(what, " has shape ", t.ShapeString(), ", expected ",
                               want.ShapeString(), has_wildcard ? " (-1 = any)" : ""));
  }
}

}  // namespace kvq
