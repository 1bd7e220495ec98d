// kvq: command-line front end. One file per subcommand (tools/cmd_<name>.cc); this file only
// registers them and turns every failure into one line `kvq: error: ...` on stderr and exit
// status 2: a kvq::Error, and a command line CLI11 rejects (its own codes 100-114 become 2).
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/conformance/case_format.h"

#define KVQ_COMMAND(name) void setup_##name(CLI::App& app);
#include "commands.inc"
#undef KVQ_COMMAND

namespace {

// "kvq" or "kvq vectors generate": the command the user reached.
std::string CommandPath(const CLI::App& app) {
  std::string path = "kvq";
  const CLI::App* at = &app;
  for (;;) {
    const std::vector<CLI::App*> given = at->get_subcommands();
    if (given.empty()) return path;
    at = given.front();
    path += " " + at->get_name();
  }
}

// The one line for a command line that CLI11 rejected. Arguments that no option took come first:
// CLI11 checks required options before leftovers, so `--inn X` would read "--in is required".
std::string ParseErrorMessage(const CLI::App& app, const CLI::ParseError& e) {
  const std::string command = CommandPath(app);
  const std::vector<std::string> extra = app.remaining(true);
  if (!extra.empty()) {
    std::string joined;
    for (const std::string& arg : extra) joined += (joined.empty() ? "" : " ") + arg;
    return "unrecognised argument" + std::string(extra.size() > 1 ? "s" : "") + " '" +
           joined + "' for " + command + " (see " + command + " --help)";
  }
  if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
      std::string(e.what()).rfind("A subcommand", 0) == 0) {
    return "no subcommand given to " + command + " (see " + command + " --help)";
  }
  return e.what();
}

}  // namespace

int main(int argc, char** argv) {
  // A reader that goes away (kvq ... --out /dev/stdout | head -c 1) makes write() fail with
  // EPIPE, which is reported as an error, instead of killing kvq without a word.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"kvq: ultra-low-bit KV-cache quantization (OSCAR and baselines)"};
  app.require_subcommand(1);
  // The version of the spec this build implements, the one the golden vectors carry.
  app.set_version_flag("--version", std::string("kvq 0.1.0 (spec ") +
                                        kvq::conformance::kSpecVersion + ")");
#define KVQ_COMMAND(name) setup_##name(app);
#include "commands.inc"
#undef KVQ_COMMAND
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "kvq: error: %s\n", ParseErrorMessage(app, e).c_str());
    return 2;
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
