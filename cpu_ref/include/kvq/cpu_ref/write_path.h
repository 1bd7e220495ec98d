// Validating entry points of the write path: what the CLI, the cache and calibration call.
// They check parameters, shapes and finiteness, then run the named stages of a Backend in the
// spec's order: the transforms (rotate (dense or FWHT) -> bit reversal -> clip), then the codec
// of the format (its encode steps, formats.inc: affine_token quantize -> pack -> dequantize),
// with the norm between the rotation and the clip when the parameters ask for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {

// Everything the write path of a quantized format produces for n rows, kept stage by stage:
// the rows every format has (rotated, normalized, clip thresholds, decoded), and the named
// outputs of the steps that ran: the norm stage's `norm` (p.norm), then the outputs of the
// format's encode steps (formats.inc's KVQ_CODEC_STEP rows; affine_token: codes, scale, min,
// packed; fp8_e4m3: codes), named and shaped by their stages.inc arguments. A history plane
// stores one of these outputs (formats.inc's source column).
struct QuantizedRows {
  size_t rows = 0;
  std::vector<float> rotated;       // [n, d]  x·R (then P_br), before the norm and the clip
  std::vector<float> normalized;    // [n, d]  rotated / n^ (p.norm; else empty)
  std::vector<float> tau;           // [n]     clip threshold per row (empty when no clip runs:
                                    //         codebook)
  std::vector<float> dequantized;   // [n, d]  the codec's `y`: decoded rows (times n^ with a norm)
  std::vector<std::pair<std::string, Tensor>> outputs;  // in the order the steps ran

  // The output called `name`; throws kvq::Error(kInvalidArgument) naming it and the outputs.
  const Tensor& Output(const std::string& name) const;
  // Its elements as T (the dtype's width must match: bf16 outputs as uint16_t bits).
  template <typename T>
  std::vector<T> Values(const std::string& name) const {
    const Tensor& t = Output(name);
    return std::vector<T>(t.data<T>(), t.data<T>() + t.bytes.size() / sizeof(T));
  }

  // What p's write path produces, as named tensors in write-path order ("rotated", "norm",
  // "normalized", "tau", the codec's outputs, "dequantized"; the norm fields only with
  // p.norm, "tau" only where the clip runs) with their shapes: what golden vectors and tests
  // compare.
  std::vector<std::pair<std::string, Tensor>> Tensors(const WriteParams& p) const;
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
// the packed codes, scale and min of QuantizeRows; affine_tile: the packed tiles, their scale
// and min, and the norms; bf16: x rounded to bf16, RNE). Throws as QuantizeRows does; a tile
// format needs n to be a multiple of its tile (kInvalidArgument).
EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                       const float* x, size_t n);
// The same with the head's per-head arrays (head_data.inc): its rotation (dense only) and what
// the codec reads (codebook: the block widths; absent, every block has p.bits).
EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const HeadArrays& head,
                       const float* x, size_t n);

// The same for n tokens of H KV heads at once, x [n, H, d] (a token's rows laid end to end,
// as the cache receives them), with head h's params[h] and rotations[h] (null unless dense).
// The heads share the format, d and the norm; a token-scope norm (norm_heads == H > 1) is one
// norm over each token's H rotated rows, so it needs them all. Returns one EncodedRows per head
// (a shared plane holds the same bytes in each).
std::vector<EncodedRows> EncodeTokens(const Backend& backend,
                                      const std::vector<WriteParams>& params,
                                      const std::vector<const float*>& rotations,
                                      const float* x, size_t n);
// The same with each head's per-head arrays (heads[h]: its rotation and codec inputs).
std::vector<EncodedRows> EncodeTokens(const Backend& backend,
                                      const std::vector<WriteParams>& params,
                                      const std::vector<HeadArrays>& heads, const float* x,
                                      size_t n);

// The inverse of the codec (not of the rotation): n stored rows -> y [n, d] fp32 in the rotated
// space, by the format's decode steps (formats.inc; affine_token: unpack -> dequantize), times
// n^ with a norm; bf16: exact widening. Whole tiles are decoded for a tile format.
// rows.plane[i] points at the first row of plane i (tile planes: the tile holding the first
// token, rows.tile_offset tokens into it); rows.heads holds the head's arrays the decode steps
// read (codebook widths; absent, every block has p.bits). Assumes rows that EncodeRows
// produced with the same arrays (no validation).
void DecodeRows(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                size_t n, float* y);

// The whole write path of a quantized format (affine_token, affine_tile) for n rows of
// x [n, d], every stage's output kept: rotate -> P_br -> norm -> clip -> the codec. Throws
// kvq::Error on invalid p, non-finite input, a rotated magnitude above kMaxRotatedAbs
// (kNonFinite, naming row and value), a norm or a codebook segment norm that overflows
// (kNonFinite), n not a multiple of the tile, a bf16 format or a norm spanning several KV heads
// (kInvalidArgument: QuantizeTokens), codebook widths outside 1..8 or laying a row out in more
// segments or code bytes than p allows (kInvalidArgument, naming the block or the counts).
QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                           const float* x, size_t n);
// The same with the head's per-head arrays (rotation, codebook widths).
QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const HeadArrays& head,
                           const float* x, size_t n);

// The same for n tokens of H KV heads, x [n, H, d] (see EncodeTokens); one result per head.
std::vector<QuantizedRows> QuantizeTokens(const Backend& backend,
                                          const std::vector<WriteParams>& params,
                                          const std::vector<const float*>& rotations,
                                          const float* x, size_t n);
// The same with each head's per-head arrays.
std::vector<QuantizedRows> QuantizeTokens(const Backend& backend,
                                          const std::vector<WriteParams>& params,
                                          const std::vector<HeadArrays>& heads, const float* x,
                                          size_t n);

}  // namespace kvq::cpu
