// The golden-vector case file (conformance/README.md): one safetensors file per case with
//   metadata  format, spec_version, generator, generator_version, seed, case, kind, ... and the
//             parameters (WriteParams / CacheParams fields as strings);
//   tensors   "in.*" (inputs) and "expect.*" (the scalar backend's outputs: bits, compared
//             exactly; attention outputs with the tolerance named in the metadata).
// This header holds the names and the metadata <-> parameter conversions that the generator
// and the runner share, so the two cannot disagree about the layout.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::conformance {

// The spec this build implements (the manifest's version). Each case carries the version whose
// rules it exercises: the first that defines everything it uses (SpecVersionOf), so a case of
// 1.0 keeps its bits and its "1.0" under every later version, and a runner replays the cases of
// every version up to its own (IsReplayableSpecVersion).
inline constexpr char kSpecVersion[] = "1.3";
inline constexpr char kGeneratorName[] = "kvq vectors generate";
inline constexpr char kGeneratorVersion[] = "1";
inline constexpr char kCaseFormat[] = "kvq-conformance-case";
inline constexpr char kFixtureFormat[] = "kvq-conformance-fixture";
inline constexpr char kManifestFileName[] = "manifest.json";
// The seed of the committed vectors (conformance/vectors).
inline constexpr uint64_t kDefaultSeed = 20261121;
// Attention tolerances written into every attention case (spec/cache.md §5), per query head
// max_j |o - ref| / max_j |ref| against the fp64 reference: the CPU oracle's, the CUDA path's.
inline constexpr double kAttentionCpuTolerance = 1e-5;
inline constexpr double kAttentionGpuTolerance = 1e-3;

// What a case exercises.
enum class CaseKind {
  kStage,      // one WriteKernels stage called directly (metadata "stage" names it)
  kPipeline,   // QuantizeRows: every stage's output of the whole write path
  kCache,      // a PagedKVCache script (prefill, appends with demotion, removal): storage bits
  kAttention,  // decode attention over a cache built by the scalar backend
};
const char* CaseKindName(CaseKind kind);
// Throws kvq::Error(kMalformedFile) naming an unknown kind.
CaseKind ParseCaseKind(const std::string& name);

// Operations of a cache script: tensor "in.ops" I32 [n, 3] = (op, sequence slot, tokens).
// Slots number sequences in the order they are added; prefill/append rows are taken in order
// from "in.k" / "in.v" BF16 [total tokens, Hkv, d].
enum class CacheOp : int32_t {
  kAddSequence = 0,     // slot = the next slot; tokens = 0
  kPrefill = 1,         // PrefillBf16(slot, tokens rows)
  kAppend = 2,          // AppendBf16(slot); tokens = 1
  kRemoveSequence = 3,  // RemoveSequence(slot); tokens = 0
};

// ---- Spec versions ----
// "1.0" or "1.1": whether this build replays cases of spec version `version`.
bool IsReplayableSpecVersion(const std::string& version);
// The first spec version that defines the parameters: 1.1 for the affine_tile format, a norm,
// G = d = 256, a flush granularity F > 1 and W = 0; 1.0 otherwise.
const char* SpecVersionOf(const WriteParams& p);
const char* SpecVersionOf(const CacheParams& p);
// The version a case's metadata requires: its parameters' (write parameters for stage and
// pipeline cases, cache parameters for cache and attention cases), and 1.1 for a stage that
// spec 1.1 introduced (norm, denorm and the affine_tile codec). Throws as the metadata readers.
const char* RequiredSpecVersion(const Safetensors& file);

// ---- Metadata ----
// The case's metadata through the one typed reader of kvq/common/metadata.h; errors start with
// "case <name>". Parameters are read and written with kvq::GetWriteParams / PutCacheParams, so
// a case, a quantized-rows file and a calibration file spell them the same way.
MetadataReader CaseMetadata(const Safetensors& file);
CacheParams GetCacheParams(const Safetensors& file);

// ---- Fixtures: data shared by many cases (the dense rotation matrices) ----
// A fixture file holds F32 "rotations" [m, d, d]. A case using one names it in metadata
// "rotation_fixture" (a path relative to the vectors folder) with its "rotation_fixture_sha256",
// and picks matrices by index tensors.
struct Fixture {
  std::string sha256;
  Safetensors file;
};
using Fixtures = std::map<std::string, Fixture>;  // by relative path

// The matrices [indices.size(), d, d] that index tensor `index_tensor` (I32 [m]) of `file`
// picks from its rotation fixture. Throws kvq::Error(kMalformedFile) for a missing fixture, a
// fixture whose SHA-256 differs from the one the case names, a shape mismatch or an index out
// of range.
std::vector<float> GatherRotations(const Safetensors& file, const Fixtures& fixtures,
                                   const std::string& index_tensor, int head_dim);

// ---- Cache cases (kCache and kAttention share the inputs) ----
// A cache built from a case's inputs and its script run on it.
struct ReplayedCache {
  std::unique_ptr<cpu::PagedKVCache> cache;
  std::vector<int> slot_ids;  // sequence id per slot; -1 once removed
};
// Builds the cache with CacheParams from the metadata, rotations "in.rotation_k_index" /
// "in.rotation_v_index" (dense only), the per-head scalars of head_data.inc "in.<name>_k" /
// "in.<name>_v" (F32 [Hkv], when present: clip ratios, fp8 scales), then runs "in.ops" with rows from "in.k" / "in.v". Throws kvq::Error for malformed
// inputs (kMalformedFile) and whatever the cache throws.
ReplayedCache ReplayCacheScript(const Safetensors& file, const Fixtures& fixtures,
                                const cpu::Backend& write_backend);
// Its second half, for scripts from elsewhere (the Python package's kvq.replay_cache): a cache
// of `params` with the per-head data `key` / `value`, then the script ops [num_ops, 3] with
// rows taken in order from k / v, bf16 bits [rows, Hkv, d]. `what` starts every message about
// the script ("case <name>"). Throws as ReplayCacheScript.
ReplayedCache RunCacheScript(const CacheParams& params, HeadData key, HeadData value,
                             const cpu::Backend& write_backend, const int32_t* ops,
                             size_t num_ops, const uint16_t* k, const uint16_t* v, size_t rows,
                             const std::string& what);

// Little-endian binary64 values as bytes (the "*_f64" tensors are U8 [..., 8]: safetensors'
// F64 is outside the formats.md subset).
std::vector<uint8_t> F64ToBytes(const std::vector<double>& values);
std::vector<double> BytesToF64(const std::vector<uint8_t>& bytes);

}  // namespace kvq::conformance
