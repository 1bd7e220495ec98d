// Shared by the CLI tests (header only; not a test file itself): a scratch directory, running
// the built kvq binary (KVQ_BINARY, compiled in by tools/CMakeLists.txt) with its output
// captured, and the check every failing command must pass.
#pragma once

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvq::cli_testing {

// A unique directory /tmp/<prefix>_XXXXXX, removed with its contents at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix) {
    std::string pattern = "/tmp/" + prefix + "_XXXXXX";
    path_ = ::mkdtemp(&pattern[0]);
  }
  ~ScratchDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline bool Exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct RunResult {
  int exit_code;
  std::string out, err;
};

// Runs `<binary> <args>` with `dir` as the working directory (so relative paths name files in
// it), stdout and stderr captured through files in `dir`. With `timeout_seconds`, a run that
// takes longer is killed (exit status 137): a command that would hang fails instead of the test.
inline RunResult RunProgram(const ScratchDir& dir, const std::string& binary,
                            const std::string& args, int timeout_seconds = 0) {
  const std::string out = dir.File("stdout.txt"), err = dir.File("stderr.txt");
  const std::string limit =
      timeout_seconds > 0 ? "timeout -s KILL " + std::to_string(timeout_seconds) + " " : "";
  const std::string command = std::string("cd '") + dir.File("") + "' && " + limit + "'" +
                              binary + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(command.c_str());
  RunResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  result.out = Slurp(out);
  result.err = Slurp(err);
  return result;
}

// `kvq <args>`: RunProgram with the built kvq binary (KVQ_BINARY).
inline RunResult RunKvq(const ScratchDir& dir, const std::string& args, int timeout_seconds = 0) {
  return RunProgram(dir, KVQ_BINARY, args, timeout_seconds);
}

// `kvq <args>` must fail with exactly one line `kvq: error: ...` naming every needle, and
// leave no file at `output`.
inline void ExpectFailure(const ScratchDir& dir, const std::string& args,
                          const std::string& output, const std::vector<std::string>& needles) {
  const RunResult r = RunKvq(dir, args);
  EXPECT_NE(r.exit_code, 0) << args;
  EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << args << "\nstderr: " << r.err;
  ASSERT_FALSE(r.err.empty()) << args;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  for (const std::string& needle : needles) {
    EXPECT_NE(r.err.find(needle), std::string::npos)
        << args << "\nstderr \"" << r.err << "\" lacks \"" << needle << "\"";
  }
  EXPECT_FALSE(Exists(output)) << output << " left behind by: " << args;
}

}  // namespace kvq::cli_testing
