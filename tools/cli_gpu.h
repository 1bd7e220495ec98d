// What the kvq CLI does on the GPU, behind one interface that a loadable module implements.
//
// The kvq binary links no CUDA code: in a CUDA build the GPU side of the CLI (the CUDA backend of
// `kvq conform`, the timings of `kvq bench` and `kvq demo`, the forward of `kvq ppl --backend
// gpu`) is libkvq_cuda.so (tools/gpu_module.cc), built beside the binary and loaded on first
// use. So `cmake --build build --target kvq` builds the CPU commands alone (the README's first
// command runs the demo minutes before the CUDA kernels are compiled), and a kvq binary runs on a
// machine without the CUDA runtime. The module is built from the same tree as the binary; its
// entry point's name (KVQ_GPU_MODULE_ENTRY) carries a version, bumped whenever this interface
// changes, so a stale module is refused instead of called.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_ppl.h"  // gpu/ppl: GpuDecodeMode, GpuPplStats (no CUDA header)
#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::cli {

#define KVQ_GPU_MODULE_ENTRY kvq_cli_gpu_module_v1

// The GPU forwards of `kvq ppl --backend gpu` on one model.
class GpuPpl {
 public:
  virtual ~GpuPpl() = default;
  virtual calib::PplForwards& forwards() = 0;
  virtual gpu::GpuPplStats stats() const = 0;
  virtual std::string device_name() const = 0;  // "NVIDIA H100 80GB HBM3 (132 SMs)"
};

// The fused write of flat rows, timed: the median over `iters` runs (CUDA events) and the stored
// planes of LayoutOf(p) as the device wrote them.
struct TimedWrite {
  double median_us = 0;
  std::vector<uint8_t> planes[kMaxPlanes];
};

class GpuModule {
 public:
  virtual ~GpuModule() = default;
  virtual bool HasDevice() const = 0;
  // The backend named "cuda" of the backend list, or null without a device.
  virtual const cpu::Backend* Backend() const = 0;
  // Median microseconds of the decode step of `seqs` of `cache` on the device (uploaded once),
  // q [B, Hq, d] fp32 host; cold L2 when asked. kUnsupported: no CUDA decode for this cache.
  virtual double AttendMicros(const cpu::PagedKVCache& cache, const std::vector<int>& seqs,
                              const float* q, int iters, int warmup, bool cold_l2) const = 0;
  // gpu::WriteRows of x [n, d] fp32 with p (and the dense rotation, when p says dense), timed.
  virtual TimedWrite TimeWriteRows(const WriteParams& p, const float* rotation, const float* x,
                                   size_t n, int iters, int warmup) const = 0;
  // kvq ppl --backend gpu (gpu/ppl/gpu_ppl.h).
  virtual std::string PplUnsupported(const std::vector<calib::LayerScheme>& layers) const = 0;
  virtual gpu::GpuDecodeMode ParseDecodeMode(const std::string& name) const = 0;
  virtual const char* DecodeModeName(gpu::GpuDecodeMode mode) const = 0;
  virtual std::unique_ptr<GpuPpl> MakePpl(const calib::Model& model, gpu::GpuDecodeMode mode,
                                          bool int8_qk) const = 0;
};

// This binary's GPU module, loaded on the first call (later calls return the same), or null
// with *why_not saying why: a build without CUDA, the module not built yet (naming the path
// and the command that builds it), or the loader's error. Never throws.
const GpuModule* GpuOrNull(std::string* why_not = nullptr);
// The same, or kvq::Error kUnsupported "<what>: <why not>".
const GpuModule& RequireGpu(const std::string& what);

}  // namespace kvq::cli
