// Testing one write-path stage generically, from its spec (kvq/common/stages.inc): valid inputs
// are drawn for every argument, the scalar reference and the backend under test run on the
// same inputs, and every output is compared bit for bit (XNNPACK tester style):
//   StageTester(StageId::kQuantize).params(Write().head_dim(128).group(64)).rows(40).seed(7)
//       .Test(backend);
// Used by the backend tests (every stage x every backend of kvq::AllBackends()) and by the
// write benchmarks (MakeStageBuffers).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/testbed/compare.h"

namespace kvq::testbed {

// The buffers of one stage call, one tensor per pointer argument in signature order, shaped by
// ArgShape for n rows under p.
struct StageBuffers {
  const StageSpec* stage = nullptr;
  WriteParams params;
  size_t rows = 0;
  std::vector<Tensor> args;

  std::vector<void*> Pointers();
  NamedTensors Inputs() const;   // the input arguments, by parameter name
  NamedTensors Outputs() const;  // the output arguments, by their golden-vector names
};

// Valid inputs for every input argument of `stage` for n rows under p, from `seed`: F32 rows
// cycling through conformance::TestRowKinds() (edge rows included; a stage over tiles gets every
// third tile constant along the tokens), a random dense matrix, codes
// in [0, 2^b - 1], random packed bytes, finite bf16 scales >= 0 (zeros and subnormals included)
// and mins of both signs; codebook block widths whose layout fits p's row limits (uniform,
// two-width or random, drawn first) and codes below each segment's 2^w; every output byte set
// to `poison`.
StageBuffers MakeStageBuffers(const StageSpec& stage, size_t n, const WriteParams& p,
                              uint64_t seed, uint8_t poison = 0xA5);

class StageTester {
 public:
  explicit StageTester(StageId id) : stage_(&GetStage(id)) {}

  StageTester& params(const WriteParams& p) { params_ = p; return *this; }
  StageTester& rows(size_t n) { rows_ = n; return *this; }
  StageTester& seed(uint64_t s) { seed_ = s; return *this; }
  // Also run the row counts below, at and past small tiles (1, 3, 4, 5) before rows(n); for a
  // stage over tiles every count is in whole tiles (1, 3, 4, 5 tiles, rows(n) rounded up).
  StageTester& edge_sizes(bool on) { edge_sizes_ = on; return *this; }

  // The stage of `backend` against the scalar reference's, outputs poisoned with two different
  // bytes (so an element the backend forgets to write cannot pass). Adds a gtest failure
  // naming the stage, parameters, seed and row count, and dumps the case (compare.h). A backend
  // that refuses the stage with kUnsupported (no kernel yet) skips the test, naming why.
  void Test(const cpu::Backend& backend) const;
  std::string Name(size_t n) const;

 private:
  const StageSpec* stage_;
  WriteParams params_;
  size_t rows_ = 0;  // 0: two rows of every test row kind
  uint64_t seed_ = 1;
  bool edge_sizes_ = true;
};

}  // namespace kvq::testbed
