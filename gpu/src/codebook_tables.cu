// kvq/gpu/codebook.h: the codebook tables in device memory (static __device__ arrays, filled once
// per device from kvq::tables::Codebook).
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
    void* symbol = nullptr;
    cudaError_t st = k == 1 ? cudaGetSymbolAddress(&symbol, g_codebook_gaussian)
                            : cudaGetSymbolAddress(&symbol, g_codebook_beta);
    if (st == cudaSuccess) {
      st = cudaMemcpy(symbol, host.data(), sizeof(float) * host.size(), cudaMemcpyHostToDevice);
    }
    status[k][device] = st;
    address[k][device] = static_cast<const float*>(symbol);
  });
  KVQ_CUDA_CHECK(status[k][device]);
  return address[k][device];
}

}  // namespace kvq::gpu
