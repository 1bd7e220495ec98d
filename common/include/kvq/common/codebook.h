// The segment layout of a codebook row (spec/numerics.md §5.4.1, §8.2): a pure function of the
// head's block widths, shared by the CPU oracle, the cache and (later) the CUDA kernels. One
// segment per width present, widths ascending; segment s covers channels [o_s, o_s + m_s) of
// the rotated row and bytes [beta_s, beta_s + B_s) of the row's code plane, and its corrected
// norm sits in slot s.
#pragma once

#include <cstdint>

#include "kvq/common/numeric.h"

namespace kvq {

inline constexpr int kCodebookMaxWidth = 8;     // block widths are 1..8
inline constexpr int kCodebookMaxSegments = 8;  // one segment per width present

struct CodebookSegment {
  int width = 0;        // w_s, 1..8
  int values = 0;       // m_s = 2 * (blocks of width w_s): even, 2..d
  int offset = 0;       // o_s = sum of m over the segments before: first channel
  int byte_offset = 0;  // beta_s = sum of B over the segments before: first code byte
  int bytes = 0;        // B_s = ceil(m_s * w_s / 8)
};

struct CodebookLayout {
  int count = 0;  // segments, 1..8
  CodebookSegment segment[kCodebookMaxSegments] = {};
  int code_bytes = 0;  // sum of B_s: the bytes the segments occupy (the rest of the plane is 0)
};

// The layout of a row of head_dim d whose d/2 RoPE blocks have `widths` (block order, each in
// 1..8; a value outside is not counted, so validate first: head_data.inc's widths row). A
// uniform row (every width b) is one segment: m = d, B = d*b/8.
KVQ_HOST_DEVICE CodebookLayout CodebookLayoutOf(int head_dim, const uint8_t* widths) {
  int blocks[kCodebookMaxWidth + 1] = {};
  for (int i = 0; i < head_dim / 2; ++i) {
    if (widths[i] >= 1 && widths[i] <= kCodebookMaxWidth) ++blocks[widths[i]];
  }
  CodebookLayout layout;
  int offset = 0, byte_offset = 0;
  for (int w = 1; w <= kCodebookMaxWidth; ++w) {
    if (blocks[w] == 0) continue;
    CodebookSegment& s = layout.segment[layout.count++];
    s.width = w;
    s.values = 2 * blocks[w];
    s.offset = offset;
    s.byte_offset = byte_offset;
    s.bytes = (s.values * w + 7) / 8;
    offset += s.values;
    byte_offset += s.bytes;
  }
  layout.code_bytes = byte_offset;
  return layout;
}

}  // namespace kvq
