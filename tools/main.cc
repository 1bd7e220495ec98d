// kvq: command-line front end. One file per subcommand (tools/cmd_<name>.cc); this file only
// registers them and turns a kvq::Error into one line on stderr and a non-zero exit.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include "kvq/common/error.h"

#define KVQ_COMMAND(name) void setup_##name(CLI::App& app);
#include "commands.inc"
#undef KVQ_COMMAND

int main(int argc, char** argv) {
  CLI::App app{"kvq: ultra-low-bit KV-cache quantization (OSCAR and baselines)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvq 0.1.0 (spec 1.0)");
  // Parse errors too are one line (CLI11's default adds "Run with --help ...").
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("kvq: error: ") + e.what() + "\n";
  });
#define KVQ_COMMAND(name) setup_##name(app);
#include "commands.inc"
#undef KVQ_COMMAND
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
