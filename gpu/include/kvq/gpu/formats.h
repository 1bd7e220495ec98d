// What the CUDA path knows of the history formats of kvq/common/formats.inc, as rows: the
// planes its kernels read (KVQ_GPU_PLANES), the formats its write stores
// (KVQ_GPU_WRITE_FORMATS), the formats and widths its decode reads on each side
// (KVQ_GPU_KEY_KINDS, KVQ_GPU_VALUE_KINDS) and what the decode plan knows of each
// (KVQ_GPU_DECODE_FORMATS). A format with CUDA kernels is rows here plus its kernel files;
// everything else (pool sizes, page strides, uploads) asks LayoutOf.
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
// codebook's planes (spec 1.3): the packed codes, u8 [row_code_bytes()], and the corrected
// segment norms, bf16 [segments], per token.
inline constexpr int kCodebookCodesPlane = 0;
inline constexpr int kCodebookNormPlane = 1;

// The planes the kernels read, per format, in LayoutOf's order: X(Name, position, present, name,
// row bytes, scope), `present`, the row bytes and the scope expressions over the side's
// WriteParams p (d = p.head_dim, groups = p.num_groups()).
#define KVQ_GPU_PLANES(X)                                                                  \
  X(Bf16, kBf16RowsPlane, true, "rows", 2 * d, PlaneScope::kToken)                         \
  X(AffineToken, kAffineCodesPlane, true, "codes", p.packed_bytes(), PlaneScope::kToken)     \
  X(AffineToken, kAffineScalePlane, true, "scale", 2 * groups, PlaneScope::kToken)         \
  X(AffineToken, kAffineMinPlane, true, "min", 2 * groups, PlaneScope::kToken)             \
  X(AffineTile, kTileCodesPlane, true, "codes", d * p.tile_channel_bytes(), PlaneScope::kTile) \
  X(AffineTile, kTileScalePlane, true, "scale", 2 * d, PlaneScope::kTile)                  \
  X(AffineTile, kTileMinPlane, true, "min", 2 * d, PlaneScope::kTile)                      \
  X(AffineTile, kTileNormPlane, p.norm, "norm", 2,                                         \
    p.norm_heads > 1 ? PlaneScope::kSharedToken : PlaneScope::kToken)                      \
  X(Fp8E4m3, kFp8CodesPlane, true, "codes", d, PlaneScope::kToken)                      \
  X(Codebook, kCodebookCodesPlane, true, "codes", p.row_code_bytes(), PlaneScope::kToken)   \
  X(Codebook, kCodebookNormPlane, true, "norm", 2 * p.segments, PlaneScope::kToken)

// Throws kvq::Error(kUnsupported) naming the format unless the kernels were written for
// LayoutOf(p): its planes where KVQ_GPU_PLANES says, with the sizes and scopes (per token, per
// tile, per token shared by the KV heads) the kernels address. `what` names the caller in the
// message.
void CheckKernelLayout(const WriteParams& p, const char* what);

// The formats the CUDA write stores, a row each: X(Name) of formats.inc. Each has, beside its
// kernels (declared in kvq/gpu/write.h from this list, defined in its kernel file):
//   void CheckWrite<Name>(const WriteParams& p, const char* what);  kUnsupported naming what
//                                                                    its kernels do not serve
//   cudaError_t Write<Name>(const WriteParams& p, const FusedWriteArgs& a, cudaStream_t s);
// which the write API (gpu/src/write_api.cc) calls for rows of that format.
#define KVQ_GPU_WRITE_FORMATS(X) X(AffineToken) X(AffineTile) X(Fp8E4m3) X(Codebook)

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
  X(kBf16, 16, __VA_ARGS__) X(kFp8E4m3, 8, __VA_ARGS__)               \
  X(kCodebook, 0, __VA_ARGS__)
#define KVQ_GPU_VALUE_KINDS(X, ...)                                    \
  X(kAffineToken, 2, __VA_ARGS__) X(kAffineToken, 4, __VA_ARGS__)     \
  X(kBf16, 16, __VA_ARGS__) X(kFp8E4m3, 8, __VA_ARGS__)               \
  X(kCodebook, 0, __VA_ARGS__)
// The head dimensions: X(head_dim, extra...).
#define KVQ_GPU_HEAD_DIMS(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)

// What the decode kernels know of a format of a side's history, one row per format they read
// (KVQ_GPU_DECODE_FORMATS): the loops of the history split its keys have (a bit per
// QuantLoop, kvq/gpu/attention_launch.h), what the plan checks of its rows (RowGeometry), the
// values its keys pair with (a format, at the keys' width or at any width of the value list),
// and whether the step reads the per-head scale s^ (head_data.inc's `scale`).
enum class RowGeometry {
  kWholeRows,      // one value a channel (bf16, fp8_e4m3): nothing to check
  kChannelGroups,  // INT-b codes in groups of G channels (affine_token): G >= d*b/8, G listed
  kKeyTiles,       // INT-b keys in tiles of G_k tokens (affine_tile): G_k * b / 8 in {8, 16}
};
inline constexpr unsigned kTwoMmaLoop = 1u << 0;  // QuantLoop::kTwoMma
inline constexpr unsigned kPackedLoop = 1u << 1;  // QuantLoop::kPacked
inline constexpr unsigned kInt8QkLoop = 1u << 2;  // QuantLoop::kInt8Qk
struct DecodeFormat {
  bool listed = false;  // false: the decode kernels do not read the format
  unsigned loops = 0;
  RowGeometry geometry = RowGeometry::kWholeRows;
  Format values = Format::kBf16;  // the value format its keys pair with
  bool same_width = true;         // the values at the keys' width only
  bool head_scale = false;
  bool runtime_widths = false;  // widths are per-head data read at run time: kind bits 0
};

// X(Name, loops, geometry, value format, same width, head scale, run-time widths).
#define KVQ_GPU_DECODE_FORMATS(X)                                                         \
  X(Bf16, kTwoMmaLoop, kWholeRows, Bf16, true, false, false)                              \
  X(AffineToken, kTwoMmaLoop | kPackedLoop | kInt8QkLoop, kChannelGroups, AffineToken,    \
    false, false, false)                                                                  \
  X(AffineTile, kTwoMmaLoop | kPackedLoop, kKeyTiles, AffineToken, false, false, false)   \
  X(Fp8E4m3, kTwoMmaLoop, kWholeRows, Fp8E4m3, true, true, false)                         \
  X(Codebook, kTwoMmaLoop | kPackedLoop, kWholeRows, Codebook, true, false, true)

constexpr DecodeFormat DecodeFormatOf(Format format) {
#define KVQ_DECODE_FORMAT_ROW(Name, loops, geometry, Values, same_width, head_scale,      \
                              runtime_widths)                                            \
  if (format == Format::k##Name) {                                                       \
    return DecodeFormat{true, loops, RowGeometry::geometry, Format::k##Values, same_width, \
                        head_scale, runtime_widths};                                     \
  }
  KVQ_GPU_DECODE_FORMATS(KVQ_DECODE_FORMAT_ROW)
#undef KVQ_DECODE_FORMAT_ROW
  return DecodeFormat{};
}

// Whether a loop of the decode kernel reads keys of kind K over values of kind V: the keys'
// row says which value format, and whether at the keys' width only (bf16 and fp8_e4m3 on both
// sides; INT-b keys, per token or tiled, over per-token INT-b values at either width: K4V2).
template <class K, class V>
constexpr bool DecodePair() {
  constexpr DecodeFormat keys = DecodeFormatOf(K::kFormat);
  return keys.listed && keys.values == V::kFormat && (!keys.same_width || K::kBits == V::kBits);
}

// A cache's history kinds at run time: its keys' and values' formats and widths.
struct DecodeKinds {
  Format key_format;
  int key_bits;
  Format value_format;
  int value_bits;
};

// The width a side's row of the kind lists names: p.bits, 16 for bf16 rows (their bits field
// is unused), 0 for a format whose widths the kernels read at run time (codebook).
int KindBits(const WriteParams& p);
// Whether a side's format at `bits` is in KVQ_GPU_KEY_KINDS / KVQ_GPU_VALUE_KINDS.
bool IsKeyKind(Format format, int bits);
bool IsValueKind(Format format, int bits);
// Whether the kernels read `kinds`: each side one of the lists above, the pair DecodePair's.
bool DecodeKindsServed(const DecodeKinds& kinds);

}  // namespace attention
}  // namespace kvq::gpu
