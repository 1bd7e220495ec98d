// What a scheme's kernels cost, for `kvq bench` and the closing lines of `kvq demo`: caches of
// a scheme filled with seeded N(0, 1) rows, and one line per storage family of the catalogue
// (schemes that store the same bytes) with its bytes per token and, when a GPU is present, its
// decode step time.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli_gpu.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/cache.h"

namespace kvq::cli {

std::vector<float> NormalValues(size_t n, std::mt19937_64& rng);

// A cache of `layer` holding `batch` sequences of `length` tokens (keys, then values, N(0, 1)
// from rng), with a query batch [batch, Hq, d] drawn after them.
struct FilledCache {
  std::unique_ptr<cpu::PagedKVCache> cache;
  std::vector<int> seqs;
  std::vector<float> q;
  size_t bytes = 0;  // PagedKVCache::Bytes(seq).total() summed over the batch
};
FilledCache FillCache(const calib::LayerScheme& layer, int batch, int length,
                      std::mt19937_64& rng);

// The shape the cost lines are stated at: one layer of a Llama-3-8B-like model (d = 128,
// Hq/Hkv = 32/8), the catalogue's default options, a decode step of B = 1 at T tokens.
struct CostShape {
  int head_dim = 128, q_heads = 32, kv_heads = 8;
  int batch = 1, length = 32768;
  int iters = 20;
  uint64_t seed = 1;
};

// One line per storage family in catalogue order: its schemes, what it stores, history bits
// per element, bytes per token (K and V of every KV head, the history alone) against bf16's,
// and, with `gpu` (null: none), the decode step of the family's first scheme that needs no
// calibration (else its first, on a synthetic calibration), cold L2, against bf16's; without,
// a line giving why_no_gpu. Throws kvq::Error as the cache and the GPU do.
std::string KernelCostLines(const CostShape& shape, const GpuModule* gpu,
                            const std::string& why_no_gpu);

}  // namespace kvq::cli
