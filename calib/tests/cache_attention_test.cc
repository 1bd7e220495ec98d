// The teacher-forced cache read (CacheAttention, one prefill per layer, each query reading the
// rows that are history at its own length) against the decode oracle: for every query position
// p, cpu::Attend on a cache of length p + 1 built by prefill, and its fp64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/calib/cache_attention.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/testbed/compare.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 64;

ModelConfig Shape() {
  ModelConfig c;
  c.num_layers = 1;
  c.num_q_heads = kHq;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  return c;
}

struct Data {
  int64_t tokens;
  std::vector<float> q, k, v;  // [T, Hq, d], [T, Hkv, d]
};

// Keys with a mean and one outlier channel (so clipping and rotations matter), logits of a
// few units.
Data RandomData(int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data x{tokens, {}, {}, {}};
  x.q.resize(tokens * kHq * kD);
  x.k.resize(tokens * kHkv * kD);
  x.v.resize(x.k.size());
  for (float& f : x.q) f = 0.6f * normal(rng);
  for (size_t i = 0; i < x.k.size(); ++i) {
    const int c = static_cast<int>(i % kD);
    x.k[i] = normal(rng) + (c == 5 ? 6.0f : 0.5f);
    x.v[i] = normal(rng);
  }
  return x;
}

LayerScheme Scheme(const std::string& name, int sink, int recent, int flush) {
  Activations shape;
  shape.info.num_layers = 1;
  shape.info.num_q_heads = kHq;
  shape.info.num_kv_heads = kHkv;
  shape.info.head_dim = kD;
  SchemeOptions o = testing::SmallSchemeOptions();
  o.sink = sink;
  o.recent = recent;
  LayerScheme s;
  if (name == "dense_clip") {
    // A dense per-head rotation with clips, as the calibrated schemes have.
    s = BuildLayerScheme("naive", shape, nullptr, 0, o);
    s.params.key.rotation = s.params.value.rotation = RotationKind::kDense;
    for (int h = 0; h < kHkv; ++h) {
      for (int side = 0; side < 2; ++side) {
        const bool keys = side == 0;
        const std::vector<float> r = ToRowMajorF32(RandomOrthogonal(kD, 11 + 2 * h + keys));
        std::vector<float>& rotation = s.heads(side).rotation;
        rotation.insert(rotation.end(), r.begin(), r.end());
      }
      s.key.clip.push_back(h == 0 ? 0.9f : 0.84f);
      s.value.clip.push_back(h == 0 ? 0.94f : 1.0f);
    }
  } else {
    s = BuildLayerScheme(name, shape, nullptr, 0, o);
  }
  s.params.flush = flush;
  s.params.Validate();
  return s;
}

// Runs CacheAttention over positions [first, T) and checks every one against cpu::Attend on a
// cache of length p + 1 (and against AttendReferenceF64).
void CheckAgainstDecode(const std::string& name, int sink, int recent, int flush, int64_t first) {
  SCOPED_TRACE(name + " S0=" + std::to_string(sink) + " W=" + std::to_string(recent) +
               " F=" + std::to_string(flush) + " first=" + std::to_string(first));
  const Data x = RandomData(100, 7);
  const LayerScheme scheme = Scheme(name, sink, recent, flush);
  const cpu::Backend& backend = cpu::BestBackend();
  CacheAttention attention(Shape(), {scheme}, backend);
  const int64_t rows = x.tokens - first;
  std::vector<float> out(rows * kHq * kD);
  attention.Attend(0, first, rows, x.q.data() + first * kHq * kD, x.k.data(), x.v.data(),
                   out.data());
  double worst_attend = 0, worst_f64 = 0;
  int64_t with_history = 0;
  for (int64_t p = first; p < x.tokens; ++p) {
    cpu::PagedKVCache cache(scheme.params, scheme.key, scheme.value, backend);
    const int seq = cache.AddSequence();
    cache.Prefill(seq, x.k.data(), x.v.data(), p + 1);
    with_history += cache.HistoryLength(seq) > 0;
    std::vector<float> o(kHq * kD);
    std::vector<double> ref(kHq * kD);
    cpu::Attend(backend, cache, seq, x.q.data() + p * kHq * kD, o.data());
    cpu::AttendReferenceF64(cache, seq, x.q.data() + p * kHq * kD, ref.data());
    const float* mine = out.data() + (p - first) * kHq * kD;
    for (double e : cpu::RelativeErrorPerHead(mine, ref.data(), kHq, kD)) {
      worst_f64 = std::max(worst_f64, e);
    }
    std::vector<double> attend64(o.begin(), o.end());
    for (double e : cpu::RelativeErrorPerHead(mine, attend64.data(), kHq, kD)) {
      worst_attend = std::max(worst_attend, e);
    }
  }
  // Both paths are within the oracle tolerance of the fp64 reference, so of each other
  // within twice that.
  EXPECT_LE(worst_f64, cpu::kAttentionOracleTolerance);
  EXPECT_LE(worst_attend, 2 * cpu::kAttentionOracleTolerance);
  if (name != "bf16") {
    EXPECT_GT(with_history, 10);  // the history is exercised
  }
  std::printf("%s S0=%d W=%d F=%d: max rel diff vs cpu::Attend %.2e, vs fp64 %.2e\n", name.c_str(),
              sink, recent, flush, worst_attend, worst_f64);
}

TEST(CacheAttention, EqualsDecodeAttentionAtEveryLength) {
  CheckAgainstDecode("naive", 8, 16, 1, 0);
  CheckAgainstDecode("hadamard_bitrev", 8, 16, 1, 0);
  CheckAgainstDecode("saw_int4", 4, 8, 1, 0);
  CheckAgainstDecode("dense_clip", 8, 16, 1, 0);
  CheckAgainstDecode("dense_clip", 0, 5, 4, 0);  // no sink, history growing 4 rows at a time
  CheckAgainstDecode("dense_clip", 8, 16, 1, 37);  // a forward over the rows from 37 on
  CheckAgainstDecode("bf16", 8, 16, 1, 0);
}

// The bf16 scheme through its cache is the bf16-rounded dense attention, bit for bit (so kvq
// ppl's bf16 row has KL exactly 0), and a quantized scheme gives the same bits whether the
// rows before `first` are computed or not (the shared prefix of kvq ppl).
TEST(CacheAttention, Bf16CacheIsDenseBf16AttentionBitForBit) {
  const Data x = RandomData(90, 3);
  CacheAttention cached(Shape(), {Scheme("bf16", 8, 16, 1)}, cpu::BestBackend());
  DenseAttention dense(Shape(), KvRounding::kBf16);
  std::vector<float> a(x.tokens * kHq * kD), b(a.size());
  cached.Attend(0, 0, x.tokens, x.q.data(), x.k.data(), x.v.data(), a.data());
  dense.Attend(0, 0, x.tokens, x.q.data(), x.k.data(), x.v.data(), b.data());
  EXPECT_TRUE(testbed::BitsEqual("bf16_cache_vs_dense_bf16", b, a, kD));
  DenseAttention exact(Shape(), KvRounding::kNone);
  exact.Attend(0, 0, x.tokens, x.q.data(), x.k.data(), x.v.data(), b.data());
  // k and v are not bf16 values: the rounding matters.
  EXPECT_NE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(CacheAttention, RowsDoNotDependOnTheFirstComputedRow) {
  const Data x = RandomData(100, 5);
  CacheAttention cached(Shape(), {Scheme("dense_clip", 8, 16, 1)}, cpu::BestBackend());
  std::vector<float> all(x.tokens * kHq * kD);
  cached.Attend(0, 0, x.tokens, x.q.data(), x.k.data(), x.v.data(), all.data());
  for (int64_t first : {1, 24, 63, 64, 65, 99}) {
    std::vector<float> tail((x.tokens - first) * kHq * kD);
    cached.Attend(0, first, x.tokens - first, x.q.data() + first * kHq * kD, x.k.data(),
                  x.v.data(), tail.data());
    EXPECT_TRUE(testbed::BitsEqual("cache_rows_from_" + std::to_string(first),
                                   std::vector<float>(all.begin() + first * kHq * kD, all.end()),
                                   tail, kD));
  }
}

TEST(CacheAttention, RejectsASchemeOfAnotherShape) {
  ModelConfig other = Shape();
  other.num_kv_heads = 1;
  testing::ExpectError([&] { CacheAttention(other, {Scheme("naive", 8, 16, 1)}, cpu::BestBackend()); },
                       ErrorCode::kShapeMismatch, "layer 0's scheme is Hq=4 Hkv=2 d=64");
}

}  // namespace
}  // namespace kvq::calib
