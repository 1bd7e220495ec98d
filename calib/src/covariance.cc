#include "kvq/calib/covariance.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

void CheckRange(const Activations& acts, int layer, int kv_head, int64_t tokens) {
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " is outside [0, ", info.num_layers, ")");
  KVQ_CHECK(kv_head >= 0 && kv_head < info.num_kv_heads, kInvalidArgument, "kv head ", kv_head,
            " is outside [0, ", info.num_kv_heads, ")");
  KVQ_CHECK(tokens >= 1 && tokens <= info.tokens, kInvalidArgument, "token count ", tokens,
            " is outside [1, ", info.tokens, "]");
}

// Rows [0, tokens) of one head as an fp64 matrix [tokens, d].
MatrixXd GatherQuery(const Activations& acts, int layer, int head, int64_t tokens) {
  const int d = acts.info.head_dim;
  MatrixXd m(tokens, d);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = acts.q(layer, t, head);
    for (int c = 0; c < d; ++c) m(t, c) = row[c];
  }
  return m;
}

MatrixXd GatherKv(const Activations& acts, int layer, int kv_head, bool keys, int64_t tokens) {
  const int d = acts.info.head_dim;
  MatrixXd m(tokens, d);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = keys ? acts.k(layer, t, kv_head) : acts.v(layer, t, kv_head);
    for (int c = 0; c < d; ++c) m(t, c) = row[c];
  }
  return m;
}

// Adds XᵀX (lower triangle via a rank update, then mirrored) to `sum`.
void AddGram(const MatrixXd& x, MatrixXd& sum) {
  MatrixXd gram = MatrixXd::Zero(x.cols(), x.cols());
  gram.selfadjointView<Eigen::Lower>().rankUpdate(x.transpose());
  sum += gram.selfadjointView<Eigen::Lower>();
}

}  // namespace

MatrixXd QueryCovariance(const Activations& acts, int layer, int kv_head, int64_t tokens) {
  CheckRange(acts, layer, kv_head, tokens);
  const int d = acts.info.head_dim;
  const int group = acts.info.group_size();
  MatrixXd sum = MatrixXd::Zero(d, d);
  for (int i = 0; i < group; ++i) AddGram(GatherQuery(acts, layer, kv_head * group + i, tokens), sum);
  return sum / static_cast<double>(group * tokens);
}

MatrixXd RawCovariance(const Activations& acts, int layer, int kv_head, bool keys,
                       int64_t tokens) {
  CheckRange(acts, layer, kv_head, tokens);
  const int d = acts.info.head_dim;
  MatrixXd sum = MatrixXd::Zero(d, d);
  AddGram(GatherKv(acts, layer, kv_head, keys, tokens), sum);
  return sum / static_cast<double>(tokens);
}

AttentionStatistics ComputeAttentionStatistics(const Activations& acts, int layer, int kv_head,
                                               int64_t tokens, bool want_key_weight,
                                               int sink_tokens, int block) {
  CheckRange(acts, layer, kv_head, tokens);
  KVQ_CHECK(block >= 1, kInvalidArgument, "attention block ", block, " must be >= 1");
  KVQ_CHECK(sink_tokens >= 0, kInvalidArgument, "sink token count ", sink_tokens,
            " must be >= 0");
  const ActivationsInfo& info = acts.info;
  const int d = info.head_dim;
  const int group = info.group_size();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const MatrixXd keys = GatherKv(acts, layer, kv_head, true, tokens);
  const MatrixXd values = GatherKv(acts, layer, kv_head, false, tokens);

  AttentionStatistics stats;
  MatrixXd output_sum = MatrixXd::Zero(d, d);
  if (want_key_weight) stats.key_weight = VectorXd::Zero(tokens);
  double entropy_sum = 0.0;
  double sink_sum = 0.0;

  for (int i = 0; i < group; ++i) {
    const MatrixXd queries = GatherQuery(acts, layer, kv_head * group + i, tokens);
    VectorXd log_sum_exp(tokens);
    for (int64_t q0 = 0; q0 < tokens; q0 += block) {
      const int64_t rows = std::min<int64_t>(block, tokens - q0);
      const int64_t first_key = info.SegmentStart(q0) / block * block;
      VectorXd running_max = VectorXd::Constant(rows, neg_inf);
      VectorXd running_sum = VectorXd::Zero(rows);
      VectorXd running_logit_sum = VectorXd::Zero(rows);  // Σ e^{l−m}·l, for the entropy
      VectorXd running_sink = VectorXd::Zero(rows);       // Σ_{s<sink} e^{l−m}
      MatrixXd accumulator = MatrixXd::Zero(rows, d);
      // Key blocks up to the causal diagonal (key s ≤ query t) from the block holding the
      // first row's sequence start; keys before a row's own sequence start (a segmented
      // capture) are masked like future ones. A row's running max is finite from the first
      // block holding one of its keys on.
      for (int64_t k0 = first_key; k0 < q0 + rows; k0 += block) {
        const int64_t cols = std::min<int64_t>(block, tokens - k0);
        MatrixXd logits = (queries.middleRows(q0, rows) * keys.middleRows(k0, cols).transpose()) * scale;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = q0 + r;
          const int64_t first = std::max<int64_t>(0, info.SegmentStart(t) - k0);
          const int64_t last = std::min<int64_t>(cols, t - k0 + 1);  // keys k0 .. t allowed
          if (last <= first) {  // no key of this block is visible to this query: no update
            logits.row(r).setZero();
            continue;
          }
          for (int64_t c = 0; c < first; ++c) logits(r, c) = neg_inf;
          for (int64_t c = last; c < cols; ++c) logits(r, c) = neg_inf;
          const double block_max = logits.row(r).segment(first, last - first).maxCoeff();
          const double new_max = std::max(running_max(r), block_max);
          const double alpha = std::exp(running_max(r) - new_max);  // exp(−inf) = 0 at start
          double block_sum = 0.0;
          double block_logit_sum = 0.0;
          double block_sink = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            if (c < first || c >= last) {
              logits(r, c) = 0.0;  // now holds the probability weight: masked keys get none
              continue;
            }
            const double logit = logits(r, c);
            const double weight = std::exp(logit - new_max);
            block_sum += weight;
            block_logit_sum += weight * logit;
            if (k0 + c - info.SegmentStart(t) < sink_tokens) block_sink += weight;
            logits(r, c) = weight;
          }
          running_sum(r) = alpha * running_sum(r) + block_sum;
          running_logit_sum(r) = alpha * running_logit_sum(r) + block_logit_sum;
          running_sink(r) = alpha * running_sink(r) + block_sink;
          accumulator.row(r) *= alpha;
          running_max(r) = new_max;
        }
        accumulator.noalias() += logits * values.middleRows(k0, cols);
      }
      for (int64_t r = 0; r < rows; ++r) {
        accumulator.row(r) /= running_sum(r);
        const double lse = running_max(r) + std::log(running_sum(r));
        log_sum_exp(q0 + r) = lse;
        entropy_sum += lse - running_logit_sum(r) / running_sum(r);
        sink_sum += running_sink(r) / running_sum(r);
      }
      AddGram(accumulator, output_sum);
    }
    if (want_key_weight) {
      // Second pass: with each row's log-sum-exp known, S[t, s] = exp(l − lse_t) exactly, and
      // the column sums give the attention mass every key receives.
      for (int64_t q0 = 0; q0 < tokens; q0 += block) {
        const int64_t rows = std::min<int64_t>(block, tokens - q0);
        for (int64_t k0 = info.SegmentStart(q0) / block * block; k0 < q0 + rows; k0 += block) {
          const int64_t cols = std::min<int64_t>(block, tokens - k0);
          const MatrixXd logits =
              (queries.middleRows(q0, rows) * keys.middleRows(k0, cols).transpose()) * scale;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = q0 + r;
            const int64_t first = std::max<int64_t>(0, info.SegmentStart(t) - k0);
            const int64_t last = std::min<int64_t>(cols, t - k0 + 1);
            for (int64_t c = first; c < last; ++c) {
              stats.key_weight(k0 + c) += std::exp(logits(r, c) - log_sum_exp(t));
            }
          }
        }
      }
    }
  }
  const double rows_total = static_cast<double>(group) * static_cast<double>(tokens);
  stats.output_covariance = output_sum / rows_total;
  stats.mean_entropy = entropy_sum / rows_total;
  stats.mean_sink_mass = sink_sum / rows_total;
  return stats;
}

MatrixXd KeyWeightedValueCovariance(const Activations& acts, int layer, int kv_head,
                                    int64_t tokens, const VectorXd& key_weight) {
  CheckRange(acts, layer, kv_head, tokens);
  KVQ_CHECK(key_weight.size() == tokens, kShapeMismatch, "key weights hold ", key_weight.size(),
            " entries, expected ", tokens);
  double total = 0.0;
  for (int64_t s = 0; s < tokens; ++s) {
    KVQ_CHECK(std::isfinite(key_weight(s)) && key_weight(s) >= 0, kInvalidArgument,
              "key weight of token ", s, " = ", key_weight(s), " must be finite and >= 0");
    total += key_weight(s);
  }
  KVQ_CHECK(total > 0, kInvalidArgument, "key weights sum to ", total, ", must be positive");
  MatrixXd weighted = GatherKv(acts, layer, kv_head, false, tokens);
  for (int64_t s = 0; s < tokens; ++s) weighted.row(s) *= std::sqrt(key_weight(s));
  MatrixXd sum = MatrixXd::Zero(acts.info.head_dim, acts.info.head_dim);
  AddGram(weighted, sum);
  return sum / total;
}

}  // namespace kvq::calib
