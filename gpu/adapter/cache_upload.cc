#include "cache_upload.h"

#include <algorithm>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/common/format.h"

namespace kvq::gpu {
namespace {

constexpr uint16_t kBf16NaN = 0x7fc0;  // filler: a read of an unused slot shows as NaN

// `count` bytes of a plane that no row fills: NaN for bf16 planes, zero otherwise.
std::vector<uint8_t> Filler(const PlaneSpec& plane, size_t count) {
  std::vector<uint8_t> bytes(count, 0);
  if (plane.dtype == DType::kBF16) {
    for (size_t i = 0; i + 1 < count; i += 2) std::memcpy(&bytes[i], &kBf16NaN, 2);
  }
  return bytes;
}

}  // namespace

CacheImage ImageOf(const cpu::PagedKVCache& cache, const std::vector<int>& seqs) {
  KVQ_CHECK(!seqs.empty(), kInvalidArgument, "DeviceCache needs at least one sequence");
  CacheImage m;
  m.params = cache.params();
  const CacheParams& p = m.params;
  const int d = p.head_dim(), hkv = p.num_kv_heads, page = p.page_size;
  const size_t row = static_cast<size_t>(hkv) * d;
  const int batch = static_cast<int>(seqs.size());
  int max_len = 0;
  for (int s : seqs) {
    const size_t t = cache.Length(s);  // throws on an unknown id
    KVQ_CHECK(t >= 1, kInvalidArgument, "sequence ", s, " is empty");
    m.lengths.push_back(static_cast<int32_t>(t));
    max_len = std::max<int>(max_len, static_cast<int>(t));
  }
  const cpu::KV kvs[2] = {cpu::KV::kKey, cpu::KV::kValue};

  if (p.quantized()) {
    // The pool as it is on the host: page ids need no translation (at least one page, so that
    // every plane has an address).
    const int pages = std::max(cache.NumPages(), 1);
    for (int kv = 0; kv < 2; ++kv) {
      const FormatLayout& layout = cache.Layout(kvs[kv]);
      for (int i = 0; i < layout.num_planes; ++i) {
        const size_t page_bytes = cache.PagePlaneBytes(kvs[kv], i);
        m.pool[kv][i] = Filler(layout.plane(i), pages * page_bytes);
        if (cache.NumPages() > 0) {
          std::memcpy(m.pool[kv][i].data(), cache.PoolPlane(kvs[kv], i),
                      cache.NumPages() * page_bytes);
        }
      }
    }
    m.max_pages = 1;
    for (int s : seqs) m.max_pages = std::max<int>(m.max_pages, cache.PageTable(s).size());
    m.page_tables.assign(static_cast<size_t>(batch) * m.max_pages, -1);
    for (int b = 0; b < batch; ++b) {
      const std::vector<int32_t>& table = cache.PageTable(seqs[b]);
      std::copy(table.begin(), table.end(),
                m.page_tables.begin() + static_cast<size_t>(b) * m.max_pages);
    }

    // Batched windows [B, S0, Hkv, d] and [B, W + F - 1, Hkv, d]; unused rows NaN.
    const size_t sink_elems = static_cast<size_t>(p.sink) * row;
    const size_t ring_elems = static_cast<size_t>(p.ring_slots()) * row;
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint16_t>& sink = m.sink[kv];
      std::vector<uint16_t>& ring = m.recent[kv];
      sink.assign(std::max<size_t>(batch * sink_elems, 8), kBf16NaN);
      ring.assign(batch * ring_elems, kBf16NaN);
      for (int b = 0; b < batch; ++b) {
        const int s = seqs[b];
        std::memcpy(&sink[b * sink_elems], cache.SinkRows(s, kvs[kv]),
                    cache.SinkLength(s) * row * sizeof(uint16_t));
        for (size_t pos = cache.RecentBegin(s); pos < cache.Length(s); ++pos) {
          const size_t slot = pos % p.ring_slots();
          std::memcpy(&ring[b * ring_elems + slot * row],
                      cache.RecentRing(s, kvs[kv]) + slot * row, row * sizeof(uint16_t));
        }
      }
    }
    for (int kv = 0; kv < 2; ++kv) m.heads[kv] = cache.Heads(kvs[kv]);
    for (int s : seqs) m.bytes_per_step += cache.Bytes(s).total();
  } else {
    // bf16 cache: page the dense rows into the rows plane; sequence b owns pages
    // [b * max_pages, (b + 1) * max_pages).
    m.max_pages = (max_len + page - 1) / page;
    const size_t page_elems = static_cast<size_t>(hkv) * page * d;
    m.page_tables.resize(static_cast<size_t>(batch) * m.max_pages);
    for (size_t i = 0; i < m.page_tables.size(); ++i) m.page_tables[i] = static_cast<int32_t>(i);
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint16_t> pool(m.page_tables.size() * page_elems, kBf16NaN);
      for (int b = 0; b < batch; ++b) {
        const size_t t = cache.Length(seqs[b]);
        const uint16_t* dense = cache.DenseRows(seqs[b], kvs[kv]);
        for (size_t pos = 0; pos < t; ++pos) {
          const size_t pg = static_cast<size_t>(b) * m.max_pages + pos / page;
          for (int h = 0; h < hkv; ++h) {
            std::memcpy(&pool[pg * page_elems + (h * page + pos % page) * d],
                        dense + (pos * hkv + h) * d, d * sizeof(uint16_t));
          }
        }
        m.bytes_per_step += t * row * sizeof(uint16_t);
      }
      std::vector<uint8_t>& bytes = m.pool[kv][0];
      bytes.resize(pool.size() * sizeof(uint16_t));
      std::memcpy(bytes.data(), pool.data(), bytes.size());
    }
  }
  return m;
}

DeviceCache UploadCache(const cpu::PagedKVCache& cache, const std::vector<int>& seqs) {
  return DeviceCache(ImageOf(cache, seqs));
}

}  // namespace kvq::gpu
