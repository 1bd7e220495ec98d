// The Highway targets register themselves (cpu_ref/src/hwy_targets.h): every target Highway
// generates under cpu_ref's build flags has its write and decode tables, with no hand-written
// target list, and the backend list holds exactly the compiled targets this CPU runs.
// The same flags as cpu_ref (its CMakeLists.txt, hwy_targets.h), so HWY_TARGETS below is the
// set Highway compiled cpu_ref's per-target files for.
#define HWY_COMPILE_ALL_ATTAINABLE
#define HWY_WANT_AVX3_DL
#include <hwy/targets.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "kvq/cpu_ref/kernels.h"

namespace kvq::cpu {
namespace {

std::set<int64_t> Bits(int64_t field) {
  std::set<int64_t> bits;
  for (int i = 0; i < 63; ++i) {
    if (field & (int64_t{1} << i)) bits.insert(int64_t{1} << i);
  }
  return bits;
}

TEST(HwyTargets, EveryGeneratedTargetRegisteredItsTables) {
  const std::vector<int64_t> compiled = CompiledHwyTargets();
  const std::set<int64_t> registered(compiled.begin(), compiled.end());
  EXPECT_EQ(registered.size(), compiled.size()) << "a target registered twice";
  std::string names;
  for (int64_t t : compiled) names += std::string(" ") + hwy::TargetName(t);
  EXPECT_EQ(registered, Bits(HWY_TARGETS)) << "registered:" << names;
  // Best first: Highway's better targets have the lower bits.
  for (size_t i = 1; i < compiled.size(); ++i) EXPECT_LT(compiled[i - 1], compiled[i]);
}

TEST(HwyTargets, BackendsAreTheCompiledTargetsThisCpuRuns) {
  std::vector<int64_t> expected;
  for (int64_t t : CompiledHwyTargets()) {
    if (t & hwy::SupportedTargets()) expected.push_back(t);
  }
  std::vector<int64_t> listed;
  for (const Backend& b : Backends()) {
    if (b.name != "scalar") listed.push_back(b.hwy_target);
  }
  EXPECT_EQ(listed, expected);
  ASSERT_FALSE(listed.empty());  // the portable target is always there
  EXPECT_EQ(Backends().front().name, "scalar");
}

}  // namespace
}  // namespace kvq::cpu
