// .npy reader and writer: round trips for every dtype, NumPy's own bytes, every rejection.
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

// What np.save(f, np.array([[1, 2, 3], [4, 5, 6.5]], dtype='<f4')) writes with NumPy >= 1.24
// (header dict, 21 - len('2') growth spaces, padding to 64 bytes, '\n'), typed in as bytes.
const std::string kNumpyF32x2x3(
    "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'sha"
    "pe': (2, 3), }                                                     "
    "     \x0a\x00\x00\x80\x3f\x00\x00\x00@\x00\x00@@\x00\x00\x80@\x00\x00"
    "\xa0@\x00\x00\xd0@",
    152);
// np.save(f, np.array([-1, 0, 7], dtype='<i4')).
const std::string kNumpyI32x3(
    "\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': False, 'sha"
    "pe': (3,), }                                                       "
    "     \x0a\xff\xff\xff\xff\x00\x00\x00\x00\x07\x00\x00\x00",
    140);

// Builds an npy file around `dict` the way NumPy pads it (spaces, '\n', 64-byte aligned).
std::string MakeNpy(const std::string& dict, const std::string& data, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < prefix - 8; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

Tensor ParseString(const std::string& s) {
  return ParseNpy(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

void ExpectMalformed(const std::string& file, const std::vector<std::string>& needles) {
  ExpectError([&] { ParseString(file); }, ErrorCode::kMalformedFile, needles);
}

TEST(Npy, RoundTripsEveryDtypeAndShape) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {5}, {2, 3}, {2, 0, 3}, {3, 1, 4, 2}};
  uint32_t seed = 1;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kU8, DType::kI32, DType::kI8}) {
    for (const auto& shape : shapes) {
      const Tensor t = RandomTensor(dtype, shape, seed++);
      const std::vector<uint8_t> bytes = SerializeNpy(t);
      const Tensor back = ParseNpy(bytes.data(), bytes.size());
      EXPECT_EQ(back, t) << DTypeName(dtype) << " " << t.ShapeString() << " seed " << seed - 1;
      EXPECT_EQ(SerializeNpy(back), bytes);
    }
  }
}

TEST(Npy, WriterEmitsVersion1WithA64ByteAlignedHeader) {
  const Tensor t = RandomTensor(DType::kF32, {4, 128}, 7);
  const std::vector<uint8_t> bytes = SerializeNpy(t);
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(std::memcmp(bytes.data(), "\x93NUMPY", 6), 0);
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[7], 0);
  const size_t header_length = bytes[8] | (bytes[9] << 8);
  EXPECT_EQ((10 + header_length) % 64, 0u);
  const std::string header(bytes.begin() + 10, bytes.begin() + 10 + header_length);
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 128), }", 0), 0u)
      << header;
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(header.find_first_not_of(' ', 62), header_length - 1);
  EXPECT_EQ(bytes.size(), 10 + header_length + 4 * 128 * 4);
  EXPECT_EQ(std::memcmp(bytes.data() + 10 + header_length, t.bytes.data(), t.bytes.size()), 0);
}

TEST(Npy, ReadsNumpyBytesFieldByField) {
  const Tensor t = ParseString(kNumpyF32x2x3);
  EXPECT_EQ(t.dtype, DType::kF32);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.ToF32(), (std::vector<float>{1, 2, 3, 4, 5, 6.5f}));
  // Our writer adds no growth spaces, yet the padding lands on the same 128 bytes.
  EXPECT_EQ(SerializeNpy(t), Bytes(kNumpyF32x2x3));

  const Tensor i = ParseString(kNumpyI32x3);
  EXPECT_EQ(i.dtype, DType::kI32);
  EXPECT_EQ(i.shape, (std::vector<int64_t>{3}));
  ASSERT_EQ(i.bytes.size(), 12u);
  EXPECT_EQ(i.data<int32_t>()[0], -1);
  EXPECT_EQ(i.data<int32_t>()[1], 0);
  EXPECT_EQ(i.data<int32_t>()[2], 7);
  EXPECT_EQ(SerializeNpy(i), Bytes(kNumpyI32x3));
}

TEST(Npy, AcceptsVersions2And3AndHeaderVariants) {
  const std::string data("\x01\x02\x03", 3);
  for (int major : {2, 3}) {
    const Tensor t = ParseString(
        MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", data, major));
    EXPECT_EQ(t, Tensor::U8({3}, {1, 2, 3})) << "version " << major;
  }
  // Any key order, double quotes, '<u1', no trailing comma, scalar shape.
  EXPECT_EQ(ParseString(
                MakeNpy("{\"shape\": (3, ), \"fortran_order\": False, \"descr\": \"<u1\"}", data)),
            Tensor::U8({3}, {1, 2, 3}));
  EXPECT_EQ(ParseString(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': ()}",
                                std::string("\x00\x00\x80\x3f", 4))),
            Tensor::F32({}, {1.0f}));
  EXPECT_EQ(ParseString(MakeNpy("{'descr': '<f2', 'fortran_order': False, 'shape': (0, 7), }", "")),
            Tensor::F16({0, 7}, {}));
}

TEST(Npy, RejectsBrokenPreamble) {
  ExpectMalformed(std::string("\x93NUMP", 5), {"5 bytes"});
  ExpectMalformed(std::string("\x93NUMPX\x01\x00\x10\x00", 10), {"NUMPX"});
  std::string v4 = MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (0,), }", "");
  v4[6] = 4;
  ExpectMalformed(v4, {"version 4.0"});
  std::string v11 = v4;
  v11[6] = 1;
  v11[7] = 1;
  ExpectMalformed(v11, {"version 1.1"});
  // Version 2 needs a 4-byte header length.
  ExpectMalformed(std::string("\x93NUMPY\x02\x00\x00\x00", 10), {"10 bytes"});
  std::string long_header = v4;
  long_header[6] = 1;
  long_header[8] = '\xff';
  long_header[9] = '\xff';
  ExpectMalformed(long_header, {"header length 65535"});
}

TEST(Npy, ReadsInt8InBothSpellings) {
  for (const char* descr : {"|i1", "<i1"}) {
    const Tensor t = ParseString(MakeNpy(std::string("{'descr': '") + descr +
                                             "', 'fortran_order': False, 'shape': (2,), }",
                                         std::string("\x80\x05", 2)));
    EXPECT_EQ(t, Tensor::I8({2}, {-128, 5})) << descr;
  }
}

TEST(Npy, RejectsUnsupportedDtypesAndLayouts) {
  ExpectMalformed(MakeNpy("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", "abcd"),
                  {"fortran_order True"});
  ExpectMalformed(MakeNpy("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", "abcd"),
                  {"big-endian", ">f4"});
  ExpectMalformed(MakeNpy("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", "abcdefgh"),
                  {"unsupported dtype", "<f8"});
  ExpectMalformed(MakeNpy("{'descr': '|b1', 'fortran_order': False, 'shape': (1,), }", "a"),
                  {"unsupported dtype", "|b1"});
  ExpectMalformed(MakeNpy("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", "abcdefgh"),
                  {"object arrays", "|O"});
  ExpectMalformed(
      MakeNpy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", "abcd"),
      {"structured"});
  ExpectMalformed(MakeNpy("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }", "abcd"),
                  {"fortran_order must be True or False"});
}

TEST(Npy, RejectsBadShapes) {
  const std::string u8 = "{'descr': '|u1', 'fortran_order': False, 'shape': ";
  ExpectMalformed(MakeNpy(u8 + "(-1, 3), }", ""), {"negative extent -1"});
  ExpectMalformed(MakeNpy(u8 + "(99999999999999999999,), }", ""),
                  {"99999999999999999999", "overflows"});
  ExpectMalformed(MakeNpy(u8 + "(4294967296, 4294967296), }", ""), {"4294967296", "overflows"});
  ExpectMalformed(MakeNpy(u8 + "(3), }", "abc"), {"not a tuple"});
  ExpectMalformed(MakeNpy(u8 + "(3L,), }", "abc"), {"expected ',' or ')'", "3L"});
  ExpectMalformed(MakeNpy(u8 + "(03,), }", "abc"), {"extent 03 has a leading zero"});
  ExpectMalformed(MakeNpy(u8 + "(,), }", ""), {"expected a non-negative integer"});
  ExpectMalformed(MakeNpy(u8 + "[3], }", "abc"), {"expected '('"});
}

TEST(Npy, RejectsBadDicts) {
  ExpectMalformed(MakeNpy("{'descr': '|u1', 'shape': (1,), }", "a"),
                  {"missing key 'fortran_order'"});
  ExpectMalformed(
      MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (1,), 'descr': '|u1'}", "a"),
      {"duplicate key 'descr'"});
  ExpectMalformed(
      MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (1,), 'extra': 1}", "a"),
      {"unknown key \"extra\""});
  ExpectMalformed(MakeNpy("{'descr': '|u1' 'fortran_order': False, 'shape': (1,), }", "a"),
                  {"expected ',' or '}'"});
  ExpectMalformed(MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (1,), } x", "a"),
                  {"must end with spaces and one '\\n'"});
  // A header without the final newline.
  std::string no_newline =
      MakeNpy("{'descr': '|u1', 'fortran_order': False, 'shape': (1,), }", "a");
  no_newline[no_newline.size() - 2] = ' ';
  ExpectMalformed(no_newline, {"must end with spaces and one '\\n'"});
  ExpectMalformed(MakeNpy("{'descr': '|u\\x31', 'fortran_order': False, 'shape': (1,), }", "a"),
                  {"escape or newline in descr"});
}

TEST(Npy, RejectsShortAndTrailingData) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  ExpectMalformed(MakeNpy(dict, std::string(23, 'x')), {"holds 23 bytes", "needs 24", "truncated"});
  ExpectMalformed(MakeNpy(dict, std::string(25, 'x')), {"holds 25 bytes", "needs 24", "trailing"});
  ExpectMalformed(MakeNpy(dict, ""), {"holds 0 bytes", "needs 24"});
}

TEST(Npy, WriterRejectsBf16AndInconsistentTensors) {
  ExpectError(
      [] {
        SerializeNpy(Tensor::BF16({2}, {1, 2}));
      },
      ErrorCode::kInvalidArgument, {"BF16"});
  Tensor bad = Tensor::F32({2, 2}, {1, 2, 3, 4});
  bad.bytes.pop_back();
  ExpectError([&] { SerializeNpy(bad); }, ErrorCode::kShapeMismatch, {"15 bytes", "expected 16"});
  bad.shape = {-2, 2};
  ExpectError([&] { SerializeNpy(bad); }, ErrorCode::kInvalidArgument, {"-2"});
}

TEST(Npy, FileRoundTripAndReadErrorsNameThePath) {
  testing::ScratchDir dir;
  const Tensor t = RandomTensor(DType::kF16, {3, 5}, 3);
  WriteNpy(dir.File("t.npy"), t);
  EXPECT_EQ(ReadNpy(dir.File("t.npy")), t);
  ExpectError([&] { ReadNpy(dir.File("missing.npy")); }, ErrorCode::kIoError, {"missing.npy"});
  WriteFile(dir.File("bad.npy"), Bytes("\x93NUMPY\x01"));
  ExpectError([&] { ReadNpy(dir.File("bad.npy")); }, ErrorCode::kMalformedFile,
              {"bad.npy", "7 bytes"});
}

}  // namespace
}  // namespace kvq
