// run_stage: one write-path stage of stages.inc on the scalar oracle, called through its row's
// argument list (the generic call the conformance replay and the stage tester make), so every
// stage, present and future, runs from Python with no edit here.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "kvq/common/error.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::python {
namespace {

py::dict RunStage(const std::string& name, const WriteParams& p, const py::dict& inputs,
                  int64_t rows) {
  const StageSpec& stage = StageByName(name);
  KVQ_CHECK(StageApplies(stage, p), kInvalidArgument, "stage '", name, "' belongs to format '",
            stage.family, "', not to '", FormatName(p.format), "'");
  KVQ_CHECK(rows >= 0 && rows % static_cast<int64_t>(StageRowMultiple(stage, p)) == 0,
            kInvalidArgument, "rows ", rows, " is not a multiple of ",
            StageRowMultiple(stage, p), " (stage '", name, "')");
  std::vector<std::vector<uint8_t>> buffers(static_cast<size_t>(stage.num_args));
  void* args[kMaxStageArgs] = {};
  for (int i = 0; i < stage.num_args; ++i) {
    const StageArg& arg = stage.args[i];
    std::vector<uint8_t>& buffer = buffers[static_cast<size_t>(i)];
    buffer.resize(ArgElements(arg.extent, rows, p) * DTypeSize(arg.dtype));
    if (arg.is_input()) {
      KVQ_CHECK(inputs.contains(arg.name), kInvalidArgument, "stage '", name, "' needs input '",
                arg.name, "'");
      const std::string what = "input '" + std::string(arg.name) + "' of stage '" + name + "'";
      const py::array a = ContiguousOf(inputs[arg.name], arg.dtype, what);
      KVQ_CHECK(static_cast<size_t>(a.nbytes()) == buffer.size(), kShapeMismatch, what,
                " holds ", a.size(), " elements, expected ", buffer.size() / DTypeSize(arg.dtype),
                " (axes ", ExtentAxes(arg.extent), ")");
      std::memcpy(buffer.data(), a.data(), buffer.size());
    }
    args[i] = buffer.data();
  }
  {
    py::gil_scoped_release unlocked;
    cpu::RunStage(cpu::ScalarBackend().write, stage.id, args, static_cast<size_t>(rows), p);
  }
  py::dict outputs;
  for (int i = 0; i < stage.num_args; ++i) {
    const StageArg& arg = stage.args[i];
    if (!arg.is_output()) continue;
    outputs[arg.expect] = Adopt(arg.dtype, ArgShape(arg.extent, rows, p),
                                std::move(buffers[static_cast<size_t>(i)]));
  }
  return outputs;
}

}  // namespace

void BindStage(py::module_& m) {
  m.def("run_stage", &RunStage, py::arg("name"), py::arg("params"), py::arg("inputs"),
        py::arg("rows"),
        "Runs stage `name` (kvq.stages()) of the scalar oracle on `rows` rows under params.\n"
        "inputs: {argument name: array} for every 'in' / 'inout' argument, each of the "
        "argument's dtype (bf16 as uint16 bits) and element count (its axes: kvq.stages()); "
        "copied in, so in-place stages never touch them.\n"
        "Returns {expect name: array} for every 'out' / 'inout' argument, shaped by its axes "
        "(the arrays own kvq's buffers). Raises kvq.Error: an unknown stage (listing them), a "
        "stage of another format, rows not a multiple of the tile, a missing or mis-sized input.");
}

}  // namespace kvq::python
