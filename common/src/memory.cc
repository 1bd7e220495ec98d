#include "kvq/common/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "kvq/common/error.h"

namespace kvq {

uint64_t MemoryLimitBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  uint64_t limit = pages > 0 && page_size > 0
                       ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size)
                       : UINT64_MAX;
  struct rlimit address_space;
  if (::getrlimit(RLIMIT_AS, &address_space) == 0 && address_space.rlim_cur != RLIM_INFINITY) {
    limit = std::min<uint64_t>(limit, address_space.rlim_cur);
  }
  return limit;
}

std::string FormatBytes(double bytes) {
  const char* units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  int unit = 0;
  while (bytes >= 1000.0 && unit < 6) {
    bytes /= 1000.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.3g %s", bytes, units[unit]);
  return text;
}

void CheckFitsInMemory(const std::string& what, double bytes) {
  const uint64_t limit = MemoryLimitBytes();
  KVQ_CHECK(bytes <= static_cast<double>(limit), kInvalidArgument, what, " = ",
            FormatBytes(bytes), " exceeds the ", FormatBytes(static_cast<double>(limit)),
            " of memory this process may use");
}

}  // namespace kvq
