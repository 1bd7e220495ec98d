// The golden-vector generator: collects the cases of every family, the fixtures they share,
// and writes them with manifest.json (generator.h).
#include "kvq/conformance/generator.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/tensor.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/manifest.h"
#include "kvq/conformance/sha256.h"
#include "generator_internal.h"

namespace kvq::conformance {
namespace internal {
namespace {

// How many matrices each fixture holds: enough for per-head K and V rotations of the cache
// cases at d = 64, while the d = 256 fixture (256 KiB a matrix) stays at one.
int MatricesFor(int head_dim) { return head_dim == 64 ? 4 : head_dim == 128 ? 2 : 1; }

void PutCommonMetadata(Safetensors* file, uint64_t case_seed, uint64_t global_seed,
                       const char* spec_version) {
  file->metadata["spec_version"] = spec_version;
  file->metadata["generator"] = kGeneratorName;
  file->metadata["generator_version"] = kGeneratorVersion;
  file->metadata["seed"] = std::to_string(case_seed);
  file->metadata["global_seed"] = std::to_string(global_seed);
}

}  // namespace

std::string RhoTag(float rho) {
  std::string text = ShortestFloat(rho);
  std::replace(text.begin(), text.end(), '.', 'p');
  return "rho" + text;
}

Safetensors VectorCollector::NewCase(const std::string& name, CaseKind kind, SplitMix64* rng,
                                     const char* spec_version) const {
  const uint64_t case_seed = CaseSeed(seed_, name);
  *rng = SplitMix64(case_seed);
  Safetensors file;
  file.metadata["format"] = kCaseFormat;
  PutCommonMetadata(&file, case_seed, seed_, spec_version);
  file.metadata["case"] = name;
  file.metadata["kind"] = CaseKindName(kind);
  return file;
}

void VectorCollector::AddCase(const std::string& name, CaseKind kind, const Safetensors& file) {
  const std::string path = name + ".safetensors";
  for (const Entry& e : entries_) {
    KVQ_CHECK(e.path != path, kInvalidArgument, "generator: duplicate case '", name, "'");
  }
  // A case keeps the version of the rules it exercises (a 1.0 case stays byte-identical).
  const std::string labelled = CaseMetadata(file).String("spec_version");
  KVQ_CHECK(labelled == RequiredSpecVersion(file), kInvalidArgument, "generator: case '", name,
            "' is labelled spec ", labelled, " but its parameters need spec ",
            RequiredSpecVersion(file));
  entries_.push_back(Entry{path, "case", CaseKindName(kind), SerializeSafetensors(file)});
}

std::string VectorCollector::EnsureFixture(int head_dim) {
  const std::string path = "fixtures/rotations_d" + std::to_string(head_dim) + ".safetensors";
  if (fixtures_.count(path) != 0) return path;
  const int m = MatricesFor(head_dim);
  SplitMix64 rng(CaseSeed(seed_, path));
  std::vector<float> all;
  for (int i = 0; i < m; ++i) {
    const std::vector<float> r = RandomOrthogonal(head_dim, &rng);
    all.insert(all.end(), r.begin(), r.end());
  }
  Safetensors file;
  file.metadata["format"] = kFixtureFormat;
  PutCommonMetadata(&file, CaseSeed(seed_, path), seed_, "1.0");
  file.metadata["description"] =
      "random orthogonal matrices (Gram-Schmidt in fp64, rounded once to fp32), row-major";
  file.Add("rotations", Tensor::F32({m, head_dim, head_dim}, all));
  std::vector<uint8_t> bytes = SerializeSafetensors(file);
  fixtures_[path] = Fixture{Sha256Hex(bytes), std::move(file)};
  entries_.push_back(Entry{path, "fixture", "", std::move(bytes)});
  return path;
}

int VectorCollector::FixtureMatrices(int head_dim) { return MatricesFor(head_dim); }

std::string VectorCollector::AddRotationFixture(const std::string& name,
                                                const std::string& description, int head_dim,
                                                const std::vector<float>& matrices) {
  const std::string path = "fixtures/" + name + ".safetensors";
  KVQ_CHECK(fixtures_.count(path) == 0, kInvalidArgument, "generator: duplicate fixture '", path,
            "'");
  const int64_t dd = static_cast<int64_t>(head_dim) * head_dim;
  KVQ_CHECK(!matrices.empty() && static_cast<int64_t>(matrices.size()) % dd == 0,
            kInvalidArgument, "generator: fixture '", path, "' holds ", matrices.size(),
            " values, not whole ", head_dim, "x", head_dim, " matrices");
  Safetensors file;
  file.metadata["format"] = kFixtureFormat;
  PutCommonMetadata(&file, CaseSeed(seed_, path), seed_, "1.0");
  file.metadata["description"] = description;
  file.Add("rotations", Tensor::F32({static_cast<int64_t>(matrices.size()) / dd, head_dim,
                                     head_dim},
                                    matrices));
  std::vector<uint8_t> bytes = SerializeSafetensors(file);
  fixtures_[path] = Fixture{Sha256Hex(bytes), std::move(file)};
  entries_.push_back(Entry{path, "fixture", "", std::move(bytes)});
  return path;
}

void VectorCollector::UseFixtureRotations(Safetensors* file, const std::string& path,
                                          const std::string& index_tensor,
                                          const std::vector<int32_t>& indices) {
  auto it = fixtures_.find(path);
  KVQ_CHECK(it != fixtures_.end(), kInvalidArgument, "generator: no fixture '", path, "'");
  const int64_t m = it->second.file.Get("rotations").shape[0];
  for (int32_t i : indices) {
    KVQ_CHECK(i >= 0 && i < m, kInvalidArgument, "generator: rotation index ", i, " past the ",
              m, " matrices of ", path);
  }
  file->metadata["rotation_fixture"] = path;
  file->metadata["rotation_fixture_sha256"] = it->second.sha256;
  file->Add(index_tensor, Tensor::I32({static_cast<int64_t>(indices.size())}, indices));
}

void VectorCollector::UseRotations(Safetensors* file, int head_dim, const std::string& index_tensor,
                                   const std::vector<int32_t>& indices) {
  const std::string path = EnsureFixture(head_dim);
  for (int32_t i : indices) {
    KVQ_CHECK(i >= 0 && i < MatricesFor(head_dim), kInvalidArgument, "generator: rotation index ",
              i, " past the d=", head_dim, " fixture");
  }
  file->metadata["rotation_fixture"] = path;
  file->metadata["rotation_fixture_sha256"] = fixtures_.at(path).sha256;
  file->Add(index_tensor, Tensor::I32({static_cast<int64_t>(indices.size())}, indices));
}

}  // namespace internal

std::vector<GeneratedFile> GenerateVectorFiles(uint64_t seed) {
  internal::VectorCollector collector(seed);
  internal::AddStageCases(&collector);
  internal::AddPipelineCases(&collector);
  internal::AddCacheAndAttentionCases(&collector);
  internal::AddSchemeAttentionCases(&collector);

  std::vector<GeneratedFile> files;
  Manifest manifest;
  manifest.spec_version = kSpecVersion;
  manifest.generator_version = kGeneratorVersion;
  manifest.seed = seed;
  for (const internal::VectorCollector::Entry& e : collector.entries()) {
    manifest.files.push_back(ManifestEntry{e.path, e.role, e.kind, Sha256Hex(e.bytes),
                                           static_cast<uint64_t>(e.bytes.size())});
    files.push_back(GeneratedFile{e.path, e.bytes});
  }
  std::sort(manifest.files.begin(), manifest.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  std::sort(files.begin(), files.end(),
            [](const GeneratedFile& a, const GeneratedFile& b) { return a.path < b.path; });
  files.push_back(GeneratedFile{kManifestFileName, SerializeManifest(manifest)});
  return files;
}

GenerateSummary GenerateVectors(const std::string& out_dir, uint64_t seed) {
  namespace fs = std::filesystem;
  const std::vector<GeneratedFile> files = GenerateVectorFiles(seed);
  const fs::path root(out_dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  KVQ_CHECK(!ec && fs::is_directory(root), kIoError, "cannot create folder '", out_dir,
            "': ", ec.message());
  // An earlier set's files that this set does not write again are removed, so no stale case
  // survives a regeneration; but only those its manifest.json lists: a file kvq never wrote is
  // never touched.
  GenerateSummary summary;
  const fs::path old_manifest = root / kManifestFileName;
  if (fs::exists(old_manifest)) {
    Manifest old;
    try {
      old = ParseManifest(ReadFileBytes(old_manifest.string()));
    } catch (const Error& e) {
      throw Error(e.code(), detail::Concat("cannot regenerate into '", out_dir, "': ", e.what(),
                                           " (without it kvq cannot tell which files there it "
                                           "wrote; move it away or choose another folder)"));
    }
    std::set<std::string> fresh;
    for (const GeneratedFile& f : files) fresh.insert(f.path);
    for (const ManifestEntry& e : old.files) {
      if (fresh.count(e.path) != 0) continue;
      const bool removed = fs::remove(root / e.path, ec);
      KVQ_CHECK(!ec, kIoError, "cannot remove stale '", (root / e.path).string(), "': ",
                ec.message());
      summary.removed += removed ? 1 : 0;
    }
  }
  for (const GeneratedFile& f : files) {
    const fs::path path = root / f.path;
    fs::create_directories(path.parent_path(), ec);
    KVQ_CHECK(!ec, kIoError, "cannot create folder '", path.parent_path().string(), "': ",
              ec.message());
    WriteFile(path.string(), f.bytes);
    ++summary.files;
    summary.bytes += f.bytes.size();
    if (f.path.rfind("fixtures/", 0) == 0) {
      ++summary.fixtures;
    } else if (f.path != kManifestFileName) {
      ++summary.cases;
    }
  }
  return summary;
}

}  // namespace kvq::conformance
