// kvq/gpu/formats.h: the CUDA kernels' view of the history formats of formats.inc.
#include "kvq/gpu/formats.h"

#include <cstring>

#include "kvq/common/error.h"

namespace kvq::gpu {
namespace {

// Whether plane `index` of `layout` is called `name`, holds `bytes` bytes a row and has
// `scope`.
bool PlaneIs(const FormatLayout& layout, int index, const char* name, size_t bytes,
             PlaneScope scope) {
  if (index >= layout.num_planes) return false;
  const PlaneSpec& plane = layout.plane(index);
  return std::strcmp(plane.name, name) == 0 && plane.row_bytes() == bytes &&
         plane.scope == scope;
}

}  // namespace

void CheckKernelLayout(const WriteParams& p, const char* what) {
  const FormatLayout layout = LayoutOf(p);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t groups = static_cast<size_t>(p.num_groups());
  bool listed = false, known = true;
  int planes = 0;
#define KVQ_PLANE_ROW(Name, position, present, name, bytes, scope)                        \
  if (p.format == Format::k##Name && (present)) {                                         \
    listed = true;                                                                        \
    ++planes;                                                                             \
    known = known && PlaneIs(layout, position, name, static_cast<size_t>(bytes), scope);  \
  }
  KVQ_GPU_PLANES(KVQ_PLANE_ROW)
#undef KVQ_PLANE_ROW
  known = listed && known && layout.num_planes == planes;
  KVQ_CHECK(known, kUnsupported, what, ": the CUDA kernels do not read the layout of format ",
            FormatName(p.format), " (", layout.num_planes, " planes)");
}

namespace attention {

int KindBits(const WriteParams& p) {
  if (DecodeFormatOf(p.format).runtime_widths) return 0;
  return p.format == Format::kBf16 ? 16 : p.bits;
}

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
