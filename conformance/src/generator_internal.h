// Shared by the generator's translation units: the case/fixture collector and the per-family
// case builders.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/prng.h"

namespace kvq::conformance::internal {

class VectorCollector {
 public:
  explicit VectorCollector(uint64_t seed) : seed_(seed) {}
  uint64_t seed() const { return seed_; }

  // A case with the common metadata (format, spec_version, generator, generator_version, seed,
  // global_seed, case, kind); *rng is seeded from (global seed, name). spec_version: the
  // version whose rules the case exercises (AddCase checks it against RequiredSpecVersion).
  Safetensors NewCase(const std::string& name, CaseKind kind, SplitMix64* rng,
                      const char* spec_version) const;
  // Stores the case as <name>.safetensors; throws on a duplicate name.
  void AddCase(const std::string& name, CaseKind kind, const Safetensors& file);

  // The dense rotation fixtures, created on first use: fixtures/rotations_d<d>.safetensors,
  // F32 "rotations" [m, d, d] of random orthogonal matrices.
  const Fixtures& fixtures() const { return fixtures_; }
  int FixtureMatrices(int head_dim);  // m
  // Names the d fixture in file's metadata and adds I32 tensor `index_tensor` = indices.
  void UseRotations(Safetensors* file, int head_dim, const std::string& index_tensor,
                    const std::vector<int32_t>& indices);
  // A fixture of the given matrices (F32 "rotations" [m, d, d]) at fixtures/<name>.safetensors
  // for the cases whose matrices are their own (the scheme cases); returns its path. Throws on
  // a duplicate name.
  std::string AddRotationFixture(const std::string& name, const std::string& description,
                                 int head_dim, const std::vector<float>& matrices);
  // As UseRotations, with the fixture at `path` (from AddRotationFixture).
  void UseFixtureRotations(Safetensors* file, const std::string& path,
                           const std::string& index_tensor, const std::vector<int32_t>& indices);

  struct Entry {
    std::string path, role, kind;
    std::vector<uint8_t> bytes;
  };
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::string EnsureFixture(int head_dim);

  uint64_t seed_;
  Fixtures fixtures_;
  std::vector<Entry> entries_;
};

// A cache script as "in.ops" triples (op, slot, tokens), counting the rows it consumes.
class Script {
 public:
  int Add() {
    Push(CacheOp::kAddSequence, slots_, 0);
    return slots_++;
  }
  void Prefill(int slot, int tokens) {
    Push(CacheOp::kPrefill, slot, tokens);
    rows_ += static_cast<size_t>(tokens);
  }
  void Append(int slot) {
    Push(CacheOp::kAppend, slot, 1);
    rows_ += 1;
  }
  void Remove(int slot) { Push(CacheOp::kRemoveSequence, slot, 0); }

  const std::vector<int32_t>& ops() const { return ops_; }
  size_t rows() const { return rows_; }

 private:
  void Push(CacheOp op, int slot, int tokens) {
    ops_.insert(ops_.end(), {static_cast<int32_t>(op), slot, tokens});
  }
  std::vector<int32_t> ops_;
  int slots_ = 0;
  size_t rows_ = 0;
};

// One cache or attention case's configuration (generate_cache.cc turns it into inputs).
struct CacheConfig {
  std::string name;
  CacheParams params;
  std::vector<int32_t> rotation_k, rotation_v;  // fixture indices per KV head (dense only)
  std::string rotation_fixture;                 // their fixture; empty: rotations_d<d>
  HeadData key, value;  // per-head scalars (clip ratios, fp8 scales, ...); rotations above
  std::function<void(Script*)> script;
  std::map<std::string, std::string> metadata;  // extra case metadata (e.g. "scheme")
};

// Adds attention/<config.name>: the cache inputs, queries for every live sequence, the fp64
// reference and the scalar oracle checked against its tolerance (generate_cache.cc).
void AddAttentionCase(VectorCollector* out, const CacheConfig& config);

// "rho1", "rho0p96": the clip ratio in a file name.
std::string RhoTag(float rho);

void AddStageCases(VectorCollector* out);
void AddPipelineCases(VectorCollector* out);
void AddCacheAndAttentionCases(VectorCollector* out);
// attention/scheme_<id>: one case per scheme of the catalogue (calib/schemes.inc).
void AddSchemeAttentionCases(VectorCollector* out);

}  // namespace kvq::conformance::internal
