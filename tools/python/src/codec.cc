// The codec of every format through the C++ write path of the scalar oracle: encode (EncodeRows:
// the stored planes), decode (DecodeRows: the planes back to rows) and quantize (QuantizeRows:
// every stage's output, what the golden pipeline vectors hold).
#include <string>
#include <utility>

#include "bindings.h"
#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq::python {
namespace {

using RowsArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

std::string ShapeText(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// x [n, d] float32 with d = p.head_dim; the matrix [d, d] when p's rotation is dense (else none).
size_t CheckRows(const WriteParams& p, const RowsArray& x, const py::object& rotation) {
  KVQ_CHECK(x.ndim() == 2 && x.shape(1) == p.head_dim, kShapeMismatch, "x is ", ShapeText(x),
            ", expected [n, ", p.head_dim, "] (head_dim ", p.head_dim, ")");
  KVQ_CHECK(p.rotation != RotationKind::kDense || !rotation.is_none(), kInvalidArgument,
            "rotation 'dense' needs the matrix: rotation=[", p.head_dim, ", ", p.head_dim, "]");
  return static_cast<size_t>(x.shape(0));
}

// The dense matrix as float32 [d, d] (read in place when it is one), or none.
RowsArray Matrix(const WriteParams& p, const py::object& rotation) {
  if (p.rotation != RotationKind::kDense || rotation.is_none()) return RowsArray();
  RowsArray r = RowsArray::ensure(rotation);
  KVQ_CHECK(r && r.ndim() == 2 && r.shape(0) == p.head_dim && r.shape(1) == p.head_dim,
            kShapeMismatch, "rotation is ", r ? ShapeText(r) : "not an array", ", expected [",
            p.head_dim, ", ", p.head_dim, "]");
  return r;
}

using WidthsArray = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

// A codebook head's block widths, uint8 [d/2] (head_data.inc's `widths`), or none: the head's
// arrays for the write path, the widths viewed in place in `held` (kept alive by the caller).
HeadArrays HeadOf(const WriteParams& p, const RowsArray& rotation, const py::object& widths,
                  WidthsArray* held) {
  HeadArrays head;
  if (rotation) head.rotation = rotation.data();
  if (!widths.is_none()) {
    *held = WidthsArray::ensure(widths);
    KVQ_CHECK(*held && held->ndim() == 1 && held->shape(0) == p.head_dim / 2, kShapeMismatch,
              "widths is ", *held ? ShapeText(*held) : "not an array", ", expected [",
              p.head_dim / 2, "] (one width per RoPE block)");
    head.widths = held->data();
  }
  return head;
}

// Plane rows that n tokens fill: n, or n / tile_tokens for a tile plane.
int64_t PlaneRows(const FormatLayout& layout, int plane, int64_t n) {
  return layout.plane(plane).scope == PlaneScope::kTile ? n / layout.tile_tokens : n;
}

py::dict Encode(const WriteParams& p, const RowsArray& x, const py::object& rotation,
                const py::object& widths) {
  const size_t n = CheckRows(p, x, rotation);
  const RowsArray r = Matrix(p, rotation);
  WidthsArray held;
  const HeadArrays head = HeadOf(p, r, widths, &held);
  cpu::EncodedRows encoded;
  {
    py::gil_scoped_release unlocked;
    encoded = cpu::EncodeRows(cpu::ScalarBackend(), p, head, x.data(), n);
  }
  const FormatLayout layout = LayoutOf(p);
  py::dict planes;
  for (int i = 0; i < layout.num_planes; ++i) {
    const PlaneSpec& s = layout.plane(i);
    planes[s.name] = Adopt(s.dtype, {PlaneRows(layout, i, static_cast<int64_t>(n)), s.elements},
                           std::move(encoded.plane[i]));
  }
  return planes;
}

py::array Decode(const WriteParams& p, const py::dict& planes, const py::object& widths) {
  const FormatLayout layout = LayoutOf(p);
  WidthsArray held;
  // The tokens the first plane holds; every plane must hold exactly those.
  int64_t n = -1;
  std::vector<py::array> planes_held;
  cpu::HistoryRunView view;
  for (int i = 0; i < layout.num_planes; ++i) {
    const PlaneSpec& s = layout.plane(i);
    KVQ_CHECK(planes.contains(s.name), kShapeMismatch, "plane '", s.name, "' of format '",
              FormatName(p.format), "' is missing");
    py::array a = ContiguousOf(planes[s.name], s.dtype, "plane '" + std::string(s.name) + "'");
    const int64_t rows = static_cast<int64_t>(a.size()) / s.elements;
    const int64_t tokens = s.scope == PlaneScope::kTile ? rows * layout.tile_tokens : rows;
    if (n < 0) n = tokens;
    KVQ_CHECK(static_cast<int64_t>(a.size()) == PlaneRows(layout, i, n) * s.elements,
              kShapeMismatch, "plane '", s.name, "' holds ", a.size(), " elements, expected ",
              PlaneRows(layout, i, n), " rows of ", s.elements, " for ", n, " tokens");
    view.plane[i] = static_cast<const uint8_t*>(a.data());
    planes_held.push_back(std::move(a));
  }
  view.heads = HeadOf(p, RowsArray(), widths, &held);
  py::array_t<float> y({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(p.head_dim)});
  float* out = y.mutable_data();
  {
    py::gil_scoped_release unlocked;
    cpu::DecodeRows(cpu::ScalarBackend(), p, view, static_cast<size_t>(n), out);
  }
  return std::move(y);
}

py::dict Quantize(const WriteParams& p, const RowsArray& x, const py::object& rotation,
                  const py::object& widths) {
  const size_t n = CheckRows(p, x, rotation);
  const RowsArray r = Matrix(p, rotation);
  WidthsArray held;
  const HeadArrays head = HeadOf(p, r, widths, &held);
  std::vector<std::pair<std::string, Tensor>> tensors;
  {
    py::gil_scoped_release unlocked;
    tensors = cpu::QuantizeRows(cpu::ScalarBackend(), p, head, x.data(), n).Tensors(p);
  }
  py::dict out;
  for (auto& [name, t] : tensors) out[name.c_str()] = Adopt(t.dtype, t.shape, std::move(t.bytes));
  return out;
}

}  // namespace

void BindCodec(py::module_& m) {
  m.def("encode", &Encode, py::arg("params"), py::arg("x"), py::arg("rotation") = py::none(),
        py::arg("widths") = py::none(),
        "The stored planes of rows x as the cache holds them (cpu::EncodeRows, scalar oracle).\n"
        "x: float32 [n, d], d = params.head_dim (n a multiple of params.tile_tokens); read in "
        "place when float32 and C-contiguous, else converted (a copy).\n"
        "rotation: float32 [d, d], only for params.rotation == 'dense'.\n"
        "widths: uint8 [d/2], a codebook head's block widths (each 1..8, block order; none: "
        "every block at params.bits).\n"
        "Returns {plane name: array [plane rows, elements]} in storage order (params.planes): "
        "uint8 codes, bf16 planes as uint16 bits; the arrays own kvq's buffers (no copy).\n"
        "Raises kvq.Error: shapes, non-finite rows, rows whose rotation overflows.");
  m.def("decode", &Decode, py::arg("params"), py::arg("planes"), py::arg("widths") = py::none(),
        "Rows from stored planes (cpu::DecodeRows): float32 [n, d] in the rotated space (times "
        "the norm with one). planes: {name: array} as encode gives them (any shape, the plane's "
        "dtype, n rows of each token plane, n / tile_tokens of each tile plane); read in place "
        "when C-contiguous, else copied first; widths: a codebook head's, as encode took them. "
        "Raises kvq.Error (shape mismatch) for a missing plane, a wrong dtype or a size that "
        "disagrees.");
  m.def("quantize", &Quantize, py::arg("params"), py::arg("x"), py::arg("rotation") = py::none(),
        py::arg("widths") = py::none(),
        "Every output of the write path of a quantized format (cpu::QuantizeRows, scalar "
        "oracle), in write-path order: {'rotated', ['norm', 'normalized',] 'tau', the codec's "
        "outputs, 'dequantized'}, each with its shape (rows [n, d] float32, tau [n], codes "
        "uint8, bf16 outputs as uint16 bits): what the golden pipeline vectors' expect.* hold. "
        "x, rotation and widths as for encode (a codebook row has no 'tau'); the arrays own "
        "kvq's buffers (no copy).");
}

}  // namespace kvq::python
