#include "cli_cost.h"

#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include "kvq/calib/calibration_file.h"
#include "kvq/common/error.h"
#include "kvq/common/format.h"

namespace kvq::cli {
namespace {

// What one side stores, from its write parameters.
std::string Stores(const WriteParams& p) {
  char text[96];
  switch (p.format) {
    case Format::kBf16:
      return "bf16 rows";
    case Format::kAffineToken:
      std::snprintf(text, sizeof text, "INT%d/token, G=%d", p.bits, p.group);
      return text;
    case Format::kAffineTile:
      std::snprintf(text, sizeof text, "INT%d/channel, %d-token tiles%s", p.bits, p.group,
                    p.norm ? ", row norm" : "");
      return text;
    case Format::kFp8E4m3:
      return "e4m3, fp32 scale per head";
    case Format::kCodebook:
      std::snprintf(text, sizeof text, "codebook %d-bit%s, norm per segment", p.bits,
                    p.segments > 1 ? " (per-head widths)" : "");
      return text;
  }
  return FormatName(p.format);
}

std::string StoresKV(const CacheParams& p) {
  const std::string k = Stores(p.key), v = Stores(p.value);
  return k == v ? k : "K " + k + "; V " + v;
}

// Schemes store the same bytes when their rows agree on everything but the rotation, the
// clip and the scale (calibrated codebook widths lay rows out in segments of their own).
using FamilyKey = std::tuple<int, int, int, int, int, int>;
FamilyKey KeyOf(const calib::SchemeInfo& info, const calib::SchemeOptions& options, int d) {
  return {static_cast<int>(info.format_k), static_cast<int>(info.format_v),
          info.BitsUnder(options), info.GroupUnder(options, d), static_cast<int>(info.norm),
          static_cast<int>(info.widths)};
}

}  // namespace

std::vector<float> NormalValues(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

FilledCache FillCache(const calib::LayerScheme& layer, int batch, int length,
                      std::mt19937_64& rng) {
  FilledCache out;
  out.cache = std::make_unique<cpu::PagedKVCache>(layer.params, layer.key, layer.value,
                                                  cpu::BestBackend());
  const CacheParams& p = layer.params;
  for (int b = 0; b < batch; ++b) {
    const int s = out.cache->AddSequence();
    const size_t n = static_cast<size_t>(length) * p.num_kv_heads * p.head_dim();
    const std::vector<float> k = NormalValues(n, rng), v = NormalValues(n, rng);
    out.cache->Prefill(s, k.data(), v.data(), length);
    out.bytes += out.cache->Bytes(s).total();
    out.seqs.push_back(s);
  }
  out.q = NormalValues(static_cast<size_t>(batch) * p.num_q_heads * p.head_dim(), rng);
  return out;
}

std::string KernelCostLines(const CostShape& shape, const GpuModule* gpu,
                            const std::string& why_no_gpu) {
  const calib::SchemeOptions options;
  calib::SchemeShape scheme_shape;
  scheme_shape.num_kv_heads = shape.kv_heads;
  scheme_shape.num_q_heads = shape.q_heads;
  scheme_shape.head_dim = shape.head_dim;

  // The families in catalogue order, each with its schemes.
  std::vector<FamilyKey> order;
  std::map<FamilyKey, std::vector<const calib::SchemeInfo*>> families;
  for (const calib::SchemeInfo& info : calib::Schemes()) {
    const FamilyKey key = KeyOf(info, options, shape.head_dim);
    if (families.find(key) == families.end()) order.push_back(key);
    families[key].push_back(&info);
  }

  calib::SyntheticCalibrations calibrations(scheme_shape, options,
                                            2 * (static_cast<int64_t>(options.sink) + 256),
                                            shape.seed);
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line,
                "What the kernels cost, one line per storage family (schemes that store the same "
                "bytes), at d = %d, Hq/Hkv = %d/%d: the quantized history's bytes per token (K "
                "and V of every KV head; the bf16 windows come on top)",
                shape.head_dim, shape.q_heads, shape.kv_heads);
  os << line;
  if (gpu != nullptr) {
    std::snprintf(line, sizeof line,
                  " and the GPU decode step at B = %d, T = %d (median of %d, cold L2; the "
                  "family's first scheme that needs no calibration)",
                  shape.batch, shape.length, shape.iters);
    os << line;
  }
  os << ":\n";
  double bf16_bytes = 0, bf16_us = 0;
  for (const FamilyKey& key : order) {
    const std::vector<const calib::SchemeInfo*>& members = families[key];
    const calib::SchemeInfo* timed = members.front();
    for (const calib::SchemeInfo* info : members) {
      if (!info->needs_calibration) {
        timed = info;
        break;
      }
    }
    const calib::Calibration* cal =
        timed->needs_calibration ? &calibrations.For(timed->name) : nullptr;
    const calib::LayerScheme layer =
        calib::BuildLayerScheme(*timed, scheme_shape, cal, 0, options);
    const CacheParams& p = layer.params;
    const double bits = p.history_bits_per_element();
    const double bytes = bits * 2.0 * p.num_kv_heads * p.head_dim() / 8.0;
    if (!p.quantized()) bf16_bytes = bytes;
    std::string names = members.front()->name;
    for (size_t i = 1; i < members.size(); ++i) {
      if (members.size() > 3 && i > 1 && i + 1 < members.size()) {
        if (i == 2) names += ", ...";
        continue;
      }
      names += std::string(", ") + members[i]->name;
    }
    if (members.size() > 3) names += " (" + std::to_string(members.size()) + ")";
    std::snprintf(line, sizeof line, "  %-36s %-60s %5.2f bits %5.0f B/token", names.c_str(),
                  StoresKV(p).c_str(), bits, bytes);
    os << line;
    if (bf16_bytes > 0 && p.quantized()) {
      std::snprintf(line, sizeof line, " (%.1fx less)", bf16_bytes / bytes);
      os << line;
    }
    if (gpu != nullptr) {
      std::mt19937_64 rng(shape.seed);
      const FilledCache filled = FillCache(layer, shape.batch, shape.length, rng);
      try {
        const double us =
            gpu->AttendMicros(*filled.cache, filled.seqs, filled.q.data(), shape.iters, 3, true);
        if (!p.quantized()) bf16_us = us;
        std::snprintf(line, sizeof line, "; GPU step %.1f us (%s)", us, timed->name);
        os << line;
        if (bf16_us > 0 && p.quantized()) {
          std::snprintf(line, sizeof line, ", %.2fx faster than bf16", bf16_us / us);
          os << line;
        }
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kUnsupported) throw;
        os << "; no CUDA decode yet";
      }
    }
    os << "\n";
  }
  if (gpu == nullptr) {
    os << "  (no GPU step times: " << why_no_gpu << ")\n";
  }
  return os.str();
}

}  // namespace kvq::cli
