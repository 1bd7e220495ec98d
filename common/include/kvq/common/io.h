// Readers and writers for .npy and safetensors. Readers validate everything and throw
// kvq::Error(kMalformedFile) naming the problem; writers follow WriteFile's policy (below), so
// a failed write never leaves a partial file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/tensor.h"

namespace kvq {

// What a file's first bytes say it is: .npy (the magic \x93NUMPY), safetensors (an 8-byte
// little-endian header length that fits the file, then '{'), or neither. The readers check it
// first, so an .npy given where safetensors is expected (or the reverse) is named as such.
enum class FileKind { kNpy, kSafetensors, kUnknown };
FileKind SniffFileKind(const uint8_t* data, size_t size);

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

// The whole file at `path`. Opening never blocks: a FIFO, device or folder is refused
// (kIoError naming the path and what it is) without waiting for a writer.
std::vector<uint8_t> ReadFileBytes(const std::string& path);

// The one output-file policy; every file kvq writes (npy, safetensors, JSON, CSV, SVG, the
// golden vectors) goes through here. By what `path` names:
//  - nothing yet, or a regular file: written atomically: a temporary file beside the target,
//    fsync, rename; a reader never sees half a file and a failure leaves the old file (or
//    nothing) and no temporary behind;
//  - a symbolic link: followed (a chain too) and its target written by these rules; the link
//    itself stays (a dangling link's target is created);
//  - an existing device node, FIFO or other non-regular file (/dev/null, /dev/full, a pipe):
//    opened and written in place (O_APPEND), never replaced; a FIFO that no process reads is
//    refused rather than waited for;
//  - a link naming an open descriptor (/dev/stdout, /dev/fd/N, /proc/self/fd/N): written
//    through that descriptor of this process (stdio flushed first), so the bytes land where
//    its other output to it goes, whatever it is open on;
//  - a folder: refused.
// Throws kvq::Error(kIoError) naming the path (and the link's target) and the reason: a
// missing folder, a folder that takes no new files, a write error such as ENOSPC.
void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes);

// What WriteFile(path) would refuse, checked before any work and without writing: kIoError
// for a folder, a missing folder, a folder that takes no new files (probed by creating and
// removing a temporary file there), a non-regular target this process may not write, a FIFO
// that no process reads (a FIFO with a reader stays open until WriteFile writes it, so the
// reader does not see its input end). Commands call it on their output paths first.
void CheckOutputFile(const std::string& path);

// The same for a folder that a writer creates (with its missing parents) and fills: it must be
// a folder, or the nearest existing ancestor must be a folder that takes new files.
void CheckOutputFolder(const std::string& path);

}  // namespace kvq
