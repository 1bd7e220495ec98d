// Readers and writers for .npy and safetensors. Readers validate everything and throw
// kvq::Error(kMalformedFile) naming the problem; writers never leave a partial file (they
// write a temporary beside the target and rename it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/tensor.h"

namespace kvq {

// .npy version 1.0-3.0, little-endian, C order: float32 '<f4', float16 '<f2', uint8 '|u1',
// int32 '<i4'. bf16 has no npy dtype.
Tensor ParseNpy(const uint8_t* data, size_t size);
Tensor ReadNpy(const std::string& path);
std::vector<uint8_t> SerializeNpy(const Tensor& t);
void WriteNpy(const std::string& path, const Tensor& t);

struct Safetensors {
  std::map<std::string, std::string> metadata;         // "__metadata__", strings only
  std::vector<std::pair<std::string, Tensor>> tensors;  // in file order (writers sort by name)

  const Tensor* Find(const std::string& name) const;
  const Tensor& Get(const std::string& name) const;  // throws naming the missing tensor
  void Add(const std::string& name, Tensor t);       // throws on a duplicate name
};

Safetensors ParseSafetensors(const uint8_t* data, size_t size);
Safetensors ReadSafetensors(const std::string& path);
std::vector<uint8_t> SerializeSafetensors(const Safetensors& file);
void WriteSafetensors(const std::string& path, const Safetensors& file);

// Whole-file helpers shared by the readers and writers.
std::vector<uint8_t> ReadFileBytes(const std::string& path);
void WriteFileAtomic(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace kvq
