// The codebook tables' first use inside a CUDA graph capture (kvq/gpu/codebook.h): a serving
// engine (or torch.cuda.graph around kvq's torch ops) may capture its first codebook write or
// decode before any eager one, so the per-device upload of the tables must not break the
// capture. This program's only test is the process's first codebook launch, so it is the
// upload's first call: keep it a program of its own (gpu/CMakeLists.txt builds one per file).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_test_util.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/conformance/prng.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu::testing {
namespace {

// A codebook write captured in a graph under the strictest capture mode (global, what
// torch.cuda.graph uses by default) on a non-blocking stream: the capture succeeds, and
// replaying the graph writes the scalar oracle's bits.
TEST(CodebookTablesUnderCapture, FirstUploadInsideAGlobalCaptureKeepsTheGraph) {
  KVQ_SKIP_WITHOUT_CUDA();
  constexpr int kD = 128;
  constexpr size_t kRows = 33;
  const WriteParams p = testbed::Write().head_dim(kD).hadamard().codebook_rows(3);
  conformance::SplitMix64 rng(20261128);
  std::vector<float> x(kRows * kD);
  for (float& v : x) v = rng.Uniform();
  const cpu::QuantizedRows want = cpu::QuantizeRows(cpu::ScalarBackend(), p, HeadArrays(),
                                                    x.data(), kRows);
  const FormatLayout layout = LayoutOf(p);
  ASSERT_EQ(layout.num_planes, 2);
  DeviceBuffer<float> dx(x);
  std::vector<DeviceBuffer<uint8_t>> planes;
  for (int i = 0; i < layout.num_planes; ++i) {
    planes.emplace_back(want.Output(layout.plane(i).source).bytes.size());
    planes.back().Fill(0xFF);
  }
  RowOutputs out;
  for (int i = 0; i < layout.num_planes; ++i) out.planes[i] = planes[i].get();

  cudaStream_t stream = nullptr;
  KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  WriteRows(p, HeadData(), dx.get(), kRows, out, nullptr, stream);
  KVQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_NE(graph, nullptr);
  // Nothing ran yet: the planes still hold the poison.
  for (const DeviceBuffer<uint8_t>& plane : planes) {
    for (uint8_t b : plane.Download()) ASSERT_EQ(b, 0xFF);
  }
  cudaGraphExec_t exec = nullptr;
  KVQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KVQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int i = 0; i < layout.num_planes; ++i) {
    EXPECT_EQ(planes[i].Download(), want.Output(layout.plane(i).source).bytes)
        << "plane " << i << " (" << layout.plane(i).source << ") after the graph's replay";
  }
  KVQ_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KVQ_CUDA_CHECK(cudaGraphDestroy(graph));
  KVQ_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace kvq::gpu::testing
