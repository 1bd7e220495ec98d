// Replays golden-vector cases against a ConformanceTarget and reports the first mismatch of
// each failing case (runner.h).
#include "kvq/conformance/runner.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <utility>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/stages.h"
#include "kvq/common/tensor.h"
#include "kvq/conformance/bits.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::conformance {
namespace {

// Fills output buffers before a kernel runs, so an element the kernel forgets to write shows
// up as a mismatch instead of passing by luck.
constexpr uint8_t kPoison = 0xA5;

// Throws the failure CompareBits finds (ReplayCase catches it).
void ExpectBits(const std::string& stage, const Tensor& expected, const void* got_data,
                size_t got_bytes, const std::string& axes = "") {
  if (std::optional<CaseFailure> f = CompareBits(stage, expected, got_data, got_bytes, axes)) {
    throw *f;
  }
}

template <typename T>
void ExpectBits(const std::string& stage, const Tensor& expected, const std::vector<T>& got,
                const std::string& axes = "") {
  ExpectBits(stage, expected, got.data(), got.size() * sizeof(T), axes);
}

const Tensor& Input(const Safetensors& c, const std::string& name, DType dtype,
                    const std::vector<int64_t>& shape) {
  const Tensor& t = c.Get(name);
  KVQ_CHECK(t.dtype == dtype, kMalformedFile, name, " is ", DTypeName(t.dtype), ", expected ",
            DTypeName(dtype));
  ExpectShape(t, shape, name);
  return t;
}

template <typename T>
std::vector<T> Poisoned(size_t count) {
  std::vector<T> v(count);
  std::memset(v.data(), kPoison, count * sizeof(T));
  return v;
}

// ---- Write-path stages, called directly through the backend's kernel table ----
// Generic over kvq/common/stages.inc: inputs "in.<name>" (a matrix from the case's rotation
// fixture), outputs poisoned, then compared with "expect.<expect>" in argument order.
void ReplayStage(const VectorSet& vs, const Safetensors& c, const cpu::Backend& backend) {
  const MetadataReader meta = CaseMetadata(c);
  const std::string& name = meta.String("stage");
  const StageSpec* stage = FindStage(name);
  KVQ_CHECK(stage != nullptr, kMalformedFile, "case ", meta.what(), ": unknown stage '", name,
            "'");
  const WriteParams p = GetWriteParams(meta, "");
  const int64_t n = meta.Int("rows", 0, int64_t{1} << 32);
  std::vector<std::vector<uint8_t>> buffers(static_cast<size_t>(stage->num_args));
  void* args[kMaxStageArgs] = {};
  for (int i = 0; i < stage->num_args; ++i) {
    const StageArg& arg = stage->args[i];
    std::vector<uint8_t>& buffer = buffers[static_cast<size_t>(i)];
    const std::vector<int64_t> shape = ArgShape(arg.extent, n, p);
    if (arg.extent == Extent::kMatrix) {
      const std::vector<float> r = GatherRotations(c, vs.fixtures, "in.rotation_index", p.head_dim);
      KVQ_CHECK(r.size() == static_cast<size_t>(p.head_dim) * p.head_dim, kMalformedFile,
                "in.rotation_index must pick one matrix");
      buffer.resize(r.size() * sizeof(float));
      std::memcpy(buffer.data(), r.data(), buffer.size());
    } else if (arg.is_input()) {
      buffer = Input(c, std::string("in.") + arg.name, arg.dtype, shape).bytes;
    } else {
      buffer.assign(ArgElements(arg.extent, n, p) * DTypeSize(arg.dtype), kPoison);
    }
    args[i] = buffer.data();
  }
  cpu::RunStage(backend.write, stage->id, args, static_cast<size_t>(n), p);
  for (int i = 0; i < stage->num_args; ++i) {
    const StageArg& arg = stage->args[i];
    if (!arg.is_output()) continue;
    const std::vector<uint8_t>& got = buffers[static_cast<size_t>(i)];
    ExpectBits(arg.expect, c.Get(std::string("expect.") + arg.expect), got.data(), got.size(),
               ExtentAxes(arg.extent));
  }
}

// ---- The whole write path through the validating entry point ----

void ReplayPipeline(const VectorSet& vs, const Safetensors& c, const cpu::Backend& backend) {
  const WriteParams p = GetWriteParams(CaseMetadata(c), "");
  const int64_t n = CaseMetadata(c).Int("rows");
  const Tensor& x = Input(c, "in.x", DType::kF32, {n, p.head_dim});
  std::vector<float> rotation;
  HeadArrays head;
  if (p.rotation == RotationKind::kDense) {
    rotation = GatherRotations(c, vs.fixtures, "in.rotation_index", p.head_dim);
    head.rotation = rotation.data();
  }
  // A codebook case with per-head block widths carries them (spec/formats.md §6).
  if (c.Find("in.widths") != nullptr) {
    head.widths = Input(c, "in.widths", DType::kU8, {p.head_dim / 2}).data<uint8_t>();
  }
  const cpu::QuantizedRows out =
      cpu::QuantizeRows(backend, p, head, x.data<float>(), static_cast<size_t>(n));
  // Every field of the format's write path, in write-path order, so the first mismatch names
  // the earliest stage that went wrong; the case must expect exactly these fields.
  std::set<std::string> compared;
  for (const auto& [field, got] : out.Tensors(p)) {
    ExpectBits(field, c.Get("expect." + field), got.bytes.data(), got.bytes.size(),
               OutputAxes(p, field));
    compared.insert("expect." + field);
  }
  for (const auto& [name, tensor] : c.tensors) {
    KVQ_CHECK(name.rfind("expect.", 0) != 0 || compared.count(name) != 0, kMalformedFile,
              "case ", CaseMetadata(c).what(), ": ", name, " is not an output of the write path of ",
              FormatName(p.format), p.norm ? " with a norm" : "");
  }
}

// ---- Paged cache storage ----
void ReplayCache(const VectorSet& vs, const Safetensors& c, const cpu::Backend& backend) {
  const ReplayedCache replayed = ReplayCacheScript(c, vs.fixtures, backend);
  const cpu::PagedKVCache& cache = *replayed.cache;
  const CacheParams& params = cache.params();
  const size_t row = static_cast<size_t>(params.num_kv_heads * params.head_dim());
  ExpectBits("pool_pages", c.Get("expect.pool_pages"),
             std::vector<int32_t>{cache.NumPages(), cache.NumFreePages()},
             CacheOutputAxes("pool_pages"));
  const char* kv_names[2] = {"key", "value"};
  const cpu::KV kvs[2] = {cpu::KV::kKey, cpu::KV::kValue};
  if (params.quantized()) {
    // Every plane of the format, in the layout's order (kvq/common/formats.inc).
    for (int h = 0; h < 2; ++h) {
      const FormatLayout& layout = cache.Layout(kvs[h]);
      const size_t pages = static_cast<size_t>(cache.NumPages());
      for (int i = 0; i < layout.num_planes; ++i) {
        const std::string name = std::string("pool.") + kv_names[h] + "." + layout.plane(i).name;
        ExpectBits(name, c.Get("expect." + name), cache.PoolPlane(kvs[h], i),
                   pages * cache.PagePlaneBytes(kvs[h], i), CacheOutputAxes(name));
      }
    }
  }
  for (size_t slot = 0; slot < replayed.slot_ids.size(); ++slot) {
    const int id = replayed.slot_ids[slot];
    const std::string base = "seq" + std::to_string(slot);
    if (id < 0) {
      KVQ_CHECK(c.Find("expect." + base + ".shape") == nullptr, kMalformedFile, "slot ", slot,
                " was removed but the case has expectations for it");
      continue;
    }
    const size_t t = cache.Length(id);
    const std::vector<int32_t> shape = {
        static_cast<int32_t>(t), static_cast<int32_t>(cache.SinkLength(id)),
        static_cast<int32_t>(cache.HistoryLength(id)), static_cast<int32_t>(cache.RecentBegin(id))};
    ExpectBits(base + ".shape", c.Get("expect." + base + ".shape"), shape,
               CacheOutputAxes(base + ".shape"));
    ExpectBits(base + ".page_table", c.Get("expect." + base + ".page_table"),
               cache.PageTable(id), CacheOutputAxes(base + ".page_table"));
    for (int h = 0; h < 2; ++h) {
      const std::string kv = kv_names[h];
      if (!params.quantized()) {
        ExpectBits(base + ".dense." + kv, c.Get("expect." + base + ".dense." + kv),
                   cache.DenseRows(id, kvs[h]), t * row * sizeof(uint16_t),
                   CacheOutputAxes(base + ".dense." + kv));
        continue;
      }
      ExpectBits(base + ".sink." + kv, c.Get("expect." + base + ".sink." + kv),
                 cache.SinkRows(id, kvs[h]), cache.SinkLength(id) * row * sizeof(uint16_t),
                 CacheOutputAxes(base + ".sink." + kv));
      // Recent rows in position order, read from the ring at slot position % (W + F - 1).
      const size_t begin = cache.RecentBegin(id);
      std::vector<uint16_t> recent;
      const uint16_t* ring = cache.RecentRing(id, kvs[h]);
      for (size_t pos = begin; pos < t; ++pos) {
        const uint16_t* r = ring + (pos % static_cast<size_t>(params.ring_slots())) * row;
        recent.insert(recent.end(), r, r + row);
      }
      ExpectBits(base + ".recent." + kv, c.Get("expect." + base + ".recent." + kv), recent,
                 CacheOutputAxes(base + ".recent." + kv));
    }
  }
}

// ---- Decode attention against the fp64 reference ----
void ReplayAttention(const VectorSet& vs, const Safetensors& c, const cpu::Backend& backend) {
  const ReplayedCache replayed = ReplayCacheScript(c, vs.fixtures, cpu::ScalarBackend());
  const cpu::PagedKVCache& cache = *replayed.cache;
  const CacheParams& params = cache.params();
  const Tensor& slots = c.Get("in.query_slots");
  const int64_t nq = static_cast<int64_t>(slots.numel());
  const Tensor& q = Input(c, "in.q", DType::kF32, {nq, params.num_q_heads, params.head_dim()});
  // The CPU oracle's tolerance, or the CUDA path's (spec/cache.md §5).
  const double tolerance = CaseMetadata(c).Double(
      backend.device == cpu::Device::kCuda ? "tolerance_gpu" : "tolerance");
  const size_t per_query = static_cast<size_t>(params.num_q_heads * params.head_dim());
  for (int64_t i = 0; i < nq; ++i) {
    const int seq = QuerySequence(c, replayed, i);
    std::vector<float> out(per_query, std::numeric_limits<float>::quiet_NaN());
    backend.attend(cache, {seq}, q.data<float>() + i * per_query, out.data());
    if (std::optional<CaseFailure> f = CompareAttention(c, i, out.data(), tolerance)) throw *f;
  }
}

}  // namespace

int QuerySequence(const Safetensors& c, const ReplayedCache& replayed, int64_t query) {
  const Tensor& slots = c.Get("in.query_slots");
  KVQ_CHECK(query >= 0 && static_cast<size_t>(query) < slots.numel(), kInvalidArgument,
            "query ", query, " is not one of the case's ", slots.numel());
  const int32_t slot = slots.data<int32_t>()[query];
  KVQ_CHECK(slot >= 0 && static_cast<size_t>(slot) < replayed.slot_ids.size() &&
                replayed.slot_ids[slot] >= 0,
            kMalformedFile, "in.query_slots[", query, "] = ", slot, " is not a live sequence");
  return replayed.slot_ids[slot];
}

std::optional<CaseFailure> CompareAttention(const Safetensors& c, int64_t query,
                                            const float* out, double tolerance) {
  const CacheParams params = GetCacheParams(c);
  const int hq = params.num_q_heads, d = params.head_dim();
  const Tensor& slots = c.Get("in.query_slots");
  const int64_t nq = static_cast<int64_t>(slots.numel());
  KVQ_CHECK(query >= 0 && query < nq, kInvalidArgument, "query ", query,
            " is not one of the case's ", nq);
  const int32_t slot = slots.data<int32_t>()[query];
  const Tensor& ref_bytes = Input(c, "expect.reference_f64", DType::kU8, {nq, hq, d, 8});
  const size_t per_query = static_cast<size_t>(hq * d);
  const int64_t i = query;
  const auto first = ref_bytes.bytes.begin() + static_cast<ptrdiff_t>(i * per_query * 8);
  const std::vector<double> ref =
      BytesToF64(std::vector<uint8_t>(first, first + static_cast<ptrdiff_t>(per_query * 8)));
  const double* r = ref.data();
  const std::vector<double> errors = cpu::RelativeErrorPerHead(out, r, hq, d);
  for (int h = 0; h < hq; ++h) {
    const float* o = out + static_cast<size_t>(h) * d;
    const double* rh = r + static_cast<size_t>(h) * d;
    bool finite = true;
    for (int j = 0; j < d; ++j) finite = finite && std::isfinite(o[j]);
    if (finite && errors[h] <= tolerance) continue;
    // Name the channel with the largest error (or the first non-finite one).
    int worst = 0;
    double worst_error = -1.0, max_ref = 0.0;
    for (int j = 0; j < d; ++j) {
      max_ref = std::max(max_ref, std::fabs(rh[j]));
      const double e = std::isfinite(o[j]) ? std::fabs(o[j] - rh[j])
                                           : std::numeric_limits<double>::infinity();
      if (e > worst_error) {
        worst_error = e;
        worst = j;
      }
    }
    CaseFailure f;
    f.mismatch.stage = "out";
    f.mismatch.row = i * hq + h;
    f.mismatch.column = worst;
    f.mismatch.where = "[query " + std::to_string(i) + " (slot " + std::to_string(slot) +
                       "), head " + std::to_string(h) + ", channel " + std::to_string(worst) +
                       "] (row = query * Hq + head)";
    char text[160];
    std::snprintf(text, sizeof text, "%.17g (fp64 reference; max|ref| of the head %.9g)",
                  rh[worst], max_ref);
    f.mismatch.expected = text;
    std::snprintf(text, sizeof text, "%.9g (relative error of the head %.3g > tolerance %.3g)",
                  static_cast<double>(o[worst]), errors[h], tolerance);
    f.mismatch.got = text;
    f.message = "attention output out of tolerance at row " + std::to_string(f.mismatch.row) +
                ", column " + std::to_string(worst) + " " + f.mismatch.where + ": expected " +
                f.mismatch.expected + ", got " + f.mismatch.got;
    return f;
  }
  return std::nullopt;
}

const char* CaseStatusName(CaseStatus status) {
  switch (status) {
    case CaseStatus::kPass:
      return "PASS";
    case CaseStatus::kFail:
      return "FAIL";
    case CaseStatus::kSkipped:
      return "SKIP";
  }
  return "?";
}

std::optional<CaseFailure> CompareBits(const std::string& output, const Tensor& expected,
                                       const void* got, size_t got_bytes,
                                       const std::string& axes) {
  std::optional<BitMismatch> m;
  try {
    m = FirstBitMismatch(expected, got, got_bytes);
  } catch (const Error& e) {
    throw Error(e.code(), output + ": " + e.what());
  }
  if (!m) return std::nullopt;
  CaseFailure f;
  f.mismatch.stage = output;
  f.mismatch.row = m->row;
  f.mismatch.column = m->column;
  f.mismatch.where = m->where + (axes.empty() ? "" : " (" + axes + ")");
  f.mismatch.expected = m->expected;
  f.mismatch.got = m->got;
  // Row: the index over every dimension but the last; column: the last. A 1-D tensor (tau,
  // per-row values) has rows only.
  const std::string at = "row " + std::to_string(m->row) +
                         (m->column >= 0 ? ", column " + std::to_string(m->column) : "");
  f.message = output + " differs at " + at + " " + f.mismatch.where + ": expected " +
              f.mismatch.expected + ", got " + f.mismatch.got;
  return f;
}

const char* CacheOutputAxes(const std::string& output) {
  const auto ends_with = [&](const std::string& tail) {
    return output.size() >= tail.size() &&
           output.compare(output.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (output == "pool_pages") return "pages created, pages free";
  if (output.rfind("pool.", 0) == 0) return "page, KV head, slot, element";
  if (output.rfind("seq", 0) != 0) return "";
  if (ends_with(".shape")) return "length, sink, history, recent begin";
  if (ends_with(".page_table")) return "page index";
  if (output.find(".recent.") != std::string::npos) {
    return "position - recent begin, KV head, channel";
  }
  if (output.find(".sink.") != std::string::npos || output.find(".dense.") != std::string::npos) {
    return "position, KV head, channel";
  }
  return "";
}

const char* OutputAxes(const WriteParams& p, const std::string& field) {
  std::vector<StageId> writers = CodecSteps(p.format, CodecPass::kEncode);
  for (const StageSpec& stage : AllStages()) {
    if (stage.transform) writers.push_back(stage.id);
  }
  for (StageId id : writers) {
    const StageSpec& stage = GetStage(id);
    for (int i = 0; i < stage.num_args; ++i) {
      if (stage.args[i].is_output() && field == stage.args[i].expect) {
        return ExtentAxes(stage.args[i].extent);
      }
    }
  }
  return "row, column";
}

VectorSet LoadVectorSet(const std::string& dir) {
  VectorSet vs;
  vs.dir = dir;
  std::vector<VerifiedFile> files = ReadVerifiedFiles(dir, &vs.manifest);
  for (VerifiedFile& f : files) {
    Safetensors parsed;
    try {
      parsed = ParseSafetensors(f.bytes.data(), f.bytes.size());
    } catch (const Error& e) {
      throw Error(ErrorCode::kMalformedFile, "'" + f.entry.path + "': " + e.what());
    }
    if (f.entry.role == "fixture") {
      KVQ_CHECK(CaseMetadata(parsed).String("format") == kFixtureFormat, kMalformedFile, "'",
                f.entry.path, "' is listed as a fixture but its format is '",
                CaseMetadata(parsed).String("format"), "'");
      vs.fixtures[f.entry.path] = Fixture{f.entry.sha256, std::move(parsed)};
      continue;
    }
    KVQ_CHECK(CaseMetadata(parsed).String("format") == kCaseFormat, kMalformedFile, "'", f.entry.path,
              "' has format '", CaseMetadata(parsed).String("format"), "', expected ", kCaseFormat);
    const std::string& version = CaseMetadata(parsed).String("spec_version");
    KVQ_CHECK(IsReplayableSpecVersion(version), kMismatch, "'", f.entry.path, "' is for spec ",
              version, ", this build implements spec ", kSpecVersion,
              " (cases of 1.0, 1.1, 1.2 and 1.3)");
    KVQ_CHECK(version == RequiredSpecVersion(parsed), kMalformedFile, "'", f.entry.path,
              "' is labelled spec ", version, " but its parameters are those of spec ",
              RequiredSpecVersion(parsed));
    KVQ_CHECK(CaseMetadata(parsed).String("kind") == f.entry.kind, kMalformedFile, "'", f.entry.path,
              "' has kind '", CaseMetadata(parsed).String("kind"), "' but manifest.json says '",
              f.entry.kind, "'");
    ParseCaseKind(f.entry.kind);
    std::string name = f.entry.path;
    const std::string suffix = ".safetensors";
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      name.resize(name.size() - suffix.size());
    }
    vs.case_names.push_back(name);
    vs.cases.push_back(std::move(parsed));
  }
  return vs;
}

CaseResult ReplayCase(const VectorSet& vectors, size_t index, const cpu::Backend& backend) {
  KVQ_CHECK(index < vectors.cases.size(), kInvalidArgument, "case index ", index, " of ",
            vectors.cases.size());
  const Safetensors& c = vectors.cases[index];
  CaseResult result;
  result.name = vectors.case_names[index];
  result.kind = CaseMetadata(c).String("kind");
  const CaseKind kind = ParseCaseKind(result.kind);
  if (kind == CaseKind::kAttention && !backend.attend) {
    result.status = CaseStatus::kSkipped;
    result.message = "backend '" + backend.name + "' has no decode step";
    return result;
  }
  try {
    switch (kind) {
      case CaseKind::kStage:
        ReplayStage(vectors, c, backend);
        break;
      case CaseKind::kPipeline:
        ReplayPipeline(vectors, c, backend);
        break;
      case CaseKind::kCache:
        ReplayCache(vectors, c, backend);
        break;
      case CaseKind::kAttention:
        ReplayAttention(vectors, c, backend);
        break;
    }
    result.status = CaseStatus::kPass;
  } catch (const CaseFailure& f) {
    result.status = CaseStatus::kFail;
    result.mismatch = f.mismatch;
    result.message = f.message;
  } catch (const Error& e) {
    // A configuration the target declares unsupported (e.g. a GPU kernel's documented limits)
    // is reported as skipped, with the target's reason; every other error is a failure.
    result.status = e.code() == ErrorCode::kUnsupported ? CaseStatus::kSkipped : CaseStatus::kFail;
    result.message = std::string(e.code() == ErrorCode::kUnsupported ? "unsupported: " : "error: ") +
                     e.what();
  } catch (const std::exception& e) {
    result.status = CaseStatus::kFail;
    result.message = std::string("error: ") + e.what();
  }
  return result;
}

std::vector<CaseResult> RunConformance(const VectorSet& vectors, const cpu::Backend& backend) {
  std::vector<CaseResult> results;
  results.reserve(vectors.cases.size());
  for (size_t i = 0; i < vectors.cases.size(); ++i) {
    results.push_back(ReplayCase(vectors, i, backend));
  }
  return results;
}

std::vector<CaseResult> RunConformance(const std::string& dir, const cpu::Backend& backend) {
  return RunConformance(LoadVectorSet(dir), backend);
}

std::string DescribeResult(const CaseResult& result) {
  std::string line = std::string(CaseStatusName(result.status)) + " " + result.name;
  if (!result.message.empty()) line += ": " + result.message;
  return line;
}

std::string DefaultVectorsDir() {
  namespace fs = std::filesystem;
  std::vector<std::string> looked;
  // A folder qualifies when it holds manifest.json; otherwise say what was there.
  auto holds_vectors = [&](const fs::path& dir, const std::string& label) {
    std::error_code ec;
    if (fs::is_regular_file(dir / kManifestFileName, ec)) return true;
    const bool exists = fs::exists(dir, ec);
    looked.push_back(label + dir.string() + (exists ? " (no manifest.json)" : " (absent)"));
    return false;
  };
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = exe.parent_path() / "vectors";
    if (holds_vectors(beside, "")) return beside.string();
    const fs::path installed = (exe.parent_path() / ".." / "share" / "kvq" / "vectors");
    if (holds_vectors(installed.lexically_normal(), "")) {
      return installed.lexically_normal().string();
    }
  } else {
    looked.push_back("beside the executable (/proc/self/exe: " + ec.message() + ")");
  }
  const char* env = std::getenv("KVQ_VECTORS_DIR");
  if (env != nullptr && env[0] != '\0') {
    if (holds_vectors(env, "$KVQ_VECTORS_DIR=")) return env;
  } else {
    looked.push_back("$KVQ_VECTORS_DIR (not set)");
  }
  std::string places;
  for (const std::string& place : looked) places += (places.empty() ? "" : "; ") + place;
  KVQ_CHECK(false, kIoError, "no golden vectors folder found; looked in: ", places,
            "; give --vectors DIR or set KVQ_VECTORS_DIR");
  return {};
}

}  // namespace kvq::conformance
