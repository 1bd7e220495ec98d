// The pieces of kvq's Python module `kvq._kvq`, one Bind* per file, and the numpy helpers they
// share. Arrays cross without copies where the layout allows: a result's bytes move into a
// capsule the array keeps alive, and views into a vector set keep the set alive.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/tensor.h"
#include "kvq/conformance/case_format.h"

namespace kvq::python {

namespace py = pybind11;

void BindErrors(py::module_& m);   // errors.cc: kvq.Error
void BindLists(py::module_& m);    // lists.cc: formats(), stages(), schemes()
void BindParams(py::module_& m);   // params.cc: WriteParams
void BindCodec(py::module_& m);    // codec.cc: encode(), decode(), quantize()
void BindStage(py::module_& m);    // stage.cc: run_stage()
void BindVectors(py::module_& m);  // vectors.cc: load_vectors(), VectorSet, Case
void BindCache(py::module_& m);    // cache.cc: Cache, attend()

// cache.cc: a kvq.Cache of an attention or cache case, its script replayed by the scalar write
// path (conformance::ReplayCacheScript).
py::object ReplayedCacheOf(const Safetensors& file, const conformance::Fixtures& fixtures);

// The numpy dtype of a kvq dtype: F32 float32, F16 float16, BF16 uint16 (the bf16 bits: numpy
// has no bf16), U8 uint8, I32 int32, I8 int8.
py::dtype NumpyDType(DType dtype);

// An array over `data` (no copy) that keeps `owner` alive; read-only.
py::array ReadOnlyView(DType dtype, const std::vector<int64_t>& shape, const void* data,
                       py::handle owner);

// `object` as a C-contiguous array of `dtype` (read in place when it is one; a non-contiguous
// array is copied). Throws kvq::Error(kShapeMismatch) "<what> must be a <u2 array (BF16), got
// float32" for another dtype or something that is not an array.
py::array ContiguousOf(const py::handle& object, DType dtype, const std::string& what);

// An array that takes over `bytes` (moved to the heap, no copy) as `shape` of `dtype`.
py::array Adopt(DType dtype, const std::vector<int64_t>& shape, std::vector<uint8_t>&& bytes);

}  // namespace kvq::python
