// The one per-target mechanism of cpu_ref's Highway code: targets register themselves. A file
// compiled once per target (write_hwy.cc, attention_hwy.cc: HWY_TARGET_INCLUDE +
// foreach_target.h) defines a table maker `Fn` inside HWY_NAMESPACE and, beside it,
//   KVQ_HWY_REGISTER(Table, Fn)
// which records, for the target being compiled (HWY_TARGET), its maker in TargetMakers<Table>
// when the program starts. In its HWY_ONCE part, TargetMakers<Table>::Make(target) then returns
// that target's table, for every target Highway generated (HWY_TARGETS under
// HWY_COMPILE_ALL_ATTAINABLE, whatever the architecture), with no list of targets written here.
// Both files include this header first, so both are compiled for the same targets.
#pragma once

// AVX3_DL (Ice Lake and later) is compiled only on request; this machine class has it.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#include <hwy/targets.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvq/common/error.h"

namespace kvq::cpu::internal {

// The makers of one kind of table (WriteKernels, AttentionKernels), one per compiled target.
template <typename Table>
class TargetMakers {
 public:
  using Maker = Table (*)();

  static TargetMakers& Get() {
    static TargetMakers makers;
    return makers;
  }
  bool Add(int64_t target, Maker maker) {
    makers_.emplace_back(target, maker);
    return true;
  }
  // The table of Highway target bit `target`; throws kUnsupported (naming `what` and the
  // target) when no maker was compiled for it.
  Table Make(int64_t target, const char* what) const {
    for (const auto& [t, maker] : makers_) {
      if (t == target) return maker();
    }
    KVQ_CHECK(false, kUnsupported, "no ", what, " were compiled for Highway target ", target,
              " (", hwy::TargetName(target), ")");
    return {};
  }
  // The targets that registered, in registration order.
  std::vector<int64_t> Targets() const {
    std::vector<int64_t> targets;
    for (const auto& entry : makers_) targets.push_back(entry.first);
    return targets;
  }

 private:
  std::vector<std::pair<int64_t, Maker>> makers_;
};

}  // namespace kvq::cpu::internal

// Inside HWY_NAMESPACE, after Fn: registers this target's Fn.
#define KVQ_HWY_REGISTER(Table, Fn)                                        \
  [[maybe_unused]] static const bool kvq_hwy_registered_##Fn =             \
      ::kvq::cpu::internal::TargetMakers<Table>::Get().Add(HWY_TARGET, &Fn)
