// safetensors reader and writer: an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets}, "__metadata__": {string: string}}), then the data
// buffer, which the tensors' [begin, end) offsets must tile exactly.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"

namespace kvq {
namespace {

using Json = nlohmann::ordered_json;  // keeps the header's key order (the file order)

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's bound
constexpr char kMetadataKey[] = "__metadata__";

// A name from an untrusted header, shortened and quoted for a message.
std::string Name(const std::string& name) {
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < 80; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (name.size() > 80) out += "...";
  return out + "'";
}

bool ParseDType(const std::string& name, DType* dtype) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kU8, DType::kI32, DType::kI8}) {
    if (name == DTypeName(d)) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

// A JSON value for a message: short and on one line.
std::string Show(const Json& value) {
  std::string text = value.dump(-1, ' ', true, Json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 80) + "...";
  return text;
}

uint64_t ExpectUnsigned(const Json& value, const std::string& what) {
  KVQ_CHECK(value.is_number_unsigned(), kMalformedFile, "safetensors: ", what,
            " must be a non-negative integer, got ", Show(value));
  return value.get<uint64_t>();
}

// Parses the header JSON, rejecting duplicate keys (which the JSON library would silently
// merge) and nesting deeper than the format uses (root > tensor > shape).
Json ParseHeaderJson(const char* begin, const char* end) {
  std::vector<std::set<std::string>> keys_per_object;
  auto callback = [&](int depth, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      KVQ_CHECK(depth < 3, kMalformedFile,
                "safetensors header nests deeper than the format allows");
      if (event == Event::object_start) keys_per_object.emplace_back();
    } else if (event == Event::object_end) {
      keys_per_object.pop_back();
    } else if (event == Event::key) {
      const std::string& key = parsed.get_ref<const std::string&>();
      KVQ_CHECK(keys_per_object.back().insert(key).second, kMalformedFile,
                "safetensors header has duplicate key ", Name(key));
    }
    return true;
  };
  try {
    return Json::parse(begin, end, callback);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorCode::kMalformedFile,
                detail::Concat("safetensors header is not valid JSON: ", e.what()));
  }
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Entry ParseEntry(const std::string& name, const Json& info, uint64_t buffer_size) {
  KVQ_CHECK(info.is_object(), kMalformedFile, "safetensors: tensor ", Name(name),
            " must be an object, got ", Show(info));
  for (auto it = info.begin(); it != info.end(); ++it) {
    KVQ_CHECK(it.key() == "dtype" || it.key() == "shape" || it.key() == "data_offsets",
              kMalformedFile, "safetensors: tensor ", Name(name), " has unknown field ",
              Name(it.key()));
  }
  KVQ_CHECK(info.contains("dtype") && info.contains("shape") && info.contains("data_offsets"),
            kMalformedFile, "safetensors: tensor ", Name(name),
            " needs dtype, shape and data_offsets");
  Entry entry;
  entry.name = name;
  const Json& dtype = info["dtype"];
  KVQ_CHECK(dtype.is_string(), kMalformedFile, "safetensors: dtype of ", Name(name),
            " must be a string, got ", Show(dtype));
  KVQ_CHECK(ParseDType(dtype.get<std::string>(), &entry.dtype), kMalformedFile,
            "safetensors: tensor ", Name(name), " has unsupported dtype ", Show(dtype),
            " (F32, F16, BF16, U8, I32, I8)");
  const Json& shape = info["shape"];
  KVQ_CHECK(shape.is_array(), kMalformedFile, "safetensors: shape of ", Name(name),
            " must be an array, got ", Show(shape));
  for (const Json& extent : shape) {
    const uint64_t e = ExpectUnsigned(extent, "shape extent of " + Name(name));
    KVQ_CHECK(e <= static_cast<uint64_t>(INT64_MAX), kMalformedFile, "safetensors: extent ", e,
              " of ", Name(name), " overflows int64");
    entry.shape.push_back(static_cast<int64_t>(e));
  }
  const Json& offsets = info["data_offsets"];
  KVQ_CHECK(offsets.is_array() && offsets.size() == 2, kMalformedFile,
            "safetensors: data_offsets of ", Name(name), " must be [begin, end], got ",
            Show(offsets));
  entry.begin = ExpectUnsigned(offsets[0], "data_offsets begin of " + Name(name));
  entry.end = ExpectUnsigned(offsets[1], "data_offsets end of " + Name(name));
  KVQ_CHECK(entry.begin <= entry.end, kMalformedFile, "safetensors: tensor ", Name(name),
            " has data_offsets begin ", entry.begin, " > end ", entry.end);
  KVQ_CHECK(entry.end <= buffer_size, kMalformedFile, "safetensors: tensor ", Name(name),
            " ends at ", entry.end, " beyond the ", buffer_size, "-byte data buffer");
  size_t expected;
  try {
    expected = CheckedNumel(entry.shape, DTypeSize(entry.dtype));
  } catch (const Error& e) {
    throw Error(ErrorCode::kMalformedFile,
                detail::Concat("safetensors: tensor ", Name(name), ": ", e.what()));
  }
  KVQ_CHECK(entry.end - entry.begin == expected, kMalformedFile, "safetensors: tensor ", Name(name),
            " spans ", entry.end - entry.begin, " bytes but ", DTypeName(entry.dtype), " shape ",
            Show(shape), " needs ", expected);
  return entry;
}

void PutLe64(uint64_t v, std::vector<uint8_t>* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace

const Tensor* Safetensors::Find(const std::string& name) const {
  for (const auto& entry : tensors) {
    if (entry.first == name) return &entry.second;
  }
  return nullptr;
}

const Tensor& Safetensors::Get(const std::string& name) const {
  const Tensor* t = Find(name);
  KVQ_CHECK(t != nullptr, kMalformedFile, "safetensors file has no tensor ", Name(name));
  return *t;
}

void Safetensors::Add(const std::string& name, Tensor t) {
  KVQ_CHECK(Find(name) == nullptr, kInvalidArgument, "duplicate tensor name ", Name(name));
  KVQ_CHECK(name != kMetadataKey, kInvalidArgument, "a tensor cannot be named ", Name(name));
  tensors.emplace_back(name, std::move(t));
}

Safetensors ParseSafetensors(const uint8_t* data, size_t size) {
  KVQ_CHECK(size >= 8, kMalformedFile, "safetensors file of ", size,
            " bytes is shorter than its 8-byte header length");
  uint64_t header_length = 0;
  for (int i = 0; i < 8; ++i) header_length |= static_cast<uint64_t>(data[i]) << (8 * i);
  KVQ_CHECK(header_length <= kMaxHeaderBytes, kMalformedFile, "safetensors header length ",
            header_length, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  KVQ_CHECK(header_length <= size - 8, kMalformedFile, "safetensors header length ", header_length,
            " exceeds the ", size - 8, " bytes after the length field");
  KVQ_CHECK(header_length > 0 && data[8] == '{', kMalformedFile,
            "safetensors header must start with '{'");
  const char* header = reinterpret_cast<const char*>(data + 8);
  const Json root = ParseHeaderJson(header, header + header_length);
  KVQ_CHECK(root.is_object(), kMalformedFile, "safetensors header must be a JSON object");

  const uint8_t* buffer = data + 8 + header_length;
  const uint64_t buffer_size = size - 8 - header_length;
  Safetensors file;
  std::vector<Entry> entries;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == kMetadataKey) {
      KVQ_CHECK(it.value().is_object(), kMalformedFile,
                "safetensors __metadata__ must be an object, got ", Show(it.value()));
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        KVQ_CHECK(m.value().is_string(), kMalformedFile, "safetensors __metadata__ value of ",
                  Name(m.key()), " must be a string, got ", Show(m.value()));
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    entries.push_back(ParseEntry(it.key(), it.value(), buffer_size));
  }

  // The offsets must tile [0, buffer_size): sorted by position, each tensor starts where the
  // previous one ended (zero-sized tensors occupy no bytes and may sit anywhere in between).
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  for (const Entry* e : by_offset) {
    KVQ_CHECK(e->begin >= covered, kMalformedFile, "safetensors: tensor ", Name(e->name), " at [",
              e->begin, ", ", e->end, ") overlaps the previous tensor ending at ", covered);
    KVQ_CHECK(e->begin == covered, kMalformedFile, "safetensors: bytes [", covered, ", ", e->begin,
              ") of the data buffer belong to no tensor");
    covered = e->end;
  }
  KVQ_CHECK(covered == buffer_size, kMalformedFile, "safetensors: bytes [", covered, ", ",
            buffer_size, ") of the data buffer belong to no tensor");

  for (const Entry& e : entries) {
    Tensor t;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.bytes.assign(buffer + e.begin, buffer + e.end);
    file.tensors.emplace_back(e.name, std::move(t));
  }
  return file;
}

Safetensors ReadSafetensors(const std::string& path) {
  const std::vector<uint8_t> bytes = ReadFileBytes(path);
  KVQ_CHECK(SniffFileKind(bytes.data(), bytes.size()) != FileKind::kNpy, kMalformedFile, path,
            " is a .npy file, expected safetensors");
  try {
    return ParseSafetensors(bytes.data(), bytes.size());
  } catch (const Error& e) {
    throw Error(e.code(), path + ": " + e.what());
  }
}

std::vector<uint8_t> SerializeSafetensors(const Safetensors& file) {
  std::vector<const std::pair<std::string, Tensor>*> sorted;
  for (const auto& entry : file.tensors) {
    KVQ_CHECK(entry.first != kMetadataKey, kInvalidArgument, "a tensor cannot be named ",
              Name(entry.first));
    ValidateTensor(entry.second);
    sorted.push_back(&entry);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    KVQ_CHECK(sorted[i - 1]->first != sorted[i]->first, kInvalidArgument, "duplicate tensor name ",
              Name(sorted[i]->first));
  }

  Json header = Json::object();
  if (!file.metadata.empty()) {
    Json metadata = Json::object();
    for (const auto& [key, value] : file.metadata) metadata[key] = value;
    header[kMetadataKey] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const auto* entry : sorted) {
    const Tensor& t = entry->second;
    Json info = Json::object();
    info["dtype"] = DTypeName(t.dtype);
    info["shape"] = t.shape;
    info["data_offsets"] = {offset, offset + t.bytes.size()};
    header[entry->first] = std::move(info);
    offset += t.bytes.size();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorCode::kInvalidArgument,
                detail::Concat("cannot encode safetensors header (names and metadata must be "
                               "UTF-8): ",
                               e.what()));
  }
  // Spaces pad the header so that the data buffer starts on an 8-byte boundary.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + offset);
  PutLe64(text.size(), &out);
  out.insert(out.end(), text.begin(), text.end());
  for (const auto* entry : sorted) {
    out.insert(out.end(), entry->second.bytes.begin(), entry->second.bytes.end());
  }
  return out;
}

void WriteSafetensors(const std::string& path, const Safetensors& file) {
  WriteFile(path, SerializeSafetensors(file));
}

}  // namespace kvq
