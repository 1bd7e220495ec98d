#include "kvq/calib/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "kvq/calib/rope_logit.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {
namespace {

using Eigen::MatrixXd;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Indices of the k largest entries of p[0..n), ties to the lower index.
std::vector<size_t> TopIndices(const double* p, size_t n, size_t k) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto before = [p](size_t a, size_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

double ErrorSum::Relative() const {
  if (error == 0.0) return 0.0;
  if (reference == 0.0) return std::numeric_limits<double>::infinity();
  return error / reference;
}

void SoftmaxF64(const double* logits, size_t n, double* p) {
  KVQ_CHECK(n >= 1, kInvalidArgument, "softmax over ", n, " logits");
  double m = logits[0];
  for (size_t i = 1; i < n; ++i) m = std::max(m, logits[i]);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    p[i] = std::exp(logits[i] - m);
    sum += p[i];
  }
  for (size_t i = 0; i < n; ++i) p[i] /= sum;
}

double KlDivergence(const double* p, const double* q, size_t n) {
  KVQ_CHECK(n >= 1, kInvalidArgument, "KL divergence over ", n, " entries");
  double kl = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] == 0.0) continue;
    if (q[i] == 0.0) return std::numeric_limits<double>::infinity();
    kl += p[i] * std::log(p[i] / q[i]);
  }
  // Rounding can leave a tiny negative sum for (nearly) equal distributions; KL ≥ 0.
  return std::max(kl, 0.0);
}

double TopKOverlap(const double* p, const double* q, size_t n, int k) {
  KVQ_CHECK(n >= 1 && k >= 1, kInvalidArgument, "top-k overlap with n = ", n, ", k = ", k);
  const size_t kk = std::min(static_cast<size_t>(k), n);
  const std::vector<size_t> a = TopIndices(p, n, kk);
  const std::vector<size_t> b = TopIndices(q, n, kk);
  std::vector<size_t> common;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
  return static_cast<double>(common.size()) / static_cast<double>(kk);
}

HeldOutHead PrepareHeldOut(const Activations& acts, int layer, int kv_head,
                           const MetricOptions& options) {
  const ActivationsInfo& info = acts.info;
  KVQ_CHECK(layer >= 0 && layer < info.num_layers, kInvalidArgument, "layer ", layer,
            " out of range [0, ", info.num_layers, ")");
  KVQ_CHECK(kv_head >= 0 && kv_head < info.num_kv_heads, kInvalidArgument, "KV head ", kv_head,
            " out of range [0, ", info.num_kv_heads, ")");
  KVQ_CHECK(info.calib_tokens < info.tokens, kInvalidArgument, "no held-out tokens: calib_tokens ",
            info.calib_tokens, " == tokens ", info.tokens);
  KVQ_CHECK(options.query_positions >= 0, kInvalidArgument, "query_positions ",
            options.query_positions, " must be >= 0");
  KVQ_CHECK(options.top_k >= 1, kInvalidArgument, "top_k ", options.top_k, " must be >= 1");
  KVQ_CHECK(options.prefix_tokens >= 0 && options.prefix_tokens <= info.calib_tokens,
            kInvalidArgument, "prefix_tokens ", options.prefix_tokens, " must lie in [0, ",
            info.calib_tokens, "]");

  HeldOutHead h;
  h.layer = layer;
  h.kv_head = kv_head;
  const int d = info.head_dim;
  const int g = info.group_size();
  const int64_t prefix = options.prefix_tokens;
  const int64_t heldout = info.tokens - info.calib_tokens;
  const int64_t t = prefix + heldout;
  h.prefix = prefix;
  h.tokens = t;
  h.group = g;
  h.head_dim = d;
  h.scale = static_cast<double>(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  const int64_t nq = options.query_positions == 0 ? heldout
                                                  : std::min(options.query_positions, heldout);
  // Sequence position i ↔ capture token i (i < prefix) or calib_tokens + i − prefix.
  auto token = [&](int64_t i) { return i < prefix ? i : info.calib_tokens + (i - prefix); };
  h.first_query = t - nq;

  h.keys.resize(static_cast<size_t>(t) * d);
  h.values.resize(static_cast<size_t>(t) * d);
  h.k.resize(t, d);
  h.v.resize(t, d);
  for (int64_t i = 0; i < t; ++i) {
    const float* k = acts.k(layer, token(i), kv_head);
    const float* v = acts.v(layer, token(i), kv_head);
    std::copy(k, k + d, h.keys.begin() + i * d);
    std::copy(v, v + d, h.values.begin() + i * d);
    for (int c = 0; c < d; ++c) {
      h.k(i, c) = RoundToBf16(k[c]);
      h.v(i, c) = RoundToBf16(v[c]);
    }
  }
  h.rope_base = info.rope_base;
  h.rope_positions.resize(static_cast<size_t>(t));
  h.token_queries.resize(static_cast<size_t>(t) * g * d);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t tok = token(i);
    h.rope_positions[i] = static_cast<double>(tok - info.SegmentStart(tok));
    for (int j = 0; j < g; ++j) {
      const float* q = acts.q(layer, tok, kv_head * g + j);
      std::copy(q, q + d, h.token_queries.begin() + (i * g + j) * d);
    }
  }
  h.q.resize(nq * g, d);
  for (int64_t r = 0; r < nq * g; ++r) {
    const float* q =
        acts.q(layer, token(h.position(r)), kv_head * g + static_cast<int>(r % g));
    for (int c = 0; c < d; ++c) h.q(r, c) = q[c];
  }
  h.logits.noalias() = h.scale * (h.k * h.q.transpose());
  h.probs = MatrixXd::Zero(t, nq * g);
  for (int64_t r = 0; r < nq * g; ++r) {
    const size_t n = static_cast<size_t>(h.position(r) + 1);  // causal: keys 0..p
    SoftmaxF64(h.logits.col(r).data(), n, h.probs.col(r).data());
  }
  h.output.noalias() = h.probs.transpose() * h.v;
  return h;
}

HeadMetrics EvaluateHead(const HeldOutHead& data, const LayerScheme& scheme,
                         const cpu::Backend& backend, const MetricOptions& options) {
  const CacheParams& cp = scheme.params;
  const int d = data.head_dim;
  const int64_t t = data.tokens;
  KVQ_CHECK(cp.num_kv_heads == 1 && cp.num_q_heads == data.group && cp.head_dim() == d,
            kShapeMismatch, "scheme has Hkv=", cp.num_kv_heads, ", Hq=", cp.num_q_heads,
            ", d=", cp.head_dim(), " but one KV head of the data has g=", data.group, ", d=", d);

  cpu::PagedKVCache cache(cp, scheme.key, scheme.value, backend);
  const int seq = cache.AddSequence();
  cache.Prefill(seq, data.keys.data(), data.values.data(), static_cast<size_t>(t));

  HeadMetrics m;
  m.bits_per_element = cache.Bytes(seq).bits_per_element();
  const int64_t history = static_cast<int64_t>(cache.HistoryLength(seq));
  const int64_t s0 = history > 0 ? cp.sink : 0;  // first history position
  m.history_tokens = history;

  // Rows as the cache holds them: delta = stored − reference (zero for bf16 rows, which are
  // checked to BE the reference bf16 rows).
  MatrixXd delta_k = MatrixXd::Zero(history, d);
  MatrixXd delta_v = MatrixXd::Zero(history, d);
  for (int64_t i = 0; i < t; ++i) {
    if (!cache.IsBf16Position(seq, static_cast<size_t>(i))) continue;
    const uint16_t* kr = cache.Bf16Row(seq, static_cast<size_t>(i), cpu::KV::kKey);
    const uint16_t* vr = cache.Bf16Row(seq, static_cast<size_t>(i), cpu::KV::kValue);
    for (int c = 0; c < d; ++c) {
      KVQ_CHECK(F32FromBf16(kr[c]) == data.k(i, c) && F32FromBf16(vr[c]) == data.v(i, c),
                kMismatch, "cache bf16 row ", i, " channel ", c, " differs from the held-out row");
    }
  }
  std::vector<float> hist_k_rotated;  // the history's write-path rotation, for tr(E_K)
  std::vector<float> hist_k_tau;
  if (history > 0) {
    for (cpu::KV kv : {cpu::KV::kKey, cpu::KV::kValue}) {
      const WriteParams wp = cache.HeadParams(kv, 0);
      const float* rotation = cache.Rotation(kv, 0);
      const std::vector<float> rotated = cache.DequantizedHistory(seq, 0, kv);
      std::vector<float> original(rotated.size());
      cpu::RotateInverse(backend, wp, rotation, rotated.data(), original.data(),
                         static_cast<size_t>(history));
      MatrixXd& delta = kv == cpu::KV::kKey ? delta_k : delta_v;
      const MatrixXd& ref = kv == cpu::KV::kKey ? data.k : data.v;
      for (int64_t i = 0; i < history; ++i) {
        for (int c = 0; c < d; ++c) {
          delta(i, c) = static_cast<double>(original[i * d + c]) - ref(s0 + i, c);
        }
      }
      if (kv == cpu::KV::kKey) {
        // The write path on the same bf16 rows must give the cache's dequantized bits.
        std::vector<float> rows(static_cast<size_t>(history) * d);
        for (int64_t i = 0; i < history; ++i) {
          for (int c = 0; c < d; ++c) rows[i * d + c] = static_cast<float>(ref(s0 + i, c));
        }
        // (with the head's arrays: a codebook head's widths, as the cache wrote it)
        cpu::QuantizedRows q =
            cpu::QuantizeRows(backend, wp, cache.Heads(kv).Arrays(wp, 0), rows.data(),
                              static_cast<size_t>(history));
        for (size_t e = 0; e < rotated.size(); ++e) {
          KVQ_CHECK(F32Bits(q.dequantized[e]) == F32Bits(rotated[e]), kMismatch, "layer ",
                    data.layer, " KV head ", data.kv_head, ": write path row ", e / d,
                    " channel ", e % d, " dequantizes to ", q.dequantized[e],
                    " but the cache holds ", rotated[e]);
        }
        double residual = 0.0, range = 0.0;
        for (size_t e = 0; e < rotated.size(); ++e) {
          const double err = static_cast<double>(q.rotated[e]) - q.dequantized[e];
          residual += err * err;
        }
        // The quantizer's groups over its input (the clipped row, divided by n^ with a norm):
        // per token and G channels, or per tile and channel (affine_tile). A format whose rows
        // are not clipped records no tau (codebook: one group, the whole rotated row).
        const std::vector<float>& input = wp.norm ? q.normalized : q.rotated;
        const auto clipped = [&](int64_t i, int c) {
          const float x = input[i * d + c];
          if (q.tau.empty()) return static_cast<double>(x);
          const float tau = q.tau[i];
          return static_cast<double>(x > tau ? tau : (x < -tau ? -tau : x));
        };
        double groups = 0.0;
        if (wp.format == Format::kAffineTile) {
          const int tile = wp.tile_tokens();
          for (int64_t t0 = 0; t0 < history; t0 += tile) {
            for (int c = 0; c < d; ++c) {
              double lo = std::numeric_limits<double>::infinity(), hi = -lo;
              for (int64_t i = t0; i < t0 + tile; ++i) {
                lo = std::min(lo, clipped(i, c));
                hi = std::max(hi, clipped(i, c));
              }
              range += hi - lo;
              groups += 1.0;
            }
          }
        } else {
          for (int64_t i = 0; i < history; ++i) {
            for (int gi = 0; gi < wp.num_groups(); ++gi) {
              double lo = std::numeric_limits<double>::infinity(), hi = -lo;
              for (int c = gi * wp.group; c < (gi + 1) * wp.group; ++c) {
                lo = std::min(lo, clipped(i, c));
                hi = std::max(hi, clipped(i, c));
              }
              range += hi - lo;
              groups += 1.0;
            }
          }
        }
        m.tr_ek = residual / static_cast<double>(history);
        m.group_range = range / groups;
      }
    }
  } else {
    m.tr_ek = kNaN;
    m.group_range = kNaN;
  }

  // Cache-level reconstruction error over all T rows.
  {
    const double k_ref = data.k.squaredNorm(), v_ref = data.v.squaredNorm();
    m.k_rel_mse = ErrorSum{delta_k.squaredNorm(), k_ref}.Relative();
    m.v_rel_mse = ErrorSum{delta_v.squaredNorm(), v_ref}.Relative();
  }

  // RoPE-logit MAE: every cache row with the queries of its own token.
  {
    RopeLogitMae mae(d, data.rope_base);
    std::vector<double> error(d);
    for (int64_t i = 0; i < t; ++i) {
      if (i < s0 || i >= s0 + history) {
        mae.AddExact(data.group);
        continue;
      }
      for (int c = 0; c < d; ++c) error[c] = delta_k(i - s0, c);
      mae.Add(error.data(), data.token_queries.data() + static_cast<size_t>(i) * data.group * d,
              data.group, data.rope_positions[i]);
    }
    m.rope_logit_mae = mae.Mean();
  }

  // Attention over the query rows. Column r of a [keys, R] matrix is one query row.
  const int64_t rows = data.rows();
  // History rows (cache index i ↔ position s0 + i) a query at position p reads quantized: the
  // history of the cache at length p + 1, positions [s0, s0 + H(p + 1)) (spec/cache.md §2).
  auto history_end = [&](int64_t r) -> int64_t {
    if (history == 0) return 0;
    return std::min<int64_t>(cp.HistoryTokens(data.position(r) + 1), history);
  };
  MatrixXd logit_delta;  // [history, R]
  if (history > 0) logit_delta.noalias() = data.scale * (delta_k * data.q.transpose());
  MatrixXd probs_q = MatrixXd::Zero(t, rows);
  MatrixXd probs_diff(t, rows);
  MatrixXd probs_q_hist = MatrixXd::Zero(history, rows);    // p_q on rows read quantized
  MatrixXd probs_ref_hist = MatrixXd::Zero(history, rows);  // p_ref on the same rows
  ErrorSum logit_sum;
  double kl_sum = 0.0, overlap_sum = 0.0;
  std::vector<double> logits_q(t);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = data.position(r) + 1;
    const int64_t h_end = history_end(r);
    for (int64_t i = 0; i < n; ++i) logits_q[i] = data.logits(i, r);
    for (int64_t i = 0; i < h_end; ++i) {
      const double dl = logit_delta(i, r);
      logits_q[s0 + i] += dl;
      logit_sum.error += dl * dl;
    }
    for (int64_t i = 0; i < n; ++i) logit_sum.reference += data.logits(i, r) * data.logits(i, r);
    SoftmaxF64(logits_q.data(), static_cast<size_t>(n), probs_q.col(r).data());
    const double* pr = data.probs.col(r).data();
    const double* pq = probs_q.col(r).data();
    kl_sum += KlDivergence(pr, pq, static_cast<size_t>(n));
    overlap_sum += TopKOverlap(pr, pq, static_cast<size_t>(n), options.top_k);
    for (int64_t i = 0; i < h_end; ++i) {
      probs_q_hist(i, r) = pq[s0 + i];
      probs_ref_hist(i, r) = pr[s0 + i];
    }
  }
  probs_diff = probs_q - data.probs;
  m.logit_rel_mse = logit_sum.Relative();
  m.attn_kl = kl_sum / static_cast<double>(rows);
  m.top10_overlap = overlap_sum / static_cast<double>(rows);

  const double out_ref = data.output.squaredNorm();
  MatrixXd output_error = probs_diff.transpose() * data.v;  // [R, d]
  if (history > 0) {
    output_error.noalias() += probs_q_hist.transpose() * delta_v;
    const MatrixXd sv_error = probs_ref_hist.transpose() * delta_v;
    m.sv_rel_mse = ErrorSum{sv_error.squaredNorm(), out_ref}.Relative();
  } else {
    m.sv_rel_mse = 0.0;
  }
  m.output_rel_mse = ErrorSum{output_error.squaredNorm(), out_ref}.Relative();

  // Cross-check: the cache's own decode attention at the last position (cache length T) must
  // agree with this path's output for that position.
  {
    const int g = data.group;
    const int64_t last = rows - g;  // rows of position T − 1
    std::vector<float> q(static_cast<size_t>(g) * d), out(static_cast<size_t>(g) * d);
    for (int j = 0; j < g; ++j) {
      for (int c = 0; c < d; ++c) q[j * d + c] = static_cast<float>(data.q(last + j, c));
    }
    cpu::Attend(backend, cache, seq, q.data(), out.data());
    for (int j = 0; j < g; ++j) {
      double max_ref = 0.0, max_diff = 0.0;
      for (int c = 0; c < d; ++c) {
        const double mine = data.output(last + j, c) + output_error(last + j, c);
        max_ref = std::max(max_ref, std::fabs(mine));
        max_diff = std::max(max_diff, std::fabs(out[j * d + c] - mine));
      }
      const double rel = max_ref > 0 ? max_diff / max_ref : max_diff;
      m.attend_check = std::max(m.attend_check, rel);
    }
    KVQ_CHECK(m.attend_check <= options.attend_tolerance, kMismatch, "layer ", data.layer,
              " KV head ", data.kv_head, ": cpu::Attend differs from the fp64 metric path by ",
              m.attend_check, " (relative) at the last query position, above ",
              options.attend_tolerance);
  }
  return m;
}

}  // namespace kvq::calib
