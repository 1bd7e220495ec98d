// Test instantiation over the one backend list (kvq/backends.h): gtest parameters and names,
// so a test expands every backend, CUDA included where a device is present.
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "kvq/backends.h"
#include "kvq/common/stages.h"

namespace kvq::testbed {

struct BackendFilter {
  bool scalar = true;  // include the scalar reference
  bool cuda = true;    // include the CUDA backend (write stages and whole decode steps only)
};

std::vector<const cpu::Backend*> TestBackends(BackendFilter filter = {});

// Test names end in the backend's name: --gtest_filter='*hwy_avx2*' selects one.
inline std::string BackendTestName(const ::testing::TestParamInfo<const cpu::Backend*>& info) {
  return info.param->name;
}

}  // namespace kvq::testbed

namespace kvq {
// gtest prints parameters with these (test names and failure messages show names, not pointers).
inline void PrintTo(const StageSpec* s, std::ostream* os) { *os << s->name; }
namespace cpu {
inline void PrintTo(const Backend* b, std::ostream* os) { *os << b->name; }
}  // namespace cpu
}  // namespace kvq
