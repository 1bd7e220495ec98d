#include "kvq/testbed/backends.h"

namespace kvq::testbed {

std::vector<const cpu::Backend*> TestBackends(BackendFilter filter) {
  std::vector<const cpu::Backend*> list;
  for (const cpu::Backend* b : AllBackends()) {
    if (!filter.scalar && b->device == cpu::Device::kCpu && b->hwy_target == 0) continue;
    if (!filter.cuda && b->device == cpu::Device::kCuda) continue;
    list.push_back(b);
  }
  return list;
}

}  // namespace kvq::testbed
