// .npy reader and writer (NumPy format versions 1.0, 2.0 and 3.0; the header is a Python
// dict literal, parsed here strictly: exactly 'descr', 'fortran_order' and 'shape').
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"

namespace kvq {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicSize = 6;
constexpr size_t kNpyAlign = 64;

// Shows untrusted header text in a message: printable ASCII as is, the rest as \xNN, cut at
// 80 characters.
std::string Quote(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < 80; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > 80) out += "...";
  return out + "\"";
}

struct NpyDtype {
  const char* descr;
  DType dtype;
};
// The accepted descriptors. A one-byte type has no byte order, so '|u1' (what NumPy writes)
// and '<u1' both mean uint8, '|i1' and '<i1' int8.
constexpr NpyDtype kNpyDtypes[] = {
    {"<f4", DType::kF32}, {"<f2", DType::kF16}, {"|u1", DType::kU8}, {"<u1", DType::kU8},
    {"<i4", DType::kI32}, {"|i1", DType::kI8},  {"<i1", DType::kI8},
};

const char* NpyDescr(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "<f4";
    case DType::kF16:
      return "<f2";
    case DType::kU8:
      return "|u1";
    case DType::kI32:
      return "<i4";
    case DType::kI8:
      return "|i1";
    case DType::kBF16:
      break;
  }
  throw Error(ErrorCode::kInvalidArgument,
              detail::Concat("dtype ", DTypeName(dtype), " has no npy descriptor"));
}

struct NpyHeader {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// Recursive descent over the header dict: {'descr': '<f4', 'fortran_order': False,
// 'shape': (2, 3), } followed by spaces and one '\n'.
class NpyHeaderParser {
 public:
  explicit NpyHeaderParser(std::string text) : text_(std::move(text)) {}

  NpyHeader Parse() {
    SkipSpace();
    Expect('{');
    bool seen_descr = false, seen_order = false, seen_shape = false;
    NpyHeader header;
    for (;;) {
      SkipSpace();
      if (Peek() == '}') break;
      const std::string key = ParseString("key");
      SkipSpace();
      Expect(':');
      SkipSpace();
      if (key == "descr") {
        Fail(!seen_descr, "duplicate key 'descr'");
        seen_descr = true;
        header.dtype = ParseDescr();
      } else if (key == "fortran_order") {
        Fail(!seen_order, "duplicate key 'fortran_order'");
        seen_order = true;
        ParseFortranOrder();
      } else if (key == "shape") {
        Fail(!seen_shape, "duplicate key 'shape'");
        seen_shape = true;
        header.shape = ParseShape();
      } else {
        Fail(false, "unknown key " + Quote(key));
      }
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      if (Peek() == '}') break;
      Fail(false, "expected ',' or '}'");
    }
    Expect('}');
    Fail(seen_descr, "missing key 'descr'");
    Fail(seen_order, "missing key 'fortran_order'");
    Fail(seen_shape, "missing key 'shape'");
    // NumPy pads with spaces and ends the header with exactly one newline.
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
    Fail(pos_ + 1 == text_.size() && text_[pos_] == '\n',
         "header must end with spaces and one '\\n' after the dict");
    return header;
  }

 private:
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }

  void Fail(bool ok, const std::string& problem) const {
    KVQ_CHECK(ok, kMalformedFile, "npy header: ", problem, " at offset ", pos_, " in ",
              Quote(text_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t')) ++pos_;
  }

  void Expect(char c) {
    Fail(Peek() == c, std::string("expected '") + c + "'");
    ++pos_;
  }

  // A Python string literal in single or double quotes, without escapes.
  std::string ParseString(const char* what) {
    const char quote = Peek();
    Fail(quote == '\'' || quote == '"', std::string("expected a quoted ") + what);
    const size_t begin = ++pos_;
    while (pos_ < text_.size() && text_[pos_] != quote) {
      Fail(text_[pos_] != '\\' && text_[pos_] != '\n', std::string("escape or newline in ") + what);
      ++pos_;
    }
    Fail(pos_ < text_.size(), std::string("unterminated ") + what);
    return text_.substr(begin, pos_++ - begin);
  }

  DType ParseDescr() {
    Fail(Peek() != '[', "structured dtypes are not supported");
    const std::string descr = ParseString("descr");
    for (const NpyDtype& known : kNpyDtypes) {
      if (descr == known.descr) return known.dtype;
    }
    Fail(descr.empty() || descr[0] != '>', "big-endian dtype " + Quote(descr));
    Fail(descr.find('O') == std::string::npos,
         "object arrays are not supported: descr " + Quote(descr));
    Fail(false, "unsupported dtype " + Quote(descr) + " (<f4, <f2, |u1, <i4, |i1)");
    return DType::kF32;
  }

  void ParseFortranOrder() {
    if (text_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return;
    }
    Fail(text_.compare(pos_, 4, "True") != 0, "fortran_order True is not supported");
    Fail(false, "fortran_order must be True or False");
  }

  int64_t ParseExtent() {
    const bool negative = Peek() == '-';
    if (negative) ++pos_;
    Fail(Peek() >= '0' && Peek() <= '9', "expected a non-negative integer extent");
    const size_t begin = pos_;
    uint64_t value = 0;
    bool overflow = false;
    while (Peek() >= '0' && Peek() <= '9') {
      const uint64_t digit = static_cast<uint64_t>(Peek() - '0');
      overflow = overflow ||
                 value > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - digit) / 10;
      if (!overflow) value = value * 10 + digit;
      ++pos_;
    }
    const std::string digits = text_.substr(begin, pos_ - begin);
    Fail(!negative, "negative extent -" + digits);
    Fail(digits.size() == 1 || digits[0] != '0', "extent " + digits + " has a leading zero");
    Fail(!overflow, "extent " + digits + " overflows int64");
    return static_cast<int64_t>(value);
  }

  // A Python tuple of integers: (), (3,), (2, 3) or (2, 3,).
  std::vector<int64_t> ParseShape() {
    Expect('(');
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    for (;;) {
      SkipSpace();
      if (Peek() == ')') break;
      shape.push_back(ParseExtent());
      SkipSpace();
      trailing_comma = false;
      if (Peek() == ',') {
        ++pos_;
        trailing_comma = true;
        continue;
      }
      Fail(Peek() == ')', "expected ',' or ')' in shape");
    }
    Fail(shape.size() != 1 || trailing_comma, "shape (n) is not a tuple; write (n,)");
    Expect(')');
    return shape;
  }

  std::string text_;
  size_t pos_ = 0;
};

std::string ShapeRepr(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() == 1) out += ",";
  return out + ")";
}

uint32_t ReadLe(const uint8_t* p, size_t n) {
  uint32_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

Tensor ParseNpy(const uint8_t* data, size_t size) {
  KVQ_CHECK(size >= kNpyMagicSize + 4, kMalformedFile, "npy file of ", size,
            " bytes is shorter than its fixed preamble");
  KVQ_CHECK(std::memcmp(data, kNpyMagic, kNpyMagicSize) == 0, kMalformedFile,
            "not an npy file: magic bytes are ",
            Quote(std::string(reinterpret_cast<const char*>(data), kNpyMagicSize)));
  const int major = data[6], minor = data[7];
  KVQ_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, kMalformedFile,
            "unsupported npy version ", major, ".", minor, " (1.0, 2.0 or 3.0)");
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t prefix = kNpyMagicSize + 2 + length_bytes;
  KVQ_CHECK(size >= prefix, kMalformedFile, "npy file of ", size,
            " bytes ends inside the header length");
  const size_t header_length = ReadLe(data + 8, length_bytes);
  KVQ_CHECK(header_length <= size - prefix, kMalformedFile, "npy header length ", header_length,
            " exceeds the ", size - prefix, " bytes after the preamble");
  const std::string header_text(reinterpret_cast<const char*>(data + prefix), header_length);
  const NpyHeader header = NpyHeaderParser(header_text).Parse();

  Tensor t;
  t.dtype = header.dtype;
  t.shape = header.shape;
  size_t expected;
  try {
    expected = CheckedNumel(t.shape, DTypeSize(t.dtype));
  } catch (const Error& e) {
    throw Error(ErrorCode::kMalformedFile,
                detail::Concat("npy shape ", ShapeRepr(t.shape), ": ", e.what()));
  }
  const size_t available = size - prefix - header_length;
  KVQ_CHECK(available == expected, kMalformedFile, "npy data holds ", available, " bytes but ",
            DTypeName(t.dtype), " shape ", t.ShapeString(), " needs ", expected,
            available < expected ? " (file is truncated)" : " (trailing bytes)");
  t.bytes.assign(data + prefix + header_length, data + size);
  return t;
}

Tensor ReadNpy(const std::string& path) {
  const std::vector<uint8_t> bytes = ReadFileBytes(path);
  KVQ_CHECK(SniffFileKind(bytes.data(), bytes.size()) != FileKind::kSafetensors, kMalformedFile,
            path, " is a safetensors file, expected .npy");
  try {
    return ParseNpy(bytes.data(), bytes.size());
  } catch (const Error& e) {
    throw Error(e.code(), path + ": " + e.what());
  }
}

std::vector<uint8_t> SerializeNpy(const Tensor& t) {
  ValidateTensor(t);
  std::string header = std::string("{'descr': '") + NpyDescr(t.dtype) +
                       "', 'fortran_order': False, 'shape': " + ShapeRepr(t.shape) + ", }";
  // Pad with spaces so that the data starts on a 64-byte boundary, then end with '\n'.
  const size_t prefix = kNpyMagicSize + 4;
  const size_t unpadded = prefix + header.size() + 1;
  header.append((kNpyAlign - unpadded % kNpyAlign) % kNpyAlign, ' ');
  header += '\n';
  KVQ_CHECK(header.size() <= 0xffff, kInvalidArgument, "npy header of ", header.size(),
            " bytes for shape ", t.ShapeString(), " does not fit version 1.0");
  std::string preamble(kNpyMagic, kNpyMagicSize);
  preamble += '\x01';
  preamble += '\x00';
  preamble += static_cast<char>(header.size() & 0xff);
  preamble += static_cast<char>(header.size() >> 8);
  preamble += header;
  std::vector<uint8_t> out;
  out.reserve(preamble.size() + t.bytes.size());
  out.assign(preamble.begin(), preamble.end());
  out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void WriteNpy(const std::string& path, const Tensor& t) { WriteFile(path, SerializeNpy(t)); }

}  // namespace kvq
