#include "kvq/backends.h"

#include "kvq/common/error.h"
#ifdef KVQ_HAVE_CUDA
#include "cuda_backend.h"  // gpu/adapter
#endif

namespace kvq {
namespace {

const cpu::Backend* Cuda() {
#ifdef KVQ_HAVE_CUDA
  return gpu::CudaBackend();
#else
  return nullptr;
#endif
}

}  // namespace

const std::vector<const cpu::Backend*>& AllBackends() {
  static const std::vector<const cpu::Backend*> all = [] {
    std::vector<const cpu::Backend*> list;
    for (const cpu::Backend& b : cpu::Backends()) list.push_back(&b);
    if (const cpu::Backend* cuda = Cuda()) list.push_back(cuda);
    return list;
  }();
  return all;
}

std::vector<const cpu::Backend*> SelectBackends(const std::string& which) {
  std::vector<const cpu::Backend*> selected;
  if (which == "all") return AllBackends();
  if (which == "cpu") {
    for (const cpu::Backend* b : AllBackends()) {
      if (b->device == cpu::Device::kCpu) selected.push_back(b);
    }
    return selected;
  }
  if (which == "gpu" || which == "cuda") {
#ifndef KVQ_HAVE_CUDA
    KVQ_CHECK(false, kUnsupported, "backend '", which, "': this kvq was built without CUDA");
#endif
    const cpu::Backend* cuda = Cuda();
    KVQ_CHECK(cuda != nullptr, kUnsupported, "backend '", which, "': no CUDA device is present");
    return {cuda};
  }
  std::string names;
  for (const cpu::Backend* b : AllBackends()) {
    if (b->name == which) return {b};
    names += (names.empty() ? "" : ", ") + b->name;
  }
  KVQ_CHECK(false, kInvalidArgument, "backend '", which, "' is not available (available: all, cpu",
#ifdef KVQ_HAVE_CUDA
            ", gpu",
#endif
            ", ", names, ")");
  return selected;
}

}  // namespace kvq
