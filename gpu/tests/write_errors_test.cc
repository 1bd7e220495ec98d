// What the CUDA write path refuses, and how: launchers return cudaErrorInvalidValue for
// configurations they have no kernel for (never a silent no-op), the runtime API throws
// kvq::Error naming the value. These checks happen before any CUDA call, so they run on
// machines without a GPU too (CI); the device-only ones skip there.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/params.h"
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
  a.codes = codes;
  a.scale = meta;
  a.min = meta;
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
  a.rotation = 7;
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.rotation = static_cast<int>(RotationKind::kDense);  // no matrices
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.rotation = static_cast<int>(RotationKind::kHadamard);
  a.fwht_block = 8;
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a.fwht_block = 256;  // larger than d
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
  a = PlausibleArgs();
  a.x = static_cast<const uint8_t*>(a.x) + 2;  // not 16-byte aligned
  EXPECT_EQ((LaunchFusedWrite<128, 64, 2>(a, nullptr)), cudaErrorInvalidValue);
}

TEST(LauncherRefuses, UnsupportedStageConfigurations) {
  StageArgs a;
  a.rows = 1;
  a.head_dim = 96;
  EXPECT_EQ(DispatchStage(Stage::kBitrev, a, nullptr), cudaErrorInvalidValue);
  a.head_dim = 128;
  a.group = 256;
  a.bits = 2;
  EXPECT_EQ(DispatchStage(Stage::kQuantize, a, nullptr), cudaErrorInvalidValue);
  a.group = 64;
  a.bits = 3;
  EXPECT_EQ(DispatchStage(Stage::kPack, a, nullptr), cudaErrorInvalidValue);
  a.bits = 2;
  a.fwht_block = 12;
  EXPECT_EQ(DispatchStage(Stage::kFwht, a, nullptr), cudaErrorInvalidValue);
  a.clip = 0.0f;
  EXPECT_EQ(DispatchStage(Stage::kClip, a, nullptr), cudaErrorInvalidValue);
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
  p.rotation = RotationKind::kDense;
  alignas(16) static float x[128];
  static uint8_t packed[32];
  static uint16_t meta[2];
  out.packed = packed;
  out.scale = meta;
  out.min = meta;
  ExpectInvalidArgument([&] { WriteRows(p, nullptr, x, 1, out); }, "rotation matrices are null");
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

TEST(CudaBackend, IsNamedCudaAndFillsEveryWriteKernel) {
  const cpu::Backend& b = CudaBackend();
  EXPECT_EQ(b.name, "cuda");
  EXPECT_NE(b.write.rotate_dense, nullptr);
  EXPECT_NE(b.write.fwht, nullptr);
  EXPECT_NE(b.write.bitrev, nullptr);
  EXPECT_NE(b.write.clip, nullptr);
  EXPECT_NE(b.write.quantize, nullptr);
  EXPECT_NE(b.write.pack, nullptr);
  EXPECT_NE(b.write.unpack, nullptr);
  EXPECT_NE(b.write.dequantize, nullptr);
}

TEST(CudaBackend, WithoutDeviceThrowsUnsupported) {
  if (HasCudaDevice()) GTEST_SKIP() << "a CUDA device is present";
  WriteParams p;
  float x[128] = {};
  float y[128];
  try {
    CudaBackend().write.bitrev(x, y, 1, p);
    ADD_FAILURE() << "expected kvq::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  }
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
