// How the CUDA path stores and reads the history formats of kvq/common/formats.inc: where the
// kernels find each plane of a format's layout (LayoutOf), and which compile-time history kind
// of the decode kernels serves a format. Everything else (pool sizes, page strides, uploads)
// asks LayoutOf.
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

// The decode kernels' compile-time history kinds. kInt2 / kInt4: affine_token with 2 / 4-bit
// codes on K and V; kTileInt2 / kTileInt4: affine_tile keys (per-channel scale / min over tiles
// of G_k tokens, optional norm) with affine_token values of the same width; kBf16: the bf16
// baseline cache, every token a bf16 row in the pages (no windows); kFp8: fp8_e4m3 on K and V
// (per-head scales s^ folded into the step). The low byte is the width.
enum class HistoryFormat : int {
  kInt2 = 2,
  kInt4 = 4,
  kBf16 = 16,
  kTileInt2 = 0x100 | 2,
  kTileInt4 = 0x100 | 4,
  kFp8 = 0x200 | 8,
};
constexpr int BitsOfKind(HistoryFormat kind) { return static_cast<int>(kind) & 0xff; }
constexpr bool IsTileKind(HistoryFormat kind) { return (static_cast<int>(kind) & 0x100) != 0; }

// The kinds and head dimensions the decode kernel is instantiated for (the instantiation,
// dispatch, extern-template and shared-memory lists expand these): X(HistoryFormat enumerator)
// and X(head_dim, extra...), the extra arguments passed through.
#define KVQ_GPU_HISTORY_FORMATS(X) X(kInt2) X(kInt4) X(kBf16) X(kTileInt2) X(kTileInt4) X(kFp8)
#define KVQ_GPU_HEAD_DIMS(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)

// The kind that serves history rows of `format` with `bits`-bit codes: true and *kind, or false
// when the kernels have none. The one mapping from formats.inc to the kernels (one function per
// format there, so a new format does not compile until it says what the GPU does with it).
bool HistoryFormatOf(Format format, int bits, HistoryFormat* kind);

// The kernel kind of a cache whose keys are of kind `key` and values of kind `value`: the same
// kind on both, or tile keys (kTileIntB) over per-token values of the same width (kIntB); false
// otherwise (the kernels have no loop for it).
bool StepKindOf(HistoryFormat key, HistoryFormat value, HistoryFormat* kind);

}  // namespace attention
}  // namespace kvq::gpu
