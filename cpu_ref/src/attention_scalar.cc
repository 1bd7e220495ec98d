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
#include "kvq/cpu_ref/write_path.h"

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
  // The run's rows as the codec of each side's format decodes them (formats.inc's decode
  // steps, run by the scalar stages): the oracle has no reader of its own per format.
  const int d = kp.head_dim;
  const size_t dd = static_cast<size_t>(d);
  std::vector<float> rows(n * dd);
  DecodeRows(ScalarBackend(), kp, k, n, rows.data());
  for (size_t i = 0; i < n; ++i) {
    for (size_t h = 0; h < g; ++h) {
      scratch[h * n + i] = scale * Dot(q_rot + h * dd, rows.data() + i * dd, d);
    }
  }
  SoftmaxStep(g, n, d, scratch, m, l, acc);
  DecodeRows(ScalarBackend(), vp, v, n, rows.data());
  for (size_t i = 0; i < n; ++i) AddValueRow(g, n, i, d, scratch, rows.data() + i * dd, acc);
}

}  // namespace

AttentionKernels ScalarAttentionKernels() {
  AttentionKernels kernels;
  kernels.bf16_update = &Bf16UpdateScalar;
  kernels.history_update = &HistoryUpdateScalar;
  return kernels;
}

}  // namespace kvq::cpu::internal
