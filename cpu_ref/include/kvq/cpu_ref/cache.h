// The OSCAR paged KV cache of the CPU oracle (spec/cache.md): per sequence a BF16 sink of S0
// tokens, an INT-b history in fixed-size pages drawn from one pool shared by all sequences,
// and a BF16 ring of the W most recent tokens. The layout is the one the CUDA path mirrors, so
// every piece of raw storage is exposed for uploads and bitwise comparisons.
//
// Logical positions of a sequence of length t:
//   sink [0, min(S0, t)) | history [S0, t - W) when t - W > S0 | recent [max(S0, t - W), t).
// Appending token t demotes position t - W into the history when t - W >= S0. History codes
// are a pure function of (original bf16 row, R, rho, G, b), so a token's history bits do not
// depend on whether it was written by Prefill or demoted by Append.
//
// A bf16 cache (CacheParams::quantized == false) keeps every token as a bf16 row, allocates no
// page and goes through the same API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

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
  size_t history_codes = 0;               // packed codes of the history rows in use
  size_t history_metadata = 0;            // bf16 (scale, min) pairs of the history rows in use
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

// Pointers to one quantized history row (one token, one KV head): codes [d*b/8] packed as the
// spec says, scale and min [d/G] bf16 bits.
struct HistoryRowRef {
  const uint8_t* codes = nullptr;
  const uint16_t* scale = nullptr;
  const uint16_t* min = nullptr;
};

class PagedKVCache {
 public:
  // params: validated here (throws kvq::Error(kInvalidArgument) naming the bad value).
  // rotation_k / rotation_v: fp32 [Hkv, d, d] row-major when key / value use RotationKind::kDense
  //   (one matrix per KV head); must be empty otherwise. Entries must be finite.
  // clip_k / clip_v: [Hkv] per-head clip ratios in (0, 1] overriding key.clip / value.clip;
  //   empty means every head uses the ratio of the write params.
  // write_backend: runs the write path (rotate -> clip -> quantize -> pack) for demotions and
  //   prefill; every backend gives the same bits. Must outlive the cache (Backends() entries do).
  // A bf16 cache (params.quantized == false) ignores rotations and clip ratios (and W).
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
  size_t HistoryLength(int seq) const;   // max(0, t - W - S0); 0 for a bf16 cache
  size_t RecentBegin(int seq) const;     // first recent position: max(S0, t - W) (bf16: S0)
  // Whether `position` (< t) is held as a bf16 row (sink, recent, or any row of a bf16 cache).
  bool IsBf16Position(int seq, size_t position) const;

  // ---- Raw storage ----
  // bf16 row [Hkv, d] of a position held in bf16 (throws kInvalidArgument otherwise).
  const uint16_t* Bf16Row(int seq, size_t position, KV kv) const;
  // Quantized cache: sink bf16 [S0, Hkv, d] (rows >= SinkLength unused, zero) and recent ring
  // bf16 [W, Hkv, d] (position p at slot p % W). Null for a bf16 cache.
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
  // Whole pool, page-major: codes u8 [NumPages, Hkv, P, d*b/8]; scale, min bf16
  // [NumPages, Hkv, P, d/G] (b, G of the key or value params).
  const uint8_t* PoolCodes(KV kv) const { return codes_[Index(kv)].data(); }
  const uint16_t* PoolScale(KV kv) const { return scale_[Index(kv)].data(); }
  const uint16_t* PoolMin(KV kv) const { return min_[Index(kv)].data(); }
  size_t PageCodeBytes(KV kv) const;      // Hkv * P * d*b/8
  size_t PageMetadataCount(KV kv) const;  // Hkv * P * d/G (elements of scale, and of min)

  // History token i (0 <= i < HistoryLength) of KV head `head`.
  HistoryRowRef HistoryRow(int seq, size_t i, int head, KV kv) const;
  // Its dequantized row in the rotated space, fp32 [d]: y = q * scale + min.
  void DequantizedHistoryRow(int seq, size_t i, int head, KV kv, float* out) const;
  // All history rows of `head` dequantized, fp32 [HistoryLength, d] (rotated space).
  std::vector<float> DequantizedHistory(int seq, int head, KV kv) const;

  // ---- Per-KV-head write data ----
  // [d, d] dense matrix of KV head `head`, or null when the rotation is not dense.
  const float* Rotation(KV kv, int head) const;
  // Its transpose Rᵀ [d, d] (computed once; the inverse map x·Rᵀ of attention outputs).
  const float* RotationTransposed(KV kv, int head) const;
  float ClipRatio(KV kv, int head) const;
  // The write params of KV head `head`: key / value with clip set to ClipRatio(kv, head).
  WriteParams HeadParams(KV kv, int head) const;
  const Backend& write_backend() const { return *write_backend_; }

  // ---- Accounting ----
  CacheBytes Bytes(int seq) const;

 private:
  struct Sequence {
    size_t length = 0;
    std::vector<uint16_t> sink[2];    // [S0, Hkv, d]
    std::vector<uint16_t> recent[2];  // [W, Hkv, d] ring
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
  std::vector<float> rotation_[2];             // [Hkv, d, d] or empty
  std::vector<float> rotation_transposed_[2];  // [Hkv, d, d] or empty
  std::vector<float> clip_[2];      // [Hkv]
  const Backend* write_backend_;

  std::map<int, Sequence> sequences_;
  int next_sequence_id_ = 0;

  int num_pages_ = 0;
  std::vector<int32_t> free_pages_;  // a stack: the most recently freed page is reused first
  std::vector<uint8_t> codes_[2];    // [num_pages, Hkv, P, d*b/8]
  std::vector<uint16_t> scale_[2];   // [num_pages, Hkv, P, d/G]
  std::vector<uint16_t> min_[2];     // [num_pages, Hkv, P, d/G]
};

}  // namespace kvq::cpu
