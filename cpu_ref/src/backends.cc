// The CPU backend list: the scalar reference first, then every Highway target compiled into
// cpu_ref that this CPU supports, best first. Each entry's write and attention tables come from
// the same target (hwy_targets.h); its `attend` runs the decode driver with them.
#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include <hwy/targets.h>

#include "kvq/common/error.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/kernels.h"
#include "attention_internal.h"
#include "write_internal.h"

namespace kvq::cpu {

void RunStage(const WriteKernels& k, StageId id, void* const* args, size_t n,
              const WriteParams& p) {
  switch (id) {
#define KVQ_STAGE(name, Name, family, backends, params, arg_list)                                  \
  case StageId::k##Name:                                                                 \
    KVQ_CHECK(k.name != nullptr, kUnsupported, "stage '" #name "' is not implemented"); \
    InvokeStage(k.name, args, n, p);                                                     \
    return;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  }
}

bool HasStage(const WriteKernels& k, StageId id) {
  switch (id) {
#define KVQ_STAGE(name, Name, family, backends, params, arg_list) \
  case StageId::k##Name:                                \
    return k.name != nullptr;
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
  }
  return false;
}

std::vector<int64_t> CompiledHwyTargets() {
  std::vector<int64_t> write = internal::HwyWriteTargets();
  std::vector<int64_t> attention = internal::HwyAttentionTargets();
  std::sort(write.begin(), write.end());  // lower bits are better targets
  std::sort(attention.begin(), attention.end());
  KVQ_CHECK(write == attention, kUnsupported,
            "write_hwy.cc and attention_hwy.cc were compiled for different Highway targets");
  return write;
}

const std::vector<Backend>& Backends() {
  static const std::vector<Backend> backends = [] {
    std::vector<Backend> list;
    Backend scalar;
    scalar.name = "scalar";
    scalar.write = internal::ScalarWriteKernels();
    scalar.attention = internal::ScalarAttentionKernels();
    list.push_back(scalar);
    const int64_t supported = hwy::SupportedTargets();
    for (const int64_t target : CompiledHwyTargets()) {
      if ((target & supported) == 0) continue;
      Backend backend;
      backend.name = "hwy_";
      for (const char* c = hwy::TargetName(target); *c != '\0'; ++c) {
        backend.name += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
      }
      backend.hwy_target = target;
      backend.write = internal::HwyWriteKernels(target);
      backend.attention = internal::HwyAttentionKernels(target);
      list.push_back(backend);
    }
    // Each entry's whole decode step runs the driver with the entry's own tables (looked up
    // when called: the list is complete by then).
    for (size_t i = 0; i < list.size(); ++i) {
      list[i].attend = [i](const PagedKVCache& cache, const std::vector<int>& seqs,
                           const float* q, float* out) {
        AttendBatch(Backends()[i], cache, seqs, q, out);
      };
    }
    // Each target's table must be its own: distinct targets, distinct code.
    for (size_t a = 1; a < list.size(); ++a) {
      for (size_t b = a + 1; b < list.size(); ++b) {
        KVQ_CHECK(list[a].write.rotate_dense != list[b].write.rotate_dense, kUnsupported,
                  "Highway targets ", list[a].name, " and ", list[b].name, " share kernels");
      }
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
