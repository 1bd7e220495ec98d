// The backend list: every implementation of kvq's kernels fills one Backend, and tests,
// benchmarks and the conformance runner expand the list (Backends(); with the CUDA adapter,
// conformance's AllBackends()).
//
// A Backend holds
//  - WriteKernels: one function pointer per write-path stage, generated from
//    kvq/common/stages.inc (the transforms, then each format's codec stages). All buffers are
//    row-major, n rows of d = p.head_dim channels, and must not alias unless the stage is
//    in place; stages assume validated inputs (WriteParams::Validate(), finite rows). The
//    validating entry points live in write_path.h; the shapes are in stages.inc.
//  - AttentionKernels: the per-run updates the CPU decode driver (attention.h) calls.
//  - attend: a whole decode step over a cache, the slot the conformance runner calls (the CPU
//    entries run cpu::AttendBatch with their own tables; the CUDA entry uploads the cache and
//    runs the GPU step).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/common/format.h"
#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"

namespace kvq::cpu {

class PagedKVCache;

struct WriteKernels {
#define KVQ_STAGE(name, Name, family, backends, params, args) void(*name) params = nullptr;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
};

// Calls stage `id` of `k` with its pointer arguments in args[] (in stages.inc order).
void RunStage(const WriteKernels& k, StageId id, void* const* args, size_t n,
              const WriteParams& p);
// Whether `k` implements stage `id`.
bool HasStage(const WriteKernels& k, StageId id);

// Decode attention over one KV head's rows for the g query heads that read it (GQA), as an
// online-softmax update of a running state: m [g] (max logit so far, -inf when empty), l [g]
// (sum of exp(s - m)), acc [g, d] (sum of exp(s - m) * v). Logits s = scale * (q[h] . k[i]).
// The cache (cache.h) and attention.h drive these per page and per bf16 run; reduction order
// is free (spec/cache.md §5), so implementations need not agree bit for bit.

// n bf16 rows, row i at rows + i * stride (elements; d values each).
struct Bf16RowsView {
  const uint16_t* rows = nullptr;
  size_t stride = 0;
};

// n consecutive history rows of one KV head (one page run), stored in the format of their
// WriteParams: plane[i] points at the run's first row of plane i of LayoutOf(p) (rows of one
// plane are contiguous within a page; see cache.h). For a tile plane that is the row of the tile
// holding the run's first token, which is `tile_offset` tokens into its tile (0 for a run that
// starts a page: pages start on tile boundaries).
// `heads` is the KV head's per-head arrays (head_data.inc) that the format's decode steps read
// (codebook: the block widths; null where the head holds none: DecodeRows fills them).
struct HistoryRunView {
  const uint8_t* plane[kMaxPlanes] = {};
  int tile_offset = 0;
  HeadArrays heads;
};

struct AttentionKernels {
  // q [g, d] fp32 (original space); k, v: n bf16 rows; scratch >= g * n floats.
  void (*bf16_update)(const float* q, size_t g, Bf16RowsView k, Bf16RowsView v, size_t n,
                      int d, float scale, float* scratch, float* m, float* l,
                      float* acc) = nullptr;
  // q_rot [g, d] fp32, already rotated by the key write path (x·R_K, then P_br); k, v: n
  // history rows decoded by the codec of kp.format / vp.format (affine_token:
  // y = q * scale + min; affine_tile: the same with the tile's per-channel (scale, min), times
  // n^ with a norm); acc accumulates in the rotated value space. scratch >= g * n floats.
  void (*history_update)(const float* q_rot, size_t g, HistoryRunView k, HistoryRunView v,
                         size_t n, const WriteParams& kp, const WriteParams& vp, float scale,
                         float* scratch, float* m, float* l, float* acc) = nullptr;
};

enum class Device : int { kCpu, kCuda };

struct Backend {
  std::string name;      // "scalar", "hwy_avx3", ..., "cuda"
  Device device = Device::kCpu;
  int64_t hwy_target = 0;  // Highway target bit, 0 for the scalar reference and CUDA
  WriteKernels write;
  AttentionKernels attention;  // CPU decode-attention kernels (null for CUDA)
  // A whole decode step: out [B, Hq, d] = attention of q [B, Hq, d] over sequences seqs [B]
  // of `cache`. Throws kvq::Error as cpu::AttendBatch does.
  std::function<void(const PagedKVCache& cache, const std::vector<int>& seqs, const float* q,
                     float* out)>
      attend;
};

// Scalar reference first, then every Highway target compiled in and supported by this CPU,
// best first. The list that the CPU tests and benchmarks expand.
const std::vector<Backend>& Backends();

// Every Highway target cpu_ref was compiled for (each registered its write and decode tables
// itself: cpu_ref/src/hwy_targets.h), best first, whether or not this CPU runs it.
std::vector<int64_t> CompiledHwyTargets();
const Backend& ScalarBackend();
// The best Highway target of this CPU: what production callers use (dynamic dispatch).
const Backend& BestBackend();
// Throws kvq::Error(kInvalidArgument) naming `name` and the available backends.
const Backend& BackendByName(const std::string& name);

}  // namespace kvq::cpu
