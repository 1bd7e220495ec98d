// The golden-vector generator behind `kvq vectors generate`: builds every case from a seed
// with the conformance PRNG, takes the expected values from the SCALAR backend (bits) and
// the fp64 attention reference, and writes one safetensors file per case plus manifest.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq::conformance {

struct GeneratedFile {
  std::string path;  // relative to the vectors folder; "manifest.json" is the last entry
  std::vector<uint8_t> bytes;
};

// The whole set in memory, sorted by path, manifest.json last. Deterministic: the same seed
// gives the same bytes. Throws kvq::Error if the scalar oracle's attention misses its own
// tolerance against the fp64 reference (the vectors would be unusable).
std::vector<GeneratedFile> GenerateVectorFiles(uint64_t seed);

struct GenerateSummary {
  size_t files = 0;     // manifest.json included
  uint64_t bytes = 0;   // total size
  size_t cases = 0;
  size_t fixtures = 0;
  size_t removed = 0;   // stale files of the earlier set (listed by its manifest) removed
};

// Writes GenerateVectorFiles(seed) under out_dir (created if missing). The files of an earlier
// set that its manifest.json lists and this set does not write are removed, so no stale case
// survives; no other file is touched. Throws kvq::Error: kIoError when a folder or file cannot
// be written or removed; the manifest reader's error, naming the folder, when an existing
// manifest.json cannot be read (then nothing is written).
GenerateSummary GenerateVectors(const std::string& out_dir, uint64_t seed);

}  // namespace kvq::conformance
