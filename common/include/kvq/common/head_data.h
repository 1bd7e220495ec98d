// The per-head data of one side (K or V) of a cache layer: the dense rotation matrices and the
// per-head scalars of head_data.inc (clip ratio, fp8 scale, ...). Everything that varies per KV
// head travels in this one record, so a new kind of per-head data is a row in head_data.inc,
// not a new argument.
#pragma once

#include <vector>

#include "kvq/common/params.h"

namespace kvq {

struct HeadData {
  // [Hkv, d, d] fp32 row-major when the side's rotation is dense (x~ = x·R); empty otherwise.
  std::vector<float> rotation;
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) std::vector<float> name;  // [Hkv] or empty
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR

  // Throws kvq::Error naming `side` ("key" / "value"), the head and the value: a rotation of
  // the wrong size (kShapeMismatch) or with a non-finite entry (kNonFinite), rotation matrices
  // given for a side whose rotation is not dense (kInvalidArgument), a scalar list that is
  // neither empty nor [num_kv_heads] (kShapeMismatch), a scalar that breaks its rule
  // (kInvalidArgument).
  void Validate(const WriteParams& p, int num_kv_heads, const char* side) const;
  // p with KV head `head`'s scalars in place of p's (an empty list keeps p's value).
  WriteParams Apply(WriteParams p, int head) const;
  // KV head `head` alone (a record for Hkv = 1); head_dim sizes the rotation.
  HeadData Slice(int head, int head_dim) const;
};

}  // namespace kvq
