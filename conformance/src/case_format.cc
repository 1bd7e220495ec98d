// Metadata conversions, fixture look-ups and the cache script shared by the generator and the
// runner (case_format.h).
#include "kvq/conformance/case_format.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/common/stages.h"
#include "kvq/common/tensor.h"

namespace kvq::conformance {
namespace {

std::string CaseName(const Safetensors& file) {
  auto it = file.metadata.find("case");
  return it == file.metadata.end() ? std::string("<unnamed case>") : it->second;
}

// The later of two "major.minor" versions.
const char* LaterVersion(const char* a, const char* b) {
  int a_major = 0, a_minor = 0, b_major = 0, b_minor = 0;
  std::sscanf(a, "%d.%d", &a_major, &a_minor);
  std::sscanf(b, "%d.%d", &b_major, &b_minor);
  return a_major != b_major ? (a_major > b_major ? a : b) : (a_minor >= b_minor ? a : b);
}

}  // namespace

const char* CaseKindName(CaseKind kind) {
  switch (kind) {
    case CaseKind::kStage:
      return "stage";
    case CaseKind::kPipeline:
      return "pipeline";
    case CaseKind::kCache:
      return "cache";
    case CaseKind::kAttention:
      return "attention";
  }
  return "?";
}

CaseKind ParseCaseKind(const std::string& name) {
  for (CaseKind kind :
       {CaseKind::kStage, CaseKind::kPipeline, CaseKind::kCache, CaseKind::kAttention}) {
    if (name == CaseKindName(kind)) return kind;
  }
  throw Error(ErrorCode::kMalformedFile, "unknown case kind '" + name + "'");
}

bool IsReplayableSpecVersion(const std::string& version) {
  return version == "1.0" || version == "1.1" || version == "1.2" || version == "1.3";
}

const char* SpecVersionOf(const WriteParams& p) {
  if (!p.quantized()) return FormatSpecVersion(p.format);
  // The format's own version, raised to 1.1 by spec 1.1's options of an older format.
  const bool v11_option = p.norm || (p.group == p.head_dim && !IsSupportedGroup(p.group));
  return LaterVersion(FormatSpecVersion(p.format), v11_option ? "1.1" : "1.0");
}

const char* SpecVersionOf(const CacheParams& p) {
  const char* v = LaterVersion(SpecVersionOf(p.key), SpecVersionOf(p.value));
  return p.flush != 1 || p.recent == 0 ? LaterVersion(v, "1.1") : v;  // spec 1.1's windows
}

const char* RequiredSpecVersion(const Safetensors& file) {
  const MetadataReader meta = CaseMetadata(file);
  const CaseKind kind = ParseCaseKind(meta.String("kind"));
  if (kind == CaseKind::kCache || kind == CaseKind::kAttention) {
    return SpecVersionOf(GetCacheParams(meta));
  }
  const WriteParams p = GetWriteParams(meta, "");
  if (kind == CaseKind::kStage) {
    const StageSpec& stage = StageByName(meta.String("stage"));
    // A codec stage came with its format; the norm and its inverse with spec 1.1.
    if (!stage.transform) return LaterVersion(FormatSpecVersion(stage.format), SpecVersionOf(p));
    const std::string name = stage.name;
    if (name == "norm" || name == "denorm") return LaterVersion("1.1", SpecVersionOf(p));
  }
  return SpecVersionOf(p);
}

MetadataReader CaseMetadata(const Safetensors& file) {
  return MetadataReader(file.metadata, "case " + CaseName(file));
}

CacheParams GetCacheParams(const Safetensors& file) {
  return kvq::GetCacheParams(CaseMetadata(file));
}

std::vector<float> GatherRotations(const Safetensors& file, const Fixtures& fixtures,
                                   const std::string& index_tensor, int head_dim) {
  const MetadataReader meta = CaseMetadata(file);
  const std::string& path = meta.String("rotation_fixture");
  const std::string& sha = meta.String("rotation_fixture_sha256");
  auto it = fixtures.find(path);
  KVQ_CHECK(it != fixtures.end(), kMalformedFile, "case ", CaseName(file), ": rotation fixture '",
            path, "' is not in the manifest");
  KVQ_CHECK(it->second.sha256 == sha, kMalformedFile, "case ", CaseName(file),
            ": rotation fixture '", path, "' has SHA-256 ", it->second.sha256,
            " but the case was generated against ", sha);
  const Tensor& rotations = it->second.file.Get("rotations");
  const int64_t d = head_dim;
  KVQ_CHECK(rotations.dtype == DType::kF32 && rotations.shape.size() == 3 &&
                rotations.shape[1] == d && rotations.shape[2] == d,
            kMalformedFile, "fixture '", path, "': rotations must be F32 [m, ", d, ", ", d,
            "], got ", DTypeName(rotations.dtype), " ", rotations.ShapeString());
  const Tensor& index = file.Get(index_tensor);
  KVQ_CHECK(index.dtype == DType::kI32 && index.shape.size() == 1, kMalformedFile, "case ",
            CaseName(file), ": ", index_tensor, " must be I32 [m], got ", DTypeName(index.dtype),
            " ", index.ShapeString());
  const size_t matrix = static_cast<size_t>(d * d);
  std::vector<float> out;
  out.reserve(index.numel() * matrix);
  const float* all = rotations.data<float>();
  for (size_t k = 0; k < index.numel(); ++k) {
    const int32_t i = index.data<int32_t>()[k];
    KVQ_CHECK(i >= 0 && i < rotations.shape[0], kMalformedFile, "case ", CaseName(file), ": ",
              index_tensor, "[", k, "] = ", i, " is outside the fixture's ", rotations.shape[0],
              " matrices");
    out.insert(out.end(), all + i * matrix, all + (i + 1) * matrix);
  }
  return out;
}

namespace {

// A per-head array of a cache case, "in.<name>_k" / "_v" [Hkv, extent], in its element type.
void ReadHeadArray(const Safetensors& file, const std::string& name, std::vector<uint8_t>* out) {
  const Tensor& t = file.Get(name);
  KVQ_CHECK(t.dtype == DType::kU8 && t.shape.size() == 2, kMalformedFile, "case ",
            CaseName(file), ": ", name, " must be U8 [Hkv, extent], got ", DTypeName(t.dtype),
            " ", t.ShapeString());
  out->assign(t.data<uint8_t>(), t.data<uint8_t>() + t.numel());
}

// A case never holds rotation values: they travel as fixture indices (in.rotation_k_index).
void ReadHeadArray(const Safetensors& file, const std::string& name, std::vector<float>*) {
  KVQ_CHECK(false, kMalformedFile, "case ", CaseName(file), ": ", name, " holds values; a "
            "cache case names its rotations by fixture index (in.rotation_k_index)");
}

}  // namespace

ReplayedCache ReplayCacheScript(const Safetensors& file, const Fixtures& fixtures,
                                const cpu::Backend& write_backend) {
  const CacheParams params = GetCacheParams(file);
  const int hkv = params.num_kv_heads;
  const int d = params.head_dim();
  HeadData key, value;
  if (params.quantized()) {
    if (params.key.rotation == RotationKind::kDense) {
      key.rotation = GatherRotations(file, fixtures, "in.rotation_k_index", d);
    }
    if (params.value.rotation == RotationKind::kDense) {
      value.rotation = GatherRotations(file, fixtures, "in.rotation_v_index", d);
    }
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                     \
    if (const Tensor* t = file.Find("in." #name "_k")) key.name = t->ToF32(); \
    if (const Tensor* t = file.Find("in." #name "_v")) value.name = t->ToF32();
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
    // Every per-head array given as values: "in.<name>_k" / "_v" (codebook widths, U8
    // [Hkv, d/2]; checked against the params by the cache). Rotations are fixture indices.
#define KVQ_HEAD_ARRAY(name, ...)                                                          \
    if (file.Find("in." #name "_k")) ReadHeadArray(file, "in." #name "_k", &key.name);   \
    if (file.Find("in." #name "_v")) ReadHeadArray(file, "in." #name "_v", &value.name);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  }
  const Tensor& ops = file.Get("in.ops");
  const Tensor& k = file.Get("in.k");
  const Tensor& v = file.Get("in.v");
  KVQ_CHECK(ops.dtype == DType::kI32 && ops.shape.size() == 2 && ops.shape[1] == 3,
            kMalformedFile, "case ", CaseName(file), ": in.ops must be I32 [n, 3], got ",
            ops.ShapeString());
  KVQ_CHECK(k.dtype == DType::kBF16 && v.dtype == DType::kBF16, kMalformedFile, "case ",
            CaseName(file), ": in.k and in.v must be BF16");
  ExpectShape(k, {-1, hkv, d}, "in.k");
  ExpectShape(v, k.shape, "in.v");
  return RunCacheScript(params, std::move(key), std::move(value), write_backend,
                        ops.data<int32_t>(), static_cast<size_t>(ops.shape[0]),
                        k.data<uint16_t>(), v.data<uint16_t>(), static_cast<size_t>(k.shape[0]),
                        "case " + CaseName(file));
}

ReplayedCache RunCacheScript(const CacheParams& params, HeadData key, HeadData value,
                             const cpu::Backend& write_backend, const int32_t* ops,
                             size_t num_ops, const uint16_t* k, const uint16_t* v, size_t rows,
                             const std::string& what) {
  ReplayedCache out;
  out.cache = std::make_unique<cpu::PagedKVCache>(params, std::move(key), std::move(value),
                                                  write_backend);
  const size_t row = static_cast<size_t>(params.num_kv_heads) *
                     static_cast<size_t>(params.head_dim());
  size_t next_row = 0;
  const int32_t* op = ops;
  for (size_t i = 0; i < num_ops; ++i, op += 3) {
    const int32_t code = op[0], slot = op[1], tokens = op[2];
    auto id_of = [&]() {
      KVQ_CHECK(slot >= 0 && static_cast<size_t>(slot) < out.slot_ids.size() &&
                    out.slot_ids[slot] >= 0,
                kMalformedFile, what, ": op ", i, " names slot ", slot,
                " which is not a live sequence");
      return out.slot_ids[slot];
    };
    switch (static_cast<CacheOp>(code)) {
      case CacheOp::kAddSequence:
        KVQ_CHECK(static_cast<size_t>(slot) == out.slot_ids.size(), kMalformedFile, what,
                  ": op ", i, " adds slot ", slot, " but the next slot is ",
                  out.slot_ids.size());
        out.slot_ids.push_back(out.cache->AddSequence());
        break;
      case CacheOp::kPrefill:
      case CacheOp::kAppend: {
        const bool append = static_cast<CacheOp>(code) == CacheOp::kAppend;
        KVQ_CHECK(tokens >= 1 && (!append || tokens == 1) &&
                      next_row + static_cast<size_t>(tokens) <= rows,
                  kMalformedFile, what, ": op ", i, " asks for ", tokens, " rows with ",
                  rows - next_row, " left in in.k");
        const int id = id_of();
        const uint16_t* krows = k + next_row * row;
        const uint16_t* vrows = v + next_row * row;
        if (append) {
          out.cache->AppendBf16(id, krows, vrows);
        } else {
          out.cache->PrefillBf16(id, krows, vrows, static_cast<size_t>(tokens));
        }
        next_row += static_cast<size_t>(tokens);
        break;
      }
      case CacheOp::kRemoveSequence:
        out.cache->RemoveSequence(id_of());
        out.slot_ids[slot] = -1;
        break;
      default:
        KVQ_CHECK(false, kMalformedFile, what, ": op ", i, " has unknown code ", code);
    }
  }
  KVQ_CHECK(next_row == rows, kMalformedFile, what, ": the script uses ", next_row, " of the ",
            rows, " rows of in.k");
  return out;
}

std::vector<uint8_t> F64ToBytes(const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * 8);
  for (size_t i = 0; i < values.size(); ++i) {
    uint64_t u;
    std::memcpy(&u, &values[i], 8);
    for (int b = 0; b < 8; ++b) bytes[8 * i + b] = static_cast<uint8_t>(u >> (8 * b));
  }
  return bytes;
}

std::vector<double> BytesToF64(const std::vector<uint8_t>& bytes) {
  KVQ_CHECK(bytes.size() % 8 == 0, kMalformedFile, "an f64 byte tensor has ", bytes.size(),
            " bytes, not a multiple of 8");
  std::vector<double> values(bytes.size() / 8);
  for (size_t i = 0; i < values.size(); ++i) {
    uint64_t u = 0;
    for (int b = 0; b < 8; ++b) u |= static_cast<uint64_t>(bytes[8 * i + b]) << (8 * b);
    std::memcpy(&values[i], &u, 8);
  }
  return values;
}

}  // namespace kvq::conformance
