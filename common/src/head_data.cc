#include "kvq/common/head_data.h"

#include <cmath>

#include "kvq/common/error.h"

namespace kvq {

void HeadData::Validate(const WriteParams& p, int num_kv_heads, const char* side) const {
  const size_t hkv = static_cast<size_t>(num_kv_heads);
  const size_t d = static_cast<size_t>(p.head_dim);
  if (p.rotation == RotationKind::kDense) {
    KVQ_CHECK(rotation.size() == hkv * d * d, kShapeMismatch, side, " rotation has ",
              rotation.size(), " values, expected [", hkv, ", ", d, ", ", d, "] = ", hkv * d * d);
    for (size_t i = 0; i < rotation.size(); ++i) {
      KVQ_CHECK(std::isfinite(rotation[i]), kNonFinite, side, " rotation of KV head ",
                i / (d * d), " has ", rotation[i], " at row ", (i / d) % d, ", column ", i % d);
    }
  } else {
    KVQ_CHECK(rotation.empty(), kInvalidArgument, side, " rotation matrices given (",
              rotation.size(), " values) but the ", side, " rotation is '",
              RotationKindName(p.rotation), "'");
  }
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                              \
  KVQ_CHECK(name.empty() || name.size() == hkv, kShapeMismatch, side, " " noun "s have ",      \
            name.size(), " values, expected one per KV head (", hkv, ")");                     \
  for (size_t h = 0; h < name.size(); ++h) {                                                    \
    const float v = name[h];                                                                    \
    KVQ_CHECK(valid, kInvalidArgument, side, " " noun " ", v, " of KV head ", h, " is not ",   \
              rule);                                                                            \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
}

WriteParams HeadData::Apply(WriteParams p, int head) const {
  const size_t h = static_cast<size_t>(head);
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) \
  if (!name.empty()) p.field = name[h];
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  return p;
}

HeadData HeadData::Slice(int head, int head_dim) const {
  const size_t h = static_cast<size_t>(head);
  const size_t dd = static_cast<size_t>(head_dim) * static_cast<size_t>(head_dim);
  HeadData out;
  if (!rotation.empty()) {
    out.rotation.assign(rotation.begin() + h * dd, rotation.begin() + (h + 1) * dd);
  }
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) \
  if (!name.empty()) out.name = {name[h]};
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  return out;
}

}  // namespace kvq
