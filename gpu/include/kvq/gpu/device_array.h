// Host-side helper for code that talks to the CUDA runtime from C++ (DeviceCache, the CUDA
// adapter's stage wrappers, the GPU tests and benchmarks): an owning device allocation with host
// round trips. Every CUDA call is checked (kvq::Error).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/rotation.h"

namespace kvq::gpu {

// An owning device allocation of `count` elements of T (movable, not copyable).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : count_(count) {
    if (count_ > 0) KVQ_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), bytes()));
  }
  DeviceArray(const T* host, size_t count) : DeviceArray(count) {
    if (count_ > 0) KVQ_CUDA_CHECK(cudaMemcpy(data_, host, bytes(), cudaMemcpyHostToDevice));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.data(), host.size()) {}
  ~DeviceArray() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept { *this = std::move(other); }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }

  T* get() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  // Every byte set to `byte`; 0xFF poisons (NaN floats and bf16, code 255, so an element a
  // kernel forgets cannot pass for a right answer).
  void Fill(unsigned char byte) const {
    if (count_ > 0) KVQ_CUDA_CHECK(cudaMemset(data_, byte, bytes()));
  }
  void Poison() const { Fill(0xFF); }
  // host.size() must equal size().
  void Upload(const std::vector<T>& host) const {
    KVQ_CHECK(host.size() == count_, kShapeMismatch, "DeviceArray::Upload: ", host.size(),
              " elements into ", count_);
    if (count_ > 0) KVQ_CUDA_CHECK(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  // Waits for all device work first, so results of kernels on any stream are complete.
  void CopyTo(T* host) const {
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    if (count_ > 0) KVQ_CUDA_CHECK(cudaMemcpy(host, data_, bytes(), cudaMemcpyDeviceToHost));
  }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    CopyTo(host.data());
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// One side's per-head data (kvq::HeadData: each row of head_data.inc) on the device; View() is
// the gpu::HeadData the kernels take. Every array row is uploaded as the host holds it (empty:
// a null pointer); every per-head scalar is uploaded
// for every KV head, as that head's write params hold it (HeadData::Apply: its own value, else
// p's), so a kernel never meets a null list where the format needs one (the fp8 scales).
class DeviceHeadData {
 public:
  DeviceHeadData() = default;
  // `host` validated against p and num_kv_heads (HeadData::Validate) by the caller.
  DeviceHeadData(const kvq::HeadData& host, const WriteParams& p, int num_kv_heads) {
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  name##_ = DeviceArray<Type>(host.name);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
    const auto per_head = [&](float WriteParams::*field) {
      std::vector<float> values(static_cast<size_t>(num_kv_heads));
      for (int h = 0; h < num_kv_heads; ++h) values[static_cast<size_t>(h)] = host.Apply(p, h).*field;
      return DeviceArray<float>(values);
    };
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) name##_ = per_head(&WriteParams::field);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  }
  HeadData View() const {
    HeadData view;
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  view.name = name##_.get();
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) view.name = name##_.get();
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
    return view;
  }

 private:
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) \
  DeviceArray<Type> name##_;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule) DeviceArray<float> name##_;
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
};

}  // namespace kvq::gpu
