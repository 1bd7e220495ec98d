// kvq qview end to end on reference model A (short captures, so seconds): its CSV is the
// library's (calib/quantizer_view.h) bit for bit, its table names every scheme, --plots writes
// one SVG per metric, --saw-block reaches the SAW schemes, and every misuse is one
// `kvq: error:` line naming the offending value.
#include <gtest/gtest.h>

#include <string>

#include "cli_test_util.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/model.h"
#include "kvq/calib/quantizer_view.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/io.h"

#ifndef KVQ_MODELS_DIR
#error "KVQ_MODELS_DIR must point at calib/models"
#endif

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::Exists;
using cli_testing::RunKvq;
using cli_testing::RunResult;

const std::string kModelA = std::string(KVQ_MODELS_DIR) + "/tiny-llama-a";

class Scratch : public cli_testing::ScratchDir {
 public:
  Scratch() : ScratchDir("kvq_qview_cli_test") {}
};

// The calibration capture (calib:0, 128 tokens), the evaluated one (heldout_en:0-1, 96 tokens
// each) and an OSCAR calibration of the first, written by kvq itself.
void Prepare(const Scratch& dir) {
  RunResult r = RunKvq(dir, "capture --model '" + kModelA +
                                "' --windows calib:0 --length 128 --dtype f32 --threads 2 "
                                "--out calib.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunKvq(dir, "capture --model '" + kModelA +
                      "' --windows heldout_en:0-1 --length 96 --dtype f32 --threads 2 "
                      "--out eval.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunKvq(dir,
             "calibrate --activations calib.safetensors --sink 16 --recent 32 --out cal.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

TEST(QviewCli, CsvIsTheLibrarysAndPlotsAreWritten) {
  Scratch dir;
  Prepare(dir);
  const std::string schemes =
      "naive,hadamard,oscar@none,oscar,raw_target@oscar,saw_int4_k,tq_mse,blockgtq";
  const RunResult r = RunKvq(dir, "qview --activations eval.safetensors --calib-activations "
                                  "calib.safetensors --calibration cal.safetensors --schemes " +
                                      schemes +
                                      " --sink 16 --saw-block 32 --threads 2 --csv view.csv "
                                      "--plots plots");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const calib::Activations eval = calib::ReadActivations(dir.File("eval.safetensors"));
  const calib::Activations cal_acts = calib::ReadActivations(dir.File("calib.safetensors"));
  const calib::Calibration cal = calib::ReadCalibration(dir.File("cal.safetensors"));
  calib::QuantizerViewOptions o;
  o.schemes = calib::ParseSchemeVariants(schemes, false);
  o.scheme.sink = 16;
  o.scheme.saw_block = 32;
  o.threads = 1;
  const calib::QuantizerView view =
      calib::ComputeQuantizerView(eval, cal_acts, &cal, o, cpu::BestBackend());
  EXPECT_EQ(cli_testing::Slurp(dir.File("view.csv")), calib::QuantizerViewCsv(view));
  // 8 layers x 1 KV head per scheme; rows at positions >= 16 of each 96-token window.
  ASSERT_EQ(view.views.size(), 8u);
  EXPECT_EQ(view.views[0].size(), 8u);
  EXPECT_EQ(view.rows_per_head, 2 * (96 - 16));
  for (const std::string& label : view.labels) {
    EXPECT_NE(r.out.find(label), std::string::npos) << label << "\n" << r.out;
  }
  // OSCAR's U·H·P_br flattens the importance diagonal on every layer (Lemma 1); the identity
  // does not. oscar@none never clips, oscar uses the calibration's ratios.
  for (int l = 0; l < 8; ++l) {
    EXPECT_NEAR(view.views[2][l].importance, 1.0, 1e-3) << l;
    EXPECT_GT(view.views[0][l].importance, 2.0) << l;
    EXPECT_EQ(view.views[2][l].clip, 1.0f) << l;
    EXPECT_EQ(view.views[3][l].clip, cal.layers[l].key.clip[0]) << l;
  }
  for (const char* metric : {"max_abs", "group_range", "importance", "tr_ek", "weighted",
                             "weighted_centred", "mean_range", "mean_energy",
                             "rope_logit_mae"}) {
    EXPECT_TRUE(Exists(dir.File(std::string("plots/keys_") + metric + ".svg"))) << metric;
  }
  // --saw-block reaches saw_int4_k: BDR-32 is not BDR-128.
  const RunResult r128 = RunKvq(dir, "qview --activations eval.safetensors --calib-activations "
                                     "calib.safetensors --schemes saw_int4_k --sink 16 "
                                     "--threads 2 --csv view128.csv");
  ASSERT_EQ(r128.exit_code, 0) << r128.err;
  o.schemes = calib::ParseSchemeVariants("saw_int4_k", false);
  o.scheme.saw_block = 128;
  const calib::QuantizerView v128 =
      calib::ComputeQuantizerView(eval, cal_acts, nullptr, o, cpu::BestBackend());
  EXPECT_EQ(cli_testing::Slurp(dir.File("view128.csv")), calib::QuantizerViewCsv(v128));
  EXPECT_NE(v128.views[0][0].tr_ek, view.views[5][0].tr_ek);
  EXPECT_EQ(v128.group, 128);  // SAW: one group per row
}

TEST(QviewCli, ErrorsNameTheOffendingValue) {
  Scratch dir;
  Prepare(dir);
  const std::string base =
      "qview --activations eval.safetensors --calib-activations calib.safetensors --threads 2 "
      "--csv bad.csv ";
  ExpectFailure(dir, base + "--schemes naive,kivi", dir.File("bad.csv"),
                {"scheme 'kivi' does not store its keys per token"});
  // The RoPE-logit MAE undoes RoPE with the capture's base: a capture without one is refused
  // by name, by qview and by eval.
  {
    Safetensors a = ReadSafetensors(dir.File("eval.safetensors"));
    a.metadata.erase("rope_base");
    WriteSafetensors(dir.File("norope.safetensors"), a);
  }
  ExpectFailure(dir, "qview --activations norope.safetensors --calib-activations "
                     "calib.safetensors --schemes tq_mse --threads 2 --csv bad.csv",
                dir.File("bad.csv"), {"rope_base"});
  ExpectFailure(dir, "eval --activations norope.safetensors --schemes tq_mse --json bad.json",
                dir.File("bad.json"), {"rope_base"});
  ExpectFailure(dir, base + "--schemes naive --sink 96", dir.File("bad.csv"),
                {"sink 96 leaves no row"});
  ExpectFailure(dir, base + "--schemes nosuch", dir.File("bad.csv"), {"nosuch"});
  ExpectFailure(dir, base + "--schemes saw_int4 --saw-block 24", dir.File("bad.csv"),
                {"saw_block 24"});
  ExpectFailure(dir, "qview --activations missing.safetensors --calib-activations "
                     "calib.safetensors --csv bad.csv",
                dir.File("bad.csv"), {"missing.safetensors"});
}

}  // namespace
}  // namespace kvq
