// Decode attention over the paged cache: the driver that walks sink, recent and history pages
// and calls a backend's attention table (attention_scalar.cc, attention_hwy.cc), and the fp64
// reference the oracle is held against.
#include "kvq/cpu_ref/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/write_path.h"
#include "write_internal.h"

namespace kvq::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// bf16 rows go to the kernels in runs of at most this many rows (bounds the scratch).
constexpr size_t kBf16Run = 256;

// (m, l, acc) of g query heads.
struct Partial {
  std::vector<float> m, l, acc;
  Partial(size_t g, size_t d) : m(g, kNegInf), l(g, 0.0f), acc(g * d, 0.0f) {}
  void Reset() {
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
  }
};

// dst <- the log-sum-exp merge of dst and src.
void Merge(const Partial& src, size_t d, Partial* dst) {
  for (size_t h = 0; h < src.m.size(); ++h) {
    if (src.m[h] == kNegInf) continue;
    const float mx = std::max(dst->m[h], src.m[h]);
    const float a = dst->m[h] == kNegInf ? 0.0f : std::exp(dst->m[h] - mx);
    const float b = std::exp(src.m[h] - mx);
    dst->l[h] = dst->l[h] * a + src.l[h] * b;
    for (size_t j = 0; j < d; ++j) {
      dst->acc[h * d + j] = dst->acc[h * d + j] * a + src.acc[h * d + j] * b;
    }
    dst->m[h] = mx;
  }
}

void CheckQuery(const PagedKVCache& cache, int seq, const float* q) {
  const CacheParams& p = cache.params();
  KVQ_CHECK(q != nullptr, kInvalidArgument, "null query");
  const size_t t = cache.Length(seq);  // throws on an unknown id
  KVQ_CHECK(t > 0, kInvalidArgument, "sequence ", seq, " is empty: nothing to attend to");
  const size_t d = static_cast<size_t>(p.head_dim());
  for (size_t i = 0; i < static_cast<size_t>(p.num_q_heads) * d; ++i) {
    KVQ_CHECK(std::isfinite(q[i]), kNonFinite, "query value ", q[i], " at head ", i / d,
              ", channel ", i % d, " is not finite");
  }
}

// ---- fp64 rotations for the reference (spec/numerics.md §3) ----

void FwhtF64(double* x, int d, int block) {
  const double s = 1.0 / std::sqrt(static_cast<double>(block));
  for (int b0 = 0; b0 < d; b0 += block) {
    double* y = x + b0;
    for (int h = 1; h < block; h <<= 1) {
      for (int k = 0; k < block; ++k) {
        if (k & h) continue;
        const double a = y[k], c = y[k + h];
        y[k] = a + c;
        y[k + h] = a - c;
      }
    }
    for (int k = 0; k < block; ++k) y[k] *= s;
  }
}

void BitReverseF64(std::vector<double>* x) {
  const int d = static_cast<int>(x->size());
  const int bits = internal::Log2(d);
  std::vector<double> y(x->size());
  for (int j = 0; j < d; ++j) y[j] = (*x)[BitReverse(static_cast<uint32_t>(j), bits)];
  *x = std::move(y);
}

// x·P_brᵀ·Rᵀ in double (the inverse of RotateF64 for orthogonal R).
std::vector<double> RotateInverseF64(std::vector<double> x, const WriteParams& p,
                                     const float* r) {
  const int d = p.head_dim;
  if (p.bitrev) BitReverseF64(&x);
  if (p.rotation == RotationKind::kDense) {
    std::vector<double> y(static_cast<size_t>(d), 0.0);
    for (int i = 0; i < d; ++i) {
      double s = 0.0;
      for (int j = 0; j < d; ++j) s += x[j] * static_cast<double>(r[i * d + j]);
      y[i] = s;
    }
    x = std::move(y);
  } else if (p.rotation == RotationKind::kHadamard) {
    FwhtF64(x.data(), d, p.fwht_block());
  }
  return x;
}

}  // namespace

void Attend(const Backend& backend, const PagedKVCache& cache, int seq, const float* q,
            float* out, const AttentionOptions& options) {
  CheckQuery(cache, seq, q);
  KVQ_CHECK(out != nullptr, kInvalidArgument, "null output");
  KVQ_CHECK(options.chunk_pages >= 1, kInvalidArgument, "chunk_pages ", options.chunk_pages,
            " must be at least 1");
  const AttentionKernels& kernels = backend.attention;
  KVQ_CHECK(kernels.bf16_update != nullptr && kernels.history_update != nullptr, kUnsupported,
            "backend '", backend.name, "' has no decode-attention kernels");
  KVQ_CHECK(backend.write.rotate_dense != nullptr && backend.write.fwht != nullptr &&
                backend.write.bitrev != nullptr,
            kUnsupported, "backend '", backend.name, "' has no rotation stages");

  const CacheParams& p = cache.params();
  const size_t hkv = static_cast<size_t>(p.num_kv_heads);
  const size_t g = static_cast<size_t>(p.group_size());
  const size_t d = static_cast<size_t>(p.head_dim());
  const size_t row = hkv * d;  // elements between consecutive tokens' rows of one head
  const size_t page = static_cast<size_t>(p.page_size);
  const float scale = p.scale();
  const size_t t = cache.Length(seq);
  const size_t history = cache.HistoryLength(seq);

  std::vector<float> scratch(g * std::max(page, kBf16Run));
  std::vector<float> q_rot(g * d), o_hist(g * d), o_hist_rot(g * d);
  Partial bf16(g, d), hist(g, d), chunk(g, d);

  for (size_t kvh = 0; kvh < hkv; ++kvh) {
    const float* qh = q + kvh * g * d;
    bf16.Reset();
    // Positions [first, first + count) whose rows are `count` consecutive rows of `k`, `v`.
    const auto bf16_rows = [&](const uint16_t* k, const uint16_t* v, size_t count) {
      for (size_t done = 0; done < count; done += kBf16Run) {
        const size_t n = std::min(kBf16Run, count - done);
        kernels.bf16_update(qh, g, Bf16RowsView{k + done * row + kvh * d, row},
                            Bf16RowsView{v + done * row + kvh * d, row}, n,
                            static_cast<int>(d), scale, scratch.data(), bf16.m.data(),
                            bf16.l.data(), bf16.acc.data());
      }
    };
    if (!p.quantized()) {
      bf16_rows(cache.DenseRows(seq, KV::kKey), cache.DenseRows(seq, KV::kValue), t);
    } else {
      bf16_rows(cache.SinkRows(seq, KV::kKey), cache.SinkRows(seq, KV::kValue),
                cache.SinkLength(seq));
      // The recent positions occupy ring slots [b % (W + F - 1), ...), wrapping once at most.
      const size_t window = static_cast<size_t>(p.ring_slots());
      const size_t begin = cache.RecentBegin(seq);
      const uint16_t* ring_k = cache.RecentRing(seq, KV::kKey);
      const uint16_t* ring_v = cache.RecentRing(seq, KV::kValue);
      size_t position = begin;
      while (position < t) {
        const size_t slot = position % window;
        const size_t n = std::min(t - position, window - slot);
        bf16_rows(ring_k + slot * row, ring_v + slot * row, n);
        position += n;
      }
    }

    bool has_history = history > 0;
    if (has_history) {
      const int head = static_cast<int>(kvh);
      const WriteParams kp = cache.HeadParams(KV::kKey, head);
      const WriteParams vp = cache.HeadParams(KV::kValue, head);
      internal::RotateRows(backend, kp, cache.Rotation(KV::kKey, head), qh, q_rot.data(), g);
      const size_t pages = (history + page - 1) / page;
      const size_t per_chunk = static_cast<size_t>(options.chunk_pages);
      hist.Reset();
      for (size_t c0 = 0; c0 < pages; c0 += per_chunk) {
        chunk.Reset();
        for (size_t pi = c0; pi < std::min(pages, c0 + per_chunk); ++pi) {
          const size_t n = std::min(page, history - pi * page);
          const HistoryRunView k = cache.HistoryRow(seq, pi * page, head, KV::kKey);
          const HistoryRunView v = cache.HistoryRow(seq, pi * page, head, KV::kValue);
          kernels.history_update(q_rot.data(), g, k, v, n, kp, vp, scale, scratch.data(),
                                 chunk.m.data(), chunk.l.data(), chunk.acc.data());
        }
        Merge(chunk, d, &hist);
      }
      // Normalise in the rotated space, then map back once per query head.
      for (size_t h = 0; h < g; ++h) {
        for (size_t j = 0; j < d; ++j) o_hist_rot[h * d + j] = hist.acc[h * d + j] / hist.l[h];
      }
      internal::RotateRowsInverse(backend, vp, cache.RotationTransposed(KV::kValue, head),
                                  o_hist_rot.data(), o_hist.data(), g);
    }

    for (size_t h = 0; h < g; ++h) {
      float* o = out + (kvh * g + h) * d;
      const float* acc_b = bf16.acc.data() + h * d;
      if (!has_history) {
        for (size_t j = 0; j < d; ++j) o[j] = acc_b[j] / bf16.l[h];
      } else {
        const float mx = std::max(bf16.m[h], hist.m[h]);
        const float eb = std::exp(bf16.m[h] - mx);
        const float wh = hist.l[h] * std::exp(hist.m[h] - mx);
        const float total = bf16.l[h] * eb + wh;
        for (size_t j = 0; j < d; ++j) o[j] = (acc_b[j] * eb + wh * o_hist[h * d + j]) / total;
      }
      for (size_t j = 0; j < d; ++j) {
        KVQ_CHECK(std::isfinite(o[j]), kNonFinite, "attention output of query head ",
                  kvh * g + h, " of sequence ", seq, " is not finite (", o[j],
                  " at channel ", j, "): the logits overflow");
      }
    }
  }
}

void AttendBatch(const Backend& backend, const PagedKVCache& cache, const std::vector<int>& seqs,
                 const float* q, float* out, const AttentionOptions& options) {
  KVQ_CHECK(seqs.empty() || (q != nullptr && out != nullptr), kInvalidArgument,
            "null query or output for a batch of ", seqs.size());
  const size_t stride =
      static_cast<size_t>(cache.params().num_q_heads) * static_cast<size_t>(cache.params().head_dim());
  for (size_t b = 0; b < seqs.size(); ++b) {
    Attend(backend, cache, seqs[b], q + b * stride, out + b * stride, options);
  }
}

void AttendReferenceF64(const PagedKVCache& cache, int seq, const float* q, double* out) {
  CheckQuery(cache, seq, q);
  KVQ_CHECK(out != nullptr, kInvalidArgument, "null output");
  const CacheParams& p = cache.params();
  const size_t hkv = static_cast<size_t>(p.num_kv_heads);
  const size_t g = static_cast<size_t>(p.group_size());
  const size_t d = static_cast<size_t>(p.head_dim());
  const double scale = static_cast<double>(p.scale());
  const size_t t = cache.Length(seq);
  const size_t history = cache.HistoryLength(seq);

  std::vector<size_t> bf16_positions;
  for (size_t i = 0; i < t; ++i) {
    if (cache.IsBf16Position(seq, i)) bf16_positions.push_back(i);
  }
  for (size_t kvh = 0; kvh < hkv; ++kvh) {
    const int head = static_cast<int>(kvh);
    std::vector<float> hist_k, hist_v;
    WriteParams kp, vp;
    if (history > 0) {
      hist_k = cache.DequantizedHistory(seq, head, KV::kKey);
      hist_v = cache.DequantizedHistory(seq, head, KV::kValue);
      kp = cache.HeadParams(KV::kKey, head);
      vp = cache.HeadParams(KV::kValue, head);
    }
    for (size_t hh = 0; hh < g; ++hh) {
      const size_t h = kvh * g + hh;
      std::vector<double> qd(q + h * d, q + (h + 1) * d);
      std::vector<double> logits_b(bf16_positions.size()), logits_h(history);
      double mx = -std::numeric_limits<double>::infinity();
      for (size_t r = 0; r < bf16_positions.size(); ++r) {
        const uint16_t* k = cache.Bf16Row(seq, bf16_positions[r], KV::kKey) + kvh * d;
        double s = 0.0;
        for (size_t j = 0; j < d; ++j) s += qd[j] * static_cast<double>(F32FromBf16(k[j]));
        logits_b[r] = scale * s;
        mx = std::max(mx, logits_b[r]);
      }
      // q~ is part of the spec (the write path's rotation stage, fp32, the same bits on every
      // backend), like the dequantized rows; everything after it is free-order and runs in
      // double here.
      std::vector<double> q_rot(d);
      if (history > 0) {
        std::vector<float> q_rot32(d);
        Rotate(ScalarBackend(), kp, cache.Rotation(KV::kKey, head), q + h * d, q_rot32.data(), 1);
        for (size_t j = 0; j < d; ++j) q_rot[j] = q_rot32[j];
      }
      for (size_t i = 0; i < history; ++i) {
        double s = 0.0;
        for (size_t j = 0; j < d; ++j) s += q_rot[j] * static_cast<double>(hist_k[i * d + j]);
        logits_h[i] = scale * s;
        mx = std::max(mx, logits_h[i]);
      }
      double total = 0.0;
      std::vector<double> o(d, 0.0), o_rot(d, 0.0);
      for (size_t r = 0; r < bf16_positions.size(); ++r) {
        const double w = std::exp(logits_b[r] - mx);
        total += w;
        const uint16_t* v = cache.Bf16Row(seq, bf16_positions[r], KV::kValue) + kvh * d;
        for (size_t j = 0; j < d; ++j) o[j] += w * static_cast<double>(F32FromBf16(v[j]));
      }
      for (size_t i = 0; i < history; ++i) {
        const double w = std::exp(logits_h[i] - mx);
        total += w;
        for (size_t j = 0; j < d; ++j) o_rot[j] += w * static_cast<double>(hist_v[i * d + j]);
      }
      if (history > 0) {
        const std::vector<double> back =
            RotateInverseF64(o_rot, vp, cache.Rotation(KV::kValue, head));
        for (size_t j = 0; j < d; ++j) o[j] += back[j];
      }
      for (size_t j = 0; j < d; ++j) out[h * d + j] = o[j] / total;
    }
  }
}

std::vector<double> RelativeErrorPerHead(const float* out, const double* ref, int num_heads,
                                         int d) {
  std::vector<double> errors(static_cast<size_t>(num_heads));
  for (int h = 0; h < num_heads; ++h) {
    double max_diff = 0.0, max_ref = 0.0;
    for (int j = 0; j < d; ++j) {
      const size_t i = static_cast<size_t>(h) * static_cast<size_t>(d) + static_cast<size_t>(j);
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(out[i]) - ref[i]));
      max_ref = std::max(max_ref, std::fabs(ref[i]));
    }
    errors[static_cast<size_t>(h)] = max_ref > 0.0 ? max_diff / max_ref : max_diff;
  }
  return errors;
}

}  // namespace kvq::cpu
