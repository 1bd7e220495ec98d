#include "kvq/calib/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/calib/matmul.h"
#include "kvq/calib/parallel.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"

namespace kvq::calib {
namespace {

constexpr int64_t kQueryBlock = 64;  // query positions per attention block

// dst [d, n] = src rows [n, d] (row i at src + i·stride) transposed.
void TransposeRows(const float* src, int64_t stride, int64_t n, int d, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = src + i * stride;
    for (int c = 0; c < d; ++c) dst[c * n + i] = row[c];
  }
}

// Per-head RMSNorm then RoPE of `heads` heads of one position, in place. x [heads, d].
void NormRopeHeads(float* x, int heads, int d, const std::vector<float>& norm, double eps,
                   const float* cos, const float* sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = x + static_cast<size_t>(h) * d;
    if (!norm.empty()) steps::RmsNorm(v, norm.data(), 1, d, eps, v);
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      // HF: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1).
      v[i] = a * cos[i] + (-b) * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

}  // namespace

// ---- The attention kernel ----

void AttendHead(int64_t first, int64_t rows, int g, int d, float scale, const float* q,
                int64_t q_stride, const float* keys, const float* values, int64_t kv_stride,
                const HistoryView* history, float* out, int64_t out_stride, float* o_rot) {
  const int64_t tokens = first + rows;
  std::vector<float> keys_t(static_cast<size_t>(tokens) * d);  // [d, tokens]
  TransposeRows(keys, kv_stride, tokens, d, keys_t.data());
  std::vector<float> hist_keys_t;
  if (history != nullptr && history->count > 0) {
    hist_keys_t.resize(static_cast<size_t>(history->count) * d);
    TransposeRows(history->keys, d, history->count, d, hist_keys_t.data());
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> qb(static_cast<size_t>(kQueryBlock) * d), s, sh, ob(qb.size());
  for (int64_t b0 = first; b0 < tokens; b0 += kQueryBlock) {
    const int64_t b1 = std::min(tokens, b0 + kQueryBlock);
    const int64_t n = b1 - b0;
    const int64_t visible_max =
        history != nullptr && history->count > 0 ? history->visible[b1 - 1 - first] : 0;
    s.assign(static_cast<size_t>(n) * b1, 0.0f);
    if (visible_max > 0) sh.assign(static_cast<size_t>(n) * visible_max, 0.0f);
    for (int j = 0; j < g; ++j) {
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(qb.data() + r * d, q + (b0 - first + r) * q_stride + j * d, d * sizeof(float));
      }
      MatMul(qb.data(), d, keys_t.data(), tokens, s.data(), b1, n, b1, d);
      if (visible_max > 0) {
        const float* qr = history->q_rot + (static_cast<size_t>(b0 - first) * g + j) * d;
        MatMul(qr, static_cast<size_t>(g) * d, hist_keys_t.data(), history->count, sh.data(),
               visible_max, n, visible_max, d);
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t p = b0 + r;
        float* row = s.data() + r * b1;
        const int64_t visible = visible_max > 0 ? history->visible[p - first] : 0;
        const int64_t h0 = visible > 0 ? history->begin : 0;
        for (int64_t i = 0; i <= p; ++i) row[i] = scale * row[i];
        for (int64_t t = 0; t < visible; ++t) row[h0 + t] = scale * sh[r * visible_max + t];
        for (int64_t i = p + 1; i < b1; ++i) row[i] = neg_inf;
        SoftmaxInPlace(row, static_cast<size_t>(b1));
        if (visible_max > 0) {
          float* hrow = sh.data() + r * visible_max;
          for (int64_t t = 0; t < visible_max; ++t) {
            hrow[t] = t < visible ? row[h0 + t] : 0.0f;
            if (t < visible) row[h0 + t] = 0.0f;
          }
        }
      }
      MatMul(s.data(), b1, values, kv_stride, ob.data(), d, n, d, b1);
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(out + (b0 - first + r) * out_stride + j * d, ob.data() + r * d,
                    d * sizeof(float));
      }
      if (visible_max > 0) {
        MatMul(sh.data(), visible_max, history->values, d, ob.data(), d, n, d, visible_max);
        for (int64_t r = 0; r < n; ++r) {
          std::memcpy(o_rot + (static_cast<size_t>(b0 - first + r) * g + j) * d,
                      ob.data() + r * d, d * sizeof(float));
        }
      } else if (history != nullptr && o_rot != nullptr) {
        for (int64_t r = 0; r < n; ++r) {
          std::fill_n(o_rot + (static_cast<size_t>(b0 - first + r) * g + j) * d, d, 0.0f);
        }
      }
    }
  }
}

void DenseAttention::Attend(int /*layer*/, int64_t first, int64_t rows, const float* q,
                            const float* k, const float* v, float* out) {
  const ModelConfig& c = config_;
  const int d = c.head_dim, hkv = c.num_kv_heads, g = c.group_size();
  const int64_t tokens = first + rows;
  const int64_t kv_row = c.kv_width();
  std::vector<float> rounded_k, rounded_v;
  if (rounding_ == KvRounding::kBf16) {
    const size_t n = static_cast<size_t>(tokens) * kv_row;
    rounded_k.resize(n);
    rounded_v.resize(n);
    for (size_t i = 0; i < n; ++i) {
      rounded_k[i] = RoundToBf16(k[i]);
      rounded_v[i] = RoundToBf16(v[i]);
    }
    k = rounded_k.data();
    v = rounded_v.data();
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int h = 0; h < hkv; ++h) {
    AttendHead(first, rows, g, d, scale, q + static_cast<size_t>(h) * g * d, c.q_width(),
               k + static_cast<size_t>(h) * d, v + static_cast<size_t>(h) * d, kv_row, nullptr,
               out + static_cast<size_t>(h) * g * d, c.q_width(), nullptr);
  }
}

void CapturingAttention::Attend(int layer, int64_t first, int64_t rows, const float* q,
                                const float* k, const float* v, float* out) {
  KVQ_CHECK(first == 0, kInvalidArgument, "capture needs whole windows (first = ", first, ")");
  LayerActivations& a = layers_[layer];
  const size_t qw = static_cast<size_t>(q_width_), kvw = static_cast<size_t>(kv_width_);
  const size_t at = static_cast<size_t>(offset_);
  std::copy(q, q + rows * qw, a.q.begin() + at * qw);
  std::copy(k, k + rows * kvw, a.k.begin() + at * kvw);
  std::copy(v, v + rows * kvw, a.v.begin() + at * kvw);
  inner_->Attend(layer, first, rows, q, k, v, out);
}

// ---- Steps ----

namespace steps {

void Embed(const Model& m, const int32_t* ids, int64_t rows, float* x) {
  const int D = m.config.hidden;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(x + r * D, m.embed.data() + static_cast<size_t>(ids[r]) * D, D * sizeof(float));
  }
}

void RmsNorm(const float* x, const float* w, int64_t rows, int width, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    double sum = 0.0;
    for (int i = 0; i < width; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float variance = static_cast<float>(sum / width);
    const float inv = 1.0f / std::sqrt(variance + static_cast<float>(eps));
    float* o = out + r * width;
    for (int i = 0; i < width; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

void QkvRope(const Model& m, int layer, const float* h, int64_t rows, int64_t first, float* q,
             float* k, float* v) {
  const ModelConfig& c = m.config;
  const LayerWeights& w = m.layers[layer];
  const int D = c.hidden, d = c.head_dim, qw = c.q_width(), kvw = c.kv_width();
  const int fused = qw + 2 * kvw;
  std::vector<float> qkv(static_cast<size_t>(rows) * fused);
  MatMul(h, D, w.qkv.data(), fused, qkv.data(), fused, rows, fused, D);
  const int half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = qkv.data() + r * fused;
    float* qr = q + r * qw;
    float* kr = k + r * kvw;
    std::memcpy(qr, src, qw * sizeof(float));
    std::memcpy(kr, src + qw, kvw * sizeof(float));
    std::memcpy(v + r * kvw, src + qw + kvw, kvw * sizeof(float));
    const float* cos = m.rope_cos.data() + (first + r) * half;
    const float* sin = m.rope_sin.data() + (first + r) * half;
    NormRopeHeads(qr, c.num_q_heads, d, w.q_norm, c.rms_eps, cos, sin);
    NormRopeHeads(kr, c.num_kv_heads, d, w.k_norm, c.rms_eps, cos, sin);
  }
}

void OutputProjectionAdd(const Model& m, int layer, const float* o, int64_t rows, float* x) {
  const ModelConfig& c = m.config;
  MatMul(o, c.q_width(), m.layers[layer].o.data(), c.hidden, x, c.hidden, rows, c.hidden,
         c.q_width(), /*accumulate=*/true);
}

void MlpAdd(const Model& m, int layer, int64_t rows, float* x) {
  const ModelConfig& c = m.config;
  const LayerWeights& w = m.layers[layer];
  const int D = c.hidden, I = c.intermediate;
  std::vector<float> h(static_cast<size_t>(rows) * D), gu(static_cast<size_t>(rows) * 2 * I);
  RmsNorm(x, w.post_norm.data(), rows, D, c.rms_eps, h.data());
  MatMul(h.data(), D, w.gate_up.data(), 2 * I, gu.data(), 2 * I, rows, 2 * I, D);
  std::vector<float> act(static_cast<size_t>(rows) * I);
  for (int64_t r = 0; r < rows; ++r) {
    SwiGlu(gu.data() + r * 2 * I, gu.data() + r * 2 * I + I, act.data() + r * I, I);
  }
  MatMul(act.data(), I, w.down.data(), D, x, D, rows, D, I, /*accumulate=*/true);
}

void Logits(const Model& m, const float* x, int64_t rows, float* logits) {
  const ModelConfig& c = m.config;
  std::vector<float> h(static_cast<size_t>(rows) * c.hidden);
  RmsNorm(x, m.final_norm.data(), rows, c.hidden, c.rms_eps, h.data());
  MatMul(h.data(), c.hidden, m.head.data(), c.vocab, logits, c.vocab, rows, c.vocab, c.hidden);
}

}  // namespace steps

// ---- The layer loop ----

std::vector<float> Forward(const Model& model, AttentionStep& attention,
                           const ForwardRequest& req) {
  const ModelConfig& c = model.config;
  KVQ_CHECK(req.ids != nullptr, kInvalidArgument, "forward: null token ids");
  KVQ_CHECK(req.tokens >= 1 && req.tokens <= c.max_positions, kInvalidArgument,
            "forward: window of ", req.tokens, " tokens is outside [1, max_position_embeddings = ",
            c.max_positions, "]");
  KVQ_CHECK(req.tokens <= model.rope_positions, kInvalidArgument, "forward: window of ",
            req.tokens, " tokens is longer than the ", model.rope_positions,
            " positions the model was loaded for (LoadModel's positions)");
  KVQ_CHECK(req.first >= 0 && req.first < req.tokens, kInvalidArgument, "forward: first position ",
            req.first, " is outside [0, ", req.tokens, ")");
  KVQ_CHECK(req.keep_rows >= 0 && req.keep_rows <= req.tokens, kInvalidArgument,
            "forward: keep_rows ", req.keep_rows, " is outside [0, ", req.tokens, "]");
  const int L = c.num_layers, D = c.hidden, kvw = c.kv_width();
  if (req.first > 0) {
    KVQ_CHECK(req.prefix != nullptr && static_cast<int>(req.prefix->size()) == L,
              kInvalidArgument, "forward: positions [0, ", req.first,
              ") need a prefix of ", L, " layers");
    for (const LayerKv& p : *req.prefix) {
      KVQ_CHECK(p.k.size() >= static_cast<size_t>(req.first) * kvw &&
                    p.v.size() >= static_cast<size_t>(req.first) * kvw,
                kInvalidArgument, "forward: the prefix holds fewer than ", req.first, " rows");
    }
  }
  const int64_t first = req.first, tokens = req.tokens, rows = tokens - first;
  std::vector<float> x(static_cast<size_t>(rows) * D), h(x.size());
  std::vector<float> q(static_cast<size_t>(rows) * c.q_width()), o(q.size());
  std::vector<float> k(static_cast<size_t>(tokens) * kvw), v(k.size());
  if (req.keep != nullptr) req.keep->assign(L, LayerKv{});
  steps::Embed(model, req.ids + first, rows, x.data());
  for (int l = 0; l < L; ++l) {
    steps::RmsNorm(x.data(), model.layers[l].input_norm.data(), rows, D, c.rms_eps, h.data());
    steps::QkvRope(model, l, h.data(), rows, first, q.data(), k.data() + first * kvw,
                   v.data() + first * kvw);
    if (first > 0) {
      const LayerKv& p = (*req.prefix)[l];
      std::copy(p.k.begin(), p.k.begin() + first * kvw, k.begin());
      std::copy(p.v.begin(), p.v.begin() + first * kvw, v.begin());
    }
    if (req.keep != nullptr) {
      (*req.keep)[l].k.assign(k.begin(), k.begin() + req.keep_rows * kvw);
      (*req.keep)[l].v.assign(v.begin(), v.begin() + req.keep_rows * kvw);
    }
    attention.Attend(l, first, rows, q.data(), k.data(), v.data(), o.data());
    steps::OutputProjectionAdd(model, l, o.data(), rows, x.data());
    steps::MlpAdd(model, l, rows, x.data());
  }
  if (!req.logits) return {};
  std::vector<float> logits(static_cast<size_t>(rows) * c.vocab);
  steps::Logits(model, x.data(), rows, logits.data());
  return logits;
}

// ---- Capture ----

Activations CaptureActivations(const Model& model, const std::vector<TokenWindows>& windows,
                               int calib_windows, int threads, const std::string& source,
                               const std::function<void(int done, int total)>& progress) {
  const ModelConfig& c = model.config;
  std::vector<const int32_t*> ids;
  int64_t length = 0;
  for (const TokenWindows& set : windows) {
    KVQ_CHECK(length == 0 || set.length == length, kInvalidArgument,
              "capture: windows of different lengths (", length, " and ", set.length, ")");
    length = set.length;
    for (size_t i = 0; i < set.count(); ++i) ids.push_back(set.window(i));
  }
  const int count = static_cast<int>(ids.size());
  KVQ_CHECK(count >= 1, kInvalidArgument, "capture: no windows");
  KVQ_CHECK(calib_windows <= count, kInvalidArgument, "capture: ", calib_windows,
            " calibration windows of ", count);
  Activations acts;
  ActivationsInfo& info = acts.info;
  info.source = source;
  info.num_layers = c.num_layers;
  info.num_q_heads = c.num_q_heads;
  info.num_kv_heads = c.num_kv_heads;
  info.head_dim = c.head_dim;
  info.rope_base = c.rope_theta;
  info.tokens = length * count;
  info.calib_tokens = length * (calib_windows < 0 ? count : std::max(calib_windows, 1));
  info.segment_tokens = count > 1 ? length : 0;
  acts.layers.resize(c.num_layers);
  for (LayerActivations& l : acts.layers) {
    l.q.resize(static_cast<size_t>(info.tokens) * c.q_width());
    l.k.resize(static_cast<size_t>(info.tokens) * c.kv_width());
    l.v.resize(l.k.size());
  }
  int done = 0;
  ParallelItems(
      count, threads,
      [&](int w) {
        DenseAttention dense(c, KvRounding::kNone);
        CapturingAttention capture(&dense, c, acts.layers.data(), w * length);
        ForwardRequest req;
        req.ids = ids[w];
        req.tokens = length;
        req.logits = false;
        Forward(model, capture, req);
      },
      progress ? std::function<void()>([&] { progress(++done, count); }) : nullptr);
  ValidateActivations(acts);
  return acts;
}

}  // namespace kvq::calib
