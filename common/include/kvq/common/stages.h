// The write-path stages as data (stages.inc): their ids, names, families and arguments with
// dtypes and shapes. Generic code (the conformance replay, the stage tests and benchmarks, the
// CUDA host wrappers) allocates, fills, calls and compares a stage through its spec instead of
// naming it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/common/tensor.h"

namespace kvq {

enum class StageId : int {
#define KVQ_STAGE(name, Name, family, backends, params, args) k##Name,
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
};

// Which backends implement a stage (stages.inc's backends column).
enum class StageBackends : int { kEveryBackend, kCpuOnly };

// KVQ_IF_CUDA_STAGE(backends, x): x for a stage the CUDA path implements, nothing for a
// kCpuOnly one (the CUDA tables and dispatch expand their rows through it, so a stage without
// a kernel neither links against one nor fills an entry).
#define KVQ_IF_CUDA_STAGE(backends, ...) KVQ_IF_CUDA_STAGE_##backends(__VA_ARGS__)
#define KVQ_IF_CUDA_STAGE_kEveryBackend(...) __VA_ARGS__
#define KVQ_IF_CUDA_STAGE_kCpuOnly(...)

enum class ArgDir : int { kIn, kOut, kInOut };
enum class Extent : int {
  kRows, kRowScalars, kMatrix, kPacked, kGroups, kNormRows, kTileChannels, kTilePacked,
  kSegments,     // [n, segments]: a codebook row's norm slots (spec 1.3)
  kCodeBytes,    // [n, row_code_bytes()]: a codebook row's code plane
  kBlockWidths,  // [d/2]: the head's block widths (a per-head array, head_data.inc)
};

// The values an argument may hold: what the generic stage tester and fuzzers draw inputs
// from. A KVQ_ARG_DOMAIN row of stages.inc sets it; without one an argument of integer codes
// (U8 rows) is kCodes (kSegmentCodes in a codebook stage), block widths (kBlockWidths) are
// kWidths, a bf16 argument called "scale" kNonNegative, anything else kAny.
enum class Domain : int {
  kAny,          // any value of the dtype (finite rows within the write path's range)
  kCodes,        // integer codes in [0, 2^b - 1]
  kNonNegative,  // >= 0 (stored scales)
  kFp8,          // e4m3 bytes other than the NaN codes 0x7f and 0xff
  kWidths,       // codebook block widths in 1..8 (every layout they give fits segments = 8
                 //   and code_bytes = d: the stage tester's parameters)
  kSegmentCodes,  // codebook codes: value j of a segment of width w in [0, 2^w - 1] (the
                  //   widths are the stage's `widths` argument)
};

struct StageArg {
  const char* name;    // the parameter; golden-vector input "in.<name>"
  const char* expect;  // golden-vector output "expect.<expect>" (kOut, kInOut)
  DType dtype;
  ArgDir dir;
  Extent extent;
  Domain domain = Domain::kAny;

  bool is_input() const { return dir != ArgDir::kOut; }
  bool is_output() const { return dir != ArgDir::kIn; }
};

inline constexpr int kMaxStageArgs = 6;

struct StageSpec {
  StageId id;
  const char* name;      // "rotate_dense", "quantize", ...
  const char* family;    // "transform" or a format id
  bool transform;        // a transform (every format) or a codec stage of `format`
  Format format;         // codec stages only
  StageBackends backends;  // kCpuOnly: no CUDA kernel (the CUDA backend answers kUnsupported)
  int num_args;
  StageArg args[kMaxStageArgs];
};

// Every stage in list order.
const std::vector<StageSpec>& AllStages();
const StageSpec& GetStage(StageId id);
// Null when no stage has that name.
const StageSpec* FindStage(const std::string& name);
// Throws kvq::Error(kInvalidArgument) naming `name` and listing the stages.
const StageSpec& StageByName(const std::string& name);
// Whether the stage may be called under p: transforms always, codec stages of p.format.
bool StageApplies(const StageSpec& stage, const WriteParams& p);
// Whether the write path of p runs the stage: it applies and its KVQ_STAGE_WHEN condition, if
// it has one, holds (what a backend must implement to run p's write path).
bool StageRuns(const StageSpec& stage, const WriteParams& p);
// The row counts a call takes are multiples of this: p.tile_tokens() for a stage with a tile
// argument (kTileChannels, kTilePacked), else 1.
size_t StageRowMultiple(const StageSpec& stage, const WriteParams& p);

// The codec of a format as stage lists (formats.inc's KVQ_CODEC_STEP rows, in order): what
// the write path runs on the clipped rows (kEncode) and the history reader on the stored
// planes (kDecode). Empty for a format without a codec (bf16).
enum class CodecPass : int { kEncode, kDecode };
const std::vector<StageId>& CodecSteps(Format format, CodecPass pass);

// The shape of argument `arg` for n rows under p, and its element count.
std::vector<int64_t> ArgShape(Extent extent, int64_t n, const WriteParams& p);
size_t ArgElements(Extent extent, int64_t n, const WriteParams& p);
// "row, column", "tile, channel, byte", ...: what the axes of an argument's shape mean.
const char* ExtentAxes(Extent extent);

// Calls a stage function `fn` with its pointer parameters taken from args[0..] in order
// (args[i] points at the i-th pointer parameter's element type), followed by `trailing`
// (n, p, and whatever else the implementation takes, e.g. a CUDA stream): the one place where
// a buffer list meets a signature.
namespace detail {
template <typename... Params, size_t... I, typename... Trailing>
void InvokeStage(void (*fn)(Params...), void* const* args, std::index_sequence<I...>,
                 Trailing&&... trailing) {
  using Tuple = std::tuple<Params...>;
  fn(static_cast<std::tuple_element_t<I, Tuple>>(args[I])..., std::forward<Trailing>(trailing)...);
}
}  // namespace detail

template <typename... Params, typename... Trailing>
void InvokeStage(void (*fn)(Params...), void* const* args, Trailing&&... trailing) {
  static_assert(sizeof...(Params) >= sizeof...(Trailing), "more trailing values than parameters");
  detail::InvokeStage(fn, args, std::make_index_sequence<sizeof...(Params) - sizeof...(Trailing)>(),
                      std::forward<Trailing>(trailing)...);
}

}  // namespace kvq
