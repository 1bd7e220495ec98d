// The parameter structs shared by the CPU oracle (cpu_ref/) and the CUDA path (gpu/).
// Every step on both sides takes the same struct, so a configuration means one thing everywhere.
// spec/numerics.md defines each field; Validate() rejects what the spec does not support.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/common/format.h"
#include "kvq/common/lloyd_max.h"
#include "kvq/common/numeric.h"

namespace kvq {

// Largest rotated magnitude the write path accepts: keeps hi - lo, the scale and every
// dequantized value finite (spec/numerics.md §6).
inline constexpr float kMaxRotatedAbs = 8.50705917e37f;  // 2^126

enum class RotationKind : int {
  kIdentity = 0,  // x~ = x
  kDense = 1,     // x~ = x·R, R a d×d fp32 matrix (OSCAR's U·H·P_br, or any orthogonal R)
  kHadamard = 2,  // x~ = x·H (normalised FWHT, block-diagonal when hadamard_block < head_dim)
};

const char* RotationKindName(RotationKind kind);
// The kind named `name` ("identity", "dense", "hadamard"); kvq::Error(kInvalidArgument) naming
// it otherwise.
RotationKind ParseRotationKind(const std::string& name);

// Write path of one row: the transforms (rotate -> bit reversal -> norm -> clip) then the codec
// of `format` (affine_token: quantize -> pack; affine_tile: quantize_tile -> pack_tile over
// tiles of `group` tokens; codebook: segment norms -> codes and corrected norms -> pack, with
// no norm and no clip). A bf16 format stores the original row and reads none of the other
// fields but head_dim.
struct WriteParams {
  // One member per row of write_params.inc (its comments say what each means).
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) Type name = init;
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM

  // Throws kvq::Error(kInvalidArgument) naming the first unsupported value.
  void Validate() const;

  int levels() const { return (1 << bits) - 1; }                 // L = 2^b - 1 (affine)
  int num_groups() const { return head_dim / group; }            // d / G (affine_token)
  KVQ_HOST_DEVICE int packed_bytes() const { return head_dim * bits / 8; }  // d*b/8 split-packed
  // Code bytes a codebook row stores: the `code_bytes` field, or d*b/8 (the uniform row's)
  // when it is 0 (spec/numerics.md §5.4.1). Host and device (the CUDA codebook stages).
  KVQ_HOST_DEVICE int row_code_bytes() const {
    return code_bytes != 0 ? code_bytes : packed_bytes();
  }
  // Tokens one plane row of a tile plane covers (formats.inc's tile_tokens column): G_k for
  // affine_tile, 1 for formats whose planes are all per token.
  int tile_tokens() const;
  // Packed bytes per channel of one tile: G_k * b / 8 (affine_tile).
  int tile_channel_bytes() const { return group * bits / 8; }
  // Values one norm spans: d * norm_heads.
  int norm_span() const { return head_dim * norm_heads; }
  int fwht_block() const { return hadamard_block == 0 ? head_dim : hadamard_block; }
  // The FWHT normaliser fp32(1/sqrt(fwht_block())), computed in double and rounded once
  // (spec/numerics.md §3.2): the one definition the CPU and GPU paths use.
  float fwht_scale() const;
  bool quantized() const { return format != Format::kBf16; }
};

// The paged KV cache (spec/cache.md): BF16 sink | history in pages | BF16 recent window.
// Used unchanged by the CPU oracle and the CUDA path. Per-KV-head rotations and clip ratios are
// data, not parameters (they override key.clip / value.clip per head). The history's format is
// key.format / value.format; a bf16 format on both is the bf16 baseline cache (every token a
// bf16 row, no windows).
struct CacheParams {
  int num_kv_heads = 8;      // Hkv
  int num_q_heads = 32;      // Hq, a positive multiple of Hkv (GQA group g = Hq / Hkv)
  int sink = 64;             // S0 >= 0
  int recent = 256;          // W >= 0 (spec 1.0: W >= 1; W = 0 writes every token after the
                             //   sink straight to the history)
  int flush = 1;             // F >= 1: the history grows F tokens at a time (HistoryTokens);
                             //   a multiple of the tile of a tile format
  int page_size = 64;        // P, history tokens per page: power of two in [16, 1024]
  WriteParams key;           // K write path (format, head_dim, group, bits, rotation, ...);
  WriteParams value;         // V write path; key.head_dim == value.head_dim == d
  float softmax_scale = 0;   // 0 means 1/sqrt(d) computed as (float)(1.0/sqrt((double)d))

  // Throws kvq::Error(kInvalidArgument) naming the first unsupported value (also validates
  // key and value, prefixing their messages with "key: " / "value: ").
  void Validate() const;

  int head_dim() const { return key.head_dim; }
  int group_size() const { return num_q_heads / num_kv_heads; }  // g = Hq / Hkv
  // Whether the history is stored in a quantized format (false: the bf16 baseline cache).
  bool quantized() const { return key.quantized(); }
  // The window rule (spec/cache.md §2): at length t the history holds positions
  // [S0, S0 + H(t)) with H(t) = F * floor(max(0, t - S0 - W) / F); 0 for a bf16 cache.
  int64_t HistoryTokens(int64_t t) const;
  // First position of the recent window at length t: min(t, S0 + H(t)) (bf16 cache: min(t, S0)).
  int64_t RecentBegin(int64_t t) const;
  // Bits per element of K and V in the quantized history, the bf16 windows not counted: the
  // code and metadata planes of one page (LayoutOf(key), LayoutOf(value)) over 2 * P * Hkv * d
  // elements; 16 for the bf16 cache. (PagedKVCache::Bytes counts the windows too.)
  double history_bits_per_element() const;
  // Slots of the recent ring: W + F - 1 (position p lives at slot p % ring_slots()).
  int ring_slots() const { return recent + flush - 1; }
  // The scale the logits are multiplied by: softmax_scale, or fp32(1/sqrt(d)) when it is 0.
  float scale() const;
};

bool IsSupportedHeadDim(int d);
// 32, 64 or 128: the channel groups of spec 1.0 and the tiles of affine_tile.
bool IsSupportedGroup(int g);
// A channel group of affine_token at head_dim d: IsSupportedGroup(g) with g <= d, or g == d
// (one (scale, min) per row, SAW-INT4; spec 1.1).
bool IsSupportedGroup(int g, int d);

}  // namespace kvq
