// manifest.json of a golden-vector folder: every file with its SHA-256 and size, the spec and
// generator versions and the seed. The runner replays nothing until every hash matches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq::conformance {

struct ManifestEntry {
  std::string path;    // relative to the vectors folder, '/'-separated
  std::string role;    // "case" or "fixture"
  std::string kind;    // the case kind (stage, pipeline, cache, attention); "" for fixtures
  std::string sha256;  // 64 lowercase hex characters
  uint64_t bytes = 0;
};

struct Manifest {
  std::string spec_version;
  std::string generator_version;
  uint64_t seed = 0;
  std::vector<ManifestEntry> files;  // sorted by path
};

// Pretty-printed JSON, a trailing newline, keys in a fixed order (byte-stable).
std::vector<uint8_t> SerializeManifest(const Manifest& manifest);
// Throws kvq::Error(kMalformedFile) naming the problem.
Manifest ParseManifest(const std::vector<uint8_t>& bytes);

struct VerifiedFile {
  ManifestEntry entry;
  std::vector<uint8_t> bytes;
};

// Reads dir/manifest.json and every file it lists, and checks each file's size and SHA-256.
// Throws kvq::Error: kIoError (a missing file), kMalformedFile (a bad manifest), kMismatch
// (spec version other than kSpecVersion, a hash or size that differs: "manifest check failed:
// '<path>' has SHA-256 <got> but manifest.json lists <expected>", or a *.safetensors file in
// the folder that the manifest does not list).
std::vector<VerifiedFile> ReadVerifiedFiles(const std::string& dir, Manifest* manifest);

}  // namespace kvq::conformance
