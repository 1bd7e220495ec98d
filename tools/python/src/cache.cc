// The paged cache of a cache or attention case (conformance::ReplayCacheScript, built by the
// scalar write path as `kvq conform` builds it), or of a script (replay_cache), as an attention
// kernel reads it: parameters, page tables, the pool's planes, the bf16 windows; and kvq's own
// decode step over it (attend). The cache is frozen once built, so its planes are read-only
// views that keep it alive.
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/conformance/case_format.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::python {
namespace {

using conformance::ReplayedCache;
using SharedCache = std::shared_ptr<ReplayedCache>;
using cpu::KV;

KV KVOf(const std::string& kv) {
  KVQ_CHECK(kv == "key" || kv == "value", kInvalidArgument, "kv must be 'key' or 'value', got '",
            kv, "'");
  return kv == "key" ? KV::kKey : KV::kValue;
}

const cpu::PagedKVCache& CacheOf(const SharedCache& c) { return *c->cache; }

// Every bf16 row's shape: [rows, Hkv, d].
std::vector<int64_t> RowsShape(const cpu::PagedKVCache& cache, size_t rows) {
  return {static_cast<int64_t>(rows), cache.params().num_kv_heads, cache.params().head_dim()};
}

py::dict Params(const SharedCache& c) {
  const CacheParams& p = CacheOf(c).params();
  return py::dict(py::arg("num_kv_heads") = p.num_kv_heads, py::arg("num_q_heads") = p.num_q_heads,
                  py::arg("head_dim") = p.head_dim(), py::arg("sink") = p.sink,
                  py::arg("recent") = p.recent, py::arg("flush") = p.flush,
                  py::arg("page_size") = p.page_size, py::arg("softmax_scale") = p.scale(),
                  py::arg("quantized") = p.quantized(), py::arg("key") = p.key,
                  py::arg("value") = p.value);
}

// {plane name: [pages, heads per page, rows per page, elements]} of one side's pool.
py::dict Pool(const SharedCache& c, const std::string& kv) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  KVQ_CHECK(cache.params().quantized(), kInvalidArgument, "a bf16 cache has no pool");
  const KV side = KVOf(kv);
  const FormatLayout& layout = cache.Layout(side);
  const CacheParams& p = cache.params();
  py::object owner = py::cast(c);
  py::dict planes;
  for (int i = 0; i < layout.num_planes; ++i) {
    const PlaneSpec& plane = layout.plane(i);
    planes[plane.name] = ReadOnlyView(
        plane.dtype,
        {cache.NumPages(), layout.HeadsPerPage(i, p.num_kv_heads),
         layout.RowsPerPage(i, p.page_size), plane.elements},
        cache.PoolPlane(side, i), owner);
  }
  return planes;
}

py::array Sink(const SharedCache& c, int seq, const std::string& kv) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  // A bf16 cache keeps every row in one run whose first SinkLength rows are the sink.
  const uint16_t* rows = cache.params().quantized() ? cache.SinkRows(seq, KVOf(kv))
                                                    : cache.DenseRows(seq, KVOf(kv));
  return ReadOnlyView(DType::kBF16, RowsShape(cache, cache.SinkLength(seq)), rows, py::cast(c));
}

// Positions [RecentBegin, t) in position order (a copy out of the ring).
py::array Recent(const SharedCache& c, int seq, const std::string& kv) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  const size_t begin = cache.RecentBegin(seq), t = cache.Length(seq);
  const size_t row = static_cast<size_t>(cache.params().num_kv_heads * cache.params().head_dim());
  std::vector<uint8_t> bytes((t - begin) * row * sizeof(uint16_t));
  for (size_t pos = begin; pos < t; ++pos) {
    std::memcpy(bytes.data() + (pos - begin) * row * sizeof(uint16_t),
                cache.Bf16Row(seq, pos, KVOf(kv)), row * sizeof(uint16_t));
  }
  return Adopt(DType::kBF16, RowsShape(cache, t - begin), std::move(bytes));
}

py::object Rotation(const SharedCache& c, const std::string& kv, int head) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  const float* r = cache.Rotation(KVOf(kv), head);
  if (r == nullptr) return py::none();
  const int d = cache.params().head_dim();
  return ReadOnlyView(DType::kF32, {d, d}, r, py::cast(c));
}

// The element type of a head_data.inc array row as an array dtype.
template <typename T>
constexpr DType RowDType() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint8_t>, "a new row type");
  return std::is_same_v<T, float> ? DType::kF32 : DType::kU8;
}

// {row name: [Hkv, extent] array} of every head_data.inc array row the side holds.
py::dict HeadArrays(const SharedCache& c, const std::string& kv) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  const HeadData& heads = cache.Heads(KVOf(kv));
  const int64_t hkv = cache.params().num_kv_heads;
  py::dict out;
#define KVQ_HEAD_ARRAY(name, Type, ...)                                                     \
  if (!heads.name.empty()) {                                                                \
    out[#name] = ReadOnlyView(RowDType<Type>(),                                             \
                              {hkv, static_cast<int64_t>(heads.name.size()) / hkv},         \
                              heads.name.data(), py::cast(c));                              \
  }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return out;
}

py::array DequantizedHistory(const SharedCache& c, int seq, int head, const std::string& kv) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  const std::vector<float> rows = cache.DequantizedHistory(seq, head, KVOf(kv));
  std::vector<uint8_t> bytes(rows.size() * sizeof(float));
  std::memcpy(bytes.data(), rows.data(), bytes.size());
  return Adopt(DType::kF32,
               {static_cast<int64_t>(cache.HistoryLength(seq)), cache.params().head_dim()},
               std::move(bytes));
}

py::array Attend(const SharedCache& c, int seq, const py::object& q) {
  const cpu::PagedKVCache& cache = CacheOf(c);
  const CacheParams& p = cache.params();
  const int64_t n = int64_t{p.num_q_heads} * p.head_dim();
  const py::array query = ContiguousOf(q, DType::kF32, "q");
  KVQ_CHECK(query.size() == n, kShapeMismatch, "q must hold Hq * d = ", n, " floats, got ",
            query.size());
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * sizeof(float));
  cpu::Attend(cpu::ScalarBackend(), cache, seq, static_cast<const float*>(query.data()),
              reinterpret_cast<float*>(bytes.data()));
  return Adopt(DType::kF32, {p.num_q_heads, p.head_dim()}, std::move(bytes));
}

// CacheParams from a dict as Cache.params gives it (head_dim, quantized and any other key are
// ignored; softmax_scale is optional); validated by the cache.
CacheParams CacheParamsOf(const py::dict& d) {
  const auto get = [&](const char* key) {
    KVQ_CHECK(d.contains(key), kInvalidArgument, "cache params lack '", key, "'");
    return d[key];
  };
  CacheParams p;
  p.num_kv_heads = get("num_kv_heads").cast<int>();
  p.num_q_heads = get("num_q_heads").cast<int>();
  p.sink = get("sink").cast<int>();
  p.recent = get("recent").cast<int>();
  p.flush = get("flush").cast<int>();
  p.page_size = get("page_size").cast<int>();
  p.key = get("key").cast<WriteParams>();
  p.value = get("value").cast<WriteParams>();
  if (d.contains("softmax_scale")) p.softmax_scale = d["softmax_scale"].cast<float>();
  return p;
}

// One side's HeadData from {"params": [the WriteParams of each KV head], "rotation": float32
// [Hkv, d, d] or None, and any other head_data.inc array row by its name ("widths": uint8
// [Hkv, d/2]) or None} (every key may be absent): a per-head scalar of head_data.inc is kept
// only where some head's value differs from the side's (`shared`).
HeadData HeadDataOf(const py::object& side, const WriteParams& shared, int hkv, const char* kv) {
  HeadData heads;
  if (side.is_none()) return heads;
  const py::dict d = side.cast<py::dict>();
  {
    const WriteParams& p = shared;  // what a row's extent is an expression of
#define KVQ_HEAD_ARRAY(name, Type, extent, ...)                                                \
    if (d.contains(#name) && !d[#name].is_none()) {                                            \
      const py::array a = ContiguousOf(d[#name], RowDType<Type>(), std::string(kv) + " " #name); \
      const int64_t want = int64_t{hkv} * (extent);                                            \
      KVQ_CHECK(a.size() == want, kShapeMismatch, kv, " " #name " must hold Hkv * ",           \
                (extent), " = ", want, " values, got ", a.size());                             \
      const Type* v = static_cast<const Type*>(a.data());                                      \
      heads.name.assign(v, v + want);                                                          \
    }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
    (void)p;
  }
  if (d.contains("params") && !d["params"].is_none()) {
    const std::vector<WriteParams> per_head = d["params"].cast<std::vector<WriteParams>>();
    KVQ_CHECK(static_cast<int>(per_head.size()) == hkv, kShapeMismatch, kv,
              " params must hold one WriteParams per KV head (", hkv, "), got ",
              per_head.size());
#define KVQ_HEAD_SCALAR(name, field, noun, valid, rule)                                      \
    for (const WriteParams& h : per_head) {                                                  \
      if (h.field != shared.field) {                                                         \
        for (const WriteParams& each : per_head) heads.name.push_back(each.field);           \
        break;                                                                               \
      }                                                                                      \
    }
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_SCALAR
  }
  return heads;
}

// The cache a script builds (conformance::RunCacheScript, kvq's scalar write path).
py::object ReplayCache(const py::dict& params, const py::dict& heads, const py::object& ops,
                       const py::object& k, const py::object& v) {
  const CacheParams p = CacheParamsOf(params);
  const int64_t row = int64_t{p.num_kv_heads} * p.head_dim();
  const py::array op = ContiguousOf(ops, DType::kI32, "ops");
  KVQ_CHECK(op.size() % 3 == 0, kShapeMismatch, "ops must be int32 [m, 3], got ", op.size(),
            " values");
  const py::array krows = ContiguousOf(k, DType::kBF16, "k");
  const py::array vrows = ContiguousOf(v, DType::kBF16, "v");
  KVQ_CHECK(krows.size() % row == 0 && vrows.size() == krows.size(), kShapeMismatch,
            "k and v must be bf16 bits [rows, Hkv, d] with Hkv * d = ", row, ", got ",
            krows.size(), " and ", vrows.size(), " values");
  const auto side = [&](const char* kv) {
    return heads.contains(kv) ? py::object(heads[kv]) : py::object(py::none());
  };
  HeadData key = HeadDataOf(side("key"), p.key, p.num_kv_heads, "key");
  HeadData value = HeadDataOf(side("value"), p.value, p.num_kv_heads, "value");
  return py::cast(std::make_shared<ReplayedCache>(conformance::RunCacheScript(
      p, std::move(key), std::move(value), cpu::ScalarBackend(),
      static_cast<const int32_t*>(op.data()), static_cast<size_t>(op.size() / 3),
      static_cast<const uint16_t*>(krows.data()), static_cast<const uint16_t*>(vrows.data()),
      static_cast<size_t>(krows.size() / row), "script")));
}

}  // namespace

py::object ReplayedCacheOf(const Safetensors& file, const conformance::Fixtures& fixtures) {
  return py::cast(std::make_shared<ReplayedCache>(
      conformance::ReplayCacheScript(file, fixtures, cpu::ScalarBackend())));
}

void BindCache(py::module_& m) {
  py::class_<ReplayedCache, SharedCache>(
      m, "Cache",
      "An attention case's paged cache (spec/cache.md), its script replayed by kvq's scalar "
      "write path; read-only. kv is 'key' or 'value'; seq a sequence id (Case.query_sequences). "
      "bf16 rows are uint16 bits [rows, Hkv, d].")
      .def_property_readonly("params", &Params,
                             "dict: num_kv_heads, num_q_heads, head_dim, sink, recent, flush, "
                             "page_size, softmax_scale (the scale applied), quantized, key and "
                             "value (kvq.WriteParams).")
      .def("sequences", [](const SharedCache& c) { return CacheOf(c).SequenceIds(); })
      .def("length", [](const SharedCache& c, int seq) { return CacheOf(c).Length(seq); })
      .def("sink_length", [](const SharedCache& c, int seq) { return CacheOf(c).SinkLength(seq); })
      .def("history_length",
           [](const SharedCache& c, int seq) { return CacheOf(c).HistoryLength(seq); })
      .def("recent_begin",
           [](const SharedCache& c, int seq) { return CacheOf(c).RecentBegin(seq); })
      .def("page_table", [](const SharedCache& c, int seq) { return CacheOf(c).PageTable(seq); },
           "list of page ids: history token i is in page table[i // P], slot i % P.")
      .def("pool", &Pool, py::arg("kv"),
           "{plane name: array [pages, heads per page, rows per page, elements]} of the "
           "format's planes (a tile plane's row holds a tile); kvq.Error for a bf16 cache.")
      .def("sink", &Sink, py::arg("seq"), py::arg("kv"),
           "bf16 bits [sink length, Hkv, d] (positions 0..; a bf16 cache's rows past the sink "
           "are recent()).")
      .def("recent", &Recent, py::arg("seq"), py::arg("kv"),
           "bf16 bits [t - recent_begin, Hkv, d], positions recent_begin.. in order (a copy).")
      .def("head_params",
           [](const SharedCache& c, const std::string& kv, int head) {
             KVQ_CHECK(head >= 0 && head < CacheOf(c).params().num_kv_heads, kInvalidArgument,
                       "KV head ", head, " is not one of the cache's ",
                       CacheOf(c).params().num_kv_heads);
             return CacheOf(c).HeadParams(KVOf(kv), head);
           },
           py::arg("kv"), py::arg("head"),
           "kvq.WriteParams: the write parameters KV head `head` is written with (the side's, "
           "with the head's clip ratio and fp8 scale).")
      .def("head_arrays", &HeadArrays, py::arg("kv"),
           "{row name: array [Hkv, extent]} of every per-head array row the side holds "
           "(head_data.inc: 'rotation' float32 [Hkv, d*d], 'widths' uint8 [Hkv, d/2], ...).")
      .def("rotation", &Rotation, py::arg("kv"), py::arg("head"),
           "float32 [d, d]: the dense rotation of a KV head; None for identity / Hadamard.")
      .def("dequantized_history", &DequantizedHistory, py::arg("seq"), py::arg("head"),
           py::arg("kv"), "float32 [history length, d]: the history as the cache dequantizes "
                          "it (rotated space).");
  m.def("replay_cache", &ReplayCache, py::arg("params"), py::arg("heads"), py::arg("ops"),
        py::arg("k"), py::arg("v"),
        "kvq.Cache: a paged cache built by kvq's scalar write path from a script "
        "(conformance::RunCacheScript). params: a dict as Cache.params gives it; heads: "
        "{'key': {'params': [kvq.WriteParams per KV head], 'rotation': float32 [Hkv, d, d] or "
        "None, and any other per-head array row by name, e.g. 'widths': uint8 [Hkv, d/2]}, "
        "'value': {...}} (every key may be absent); ops int32 [m, 3] of (op, slot, tokens): "
        "0 adds a sequence (slots count up from 0), 1 prefills `tokens` rows, 2 appends one, 3 "
        "removes the slot; k, v bf16 bits [rows, Hkv, d] taken in order. kvq.Error for what "
        "the cache refuses or a malformed script.");
  m.def("attend", &Attend, py::arg("cache"), py::arg("seq"), py::arg("q"),
        "kvq's decode step (cpu::Attend, scalar): q float32 [Hq, d] over sequence seq of cache "
        "-> out float32 [Hq, d]. kvq.Error for an unknown or empty sequence, a non-finite q.");
}

}  // namespace kvq::python
