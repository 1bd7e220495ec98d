#include "kvq/common/head_data.h"

#include <cmath>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/common/params_builder.h"

namespace kvq {
namespace {

// Each array row's element type and noun, for the expansions below that dispatch by name.
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun_, valid, code, ...) \
  struct Row_##name {                                                           \
    using T = Type;                                                             \
    static constexpr const char* kNoun = noun_;                                 \
  };
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY

// The message's start: "<side> <noun> of KV head <h>" (no side: "<noun> of KV head <h>").
std::string Where(const std::string& side, const char* noun, size_t head) {
  return detail::Concat(side.empty() ? "" : side + " ", noun, " of KV head ", head);
}

// One head's `values` of the row called `row`: each value against the row's `valid`, then the
// row's KVQ_HEAD_ARRAY_RULE rows.
void CheckHeadValues(const char* row, const WriteParams& p, const void* values,
                     const std::string& side, size_t head) {
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...)                \
  if (std::strcmp(row, #name) == 0) {                                                      \
    const Type* held = static_cast<const Type*>(values);                                   \
    const size_t per_head = static_cast<size_t>(extent);                                  \
    for (size_t i = 0; i < per_head; ++i) {                                                \
      const Type v = held[i];                                                              \
      KVQ_CHECK(valid, code, Where(side, noun, head), " has ", +v, " at ", __VA_ARGS__);   \
    }                                                                                      \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_ARRAY_RULE(name, valid, ...)                                              \
  if (std::strcmp(row, #name) == 0) {                                                      \
    const Row_##name::T* v = static_cast<const Row_##name::T*>(values);                    \
    KVQ_CHECK(valid, kInvalidArgument, Where(side, Row_##name::kNoun, head), " ",          \
              __VA_ARGS__);                                                                \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY_RULE
}

}  // namespace

const void* HeadArrays::Find(const char* name) const {
#define KVQ_HEAD_ARRAY(row, Type, extent, use, fill, noun, valid, code, ...) \
  if (std::strcmp(name, #row) == 0) return row;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return nullptr;
}

bool HeadArrays::IsRow(const char* name) {
#define KVQ_HEAD_ARRAY(row, Type, extent, use, fill, noun, valid, code, ...) \
  if (std::strcmp(name, #row) == 0) return true;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return false;
}

FilledHeadArrays::FilledHeadArrays(const WriteParams& p, const HeadArrays& given) : view_(given) {
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  if (view_.name == nullptr && (use) == HeadArrayUse::kOptional) {            \
    name##_fill_.assign(static_cast<size_t>(extent), static_cast<Type>(fill)); \
    view_.name = name##_fill_.data();                                         \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
}

void ValidateHeadArray(const WriteParams& p, const HeadArrays& arrays, size_t head,
                       const char* name) {
  const void* values = arrays.Find(name);
  if (values != nullptr) CheckHeadValues(name, p, values, "", head);
}

void HeadData::Validate(const WriteParams& p, int num_kv_heads, const char* side) const {
  const size_t hkv = static_cast<size_t>(num_kv_heads);
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...)                  \
  {                                                                                        \
    const HeadArrayUse held_as = (use);                                                    \
    const size_t per_head = static_cast<size_t>(extent);                                   \
    if (held_as == HeadArrayUse::kAbsent) {                                                \
      KVQ_CHECK(name.empty(), kInvalidArgument, side, " " noun " given (", name.size(),     \
                " values) for parameters that have none (", params::Describe(p), ")");      \
    } else if (held_as == HeadArrayUse::kRequired || !name.empty()) {                      \
      KVQ_CHECK(name.size() == hkv * per_head, kShapeMismatch, side, " " noun " has ",      \
                name.size(), " values, expected [", hkv, ", ", per_head, "] = ",           \
                hkv * per_head);                                                           \
      for (size_t h = 0; h < hkv; ++h) {                                                   \
        CheckHeadValues(#name, p, name.data() + h * per_head, side, h);                    \
      }                                                                                    \
    }                                                                                      \
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
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  take(name, one.name, static_cast<size_t>(extent), noun);
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) take(name, one.name, 1, noun "s");
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY
  return one;
}

HeadArrays HeadData::Arrays(const WriteParams& p, int head) const {
  HeadArrays arrays;
  const size_t h = static_cast<size_t>(head);
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  if (!name.empty()) arrays.name = name.data() + h * static_cast<size_t>(extent);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return arrays;
}

}  // namespace kvq
