// kvq info FILE: lists the tensors (name, dtype, shape, bytes) and metadata of a .npy or
// .safetensors file. The format is recognised by its first bytes, not by the file name.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"

namespace {

void PrintTensor(const std::string& name, const kvq::Tensor& t) {
  std::printf("  %-16s %-5s %-16s %zu bytes\n", name.c_str(), kvq::DTypeName(t.dtype),
              t.ShapeString().c_str(), t.bytes.size());
}

void RunInfo(const std::string& path) {
  const std::vector<uint8_t> bytes = kvq::ReadFileBytes(path);
  try {
    if (kvq::SniffFileKind(bytes.data(), bytes.size()) == kvq::FileKind::kNpy) {
      const kvq::Tensor t = kvq::ParseNpy(bytes.data(), bytes.size());
      std::printf("%s: npy, 1 tensor\n", path.c_str());
      PrintTensor("(array)", t);
      return;
    }
    const kvq::Safetensors file = kvq::ParseSafetensors(bytes.data(), bytes.size());
    std::printf("%s: safetensors, %zu tensor%s\n", path.c_str(), file.tensors.size(),
                file.tensors.size() == 1 ? "" : "s");
    for (const auto& [name, tensor] : file.tensors) PrintTensor(name, tensor);
    if (!file.metadata.empty()) {
      std::printf("metadata:\n");
      for (const auto& [key, value] : file.metadata) {
        std::printf("  %s = %s\n", key.c_str(), value.c_str());
      }
    }
  } catch (const kvq::Error& e) {
    throw kvq::Error(e.code(), path + ": " + e.what());
  }
}

}  // namespace

void setup_info(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  CLI::App* command =
      app.add_subcommand("info", "list the tensors and metadata of a .npy or .safetensors file");
  command->add_option("file", *path, ".npy or .safetensors file")->required();
  command->callback([path] { RunInfo(*path); });
}
