// Clip-ratio selection (shared/DESIGN.md "Calibration"): per layer, ρ from a grid minimising the
// target-weighted quantization error of the calibration rows through the real write path
// (kvq::cpu, the spec's rotate → clip → quantize → dequantize).
#pragma once

#include <Eigen/Dense>
#include <cstddef>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

// 0.80, 0.82, …, 1.00 (each value the double nearest 0.80 + 0.02·i).
std::vector<double> DefaultClipGrid();

// Throws kvq::Error(kInvalidArgument) unless the grid is non-empty and every ρ is in (0, 1].
void ValidateClipGrid(const std::vector<double>& grid);

// The rows of one KV head and how their errors are weighted.
struct ClipRows {
  const float* rotation = nullptr;  // R [d, d] fp32 row-major (the stored rotation)
  const float* rows = nullptr;      // x [n, d] fp32, original space
  size_t n = 0;
  Eigen::MatrixXd metric;           // Rᵀ·C·R [d, d] (RotatedMetric), C the target
};

// Rᵀ·C·R in fp64 with R the fp32 rotation exactly as stored. R [d, d] row-major.
Eigen::MatrixXd RotatedMetric(const float* rotation, const Eigen::MatrixXd& target);

// For each ρ in `grid`: (1/Σn) Σ_heads Σ_rows eᵀ·M·e, with e = x̃ − x̂ the rotated row minus its
// dequantized value (both in the rotated space) from kvq::cpu::QuantizeRows at clip ρ.
// `params` supplies head_dim, group and bits (rotation fields are ignored: every head's dense
// R is applied once with cpu::Rotate, then each ρ runs QuantizeRows with the identity rotation
// on the rotated rows, which the spec makes bit-identical to the dense write path).
// Throws kvq::Error: empty `heads`, invalid params or grid, null pointers, a metric not d×d,
// and whatever the write path rejects (non-finite rows).
std::vector<double> ClipObjectives(const cpu::Backend& backend, const WriteParams& params,
                                   const std::vector<ClipRows>& heads,
                                   const std::vector<double>& grid);

// Index of the smallest objective; ties go to the earliest grid entry. Non-empty input.
size_t ArgMinObjective(const std::vector<double>& objectives);

}  // namespace kvq::calib
