// How the CUDA path stores and reads the history formats of kvq/common/formats.inc: where the
// kernels find each plane of a format's layout (LayoutOf), and which formats and widths the
// decode kernels read on each side. Everything else (pool sizes, page strides, uploads) asks
// LayoutOf.
#pragma once

#include <cstdint>

#include "kvq/common/format.h"
#include "kvq/common/params.h"

namespace kvq::gpu {

// affine_token's planes, in LayoutOf's order: the positions the write and decode kernels store
// and read (codes u8 [d*b/8], scale bf16 [d/G], min bf16 [d/G] per row).
inline constexpr int kAffineCodesPlane = 0;
inline constexpr int kAffineScalePlane = 1;
inline constexpr int kAffineMinPlane = 2;
// affine_tile's planes (spec 1.1, KIVI / OScaR keys): codes u8 [d * G_k*b/8] per tile
// (channel-major), scale and min bf16 [d] per tile, and with a norm the norm bf16 [1] per token
// (per KV head, or one row shared by the KV heads for the token scope).
inline constexpr int kTileCodesPlane = 0;
inline constexpr int kTileScalePlane = 1;
inline constexpr int kTileMinPlane = 2;
inline constexpr int kTileNormPlane = 3;
// bf16's one plane: the rows, bf16 [d].
inline constexpr int kBf16RowsPlane = 0;
// fp8_e4m3's one plane (spec 1.2): the codes, one e4m3 byte a value, u8 [d].
inline constexpr int kFp8CodesPlane = 0;

// Throws kvq::Error(kUnsupported) naming the format unless the kernels were written for
// LayoutOf(p): its planes where the positions above say, with the scopes (per token, per tile,
// per token shared by the KV heads) the kernels address. `what` names
// the caller in the message.
void CheckKernelLayout(const WriteParams& p, const char* what);

namespace attention {

// A side's history kind for the decode kernels: a format of formats.inc at a code width. The
// kernels take the keys' kind and the values' kind as separate template parameters.
template <Format FORMAT, int BITS>
struct HistoryKind {
  static constexpr Format kFormat = FORMAT;
  static constexpr int kBits = BITS;
};

// The kinds the decode kernels read, per side (formats x widths): X(Format enumerator, bits,
// extra...), the extra arguments passed through. The instantiation, dispatch and shared-memory
// lists expand their product, of which DecodePair keeps the pairs a loop reads; a format or a
// width not listed here is answered kUnsupported by name.
#define KVQ_GPU_KEY_KINDS(X, ...)                                      \
  X(kAffineToken, 2, __VA_ARGS__) X(kAffineToken, 4, __VA_ARGS__)     \
  X(kAffineTile, 2, __VA_ARGS__) X(kAffineTile, 4, __VA_ARGS__)       \
  X(kBf16, 16, __VA_ARGS__) X(kFp8E4m3, 8, __VA_ARGS__)
#define KVQ_GPU_VALUE_KINDS(X, ...)                                    \
  X(kAffineToken, 2, __VA_ARGS__) X(kAffineToken, 4, __VA_ARGS__)     \
  X(kBf16, 16, __VA_ARGS__) X(kFp8E4m3, 8, __VA_ARGS__)
// The head dimensions: X(head_dim, extra...).
#define KVQ_GPU_HEAD_DIMS(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)

// Whether a loop of the decode kernel reads keys of kind K over values of kind V: bf16 rows on
// both sides (the bf16 cache), fp8_e4m3 on both (per-head scales folded into the step), or
// INT-b keys, per token (affine_token) or tiled over G_k tokens (affine_tile, spec 1.1), over
// per-token INT-b values, each side at its own width (K4V2 and the like).
template <class K, class V>
constexpr bool DecodePair() {
  constexpr bool same = K::kFormat == V::kFormat && K::kBits == V::kBits;
  if (K::kFormat == Format::kBf16 || K::kFormat == Format::kFp8E4m3) return same;
  return (K::kFormat == Format::kAffineToken || K::kFormat == Format::kAffineTile) &&
         V::kFormat == Format::kAffineToken;
}

// A cache's history kinds at run time: its keys' and values' formats and widths.
struct DecodeKinds {
  Format key_format;
  int key_bits;
  Format value_format;
  int value_bits;
};

// The width a side's row of the kind lists names: p.bits, or 16 for bf16 rows (their bits
// field is unused).
int KindBits(const WriteParams& p);
// Whether a side's format at `bits` is in KVQ_GPU_KEY_KINDS / KVQ_GPU_VALUE_KINDS.
bool IsKeyKind(Format format, int bits);
bool IsValueKind(Format format, int bits);
// Whether the kernels read `kinds`: each side one of the lists above, the pair DecodePair's.
bool DecodeKindsServed(const DecodeKinds& kinds);

}  // namespace attention
}  // namespace kvq::gpu
