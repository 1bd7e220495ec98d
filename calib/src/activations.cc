#include "kvq/calib/activations.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/metadata.h"

namespace kvq::calib {
namespace {

std::string LayerTensorName(int layer, const char* what) {
  return "layers." + std::to_string(layer) + "." + what;
}

void CheckFinite(const std::vector<float>& values, int layer, const char* tensor, int heads,
                 int d) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      const size_t row = i / static_cast<size_t>(d);
      KVQ_CHECK(false, kNonFinite, "activations layer ", layer, " tensor ", tensor, " token ",
                row / heads, " head ", row % heads, " channel ", i % d, ": value ", values[i],
                " is not finite");
    }
  }
}

Tensor StoreAs(DType storage, std::vector<int64_t> shape, const std::vector<float>& values) {
  switch (storage) {
    case DType::kF32: return Tensor::F32(std::move(shape), values);
    case DType::kBF16: {
      std::vector<uint16_t> bits(values.size());
      for (size_t i = 0; i < values.size(); ++i) bits[i] = Bf16FromF32(values[i]);
      return Tensor::BF16(std::move(shape), bits);
    }
    case DType::kF16: {
      Tensor t;
      t.dtype = DType::kF16;
      t.shape = std::move(shape);
      t.bytes.resize(values.size() * 2);
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t h = F16FromF32(values[i]);
        std::memcpy(t.bytes.data() + 2 * i, &h, 2);
      }
      return t;
    }
    default: break;
  }
  KVQ_CHECK(false, kInvalidArgument, "activations cannot be stored as ", DTypeName(storage),
            " (BF16, F16 or F32)");
  return Tensor{};
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> RowsAfterSink(const ActivationsInfo& info,
                                                       int64_t tokens, int64_t skip) {
  KVQ_CHECK(tokens >= 0 && tokens <= info.tokens && skip >= 0, kInvalidArgument,
            "rows after sink: tokens ", tokens, " must lie in [0, ", info.tokens,
            "] and skip ", skip, " must be >= 0");
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const int64_t length = info.segment_tokens > 0 ? info.segment_tokens : info.tokens;
  for (int64_t start = 0; start < tokens; start += length) {
    const int64_t begin = start + skip;
    const int64_t end = std::min(tokens, start + length);
    if (begin < end) ranges.emplace_back(begin, end);
  }
  return ranges;
}

void ValidateActivations(const Activations& acts) {
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(info.num_layers >= 1, kInvalidArgument, "activations: num_layers ", info.num_layers,
            " must be at least 1");
  KVQ_CHECK(info.num_kv_heads >= 1, kInvalidArgument, "activations: num_kv_heads ",
            info.num_kv_heads, " must be at least 1");
  KVQ_CHECK(info.num_q_heads >= info.num_kv_heads && info.num_q_heads % info.num_kv_heads == 0,
            kInvalidArgument, "activations: num_q_heads ", info.num_q_heads,
            " is not a multiple of num_kv_heads ", info.num_kv_heads);
  KVQ_CHECK(IsSupportedHeadDim(info.head_dim), kInvalidArgument, "activations: head_dim ",
            info.head_dim, " is not supported (64, 128 or 256)");
  KVQ_CHECK(std::isfinite(info.rope_base) && info.rope_base > 0, kInvalidArgument,
            "activations: rope_base ", info.rope_base, " must be positive and finite");
  KVQ_CHECK(info.tokens >= 1, kInvalidArgument, "activations: tokens ", info.tokens,
            " must be at least 1");
  KVQ_CHECK(info.calib_tokens >= 1 && info.calib_tokens <= info.tokens, kInvalidArgument,
            "activations: calib_tokens ", info.calib_tokens, " must lie in [1, tokens = ",
            info.tokens, "]");
  KVQ_CHECK(info.segment_tokens >= 0 &&
                (info.segment_tokens == 0 || (info.tokens % info.segment_tokens == 0 &&
                                              info.calib_tokens % info.segment_tokens == 0)),
            kInvalidArgument, "activations: segment_tokens ", info.segment_tokens,
            " must be 0 or divide tokens = ", info.tokens, " and calib_tokens = ",
            info.calib_tokens);
  KVQ_CHECK(static_cast<int>(acts.layers.size()) == info.num_layers, kShapeMismatch,
            "activations: ", acts.layers.size(), " layers present, metadata says ",
            info.num_layers);
  const size_t q_size = static_cast<size_t>(info.tokens) * info.num_q_heads * info.head_dim;
  const size_t kv_size = static_cast<size_t>(info.tokens) * info.num_kv_heads * info.head_dim;
  for (int l = 0; l < info.num_layers; ++l) {
    const LayerActivations& layer = acts.layers[l];
    KVQ_CHECK(layer.q.size() == q_size, kShapeMismatch, "activations layer ", l, " q holds ",
              layer.q.size(), " values, expected T*Hq*d = ", q_size);
    KVQ_CHECK(layer.k.size() == kv_size, kShapeMismatch, "activations layer ", l, " k holds ",
              layer.k.size(), " values, expected T*Hkv*d = ", kv_size);
    KVQ_CHECK(layer.v.size() == kv_size, kShapeMismatch, "activations layer ", l, " v holds ",
              layer.v.size(), " values, expected T*Hkv*d = ", kv_size);
    CheckFinite(layer.q, l, "q", info.num_q_heads, info.head_dim);
    CheckFinite(layer.k, l, "k", info.num_kv_heads, info.head_dim);
    CheckFinite(layer.v, l, "v", info.num_kv_heads, info.head_dim);
  }
}

Activations ActivationsFromSafetensors(const Safetensors& file) {
  const MetadataReader meta(file.metadata, "activations");
  KVQ_CHECK(meta.String("format") == kActivationsFormat, kMalformedFile,
            "activations: format is '", meta.String("format"), "', expected '",
            kActivationsFormat, "'");
  const int64_t version = meta.Int("version");
  KVQ_CHECK(version == kActivationsVersion, kMalformedFile, "activations: version ", version,
            " is not supported (expected ", kActivationsVersion, ")");
  Activations acts;
  ActivationsInfo& info = acts.info;
  info.source = meta.String("source");
  info.num_layers = static_cast<int>(meta.Int("num_layers", 1, 1 << 16));
  info.num_q_heads = static_cast<int>(meta.Int("num_q_heads", 1, 1 << 16));
  info.num_kv_heads = static_cast<int>(meta.Int("num_kv_heads", 1, 1 << 16));
  info.head_dim = static_cast<int>(meta.Int("head_dim", 1, 1 << 16));
  info.rope_base = meta.Double("rope_base");
  info.tokens = meta.Int("tokens", 1, int64_t{1} << 40);
  info.calib_tokens = meta.Int("calib_tokens", 1, int64_t{1} << 40);
  if (file.metadata.count("segment_tokens") != 0) {
    info.segment_tokens = meta.Int("segment_tokens", 1, int64_t{1} << 40);
  }

  std::set<std::string> expected_names;
  for (int l = 0; l < info.num_layers; ++l) {
    for (const char* what : {"q", "k", "v"}) expected_names.insert(LayerTensorName(l, what));
  }
  for (const auto& [name, tensor] : file.tensors) {
    KVQ_CHECK(expected_names.count(name) == 1, kMalformedFile, "activations: unexpected tensor '",
              name, "' (num_layers = ", info.num_layers, ")");
  }
  acts.layers.resize(info.num_layers);
  const std::vector<int64_t> q_shape = {info.tokens, info.num_q_heads, info.head_dim};
  const std::vector<int64_t> kv_shape = {info.tokens, info.num_kv_heads, info.head_dim};
  for (int l = 0; l < info.num_layers; ++l) {
    for (const char* what : {"q", "k", "v"}) {
      const std::string name = LayerTensorName(l, what);
      const Tensor* t = file.Find(name);
      KVQ_CHECK(t != nullptr, kMalformedFile, "activations: tensor '", name,
                "' is missing (layers 0..", info.num_layers - 1, " must all be present)");
      KVQ_CHECK(t->dtype == DType::kBF16 || t->dtype == DType::kF16 || t->dtype == DType::kF32,
                kMalformedFile, "activations: tensor '", name, "' has dtype ",
                DTypeName(t->dtype), " (BF16, F16 or F32)");
      ExpectShape(*t, what[0] == 'q' ? q_shape : kv_shape, "activations tensor '" + name + "'");
      std::vector<float> values = t->ToF32();
      if (what[0] == 'q') acts.layers[l].q = std::move(values);
      if (what[0] == 'k') acts.layers[l].k = std::move(values);
      if (what[0] == 'v') acts.layers[l].v = std::move(values);
    }
  }
  ValidateActivations(acts);
  return acts;
}

Activations ReadActivations(const std::string& path) {
  return ActivationsFromSafetensors(ReadSafetensors(path));
}

Safetensors ActivationsToSafetensors(const Activations& acts, DType storage) {
  ValidateActivations(acts);
  const ActivationsInfo& info = acts.info;
  Safetensors file;
  file.metadata["format"] = kActivationsFormat;
  file.metadata["version"] = std::to_string(kActivationsVersion);
  file.metadata["source"] = info.source;
  file.metadata["num_layers"] = std::to_string(info.num_layers);
  file.metadata["num_q_heads"] = std::to_string(info.num_q_heads);
  file.metadata["num_kv_heads"] = std::to_string(info.num_kv_heads);
  file.metadata["head_dim"] = std::to_string(info.head_dim);
  file.metadata["rope_base"] = ShortestDouble(info.rope_base);
  file.metadata["tokens"] = std::to_string(info.tokens);
  file.metadata["calib_tokens"] = std::to_string(info.calib_tokens);
  if (info.segment_tokens > 0) {
    file.metadata["segment_tokens"] = std::to_string(info.segment_tokens);
  }
  const std::vector<int64_t> q_shape = {info.tokens, info.num_q_heads, info.head_dim};
  const std::vector<int64_t> kv_shape = {info.tokens, info.num_kv_heads, info.head_dim};
  for (int l = 0; l < info.num_layers; ++l) {
    file.Add(LayerTensorName(l, "q"), StoreAs(storage, q_shape, acts.layers[l].q));
    file.Add(LayerTensorName(l, "k"), StoreAs(storage, kv_shape, acts.layers[l].k));
    file.Add(LayerTensorName(l, "v"), StoreAs(storage, kv_shape, acts.layers[l].v));
  }
  return file;
}

void WriteActivations(const std::string& path, const Activations& acts, DType storage) {
  WriteSafetensors(path, ActivationsToSafetensors(acts, storage));
}

}  // namespace kvq::calib
