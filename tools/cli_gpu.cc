// Loads the CLI's GPU module (cli_gpu.h) and gives the backend list its CUDA backend from it.
#include "cli_gpu.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>
#include <system_error>

#include "cuda_source.h"  // conformance/backends
#include "kvq/common/error.h"

namespace kvq {
namespace cli {
namespace {

constexpr const char* kModuleName = "libkvq_cuda.so";

#ifndef KVQ_CUDA_MODULE_INSTALL_DIR
#define KVQ_CUDA_MODULE_INSTALL_DIR "lib/kvq"
#endif

// Where the module may be: beside the binary (the build tree), or in the install's library
// folder beside its bin/.
std::vector<std::filesystem::path> ModuleCandidates() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const std::filesystem::path dir = self.parent_path();
  return {dir / kModuleName, dir.parent_path() / KVQ_CUDA_MODULE_INSTALL_DIR / kModuleName};
}

struct Loaded {
  const GpuModule* module = nullptr;
  std::string why_not;
};

Loaded Load() {
#ifndef KVQ_CUDA_MODULE
  return {nullptr, "this kvq was built without CUDA (nvcc not found, or -DKVQ_ENABLE_CUDA=OFF)"};
#else
  const std::vector<std::filesystem::path> candidates = ModuleCandidates();
  for (const std::filesystem::path& path : candidates) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* error = dlerror();
      return {nullptr, "cannot load the GPU module " + path.string() + ": " +
                           (error != nullptr ? error : "unknown error")};
    }
#define KVQ_STRINGIFY_(x) #x
#define KVQ_STRINGIFY(x) KVQ_STRINGIFY_(x)
    using Entry = const GpuModule* (*)();
    auto entry =
        reinterpret_cast<Entry>(dlsym(handle, KVQ_STRINGIFY(KVQ_GPU_MODULE_ENTRY)));
    if (entry == nullptr) {
      return {nullptr, "the GPU module " + path.string() + " is from another kvq build (no " +
                           KVQ_STRINGIFY(KVQ_GPU_MODULE_ENTRY) + "): rebuild it with the binary"};
    }
#undef KVQ_STRINGIFY
#undef KVQ_STRINGIFY_
    return {entry(), ""};  // (never unloaded: its backend lives as long as the process)
  }
  if (candidates.empty()) {
    return {nullptr, std::string("the GPU part of kvq (") + kModuleName + ") is not found"};
  }
  // In a build tree the binary is <build>/tools/kvq: name the command that builds the module.
  const std::filesystem::path build = candidates[0].parent_path().parent_path();
  std::error_code ec;
  const std::string how =
      std::filesystem::exists(build / "CMakeCache.txt", ec)
          ? "`cmake --build " + build.string() + "` builds it (the README's test command does)"
          : "install it with the binary";
  return {nullptr, "the GPU part of kvq (" + candidates[0].string() + ") is not built yet: " + how};
#endif
}

const Loaded& Module() {
  static const Loaded loaded = Load();
  return loaded;
}

}  // namespace

const GpuModule* GpuOrNull(std::string* why_not) {
  const Loaded& loaded = Module();
  if (loaded.module == nullptr && why_not != nullptr) *why_not = loaded.why_not;
  return loaded.module;
}

const GpuModule& RequireGpu(const std::string& what) {
  std::string why_not;
  const GpuModule* gpu = GpuOrNull(&why_not);
  KVQ_CHECK(gpu != nullptr, kUnsupported, what, ": ", why_not);
  return *gpu;
}

}  // namespace cli

const cpu::Backend* CudaBackendOrNull(std::string* why_not) {
  const cli::GpuModule* gpu = cli::GpuOrNull(why_not);
  if (gpu == nullptr) return nullptr;
  const cpu::Backend* cuda = gpu->Backend();
  if (cuda == nullptr) *why_not = "no CUDA device is present";
  return cuda;
}

}  // namespace kvq
