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

#include "kvq/common/codebook.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"
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

// The tree norm of each span of m = d * norm_heads values (numerics.md §5.1): squares in fp32,
// padded with +0 to a power of two M, folded by a[j] = a[j] + a[j + h] for h = M/2, ..., 1;
// n = sqrtf(a[0]) (correctly rounded), n^ = bf16(n); the span becomes x / n^ (IEEE), or +0
// everywhere when n^ = 0.
void Norm(float* x, uint16_t* norm, size_t n, const WriteParams& p) {
  const size_t m = static_cast<size_t>(p.norm_span());
  const size_t padded = static_cast<size_t>(NormTreeSize(static_cast<int64_t>(m)));
  std::vector<float> a(padded);
  for (size_t row = 0; row < n; ++row) {
    float* xr = x + row * m;
    for (size_t j = 0; j < padded; ++j) a[j] = j < m ? xr[j] * xr[j] : +0.0f;
    for (size_t h = padded / 2; h >= 1; h /= 2) {
      for (size_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
    }
    const float length = std::sqrt(a[0]);
    const uint16_t bits = Bf16FromF32(length);
    norm[row] = bits;
    const float stored = F32FromBf16(bits);
    for (size_t j = 0; j < m; ++j) xr[j] = stored == 0.0f ? +0.0f : xr[j] / stored;
  }
}

// y = y * n^, one rounding.
void Denorm(float* y, const uint16_t* norm, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  for (size_t row = 0; row < n; ++row) {
    const float stored = F32FromBf16(norm[row]);
    for (size_t j = 0; j < d; ++j) y[row * d + j] = y[row * d + j] * stored;
  }
}

// Spec §5 on one group of `count` values x[0], x[stride], ...: the stored (scale, min) and the
// codes q[0], q[stride], ... (the same rule for a per-token group of channels and for one
// channel of a tile).
void QuantizeGroup(const float* x, size_t count, size_t stride, float levels, uint8_t* q,
                   uint16_t* scale, uint16_t* min) {
  float lo = x[0];
  float hi = x[0];
  for (size_t j = 1; j < count; ++j) {
    lo = (x[j * stride] < lo) ? x[j * stride] : lo;
    hi = (x[j * stride] > hi) ? x[j * stride] : hi;
  }
  lo = lo + 0.0f;  // -0 -> +0: the bits cannot depend on which zero the scan kept
  hi = hi + 0.0f;
  const float s = (hi - lo) / levels;
  *scale = Bf16FromF32(s);
  *min = Bf16FromF32(lo);
  const float sf = F32FromBf16(*scale);
  const float mf = F32FromBf16(*min);
  for (size_t j = 0; j < count; ++j) {
    if (sf == 0.0f) {
      q[j * stride] = 0;
      continue;
    }
    const float t = (x[j * stride] - mf) / sf;
    float c = std::nearbyint(t);  // the default rounding mode: half to even
    c = (c < 0.0f) ? 0.0f : ((c > levels) ? levels : c);
    q[j * stride] = static_cast<uint8_t>(c);
  }
}

// Per token, per contiguous group of G channels.
void Quantize(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
              const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t group = static_cast<size_t>(p.group);
  const size_t groups = d / group;
  const float levels = static_cast<float>(p.levels());
  for (size_t row = 0; row < n; ++row) {
    for (size_t g = 0; g < groups; ++g) {
      QuantizeGroup(x + row * d + g * group, group, 1, levels, codes + row * d + g * group,
                    scale + row * groups + g, min + row * groups + g);
    }
  }
}

// ---- affine_tile: tile t holds rows [t*G_k, (t+1)*G_k); channel j of a tile is one group ----

// The transposed tile: group (t, j) is x[t*G_k + r][j] for r = 0..G_k-1; its (scale, min) go to
// [t][j]; codes stay token-major like the rows.
void QuantizeTile(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                  const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const float levels = static_cast<float>(p.levels());
  for (size_t t = 0; t < n / tile; ++t) {
    for (size_t j = 0; j < d; ++j) {
      QuantizeGroup(x + t * tile * d + j, tile, d, levels, codes + t * tile * d + j,
                    scale + t * d + j, min + t * d + j);
    }
  }
}

// Tile t, channel j: bytes [t][j][0 .. G_k*b/8) hold the channel's G_k codes by the split rule
// along the tokens: INT2 byte i <- tokens i, G_k/4+i, G_k/2+i, 3G_k/4+i; INT4 byte i <- tokens
// i (low nibble) and G_k/2+i.
void PackTile(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = tile / per_byte;  // bytes per channel
  for (size_t t = 0; t < n / tile; ++t) {
    for (size_t j = 0; j < d; ++j) {
      uint8_t* out = packed + (t * d + j) * slice;
      for (size_t i = 0; i < slice; ++i) {
        unsigned byte = 0;
        for (size_t part = 0; part < per_byte; ++part) {
          const size_t token = t * tile + part * slice + i;
          byte |= static_cast<unsigned>(codes[token * d + j]) << (part * p.bits);
        }
        out[i] = static_cast<uint8_t>(byte);
      }
    }
  }
}

void UnpackTile(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t per_byte = static_cast<size_t>(8 / p.bits);
  const size_t slice = tile / per_byte;
  const unsigned mask = (1u << p.bits) - 1u;
  for (size_t t = 0; t < n / tile; ++t) {
    for (size_t j = 0; j < d; ++j) {
      const uint8_t* in = packed + (t * d + j) * slice;
      for (size_t i = 0; i < slice; ++i) {
        for (size_t part = 0; part < per_byte; ++part) {
          const size_t token = t * tile + part * slice + i;
          codes[token * d + j] = static_cast<uint8_t>((in[i] >> (part * p.bits)) & mask);
        }
      }
    }
  }
}

// y = q*sf + mf with the (scale, min) of the token's tile and the channel.
void DequantizeTile(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                    size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  for (size_t row = 0; row < n / tile * tile; ++row) {
    const size_t t = row / tile;
    for (size_t j = 0; j < d; ++j) {
      const float sf = F32FromBf16(scale[t * d + j]);
      const float mf = F32FromBf16(min[t * d + j]);
      const float product = static_cast<float>(codes[row * d + j]) * sf;
      y[row * d + j] = product + mf;
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

// ---- fp8_e4m3 (spec 1.2) ----

// code = e4m3(x / s^): the IEEE fp32 quotient, then round to nearest even, saturating to
// +-448 (E4m3FromF32, numerics.md §9).
void QuantizeFp8(const float* x, uint8_t* codes, size_t n, const WriteParams& p) {
  const size_t count = n * static_cast<size_t>(p.head_dim);
  for (size_t i = 0; i < count; ++i) codes[i] = E4m3FromF32(x[i] / p.head_scale);
}

// y = s^ * e4m3 value: the e4m3 value is exact in fp32, the product rounded once.
void DequantizeFp8(const uint8_t* codes, float* y, size_t n, const WriteParams& p) {
  const size_t count = n * static_cast<size_t>(p.head_dim);
  for (size_t i = 0; i < count; ++i) y[i] = p.head_scale * F32FromE4m3(codes[i]);
}

// ---- codebook (spec 1.3, numerics.md §5.4, §7.3, §8.2) ----
// Every stage walks the segments of the head's layout (CodebookLayoutOf: one per width
// present, widths ascending); segment s is channels [o_s, o_s + m_s) of the row and norm slot
// s; slots past the head's segments hold +0.

// sqrtf of the tree sum of m squares (numerics.md §5.1 steps 1-3): squares in fp32, +0 up to
// the power of two M >= m, then a[j] = a[j] + a[j + h] for h = M/2, ..., 1. `a` holds >= M.
float TreeLength(const float* v, size_t m, float* a) {
  const size_t padded = static_cast<size_t>(NormTreeSize(static_cast<int64_t>(m)));
  for (size_t j = 0; j < padded; ++j) a[j] = j < m ? v[j] * v[j] : +0.0f;
  for (size_t h = padded / 2; h >= 1; h /= 2) {
    for (size_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
  }
  return std::sqrt(a[0]);
}

// n^ = bf16(tree length); u = x / n^ (IEEE), or +0 everywhere when n^ = 0.
void SegmentNorm(const float* x, const uint8_t* widths, float* unit, uint16_t* segment_norm,
                 size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  std::vector<float> a(d);
  for (size_t row = 0; row < n; ++row) {
    for (size_t s = 0; s < slots; ++s) segment_norm[row * slots + s] = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const size_t m = static_cast<size_t>(seg.values);
      const float* v = x + row * d + static_cast<size_t>(seg.offset);
      float* u = unit + row * d + static_cast<size_t>(seg.offset);
      const uint16_t bits = Bf16FromF32(TreeLength(v, m, a.data()));
      segment_norm[row * slots + static_cast<size_t>(s)] = bits;
      const float stored = F32FromBf16(bits);
      for (size_t j = 0; j < m; ++j) u[j] = stored == 0.0f ? +0.0f : v[j] / stored;
    }
  }
}

// code = #{k : t_k < u} (IEEE comparisons: a tie goes to the lower centroid); then
// N^ = bf16(n^ / r), r the tree length of the centroids the codes pick (fp32, not rounded).
void QuantizeCodebook(const float* unit, const uint8_t* widths, const uint16_t* segment_norm,
                      uint8_t* codes, uint16_t* norm, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  std::vector<float> decoded(d), a(d);
  for (size_t row = 0; row < n; ++row) {
    for (size_t s = 0; s < slots; ++s) norm[row * slots + s] = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const size_t m = static_cast<size_t>(seg.values);
      const tables::CodebookTable table = tables::Codebook(seg.values, seg.width, p.codebook);
      const float* u = unit + row * d + static_cast<size_t>(seg.offset);
      uint8_t* c = codes + row * d + static_cast<size_t>(seg.offset);
      for (size_t j = 0; j < m; ++j) {
        int below = 0;
        for (int k = 0; k + 1 < table.levels; ++k) below += table.boundaries[k] < u[j] ? 1 : 0;
        c[j] = static_cast<uint8_t>(below);
        decoded[j] = table.centroids[below];
      }
      const float r = TreeLength(decoded.data(), m, a.data());
      const float stored = F32FromBf16(segment_norm[row * slots + static_cast<size_t>(s)]);
      norm[row * slots + static_cast<size_t>(s)] = Bf16FromF32(stored / r);
    }
  }
}

// One segment's m codes of width w into its ceil(m*w/8) bytes `out` (zeroed first). Codes are
// below 2^w; the mask keeps the stage total on any byte.
void PackSegment(const uint8_t* c, size_t m, int w, uint8_t* out) {
  const unsigned mask = (1u << w) - 1u;
  if (w == 2) {  // split-quarter over q = ceil(m/4): byte i <- codes i, q+i, 2q+i, 3q+i
    const size_t q = (m + 3) / 4;
    for (size_t i = 0; i < q; ++i) {
      unsigned byte = 0;
      for (size_t part = 0; part < 4; ++part) {
        const size_t k = part * q + i;
        if (k < m) byte |= (c[k] & mask) << (2 * part);
      }
      out[i] = static_cast<uint8_t>(byte);
    }
  } else if (w == 4) {  // split-half over q = m/2: byte i <- code i (low), q+i (high)
    const size_t q = m / 2;
    for (size_t i = 0; i < q; ++i) {
      out[i] = static_cast<uint8_t>((c[i] & mask) | ((c[q + i] & mask) << 4));
    }
  } else {  // LSB-first bit stream: bit t of code k is stream bit k*w + t
    const size_t bytes = (m * static_cast<size_t>(w) + 7) / 8;
    for (size_t i = 0; i < bytes; ++i) out[i] = 0;
    for (size_t k = 0; k < m; ++k) {
      for (int t = 0; t < w; ++t) {
        const size_t e = k * static_cast<size_t>(w) + static_cast<size_t>(t);
        out[e / 8] = static_cast<uint8_t>(out[e / 8] | (((c[k] >> t) & 1u) << (e % 8)));
      }
    }
  }
}

void UnpackSegment(const uint8_t* in, size_t m, int w, uint8_t* c) {
  const unsigned mask = (1u << w) - 1u;
  if (w == 2) {
    const size_t q = (m + 3) / 4;
    for (size_t i = 0; i < q; ++i) {
      for (size_t part = 0; part < 4; ++part) {
        const size_t k = part * q + i;
        if (k < m) c[k] = static_cast<uint8_t>((in[i] >> (2 * part)) & mask);
      }
    }
  } else if (w == 4) {
    const size_t q = m / 2;
    for (size_t i = 0; i < q; ++i) {
      c[i] = static_cast<uint8_t>(in[i] & mask);
      c[q + i] = static_cast<uint8_t>(in[i] >> 4);
    }
  } else {
    for (size_t k = 0; k < m; ++k) {
      unsigned code = 0;
      for (int t = 0; t < w; ++t) {
        const size_t e = k * static_cast<size_t>(w) + static_cast<size_t>(t);
        code |= ((in[e / 8] >> (e % 8)) & 1u) << t;
      }
      c[k] = static_cast<uint8_t>(code);
    }
  }
}

// The row's code plane: each segment's bytes at its byte offset, 0x00 up to code_bytes.
void PackCodebook(const uint8_t* codes, const uint8_t* widths, uint8_t* packed, size_t n,
                  const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t row_bytes = static_cast<size_t>(p.row_code_bytes());
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  for (size_t row = 0; row < n; ++row) {
    uint8_t* out = packed + row * row_bytes;
    for (size_t i = 0; i < row_bytes; ++i) out[i] = 0;
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      PackSegment(codes + row * d + static_cast<size_t>(seg.offset),
                  static_cast<size_t>(seg.values), seg.width,
                  out + static_cast<size_t>(seg.byte_offset));
    }
  }
}

void UnpackCodebook(const uint8_t* packed, const uint8_t* widths, uint8_t* codes, size_t n,
                    const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t row_bytes = static_cast<size_t>(p.row_code_bytes());
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  for (size_t row = 0; row < n; ++row) {
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      UnpackSegment(packed + row * row_bytes + static_cast<size_t>(seg.byte_offset),
                    static_cast<size_t>(seg.values), seg.width,
                    codes + row * d + static_cast<size_t>(seg.offset));
    }
  }
}

// y = c[code] * N^f: the fp32 centroid times the segment's corrected norm, one rounding.
void DequantizeCodebook(const uint8_t* codes, const uint8_t* widths, const uint16_t* norm,
                        float* y, size_t n, const WriteParams& p) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t slots = static_cast<size_t>(p.segments);
  const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
  for (size_t row = 0; row < n; ++row) {
    for (int s = 0; s < layout.count; ++s) {
      const CodebookSegment& seg = layout.segment[s];
      const tables::CodebookTable table = tables::Codebook(seg.values, seg.width, p.codebook);
      const unsigned mask = static_cast<unsigned>(table.levels - 1);
      const float stored = F32FromBf16(norm[row * slots + static_cast<size_t>(s)]);
      const size_t base = row * d + static_cast<size_t>(seg.offset);
      for (size_t j = 0; j < static_cast<size_t>(seg.values); ++j) {
        y[base + j] = table.centroids[codes[base + j] & mask] * stored;
      }
    }
  }
}

}  // namespace

WriteKernels ScalarWriteKernels() {
  WriteKernels k;
#define KVQ_STAGE(name, Name, family, backends, params, args) k.name = &Name;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  return k;
}

}  // namespace kvq::cpu::internal
