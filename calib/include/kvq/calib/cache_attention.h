// Attention through a scheme's real paged KV cache, for teacher-forced evaluation (kvq ppl):
// the forward's attention hook (forward.h) backed by a cpu::PagedKVCache per layer.
//
// Decode faithfulness. In layer l the T rows of k and v are prefilled into the scheme's cache
// (history codes are a pure function of the bf16 row, spec/cache.md §2, so one prefill gives
// every row its final bits). The query at position p then reads the cache as it is at length
// p + 1: position i comes from the history (its dequantized rotated row, with q rotated by the
// key write path, q·R_K then P_br, and the history part of the output mapped back by R_Vᵀ:
// exactly what cpu::Attend does) iff S0 ≤ i < S0 + H(p + 1), else from the bf16 row (the
// original row rounded to bf16, what the sink and recent windows hold). The result equals
// cpu::Attend on a cache of length p + 1 built by prefill, within the oracle's tolerance
// (cache_attention_test.cc checks it position by position).
#pragma once

#include <vector>

#include "kvq/calib/forward.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

class CacheAttention : public AttentionStep {
 public:
  // layers[l]: the scheme of layer l (BuildLayerScheme, clip ratios already chosen), one per
  // layer of `config`, whose Hq, Hkv and d its CacheParams must match (kShapeMismatch naming
  // the layer and both shapes). backend: the cache's write path and the query/output
  // rotations (must outlive this object; cpu::Backends() entries do).
  CacheAttention(const ModelConfig& config, std::vector<LayerScheme> layers,
                 const cpu::Backend& backend);

  // Throws what PagedKVCache::Prefill throws (non-finite rows, rows that overflow bf16).
  void Attend(int layer, int64_t first, int64_t rows, const float* q, const float* k,
              const float* v, float* out) override;

  // Bits per element of the caches at the last window's length, K and V, mean over layers
  // (cpu::CacheBytes::bits_per_element: codes, metadata and bf16 windows in use).
  double bits_per_element() const;

 private:
  std::vector<LayerScheme> layers_;
  const cpu::Backend* backend_;
  std::vector<double> bits_;  // per layer, at the last call
};

}  // namespace kvq::calib
