// kvq capture and kvq ppl end to end on reference model A (short windows, so seconds): the
// capture is the library's, bit for bit, and kvq calibrate reads it; kvq ppl's JSON holds the
// bf16 row at KL 0 and the reference's perplexity; every error is one `kvq: error:` line naming
// the offending value (bad folder, config/weights mismatch, NaN weights, unknown scheme or
// window set, a window longer than the context, a calibration of another shape).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_test_util.h"
#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/model.h"
#include "kvq/common/io.h"
#include "kvq/common/numeric.h"

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
  Scratch() : ScratchDir("kvq_ppl_cli_test") {}
};

// A copy of model A's folder (config, weights, tokens) into `dir`/name, with `edit` applied to
// the weights and `config_edit` to config.json's text.
std::string CopyModel(const Scratch& dir, const std::string& name,
                      const std::function<void(Safetensors&)>& edit,
                      const std::function<std::string(std::string)>& config_edit = nullptr) {
  namespace fs = std::filesystem;
  const std::string out = dir.File(name);
  fs::create_directories(out);
  std::string config = cli_testing::Slurp(kModelA + "/config.json");
  if (config_edit) config = config_edit(config);
  std::ofstream(out + "/config.json") << config;
  fs::copy_file(kModelA + "/tokens.safetensors", out + "/tokens.safetensors");
  Safetensors weights = ReadSafetensors(kModelA + "/model.safetensors");
  if (edit) edit(weights);
  WriteSafetensors(out + "/model.safetensors", weights);
  return out;
}

// The int8-row weights read back through kvq info (I8 is a safetensors dtype of kvq's).
TEST(InfoCli, ListsInt8Weights) {
  Scratch dir;
  const RunResult r = RunKvq(dir, "info '" + kModelA + "/model.safetensors'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("model.embed_tokens.weight I8    [8192, 512]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.embed_tokens.weight_scale BF16  [8192]"), std::string::npos);
}

TEST(CaptureCli, WritesTheLibrarysCaptureThatCalibrateReads) {
  Scratch dir;
  const RunResult r = RunKvq(dir, "capture --model '" + kModelA +
                                      "' --windows calib:0,calib:4 --length 96 --dtype f32 "
                                      "--threads 2 --out acts.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const calib::Activations acts = calib::ReadActivations(dir.File("acts.safetensors"));
  EXPECT_EQ(acts.info.num_layers, 8);
  EXPECT_EQ(acts.info.num_q_heads, 4);
  EXPECT_EQ(acts.info.num_kv_heads, 1);
  EXPECT_EQ(acts.info.head_dim, 128);
  EXPECT_EQ(acts.info.tokens, 192);
  EXPECT_EQ(acts.info.calib_tokens, 192);
  EXPECT_EQ(acts.info.segment_tokens, 96);
  EXPECT_EQ(acts.info.rope_base, 1e6);
  // Bit for bit the library's capture (f32 storage).
  const calib::Model model = calib::LoadModel(kModelA);
  const auto windows = calib::ReadTokenWindows(kModelA + "/tokens.safetensors",
                                               calib::ParseWindowSelections("calib:0,calib:4"),
                                               96, model.config.vocab);
  const calib::Activations direct = calib::CaptureActivations(model, windows, -1, 1, "x");
  for (int l : {0, 7}) {
    EXPECT_EQ(acts.layers[l].q, direct.layers[l].q) << l;
    EXPECT_EQ(acts.layers[l].k, direct.layers[l].k) << l;
    EXPECT_EQ(acts.layers[l].v, direct.layers[l].v) << l;
  }
  // kvq calibrate reads it (a segmented capture: sink rows skipped per window).
  const RunResult c =
      RunKvq(dir, "calibrate --activations acts.safetensors --sink 16 --recent 32 --out cal.safetensors");
  ASSERT_EQ(c.exit_code, 0) << c.err;
  const calib::Calibration cal = calib::ReadCalibration(dir.File("cal.safetensors"));
  EXPECT_EQ(cal.info.num_layers, 8);
  EXPECT_EQ(cal.info.sink, 16);
  // One held-out window after the calibration windows: kvq eval scores it.
  const RunResult held = RunKvq(dir, "capture --model '" + kModelA +
                                         "' --windows calib:0,heldout_en:0 --length 96 "
                                         "--calib-windows 1 --out held.safetensors");
  ASSERT_EQ(held.exit_code, 0) << held.err;
  const RunResult e = RunKvq(dir, "eval --activations held.safetensors --calibration cal.safetensors "
                                  "--sink 16 --recent 32 --group 64 --page 16 --schemes naive,oscar");
  EXPECT_EQ(e.exit_code, 0) << e.err;
}

TEST(PplCli, Bf16RowIsTheReferenceAndOscarIsCompared) {
  Scratch dir;
  const RunResult r = RunKvq(
      dir, "ppl --model '" + kModelA +
               "' --windows heldout_en:0-1 --length 112 --calib-windows calib:0 --calib-length 96 "
               "--sink 16 --recent 32 --page 16 --schemes bf16,naive,oscar --clip both "
               "--threads 2 --json out.json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("heldout_en: 2 windows x 112 tokens"), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(cli_testing::Slurp(dir.File("out.json")));
  EXPECT_EQ(j["format"], "kvq-ppl");
  const auto& rows = j["sets"][0]["rows"];
  ASSERT_EQ(rows.size(), 5u);  // reference, fp32, bf16, naive, oscar
  EXPECT_EQ(rows[0]["label"], "bf16 (reference)");
  EXPECT_EQ(rows[1]["label"], "fp32 (no cache)");
  // The fp32 forward differs from the bf16 cache only by the rounding of K and V.
  EXPECT_NEAR(rows[1]["ppl"].get<double>(), rows[0]["ppl"].get<double>(),
              1e-3 * rows[0]["ppl"].get<double>());
  EXPECT_GT(rows[1]["kl"].get<double>(), 0.0);
  EXPECT_LT(rows[1]["kl"].get<double>(), 1e-3);
  EXPECT_EQ(rows[2]["label"], "bf16");
  EXPECT_EQ(rows[2]["kl"].get<double>(), 0.0);
  EXPECT_EQ(rows[2]["ppl"].get<double>(), rows[0]["ppl"].get<double>());
  EXPECT_GT(rows[3]["kl_tail"].get<double>(), 0.0);
  EXPECT_EQ(rows[4]["label"], "oscar");
  EXPECT_EQ(rows[4]["clip"], "own");
  EXPECT_TRUE(rows[3].contains("delta_kl_vs_oscar"));
  EXPECT_EQ(rows[3]["delta_kl_vs_oscar"]["windows"], 2);
  EXPECT_EQ(rows[4]["clip_k"].size(), 8u);
}

// --saw-block reaches the SAW schemes (BDR-16 is not BDR-128) and is recorded; a block the
// schemes cannot use fails naming it.
TEST(PplCli, SawBlockReachesTheSawSchemes) {
  Scratch dir;
  const std::string common = "ppl --model '" + kModelA +
                             "' --windows heldout_en:0-1 --length 112 --tail-from 16 "
                             "--schemes saw_int4,saw_int4_k --no-fp32 --threads 2";
  const RunResult r128 = RunKvq(dir, common + " --json b128.json");
  ASSERT_EQ(r128.exit_code, 0) << r128.err;
  const RunResult r16 = RunKvq(dir, common + " --saw-block 16 --json b16.json");
  ASSERT_EQ(r16.exit_code, 0) << r16.err;
  const nlohmann::json a = nlohmann::json::parse(cli_testing::Slurp(dir.File("b128.json")));
  const nlohmann::json b = nlohmann::json::parse(cli_testing::Slurp(dir.File("b16.json")));
  EXPECT_EQ(a["options"]["saw_block"], 128);
  EXPECT_EQ(b["options"]["saw_block"], 16);
  // Rows: reference, saw_int4, saw_int4_k. The reference does not move; the schemes do.
  ASSERT_EQ(a["sets"][0]["rows"].size(), 3u);
  EXPECT_EQ(a["sets"][0]["rows"][1]["label"], "saw_int4");
  EXPECT_EQ(b["sets"][0]["rows"][2]["label"], "saw_int4_k");
  EXPECT_EQ(a["sets"][0]["rows"][0]["ppl"], b["sets"][0]["rows"][0]["ppl"]);
  for (int row : {1, 2}) {
    EXPECT_GT(a["sets"][0]["rows"][row]["kl"].get<double>(), 0.0);
    EXPECT_NE(a["sets"][0]["rows"][row]["kl"], b["sets"][0]["rows"][row]["kl"]) << row;
  }
  ExpectFailure(dir, common + " --saw-block 24 --json bad.json", dir.File("bad.json"),
                {"saw_block 24 must be a power of two in [16, 256]"});
}

// K and V apart: --k-bits 4 --v-bits 2 (K4V2) builds the shared-width schemes with those
// widths (history bits (4.5 + 2.5) / 2 at G = 64), leaves saw_int4's own INT4, calibrates
// OSCAR's V clip at V's width, and changes the numbers against K2V2.
TEST(PplCli, KeyAndValueWidthsApart) {
  Scratch dir;
  const std::string common = "ppl --model '" + kModelA +
                             "' --windows heldout_en:0 --length 160 --calib-windows calib:0 "
                             "--calib-length 256 --sink 16 --recent 32 --page 16 --tail-from 48 "
                             "--schemes naive,oscar,saw_int4 --no-fp32 --threads 2";
  const RunResult k4v2 = RunKvq(dir, common + " --k-bits 4 --v-bits 2 --json k4v2.json");
  ASSERT_EQ(k4v2.exit_code, 0) << k4v2.err;
  EXPECT_NE(k4v2.out.find("b=K4V2"), std::string::npos) << k4v2.out;
  const RunResult k2v2 = RunKvq(dir, common + " --json k2v2.json");
  ASSERT_EQ(k2v2.exit_code, 0) << k2v2.err;
  const nlohmann::json a = nlohmann::json::parse(cli_testing::Slurp(dir.File("k4v2.json")));
  const nlohmann::json b = nlohmann::json::parse(cli_testing::Slurp(dir.File("k2v2.json")));
  EXPECT_EQ(a["options"]["k_bits"], 4);
  EXPECT_EQ(a["options"]["v_bits"], 2);
  const nlohmann::json& rows = a["sets"][0]["rows"];
  ASSERT_EQ(rows.size(), 4u);  // reference, naive, oscar, saw_int4
  EXPECT_EQ(rows[1]["history_bits_per_element"], 3.5);
  EXPECT_EQ(rows[2]["history_bits_per_element"], 3.5);
  EXPECT_EQ(rows[3]["history_bits_per_element"], 4.25);
  EXPECT_EQ(b["sets"][0]["rows"][1]["history_bits_per_element"], 2.5);
  EXPECT_LT(rows[1]["kl"].get<double>(), b["sets"][0]["rows"][1]["kl"].get<double>())
      << "INT4 keys should lose less than INT2 keys";
  EXPECT_EQ(rows[3]["kl"], b["sets"][0]["rows"][3]["kl"]) << "saw_int4 keeps its own width";
  ExpectFailure(dir, common + " --k-bits 3 --json bad.json", dir.File("bad.json"),
                {"--k-bits 3 is not supported by scheme 'naive' (2 or 4)"});
  ExpectFailure(dir, common + " --v-bits 9 --json bad.json", dir.File("bad.json"),
                {"--v-bits 9 is not supported by scheme 'naive' (2 or 4)"});
}

// The codebook schemes take any width 1..8 (K3V2 here), with no INT-b scheme in the run: the
// base calibration the pipeline computes keeps its clip at --bits, and each codebook scheme
// makes its own from the capture (blockgtq's allocation at K's width).
TEST(PplCli, CodebookSchemesTakeOtherWidths) {
  Scratch dir;
  const std::string common = "ppl --model '" + kModelA +
                             "' --windows heldout_en:0 --length 160 --calib-windows calib:0 "
                             "--calib-length 256 --tail-from 48 --no-fp32 --threads 2";
  const RunResult k3v2 = RunKvq(dir, common + " --schemes tq_mse,blockgtq --k-bits 3 --v-bits 2 "
                                              "--json k3v2.json");
  ASSERT_EQ(k3v2.exit_code, 0) << k3v2.err;
  const RunResult k2v2 = RunKvq(dir, common + " --schemes tq_mse,blockgtq --json k2v2.json");
  ASSERT_EQ(k2v2.exit_code, 0) << k2v2.err;
  const nlohmann::json a = nlohmann::json::parse(cli_testing::Slurp(dir.File("k3v2.json")));
  const nlohmann::json b = nlohmann::json::parse(cli_testing::Slurp(dir.File("k2v2.json")));
  const nlohmann::json& rows = a["sets"][0]["rows"];
  ASSERT_EQ(rows.size(), 3u);  // reference, tq_mse, blockgtq
  // TurboQuant-MSE K3V2 at d = 128: (3 + 16/128) and (2 + 16/128) bits a channel.
  EXPECT_EQ(rows[1]["history_bits_per_element"], 2.625);
  for (int i = 1; i <= 2; ++i) {
    EXPECT_LT(rows[i]["kl"].get<double>(), b["sets"][0]["rows"][i]["kl"].get<double>())
        << rows[i]["label"] << ": 3-bit keys should lose less than 2-bit keys";
  }
  ExpectFailure(dir, common + " --schemes tq_mse --k-bits 9 --json bad.json", dir.File("bad.json"),
                {"--k-bits 9 is not supported by scheme 'tq_mse' (1..8)"});
}

// Block-GTQ at a fractional key average (kvq calibrate --scheme blockgtq --k-bits 2.5), which
// kvq ppl's integer --k-bits cannot ask for, comes in as a --calibration file: the pipeline
// adds no raw-target rotations to it (only an OSCAR file may lack them) and prints no clip
// ratios (a codebook file has none).
TEST(PplCli, BlockGtqTakesAFractionalWidthsFile) {
  Scratch dir;
  const RunResult cap = RunKvq(dir, "capture --model '" + kModelA +
                                        "' --windows calib:0 --length 256 --dtype f32 --threads 2 "
                                        "--out cap.safetensors");
  ASSERT_EQ(cap.exit_code, 0) << cap.err;
  const RunResult cal = RunKvq(dir, "calibrate --activations cap.safetensors --scheme blockgtq "
                                    "--k-bits 2.5 --v-bits 2 --threads 2 --out cal.safetensors");
  ASSERT_EQ(cal.exit_code, 0) << cal.err;
  const RunResult ppl = RunKvq(dir, "ppl --model '" + kModelA +
                                        "' --windows heldout_en:0 --length 160 --tail-from 48 "
                                        "--no-fp32 --threads 2 --schemes blockgtq --v-bits 2 "
                                        "--calibration cal.safetensors --json k25.json");
  ASSERT_EQ(ppl.exit_code, 0) << ppl.err;
  EXPECT_NE(ppl.out.find("blockgtq calibration (no clip ratios)"), std::string::npos) << ppl.out;
  const nlohmann::json a = nlohmann::json::parse(cli_testing::Slurp(dir.File("k25.json")));
  const nlohmann::json& rows = a["sets"][0]["rows"];
  ASSERT_EQ(rows.size(), 2u);  // reference, blockgtq
  // Keys: floor(64 * 2.5) = 160 code bits over the 64 RoPE blocks plus a bf16 norm per segment;
  // values: 2 + 16/128.
  EXPECT_GT(rows[1]["history_bits_per_element"].get<double>(), (2.5 + 2.125) / 2);
  EXPECT_LT(rows[1]["history_bits_per_element"].get<double>(), (3.0 + 2.125) / 2 + 0.25);
}

TEST(PplCli, ErrorsNameTheOffendingValue) {
  Scratch dir;
  const std::string small =
      " --windows heldout_en:0 --length 64 --calib-windows calib:0 --calib-length 64 --sink 16 "
      "--recent 16 --page 16 --json out.json";
  ExpectFailure(dir, "ppl --model /nonexistent/model" + small, dir.File("out.json"),
                {"model folder '/nonexistent/model' does not exist"});
  ExpectFailure(dir, "ppl --model '" + kModelA + "' --schemes naive,kivi3" + small,
                dir.File("out.json"), {"unknown scheme 'kivi3'"});
  ExpectFailure(dir, "ppl --model '" + kModelA + "' --windows heldout_fr:0 --json out.json",
                dir.File("out.json"), {"no tensor 'heldout_fr'"});
  ExpectFailure(dir, "ppl --model '" + kModelA + "' --windows heldout_en:0 --length 4096",
                dir.File("out.json"), {"window length 4096"});
  ExpectFailure(dir, "ppl --model '" + kModelA + "' --clip best" + small, dir.File("out.json"),
                {"--clip 'best'"});
  // NaN weights: named by tensor, row and column.
  const std::string nan_model = CopyModel(dir, "nan", [](Safetensors& w) {
    for (auto& [name, t] : w.tensors) {
      if (name == "model.layers.2.input_layernorm.weight") t.data<float>()[5] = std::nanf("");
    }
  });
  ExpectFailure(dir, "ppl --model '" + nan_model + "'" + small, dir.File("out.json"),
                {"'model.layers.2.input_layernorm.weight' row 0 column 5", "not finite"});
  // A config that does not match the weights.
  const std::string deeper = CopyModel(dir, "deeper", nullptr, [](std::string c) {
    const std::string from = "\"num_hidden_layers\": 8";
    return c.replace(c.find(from), from.size(), "\"num_hidden_layers\": 9");
  });
  ExpectFailure(dir, "capture --model '" + deeper + "' --out acts.safetensors",
                dir.File("acts.safetensors"),
                {"no tensor 'model.layers.8.input_layernorm.weight'"});
  const std::string wide = CopyModel(dir, "wide", nullptr, [](std::string c) {
    const std::string from = "\"intermediate_size\": 1024";
    return c.replace(c.find(from), from.size(), "\"intermediate_size\": 2048");
  });
  ExpectFailure(dir, "capture --model '" + wide + "' --out acts.safetensors",
                dir.File("acts.safetensors"),
                {"'model.layers.0.mlp.gate_proj.weight' has shape [1024, 512], the config "
                 "implies [2048, 512]"});
  // A calibration of another model shape.
  calib::Calibration other;
  other.info.num_layers = 2;
  other.info.num_kv_heads = 1;
  other.info.head_dim = 64;
  other.layers.resize(2);
  for (calib::LayerCalibration& l : other.layers) {
    std::vector<float> eye(64 * 64, 0.0f);
    for (int i = 0; i < 64; ++i) eye[i * 65] = 1.0f;
    l.key.rotation = l.value.rotation = l.k_basis = l.v_basis = eye;
    l.k_eigenvalues = l.v_eigenvalues = std::vector<float>(64, 1.0f);
    l.key.clip = l.value.clip = {1.0f};
  }
  calib::WriteCalibration(dir.File("other.safetensors"), other);
  ExpectFailure(dir, "ppl --model '" + kModelA + "' --calibration other.safetensors --schemes oscar" + small,
                dir.File("out.json"),
                {"calibration 'other.safetensors' is 2 layers x 1 KV heads x d=64, the model 8 x 1 x d=128"});
  ExpectFailure(dir, "capture --model '" + kModelA + "' --dtype f8 --out acts.safetensors",
                dir.File("acts.safetensors"), {"--dtype 'f8'"});
}

}  // namespace
}  // namespace kvq
