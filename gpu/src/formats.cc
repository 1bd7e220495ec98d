// kvq/gpu/formats.h: the CUDA kernels' view of the history formats of formats.inc.
#include "kvq/gpu/formats.h"

#include <cstring>

#include "kvq/common/error.h"

namespace kvq::gpu {
namespace {

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

int KindBits(const WriteParams& p) { return p.format == Format::kBf16 ? 16 : p.bits; }

#define KVQ_KIND_IS(F, B, ...) \
  if (format == Format::F && bits == B) return true;
bool IsKeyKind(Format format, int bits) {
  KVQ_GPU_KEY_KINDS(KVQ_KIND_IS)
  return false;
}
bool IsValueKind(Format format, int bits) {
  KVQ_GPU_VALUE_KINDS(KVQ_KIND_IS)
  return false;
}
#undef KVQ_KIND_IS

bool DecodeKindsServed(const DecodeKinds& kinds) {
#define KVQ_PAIR_SERVED(VF, VB, KF, KB)                                                 \
  if (kinds.key_format == Format::KF && kinds.key_bits == KB &&                        \
      kinds.value_format == Format::VF && kinds.value_bits == VB) {                    \
    return DecodePair<HistoryKind<Format::KF, KB>, HistoryKind<Format::VF, VB>>();     \
  }
#define KVQ_KEY_SERVED(KF, KB, ...) KVQ_GPU_VALUE_KINDS(KVQ_PAIR_SERVED, KF, KB)
  KVQ_GPU_KEY_KINDS(KVQ_KEY_SERVED)
#undef KVQ_KEY_SERVED
#undef KVQ_PAIR_SERVED
  return false;
}

}  // namespace attention
}  // namespace kvq::gpu
