#include "kvq/calib/codebook_calibration.h"

#include <algorithm>
#include <cmath>

#include "kvq/calib/parallel.h"
#include "kvq/calib/random.h"
#include "kvq/calib/rotation.h"
#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/params.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;

// 4^(−w) for w in 0..8, exact in fp64.
double QuarterPower(int w) { return std::ldexp(1.0, -2 * w); }

bool IsSupportedHeadDimension(int d) { return d == 64 || d == 128 || d == 256; }

// The row limits of one side: the maxima of the segment count and of Σ_s B_s over its heads.
void RowLimits(const std::vector<uint8_t>& widths, int d, int* segments, int* code_bytes) {
  const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
  *segments = std::max(*segments, layout.count);
  *code_bytes = std::max(*code_bytes, layout.code_bytes);
}

}  // namespace

std::vector<double> BlockEnergies(const Activations& acts, int layer, int kv_head,
                                  int64_t tokens) {
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", info.num_layers, ")");
  KVQ_CHECK(kv_head >= 0 && kv_head < info.num_kv_heads, kInvalidArgument, "kv head ", kv_head,
            " out of range [0, ", info.num_kv_heads, ")");
  KVQ_CHECK(tokens >= 1 && tokens <= info.calib_tokens, kInvalidArgument, "energies over ",
            tokens, " tokens: calibration uses 1 to calib_tokens = ", info.calib_tokens,
            " (held-out tokens never calibrate)");
  const int d = info.head_dim;
  const int blocks = d / 2;
  const int group = info.group_size();
  std::vector<double> key_sum(blocks, 0.0), query_sum(blocks, 0.0);
  auto add = [&](const float* x, std::vector<double>& sum) {
    for (int i = 0; i < blocks; ++i) {
      const double a = x[i], b = x[i + blocks];
      sum[i] += a * a + b * b;
    }
  };
  for (int64_t t = 0; t < tokens; ++t) {
    add(acts.k(layer, t, kv_head), key_sum);
    for (int g = 0; g < group; ++g) add(acts.q(layer, t, kv_head * group + g), query_sum);
  }
  std::vector<double> scores(blocks);
  const double key_count = static_cast<double>(tokens);
  const double query_count = static_cast<double>(tokens) * group;
  for (int i = 0; i < blocks; ++i) {
    scores[i] = (query_sum[i] / query_count + key_sum[i] / key_count) / 2.0;
  }
  return scores;
}

int64_t WidthBudget(int blocks, double avg_bits) {
  KVQ_CHECK(blocks >= 1, kInvalidArgument, "width budget of ", blocks,
            " blocks: at least 1 block");
  KVQ_CHECK(std::isfinite(avg_bits) && avg_bits >= 1.0 && avg_bits <= kCodebookMaxWidth,
            kInvalidArgument, "average width ", avg_bits, " is not in [1, ",
            kCodebookMaxWidth, "] (block widths are 1..8)");
  return static_cast<int64_t>(std::floor(static_cast<double>(blocks) * avg_bits));
}

std::vector<uint8_t> GreedyWidths(const std::vector<double>& scores, int64_t budget) {
  const int64_t blocks = static_cast<int64_t>(scores.size());
  KVQ_CHECK(blocks >= 1, kInvalidArgument, "greedy widths of no blocks");
  for (size_t i = 0; i < scores.size(); ++i) {
    KVQ_CHECK(std::isfinite(scores[i]) && scores[i] >= 0.0, kInvalidArgument, "block ", i,
              " has score ", scores[i], " (scores are finite and >= 0)");
  }
  KVQ_CHECK(budget >= blocks && budget <= kCodebookMaxWidth * blocks, kInvalidArgument,
            "width budget ", budget, " is not in [", blocks, ", ", kCodebookMaxWidth * blocks,
            "] for ", blocks, " blocks of width 1..8");
  std::vector<uint8_t> widths(scores.size(), 1);
  for (int64_t spent = blocks; spent < budget; ++spent) {
    int best = -1;
    double best_priority = 0.0;
    for (int64_t i = 0; i < blocks; ++i) {
      if (widths[i] >= kCodebookMaxWidth) continue;
      const double priority = scores[i] * QuarterPower(widths[i]);
      if (best < 0 || priority > best_priority) {
        best = static_cast<int>(i);
        best_priority = priority;
      }
    }
    ++widths[best];  // best ≥ 0: budget ≤ 8·blocks leaves a block below 8 while spent < budget
  }
  return widths;
}

double AllocationObjective(const std::vector<double>& scores,
                           const std::vector<uint8_t>& widths) {
  KVQ_CHECK(scores.size() == widths.size(), kShapeMismatch, "objective of ", widths.size(),
            " widths over ", scores.size(), " scores");
  double sum = 0.0;
  for (size_t i = 0; i < scores.size(); ++i) sum += scores[i] * QuarterPower(widths[i]);
  return sum;
}

MatrixXd BlockGtqKeyRotation(int head_dim, const std::vector<uint8_t>& widths, uint64_t seed,
                             int layer, int kv_head, int rotation_threshold) {
  KVQ_CHECK(IsSupportedHeadDimension(head_dim), kInvalidArgument, "head_dim ", head_dim,
            " is not supported (64, 128 or 256)");
  const int blocks = head_dim / 2;
  KVQ_CHECK(static_cast<int>(widths.size()) == blocks, kShapeMismatch, widths.size(),
            " block widths for head_dim ", head_dim, " (expected ", blocks, ")");
  for (int i = 0; i < blocks; ++i) {
    KVQ_CHECK(widths[i] >= 1 && widths[i] <= kCodebookMaxWidth, kInvalidArgument, "block ", i,
              " has width ", +widths[i], " (widths are 1..8)");
  }
  KVQ_CHECK(rotation_threshold >= 1 && rotation_threshold <= kCodebookMaxWidth + 1,
            kInvalidArgument, "rotation threshold ", rotation_threshold,
            " is not in 1..9 (segments of width >= it are rotated; 9 rotates none)");
  // R = P·diag(A_w): row i_k (and i_k + L) of R is row o_s + 2k (and o_s + 2k + 1) of diag(A_w).
  MatrixXd rotation = MatrixXd::Zero(head_dim, head_dim);
  const CodebookLayout layout = CodebookLayoutOf(head_dim, widths.data());
  for (int s = 0; s < layout.count; ++s) {
    const CodebookSegment& segment = layout.segment[s];
    const int m = segment.values;
    const MatrixXd a =
        segment.width >= rotation_threshold
            ? RandomOrthogonal(m, DeriveSeed(seed, {static_cast<uint64_t>(layer),
                                                    static_cast<uint64_t>(kv_head), 0,
                                                    static_cast<uint64_t>(segment.width)}))
            : MatrixXd::Identity(m, m);
    int k = 0;
    for (int i = 0; i < blocks; ++i) {
      if (widths[i] != segment.width) continue;
      rotation.block(i, segment.offset, 1, m) = a.row(2 * k);
      rotation.block(i + blocks, segment.offset, 1, m) = a.row(2 * k + 1);
      ++k;
    }
  }
  return rotation;
}

MatrixXd TurboQuantRotation(int head_dim, uint64_t seed, int layer, int kv_head, int side) {
  KVQ_CHECK(IsSupportedHeadDimension(head_dim), kInvalidArgument, "head_dim ", head_dim,
            " is not supported (64, 128 or 256)");
  KVQ_CHECK(side == 0 || side == 1, kInvalidArgument, "side ", side, " (0: K, 1: V)");
  return RandomOrthogonal(head_dim, DeriveSeed(seed, {static_cast<uint64_t>(layer),
                                                      static_cast<uint64_t>(kv_head),
                                                      static_cast<uint64_t>(side)}));
}

Calibration CalibrateCodebook(const Activations& acts, const CodebookCalibrationOptions& o,
                              AllocationStability* stability) {
  ValidateActivations(acts);
  KVQ_CHECK(o.scheme != "tq_mse_fwht", kInvalidArgument,
            "calibration scheme 'tq_mse_fwht' has nothing to calibrate: its rotation is the "
            "FWHT and its rows are uniform (no file; use --scheme tq_mse for seeded Haar "
            "rotations, blockgtq for allocated widths)");
  KVQ_CHECK(o.scheme == "tq_mse" || o.scheme == "blockgtq", kInvalidArgument,
            "codebook calibration scheme '", o.scheme, "' (tq_mse or blockgtq)");
  const bool allocates = o.scheme == "blockgtq";
  const ActivationsInfo& info = acts.info;
  const int d = info.head_dim;
  const int blocks = d / 2;
  const int64_t budget = WidthBudget(blocks, o.k_avg_bits);  // names a b̄ outside [1, 8]
  KVQ_CHECK(allocates || o.k_avg_bits == std::floor(o.k_avg_bits), kInvalidArgument,
            "K width ", o.k_avg_bits, " of scheme 'tq_mse' is not an integer 1..8 (a "
            "fractional average needs blockgtq's allocation)");
  const int k_bits = static_cast<int>(std::ceil(o.k_avg_bits));
  KVQ_CHECK(o.v_bits >= 0 && o.v_bits <= kCodebookMaxWidth, kInvalidArgument, "V width ",
            o.v_bits, " is not in 1..8 (0: the K width rounded up)");
  const int v_bits = o.v_bits != 0 ? o.v_bits : k_bits;
  KVQ_CHECK(o.rotation_threshold >= 1 && o.rotation_threshold <= kCodebookMaxWidth + 1,
            kInvalidArgument, "rotation threshold ", o.rotation_threshold,
            " is not in 1..9 (segments of width >= it are rotated; 9 rotates none)");
  KVQ_CHECK(o.threads >= 1, kInvalidArgument, "threads ", o.threads, " must be >= 1");
  KVQ_CHECK(o.sink >= 0, kInvalidArgument, "sink ", o.sink, " must be >= 0");
  KVQ_CHECK(o.recent >= 1, kInvalidArgument, "recent ", o.recent, " must be >= 1");
  std::vector<int64_t> prefixes = o.stability_prefixes;
  if (prefixes.empty()) {
    for (int64_t divisor : {8, 4, 2}) {
      if (info.calib_tokens / divisor >= 1) prefixes.push_back(info.calib_tokens / divisor);
    }
  }
  std::sort(prefixes.begin(), prefixes.end());
  prefixes.erase(std::unique(prefixes.begin(), prefixes.end()), prefixes.end());
  for (int64_t p : prefixes) {
    KVQ_CHECK(p >= 1 && p < info.calib_tokens, kInvalidArgument, "stability prefix of ", p,
              " tokens is not in [1, calib_tokens = ", info.calib_tokens, ")");
  }

  const int layers = info.num_layers;
  const int hkv = info.num_kv_heads;
  Calibration cal;
  CalibrationInfo& out = cal.info;
  out.num_layers = layers;
  out.num_kv_heads = hkv;
  out.head_dim = d;
  out.group = d;
  out.bits = k_bits;
  out.v_bits = v_bits != k_bits ? v_bits : 0;
  out.sink = o.sink;
  out.recent = o.recent;
  out.scheme = o.scheme;
  out.rotation.clear();
  out.value_target.clear();
  out.granularity = "kv_head";
  out.source = o.source;
  CodebookCalibrationInfo& cb = out.codebook;
  cb.density = CodebookDensityName(o.density);
  cb.k_avg_bits = allocates ? o.k_avg_bits : 0.0;
  cb.rotation_threshold = allocates ? o.rotation_threshold : 1;
  cb.seed = o.seed;
  cal.layers.resize(layers);
  if (stability) {
    stability->prefixes = allocates ? prefixes : std::vector<int64_t>();
    const size_t n = stability->prefixes.size();
    stability->hamming.assign(n, std::vector<std::vector<int>>(layers, std::vector<int>(hkv)));
    stability->regret.assign(n,
                             std::vector<std::vector<double>>(layers, std::vector<double>(hkv)));
  }
  const size_t matrix = static_cast<size_t>(d) * d;
  for (LayerCalibration& layer : cal.layers) {
    layer.key.rotation.resize(hkv * matrix);
    layer.value.rotation.resize(hkv * matrix);
    if (allocates) {
      layer.key.widths.resize(static_cast<size_t>(hkv) * blocks);
      layer.k_scores.resize(static_cast<size_t>(hkv) * blocks);
    }
  }
  // One unit per (layer, KV head): its own seeds, so the bits do not depend on the threads.
  ParallelItems(layers * hkv, o.threads, [&](int unit) {
    const int l = unit / hkv;
    const int h = unit % hkv;
    LayerCalibration& layer = cal.layers[l];
    auto store = [&](const MatrixXd& r, std::vector<float>& rotation) {
      const std::vector<float> f = ToRowMajorF32(r);
      std::copy(f.begin(), f.end(), rotation.begin() + h * matrix);
    };
    store(TurboQuantRotation(d, o.seed, l, h, 1), layer.value.rotation);
    if (!allocates) {
      store(TurboQuantRotation(d, o.seed, l, h, 0), layer.key.rotation);
      return;
    }
    const std::vector<double> scores = BlockEnergies(acts, l, h, info.calib_tokens);
    const std::vector<uint8_t> widths = GreedyWidths(scores, budget);
    store(BlockGtqKeyRotation(d, widths, o.seed, l, h, o.rotation_threshold),
          layer.key.rotation);
    std::copy(widths.begin(), widths.end(), layer.key.widths.begin() + h * blocks);
    for (int i = 0; i < blocks; ++i) layer.k_scores[h * blocks + i] = static_cast<float>(scores[i]);
    if (!stability) return;
    const double full = AllocationObjective(scores, widths);
    for (size_t p = 0; p < stability->prefixes.size(); ++p) {
      const std::vector<uint8_t> early =
          GreedyWidths(BlockEnergies(acts, l, h, stability->prefixes[p]), budget);
      int distance = 0;
      for (int i = 0; i < blocks; ++i) distance += early[i] != widths[i];
      stability->hamming[p][l][h] = distance;
      stability->regret[p][l][h] =
          full > 0.0 ? AllocationObjective(scores, early) / full - 1.0 : 0.0;
    }
  });
  // The row limits: maxima over the side's (layer, KV head) pairs; a side without widths is
  // the uniform row (one segment, code_bytes 0: d·b/8).
  cb.k_segments = 1;
  cb.k_code_bytes = 0;
  cb.v_segments = 1;
  cb.v_code_bytes = 0;
  if (allocates) {
    for (const LayerCalibration& layer : cal.layers) {
      for (int h = 0; h < hkv; ++h) {
        const std::vector<uint8_t> head(layer.key.widths.begin() + h * blocks,
                                        layer.key.widths.begin() + (h + 1) * blocks);
        RowLimits(head, d, &cb.k_segments, &cb.k_code_bytes);
      }
    }
  }
  ValidateCalibration(cal);
  return cal;
}

}  // namespace kvq::calib
