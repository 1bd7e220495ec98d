// Activation captures: per layer the post-RoPE queries, keys and values of one token sequence,
// as the KV cache sees them (spec/formats.md §4). One safetensors file per capture.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/tensor.h"

namespace kvq::calib {

inline constexpr const char* kActivationsFormat = "kvq-activations";
inline constexpr int kActivationsVersion = 1;

struct ActivationsInfo {
  std::string source;        // where the capture came from ("kvq synth seed=7", a model name)
  int num_layers = 0;        // L
  int num_q_heads = 0;       // Hq, a multiple of Hkv
  int num_kv_heads = 0;      // Hkv
  int head_dim = 0;          // d: 64, 128 or 256
  double rope_base = 0.0;    // RoPE base the capture used (informational, > 0)
  int64_t tokens = 0;        // T
  int64_t calib_tokens = 0;  // the first calib_tokens tokens calibrate; the rest are held out

  int group_size() const { return num_q_heads / num_kv_heads; }  // query heads per KV head
};

// One layer: row-major fp32 (exact conversions of the stored BF16/F16/F32 values).
struct LayerActivations {
  std::vector<float> q;  // [T, Hq, d]
  std::vector<float> k;  // [T, Hkv, d]
  std::vector<float> v;  // [T, Hkv, d]
};

struct Activations {
  ActivationsInfo info;
  std::vector<LayerActivations> layers;  // L entries

  // Element accessors (no bounds checks: call Validate first).
  const float* q(int layer, int64_t token, int head) const {
    return layers[layer].q.data() + (token * info.num_q_heads + head) * info.head_dim;
  }
  const float* k(int layer, int64_t token, int kv_head) const {
    return layers[layer].k.data() + (token * info.num_kv_heads + kv_head) * info.head_dim;
  }
  const float* v(int layer, int64_t token, int kv_head) const {
    return layers[layer].v.data() + (token * info.num_kv_heads + kv_head) * info.head_dim;
  }
};

// Throws kvq::Error unless: L ≥ 1, Hkv ≥ 1, Hq a multiple of Hkv, d supported (64/128/256),
// rope_base > 0 and finite, 1 ≤ calib_tokens ≤ T, every layer holds vectors of exactly
// T·Hq·d and T·Hkv·d values (kShapeMismatch), and every value is finite (kNonFinite naming
// layer, tensor, token, head and channel).
void ValidateActivations(const Activations& acts);

// Reads and validates a capture from a parsed safetensors file. Accepts BF16, F16 or F32
// tensors. Rejects (kMalformedFile) a wrong or missing `format`, an unknown `version`, missing
// or unparsable metadata, a missing layer tensor (naming it), tensors beyond layer L−1, a tensor
// not rank 3 or whose shape disagrees with the metadata or with layer 0 (kShapeMismatch), and
// everything ValidateActivations rejects.
Activations ActivationsFromSafetensors(const Safetensors& file);
Activations ReadActivations(const std::string& path);

// Validates, then stores every tensor as `storage` (kBF16, kF16 or kF32; conversions round to
// nearest even) with the metadata of spec/formats.md §4.
Safetensors ActivationsToSafetensors(const Activations& acts, DType storage);
void WriteActivations(const std::string& path, const Activations& acts,
                      DType storage = DType::kBF16);

}  // namespace kvq::calib
