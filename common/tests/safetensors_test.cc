// safetensors reader and writer: round trips, golden bytes, every rejection.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/tensor.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::Bytes;
using testing::ExpectError;
using testing::RandomTensor;

// 8-byte little-endian length, then the header text, then the data buffer.
std::string MakeFile(const std::string& header, const std::string& data) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

Safetensors ParseString(const std::string& s) {
  return ParseSafetensors(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

void ExpectMalformed(const std::string& file, const std::vector<std::string>& needles) {
  ExpectError([&] { ParseString(file); }, ErrorCode::kMalformedFile, needles);
}

// The golden file: metadata, tensors b, a, z added out of order (the writer sorts them),
// z zero-sized. Hand-built: header 194 bytes + 6 spaces = 200 = 0xc8.
const std::string kGoldenHeader =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},"
    "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[3,11]},"
    "\"z\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[11,11]}}      ";
const std::string kGoldenFile = std::string("\xc8\x00\x00\x00\x00\x00\x00\x00", 8) + kGoldenHeader +
                                std::string(
                                    "\x01\x02\x03"
                                    "\x00\x00\x80\x3f"
                                    "\x00\x00\x00\xc0",
                                    11);

TEST(Safetensors, WriterMatchesGoldenBytes) {
  Safetensors file;
  file.metadata["format"] = "pt";
  file.Add("b", Tensor::F32({2}, {1.0f, -2.0f}));
  file.Add("a", Tensor::U8({3}, {1, 2, 3}));
  file.Add("z", Tensor::BF16({0}, {}));
  EXPECT_EQ(SerializeSafetensors(file), Bytes(kGoldenFile));
}

TEST(Safetensors, ReadsGoldenBytesFieldByField) {
  const Safetensors file = ParseString(kGoldenFile);
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.tensors.size(), 3u);
  EXPECT_EQ(file.tensors[0].first, "a");
  EXPECT_EQ(file.tensors[1].first, "b");
  EXPECT_EQ(file.tensors[2].first, "z");
  EXPECT_EQ(file.Get("a").dtype, DType::kU8);
  EXPECT_EQ(file.Get("a").shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(file.Get("a").bytes, (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(file.Get("b").dtype, DType::kF32);
  EXPECT_EQ(file.Get("b").ToF32(), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(file.Get("z").dtype, DType::kBF16);
  EXPECT_EQ(file.Get("z").shape, (std::vector<int64_t>{0}));
  EXPECT_TRUE(file.Get("z").bytes.empty());
  EXPECT_EQ(file.Find("missing"), nullptr);
  ExpectError([&] { file.Get("missing"); }, ErrorCode::kMalformedFile, {"'missing'"});
}

TEST(Safetensors, RoundTripsEveryDtype) {
  Safetensors file;
  file.metadata = {{"format", "kvq"}, {"unicode", "\xc3\xa9t\xc3\xa9"}, {"", "empty key"}};
  uint32_t seed = 11;
  for (DType dtype :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kU8, DType::kI32, DType::kI8}) {
    for (const auto& shape :
         std::vector<std::vector<int64_t>>{{}, {0}, {7}, {3, 4}, {2, 0, 5}, {2, 3, 2}}) {
      file.Add(std::string(DTypeName(dtype)) + "_" + std::to_string(seed),
               RandomTensor(dtype, shape, seed));
      ++seed;
    }
  }
  const std::vector<uint8_t> bytes = SerializeSafetensors(file);
  const Safetensors back = ParseSafetensors(bytes.data(), bytes.size());
  EXPECT_EQ(back.metadata, file.metadata);
  ASSERT_EQ(back.tensors.size(), file.tensors.size());
  for (const auto& [name, tensor] : file.tensors) {
    const Tensor* read = back.Find(name);
    ASSERT_NE(read, nullptr) << name;
    EXPECT_EQ(*read, tensor) << name;
  }
  for (size_t i = 1; i < back.tensors.size(); ++i) {
    EXPECT_LT(back.tensors[i - 1].first, back.tensors[i].first);
  }
  EXPECT_EQ(SerializeSafetensors(back), bytes);
  // Header length is a multiple of 8, padded with spaces.
  uint64_t header_length = 0;
  for (int i = 0; i < 8; ++i) header_length |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_NE(bytes[8 + header_length - 1], '\0');

  // An empty file: just "{}" and padding.
  const std::vector<uint8_t> empty = SerializeSafetensors(Safetensors{});
  EXPECT_EQ(empty, Bytes(std::string("\x08\0\0\0\0\0\0\0{}      ", 16)));
  EXPECT_TRUE(ParseSafetensors(empty.data(), empty.size()).tensors.empty());
}

TEST(Safetensors, KeepsHeaderOrderAndAcceptsDataOutOfKeyOrder) {
  // 'y' lists first but its bytes come second; zero-sized tensors sit anywhere.
  const Safetensors file =
      ParseString(MakeFile("{\"y\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]},"
                           "\"e\":{\"dtype\":\"I32\",\"shape\":[0,4],\"data_offsets\":[1,1]},"
                           "\"x\":{\"shape\":[1],\"data_offsets\":[0,1],\"dtype\":\"U8\"}}",
                           "abc"));
  ASSERT_EQ(file.tensors.size(), 3u);
  EXPECT_EQ(file.tensors[0].first, "y");
  EXPECT_EQ(file.tensors[1].first, "e");
  EXPECT_EQ(file.tensors[2].first, "x");
  EXPECT_EQ(file.Get("y").bytes, Bytes("bc"));
  EXPECT_EQ(file.Get("x").bytes, Bytes("a"));
  EXPECT_EQ(file.Get("e").shape, (std::vector<int64_t>{0, 4}));
}

std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":" + dtype + ",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

// A file whose header holds one tensor entry "a" and nothing else.
std::string OneTensorFile(const std::string& dtype, const std::string& shape,
                          const std::string& offsets, const std::string& data) {
  return MakeFile("{" + Entry("a", dtype, shape, offsets) + "}", data);
}

TEST(Safetensors, RejectsBadLengthField) {
  ExpectMalformed(std::string("\x02\0\0", 3), {"3 bytes"});
  ExpectMalformed(MakeFile("", ""), {"must start with '{'"});
  std::string huge = MakeFile("{}", "");
  huge[0] = '\x00';
  huge[1] = '\xc2';
  huge[2] = '\xeb';
  huge[3] = '\x0b';  // 200000000
  ExpectMalformed(huge, {"200000000", "100000000"});
  std::string past_end = MakeFile("{}", "");
  past_end[0] = 3;
  ExpectMalformed(past_end, {"header length 3", "2 bytes"});
  std::string all_ones(16, '\xff');
  ExpectMalformed(all_ones, {"18446744073709551615"});
  ExpectMalformed(MakeFile(" {}", ""), {"must start with '{'"});
}

TEST(Safetensors, RejectsBadJson) {
  ExpectMalformed(MakeFile("{\"a\":", ""), {"not valid JSON"});
  ExpectMalformed(MakeFile("{} x", ""), {"not valid JSON"});
  ExpectMalformed(MakeFile("{\"a\":\"\xff\"}", ""), {"not valid JSON"});
  ExpectMalformed(MakeFile("{" + Entry("a", "\"U8\"", "[1]", "[0,1]") + "," +
                               Entry("a", "\"U8\"", "[1]", "[1,2]") + "}",
                           "xy"),
                  {"duplicate key 'a'"});
  ExpectMalformed(
      MakeFile("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
               "x"),
      {"duplicate key 'dtype'"});
  ExpectMalformed(MakeFile("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", ""),
                  {"duplicate key 'k'"});
  ExpectMalformed(MakeFile("{\"a\":{\"shape\":[[1]]}}", ""), {"nests deeper"});
}

// I8 (int8-row model weights, calib/models): two's complement bytes, one per element.
TEST(Safetensors, ReadsI8) {
  const Safetensors file =
      ParseString(MakeFile("{\"w\":{\"dtype\":\"I8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}",
                           std::string("\x81\x7f\x00\xff", 4)));
  const Tensor& w = file.Get("w");
  EXPECT_EQ(w.dtype, DType::kI8);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(w.data<int8_t>()[0], -127);
  EXPECT_EQ(w.data<int8_t>()[1], 127);
  EXPECT_EQ(w.data<int8_t>()[2], 0);
  EXPECT_EQ(w.data<int8_t>()[3], -1);
  EXPECT_EQ(w, Tensor::I8({2, 2}, {-127, 127, 0, -1}));
  // The byte count must match, as for every dtype.
  ExpectMalformed(OneTensorFile("\"I8\"", "[3]", "[0,4]", "1234"), {"spans 4 bytes", "needs 3"});
}

TEST(Safetensors, RejectsBadEntries) {
  ExpectMalformed(OneTensorFile("\"F64\"", "[1]", "[0,8]", "12345678"),
                  {"'a'", "unsupported dtype \"F64\""});
  ExpectMalformed(OneTensorFile("\"I64\"", "[1]", "[0,8]", "12345678"), {"\"I64\""});
  ExpectMalformed(OneTensorFile("\"U16\"", "[1]", "[0,2]", "12"), {"\"U16\"", "I8)"});
  ExpectMalformed(OneTensorFile("5", "[1]", "[0,1]", "1"), {"must be a string, got 5"});
  ExpectMalformed(OneTensorFile("\"U8\"", "3", "[0,3]", "123"), {"must be an array, got 3"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[-1]", "[0,0]", ""), {"got -1"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[2.5]", "[0,0]", ""), {"got 2.5"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[9223372036854775808]", "[0,0]", ""),
                  {"9223372036854775808", "overflows int64"});
  ExpectMalformed(OneTensorFile("\"F32\"", "[4294967296,4294967296]", "[0,0]", ""),
                  {"4294967296", "overflows"});
  ExpectMalformed(OneTensorFile("\"F32\"", "[3]", "[0,8]", "12345678"),
                  {"spans 8 bytes", "needs 12"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[1]", "[0]", "1"), {"[begin, end], got [0]"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[1]", "[0,1,2]", "1"), {"got [0,1,2]"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[0]", "[4,0]", "1234"), {"begin 4 > end 0"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[5]", "[0,5]", "1234"), {"ends at 5", "4-byte"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[1]", "[0,18446744073709551616]", "1"),
                  {"got 1.8446744073709552e+19"});
  ExpectMalformed(MakeFile("{\"a\":[1]}", ""), {"'a'", "must be an object, got [1]"});
  ExpectMalformed(MakeFile("{\"a\":{\"dtype\":\"U8\",\"shape\":[0]}}", ""),
                  {"'a'", "needs dtype, shape and data_offsets"});
  ExpectMalformed(
      MakeFile("{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":1}}", ""),
      {"unknown field 'x'"});
}

TEST(Safetensors, RejectsOffsetsThatDoNotTileTheBuffer) {
  ExpectMalformed(MakeFile("{" + Entry("a", "\"U8\"", "[8]", "[0,8]") + "," +
                               Entry("b", "\"U8\"", "[8]", "[4,12]") + "}",
                           "123456789012"),
                  {"'b'", "[4, 12)", "overlaps", "ending at 8"});
  ExpectMalformed(MakeFile("{" + Entry("a", "\"U8\"", "[4]", "[0,4]") + "," +
                               Entry("b", "\"U8\"", "[4]", "[8,12]") + "}",
                           "123456789012"),
                  {"bytes [4, 8)", "belong to no tensor"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[4]", "[4,8]", "12345678"), {"bytes [0, 4)"});
  ExpectMalformed(OneTensorFile("\"U8\"", "[8]", "[0,8]", "123456789012"), {"bytes [8, 12)"});
  ExpectMalformed(MakeFile("{}", "x"), {"bytes [0, 1)"});
}

TEST(Safetensors, RejectsBadMetadata) {
  ExpectMalformed(MakeFile("{\"__metadata__\":{\"k\":1}}", ""), {"'k'", "must be a string, got 1"});
  ExpectMalformed(MakeFile("{\"__metadata__\":{\"k\":{\"n\":\"v\"}}}", ""),
                  {"'k'", "got {\"n\":\"v\"}"});
  ExpectMalformed(MakeFile("{\"__metadata__\":[\"k\"]}", ""),
                  {"__metadata__ must be an object, got [\"k\"]"});
  ExpectMalformed(MakeFile("{\"__metadata__\":null}", ""), {"got null"});
}

TEST(Safetensors, WriterRejectsWhatItCannotEncode) {
  Safetensors file;
  file.Add("a", Tensor::U8({1}, {1}));
  ExpectError([&] { file.Add("a", Tensor::U8({1}, {2})); }, ErrorCode::kInvalidArgument, {"'a'"});
  ExpectError([&] { file.Add("__metadata__", Tensor::U8({1}, {2})); }, ErrorCode::kInvalidArgument,
              {"'__metadata__'"});
  Safetensors duplicate;
  duplicate.tensors = {{"d", Tensor::U8({1}, {1})}, {"d", Tensor::U8({1}, {1})}};
  ExpectError([&] { SerializeSafetensors(duplicate); }, ErrorCode::kInvalidArgument, {"'d'"});
  Safetensors inconsistent;
  inconsistent.tensors = {{"t", Tensor::F32({2}, {1, 2})}};
  inconsistent.tensors[0].second.shape = {3};
  ExpectError([&] { SerializeSafetensors(inconsistent); }, ErrorCode::kShapeMismatch,
              {"[3]", "8 bytes"});
  Safetensors bad_utf8;
  bad_utf8.Add("\xff", Tensor::U8({1}, {1}));
  ExpectError([&] { SerializeSafetensors(bad_utf8); }, ErrorCode::kInvalidArgument, {"UTF-8"});
}

TEST(Safetensors, FileRoundTrip) {
  testing::ScratchDir dir;
  Safetensors file;
  file.metadata["k"] = "v";
  file.Add("w", RandomTensor(DType::kBF16, {4, 4}, 5));
  WriteSafetensors(dir.File("w.safetensors"), file);
  const Safetensors back = ReadSafetensors(dir.File("w.safetensors"));
  EXPECT_EQ(back.metadata, file.metadata);
  EXPECT_EQ(back.Get("w"), file.Get("w"));
  WriteFile(dir.File("bad.safetensors"), Bytes(std::string("\x01\0\0\0\0\0\0\0[", 9)));
  ExpectError([&] { ReadSafetensors(dir.File("bad.safetensors")); }, ErrorCode::kMalformedFile,
              {"bad.safetensors", "'{'"});
}

}  // namespace
}  // namespace kvq
