#include "kvq/testbed/data.h"

#include <cmath>
#include <utility>

#include "kvq/common/codebook.h"

namespace kvq::testbed {

std::vector<float> RandomMatrix(int d, SplitMix64* rng) {
  const float inv_sqrt = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> r(static_cast<size_t>(d) * static_cast<size_t>(d));
  for (float& v : r) {
    v = rng->Bell() * inv_sqrt;
    if (rng->Below(64) == 0) v = rng->Bit() ? 0.0f : -0.0f;
  }
  return r;
}

std::vector<float> HeadRotations(const WriteParams& p, int num_kv_heads, SplitMix64* rng) {
  std::vector<float> all;
  if (!p.quantized() || p.rotation != RotationKind::kDense) return all;
  for (int h = 0; h < num_kv_heads; ++h) {
    const std::vector<float> r = RandomOrthogonal(p.head_dim, rng);
    all.insert(all.end(), r.begin(), r.end());
  }
  return all;
}

std::vector<float> HeadClips(int num_kv_heads, SplitMix64* rng) {
  std::vector<float> clips(static_cast<size_t>(num_kv_heads));
  for (float& c : clips) c = 0.85f + 0.15f * rng->Uniform01();
  clips[0] = 1.0f;  // one head that never clips
  return clips;
}

std::vector<uint8_t> HeadWidths(const WriteParams& p, int num_kv_heads, SplitMix64* rng) {
  const size_t blocks = static_cast<size_t>(p.head_dim / 2);
  std::vector<uint8_t> widths(static_cast<size_t>(num_kv_heads) * blocks);
  for (size_t h = 0; h < static_cast<size_t>(num_kv_heads); ++h) {
    // Up to `span` neighbouring widths around `base`, so heads range from one segment to eight.
    const uint32_t base = 1 + rng->Below(kCodebookMaxWidth);
    const uint32_t span = 1 + rng->Below(kCodebookMaxWidth);
    for (size_t i = 0; i < blocks; ++i) {
      const uint32_t w = base + rng->Below(span);
      widths[h * blocks + i] = static_cast<uint8_t>(w > kCodebookMaxWidth ? w - kCodebookMaxWidth : w);
    }
  }
  return widths;
}

std::vector<float> KvRows(size_t tokens, int num_kv_heads, int d, SplitMix64* rng,
                          float magnitude) {
  std::vector<float> rows(tokens * static_cast<size_t>(num_kv_heads) * static_cast<size_t>(d));
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t channel = i % static_cast<size_t>(d);
    const float outlier = (channel % 29 == 3) ? 8.0f : 1.0f;
    rows[i] = magnitude * outlier * rng->Bell();
  }
  return rows;
}

std::vector<float> Queries(size_t n, int d, SplitMix64* rng, float magnitude) {
  std::vector<float> q(n * static_cast<size_t>(d));
  for (float& v : q) v = magnitude * rng->Bell();
  return q;
}

std::vector<int32_t> RandomPermutation(int n, SplitMix64* rng) {
  std::vector<int32_t> order(static_cast<size_t>(n > 0 ? n : 0));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  for (size_t i = order.size(); i > 1; --i) {
    std::swap(order[i - 1], order[rng->Below(static_cast<uint32_t>(i))]);
  }
  return order;
}

CacheHeads DrawCacheHeads(const CacheParams& p, SplitMix64* rng_in) {
  SplitMix64& rng = *rng_in;
  std::vector<float> rk = HeadRotations(p.key, p.num_kv_heads, &rng);
  std::vector<float> rv = HeadRotations(p.value, p.num_kv_heads, &rng);
  CacheHeads heads;
  HeadData& key = heads.key;
  HeadData& value = heads.value;
  key.rotation = std::move(rk);
  value.rotation = std::move(rv);
  if (p.quantized()) {
    // Codebook rows are not clipped (spec/numerics.md §5.4): such a side keeps rho = 1.
    key.clip = HeadClips(p.num_kv_heads, &rng);
    value.clip = HeadClips(p.num_kv_heads, &rng);
    if (p.key.format == Format::kCodebook) key.clip.clear();
    if (p.value.format == Format::kCodebook) value.clip.clear();
    // fp8 sides: a scale per head in [0.01, 0.1) (KvRows reach ~30: codes up to ~3000 / 448
    // saturate on the outlier channels of the smaller scales), drawn after everything else so
    // the other formats' caches keep their bits.
    for (auto [w, side] : {std::pair<const WriteParams*, HeadData*>{&p.key, &key},
                           {&p.value, &value}}) {
      if (w->format != Format::kFp8E4m3) continue;
      side->scale.resize(static_cast<size_t>(p.num_kv_heads));
      for (float& s : side->scale) s = 0.01f + 0.09f * rng.Uniform01();
    }
    // Codebook sides whose row limits leave room for more than the uniform row (segments > 1):
    // per-head block widths (Block-GTQ's allocation), drawn last for the same reason.
    for (auto [w, side] : {std::pair<const WriteParams*, HeadData*>{&p.key, &key},
                           {&p.value, &value}}) {
      if (w->format != Format::kCodebook || w->segments == 1) continue;
      side->widths = HeadWidths(*w, p.num_kv_heads, &rng);
    }
  }
  return heads;
}

cpu::PagedKVCache MakeCache(const CacheParams& p, uint64_t seed, const cpu::Backend& backend) {
  SplitMix64 rng(seed);
  CacheHeads heads = DrawCacheHeads(p, &rng);
  return cpu::PagedKVCache(p, std::move(heads.key), std::move(heads.value), backend);
}

}  // namespace kvq::testbed
