// kvq ppl on the GPU (issue 16, item 7): the teacher-forced forward of calib/forward.h on the
// device, as a calib::PplForwards, so that calib::EvaluatePerplexity scores it exactly as it
// scores the CPU's (same windows, shared prefix, metrics, tables, JSON).
//
// Per window and layer, as the CPU forward: embedding, RMSNorm, the fused q|k|v projection
// (cuBLAS fp32 GEMM, pedantic math: no TF32), Qwen3's q/k norms and RoPE, then attention
// through the scheme's real GPU cache, W_O, the SwiGLU MLP (cuBLAS) and the tied head (cuBLAS).
// Attention of layer l over a window of T tokens whose positions [first, T) are computed:
//  - the T rows of k and v are rounded to bf16 (RNE, as cpu::PagedKVCache::Prefill does);
//  - quantized scheme: kvq::gpu::PrefillWrite writes the T rows' history into the pages with
//    the scheme's per-head rotations and clip ratios (the history bits are a pure function of
//    the row, so one prefill gives every row its final bits: the CPU cache's bits);
//    bf16 cache (the reference and the `bf16` row): the rows are paged as the decode kernel's
//    bf16 cache reads them;
//  - kvq::gpu::DecodeAttention reads, for the query at position p, the cache at length p + 1:
//      kBatch (default): one decode call per layer over a batch of T − first "sequences", one per
//        position, sharing the history pages (page table rows identical) with lengths p + 1;
//        each sequence's bf16 windows (sink, recent ring) hold what that length's cache holds;
//      kSteps: the decoding loop itself: PrefillWrite of positions [0, first), then per
//        position p an AppendStep (the token enters the ring, position p − W is demoted into
//        the history by the append kernel) and a decode step of batch 1 at length p + 1
//        (quantized caches only; the bf16 cache is always batched).
// The fp32 forward (no cache rounding) has no GPU twin (Fp32 throws kUnsupported).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "kvq/calib/schemes.h"

namespace kvq::gpu {

// Why the CUDA write and decode kernels cannot serve a scheme (its layers), or "" when they
// can: the reasons PrefillWrite and PlanDecodeAttention give (formats other than affine_token
// or bf16, K and V of different widths, a flush F != 1, a recent window W = 0, a key norm,
// G = d = 256, ...). Needs no device.
std::string GpuPplUnsupported(const std::vector<calib::LayerScheme>& layers);

enum class GpuDecodeMode { kBatch, kSteps };
const char* GpuDecodeModeName(GpuDecodeMode mode);          // "batch", "steps"
GpuDecodeMode ParseGpuDecodeMode(const std::string& name);  // throws kInvalidArgument

// Where the time went (wall seconds on the calling threads, each forward's device work and
// transfers included: every forward ends with its logits on the host).
struct GpuPplStats {
  int reference_forwards = 0, scheme_forwards = 0;
  double reference_seconds = 0, scheme_seconds = 0;
  int64_t positions = 0;  // query positions computed, all forwards
};

class GpuPplForwards : public calib::PplForwards {
 public:
  // Uploads the model's weights to the current device. Throws kvq::Error: no device
  // (kUnsupported), a CUDA or cuBLAS failure.
  // int8_qk: the decode plan's choice of the quantized history's QK^T loop (kInt8Qk where it
  // applies, as in production); false plans the bf16 hi + lo loops (allow_int8_qk = false).
  explicit GpuPplForwards(const calib::Model& model, GpuDecodeMode mode = GpuDecodeMode::kBatch,
                          bool int8_qk = true);
  ~GpuPplForwards() override;
  GpuPplForwards(const GpuPplForwards&) = delete;
  GpuPplForwards& operator=(const GpuPplForwards&) = delete;

  std::vector<float> Reference(const calib::ForwardRequest& request) override;
  std::vector<float> Fp32(const calib::ForwardRequest& request) override;  // kUnsupported
  // Throws kUnsupported with GpuPplUnsupported's reason; kNonFinite when a row the CPU cache
  // would reject reaches the write kernels.
  std::vector<float> Scheme(int scheme, const std::vector<calib::LayerScheme>& layers,
                            const calib::ForwardRequest& request,
                            double* bits_per_element) override;

  GpuPplStats stats() const;
  std::string device_name() const;  // "NVIDIA H100 80GB HBM3 (132 SMs)"

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  mutable std::mutex mutex_;  // one forward at a time on the device
};

// Bits per element of K and V a cache of `params` holds at length t (cpu::CacheBytes's rule:
// bf16 sink and recent rows in use plus the history planes of the rows in use).
double CacheBitsPerElement(const CacheParams& params, int64_t t);

}  // namespace kvq::gpu
