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

RotationKind ParseRotationKind(const std::string& name) {
  for (RotationKind kind :
       {RotationKind::kIdentity, RotationKind::kDense, RotationKind::kHadamard}) {
    if (name == RotationKindName(kind)) return kind;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "rotation '" + name + "' is not identity, dense or hadamard");
}

WriteParams BuildWriteParams(const std::string& format, int head_dim, int group, int bits,
                             float clip, const std::string& rotation, int hadamard_block,
                             bool bitrev, bool norm, int norm_heads, float head_scale) {
  return params::Write()
      .format(ParseFormat(format))
      .head_dim(head_dim)
      .group(group)
      .bits(bits)
      .clip(clip)
      .rotation(ParseRotationKind(rotation))
      .block(hadamard_block)
      .bitrev(bitrev)
      .norm(norm, norm_heads)
      .head_scale(head_scale)
      .Build();
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
  const WriteParams defaults;
  py::class_<WriteParams>(m, "WriteParams",
                          "The write path of one KV head's rows (kvq::WriteParams, "
                          "spec/numerics.md). Built from keyword arguments by kvq's builder and "
                          "validated by it: an unsupported value raises kvq.Error naming it.")
      .def(py::init(&BuildWriteParams), py::kw_only(),
           py::arg("format") = FormatName(defaults.format),
           py::arg("head_dim") = defaults.head_dim, py::arg("group") = defaults.group,
           py::arg("bits") = defaults.bits, py::arg("clip") = defaults.clip,
           py::arg("rotation") = RotationKindName(defaults.rotation),
           py::arg("hadamard_block") = defaults.hadamard_block,
           py::arg("bitrev") = defaults.bitrev, py::arg("norm") = defaults.norm,
           py::arg("norm_heads") = defaults.norm_heads,
           py::arg("head_scale") = defaults.head_scale,
           "format: a name of kvq.formats(); rotation: 'identity', 'dense' (give the matrix to "
           "encode) or 'hadamard'; group: channels per group (affine_token) or tokens per tile "
           "(affine_tile); norm_heads: KV heads one norm spans (with norm=True).")
      .def_property_readonly("format", [](const WriteParams& p) { return FormatName(p.format); })
      .def_readonly("head_dim", &WriteParams::head_dim)
      .def_readonly("group", &WriteParams::group)
      .def_readonly("bits", &WriteParams::bits)
      .def_readonly("clip", &WriteParams::clip)
      .def_property_readonly("rotation",
                             [](const WriteParams& p) { return RotationKindName(p.rotation); })
      .def_readonly("hadamard_block", &WriteParams::hadamard_block)
      .def_readonly("bitrev", &WriteParams::bitrev)
      .def_readonly("norm", &WriteParams::norm)
      .def_readonly("norm_heads", &WriteParams::norm_heads)
      .def_readonly("head_scale", &WriteParams::head_scale)
      .def_property_readonly("tile_tokens", &WriteParams::tile_tokens,
                             "Tokens one row of a tile plane covers (1 for per-token formats).")
      .def_property_readonly("planes", &Planes,
                             "The stored planes in storage order (formats.inc's KVQ_PLANE rows "
                             "under these parameters), each a dict: name, source (the write-path "
                             "output it stores), dtype, role, scope ('token', 'tile', "
                             "'shared_token'), elements (per plane row), tokens_per_row.")
      .def("__repr__", [](const WriteParams& p) {
        return "WriteParams(" + std::string(FormatName(p.format)) + " " + params::Describe(p) + ")";
      });
}

}  // namespace kvq::python
