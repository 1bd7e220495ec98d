// kvq::gpu::CudaBackend(): the CUDA path behind cpu::Backend's signatures. One generic host
// wrapper (RunHostStage) runs any stage from its spec (kvq/common/stages.h): it uploads each
// input argument by its dtype and extent, poisons each output, runs gpu::RunStage and
// downloads the outputs. The WriteKernels entries are generated from stages.inc, each passing
// its pointers to that wrapper.
#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache_upload.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/common/tensor.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/gpu/device_cache.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

// Stage `id` on host buffers args[] (stages.inc order; shapes from the spec): synchronous.
void RunHostStage(StageId id, void* const* args, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  const StageSpec& spec = GetStage(id);
  std::vector<DeviceArray<uint8_t>> buffers;
  buffers.reserve(spec.num_args);
  void* device_args[kMaxStageArgs] = {};
  for (int i = 0; i < spec.num_args; ++i) {
    const StageArg& arg = spec.args[i];
    const size_t bytes = ArgElements(arg.extent, static_cast<int64_t>(n), p) * DTypeSize(arg.dtype);
    // At least one byte, so that an empty argument still has an address.
    buffers.emplace_back(bytes > 0 ? bytes : 1);
    DeviceArray<uint8_t>& buffer = buffers.back();
    if (arg.is_input()) {
      if (bytes > 0) {
        KVQ_CUDA_CHECK(cudaMemcpy(buffer.get(), args[i], bytes, cudaMemcpyHostToDevice));
      }
    } else {
      buffer.Poison();
    }
    device_args[i] = buffer.get();
  }
  RunStage(id, device_args, n, p);
  // Waits for the stage and surfaces an asynchronous kernel fault.
  KVQ_CUDA_CHECK(cudaGetLastError());
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < spec.num_args; ++i) {
    const StageArg& arg = spec.args[i];
    const size_t bytes = ArgElements(arg.extent, static_cast<int64_t>(n), p) * DTypeSize(arg.dtype);
    if (arg.is_output() && bytes > 0) {
      KVQ_CUDA_CHECK(cudaMemcpy(args[i], buffers[i].get(), bytes, cudaMemcpyDeviceToHost));
    }
  }
}

// One host function per stage of stages.inc, with cpu::WriteKernels' signature.
#define KVQ_ARG(name, expect, dtype, dir, extent) const_cast<void*>(static_cast<const void*>(name)),
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  KVQ_IF_CUDA_STAGE(backends, void Host##Name params {                \
    void* const list[] = {arg_list};                                  \
    RunHostStage(StageId::k##Name, list, n, p);                       \
  })
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
#undef KVQ_ARG

cpu::Backend MakeCudaBackend() {
  cpu::Backend b;
  b.name = "cuda";
  b.device = cpu::Device::kCuda;
  b.hwy_target = 0;
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  KVQ_IF_CUDA_STAGE(backends, b.write.name = Host##Name;)
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  b.attend = [](const cpu::PagedKVCache& cache, const std::vector<int>& seqs, const float* q,
                float* out) { UploadCache(cache, seqs).Attend(q, out); };
  return b;
}

}  // namespace

const cpu::Backend* CudaBackend() {
  static const cpu::Backend* const backend = []() -> const cpu::Backend* {
    if (!HasCudaDevice()) return nullptr;
    static const cpu::Backend cuda = MakeCudaBackend();
    return &cuda;
  }();
  return backend;
}

}  // namespace kvq::gpu
