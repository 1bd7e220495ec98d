// kvq.WriteParams: the write parameters, built from keyword arguments through kvq's builder
// (params::Write) and validated by WriteParams::Validate, so a bad value raises kvq.Error with
// kvq's own message.
#include <string>

#include "bindings.h"
#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"

namespace kvq::python {
namespace {

// A keyword argument's value as the parameter's type (write_params.inc's types): the format, the
// rotation kind and the codebook density by name.
void FromPython(py::handle value, int* out) { *out = value.cast<int>(); }
void FromPython(py::handle value, float* out) { *out = value.cast<float>(); }
void FromPython(py::handle value, bool* out) { *out = value.cast<bool>(); }
void FromPython(py::handle value, Format* out) { *out = ParseFormat(value.cast<std::string>()); }
void FromPython(py::handle value, RotationKind* out) {
  *out = ParseRotationKind(value.cast<std::string>());
}
void FromPython(py::handle value, CodebookDensity* out) {
  *out = ParseCodebookDensity(value.cast<std::string>());
}

template <typename T>
py::object ToPython(T value) {
  return py::cast(value);
}
py::object ToPython(Format value) { return py::str(FormatName(value)); }
py::object ToPython(RotationKind value) { return py::str(RotationKindName(value)); }
py::object ToPython(CodebookDensity value) { return py::str(CodebookDensityName(value)); }

// WriteParams from keyword arguments, one per row of write_params.inc (absent: the default),
// validated by the builder.
WriteParams BuildWriteParams(const py::kwargs& kwargs) {
  WriteParams p;
  size_t used = 0;
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  if (kwargs.contains(#name)) {                                          \
    FromPython(kwargs[#name], &p.name);                                  \
    ++used;                                                              \
  }
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
  if (used != kwargs.size()) {
    for (const auto& item : kwargs) {
      const std::string name = item.first.cast<std::string>();
      bool known = false;
#define KVQ_WRITE_PARAM(Type, row, init, key, spec, stored, shown, label) \
  known = known || name == #row;
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
      if (!known) {
        throw py::type_error("WriteParams() got an unexpected keyword argument '" + name + "'");
      }
    }
  }
  return params::Write(p).Build();
}

py::list Planes(const WriteParams& p) {
  static const char* const kScopes[] = {"token", "tile", "shared_token"};
  static const char* const kRoles[] = {"codes", "metadata", "rows"};
  const FormatLayout layout = LayoutOf(p);
  py::list out;
  for (int i = 0; i < layout.num_planes; ++i) {
    const PlaneSpec& s = layout.plane(i);
    out.append(py::dict(py::arg("name") = s.name, py::arg("source") = s.source,
                        py::arg("dtype") = DTypeName(s.dtype),
                        py::arg("role") = kRoles[static_cast<int>(s.role)],
                        py::arg("scope") = kScopes[static_cast<int>(s.scope)],
                        py::arg("elements") = s.elements,
                        py::arg("tokens_per_row") =
                            s.scope == PlaneScope::kTile ? layout.tile_tokens : 1));
  }
  return out;
}

}  // namespace

void BindParams(py::module_& m) {
  // The constructor's keywords with their defaults, from the rows (pybind11 keeps the pointer).
  static const std::string init_doc = [] {
    const WriteParams defaults;
    std::string doc = "WriteParams(*";
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  doc += std::string(", " #name "=") + py::repr(ToPython(defaults.name)).cast<std::string>();
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
    return doc +
           ")\n\nKeyword arguments only, one per row of kvq's write_params.inc; absent ones keep "
           "these defaults. format: a name of kvq.formats(); group: channels per group "
           "(affine_token) or tokens per tile (affine_tile); rotation: 'identity', 'dense' (give "
           "the matrix to encode) or 'hadamard'.";
  }();
  py::class_<WriteParams> cls(m, "WriteParams",
                              "The write path of one KV head's rows (kvq::WriteParams, "
                              "spec/numerics.md). Built from keyword arguments by kvq's builder "
                              "and validated by it: an unsupported value raises kvq.Error "
                              "naming it.");
  cls.def(py::init(&BuildWriteParams), init_doc.c_str());
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  cls.def_property_readonly(#name, [](const WriteParams& p) { return ToPython(p.name); });
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
  cls.def_property_readonly("tile_tokens", &WriteParams::tile_tokens,
                             "Tokens one row of a tile plane covers (1 for per-token formats).")
      .def_property_readonly("planes", &Planes,
                             "The stored planes in storage order (formats.inc's KVQ_PLANE rows "
                             "under these parameters), each a dict: name, source (the write-path "
                             "output it stores), dtype, role, scope ('token', 'tile', "
                             "'shared_token'), elements (per plane row), tokens_per_row.")
      .def("__repr__", [](const WriteParams& p) {
        return "WriteParams(" + params::Describe(p) + ")";
      });
}

}  // namespace kvq::python
