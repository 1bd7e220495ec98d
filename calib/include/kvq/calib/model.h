// A decoder-only language model folder as kvq reads it (spec/formats.md §7): an HF
// `config.json` (model_type llama or qwen3) and `model.safetensors` with HF names, matrices
// either int8-row (I8 [out, in] + BF16 `NAME_scale` [out], w = float32(q) · float32(s), one fp32
// multiply: the definition of calib/models/*) or plain F32/BF16/F16; plus token windows
// (`tokens.safetensors`: I32 [windows, length] tensors). The forward pass is in forward.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/io.h"

namespace kvq::calib {

enum class ModelArch {
  kLlama,  // LlamaForCausalLM: pre-norm RMSNorm, GQA, rotate-half RoPE, SwiGLU
  kQwen3,  // Qwen3ForCausalLM: the same plus per-head RMSNorm of q and k before RoPE
};
const char* ModelArchName(ModelArch arch);  // "llama", "qwen3"

// The config.json fields the forward uses.
struct ModelConfig {
  ModelArch arch = ModelArch::kLlama;
  int num_layers = 0;     // num_hidden_layers
  int hidden = 0;         // hidden_size D
  int num_q_heads = 0;    // num_attention_heads Hq
  int num_kv_heads = 0;   // num_key_value_heads Hkv (default Hq)
  int head_dim = 0;       // head_dim d (default D / Hq), even
  int intermediate = 0;   // intermediate_size I
  int vocab = 0;          // vocab_size V
  int max_positions = 0;  // max_position_embeddings: the longest window the forward accepts
  double rms_eps = 0.0;   // rms_norm_eps
  double rope_theta = 0.0;  // rope_theta (top level, or rope_parameters.rope_theta)
  bool tied = true;       // tie_word_embeddings: the head is embed_tokens
  int bos = -1, eos = -1;  // bos_token_id / eos_token_id, -1 when absent

  int group_size() const { return num_q_heads / num_kv_heads; }
  int q_width() const { return num_q_heads * head_dim; }    // Hq·d
  int kv_width() const { return num_kv_heads * head_dim; }  // Hkv·d
};

// Parses config.json text. Throws kvq::Error naming `where` and the key: kMalformedFile for
// text that is not a JSON object or a field of the wrong type; kInvalidArgument for a missing
// required field, a model_type other than llama/qwen3, hidden_act other than silu, attention or
// MLP biases, a rope type other than default, sliding-window attention, non-positive sizes,
// Hq not a multiple of Hkv, or an odd head_dim.
ModelConfig ParseModelConfig(const std::string& json_text, const std::string& where);

// One decoder layer, matrices dequantized to fp32 and stored transposed ([in, out] row-major:
// the forward computes x·W with x [rows, in]). q, k, v are fused column-wise ([D, (Hq + 2·Hkv)·d]:
// q | k | v), and so are gate and up ([D, 2·I]: gate | up).
struct LayerWeights {
  std::vector<float> input_norm;  // [D]
  std::vector<float> post_norm;   // [D]
  std::vector<float> q_norm;      // [d] (qwen3), else empty
  std::vector<float> k_norm;      // [d] (qwen3), else empty
  std::vector<float> qkv;         // [D, (Hq + 2·Hkv)·d]
  std::vector<float> o;           // [Hq·d, D]
  std::vector<float> gate_up;     // [D, 2·I]
  std::vector<float> down;        // [I, D]
};

struct Model {
  std::string where;   // the folder (or file) it came from, for messages
  ModelConfig config;
  std::map<std::string, std::string> metadata;  // model.safetensors' __metadata__
  std::vector<float> embed;       // [V, D] (lookup)
  std::vector<float> head;        // [D, V]: embedᵀ when tied, else lm_headᵀ
  std::vector<float> final_norm;  // [D]
  std::vector<LayerWeights> layers;
  // RoPE (HF default rope, rotate-half): inv_freq[i] = 1 / θ^(2i/d) in fp32 and, for every
  // position p < rope_positions, angle = fp32(p · inv_freq[i]); cos/sin [rope_positions, d/2]
  // are fp32 of the double-precision cos/sin of that angle. rope_positions ≤ max_positions is
  // what the loader was asked for: the forward takes windows of at most that many tokens.
  int64_t rope_positions = 0;
  std::vector<float> rope_cos, rope_sin;
};

// Builds a model from parsed parts. Every tensor the config implies must be present with its
// shape (kMalformedFile naming the tensor and both shapes), int8 matrices need their BF16
// `_scale` [out]; no other tensor may be present (kMalformedFile naming it: e.g. q_norm weights
// with a llama config); every weight, scale and norm value must be finite (kNonFinite naming
// tensor, row and column).
// `positions`: how many positions the RoPE tables cover (clamped to max_position_embeddings;
// 0: all of them): the longest window the caller will run, so a long-context config does not
// cost tables for millions of positions. Layer buffers are allocated as their tensors are
// found, so a config that claims more layers than the file holds fails naming the first missing
// tensor without allocating for the claim.
Model BuildModel(const ModelConfig& config, const Safetensors& weights, const std::string& where,
                 int64_t positions = 0);

// Reads DIR/config.json (ParseModelConfig). Throws kIoError naming the folder when it, its
// config.json or its model.safetensors is missing.
ModelConfig ReadModelConfig(const std::string& dir);

// Reads DIR/config.json and DIR/model.safetensors; `positions` as BuildModel's. Throws what
// ReadModelConfig, ReadSafetensors and BuildModel throw.
Model LoadModel(const std::string& dir, int64_t positions = 0);

// ---- Token windows ----

// One tensor of a tokens file, a selection of its rows, cut to a common length.
struct TokenWindows {
  std::string name;          // tensor name (e.g. heldout_en), the set's label
  std::vector<int> rows;     // the selected row indices of the tensor
  int64_t length = 0;        // tokens per window
  std::vector<int32_t> ids;  // [rows.size(), length]
  const int32_t* window(size_t i) const { return ids.data() + i * static_cast<size_t>(length); }
  size_t count() const { return rows.size(); }
};

// A selection: NAME (every row), NAME:i (one row) or NAME:a-b (rows a..b inclusive). A list
// joins selections with commas: "heldout_en:0-3,heldout_code:0-3"; selections of one tensor
// make one set ("calib:0-1,calib:4-5").
struct WindowSelection {
  std::string name;
  int first = 0, last = -1;  // inclusive; last = -1: to the end
};
// Throws kInvalidArgument naming the text for an empty entry or a bad range.
std::vector<WindowSelection> ParseWindowSelections(const std::string& text);

// Reads the selected windows of a tokens file, one TokenWindows per tensor named: every named
// tensor must be I32 [n, T] (kMalformedFile naming it otherwise or when missing, listing the
// tensors present); rows must exist and be selected once (kInvalidArgument naming the row); `length` > 0 cuts every window to its first `length`
// tokens (kInvalidArgument when longer than T); 0 keeps T. Every id must lie in [0, vocab)
// (kInvalidArgument naming tensor, row, position and id).
std::vector<TokenWindows> ReadTokenWindows(const std::string& path,
                                           const std::vector<WindowSelection>& selections,
                                           int64_t length, int vocab);

// DIR/tokens.safetensors if it exists, else the tokens file of the reference model whose
// folder the README names for models without their own (tiny-qwen3-b uses tiny-llama-a's):
// ../tiny-llama-a/tokens.safetensors. Throws kIoError when neither exists.
std::string DefaultTokensPath(const std::string& model_dir);

}  // namespace kvq::calib
