// What the CUDA write path refuses, and how: launchers return cudaErrorInvalidValue for
// configurations they have no kernel for (never a silent no-op), the runtime API throws
// kvq::Error naming the value. These checks happen before any CUDA call, so they run on
// machines without a GPU too (CI); the device-only ones skip there.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

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
  a.params.head_dim = 96;
  EXPECT_EQ(DispatchStage(StageId::kBitrev, a, nullptr), cudaErrorInvalidValue);
  a.params.head_dim = 128;
  a.params.group = 256;
  a.params.bits = 2;
  EXPECT_EQ(DispatchStage(StageId::kQuantize, a, nullptr), cudaErrorInvalidValue);
  a.params.group = 64;
  a.params.bits = 3;
  EXPECT_EQ(DispatchStage(StageId::kPack, a, nullptr), cudaErrorInvalidValue);
  a.params.bits = 2;
  a.fwht_block = 12;
  EXPECT_EQ(DispatchStage(StageId::kFwht, a, nullptr), cudaErrorInvalidValue);
  a.params.clip = 0.0f;
  EXPECT_EQ(DispatchStage(StageId::kClip, a, nullptr), cudaErrorInvalidValue);
}

// Every stage of the list (kvq/common/stages.inc) has a launcher: with no rows, each accepts a
// valid configuration and launches nothing (never cudaErrorInvalidValue for a stage it lacks).
TEST(LauncherRefuses, NoStageOfTheListIsMissing) {
  for (const StageSpec& stage : AllStages()) {
    StageArgs a;
    a.rows = 0;
    a.fwht_block = 128;
    EXPECT_EQ(DispatchStage(stage.id, a, nullptr), cudaSuccess) << stage.name;
  }
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
void ExpectInvalidArgument(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected kvq::Error naming " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RuntimeApiRejects, InvalidWriteParams) {
  WriteParams p;
  p.head_dim = 96;
  RowOutputs out;
  ExpectInvalidArgument([&] { WriteRows(p, nullptr, static_cast<const float*>(nullptr), 4, out); },
                        "96");
  p.head_dim = 128;
  p.bits = 3;
  ExpectInvalidArgument([&] { Quantize(nullptr, nullptr, nullptr, nullptr, 4, p); }, "3");
  p.bits = 2;
  ExpectInvalidArgument([&] { Bitrev(nullptr, nullptr, 4, p); }, "x is null");
  alignas(16) static float x[128];
  ExpectInvalidArgument([&] { Bitrev(x, x, 1, p); }, "x and y alias");
  static uint8_t packed[32];
  static uint16_t meta[2];
  ExpectInvalidArgument([&] { WriteRows(p, nullptr, x, 1, out); }, "plane 'codes' is null");
  p.rotation = RotationKind::kDense;
  out.planes[kAffineCodesPlane] = packed;
  out.planes[kAffineScalePlane] = reinterpret_cast<uint8_t*>(meta);
  out.planes[kAffineMinPlane] = reinterpret_cast<uint8_t*>(meta + 1);
  ExpectInvalidArgument([&] { WriteRows(p, nullptr, x, 1, out); }, "rotation matrices are null");
}

// What the kernels do not serve is refused as kUnsupported, naming the value: a codec stage of
// another format, a fused write or cache of a format the fused kernel does not store, F != 1.
TEST(RuntimeApiRejects, UnsupportedFormatsAndFlush) {
  auto expect_unsupported = [](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "expected kvq::Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  WriteParams bf16;
  bf16.format = Format::kBf16;
  alignas(16) static float x[128];
  static uint8_t codes[128];
  static uint16_t meta[4];
  expect_unsupported([&] { Quantize(x, codes, meta, meta + 2, 1, bf16); }, "bf16");
  RowOutputs out;
  expect_unsupported([&] { WriteRows(bf16, nullptr, x, 1, out); }, "bf16");
  CacheParams c;
  c.flush = 4;
  alignas(16) static uint16_t k[8];
  expect_unsupported(
      [&] {
        PrefillWrite(c, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{}, PagePool{},
                     Windows{});
      },
      "flush F = 4");
}

TEST(RuntimeApiRejects, InvalidCacheParams) {
  CacheParams c;
  c.page_size = 48;
  alignas(16) static uint16_t k[8];
  ExpectInvalidArgument(
      [&] {
        PrefillWrite(c, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{}, PagePool{},
                     Windows{});
      },
      "48");
  c.page_size = 64;
  c.key.format = c.value.format = kvq::Format::kBf16;
  ExpectInvalidArgument(
      [&] {
        PrefillWrite(c, k, k, 1, nullptr, HeadData{}, HeadData{}, PagePool{}, PagePool{},
                     Windows{});
      },
      "quantized");
}

TEST(CudaCheck, ErrorCarriesNameStringAndCallSite) {
  try {
    KVQ_CUDA_CHECK(cudaErrorInvalidValue);
    ADD_FAILURE() << "expected kvq::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
    EXPECT_NE(what.find("write_errors_test.cc"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace kvq::gpu
