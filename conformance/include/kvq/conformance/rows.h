// The one row generator of kvq's tests and golden vectors: random rows and the edge rows the
// spec's corner cases hinge on (signed zeros, constant groups, subnormals, rounding ties,
// magnitudes near the 2^126 limit, ...). Every value is built from SplitMix64 bits with exact
// arithmetic, so a seed gives the same rows on every compiler and CPU.
#pragma once

#include <string>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/conformance/prng.h"

namespace kvq::conformance {

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
  // Kinds the tests add (the golden vectors' lists below never draw them, so the committed
  // vectors do not depend on them):
  kBf16Bell,       // bell-shaped times 4, rounded to bf16 as K/V rows arrive (many exact ties)
  kCauchy,         // bell / (|uniform| + 2^-20) capped at 1e6: heavy tails on every channel
  kSparseSpikes,   // bell-shaped with ~3% of the channels x 100
  kLargeScale,     // bell-shaped times 2^66 (~7e19)
  kTinyScale,      // bell-shaped times 2^-100 (~8e-31)
  kSmallIntegers,  // integers in [-4, 4]: equal magnitudes, zeros, ties everywhere
  kLargeOffset,    // 1001 + {0, 0.5, 1}: bf16(min) is several scale steps away from the min
  kNearLimit,      // magnitudes up to 1.2e38 (> 2^126): rejected by the validating write path
  kMinimal,        // the smallest normal and subnormal magnitudes, and zeros
  kRamp,           // +-j/2: every magnitude twice, both signs of the clip threshold
  kFarOutliers,    // bell-shaped with three channels +-2^e (1 + u), e in [0, 100]: up to ~2.5e30
  kEqualMagnitudes,  // nine in ten entries +-c (c in [1, 2), a full mantissa), the rest bell x 4:
                     // the clip's order statistic falls in a run of equal magnitudes
  kWideRange,      // +-2^e (1 + u), e in [-100, 100] per entry: ~8e-31 .. ~2.5e30 in one row
  kSignedOffset,   // +-2^e (1 + u), e in [9, 11], plus bell x 2^-10: a common offset of either
                   // sign, bf16(min) many scale steps below or above the min
};

const char* RowKindName(RowKind kind);

// Every edge kind (everything but kRandom and kHeavyTail), in a fixed order.
const std::vector<RowKind>& EdgeRowKinds();
// Every kind the golden vectors draw, kRandom first (kRandom, kHeavyTail, then the edge kinds).
const std::vector<RowKind>& AllRowKinds();
// Every kind of the enum: what the tests draw. `within_write_range` drops kNearLimit, whose
// rows the validating write path rejects after any rotation.
std::vector<RowKind> TestRowKinds(bool within_write_range = true);
// The kinds whose rows p's validating write path accepts after any rotation: TestRowKinds(true)
// without kHuge, kLargeScale, kFarOutliers and kWideRange when p has a norm (their squares
// overflow fp32, and the write path rejects an infinite norm).
std::vector<RowKind> TestRowKinds(const WriteParams& p);

// Fills row [p.head_dim] with a row of `kind` (p.group and p.bits shape the tie rows).
void FillRow(RowKind kind, const WriteParams& p, SplitMix64* rng, float* row);

// n rows, row-major, whose kinds take `kinds` in turn (row r is kinds[r % kinds.size()]): with
// n >= kinds.size(), every kind at least once.
std::vector<float> MixedRows(size_t n, const WriteParams& p, SplitMix64* rng,
                             const std::vector<RowKind>& kinds = TestRowKinds());

// n rows of the given kinds, row-major, with the kinds' names joined by "," (names may be null).
std::vector<float> MakeRows(const std::vector<RowKind>& kinds, const WriteParams& p,
                            SplitMix64* rng, std::string* names);

// The fp32 values the fp8 e4m3 conversion hinges on (spec/numerics.md §9), both signs: every
// finite e4m3 value, every midpoint between two neighbours (a rounding tie) and the fp32 values
// just below and above it, the saturation edge (448, the would-be tie 464 with 480, 1e30,
// FLT_MAX, Inf), the bottom of the subnormals (2^-10, the smallest fp32 subnormal) and +-0.
// Multiplied by a power of two s they stay exact, so x / s lands on the same boundaries.
std::vector<float> Fp8BoundaryValues();

}  // namespace kvq::conformance
