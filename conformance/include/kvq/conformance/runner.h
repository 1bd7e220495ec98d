// Replays golden vectors against a backend: a CPU backend, the CUDA backend, or your own kernels
// filled into a cpu::Backend (conformance/README.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/manifest.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::conformance {

// What is replayed against a backend (an entry of AllBackends(), backends.h): stage cases call
// its WriteKernels through the stage specs (kvq/common/stages.inc), pipeline cases run
// cpu::QuantizeRows with it, cache cases build a cpu::PagedKVCache whose write path it is, and
// attention cases build the cache with the scalar backend and call its `attend` (none: the
// attention cases are skipped, never passed). The attention tolerance is the CPU oracle's
// (metadata "tolerance", 1e-5) or, for a CUDA backend, the CUDA path's ("tolerance_gpu", 1e-3).

enum class CaseStatus { kPass, kFail, kSkipped };
const char* CaseStatusName(CaseStatus status);

// The first difference found in a failing case.
struct Mismatch {
  std::string stage;     // the output compared: "codes", "tau", "pool.key.scale", "out", ...
  int64_t row = -1;      // flattened index over every dimension but the last (-1: none)
  int64_t column = -1;   // index in the last dimension (-1: none)
  std::string where;     // the full index, e.g. "[2, 1, 5, 7]", and what it means
  std::string expected;  // bits and value, e.g. "0x3f800000 (1)"
  std::string got;
};

struct CaseResult {
  std::string name;  // the case path without ".safetensors", e.g. "pipeline/d128_g64_b2_..."
  std::string kind;
  CaseStatus status = CaseStatus::kPass;
  Mismatch mismatch;    // filled for kFail when outputs differ
  std::string message;  // why it failed (mismatch summary or the error thrown) or was skipped
};

// A replay's failure: the first mismatch and its line. Thrown inside a case, caught by
// ReplayCase; returned by CompareBits.
struct CaseFailure {
  Mismatch mismatch;
  std::string message;  // "codes differs at row 1, column 5 [1, 5] of [3, 64] (row, column): ..."
};

// The one comparison of every replay (and of outside replays, e.g. the Python package's):
// `got` (raw bytes laid out as `expected`: same dtype and shape) against `expected` bit for
// bit; the first difference as a failure naming `output` and, when given, what the axes mean;
// nothing when every bit agrees. A size mismatch is kvq::Error(kShapeMismatch) naming `output`.
std::optional<CaseFailure> CompareBits(const std::string& output, const Tensor& expected,
                                       const void* got, size_t got_bytes,
                                       const std::string& axes = "");

// What the axes of write-path output `field` under p mean, from the stage argument that writes
// it (p's encode steps, then the transforms): "row, column", "tile, channel, byte", ...
const char* OutputAxes(const WriteParams& p, const std::string& field);

// What the axes of cache-case output `output` (an expect.* name without "expect.") mean, as the
// cache replay reports them: "page, KV head, slot, element" for a pool plane ("pool.key.codes"),
// "length, sink, history, recent begin" for "seq<s>.shape", "page index" for a page table,
// "position, KV head, channel" for sink and dense rows, "position - recent begin, KV head,
// channel" for recent rows, "pages created, pages free" for "pool_pages"; "" for another name.
const char* CacheOutputAxes(const std::string& output);

// Attention cases (kAttention), the two halves of their replay, shared with outside replays:
// the sequence id of the case's query `query` (in.query_slots[query]) in `replayed`, and the
// verdict on `out` fp32 [Hq, d], a kernel's output for that query: nothing when every head is
// finite and its relative error max_j |o - ref| / max_j |ref| against expect.reference_f64 is
// <= tolerance (spec/cache.md §5), else the worst channel of the first head that is not, as a
// failure of output "out". Throw kvq::Error(kInvalidArgument) for a query out of range,
// kMalformedFile for a slot that is not a live sequence.
int QuerySequence(const Safetensors& c, const ReplayedCache& replayed, int64_t query);
std::optional<CaseFailure> CompareAttention(const Safetensors& c, int64_t query,
                                            const float* out, double tolerance);

// A verified, parsed vectors folder.
struct VectorSet {
  std::string dir;
  Manifest manifest;
  Fixtures fixtures;
  std::vector<std::string> case_names;  // manifest order
  std::vector<Safetensors> cases;
};

// Verifies manifest.json (every SHA-256; see ReadVerifiedFiles) and parses every file. Throws
// kvq::Error: kMismatch for a failed hash check or another spec version, kMalformedFile for a
// file that is not a case of this format.
VectorSet LoadVectorSet(const std::string& dir);

// Replays one case. Never throws for a target's misbehaviour: errors thrown while replaying
// become a kFail result carrying the message.
CaseResult ReplayCase(const VectorSet& vectors, size_t index, const cpu::Backend& backend);
std::vector<CaseResult> RunConformance(const VectorSet& vectors, const cpu::Backend& backend);
// LoadVectorSet(dir) then RunConformance (throws as LoadVectorSet does).
std::vector<CaseResult> RunConformance(const std::string& dir, const cpu::Backend& backend);

// One line: "FAIL pipeline/...: codes differs at [row 3, column 17] (...): expected 2, got 1".
std::string DescribeResult(const CaseResult& result);

// The default vectors folder of `kvq conform` (no path is compiled in): the first folder holding
// manifest.json of (1) vectors/ beside the running executable (/proc/self/exe; the build puts
// a link to conformance/vectors beside kvq), (2) ../share/kvq/vectors from it (an installed
// kvq), (3) $KVQ_VECTORS_DIR. Throws kvq::Error(kIoError) naming every place it looked and
// what it found there.
std::string DefaultVectorsDir();

}  // namespace kvq::conformance
