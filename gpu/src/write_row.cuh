// Slice-level building blocks of the write path, shared by the stage kernels and the fused
// kernel so that what the stage tests check is what the fused kernel runs.
//
// Layout. A row of d channels is held by a *slice* of kLanes = d/16 consecutive lanes, 16
// values per lane, so a warp holds 32/kLanes rows at once (8, 4, 2 for d = 64, 128, 256).
// Lane r of a slice (r = lane % kLanes) holds, in "pair-strided" order, the positions
//   RowPosition(k, rho) = (k & 1) + 2 rho + 2 kLanes (k >> 1)   in v[k], k = 0..15,
// where rho is the slice lane's *logical* index: rho = r, except after a bit reversal, which
// is done by relabelling instead of moving data (see LoadRow). In this order
//  - a lane's values come in adjacent pairs: one 32-bit load of two bf16, one 16-bit store of
//    two packed bytes;
//  - every quantization group (G >= 32) is the run of registers [g G/kLanes, ..), held by all
//    lanes of the slice, so group statistics are in-register reductions followed by
//    log2(kLanes) shuffle steps;
//  - every packed byte is built from one lane's own codes (PackCodes).
// Against a warp per row this divides the per-row reductions, group metadata (one IEEE
// division, reciprocal and bf16 rounding per group), addressing and control by 32/kLanes.
//
// Bit-exactness (spec/numerics.md): every arithmetic step is an explicit _rn intrinsic (never
// contracted) or an operation proven to give the same bits (the FWHT's fmaf with a +-1 factor,
// the quantizer's reciprocal estimate with an exact fallback near half-integers: see there), and
// reductions are exact (min, max, order statistics over integer keys), so their order is free.
// Shuffles always use the full warp mask; every function is called by all 32 lanes.
#pragma once

#include <cstdint>

#include "kvq/common/numeric.h"

namespace kvq::gpu::detail {

constexpr unsigned kFullMask = 0xffffffffu;

template <int D>
struct SliceTraits {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static constexpr int kPer = 16;                   // values per lane
  static constexpr int kLanes = D / kPer;           // lanes per row: 4, 8, 16
  static constexpr int kRowsPerWarp = 32 / kLanes;  // 8, 4, 2
  static constexpr int kLog2 = D == 64 ? 6 : (D == 128 ? 7 : 8);
  static constexpr int kLaneBits = kLog2 - 4;       // log2(kLanes)
};

__device__ __forceinline__ int LaneId() { return static_cast<int>(threadIdx.x & 31u); }

// r: this lane's index within its slice; the slice index within the warp is LaneId() / kLanes.
template <int D>
__device__ __forceinline__ int SliceLane() {
  return LaneId() & (SliceTraits<D>::kLanes - 1);
}
template <int D>
__device__ __forceinline__ int SliceIndex() {
  return LaneId() / SliceTraits<D>::kLanes;
}
// The ballot bits of this lane's slice.
template <int D>
__device__ __forceinline__ unsigned SliceBallotMask() {
  constexpr int kLanes = SliceTraits<D>::kLanes;
  return ((1u << kLanes) - 1u) << (LaneId() & ~(kLanes - 1));
}

// Reductions over the lanes of a slice (xor butterflies with offsets below kLanes stay inside
// the slice); the result is the same in every lane of the slice.
template <int D>
__device__ __forceinline__ uint32_t SliceMax(uint32_t v) {
#pragma unroll
  for (int offset = 1; offset < SliceTraits<D>::kLanes; offset <<= 1) {
    v = max(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}
template <int D>
__device__ __forceinline__ int SliceSum(int v) {
#pragma unroll
  for (int offset = 1; offset < SliceTraits<D>::kLanes; offset <<= 1) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// The low `bits` bits of c reversed.
template <int kBits>
__device__ __host__ constexpr int ReverseBits(int c) {
  int out = 0;
  for (int b = 0; b < kBits; ++b) out |= ((c >> b) & 1) << (kBits - 1 - b);
  return out;
}

// ---- Loading a row, rotation by FWHT and bit reversal ------------------------------------------
//
// Without bit reversal a row is loaded in pair-strided order (rho = r) and an FWHT runs in that
// order. With bit reversal the lane loads, in "reversal-source" order, the two runs of 8
// positions w[t + 8 e] = x'[t + 8 r + 8 kLanes e] (t < 8, e < 2) of the rotated row x'; the FWHT
// runs in that order, and since beta (bit reversal over log2(d) bits) sends t + 8 r +
// 8 kLanes e to e + 2 rev(r) + 2 kLanes rev3(t), v[e + 2 rev3(t)] = w[t + 8 e] with
// rho = rev(r) is the bit-reversed row in pair-strided order: a register renaming and a
// relabelled lane, no data movement.

// Position (within the row) of v[k] held by logical slice lane rho.
template <int D>
__device__ __forceinline__ int RowPosition(int k, int rho) {
  return (k & 1) + 2 * rho + 2 * SliceTraits<D>::kLanes * (k >> 1);
}

// Where position bit b of a loaded order lives: a stage with stride 2^b pairs registers k and
// k ^ RegisterMask(b) when that is nonzero, else lanes r and r ^ LaneMask(b).
template <int D, bool kReversalSource>
struct LoadOrder {
  static constexpr int kLaneBits = SliceTraits<D>::kLaneBits;
  static constexpr int RegisterMask(int b) {
    return kReversalSource ? (b < 3 ? 1 << b : (b == 3 + kLaneBits ? 8 : 0))
                           : (b == 0 ? 1 : (b > kLaneBits ? 1 << (b - kLaneBits) : 0));
  }
  static constexpr int LaneMask(int b) {
    return kReversalSource ? ((b >= 3 && b < 3 + kLaneBits) ? 1 << (b - 3) : 0)
                           : ((b >= 1 && b <= kLaneBits) ? 1 << (b - 1) : 0);
  }
};

// Normalised FWHT on each contiguous block of 2^kBlockLog2 channels, stages h = 1, 2, ...,
// block/2 in that order (spec/numerics.md §3.2), then one multiply by `scale` =
// fp32(1/sqrt(block)). Pairs in one lane: a + b, a - b. Pairs across lanes use one shuffle per
// value: the lane holding k keeps x[k] + x[k+h] = other + mine, the one holding k+h keeps
// x[k] - x[k+h] = other + (-mine) (IEEE defines a - b as a + (-b)); sign * mine is exact, so
// fmaf rounds once, the sum: the same bits as __fadd_rn / __fsub_rn in one instruction.
// The block size is a template parameter so that no stage is conditional at run time.
template <int D, bool kReversalSource, int kBlockLog2>
__device__ __forceinline__ void FwhtStages(float (&w)[16], float scale) {
  using Order = LoadOrder<D, kReversalSource>;
  const int r = SliceLane<D>();
#pragma unroll
  for (int b = 0; b < kBlockLog2; ++b) {
    const int register_mask = Order::RegisterMask(b);
    if (register_mask != 0) {
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        if ((k & register_mask) == 0) {
          const float lo = w[k];
          const float hi = w[k | register_mask];
          w[k] = __fadd_rn(lo, hi);
          w[k | register_mask] = __fsub_rn(lo, hi);
        }
      }
    } else {
      const int lane_mask = Order::LaneMask(b);
      const float sign = (r & lane_mask) ? -1.0f : 1.0f;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float other = __shfl_xor_sync(kFullMask, w[k], lane_mask);
        w[k] = fmaf(sign, w[k], other);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) w[k] = __fmul_rn(w[k], scale);
}

// The FWHT for a run-time block size (a power of two in [16, D]; anything else does nothing:
// the launchers refuse it).
template <int D, bool kReversalSource>
__device__ __forceinline__ void Fwht(float (&w)[16], int block, float scale) {
  switch (block) {
    case 16: FwhtStages<D, kReversalSource, 4>(w, scale); break;
    case 32: FwhtStages<D, kReversalSource, 5>(w, scale); break;
    case 64: FwhtStages<D, kReversalSource, 6>(w, scale); break;
    case 128:
      if constexpr (D >= 128) FwhtStages<D, kReversalSource, 7>(w, scale);
      break;
    case 256:
      if constexpr (D >= 256) FwhtStages<D, kReversalSource, 8>(w, scale);
      break;
    default: break;
  }
}

// Input rows: fp32, or bf16 (widened exactly: the bits shifted into the high half).
__device__ __forceinline__ float WidenBf16Low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float WidenBf16High(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// This lane's values of a row (T = float or uint16_t bf16 bits, in shared or global memory;
// 16-byte aligned) in the order that LoadRow's rotation needs: pair-strided, or
// reversal-source when `reversal_source`.
template <int D, typename T>
__device__ __forceinline__ void LoadRowValues(const T* row, bool reversal_source,
                                              float (&w)[16]) {
  constexpr int kLanes = SliceTraits<D>::kLanes;
  const int r = SliceLane<D>();
  if (!reversal_source) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int position = 2 * r + 2 * kLanes * s;
      if constexpr (sizeof(T) == 4) {
        const float2 pair = *reinterpret_cast<const float2*>(row + position);
        w[2 * s] = pair.x;
        w[2 * s + 1] = pair.y;
      } else {
        const uint32_t pair = *reinterpret_cast<const uint32_t*>(row + position);
        w[2 * s] = WidenBf16Low(pair);
        w[2 * s + 1] = WidenBf16High(pair);
      }
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const T* run = row + 8 * r + 8 * kLanes * e;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float4 q = *reinterpret_cast<const float4*>(run + 4 * i);
        w[8 * e + 4 * i] = q.x;
        w[8 * e + 4 * i + 1] = q.y;
        w[8 * e + 4 * i + 2] = q.z;
        w[8 * e + 4 * i + 3] = q.w;
      }
    } else {
      const uint4 q = *reinterpret_cast<const uint4*>(run);
      const uint32_t pairs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[8 * e + 2 * i] = WidenBf16Low(pairs[i]);
        w[8 * e + 2 * i + 1] = WidenBf16High(pairs[i]);
      }
    }
  }
}

// Loads this lane's part of a row of D values (see LoadRowValues), applies the FWHT when
// `fwht_block` > 0 and the bit reversal when `bitrev`, and returns the rotated row in
// pair-strided order in v. Returns rho.
template <int D, typename T>
__device__ __forceinline__ int LoadRow(const T* row, bool bitrev, int fwht_block,
                                       float fwht_scale, float (&v)[16]) {
  if (!bitrev) {
    LoadRowValues<D>(row, false, v);
    if (fwht_block > 0) Fwht<D, false>(v, fwht_block, fwht_scale);
    return SliceLane<D>();
  }
  float w[16];
  LoadRowValues<D>(row, true, w);
  if (fwht_block > 0) Fwht<D, true>(w, fwht_block, fwht_scale);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    v[2 * ReverseBits<3>(t)] = w[t];
    v[2 * ReverseBits<3>(t) + 1] = w[t + 8];
  }
  return static_cast<int>(__brev(static_cast<unsigned>(SliceLane<D>())) >>
                          (32 - SliceTraits<D>::kLaneBits));
}

// ---- Clip (order statistic) -------------------------------------------------------------------

// k = min(floor(rho * d), d - 1) with rho * d computed in double (spec/numerics.md §4).
__device__ __forceinline__ int ClipRank(float rho, int d) {
  const double position = floor(static_cast<double>(rho) * static_cast<double>(d));
  return position < static_cast<double>(d - 1) ? static_cast<int>(position) : d - 1;
}

// Up to this many elements above the order statistic, merging the lanes' sorted magnitudes
// from the top costs fewer instructions than the 31-pass bitwise radix select.
constexpr int kTopSelectLimit = 32;

// Sorts 16 keys descending in registers (bitonic network, 80 compare-exchanges).
__device__ __forceinline__ void SortDescending16(uint32_t (&key)[16]) {
#pragma unroll
  for (int size = 2; size <= 16; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const uint32_t a = key[i];
          const uint32_t b = key[j];
          const bool descending = (i & size) == 0;
          key[i] = descending ? max(a, b) : min(a, b);
          key[j] = descending ? min(a, b) : max(a, b);
        }
      }
    }
  }
}

// Drops the head of a descending key list where `pop` (0 enters at the tail).
__device__ __forceinline__ void PopHead16(uint32_t (&key)[16], bool pop) {
#pragma unroll
  for (int s = 0; s < 15; ++s) key[s] = pop ? key[s + 1] : key[s];
  key[15] = pop ? 0u : key[15];
}

// The bits of tau = the k-th smallest (0-based) of |v| over the slice's row: an exact order
// statistic on bit patterns (unsigned order = numeric order for non-negative floats;
// |-0| = +0). k may differ between the slices of a warp. `max_magnitude_bits`: the row's largest
// |v| (the answer where k = D - 1).
template <int D>
__device__ __forceinline__ uint32_t ClipThresholdBits(const float (&v)[16], int k,
                                                      uint32_t max_magnitude_bits) {
  const int above = D - 1 - k;  // elements ranked above the order statistic
  if (__all_sync(kFullMask, above == 0)) return max_magnitude_bits;
  const unsigned slice_mask = SliceBallotMask<D>();
  if (__all_sync(kFullMask, above <= kTopSelectLimit)) {
    // Merge from the top: each lane sorts its magnitudes descending (keys mag + 1, so that the
    // 0 a lane shifts in when it runs out ranks below every element). A round takes the slice
    // maximum m of the lanes' heads and counts the heads equal to it: those are the next
    // largest elements of the row; lanes holding m pop their head. The round whose count
    // passes the elements still to skip has reached rank k: tau = m.
    uint32_t top[16];
#pragma unroll
    for (int s = 0; s < 16; ++s) top[s] = (__float_as_uint(v[s]) & 0x7fffffffu) + 1u;
    SortDescending16(top);
    int remaining = above;
    // Bulk rounds first: `second` = the slice maximum of the lanes' second keys. Every
    // remaining element other than a head is <= its lane's second <= `second`, so the heads
    // > `second` are exactly the elements > `second`: the `count` largest remaining ones,
    // strictly above all others. While count <= remaining they all rank above k: pop them in
    // one round. A slice leaves this phase at the first round that cannot pop.
    bool bulk = remaining > 0;
    while (__any_sync(kFullMask, bulk)) {
      const uint32_t second = SliceMax<D>(top[1]);
      const bool big = top[0] > second;
      const int count = __popc(__ballot_sync(kFullMask, big) & slice_mask);
      if (bulk) {
        if (count == 0 || count > remaining) {
          bulk = false;
        } else {
          remaining -= count;
          PopHead16(top, big);
          bulk = remaining > 0;
        }
      }
    }
    bool done = false;
    uint32_t threshold = 0;
    while (__any_sync(kFullMask, !done)) {
      const uint32_t m = SliceMax<D>(top[0]);
      const bool hit = top[0] == m;
      const int count = __popc(__ballot_sync(kFullMask, hit) & slice_mask);
      if (!done) {
        if (count > remaining) {
          threshold = m - 1u;
          done = true;
        } else {
          remaining -= count;
          PopHead16(top, hit);
        }
      }
    }
    return threshold;
  }
  // Bitwise radix select from bit 30 (bit 31 of a magnitude is 0): count the elements that
  // match the prefix so far with this bit 0; descend into the half that holds rank k.
  uint32_t prefix = 0;
  int rank = k;
#pragma unroll 1
  for (int bit = 30; bit >= 0; --bit) {
    const uint32_t limit = 1u << bit;
    int zeros = 0;
#pragma unroll
    for (int s = 0; s < 16; ++s) {
      zeros += (((__float_as_uint(v[s]) & 0x7fffffffu) ^ prefix) < limit) ? 1 : 0;
    }
    const int count = SliceSum<D>(zeros);
    if (rank >= count) {
      rank -= count;
      prefix |= limit;
    }
  }
  return prefix;
}

// The bits of max |v| over the slice's row (for rows without NaN), the same in every lane of
// the slice.
template <int D>
__device__ __forceinline__ uint32_t SliceMaxMagnitudeBits(const float (&v)[16]) {
  uint32_t bits = 0;
#pragma unroll
  for (int s = 0; s < 16; ++s) bits = max(bits, __float_as_uint(v[s]) & 0x7fffffffu);
  return SliceMax<D>(bits);
}

// The spec's clip of one value against tau (comparisons, so +-0 are kept).
__device__ __forceinline__ float ClipValue(float x, float tau) {
  return (x > tau) ? tau : ((x < -tau) ? -tau : x);
}

// ---- The norm's tree (spec/numerics.md §5.1) --------------------------------------------------

// The spec's tree over squares[0, padded) in shared memory (padded a power of two, the squares
// past the span already +0): for h = padded/2, ..., 1, squares[j] += squares[j + h] for j < h,
// level by level behind a barrier. Returns S = squares[0] in every thread. Each sum is one
// __fadd_rn of the scalar loop's two operands, so S has the scalar's bits. Called by every
// thread of the block, after a barrier that follows the last write of a square.
__device__ __forceinline__ float BlockTreeSum(float* squares, int padded) {
  for (int h = padded / 2; h >= 1; h /= 2) {
    for (int j = static_cast<int>(threadIdx.x); j < h; j += static_cast<int>(blockDim.x)) {
      squares[j] = __fadd_rn(squares[j], squares[j + h]);
    }
    __syncthreads();
  }
  return squares[0];
}

// The same tree over one row of D values held by a slice (one KV head: M = D), in the
// pair-strided order of logical lane rho: position bits [0] = k & 1, [1, 1 + b) = rho,
// [1 + b, 4 + b) = k >> 1 (b = kLaneBits). The tree folds the top bit first: the register
// bits (k masks 8, 4, 2), the lane bits (rho's top bit first: a shuffle over the physical lane
// bit that holds it, reversed after a bit reversal), then bit 0. Returns S in every lane of
// the slice.
template <int D>
__device__ __forceinline__ float SliceTreeSquareSum(const float (&v)[16], bool bitrev) {
  constexpr int kLaneBits = SliceTraits<D>::kLaneBits;
  float a[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) a[k] = __fmul_rn(v[k], v[k]);
#pragma unroll
  for (int mask = 8; mask >= 2; mask >>= 1) {
#pragma unroll
    for (int k = 0; k < mask; ++k) a[k] = __fadd_rn(a[k], a[k + mask]);
  }
#pragma unroll
  for (int bit = kLaneBits - 1; bit >= 0; --bit) {
    const int offset = bitrev ? 1 << (kLaneBits - 1 - bit) : 1 << bit;
    a[0] = __fadd_rn(a[0], __shfl_xor_sync(kFullMask, a[0], offset));
    a[1] = __fadd_rn(a[1], __shfl_xor_sync(kFullMask, a[1], offset));
  }
  return __fadd_rn(a[0], a[1]);
}

// u = x / n^ with the stored norm's fp32 value (IEEE division), +0 everywhere when n^ = 0.
__device__ __forceinline__ float Normalize(float x, float stored_norm) {
  return stored_norm == 0.0f ? +0.0f : __fdiv_rn(x, stored_norm);
}

// ---- Row statistics ---------------------------------------------------------------------------

// fp32 min / max that return NaN when either input is NaN (PTX min.NaN / max.NaN, sm_80+), so a
// NaN anywhere in a group reaches its reduced extremes. Between -0 and +0 either may come back;
// the quantizer adds +0 to both extremes first (spec/numerics.md §5), which makes that moot.
__device__ __forceinline__ float MinNaN(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float MaxNaN(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Min / max of each quantization group, reduced over the slice (exact: min and max round
// nothing). The row's extremes follow: its range check (|x| > 2^126, Inf, NaN) and its largest
// magnitude.
template <int D, int G>
struct GroupRanges {
  static constexpr int kGroups = D / G;
  float lo[kGroups];
  float hi[kGroups];

  __device__ __forceinline__ float RowMin() const {
    float m = lo[0];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) m = MinNaN(m, lo[g]);
    return m;
  }
  __device__ __forceinline__ float RowMax() const {
    float m = hi[0];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) m = MaxNaN(m, hi[g]);
    return m;
  }
  // |x| > limit, +-Inf or NaN somewhere in the row (NaN fails the comparison).
  __device__ __forceinline__ bool OutOfRange(float limit) const {
    return !(fmaxf(fabsf(RowMin()), fabsf(RowMax())) <= limit);
  }
  // The bits of max |x| over the row (for rows that are in range): the largest magnitude is
  // the row's min or its max.
  __device__ __forceinline__ uint32_t MaxMagnitudeBits() const {
    return max(__float_as_uint(RowMin()) & 0x7fffffffu, __float_as_uint(RowMax()) & 0x7fffffffu);
  }
};

template <int D, int G>
__device__ __forceinline__ GroupRanges<D, G> ComputeGroupRanges(const float (&v)[16]) {
  static_assert(G >= 32 && G <= D, "group must be in [32, head_dim]");
  constexpr int kLanes = SliceTraits<D>::kLanes;
  constexpr int kSlots = G / kLanes;  // slots per group (>= 2)
  GroupRanges<D, G> ranges;
#pragma unroll
  for (int g = 0; g < GroupRanges<D, G>::kGroups; ++g) {
    float lo = v[g * kSlots];
    float hi = lo;
#pragma unroll
    for (int s = 1; s < kSlots; ++s) {
      lo = MinNaN(lo, v[g * kSlots + s]);
      hi = MaxNaN(hi, v[g * kSlots + s]);
    }
#pragma unroll
    for (int offset = 1; offset < kLanes; offset <<= 1) {
      lo = MinNaN(lo, __shfl_xor_sync(kFullMask, lo, offset));
      hi = MaxNaN(hi, __shfl_xor_sync(kFullMask, hi, offset));
    }
    ranges.lo[g] = lo;
    ranges.hi[g] = hi;
  }
  return ranges;
}

// ---- Quantizer --------------------------------------------------------------------------------

// Spec §5 steps 1-3 on one group of `count` values x[0], x[stride], ... (a channel of a tile,
// §5.2): the exact min and max (+0 normalised), s = (hi - lo) / L and the stored bf16 pair.
struct StoredPair {
  uint16_t scale;
  uint16_t min;
};
__device__ __forceinline__ StoredPair StridedGroupPair(const float* x, int count, int64_t stride,
                                                      float levels) {
  float lo = x[0];
  float hi = lo;
  for (int r = 1; r < count; ++r) {
    const float v = x[r * stride];
    lo = (v < lo) ? v : lo;
    hi = (v > hi) ? v : hi;
  }
  lo = __fadd_rn(lo, 0.0f);  // -0 -> +0
  hi = __fadd_rn(hi, 0.0f);
  return {Bf16FromF32(__fdiv_rn(__fsub_rn(hi, lo), levels)), Bf16FromF32(lo)};
}

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
// division's, exactly as spec/numerics.md §5 writes it (QuantizeCodeByDivision).
// gpu_write_numerics_test compares this with __fdiv_rn on every positive bf16 scale against
// quotients at and around every half-integer, and on random pairs.
// The estimate as a code word: bits [0, 8) hold the code, bits [8, 16) are 0 (the word is
// 1.5 * 2^23 + code as an fp32 bit pattern); PackCodes reads only those two bytes. frac_max
// accumulates |c - rint(c)|: the estimate of this code is uncertain when it exceeds
// kHalfMinusMargin (or when inv == 0).
template <int BITS>
__device__ __forceinline__ uint32_t QuantizeCodeWord(float a, float inv, float& frac_max) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const float y = __fmul_rn(a, inv);
  const float c = fminf(fmaxf(y, 0.0f), kLevels);  // (NaN input: 0, as the division path)
  const float t = __fadd_rn(c, kRoundMagic);
  const float frac = __fsub_rn(c, __fsub_rn(t, kRoundMagic));  // exact: c - rint(c)
  frac_max = fmaxf(frac_max, fabsf(frac));
  return __float_as_uint(t);  // t = 1.5 * 2^23 + rint(c), rint(c) in [0, 15]
}

template <int BITS>
__device__ __forceinline__ uint32_t QuantizeCodeEstimate(float a, float inv, bool& uncertain) {
  float frac_max = 0.0f;
  const uint32_t word = QuantizeCodeWord<BITS>(a, inv, frac_max);
  uncertain = inv == 0.0f || frac_max > kHalfMinusMargin;
  return word & 0xffu;
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

// One quantized row, slice-distributed.
template <int D, int G>
struct QuantizedSlice {
  // v[k]'s code in bits [0, 8) of code[k], bits [8, 16) zero (QuantizeCodeWord).
  uint32_t code[16];
  // Lanes r < d/G: (min << 16) | scale of group r, the bf16 bits (spec/numerics.md §5).
  uint32_t meta;
};

// The asymmetric quantizer of spec/numerics.md §5 on one row. `ranges` are the group extremes
// of the row before the clip (finite for every row that is stored); `tau` the clip threshold,
// or negative when the row is not clipped (rho = 1). The values v must already be clipped. The
// clip is monotone (x <= y implies clip(x) <= clip(y)), so a group's clipped min / max are the
// clipped unclipped extremes (and -0 / +0 become +0 either way).
template <int D, int G, int BITS>
__device__ __forceinline__ void QuantizeSlice(const float (&v)[16], const GroupRanges<D, G>& ranges,
                                              float tau, QuantizedSlice<D, G>& out) {
  constexpr int kLanes = SliceTraits<D>::kLanes;
  constexpr int kGroups = D / G;
  constexpr int kSlots = G / kLanes;
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const int r = SliceLane<D>();
  // Slice lane r derives group (r mod kGroups)'s metadata: one IEEE division, two bf16
  // roundings and one reciprocal per lane, then shuffles broadcast it to the slice.
  const int my_group = r & (kGroups - 1);
  float lo = ranges.lo[0];
  float hi = ranges.hi[0];
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    lo = my_group == g ? ranges.lo[g] : lo;
    hi = my_group == g ? ranges.hi[g] : hi;
  }
  if (tau >= 0.0f) {
    lo = ClipValue(lo, tau);
    hi = ClipValue(hi, tau);
  }
  lo = __fadd_rn(lo, 0.0f);  // -0 -> +0
  hi = __fadd_rn(hi, 0.0f);
  const float step = __fdiv_rn(__fsub_rn(hi, lo), kLevels);
  // Both bf16 roundings in one instruction, packed as (min << 16) | scale.
  const uint32_t my_meta = PackBf16Pair(lo, step);
  out.meta = my_meta;
  const float my_inv = QuantizeReciprocal(__uint_as_float(my_meta << 16));
  const int slice_base = LaneId() & ~(kLanes - 1);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const uint32_t meta = __shfl_sync(kFullMask, my_meta, slice_base + g);
    const float inv = __shfl_sync(kFullMask, my_inv, slice_base + g);
    const float sf = __uint_as_float(meta << 16);          // F32FromBf16(scale), exact
    const float mf = __uint_as_float(meta & 0xffff0000u);  // F32FromBf16(min), exact
    // QuantizeCode, with one warp vote per group deciding whether any lane divides; that rare
    // pass recomputes which codes need it.
    float frac_max = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      out.code[g * kSlots + s] =
          QuantizeCodeWord<BITS>(__fsub_rn(v[g * kSlots + s], mf), inv, frac_max);
    }
    // sf == 0 gives inv == 0, so every code of such a group is decided here: 0 (spec §5).
    if (__any_sync(kFullMask, inv == 0.0f || frac_max > kHalfMinusMargin)) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const float a = __fsub_rn(v[g * kSlots + s], mf);
        bool uncertain;
        QuantizeCodeEstimate<BITS>(a, inv, uncertain);
        if (uncertain) {
          out.code[g * kSlots + s] = sf != 0.0f ? QuantizeCodeByDivision<BITS>(a, sf) : 0u;
        }
      }
    }
  }
}

// ---- Packing and stores -------------------------------------------------------------------------

// The row's packed bytes (spec/numerics.md §8) held by this lane, as words: byte b of the lane
// is the row's byte (b & 1) + 2 rho + 2 kLanes (b >> 1), so consecutive byte pairs are stored
// with one 16-bit store.
//  INT2: byte i < d/4 holds positions i + q d/4 (q = 0..3, bits 2q); d/4 = 2 kLanes * 2, so
//        lane byte b (< 4) holds v[b + 4q].
//  INT4: byte i < d/2 holds positions i (low nibble) and i + d/2; d/2 = 2 kLanes * 4, so lane
//        byte b (< 8) holds v[b] and v[b + 8].
template <int BITS>
struct PackedSlice {
  static constexpr int kBytes = BITS == 2 ? 4 : 8;
  uint32_t word[kBytes / 4];
};

// Bytes [code0, code1, code2, code3] of four code words (bits [8, 16) of each are zero).
__device__ __forceinline__ uint32_t GatherCodeBytes(uint32_t c0, uint32_t c1, uint32_t c2,
                                                    uint32_t c3) {
  const uint32_t low = __byte_perm(c0, c1, 0x5540);   // c0.b0, c1.b0, 0, 0
  const uint32_t high = __byte_perm(c2, c3, 0x5540);  // c2.b0, c3.b0, 0, 0
  return __byte_perm(low, high, 0x5410);
}

template <int BITS>
__device__ __forceinline__ PackedSlice<BITS> PackCodes(const uint32_t (&code)[16]) {
  PackedSlice<BITS> p;
  if constexpr (BITS == 2) {
    uint32_t w = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w |= GatherCodeBytes(code[4 * q], code[4 * q + 1], code[4 * q + 2], code[4 * q + 3])
           << (2 * q);
    }
    p.word[0] = w;
  } else {
    static_assert(BITS == 4, "bits must be 2 or 4");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int b = 4 * half;
      p.word[half] =
          GatherCodeBytes(code[b], code[b + 1], code[b + 2], code[b + 3]) |
          (GatherCodeBytes(code[b + 8], code[b + 9], code[b + 10], code[b + 11]) << 4);
    }
  }
  return p;
}

// Stores the lane's packed bytes of a row whose d*b/8 bytes start at dst (2-byte aligned).
template <int D, int BITS>
__device__ __forceinline__ void StorePackedSlice(const PackedSlice<BITS>& p, int rho,
                                                 uint8_t* dst) {
  constexpr int kLanes = SliceTraits<D>::kLanes;
#pragma unroll
  for (int pair = 0; pair < PackedSlice<BITS>::kBytes / 2; ++pair) {
    *reinterpret_cast<uint16_t*>(dst + 2 * rho + 2 * kLanes * pair) =
        static_cast<uint16_t>(p.word[pair / 2] >> (16 * (pair % 2)));
  }
}

// Slice lanes r < d/G store group r's (scale, min).
template <int D, int G>
__device__ __forceinline__ void StoreMetadata(const QuantizedSlice<D, G>& q, uint16_t* scale,
                                              uint16_t* min) {
  const int r = SliceLane<D>();
  if (r < D / G) {
    scale[r] = static_cast<uint16_t>(q.meta & 0xffffu);
    min[r] = static_cast<uint16_t>(q.meta >> 16);
  }
}

}  // namespace kvq::gpu::detail
