// kvq conform without --vectors: no path is compiled in. A copied binary looks for vectors/
// beside itself, then ../share/kvq/vectors, then $KVQ_VECTORS_DIR, and when none holds a
// manifest the one error line names every place it looked; --vectors overrides them all.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <string>

#include "cli_test_util.h"

namespace kvq {
namespace {

using cli_testing::RunResult;
using cli_testing::ScratchDir;
using cli_testing::Slurp;

// Runs `<binary> <args>` in `dir` with KVQ_VECTORS_DIR set to `env` (unset when empty).
RunResult RunCopy(const ScratchDir& dir, const std::string& binary, const std::string& env,
                  const std::string& args) {
  const std::string out = dir.File("stdout.txt"), err = dir.File("stderr.txt");
  const std::string environment =
      env.empty() ? "env -u KVQ_VECTORS_DIR " : "env KVQ_VECTORS_DIR='" + env + "' ";
  const std::string command = "cd '" + dir.File("") + "' && " + environment + "'" + binary +
                              "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(command.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = Slurp(out);
  r.err = Slurp(err);
  return r;
}

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

TEST(ConformVectorsCli, CopiedBinaryFindsVectorsBesideItOrThroughTheEnvironment) {
  ScratchDir dir("kvq_conform_lookup");
  ASSERT_EQ(std::system(("mkdir -p '" + dir.File("bin") + "' '" + dir.File("empty") + "' && cp '" +
                         KVQ_BINARY + "' '" + dir.File("bin/kvq") + "'")
                            .c_str()),
            0);
  const std::string kvq = dir.File("bin/kvq");
  const std::string conform = "conform --backend scalar --failures-only";

  // Nothing anywhere: one line naming each place.
  RunResult r = RunCopy(dir, kvq, "", conform);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  EXPECT_TRUE(Contains(r.err, dir.File("bin/vectors") + " (absent)")) << r.err;
  EXPECT_TRUE(Contains(r.err, "share/kvq/vectors (absent)")) << r.err;
  EXPECT_TRUE(Contains(r.err, "$KVQ_VECTORS_DIR (not set)")) << r.err;

  // An environment variable naming a folder without a manifest says so.
  r = RunCopy(dir, kvq, dir.File("empty"), conform);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(Contains(r.err, "$KVQ_VECTORS_DIR=" + dir.File("empty") + " (no manifest.json)"))
      << r.err;

  // The environment variable naming the committed vectors: every case passes.
  r = RunCopy(dir, kvq, KVQ_SOURCE_VECTORS, conform);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, std::string("(") + KVQ_SOURCE_VECTORS + ", spec")) << r.out;
  EXPECT_TRUE(Contains(r.out, " 0 failed")) << r.out;

  // --vectors overrides the environment.
  r = RunCopy(dir, kvq, KVQ_SOURCE_VECTORS, conform + " --vectors '" + dir.File("empty") + "'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(Contains(r.err, "manifest.json")) << r.err;

  // vectors/ beside the binary wins, with no environment at all.
  ASSERT_EQ(std::system(("ln -s '" + std::string(KVQ_SOURCE_VECTORS) + "' '" +
                         dir.File("bin/vectors") + "'")
                            .c_str()),
            0);
  r = RunCopy(dir, kvq, "", conform);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, "(" + dir.File("bin/vectors") + ", spec")) << r.out;
  EXPECT_TRUE(Contains(r.out, " 0 failed")) << r.out;
}

// The build links the committed vectors beside the built binary (tools/CMakeLists.txt).
TEST(ConformVectorsCli, BuiltBinaryHasVectorsBesideIt) {
  ScratchDir dir("kvq_conform_built");
  const RunResult r = RunCopy(dir, KVQ_BINARY, dir.File("nowhere"), "conform --backend scalar --failures-only");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, "/vectors, spec")) << r.out;
}

}  // namespace
}  // namespace kvq
