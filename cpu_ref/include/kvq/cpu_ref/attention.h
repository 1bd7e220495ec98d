// Decode attention over the paged KV cache (spec/cache.md §5): one query token per sequence,
// all Hq query heads, over sink + history + recent. Query head h reads KV head h / (Hq / Hkv).
//
// Per KV head: the bf16 rows (sink and recent; every row of a bf16 cache) form one partial
// (m, l, acc); the history is split into chunks of `chunk_pages` pages, each its own partial,
// with the query rotated once (q~ = q·R_K, then P_br, by the write path's rotation stage) and
// values accumulated in the rotated space; the history partials merge by log-sum-exp, are
// mapped back once by R_Vᵀ (RotateInverse with the value params), and merge with the bf16
// partial. Reduction order is free: results are held against AttendReferenceF64.
#pragma once

#include <cstddef>
#include <vector>

#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {

// What the oracle guarantees against AttendReferenceF64, per query head:
// max_j |o[j] - ref[j]| / max_j |ref[j]| <= kAttentionOracleTolerance (spec/cache.md §5),
// for logits |scale·q·k| up to ~32. Why there is a domain: a logit s is an fp32 value, known
// to 2^-24·|s| at best (1.9e-6 at |s| = 32, 3.8e-6 at 64), and that error moves exp(s) by the
// same relative amount; the dot product and the scale multiply round again. Measured worst
// over the tests (zero-mean values, logits to ~30): 5.1e-6 (hwy_scalar), 2.6e-6 (AVX-512);
// with logits to ~65 about 1e-5 (hwy_scalar, whose MulAdd is unfused) and 5e-6 (AVX-512).
inline constexpr double kAttentionOracleTolerance = 1e-5;

struct AttentionOptions {
  int chunk_pages = 4;  // history pages per (m, l, acc) partial; >= 1
};

// out [Hq, d] fp32 = attention of q [Hq, d] fp32 over sequence `seq` of `cache`, with the
// attention table of `backend` (and its write-path stages for the query and output
// rotations). Throws kvq::Error: unknown or empty sequence (kInvalidArgument), null pointers,
// chunk_pages < 1 (kInvalidArgument), a backend without attention kernels (kUnsupported),
// non-finite q (kNonFinite, naming head and channel), an output that overflows (kNonFinite,
// naming the head).
void Attend(const Backend& backend, const PagedKVCache& cache, int seq, const float* q,
            float* out, const AttentionOptions& options = {});

// A batch: seqs [B] (distinct or not, any lengths), q [B, Hq, d], out [B, Hq, d].
void AttendBatch(const Backend& backend, const PagedKVCache& cache, const std::vector<int>& seqs,
                 const float* q, float* out, const AttentionOptions& options = {});

// The fp64 reference over the same inputs: bf16 rows converted exactly, history rows as the
// cache dequantizes them (exact fp32 values in the rotated space), and the rotated query q~
// of the write path's rotation stage (spec'd fp32 bits, ScalarBackend); logits, softmax,
// value sums and the R_Vᵀ map back run in double. out [Hq, d]. Throws as Attend.
void AttendReferenceF64(const PagedKVCache& cache, int seq, const float* q, double* out);

// Per query head max_j |out - ref| / max_j |ref| (or max |out - ref| where ref is all zero).
// out, ref [num_heads, d]. Returns [num_heads].
std::vector<double> RelativeErrorPerHead(const float* out, const double* ref, int num_heads,
                                         int d);

}  // namespace kvq::cpu
