// Highway implementation of every write-path stage, compiled once per Highway target
// (HWY_COMPILE_ALL_ATTAINABLE: the portable target (HWY_SCALAR with GCC 12, else EMU128), SSSE3,
// SSE4, AVX2, AVX3, AVX3_DL on x86), each one
// bit-identical to the scalar reference in write_scalar.cc.
//
// How the bits are kept identical:
//  - rotation: lanes run over output columns j, the loop over i stays ascending, Mul then Add
//    (never MulAdd, which is fused on some targets only);
//  - FWHT: the same butterflies per element in the same stage order (a+b is commutative in
//    IEEE arithmetic, so computing a lane's sum as partner+self changes nothing);
//  - clip: the order statistic is found by an exact radix select on the bits of |x|;
//  - quantize: exact min/max, the scalar metadata math, IEEE division, clamp then
//    round-half-to-even by adding and subtracting 2^23 (exact for codes 0..15);
//  - pack/unpack/dequantize are integer or exact operations;
//  - norm: the squares are lane-wise, the tree's strides >= the vector length add whole
//    vectors (a[j] + a[j+h], the same pairs as the scalar loop), the last strides and the
//    correctly rounded sqrt run on one row's scalars; the division is IEEE;
//  - tiles: per-channel min/max over the tile's rows are lane-wise (exact), the metadata math is
//    the scalar's per channel, codes as in quantize; packing along tokens is integer;
//  - codebook: segment norms as the norm (squares lane-wise, the tree's pairs, sqrt and the
//    division IEEE), codes by a lane-wise binary search over the boundaries (it counts the
//    boundaries strictly below u, as the scalar's compare-and-add does), centroids gathered,
//    packing integer (bit streams in 64-bit lanes of eight codes).
//
// Requires Highway 1.0.3 only (no LoadN, ReduceSum or HWY_EXPORT_T).

#include "hwy_targets.h"  // first: fixes the target list

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"
#include "kvq/cpu_ref/kernels.h"
#include "write_internal.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "write_hwy.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace kvq::cpu::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;

// ------------------------------------------------------------------ dense rotation

// Accumulates kRows rows x kCols column vectors of y = x·R in registers, so one load of R
// feeds kRows rows. Per output element: acc = +0, then acc = acc + x[i]*R[i][j], i ascending.
template <size_t kRows, size_t kCols>
HWY_INLINE void RotateTile(const float* HWY_RESTRICT x, const float* HWY_RESTRICT r,
                           float* HWY_RESTRICT y, size_t d, size_t col0) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  using V = hn::Vec<DF>;
  V acc[kRows][kCols];
  for (size_t row = 0; row < kRows; ++row) {
    for (size_t c = 0; c < kCols; ++c) acc[row][c] = hn::Zero(df);
  }
  for (size_t i = 0; i < d; ++i) {
    V rv[kCols];
    for (size_t c = 0; c < kCols; ++c) rv[c] = hn::LoadU(df, r + i * d + col0 + c * lanes);
    for (size_t row = 0; row < kRows; ++row) {
      const V xi = hn::Set(df, x[row * d + i]);
      for (size_t c = 0; c < kCols; ++c) acc[row][c] = hn::Add(acc[row][c], hn::Mul(xi, rv[c]));
    }
  }
  for (size_t row = 0; row < kRows; ++row) {
    for (size_t c = 0; c < kCols; ++c) hn::StoreU(acc[row][c], df, y + row * d + col0 + c * lanes);
  }
}

// Wide register files (AVX-512: 32 registers) hold a 4x4 tile; the others a 4x2 tile.
#if HWY_TARGET <= HWY_AVX3
constexpr size_t kRotateCols = 4;
#else
constexpr size_t kRotateCols = 2;
#endif
constexpr size_t kRotateRows = 4;

void RotateDense(const float* x, const float* r, float* y, size_t n, const WriteParams& p) {
  const DF df;
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile_cols = kRotateCols * hn::Lanes(df);
  // d is 64, 128 or 256 and a vector holds at most 16 floats, so d is a multiple of the tile.
  HWY_ASSERT(d % tile_cols == 0);
  size_t row = 0;
  for (; row + kRotateRows <= n; row += kRotateRows) {
    for (size_t col = 0; col < d; col += tile_cols) {
      RotateTile<kRotateRows, kRotateCols>(x + row * d, r, y + row * d, d, col);
    }
  }
  for (; row < n; ++row) {
    for (size_t col = 0; col < d; col += tile_cols) {
      RotateTile<1, kRotateCols>(x + row * d, r, y + row * d, d, col);
    }
  }
}

// ------------------------------------------------------------------ FWHT

// Strides below the vector length pair lanes of one vector: lane k meets lane k^h; the lane
// with bit h clear keeps self+partner, the other partner-self (= x[k-h] - x[k]).
using IndicesF = decltype(hn::SetTableIndices(DF(), static_cast<const int32_t*>(nullptr)));

struct InVectorStages {
  static constexpr size_t kMaxStages = 4;  // up to 16 float lanes
  size_t count = 0;
  IndicesF partner[kMaxStages];
  hn::Mask<DF> upper[kMaxStages];
};

HWY_INLINE InVectorStages MakeInVectorStages(size_t lanes) {
  const DF df;
  const DI di;
  InVectorStages stages;
  HWY_ALIGN int32_t idx[hn::MaxLanes(DF())];
  for (size_t h = 1; h < lanes; h *= 2) {
    HWY_ASSERT(stages.count < InVectorStages::kMaxStages);
    for (size_t k = 0; k < lanes; ++k) idx[k] = static_cast<int32_t>(k ^ h);
    stages.partner[stages.count] = hn::SetTableIndices(df, idx);
    const auto bit_set = hn::Ne(hn::And(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(h))),
                                hn::Zero(di));
    stages.upper[stages.count] = hn::RebindMask(df, bit_set);
    ++stages.count;
  }
  return stages;
}

void Fwht(float* x, size_t n, const WriteParams& p) {
  const DF df;
  using V = hn::Vec<DF>;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t block = static_cast<size_t>(p.fwht_block());
  // Blocks are at least 16 floats, a vector at most 16: every block is whole vectors.
  HWY_ASSERT(block % lanes == 0);
  const V scale = hn::Set(df, p.fwht_scale());
  const InVectorStages stages = MakeInVectorStages(lanes);
  const bool scale_after_in_vector = (block == lanes);
  for (size_t row = 0; row < n; ++row) {
    for (size_t start = 0; start < d; start += block) {
      float* b = x + row * d + start;
      // Strides 1 .. lanes/2 touch one vector only, so all of them run on a loaded vector.
      for (size_t k = 0; k < block; k += lanes) {
        V v = hn::LoadU(df, b + k);
        for (size_t s = 0; s < stages.count; ++s) {
          const V partner = hn::TableLookupLanes(v, stages.partner[s]);
          v = hn::IfThenElse(stages.upper[s], hn::Sub(partner, v), hn::Add(v, partner));
        }
        if (scale_after_in_vector) v = hn::Mul(v, scale);
        hn::StoreU(v, df, b + k);
      }
      // Strides lanes .. block/2 pair whole vectors; the last stage also applies the scale.
      for (size_t h = lanes; h < block; h *= 2) {
        const bool last = (2 * h == block);
        for (size_t k = 0; k < block; k += 2 * h) {
          for (size_t m = 0; m < h; m += lanes) {
            const V a = hn::LoadU(df, b + k + m);
            const V c = hn::LoadU(df, b + k + m + h);
            V sum = hn::Add(a, c);
            V difference = hn::Sub(a, c);
            if (last) {
              sum = hn::Mul(sum, scale);
              difference = hn::Mul(difference, scale);
            }
            hn::StoreU(sum, df, b + k + m);
            hn::StoreU(difference, df, b + k + m + h);
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ bit reversal

void Bitrev(const float* x, float* y, size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const int32_t* table = BitReverseTable(p.head_dim);
  for (size_t row = 0; row < n; ++row) {
    for (size_t j = 0; j < d; j += lanes) {
      const auto index = hn::LoadU(di, table + j);
      hn::StoreU(hn::GatherIndex(df, x + row * d, index), df, y + row * d + j);
    }
  }
}

// ------------------------------------------------------------------ clip

// The k-th smallest |x| (0-based) by a radix select on the bits of |x|: for non-negative
// floats the uint32 order is the value order (subnormals and +0 included), and every finite
// |x| is below 2^31, so signed int32 compares serve. tau is the largest c with
// #{|x| < c} <= k; built greedily from bit 30 down because #{|x| < c} grows with c.
HWY_INLINE float OrderStatisticOfMagnitudes(const float* HWY_RESTRICT xr, size_t d, size_t k,
                                            int32_t* HWY_RESTRICT bits) {
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  for (size_t j = 0; j < d; j += lanes) {
    hn::StoreU(hn::BitCast(di, hn::Abs(hn::LoadU(df, xr + j))), di, bits + j);
  }
  int32_t answer = 0;
  for (int bit = 30; bit >= 0; --bit) {
    const int32_t candidate = answer | (int32_t{1} << bit);
    const auto c = hn::Set(di, candidate);
    size_t below = 0;
    for (size_t j = 0; j < d; j += lanes) {
      below += hn::CountTrue(di, hn::Lt(hn::LoadU(di, bits + j), c));
    }
    if (below <= k) answer = candidate;
  }
  float tau;
  std::memcpy(&tau, &answer, sizeof tau);
  return tau;
}

void Clip(float* x, float* tau, size_t n, const WriteParams& p) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t k = ClipRank(p.clip, p.head_dim);
  HWY_ALIGN int32_t bits[256];
  HWY_ASSERT(d <= 256);
  for (size_t row = 0; row < n; ++row) {
    float* xr = x + row * d;
    const float t = OrderStatisticOfMagnitudes(xr, d, k, bits);
    tau[row] = t;
    const auto upper = hn::Set(df, t);
    const auto lower = hn::Neg(upper);
    for (size_t j = 0; j < d; j += lanes) {
      const auto v = hn::LoadU(df, xr + j);
      const auto clipped =
          hn::IfThenElse(hn::Gt(v, upper), upper, hn::IfThenElse(hn::Lt(v, lower), lower, v));
      hn::StoreU(clipped, df, xr + j);
    }
  }
}

// ------------------------------------------------------------------ quantize

void Quantize(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
              const WriteParams& p) {
  const DF df;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const size_t groups = d / group;
  const float levels = static_cast<float>(p.levels());
  HWY_ASSERT(group % lanes == 0);
  const DI di;
  const auto zero = hn::Zero(df);
  const auto top = hn::Set(df, levels);
  const auto round_magic = hn::Set(df, 8388608.0f);  // 2^23
  for (size_t row = 0; row < n; ++row) {
    for (size_t g = 0; g < groups; ++g) {
      const float* xg = x + row * d + g * group;
      uint8_t* qg = codes + row * d + g * group;
      auto lo_v = hn::LoadU(df, xg);
      auto hi_v = lo_v;
      for (size_t j = lanes; j < group; j += lanes) {
        const auto v = hn::LoadU(df, xg + j);
        lo_v = hn::Min(lo_v, v);
        hi_v = hn::Max(hi_v, v);
      }
      // Min/max are exact; only the sign of a zero may depend on the order, and + 0.0f
      // makes it +0 as the spec says.
      const float lo = hn::GetLane(hn::MinOfLanes(df, lo_v)) + 0.0f;
      const float hi = hn::GetLane(hn::MaxOfLanes(df, hi_v)) + 0.0f;
      const float s = (hi - lo) / levels;
      const uint16_t scale_bits = Bf16FromF32(s);
      const uint16_t min_bits = Bf16FromF32(lo);
      scale[row * groups + g] = scale_bits;
      min[row * groups + g] = min_bits;
      const float sf = F32FromBf16(scale_bits);
      const float mf = F32FromBf16(min_bits);
      if (sf == 0.0f) {
        std::memset(qg, 0, group);
        continue;
      }
      const auto sf_v = hn::Set(df, sf);
      const auto mf_v = hn::Set(df, mf);
      for (size_t j = 0; j < group; j += lanes) {
        auto t = hn::Div(hn::Sub(hn::LoadU(df, xg + j), mf_v), sf_v);
        // Clamping to the integers [0, L] before rounding gives the same code as rounding
        // first, and keeps the conversion in range.
        t = hn::Min(hn::Max(t, zero), top);
        // Round half to even by adding and subtracting 2^23: for 0 <= t <= 15 the sum's unit
        // in the last place is 1, so the addition rounds t to an integer (ties to even under
        // the default rounding mode) and the subtraction is exact. NearestInt is avoided: on
        // Highway's portable targets it adds 0.5 and truncates, and 0.49999997f + 0.5f is 1.
        const auto q = hn::ConvertTo(di, hn::Sub(hn::Add(t, round_magic), round_magic));
        hn::StoreU(hn::DemoteTo(d8, q), d8, qg + j);
      }
    }
  }
}

// ------------------------------------------------------------------ norm

void Norm(float* x, uint16_t* norm, size_t n, const WriteParams& p) {
  const DF df;
  using V = hn::Vec<DF>;
  const size_t lanes = hn::Lanes(df);
  const size_t m = static_cast<size_t>(p.norm_span());
  const size_t padded = static_cast<size_t>(NormTreeSize(static_cast<int64_t>(m)));
  // m = d * heads with d >= 64: whole vectors, and padded >= m is a power of two >= 64.
  HWY_ASSERT(m % lanes == 0 && padded % lanes == 0);
  std::vector<float> a(padded);
  for (size_t row = 0; row < n; ++row) {
    float* xr = x + row * m;
    for (size_t j = 0; j < m; j += lanes) {
      const V v = hn::LoadU(df, xr + j);
      hn::StoreU(hn::Mul(v, v), df, a.data() + j);
    }
    for (size_t j = m; j < padded; ++j) a[j] = +0.0f;
    size_t h = padded / 2;
    for (; h >= lanes; h /= 2) {
      for (size_t j = 0; j < h; j += lanes) {
        hn::StoreU(hn::Add(hn::LoadU(df, a.data() + j), hn::LoadU(df, a.data() + j + h)), df,
                   a.data() + j);
      }
    }
    for (; h >= 1; h /= 2) {
      for (size_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
    }
    const float length = std::sqrt(a[0]);
    const uint16_t bits = Bf16FromF32(length);
    norm[row] = bits;
    const float stored = F32FromBf16(bits);
    if (stored == 0.0f) {
      for (size_t j = 0; j < m; j += lanes) hn::StoreU(hn::Zero(df), df, xr + j);
      continue;
    }
    const V divisor = hn::Set(df, stored);
    for (size_t j = 0; j < m; j += lanes) {
      hn::StoreU(hn::Div(hn::LoadU(df, xr + j), divisor), df, xr + j);
    }
  }
}

void Denorm(float* y, const uint16_t* norm, size_t n, const WriteParams& p) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  for (size_t row = 0; row < n; ++row) {
    const auto factor = hn::Set(df, F32FromBf16(norm[row]));
    float* yr = y + row * d;
    for (size_t j = 0; j < d; j += lanes) hn::StoreU(hn::Mul(hn::LoadU(df, yr + j), factor), df, yr + j);
  }
}

// ------------------------------------------------------------------ tiles

// Tile t's rows [t*G_k, (t+1)*G_k): lanes run over channels, the loop over the tile's rows.
void QuantizeTile(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                  const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  using V = hn::Vec<DF>;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const float levels = static_cast<float>(p.levels());
  HWY_ASSERT(d % lanes == 0 && d <= 256);
  HWY_ALIGN float lo[256], hi[256], sf[256], mf[256];
  const V zero = hn::Zero(df);
  const V top = hn::Set(df, levels);
  const V round_magic = hn::Set(df, 8388608.0f);  // 2^23
  for (size_t t = 0; t < n / tile; ++t) {
    const float* xt = x + t * tile * d;
    for (size_t j = 0; j < d; j += lanes) {
      V lo_v = hn::LoadU(df, xt + j);
      V hi_v = lo_v;
      for (size_t r = 1; r < tile; ++r) {
        const V v = hn::LoadU(df, xt + r * d + j);
        lo_v = hn::Min(lo_v, v);
        hi_v = hn::Max(hi_v, v);
      }
      hn::Store(lo_v, df, lo + j);
      hn::Store(hi_v, df, hi + j);
    }
    // The metadata of each channel exactly as the scalar computes it.
    for (size_t j = 0; j < d; ++j) {
      const float l = lo[j] + 0.0f;
      const float h = hi[j] + 0.0f;
      const float s = (h - l) / levels;
      const uint16_t scale_bits = Bf16FromF32(s);
      const uint16_t min_bits = Bf16FromF32(l);
      scale[t * d + j] = scale_bits;
      min[t * d + j] = min_bits;
      sf[j] = F32FromBf16(scale_bits);
      mf[j] = F32FromBf16(min_bits);
    }
    for (size_t r = 0; r < tile; ++r) {
      const float* xr = xt + r * d;
      uint8_t* qr = codes + (t * tile + r) * d;
      for (size_t j = 0; j < d; j += lanes) {
        const V s = hn::Load(df, sf + j);
        const auto nonzero = hn::Ne(s, zero);
        // A zero scale divides by 1 instead, and the code is then forced to 0.
        const V divisor = hn::IfThenElse(nonzero, s, hn::Set(df, 1.0f));
        V q = hn::Div(hn::Sub(hn::LoadU(df, xr + j), hn::Load(df, mf + j)), divisor);
        q = hn::Min(hn::Max(q, zero), top);
        q = hn::IfThenElseZero(nonzero, hn::Sub(hn::Add(q, round_magic), round_magic));
        hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, q)), d8, qr + j);
      }
    }
  }
}

// Packing along the tokens: the bytes of (token slice i, every channel) are formed lane-wise
// over the channels into a [slice][d] staging tile, which is then transposed into the
// channel-major [d][slice] layout.
void PackTile(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p) {
  const hn::CappedTag<uint8_t, 16> d8;
  const size_t lanes = hn::Lanes(d8);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = tile / per_byte;
  HWY_ASSERT(d % lanes == 0);
  std::vector<uint8_t> staging(slice * d);
  for (size_t t = 0; t < n / tile; ++t) {
    const uint8_t* ct = codes + t * tile * d;
    for (size_t i = 0; i < slice; ++i) {
      for (size_t j = 0; j < d; j += lanes) {
        auto byte = hn::LoadU(d8, ct + i * d + j);
        if (p.bits == 2) {
          byte = hn::Or(hn::Or(byte, hn::ShiftLeft<2>(hn::LoadU(d8, ct + (slice + i) * d + j))),
                        hn::Or(hn::ShiftLeft<4>(hn::LoadU(d8, ct + (2 * slice + i) * d + j)),
                               hn::ShiftLeft<6>(hn::LoadU(d8, ct + (3 * slice + i) * d + j))));
        } else {
          byte = hn::Or(byte, hn::ShiftLeft<4>(hn::LoadU(d8, ct + (slice + i) * d + j)));
        }
        hn::StoreU(byte, d8, staging.data() + i * d + j);
      }
    }
    uint8_t* out = packed + t * d * slice;
    for (size_t j = 0; j < d; ++j) {
      for (size_t i = 0; i < slice; ++i) out[j * slice + i] = staging[i * d + j];
    }
  }
}

void UnpackTile(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p) {
  const hn::CappedTag<uint8_t, 16> d8;
  const size_t lanes = hn::Lanes(d8);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = tile / per_byte;
  HWY_ASSERT(d % lanes == 0);
  std::vector<uint8_t> staging(slice * d);
  for (size_t t = 0; t < n / tile; ++t) {
    const uint8_t* in = packed + t * d * slice;
    for (size_t j = 0; j < d; ++j) {
      for (size_t i = 0; i < slice; ++i) staging[i * d + j] = in[j * slice + i];
    }
    uint8_t* ct = codes + t * tile * d;
    for (size_t i = 0; i < slice; ++i) {
      for (size_t j = 0; j < d; j += lanes) {
        const auto byte = hn::LoadU(d8, staging.data() + i * d + j);
        if (p.bits == 2) {
          const auto mask = hn::Set(d8, uint8_t{3});
          hn::StoreU(hn::And(byte, mask), d8, ct + i * d + j);
          hn::StoreU(hn::And(hn::ShiftRight<2>(byte), mask), d8, ct + (slice + i) * d + j);
          hn::StoreU(hn::And(hn::ShiftRight<4>(byte), mask), d8, ct + (2 * slice + i) * d + j);
          hn::StoreU(hn::ShiftRight<6>(byte), d8, ct + (3 * slice + i) * d + j);
        } else {
          hn::StoreU(hn::And(byte, hn::Set(d8, uint8_t{15})), d8, ct + i * d + j);
          hn::StoreU(hn::ShiftRight<4>(byte), d8, ct + (slice + i) * d + j);
        }
      }
    }
  }
}

void DequantizeTile(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                    size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  HWY_ASSERT(d % lanes == 0 && d <= 256);
  HWY_ALIGN float sf[256], mf[256];
  for (size_t t = 0; t < n / tile; ++t) {
    for (size_t j = 0; j < d; ++j) {
      sf[j] = F32FromBf16(scale[t * d + j]);
      mf[j] = F32FromBf16(min[t * d + j]);
    }
    for (size_t r = t * tile; r < (t + 1) * tile; ++r) {
      for (size_t j = 0; j < d; j += lanes) {
        const auto q = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, codes + r * d + j)));
        hn::StoreU(hn::Add(hn::Mul(q, hn::Load(df, sf + j)), hn::Load(df, mf + j)), df,
                   y + r * d + j);
      }
    }
  }
}

// ------------------------------------------------------------------ pack / unpack

// The byte slices of a row are 16, 32 or 64 bytes: full vectors where they fit, else 16.
template <class D8>
HWY_INLINE void PackRows(D8 d8, const uint8_t* codes, uint8_t* packed, size_t n, size_t d,
                         int bits) {
  const size_t lanes = hn::Lanes(d8);
  if (bits == 2) {
    const size_t slice = d / 4;
    for (size_t row = 0; row < n; ++row) {
      const uint8_t* c = codes + row * d;
      uint8_t* out = packed + row * slice;
      for (size_t i = 0; i < slice; i += lanes) {
        const auto c0 = hn::LoadU(d8, c + i);
        const auto c1 = hn::LoadU(d8, c + slice + i);
        const auto c2 = hn::LoadU(d8, c + 2 * slice + i);
        const auto c3 = hn::LoadU(d8, c + 3 * slice + i);
        const auto byte = hn::Or(hn::Or(c0, hn::ShiftLeft<2>(c1)),
                                 hn::Or(hn::ShiftLeft<4>(c2), hn::ShiftLeft<6>(c3)));
        hn::StoreU(byte, d8, out + i);
      }
    }
  } else {
    const size_t slice = d / 2;
    for (size_t row = 0; row < n; ++row) {
      const uint8_t* c = codes + row * d;
      uint8_t* out = packed + row * slice;
      for (size_t i = 0; i < slice; i += lanes) {
        const auto byte =
            hn::Or(hn::LoadU(d8, c + i), hn::ShiftLeft<4>(hn::LoadU(d8, c + slice + i)));
        hn::StoreU(byte, d8, out + i);
      }
    }
  }
}

template <class D8>
HWY_INLINE void UnpackRows(D8 d8, const uint8_t* packed, uint8_t* codes, size_t n, size_t d,
                           int bits) {
  const size_t lanes = hn::Lanes(d8);
  if (bits == 2) {
    const size_t slice = d / 4;
    const auto mask = hn::Set(d8, uint8_t{3});
    for (size_t row = 0; row < n; ++row) {
      const uint8_t* in = packed + row * slice;
      uint8_t* c = codes + row * d;
      for (size_t i = 0; i < slice; i += lanes) {
        const auto byte = hn::LoadU(d8, in + i);
        hn::StoreU(hn::And(byte, mask), d8, c + i);
        hn::StoreU(hn::And(hn::ShiftRight<2>(byte), mask), d8, c + slice + i);
        hn::StoreU(hn::And(hn::ShiftRight<4>(byte), mask), d8, c + 2 * slice + i);
        hn::StoreU(hn::ShiftRight<6>(byte), d8, c + 3 * slice + i);
      }
    }
  } else {
    const size_t slice = d / 2;
    const auto mask = hn::Set(d8, uint8_t{15});
    for (size_t row = 0; row < n; ++row) {
      const uint8_t* in = packed + row * slice;
      uint8_t* c = codes + row * d;
      for (size_t i = 0; i < slice; i += lanes) {
        const auto byte = hn::LoadU(d8, in + i);
        hn::StoreU(hn::And(byte, mask), d8, c + i);
        hn::StoreU(hn::ShiftRight<4>(byte), d8, c + slice + i);
      }
    }
  }
}

void Pack(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slice = d * static_cast<size_t>(p.bits) / 8;
  const hn::ScalableTag<uint8_t> full;
  if (slice % hn::Lanes(full) == 0) {
    PackRows(full, codes, packed, n, d, p.bits);
  } else {
    PackRows(hn::CappedTag<uint8_t, 16>(), codes, packed, n, d, p.bits);
  }
}

void Unpack(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slice = d * static_cast<size_t>(p.bits) / 8;
  const hn::ScalableTag<uint8_t> full;
  if (slice % hn::Lanes(full) == 0) {
    UnpackRows(full, packed, codes, n, d, p.bits);
  } else {
    UnpackRows(hn::CappedTag<uint8_t, 16>(), packed, codes, n, d, p.bits);
  }
}

// ------------------------------------------------------------------ dequantize

void Dequantize(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const size_t groups = d / group;
  for (size_t row = 0; row < n; ++row) {
    for (size_t g = 0; g < groups; ++g) {
      const auto sf = hn::Set(df, F32FromBf16(scale[row * groups + g]));
      const auto mf = hn::Set(df, F32FromBf16(min[row * groups + g]));
      const size_t base = row * d + g * group;
      for (size_t j = 0; j < group; j += lanes) {
        const auto q = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, codes + base + j)));
        hn::StoreU(hn::Add(hn::Mul(q, sf), mf), df, y + base + j);
      }
    }
  }
}

// ------------------------------------------------------------------ fp8_e4m3

// E4m3FromF32 lane-wise on x / s^ (IEEE Div): the same integer steps on the fp32 bits (bias
// add and 20-bit shift for the normal range, saturation at 448), and for the subnormal range
// |v| * 512 (exact) rounded half to even by adding and subtracting 2^23.
void QuantizeFp8(const float* x, uint8_t* codes, size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t count = n * static_cast<size_t>(p.head_dim);
  HWY_ASSERT(count % lanes == 0);  // d is a multiple of every vector length
  const auto scale = hn::Set(df, p.head_scale);
  const auto abs_mask = hn::Set(di, 0x7fffffff);
  const auto sign_bit = hn::Set(di, 0x80);
  const auto max_bits = hn::Set(di, static_cast<int32_t>(kE4m3MaxBits));
  const auto min_normal_bits = hn::Set(di, static_cast<int32_t>(kE4m3MinNormalBits));
  const auto round_bias = hn::Set(di, 0x7ffff);
  const auto one = hn::Set(di, 1);
  const auto rebias = hn::Set(di, (127 - 7) << 3);
  const auto saturated = hn::Set(di, 0x7e);
  const auto subnormal_unit = hn::Set(df, 512.0f);
  const auto round_magic = hn::Set(df, 8388608.0f);
  for (size_t i = 0; i < count; i += lanes) {
    const auto v = hn::BitCast(di, hn::Div(hn::LoadU(df, x + i), scale));
    const auto sign = hn::And(hn::ShiftRight<24>(v), sign_bit);  // arithmetic: bit 31 -> bit 7
    const auto a = hn::And(v, abs_mask);
    const auto normal = hn::Sub(
        hn::ShiftRight<20>(hn::Add(hn::Add(a, round_bias), hn::And(hn::ShiftRight<20>(a), one))),
        rebias);
    const auto is_subnormal = hn::Lt(a, min_normal_bits);
    // Only subnormal lanes reach the float rounding (others would overflow the int convert).
    const auto small = hn::IfThenElseZero(hn::RebindMask(df, is_subnormal), hn::BitCast(df, a));
    const auto subnormal = hn::ConvertTo(
        di, hn::Sub(hn::Add(hn::Mul(small, subnormal_unit), round_magic), round_magic));
    auto magnitude = hn::IfThenElse(is_subnormal, subnormal, normal);
    magnitude = hn::IfThenElse(hn::Lt(a, max_bits), magnitude, saturated);
    hn::StoreU(hn::DemoteTo(d8, hn::Or(magnitude, sign)), d8, codes + i);
  }
}

// Every code's value from the generated table (tables.inc: kE4m3Values, F32FromE4m3's bits),
// gathered lane-wise, times s^.
void DequantizeFp8(const uint8_t* codes, float* y, size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t count = n * static_cast<size_t>(p.head_dim);
  HWY_ASSERT(count % lanes == 0);
  const int32_t* value_bits = reinterpret_cast<const int32_t*>(tables::kE4m3Values);
  const auto scale = hn::Set(df, p.head_scale);
  for (size_t i = 0; i < count; i += lanes) {
    const auto index = hn::PromoteTo(di, hn::LoadU(d8, codes + i));
    const auto value = hn::BitCast(df, hn::GatherIndex(di, value_bits, index));
    hn::StoreU(hn::Mul(scale, value), df, y + i);
  }
}

// ------------------------------------------------------------------ codebook (spec 1.3)
// Segments start at any even channel and hold any even count m <= d, so each segment is
// staged in buffers padded to whole vectors (zeros past m) and only its m results are copied
// out. The arithmetic per value is the scalar's: IEEE squares, the same tree pairs, correctly
// rounded sqrt, IEEE division and products; codes are counts (a binary search that moves up
// only when t < u counts the boundaries strictly below u exactly); packing is integer.

// Scratch of one stage call: staging buffers of the largest segment (d values) rounded up to
// whole vectors of every lane type used.
struct CodebookScratch {
  explicit CodebookScratch(size_t d)
      : padded(d + 8 * hn::Lanes(hn::ScalableTag<uint8_t>())),
        f(padded), g(padded), tree(padded), i32(padded), bytes(padded), out_bytes(padded),
        words(padded), out_words(padded) {}
  size_t padded;
  std::vector<float> f, g, tree;
  std::vector<int32_t> i32;
  std::vector<uint8_t> bytes, out_bytes;
  std::vector<uint64_t> words, out_words;
};

size_t RoundUp(size_t v, size_t multiple) { return (v + multiple - 1) / multiple * multiple; }

// sqrtf of the tree sum of v[0..m)'s squares (numerics.md §5.1): squares lane-wise over
// whole vectors of the segment, the rest one by one; strides >= the vector length add whole
// vectors (the scalar's pairs), the last strides run on scalars.
HWY_INLINE float TreeLength(const float* v, size_t m, float* a) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t padded = static_cast<size_t>(NormTreeSize(static_cast<int64_t>(m)));
  size_t j = 0;
  for (; j + lanes <= m; j += lanes) {
    const auto x = hn::LoadU(df, v + j);
    hn::StoreU(hn::Mul(x, x), df, a + j);
  }
  for (; j < m; ++j) a[j] = v[j] * v[j];
  for (; j < padded; ++j) a[j] = +0.0f;
  size_t h = padded / 2;
  for (; h >= lanes; h /= 2) {
    for (size_t k = 0; k < h; k += lanes) {
      hn::StoreU(hn::Add(hn::LoadU(df, a + k), hn::LoadU(df, a + k + h)), df, a + k);
    }
  }
  for (; h >= 1; h /= 2) {
    for (size_t k = 0; k < h; ++k) a[k] = a[k] + a[k + h];
  }
  return std::sqrt(a[0]);
}

void SegmentNorm(const float* x, const uint8_t* widths, float* unit, uint16_t* segment_norm,
                 size_t n, const WriteParams& p) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  CodebookScratch scratch(d);
  for (size_t row = 0; row < n; ++row) {
    for (size_t s = 0; s < slots; ++s) segment_norm[row * slots + s] = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const size_t m = static_cast<size_t>(seg.values);
      const float* v = x + row * d + static_cast<size_t>(seg.offset);
      float* u = unit + row * d + static_cast<size_t>(seg.offset);
      const uint16_t bits = Bf16FromF32(TreeLength(v, m, scratch.tree.data()));
      segment_norm[row * slots + static_cast<size_t>(s)] = bits;
      const float stored = F32FromBf16(bits);
      if (stored == 0.0f) {
        for (size_t j = 0; j < m; ++j) u[j] = +0.0f;
        continue;
      }
      const auto divisor = hn::Set(df, stored);
      size_t j = 0;
      for (; j + lanes <= m; j += lanes) {
        hn::StoreU(hn::Div(hn::LoadU(df, v + j), divisor), df, u + j);
      }
      for (; j < m; ++j) u[j] = v[j] / stored;
    }
  }
}

void QuantizeCodebook(const float* unit, const uint8_t* widths, const uint16_t* segment_norm,
                      uint8_t* codes, uint16_t* norm, size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  CodebookScratch scratch(d);
  float* staged = scratch.f.data();
  float* decoded = scratch.g.data();
  uint8_t* staged_codes = scratch.bytes.data();
  for (size_t row = 0; row < n; ++row) {
    for (size_t s = 0; s < slots; ++s) norm[row * slots + s] = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const size_t m = static_cast<size_t>(seg.values);
      const size_t covered = RoundUp(m, lanes);
      const tables::CodebookTable table = tables::Codebook(seg.values, seg.width, p.codebook);
      const float* u = unit + row * d + static_cast<size_t>(seg.offset);
      std::memcpy(staged, u, m * sizeof(float));
      for (size_t j = m; j < covered; ++j) staged[j] = 0.0f;
      for (size_t j = 0; j < covered; j += lanes) {
        const auto value = hn::LoadU(df, staged + j);
        auto below = hn::Zero(di);
        // Steps 2^(w-1), ..., 1: move up past boundary t[below + step - 1] when it is < u.
        for (int step = table.levels / 2; step >= 1; step /= 2) {
          const auto probe = hn::Add(below, hn::Set(di, step - 1));
          const auto bound = hn::GatherIndex(df, table.boundaries, probe);
          below = hn::IfThenElse(hn::RebindMask(di, hn::Lt(bound, value)),
                                 hn::Add(below, hn::Set(di, step)), below);
        }
        hn::StoreU(hn::GatherIndex(df, table.centroids, below), df, decoded + j);
        hn::StoreU(hn::DemoteTo(d8, below), d8, staged_codes + j);
      }
      std::memcpy(codes + row * d + static_cast<size_t>(seg.offset), staged_codes, m);
      const float r = TreeLength(decoded, m, scratch.tree.data());
      const float stored = F32FromBf16(segment_norm[row * slots + static_cast<size_t>(s)]);
      norm[row * slots + static_cast<size_t>(s)] = Bf16FromF32(stored / r);
    }
  }
}

// Split layouts (w = 2: four slices of q = ceil(m/4) codes a byte; w = 4: two of q = m/2): the
// slices are staged at a stride of whole vectors, zero past m, and combined lane-wise.
void PackSplit(const uint8_t* c, size_t m, int w, CodebookScratch* scratch, uint8_t* out) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t lanes = hn::Lanes(d8);
  const size_t parts = w == 2 ? 4 : 2;
  const size_t q = (m + parts - 1) / parts;
  const size_t stride = RoundUp(q, lanes);
  uint8_t* staged = scratch->bytes.data();
  uint8_t* packed = scratch->out_bytes.data();
  for (size_t part = 0; part < parts; ++part) {
    for (size_t i = 0; i < stride; ++i) {
      const size_t k = part * q + i;
      staged[part * stride + i] = (i < q && k < m) ? c[k] : 0;
    }
  }
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1u << w) - 1u));
  for (size_t i = 0; i < stride; i += lanes) {
    auto byte = hn::And(hn::LoadU(d8, staged + i), mask);
    if (w == 2) {
      byte = hn::Or(
          hn::Or(byte, hn::ShiftLeft<2>(hn::And(hn::LoadU(d8, staged + stride + i), mask))),
          hn::Or(hn::ShiftLeft<4>(hn::And(hn::LoadU(d8, staged + 2 * stride + i), mask)),
                 hn::ShiftLeft<6>(hn::And(hn::LoadU(d8, staged + 3 * stride + i), mask))));
    } else {
      byte = hn::Or(byte, hn::ShiftLeft<4>(hn::And(hn::LoadU(d8, staged + stride + i), mask)));
    }
    hn::StoreU(byte, d8, packed + i);
  }
  std::memcpy(out, packed, q);
}

void UnpackSplit(const uint8_t* in, size_t m, int w, CodebookScratch* scratch, uint8_t* c) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t lanes = hn::Lanes(d8);
  const size_t parts = w == 2 ? 4 : 2;
  const size_t q = (m + parts - 1) / parts;
  const size_t stride = RoundUp(q, lanes);
  uint8_t* staged = scratch->bytes.data();
  uint8_t* codes = scratch->out_bytes.data();
  std::memcpy(staged, in, q);
  for (size_t i = q; i < stride; ++i) staged[i] = 0;
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1u << w) - 1u));
  for (size_t i = 0; i < stride; i += lanes) {
    const auto byte = hn::LoadU(d8, staged + i);
    hn::StoreU(hn::And(byte, mask), d8, codes + i);
    if (w == 2) {
      hn::StoreU(hn::And(hn::ShiftRight<2>(byte), mask), d8, codes + stride + i);
      hn::StoreU(hn::And(hn::ShiftRight<4>(byte), mask), d8, codes + 2 * stride + i);
      hn::StoreU(hn::ShiftRight<6>(byte), d8, codes + 3 * stride + i);
    } else {
      hn::StoreU(hn::ShiftRight<4>(byte), d8, codes + stride + i);
    }
  }
  for (size_t part = 0; part < parts; ++part) {
    for (size_t i = 0; i < q; ++i) {
      const size_t k = part * q + i;
      if (k < m) c[k] = codes[part * stride + i];
    }
  }
}

// The LSB-first bit stream in groups of 8 codes: a group's 8*w bits are w bytes, the low w
// bytes of one 64-bit word (code k of the group at bits [k*w, (k+1)*w)), so lanes run over
// groups. The codes are staged as eight planes of 64-bit values (plane k: code k of every
// group, zero past m), which needs no byte-order assumption. Only the segment's ceil(m*w/8)
// bytes are written; padded codes are 0, so the last byte's unused bits are too.
void PackStream(const uint8_t* c, size_t m, int w, CodebookScratch* scratch, uint8_t* out) {
  const hn::ScalableTag<uint64_t> d64;
  const size_t lanes = hn::Lanes(d64);
  const size_t groups = (m + 7) / 8;
  const size_t covered = RoundUp(groups, lanes);
  uint64_t* planes = scratch->words.data();  // [8][covered]
  uint64_t* words = scratch->out_words.data();
  for (size_t k = 0; k < 8 * covered; ++k) planes[k] = 0;
  for (size_t k = 0; k < m; ++k) planes[(k % 8) * covered + k / 8] = c[k];
  const auto code_mask = hn::Set(d64, (uint64_t{1} << w) - 1u);
  for (size_t g = 0; g < covered; g += lanes) {
    auto word = hn::Zero(d64);
    for (int k = 0; k < 8; ++k) {
      const auto code = hn::And(hn::LoadU(d64, planes + static_cast<size_t>(k) * covered + g),
                                code_mask);
      word = hn::Or(word, hn::ShiftLeftSame(code, k * w));
    }
    hn::StoreU(word, d64, words + g);
  }
  const size_t bytes = (m * static_cast<size_t>(w) + 7) / 8;
  for (size_t e = 0; e < bytes; ++e) {
    const size_t g = e / static_cast<size_t>(w), b = e % static_cast<size_t>(w);
    out[e] = static_cast<uint8_t>(words[g] >> (8 * b));
  }
}

void UnpackStream(const uint8_t* in, size_t m, int w, CodebookScratch* scratch, uint8_t* c) {
  const hn::ScalableTag<uint64_t> d64;
  const size_t lanes = hn::Lanes(d64);
  const size_t groups = (m + 7) / 8;
  const size_t covered = RoundUp(groups, lanes);
  const size_t bytes = (m * static_cast<size_t>(w) + 7) / 8;
  uint64_t* words = scratch->out_words.data();
  uint64_t* planes = scratch->words.data();  // [8][covered]
  for (size_t g = 0; g < covered; ++g) words[g] = 0;
  for (size_t e = 0; e < bytes; ++e) {
    const size_t g = e / static_cast<size_t>(w), b = e % static_cast<size_t>(w);
    words[g] |= static_cast<uint64_t>(in[e]) << (8 * b);
  }
  const auto code_mask = hn::Set(d64, (uint64_t{1} << w) - 1u);
  for (size_t g = 0; g < covered; g += lanes) {
    const auto word = hn::LoadU(d64, words + g);
    for (int k = 0; k < 8; ++k) {
      hn::StoreU(hn::And(hn::ShiftRightSame(word, k * w), code_mask), d64,
                 planes + static_cast<size_t>(k) * covered + g);
    }
  }
  for (size_t k = 0; k < m; ++k) c[k] = static_cast<uint8_t>(planes[(k % 8) * covered + k / 8]);
}

void PackCodebook(const uint8_t* codes, const uint8_t* widths, uint8_t* packed, size_t n,
                  const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t row_bytes = static_cast<size_t>(p.row_code_bytes());
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  CodebookScratch scratch(d);
  for (size_t row = 0; row < n; ++row) {
    uint8_t* out = packed + row * row_bytes;
    std::memset(out, 0, row_bytes);
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const uint8_t* c = codes + row * d + static_cast<size_t>(seg.offset);
      const size_t m = static_cast<size_t>(seg.values);
      uint8_t* o = out + static_cast<size_t>(seg.byte_offset);
      if (seg.width == 2 || seg.width == 4) {
        PackSplit(c, m, seg.width, &scratch, o);
      } else {
        PackStream(c, m, seg.width, &scratch, o);
      }
    }
  }
}

void UnpackCodebook(const uint8_t* packed, const uint8_t* widths, uint8_t* codes, size_t n,
                    const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t row_bytes = static_cast<size_t>(p.row_code_bytes());
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  CodebookScratch scratch(d);
  for (size_t row = 0; row < n; ++row) {
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const uint8_t* in = packed + row * row_bytes + static_cast<size_t>(seg.byte_offset);
      const size_t m = static_cast<size_t>(seg.values);
      uint8_t* c = codes + row * d + static_cast<size_t>(seg.offset);
      if (seg.width == 2 || seg.width == 4) {
        UnpackSplit(in, m, seg.width, &scratch, c);
      } else {
        UnpackStream(in, m, seg.width, &scratch, c);
      }
    }
  }
}

// The centroids gathered by code (masked to the width, as the scalar), times N^f.
void DequantizeCodebook(const uint8_t* codes, const uint8_t* widths, const uint16_t* norm,
                        float* y, size_t n, const WriteParams& p) {
  const DF df;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  CodebookScratch scratch(d);
  uint8_t* staged = scratch.bytes.data();
  float* decoded = scratch.f.data();
  for (size_t row = 0; row < n; ++row) {
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const size_t m = static_cast<size_t>(seg.values);
      const size_t covered = RoundUp(m, lanes);
      const tables::CodebookTable table = tables::Codebook(seg.values, seg.width, p.codebook);
      const size_t base = row * d + static_cast<size_t>(seg.offset);
      std::memcpy(staged, codes + base, m);
      for (size_t j = m; j < covered; ++j) staged[j] = 0;
      const auto factor = hn::Set(df, F32FromBf16(norm[row * slots + static_cast<size_t>(s)]));
      const auto mask = hn::Set(di, table.levels - 1);
      for (size_t j = 0; j < covered; j += lanes) {
        const auto index = hn::And(hn::PromoteTo(di, hn::LoadU(d8, staged + j)), mask);
        hn::StoreU(hn::Mul(hn::GatherIndex(df, table.centroids, index), factor), df,
                   decoded + j);
      }
      std::memcpy(y + base, decoded, m * sizeof(float));
    }
  }
}

WriteKernels MakeWriteKernels() {
  WriteKernels k;
#define KVQ_STAGE(name, Name, family, backends, params, args) k.name = &Name;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  return k;
}
KVQ_HWY_REGISTER(WriteKernels, MakeWriteKernels);

}  // namespace HWY_NAMESPACE
}  // namespace kvq::cpu::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::cpu::internal {

std::vector<int64_t> HwyWriteTargets() { return TargetMakers<WriteKernels>::Get().Targets(); }

WriteKernels HwyWriteKernels(int64_t hwy_target) {
  return TargetMakers<WriteKernels>::Get().Make(hwy_target, "write kernels");
}

}  // namespace kvq::cpu::internal
#endif  // HWY_ONCE
