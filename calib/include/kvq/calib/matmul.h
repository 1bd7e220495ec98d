// fp32 kernels of the model forward (forward.h): a register-blocked GEMM and the row-wise
// nonlinearities, in Highway with dynamic dispatch to the best target of this CPU.
//
// These are NOT spec'd paths: they use fused multiply-add where the target has it and
// Highway's Exp (≤ 1 ulp), so their bits may differ between targets (not between runs or
// thread counts on one machine). What they do guarantee, and what the perplexity evaluation
// relies on: every output element is a function of its own inputs only (one accumulation
// chain per element of MatMul, over k in ascending order), so a row's result does not depend
// on the other rows computed with it, on m or n, or on how the caller splits the work.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::calib {

// C [m, n] = A [m, k] · B [k, n] (or C += A·B when `accumulate`), fp32, row-major with leading
// dimensions lda ≥ k, ldb ≥ n, ldc ≥ n (elements). With accumulate, each element is
// c + (Σ_k a·b): the sum is formed first, then added once. k = 0 gives zeros (or leaves C).
// C must not alias A or B. No validation beyond debug asserts: callers pass consistent shapes.
void MatMul(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc,
            size_t m, size_t n, size_t k, bool accumulate = false);

// x [n] ← softmax(x): exp(x − max) / Σ exp(x − max), in place. Entries equal to −inf get
// probability 0; n ≥ 1 and at least one entry finite.
void SoftmaxInPlace(float* x, size_t n);

// log Σ exp(x) over n ≥ 1 finite values: max + log(Σ exp(x − max)), the sum accumulated in
// fp32 vector lanes over short blocks and in fp64 across them.
double LogSumExp(const float* x, size_t n);

// out [n] = silu(gate) · up = gate / (1 + exp(−gate)) · up (SwiGLU's elementwise step).
// out may alias gate or up.
void SwiGlu(const float* gate, const float* up, float* out, size_t n);

// The Highway target the kernels above run on ("AVX3", "AVX2", ...), for logs.
const char* MatMulTargetName();

}  // namespace kvq::calib
