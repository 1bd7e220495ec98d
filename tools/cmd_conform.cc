// kvq conform --backend NAME [--vectors DIR]: replays the golden vectors (default folder:
// conformance::DefaultVectorsDir, beside the binary or $KVQ_VECTORS_DIR) against backends of the
// one backend list (kvq/backends.h: `all`, `cpu`, `gpu`, or one by name), prints a case x
// backend pass/fail table with the first mismatch of each failure, and fails (kvq::Error
// kMismatch, exit status 2) when any case fails.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kvq/backends.h"
#include "kvq/common/error.h"
#include "kvq/conformance/runner.h"

namespace {

struct ConformOptions {
  std::string backend;
  std::string vectors;  // empty: kvq::conformance::DefaultVectorsDir()
  bool failures_only = false;
};

void RunConform(const ConformOptions& options) {
  using kvq::conformance::CaseResult;
  using kvq::conformance::CaseStatus;
  const std::vector<const kvq::cpu::Backend*> targets = kvq::SelectBackends(options.backend);
  KVQ_CHECK(!targets.empty(), kUnsupported, "--backend ", options.backend,
            ": no backend is available");
  const std::string dir =
      options.vectors.empty() ? kvq::conformance::DefaultVectorsDir() : options.vectors;
  const kvq::conformance::VectorSet vectors = kvq::conformance::LoadVectorSet(dir);

  std::vector<std::vector<CaseResult>> results;  // [target][case]
  for (const kvq::cpu::Backend* target : targets) {
    results.push_back(kvq::conformance::RunConformance(vectors, *target));
  }

  // One row per case, one column per target: "PASS", "FAIL" or "SKIP".
  size_t name_width = 4;
  for (const std::string& name : vectors.case_names) name_width = std::max(name_width, name.size());
  std::vector<size_t> widths;
  std::string header = "case";
  for (const kvq::cpu::Backend* target : targets) {
    header.resize(name_width + 2 * (widths.size() + 1) +
                      std::accumulate(widths.begin(), widths.end(), size_t{0}),
                  ' ');
    header += target->name;
    widths.push_back(std::max<size_t>(4, target->name.size()));
  }
  std::printf("%s\n", header.c_str());
  size_t passed = 0, failed = 0, skipped = 0;
  for (size_t c = 0; c < vectors.cases.size(); ++c) {
    bool any_failure = false;
    for (size_t t = 0; t < targets.size(); ++t) {
      const CaseStatus s = results[t][c].status;
      passed += s == CaseStatus::kPass;
      failed += s == CaseStatus::kFail;
      skipped += s == CaseStatus::kSkipped;
      any_failure = any_failure || s == CaseStatus::kFail;
    }
    if (options.failures_only && !any_failure) continue;
    std::string line = vectors.case_names[c];
    for (size_t t = 0; t < targets.size(); ++t) {
      line.resize(name_width + 2 * (t + 1) + std::accumulate(widths.begin(), widths.begin() + t,
                                                             size_t{0}),
                  ' ');
      line += kvq::conformance::CaseStatusName(results[t][c].status);
    }
    std::printf("%s\n", line.c_str());
  }
  if (failed > 0) {
    std::printf("\nfirst mismatch of each failure:\n");
    for (size_t t = 0; t < targets.size(); ++t) {
      for (const CaseResult& r : results[t]) {
        if (r.status != CaseStatus::kFail) continue;
        std::printf("  [%s] %s\n", targets[t]->name.c_str(),
                    kvq::conformance::DescribeResult(r).c_str());
      }
    }
  }
  std::printf("\n%zu cases x %zu backends (%s, spec %s): %zu passed, %zu failed, %zu skipped\n",
              vectors.cases.size(), targets.size(), dir.c_str(),
              vectors.manifest.spec_version.c_str(), passed, failed, skipped);
  std::fflush(stdout);
  KVQ_CHECK(failed == 0, kMismatch, "conformance failed: ", failed, " of ",
            vectors.cases.size() * targets.size(), " case runs failed (see the table above)");
}

}  // namespace

void setup_conform(CLI::App& app) {
  CLI::App* conform = app.add_subcommand(
      "conform", "Replay the golden vectors against CPU backends or the CUDA backend");
  auto options = std::make_shared<ConformOptions>();
  conform
      ->add_option("--backend", options->backend,
                   "all, cpu (every CPU backend), gpu, or a backend name (scalar, hwy_avx2, ...)")
      ->required();
  conform->add_option("--vectors", options->vectors,
                      "Vectors folder (default: vectors/ beside the kvq binary, else "
                      "../share/kvq/vectors from it, else $KVQ_VECTORS_DIR)");
  conform->add_flag("--failures-only", options->failures_only,
                    "Print only the table rows of failing cases");
  conform->callback([options] { RunConform(*options); });
}
