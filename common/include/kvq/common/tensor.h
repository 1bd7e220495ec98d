// An owning, typed, shaped buffer: what the file readers return and the writers take.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvq {

enum class DType { kF32, kF16, kBF16, kU8, kI32, kI8 };

const char* DTypeName(DType dtype);  // "F32", "F16", "BF16", "U8", "I32", "I8" (safetensors names)
size_t DTypeSize(DType dtype);

struct Tensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian, row-major, size = numel * DTypeSize(dtype)

  size_t numel() const;  // product of the extents; throws as CheckedNumel does
  std::string ShapeString() const;  // "[4, 128]"

  template <typename T>
  const T* data() const { return reinterpret_cast<const T*>(bytes.data()); }
  template <typename T>
  T* data() { return reinterpret_cast<T*>(bytes.data()); }

  // Converts F32, F16 and BF16 exactly to fp32; throws kvq::Error for integer dtypes.
  std::vector<float> ToF32() const;

  static Tensor F32(std::vector<int64_t> shape, const std::vector<float>& values);
  static Tensor BF16(std::vector<int64_t> shape, const std::vector<uint16_t>& bits);
  static Tensor F16(std::vector<int64_t> shape, const std::vector<uint16_t>& bits);
  static Tensor U8(std::vector<int64_t> shape, const std::vector<uint8_t>& values);
  static Tensor I32(std::vector<int64_t> shape, const std::vector<int32_t>& values);
  static Tensor I8(std::vector<int64_t> shape, const std::vector<int8_t>& values);
};

// Same dtype, same shape and the same bytes (bitwise: a NaN equals the same NaN).
bool operator==(const Tensor& a, const Tensor& b);
inline bool operator!=(const Tensor& a, const Tensor& b) { return !(a == b); }

// item_size times the product of `shape`'s extents (the element count for item_size 1, the
// byte count for item_size = DTypeSize). Throws kvq::Error(kInvalidArgument) naming the
// extent for a negative extent and when the product overflows size_t; a zero extent makes the
// product 0 whatever the others are.
size_t CheckedNumel(const std::vector<int64_t>& shape, size_t item_size = 1);

// Throws kvq::Error(kShapeMismatch) unless t.bytes.size() == numel * DTypeSize(t.dtype)
// (naming both), and as CheckedNumel does for a bad shape.
void ValidateTensor(const Tensor& t);

// Throws kvq::Error(kShapeMismatch) unless t.shape equals `expected`; -1 in `expected`
// matches any extent. `what` names the tensor in the message.
void ExpectShape(const Tensor& t, const std::vector<int64_t>& expected, const std::string& what);

}  // namespace kvq
