// libkvq_cuda.so: the kvq CLI's GPU side (cli_gpu.h), a loadable module built in a CUDA build
// beside the kvq binary. It links the CUDA library, the adapter (backend and cache upload), the
// GPU forward of `kvq ppl` and the benchmarks' timing helpers; the binary links none of them.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache_upload.h"  // gpu/adapter
#include "cli_gpu.h"
#include "cuda_backend.h"  // gpu/adapter
#include "gpu_ppl.h"       // gpu/ppl
#include "gpu_timing.h"    // bench/
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_cache.h"

namespace kvq::cli {
namespace {

class Ppl final : public GpuPpl {
 public:
  Ppl(const calib::Model& model, gpu::GpuDecodeMode mode, bool int8_qk)
      : forwards_(model, mode, int8_qk) {}
  calib::PplForwards& forwards() override { return forwards_; }
  gpu::GpuPplStats stats() const override { return forwards_.stats(); }
  std::string device_name() const override { return forwards_.device_name(); }

 private:
  gpu::GpuPplForwards forwards_;
};

class Module final : public GpuModule {
 public:
  bool HasDevice() const override { return gpu::HasCudaDevice(); }
  const cpu::Backend* Backend() const override { return gpu::CudaBackend(); }

  double AttendMicros(const cpu::PagedKVCache& cache, const std::vector<int>& seqs,
                      const float* q, int iters, int warmup, bool cold_l2) const override {
    gpu::DeviceCache device = gpu::UploadCache(cache, seqs);
    return bench::MedianAttendMicros(device, q, iters, warmup, cold_l2);
  }

  TimedWrite TimeWriteRows(const WriteParams& p, const float* rotation, const float* x, size_t n,
                           int iters, int warmup) const override {
    bench::TimedRowWrite timed = bench::TimeWriteRows(p, rotation, x, n, iters, warmup);
    TimedWrite out;
    out.median_us = timed.median_us;
    for (int i = 0; i < kMaxPlanes; ++i) out.planes[i] = std::move(timed.planes[i]);
    return out;
  }

  std::string PplUnsupported(const std::vector<calib::LayerScheme>& layers) const override {
    return gpu::GpuPplUnsupported(layers);
  }
  gpu::GpuDecodeMode ParseDecodeMode(const std::string& name) const override {
    return gpu::ParseGpuDecodeMode(name);
  }
  const char* DecodeModeName(gpu::GpuDecodeMode mode) const override {
    return gpu::GpuDecodeModeName(mode);
  }
  std::unique_ptr<GpuPpl> MakePpl(const calib::Model& model, gpu::GpuDecodeMode mode,
                                  bool int8_qk) const override {
    return std::make_unique<Ppl>(model, mode, int8_qk);
  }
};

}  // namespace
}  // namespace kvq::cli

extern "C" __attribute__((visibility("default"))) const kvq::cli::GpuModule*
KVQ_GPU_MODULE_ENTRY() {
  static const kvq::cli::Module module;
  return &module;
}
