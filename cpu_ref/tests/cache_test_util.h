// Shared by the cache and attention tests: configurations, seeded K/V/Q data, random
// orthogonal rotations, and a cache built from them.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu::testing {

// A random orthogonal d×d matrix (Gram-Schmidt on a Gaussian matrix in double), rounded to
// fp32, row-major.
inline std::vector<float> RandomOrthogonal(int d, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> m(static_cast<size_t>(d) * d);
  for (double& x : m) x = normal(rng);
  for (int i = 0; i < d; ++i) {
    double* row = &m[static_cast<size_t>(i) * d];
    for (int pass = 0; pass < 2; ++pass) {  // twice for numerical orthogonality
      for (int k = 0; k < i; ++k) {
        const double* other = &m[static_cast<size_t>(k) * d];
        double dot = 0.0;
        for (int j = 0; j < d; ++j) dot += row[j] * other[j];
        for (int j = 0; j < d; ++j) row[j] -= dot * other[j];
      }
    }
    double norm = 0.0;
    for (int j = 0; j < d; ++j) norm += row[j] * row[j];
    norm = std::sqrt(norm);
    for (int j = 0; j < d; ++j) row[j] /= norm;
  }
  return std::vector<float>(m.begin(), m.end());
}

// Per-KV-head rotations [Hkv, d, d] for a dense rotation, else empty.
inline std::vector<float> HeadRotations(const WriteParams& p, int hkv, std::mt19937_64& rng) {
  std::vector<float> all;
  if (p.rotation != RotationKind::kDense) return all;
  for (int h = 0; h < hkv; ++h) {
    const std::vector<float> r = RandomOrthogonal(p.head_dim, rng);
    all.insert(all.end(), r.begin(), r.end());
  }
  return all;
}

inline std::vector<float> HeadClips(int hkv, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uniform(0.85f, 1.0f);
  std::vector<float> clips(static_cast<size_t>(hkv));
  for (float& c : clips) c = uniform(rng);
  clips[0] = 1.0f;  // one head that never clips
  return clips;
}

// Rows that look like K/V: N(0, 1) with a few fixed outlier channels and a per-token offset.
inline std::vector<float> RandomRows(size_t tokens, int hkv, int d, std::mt19937_64& rng,
                                     float magnitude = 1.0f) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(tokens * static_cast<size_t>(hkv) * static_cast<size_t>(d));
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t channel = i % static_cast<size_t>(d);
    const float outlier = (channel % 29 == 3) ? 8.0f : 1.0f;
    rows[i] = magnitude * outlier * normal(rng);
  }
  return rows;
}

inline CacheParams MakeCacheParams(int hq, int hkv, int d, int bits, int group, int sink,
                                   int recent, int page, RotationKind rotation, bool bitrev) {
  CacheParams p;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.sink = sink;
  p.recent = recent;
  p.page_size = page;
  for (WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = d;
    w->bits = bits;
    w->group = group;
    w->rotation = rotation;
    w->bitrev = bitrev;
  }
  return p;
}

inline std::string DescribeParams(const CacheParams& p) {
  std::ostringstream os;
  os << "Hq=" << p.num_q_heads << " Hkv=" << p.num_kv_heads << " d=" << p.head_dim()
     << " b=" << p.key.bits << "/" << p.value.bits << " G=" << p.key.group << "/"
     << p.value.group << " S0=" << p.sink << " W=" << p.recent << " P=" << p.page_size
     << " rot=" << RotationKindName(p.key.rotation) << (p.key.bitrev ? "+br" : "")
     << " quantized=" << p.quantized();
  return os.str();
}

// A cache with random per-head rotations and clip ratios for `p`.
inline PagedKVCache MakeCache(const CacheParams& p, std::mt19937_64& rng,
                              const Backend& backend = BestBackend()) {
  std::vector<float> rk = HeadRotations(p.key, p.num_kv_heads, rng);
  std::vector<float> rv = HeadRotations(p.value, p.num_kv_heads, rng);
  std::vector<float> ck = HeadClips(p.num_kv_heads, rng);
  std::vector<float> cv = HeadClips(p.num_kv_heads, rng);
  return PagedKVCache(p, rk, rv, ck, cv, backend);
}

}  // namespace kvq::cpu::testing
