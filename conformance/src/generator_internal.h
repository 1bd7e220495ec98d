// Shared by the generator's translation units: the case/fixture collector and the per-family
// case builders.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/params.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/prng.h"

namespace kvq::conformance::internal {

class VectorCollector {
 public:
  explicit VectorCollector(uint64_t seed) : seed_(seed) {}
  uint64_t seed() const { return seed_; }

  // A case with the common metadata (format, spec_version, generator, generator_version, seed,
  // global_seed, case, kind); *rng is seeded from (global seed, name).
  Safetensors NewCase(const std::string& name, CaseKind kind, SplitMix64* rng) const;
  // Stores the case as <name>.safetensors; throws on a duplicate name.
  void AddCase(const std::string& name, CaseKind kind, const Safetensors& file);

  // The dense rotation fixtures, created on first use: fixtures/rotations_d<d>.safetensors,
  // F32 "rotations" [m, d, d] of random orthogonal matrices.
  const Fixtures& fixtures() const { return fixtures_; }
  int FixtureMatrices(int head_dim);  // m
  // Names the d fixture in file's metadata and adds I32 tensor `index_tensor` = indices.
  void UseRotations(Safetensors* file, int head_dim, const std::string& index_tensor,
                    const std::vector<int32_t>& indices);

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

// "rho1", "rho0p96": the clip ratio in a file name.
std::string RhoTag(float rho);

void AddStageCases(VectorCollector* out);
void AddPipelineCases(VectorCollector* out);
void AddCacheAndAttentionCases(VectorCollector* out);

}  // namespace kvq::conformance::internal
