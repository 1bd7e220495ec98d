// The kvq binary links no CUDA code; its GPU side is the module libkvq_cuda.so beside it
// (tools/cli_gpu.h), so the CPU commands build and run without it. Checked here: the binary's
// dynamic dependencies, a copy of the binary without its module (every GPU request fails with
// one line naming the module and how to build it; the CPU work runs and says what it left
// out), the module loaded by the build's own binary, and the demo's closing cost lines.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "cli_test_util.h"

namespace kvq::cli_testing {
namespace {

std::string CommandOutput(const std::string& command) {
  std::string text;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) text.append(buffer, n);
  ::pclose(pipe);
  return text;
}

bool CudaBuild() {
#ifdef KVQ_CUDA_BUILD
  return true;
#else
  return false;
#endif
}

TEST(GpuModule, KvqLinksNoCudaLibrary) {
  const std::string needed = CommandOutput(std::string("readelf -d '") + KVQ_BINARY + "'");
  ASSERT_NE(needed.find("NEEDED"), std::string::npos) << needed;
  for (const char* library : {"libcudart", "libcublas", "libcuda.", "libkvq_gpu", "libkvq_cuda"}) {
    EXPECT_EQ(needed.find(library), std::string::npos) << "kvq needs " << library << ":\n"
                                                        << needed;
  }
}

// A copy of the binary in a folder without the module.
class WithoutModule : public ::testing::Test {
 protected:
  void SetUp() override {
    binary_ = bin_.File("kvq");
    ASSERT_EQ(std::system(("cp '" + std::string(KVQ_BINARY) + "' '" + binary_ + "'").c_str()), 0);
  }
  // What the loader says is missing: the module beside the copy, or CUDA altogether.
  std::vector<std::string> Why() const {
    if (CudaBuild()) return {bin_.File("libkvq_cuda.so"), "is not built yet"};
    return {"built without CUDA"};
  }
  void ExpectGpuRefused(const std::string& args, const std::vector<std::string>& needles) {
    const RunResult r = RunProgram(work_, binary_, args, 120);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    std::vector<std::string> all = needles;
    for (const std::string& why : Why()) all.push_back(why);
    for (const std::string& needle : all) {
      EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err << " lacks "
                                                       << needle;
    }
  }

  ScratchDir bin_{"kvq_module_bin"}, work_{"kvq_module_work"};
  std::string binary_;
};

TEST_F(WithoutModule, EveryGpuRequestNamesTheMissingModule) {
  ExpectGpuRefused("conform --backend gpu", {"backend 'gpu'"});
  ExpectGpuRefused("bench --backend gpu --seq-len 64 --iters 1", {"--backend gpu"});
  ExpectGpuRefused(std::string("ppl --backend gpu --model ") + KVQ_MODELS_DIR + "/tiny-llama-a",
                   {"--backend gpu"});
  // Before any work: no file appears.
  ExpectGpuRefused("ppl --backend both --model " + std::string(KVQ_MODELS_DIR) +
                       "/tiny-llama-a --json out.json",
                   {"--backend both"});
  EXPECT_FALSE(Exists(work_.File("out.json")));
}

TEST_F(WithoutModule, CpuWorkRunsAndSaysWhatItLeftOut) {
  const RunResult r =
      RunProgram(work_, binary_, "bench --backend all --schemes bf16,naive --seq-len 64 --iters 1",
                 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("GPU columns omitted"), std::string::npos) << r.err;
  for (const std::string& why : Why()) EXPECT_NE(r.err.find(why), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("cpu_us"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("gpu_us"), std::string::npos) << r.out;
}

// The build's own binary finds its module (CI has no device: the refusal names the device,
// not the module).
TEST(GpuModule, BuildBinaryLoadsItsModule) {
  if (!CudaBuild()) GTEST_SKIP() << "a build without CUDA has no module";
  ScratchDir dir("kvq_module_loads");
  const RunResult r = RunKvq(dir, "conform --backend gpu --failures-only", 600);
  if (r.exit_code == 0) return;  // a device is present and the module served it
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("no CUDA device is present"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("not built"), std::string::npos) << r.err;
}

// kvq demo: the table says which bits count the windows, and the demo ends with one line per
// storage family on what its kernels cost.
TEST(Demo, SaysWhatTheBitsCountAndWhatTheKernelsCost) {
  ScratchDir dir("kvq_demo_cost");
  const RunResult r = RunKvq(dir, "demo --schemes naive,kivi --windows heldout_en:0 "
                                  "--calib-windows calib:0 --length 512 --calib-length 512",
                             900);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(" hist   +win "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the bf16 sink and recent windows included"), std::string::npos);
  const size_t costs = r.out.find("What the kernels cost");
  ASSERT_NE(costs, std::string::npos) << r.out;
  const std::string tail = r.out.substr(costs);
  // Bytes per token of each family at d = 128, Hkv = 8 (K and V): bf16 16 bits, INT2 per token
  // with G = 64 2.5 bits, KIVI 3.0, OScaR's row norm 3.0625, SAW-INT4 4.25, FP8 8.
  for (const char* row : {"bf16 rows", "16.00 bits  4096 B/token", "naive, hadamard, ..., oscar",
                          " 2.50 bits   640 B/token (6.4x less)", "kivi, kivi_hadamard",
                          " 3.00 bits   768 B/token", "kivi_norm, ots", " 3.06 bits   784 B/token",
                          "saw_int4, saw_int4_k, saw_hessian", " 4.25 bits  1088 B/token",
                          "fp8, fp8_unscaled, fp8_hadamard", " 8.00 bits  2048 B/token"}) {
    EXPECT_NE(tail.find(row), std::string::npos) << "no \"" << row << "\" in:\n" << tail;
  }
}

}  // namespace
}  // namespace kvq::cli_testing
