// Scalar decode-attention kernels: the plain loops every SIMD version is checked against
// (through the fp64 reference, since reduction order is free on this path).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_internal.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::internal {
namespace {

// Folds logits s [g, n] into the running state: m <- max(m, max s), rescale l and acc by
// exp(m_old - m), then add exp(s - m) to l. Leaves the probabilities in s for the value pass.
void SoftmaxStep(size_t g, size_t n, int d, float* s, float* m, float* l, float* acc) {
  for (size_t h = 0; h < g; ++h) {
    float* row = s + h * n;
    float mx = m[h];
    for (size_t i = 0; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
    const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                        : std::exp(m[h] - mx);
    float sum = l[h] * alpha;
    for (size_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - mx);
      sum += row[i];
    }
    l[h] = sum;
    m[h] = mx;
    for (int j = 0; j < d; ++j) acc[h * static_cast<size_t>(d) + static_cast<size_t>(j)] *= alpha;
  }
}

// acc[h] += p[h][i] * value, for one value row shared by the g heads.
void AddValueRow(size_t g, size_t n, size_t i, int d, const float* p, const float* value,
                 float* acc) {
  for (size_t h = 0; h < g; ++h) {
    const float ph = p[h * n + i];
    float* a = acc + h * static_cast<size_t>(d);
    for (int j = 0; j < d; ++j) a[j] = a[j] + ph * value[j];
  }
}

// Accumulated in double and rounded once: with logits of magnitude ~50 a sequential fp32 sum
// alone costs ~1e-5 of relative output error, the whole budget of spec/cache.md §5.
float Dot(const float* a, const float* b, int d) {
  double s = 0.0;
  for (int j = 0; j < d; ++j) s += static_cast<double>(a[j]) * static_cast<double>(b[j]);
  return static_cast<float>(s);
}

void Bf16Row(const uint16_t* row, int d, float* out) {
  for (int j = 0; j < d; ++j) out[j] = F32FromBf16(row[j]);
}

// ---- One history row of a run, decoded to fp32 in the rotated space, per format ----

void DecodeRowBf16(const HistoryRunView& run, size_t i, const WriteParams& p, float* out) {
  const uint16_t* row = reinterpret_cast<const uint16_t*>(run.plane[0]) +
                        i * static_cast<size_t>(p.head_dim);
  Bf16Row(row, p.head_dim, out);
}

// y = code * scale + min (the product is exact).
void DecodeRowAffineToken(const HistoryRunView& run, size_t i, const WriteParams& p,
                          float* out) {
  const int d = p.head_dim;
  const int part = d * p.bits / 8;  // INT2: d/4 bytes (quarters); INT4: d/2 (halves)
  const uint32_t mask = static_cast<uint32_t>(p.levels());
  const uint8_t* codes = run.plane[0] + i * static_cast<size_t>(p.code_bytes());
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(run.plane[1]);
  const uint16_t* mins = reinterpret_cast<const uint16_t*>(run.plane[2]);
  const size_t groups = static_cast<size_t>(p.num_groups());
  for (int j = 0; j < d; ++j) {
    const int which = j / part;
    const uint32_t code = (static_cast<uint32_t>(codes[j - which * part]) >>
                           (which * p.bits)) & mask;
    const size_t g = i * groups + static_cast<size_t>(j / p.group);
    out[j] = static_cast<float>(code) * F32FromBf16(scales[g]) + F32FromBf16(mins[g]);
  }
}

// Token k = tile_offset + i of the run: tile k / G_k, token r = k % G_k of it. Channel j's codes
// are bytes [j * G_k*b/8, ...) of the tile row, token r at byte r % (G_k*b/8), bit offset
// b * (r / (G_k*b/8)). y = code * scale[tile][j] + min[tile][j], then times n^ with a norm.
void DecodeRowAffineTile(const HistoryRunView& run, size_t i, const WriteParams& p,
                         float* out) {
  const int d = p.head_dim;
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t k = static_cast<size_t>(run.tile_offset) + i;
  const size_t t = k / tile, r = k % tile;
  const size_t slice = static_cast<size_t>(p.tile_channel_bytes());
  const uint32_t mask = static_cast<uint32_t>(p.levels());
  const uint8_t* codes = run.plane[0] + t * static_cast<size_t>(d) * slice;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(run.plane[1]) + t * d;
  const uint16_t* mins = reinterpret_cast<const uint16_t*>(run.plane[2]) + t * d;
  const size_t which = r / slice;
  for (int j = 0; j < d; ++j) {
    const uint32_t code = (static_cast<uint32_t>(codes[j * slice + r % slice]) >>
                           (which * static_cast<size_t>(p.bits))) & mask;
    out[j] = static_cast<float>(code) * F32FromBf16(scales[j]) + F32FromBf16(mins[j]);
  }
  if (p.norm) {
    const int plane = LayoutOf(p).Find("norm");
    const float n = F32FromBf16(reinterpret_cast<const uint16_t*>(run.plane[plane])[i]);
    for (int j = 0; j < d; ++j) out[j] = out[j] * n;
  }
}

// y = s^ * e4m3 value (the codec's dequantize, numerics.md §9).
void DecodeRowFp8E4m3(const HistoryRunView& run, size_t i, const WriteParams& p, float* out) {
  const uint8_t* codes = run.plane[0] + i * static_cast<size_t>(p.head_dim);
  for (int j = 0; j < p.head_dim; ++j) out[j] = p.head_scale * F32FromE4m3(codes[j]);
}

void DecodeRow(const HistoryRunView& run, size_t i, const WriteParams& p, float* out) {
  switch (p.format) {
#define KVQ_FORMAT(id, Name, tile_tokens, summary) \
  case Format::k##Name:                            \
    return DecodeRow##Name(run, i, p, out);
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  }
}

void Bf16UpdateScalar(const float* q, size_t g, Bf16RowsView k, Bf16RowsView v, size_t n, int d,
                      float scale, float* scratch, float* m, float* l, float* acc) {
  std::vector<float> row(static_cast<size_t>(d));
  for (size_t i = 0; i < n; ++i) {
    Bf16Row(k.rows + i * k.stride, d, row.data());
    for (size_t h = 0; h < g; ++h) {
      scratch[h * n + i] = scale * Dot(q + h * static_cast<size_t>(d), row.data(), d);
    }
  }
  SoftmaxStep(g, n, d, scratch, m, l, acc);
  for (size_t i = 0; i < n; ++i) {
    Bf16Row(v.rows + i * v.stride, d, row.data());
    AddValueRow(g, n, i, d, scratch, row.data(), acc);
  }
}

void HistoryUpdateScalar(const float* q_rot, size_t g, HistoryRunView k, HistoryRunView v,
                         size_t n, const WriteParams& kp, const WriteParams& vp, float scale,
                         float* scratch, float* m, float* l, float* acc) {
  const int d = kp.head_dim;
  std::vector<float> row(static_cast<size_t>(d));
  for (size_t i = 0; i < n; ++i) {
    DecodeRow(k, i, kp, row.data());
    for (size_t h = 0; h < g; ++h) {
      scratch[h * n + i] = scale * Dot(q_rot + h * static_cast<size_t>(d), row.data(), d);
    }
  }
  SoftmaxStep(g, n, d, scratch, m, l, acc);
  for (size_t i = 0; i < n; ++i) {
    DecodeRow(v, i, vp, row.data());
    AddValueRow(g, n, i, d, scratch, row.data(), acc);
  }
}

}  // namespace

AttentionKernels ScalarAttentionKernels() {
  AttentionKernels kernels;
  kernels.bf16_update = &Bf16UpdateScalar;
  kernels.history_update = &HistoryUpdateScalar;
  return kernels;
}

}  // namespace kvq::cpu::internal
