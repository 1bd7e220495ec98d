// kvq::gpu::CudaBackend(): the CUDA stages behind cpu::WriteKernels' host-pointer signatures,
// so tests and benchmarks written against cpu::Backend expand the GPU too. Each wrapper copies
// its inputs to the device, poisons the outputs (0xFF bytes: NaN floats and bf16, code 255,
// so an element the kernel forgets cannot pass for a right answer), runs the stage and copies
// the results back. Synchronous; meant for conformance, not speed.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

size_t Elements(size_t n, const WriteParams& p) { return n * static_cast<size_t>(p.head_dim); }
size_t Groups(size_t n, const WriteParams& p) { return n * static_cast<size_t>(p.num_groups()); }
size_t PackedBytes(size_t n, const WriteParams& p) {
  return n * static_cast<size_t>(p.code_bytes());
}

// Waits for the stage and surfaces an asynchronous kernel fault.
void Finish() {
  KVQ_CUDA_CHECK(cudaGetLastError());
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
}

void RotateDenseHost(const float* x, const float* r, float* y, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  const size_t d = static_cast<size_t>(p.head_dim);
  DeviceArray<float> dx(x, Elements(n, p)), dr(r, d * d), dy(Elements(n, p));
  dy.Poison();
  RotateDense(dx.get(), dr.get(), dy.get(), n, p);
  Finish();
  dy.CopyTo(y);
}

void FwhtHost(float* x, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<float> dx(x, Elements(n, p));
  Fwht(dx.get(), n, p);
  Finish();
  dx.CopyTo(x);
}

void BitrevHost(const float* x, float* y, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<float> dx(x, Elements(n, p)), dy(Elements(n, p));
  dy.Poison();
  Bitrev(dx.get(), dy.get(), n, p);
  Finish();
  dy.CopyTo(y);
}

void ClipHost(float* x, float* tau, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<float> dx(x, Elements(n, p)), dtau(n);
  dtau.Poison();
  Clip(dx.get(), dtau.get(), n, p);
  Finish();
  dx.CopyTo(x);
  dtau.CopyTo(tau);
}

void QuantizeHost(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                  const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<float> dx(x, Elements(n, p));
  DeviceArray<uint8_t> dcodes(Elements(n, p));
  DeviceArray<uint16_t> dscale(Groups(n, p)), dmin(Groups(n, p));
  dcodes.Poison();
  dscale.Poison();
  dmin.Poison();
  Quantize(dx.get(), dcodes.get(), dscale.get(), dmin.get(), n, p);
  Finish();
  dcodes.CopyTo(codes);
  dscale.CopyTo(scale);
  dmin.CopyTo(min);
}

void PackHost(const uint8_t* codes, uint8_t* packed, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<uint8_t> dcodes(codes, Elements(n, p)), dpacked(PackedBytes(n, p));
  dpacked.Poison();
  Pack(dcodes.get(), dpacked.get(), n, p);
  Finish();
  dpacked.CopyTo(packed);
}

void UnpackHost(const uint8_t* packed, uint8_t* codes, size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<uint8_t> dpacked(packed, PackedBytes(n, p)), dcodes(Elements(n, p));
  dcodes.Poison();
  Unpack(dpacked.get(), dcodes.get(), n, p);
  Finish();
  dcodes.CopyTo(codes);
}

void DequantizeHost(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, float* y,
                    size_t n, const WriteParams& p) {
  RequireCudaDevice();
  p.Validate();
  DeviceArray<uint8_t> dcodes(codes, Elements(n, p));
  DeviceArray<uint16_t> dscale(scale, Groups(n, p)), dmin(min, Groups(n, p));
  DeviceArray<float> dy(Elements(n, p));
  dy.Poison();
  Dequantize(dcodes.get(), dscale.get(), dmin.get(), dy.get(), n, p);
  Finish();
  dy.CopyTo(y);
}

}  // namespace

const cpu::Backend& CudaBackend() {
  static const cpu::Backend backend = [] {
    cpu::Backend b;
    b.name = "cuda";
    b.hwy_target = 0;
    b.write.rotate_dense = RotateDenseHost;
    b.write.fwht = FwhtHost;
    b.write.bitrev = BitrevHost;
    b.write.clip = ClipHost;
    b.write.quantize = QuantizeHost;
    b.write.pack = PackHost;
    b.write.unpack = UnpackHost;
    b.write.dequantize = DequantizeHost;
    return b;
  }();
  return backend;
}

}  // namespace kvq::gpu
