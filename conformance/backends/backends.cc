#include "kvq/backends.h"

#include "cuda_source.h"
#include "kvq/common/error.h"

namespace kvq {

const std::vector<const cpu::Backend*>& AllBackends() {
  static const std::vector<const cpu::Backend*> all = [] {
    std::vector<const cpu::Backend*> list;
    for (const cpu::Backend& b : cpu::Backends()) list.push_back(&b);
    std::string why_not;
    if (const cpu::Backend* cuda = CudaBackendOrNull(&why_not)) list.push_back(cuda);
    return list;
  }();
  return all;
}

std::vector<const cpu::Backend*> SelectBackends(const std::string& which) {
  std::vector<const cpu::Backend*> selected;
  if (which == "all") return AllBackends();
  if (which == "cpu") {  // (without asking for the CUDA backend: no CUDA runtime is loaded)
    for (const cpu::Backend& b : cpu::Backends()) selected.push_back(&b);
    return selected;
  }
  if (which == "gpu" || which == "cuda") {
    std::string why_not;
    const cpu::Backend* cuda = CudaBackendOrNull(&why_not);
    KVQ_CHECK(cuda != nullptr, kUnsupported, "backend '", which, "': ", why_not);
    return {cuda};
  }
  std::string names;
  for (const cpu::Backend* b : AllBackends()) {
    if (b->name == which) return {b};
    names += (names.empty() ? "" : ", ") + b->name;
  }
  std::string why_not;
  const bool cuda = CudaBackendOrNull(&why_not) != nullptr;
  KVQ_CHECK(false, kInvalidArgument, "backend '", which, "' is not available (available: all, cpu",
            cuda ? ", gpu" : "", ", ", names, ")");
  return selected;
}

}  // namespace kvq
