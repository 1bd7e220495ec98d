// The scalar reference of the write path: the executable form of spec/numerics.md, written as
// literally as the spec reads so that a reviewer can check it line by line. Every other
// backend (each Highway target, the CUDA path) must reproduce these bits exactly.
//
// Speed is not a goal here, but nothing is pessimised either: the file is built at -O3 with
// -ffp-contract=off like the rest of the library, so the compiler may vectorise whatever the
// spec's order allows (it cannot reorder the rotation's sums).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "write_internal.h"

namespace kvq::cpu::internal {
namespace {

// y[j] = sum_i x[i]*R[i][j]: i ascending, acc from +0.0f, the product rounded on its own.
void RotateDense(const float* x, const float* r, float* y, size_t n,
                       const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  for (size_t row = 0; row < n; ++row) {
    const float* xr = x + row * d;
    float* yr = y + row * d;
    for (size_t j = 0; j < d; ++j) {
      float acc = +0.0f;
      for (size_t i = 0; i < d; ++i) {
        const float product = xr[i] * r[i * d + j];
        acc = acc + product;
      }
      yr[j] = acc;
    }
  }
}

// Butterflies with strides 1, 2, ..., block/2 on each block, then one multiply by the scale.
void Fwht(float* x, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t block = static_cast<size_t>(p.fwht_block());
  const float scale = p.fwht_scale();
  for (size_t row = 0; row < n; ++row) {
    for (size_t start = 0; start < d; start += block) {
      float* b = x + row * d + start;
      for (size_t h = 1; h < block; h *= 2) {
        for (size_t k = 0; k < block; ++k) {
          if ((k & h) != 0) continue;
          const float a = b[k];
          const float c = b[k + h];
          b[k] = a + c;
          b[k + h] = a - c;
        }
      }
      for (size_t k = 0; k < block; ++k) b[k] = b[k] * scale;
    }
  }
}

// y[j] = x[beta(j)].
void Bitrev(const float* x, float* y, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const int log2_d = Log2(p.head_dim);
  for (size_t row = 0; row < n; ++row) {
    for (size_t j = 0; j < d; ++j) {
      y[row * d + j] = x[row * d + BitReverse(static_cast<uint32_t>(j), log2_d)];
    }
  }
}

// tau = a[k] with a = |x| sorted ascending; then the two comparisons of the spec.
void Clip(float* x, float* tau, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t k = ClipRank(p.clip, p.head_dim);
  std::vector<float> magnitudes(d);
  for (size_t row = 0; row < n; ++row) {
    float* xr = x + row * d;
    for (size_t j = 0; j < d; ++j) magnitudes[j] = std::fabs(xr[j]);
    std::sort(magnitudes.begin(), magnitudes.end());
    const float t = magnitudes[k];
    for (size_t j = 0; j < d; ++j) {
      xr[j] = (xr[j] > t) ? t : ((xr[j] < -t) ? -t : xr[j]);
    }
    tau[row] = t;
  }
}

void Quantize(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                    const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const size_t groups = d / group;
  const float levels = static_cast<float>(p.levels());
  for (size_t row = 0; row < n; ++row) {
    for (size_t g = 0; g < groups; ++g) {
      const float* xg = x + row * d + g * group;
      uint8_t* qg = codes + row * d + g * group;
      float lo = xg[0];
      float hi = xg[0];
      for (size_t j = 1; j < group; ++j) {
        lo = (xg[j] < lo) ? xg[j] : lo;
        hi = (xg[j] > hi) ? xg[j] : hi;
      }
      lo = lo + 0.0f;  // -0 -> +0: the bits cannot depend on which zero the scan kept
      hi = hi + 0.0f;
      const float s = (hi - lo) / levels;
      const uint16_t scale_bits = Bf16FromF32(s);
      const uint16_t min_bits = Bf16FromF32(lo);
      scale[row * groups + g] = scale_bits;
      min[row * groups + g] = min_bits;
      const float sf = F32FromBf16(scale_bits);
      const float mf = F32FromBf16(min_bits);
      for (size_t j = 0; j < group; ++j) {
        if (sf == 0.0f) {
          qg[j] = 0;
          continue;
        }
        const float t = (xg[j] - mf) / sf;
        float q = std::nearbyint(t);  // the default rounding mode: half to even
        q = (q < 0.0f) ? 0.0f : ((q > levels) ? levels : q);
        qg[j] = static_cast<uint8_t>(q);
      }
    }
  }
}

// INT2: byte i <- channels i, d/4+i, d/2+i, 3d/4+i in bits [1:0], [3:2], [5:4], [7:6].
// INT4: byte i <- channel i (low nibble), d/2+i (high nibble).
void Pack(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = d / per_byte;  // bytes per row
  for (size_t row = 0; row < n; ++row) {
    const uint8_t* c = codes + row * d;
    uint8_t* out = packed + row * slice;
    for (size_t i = 0; i < slice; ++i) {
      unsigned byte = 0;
      for (size_t part = 0; part < per_byte; ++part) {
        byte |= static_cast<unsigned>(c[part * slice + i]) << (part * p.bits);
      }
      out[i] = static_cast<uint8_t>(byte);
    }
  }
}

void Unpack(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = d / per_byte;
  const unsigned mask = (1u << p.bits) - 1u;
  for (size_t row = 0; row < n; ++row) {
    const uint8_t* in = packed + row * slice;
    uint8_t* c = codes + row * d;
    for (size_t i = 0; i < slice; ++i) {
      for (size_t part = 0; part < per_byte; ++part) {
        c[part * slice + i] = static_cast<uint8_t>((in[i] >> (part * p.bits)) & mask);
      }
    }
  }
}

// y = q*sf + mf: the product is exact, the sum rounded once.
void Dequantize(const uint8_t* codes, const uint16_t* scale, const uint16_t* min,
                      float* y, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const size_t groups = d / group;
  for (size_t row = 0; row < n; ++row) {
    for (size_t j = 0; j < d; ++j) {
      const size_t g = row * groups + j / group;
      const float sf = F32FromBf16(scale[g]);
      const float mf = F32FromBf16(min[g]);
      const float product = static_cast<float>(codes[row * d + j]) * sf;
      y[row * d + j] = product + mf;
    }
  }
}

}  // namespace

WriteKernels ScalarWriteKernels() {
  WriteKernels k;
#define KVQ_STAGE(name, Name, family, params, args) k.name = &Name;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  return k;
}

}  // namespace kvq::cpu::internal
