#include "kvq/calib/model.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"

namespace kvq::calib {
namespace {

using Json = nlohmann::json;

// ---- config.json ----

class ConfigReader {
 public:
  ConfigReader(const Json& root, std::string where) : root_(root), where_(std::move(where)) {}

  bool Has(const std::string& key) const { return root_.contains(key) && !root_[key].is_null(); }

  int Int(const std::string& key) const {
    KVQ_CHECK(Has(key), kInvalidArgument, where_, ": config.json has no '", key, "'");
    return IntOf(root_[key], key);
  }
  int IntOr(const std::string& key, int fallback) const {
    return Has(key) ? IntOf(root_[key], key) : fallback;
  }
  double Number(const Json& value, const std::string& key) const {
    KVQ_CHECK(value.is_number(), kMalformedFile, where_, ": config.json '", key,
              "' must be a number, got ", value.dump());
    return value.get<double>();
  }
  double NumberAt(const std::string& key) const {
    KVQ_CHECK(Has(key), kInvalidArgument, where_, ": config.json has no '", key, "'");
    return Number(root_[key], key);
  }
  std::string StringOr(const std::string& key, const std::string& fallback) const {
    if (!Has(key)) return fallback;
    KVQ_CHECK(root_[key].is_string(), kMalformedFile, where_, ": config.json '", key,
              "' must be a string, got ", root_[key].dump());
    return root_[key].get<std::string>();
  }
  bool BoolOr(const std::string& key, bool fallback) const {
    if (!Has(key)) return fallback;
    KVQ_CHECK(root_[key].is_boolean(), kMalformedFile, where_, ": config.json '", key,
              "' must be true or false, got ", root_[key].dump());
    return root_[key].get<bool>();
  }
  const Json& root() const { return root_; }
  const std::string& where() const { return where_; }

 private:
  int IntOf(const Json& value, const std::string& key) const {
    KVQ_CHECK(value.is_number_integer(), kMalformedFile, where_, ": config.json '", key,
              "' must be an integer, got ", value.dump());
    const int64_t v = value.get<int64_t>();
    KVQ_CHECK(v >= -1 && v <= (int64_t{1} << 30), kInvalidArgument, where_, ": config.json '",
              key, "' = ", v, " is out of range");
    return static_cast<int>(v);
  }

  const Json& root_;
  std::string where_;
};

// ---- weights ----

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

class WeightReader {
 public:
  WeightReader(const Safetensors& file, std::string where)
      : file_(file), where_(std::move(where)) {}

  const Tensor& Expect(const std::string& name, const std::vector<int64_t>& shape) {
    const Tensor* t = file_.Find(name);
    KVQ_CHECK(t != nullptr, kMalformedFile, where_, ": model.safetensors has no tensor '", name,
              "'");
    KVQ_CHECK(t->shape == shape, kMalformedFile, where_, ": tensor '", name, "' has shape ",
              t->ShapeString(), ", the config implies ", ShapeText(shape));
    used_.insert(name);
    return *t;
  }

  // A vector (norm weight): F32, BF16 or F16, finite.
  std::vector<float> Vector(const std::string& name, int64_t n) {
    const Tensor& t = Expect(name, {n});
    KVQ_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16,
              kMalformedFile, where_, ": tensor '", name, "' has dtype ", DTypeName(t.dtype),
              " (F32, BF16 or F16)");
    std::vector<float> v = t.ToF32();
    CheckFinite(name, v.data(), 1, static_cast<size_t>(n));
    return v;
  }

  // A matrix [out, in] as fp32 row-major [out, in]: I8 codes times the BF16 `_scale` of their
  // row (one fp32 multiply), or F32/BF16/F16 converted exactly.
  std::vector<float> Matrix(const std::string& name, int64_t out, int64_t in) {
    const Tensor& t = Expect(name, {out, in});
    std::vector<float> w;
    if (t.dtype == DType::kI8) {
      const Tensor& s = Expect(name + "_scale", {out});
      KVQ_CHECK(s.dtype == DType::kBF16 || s.dtype == DType::kF32, kMalformedFile, where_,
                ": tensor '", name, "_scale' has dtype ", DTypeName(s.dtype), " (BF16 or F32)");
      const std::vector<float> scale = s.ToF32();
      CheckFinite(name + "_scale", scale.data(), 1, static_cast<size_t>(out));
      const int8_t* q = t.data<int8_t>();
      w.resize(static_cast<size_t>(out) * in);
      for (int64_t r = 0; r < out; ++r) {
        for (int64_t c = 0; c < in; ++c) {
          w[r * in + c] = static_cast<float>(q[r * in + c]) * scale[r];
        }
      }
    } else {
      KVQ_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16,
                kMalformedFile, where_, ": tensor '", name, "' has dtype ", DTypeName(t.dtype),
                " (I8 with a _scale, F32, BF16 or F16)");
      w = t.ToF32();
    }
    CheckFinite(name, w.data(), static_cast<size_t>(out), static_cast<size_t>(in));
    return w;
  }

  // Rejects tensors nobody asked for (a wrong architecture or a misnamed file).
  void ExpectNoOthers() const {
    for (const auto& [name, tensor] : file_.tensors) {
      KVQ_CHECK(used_.count(name) == 1, kMalformedFile, where_, ": unexpected tensor '", name,
                "' ", tensor.ShapeString(), " (not part of the architecture config.json names)");
    }
  }

 private:
  void CheckFinite(const std::string& name, const float* v, size_t rows, size_t cols) const {
    for (size_t i = 0; i < rows * cols; ++i) {
      KVQ_CHECK(std::isfinite(v[i]), kNonFinite, where_, ": tensor '", name, "' row ", i / cols,
                " column ", i % cols, ": value ", v[i], " is not finite");
    }
  }

  const Safetensors& file_;
  std::string where_;
  std::set<std::string> used_;
};

// dst [in, out_total] columns [col0, col0 + out) = wᵀ of w [out, in].
void PutTransposed(const std::vector<float>& w, int64_t out, int64_t in, int64_t out_total,
                   int64_t col0, std::vector<float>* dst) {
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t c = 0; c < in; ++c) (*dst)[c * out_total + col0 + r] = w[r * in + c];
  }
}

}  // namespace

const char* ModelArchName(ModelArch arch) {
  return arch == ModelArch::kQwen3 ? "qwen3" : "llama";
}

ModelConfig ParseModelConfig(const std::string& json_text, const std::string& where) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw Error(ErrorCode::kMalformedFile,
                detail::Concat(where, ": config.json is not valid JSON: ", e.what()));
  }
  KVQ_CHECK(root.is_object(), kMalformedFile, where, ": config.json must be a JSON object");
  const ConfigReader r(root, where);
  ModelConfig c;
  const std::string type = r.StringOr("model_type", "");
  if (type == "llama") {
    c.arch = ModelArch::kLlama;
  } else if (type == "qwen3") {
    c.arch = ModelArch::kQwen3;
  } else {
    KVQ_CHECK(false, kInvalidArgument, where, ": model_type '", type,
              "' is not supported (llama or qwen3)");
  }
  c.num_layers = r.Int("num_hidden_layers");
  c.hidden = r.Int("hidden_size");
  c.num_q_heads = r.Int("num_attention_heads");
  c.num_kv_heads = r.IntOr("num_key_value_heads", c.num_q_heads);
  c.head_dim = r.IntOr("head_dim", c.num_q_heads > 0 ? c.hidden / c.num_q_heads : 0);
  c.intermediate = r.Int("intermediate_size");
  c.vocab = r.Int("vocab_size");
  c.max_positions = r.Int("max_position_embeddings");
  c.rms_eps = r.NumberAt("rms_norm_eps");
  c.tied = r.BoolOr("tie_word_embeddings", false);
  c.bos = r.IntOr("bos_token_id", -1);
  c.eos = r.IntOr("eos_token_id", -1);
  for (const auto& [key, value] :
       {std::pair<const char*, int>{"num_hidden_layers", c.num_layers},
        {"hidden_size", c.hidden},
        {"num_attention_heads", c.num_q_heads},
        {"num_key_value_heads", c.num_kv_heads},
        {"head_dim", c.head_dim},
        {"intermediate_size", c.intermediate},
        {"vocab_size", c.vocab},
        {"max_position_embeddings", c.max_positions}}) {
    KVQ_CHECK(value >= 1, kInvalidArgument, where, ": config.json '", key, "' = ", value,
              " must be positive");
  }
  // The widths are ints (Hq·d, Hkv·d): each head count times head_dim stays within 2^30.
  KVQ_CHECK(int64_t{c.num_q_heads} * c.head_dim <= (int64_t{1} << 30), kInvalidArgument, where,
            ": num_attention_heads ", c.num_q_heads, " x head_dim ", c.head_dim,
            " exceeds 2^30");
  KVQ_CHECK(c.num_q_heads % c.num_kv_heads == 0, kInvalidArgument, where,
            ": num_attention_heads ", c.num_q_heads, " is not a multiple of num_key_value_heads ",
            c.num_kv_heads);
  KVQ_CHECK(c.head_dim % 2 == 0, kInvalidArgument, where, ": head_dim ", c.head_dim,
            " must be even (rotate-half RoPE)");
  KVQ_CHECK(std::isfinite(c.rms_eps) && c.rms_eps > 0, kInvalidArgument, where,
            ": rms_norm_eps ", c.rms_eps, " must be positive");

  // RoPE: the default rope only (no scaling), θ at the top level or in rope_parameters.
  const Json* rope_parameters = r.Has("rope_parameters") ? &root["rope_parameters"] : nullptr;
  if (r.Has("rope_scaling")) {
    const Json& s = root["rope_scaling"];
    KVQ_CHECK(s.is_object() && s.value("rope_type", s.value("type", "default")) == "default",
              kInvalidArgument, where, ": rope_scaling ", s.dump(),
              " is not supported (default RoPE only)");
  }
  if (rope_parameters != nullptr) {
    KVQ_CHECK(rope_parameters->is_object(), kMalformedFile, where,
              ": config.json 'rope_parameters' must be an object");
    const std::string rope_type = rope_parameters->value("rope_type", "default");
    KVQ_CHECK(rope_type == "default", kInvalidArgument, where, ": rope_type '", rope_type,
              "' is not supported (default RoPE only)");
  }
  if (r.Has("rope_theta")) {
    c.rope_theta = r.NumberAt("rope_theta");
  } else if (rope_parameters != nullptr && rope_parameters->contains("rope_theta")) {
    c.rope_theta = r.Number((*rope_parameters)["rope_theta"], "rope_parameters.rope_theta");
  } else {
    KVQ_CHECK(false, kInvalidArgument, where, ": config.json has no 'rope_theta'");
  }
  KVQ_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 1, kInvalidArgument, where,
            ": rope_theta ", c.rope_theta, " must be > 1");

  const std::string act = r.StringOr("hidden_act", "silu");
  KVQ_CHECK(act == "silu", kInvalidArgument, where, ": hidden_act '", act,
            "' is not supported (silu: SwiGLU)");
  KVQ_CHECK(!r.BoolOr("attention_bias", false), kInvalidArgument, where,
            ": attention_bias true is not supported");
  KVQ_CHECK(!r.BoolOr("mlp_bias", false), kInvalidArgument, where,
            ": mlp_bias true is not supported");
  KVQ_CHECK(!r.BoolOr("use_sliding_window", false), kInvalidArgument, where,
            ": use_sliding_window true is not supported (full attention only)");
  if (r.Has("layer_types")) {
    const Json& types = root["layer_types"];
    KVQ_CHECK(types.is_array(), kMalformedFile, where, ": 'layer_types' must be an array");
    for (const Json& t : types) {
      KVQ_CHECK(t == "full_attention", kInvalidArgument, where, ": layer type ", t.dump(),
                " is not supported (full_attention only)");
    }
  }
  return c;
}

Model BuildModel(const ModelConfig& config, const Safetensors& weights, const std::string& where,
                 int64_t positions) {
  KVQ_CHECK(positions >= 0, kInvalidArgument, where, ": RoPE positions ", positions,
            " is negative");
  const ModelConfig& c = config;
  Model m;
  m.where = where;
  m.config = c;
  m.metadata = weights.metadata;
  WeightReader r(weights, where);
  const int64_t D = c.hidden, V = c.vocab, I = c.intermediate, d = c.head_dim;
  const int64_t qw = c.q_width(), kvw = c.kv_width();

  m.embed = r.Matrix("model.embed_tokens.weight", V, D);
  m.head.resize(static_cast<size_t>(D) * V);
  if (c.tied) {
    PutTransposed(m.embed, V, D, V, 0, &m.head);
  } else {
    PutTransposed(r.Matrix("lm_head.weight", V, D), V, D, V, 0, &m.head);
  }
  m.final_norm = r.Vector("model.norm.weight", D);
  // Layer by layer, each buffer sized after the tensors that fill it were found with their
  // shapes: a config that claims more layers or wider projections than the file holds fails
  // naming the missing tensor, before anything is allocated in proportion to the claim.
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    m.layers.emplace_back();
    LayerWeights& w = m.layers.back();
    w.input_norm = r.Vector(p + "input_layernorm.weight", D);
    w.post_norm = r.Vector(p + "post_attention_layernorm.weight", D);
    if (c.arch == ModelArch::kQwen3) {
      w.q_norm = r.Vector(p + "self_attn.q_norm.weight", d);
      w.k_norm = r.Vector(p + "self_attn.k_norm.weight", d);
    }
    const int64_t fused = qw + 2 * kvw;
    const std::vector<float> q_proj = r.Matrix(p + "self_attn.q_proj.weight", qw, D);
    const std::vector<float> k_proj = r.Matrix(p + "self_attn.k_proj.weight", kvw, D);
    const std::vector<float> v_proj = r.Matrix(p + "self_attn.v_proj.weight", kvw, D);
    w.qkv.resize(static_cast<size_t>(D) * fused);
    PutTransposed(q_proj, qw, D, fused, 0, &w.qkv);
    PutTransposed(k_proj, kvw, D, fused, qw, &w.qkv);
    PutTransposed(v_proj, kvw, D, fused, qw + kvw, &w.qkv);
    const std::vector<float> o_proj = r.Matrix(p + "self_attn.o_proj.weight", D, qw);
    w.o.resize(static_cast<size_t>(qw) * D);
    PutTransposed(o_proj, D, qw, D, 0, &w.o);
    const std::vector<float> gate = r.Matrix(p + "mlp.gate_proj.weight", I, D);
    const std::vector<float> up = r.Matrix(p + "mlp.up_proj.weight", I, D);
    w.gate_up.resize(static_cast<size_t>(D) * 2 * I);
    PutTransposed(gate, I, D, 2 * I, 0, &w.gate_up);
    PutTransposed(up, I, D, 2 * I, I, &w.gate_up);
    const std::vector<float> down = r.Matrix(p + "mlp.down_proj.weight", D, I);
    w.down.resize(static_cast<size_t>(I) * D);
    PutTransposed(down, D, I, D, 0, &w.down);
  }
  r.ExpectNoOthers();

  // RoPE tables, as HF's default rope computes them in fp32.
  const int half = c.head_dim / 2;
  std::vector<float> inv_freq(half);
  const float theta = static_cast<float>(c.rope_theta);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv_freq[i] = 1.0f / std::pow(theta, exponent);
  }
  // Only the positions the caller will run: a config may allow millions (long-context models),
  // and the tables would take 4·d bytes per position.
  m.rope_positions =
      positions == 0 ? c.max_positions : std::min<int64_t>(positions, c.max_positions);
  m.rope_cos.resize(static_cast<size_t>(m.rope_positions) * half);
  m.rope_sin.resize(m.rope_cos.size());
  for (int64_t p = 0; p < m.rope_positions; ++p) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(p) * inv_freq[i];
      m.rope_cos[static_cast<size_t>(p) * half + i] = static_cast<float>(std::cos(double{angle}));
      m.rope_sin[static_cast<size_t>(p) * half + i] = static_cast<float>(std::sin(double{angle}));
    }
  }
  return m;
}

ModelConfig ReadModelConfig(const std::string& dir) {
  namespace fs = std::filesystem;
  KVQ_CHECK(fs::is_directory(dir), kIoError, "model folder '", dir, "' does not exist");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string weights_path = (fs::path(dir) / "model.safetensors").string();
  KVQ_CHECK(fs::exists(config_path), kIoError, "model folder '", dir, "' has no config.json");
  KVQ_CHECK(fs::exists(weights_path), kIoError, "model folder '", dir,
            "' has no model.safetensors (model B's weights are not committed: see its README)");
  const std::vector<uint8_t> config_bytes = ReadFileBytes(config_path);
  return ParseModelConfig(std::string(config_bytes.begin(), config_bytes.end()), dir);
}

Model LoadModel(const std::string& dir, int64_t positions) {
  const ModelConfig config = ReadModelConfig(dir);
  const std::string weights_path = (std::filesystem::path(dir) / "model.safetensors").string();
  return BuildModel(config, ReadSafetensors(weights_path), dir, positions);
}

// ---- Token windows ----

std::vector<WindowSelection> ParseWindowSelections(const std::string& text) {
  std::vector<WindowSelection> out;
  std::stringstream stream(text);
  std::string item;
  auto number = [&](const std::string& s) {
    KVQ_CHECK(!s.empty() && s.size() < 9 && s.find_first_not_of("0123456789") == std::string::npos,
              kInvalidArgument, "window selection '", item, "': '", s,
              "' is not a row number");
    return std::stoi(s);
  };
  while (std::getline(stream, item, ',')) {
    KVQ_CHECK(!item.empty(), kInvalidArgument, "empty window selection in '", text, "'");
    WindowSelection s;
    const size_t colon = item.find(':');
    s.name = item.substr(0, colon);
    KVQ_CHECK(!s.name.empty(), kInvalidArgument, "window selection '", item,
              "' has no tensor name");
    if (colon != std::string::npos) {
      const std::string range = item.substr(colon + 1);
      const size_t dash = range.find('-');
      s.first = number(range.substr(0, dash));
      s.last = dash == std::string::npos ? s.first : number(range.substr(dash + 1));
      KVQ_CHECK(s.last >= s.first, kInvalidArgument, "window selection '", item, "': row ",
                s.last, " comes before row ", s.first);
    }
    out.push_back(s);
  }
  KVQ_CHECK(!out.empty(), kInvalidArgument, "empty window selection '", text, "'");
  return out;
}

std::vector<TokenWindows> ReadTokenWindows(const std::string& path,
                                           const std::vector<WindowSelection>& selections,
                                           int64_t length, int vocab) {
  const Safetensors file = ReadSafetensors(path);
  std::string present;
  for (const auto& [name, t] : file.tensors) {
    present += (present.empty() ? "" : ", ") + name + " " + t.ShapeString();
  }
  std::vector<TokenWindows> out;
  for (const WindowSelection& s : selections) {
    const Tensor* t = file.Find(s.name);
    KVQ_CHECK(t != nullptr, kMalformedFile, path, ": no tensor '", s.name, "' (present: ", present,
              ")");
    KVQ_CHECK(t->dtype == DType::kI32 && t->shape.size() == 2, kMalformedFile, path,
              ": tensor '", s.name, "' is ", DTypeName(t->dtype), " ", t->ShapeString(),
              ", expected I32 [windows, tokens]");
    const int64_t n = t->shape[0], full = t->shape[1];
    const int last = s.last < 0 ? static_cast<int>(n) - 1 : s.last;
    KVQ_CHECK(s.first < n && last < n, kInvalidArgument, path, ": tensor '", s.name, "' has ",
              n, " windows, row ", std::max(s.first, last), " does not exist");
    KVQ_CHECK(length >= 0 && length <= full, kInvalidArgument, "window length ", length,
              " exceeds the ", full, " tokens of '", s.name, "' in ", path);
    // Selections of one tensor join one set (calib:0-1,calib:4-5), in the order given.
    TokenWindows* w = nullptr;
    for (TokenWindows& existing : out) {
      if (existing.name == s.name) w = &existing;
    }
    if (w == nullptr) {
      out.emplace_back();
      w = &out.back();
      w->name = s.name;
      w->length = length > 0 ? length : full;
    }
    for (int row = s.first; row <= last; ++row) {
      KVQ_CHECK(std::find(w->rows.begin(), w->rows.end(), row) == w->rows.end(),
                kInvalidArgument, "window selection: row ", row, " of '", s.name,
                "' is selected twice");
      w->rows.push_back(row);
      const int32_t* src = t->data<int32_t>() + static_cast<size_t>(row) * full;
      for (int64_t i = 0; i < w->length; ++i) {
        KVQ_CHECK(src[i] >= 0 && src[i] < vocab, kInvalidArgument, path, ": tensor '", s.name,
                  "' row ", row, " position ", i, ": token id ", src[i],
                  " is outside the vocabulary [0, ", vocab, ")");
      }
      w->ids.insert(w->ids.end(), src, src + w->length);
    }
  }
  return out;
}

std::string DefaultTokensPath(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path own = fs::path(model_dir) / "tokens.safetensors";
  if (fs::exists(own)) return own.string();
  const fs::path sibling =
      (fs::path(model_dir) / ".." / "tiny-llama-a" / "tokens.safetensors").lexically_normal();
  KVQ_CHECK(fs::exists(sibling), kIoError, "model folder '", model_dir,
            "' has no tokens.safetensors (nor ../tiny-llama-a/tokens.safetensors): pass "
            "--tokens FILE");
  return sibling.string();
}

}  // namespace kvq::calib
