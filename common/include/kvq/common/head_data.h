// The per-head data of one side (K or V) of a cache layer: the per-head arrays (the dense
// rotation matrices, the codebook block widths) and scalars (clip ratio, fp8 scale, ...) of
// head_data.inc. Everything that varies per KV head travels in this one record, so a new kind
// of per-head data is a row in head_data.inc, not a new argument.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/codebook.h"
#include "kvq/common/params.h"

namespace kvq {

// Whether a side holds a per-head array (head_data.inc's `use` column).
enum class HeadArrayUse : int { kAbsent, kOptional, kRequired };

// One KV head's per-head arrays: a pointer per KVQ_HEAD_ARRAY row to that head's `extent`
// values, null when the head holds none. What the write path takes per head (the rotation of
// the transforms, the arrays its codec steps read: formats.inc).
struct HeadArrays {
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  const Type* name = nullptr;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY

  // The array of the row called `name`, or null (no such row, or the head holds none).
  const void* Find(const char* name) const;
  // Whether `name` is a KVQ_HEAD_ARRAY row.
  static bool IsRow(const char* name);
};

// A head's arrays with every kOptional row it does not hold filled in (`extent` copies of the
// row's `fill` under p: a codebook head without widths reads every block at p.bits). Owns the
// filled values; moving keeps the pointers valid, copying is not allowed.
class FilledHeadArrays {
 public:
  FilledHeadArrays(const WriteParams& p, const HeadArrays& given);
  FilledHeadArrays(FilledHeadArrays&&) = default;
  FilledHeadArrays& operator=(FilledHeadArrays&&) = default;
  FilledHeadArrays(const FilledHeadArrays&) = delete;
  FilledHeadArrays& operator=(const FilledHeadArrays&) = delete;

  const HeadArrays& view() const { return view_; }

 private:
  HeadArrays view_;
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  std::vector<Type> name##_fill_;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
};

// Checks the array `name` (a KVQ_HEAD_ARRAY row) of KV head `head` under p: each value against
// the row's `valid` (its `code`), then the row's KVQ_HEAD_ARRAY_RULE rows (kInvalidArgument);
// messages name the array, the head and the value. An absent array passes.
void ValidateHeadArray(const WriteParams& p, const HeadArrays& arrays, size_t head,
                       const char* name);

struct HeadData {
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  std::vector<Type> name;  // [Hkv, extent] when held, empty otherwise
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) std::vector<float> name;  // [Hkv] or empty
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
#undef KVQ_HEAD_ARRAY

  // Throws kvq::Error naming `side` ("key" / "value"), the head and the value: an array of the
  // wrong size (kShapeMismatch), an array value that breaks its rule (the row's code: a
  // non-finite rotation entry is kNonFinite), a whole array that breaks a KVQ_HEAD_ARRAY_RULE
  // (kInvalidArgument: codebook widths needing more segments or code bytes than the side
  // allows), a required array missing or an array given for a side whose parameters do not
  // call for it (kInvalidArgument / kShapeMismatch), a scalar list that is neither empty nor
  // [num_kv_heads] (kShapeMismatch), a scalar that breaks its rule (kInvalidArgument).
  void Validate(const WriteParams& p, int num_kv_heads, const char* side) const;
  // p with KV head `head`'s scalars in place of p's (an empty list keeps p's value).
  WriteParams Apply(WriteParams p, int head) const;
  // KV head `head`'s data alone, as a side of one KV head holds it: every present array's
  // `extent` values of that head, every non-empty scalar list's value of that head; what is
  // empty stays empty. Throws kvq::Error(kShapeMismatch) naming `side`, the row and the head
  // when a non-empty row holds no values for `head` (a negative head included).
  HeadData Slice(const WriteParams& p, int head, const char* side) const;
  // KV head `head`'s arrays under p (null where the side holds none).
  HeadArrays Arrays(const WriteParams& p, int head) const;
};

}  // namespace kvq
