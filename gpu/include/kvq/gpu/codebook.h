// The codebook tables (kvq::tables::Codebook, spec/numerics.md §5.4) in device memory, for the
// codebook write and decode kernels. One table set per density, laid out as
//   word (m/2 - 1) * kDeviceCodebookWordsPerSize + DeviceCodebookOffset(w) + i
// for segment size m (2, 4, ..., 256) and width w (1..8): the 2^w centroids ascending
// (i < 2^w), then the 2^w - 1 boundaries ascending (i = 2^w + k) — Codebook(m, w, density)'s
// arrays, copied bit for bit.
#pragma once

#include <cstddef>

#include "kvq/common/lloyd_max.h"
#include "kvq/common/numeric.h"

namespace kvq::gpu {

// Where width w's codebook starts within one segment size: the widths below it hold
// 2^w' + 2^w' - 1 words each.
constexpr int DeviceCodebookOffset(int w) { return (2 << w) - w - 3; }
inline constexpr int kDeviceCodebookWordsPerSize = (2 << 9) - 9 - 3;  // widths 1..8: 1012

// The table set of `density` on the current device, uploaded at its first use there (device
// memory of the library's own, never freed). The first use may come inside a stream capture (a
// graph-captured write or decode): the upload runs outside the graph, on a stream of its own.
// Throws kvq::Error on a CUDA failure.
const float* DeviceCodebookTables(CodebookDensity density);

}  // namespace kvq::gpu
