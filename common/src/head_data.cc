#include "kvq/common/head_data.h"

#include <cmath>

#include "kvq/common/error.h"
#include "kvq/common/params_builder.h"

namespace kvq {

void HeadData::Validate(const WriteParams& p, int num_kv_heads, const char* side) const {
  const size_t hkv = static_cast<size_t>(num_kv_heads);
#define KVQ_HEAD_ARRAY(name, Type, extent, present, noun, valid, code, ...)                   \
  if (present) {                                                                            \
    const size_t per_head = static_cast<size_t>(extent);                                   \
    KVQ_CHECK(name.size() == hkv * per_head, kShapeMismatch, side, " " noun " has ",         \
              name.size(), " values, expected [", hkv, ", ", per_head, "] = ",              \
              hkv * per_head);                                                              \
    for (size_t h = 0; h < hkv; ++h) {                                                      \
      for (size_t i = 0; i < per_head; ++i) {                                               \
        const Type v = name[h * per_head + i];                                              \
        KVQ_CHECK(valid, code, side, " " noun " of KV head ", h, " has ", v, " at ",        \
                  __VA_ARGS__);                                                             \
      }                                                                                     \
    }                                                                                       \
  } else {                                                                                  \
    KVQ_CHECK(name.empty(), kInvalidArgument, side, " " noun " given (", name.size(),       \
              " values) for parameters that have none (", params::Describe(p), ")");        \
  }
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                       \
  KVQ_CHECK(name.empty() || name.size() == hkv, kShapeMismatch, side, " " noun "s have ",     \
            name.size(), " values, expected one per KV head (", hkv, ")");                    \
  for (size_t h = 0; h < name.size(); ++h) {                                                  \
    const float v = name[h];                                                                  \
    KVQ_CHECK(valid, kInvalidArgument, side, " " noun " ", v, " of KV head ", h, " is not ",  \
              rule);                                                                          \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
}

WriteParams HeadData::Apply(WriteParams p, int head) const {
  const size_t h = static_cast<size_t>(head);
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) \
  if (!name.empty()) p.field = name[h];
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  return p;
}

HeadData HeadData::Slice(const WriteParams& p, int head, const char* side) const {
  HeadData one;
  auto take = [&](const auto& all, auto& out, size_t per_head, const char* noun) {
    if (all.empty()) return;
    KVQ_CHECK(head >= 0 && all.size() >= (static_cast<size_t>(head) + 1) * per_head,
              kShapeMismatch, side, " ", noun, ": ", all.size(), " values, none for KV head ",
              head, " (", per_head, " per head)");
    const auto first = all.begin() + static_cast<size_t>(head) * per_head;
    out.assign(first, first + per_head);
  };
#define KVQ_HEAD_ARRAY(name, Type, extent, present, noun, valid, code, ...) \
  take(name, one.name, static_cast<size_t>(extent), noun);
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) take(name, one.name, 1, noun "s");
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
  return one;
}

}  // namespace kvq
