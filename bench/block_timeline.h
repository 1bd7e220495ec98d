// The decode step's block timeline (DecodeAttentionInputs::timeline) summarised per kind of
// block, for the attention and step benchmarks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "kvq/gpu/attention_launch.h"

namespace kvq::bench {

// Per-kind summary of one step's block records (attention::BlockKind; times in us from the
// first block's entry): entries, exits, durations (exit - entry), and for history and merge
// blocks the wait from entry until their inputs (queries, partials) were ready and when.
inline std::string SummarizeTimeline(const std::vector<uint64_t>& rec, const char* title) {
  const size_t n = rec.size() / 4;
  uint64_t t0 = UINT64_MAX;
  for (size_t i = 0; i < n; ++i) t0 = std::min(t0, rec[4 * i]);
  auto us = [&](uint64_t t) { return (static_cast<double>(t) - static_cast<double>(t0)) * 1e-3; };
  auto pct = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
  };
  std::string out = std::string("timeline ") + title + " (us from the first block's entry):\n";
  const char* names[] = {"rotate", "history", "window", "empty", "merge"};
  for (uint32_t kind = 0; kind < 5; ++kind) {
    std::vector<double> entry, exit, dur, ready, ready_at;
    std::vector<int> sms;
    for (size_t i = 0; i < n; ++i) {
      if ((rec[4 * i + 3] >> 32) != kind) continue;
      entry.push_back(us(rec[4 * i]));
      exit.push_back(us(rec[4 * i + 2]));
      dur.push_back((static_cast<double>(rec[4 * i + 2]) - static_cast<double>(rec[4 * i])) * 1e-3);
      if (rec[4 * i + 1]) {
        ready.push_back((static_cast<double>(rec[4 * i + 1]) - static_cast<double>(rec[4 * i])) * 1e-3);
        ready_at.push_back(us(rec[4 * i + 1]));
      }
      sms.push_back(static_cast<int>(rec[4 * i + 3] & 0xffffffffu));
    }
    if (entry.empty()) continue;
    std::sort(sms.begin(), sms.end());
    const size_t distinct = std::unique(sms.begin(), sms.end()) - sms.begin();
    char line[512];
    std::snprintf(line, sizeof line,
                  "  %-7s %6zu blocks on %3zu SMs | entry %7.2f .. %7.2f (median %7.2f) | exit %7.2f .. "
                  "%7.2f (median %7.2f) | duration median %7.2f, min %7.2f, max %7.2f",
                  names[kind], entry.size(), distinct, pct(entry, 0), pct(entry, 1),
                  pct(entry, 0.5), pct(exit, 0), pct(exit, 1), pct(exit, 0.5), pct(dur, 0.5),
                  pct(dur, 0), pct(dur, 1));
    out += line;
    if (!ready.empty()) {
      std::snprintf(line, sizeof line,
                    " | %s ready after entry: median %.2f, max %.2f; at %.2f .. %.2f",
                    kind == static_cast<uint32_t>(kvq::gpu::attention::BlockKind::kMerge)
                        ? "partials"
                        : "queries",
                    pct(ready, 0.5), pct(ready, 1),
                    pct(ready_at, 0), pct(ready_at, 1));
      out += line;
    }
    out += "\n";
  }
  return out;
}

}  // namespace kvq::bench
