// The golden vectors through conformance's one reader (LoadVectorSet: the manifest verified,
// every file parsed): a VectorSet of cases, each with its metadata, parameters, inputs,
// expected outputs and tolerance. Tensors are read-only views into the loaded set (no copy).
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <pybind11/stl.h>

#include "bindings.h"
#include "kvq/common/error.h"
#include "kvq/common/metadata.h"
#include "kvq/common/stages.h"
#include "kvq/conformance/case_format.h"
#include "kvq/conformance/runner.h"

namespace kvq::python {
namespace {

using conformance::VectorSet;
using SharedSet = std::shared_ptr<VectorSet>;  // never modified once loaded

// One case of a loaded set; keeps the set alive.
struct CaseRef {
  SharedSet set;
  size_t index = 0;

  const Safetensors& file() const { return set->cases[index]; }
  const std::string& name() const { return set->case_names[index]; }
};

// The tensors whose names start with `prefix`, the prefix dropped, as views into the set.
py::dict TensorsWithPrefix(const CaseRef& c, const std::string& prefix) {
  py::object owner = py::cast(c.set);
  py::dict out;
  for (const auto& [name, t] : c.file().tensors) {
    if (name.rfind(prefix, 0) != 0) continue;
    out[name.substr(prefix.size()).c_str()] = ReadOnlyView(t.dtype, t.shape, t.bytes.data(), owner);
  }
  return out;
}

CaseRef FindCase(const SharedSet& set, const std::string& name) {
  for (size_t i = 0; i < set->case_names.size(); ++i) {
    if (set->case_names[i] == name) return CaseRef{set, i};
  }
  throw Error(ErrorCode::kInvalidArgument,
              "no case '" + name + "' in " + set->dir + " (" +
                  std::to_string(set->case_names.size()) + " cases)");
}

// What the axes of expected output `output` mean: from the stage argument that writes it (stage
// cases), the write path's output (pipeline cases) or the cache replay's names (cache cases);
// none for attention cases.
std::string AxesOf(const CaseRef& c, const std::string& output) {
  const MetadataReader meta = conformance::CaseMetadata(c.file());
  const std::string& kind = meta.String("kind");
  if (kind == "pipeline") return conformance::OutputAxes(GetWriteParams(meta, ""), output);
  if (kind == "cache") return conformance::CacheOutputAxes(output);
  if (kind != "stage") return "";
  const StageSpec& stage = StageByName(meta.String("stage"));
  for (int i = 0; i < stage.num_args; ++i) {
    if (stage.args[i].is_output() && output == stage.args[i].expect) {
      return ExtentAxes(stage.args[i].extent);
    }
  }
  return "";
}

// None, or a failure as a dict: output, row, column, where, expected, got, message.
py::object FailureOf(const std::optional<conformance::CaseFailure>& f) {
  if (!f) return py::none();
  return py::dict(py::arg("output") = f->mismatch.stage, py::arg("row") = f->mismatch.row,
                  py::arg("column") = f->mismatch.column, py::arg("where") = f->mismatch.where,
                  py::arg("expected") = f->mismatch.expected, py::arg("got") = f->mismatch.got,
                  py::arg("message") = f->message);
}

// None when `got` has every bit of expect.<output>; else the first mismatch, as kvq conform
// reports it (conformance::CompareBits), the message naming `label`.
py::object Compare(const CaseRef& c, const std::string& output, const py::object& got,
                   const std::string& label) {
  const Tensor& expected = c.file().Get("expect." + output);
  const py::array bytes = ContiguousOf(got, expected.dtype, label.empty() ? output : label);
  const std::optional<conformance::CaseFailure> f = conformance::CompareBits(
      label.empty() ? output : label, expected, bytes.data(),
      static_cast<size_t>(bytes.nbytes()), AxesOf(c, output));
  return FailureOf(f);
}

// The verdict on an attention kernel's output for query `query` (conformance::CompareAttention).
py::object CompareAttention(const CaseRef& c, int64_t query, const py::object& out,
                            double tolerance) {
  const py::array values = ContiguousOf(out, DType::kF32, "out");
  const CacheParams p = conformance::GetCacheParams(c.file());
  KVQ_CHECK(values.size() == int64_t{p.num_q_heads} * p.head_dim(), kShapeMismatch,
            "out must hold Hq * d = ", p.num_q_heads * p.head_dim(), " floats, got ",
            values.size());
  return FailureOf(conformance::CompareAttention(c.file(), query,
                                                 static_cast<const float*>(values.data()),
                                                 tolerance));
}

bool HasWriteParams(const CaseRef& c) {
  const std::string& kind = conformance::CaseMetadata(c.file()).String("kind");
  return kind == "stage" || kind == "pipeline";
}

// The case's exact-or-tolerance rule: 0 where bits are compared exactly, else the metadata's.
double Tolerance(const CaseRef& c, const char* key) {
  const MetadataReader meta = conformance::CaseMetadata(c.file());
  return meta.Has(key) ? meta.Double(key) : 0.0;
}

}  // namespace

void BindVectors(py::module_& m) {
  py::class_<VectorSet, SharedSet>(m, "VectorSet",
                                   "A verified golden-vector folder (conformance::LoadVectorSet).")
      .def_readonly("dir", &VectorSet::dir)
      .def_property_readonly("spec_version",
                             [](const VectorSet& s) { return s.manifest.spec_version; })
      .def_property_readonly("seed", [](const VectorSet& s) { return s.manifest.seed; })
      .def("names", [](const VectorSet& s) { return s.case_names; },
           "Every case name in manifest order ('pipeline/d64_g32_b2_...').")
      .def("__len__", [](const VectorSet& s) { return s.case_names.size(); })
      .def("case", &FindCase, py::arg("name"),
           "The case called `name`; kvq.Error (invalid argument) when there is none.");

  py::class_<CaseRef>(m, "Case", "One golden-vector case (conformance/README.md, 'A case file').")
      .def_property_readonly("name", &CaseRef::name)
      .def_property_readonly(
          "kind",
          [](const CaseRef& c) { return conformance::CaseMetadata(c.file()).String("kind"); },
          "'stage', 'pipeline', 'cache' or 'attention'.")
      .def_property_readonly("metadata", [](const CaseRef& c) { return c.file().metadata; },
                             "Every metadata string of the file.")
      .def_property_readonly(
          "inputs", [](const CaseRef& c) { return TensorsWithPrefix(c, "in."); },
          "{name: array} of the 'in.*' tensors, 'in.' dropped (read-only views, no copy; bf16 "
          "as uint16 bits).")
      .def_property_readonly(
          "expected", [](const CaseRef& c) { return TensorsWithPrefix(c, "expect."); },
          "{name: array} of the 'expect.*' tensors, 'expect.' dropped (read-only views).")
      .def_property_readonly(
          "tolerance", [](const CaseRef& c) { return Tolerance(c, "tolerance"); },
          "0.0 where the expected bits are compared exactly; for attention cases the CPU "
          "oracle's bound on max_j |o - ref| / max_j |ref| per query head (spec/cache.md §5).")
      .def_property_readonly(
          "tolerance_gpu", [](const CaseRef& c) { return Tolerance(c, "tolerance_gpu"); },
          "The CUDA path's bound (attention cases), else 0.0.")
      .def_property_readonly(
          "write_params",
          [](const CaseRef& c) -> py::object {
            if (!HasWriteParams(c)) return py::none();
            return py::cast(GetWriteParams(conformance::CaseMetadata(c.file()), ""));
          },
          "The kvq.WriteParams of a stage or pipeline case; None for cache and attention cases.")
      .def_property_readonly(
          "rotation",
          [](const CaseRef& c) -> py::object {
            if (!HasWriteParams(c) || !c.file().Find("in.rotation_index")) return py::none();
            const int d = GetWriteParams(conformance::CaseMetadata(c.file()), "").head_dim;
            std::vector<float> r =
                conformance::GatherRotations(c.file(), c.set->fixtures, "in.rotation_index", d);
            const int64_t m = static_cast<int64_t>(r.size()) / (int64_t{d} * d);
            std::vector<uint8_t> bytes(r.size() * sizeof(float));
            std::memcpy(bytes.data(), r.data(), bytes.size());
            return Adopt(DType::kF32, {m, d, d}, std::move(bytes));
          },
          "float32 [m, d, d]: the dense matrices the case picks from its fixture (a copy), "
          "None when it uses none. A pipeline case's matrix is rotation[0].")
      .def("compare", &Compare, py::arg("output"), py::arg("got"), py::arg("label") = "",
           "Compares `got` with expected[output] bit for bit (the comparator of kvq conform): "
           "None when every bit agrees, else the first mismatch as a dict (output, row, column, "
           "where, expected, got, message), the message naming `label` (default: output). got "
           "must have the expected dtype (bf16 as uint16 bits) and size, else kvq.Error (shape "
           "mismatch); a non-contiguous array is copied first.")
      .def("cache", [](const CaseRef& c) { return ReplayedCacheOf(c.file(), c.set->fixtures); },
           "kvq.Cache: the paged cache of a cache or attention case, its in.ops script replayed "
           "by kvq's scalar write path (as kvq conform builds it for attention cases).")
      .def(
          "query_sequence",
          [](const CaseRef& c, const conformance::ReplayedCache& cache, int64_t query) {
            return conformance::QuerySequence(c.file(), cache, query);
          },
          py::arg("cache"), py::arg("query"),
          "The sequence id in `cache` (of .cache()) that attention query `query` reads "
          "(in.query_slots[query]); kvq.Error for a query out of range.")
      .def("compare_attention", &CompareAttention, py::arg("query"), py::arg("out"),
           py::arg("tolerance"),
           "An attention case's verdict on out float32 [Hq, d] for query `query` (kvq conform's "
           "rule, spec/cache.md §5): None when every head is finite with max_j |o - ref| / "
           "max_j |ref| <= tolerance against expect.reference_f64, else the worst channel of "
           "the first head that is not, as compare() gives it (output 'out').");

  m.def(
      "load_vectors",
      [](const std::string& dir) {
        py::gil_scoped_release unlocked;
        return SharedSet(std::make_shared<VectorSet>(conformance::LoadVectorSet(dir)));
      },
      py::arg("dir"),
      "Verifies dir/manifest.json (every SHA-256) and parses every case: a VectorSet. Raises "
      "kvq.Error: 'mismatch' for a failed check, 'malformed file', 'i/o error'.");
}

}  // namespace kvq::python
