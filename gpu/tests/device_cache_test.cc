// DeviceCache (uploaded from a CPU PagedKVCache by the adapter's UploadCache) mirrors the cache on
// the device: decode attention over the mirror must
// match the fp64 reference over the same rows within the GPU tolerance (spec/cache.md §5), for
// quantized and bf16 caches and for batches of sequences of different lengths.
#include "kvq/gpu/device_cache.h"

#include <gtest/gtest.h>

#include "cache_upload.h"  // gpu/adapter

#include <cmath>
#include <vector>

#include "kvq/conformance/prng.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"

namespace kvq::gpu {
namespace {

using testbed::Write;

// Hq 8 Hkv 2 S0 16 W 32 P 16, FWHT on K (+ P_br) and V, INT2 d128 G64 (or the bf16 cache).
CacheParams SmallParams(bool quantized) {
  testbed::Cache c = testbed::Cache().kv_heads(2).q_heads(8).sink(16).recent(32).page(16)
                         .key(Write().head_dim(128).group(64).bits(2).hadamard().bitrev()
                                  .clip(0.96f))
                         .value(Write().head_dim(128).group(64).bits(2).hadamard().clip(0.92f));
  if (!quantized) c.bf16();
  return c;
}

void CheckBatch(bool quantized, const std::vector<int>& lengths, uint64_t seed) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  conformance::SplitMix64 rng(seed);
  const CacheParams p = SmallParams(quantized);
  const int d = p.head_dim(), hkv = p.num_kv_heads, hq = p.num_q_heads;
  cpu::PagedKVCache cache(p, {}, {});
  std::vector<int> seqs;
  for (int len : lengths) {
    const int s = cache.AddSequence();
    const std::vector<float> k = testbed::KvRows(static_cast<size_t>(len), hkv, d, &rng);
    const std::vector<float> v = testbed::KvRows(static_cast<size_t>(len), hkv, d, &rng);
    cache.Prefill(s, k.data(), v.data(), len);
    seqs.push_back(s);
  }
  const std::vector<float> q = testbed::Queries(seqs.size() * hq, d, &rng);
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
