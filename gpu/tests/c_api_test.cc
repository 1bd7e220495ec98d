// The C ABI (kvq/gpu/c_api.h) against the C++ it translates: a prefill and decode-step appends
// through kvq_write_prefill / kvq_write_append leave pools and windows bit-identical to the CPU
// oracle's PagedKVCache (scalar backend: the bits the C++ write API is held to by
// write_paged_test), and kvq_decode over them gives the bits of the C++ decode step
// (DeviceCache over the uploaded CPU cache), for OSCAR INT2 (dense rotations, sink, window),
// KIVI (tiled keys, F = 128), fp8_e4m3 (per-head scales) and the bf16 cache (decode only: its
// write is the caller's copy and is refused). Bad inputs return a status and a message naming
// the value; those cases need no device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cache_upload.h"
#include "gpu_test_util.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params_builder.h"
#include "kvq/conformance/prng.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/gpu/c_api.h"
#include "kvq/gpu/device_cache.h"
#include "kvq/testbed/cache_checks.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"

namespace kvq::gpu {
namespace {

using namespace kvq::gpu::testing;
using conformance::SplitMix64;
using cpu::KV;
using testbed::AllBitsEqual;
using testbed::AsTensor;
using testbed::NamedTensors;
using params::Cache;
using params::Write;

// The metadata text of `c` (PutCacheParams' keys), as kvq_cache_create reads it.
std::string ParamsText(const CacheParams& c) {
  Metadata metadata;
  PutCacheParams(c, &metadata);
  std::string text;
  for (const auto& [key, value] : metadata) text += key + "=" + value + ";\n";
  return text;
}

// A kvq_cache handle that must be created (ASSERTs the status) and is destroyed at scope end.
struct Handle {
  kvq_cache* cache = nullptr;
  explicit Handle(const CacheParams& c) {
    const int status = kvq_cache_create(ParamsText(c).c_str(), &cache);
    EXPECT_EQ(status, KVQ_OK) << kvq_last_error();
  }
  ~Handle() { kvq_cache_destroy(cache); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
};

// Index of the per-head row called `name` (kvq_head_row_name); -1 when there is none.
int HeadRow(const char* name) {
  for (int r = 0; r < kvq_head_rows(); ++r) {
    if (std::strcmp(kvq_head_row_name(r), name) == 0) return r;
  }
  return -1;
}

struct AbiCase {
  const char* name;
  CacheParams params;
};

std::vector<AbiCase> QuantizedCases() {
  return {
      {"oscar_int2_dense_S4_W8",
       Cache().kv_heads(2).q_heads(8).sink(4).recent(8).page(16)
           .key(Write().head_dim(128).group(64).bits(2).rotation(RotationKind::kDense).clip(0.96f))
           .value(Write().head_dim(128).group(64).bits(2).rotation(RotationKind::kDense)
                      .clip(0.92f))},
      {"kivi_tile32_F128_W1",
       Cache().kv_heads(2).q_heads(4).sink(0).recent(1).flush(128).page(64)
           .key(Write().head_dim(128).tile(32).bits(2))
           .value(Write().head_dim(128).group(32).bits(2))},
      {"fp8_hadamard_S2_W4",
       Cache().kv_heads(2).q_heads(4).sink(2).recent(4).page(16)
           .both(Write().head_dim(64).hadamard().fp8(0.0625f))},
  };
}

// The per-head data of the CPU cache and its device copies, one pointer per C ABI row.
struct Heads {
  kvq::HeadData host[2];
  std::vector<DeviceArray<float>> device;
  std::vector<const void*> rows[2];

  Heads(const CacheParams& c, SplitMix64* rng) {
    for (int kv = 0; kv < 2; ++kv) {
      const WriteParams& p = kv == 0 ? c.key : c.value;
      rows[kv].assign(static_cast<size_t>(kvq_head_rows()), nullptr);
      if (!p.quantized()) continue;
      host[kv].rotation = testbed::HeadRotations(p, c.num_kv_heads, rng);
      host[kv].clip = testbed::HeadClips(c.num_kv_heads, rng);
      if (p.format == Format::kFp8E4m3) {  // a different scale per head and side
        for (int h = 0; h < c.num_kv_heads; ++h) {
          host[kv].scale.push_back(p.head_scale * static_cast<float>(1 + h + 2 * kv));
        }
      }
      const auto add = [&](const std::vector<float>& values, const char* row) {
        if (values.empty()) return;
        device.emplace_back(values);
        rows[kv][static_cast<size_t>(HeadRow(row))] = device.back().get();
      };
      device.reserve(8);
      add(host[kv].rotation, "rotation");
      add(host[kv].clip, "clip");
      add(host[kv].scale, "scale");
    }
  }
};

// Device pools of `pages` pages in the C ABI's shapes, zeroed (the CPU pool's pages start so).
struct Pools {
  std::vector<DeviceArray<uint8_t>> planes[2];
  std::vector<void*> pointers[2];
  int64_t pages = 0;

  Pools(const kvq_cache* cache, int64_t num_pages) : pages(num_pages) {
    for (int kv = 0; kv < 2; ++kv) {
      int32_t count = 0;
      EXPECT_EQ(kvq_pool_num_planes(cache, kv, &count), KVQ_OK) << kvq_last_error();
      for (int i = 0; i < count; ++i) {
        int64_t bytes = 0;
        EXPECT_EQ(kvq_pool_plane(cache, kv, i, pages, nullptr, nullptr, &bytes, nullptr), KVQ_OK);
        planes[kv].emplace_back(static_cast<size_t>(bytes));
        planes[kv].back().Fill(0);
        pointers[kv].push_back(planes[kv].back().get());
      }
    }
  }
};

// Two sequences prefilled through the C ABI, then `steps` appends: pools and windows against
// the CPU cache that ran the same rows, then the decode step against DeviceCache's.
void CheckWriteAndDecode(const AbiCase& test, int steps) {
  const CacheParams& c = test.params;
  SplitMix64 rng(2026);
  Heads heads(c, &rng);
  const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim();
  const int ring = c.ring_slots(), s0 = c.sink;
  const std::vector<int> initial = {c.sink + c.recent + 2 * c.page_size + 3,
                                    std::max(1, c.sink + c.recent - 1)};
  const int batch = static_cast<int>(initial.size());

  cpu::PagedKVCache cache(c, heads.host[0], heads.host[1], cpu::ScalarBackend());
  std::vector<int> seqs;
  std::vector<std::vector<uint16_t>> prefill_k(batch), prefill_v(batch), step_k(steps),
      step_v(steps);
  for (int b = 0; b < batch; ++b) {
    prefill_k[b] = testbed::ToBf16(testbed::KvRows(initial[b], c.num_kv_heads, c.head_dim(), &rng));
    prefill_v[b] = testbed::ToBf16(testbed::KvRows(initial[b], c.num_kv_heads, c.head_dim(), &rng));
    seqs.push_back(cache.AddSequence());
    cache.PrefillBf16(seqs[b], prefill_k[b].data(), prefill_v[b].data(), initial[b]);
  }
  for (int s = 0; s < steps; ++s) {
    step_k[s] = testbed::ToBf16(testbed::KvRows(batch, c.num_kv_heads, c.head_dim(), &rng));
    step_v[s] = testbed::ToBf16(testbed::KvRows(batch, c.num_kv_heads, c.head_dim(), &rng));
    for (int b = 0; b < batch; ++b) {
      cache.AppendBf16(seqs[b], step_k[s].data() + b * row, step_v[s].data() + b * row);
    }
  }

  // The GPU uses the CPU's final page tables, so the whole pools compare byte for byte.
  int max_pages = 1;
  for (int seq : seqs) max_pages = std::max<int>(max_pages, static_cast<int>(cache.PageTable(seq).size()));
  std::vector<int32_t> tables(static_cast<size_t>(batch) * max_pages, 0);
  for (int b = 0; b < batch; ++b) {
    const std::vector<int32_t>& t = cache.PageTable(seqs[b]);
    std::copy(t.begin(), t.end(), tables.begin() + static_cast<size_t>(b) * max_pages);
  }

  Handle handle(c);
  ASSERT_NE(handle.cache, nullptr);
  Pools pools(handle.cache, std::max(cache.NumPages(), 1));
  DeviceArray<int32_t> dtables(tables), dlengths(static_cast<size_t>(batch));
  DeviceArray<uint16_t> sink_k(std::max<size_t>(batch * s0 * row, 8)),
      sink_v(std::max<size_t>(batch * s0 * row, 8)),
      ring_k(std::max<size_t>(batch * ring * row, 8)),
      ring_v(std::max<size_t>(batch * ring * row, 8));
  DeviceArray<int32_t> flags(1);
  flags.Fill(0);
  for (int b = 0; b < batch; ++b) {
    DeviceArray<uint16_t> dk(prefill_k[b]), dv(prefill_v[b]);
    ASSERT_EQ(kvq_write_prefill(handle.cache, dk.get(), dv.get(), initial[b],
                                dtables.get() + b * max_pages, max_pages,
                                heads.rows[0].data(), heads.rows[1].data(),
                                pools.pointers[0].data(), pools.pointers[1].data(), pools.pages,
                                s0 > 0 ? sink_k.get() + b * s0 * row : nullptr,
                                s0 > 0 ? sink_v.get() + b * s0 * row : nullptr,
                                ring_k.get() + b * ring * row, ring_v.get() + b * ring * row,
                                flags.get(), nullptr),
              KVQ_OK)
        << kvq_last_error();
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<int32_t> lengths(initial.begin(), initial.end());
  for (int s = 0; s < steps; ++s) {
    dlengths.Upload(lengths);
    DeviceArray<uint16_t> dk(step_k[s]), dv(step_v[s]);
    ASSERT_EQ(kvq_write_append(handle.cache, dk.get(), dv.get(), batch, dlengths.get(),
                               dtables.get(), max_pages, heads.rows[0].data(),
                               heads.rows[1].data(), pools.pointers[0].data(),
                               pools.pointers[1].data(), pools.pages,
                               s0 > 0 ? sink_k.get() : nullptr, s0 > 0 ? sink_v.get() : nullptr,
                               ring_k.get(), ring_v.get(), flags.get(), nullptr),
              KVQ_OK)
        << kvq_last_error();
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    for (int32_t& len : lengths) ++len;
  }
  EXPECT_EQ(flags.Download()[0], 0) << test.name;

  NamedTensors expected, got;
  for (KV kv : {KV::kKey, KV::kValue}) {
    const int k = static_cast<int>(kv);
    for (size_t i = 0; i < pools.planes[k].size(); ++i) {
      const size_t bytes = static_cast<size_t>(cache.NumPages()) *
                           cache.PagePlaneBytes(kv, static_cast<int>(i));
      const uint8_t* cpu = cache.PoolPlane(kv, static_cast<int>(i));
      std::vector<uint8_t> want(cpu, cpu + bytes), have = pools.planes[k][i].Download();
      have.resize(bytes);
      const std::string name = std::string(k == 0 ? "key" : "value") + ".pool." +
                               std::to_string(i);
      expected.emplace_back(name, AsTensor(want));
      got.emplace_back(name, AsTensor(have));
    }
    // The windows in use: sink rows [0, SinkLength) and the ring slots of [RecentBegin, t).
    const std::vector<uint16_t> sink = (k == 0 ? sink_k : sink_v).Download();
    const std::vector<uint16_t> rings = (k == 0 ? ring_k : ring_v).Download();
    for (int b = 0; b < batch; ++b) {
      std::vector<uint16_t> want, have;
      const uint16_t* cpu_sink = cache.SinkRows(seqs[b], kv);
      for (size_t p = 0; p < cache.SinkLength(seqs[b]); ++p) {
        want.insert(want.end(), cpu_sink + p * row, cpu_sink + (p + 1) * row);
        have.insert(have.end(), sink.begin() + (b * s0 + p) * row,
                    sink.begin() + (b * s0 + p + 1) * row);
      }
      const uint16_t* cpu_ring = cache.RecentRing(seqs[b], kv);
      for (size_t p = cache.RecentBegin(seqs[b]); p < cache.Length(seqs[b]); ++p) {
        const size_t slot = p % static_cast<size_t>(ring);
        want.insert(want.end(), cpu_ring + slot * row, cpu_ring + (slot + 1) * row);
        have.insert(have.end(), rings.begin() + (b * ring + slot) * row,
                    rings.begin() + (b * ring + slot + 1) * row);
      }
      const std::string name = std::string(k == 0 ? "key" : "value") + ".windows.seq" +
                               std::to_string(b);
      expected.emplace_back(name, AsTensor(want, static_cast<int64_t>(row)));
      got.emplace_back(name, AsTensor(have, static_cast<int64_t>(row)));
    }
  }
  EXPECT_TRUE(AllBitsEqual(std::string("c_api write ") + test.name, expected, got, {}));

  // The decode step: the C ABI over its own pools against DeviceCache over the CPU cache.
  const int hq = c.num_q_heads, d = c.head_dim();
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(batch) * hq, d, &rng);
  std::vector<float> want(q.size());
  UploadCache(cache, seqs).Attend(q.data(), want.data());
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  dlengths.Upload(lengths);
  int64_t workspace_bytes = 0;
  ASSERT_EQ(kvq_decode_workspace_bytes(handle.cache, batch, max_len, &workspace_bytes), KVQ_OK)
      << kvq_last_error();
  DeviceArray<uint8_t> workspace(static_cast<size_t>(std::max<int64_t>(workspace_bytes, 256)));
  DeviceArray<float> dq(q), dout(q.size());
  dout.Poison();
  std::vector<const void*> key_planes(pools.pointers[0].begin(), pools.pointers[0].end());
  std::vector<const void*> value_planes(pools.pointers[1].begin(), pools.pointers[1].end());
  ASSERT_EQ(kvq_decode(handle.cache, dq.get(), batch, max_len, dlengths.get(), dtables.get(),
                       max_pages, heads.rows[0].data(), heads.rows[1].data(), key_planes.data(),
                       value_planes.data(), s0 > 0 ? sink_k.get() : nullptr,
                       s0 > 0 ? sink_v.get() : nullptr, ring_k.get(), ring_v.get(), dout.get(),
                       workspace.get(), workspace_bytes, nullptr),
            KVQ_OK)
      << kvq_last_error();
  EXPECT_TRUE(testbed::BitsEqual(std::string("c_api decode ") + test.name, "out",
                                 AsTensor(want, d), AsTensor(dout.Download(), d)));
}

class CApiCaseTest : public ::testing::TestWithParam<AbiCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_CUDA(); }
};

TEST_P(CApiCaseTest, WriteEqualsCpuCacheAndDecodeEqualsCpp) {
  CheckWriteAndDecode(GetParam(), std::max(GetParam().params.page_size,
                                           GetParam().params.flush) + 3);
}

INSTANTIATE_TEST_SUITE_P(Caches, CApiCaseTest, ::testing::ValuesIn(QuantizedCases()),
                         [](const ::testing::TestParamInfo<AbiCase>& info) {
                           return std::string(info.param.name) + "__cuda";
                         });

// The bf16 cache: the pages of the CPU cache's image (ImageOf) decoded through the C ABI give
// DeviceCache's bits; its write is refused with the reason.
TEST(CApiBf16Test, DecodeEqualsCppAndWriteIsRefused__cuda) {
  KVQ_SKIP_WITHOUT_CUDA();
  const CacheParams c = Cache().kv_heads(2).q_heads(8).page(16).both(Write().head_dim(128)).bf16();
  SplitMix64 rng(77);
  cpu::PagedKVCache cache(c, {}, {}, {}, {}, cpu::ScalarBackend());
  const std::vector<int> lengths = {37, 130};
  std::vector<int> seqs;
  for (int len : lengths) {
    seqs.push_back(cache.AddSequence());
    const std::vector<uint16_t> k = testbed::ToBf16(testbed::KvRows(len, 2, 128, &rng));
    const std::vector<uint16_t> v = testbed::ToBf16(testbed::KvRows(len, 2, 128, &rng));
    cache.PrefillBf16(seqs.back(), k.data(), v.data(), len);
  }
  const CacheImage image = ImageOf(cache, seqs);
  Handle handle(c);
  ASSERT_NE(handle.cache, nullptr);

  int32_t planes = 0;
  ASSERT_EQ(kvq_pool_num_planes(handle.cache, KVQ_SIDE_KEY, &planes), KVQ_OK);
  ASSERT_EQ(planes, 1);
  const int64_t pages = static_cast<int64_t>(image.pool[0][0].size() / (2 * 16 * 128 * 2));
  int64_t shape[4] = {}, bytes = 0;
  int32_t dtype = -1;
  ASSERT_EQ(kvq_pool_plane(handle.cache, KVQ_SIDE_VALUE, 0, pages, shape, &dtype, &bytes, nullptr),
            KVQ_OK);
  EXPECT_EQ(dtype, KVQ_DTYPE_BF16);
  EXPECT_EQ(bytes, static_cast<int64_t>(image.pool[1][0].size()));
  EXPECT_EQ(shape[1] * shape[2] * shape[3], 2 * 16 * 128);

  DeviceArray<uint8_t> kpool(image.pool[0][0]), vpool(image.pool[1][0]);
  DeviceArray<int32_t> dtables(image.page_tables), dlengths(image.lengths);
  const int batch = static_cast<int>(seqs.size());
  const std::vector<float> q = testbed::Queries(static_cast<size_t>(batch) * 8, 128, &rng);
  std::vector<float> want(q.size());
  DeviceCache(image).Attend(q.data(), want.data());
  int64_t workspace_bytes = 0;
  ASSERT_EQ(kvq_decode_workspace_bytes(handle.cache, batch, 130, &workspace_bytes), KVQ_OK);
  DeviceArray<uint8_t> workspace(static_cast<size_t>(std::max<int64_t>(workspace_bytes, 256)));
  DeviceArray<float> dq(q), dout(q.size());
  dout.Poison();
  const void* key_planes[1] = {kpool.get()};
  const void* value_planes[1] = {vpool.get()};
  ASSERT_EQ(kvq_decode(handle.cache, dq.get(), batch, 130, dlengths.get(), dtables.get(),
                       image.max_pages, nullptr, nullptr, key_planes, value_planes, nullptr,
                       nullptr, nullptr, nullptr, dout.get(), workspace.get(), workspace_bytes,
                       nullptr),
            KVQ_OK)
      << kvq_last_error();
  EXPECT_TRUE(testbed::BitsEqual("c_api decode bf16", "out", AsTensor(want, 128),
                                 AsTensor(dout.Download(), 128)));

  void* pool_planes[1] = {kpool.get()};
  EXPECT_EQ(kvq_write_prefill(handle.cache, dq.get(), dq.get(), 4, dtables.get(), 8, nullptr,
                              nullptr, pool_planes, pool_planes, pages, nullptr, nullptr, nullptr,
                              nullptr, nullptr, nullptr),
            KVQ_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(kvq_last_error()).find("bf16 baseline cache has no kvq write"),
            std::string::npos)
      << kvq_last_error();
}

// ---- Errors (no device needed) -------------------------------------------------------------

// Expects `status` to be `code` and the message to hold every needle.
void ExpectStatus(int status, int code, const std::vector<std::string>& needles) {
  EXPECT_EQ(status, code) << kvq_last_error();
  const std::string message = kvq_last_error();
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' not in: " << message;
  }
}

CacheParams Oscar() { return QuantizedCases()[0].params; }

// Stand-in arguments of the refusal tests: 16-byte aligned buffers the C ABI checks but never
// dereferences, three of them as Oscar()'s pool planes, and per-head rows holding the dense
// rotation only.
struct StandIns {
  alignas(16) uint8_t bytes[4][256] = {};
  void* planes[3] = {bytes[0], bytes[1], bytes[2]};
  std::vector<const void*> rows = std::vector<const void*>(static_cast<size_t>(kvq_head_rows()));
  StandIns() { rows[static_cast<size_t>(HeadRow("rotation"))] = bytes[3]; }
};

TEST(CApiErrorsTest, CreateRefusesBadParameters) {
  kvq_cache* cache = nullptr;
  ExpectStatus(kvq_cache_create(nullptr, &cache), KVQ_ERROR_INVALID_ARGUMENT,
               {"kvq_cache_create", "params is null"});
  ExpectStatus(kvq_cache_create(ParamsText(Oscar()).c_str(), nullptr), KVQ_ERROR_INVALID_ARGUMENT,
               {"out is null"});
  // An unknown format ("scheme"): named.
  std::string text = ParamsText(Oscar()) + "key.row_format=oscar_int3;";
  ExpectStatus(kvq_cache_create(text.c_str(), &cache), KVQ_ERROR_INVALID_ARGUMENT,
               {"oscar_int3"});
  EXPECT_EQ(cache, nullptr);
  // A head_dim the spec does not have.
  CacheParams bad_d = Oscar();
  text = ParamsText(bad_d);
  const size_t at = text.find("key.head_dim=128");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 16, "key.head_dim=96");
  ExpectStatus(kvq_cache_create(text.c_str(), &cache), KVQ_ERROR_INVALID_ARGUMENT, {"96"});
  // An unknown and a repeated key.
  text = ParamsText(Oscar()) + "key.bitz=2;";
  ExpectStatus(kvq_cache_create(text.c_str(), &cache), KVQ_ERROR_INVALID_ARGUMENT,
               {"unknown parameter 'key.bitz'"});
  text = ParamsText(Oscar()) + "sink=4;";
  ExpectStatus(kvq_cache_create(text.c_str(), &cache), KVQ_ERROR_INVALID_ARGUMENT,
               {"'sink' is given twice"});
  ExpectStatus(kvq_cache_create("num_kv_heads", &cache), KVQ_ERROR_INVALID_ARGUMENT,
               {"'num_kv_heads' is not name=value"});
  // Valid parameters the CUDA decode does not serve: INT4 in groups of 32 at d = 128.
  const CacheParams int4_g32 =
      Cache().kv_heads(2).q_heads(4).sink(4).recent(8).page(16).both(
          Write().head_dim(128).group(32).bits(4));
  ExpectStatus(kvq_cache_create(ParamsText(int4_g32).c_str(), &cache), KVQ_ERROR_UNSUPPORTED,
               {"32"});
  EXPECT_EQ(cache, nullptr);
}

TEST(CApiErrorsTest, QueriesRefuseBadIndices) {
  Handle handle(Oscar());
  ASSERT_NE(handle.cache, nullptr);
  int32_t dims[KVQ_DIM_COUNT] = {};
  ASSERT_EQ(kvq_cache_dims(handle.cache, dims), KVQ_OK);
  EXPECT_EQ(dims[KVQ_DIM_HEAD_DIM], 128);
  EXPECT_EQ(dims[KVQ_DIM_Q_HEADS], 8);
  EXPECT_EQ(dims[KVQ_DIM_RING_SLOTS], 8);
  int64_t history = -1;
  ASSERT_EQ(kvq_cache_history_tokens(handle.cache, 4 + 8 + 5, &history), KVQ_OK);
  EXPECT_EQ(history, 5);
  int64_t shape[4] = {};
  int32_t dtype = -1;
  const char* name = nullptr;
  ASSERT_EQ(kvq_pool_plane(handle.cache, KVQ_SIDE_KEY, 1, 10, shape, &dtype, nullptr, &name),
            KVQ_OK);
  EXPECT_EQ(std::string(name), "scale");
  EXPECT_EQ(dtype, KVQ_DTYPE_BF16);
  EXPECT_EQ(shape[0], 10);
  EXPECT_EQ(shape[1], 2);
  EXPECT_EQ(shape[2], 16);
  EXPECT_EQ(shape[3], 2);  // d / G
  ExpectStatus(kvq_pool_plane(handle.cache, 2, 0, 1, shape, nullptr, nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"side 2"});
  ExpectStatus(kvq_pool_plane(handle.cache, KVQ_SIDE_KEY, 3, 1, shape, nullptr, nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"plane 3", "affine_token"});
  ExpectStatus(kvq_cache_dims(nullptr, dims), KVQ_ERROR_INVALID_ARGUMENT, {"cache is null"});
  const int rotation = HeadRow("rotation");
  ASSERT_GE(rotation, 0);
  int64_t elements = 0;
  int32_t use = -1;
  ASSERT_EQ(kvq_head_row_shape(handle.cache, KVQ_SIDE_VALUE, rotation, &elements, &dtype, &use),
            KVQ_OK);
  EXPECT_EQ(elements, 128 * 128);
  EXPECT_EQ(use, KVQ_HEAD_ROW_REQUIRED);
  EXPECT_EQ(kvq_head_row_name(kvq_head_rows()), nullptr);
  ExpectStatus(kvq_head_row_shape(handle.cache, KVQ_SIDE_KEY, kvq_head_rows(), &elements,
                                  nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"per-head row " + std::to_string(kvq_head_rows())});
}

// Write arguments refused before any CUDA call (the pointers are never dereferenced).
TEST(CApiErrorsTest, WritesRefuseBadArguments) {
  Handle handle(Oscar());
  ASSERT_NE(handle.cache, nullptr);
  StandIns stand_ins;
  auto& [dummy, planes, rows] = stand_ins;
  const int32_t* table = reinterpret_cast<const int32_t*>(dummy[3]);
  // 4 + 8 + 40 tokens put 40 in the history: 3 pages of 16, the table has 2.
  ExpectStatus(kvq_write_prefill(handle.cache, dummy[0], dummy[1], 52, table, 2, rows.data(),
                                 rows.data(), planes, planes, 4, dummy[0], dummy[1], dummy[2],
                                 dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"page table of 2 entries", "needs 3 pages"});
  // A null key.
  ExpectStatus(kvq_write_prefill(handle.cache, nullptr, dummy[1], 52, table, 3, rows.data(),
                                 rows.data(), planes, planes, 4, dummy[0], dummy[1], dummy[2],
                                 dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"key is null"});
  // The dense value rotation missing.
  std::vector<const void*> none(rows.size(), nullptr);
  ExpectStatus(kvq_write_prefill(handle.cache, dummy[0], dummy[1], 52, table, 3, rows.data(),
                                 none.data(), planes, planes, 4, dummy[0], dummy[1], dummy[2],
                                 dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"value per-head row 'rotation' is required"});
  // A null plane, an empty pool, a negative token count, a null handle.
  void* holed[3] = {dummy[0], nullptr, dummy[2]};
  ExpectStatus(kvq_write_append(handle.cache, dummy[0], dummy[1], 1, table, table, 3, rows.data(),
                                rows.data(), planes, holed, 4, dummy[0], dummy[1], dummy[2],
                                dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"value pool plane 1 ('scale') is null"});
  ExpectStatus(kvq_write_append(handle.cache, dummy[0], dummy[1], 1, table, table, 3, rows.data(),
                                rows.data(), planes, planes, 0, dummy[0], dummy[1], dummy[2],
                                dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"pool of 0 pages"});
  ExpectStatus(kvq_write_prefill(handle.cache, dummy[0], dummy[1], -3, table, 3, rows.data(),
                                 rows.data(), planes, planes, 4, dummy[0], dummy[1], dummy[2],
                                 dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"token count -3"});
  ExpectStatus(kvq_write_append(nullptr, dummy[0], dummy[1], 1, table, table, 3, rows.data(),
                                rows.data(), planes, planes, 4, dummy[0], dummy[1], dummy[2],
                                dummy[3], nullptr, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"kvq_write_append", "cache is null"});
  // A success clears the message.
  int32_t dims[KVQ_DIM_COUNT];
  ASSERT_EQ(kvq_cache_dims(handle.cache, dims), KVQ_OK);
  EXPECT_STREQ(kvq_last_error(), "");
}

TEST(CApiErrorsTest, DecodeRefusesBadArguments) {
  Handle handle(Oscar());
  ASSERT_NE(handle.cache, nullptr);
  int64_t bytes = 0;
  ExpectStatus(kvq_decode_workspace_bytes(handle.cache, 0, 100, &bytes),
               KVQ_ERROR_INVALID_ARGUMENT, {"batch 0"});
  ExpectStatus(kvq_decode_workspace_bytes(handle.cache, 1, 0, &bytes),
               KVQ_ERROR_INVALID_ARGUMENT, {"max_seq_len 0"});
  StandIns stand_ins;
  auto& [dummy, planes, rows] = stand_ins;
  float* out = reinterpret_cast<float*>(dummy[3]);
  ExpectStatus(kvq_decode(handle.cache, reinterpret_cast<const float*>(dummy[0] + 4), 1, 100,
                          reinterpret_cast<const int32_t*>(dummy[1]),
                          reinterpret_cast<const int32_t*>(dummy[1]), 8, rows.data(), rows.data(),
                          planes, planes, dummy[0], dummy[1], dummy[2], dummy[3], out, dummy[0],
                          1 << 20, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"not 16-byte aligned"});
  // A per-head row the format does not read (fp8 scales on an INT2 cache).
  std::vector<const void*> extra = rows;
  extra[static_cast<size_t>(HeadRow("scale"))] = dummy[2];
  ExpectStatus(kvq_decode(handle.cache, reinterpret_cast<const float*>(dummy[0]), 1, 100,
                          reinterpret_cast<const int32_t*>(dummy[1]),
                          reinterpret_cast<const int32_t*>(dummy[1]), 8, extra.data(),
                          rows.data(), planes, planes, dummy[0], dummy[1], dummy[2], dummy[3],
                          out, dummy[0], 1 << 20, nullptr),
               KVQ_ERROR_INVALID_ARGUMENT, {"key per-head row 'scale' is given"});
}

// kvq_decode_step's refusals, before any CUDA call: its decode's (a misaligned query), its
// append's (a null pool plane), and the bf16 cache's (no append step).
TEST(CApiErrorsTest, DecodeStepRefusesBadArguments) {
  Handle handle(Oscar());
  ASSERT_NE(handle.cache, nullptr);
  StandIns stand_ins;
  auto& [dummy, planes, rows] = stand_ins;
  const int32_t* ints = reinterpret_cast<const int32_t*>(dummy[1]);
  float* out = reinterpret_cast<float*>(dummy[3]);
  // Structured bindings are captured by name only from C++20: the stand-ins by reference.
  const auto step = [&, &dummy = stand_ins.bytes, &planes = stand_ins.planes,
                     &rows = stand_ins.rows](kvq_cache* cache, const float* q,
                                             void* const* value_planes) {
    return kvq_decode_step(cache, dummy[0], dummy[1], ints, q, 1, 100, ints, ints, 8,
                           rows.data(), rows.data(), planes, value_planes, 4, dummy[0], dummy[1],
                           dummy[2], dummy[3], nullptr, out, dummy[0], 1 << 20, nullptr);
  };
  ExpectStatus(step(handle.cache, reinterpret_cast<const float*>(dummy[0] + 4), planes),
               KVQ_ERROR_INVALID_ARGUMENT, {"kvq_decode_step", "not 16-byte aligned"});
  void* holed[3] = {dummy[0], nullptr, dummy[2]};
  ExpectStatus(step(handle.cache, reinterpret_cast<const float*>(dummy[0]), holed),
               KVQ_ERROR_INVALID_ARGUMENT, {"value pool plane 1 ('scale') is null"});
  Handle bf16(Cache().kv_heads(2).q_heads(8).page(16).both(Write().head_dim(128)).bf16());
  ASSERT_NE(bf16.cache, nullptr);
  ExpectStatus(step(bf16.cache, reinterpret_cast<const float*>(dummy[0]), planes),
               KVQ_ERROR_UNSUPPORTED, {"bf16 baseline cache has no kvq write"});
}

}  // namespace
}  // namespace kvq::gpu
