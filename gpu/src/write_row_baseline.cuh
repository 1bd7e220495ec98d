// The write kernel's row functions AS THEY WERE before the 2026-11-21 speed-up (per-code IEEE
// division, per-group metadata in every lane, bitwise peeling / radix select). Kept only so that
// kvq_bench_gpu_write can time the old and the new fused kernel in one device run; nothing else
// uses it. Remove together with benchmark_only::UseBaselineFusedWrite when that comparison is no
// longer wanted (docs/performance.md holds its last figures).
#pragma once

#include <cstdint>

#include "kvq/common/numeric.h"

namespace kvq::gpu::detail::baseline {

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
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        const float other = __shfl_xor_sync(kFullMask, v[s], h);
        // Pair (k, k+h): the lane holding k keeps x[k] + x[k+h]; the one holding k+h keeps
        // x[k] - x[k+h] = other - mine.
        v[s] = (lane & h) ? __fsub_rn(other, v[s]) : __fadd_rn(v[s], other);
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

// Above this many elements over the order statistic, a bitwise radix select is cheaper than
// peeling maxima one distinct value at a time.
constexpr int kTopSelectLimit = 12;

// tau = the k-th smallest (0-based) of |v| over the row, an exact order statistic on the bit
// patterns (for non-negative floats, unsigned order = numeric order; |-0| = +0). Then clips
// v in place with the spec's comparisons and returns tau. All lanes return the same tau.
template <int D>
__device__ __forceinline__ float ClipRow(float (&v)[D / 32], int k) {
  constexpr int kPer = D / 32;
  uint32_t mag[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) mag[s] = __float_as_uint(v[s]) & 0x7fffffffu;

  uint32_t threshold;
  const int above = D - 1 - k;  // elements ranked above the order statistic
  if (above == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int s = 0; s < kPer; ++s) m = max(m, mag[s]);
    threshold = __reduce_max_sync(kFullMask, m);
  } else if (above <= kTopSelectLimit) {
    // Peel the largest distinct magnitudes: each round finds the maximum below `bound` and how
    // many elements equal it; the order statistic is reached when that run covers rank k.
    uint32_t bound = 0xffffffffu;
    int remaining = above;
    while (true) {
      uint32_t local = 0;
#pragma unroll
      for (int s = 0; s < kPer; ++s) local = max(local, mag[s] < bound ? mag[s] : 0u);
      const uint32_t m = __reduce_max_sync(kFullMask, local);
      uint32_t equal = 0;
#pragma unroll
      for (int s = 0; s < kPer; ++s) equal += (mag[s] == m) ? 1u : 0u;
      const int count = static_cast<int>(__reduce_add_sync(kFullMask, equal));
      if (count > remaining) {
        threshold = m;
        break;
      }
      remaining -= count;
      bound = m;
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
  uint32_t code[D / 32];      // the lane's codes, slot s = channel lane + 32*s
  uint16_t scale[D / G];      // bf16 bits, the same in every lane
  uint16_t min[D / G];
};

// The asymmetric quantizer of spec/numerics.md §5 on one clipped row.
template <int D, int G, int BITS>
__device__ __forceinline__ void QuantizeRow(const float (&v)[D / 32], QuantizedRow<D, G>& out) {
  static_assert(G >= 32 && G <= D, "group must be in [32, head_dim]");
  constexpr int kSlots = G / 32;
  constexpr int kGroups = D / G;
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    uint32_t key_min = 0xffffffffu;
    uint32_t key_max = 0u;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const uint32_t key = OrderedKey(v[g * kSlots + s]);
      key_min = min(key_min, key);
      key_max = max(key_max, key);
    }
    key_min = __reduce_min_sync(kFullMask, key_min);
    key_max = __reduce_max_sync(kFullMask, key_max);
    const float lo = __fadd_rn(FromOrderedKey(key_min), 0.0f);  // -0 -> +0
    const float hi = __fadd_rn(FromOrderedKey(key_max), 0.0f);
    const float step = __fdiv_rn(__fsub_rn(hi, lo), kLevels);
    const uint16_t scale_bits = Bf16FromF32(step);
    const uint16_t min_bits = Bf16FromF32(lo);
    out.scale[g] = scale_bits;
    out.min[g] = min_bits;
    const float sf = F32FromBf16(scale_bits);
    const float mf = F32FromBf16(min_bits);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      uint32_t q = 0;
      if (sf != 0.0f) {
        // Clamp first, then round: the same q as rounding first (0 and L are integers), and
        // no out-of-range conversion.
        const float t = __fdiv_rn(__fsub_rn(v[g * kSlots + s], mf), sf);
        q = static_cast<uint32_t>(__float2int_rn(fminf(fmaxf(t, 0.0f), kLevels)));
      }
      out.code[g * kSlots + s] = q;
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
#pragma unroll
  for (int g = 0; g < D / G; ++g) {
    if (lane == g) {
      scale[g] = row.scale[g];
      min[g] = row.min[g];
    }
  }
}

}  // namespace kvq::gpu::detail::baseline
