// kvq vectors generate --out DIR [--seed S]: writes the golden conformance vectors (one
// safetensors file per case plus manifest.json) from the scalar backend. Regenerate only when
// the spec changes; see conformance/README.md.
#include <CLI/CLI.hpp>

#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>

#include "cli_common.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/generator.h"

namespace {

struct VectorsOptions {
  std::string out;
  uint64_t seed = kvq::conformance::kDefaultSeed;
};

}  // namespace

void setup_vectors(CLI::App& app) {
  CLI::App* vectors = app.add_subcommand("vectors", "Golden conformance vectors");
  vectors->require_subcommand(1);
  CLI::App* generate = vectors->add_subcommand(
      "generate", "Generate the golden vectors (expected values from the scalar backend)");
  auto options = std::make_shared<VectorsOptions>();
  generate
      ->add_option("--out", options->out,
                   "Output folder (created if missing); of its files only those that the "
                   "manifest.json there lists are replaced or removed")
      ->required()
      ->check(kvq::cli::OutputFolder());
  generate->add_option("--seed", options->seed,
                       "Global seed (the committed set uses the default)")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  generate->callback([options] {
    const kvq::conformance::GenerateSummary summary =
        kvq::conformance::GenerateVectors(options->out, options->seed);
    std::printf("wrote %zu cases and %zu fixtures (+ manifest.json) to %s: %" PRIu64
                " bytes, seed %" PRIu64 ", spec %s",
                summary.cases, summary.fixtures, options->out.c_str(), summary.bytes,
                options->seed, kvq::conformance::kSpecVersion);
    if (summary.removed > 0) {
      std::printf("; removed %zu stale file%s of the earlier set", summary.removed,
                  summary.removed == 1 ? "" : "s");
    }
    std::printf("\n");
  });
}
