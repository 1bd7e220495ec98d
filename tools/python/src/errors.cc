// kvq::Error as the Python exception kvq.Error (a ValueError) carrying kvq's message and its
// code (ErrorCodeName: "invalid argument", "shape mismatch", ...).
#include "bindings.h"
#include "kvq/common/error.h"

namespace kvq::python {

void BindErrors(py::module_& m) {
  static py::exception<Error> error(m, "Error", PyExc_ValueError);
  error.attr("__module__") = "kvq";
  error.doc() =
      "An error kvq raised: str(e) is kvq's message (naming the offending value), e.code the "
      "kind (kvq::ErrorCodeName: 'invalid argument', 'shape mismatch', 'non-finite value', "
      "'malformed file', 'i/o error', 'unsupported', 'mismatch').";
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const Error& e) {
      py::object instance = py::reinterpret_borrow<py::object>(error.ptr())(e.what());
      instance.attr("code") = ErrorCodeName(e.code());
      PyErr_SetObject(error.ptr(), instance.ptr());
    }
  });
}

}  // namespace kvq::python
