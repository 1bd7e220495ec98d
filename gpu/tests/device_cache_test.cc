// DeviceCache (uploaded from a CPU PagedKVCache by the adapter's UploadCache) mirrors the cache on
// the device: decode attention over the mirror must
// match the fp64 reference over the same rows within the GPU tolerance (spec/cache.md §5), for
// quantized and bf16 caches and for batches of sequences of different lengths.
#include "kvq/gpu/device_cache.h"

#include <gtest/gtest.h>

#include "cache_upload.h"  // gpu/adapter

#include <cmath>
#include <random>
#include <vector>

#include "kvq/cpu_ref/attention.h"
#include "kvq/gpu/cuda_check.h"

namespace kvq::gpu {
namespace {

CacheParams SmallParams(bool quantized) {
  CacheParams p;
  p.num_kv_heads = 2;
  p.num_q_heads = 8;
  p.sink = 16;
  p.recent = 32;
  p.page_size = 16;
  if (!quantized) p.key.format = p.value.format = kvq::Format::kBf16;
  p.key.head_dim = p.value.head_dim = 128;
  p.key.group = p.value.group = 64;
  p.key.bits = p.value.bits = 2;
  p.key.rotation = p.value.rotation = RotationKind::kHadamard;
  p.key.bitrev = true;
  p.key.clip = 0.96f;
  p.value.clip = 0.92f;
  return p;
}

std::vector<float> Normal(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void CheckBatch(bool quantized, const std::vector<int>& lengths, uint64_t seed) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(seed);
  const CacheParams p = SmallParams(quantized);
  const int d = p.head_dim(), hkv = p.num_kv_heads, hq = p.num_q_heads;
  cpu::PagedKVCache cache(p, {}, {});
  std::vector<int> seqs;
  for (int len : lengths) {
    const int s = cache.AddSequence();
    const std::vector<float> k = Normal(static_cast<size_t>(len) * hkv * d, rng);
    const std::vector<float> v = Normal(static_cast<size_t>(len) * hkv * d, rng);
    cache.Prefill(s, k.data(), v.data(), len);
    seqs.push_back(s);
  }
  const std::vector<float> q = Normal(seqs.size() * hq * d, rng);
  std::vector<float> out(q.size());
  DeviceCache device = UploadCache(cache, seqs);
  EXPECT_GT(device.BytesPerStep(), 0u);
  device.Attend(q.data(), out.data());
  for (size_t b = 0; b < seqs.size(); ++b) {
    std::vector<double> ref(static_cast<size_t>(hq) * d);
    cpu::AttendReferenceF64(cache, seqs[b], q.data() + b * hq * d, ref.data());
    const std::vector<double> err =
        cpu::RelativeErrorPerHead(out.data() + b * hq * d, ref.data(), hq, d);
    for (int h = 0; h < hq; ++h) {
      EXPECT_LE(err[h], kGpuAttentionTolerance)
          << "sequence " << b << " (length " << lengths[b] << ") head " << h << " seed " << seed;
    }
  }
}

TEST(DeviceCacheTest, QuantizedBatchMatchesReference) {
  CheckBatch(true, {1, 40, 49, 64, 300, 1000}, 11);
}

TEST(DeviceCacheTest, Bf16BatchMatchesReference) { CheckBatch(false, {1, 17, 500}, 12); }

TEST(DeviceCacheTest, RejectsEmptySequence) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  cpu::PagedKVCache cache(SmallParams(true), {}, {});
  const int s = cache.AddSequence();
  EXPECT_THROW(UploadCache(cache, {s}), Error);
  EXPECT_THROW(UploadCache(cache, {}), Error);
}

}  // namespace
}  // namespace kvq::gpu
