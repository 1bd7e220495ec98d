// The elementwise and data-movement kernels of the GPU forward of kvq ppl (gpu_ppl.h): what
// calib/forward.cc's steps do besides the GEMMs (cuBLAS) and attention (kvq's write and decode
// kernels), and the two layouts the decode kernel reads that no kvq write kernel makes for a
// teacher-forced batch: the bf16 cache's pages, and the bf16 windows of every position's cache.
//
// Compiled with -fmad=false -prec-div=true -prec-sqrt=true: the products and sums are rounded
// one by one as the CPU steps round them (-ffp-contract=off), so given the same inputs Embed,
// RmsNorm's normalisation, the q/k norms and RoPE give the CPU's bits (RmsNorm's fp64 sum is
// reduced in another order; SwiGLU's exp is CUDA's expf, not Highway's).
//
// All pointers are device pointers; each launcher queues one kernel on `stream` and returns
// cudaGetLastError() (it neither synchronises nor throws).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvq::gpu::ppl {

// x [rows, width] = table[ids[r]] rows (table [V, width]).
cudaError_t LaunchEmbed(const float* table, const int32_t* ids, int64_t rows, int width,
                        float* x, cudaStream_t stream);

// out [rows, width] = w ⊙ x / sqrt(mean(x²) + eps) per row: the sum of squares in fp64, the
// mean rounded to fp32, inv = 1 / sqrt(mean + eps) in fp32 (steps::RmsNorm). out may be x.
cudaError_t LaunchRmsNorm(const float* x, const float* w, int64_t rows, int width, float eps,
                          float* out, cudaStream_t stream);

// Splits the fused projection qkv [rows, (Hq + 2·Hkv)·d] into q [rows, Hq·d] and the rows
// [rows, Hkv·d] of k and v (k_rows, v_rows: where position first + r goes, row r), applying
// Qwen3's per-head RMSNorm (q_norm / k_norm [d], null for llama) and rotate-half RoPE of
// positions first + r (cos, sin [max_positions, d/2]) to q and k (steps::QkvRope).
cudaError_t LaunchQkvRope(const float* qkv, int64_t rows, int64_t first, int hq, int hkv, int d,
                          const float* q_norm, const float* k_norm, float eps, const float* cos,
                          const float* sin, float* q, float* k_rows, float* v_rows,
                          cudaStream_t stream);

// act [rows, inter] = silu(gate) · up with gu [rows, 2·inter] = gate | up per row.
cudaError_t LaunchSwiGlu(const float* gu, int64_t rows, int inter, float* act,
                         cudaStream_t stream);

// y [n] = bf16(x) (round to nearest even; what cpu::PagedKVCache::Prefill stores).
cudaError_t LaunchRoundBf16(const float* x, int64_t n, uint16_t* y, cudaStream_t stream);

// The bf16 cache's pages: rows [tokens, Hkv, d] bf16 into pool [ceil(tokens / P), Hkv, P, d]
// (token i in page i / P, slot i % P; the page table is the identity). Slots past `tokens` of
// the last page are left as they are. d a multiple of 8.
cudaError_t LaunchPageBf16(const uint16_t* rows, int64_t tokens, int hkv, int d, int page_size,
                           uint16_t* pool, cudaStream_t stream);

// The bf16 windows of a batch of caches over one window's rows: sequence b is the cache of
// length t = first + b + 1 (F = 1): its sink [b, S0, Hkv, d] receives positions
// [0, min(S0, t)), its recent ring [b, W, Hkv, d] the positions [RecentBegin(t), t) at slot
// p % W, RecentBegin(t) = t ≤ S0 ? t : max(S0, t − W), both from rows k, v [first + batch,
// Hkv, d] bf16. What PrefillWrite (or AppendStep, position by position) leaves in the windows
// of a sequence of that length. Slots a sequence does not use are left as they are. Hkv·d a
// multiple of 8, every pointer 16-byte aligned.
cudaError_t LaunchGatherWindows(const uint16_t* k, const uint16_t* v, int64_t first, int batch,
                                int hkv, int d, int sink, int recent, uint16_t* sink_k,
                                uint16_t* sink_v, uint16_t* recent_k, uint16_t* recent_v,
                                cudaStream_t stream);

// lengths [n] = offset + i.
cudaError_t LaunchIota(int32_t* lengths, int n, int offset, cudaStream_t stream);

}  // namespace kvq::gpu::ppl
