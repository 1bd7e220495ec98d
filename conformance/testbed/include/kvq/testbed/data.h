// Seeded data for tests and benchmarks, built from SplitMix64 (kvq/conformance/prng.h), so a
// seed gives the same data on every machine: rotations, clip ratios, K/V-like rows, queries,
// and caches filled with them.
#pragma once

#include <cstdint>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/conformance/prng.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::testbed {

using conformance::SplitMix64;

// A random orthogonal d x d matrix, row-major (Gram-Schmidt twice in double, rounded to fp32).
using conformance::RandomOrthogonal;
// A dense d x d matrix of bell-shaped entries / sqrt(d), with a few +0 and -0 (not orthogonal:
// for stage tests of the dense rotation).
std::vector<float> RandomMatrix(int d, SplitMix64* rng);

// Per-KV-head data of a cache: rotations [Hkv, d, d] when the write params are dense (else
// empty) and clip ratios [Hkv] in [0.85, 1] with head 0 at 1 (never clips).
std::vector<float> HeadRotations(const WriteParams& p, int num_kv_heads, SplitMix64* rng);
std::vector<float> HeadClips(int num_kv_heads, SplitMix64* rng);
// Codebook block widths [Hkv, d/2] in 1..8 (spec/numerics.md §5.4.1), each head's drawn around a
// width of its own so that heads lay their rows out in one to eight segments. They fit any
// side whose row limits are segments = 8 and code_bytes = d.
std::vector<uint8_t> HeadWidths(const WriteParams& p, int num_kv_heads, SplitMix64* rng);

// Rows that look like K or V: bell-shaped, channels j % 29 == 3 eight times larger, times
// `magnitude`. [tokens, Hkv, d] fp32.
std::vector<float> KvRows(size_t tokens, int num_kv_heads, int d, SplitMix64* rng,
                          float magnitude = 1.0f);
// Queries [n, d] of bell-shaped values times `magnitude`.
std::vector<float> Queries(size_t n, int d, SplitMix64* rng, float magnitude = 1.0f);

// A random permutation of 0 .. n - 1 (Fisher-Yates): page ids for page tables, so tests exercise
// the indirection.
std::vector<int32_t> RandomPermutation(int n, SplitMix64* rng);

// The per-head data of both sides of a cache for `p`, drawn from rng in a fixed order:
// rotations (dense sides), clip ratios (quantized sides but codebook ones, whose rows are not
// clipped), fp8 scales (fp8 sides), block widths (HeadWidths: codebook sides with segments > 1).
struct CacheHeads {
  HeadData key, value;
};
CacheHeads DrawCacheHeads(const CacheParams& p, SplitMix64* rng);

// A cache for `p` with the per-head data of DrawCacheHeads, writing through `backend`.
cpu::PagedKVCache MakeCache(const CacheParams& p, uint64_t seed,
                            const cpu::Backend& backend = cpu::BestBackend());
// The same with its seed drawn from rng.
inline cpu::PagedKVCache MakeCache(const CacheParams& p, SplitMix64* rng,
                                   const cpu::Backend& backend = cpu::BestBackend()) {
  return MakeCache(p, rng->NextU64(), backend);
}

}  // namespace kvq::testbed
