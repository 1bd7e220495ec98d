// Validating entry points of the write path: what the CLI, the cache and calibration call.
// They check parameters, shapes and finiteness, then run the named stages of a Backend in the
// spec's order: the transforms (rotate (dense or FWHT) -> bit reversal -> clip), then the codec
// of the format (affine_token: quantize -> pack).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {

// Everything the write path produces for n rows, kept stage by stage.
struct QuantizedRows {
  size_t rows = 0;
  std::vector<float> rotated;       // [n, d]  x·R (then P_br), before the clip
  std::vector<float> tau;           // [n]     clip threshold per row
  std::vector<uint8_t> codes;       // [n, d]  code values, one per byte
  std::vector<uint8_t> packed;      // [n, d*b/8] spec packing
  std::vector<uint16_t> scale;      // [n, d/G] bf16 bits
  std::vector<uint16_t> min;        // [n, d/G] bf16 bits
  std::vector<float> dequantized;   // [n, d]  in the rotated space
};

// y [n, d] = x [n, d] rotated as p says (identity, dense `rotation` [d, d], or FWHT), then
// bit-reversed if p.bitrev. `rotation` is read only for RotationKind::kDense (else may be null).
// Throws kvq::Error: invalid p, non-finite x (kNonFinite, naming row and column), null matrix.
void Rotate(const Backend& backend, const WriteParams& p, const float* rotation, const float* x,
            float* y, size_t n);

// The inverse map: y = x · P_brᵀ · Rᵀ (bit reversal is an involution; FWHT is its own
// inverse). Used to bring dequantized rows back to the original space.
void RotateInverse(const Backend& backend, const WriteParams& p, const float* rotation,
                   const float* x, float* y, size_t n);

// The stored planes of n rows: plane i of LayoutOf(p), row after row (n rows of a token plane,
// n / tile_tokens of a tile plane), exactly the bytes a history page holds.
struct EncodedRows {
  size_t rows = 0;
  std::vector<uint8_t> plane[kMaxPlanes];
};

// The write path for n rows of x [n, d] in p's format, as the cache stores them (affine_token:
// the packed codes, scale and min of QuantizeRows; bf16: x rounded to bf16, RNE). Throws as
// QuantizeRows does; a tile format needs n to be a multiple of its tile (kInvalidArgument).
EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                       const float* x, size_t n);

// The inverse of the codec (not of the rotation): n stored rows -> y [n, d] fp32 in the rotated
// space (affine_token: q * scale + min; bf16: exact widening). rows.plane[i] points at the first
// row of plane i. Assumes rows that EncodeRows produced (no validation).
void DecodeRows(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                size_t n, float* y);

// The whole affine_token write path for n rows of x [n, d], every stage's output kept. Throws kvq::Error on invalid p, non-finite
// input, or a rotated magnitude above kMaxRotatedAbs (kNonFinite, naming row and value).
QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                           const float* x, size_t n);

}  // namespace kvq::cpu
