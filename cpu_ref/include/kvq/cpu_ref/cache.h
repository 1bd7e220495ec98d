// The paged KV cache of the CPU oracle (spec/cache.md): per sequence a BF16 sink of S0
// tokens, a history in fixed-size pages drawn from one pool shared by all sequences, and a
// BF16 ring of the most recent tokens. The layout is the one the CUDA path mirrors, so every
// piece of raw storage is exposed for uploads and bitwise comparisons.
//
// Logical positions of a sequence of length t (CacheParams::HistoryTokens, F = flush):
//   sink [0, min(S0, t)) | history [S0, S0 + H(t)) | recent [min(t, S0 + H(t)), t),
//   H(t) = F * floor(max(0, t - S0 - W) / F).
// Appending tokens demotes the positions that enter the history; their codes are a pure
// function of (original bf16 rows, R, rho, the format's parameters), so a token's history bits
// do not depend on whether it was written by Prefill or demoted by Append.
//
// The history pool is one byte array per plane of the format (LayoutOf(key) / LayoutOf(value),
// kvq/common/formats.inc): plane i of page pg holds [Hkv, RowsPerPage(i), row_bytes(i)].
//
// A bf16 cache (key.format == value.format == bf16) keeps every token as a bf16 row, allocates
// no page and goes through the same API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {

// Which half of the cache: keys or values.
enum class KV : int { kKey = 0, kValue = 1 };

// Bytes a sequence's cache holds, K and V together. "In use" counts only filled slots; the
// *_allocated fields count whole pages (the memory the pool actually hands out).
struct CacheBytes {
  size_t sink = 0;                        // bf16 sink rows in use
  size_t recent = 0;                      // bf16 recent rows in use (bf16 cache: every row
                                          // after the sink)
  size_t history_codes = 0;               // code planes of the history rows in use
  size_t history_metadata = 0;            // metadata planes (scales, mins, ...) in use
  size_t history_codes_allocated = 0;     // packed codes of the whole pages allocated
  size_t history_metadata_allocated = 0;  // metadata of the whole pages allocated
  size_t elements = 0;                    // 2 * t * Hkv * d: the K and V values represented

  size_t total() const { return sink + recent + history_codes + history_metadata; }
  size_t total_allocated() const {
    return sink + recent + history_codes_allocated + history_metadata_allocated;
  }
  // 8 * bytes / elements (0 for an empty sequence).
  double bits_per_element() const;
  double bits_per_element_allocated() const;
};

class PagedKVCache {
 public:
  // params: validated here (throws kvq::Error(kInvalidArgument) naming the bad value).
  // key / value: the per-head data of each side (kvq/common/head_data.h): rotation fp32
  //   [Hkv, d, d] row-major when that side's rotation is RotationKind::kDense (one matrix per
  //   KV head), empty otherwise; each per-head scalar of head_data.inc [Hkv] or empty (every
  //   head takes the write params' value): clip ratios in (0, 1] overriding key.clip /
  //   value.clip, fp8 scales > 0 overriding head_scale, ... Validated by HeadData::Validate.
  // write_backend: runs the write path (rotate -> clip -> quantize -> pack) for demotions and
  //   prefill; every backend gives the same bits. Must outlive the cache (Backends() entries do).
  // A bf16 cache ignores the per-head data (and the windows).
  PagedKVCache(const CacheParams& params, HeadData key, HeadData value,
               const Backend& write_backend);
  // The same with rotations and clip ratios given one by one (no other per-head data).
  PagedKVCache(const CacheParams& params, std::vector<float> rotation_k,
               std::vector<float> rotation_v, std::vector<float> clip_k = {},
               std::vector<float> clip_v = {}, const Backend& write_backend = BestBackend());

  // A new empty sequence; returns its id (ids are never reused within one cache).
  int AddSequence();
  // Drops a sequence and returns its pages to the pool's free list. Throws on an unknown id.
  void RemoveSequence(int seq);

  // Appends `tokens` tokens to sequence `seq` (a prefill of an empty sequence, or a chunked
  // prefill of a longer one): the result is bit-identical to `tokens` calls of Append.
  // k, v: fp32 [tokens, Hkv, d], rounded to bf16 (RNE) on entry. Throws kvq::Error:
  // unknown seq (kInvalidArgument), null pointers (kInvalidArgument), a non-finite value or one
  // that rounds to +-Inf in bf16 (kNonFinite, naming key/value, token, KV head and channel), a
  // row whose rotation overflows (kNonFinite, naming the position). On any error the cache is
  // unchanged.
  void Prefill(int seq, const float* k, const float* v, size_t tokens);
  // The same with bf16 bits [tokens, Hkv, d] taken as they are.
  void PrefillBf16(int seq, const uint16_t* k, const uint16_t* v, size_t tokens);
  // One decode step: k, v fp32 [Hkv, d] (rounded to bf16) or bf16 bits; as Prefill with 1 token.
  void Append(int seq, const float* k, const float* v) { Prefill(seq, k, v, 1); }
  void AppendBf16(int seq, const uint16_t* k, const uint16_t* v) { PrefillBf16(seq, k, v, 1); }

  // ---- Shape of one sequence (all throw kInvalidArgument on an unknown id) ----
  const CacheParams& params() const { return params_; }
  bool HasSequence(int seq) const { return sequences_.count(seq) != 0; }
  std::vector<int> SequenceIds() const;  // ascending
  size_t Length(int seq) const;          // t
  size_t SinkLength(int seq) const;      // min(S0, t) (bf16 cache: the same)
  size_t HistoryLength(int seq) const;   // H(t); 0 for a bf16 cache
  size_t RecentBegin(int seq) const;     // first recent position: min(t, S0 + H(t))
  // Whether `position` (< t) is held as a bf16 row (sink, recent, or any row of a bf16 cache).
  bool IsBf16Position(int seq, size_t position) const;

  // ---- Raw storage ----
  // bf16 row [Hkv, d] of a position held in bf16 (throws kInvalidArgument otherwise).
  const uint16_t* Bf16Row(int seq, size_t position, KV kv) const;
  // Quantized cache: sink bf16 [S0, Hkv, d] (rows >= SinkLength unused, zero) and recent ring
  // bf16 [W + F - 1, Hkv, d] (position p at slot p % (W + F - 1)). Null for a bf16 cache.
  const uint16_t* SinkRows(int seq, KV kv) const;
  const uint16_t* RecentRing(int seq, KV kv) const;
  // bf16 cache: every row, [t, Hkv, d]. Null for a quantized cache.
  const uint16_t* DenseRows(int seq, KV kv) const;
  // int32 page ids; history token i lives in page table[i / P], slot i % P.
  const std::vector<int32_t>& PageTable(int seq) const;

  // The page pool. Pointers stay valid until the next call that allocates pages (Prefill,
  // Append). Pages never handed out, and slots not in use, are zero.
  int NumPages() const { return num_pages_; }         // pages the pool has ever created
  int NumFreePages() const { return static_cast<int>(free_pages_.size()); }
  // What a history row of K or of V stores (LayoutOf of the key / value write params).
  const FormatLayout& Layout(KV kv) const { return layout_[Index(kv)]; }
  // Plane `plane` of the whole pool, page-major: [NumPages, Hkv, RowsPerPage, row_bytes].
  const uint8_t* PoolPlane(KV kv, int plane) const { return pool_[Index(kv)][plane].data(); }
  // Bytes of one page of that plane (FormatLayout::PageBytes).
  size_t PagePlaneBytes(KV kv, int plane) const;

  // The planes of history token i (0 <= i < HistoryLength) of KV head `head`: pointers at its
  // row (at its tile's row for a tile plane).
  HistoryRunView HistoryRow(int seq, size_t i, int head, KV kv) const;
  // Its decoded row in the rotated space, fp32 [d] (affine_token: y = q * scale + min).
  void DequantizedHistoryRow(int seq, size_t i, int head, KV kv, float* out) const;
  // All history rows of `head` dequantized, fp32 [HistoryLength, d] (rotated space).
  std::vector<float> DequantizedHistory(int seq, int head, KV kv) const;

  // ---- Per-KV-head write data ----
  // [d, d] dense matrix of KV head `head`, or null when the rotation is not dense.
  const float* Rotation(KV kv, int head) const;
  // Its transpose Rᵀ [d, d] (computed once; the inverse map x·Rᵀ of attention outputs).
  const float* RotationTransposed(KV kv, int head) const;
  float ClipRatio(KV kv, int head) const { return HeadParams(kv, head).clip; }
  // The write params of KV head `head`: key / value with that head's per-head scalars applied
  // (clip ratio, fp8 scale, ...: HeadData::Apply).
  WriteParams HeadParams(KV kv, int head) const;
  // The per-head data of one side, as given to the constructor.
  const HeadData& Heads(KV kv) const { return heads_[Index(kv)]; }
  const Backend& write_backend() const { return *write_backend_; }

  // ---- Accounting ----
  CacheBytes Bytes(int seq) const;

 private:
  struct Sequence {
    size_t length = 0;
    std::vector<uint16_t> sink[2];    // [S0, Hkv, d]
    std::vector<uint16_t> recent[2];  // [W + F - 1, Hkv, d] ring
    std::vector<uint16_t> dense[2];   // bf16 cache: [t, Hkv, d]
    std::vector<int32_t> page_table;
  };

  static int Index(KV kv) { return static_cast<int>(kv); }
  const Sequence& Get(int seq) const;
  Sequence& Get(int seq);
  size_t RowElements() const;  // Hkv * d
  // Validates and appends rows that are already bf16.
  void Extend(int seq, const uint16_t* k, const uint16_t* v, size_t tokens);
  int32_t AllocatePage();

  CacheParams params_;
  HeadData heads_[2];                          // key, value
  std::vector<float> rotation_transposed_[2];  // [Hkv, d, d] or empty
  const Backend* write_backend_;

  std::map<int, Sequence> sequences_;
  int next_sequence_id_ = 0;

  int num_pages_ = 0;
  std::vector<int32_t> free_pages_;  // a stack: the most recently freed page is reused first
  FormatLayout layout_[2];
  std::vector<uint8_t> pool_[2][kMaxPlanes];  // per plane: [num_pages, Hkv, rows, row_bytes]
};

}  // namespace kvq::cpu
