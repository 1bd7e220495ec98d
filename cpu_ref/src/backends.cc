// The backend list: the scalar reference first, then every Highway target compiled into
// write_hwy.cc that this CPU supports, best first.
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/cpu_ref/kernels.h"
#include "attention_internal.h"
#include "write_internal.h"

namespace kvq::cpu {

const std::vector<Backend>& Backends() {
  static const std::vector<Backend> backends = [] {
    std::vector<Backend> list;
    Backend scalar;
    scalar.name = "scalar";
    scalar.hwy_target = 0;
    scalar.write = internal::ScalarWriteKernels();
    scalar.attention = internal::ScalarAttentionKernels();
    list.push_back(scalar);
    for (Backend backend : internal::HwyBackends()) {
      backend.attention = internal::HwyAttentionKernels(backend.hwy_target);  // attention_hwy.cc
      list.push_back(backend);
    }
    return list;
  }();
  return backends;
}

const Backend& ScalarBackend() { return Backends().front(); }

const Backend& BestBackend() {
  const std::vector<Backend>& list = Backends();
  return list.size() > 1 ? list[1] : list[0];
}

const Backend& BackendByName(const std::string& name) {
  std::string available;
  for (const Backend& backend : Backends()) {
    if (backend.name == name) return backend;
    available += (available.empty() ? "" : ", ") + backend.name;
  }
  KVQ_CHECK(false, kInvalidArgument, "backend '", name, "' is not available (available: ",
            available, ")");
  return Backends().front();  // not reached
}

}  // namespace kvq::cpu
