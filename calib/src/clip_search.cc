#include "kvq/calib/clip_search.h"

#include <cmath>

#include "kvq/common/error.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {

std::vector<double> DefaultClipGrid() {
  std::vector<double> grid;
  for (int i = 0; i <= 10; ++i) grid.push_back((80 + 2 * i) / 100.0);
  return grid;
}

void ValidateClipGrid(const std::vector<double>& grid) {
  KVQ_CHECK(!grid.empty(), kInvalidArgument, "clip grid is empty");
  for (size_t i = 0; i < grid.size(); ++i) {
    KVQ_CHECK(std::isfinite(grid[i]) && grid[i] > 0 && grid[i] <= 1, kInvalidArgument,
              "clip grid entry ", i, " = ", grid[i], " is outside (0, 1]");
  }
}

Eigen::MatrixXd RotatedMetric(const float* rotation, const Eigen::MatrixXd& target) {
  KVQ_CHECK(rotation != nullptr, kInvalidArgument, "rotation is null");
  KVQ_CHECK(target.rows() == target.cols(), kShapeMismatch, "target must be square, got ",
            target.rows(), "x", target.cols());
  const Eigen::Index d = target.rows();
  Eigen::MatrixXd r(d, d);
  for (Eigen::Index i = 0; i < d; ++i) {
    for (Eigen::Index j = 0; j < d; ++j) r(i, j) = rotation[i * d + j];
  }
  Eigen::MatrixXd metric = r.transpose() * target * r;
  return (metric + metric.transpose()) * 0.5;  // exactly symmetric
}

std::vector<double> ClipObjectives(const cpu::Backend& backend, const WriteParams& params,
                                   const std::vector<ClipRows>& heads,
                                   const std::vector<double>& grid) {
  KVQ_CHECK(!heads.empty(), kInvalidArgument, "clip search needs at least one head");
  ValidateClipGrid(grid);
  WriteParams identity = params;
  identity.rotation = RotationKind::kIdentity;
  identity.bitrev = false;
  identity.hadamard_block = 0;
  identity.clip = 1.0f;
  identity.Validate();
  WriteParams dense = identity;
  dense.rotation = RotationKind::kDense;
  const int d = params.head_dim;

  std::vector<double> sums(grid.size(), 0.0);
  size_t total_rows = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    const ClipRows& head = heads[h];
    KVQ_CHECK(head.rotation != nullptr && (head.rows != nullptr || head.n == 0), kInvalidArgument,
              "clip search head ", h, ": null rotation or rows");
    KVQ_CHECK(head.metric.rows() == d && head.metric.cols() == d, kShapeMismatch,
              "clip search head ", h, ": metric is ", head.metric.rows(), "x",
              head.metric.cols(), ", expected ", d, "x", d);
    if (head.n == 0) continue;
    std::vector<float> rotated(head.n * d);
    cpu::Rotate(backend, dense, head.rotation, head.rows, rotated.data(), head.n);
    total_rows += head.n;
    for (size_t g = 0; g < grid.size(); ++g) {
      identity.clip = static_cast<float>(grid[g]);
      const cpu::QuantizedRows q =
          cpu::QuantizeRows(backend, identity, nullptr, rotated.data(), head.n);
      Eigen::MatrixXd error(static_cast<Eigen::Index>(head.n), d);
      for (size_t r = 0; r < head.n; ++r) {
        for (int c = 0; c < d; ++c) {
          error(r, c) = static_cast<double>(q.rotated[r * d + c]) -
                        static_cast<double>(q.dequantized[r * d + c]);
        }
      }
      // Σ_rows e·M·eᵀ = Σ_ij M_ij (EᵀE)_ij with EᵀE from a rank update (lower triangle).
      Eigen::MatrixXd gram = Eigen::MatrixXd::Zero(d, d);
      gram.selfadjointView<Eigen::Lower>().rankUpdate(error.transpose());
      double sum = 0.0;
      for (int i = 0; i < d; ++i) {
        sum += head.metric(i, i) * gram(i, i);
        for (int j = 0; j < i; ++j) sum += 2.0 * head.metric(i, j) * gram(i, j);
      }
      sums[g] += sum;
    }
  }
  KVQ_CHECK(total_rows > 0, kInvalidArgument, "clip search has no rows");
  for (double& s : sums) s /= static_cast<double>(total_rows);
  return sums;
}

size_t ArgMinObjective(const std::vector<double>& objectives) {
  KVQ_CHECK(!objectives.empty(), kInvalidArgument, "no objectives to choose from");
  size_t best = 0;
  for (size_t i = 1; i < objectives.size(); ++i) {
    if (objectives[i] < objectives[best]) best = i;
  }
  return best;
}

}  // namespace kvq::calib
