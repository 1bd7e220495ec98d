// Clip selection against a brute-force evaluation through the dense write path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kvq/calib/clip_search.h"
#include "kvq/calib/covariance.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/cpu_ref/write_path.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;

struct Fixture {
  Activations acts;
  std::vector<float> rotation[2];  // per KV head
  std::vector<float> rows[2];      // tokens [8, calib) of keys, per KV head
  MatrixXd target[2];
};

const Fixture& Data() {
  static const Fixture* f = [] {
    auto* fx = new Fixture;
    fx->acts = Synthesize(testing::SynthShape(1, 4, 2, 128, 400, 21));
    for (int h = 0; h < 2; ++h) {
      fx->target[h] = QueryCovariance(fx->acts, 0, h, 200);
      fx->rotation[h] = ToRowMajorF32(OscarRotation(SortedEigenBasis(fx->target[h]).vectors));
      for (int64_t t = 8; t < 200; ++t) {
        const float* k = fx->acts.k(0, t, h);
        fx->rows[h].insert(fx->rows[h].end(), k, k + 128);
      }
    }
    return fx;
  }();
  return *f;
}

// Objective by brute force: the full dense write path (rotation inside QuantizeRows) at each ρ,
// and e·(Rᵀ C R)·eᵀ summed row by row with plain loops.
std::vector<double> BruteForce(const cpu::Backend& backend, const WriteParams& base,
                               const std::vector<double>& grid) {
  const Fixture& f = Data();
  std::vector<double> out;
  for (double rho : grid) {
    double sum = 0;
    size_t rows = 0;
    for (int h = 0; h < 2; ++h) {
      WriteParams p = base;
      p.rotation = RotationKind::kDense;
      p.clip = static_cast<float>(rho);
      const size_t n = f.rows[h].size() / 128;
      const cpu::QuantizedRows q = cpu::QuantizeRows(backend, p, f.rotation[h].data(), f.rows[h].data(), n);
      const MatrixXd metric = RotatedMetric(f.rotation[h].data(), f.target[h]);
      for (size_t r = 0; r < n; ++r) {
        double e[128];
        for (int c = 0; c < 128; ++c) {
          e[c] = static_cast<double>(q.rotated[r * 128 + c]) - q.dequantized[r * 128 + c];
        }
        for (int i = 0; i < 128; ++i) {
          for (int j = 0; j < 128; ++j) sum += e[i] * metric(i, j) * e[j];
        }
      }
      rows += n;
    }
    out.push_back(sum / rows);
  }
  return out;
}

TEST(ClipSearch, PicksTheGridPointMinimisingTheBruteForceObjective) {
  const Fixture& f = Data();
  const std::vector<double> grid = DefaultClipGrid();
  ASSERT_EQ(grid.size(), 11u);
  EXPECT_EQ(grid.front(), 0.80);
  EXPECT_EQ(grid.back(), 1.00);
  for (int bits : {2, 4}) {
    for (int group : {32, 64, 128}) {
      WriteParams p;
      p.group = group;
      p.bits = bits;
      std::vector<ClipRows> heads;
      for (int h = 0; h < 2; ++h) {
        heads.push_back({f.rotation[h].data(), f.rows[h].data(), f.rows[h].size() / 128,
                         RotatedMetric(f.rotation[h].data(), f.target[h])});
      }
      for (const cpu::Backend* backend : {&cpu::ScalarBackend(), &cpu::BestBackend()}) {
        const std::vector<double> fast = ClipObjectives(*backend, p, heads, grid);
        const std::vector<double> brute = BruteForce(*backend, p, grid);
        size_t brute_best = 0;
        for (size_t i = 0; i < grid.size(); ++i) {
          EXPECT_NEAR(fast[i], brute[i], 1e-9 * brute[i])
              << "b " << bits << " G " << group << " rho " << grid[i] << " " << backend->name;
          if (brute[i] < brute[brute_best]) brute_best = i;
        }
        EXPECT_EQ(ArgMinObjective(fast), brute_best) << "b " << bits << " G " << group;
        if (bits == 2 && group == 64 && backend == &cpu::BestBackend()) {
          std::printf("[ clip     ] INT2 G=64 objective:");
          for (size_t i = 0; i < grid.size(); ++i) std::printf(" %.2f:%.4g", grid[i], fast[i]);
          std::printf("  -> %.2f\n", grid[brute_best]);
        }
      }
    }
  }
}

TEST(ClipSearch, InteriorOptimumOnOutlierHeavyRows) {
  // INT2 with outliers: some clipping beats none, and clipping everything to the 80th
  // percentile is not free either, so the objective is not monotone over the grid.
  const Fixture& f = Data();
  WriteParams p;
  std::vector<ClipRows> heads = {{f.rotation[0].data(), f.rows[0].data(), f.rows[0].size() / 128,
                                  RotatedMetric(f.rotation[0].data(), f.target[0])}};
  const std::vector<double> objectives = ClipObjectives(cpu::BestBackend(), p, heads, DefaultClipGrid());
  EXPECT_LT(objectives[ArgMinObjective(objectives)], objectives.back());
}

TEST(ClipSearch, TiesGoToTheEarliestEntryAndGridIsValidated) {
  EXPECT_EQ(ArgMinObjective({3, 1, 2, 1}), 1u);
  EXPECT_THROW(ArgMinObjective({}), Error);
  EXPECT_THROW(ValidateClipGrid({}), Error);
  EXPECT_THROW(ValidateClipGrid({0.9, 0.0}), Error);
  EXPECT_THROW(ValidateClipGrid({1.01}), Error);
  EXPECT_THROW(ValidateClipGrid({std::nan("")}), Error);
  EXPECT_NO_THROW(ValidateClipGrid({0.5, 1.0}));
}

}  // namespace
}  // namespace kvq::calib
