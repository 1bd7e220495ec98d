#include "kvq/gpu/device_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "kvq/common/error.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"

namespace kvq::gpu {
namespace {

constexpr uint16_t kBf16NaN = 0x7fc0;  // filler: a read of an unused slot shows as NaN

}  // namespace

struct DeviceCache::Impl {
  CacheParams params;
  int batch = 0;
  int max_len = 0;
  int max_pages = 1;
  size_t bytes_per_step = 0;
  DeviceArray<int32_t> lens, tables;
  DeviceArray<uint8_t> key_codes, value_codes;
  DeviceArray<uint16_t> key_scale, key_min, value_scale, value_min;
  DeviceArray<uint16_t> sink_key, sink_value, recent_key, recent_value;
  DeviceArray<float> rotation_key, rotation_value;
  DeviceArray<float> q, out;
  DecodeAttentionPlan plan;
  DeviceArray<uint8_t> workspace;

  DecodeAttentionInputs Inputs() const {
    DecodeAttentionInputs in;
    in.batch = batch;
    in.max_seq_len = max_len;
    in.seq_lens = lens.get();
    in.page_tables = tables.get();
    in.max_pages = max_pages;
    in.key_codes = key_codes.get();
    in.key_scale = key_scale.get();
    in.key_min = key_min.get();
    in.value_codes = value_codes.get();
    in.value_scale = value_scale.get();
    in.value_min = value_min.get();
    in.sink_key = sink_key.get();
    in.sink_value = sink_value.get();
    in.recent_key = recent_key.get();
    in.recent_value = recent_value.get();
    in.rotation_key = rotation_key.get();
    in.rotation_value = rotation_value.get();
    in.q = q.get();
    return in;
  }

  void Run(cudaStream_t stream) {
    DecodeAttention(params, Inputs(), plan, workspace.get(), workspace.bytes(), out.get(), stream);
  }
};

DeviceCache::DeviceCache(const cpu::PagedKVCache& cache, const std::vector<int>& seqs)
    : impl_(std::make_unique<Impl>()) {
  RequireCudaDevice();
  KVQ_CHECK(!seqs.empty(), kInvalidArgument, "DeviceCache needs at least one sequence");
  Impl& m = *impl_;
  m.params = cache.params();
  const CacheParams& p = m.params;
  const int d = p.head_dim(), hkv = p.num_kv_heads, page = p.page_size;
  const size_t row = static_cast<size_t>(hkv) * d;
  m.batch = static_cast<int>(seqs.size());

  std::vector<int32_t> lens;
  for (int s : seqs) {
    const size_t t = cache.Length(s);  // throws on an unknown id
    KVQ_CHECK(t >= 1, kInvalidArgument, "sequence ", s, " is empty");
    lens.push_back(static_cast<int32_t>(t));
    m.max_len = std::max<int>(m.max_len, static_cast<int>(t));
  }
  m.lens = DeviceArray<int32_t>(lens);

  if (p.quantized()) {
    // The pool as it is on the host: page ids need no translation.
    const int pages = std::max(cache.NumPages(), 1);
    for (const cpu::KV kv : {cpu::KV::kKey, cpu::KV::kValue}) {
      const size_t code_bytes = cache.PageCodeBytes(kv);
      const size_t meta = cache.PageMetadataCount(kv);
      std::vector<uint8_t> codes(pages * code_bytes, 0);
      std::vector<uint16_t> scale(pages * meta, kBf16NaN), mins(pages * meta, kBf16NaN);
      if (cache.NumPages() > 0) {
        std::memcpy(codes.data(), cache.PoolCodes(kv), cache.NumPages() * code_bytes);
        std::memcpy(scale.data(), cache.PoolScale(kv), cache.NumPages() * meta * 2);
        std::memcpy(mins.data(), cache.PoolMin(kv), cache.NumPages() * meta * 2);
      }
      const bool is_key = kv == cpu::KV::kKey;
      (is_key ? m.key_codes : m.value_codes) = DeviceArray<uint8_t>(codes);
      (is_key ? m.key_scale : m.value_scale) = DeviceArray<uint16_t>(scale);
      (is_key ? m.key_min : m.value_min) = DeviceArray<uint16_t>(mins);
    }
    for (int s : seqs) m.max_pages = std::max<int>(m.max_pages, cache.PageTable(s).size());
    std::vector<int32_t> tables(static_cast<size_t>(m.batch) * m.max_pages, -1);
    for (int b = 0; b < m.batch; ++b) {
      const std::vector<int32_t>& table = cache.PageTable(seqs[b]);
      std::copy(table.begin(), table.end(), tables.begin() + static_cast<size_t>(b) * m.max_pages);
    }
    m.tables = DeviceArray<int32_t>(tables);

    // Batched windows [B, S0, Hkv, d] and [B, W, Hkv, d]; unused rows NaN.
    const size_t sink_elems = static_cast<size_t>(p.sink) * row;
    const size_t ring_elems = static_cast<size_t>(p.recent) * row;
    for (const cpu::KV kv : {cpu::KV::kKey, cpu::KV::kValue}) {
      std::vector<uint16_t> sink(std::max<size_t>(m.batch * sink_elems, 8), kBf16NaN);
      std::vector<uint16_t> ring(m.batch * ring_elems, kBf16NaN);
      for (int b = 0; b < m.batch; ++b) {
        const int s = seqs[b];
        std::memcpy(&sink[b * sink_elems], cache.SinkRows(s, kv),
                    cache.SinkLength(s) * row * sizeof(uint16_t));
        for (size_t pos = cache.RecentBegin(s); pos < cache.Length(s); ++pos) {
          const size_t slot = pos % p.recent;
          std::memcpy(&ring[b * ring_elems + slot * row], cache.RecentRing(s, kv) + slot * row,
                      row * sizeof(uint16_t));
        }
      }
      const bool is_key = kv == cpu::KV::kKey;
      (is_key ? m.sink_key : m.sink_value) = DeviceArray<uint16_t>(sink);
      (is_key ? m.recent_key : m.recent_value) = DeviceArray<uint16_t>(ring);
    }
    for (const cpu::KV kv : {cpu::KV::kKey, cpu::KV::kValue}) {
      if (cache.Rotation(kv, 0) == nullptr) continue;
      std::vector<float> r;
      for (int h = 0; h < hkv; ++h) {
        const float* head = cache.Rotation(kv, h);
        r.insert(r.end(), head, head + static_cast<size_t>(d) * d);
      }
      (kv == cpu::KV::kKey ? m.rotation_key : m.rotation_value) = DeviceArray<float>(r);
    }
    for (int s : seqs) {
      const cpu::CacheBytes bytes = cache.Bytes(s);
      m.bytes_per_step += bytes.total();
    }
  } else {
    // bf16 cache: page the dense rows; sequence b owns pages [b * max_pages, (b+1) * max_pages).
    m.max_pages = (m.max_len + page - 1) / page;
    const size_t page_elems = static_cast<size_t>(hkv) * page * d;
    std::vector<int32_t> tables(static_cast<size_t>(m.batch) * m.max_pages);
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
    m.tables = DeviceArray<int32_t>(tables);
    for (const cpu::KV kv : {cpu::KV::kKey, cpu::KV::kValue}) {
      std::vector<uint16_t> pool(tables.size() * page_elems, kBf16NaN);
      for (int b = 0; b < m.batch; ++b) {
        const size_t t = cache.Length(seqs[b]);
        const uint16_t* dense = cache.DenseRows(seqs[b], kv);
        for (size_t pos = 0; pos < t; ++pos) {
          const size_t pg = static_cast<size_t>(b) * m.max_pages + pos / page;
          for (int h = 0; h < hkv; ++h) {
            std::memcpy(&pool[pg * page_elems + (h * page + pos % page) * d],
                        dense + (pos * hkv + h) * d, d * sizeof(uint16_t));
          }
        }
        m.bytes_per_step += t * row * sizeof(uint16_t);
      }
      std::vector<uint8_t> bytes(pool.size() * sizeof(uint16_t));
      std::memcpy(bytes.data(), pool.data(), bytes.size());
      (kv == cpu::KV::kKey ? m.key_codes : m.value_codes) = DeviceArray<uint8_t>(bytes);
    }
  }

  m.q = DeviceArray<float>(static_cast<size_t>(m.batch) * p.num_q_heads * d);
  m.out = DeviceArray<float>(static_cast<size_t>(m.batch) * p.num_q_heads * d);
  m.plan = PlanDecodeAttention(p, m.batch, m.max_len);
  m.workspace = DeviceArray<uint8_t>(std::max<size_t>(m.plan.workspace_bytes, 256));
}

DeviceCache::~DeviceCache() = default;

int DeviceCache::batch() const { return impl_->batch; }
const CacheParams& DeviceCache::params() const { return impl_->params; }
size_t DeviceCache::BytesPerStep() const { return impl_->bytes_per_step; }

void DeviceCache::Attend(const float* q, float* out) {
  Impl& m = *impl_;
  KVQ_CHECK(q != nullptr && out != nullptr, kInvalidArgument, "DeviceCache::Attend: null pointer");
  KVQ_CUDA_CHECK(cudaMemcpy(m.q.get(), q, m.q.bytes(), cudaMemcpyHostToDevice));
  // Poison the output so that an element the kernels do not write shows as NaN.
  KVQ_CUDA_CHECK(cudaMemset(m.out.get(), 0xff, m.out.bytes()));
  m.Run(nullptr);
  KVQ_CUDA_CHECK(cudaGetLastError());
  KVQ_CUDA_CHECK(cudaMemcpy(out, m.out.get(), m.out.bytes(), cudaMemcpyDeviceToHost));
}

double DeviceCache::MedianAttendMicros(const float* q, int iters, int warmup, bool cold_l2) {
  Impl& m = *impl_;
  KVQ_CUDA_CHECK(cudaMemcpy(m.q.get(), q, m.q.bytes(), cudaMemcpyHostToDevice));
  return MedianDeviceMicros([&m] { m.Run(nullptr); }, iters, warmup, cold_l2);
}

}  // namespace kvq::gpu
