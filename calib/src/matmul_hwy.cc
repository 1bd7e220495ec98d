// The forward's fp32 kernels (matmul.h), compiled once per Highway target and dispatched to
// the best one of this CPU (the hwy/examples/skeleton.cc pattern of Highway 1.0.3).
//
// MatMul: C = A·B in row blocks of kRowBlock rows (an A block stays in L2), and per block in
// column panels of kVecs vectors: the panel of B is copied once into a contiguous [k, width]
// buffer (zero-padded past n), then tiles of up to 4 rows × kVecs vectors accumulate
// a[r, p]·b[p, :] over p in registers (12 accumulators + 3 B vectors + 1 broadcast = 16
// registers on AVX2). Each element is one MulAdd chain over p ascending, whatever the tile or
// panel it falls in, so results do not depend on how rows or columns are grouped.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>

#include "kvq/calib/matmul.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "matmul_hwy.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace kvq::calib {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr size_t kVecs = 3;        // vectors per tile row
constexpr size_t kRowBlock = 128;  // rows of A per block
// Stack buffers for partial vectors: enough lanes for any target (2048-bit vectors).
constexpr size_t kMaxLanesAny = 64;

// One tile: kTileRows rows of A (pointers; a short tile repeats a row and drops its result)
// times the panel. The accumulators are named locals (an array of vectors made GCC spill them
// to the stack on every step): 4 rows × 3 vectors where the target has 16 vector registers,
// 8 rows × 3 vectors with AVX-512's 32 (4 × 3 zmm tiles ran at half the speed of 4 × 3 ymm
// ones on Zen 4: too few independent multiply-adds per load).
#if HWY_TARGET <= HWY_AVX3
#define KVQ_TILE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
constexpr size_t kTileRows = 8;
#else
#define KVQ_TILE_ROWS(X) X(0) X(1) X(2) X(3)
constexpr size_t kTileRows = 4;
#endif

HWY_INLINE void Tile(const float* const* HWY_RESTRICT a, const float* HWY_RESTRICT panel,
                     size_t k, float* HWY_RESTRICT c, size_t ldc, size_t rows, size_t cols,
                     bool accumulate) {
  const DF df;
  const size_t N = hn::Lanes(df);
#define KVQ_DECLARE(i)                                                 \
  VF c##i##0 = hn::Zero(df), c##i##1 = hn::Zero(df), c##i##2 = hn::Zero(df); \
  const float* HWY_RESTRICT a##i = a[i];
  KVQ_TILE_ROWS(KVQ_DECLARE)
#undef KVQ_DECLARE
  const float* bp = panel;
  for (size_t p = 0; p < k; ++p, bp += kVecs * N) {
    const VF b0 = hn::Load(df, bp);
    const VF b1 = hn::Load(df, bp + N);
    const VF b2 = hn::Load(df, bp + 2 * N);
#define KVQ_STEP(i)                       \
  {                                       \
    const VF av = hn::Set(df, a##i[p]);   \
    c##i##0 = hn::MulAdd(av, b0, c##i##0); \
    c##i##1 = hn::MulAdd(av, b1, c##i##1); \
    c##i##2 = hn::MulAdd(av, b2, c##i##2); \
  }
    KVQ_TILE_ROWS(KVQ_STEP)
#undef KVQ_STEP
  }
  const size_t width = kVecs * N;
  HWY_ALIGN float tmp[kTileRows * kVecs * kMaxLanesAny];
#define KVQ_STORE(i)                                \
  hn::Store(c##i##0, df, tmp + i * width);          \
  hn::Store(c##i##1, df, tmp + i * width + N);      \
  hn::Store(c##i##2, df, tmp + i * width + 2 * N);
  KVQ_TILE_ROWS(KVQ_STORE)
#undef KVQ_STORE
  for (size_t r = 0; r < rows; ++r) {
    float* out = c + r * ldc;
    const float* t = tmp + r * width;
    if (cols == width) {
      for (size_t j = 0; j < width; j += N) {
        VF v = hn::Load(df, t + j);
        if (accumulate) v = hn::Add(hn::LoadU(df, out + j), v);
        hn::StoreU(v, df, out + j);
      }
    } else {
      for (size_t col = 0; col < cols; ++col) out[col] = accumulate ? out[col] + t[col] : t[col];
    }
  }
}
#undef KVQ_TILE_ROWS

void MatMulImpl(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc,
                size_t m, size_t n, size_t k, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) {
      for (size_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    }
    return;
  }
  const DF df;
  const size_t width = kVecs * hn::Lanes(df);
  auto panel = hwy::AllocateAligned<float>(k * width);
  for (size_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const size_t rows = std::min(kRowBlock, m - m0);
    for (size_t n0 = 0; n0 < n; n0 += width) {
      const size_t cols = std::min(width, n - n0);
      for (size_t p = 0; p < k; ++p) {
        float* dst = panel.get() + p * width;
        std::memcpy(dst, b + p * ldb + n0, cols * sizeof(float));
        if (cols < width) std::fill(dst + cols, dst + width, 0.0f);
      }
      for (size_t i = 0; i < rows; i += kTileRows) {
        const size_t tile = std::min(kTileRows, rows - i);
        const float* a_rows[kTileRows];
        for (size_t r = 0; r < kTileRows; ++r) a_rows[r] = a + (m0 + i + (r < tile ? r : 0)) * lda;
        Tile(a_rows, panel.get(), k, c + (m0 + i) * ldc + n0, ldc, tile, cols, accumulate);
      }
    }
  }
}

// Sum of the lanes of v in fp64 (lane order).
HWY_INLINE double SumLanesF64(VF v) {
  const DF df;
  HWY_ALIGN float lanes[kMaxLanesAny];
  hn::Store(v, df, lanes);
  double sum = 0.0;
  for (size_t i = 0; i < hn::Lanes(df); ++i) sum += lanes[i];
  return sum;
}

// The last n - i (< N) entries of x as a vector, padded with `fill`.
HWY_INLINE VF LoadTail(const float* x, size_t count, float fill) {
  const DF df;
  HWY_ALIGN float buf[kMaxLanesAny];
  std::fill(buf, buf + hn::Lanes(df), fill);
  std::memcpy(buf, x, count * sizeof(float));
  return hn::Load(df, buf);
}

HWY_INLINE void StoreTail(VF v, float* x, size_t count) {
  const DF df;
  HWY_ALIGN float buf[kMaxLanesAny];
  hn::Store(v, df, buf);
  std::memcpy(x, buf, count * sizeof(float));
}

float MaxOf(const float* x, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  VF vmax = hn::Set(df, neg_inf);
  size_t i = 0;
  for (; i + N <= n; i += N) vmax = hn::Max(vmax, hn::LoadU(df, x + i));
  if (i < n) vmax = hn::Max(vmax, LoadTail(x + i, n - i, neg_inf));
  return hn::GetLane(hn::MaxOfLanes(df, vmax));
}

// Sums of exponentials: fp32 lanes for at most kSumBlock vectors at a time, then fp64, so the
// relative error stays ~1e-7 for any n (fp32 lanes alone drift to ~1e-6 over 8192 terms).
constexpr size_t kSumBlock = 16;

void SoftmaxInPlaceImpl(float* x, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const VF vmax = hn::Set(df, MaxOf(x, n));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  double sum = 0.0;
  VF vsum = hn::Zero(df);
  size_t i = 0, block = 0;
  for (; i + N <= n; i += N) {
    const VF e = hn::Exp(df, hn::Sub(hn::LoadU(df, x + i), vmax));
    hn::StoreU(e, df, x + i);
    vsum = hn::Add(vsum, e);
    if (++block == kSumBlock) {
      sum += SumLanesF64(vsum);
      vsum = hn::Zero(df);
      block = 0;
    }
  }
  if (i < n) {
    const VF e = hn::Exp(df, hn::Sub(LoadTail(x + i, n - i, neg_inf), vmax));
    StoreTail(e, x + i, n - i);
    vsum = hn::Add(vsum, e);
  }
  sum += SumLanesF64(vsum);
  const VF inv = hn::Set(df, static_cast<float>(1.0 / sum));
  for (i = 0; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), inv), df, x + i);
  if (i < n) StoreTail(hn::Mul(LoadTail(x + i, n - i, 0.0f), inv), x + i, n - i);
}

double LogSumExpImpl(const float* x, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const float mx = MaxOf(x, n);
  const VF vmax = hn::Set(df, mx);
  double sum = 0.0;
  VF vsum = hn::Zero(df);
  size_t i = 0, block = 0;
  for (; i + N <= n; i += N) {
    vsum = hn::Add(vsum, hn::Exp(df, hn::Sub(hn::LoadU(df, x + i), vmax)));
    if (++block == kSumBlock) {
      sum += SumLanesF64(vsum);
      vsum = hn::Zero(df);
      block = 0;
    }
  }
  if (i < n) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    vsum = hn::Add(vsum, hn::Exp(df, hn::Sub(LoadTail(x + i, n - i, neg_inf), vmax)));
  }
  sum += SumLanesF64(vsum);
  return static_cast<double>(mx) + std::log(sum);
}

HWY_INLINE VF Silu(VF g) {
  const DF df;
  // exp(-g) overflows past 88: clamp (silu(g) is then ~g·e^g, below 1e-36 in magnitude).
  const VF e = hn::Exp(df, hn::Min(hn::Neg(g), hn::Set(df, 88.0f)));
  return hn::Div(g, hn::Add(hn::Set(df, 1.0f), e));
}

void SwiGluImpl(const float* gate, const float* up, float* out, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::Mul(Silu(hn::LoadU(df, gate + i)), hn::LoadU(df, up + i)), df, out + i);
  }
  if (i < n) {
    StoreTail(hn::Mul(Silu(LoadTail(gate + i, n - i, 0.0f)), LoadTail(up + i, n - i, 0.0f)),
              out + i, n - i);
  }
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvq::calib
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::calib {

HWY_EXPORT(MatMulImpl);
HWY_EXPORT(SoftmaxInPlaceImpl);
HWY_EXPORT(LogSumExpImpl);
HWY_EXPORT(SwiGluImpl);
HWY_EXPORT(TargetNameImpl);

void MatMul(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc,
            size_t m, size_t n, size_t k, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MatMulImpl)(a, lda, b, ldb, c, ldc, m, n, k, accumulate);
}

void SoftmaxInPlace(float* x, size_t n) { HWY_DYNAMIC_DISPATCH(SoftmaxInPlaceImpl)(x, n); }

double LogSumExp(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(LogSumExpImpl)(x, n); }

void SwiGlu(const float* gate, const float* up, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(SwiGluImpl)(gate, up, out, n);
}

const char* MatMulTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

}  // namespace kvq::calib
#endif  // HWY_ONCE
