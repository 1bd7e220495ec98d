// Tensor: shapes, element counts, factories, exact conversion to fp32.
#include "kvq/common/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::ExpectError;

TEST(Tensor, DTypeNamesAndSizes) {
  EXPECT_STREQ(DTypeName(DType::kF32), "F32");
  EXPECT_STREQ(DTypeName(DType::kF16), "F16");
  EXPECT_STREQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_STREQ(DTypeName(DType::kU8), "U8");
  EXPECT_STREQ(DTypeName(DType::kI32), "I32");
  EXPECT_STREQ(DTypeName(DType::kI8), "I8");
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
}

TEST(Tensor, NumelAndShapeString) {
  Tensor t;
  EXPECT_EQ(t.numel(), 1u);  // a scalar
  EXPECT_EQ(t.ShapeString(), "[]");
  t.shape = {4, 128};
  EXPECT_EQ(t.numel(), 512u);
  EXPECT_EQ(t.ShapeString(), "[4, 128]");
  t.shape = {3, 0, 5};
  EXPECT_EQ(t.numel(), 0u);
  EXPECT_EQ(CheckedNumel({4, 128}, 4), 2048u);
  EXPECT_EQ(CheckedNumel({INT64_MAX, INT64_MAX, 0}, 4), 0u);
  ExpectError([] { CheckedNumel({2, -3}); }, ErrorCode::kInvalidArgument, {"-3", "dimension 1"});
  ExpectError(
      [] {
        CheckedNumel({1 << 30, 1 << 30, 1 << 30});
      },
      ErrorCode::kInvalidArgument, {"1073741824", "dimension 2", "overflows"});
  ExpectError([] { CheckedNumel({int64_t{1} << 62}, 4); }, ErrorCode::kInvalidArgument,
              {"4611686018427387904", "overflows"});
}

TEST(Tensor, FactoriesCheckTheValueCount) {
  const Tensor f = Tensor::F32({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(f.dtype, DType::kF32);
  EXPECT_EQ(f.bytes.size(), 16u);
  EXPECT_EQ(f.data<float>()[3], 4.0f);
  EXPECT_EQ(Tensor::I32({1}, {-5}).data<int32_t>()[0], -5);
  EXPECT_EQ(Tensor::U8({2}, {9, 8}).bytes, (std::vector<uint8_t>{9, 8}));
  EXPECT_EQ(Tensor::BF16({1}, {0x3f80}).dtype, DType::kBF16);
  EXPECT_EQ(Tensor::F16({1}, {0x3c00}).dtype, DType::kF16);
  ExpectError(
      [] {
        Tensor::F32({2, 3}, {1, 2});
      },
      ErrorCode::kShapeMismatch, {"[2, 3]", "6", "got 2"});
  ExpectError([] { Tensor::U8({-1}, {}); }, ErrorCode::kInvalidArgument, {"-1"});
}

TEST(Tensor, EqualityIsBitwise) {
  const float nan = std::nanf("");
  EXPECT_EQ(Tensor::F32({1}, {nan}), Tensor::F32({1}, {nan}));
  EXPECT_NE(Tensor::F32({1}, {0.0f}), Tensor::F32({1}, {-0.0f}));
  EXPECT_NE(Tensor::F32({2}, {1, 2}), Tensor::F32({1, 2}, {1, 2}));
  EXPECT_NE(Tensor::U8({4}, {0, 0, 0, 0}), Tensor::F32({1}, {0.0f}));
}

TEST(Tensor, ToF32IsExactForEveryHalfPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  const std::vector<float> from_bf16 = Tensor::BF16({65536}, all).ToF32();
  const std::vector<float> from_f16 = Tensor::F16({256, 256}, all).ToF32();
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(F32Bits(from_bf16[i]), i << 16) << "bf16 0x" << std::hex << i;
    ASSERT_EQ(F32Bits(from_f16[i]), F32Bits(F32FromF16(static_cast<uint16_t>(i))))
        << "f16 0x" << std::hex << i;
  }
  const std::vector<float> values = {0.0f, -0.0f, 1.5f, -3e38f, 1e-45f, std::nanf("")};
  const std::vector<float> same = Tensor::F32({6}, values).ToF32();
  EXPECT_EQ(std::memcmp(same.data(), values.data(), sizeof(float) * values.size()), 0);
}

TEST(Tensor, ToF32RejectsIntegersAndInconsistentBytes) {
  ExpectError([] { Tensor::U8({1}, {1}).ToF32(); }, ErrorCode::kInvalidArgument, {"U8"});
  ExpectError([] { Tensor::I32({1}, {1}).ToF32(); }, ErrorCode::kInvalidArgument, {"I32"});
  ExpectError([] { Tensor::I8({1}, {-1}).ToF32(); }, ErrorCode::kInvalidArgument, {"I8"});
  Tensor t = Tensor::F32({2}, {1, 2});
  t.bytes.resize(7);
  ExpectError([&] { t.ToF32(); }, ErrorCode::kShapeMismatch, {"7 bytes", "expected 8"});
}

TEST(Tensor, ExpectShape) {
  const Tensor t = Tensor::U8({3, 4}, std::vector<uint8_t>(12));
  ExpectShape(t, {3, 4}, "x");
  ExpectShape(t, {-1, 4}, "x");
  ExpectShape(t, {-1, -1}, "x");
  ExpectError(
      [&] {
        ExpectShape(t, {3, 5}, "codes");
      },
      ErrorCode::kShapeMismatch, {"codes", "[3, 4]", "[3, 5]"});
  ExpectError([&] { ExpectShape(t, {-1}, "codes"); }, ErrorCode::kShapeMismatch,
              {"[3, 4]", "[-1]"});
}

}  // namespace
}  // namespace kvq
