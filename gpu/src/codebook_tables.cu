// kvq/gpu/codebook.h: the codebook tables in device memory (static __device__ arrays, filled once
// per device from kvq::tables::Codebook; safe to first call inside a stream capture).
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/tables.h"
#include "kvq/gpu/codebook.h"
#include "kvq/gpu/cuda_check.h"

namespace kvq::gpu {
namespace {

constexpr int kSizes = static_cast<int>(tables::kCodebookSizes);
constexpr int kWords = kSizes * kDeviceCodebookWordsPerSize;
static_assert(DeviceCodebookOffset(tables::kCodebookMaxBits + 1) == kDeviceCodebookWordsPerSize,
              "one segment size holds every width");

__device__ float g_codebook_beta[kWords];
__device__ float g_codebook_gaussian[kWords];

std::vector<float> HostTables(CodebookDensity density) {
  std::vector<float> words(kWords);
  for (int s = 0; s < kSizes; ++s) {
    const int m = 2 * (s + 1);
    for (int w = 1; w <= tables::kCodebookMaxBits; ++w) {
      const tables::CodebookTable table = tables::Codebook(m, w, density);
      float* out = words.data() + s * kDeviceCodebookWordsPerSize + DeviceCodebookOffset(w);
      std::memcpy(out, table.centroids, sizeof(float) * table.levels);
      std::memcpy(out + table.levels, table.boundaries, sizeof(float) * (table.levels - 1));
    }
  }
  return words;
}

constexpr int kMaxDevices = 64;

}  // namespace

const float* DeviceCodebookTables(CodebookDensity density) {
  static std::once_flag once[2][kMaxDevices];
  static cudaError_t status[2][kMaxDevices];
  static const float* address[2][kMaxDevices];
  int device = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&device));
  KVQ_CHECK(device >= 0 && device < kMaxDevices, kUnsupported, "CUDA device ", device,
            " is beyond the codebook tables' ", kMaxDevices, " devices");
  const int k = density == CodebookDensity::kGaussian ? 1 : 0;
  std::call_once(once[k][device], [&] {
    const std::vector<float> host = HostTables(density);
    // The first use may come while this thread's stream is being captured into a CUDA graph
    // (a codebook write or decode under torch.cuda.graph): the upload belongs to no graph, so
    // it runs with the thread's capture mode relaxed, on a non-blocking stream of its own (no
    // implicit synchronisation with a capturing stream), and waits for its copy.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t st = cudaThreadExchangeStreamCaptureMode(&mode);
    const bool exchanged = st == cudaSuccess;
    cudaStream_t upload = nullptr;
    if (st == cudaSuccess) st = cudaStreamCreateWithFlags(&upload, cudaStreamNonBlocking);
    void* symbol = nullptr;
    if (st == cudaSuccess) {
      st = k == 1 ? cudaGetSymbolAddress(&symbol, g_codebook_gaussian)
                  : cudaGetSymbolAddress(&symbol, g_codebook_beta);
    }
    if (st == cudaSuccess) {
      st = cudaMemcpyAsync(symbol, host.data(), sizeof(float) * host.size(),
                           cudaMemcpyHostToDevice, upload);
    }
    if (st == cudaSuccess) st = cudaStreamSynchronize(upload);
    if (upload != nullptr) {
      const cudaError_t destroyed = cudaStreamDestroy(upload);
      if (st == cudaSuccess) st = destroyed;
    }
    if (exchanged) {
      const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
      if (st == cudaSuccess) st = restored;
    }
    status[k][device] = st;
    address[k][device] = static_cast<const float*>(symbol);
  });
  KVQ_CUDA_CHECK(status[k][device]);
  return address[k][device];
}

}  // namespace kvq::gpu
