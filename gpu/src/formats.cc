// kvq/gpu/formats.h: the CUDA kernels' view of the history formats of formats.inc.
#include "kvq/gpu/formats.h"

#include <cstring>

#include "kvq/common/error.h"

namespace kvq::gpu {
namespace {

// One function per format of kvq/common/formats.inc: the decode kernels' kind for its rows.
// A format added there does not compile here until it has one (say false for "none").
bool KindOfBf16(int /*bits*/, attention::HistoryFormat* kind) {
  *kind = attention::HistoryFormat::kBf16;
  return true;
}
bool KindOfAffineToken(int bits, attention::HistoryFormat* kind) {
  switch (bits) {
    case 2: *kind = attention::HistoryFormat::kInt2; return true;
    case 4: *kind = attention::HistoryFormat::kInt4; return true;
    default: return false;
  }
}

// Spec 1.1's tiles (KIVI / OScaR keys): the tile kinds (keys only: StepKindOf pairs them with
// per-token values).
bool KindOfAffineTile(int bits, attention::HistoryFormat* kind) {
  switch (bits) {
    case 2: *kind = attention::HistoryFormat::kTileInt2; return true;
    case 4: *kind = attention::HistoryFormat::kTileInt4; return true;
    default: return false;
  }
}

// Spec 1.2's fp8_e4m3: the fp8 decode kind (the paged write refuses it by name for now).
bool KindOfFp8E4m3(int bits, attention::HistoryFormat* kind) {
  if (bits != 8) return false;
  *kind = attention::HistoryFormat::kFp8;
  return true;
}

// Whether plane `index` of `layout` is called `name`, holds `bytes` bytes a row and has
// `scope` (a per-token plane unless said otherwise).
bool PlaneIs(const FormatLayout& layout, int index, const char* name, size_t bytes,
             PlaneScope scope = PlaneScope::kToken) {
  if (index >= layout.num_planes) return false;
  const PlaneSpec& plane = layout.plane(index);
  return std::strcmp(plane.name, name) == 0 && plane.row_bytes() == bytes &&
         plane.scope == scope;
}

}  // namespace

void CheckKernelLayout(const WriteParams& p, const char* what) {
  const FormatLayout layout = LayoutOf(p);
  const size_t d = static_cast<size_t>(p.head_dim);
  const int groups = p.num_groups();
  bool known = false;
  switch (p.format) {
    case Format::kBf16:
      known = layout.num_planes == 1 && PlaneIs(layout, kBf16RowsPlane, "rows", 2 * d);
      break;
    case Format::kAffineToken:
      known = layout.num_planes == 3 &&
              PlaneIs(layout, kAffineCodesPlane, "codes", static_cast<size_t>(p.code_bytes())) &&
              PlaneIs(layout, kAffineScalePlane, "scale", 2 * static_cast<size_t>(groups)) &&
              PlaneIs(layout, kAffineMinPlane, "min", 2 * static_cast<size_t>(groups));
      break;
    case Format::kAffineTile:  // the tile write (write_tile.cu)
      known = layout.num_planes == (p.norm ? 4 : 3) &&
              PlaneIs(layout, kTileCodesPlane, "codes",
                      d * static_cast<size_t>(p.tile_channel_bytes()), PlaneScope::kTile) &&
              PlaneIs(layout, kTileScalePlane, "scale", 2 * d, PlaneScope::kTile) &&
              PlaneIs(layout, kTileMinPlane, "min", 2 * d, PlaneScope::kTile) &&
              (!p.norm || PlaneIs(layout, kTileNormPlane, "norm", 2,
                                  p.norm_heads > 1 ? PlaneScope::kSharedToken
                                                   : PlaneScope::kToken));
      break;
    case Format::kFp8E4m3:  // the fp8 decode (attention_fp8_rows.cuh)
      known = layout.num_planes == 1 && PlaneIs(layout, kFp8CodesPlane, "codes", d);
      break;
  }
  KVQ_CHECK(known, kUnsupported, what, ": the CUDA kernels do not read the layout of format ",
            FormatName(p.format), " (", layout.num_planes, " planes)");
}

namespace attention {

bool HistoryFormatOf(Format format, int bits, HistoryFormat* kind) {
  switch (format) {
#define KVQ_FORMAT(id, Name, tile_tokens, spec, summary) \
  case Format::k##Name:                                  \
    return KindOf##Name(bits, kind);
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  }
  return false;
}

bool StepKindOf(HistoryFormat key, HistoryFormat value, HistoryFormat* kind) {
  const bool same = key == value && !IsTileKind(key);
  const bool tile_keys = IsTileKind(key) && !IsTileKind(value) && value != HistoryFormat::kBf16 &&
                         BitsOfKind(key) == BitsOfKind(value);
  if (!same && !tile_keys) return false;
  *kind = key;
  return true;
}

}  // namespace attention
}  // namespace kvq::gpu
