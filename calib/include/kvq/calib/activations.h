// Activation captures: per layer the post-RoPE queries, keys and values of one token sequence,
// as the KV cache sees them (spec/formats.md §4). One safetensors file per capture.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
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
  // 0: the capture is one token sequence. Otherwise it is tokens / segment_tokens independent
  // sequences (windows) of segment_tokens tokens each, laid end to end: attention never
  // crosses a segment boundary and each segment starts at RoPE position 0 (`kvq capture` of
  // several windows). tokens and calib_tokens are multiples of it.
  int64_t segment_tokens = 0;

  int group_size() const { return num_q_heads / num_kv_heads; }  // query heads per KV head
  // First token of the sequence that token t belongs to (0 for an unsegmented capture).
  int64_t SegmentStart(int64_t t) const {
    return segment_tokens > 0 ? t - t % segment_tokens : 0;
  }
};

// The token ranges [begin, end) of [0, tokens) that lie at least `skip` tokens after the start
// of their sequence, in order: one range for an unsegmented capture ([skip, tokens) when
// skip < tokens), one per segment otherwise. What the clip search uses as calibration rows
// (each sequence's first S0 tokens stay in the BF16 sink). tokens ≤ info.tokens, skip ≥ 0.
std::vector<std::pair<int64_t, int64_t>> RowsAfterSink(const ActivationsInfo& info,
                                                       int64_t tokens, int64_t skip);

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
// rope_base > 0 and finite, 1 ≤ calib_tokens ≤ T, segment_tokens ≥ 0 dividing T and
// calib_tokens (kInvalidArgument naming the three), every layer holds vectors of exactly
// T·Hq·d and T·Hkv·d values (kShapeMismatch), and every value is finite (kNonFinite naming
// layer, tensor, token, head and channel).
void ValidateActivations(const Activations& acts);

// Reads and validates a capture from a parsed safetensors file. Accepts BF16, F16 or F32
// tensors; the metadata `segment_tokens` is optional (absent: one sequence). Rejects (kMalformedFile) a wrong or missing `format`, an unknown `version`, missing
// or unparsable metadata, a missing layer tensor (naming it), tensors beyond layer L−1, a tensor
// not rank 3 or whose shape disagrees with the metadata or with layer 0 (kShapeMismatch), and
// everything ValidateActivations rejects.
Activations ActivationsFromSafetensors(const Safetensors& file);
Activations ReadActivations(const std::string& path);

// Validates, then stores every tensor as `storage` (kBF16, kF16 or kF32; conversions round to
// nearest even) with the metadata of spec/formats.md §4 (`segment_tokens` only when > 0, so
// one-sequence captures keep their bytes).
Safetensors ActivationsToSafetensors(const Activations& acts, DType storage);
void WriteActivations(const std::string& path, const Activations& acts,
                      DType storage = DType::kBF16);

}  // namespace kvq::calib
