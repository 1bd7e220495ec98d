// kvq's lists as Python: each entry is a row of formats.inc, stages.inc or schemes.inc as the C++
// tables expand it, so a new row appears here with no edit.
#include "bindings.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/format.h"
#include "kvq/common/stages.h"

namespace kvq::python {
namespace {

const char* DirectionName(ArgDir dir) {
  switch (dir) {
    case ArgDir::kIn: return "in";
    case ArgDir::kOut: return "out";
    case ArgDir::kInOut: return "inout";
  }
  return "?";
}

py::list Formats() {
  py::list out;
  for (Format f : AllFormats()) {
    out.append(py::dict(py::arg("name") = FormatName(f), py::arg("summary") = FormatSummary(f),
                        py::arg("spec_version") = FormatSpecVersion(f)));
  }
  return out;
}

py::list Stages() {
  py::list out;
  for (const StageSpec& s : AllStages()) {
    py::list args;
    for (int i = 0; i < s.num_args; ++i) {
      const StageArg& a = s.args[i];
      args.append(py::dict(py::arg("name") = a.name, py::arg("expect") = a.expect,
                           py::arg("dtype") = DTypeName(a.dtype),
                           py::arg("direction") = DirectionName(a.dir),
                           py::arg("axes") = ExtentAxes(a.extent)));
    }
    out.append(py::dict(py::arg("name") = s.name, py::arg("family") = s.family,
                        py::arg("cuda") = s.backends == StageBackends::kEveryBackend,
                        py::arg("args") = args));
  }
  return out;
}

py::list Schemes() {
  py::list out;
  for (const calib::SchemeInfo& s : calib::Schemes()) {
    out.append(py::dict(py::arg("name") = s.name, py::arg("summary") = s.description,
                        py::arg("format_k") = FormatName(s.format_k),
                        py::arg("format_v") = FormatName(s.format_v),
                        py::arg("needs_calibration") = s.needs_calibration));
  }
  return out;
}

}  // namespace

void BindLists(py::module_& m) {
  m.def("formats", &Formats,
        "The history formats in list order (formats.inc), each a dict: name, summary, "
        "spec_version (the spec that brought it).");
  m.def("stages", &Stages,
        "The write-path stages in list order (stages.inc), each a dict: name, family "
        "('transform' or the format whose codec it belongs to), cuda (whether the CUDA path "
        "implements it), args (dicts: name, expect, dtype, direction 'in'|'out'|'inout', axes).");
  m.def("schemes", &Schemes,
        "The scheme catalogue in order (schemes.inc), each a dict: name, summary, format_k, "
        "format_v, needs_calibration.");
}

}  // namespace kvq::python
