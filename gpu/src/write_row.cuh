// Warp-level building blocks of the write path, shared by the stage kernels and the fused
// kernel so that what the stage tests check is what the fused kernel runs.
//
// Register layout of one row: a warp holds the d channels, lane l keeping channels
// l + 32*s for s = 0 .. d/32 - 1 (v[s]). Every group of G >= 32 channels is then a run of whole
// slots across all 32 lanes, and the packed bytes of a row are (almost always) built from one
// lane's own codes.
//
// Bit-exactness (spec/numerics.md): every arithmetic step is an explicit _rn intrinsic (never
// contracted) or an operation proven to give the same bits (the FWHT's fmaf with a +-1 factor,
// the quantizer's reciprocal estimate with an exact fallback near half-integers: see there), and
// reductions are exact (min, max, order statistics over integer keys), so their order is free.
#pragma once

#include <cstdint>

#include "kvq/common/numeric.h"

namespace kvq::gpu::detail {

constexpr unsigned kFullMask = 0xffffffffu;

template <int D>
struct RowTraits {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static constexpr int kPerLane = D / 32;  // channels per lane
  static constexpr int kLog2 = D == 64 ? 6 : (D == 128 ? 7 : 8);
};

__device__ __forceinline__ int LaneId() { return static_cast<int>(threadIdx.x & 31u); }

// beta(c): the log2(D) low bits of c reversed.
template <int D>
__device__ __forceinline__ int BitReverse(int c) {
  return static_cast<int>(__brev(static_cast<unsigned>(c)) >> (32 - RowTraits<D>::kLog2));
}

// Normalised FWHT on each contiguous block of `block` channels (a power of two in [16, D]).
// Stages with stride h = 1, 2, ..., block/2 in that order, exactly as the scalar loop: strides
// below 32 pair lanes l and l^h (one shuffle per value; the lane with bit h clear computes
// a + b, its partner a - b), larger strides pair slots of the same lane. Then one multiply by
// `scale` = fp32(1/sqrt(block)).
template <int D>
__device__ __forceinline__ void FwhtRow(float (&v)[D / 32], int block, float scale) {
  constexpr int kPer = D / 32;
  const int lane = LaneId();
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    if (h < block) {
      // Pair (k, k+h): the lane holding k keeps x[k] + x[k+h] = other + mine; the one holding
      // k+h keeps x[k] - x[k+h] = other + (-mine) (IEEE defines a - b as a + (-b)). sign * mine
      // is exact (+-mine, zeros keep their signs), so fmaf rounds exactly once, the sum: the
      // same bits as __fadd_rn / __fsub_rn, in one instruction instead of add, sub and select.
      const float sign = (lane & h) ? -1.0f : 1.0f;
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        const float other = __shfl_xor_sync(kFullMask, v[s], h);
        v[s] = fmaf(sign, v[s], other);
      }
    }
  }
#pragma unroll
  for (int hs = 1; hs < kPer; hs <<= 1) {
    if (hs * 32 < block) {
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        if ((s & hs) == 0) {
          const float a = v[s];
          const float b = v[s + hs];
          v[s] = __fadd_rn(a, b);
          v[s + hs] = __fsub_rn(a, b);
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < kPer; ++s) v[s] = __fmul_rn(v[s], scale);
}

// k = min(floor(rho * d), d - 1) with rho * d computed in double (spec/numerics.md §4).
__device__ __forceinline__ int ClipRank(float rho, int d) {
  const double position = floor(static_cast<double>(rho) * static_cast<double>(d));
  return position < static_cast<double>(d - 1) ? static_cast<int>(position) : d - 1;
}

// Up to this many elements over the order statistic, merging the lanes' sorted magnitudes
// from the top (one warp max + one ballot per round, at most 33 rounds) costs fewer
// instructions than the 31-pass bitwise radix select (estimated ~(8 + d/32) instructions per
// round against ~(5 + 2d/32) per pass; H100, FWHT prefill at d = 128, rho = 0.80, i.e. 25
// elements above: 0.94 ms with the radix select, 0.57 ms with this, other changes included).
constexpr int kTopSelectLimit = 32;

// The largest |v| of the row as fp32 bits (unsigned order = numeric order for non-negative
// floats; NaN and Inf rank above every finite value). The same in every lane.
template <int D>
__device__ __forceinline__ uint32_t MaxMagnitudeBits(const float (&v)[D / 32]) {
  uint32_t m = 0;
#pragma unroll
  for (int s = 0; s < D / 32; ++s) m = max(m, __float_as_uint(v[s]) & 0x7fffffffu);
  return __reduce_max_sync(kFullMask, m);
}

// tau = the k-th smallest (0-based) of |v| over the row, an exact order statistic on the bit
// patterns (for non-negative floats, unsigned order = numeric order; |-0| = +0). Then clips
// v in place with the spec's comparisons and returns tau. All lanes return the same tau.
// max_bits = MaxMagnitudeBits<D>(v) (the caller has it from the range check).
template <int D>
__device__ __forceinline__ float ClipRow(float (&v)[D / 32], int k, uint32_t max_bits) {
  constexpr int kPer = D / 32;
  const int above = D - 1 - k;  // elements ranked above the order statistic
  if (above == 0) {
    // tau = max |v|: no x > tau and no x < -tau (NaN compares false), so the clip keeps every
    // bit and is skipped.
    return __uint_as_float(max_bits);
  }
  uint32_t mag[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) mag[s] = __float_as_uint(v[s]) & 0x7fffffffu;

  uint32_t threshold;
  if (above <= kTopSelectLimit) {
    // Merge from the top: each lane sorts its magnitudes descending (keys mag + 1, so that the
    // 0 a lane shifts in when it runs out ranks below every element), then each round takes
    // the warp maximum m of the lanes' heads and counts the heads equal to it (ballot); those
    // are the next largest elements of the row. Lanes holding m pop their head. The round whose
    // count passes the elements still to skip has reached rank k: tau = m.
    uint32_t top[kPer];
#pragma unroll
    for (int s = 0; s < kPer; ++s) top[s] = mag[s] + 1u;
#pragma unroll
    for (int i = 0; i < kPer - 1; ++i) {
#pragma unroll
      for (int j = 0; j < kPer - 1 - i; ++j) {
        const uint32_t a = top[j];
        const uint32_t b = top[j + 1];
        top[j] = max(a, b);
        top[j + 1] = min(a, b);
      }
    }
    int remaining = above;
    // Bulk rounds first: let `second` be the warp maximum of the lanes' second-largest keys.
    // Every remaining element other than a head is <= its lane's second <= `second`, so the
    // heads > `second` are exactly the elements > `second`: the `count` largest remaining ones,
    // strictly above all others (no ties to break). While count <= remaining they all rank
    // above k: pop them in one round (often several elements, where the loop below pops one
    // value). Empty slots hold key 0 and never count. kPer >= 2 (d >= 64). Not at d = 256:
    // there the extra live values cost the 64-register kernels a spill (ptxas -v).
    while (kPer <= 4 && remaining > 0) {
      const uint32_t second = __reduce_max_sync(kFullMask, top[1]);
      const bool big = top[0] > second;
      const int count = __popc(__ballot_sync(kFullMask, big));
      if (count == 0 || count > remaining) break;
      remaining -= count;
#pragma unroll
      for (int s = 0; s < kPer - 1; ++s) top[s] = big ? top[s + 1] : top[s];
      top[kPer - 1] = big ? 0u : top[kPer - 1];
    }
    while (true) {
      const uint32_t m = __reduce_max_sync(kFullMask, top[0]);
      const bool hit = top[0] == m;
      const int count = __popc(__ballot_sync(kFullMask, hit));
      if (count > remaining) {
        threshold = m - 1u;
        break;
      }
      remaining -= count;
#pragma unroll
      for (int s = 0; s < kPer - 1; ++s) top[s] = hit ? top[s + 1] : top[s];
      top[kPer - 1] = hit ? 0u : top[kPer - 1];
    }
  } else {
    // Bitwise radix select from bit 30 (bit 31 of a magnitude is 0): count the candidates that
    // match the prefix so far with this bit 0; descend into the half that holds rank k.
    uint32_t prefix = 0;
    int rank = k;
#pragma unroll 1
    for (int bit = 30; bit >= 0; --bit) {
      const uint32_t limit = 1u << bit;
      uint32_t zeros = 0;
#pragma unroll
      for (int s = 0; s < kPer; ++s) zeros += ((mag[s] ^ prefix) < limit) ? 1u : 0u;
      const int count = static_cast<int>(__reduce_add_sync(kFullMask, zeros));
      if (rank >= count) {
        rank -= count;
        prefix |= limit;
      }
    }
    threshold = prefix;
  }
  const float tau = __uint_as_float(threshold);
#pragma unroll
  for (int s = 0; s < kPer; ++s) v[s] = (v[s] > tau) ? tau : ((v[s] < -tau) ? -tau : v[s]);
  return tau;
}

template <int D>
__device__ __forceinline__ float ClipRow(float (&v)[D / 32], int k) {
  return ClipRow<D>(v, k, MaxMagnitudeBits<D>(v));
}

// A total order on fp32 bit patterns as unsigned integers (-0 sorts just below +0), so warp
// min/max run on the integer reduction unit and are exact.
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}
__device__ __forceinline__ float FromOrderedKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : ~key);
}

template <int D, int G>
struct QuantizedRow {
  uint32_t code[D / 32];  // the lane's codes, slot s = channel lane + 32*s
  uint16_t scale;         // lanes g < D/G: bf16 bits of group g's scale
  uint16_t min;           // lanes g < D/G: bf16 bits of group g's min
};

// rint half-to-even by addition: for 0 <= c <= 2^22, c + 1.5*2^23 lies in [2^23, 2^24) where
// the fp32 spacing is 1, so the RN sum is 1.5*2^23 + rint(c) and its low mantissa bits are
// rint(c) (1.5*2^23 is even, so ties go to the even integer exactly as rint does).
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23, bit pattern 0x4B400000
// The reciprocal estimate is trusted when it lies at least 2^-12 from every half-integer.
constexpr float kHalfMinusMargin = 0.5f - 0x1p-12f;

// The spec's code clamp(rint(fl(a / sf)), 0, L) for a = fl(x - mf) and sf > 0, with the IEEE
// division (the slow path: MUFU reciprocal, refinement, check and branch) replaced by one
// multiply when that cannot change the result. `inv` is fp32(1/sf) correctly rounded
// (__frcp_rn), and sf is in [2^-125, 2^125], so inv is normal and finite; `inv` == 0 means
// "no estimate" (sf outside that range): always divide.
//
// Why the fast answer is exact. Let Q = a / sf (real), y = fl(a * inv). inv = (1/sf)(1 + e1),
// y = a * inv * (1 + e2) with |e1|, |e2| <= 2^-24, so |y - Q| <= |Q| * 2^-22.9 (+ 2^-150 if y
// underflows, irrelevant here). Let c = clamp(y, 0, L).
//  - y > L: Q > L - 0.5, so fl(Q) > L - 0.5 (rounding is monotone and L - 0.5 is an fp32
//    value), rint(fl(Q)) >= L, the code is L = rint(c).
//  - y < 0: Q < 0.5 likewise, the code is 0 = rint(c).
//  - 0 <= y <= L (<= 15): |y - Q| < 2^-18.9 and |fl(Q) - Q| <= 2^-20 (half an ulp below 16),
//    so |fl(Q) - y| < 2^-18. If y is at least 2^-12 from every half-integer, fl(Q) lies strictly
//    inside the same interval (n - 1/2, n + 1/2) as y, n = rint(y): rint(fl(Q)) = n (a
//    rounding of fl(Q) onto a half-integer from below, the double-rounding trap, needs
//    |Q - h| <= 2^-20 and so |y - h| < 2^-18: that case takes the division). Clamping n to
//    [0, L] matches clamping fl(Q) first: the half-integers -1/2 and L + 1/2 need no margin
//    because both of their neighbours clamp to the same code.
// Otherwise (|frac(c)| > 1/2 - 2^-12, about 1 code in 2000 on random data) the code is the
// division's, exactly as spec/numerics.md §5 writes it (QuantizeCodeByDivision). gpu_write_numerics_test compares this
// with __fdiv_rn on every positive bf16 scale against quotients at and around every
// half-integer, and on random pairs.
template <int BITS>
__device__ __forceinline__ uint32_t QuantizeCodeEstimate(float a, float inv, bool& uncertain) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const float y = __fmul_rn(a, inv);
  const float c = fminf(fmaxf(y, 0.0f), kLevels);  // (NaN input: 0, as the division path)
  const float t = __fadd_rn(c, kRoundMagic);
  const float frac = __fsub_rn(c, __fsub_rn(t, kRoundMagic));  // exact: c - rint(c)
  uncertain = inv == 0.0f || fabsf(frac) > kHalfMinusMargin;
  return __float_as_uint(t) & 0xffu;  // t = 1.5 * 2^23 + rint(c), rint(c) in [0, 15]
}

// The spec's formula itself. Clamp first, then round: the same q as rounding first (0 and L
// are integers), and no out-of-range conversion.
template <int BITS>
__device__ __forceinline__ uint32_t QuantizeCodeByDivision(float a, float sf) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  return static_cast<uint32_t>(__float2int_rn(fminf(fmaxf(__fdiv_rn(a, sf), 0.0f), kLevels)));
}

template <int BITS>
__device__ __forceinline__ uint32_t QuantizeCode(float a, float sf, float inv) {
  bool uncertain;
  const uint32_t code = QuantizeCodeEstimate<BITS>(a, inv, uncertain);
  return uncertain ? QuantizeCodeByDivision<BITS>(a, sf) : code;
}

// fp32(1/sf) where QuantizeCode may use it (sf in [2^-125, 2^125]), else 0.
__device__ __forceinline__ float QuantizeReciprocal(float sf) {
  return (sf >= 0x1p-125f && sf <= 0x1p125f) ? __frcp_rn(sf) : 0.0f;
}

// (Bf16FromF32(high) << 16) | Bf16FromF32(low). cvt.rn.bf16x2.f32 rounds both to nearest even
// in one instruction (no .ftz: subnormals round like any value, overflow gives Inf), the same
// bits as Bf16FromF32 for every non-NaN input. NaN (only from rows that raise
// kErrorFlagNonFinite) takes Bf16FromF32 itself, whose NaN payload differs from the hardware's
// canonical NaN.
__device__ __forceinline__ uint32_t PackBf16Pair(float high, float low) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  if (isnan(high) || isnan(low)) {
    packed = (static_cast<uint32_t>(Bf16FromF32(high)) << 16) | Bf16FromF32(low);
  }
  return packed;
}

// The asymmetric quantizer of spec/numerics.md §5 on one clipped row.
template <int D, int G, int BITS>
__device__ __forceinline__ void QuantizeRow(const float (&v)[D / 32], QuantizedRow<D, G>& out) {
  static_assert(G >= 32 && G <= D, "group must be in [32, head_dim]");
  constexpr int kSlots = G / 32;
  constexpr int kGroups = D / G;
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const int lane = LaneId();
  // Exact group min / max as ordered integer keys, reduced over the warp.
  uint32_t key_min[kGroups];
  uint32_t key_max[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    uint32_t lo_key = 0xffffffffu;
    uint32_t hi_key = 0u;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const uint32_t key = OrderedKey(v[g * kSlots + s]);
      lo_key = min(lo_key, key);
      hi_key = max(hi_key, key);
    }
    key_min[g] = __reduce_min_sync(kFullMask, lo_key);
    key_max[g] = __reduce_max_sync(kFullMask, hi_key);
  }
  // Lane g < kGroups derives group g's metadata: one IEEE division, two bf16 roundings and one
  // reciprocal per lane instead of one per group in every lane.
  uint32_t my_min = key_min[0];
  uint32_t my_max = key_max[0];
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    my_min = lane == g ? key_min[g] : my_min;
    my_max = lane == g ? key_max[g] : my_max;
  }
  const float lo = __fadd_rn(FromOrderedKey(my_min), 0.0f);  // -0 -> +0
  const float hi = __fadd_rn(FromOrderedKey(my_max), 0.0f);
  const float step = __fdiv_rn(__fsub_rn(hi, lo), kLevels);
  // Both bf16 roundings in one instruction, packed as (min << 16) | scale; one shuffle then
  // broadcasts both to the group's lanes.
  const uint32_t my_meta = PackBf16Pair(lo, step);
  out.scale = static_cast<uint16_t>(my_meta & 0xffffu);
  out.min = static_cast<uint16_t>(my_meta >> 16);
  const float my_inv = QuantizeReciprocal(__uint_as_float(my_meta << 16));
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const uint32_t meta = kGroups == 1 ? my_meta : __shfl_sync(kFullMask, my_meta, g);
    const float sf = __uint_as_float(meta << 16);          // F32FromBf16(scale), exact
    const float mf = __uint_as_float(meta & 0xffff0000u);  // F32FromBf16(min), exact
    const float inv = kGroups == 1 ? my_inv : __shfl_sync(kFullMask, my_inv, g);
    // QuantizeCode, with one warp vote per group deciding whether any lane divides.
    float a[kSlots];
    bool uncertain[kSlots];
    bool any_uncertain = false;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      a[s] = __fsub_rn(v[g * kSlots + s], mf);
      out.code[g * kSlots + s] = QuantizeCodeEstimate<BITS>(a[s], inv, uncertain[s]);
      any_uncertain |= uncertain[s];
    }
    // sf == 0 gives inv == 0, so every code of such a group is decided here: 0 (spec §5).
    if (__any_sync(kFullMask, any_uncertain)) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (uncertain[s]) {
          out.code[g * kSlots + s] = sf != 0.0f ? QuantizeCodeByDivision<BITS>(a[s], sf) : 0u;
        }
      }
    }
  }
}

// Packs the row's codes (spec/numerics.md §8) and stores its d*b/8 bytes at dst.
// INT2, byte i < d/4 holds channels i + q*d/4 (q = 0..3); INT4, byte i < d/2 holds i and d/2+i.
// Lane l writes bytes l + 32*t; for d >= 128 (INT2) or any d (INT4) the four (two) channels of
// those bytes are slots of lane l itself; INT2 at d = 64 takes two codes from lane l + 16.
template <int D, int BITS>
__device__ __forceinline__ void StorePackedRow(const uint32_t (&code)[D / 32], uint8_t* dst) {
  const int lane = LaneId();
  if constexpr (BITS == 2) {
    if constexpr (D == 64) {
      // byte i < 16: channels i (lane i, slot 0), 16+i (lane i+16, slot 0), 32+i (lane i,
      // slot 1), 48+i (lane i+16, slot 1).
      const uint32_t up0 = __shfl_down_sync(kFullMask, code[0], 16);
      const uint32_t up1 = __shfl_down_sync(kFullMask, code[1], 16);
      if (lane < 16) {
        dst[lane] = static_cast<uint8_t>(code[0] | (up0 << 2) | (code[1] << 4) | (up1 << 6));
      }
    } else {
      constexpr int kBytesPerLane = D / 128;  // byte l + 32t: slots t + q*kBytesPerLane
#pragma unroll
      for (int t = 0; t < kBytesPerLane; ++t) {
        uint32_t byte = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) byte |= code[t + q * kBytesPerLane] << (2 * q);
        dst[lane + 32 * t] = static_cast<uint8_t>(byte);
      }
    }
  } else {
    static_assert(BITS == 4, "bits must be 2 or 4");
    constexpr int kBytesPerLane = D / 64;  // byte l + 32t: slot t (low), t + kBytesPerLane
#pragma unroll
    for (int t = 0; t < kBytesPerLane; ++t) {
      dst[lane + 32 * t] = static_cast<uint8_t>(code[t] | (code[t + kBytesPerLane] << 4));
    }
  }
}

// Lane g < d/G stores group g's (scale, min).
template <int D, int G>
__device__ __forceinline__ void StoreMetadata(const QuantizedRow<D, G>& row, uint16_t* scale,
                                              uint16_t* min) {
  const int lane = LaneId();
  if (lane < D / G) {
    scale[lane] = row.scale;
    min[lane] = row.min;
  }
}

}  // namespace kvq::gpu::detail
