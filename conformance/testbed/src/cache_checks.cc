#include "kvq/testbed/cache_checks.h"

#include <cstring>
#include <sstream>

#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::testbed {

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = Bf16FromF32(x[i]);
  return bits;
}

std::vector<float> FromBf16(const std::vector<uint16_t>& bits) {
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) x[i] = F32FromBf16(bits[i]);
  return x;
}

::testing::AssertionResult CacheHolds(const cpu::PagedKVCache& cache, int seq,
                                      const std::vector<uint16_t> (&rows)[2]) {
  const CacheParams& p = cache.params();
  const size_t t = cache.Length(seq);
  const size_t hkv = static_cast<size_t>(p.num_kv_heads);
  const size_t d = static_cast<size_t>(p.head_dim());
  const size_t row = hkv * d;
  auto fail = [&]() {
    return ::testing::AssertionFailure() << "sequence " << seq << " at length " << t << ": ";
  };
  if (rows[0].size() != t * row || rows[1].size() != t * row) {
    return fail() << "given " << rows[0].size() / row << " rows";
  }
  const size_t history = static_cast<size_t>(p.HistoryTokens(static_cast<int64_t>(t)));
  const size_t sink = static_cast<size_t>(p.sink);
  if (cache.HistoryLength(seq) != history) {
    return fail() << "history length " << cache.HistoryLength(seq) << ", the rule says "
                  << history;
  }
  const size_t page = static_cast<size_t>(p.page_size);
  if (cache.PageTable(seq).size() != (history + page - 1) / page) {
    return fail() << cache.PageTable(seq).size() << " pages for " << history << " history rows";
  }
  for (size_t pos = 0; pos < t; ++pos) {
    const bool in_history = p.quantized() && pos >= sink && pos - sink < history;
    if (cache.IsBf16Position(seq, pos) == in_history) {
      return fail() << "position " << pos << (in_history ? " should be history" : " should be bf16");
    }
    for (int kv = 0; kv < 2 && !in_history; ++kv) {
      if (std::memcmp(cache.Bf16Row(seq, pos, static_cast<cpu::KV>(kv)), &rows[kv][pos * row],
                      row * sizeof(uint16_t)) != 0) {
        return fail() << (kv ? "value" : "key") << " bf16 row of position " << pos << " differs";
      }
    }
  }
  // History: each plane row equals the encoding of its original rows (one token, or one tile),
  // all KV heads of the tokens encoded together (a token-scope norm spans them).
  for (int kv = 0; kv < 2 && history > 0; ++kv) {
    const cpu::KV half = static_cast<cpu::KV>(kv);
    const FormatLayout& layout = cache.Layout(half);
    const size_t unit = static_cast<size_t>(layout.tile_tokens);
    std::vector<WriteParams> params;
    std::vector<HeadArrays> arrays;  // each head's rotation and codec arrays (codebook widths)
    for (size_t h = 0; h < hkv; ++h) {
      params.push_back(cache.HeadParams(half, static_cast<int>(h)));
      arrays.push_back(cache.Heads(half).Arrays(params.back(), static_cast<int>(h)));
    }
    for (size_t i0 = 0; i0 < history; i0 += unit) {
      std::vector<float> x(unit * row);
      for (size_t e = 0; e < unit * row; ++e) x[e] = F32FromBf16(rows[kv][(sink + i0) * row + e]);
      const std::vector<cpu::EncodedRows> want =
          cpu::EncodeTokens(cpu::ScalarBackend(), params, arrays, x.data(), unit);
      for (size_t h = 0; h < hkv; ++h) {
        for (size_t r = 0; r < unit; ++r) {
          const cpu::HistoryRunView got = cache.HistoryRow(seq, i0 + r, static_cast<int>(h), half);
          if (got.tile_offset != static_cast<int>(r)) {
            return fail() << "history row " << i0 + r << " is " << got.tile_offset
                          << " tokens into its tile, expected " << r;
          }
          for (int plane = 0; plane < layout.num_planes; ++plane) {
            const PlaneSpec& spec = layout.plane(plane);
            if (spec.scope == PlaneScope::kTile && r > 0) continue;  // one row per tile
            const size_t index = spec.scope == PlaneScope::kTile ? 0 : r;
            if (std::memcmp(got.plane[plane], &want[h].plane[plane][index * spec.row_bytes()],
                            spec.row_bytes()) != 0) {
              return fail() << (kv ? "value" : "key") << " history row " << i0 + r
                            << " (position " << sink + i0 + r << "), KV head " << h << ": plane '"
                            << spec.name << "' differs from the encoding of its original row";
            }
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvq::testbed
