// The embedded synthetic default data: a seeded generator of post-RoPE Q/K/V activations whose
// statistics follow what the seeds publish about real models (docs/synthetic_data.md gives the
// model and the statistics measured on its output). Same options → the same bits on any
// machine: our own PRNG and elementary functions, fixed summation orders, no FMA.
#pragma once

#include <array>
#include <cstdint>

#include "kvq/calib/activations.h"

namespace kvq::calib {

// Shape of the capture.
struct SynthOptions {
  uint64_t seed = 0;
  int num_layers = 4;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;             // 64, 128 or 256
  int64_t tokens = 2048;
  int64_t calib_tokens = 0;       // 0 means tokens / 2 (the second half is held out)
  double rope_base = 1e6;         // Qwen3's; 1e4 is Llama-2's
  int threads = 2;                // work is split by (layer, KV head); any count gives the same bits
};

// The statistical model's parameters (docs/synthetic_data.md explains each one).
struct SynthModel {
  // Pre-RoPE query spectrum, top 8: the Qwen3-4B layer-10 eigenvalues of seeds/000 A.4.
  std::array<double, 8> query_top = {162.5, 85.5, 35.6, 17.4, 11.6, 7.5, 6.1, 5.0};
  double query_tail_first = 3.0;   // the remaining d−8 eigenvalues fall geometrically
  double query_tail_last = 0.01;   // from first to last
  double query_head_jitter = 0.2;  // each query head scales each eigenvalue by exp(σ·N(0,1))
  double query_layer_share = 0.95; // weight of the layer-shared part of the top-8 directions
  double query_home_weight = 0.85; // weight of each shared top direction on its home channel
  double query_mean_fraction = 0.6;  // share of λ1 that is the queries' mean along it
  int slow_pairs = 16;             // RoPE pairs with the lowest frequencies (16 ≤ · ≤ d/2): the
                                   // query top-8 directions and key outlier channels live there
  double key_channel_variance = 1.0;  // mean variance per channel of the Gaussian key part
  double key_spectrum_decay = 16.0;   // key eigenvalues ∝ 0.1 + exp(−k / decay)
  std::array<double, 2> key_outlier_low = {18.0, 8.0};   // |outlier channel mean| drawn
  std::array<double, 2> key_outlier_high = {32.0, 16.0};  // uniformly in [low, high]
  double key_outlier_jitter = 0.15;   // per token multiplicative N(1, σ²) on the outliers
  double sink_logit_gap = 9.0;        // mean q·(k_sink − k)/√d: ordinary keys' mean opposes
                                      // the queries' mean along the top query direction
  double sink_key_scale = 0.1;        // sink keys: this times a Gaussian key, no outliers
  double positional_norm = 5.5;       // shared pre-RoPE vector on fast pairs: recency bias
  double value_channel_variance = 1.0;
  double value_mean_std = 0.3;        // per-channel value mean ~ N(0, σ²), fixed per head
  double sink_value_scale = 0.1;      // sink values: this times a Gaussian value, no mean
  int sink_tokens = 1;                // the first sink_tokens tokens are attention sinks
};

// Generates the capture. Values are rounded to bf16 (what WriteActivations stores by default),
// so the returned Activations equal what reading the written file gives. The source metadata
// records the seed. Throws kvq::Error(kInvalidArgument) for unsupported shapes (d not
// 64/128/256, Hq not a multiple of Hkv, fewer than 2 tokens, calib_tokens > tokens, layers < 1,
// threads < 1, rope_base ≤ 0, sink_tokens outside [0, calib_tokens)).
Activations Synthesize(const SynthOptions& options, const SynthModel& model = SynthModel());

}  // namespace kvq::calib
