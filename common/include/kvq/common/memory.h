// How much memory a run may take, so that sizes taken from options and files are refused,
// naming them, before an allocation in proportion fails as a bare std::bad_alloc (or wakes the
// OOM killer).
#pragma once

#include <cstdint>
#include <string>

namespace kvq {

// The machine's physical memory, or the address-space limit (RLIMIT_AS, `ulimit -v`) when that
// is lower.
uint64_t MemoryLimitBytes();

// Throws kvq::Error(kInvalidArgument) "<what> = <bytes> exceeds the <limit> of memory this
// process may use" when `bytes` (a double, so a product of huge sizes cannot wrap) exceeds
// MemoryLimitBytes(). `what` names the sizes and their values: "synth: 4 layers x 10^8 tokens
// x ...". Callers pass the bytes of what they are about to allocate at least, never an
// overestimate, so a run that fits is never refused.
void CheckFitsInMemory(const std::string& what, double bytes);

// "9.83 TB", "512 MB": a byte count for messages (decimal units, 3 significant digits).
std::string FormatBytes(double bytes);

}  // namespace kvq
