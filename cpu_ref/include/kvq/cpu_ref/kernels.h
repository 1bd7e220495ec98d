// The named stages of the write path, as a table of function pointers. Every implementation
// (the scalar executable spec, each compiled Highway target, and the CUDA path through host
// wrappers) fills one table; tests and benchmarks expand the list returned by Backends().
//
// All buffers are row-major, n rows of d = p.head_dim channels, and must not alias unless a
// stage says "in place". Stages assume validated inputs (WriteParams::Validate(), finite rows);
// the validating entry points live in write_path.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/params.h"

namespace kvq::cpu {

struct WriteKernels {
  // y[r][j] = sum_i x[r][i] * R[i][j], i ascending from +0.0f, each product and sum rounded
  // to fp32 separately. x [n, d], R [d, d], y [n, d].
  void (*rotate_dense)(const float* x, const float* r, float* y, size_t n, const WriteParams& p);
  // In place: normalised FWHT on each contiguous block of p.fwht_block() channels; butterfly
  // strides 1, 2, ..., block/2, then one multiply by fp32(1/sqrt(block)). x [n, d].
  void (*fwht)(float* x, size_t n, const WriteParams& p);
  // y[r][j] = x[r][bitrev(j)] over log2(d) bits. x, y [n, d].
  void (*bitrev)(const float* x, float* y, size_t n, const WriteParams& p);
  // In place: tau[r] = the order statistic of |x[r][:]| at min(floor(rho*d), d-1) (ascending),
  // then x <- (x > tau) ? tau : (x < -tau) ? -tau : x. x [n, d], tau [n].
  void (*clip)(float* x, float* tau, size_t n, const WriteParams& p);
  // Asymmetric per-group quantizer with bf16 metadata. x [n, d] -> codes [n, d] (values in
  // [0, 2^b - 1], one per byte), scale and min [n, d/G] as bf16 bits.
  void (*quantize)(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                   const WriteParams& p);
  // codes [n, d] -> packed [n, d*b/8] (INT2 split-quarter, INT4 split-half).
  void (*pack)(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p);
  // packed [n, d*b/8] -> codes [n, d].
  void (*unpack)(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p);
  // y = q * scale + min per group (the product is exact, so fused or not gives the same bits).
  // codes [n, d], scale and min [n, d/G] bf16 bits, y [n, d].
  void (*dequantize)(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                     size_t n, const WriteParams& p);
};

// Decode attention over one KV head's rows for the g query heads that read it (GQA), as an
// online-softmax update of a running state: m [g] (max logit so far, -inf when empty), l [g]
// (sum of exp(s - m)), acc [g, d] (sum of exp(s - m) * v). Logits s = scale * (q[h] . k[i]).
// The cache (cache.h) and attention.h drive these per page and per bf16 run; reduction order
// is free (spec/cache.md §5), so implementations need not agree bit for bit.

// n bf16 rows, row i at rows + i * stride (elements; d values each).
struct Bf16RowsView {
  const uint16_t* rows = nullptr;
  size_t stride = 0;
};

// n quantized rows stored contiguously (one page run of one KV head): codes [n, d*b/8] in the
// spec packing, scale and min [n, d/G] bf16 bits.
struct QuantizedRowsView {
  const uint8_t* codes = nullptr;
  const uint16_t* scale = nullptr;
  const uint16_t* min = nullptr;
};

struct AttentionKernels {
  // q [g, d] fp32 (original space); k, v: n bf16 rows; scratch >= g * n floats.
  void (*bf16_update)(const float* q, size_t g, Bf16RowsView k, Bf16RowsView v, size_t n,
                      int d, float scale, float* scratch, float* m, float* l,
                      float* acc) = nullptr;
  // q_rot [g, d] fp32, already rotated by the key write path (x·R_K, then P_br); k, v: n
  // quantized rows dequantized as y = q * scale + min with kp / vp (bits, group, head_dim);
  // acc accumulates in the rotated value space. scratch >= g * n floats.
  void (*history_update)(const float* q_rot, size_t g, QuantizedRowsView k,
                         QuantizedRowsView v, size_t n, const WriteParams& kp,
                         const WriteParams& vp, float scale, float* scratch, float* m,
                         float* l, float* acc) = nullptr;
};

struct Backend {
  std::string name;      // "scalar", "hwy_avx3", "hwy_avx2", "hwy_sse4", "hwy_scalar", ...
  int64_t hwy_target;    // Highway target bit, 0 for the scalar reference
  WriteKernels write;
  AttentionKernels attention;  // decode attention (attention.h)
};

// Scalar reference first, then every Highway target compiled in and supported by this CPU,
// best first. The list that tests and benchmarks expand.
const std::vector<Backend>& Backends();
const Backend& ScalarBackend();
// The best Highway target of this CPU: what production callers use (dynamic dispatch).
const Backend& BestBackend();
// Throws kvq::Error(kInvalidArgument) naming `name` and the available backends.
const Backend& BackendByName(const std::string& name);

}  // namespace kvq::cpu
