// Highway decode-attention kernels, compiled once per target (HWY_COMPILE_ALL_ATTAINABLE).
//
// Layout of the work, per call (one KV head, its g query heads, n rows of one page or bf16 run):
//  1. logits: each key row is loaded (bf16 -> fp32, or unpacked and dequantized) one vector at
//     a time in registers and immediately multiplied into the accumulators of a batch of up to
//     8 query heads, so a row is decoded once for all heads of the GQA group. Small batches
//     (g = 1, 2) get 4 / g accumulators per head so there are always >= 4 independent chains.
//  2. softmax step: vector max, Highway's Exp (<= 1 ulp), vector sums.
//  3. values: for a block of channels the accumulators of the head batch stay in registers
//     while the n value rows stream through; each value vector is decoded once per block.
// MulAdd (fused where the target has FMA) is fine here: reduction order is free on this path
// (spec/cache.md §5) and dequantization q * scale + min is exact either way.
//
// Requires Highway 1.0.3 only.

#include "hwy_targets.h"  // first: the same target list as write_hwy.cc

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_internal.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention_hwy.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace kvq::cpu::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// One bf16 row: lanes [j0, j0 + N) widened exactly to fp32.
struct Bf16Source {
  const uint16_t* row;

  HWY_INLINE VF Load(DF df, size_t j0) const {
    const hn::Rebind<uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> d32;
    return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(d32, hn::LoadU(d16, row + j0))));
  }
};

// One packed history row: lanes [j0, j0 + N) unpacked and dequantized, code * scale + min.
// INT2 byte i holds channels i, d/4+i, d/2+i, 3d/4+i (2 bits each); INT4 byte i holds i and
// d/2+i: channel j sits in byte (j mod part) at bit offset bits * (j / part). The row's
// (scale, min) pairs come already widened to fp32, so each vector costs two broadcast loads.
struct AffineTokenSource {
  const uint8_t* codes;
  const float* scale;  // [d/G] fp32
  const float* min;    // [d/G] fp32
  size_t part_shift;   // log2(part), part = d*b/8 bytes
  size_t group_shift;  // log2(G)
  int bits;
  uint32_t mask;

  HWY_INLINE VF Load(DF df, size_t j0) const {
    const hn::Rebind<uint8_t, DF> d8;
    const hn::RebindToUnsigned<DF> d32;
    const hn::RebindToSigned<DF> di32;
    const size_t which = j0 >> part_shift;
    const size_t byte = j0 - (which << part_shift);
    const auto raw = hn::PromoteTo(d32, hn::LoadU(d8, codes + byte));
    const auto code = hn::And(hn::ShiftRightSame(raw, static_cast<int>(which) * bits),
                              hn::Set(d32, mask));
    const size_t g = j0 >> group_shift;
    return hn::MulAdd(hn::ConvertTo(df, hn::BitCast(di32, code)), hn::Set(df, scale[g]),
                      hn::Set(df, min[g]));
  }
};

// One fp32 row already decoded.
struct F32Source {
  const float* row;

  HWY_INLINE VF Load(DF df, size_t j0) const { return hn::LoadU(df, row + j0); }
};

size_t Log2(size_t x) {
  size_t log = 0;
  while ((size_t{1} << log) < x) ++log;
  return log;
}

// ---- Per format: a run of n history rows, and Row(i), the source of row i ----

class Bf16Run {
 public:
  Bf16Run(const HistoryRunView& rows, size_t, const WriteParams& p, std::vector<float>*)
      : rows_(reinterpret_cast<const uint16_t*>(rows.plane[0])),
        d_(static_cast<size_t>(p.head_dim)) {}
  HWY_INLINE Bf16Source Row(size_t i) const { return Bf16Source{rows_ + i * d_}; }

 private:
  const uint16_t* rows_;
  size_t d_;
};

// Every (scale, min) of the run is widened to fp32 once per call (into `widened`,
// [2, n, d/G]).
class AffineTokenRun {
 public:
  AffineTokenRun(const HistoryRunView& rows, size_t n, const WriteParams& p,
                 std::vector<float>* widened)
      : codes_(rows.plane[0]) {
    code_bytes_ = static_cast<size_t>(p.packed_bytes());
    groups_ = static_cast<size_t>(p.num_groups());
    row_.part_shift = Log2(code_bytes_);
    row_.group_shift = Log2(static_cast<size_t>(p.group));
    row_.bits = p.bits;
    row_.mask = static_cast<uint32_t>(p.levels());
    const size_t count = n * groups_;
    widened->resize(2 * count);
    scale_ = widened->data();
    min_ = scale_ + count;
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(rows.plane[1]);
    const uint16_t* mins = reinterpret_cast<const uint16_t*>(rows.plane[2]);
    for (size_t i = 0; i < count; ++i) {
      scale_[i] = F32FromBf16(scales[i]);
      min_[i] = F32FromBf16(mins[i]);
    }
  }

  HWY_INLINE AffineTokenSource Row(size_t i) const {
    AffineTokenSource s = row_;
    s.codes = codes_ + i * code_bytes_;
    s.scale = scale_ + i * groups_;
    s.min = min_ + i * groups_;
    return s;
  }

 private:
  const uint8_t* codes_;
  float* scale_ = nullptr;
  float* min_ = nullptr;
  size_t code_bytes_, groups_;
  AffineTokenSource row_{};
};

// A tile stores each channel's codes along the tokens, so a row's channels are G_k*b/8 bytes
// apart: the run is decoded once per call into fp32 rows (into `decoded`, [n, d]), the exact
// values code * scale + min (times n^ with a norm) of the codec, and read from there. Per tile,
// the channel-major bytes are transposed to [G_k*b/8][d] (bytes), then each token's codes come
// out lane-wise over the channels (shift and mask) and are dequantized with the tile's
// per-channel (scale, min) held as fp32 vectors.
class AffineTileRun {
 public:
  AffineTileRun(const HistoryRunView& rows, size_t n, const WriteParams& p,
                std::vector<float>* decoded)
      : d_(static_cast<size_t>(p.head_dim)) {
    const DF df;
    const hn::Rebind<uint8_t, DF> d8;
    const hn::RebindToSigned<DF> di;
    const size_t lanes = hn::Lanes(df);
    const size_t tile = static_cast<size_t>(p.tile_tokens());
    const size_t slice = static_cast<size_t>(p.tile_channel_bytes());
    const size_t offset = static_cast<size_t>(rows.tile_offset);
    const size_t tiles = (offset + n + tile - 1) / tile;
    const int norm_plane = p.norm ? LayoutOf(p).Find("norm") : -1;
    const uint16_t* norms =
        norm_plane >= 0 ? reinterpret_cast<const uint16_t*>(rows.plane[norm_plane]) : nullptr;
    const int bits = p.bits;
    const auto mask = hn::Set(di, static_cast<int32_t>(p.levels()));
    decoded->resize(n * d_ + 2 * d_);
    rows_ = decoded->data();
    float* sf = rows_ + n * d_;
    float* mf = sf + d_;
    staging_.resize(slice * d_);
    for (size_t t = 0; t < tiles; ++t) {
      const uint8_t* in = rows.plane[0] + t * d_ * slice;
      for (size_t j = 0; j < d_; ++j) {
        for (size_t i = 0; i < slice; ++i) staging_[i * d_ + j] = in[j * slice + i];
      }
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(rows.plane[1]) + t * d_;
      const uint16_t* mins = reinterpret_cast<const uint16_t*>(rows.plane[2]) + t * d_;
      for (size_t j = 0; j < d_; ++j) {
        sf[j] = F32FromBf16(scales[j]);
        mf[j] = F32FromBf16(mins[j]);
      }
      for (size_t r = 0; r < tile; ++r) {
        const size_t k = t * tile + r;  // token of the run's tiles
        if (k < offset || k >= offset + n) continue;
        const size_t i = k - offset;
        const uint8_t* bytes = staging_.data() + (r % slice) * d_;
        const int shift = static_cast<int>(r / slice) * bits;
        const VF factor = hn::Set(df, norms != nullptr ? F32FromBf16(norms[i]) : 1.0f);
        float* out = rows_ + i * d_;
        for (size_t j = 0; j < d_; j += lanes) {
          const auto raw = hn::PromoteTo(di, hn::LoadU(d8, bytes + j));
          const auto code = hn::And(hn::ShiftRightSame(raw, shift), mask);
          VF y = hn::Add(hn::Mul(hn::ConvertTo(df, code), hn::LoadU(df, sf + j)),
                         hn::LoadU(df, mf + j));
          if (norms != nullptr) y = hn::Mul(y, factor);
          hn::StoreU(y, df, out + j);
        }
      }
    }
  }
  HWY_INLINE F32Source Row(size_t i) const { return F32Source{rows_ + i * d_}; }

 private:
  size_t d_;
  float* rows_ = nullptr;
  std::vector<uint8_t> staging_;
};

// A format without a reader of its own above (fp8_e4m3 today): the run decoded once per call
// into fp32 rows by its codec's decode steps (formats.inc: DecodeRows with the stages of the
// best backend this CPU runs, bit-identical to every other backend's), read from there.
class CodecRun {
 public:
  CodecRun(const HistoryRunView& rows, size_t n, const WriteParams& p, std::vector<float>* decoded)
      : d_(static_cast<size_t>(p.head_dim)) {
    decoded->resize(n * d_);
    rows_ = decoded->data();
    DecodeRows(BestBackend(), p, rows, n, rows_);
  }
  HWY_INLINE F32Source Row(size_t i) const { return F32Source{rows_ + i * d_}; }

 private:
  size_t d_;
  float* rows_ = nullptr;
};

// The reader of each format: its own class where one is written above, else CodecRun.
template <Format F>
struct RunOf {
  using type = CodecRun;
};
template <>
struct RunOf<Format::kBf16> {
  using type = Bf16Run;
};
template <>
struct RunOf<Format::kAffineToken> {
  using type = AffineTokenRun;
};
template <>
struct RunOf<Format::kAffineTile> {
  using type = AffineTileRun;
};

// Calls fn(make_source) where make_source(i) is the source of row i of the run, decoded by the
// reader of p.format (RunOf).
template <class Fn>
HWY_INLINE void WithRowSources(const HistoryRunView& run, size_t n, const WriteParams& p,
                               std::vector<float>* scratch, const Fn& fn) {
  switch (p.format) {
#define KVQ_FORMAT(id, Name, tile_tokens, spec, summary)                   \
  case Format::k##Name: {                                                  \
    const typename RunOf<Format::k##Name>::type rows(run, n, p, scratch);  \
    fn([&rows](size_t i) { return rows.Row(i); });                         \
    return;                                                                \
  }
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  }
}

// out[h] = scale * (q[h] . row) for the HB heads of q (rows d apart).
template <size_t HB, class Source>
HWY_INLINE void DotHeads(DF df, const Source& row, const float* q, size_t d, float scale,
                         float* out, size_t out_stride) {
  // Independent chains per head: at least 4 per batch (latency), and at least 16 partial
  // sums per head (accuracy: fewer, longer fp32 chains cost ~1e-5 relative output error at
  // logits of magnitude ~50; see kAttentionOracleTolerance).
  constexpr size_t kForLatency = HB >= 4 ? 1 : 4 / HB;
  constexpr size_t kForAccuracy = HWY_LANES(float) >= 16 ? 1 : 16 / HWY_LANES(float);
  constexpr size_t kAcc = kForLatency > kForAccuracy ? kForLatency : kForAccuracy;
  const size_t lanes = hn::Lanes(df);
  const size_t vectors = d / lanes;
  VF acc[HB][kAcc];
  for (size_t h = 0; h < HB; ++h) {
    for (size_t a = 0; a < kAcc; ++a) acc[h][a] = hn::Zero(df);
  }
  size_t v = 0;
  for (; v + kAcc <= vectors; v += kAcc) {
    for (size_t a = 0; a < kAcc; ++a) {
      const size_t j0 = (v + a) * lanes;
      const VF x = row.Load(df, j0);
      for (size_t h = 0; h < HB; ++h) {
        acc[h][a] = hn::MulAdd(hn::LoadU(df, q + h * d + j0), x, acc[h][a]);
      }
    }
  }
  for (; v < vectors; ++v) {
    const size_t j0 = v * lanes;
    const VF x = row.Load(df, j0);
    for (size_t h = 0; h < HB; ++h) {
      acc[h][0] = hn::MulAdd(hn::LoadU(df, q + h * d + j0), x, acc[h][0]);
    }
  }
  for (size_t h = 0; h < HB; ++h) {
    VF sum = acc[h][0];
    for (size_t a = 1; a < kAcc; ++a) sum = hn::Add(sum, acc[h][a]);
    out[h * out_stride] = scale * hn::GetLane(hn::SumOfLanes(df, sum));
  }
}

// acc[h][block] += sum_i p[h][i] * row_i[block] for the HB heads, a block of channels at a
// time with the accumulators in registers.
template <size_t HB, class MakeSource>
HWY_INLINE void AccumulateHeads(DF df, const MakeSource& make_source, size_t n, size_t d,
                                const float* p, float* acc) {
  constexpr size_t kBlock = HB >= 8 ? 1 : (HB >= 4 ? 2 : 4);  // vectors per block
  const size_t lanes = hn::Lanes(df);
  const size_t vectors = d / lanes;
  for (size_t v0 = 0; v0 < vectors; v0 += kBlock) {
    const size_t block = vectors - v0 < kBlock ? vectors - v0 : kBlock;
    VF a[HB][kBlock];
    for (size_t h = 0; h < HB; ++h) {
      for (size_t b = 0; b < kBlock; ++b) {
        a[h][b] = b < block ? hn::LoadU(df, acc + h * d + (v0 + b) * lanes) : hn::Zero(df);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      const auto source = make_source(i);
      for (size_t b = 0; b < kBlock; ++b) {
        if (b >= block) break;
        const VF x = source.Load(df, (v0 + b) * lanes);
        for (size_t h = 0; h < HB; ++h) {
          a[h][b] = hn::MulAdd(hn::Set(df, p[h * n + i]), x, a[h][b]);
        }
      }
    }
    for (size_t h = 0; h < HB; ++h) {
      for (size_t b = 0; b < block; ++b) hn::StoreU(a[h][b], df, acc + h * d + (v0 + b) * lanes);
    }
  }
}

// Folds logits s [g, n] into (m, l, acc) and leaves exp(s - m_new) in s.
void SoftmaxStep(DF df, size_t g, size_t n, size_t d, float* s, float* m, float* l,
                 float* acc) {
  const size_t lanes = hn::Lanes(df);
  for (size_t h = 0; h < g; ++h) {
    float* row = s + h * n;
    float mx = m[h];
    size_t i = 0;
    if (n >= lanes) {
      VF vmax = hn::LoadU(df, row);
      for (i = lanes; i + lanes <= n; i += lanes) vmax = hn::Max(vmax, hn::LoadU(df, row + i));
      const float block_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
      mx = block_max > mx ? block_max : mx;
    }
    for (; i < n; ++i) mx = row[i] > mx ? row[i] : mx;

    const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                        : std::exp(m[h] - mx);
    const VF vmx = hn::Set(df, mx);
    VF vsum = hn::Zero(df);
    for (i = 0; i + lanes <= n; i += lanes) {
      const VF e = hn::Exp(df, hn::Sub(hn::LoadU(df, row + i), vmx));
      hn::StoreU(e, df, row + i);
      vsum = hn::Add(vsum, e);
    }
    float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
    for (; i < n; ++i) {
      row[i] = std::exp(row[i] - mx);
      sum += row[i];
    }
    l[h] = l[h] * alpha + sum;
    m[h] = mx;
    const VF valpha = hn::Set(df, alpha);
    float* a = acc + h * d;
    for (size_t j = 0; j < d; j += lanes) hn::StoreU(hn::Mul(hn::LoadU(df, a + j), valpha), df, a + j);
  }
}

// Runs body(h0, integral_constant<HB>) over head batches (8 on AVX-512, then 4, 2, 1) covering [0, g).
// Batches of 8 only with 32 vector registers (AVX-512), so the accumulators stay in registers.
template <class Body>
HWY_INLINE void ForEachHeadBatch(size_t g, const Body& body) {
  size_t h0 = 0;
  if (HWY_LANES(float) >= 16) {
    for (; h0 + 8 <= g; h0 += 8) body(h0, std::integral_constant<size_t, 8>());
  }
  for (; h0 + 4 <= g; h0 += 4) body(h0, std::integral_constant<size_t, 4>());
  if (h0 + 2 <= g) { body(h0, std::integral_constant<size_t, 2>()); h0 += 2; }
  if (h0 + 1 <= g) { body(h0, std::integral_constant<size_t, 1>()); h0 += 1; }
}

template <class MakeKey, class MakeValue>
HWY_INLINE void Update(const float* q, size_t g, const MakeKey& make_key,
                       const MakeValue& make_value, size_t n, size_t d, float scale,
                       float* scratch, float* m, float* l, float* acc) {
  const DF df;
  for (size_t i = 0; i < n; ++i) {
    const auto key = make_key(i);
    ForEachHeadBatch(g, [&](size_t h0, auto hb) {
      DotHeads<decltype(hb)::value>(df, key, q + h0 * d, d, scale, scratch + h0 * n + i, n);
    });
  }
  SoftmaxStep(df, g, n, d, scratch, m, l, acc);
  ForEachHeadBatch(g, [&](size_t h0, auto hb) {
    AccumulateHeads<decltype(hb)::value>(df, make_value, n, d, scratch + h0 * n, acc + h0 * d);
  });
}

void Bf16Update(const float* q, size_t g, Bf16RowsView k, Bf16RowsView v, size_t n, int d,
                float scale, float* scratch, float* m, float* l, float* acc) {
  const auto make_key = [&](size_t i) { return Bf16Source{k.rows + i * k.stride}; };
  const auto make_value = [&](size_t i) { return Bf16Source{v.rows + i * v.stride}; };
  Update(q, g, make_key, make_value, n, static_cast<size_t>(d), scale, scratch, m, l, acc);
}

void HistoryUpdate(const float* q_rot, size_t g, HistoryRunView k, HistoryRunView v, size_t n,
                   const WriteParams& kp, const WriteParams& vp, float scale, float* scratch,
                   float* m, float* l, float* acc) {
  thread_local std::vector<float> key_metadata, value_metadata;
  const size_t d = static_cast<size_t>(kp.head_dim);
  WithRowSources(k, n, kp, &key_metadata, [&](const auto& make_key) {
    WithRowSources(v, n, vp, &value_metadata, [&](const auto& make_value) {
      Update(q_rot, g, make_key, make_value, n, d, scale, scratch, m, l, acc);
    });
  });
}

AttentionKernels MakeAttentionKernels() {
  // A vector must not straddle a (scale, min) group or an INT2 quarter: N | G and N | d/4.
  const size_t lanes = hn::Lanes(DF());
  HWY_ASSERT(lanes <= 16);  // G >= 32 and d/4 >= 16 for every supported d, G
  AttentionKernels kernels;
  kernels.bf16_update = &Bf16Update;
  kernels.history_update = &HistoryUpdate;
  return kernels;
}
KVQ_HWY_REGISTER(AttentionKernels, MakeAttentionKernels);

}  // namespace HWY_NAMESPACE
}  // namespace kvq::cpu::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::cpu::internal {

std::vector<int64_t> HwyAttentionTargets() {
  return TargetMakers<AttentionKernels>::Get().Targets();
}

AttentionKernels HwyAttentionKernels(int64_t hwy_target) {
  return TargetMakers<AttentionKernels>::Get().Make(hwy_target, "decode-attention kernels");
}

}  // namespace kvq::cpu::internal
#endif  // HWY_ONCE
