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
//    the scalar's per channel, codes as in quantize; packing along tokens is integer.
//
// Requires Highway 1.0.3 only (no LoadN, ReduceSum or HWY_EXPORT_T).

#include "hwy_targets.h"  // first: fixes the target list

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

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
