#include "kvq/gpu/device_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>

#include "kvq/common/error.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"

namespace kvq::gpu {

struct DeviceCache::Impl {
  CacheParams params;
  int batch = 0;
  int max_len = 0;
  int max_pages = 1;
  size_t bytes_per_step = 0;
  DeviceArray<int32_t> lens, tables;
  DeviceArray<uint8_t> pool[2][kMaxPlanes];
  DeviceArray<uint16_t> sink[2], recent[2];
  DeviceHeadData heads[2];
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
    for (int i = 0; i < kMaxPlanes; ++i) {
      in.key_planes[i] = pool[0][i].get();
      in.value_planes[i] = pool[1][i].get();
    }
    in.sink_key = sink[0].get();
    in.sink_value = sink[1].get();
    in.recent_key = recent[0].get();
    in.recent_value = recent[1].get();
    in.key_heads = heads[0].View();
    in.value_heads = heads[1].View();
    in.q = q.get();
    return in;
  }

  void Run(cudaStream_t stream) {
    DecodeAttention(params, Inputs(), plan, workspace.get(), workspace.bytes(), out.get(), stream);
  }
};

DeviceCache::DeviceCache(const CacheImage& image) : impl_(std::make_unique<Impl>()) {
  RequireCudaDevice();
  Impl& m = *impl_;
  m.params = image.params;
  const CacheParams& p = m.params;
  p.Validate();
  m.batch = static_cast<int>(image.lengths.size());
  KVQ_CHECK(m.batch >= 1, kInvalidArgument, "DeviceCache needs at least one sequence");
  for (size_t b = 0; b < image.lengths.size(); ++b) {
    KVQ_CHECK(image.lengths[b] >= 1, kInvalidArgument, "DeviceCache: sequence ", b,
              " has length ", image.lengths[b], " (at least 1)");
    m.max_len = std::max<int>(m.max_len, image.lengths[b]);
  }
  m.max_pages = image.max_pages;
  KVQ_CHECK(m.max_pages >= 1 &&
                image.page_tables.size() == static_cast<size_t>(m.batch) * m.max_pages,
            kInvalidArgument, "DeviceCache: ", image.page_tables.size(),
            " page-table entries for ", m.batch, " sequences of ", m.max_pages);
  m.lens = DeviceArray<int32_t>(image.lengths);
  m.tables = DeviceArray<int32_t>(image.page_tables);
  const size_t row = static_cast<size_t>(p.num_kv_heads) * p.head_dim();
  for (int kv = 0; kv < 2; ++kv) {
    const FormatLayout layout = LayoutOf(kv == 0 ? p.key : p.value);
    const size_t pages =
        image.pool[kv][0].size() / layout.PageBytes(0, p.page_size, p.num_kv_heads);
    for (int i = 0; i < kMaxPlanes; ++i) {
      const size_t want = i < layout.num_planes
                              ? pages * layout.PageBytes(i, p.page_size, p.num_kv_heads)
                              : 0;
      KVQ_CHECK(image.pool[kv][i].size() == want, kInvalidArgument, "DeviceCache: ",
                kv == 0 ? "key" : "value", " plane ", i, " holds ", image.pool[kv][i].size(),
                " bytes, ", pages, " pages need ", want);
      m.pool[kv][i] = DeviceArray<uint8_t>(image.pool[kv][i]);
    }
    if (p.quantized()) {
      KVQ_CHECK(image.sink[kv].size() >= static_cast<size_t>(m.batch) * p.sink * row &&
                    image.recent[kv].size() == static_cast<size_t>(m.batch) * p.ring_slots() * row,
                kInvalidArgument, "DeviceCache: the windows do not hold [B, S0 | W + F - 1, Hkv, d]");
    }
    m.sink[kv] = DeviceArray<uint16_t>(image.sink[kv]);
    m.recent[kv] = DeviceArray<uint16_t>(image.recent[kv]);
    const WriteParams& wp = kv == 0 ? p.key : p.value;
    const char* side = kv == 0 ? "key" : "value";
    image.heads[kv].Validate(wp, p.num_kv_heads, side);
    m.heads[kv] = DeviceHeadData(image.heads[kv], wp, p.num_kv_heads);
  }
  m.bytes_per_step = image.bytes_per_step;
  m.q = DeviceArray<float>(static_cast<size_t>(m.batch) * p.num_q_heads * p.head_dim());
  m.out = DeviceArray<float>(static_cast<size_t>(m.batch) * p.num_q_heads * p.head_dim());
  m.plan = PlanDecodeAttention(p, m.batch, m.max_len);
  m.workspace = DeviceArray<uint8_t>(std::max<size_t>(m.plan.workspace_bytes, 256));
}

DeviceCache::~DeviceCache() = default;
DeviceCache::DeviceCache(DeviceCache&&) noexcept = default;
DeviceCache& DeviceCache::operator=(DeviceCache&&) noexcept = default;

int DeviceCache::batch() const { return impl_->batch; }
const CacheParams& DeviceCache::params() const { return impl_->params; }
const DecodeAttentionPlan& DeviceCache::plan() const { return impl_->plan; }
size_t DeviceCache::BytesPerStep() const { return impl_->bytes_per_step; }

void DeviceCache::SetQuery(const float* q) {
  Impl& m = *impl_;
  KVQ_CHECK(q != nullptr, kInvalidArgument, "DeviceCache::SetQuery: null pointer");
  KVQ_CUDA_CHECK(cudaMemcpy(m.q.get(), q, m.q.bytes(), cudaMemcpyHostToDevice));
}

void DeviceCache::Step(cudaStream_t stream) { impl_->Run(stream); }

void DeviceCache::Attend(const float* q, float* out) {
  Impl& m = *impl_;
  KVQ_CHECK(q != nullptr && out != nullptr, kInvalidArgument, "DeviceCache::Attend: null pointer");
  SetQuery(q);
  // Poison the output so that an element the kernels do not write shows as NaN.
  KVQ_CUDA_CHECK(cudaMemset(m.out.get(), 0xff, m.out.bytes()));
  m.Run(nullptr);
  KVQ_CUDA_CHECK(cudaGetLastError());
  KVQ_CUDA_CHECK(cudaMemcpy(out, m.out.get(), m.out.bytes(), cudaMemcpyDeviceToHost));
}

}  // namespace kvq::gpu
