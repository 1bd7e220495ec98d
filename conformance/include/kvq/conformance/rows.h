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

// The kinds of rows (row_kinds.inc: one row each, with what the rows hold).
enum class RowKind {
#define KVQ_ROW_KIND(Name, id, draw, norm_ok, summary) k##Name,
#include "kvq/conformance/row_kinds.inc"
#undef KVQ_ROW_KIND
};

const char* RowKindName(RowKind kind);

// The edge kinds the golden vectors draw (draw column kVectorsEdge), in list order.
const std::vector<RowKind>& EdgeRowKinds();
// Every kind the golden vectors draw, in list order (kRandom, kHeavyTail, then the edge kinds).
const std::vector<RowKind>& AllRowKinds();
// Every kind of the list: what the tests draw. `within_write_range` drops the kBeyondRange
// kinds (kNearLimit), whose rows the validating write path rejects after any rotation.
std::vector<RowKind> TestRowKinds(bool within_write_range = true);
// The kinds whose rows p's validating write path accepts after any rotation: TestRowKinds(true)
// without the kinds whose norm_ok column is false when p has a norm or is a codebook row
// (segment norms; their squares overflow fp32, and the write path rejects an infinite norm).
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
