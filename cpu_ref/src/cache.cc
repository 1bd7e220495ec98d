// The paged KV cache of the CPU oracle (spec/cache.md). Prefill and Append share one path,
// Extend(): it gathers the rows that enter the history (from the recent ring or from the new
// tokens), quantizes them through the validating write path, and only then mutates the cache,
// so a failure leaves the cache as it was and a token's history bits never depend on how it
// got there.
#include "kvq/cpu_ref/cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::cpu {
namespace {

const char* KVName(int kv) { return kv == 0 ? "key" : "value"; }

bool IsNonFiniteBf16(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u; }

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

}  // namespace

double CacheBytes::bits_per_element() const {
  return elements == 0 ? 0.0 : 8.0 * static_cast<double>(total()) / static_cast<double>(elements);
}

double CacheBytes::bits_per_element_allocated() const {
  return elements == 0 ? 0.0
                       : 8.0 * static_cast<double>(total_allocated()) /
                             static_cast<double>(elements);
}

PagedKVCache::PagedKVCache(const CacheParams& params, HeadData key, HeadData value,
                           const Backend& write_backend)
    : params_(params), write_backend_(&write_backend) {
  params_.Validate();
  if (!params_.quantized()) return;  // the bf16 baseline needs no write data
  layout_[0] = LayoutOf(params_.key);
  layout_[1] = LayoutOf(params_.value);
  const size_t d = static_cast<size_t>(params_.head_dim());
  HeadData* sides[2] = {&key, &value};
  for (int kv = 0; kv < 2; ++kv) {
    const WriteParams& wp = kv == 0 ? params_.key : params_.value;
    sides[kv]->Validate(wp, params_.num_kv_heads, KVName(kv));
    heads_[kv] = std::move(*sides[kv]);
    const std::vector<float>& rotation = heads_[kv].rotation;
    std::vector<float>& transposed = rotation_transposed_[kv];
    transposed.resize(rotation.size());
    for (size_t base = 0; base < transposed.size(); base += d * d) {
      for (size_t i = 0; i < d; ++i) {
        for (size_t j = 0; j < d; ++j) transposed[base + j * d + i] = rotation[base + i * d + j];
      }
    }
  }
}

namespace {

HeadData RotationAndClip(std::vector<float> rotation, std::vector<float> clip) {
  HeadData h;
  h.rotation = std::move(rotation);
  h.clip = std::move(clip);
  return h;
}

}  // namespace

PagedKVCache::PagedKVCache(const CacheParams& params, std::vector<float> rotation_k,
                           std::vector<float> rotation_v, std::vector<float> clip_k,
                           std::vector<float> clip_v, const Backend& write_backend)
    : PagedKVCache(params, RotationAndClip(std::move(rotation_k), std::move(clip_k)),
                   RotationAndClip(std::move(rotation_v), std::move(clip_v)), write_backend) {}

int PagedKVCache::AddSequence() {
  const int id = next_sequence_id_++;
  Sequence& s = sequences_[id];
  if (params_.quantized()) {
    const size_t row = RowElements();
    for (int kv = 0; kv < 2; ++kv) {
      s.sink[kv].assign(static_cast<size_t>(params_.sink) * row, 0);
      s.recent[kv].assign(static_cast<size_t>(params_.ring_slots()) * row, 0);
    }
  }
  return id;
}

void PagedKVCache::RemoveSequence(int seq) {
  Sequence& s = Get(seq);
  for (int32_t page : s.page_table) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = 0; i < layout_[kv].num_planes; ++i) {
        const size_t bytes = PagePlaneBytes(static_cast<KV>(kv), i);
        std::fill_n(pool_[kv][i].begin() + static_cast<ptrdiff_t>(page * bytes), bytes,
                    uint8_t{0});
      }
    }
    free_pages_.push_back(page);
  }
  sequences_.erase(seq);
}

void PagedKVCache::Prefill(int seq, const float* k, const float* v, size_t tokens) {
  Get(seq);  // an unknown id is reported before anything else
  if (tokens == 0) return;
  KVQ_CHECK(k != nullptr && v != nullptr, kInvalidArgument, "null key or value rows for ",
            tokens, " tokens");
  const size_t row = RowElements();
  const size_t d = static_cast<size_t>(params_.head_dim());
  const float* inputs[2] = {k, v};
  std::vector<uint16_t> bits[2];
  for (int kv = 0; kv < 2; ++kv) {
    bits[kv].resize(tokens * row);
    for (size_t i = 0; i < tokens * row; ++i) {
      const float x = inputs[kv][i];
      const uint16_t b = Bf16FromF32(x);
      if (!std::isfinite(x) || IsNonFiniteBf16(b)) {
        throw Error(ErrorCode::kNonFinite,
                    detail::Concat(KVName(kv), " value ", x,
                                   std::isfinite(x) ? " (rounds to inf in bf16)" : "",
                                   " at token ", i / row, " (position ", Length(seq) + i / row,
                                   "), KV head ", (i % row) / d, ", channel ", i % d,
                                   " of sequence ", seq));
      }
      bits[kv][i] = b;
    }
  }
  Extend(seq, bits[0].data(), bits[1].data(), tokens);
}

void PagedKVCache::PrefillBf16(int seq, const uint16_t* k, const uint16_t* v, size_t tokens) {
  Get(seq);
  if (tokens == 0) return;
  KVQ_CHECK(k != nullptr && v != nullptr, kInvalidArgument, "null key or value rows for ",
            tokens, " tokens");
  Extend(seq, k, v, tokens);
}

void PagedKVCache::Extend(int seq, const uint16_t* k, const uint16_t* v, size_t tokens) {
  Sequence& s = Get(seq);
  const size_t row = RowElements();
  const size_t d = static_cast<size_t>(params_.head_dim());
  const size_t hkv = static_cast<size_t>(params_.num_kv_heads);
  const uint16_t* inputs[2] = {k, v};
  for (int kv = 0; kv < 2; ++kv) {
    for (size_t i = 0; i < tokens * row; ++i) {
      KVQ_CHECK(!IsNonFiniteBf16(inputs[kv][i]), kNonFinite, KVName(kv), " bf16 value 0x",
                std::hex, inputs[kv][i], std::dec, " (", F32FromBf16(inputs[kv][i]),
                ") at token ", i / row, " (position ", s.length + i / row, "), KV head ",
                (i % row) / d, ", channel ", i % d, " of sequence ", seq);
    }
  }

  const size_t t0 = s.length;
  const size_t t1 = t0 + tokens;
  if (!params_.quantized()) {
    for (int kv = 0; kv < 2; ++kv) s.dense[kv].insert(s.dense[kv].end(), inputs[kv],
                                                      inputs[kv] + tokens * row);
    s.length = t1;
    return;
  }

  const size_t sink = static_cast<size_t>(params_.sink);
  const size_t ring = static_cast<size_t>(params_.ring_slots());
  const size_t page = static_cast<size_t>(params_.page_size);
  // The history covers [S0, S0 + H(t)); positions [e0, e1) enter it now.
  const size_t e0 = sink + static_cast<size_t>(params_.HistoryTokens(static_cast<int64_t>(t0)));
  const size_t e1 = sink + static_cast<size_t>(params_.HistoryTokens(static_cast<int64_t>(t1)));
  const size_t n = e1 - e0;

  // 1. Everything that can fail: encode the rows entering the history, per half, all KV heads
  //    of a token together (a token-scope norm spans them).
  std::vector<EncodedRows> encoded[2];
  if (n > 0) {
    std::vector<float> x(n * row);
    for (int kv = 0; kv < 2; ++kv) {
      for (size_t r = 0; r < n; ++r) {
        const size_t p = e0 + r;
        // A position below t0 is still in the ring: it was recent at length t0.
        const uint16_t* src = p < t0 ? s.recent[kv].data() + (p % ring) * row
                                     : inputs[kv] + (p - t0) * row;
        for (size_t j = 0; j < row; ++j) x[r * row + j] = F32FromBf16(src[j]);
      }
      const KV half = static_cast<KV>(kv);
      std::vector<WriteParams> params;
      std::vector<HeadArrays> arrays;  // each head's rotation and codec arrays (widths)
      for (size_t h = 0; h < hkv; ++h) {
        params.push_back(HeadParams(half, static_cast<int>(h)));
        arrays.push_back(heads_[Index(half)].Arrays(params.back(), static_cast<int>(h)));
      }
      try {
        encoded[kv] = EncodeTokens(*write_backend_, params, arrays, x.data(), n);
      } catch (const Error& e) {
        throw Error(e.code(), detail::Concat("sequence ", seq, ": writing ", KVName(kv),
                                             " history rows of positions [", e0, ", ", e1,
                                             ") (row r is position ", e0, " + r): ", e.what()));
      }
    }
  }

  // 2. Commit: pages, history rows (plane by plane), sink rows, recent rows.
  const size_t history_rows = e1 - sink;
  while (s.page_table.size() < CeilDiv(history_rows, page)) s.page_table.push_back(AllocatePage());
  for (int kv = 0; kv < 2; ++kv) {
    const FormatLayout& layout = layout_[kv];
    for (int i = 0; i < layout.num_planes && n > 0; ++i) {
      const PlaneSpec& plane = layout.plane(i);
      const size_t row_bytes = plane.row_bytes();
      // A tile plane has one row per tile_tokens tokens; the rows entering the history start
      // and end on tile boundaries (F is a multiple of the tile, and so is P). A shared plane
      // has one row for all KV heads (each head's encoding holds the same bytes).
      const size_t per_row = plane.scope == PlaneScope::kTile
                                 ? static_cast<size_t>(layout.tile_tokens) : 1;
      const size_t heads = static_cast<size_t>(layout.HeadsPerPage(i, params_.num_kv_heads));
      for (size_t r = 0; r < n / per_row; ++r) {
        const size_t token = e0 - sink + r * per_row;  // history index of the row's first token
        const int64_t pg = s.page_table[token / page];
        for (size_t h = 0; h < heads; ++h) {
          const size_t base = layout.RowOffset(i, params_.page_size, params_.num_kv_heads, pg,
                                               static_cast<int>(h),
                                               static_cast<int64_t>(token % page));
          std::memcpy(&pool_[kv][i][base], &encoded[kv][h].plane[i][r * row_bytes], row_bytes);
        }
      }
    }
    for (size_t p = t0; p < std::min(sink, t1); ++p) {
      std::memcpy(&s.sink[kv][p * row], inputs[kv] + (p - t0) * row, row * sizeof(uint16_t));
    }
    for (size_t p = std::max(t0, e1); p < t1; ++p) {
      std::memcpy(&s.recent[kv][(p % ring) * row], inputs[kv] + (p - t0) * row,
                  row * sizeof(uint16_t));
    }
  }
  s.length = t1;
}

int32_t PagedKVCache::AllocatePage() {
  if (!free_pages_.empty()) {
    const int32_t page = free_pages_.back();  // zeroed when it was freed
    free_pages_.pop_back();
    return page;
  }
  KVQ_CHECK(num_pages_ < INT32_MAX, kUnsupported, "the page pool is full (", num_pages_,
            " pages)");
  const int32_t page = num_pages_++;
  for (int kv = 0; kv < 2; ++kv) {
    for (int i = 0; i < layout_[kv].num_planes; ++i) {
      pool_[kv][i].resize(static_cast<size_t>(num_pages_) * PagePlaneBytes(static_cast<KV>(kv), i),
                          0);
    }
  }
  return page;
}

const PagedKVCache::Sequence& PagedKVCache::Get(int seq) const {
  auto it = sequences_.find(seq);
  KVQ_CHECK(it != sequences_.end(), kInvalidArgument, "unknown sequence id ", seq);
  return it->second;
}

PagedKVCache::Sequence& PagedKVCache::Get(int seq) {
  auto it = sequences_.find(seq);
  KVQ_CHECK(it != sequences_.end(), kInvalidArgument, "unknown sequence id ", seq);
  return it->second;
}

size_t PagedKVCache::RowElements() const {
  return static_cast<size_t>(params_.num_kv_heads) * static_cast<size_t>(params_.head_dim());
}

std::vector<int> PagedKVCache::SequenceIds() const {
  std::vector<int> ids;
  for (const auto& entry : sequences_) ids.push_back(entry.first);
  return ids;
}

size_t PagedKVCache::Length(int seq) const { return Get(seq).length; }

size_t PagedKVCache::SinkLength(int seq) const {
  return std::min(Get(seq).length, static_cast<size_t>(params_.sink));
}

size_t PagedKVCache::HistoryLength(int seq) const {
  return static_cast<size_t>(params_.HistoryTokens(static_cast<int64_t>(Get(seq).length)));
}

size_t PagedKVCache::RecentBegin(int seq) const {
  return static_cast<size_t>(params_.RecentBegin(static_cast<int64_t>(Get(seq).length)));
}

bool PagedKVCache::IsBf16Position(int seq, size_t position) const {
  const size_t t = Length(seq);
  KVQ_CHECK(position < t, kInvalidArgument, "position ", position, " is past the length ", t,
            " of sequence ", seq);
  return position < SinkLength(seq) || position >= RecentBegin(seq);
}

const uint16_t* PagedKVCache::Bf16Row(int seq, size_t position, KV kv) const {
  KVQ_CHECK(IsBf16Position(seq, position), kInvalidArgument, "position ", position,
            " of sequence ", seq, " is in the quantized history, not held as bf16");
  const Sequence& s = Get(seq);
  const size_t row = RowElements();
  const int i = Index(kv);
  if (!params_.quantized()) return s.dense[i].data() + position * row;
  if (position < static_cast<size_t>(params_.sink)) return s.sink[i].data() + position * row;
  return s.recent[i].data() + (position % static_cast<size_t>(params_.ring_slots())) * row;
}

const uint16_t* PagedKVCache::SinkRows(int seq, KV kv) const {
  const Sequence& s = Get(seq);
  return params_.quantized() ? s.sink[Index(kv)].data() : nullptr;
}

const uint16_t* PagedKVCache::RecentRing(int seq, KV kv) const {
  const Sequence& s = Get(seq);
  return params_.quantized() ? s.recent[Index(kv)].data() : nullptr;
}

const uint16_t* PagedKVCache::DenseRows(int seq, KV kv) const {
  const Sequence& s = Get(seq);
  return params_.quantized() ? nullptr : s.dense[Index(kv)].data();
}

const std::vector<int32_t>& PagedKVCache::PageTable(int seq) const { return Get(seq).page_table; }

size_t PagedKVCache::PagePlaneBytes(KV kv, int plane) const {
  return layout_[Index(kv)].PageBytes(plane, params_.page_size, params_.num_kv_heads);
}

HistoryRunView PagedKVCache::HistoryRow(int seq, size_t i, int head, KV kv) const {
  const Sequence& s = Get(seq);
  const size_t n = HistoryLength(seq);
  KVQ_CHECK(i < n, kInvalidArgument, "history row ", i, " is past the history length ", n,
            " of sequence ", seq);
  KVQ_CHECK(head >= 0 && head < params_.num_kv_heads, kInvalidArgument, "KV head ", head,
            " is outside [0, ", params_.num_kv_heads, ")");
  const size_t page = static_cast<size_t>(params_.page_size);
  const int64_t pg = s.page_table[i / page];
  const FormatLayout& layout = layout_[Index(kv)];
  HistoryRunView view;
  for (int p = 0; p < layout.num_planes; ++p) {
    view.plane[p] = pool_[Index(kv)][p].data() +
                    layout.RowOffset(p, params_.page_size, params_.num_kv_heads, pg, head,
                                     static_cast<int64_t>(i % page));
  }
  view.tile_offset = static_cast<int>(i % static_cast<size_t>(layout.tile_tokens));
  view.heads = heads_[Index(kv)].Arrays(HeadParams(kv, head), head);
  return view;
}

void PagedKVCache::DequantizedHistoryRow(int seq, size_t i, int head, KV kv, float* out) const {
  const HistoryRunView row = HistoryRow(seq, i, head, kv);
  DecodeRows(ScalarBackend(), HeadParams(kv, head), row, 1, out);
}

std::vector<float> PagedKVCache::DequantizedHistory(int seq, int head, KV kv) const {
  const size_t n = HistoryLength(seq);
  const size_t d = static_cast<size_t>(params_.head_dim());
  std::vector<float> rows(n * d);
  // One page run at a time (a tile format decodes whole tiles).
  const size_t page = static_cast<size_t>(params_.page_size);
  for (size_t i0 = 0; i0 < n; i0 += page) {
    DecodeRows(ScalarBackend(), HeadParams(kv, head), HistoryRow(seq, i0, head, kv),
               std::min(page, n - i0), &rows[i0 * d]);
  }
  return rows;
}

const float* PagedKVCache::Rotation(KV kv, int head) const {
  KVQ_CHECK(head >= 0 && head < params_.num_kv_heads, kInvalidArgument, "KV head ", head,
            " is outside [0, ", params_.num_kv_heads, ")");
  const std::vector<float>& r = heads_[Index(kv)].rotation;
  if (r.empty()) return nullptr;
  const size_t d = static_cast<size_t>(params_.head_dim());
  return r.data() + static_cast<size_t>(head) * d * d;
}

const float* PagedKVCache::RotationTransposed(KV kv, int head) const {
  const float* r = Rotation(kv, head);  // validates head
  if (r == nullptr) return nullptr;
  const size_t d = static_cast<size_t>(params_.head_dim());
  return rotation_transposed_[Index(kv)].data() + static_cast<size_t>(head) * d * d;
}

WriteParams PagedKVCache::HeadParams(KV kv, int head) const {
  KVQ_CHECK(head >= 0 && head < params_.num_kv_heads, kInvalidArgument, "KV head ", head,
            " is outside [0, ", params_.num_kv_heads, ")");
  return heads_[Index(kv)].Apply(kv == KV::kKey ? params_.key : params_.value, head);
}

CacheBytes PagedKVCache::Bytes(int seq) const {
  const Sequence& s = Get(seq);
  const size_t row_bytes = RowElements() * sizeof(uint16_t);  // one bf16 row of K (or of V)
  CacheBytes b;
  b.elements = 2 * s.length * RowElements();
  const size_t sink_rows = SinkLength(seq);
  b.sink = 2 * sink_rows * row_bytes;
  b.recent = 2 * (s.length - RecentBegin(seq)) * row_bytes;
  if (params_.quantized()) {
    const int64_t used = static_cast<int64_t>(HistoryLength(seq));
    const int64_t allocated =
        static_cast<int64_t>(s.page_table.size()) * static_cast<int64_t>(params_.page_size);
    const int heads = params_.num_kv_heads;
    for (const FormatLayout& layout : layout_) {
      b.history_codes += layout.Bytes(PlaneRole::kCodes, used, heads);
      b.history_metadata += layout.Bytes(PlaneRole::kMetadata, used, heads);
      b.history_codes_allocated += layout.Bytes(PlaneRole::kCodes, allocated, heads);
      b.history_metadata_allocated += layout.Bytes(PlaneRole::kMetadata, allocated, heads);
    }
  }
  return b;
}

}  // namespace kvq::cpu
