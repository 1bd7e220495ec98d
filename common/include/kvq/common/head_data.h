// The per-head data of one side (K or V) of a cache layer: the per-head arrays (the dense
// rotation matrices) and scalars (clip ratio, fp8 scale, ...) of head_data.inc. Everything that
// varies per KV head travels in this one record, so a new kind of per-head data is a row in
// head_data.inc, not a new argument.
#pragma once

#include <vector>

#include "kvq/common/params.h"

namespace kvq {

struct HeadData {
#define KVQ_HEAD_ARRAY(name, Type, extent, present, noun, valid, code, ...) \
  std::vector<Type> name;  // [Hkv, extent] when present, empty otherwise
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) std::vector<float> name;  // [Hkv] or empty
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY

  // Throws kvq::Error naming `side` ("key" / "value"), the head and the value: an array of the
  // wrong size (kShapeMismatch), an array value that breaks its rule (the row's code: a
  // non-finite rotation entry is kNonFinite), an array given for a side whose parameters do not
  // call for it (kInvalidArgument), a scalar list that is neither empty nor [num_kv_heads]
  // (kShapeMismatch), a scalar that breaks its rule (kInvalidArgument).
  void Validate(const WriteParams& p, int num_kv_heads, const char* side) const;
  // p with KV head `head`'s scalars in place of p's (an empty list keeps p's value).
  WriteParams Apply(WriteParams p, int head) const;
  // KV head `head`'s data alone, as a side of one KV head holds it: every present array's
  // `extent` values of that head, every non-empty scalar list's value of that head; what is
  // empty stays empty. Throws kvq::Error(kShapeMismatch) naming `side`, the row and the head
  // when a non-empty row holds no values for `head` (a negative head included).
  HeadData Slice(const WriteParams& p, int head, const char* side) const;
};

}  // namespace kvq
