// What the CUDA write path refuses, and how: launchers return cudaErrorInvalidValue for
// configurations they have no kernel for (never a silent no-op), the runtime API throws
// kvq::Error naming the value. These checks happen before any CUDA call, so they run on
// machines without a GPU too (CI); the device-only ones skip there.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/write.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/params.h"

namespace kvq::gpu {
namespace {

using testbed::Cache;
using testbed::ExpectError;
using testbed::Write;

// A FusedWriteArgs that would be valid apart from what a test changes (pointers are never
// dereferenced: the launcher refuses before launching).
FusedWriteArgs PlausibleArgs() {
  alignas(16) static uint16_t x[8];
  static uint8_t codes[1];
  static uint16_t meta[1];
  FusedWriteArgs a;
  a.x = x;
  a.num_tokens = 1;
  a.token_stride = 128;
  a.planes[kAffineCodesPlane] = codes;
  a.planes[kAffineScalePlane] = reinterpret_cast<uint8_t*>(meta);
  a.planes[kAffineMinPlane] = reinterpret_cast<uint8_t*>(meta);
  return a;
}

TEST(LauncherRefuses, UnsupportedHeadDimGroupOrBits) {
  const FusedWriteArgs a = PlausibleArgs();
  EXPECT_EQ(DispatchFusedWrite(96, 32, 2, a, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DispatchFusedWrite(512, 64, 2, a, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DispatchFusedWrite(128, 16, 2, a, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DispatchFusedWrite(64, 128, 2, a, nullptr), cudaErrorInvalidValue);  // G > d
  EXPECT_EQ(DispatchFusedWrite(128, 64, 3, a, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DispatchFusedWrite(128, 64, 8, a, nullptr), cudaErrorInvalidValue);
}

TEST(LauncherRefuses, UnsupportedPageSizeRotationOrBlock) {
  FusedWriteArgs a = PlausibleArgs();
  a.mode = WriteMode::kPrefill;
  a.page_size_log2 = 3;  // P = 8
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.page_size_log2 = 11;  // P = 2048
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a = PlausibleArgs();
  a.rotation.kind = 7;
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.rotation.kind = static_cast<int>(RotationKind::kDense);  // no matrices
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.rotation.kind = static_cast<int>(RotationKind::kHadamard);
  a.rotation.fwht_block = 8;
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.rotation.fwht_block = 256;  // larger than d
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a = PlausibleArgs();
  a.x = static_cast<const uint8_t*>(a.x) + 2;  // not 16-byte aligned
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
}

TEST(LauncherRefuses, UnsupportedStageConfigurations) {
  StageArgs a;
  a.rows = 1;
  a.params = Write().head_dim(96).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kBitrev, a, nullptr), cudaErrorInvalidValue);
  a.params = Write().head_dim(128).group(256).bits(2).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kQuantize, a, nullptr), cudaErrorInvalidValue);
  a.params = Write().head_dim(128).group(64).bits(3).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kPack, a, nullptr), cudaErrorInvalidValue);
  a.params = Write().head_dim(128).group(64).bits(2).Unchecked();
  a.fwht_block = 12;
  EXPECT_EQ(DispatchStage(StageId::kFwht, a, nullptr), cudaErrorInvalidValue);
  a.params = Write().head_dim(128).group(64).bits(2).clip(0.0f).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kClip, a, nullptr), cudaErrorInvalidValue);
}

// Every stage the list (kvq/common/stages.inc) marks kEveryBackend has a launcher: with no
// rows, each accepts a valid configuration and launches nothing; a kCpuOnly stage dispatches to
// cudaErrorInvalidValue and its runtime function answers kUnsupported naming it (needs no
// device: the check precedes any CUDA call).
TEST(LauncherRefuses, NoStageOfTheListIsMissing) {
  for (const StageSpec& stage : AllStages()) {
    StageArgs a;
    a.rows = 0;
    a.fwht_block = 128;
    if (stage.backends == StageBackends::kEveryBackend) {
      EXPECT_EQ(DispatchStage(stage.id, a, nullptr), cudaSuccess) << stage.name;
    } else {
      EXPECT_EQ(DispatchStage(stage.id, a, nullptr), cudaErrorInvalidValue) << stage.name;
      ExpectError([&] { RunStage(stage.id, nullptr, 0, WriteParams(), nullptr); },
                  ErrorCode::kUnsupported, {std::string(stage.name)});
    }
  }
}

// The backends column reaches the CUDA side through KVQ_IF_CUDA_STAGE: a kEveryBackend row
// expands, a kCpuOnly row vanishes (commas and all).
TEST(LauncherRefuses, CpuOnlyRowsExpandToNothingOnTheCudaSide) {
  int entries = 0;
  KVQ_IF_CUDA_STAGE(kEveryBackend, entries += std::max(1, 0);)
  KVQ_IF_CUDA_STAGE(kCpuOnly, entries += std::max(10, 0);)
  EXPECT_EQ(entries, 1);
}

// The tile codec refuses a row count that is not a whole number of tiles, a tile outside
// {32, 64, 128} and widths other than 2 and 4; the norm refuses a span above 32768 values.
TEST(LauncherRefuses, UnsupportedTileAndNormConfigurations) {
  StageArgs a;
  a.rows = 48;  // not a multiple of the tile of 32
  a.params = Write().head_dim(64).tile(32).bits(2).Unchecked();
  for (StageId id : {StageId::kQuantizeTile, StageId::kPackTile, StageId::kUnpackTile,
                     StageId::kDequantizeTile}) {
    EXPECT_EQ(DispatchStage(id, a, nullptr), cudaErrorInvalidValue) << GetStage(id).name;
  }
  a.rows = 32;
  a.params = Write().head_dim(64).tile(32).bits(3).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kPackTile, a, nullptr), cudaErrorInvalidValue);
  a.params = Write().head_dim(64).tile(32).bits(2).Unchecked();
  a.params.group = 16;
  EXPECT_EQ(DispatchStage(StageId::kQuantizeTile, a, nullptr), cudaErrorInvalidValue);
  a.rows = 1;
  a.params = Write().head_dim(256).tile(32).bits(2).norm().norm_heads(256).Unchecked();
  EXPECT_EQ(DispatchStage(StageId::kNorm, a, nullptr), cudaErrorInvalidValue);
}

TEST(LauncherRefuses, InconsistentPrefillWindows) {
  // No launch happens on any of these, so fake 16-byte aligned pointers do.
  auto* row = reinterpret_cast<uint16_t*>(uintptr_t{4096});
  PrefillWindowsArgs ok;
  ok.key = ok.value = row;
  ok.sink_key = ok.sink_value = ok.recent_key = ok.recent_value = row;
  ok.row_elems = 1024;
  ok.sink_tokens = 4;
  ok.recent_begin = 10;
  ok.tokens = 12;
  ok.recent = 8;
  PrefillWindowsArgs a = ok;
  a.tokens = 19;  // 9 recent rows for a ring of 8
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaErrorInvalidValue);
  a = ok;
  a.recent_begin = 3;  // recent rows overlapping the sink
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaErrorInvalidValue);
  a = ok;
  a.row_elems = 1020;  // not whole 16-byte vectors
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaErrorInvalidValue);
  a = ok;
  a.recent_key = row + 1;  // not 16-byte aligned
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaErrorInvalidValue);
  a = ok;
  a.sink_value = nullptr;  // sink rows without a sink
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaErrorInvalidValue);
  a = ok;
  a.sink_tokens = 0;
  a.recent_begin = a.tokens = 0;  // nothing to copy: no launch, no error
  EXPECT_EQ(LaunchPrefillWindows(a, nullptr), cudaSuccess);
}

// The message must name the offending value.
TEST(RuntimeApiRejects, InvalidWriteParams) {
  constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;
  RowOutputs out;
  const WriteParams d96 = Write().head_dim(96).Unchecked();
  ExpectError([&] { WriteRows(d96, nullptr, static_cast<const float*>(nullptr), 4, out); },
              kInvalid, {"96"});
  const WriteParams bits3 = Write().head_dim(128).bits(3).Unchecked();
  ExpectError([&] { Quantize(nullptr, nullptr, nullptr, nullptr, 4, bits3); }, kInvalid, {"3"});
  const WriteParams p = Write().head_dim(128).bits(2);
  ExpectError([&] { Bitrev(nullptr, nullptr, 4, p); }, kInvalid, {"x is null"});
  alignas(16) static float x[128];
  ExpectError([&] { Bitrev(x, x, 1, p); }, kInvalid, {"x and y alias"});
  static uint8_t packed[32];
  static uint16_t meta[2];
  ExpectError([&] { WriteRows(p, nullptr, x, 1, out); }, kInvalid, {"plane 'codes' is null"});
  const WriteParams dense = Write(p).rotation(RotationKind::kDense);
  out.planes[kAffineCodesPlane] = packed;
  out.planes[kAffineScalePlane] = reinterpret_cast<uint8_t*>(meta);
  out.planes[kAffineMinPlane] = reinterpret_cast<uint8_t*>(meta + 1);
  ExpectError([&] { WriteRows(dense, nullptr, x, 1, out); }, kInvalid,
              {"rotation matrices are null"});
}

// What the kernels do not serve is refused as kUnsupported, naming the value: a codec stage of
// another format, a fused write or cache of a format the fused kernels do not store, a dense
// rotation on the tile write, a norm that spans more than kMaxNormSpan values.
TEST(RuntimeApiRejects, UnsupportedFormats) {
  constexpr ErrorCode kUnsupported = ErrorCode::kUnsupported;
  const WriteParams bf16 = Write().format(Format::kBf16).Unchecked();
  alignas(16) static float x[128];
  static uint8_t codes[128];
  static uint16_t meta[4];
  ExpectError([&] { Quantize(x, codes, meta, meta + 2, 1, bf16); }, kUnsupported, {"bf16"});
  RowOutputs out;
  ExpectError([&] { WriteRows(bf16, nullptr, x, 1, out); }, kUnsupported, {"bf16"});
  alignas(16) static uint16_t k[8];
  const CacheParams dense_tile = Cache().sink(0).recent(1).flush(32).page(32)
                                     .key(Write().tile(32).rotation(RotationKind::kDense))
                                     .value(Write().group(32));
  ExpectError(
      [&] {
        PrefillWrite(dense_tile, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{},
                     PagePool{}, Windows{});
      },
      kUnsupported, {"(key)", "dense"});
  const CacheParams wide_norm = Cache().kv_heads(256).q_heads(256).sink(0).recent(1).flush(32)
                                    .page(32)
                                    .key(Write().head_dim(256).tile(32).norm().norm_heads(256))
                                    .value(Write().head_dim(256).group(32));
  ExpectError(
      [&] {
        PrefillWrite(wide_norm, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{},
                     PagePool{}, Windows{});
      },
      kUnsupported, {"norm over 256 KV heads", "32768"});
}

TEST(RuntimeApiRejects, InvalidCacheParams) {
  alignas(16) static uint16_t k[8];
  const CacheParams page48 = Cache().page(48).Unchecked();
  ExpectError(
      [&] {
        PrefillWrite(page48, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{}, PagePool{},
                     Windows{});
      },
      ErrorCode::kInvalidArgument, {"48"});
  const CacheParams bf16 = Cache().page(64).bf16().Unchecked();
  ExpectError(
      [&] {
        PrefillWrite(bf16, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{}, PagePool{},
                     Windows{});
      },
      ErrorCode::kInvalidArgument, {"quantized"});
}

TEST(CudaCheck, ErrorCarriesNameStringAndCallSite) {
  ExpectError([] { KVQ_CUDA_CHECK(cudaErrorInvalidValue); }, ErrorCode::kInvalidArgument,
              {"cudaErrorInvalidValue", "write_errors_test.cc"});
}

}  // namespace
}  // namespace kvq::gpu
