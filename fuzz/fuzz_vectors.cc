// libFuzzer harness for the golden-vector readers: the manifest parser and a case file replayed
// against the scalar oracle. Any input must end in a result or a kvq::Error, never a crash, a
// sanitizer report or a hang. The first byte picks the reader so one corpus covers both.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/conformance/manifest.h"
#include "kvq/conformance/runner.h"
#include "kvq/cpu_ref/kernels.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  ++data;
  --size;
  try {
    if (selector & 1) {
      const std::vector<uint8_t> bytes(data, data + size);
      const kvq::conformance::Manifest manifest = kvq::conformance::ParseManifest(bytes);
      // What parsed must serialise and parse back to the same bytes.
      const std::vector<uint8_t> again = kvq::conformance::SerializeManifest(manifest);
      const std::vector<uint8_t> twice =
          kvq::conformance::SerializeManifest(kvq::conformance::ParseManifest(again));
      if (again != twice) __builtin_trap();
    } else {
      kvq::conformance::VectorSet set;
      set.case_names.push_back("fuzz");
      set.cases.push_back(kvq::ParseSafetensors(data, size));
      // ReplayCase turns errors into a failed result; the sanitizers catch everything else.
      kvq::conformance::ReplayCase(set, 0, kvq::cpu::ScalarBackend());
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
