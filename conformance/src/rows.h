// The kinds of input rows the golden vectors use: random rows and the edge rows the spec's
// corner cases hinge on (signed zeros, constant groups, subnormals, rounding ties, ...).
#pragma once

#include <string>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/conformance/prng.h"

namespace kvq::conformance::internal {

enum class RowKind {
  kRandom,         // uniform [-1, 1) times a random power of two in [2^-4, 2^4]
  kHeavyTail,      // bell-shaped, with two channels 8x larger (key-like outlier channels)
  kZeros,          // all +0
  kNegativeZeros,  // all -0: lo + 0.0f must turn the stored min into +0
  kMixedZeros,     // +0 and -0 at random: min/max order must not matter
  kConstant,       // one value everywhere: scale 0, every code 0
  kOutlier,        // small values and one channel near +-1000
  kSubnormal,      // fp32 subnormals (and zeros) of both signs
  kTies,           // per group, (x - min) / scale lands exactly on k + 0.5 (even groups) or the
                   // scale and min are bf16 rounding ties (odd groups)
  kHuge,           // magnitudes up to 2^111, mixed with small values
  kDuplicates,     // values from {0, +-0.5, +-1, +-1.5, +-2}: ties in the clip's order statistic
};

const char* RowKindName(RowKind kind);

// Every edge kind (everything but kRandom and kHeavyTail), in a fixed order.
const std::vector<RowKind>& EdgeRowKinds();
// Every kind, kRandom first.
const std::vector<RowKind>& AllRowKinds();

// Fills row [p.head_dim] with a row of `kind` (p.group and p.bits shape the tie rows).
void FillRow(RowKind kind, const WriteParams& p, SplitMix64* rng, float* row);

// n rows of the given kinds, row-major, with the kinds' names joined by ",".
std::vector<float> MakeRows(const std::vector<RowKind>& kinds, const WriteParams& p,
                            SplitMix64* rng, std::string* names);

}  // namespace kvq::conformance::internal
