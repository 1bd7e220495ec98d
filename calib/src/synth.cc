#include "kvq/calib/synth.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "kvq/calib/random.h"
#include "kvq/common/error.h"
#include "kvq/common/memory.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"

namespace kvq::calib {
namespace {

// A d×d fp64 matrix, column-major like Eigen, filled and orthonormalised by our own loops so
// that every bit is fixed by the seed.
struct Basis {
  int d = 0;
  std::vector<double> col;  // col[k * d + j] = component j of direction k
  double* column(int k) { return col.data() + static_cast<size_t>(k) * d; }
  const double* column(int k) const { return col.data() + static_cast<size_t>(k) * d; }
};

// Modified Gram–Schmidt (two passes) on columns in order; the first columns keep their span.
void Orthonormalise(Basis& b) {
  const int d = b.d;
  for (int k = 0; k < d; ++k) {
    double* v = b.column(k);
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < k; ++i) {
        const double* u = b.column(i);
        double dot = 0.0;
        for (int j = 0; j < d; ++j) dot += u[j] * v[j];
        for (int j = 0; j < d; ++j) v[j] -= dot * u[j];
      }
    }
    double norm2 = 0.0;
    for (int j = 0; j < d; ++j) norm2 += v[j] * v[j];
    const double inv = 1.0 / std::sqrt(norm2);
    for (int j = 0; j < d; ++j) v[j] *= inv;
  }
}

Basis RandomBasis(int d, Xoshiro256& rng) {
  Basis b{d, std::vector<double>(static_cast<size_t>(d) * d)};
  for (double& x : b.col) x = rng.Normal();
  Orthonormalise(b);
  return b;
}

// Mixing matrix, row-major fp32: M[k][j] = sqrt(λ_k)·B[j][k], so a row of standard normals z
// maps to y = z·M with covariance B·diag(λ)·Bᵀ.
std::vector<float> MixingMatrix(const Basis& b, const std::vector<double>& eigenvalues) {
  const int d = b.d;
  std::vector<float> m(static_cast<size_t>(d) * d);
  for (int k = 0; k < d; ++k) {
    const double s = std::sqrt(eigenvalues[k]);
    const double* u = b.column(k);
    for (int j = 0; j < d; ++j) m[static_cast<size_t>(k) * d + j] = static_cast<float>(s * u[j]);
  }
  return m;
}

// y[j] = Σ_k z[k]·M[k][j], k ascending from +0 in fp32 (each product and sum rounded: the
// build has no FMA contraction), so the bits do not depend on vector width.
void MixRow(const float* __restrict z, const float* __restrict m, float* __restrict y, int d) {
  for (int j = 0; j < d; ++j) y[j] = 0.0f;
  for (int k = 0; k < d; ++k) {
    const float zk = z[k];
    const float* row = m + static_cast<size_t>(k) * d;
    for (int j = 0; j < d; ++j) y[j] = y[j] + zk * row[j];
  }
}

struct RopeTable {
  int half = 0;
  std::vector<float> cos, sin;  // [T, d/2]
};

// Rotate-half RoPE (Llama/Qwen): pair (i, i + d/2) turns by t·θ_i, θ_i = base^(−2i/d).
RopeTable MakeRopeTable(int64_t tokens, int d, double base) {
  RopeTable table;
  table.half = d / 2;
  table.cos.resize(static_cast<size_t>(tokens) * table.half);
  table.sin.resize(table.cos.size());
  const double log_base = PortableLog(base);
  for (int i = 0; i < table.half; ++i) {
    const double theta = PortableExp(-(2.0 * i / d) * log_base);
    for (int64_t t = 0; t < tokens; ++t) {
      double s = 0.0, c = 0.0;
      PortableSinCos(static_cast<double>(t) * theta, &s, &c);
      table.cos[static_cast<size_t>(t) * table.half + i] = static_cast<float>(c);
      table.sin[static_cast<size_t>(t) * table.half + i] = static_cast<float>(s);
    }
  }
  return table;
}

void ApplyRope(const RopeTable& table, int64_t t, float* x) {
  const float* c = table.cos.data() + static_cast<size_t>(t) * table.half;
  const float* s = table.sin.data() + static_cast<size_t>(t) * table.half;
  for (int i = 0; i < table.half; ++i) {
    const float a = x[i];
    const float b = x[i + table.half];
    x[i] = a * c[i] - b * s[i];
    x[i + table.half] = a * s[i] + b * c[i];
  }
}

// Everything fixed for one (layer, KV head) before tokens are drawn.
struct HeadModel {
  std::vector<std::vector<float>> query_mixing;  // per query head of the group, [d, d]
  std::vector<std::vector<float>> query_mean;    // per query head, [d] (pre-RoPE)
  std::vector<float> key_mixing, value_mixing;   // [d, d]
  std::vector<float> positional;                 // [d] shared by queries and keys (pre-RoPE)
  std::vector<float> value_mean;                 // [d]
  int outlier_channel[2] = {0, 0};
  double outlier_mean[2] = {0.0, 0.0};
  std::vector<double> top_direction;  // [d] the query's top eigendirection (pre-RoPE)
  double key_mean_along_top = 0.0;    // ordinary keys' mean along it
};

// Layer-shared part of the query top-8 directions: unit vectors on the slow channels, direction
// k concentrated on its "home" channel (pair half − slow + k), the rest spread at random.
std::vector<double> LayerSharedDirections(const SynthOptions& o, const SynthModel& m, int layer) {
  const int d = o.head_dim;
  const int half = d / 2;
  const int slow = m.slow_pairs;
  Xoshiro256 rng(DeriveSeed(o.seed, {static_cast<uint64_t>(layer), 0x5348415245ULL}));
  std::vector<double> shared(static_cast<size_t>(8) * d, 0.0);
  for (int k = 0; k < 8; ++k) {
    double* direction = shared.data() + static_cast<size_t>(k) * d;
    double norm2 = 0.0;
    for (int p = half - slow; p < half; ++p) {
      direction[p] = rng.Normal();
      direction[p + half] = rng.Normal();
      norm2 += direction[p] * direction[p] + direction[p + half] * direction[p + half];
    }
    const double spread = std::sqrt(1.0 - m.query_home_weight * m.query_home_weight);
    for (int j = 0; j < d; ++j) direction[j] *= spread / std::sqrt(norm2);
    direction[half - slow + k] += m.query_home_weight;
  }
  return shared;
}

HeadModel BuildHeadModel(const SynthOptions& o, const SynthModel& m, int layer, int kv_head,
                         const std::vector<double>& shared) {
  const int d = o.head_dim;
  const int half = d / 2;
  const int slow = m.slow_pairs;
  const int group = o.num_q_heads / o.num_kv_heads;
  Xoshiro256 rng(DeriveSeed(o.seed, {static_cast<uint64_t>(layer),
                                     static_cast<uint64_t>(kv_head), 1}));
  HeadModel h;

  // Key outlier channels: two distinct pairs among the eight slowest, either member.
  const int pair0 = half - 1 - static_cast<int>(rng.Next() % 8);
  int pair1 = pair0;
  while (pair1 == pair0) pair1 = half - 1 - static_cast<int>(rng.Next() % 8);
  const int pairs[2] = {pair0, pair1};
  for (int j = 0; j < 2; ++j) {
    h.outlier_channel[j] = pairs[j] + ((rng.Next() & 1) ? half : 0);
    const double magnitude = m.key_outlier_low[j] +
                             (m.key_outlier_high[j] - m.key_outlier_low[j]) * rng.Uniform();
    h.outlier_mean[j] = (rng.Next() & 1) ? -magnitude : magnitude;
  }
  auto is_outlier_pair = [&](int channel) {
    const int pair = channel % half;
    return pair == pairs[0] || pair == pairs[1];
  };

  // Query basis, orthonormalised in the order [top 8, outlier-pair axes, the rest]:
  // - top 8 on the slow channels minus the outlier pairs, mixing the layer-shared directions
  //   with head-specific ones;
  // - the four outlier-pair axes exactly, given the four smallest eigenvalues: queries carry
  //   almost no energy where keys have their outliers (seeds/000 A.4 step 1: the key spike
  //   lands in the bottom-ranked eigenchannels of C_Q);
  // - the rest at random in the remaining space.
  Basis query{d, std::vector<double>(static_cast<size_t>(d) * d, 0.0)};
  const double own = std::sqrt(1.0 - m.query_layer_share * m.query_layer_share);
  // Final positions d−4 .. d−1: partner of c2, partner of c1, c2, c1 (the larger outlier c1 gets
  // the smallest eigenvalue, c2 the next: seeds/000 A.4 shows the spike on the last two).
  auto partner = [&](int channel) { return channel < half ? channel + half : channel - half; };
  const int axes[4] = {partner(h.outlier_channel[1]), partner(h.outlier_channel[0]),
                       h.outlier_channel[1], h.outlier_channel[0]};
  for (int k = 0; k < d; ++k) {
    double* col = query.column(k);
    if (k < 8) {
      double norm2 = 0.0;
      for (int j = 0; j < d; ++j) {
        col[j] = (j % half >= half - slow && !is_outlier_pair(j)) ? rng.Normal() : 0.0;
        norm2 += col[j] * col[j];
      }
      for (int j = 0; j < d; ++j) {
        const double common = is_outlier_pair(j) ? 0.0 : shared[static_cast<size_t>(k) * d + j];
        col[j] = m.query_layer_share * common + own * col[j] / std::sqrt(norm2);
      }
    } else if (k < 12) {
      col[axes[k - 8]] = 1.0;
    } else {
      for (int j = 0; j < d; ++j) col[j] = rng.Normal();
    }
  }
  Orthonormalise(query);
  // Move the four axes (Gram–Schmidt left them exact: the top 8 have no weight there) last.
  std::rotate(query.col.begin() + static_cast<ptrdiff_t>(8) * d,
              query.col.begin() + static_cast<ptrdiff_t>(12) * d, query.col.end());
  std::vector<double> spectrum(d);
  for (int k = 0; k < d; ++k) {
    if (k < 8) {
      spectrum[k] = m.query_top[k];
    } else {
      const double f = (d > 9) ? static_cast<double>(k - 8) / (d - 9) : 0.0;
      spectrum[k] = m.query_tail_first *
                    PortableExp(f * PortableLog(m.query_tail_last / m.query_tail_first));
    }
  }
  // The top direction carries a mean (the uncentred C_Q keeps its eigenvalue): ordinary keys
  // have the opposite mean along it, so they score sink_logit_gap below a small sink key.
  const double query_mean = std::sqrt(m.query_mean_fraction * spectrum[0]);
  h.key_mean_along_top = -m.sink_logit_gap * std::sqrt(static_cast<double>(d)) / query_mean;
  h.top_direction.assign(query.column(0), query.column(0) + d);

  // Positional vector on the fast pairs, shared by the group's queries and the keys.
  std::vector<double> positional(d, 0.0);
  double positional_norm2 = 0.0;
  for (int j = 0; j < d; ++j) {
    if (j % half < half - slow) {
      positional[j] = rng.Normal();
      positional_norm2 += positional[j] * positional[j];
    }
  }
  h.positional.resize(d);
  const double positional_scale =
      positional_norm2 > 0 ? m.positional_norm / std::sqrt(positional_norm2) : 0.0;
  for (int j = 0; j < d; ++j) h.positional[j] = static_cast<float>(positional[j] * positional_scale);

  for (int i = 0; i < group; ++i) {
    std::vector<double> jittered(d);
    for (int k = 0; k < d; ++k) {
      jittered[k] = spectrum[k] * PortableExp(m.query_head_jitter * rng.Normal());
    }
    jittered[0] *= 1.0 - m.query_mean_fraction;  // the rest of λ1 is the mean's
    h.query_mixing.push_back(MixingMatrix(query, jittered));
    std::vector<float> mean(d);
    const double scale = query_mean * (1.0 + 0.1 * rng.Normal());
    for (int j = 0; j < d; ++j) {
      mean[j] = static_cast<float>(h.positional[j] + scale * h.top_direction[j]);
    }
    h.query_mean.push_back(std::move(mean));
  }

  // Keys: a random basis unrelated to the queries', gently decaying spectrum.
  const Basis key = RandomBasis(d, rng);
  std::vector<double> key_spectrum(d);
  double key_total = 0.0;
  for (int k = 0; k < d; ++k) {
    key_spectrum[k] = 0.1 + PortableExp(-k / m.key_spectrum_decay);
    key_total += key_spectrum[k];
  }
  for (double& v : key_spectrum) v *= m.key_channel_variance * d / key_total;
  h.key_mixing = MixingMatrix(key, key_spectrum);

  // Values: a random basis, eigenvalues ∝ 1/(k+1), a fixed per-head mean.
  const Basis value = RandomBasis(d, rng);
  std::vector<double> value_spectrum(d);
  double value_total = 0.0;
  for (int k = 0; k < d; ++k) {
    value_spectrum[k] = 1.0 / (k + 1);
    value_total += value_spectrum[k];
  }
  for (double& v : value_spectrum) v *= m.value_channel_variance * d / value_total;
  h.value_mixing = MixingMatrix(value, value_spectrum);
  h.value_mean.resize(d);
  for (int j = 0; j < d; ++j) h.value_mean[j] = static_cast<float>(m.value_mean_std * rng.Normal());
  return h;
}

void GenerateHead(const SynthOptions& o, const SynthModel& m, const RopeTable& rope,
                  const std::vector<double>& shared, int layer, int kv_head,
                  LayerActivations& out) {
  const int d = o.head_dim;
  const int group = o.num_q_heads / o.num_kv_heads;
  const HeadModel h = BuildHeadModel(o, m, layer, kv_head, shared);
  Xoshiro256 rng(DeriveSeed(o.seed, {static_cast<uint64_t>(layer),
                                     static_cast<uint64_t>(kv_head), 2}));
  std::vector<float> z(d);
  auto draw = [&]() {
    for (float& x : z) x = static_cast<float>(rng.Normal());
  };
  for (int64_t t = 0; t < o.tokens; ++t) {
    const bool sink = t < m.sink_tokens;
    for (int i = 0; i < group; ++i) {
      const int head = kv_head * group + i;
      float* q = out.q.data() + (static_cast<size_t>(t) * o.num_q_heads + head) * d;
      draw();
      MixRow(z.data(), h.query_mixing[i].data(), q, d);
      for (int j = 0; j < d; ++j) q[j] = q[j] + h.query_mean[i][j];
      ApplyRope(rope, t, q);
      for (int j = 0; j < d; ++j) q[j] = RoundToBf16(q[j]);
    }
    float* k = out.k.data() + (static_cast<size_t>(t) * o.num_kv_heads + kv_head) * d;
    draw();
    MixRow(z.data(), h.key_mixing.data(), k, d);
    double jitter[2];
    for (double& j : jitter) j = rng.Normal();
    if (sink) {
      for (int j = 0; j < d; ++j) k[j] = k[j] * static_cast<float>(m.sink_key_scale);
    } else {
      for (int j = 0; j < d; ++j) {
        k[j] = k[j] + static_cast<float>(h.positional[j] + h.key_mean_along_top * h.top_direction[j]);
      }
      for (int j = 0; j < 2; ++j) {
        const float outlier =
            static_cast<float>(h.outlier_mean[j] * (1.0 + m.key_outlier_jitter * jitter[j]));
        k[h.outlier_channel[j]] = k[h.outlier_channel[j]] + outlier;
      }
    }
    ApplyRope(rope, t, k);
    for (int j = 0; j < d; ++j) k[j] = RoundToBf16(k[j]);

    float* v = out.v.data() + (static_cast<size_t>(t) * o.num_kv_heads + kv_head) * d;
    draw();
    MixRow(z.data(), h.value_mixing.data(), v, d);
    for (int j = 0; j < d; ++j) {
      v[j] = sink ? v[j] * static_cast<float>(m.sink_value_scale) : v[j] + h.value_mean[j];
      v[j] = RoundToBf16(v[j]);
    }
  }
}

}  // namespace

Activations Synthesize(const SynthOptions& o, const SynthModel& m) {
  KVQ_CHECK(IsSupportedHeadDim(o.head_dim), kInvalidArgument, "synth: head_dim ", o.head_dim,
            " is not supported (64, 128 or 256)");
  KVQ_CHECK(o.num_layers >= 1, kInvalidArgument, "synth: layers ", o.num_layers,
            " must be at least 1");
  KVQ_CHECK(o.num_kv_heads >= 1 && o.num_q_heads >= o.num_kv_heads &&
                o.num_q_heads % o.num_kv_heads == 0,
            kInvalidArgument, "synth: num_q_heads ", o.num_q_heads,
            " must be a positive multiple of num_kv_heads ", o.num_kv_heads);
  KVQ_CHECK(o.tokens >= 2, kInvalidArgument, "synth: tokens ", o.tokens, " must be at least 2");
  const int64_t calib_tokens = o.calib_tokens == 0 ? o.tokens / 2 : o.calib_tokens;
  KVQ_CHECK(calib_tokens >= 1 && calib_tokens <= o.tokens, kInvalidArgument,
            "synth: calib_tokens ", calib_tokens, " must lie in [1, tokens = ", o.tokens, "]");
  KVQ_CHECK(std::isfinite(o.rope_base) && o.rope_base > 1.0, kInvalidArgument,
            "synth: rope_base ", o.rope_base, " must be finite and > 1");
  KVQ_CHECK(o.threads >= 1, kInvalidArgument, "synth: threads ", o.threads, " must be >= 1");
  KVQ_CHECK(m.slow_pairs >= 16 && m.slow_pairs <= o.head_dim / 2, kInvalidArgument,
            "synth: slow_pairs ", m.slow_pairs, " must lie in [16, head_dim / 2]");
  KVQ_CHECK(m.sink_tokens >= 0 && m.sink_tokens < calib_tokens, kInvalidArgument,
            "synth: sink_tokens ", m.sink_tokens, " must lie in [0, calib_tokens = ",
            calib_tokens, ")");
  // The capture itself, fp32, before anything is allocated for it.
  CheckFitsInMemory(
      detail::Concat("synth: layers ", o.num_layers, " x tokens ", o.tokens, " x (q_heads ",
                     o.num_q_heads, " + 2 x kv_heads ", o.num_kv_heads, ") x head_dim ",
                     o.head_dim, " x 4 bytes"),
      4.0 * o.num_layers * static_cast<double>(o.tokens) *
          (o.num_q_heads + 2.0 * o.num_kv_heads) * o.head_dim);

  Activations acts;
  ActivationsInfo& info = acts.info;
  info.source = "kvq synth seed=" + std::to_string(o.seed);
  info.num_layers = o.num_layers;
  info.num_q_heads = o.num_q_heads;
  info.num_kv_heads = o.num_kv_heads;
  info.head_dim = o.head_dim;
  info.rope_base = o.rope_base;
  info.tokens = o.tokens;
  info.calib_tokens = calib_tokens;
  acts.layers.resize(o.num_layers);
  for (LayerActivations& layer : acts.layers) {
    layer.q.resize(static_cast<size_t>(o.tokens) * o.num_q_heads * o.head_dim);
    layer.k.resize(static_cast<size_t>(o.tokens) * o.num_kv_heads * o.head_dim);
    layer.v.resize(layer.k.size());
  }
  const RopeTable rope = MakeRopeTable(o.tokens, o.head_dim, o.rope_base);
  std::vector<std::vector<double>> shared(o.num_layers);
  for (int l = 0; l < o.num_layers; ++l) shared[l] = LayerSharedDirections(o, m, l);

  // Units of work are (layer, KV head); each writes its own rows and draws its own stream.
  const int units = o.num_layers * o.num_kv_heads;
  std::atomic<int> next{0};
  auto worker = [&]() {
    for (int u = next++; u < units; u = next++) {
      const int layer = u / o.num_kv_heads;
      GenerateHead(o, m, rope, shared[layer], layer, u % o.num_kv_heads, acts.layers[layer]);
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < std::min(o.threads, units); ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
  return acts;
}

}  // namespace kvq::calib
