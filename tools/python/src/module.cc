// kvq._kvq: kvq's oracle for Python (tools/python/README.md). Everything it lists comes from
// kvq's own lists (formats.inc, stages.inc, schemes.inc) through the C++ tables that expand them.
#include <cstring>
#include <memory>

#include "bindings.h"
#include "kvq/common/error.h"

namespace kvq::python {

py::dtype NumpyDType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return py::dtype::of<float>();
    case DType::kF16: return py::dtype("float16");
    case DType::kBF16: return py::dtype::of<uint16_t>();
    case DType::kU8: return py::dtype::of<uint8_t>();
    case DType::kI32: return py::dtype::of<int32_t>();
    case DType::kI8: return py::dtype::of<int8_t>();
  }
  return py::dtype::of<uint8_t>();
}

py::array ReadOnlyView(DType dtype, const std::vector<int64_t>& shape, const void* data,
                       py::handle owner) {
  py::array view(NumpyDType(dtype), std::vector<py::ssize_t>(shape.begin(), shape.end()), data,
                 owner);
  view.attr("flags").attr("writeable") = false;
  return view;
}

py::array ContiguousOf(const py::handle& object, DType dtype, const std::string& what) {
  const py::array a = py::array::ensure(object, py::array::c_style);
  const std::string want = py::str(NumpyDType(dtype).attr("str"));
  const std::string got =
      a ? std::string(py::str(a.dtype())) : std::string(py::str(object.get_type()));
  KVQ_CHECK(a && std::string(py::str(a.dtype().attr("str"))) == want, kShapeMismatch, what,
            " must be a ", want, " array (", DTypeName(dtype), "), got ", got);
  return a;
}

py::array Adopt(DType dtype, const std::vector<int64_t>& shape, std::vector<uint8_t>&& bytes) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  return py::array(NumpyDType(dtype), std::vector<py::ssize_t>(shape.begin(), shape.end()),
                   owned->data(), owner);
}

}  // namespace kvq::python

PYBIND11_MODULE(_kvq, m) {
  m.doc() = "kvq's oracle (the C++ scalar reference): lists, parameters, codecs, golden vectors.";
  kvq::python::BindErrors(m);
  kvq::python::BindLists(m);
  kvq::python::BindParams(m);
  kvq::python::BindCodec(m);
  kvq::python::BindStage(m);
  kvq::python::BindVectors(m);
  kvq::python::BindCache(m);
}
