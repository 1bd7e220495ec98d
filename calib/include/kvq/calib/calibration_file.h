// Calibration artifacts (spec/formats.md §5): per layer and KV head the key and value rotations
// R, their eigenbases U and eigenvalues, and the clip ratios, in one safetensors file.
#pragma once

#include <string>
#include <vector>

#include "kvq/common/io.h"

namespace kvq::calib {

inline constexpr const char* kCalibrationFormat = "kvq-calibration";
inline constexpr int kCalibrationFormatVersion = 1;

struct CalibrationInfo {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 128;        // d: 64, 128 or 256
  int group = 64;            // G the clip was selected for
  int bits = 2;              // b the clip was selected for
  int sink = 64;             // S0 (BF16 sink tokens; not quantized, so not in the clip rows)
  int recent = 256;          // W
  std::string scheme = "oscar";
  std::string rotation = "oscar";           // how R was built from U (rotation recipes)
  std::string granularity = "kv_head";      // kv_head | layer
  std::string value_target = "attn_output"; // attn_output | key_weighted | raw
  std::string source;                       // the activation file calibrated on
};

// One layer; every array row-major fp32.
struct LayerCalibration {
  std::vector<float> k_rotation, v_rotation;        // [Hkv, d, d]  R (x~ = x·R)
  std::vector<float> k_basis, v_basis;              // [Hkv, d, d]  U, columns = eigenvectors
  std::vector<float> k_eigenvalues, v_eigenvalues;  // [Hkv, d]     descending
  std::vector<float> k_clip, v_clip;                // [Hkv]        ρ in (0, 1]

  const float* k_rotation_of(int kv_head, int d) const {
    return k_rotation.data() + static_cast<size_t>(kv_head) * d * d;
  }
  const float* v_rotation_of(int kv_head, int d) const {
    return v_rotation.data() + static_cast<size_t>(kv_head) * d * d;
  }
};

struct Calibration {
  CalibrationInfo info;
  std::vector<LayerCalibration> layers;
};

// Throws kvq::Error unless: L ≥ 1, Hkv ≥ 1, d/G/bits supported (WriteParams rules), sink ≥ 0,
// recent ≥ 1, granularity and value_target from their lists, every array of its exact size
// (kShapeMismatch naming layer and tensor), every value finite (kNonFinite), every rotation and
// basis orthogonal (max |MᵀM − I| ≤ 1e-4 in fp64; kInvalidArgument naming layer, tensor, head
// and the deviation), eigenvalues descending, clip ratios in (0, 1], and for per-layer
// granularity the same R, U, eigenvalues and clip on every KV head.
void ValidateCalibration(const Calibration& cal);

// Parses (validating as above plus: format and format_version, every metadata key, every
// tensor of layers 0..L−1 present with the right dtype F32 and shape, no stray tensors).
Calibration CalibrationFromSafetensors(const Safetensors& file);
Calibration ReadCalibration(const std::string& path);
Safetensors CalibrationToSafetensors(const Calibration& cal);  // validates first
void WriteCalibration(const std::string& path, const Calibration& cal);

}  // namespace kvq::calib
