// Device helpers of the codebook format (spec/numerics.md §5.4, §7.3, §8.2) shared by the write
// (write_fused.cu) and the decode loop (attention_codebook_rows.cuh): the tables of
// kvq/gpu/codebook.h, a head's segment layout, the encoder's boundary count and the packed
// code positions.
#pragma once

#include <cstdint>

#include "kvq/common/codebook.h"
#include "kvq/gpu/codebook.h"

namespace kvq::gpu::codebook {

// The table of segment size m and width w within a density's table set: 2^w centroids, then
// 2^w - 1 boundaries.
__device__ __forceinline__ const float* TableOf(const float* tables, int m, int w) {
  return tables + (m / 2 - 1) * kDeviceCodebookWordsPerSize + DeviceCodebookOffset(w);
}

// code = #{k : t_k < u} over the 2^w - 1 ascending boundaries t (IEEE comparisons: a tie
// goes to the lower centroid, -0 counts as +0): a binary search for the first t_k >= u.
__device__ __forceinline__ int CountBelow(const float* boundaries, int levels, float u) {
  int lo = 0, hi = levels - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(boundaries + mid) < u) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The layout of KV head `head`'s rows: its widths row (d/2 values at widths + head * d/2), or
// every block at `bits` when the side has no widths.
__device__ __forceinline__ CodebookLayout HeadLayout(int head_dim, const uint8_t* widths,
                                                     int bits, int head) {
  if (widths != nullptr) return CodebookLayoutOf(head_dim, widths + head * (head_dim / 2));
  CodebookLayout layout;
  layout.count = 1;
  layout.segment[0].width = bits;
  layout.segment[0].values = head_dim;
  layout.segment[0].bytes = (head_dim * bits + 7) / 8;
  layout.code_bytes = layout.segment[0].bytes;
  return layout;
}

// Where code j (0 <= j < m) of a segment of m values at width w sits in the segment's bytes
// (numerics.md §8.2): w = 2 split-quarter over q = ceil(m/4) (byte j mod q, bits 2 (j / q)),
// w = 4 split-half over q = m/2 (byte j mod q, bits 4 (j / q)), otherwise the LSB-first bit
// stream (bit j*w: byte j*w/8, bit (j*w) mod 8; a code may span two bytes).
struct CodePosition {
  int byte;
  int shift;
};
__device__ __forceinline__ CodePosition CodePositionOf(int j, int m, int w) {
  if (w == 2) {
    const int q = (m + 3) / 4;
    return {j % q, 2 * (j / q)};
  }
  if (w == 4) {
    const int q = m / 2;
    return {j % q, 4 * (j / q)};
  }
  return {(j * w) >> 3, (j * w) & 7};
}

// The inverse of CodePositionOf: the code j whose first bit is bit `bit` of the segment's bytes
// (bit = 8 * byte + shift of CodePositionOf(j, m, w)).
__host__ __device__ __forceinline__ int ChannelAt(int bit, int w, int m) {
  if (w == 2) return ((bit & 7) >> 1) * ((m + 3) / 4) + (bit >> 3);
  if (w == 4) return ((bit & 7) >> 2) * (m / 2) + (bit >> 3);
  return bit / w;
}

}  // namespace kvq::gpu::codebook
