#include "kvq/calib/cache_attention.h"

#include <algorithm>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::calib {

CacheAttention::CacheAttention(const ModelConfig& config, std::vector<LayerScheme> layers,
                               const cpu::Backend& backend)
    : layers_(std::move(layers)), backend_(&backend), bits_(layers_.size(), 0.0) {
  KVQ_CHECK(static_cast<int>(layers_.size()) == config.num_layers, kShapeMismatch,
            "cache attention: ", layers_.size(), " layer schemes for a model of ",
            config.num_layers, " layers");
  for (size_t l = 0; l < layers_.size(); ++l) {
    const CacheParams& p = layers_[l].params;
    KVQ_CHECK(p.num_q_heads == config.num_q_heads && p.num_kv_heads == config.num_kv_heads &&
                  p.head_dim() == config.head_dim,
              kShapeMismatch, "cache attention: layer ", l, "'s scheme is Hq=", p.num_q_heads,
              " Hkv=", p.num_kv_heads, " d=", p.head_dim(), ", the model Hq=",
              config.num_q_heads, " Hkv=", config.num_kv_heads, " d=", config.head_dim);
  }
}

double CacheAttention::bits_per_element() const {
  double sum = 0.0;
  for (double b : bits_) sum += b;
  return bits_.empty() ? 0.0 : sum / static_cast<double>(bits_.size());
}

void CacheAttention::Attend(int layer, int64_t first, int64_t rows, const float* q,
                            const float* k, const float* v, float* out) {
  const LayerScheme& scheme = layers_[layer];
  const CacheParams& p = scheme.params;
  const int d = p.head_dim(), hkv = p.num_kv_heads, g = p.group_size(), hq = p.num_q_heads;
  const int64_t tokens = first + rows;
  const int64_t kv_row = static_cast<int64_t>(hkv) * d;

  cpu::PagedKVCache cache(p, scheme.key, scheme.value, *backend_);
  const int seq = cache.AddSequence();
  cache.Prefill(seq, k, v, static_cast<size_t>(tokens));
  bits_[layer] = cache.Bytes(seq).bits_per_element();

  // The rows a query reads outside the history: what the sink and recent windows hold (the
  // original rows in bf16), or a bf16 cache's dense rows.
  std::vector<float> kb(static_cast<size_t>(tokens) * kv_row), vb(kb.size());
  if (!p.quantized()) {
    const uint16_t* dk = cache.DenseRows(seq, cpu::KV::kKey);
    const uint16_t* dv = cache.DenseRows(seq, cpu::KV::kValue);
    for (size_t i = 0; i < kb.size(); ++i) {
      kb[i] = F32FromBf16(dk[i]);
      vb[i] = F32FromBf16(dv[i]);
    }
  } else {
    for (size_t i = 0; i < kb.size(); ++i) {
      kb[i] = RoundToBf16(k[i]);
      vb[i] = RoundToBf16(v[i]);
    }
  }
  // History rows query r reads: H(p + 1) at its own cache length.
  std::vector<int64_t> visible(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) visible[r] = p.HistoryTokens(first + r + 1);
  const int64_t history = static_cast<int64_t>(cache.HistoryLength(seq));
  const bool reads_history = history > 0 && visible.back() > 0;

  std::vector<float> q_head, q_rot, o_rot, o_back;
  for (int h = 0; h < hkv; ++h) {
    const float* qh = q + static_cast<size_t>(h) * g * d;
    float* oh = out + static_cast<size_t>(h) * g * d;
    if (!reads_history) {
      AttendHead(first, rows, g, d, p.scale(), qh, hq * d, kb.data() + h * d, vb.data() + h * d,
                 kv_row, nullptr, oh, hq * d, nullptr);
      continue;
    }
    const size_t n = static_cast<size_t>(rows) * g;
    q_head.resize(n * d);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(q_head.data() + static_cast<size_t>(r) * g * d, qh + r * hq * d,
                  static_cast<size_t>(g) * d * sizeof(float));
    }
    q_rot.resize(n * d);
    cpu::Rotate(*backend_, cache.HeadParams(cpu::KV::kKey, h), cache.Rotation(cpu::KV::kKey, h),
                q_head.data(), q_rot.data(), n);
    const std::vector<float> hist_k = cache.DequantizedHistory(seq, h, cpu::KV::kKey);
    const std::vector<float> hist_v = cache.DequantizedHistory(seq, h, cpu::KV::kValue);
    HistoryView view;
    view.begin = p.sink;
    view.keys = hist_k.data();
    view.values = hist_v.data();
    view.count = history;
    view.q_rot = q_rot.data();
    view.visible = visible.data();
    o_rot.assign(n * d, 0.0f);
    AttendHead(first, rows, g, d, p.scale(), qh, hq * d, kb.data() + h * d, vb.data() + h * d,
               kv_row, &view, oh, hq * d, o_rot.data());
    o_back.resize(n * d);
    cpu::RotateInverse(*backend_, cache.HeadParams(cpu::KV::kValue, h),
                       cache.Rotation(cpu::KV::kValue, h), o_rot.data(), o_back.data(), n);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = oh + r * hq * d;
      const float* src = o_back.data() + static_cast<size_t>(r) * g * d;
      for (int i = 0; i < g * d; ++i) dst[i] += src[i];
    }
  }
}

}  // namespace kvq::calib
