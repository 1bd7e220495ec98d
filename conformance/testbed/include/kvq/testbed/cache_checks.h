// The invariants of the paged cache (spec/cache.md §2-§4), checked against the rows a sequence
// was given: the window rule, bf16 rows where the rule keeps bf16, and history bits equal to the
// format's encoding of the original rows — so prefill and decode-time demotion cannot differ.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvq/cpu_ref/cache.h"

namespace kvq::testbed {

// rows[0] / rows[1]: the bf16 bits of every K / V row sequence `seq` was given, [t, Hkv, d].
::testing::AssertionResult CacheHolds(const cpu::PagedKVCache& cache, int seq,
                                      const std::vector<uint16_t> (&rows)[2]);

// fp32 rows rounded to bf16 (RNE), as the cache stores them, and bf16 bits widened back to fp32
// (exact).
std::vector<uint16_t> ToBf16(const std::vector<float>& x);
std::vector<float> FromBf16(const std::vector<uint16_t>& bits);

}  // namespace kvq::testbed
