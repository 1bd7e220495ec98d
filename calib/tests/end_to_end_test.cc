// The demo path on the defaults: kvq synth + kvq calibrate must stay well under a minute.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "kvq/calib/calibrate.h"
#include "kvq/calib/synth.h"

namespace kvq::calib {
namespace {

// Time is measured by `kvq demo` and recorded in docs/accuracy_synthetic.md, not asserted here.
TEST(EndToEnd, DefaultsCalibrateAndClipTheOutlierHeavyKeys) {
  const auto start = std::chrono::steady_clock::now();
  const Activations acts = Synthesize(SynthOptions());
  const auto synthesised = std::chrono::steady_clock::now();
  const Calibration cal = Calibrate(acts, CalibrationOptions(), cpu::BestBackend());
  const auto end = std::chrono::steady_clock::now();
  const double synth_s = std::chrono::duration<double>(synthesised - start).count();
  const double calib_s = std::chrono::duration<double>(end - synthesised).count();
  std::printf("[ timing   ] synth %.2f s, calibrate %.2f s (backend %s)\n", synth_s, calib_s,
              cpu::BestBackend().name.c_str());
  for (int l = 0; l < cal.info.num_layers; ++l) {
    std::printf("[ clip     ] layer %d: K %.2f V %.2f\n", l, cal.layers[l].key.clip[0],
                cal.layers[l].value.clip[0]);
    // INT2 on outlier-heavy rows: the selected clip actually clips (ρ < 1).
    EXPECT_LT(cal.layers[l].key.clip[0], 1.0f) << "layer " << l;
  }
}

}  // namespace
}  // namespace kvq::calib
