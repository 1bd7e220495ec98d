// kvq ppl: end-to-end perplexity, KL and top-1 of every KV-cache scheme on a real model,
// teacher-forced through each scheme's paged cache (calib/ppl.h), with paired ΔKL against OSCAR.
#include <CLI/CLI.hpp>

#include <memory>

#include "cli_ppl.h"

void setup_ppl(CLI::App& app) {
  auto cmd = std::make_shared<kvq::cli::PplCommand>();
  CLI::App* sub = app.add_subcommand(
      "ppl",
      "Teacher-forced perplexity / KL / top-1 of every scheme on a model (real paged caches)");
  kvq::cli::AddPplOptions(sub, cmd.get(), /*demo=*/false);
  sub->callback([cmd]() { kvq::cli::RunPplCommand(*cmd); });
}
