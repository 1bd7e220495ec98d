// History formats as data: which planes one KV head's stored history row (or tile) holds, with
// their dtypes and sizes, derived from the write parameters. The formats and their planes are
// listed once, in formats.inc; everything that stores, counts, uploads or compares history bytes
// asks LayoutOf() instead of spelling the shape out (spec/cache.md §4, spec/formats.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/tensor.h"

namespace kvq {

struct WriteParams;

enum class Format : int {
#define KVQ_FORMAT(id, Name, tile_tokens, spec, summary) k##Name,
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
};

// Every format in list order.
const std::vector<Format>& AllFormats();
const char* FormatName(Format format);     // "bf16", "affine_token"
const char* FormatSummary(Format format);  // one line, for --help and docs
const char* FormatSpecVersion(Format format);  // "1.0", "1.1", ...: the spec that brought it
// Throws kvq::Error(kInvalidArgument) naming `name` and listing the formats.
Format ParseFormat(const std::string& name);
// Whether `format` reads the write parameter `param` (a row name of write_params.inc) beyond
// head_dim and the shared transforms: formats.inc's KVQ_FORMAT_PARAM rows.
bool FormatReads(Format format, const char* param);

// How a plane's bytes are counted (CacheBytes): packed codes, per-group or per-tile metadata,
// or whole bf16 rows.
enum class PlaneRole : int { kCodes, kMetadata, kRows };
// One plane row per (KV head, token), per (KV head, tile of tile_tokens tokens), or per token
// for all KV heads together (kSharedToken: a page holds [1, P, elements] of it).
enum class PlaneScope : int { kToken, kTile, kSharedToken };

struct PlaneSpec {
  const char* name = "";  // "codes", "scale", "min", "rows": tensor names in files and vectors
  const char* source = "";  // the write-path output it stores (formats.inc's source column)
  DType dtype = DType::kU8;
  PlaneRole role = PlaneRole::kCodes;
  PlaneScope scope = PlaneScope::kToken;
  int64_t elements = 0;   // per row

  size_t row_bytes() const { return static_cast<size_t>(elements) * DTypeSize(dtype); }
};

inline constexpr int kMaxPlanes = 4;

// The planes of one format under given write parameters.
struct FormatLayout {
  Format format = Format::kAffineToken;
  int tile_tokens = 1;  // tokens per kTile plane row
  int num_planes = 0;
  PlaneSpec planes[kMaxPlanes];

  const PlaneSpec& plane(int i) const { return planes[i]; }
  // Index of the plane called `name`; -1 when the format has none.
  int Find(const std::string& name) const;
  // Plane rows a page of `page_size` tokens holds per KV head: page_size, or page_size /
  // tile_tokens for a tile plane.
  int64_t RowsPerPage(int plane, int page_size) const;
  // KV heads a page of the plane is laid out for: num_kv_heads, or 1 for a shared plane.
  int64_t HeadsPerPage(int plane, int num_kv_heads) const;
  // Bytes of one page of the plane: [HeadsPerPage, RowsPerPage, row_bytes].
  size_t PageBytes(int plane, int page_size, int num_kv_heads) const;
  // Byte offset, within the plane's pool, of the row that holds history token `token_in_page`
  // of page `page` for KV head `head` (the tile's row for a tile plane; the one shared row for
  // a shared plane).
  size_t RowOffset(int plane, int page_size, int num_kv_heads, int64_t page, int head,
                   int64_t token_in_page) const;
  // Bytes that `tokens` history tokens of `num_kv_heads` KV heads occupy in planes of `role`
  // (a tile plane is counted per started tile, a shared plane once for all heads).
  size_t Bytes(PlaneRole role, int64_t tokens, int num_kv_heads) const;
};

// The layout of p.format under p (which must be valid: WriteParams::Validate).
FormatLayout LayoutOf(const WriteParams& p);

}  // namespace kvq
