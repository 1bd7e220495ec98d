// The conformance runner: freshly generated vectors pass on every CPU backend; a corrupted
// expected value is reported as a failure naming the case, stage, row and column; a tampered
// or unlisted file fails the manifest check; a broken kernel is caught.
#include "kvq/conformance/runner.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/numeric.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/generator.h"
#include "kvq/conformance/manifest.h"
#include "kvq/conformance/sha256.h"
#include "kvq/cpu_ref/attention.h"

namespace kvq::conformance {
namespace {

namespace fs = std::filesystem;

// The generated set, once per test binary (generation takes a few seconds).
const std::vector<GeneratedFile>& Generated() {
  static const std::vector<GeneratedFile> files = GenerateVectorFiles(kDefaultSeed);
  return files;
}

class ConformanceRunner : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("kvq_conformance_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    for (const GeneratedFile& f : Generated()) {
      fs::create_directories((dir_ / f.path).parent_path());
      WriteFile((dir_ / f.path).string(), f.bytes);
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& relative) const { return (dir_ / relative).string(); }

  // Rewrites a case file and, when `update_manifest`, its manifest entry (so that only the
  // replay can notice the change).
  void Rewrite(const std::string& relative, const Safetensors& file, bool update_manifest) {
    const std::vector<uint8_t> bytes = SerializeSafetensors(file);
    WriteFile(Path(relative), bytes);
    if (!update_manifest) return;
    Manifest manifest = ParseManifest(ReadFileBytes(Path(kManifestFileName)));
    for (ManifestEntry& e : manifest.files) {
      if (e.path != relative) continue;
      e.sha256 = Sha256Hex(bytes);
      e.bytes = bytes.size();
    }
    WriteFile(Path(kManifestFileName), SerializeManifest(manifest));
  }

  static const CaseResult& Find(const std::vector<CaseResult>& results, const std::string& name) {
    for (const CaseResult& r : results) {
      if (r.name == name) return r;
    }
    ADD_FAILURE() << "no result for case " << name;
    static const CaseResult none;
    return none;
  }

  static size_t CountFailures(const std::vector<CaseResult>& results) {
    size_t n = 0;
    for (const CaseResult& r : results) n += r.status == CaseStatus::kFail;
    return n;
  }

  fs::path dir_;
};

TEST_F(ConformanceRunner, FreshVectorsPassOnEveryCpuBackend) {
  const VectorSet vectors = LoadVectorSet(dir_.string());
  ASSERT_GT(vectors.cases.size(), 250u);
  for (const cpu::Backend& backend : cpu::Backends()) {
    const std::vector<CaseResult> results = RunConformance(vectors, backend);
    ASSERT_EQ(results.size(), vectors.cases.size());
    for (const CaseResult& r : results) {
      EXPECT_EQ(r.status, CaseStatus::kPass) << backend.name << ": " << DescribeResult(r);
    }
  }
}

TEST_F(ConformanceRunner, EveryStageAndKindIsCovered) {
  const VectorSet vectors = LoadVectorSet(dir_.string());
  std::map<std::string, int> stages, kinds;
  for (const Safetensors& c : vectors.cases) {
    ++kinds[CaseMetadata(c).String("kind")];
    if (CaseMetadata(c).String("kind") == "stage") ++stages[CaseMetadata(c).String("stage")];
  }
  for (const StageSpec& stage : AllStages()) EXPECT_GT(stages[stage.name], 0) << stage.name;
  EXPECT_GE(kinds["pipeline"], 192);  // the full d x G x bits x rho x rotation grid
  EXPECT_GT(kinds["cache"], 0);
  EXPECT_GT(kinds["attention"], 0);
}

TEST_F(ConformanceRunner, CorruptedExpectedCodeIsReportedWithCaseRowAndColumn) {
  const std::string name = "pipeline/d128_g64_b2_rho0p96_dense";
  const std::string relative = name + ".safetensors";
  Safetensors file = ReadSafetensors(Path(relative));
  Tensor& codes = const_cast<Tensor&>(file.Get("expect.codes"));
  ASSERT_EQ(codes.shape, (std::vector<int64_t>{3, 128}));
  codes.data<uint8_t>()[2 * 128 + 17] ^= 1;  // row 2, column 17: one bit
  Rewrite(relative, file, /*update_manifest=*/true);

  const std::vector<CaseResult> results =
      RunConformance(dir_.string(), cpu::ScalarBackend());
  const CaseResult& r = Find(results, name);
  ASSERT_EQ(r.status, CaseStatus::kFail) << DescribeResult(r);
  EXPECT_EQ(r.mismatch.stage, "codes");
  EXPECT_EQ(r.mismatch.row, 2);
  EXPECT_EQ(r.mismatch.column, 17);
  const std::string line = DescribeResult(r);
  EXPECT_NE(line.find(name), std::string::npos) << line;
  EXPECT_NE(line.find("row 2, column 17"), std::string::npos) << line;
  EXPECT_EQ(CountFailures(results), 1u);  // nothing else
}

TEST_F(ConformanceRunner, CorruptedTauBitIsReportedAtItsRow) {
  const std::string name = "stage/clip_d64_rho0p92";
  const std::string relative = name + ".safetensors";
  Safetensors file = ReadSafetensors(Path(relative));
  Tensor& tau = const_cast<Tensor&>(file.Get("expect.tau"));
  uint32_t bits = F32Bits(tau.data<float>()[3]) ^ 1u;  // the last mantissa bit of row 3
  tau.data<float>()[3] = F32FromBits(bits);
  Rewrite(relative, file, true);

  const std::vector<CaseResult> results =
      RunConformance(dir_.string(), cpu::BestBackend());
  const CaseResult& r = Find(results, name);
  ASSERT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.mismatch.stage, "tau");
  EXPECT_EQ(r.mismatch.row, 3);
  EXPECT_NE(r.mismatch.expected, r.mismatch.got);
  EXPECT_EQ(CountFailures(results), 1u);
}

TEST_F(ConformanceRunner, CorruptedCachePageBitIsReported) {
  const std::string name = "cache/d64_b2_g32_dense_s4_w8_p16";
  const std::string relative = name + ".safetensors";
  Safetensors file = ReadSafetensors(Path(relative));
  Tensor& scale = const_cast<Tensor&>(file.Get("expect.pool.value.scale"));
  ASSERT_EQ(scale.shape.size(), 4u);
  // Page 1, head 0, slot 3, group 1.
  const size_t flat = ((1 * scale.shape[1] + 0) * scale.shape[2] + 3) * scale.shape[3] + 1;
  scale.data<uint16_t>()[flat] ^= 0x0001;
  Rewrite(relative, file, true);

  const std::vector<CaseResult> results =
      RunConformance(dir_.string(), cpu::ScalarBackend());
  const CaseResult& r = Find(results, name);
  ASSERT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.mismatch.stage, "pool.value.scale");
  EXPECT_EQ(r.mismatch.column, 1);
  EXPECT_NE(r.mismatch.where.find("[1, 0, 3, 1]"), std::string::npos) << r.mismatch.where;
}

TEST_F(ConformanceRunner, AttentionOutsideToleranceIsReported) {
  const std::string name = "attention/d128_b2_g64_dense_long";
  const std::string relative = name + ".safetensors";
  Safetensors file = ReadSafetensors(Path(relative));
  Tensor& ref = const_cast<Tensor&>(file.Get("expect.reference_f64"));
  std::vector<double> values = BytesToF64(ref.bytes);
  const int d = 128;
  // Query 0, head 1, channel 5 moved by 1e-3 of the head's largest magnitude: far beyond the
  // CPU tolerance 1e-5, within the GPU's 1e-3 only if nothing else differs.
  double max_ref = 0;
  for (int j = 0; j < d; ++j) max_ref = std::max(max_ref, std::fabs(values[1 * d + j]));
  values[1 * d + 5] += 1e-3 * max_ref;
  ref.bytes = F64ToBytes(values);
  Rewrite(relative, file, true);

  const std::vector<CaseResult> results =
      RunConformance(dir_.string(), cpu::ScalarBackend());
  const CaseResult& r = Find(results, name);
  ASSERT_EQ(r.status, CaseStatus::kFail);
  EXPECT_EQ(r.mismatch.stage, "out");
  EXPECT_EQ(r.mismatch.row, 1);  // query 0 * Hq + head 1
  EXPECT_EQ(r.mismatch.column, 5);
}

TEST_F(ConformanceRunner, TamperedFileFailsTheManifestCheck) {
  const std::string relative = "stage/quantize_d64_g32_b2.safetensors";
  std::vector<uint8_t> bytes = ReadFileBytes(Path(relative));
  bytes[bytes.size() - 1] ^= 0x80;
  WriteFile(Path(relative), bytes);
  try {
    LoadVectorSet(dir_.string());
    FAIL() << "a tampered file passed the manifest check";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    const std::string message = e.what();
    EXPECT_NE(message.find("manifest check failed"), std::string::npos) << message;
    EXPECT_NE(message.find(relative), std::string::npos) << message;
    EXPECT_NE(message.find(Sha256Hex(bytes)), std::string::npos) << message;
  }
  EXPECT_THROW(RunConformance(dir_.string(), cpu::ScalarBackend()), Error);
}

TEST_F(ConformanceRunner, TamperedFixtureFailsTheManifestCheck) {
  const std::string relative = "fixtures/rotations_d64.safetensors";
  std::vector<uint8_t> bytes = ReadFileBytes(Path(relative));
  bytes[bytes.size() / 2] ^= 0x01;
  WriteFile(Path(relative), bytes);
  try {
    LoadVectorSet(dir_.string());
    FAIL() << "a tampered fixture passed the manifest check";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find(relative), std::string::npos) << e.what();
  }
}

TEST_F(ConformanceRunner, UnlistedCaseFileFailsTheManifestCheck) {
  fs::copy_file(Path("stage/bitrev_d64.safetensors"), Path("stage/stray.safetensors"));
  try {
    LoadVectorSet(dir_.string());
    FAIL() << "an unlisted file was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find("stage/stray.safetensors"), std::string::npos)
        << e.what();
  }
}

TEST_F(ConformanceRunner, OtherSpecVersionIsRejected) {
  Manifest manifest = ParseManifest(ReadFileBytes(Path(kManifestFileName)));
  manifest.spec_version = "0.9";
  WriteFile(Path(kManifestFileName), SerializeManifest(manifest));
  try {
    LoadVectorSet(dir_.string());
    FAIL() << "vectors of another spec version were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find("0.9"), std::string::npos) << e.what();
  }
}

// A quantize kernel that is right except for one code: the stage and pipeline cases using it
// must fail, naming the codes.
void OffByOneQuantize(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min, size_t n,
                      const WriteParams& p) {
  cpu::ScalarBackend().write.quantize(x, codes, scale, min, n, p);
  if (n > 0 && p.head_dim == 256) codes[7] = static_cast<uint8_t>(codes[7] == 0 ? 1 : 0);
}

TEST_F(ConformanceRunner, BrokenKernelIsCaught) {
  cpu::Backend broken = cpu::ScalarBackend();
  broken.name = "broken";
  broken.write.quantize = &OffByOneQuantize;
  const std::vector<CaseResult> results = RunConformance(dir_.string(), broken);
  size_t failed = 0;
  for (const CaseResult& r : results) {
    if (r.status != CaseStatus::kFail) continue;
    ++failed;
    const bool d256 = r.name.find("d256") != std::string::npos;
    EXPECT_TRUE(d256) << DescribeResult(r);
    if (r.kind == "stage" || r.kind == "pipeline") {
      EXPECT_EQ(r.mismatch.stage, "codes") << DescribeResult(r);
      EXPECT_EQ(r.mismatch.row, 0);
      EXPECT_EQ(r.mismatch.column, 7);
    }
  }
  EXPECT_GE(failed, 1u + 3u * 2u * 3u * 4u);  // the quantize stage cases and the d256 grid
  const CaseResult& stage = Find(results, "stage/quantize_d256_g64_b4");
  EXPECT_EQ(stage.status, CaseStatus::kFail);
}

// A tile quantizer that is right except for one (scale, min) pair: exactly the cases that run it
// (its stage, the affine_tile pipelines, the caches with tiled keys or values) fail.
void WrongMinQuantizeTile(const float* x, uint8_t* codes, uint16_t* scale, uint16_t* min,
                          size_t n, const WriteParams& p) {
  cpu::ScalarBackend().write.quantize_tile(x, codes, scale, min, n, p);
  if (n > 0) min[3] ^= 1;
}

TEST_F(ConformanceRunner, BrokenTileKernelIsCaught) {
  cpu::Backend broken = cpu::ScalarBackend();
  broken.name = "broken_tile";
  broken.write.quantize_tile = &WrongMinQuantizeTile;
  size_t failed = 0;
  for (const CaseResult& r : RunConformance(dir_.string(), broken)) {
    const bool tiled = r.name.find("tile") != std::string::npos ||
                       r.name.find("kivi") != std::string::npos ||
                       r.name.find("ots") != std::string::npos;
    if (r.kind == "attention") continue;  // built with the scalar backend
    if (r.name.rfind("stage/", 0) == 0 && r.name.rfind("stage/quantize_tile", 0) != 0) {
      EXPECT_EQ(r.status, CaseStatus::kPass) << DescribeResult(r);
      continue;
    }
    EXPECT_EQ(r.status == CaseStatus::kFail, tiled) << DescribeResult(r);
    if (r.status != CaseStatus::kFail) continue;
    ++failed;
    if (r.kind == "stage" || r.kind == "pipeline") {
      EXPECT_EQ(r.mismatch.stage, "min") << DescribeResult(r);
      EXPECT_EQ(r.mismatch.row, 0);
      EXPECT_EQ(r.mismatch.column, 3);
    }
  }
  EXPECT_GE(failed, 7u + 7u + 4u);  // quantize_tile stages, tile pipelines, tiled caches
}

// A case whose label and parameters disagree is refused when the set is loaded.
TEST_F(ConformanceRunner, CaseLabelledWithTheWrongSpecVersionIsRejected) {
  const std::string relative = "cache/kivi_d64_gk32_f64_w1.safetensors";
  Safetensors file = ReadSafetensors(Path(relative));
  file.metadata["spec_version"] = "1.0";
  Rewrite(relative, file, /*update_manifest=*/true);
  try {
    LoadVectorSet(dir_.string());
    FAIL() << "a 1.1 case labelled 1.0 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformedFile);
    EXPECT_NE(std::string(e.what()).find("labelled spec 1.0"), std::string::npos) << e.what();
  }
}

TEST_F(ConformanceRunner, BackendWithoutWriteKernelsSkipsWritePathAndRunsAttention) {
  cpu::Backend target;
  target.name = "attention_only";
  target.attend = [](const cpu::PagedKVCache& cache, const std::vector<int>& seqs,
                     const float* q, float* out) {
    cpu::AttendBatch(cpu::ScalarBackend(), cache, seqs, q, out);
  };
  const std::vector<CaseResult> results = RunConformance(dir_.string(), target);
  size_t attention = 0;
  for (const CaseResult& r : results) {
    if (r.kind == "attention") {
      ++attention;
      EXPECT_EQ(r.status, CaseStatus::kPass) << DescribeResult(r);
    } else if (r.name == "cache/bf16_d64") {
      // The bf16 cache never runs the write path: it needs no write kernel.
      EXPECT_EQ(r.status, CaseStatus::kPass) << DescribeResult(r);
    } else {
      EXPECT_EQ(r.status, CaseStatus::kSkipped) << r.name;
    }
  }
  EXPECT_GT(attention, 0u);
}

TEST_F(ConformanceRunner, WrongAttentionIsCaughtAndGpuToleranceIsLooser) {
  // Outputs scaled by (1 + 1e-4): outside the CPU tolerance, inside the GPU one.
  cpu::Backend target = cpu::ScalarBackend();
  target.attend = [](const cpu::PagedKVCache& cache, const std::vector<int>& seqs,
                     const float* q, float* out) {
    cpu::AttendBatch(cpu::ScalarBackend(), cache, seqs, q, out);
    const size_t n = seqs.size() *
                     static_cast<size_t>(cache.params().num_q_heads * cache.params().head_dim());
    for (size_t i = 0; i < n; ++i) out[i] *= 1.0001f;
  };
  const VectorSet vectors = LoadVectorSet(dir_.string());
  for (const CaseResult& r : RunConformance(vectors, target)) {
    if (r.kind == "attention") {
      EXPECT_EQ(r.status, CaseStatus::kFail) << r.name;
    }
  }
  target.device = cpu::Device::kCuda;  // judged at the CUDA path's tolerance
  for (const CaseResult& r : RunConformance(vectors, target)) {
    if (r.kind == "attention") {
      EXPECT_EQ(r.status, CaseStatus::kPass) << DescribeResult(r);
    }
  }
}

TEST(ConformanceGenerator, SameSeedSameBytesOtherSeedOtherData) {
  const std::vector<GeneratedFile>& a = Generated();
  const std::vector<GeneratedFile> b = GenerateVectorFiles(kDefaultSeed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].path, b[i].path);
    EXPECT_TRUE(a[i].bytes == b[i].bytes) << a[i].path;
  }
  const std::vector<GeneratedFile> c = GenerateVectorFiles(kDefaultSeed + 1);
  ASSERT_EQ(a.size(), c.size());
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += a[i].bytes != c[i].bytes;
  EXPECT_EQ(differing, a.size());  // every file records its seed, every case has random data
}

// The budget: spec 1.0's cases (2.99 MB), spec 1.1's (1.86 MB: the norm, the affine_tile
// codec, their pipelines, and the KIVI, OScaR, SAW-INT4, W = 0 and F > 1 caches), 1.2's and
// 1.3's.
TEST(ConformanceGenerator, SetStaysSmall) {
  uint64_t total = 0;
  for (const GeneratedFile& f : Generated()) total += f.bytes.size();
  // 3 MB for the spec-1.0 families, 485,608 bytes for attention/scheme_* (one case per scheme
  // of the catalogue, 19 of them, and their fixtures), 1.86 MB for spec 1.1's families (the
  // norm, the affine_tile codec, their pipelines, the KIVI, OScaR, SAW-INT4, W = 0 and F > 1
  // caches), 486,220 bytes for spec 1.2's fp8 cases (7 stage, 7 pipeline, 3 cache and 6
  // attention cases, 3 of them scheme cases), 147,516 bytes for the offset-channel and
  // fp16-range cases added with 1.2's set (3 stage and 6 pipeline cases, 3 of them tiles),
  // 150,783 bytes for spec 1.3's codebook stage and pipeline cases (26 stage, 8 pipeline),
  // 327,068 bytes for its codebook cache and attention cases (3 each: TurboQuant-MSE K3V2,
  // Block-GTQ per-head key widths, a Gaussian 5-bit table) and the three codebook schemes'
  // cases with their fixtures, and the manifest's lines: 6,462,948 bytes today. The limit keeps
  // the set a small part of what a device call carries (64 MiB with the tracked tree).
  EXPECT_LE(total, 6600000u) << "the golden vectors grew past 6.6 MB";
}

// Every case carries the version whose rules it exercises: spec 1.0's cases kept "1.0" (their
// bytes are those of the 1.0 set), the cases of 1.1's rules say "1.1", those of 1.2's (fp8)
// "1.2", those of 1.3's (codebook) "1.3", and all four kinds exist.
TEST(ConformanceGenerator, CasesCarryTheSpecVersionOfTheirRules) {
  std::map<std::string, int> versions;
  for (const GeneratedFile& f : Generated()) {
    if (f.path == kManifestFileName || f.path.rfind("fixtures/", 0) == 0) continue;
    const Safetensors c = ParseSafetensors(f.bytes.data(), f.bytes.size());
    const std::string version = CaseMetadata(c).String("spec_version");
    EXPECT_EQ(version, RequiredSpecVersion(c)) << f.path;
    ++versions[version];
  }
  EXPECT_GE(versions["1.0"], 290);
  EXPECT_GE(versions["1.1"], 40);
  EXPECT_GE(versions["1.2"], 20);
  EXPECT_GE(versions["1.3"], 30);
  EXPECT_EQ(versions.size(), 4u);
}

}  // namespace
}  // namespace kvq::conformance
