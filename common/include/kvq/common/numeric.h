// Element-type conversions shared bit for bit by the CPU oracle and the CUDA path.
// spec/numerics.md §1. All conversions round to nearest, ties to even (RNE).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVQ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVQ_HOST_DEVICE inline
#endif

namespace kvq {

KVQ_HOST_DEVICE uint32_t F32Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KVQ_HOST_DEVICE float F32FromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// fp32 -> bf16, round to nearest even. NaN stays NaN (quiet, sign kept); Inf stays Inf;
// subnormals round like any other value (bf16 shares fp32's exponent range).
KVQ_HOST_DEVICE uint16_t Bf16FromF32(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// bf16 -> fp32 is exact.
KVQ_HOST_DEVICE float F32FromBf16(uint16_t h) { return F32FromBits(static_cast<uint32_t>(h) << 16); }

// Rounds an fp32 value to the nearest bf16 and back (the value the cache stores).
KVQ_HOST_DEVICE float RoundToBf16(float f) { return F32FromBf16(Bf16FromF32(f)); }

// fp16 -> fp32 is exact (subnormals, Inf and NaN included).
KVQ_HOST_DEVICE float F32FromF16(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return F32FromBits(sign | 0x7f800000u | (man << 13));  // Inf / NaN
  if (exp == 0) {
    if (man == 0) return F32FromBits(sign);
    // Subnormal: value = man * 2^-24, exact in fp32.
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return F32FromBits(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp32 -> fp16, round to nearest even; overflow goes to Inf, NaN stays NaN.
KVQ_HOST_DEVICE uint16_t F16FromF32(float f) {
  uint32_t u = F32Bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (a < 0x38800000u) {  // below 2^-14: fp16 subnormal or zero
    if (a < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
    uint32_t exp = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // value = man * 2^(exp-150); subnormal unit 2^-24
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t rounded = a + 0x0fffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// M: the norm's span of m values padded with +0 to a power of two, the size of its summation
// tree (spec/numerics.md §5.1). The one definition for the CPU oracle and the CUDA kernels.
KVQ_HOST_DEVICE int64_t NormTreeSize(int64_t m) {
  int64_t padded = 1;
  while (padded < m) padded *= 2;
  return padded;
}

// beta(j): the low `bits` bits of j in reverse order (spec/numerics.md §3.3, P_br; an
// involution), bits in [0, 32]. The one definition for the CPU oracle, calibration and the CUDA
// kernels; on the device the same function is one bit-reverse instruction and a shift (the loop
// compiles to a chain of 3 * bits operations, partly left as a loop, on the kernels' paths).
KVQ_HOST_DEVICE uint32_t BitReverse(uint32_t j, int bits) {
#if defined(__CUDA_ARCH__)
  return bits == 0 ? 0u : __brev(j) >> (32 - bits);
#else
  uint32_t reversed = 0;
  for (int b = 0; b < bits; ++b) reversed |= ((j >> b) & 1u) << (bits - 1 - b);
  return reversed;
#endif
}

// ---- OCP FP8 e4m3 (spec/numerics.md §9, spec 1.2) ----
// One sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent field 0 holds the
// subnormals m * 2^-9; 0x7f / 0xff are NaN; no infinities. The largest finite value is 448.
inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint32_t kE4m3MaxBits = 0x43e00000u;        // F32Bits(448.0f)
inline constexpr uint32_t kE4m3MinNormalBits = 0x3c800000u;  // F32Bits(2^-6)

// fp32 -> e4m3, round to nearest even, saturating to +-448 (Inf saturates too; NaN is the
// caller's to reject: it is never stored). The sign bit is the input's (-0 and negative values
// that round to zero give 0x80). Integer arithmetic on the fp32 bits, except the subnormal
// range where |v| * 2^9 (exact) is rounded by rint: the same steps on every backend.
KVQ_HOST_DEVICE uint8_t E4m3FromF32(float v) {
  const uint32_t u = F32Bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  uint32_t magnitude;
  if (a >= kE4m3MaxBits) {
    magnitude = 0x7eu;  // 448 and everything above it
  } else if (a < kE4m3MinNormalBits) {
    // Subnormal e4m3 (or zero): q = rint(|v| * 512) in [0, 8]; q = 8 is 2^-6, the first
    // normal, whose code is 0x08 as well.
#if defined(__CUDA_ARCH__)
    magnitude = static_cast<uint32_t>(__float2int_rn(__fmul_rn(F32FromBits(a), 512.0f)));
#else
    const float scaled = F32FromBits(a) * 512.0f;
    // Adding and subtracting 2^23 rounds half to even for 0 <= scaled < 2^22.
    magnitude = static_cast<uint32_t>((scaled + 8388608.0f) - 8388608.0f);
#endif
  } else {
    // Normal: keep 3 of the 23 mantissa bits, round to nearest even on the dropped 20 (a carry
    // into the exponent is the correct next binade), then rebias 127 -> 7.
    const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    magnitude = rounded - ((127u - 7u) << 3);
  }
  return static_cast<uint8_t>(sign | magnitude);
}

// e4m3 -> fp32, exact; NaN for 0x7f and 0xff.
KVQ_HOST_DEVICE float F32FromE4m3(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return F32FromBits(sign | 0x7fc00000u);
  if (exponent == 0) {
    // m * 2^-9, exact in fp32.
    return F32FromBits(sign | F32Bits(static_cast<float>(mantissa) * 0.001953125f));
  }
  return F32FromBits(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// True for NaN and +-Inf.
KVQ_HOST_DEVICE bool IsNonFinite(float f) { return (F32Bits(f) & 0x7f800000u) == 0x7f800000u; }

}  // namespace kvq
