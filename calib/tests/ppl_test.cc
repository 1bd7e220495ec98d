// kvq ppl as a library, on reference model A with short windows (S0 = 16, W = 32, T = 160): the
// bf16 scheme through its cache equals the reference exactly, the shared prefix and the thread
// count change no bit, the numbers are what a direct forward gives, the fair-clip rule
// reproduces the calibration's own ratios, and the statistics.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvq/calib/cache_attention.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/fair_clip.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/matmul.h"
#include "kvq/calib/model.h"
#include "kvq/calib/ppl.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testing::ExpectError;
using testing::kModelA;
// Window lengths (smaller in sanitizer builds); S0 = 16, W = 32: the history starts at 48.
constexpr int64_t kLength = testing::kSanitizerBuild ? 96 : 160;
constexpr int64_t kCalibLength = testing::kSanitizerBuild ? 64 : 128;

struct Fixture {
  Model model;
  std::vector<TokenWindows> eval;
  Activations calib_acts;
  Calibration cal;
  SchemeOptions scheme;
};

const Fixture& Shared() {
  static const Fixture* f = [] {
    auto* x = new Fixture;
    x->model = LoadModel(kModelA);
    const std::string tokens = kModelA + "/tokens.safetensors";
    x->eval = ReadTokenWindows(tokens, ParseWindowSelections("heldout_en:0-1,heldout_code:0"),
                               kLength, x->model.config.vocab);
    const std::vector<TokenWindows> calib =
        ReadTokenWindows(tokens, ParseWindowSelections("calib:0,calib:4"), kCalibLength,
                         x->model.config.vocab);
    x->calib_acts = CaptureActivations(x->model, calib, -1, 2, "test");
    x->scheme.group = 64;
    x->scheme.sink = 16;
    x->scheme.recent = 32;
    x->scheme.page = 16;
    CalibrationOptions o;
    o.sink = 16;
    o.recent = 32;
    o.threads = 2;
    x->cal = Calibrate(x->calib_acts, o, cpu::BestBackend());
    return x;
  }();
  return *f;
}

// `one_window`: heldout_en:0 only (the bit-identity tests), else all three windows.
PplResult RunPpl(const std::string& schemes, bool share_prefix, int threads,
                 bool per_position = false, bool one_window = false) {
  const Fixture& f = Shared();
  std::vector<TokenWindows> eval = f.eval;
  if (one_window) {
    eval.resize(1);
    eval[0].rows.resize(1);
    eval[0].ids.resize(eval[0].length);
  }
  PplOptions o;
  o.schemes = ParseSchemeVariants(schemes, false);
  o.scheme = f.scheme;
  o.threads = threads;
  o.share_prefix = share_prefix;
  o.per_position = per_position;
  o.fp32_baseline = false;  // its own test is the CLI's
  const auto layers = BuildVariantLayers(f.model.config, &f.calib_acts, &f.cal, o,
                                         cpu::BestBackend());
  return EvaluatePerplexity(f.model, eval, layers, o, cpu::BestBackend());
}

void ExpectSameSums(const PositionSums& a, const PositionSums& b, const std::string& what) {
  EXPECT_EQ(a.count, b.count) << what;
  EXPECT_EQ(a.nll, b.nll) << what;
  EXPECT_EQ(a.kl, b.kl) << what;
  EXPECT_EQ(a.top1, b.top1) << what;
}

void ExpectSameResults(const PplResult& a, const PplResult& b) {
  ASSERT_EQ(a.sets.size(), b.sets.size());
  for (size_t s = 0; s < a.sets.size(); ++s) {
    ASSERT_EQ(a.sets[s].rows.size(), b.sets[s].rows.size());
    for (size_t r = 0; r < a.sets[s].rows.size(); ++r) {
      const RowResult& x = a.sets[s].rows[r];
      const RowResult& y = b.sets[s].rows[r];
      ASSERT_EQ(x.windows.size(), y.windows.size());
      for (size_t w = 0; w < x.windows.size(); ++w) {
        const std::string what = a.sets[s].name + " " + x.label + " window " + std::to_string(w);
        ExpectSameSums(x.windows[w].all, y.windows[w].all, what + " all");
        ExpectSameSums(x.windows[w].tail, y.windows[w].tail, what + " tail");
      }
    }
  }
}

// The bf16 scheme runs through its own PagedKVCache (bf16 format) and must give the
// reference's logits bit for bit: KL exactly 0, the same NLL sums, full top-1 agreement.
TEST(Ppl, Bf16SchemeIsTheReferenceExactly) {
  const PplResult r = RunPpl("bf16,naive,oscar", /*share_prefix=*/true, 2);
  ASSERT_EQ(r.sets.size(), 2u);
  EXPECT_EQ(r.options.tail_from, 48);
  for (const WindowSetResult& set : r.sets) {
    const RowResult* ref = set.Find("bf16 (reference)");
    const RowResult* bf16 = set.Find("bf16");
    const RowResult* naive = set.Find("naive");
    ASSERT_NE(ref, nullptr);
    ASSERT_NE(bf16, nullptr);
    for (size_t w = 0; w < bf16->windows.size(); ++w) {
      for (bool tail : {false, true}) {
        const PositionSums& a = tail ? bf16->windows[w].tail : bf16->windows[w].all;
        const PositionSums& b = tail ? ref->windows[w].tail : ref->windows[w].all;
        EXPECT_EQ(a.kl, 0.0);
        EXPECT_EQ(a.nll, b.nll);
        EXPECT_EQ(a.top1, a.count);
        EXPECT_EQ(a.count, tail ? kLength - 1 - 48 : kLength - 1);
      }
    }
    EXPECT_EQ(bf16->Ppl(false), ref->Ppl(false));
    // A quantized scheme differs, but only where the history exists.
    EXPECT_GT(naive->MeanKl(true), 0.0);
    EXPECT_NEAR(naive->Total(false).kl, naive->Total(true).kl, 1e-12);
    EXPECT_GT(naive->bits_per_element, 2.0);
    EXPECT_LT(naive->bits_per_element, 16.0);
    EXPECT_EQ(bf16->bits_per_element, 16.0);
    // The history alone: INT2 codes plus one bf16 (scale, min) per 64 channels; the windows
    // are what lifts bits_per_element above it.
    EXPECT_EQ(naive->history_bits, 2.0 + 32.0 / 64);
    EXPECT_GT(naive->bits_per_element, naive->history_bits);
    EXPECT_EQ(bf16->history_bits, 16.0);
  }
}

// Rows before S0 + W are computed once (by the reference) and the thread count is free: no
// number may change.
TEST(Ppl, SharedPrefixAndThreadsChangeNoBit) {
  const std::string schemes = "bf16,hadamard_bitrev,oscar";
  const PplResult a = RunPpl(schemes, true, 2, false, true);
  ExpectSameResults(a, RunPpl(schemes, false, 2, false, true));
  ExpectSameResults(a, RunPpl(schemes, true, 3, false, true));
}

// The row of a scheme is what a plain forward through CacheAttention gives for that window.
TEST(Ppl, NumbersAreThoseOfADirectForward) {
  const Fixture& f = Shared();
  const PplResult r = RunPpl("hadamard", true, 2, /*per_position=*/true);  // all 3 windows
  PplOptions o;
  o.schemes = ParseSchemeVariants("hadamard", false);
  o.scheme = f.scheme;
  const auto layers = BuildVariantLayers(f.model.config, nullptr, nullptr, o, cpu::BestBackend());
  const TokenWindows& set = f.eval[1];  // heldout_code:0
  CacheAttention attention(f.model.config, layers[0], cpu::BestBackend());
  ForwardRequest req;
  req.ids = set.window(0);
  req.tokens = set.length;
  const std::vector<float> logits = Forward(f.model, attention, req);
  const RowResult* row = r.Get("heldout_code").Find("hadamard");
  ASSERT_NE(row, nullptr);
  ASSERT_EQ(row->windows[0].nll.size(), static_cast<size_t>(kLength - 1));
  double sum = 0;
  for (int p = 0; p < kLength - 1; ++p) {
    const float* x = logits.data() + static_cast<size_t>(p) * f.model.config.vocab;
    const double nll = LogSumExp(x, f.model.config.vocab) - x[set.window(0)[p + 1]];
    EXPECT_EQ(row->windows[0].nll[p], static_cast<float>(nll)) << p;
    sum += nll;
  }
  EXPECT_NEAR(row->windows[0].all.nll, sum, 1e-9 * sum);
  // The JSON carries the per-position values.
  EXPECT_NE(PplJson(r).find("\"nll\""), std::string::npos);
}

// The fair-clip rule applied to OSCAR's own rotation reproduces the ratios kvq calibrate chose:
// the same rows, targets, objective and grid. @oscar reuses them; eigenbasis_only chooses its own.
TEST(Ppl, OwnClipIsCalibratesRule) {
  const Fixture& f = Shared();
  PplOptions o;
  o.schemes = ParseSchemeVariants("oscar,eigenbasis_only,eigenbasis_only@oscar,naive@own", false);
  o.scheme = f.scheme;
  o.threads = 2;
  const auto layers =
      BuildVariantLayers(f.model.config, &f.calib_acts, &f.cal, o, cpu::BestBackend());
  int differ = 0;
  for (int l = 0; l < f.model.config.num_layers; ++l) {
    EXPECT_EQ(layers[0][l].key.clip, f.cal.layers[l].key.clip) << "layer " << l;
    EXPECT_EQ(layers[0][l].value.clip, f.cal.layers[l].value.clip) << "layer " << l;
    EXPECT_EQ(layers[2][l].key.clip, f.cal.layers[l].key.clip) << "layer " << l;
    differ += layers[1][l].key.clip != f.cal.layers[l].key.clip;
    differ += layers[1][l].value.clip != f.cal.layers[l].value.clip;
    ASSERT_EQ(layers[3][l].key.clip.size(), 1u);  // naive@own: a clip where naive has none
    EXPECT_LE(layers[3][l].key.clip[0], 1.0f);
  }
  EXPECT_GT(differ, 0) << "eigenbasis_only chose OSCAR's ratios on every layer and side";
}

TEST(Ppl, SchemeVariants) {
  const std::vector<SchemeVariant> all = ParseSchemeVariants("all", true);
  std::vector<std::string> labels;
  for (const SchemeVariant& v : all) labels.push_back(v.label);
  const auto at = [&](const std::string& l) {
    return std::find(labels.begin(), labels.end(), l) - labels.begin();
  };
  EXPECT_EQ(at("eigenbasis_only@oscar"), at("eigenbasis_only") + 1);
  EXPECT_EQ(at("oscar@oscar"), static_cast<long>(labels.size()));   // oscar's own is OSCAR's
  EXPECT_EQ(at("hadamard@oscar"), static_cast<long>(labels.size()));  // hadamard never clips
  EXPECT_EQ(all[at("clip_only")].Resolved(), ClipChoice::kOwn);
  EXPECT_EQ(all[at("naive")].Resolved(), ClipChoice::kNone);
  const std::vector<SchemeVariant> some = ParseSchemeVariants("hadamard@own,oscar_no_bitrev@none", false);
  EXPECT_EQ(some[0].Resolved(), ClipChoice::kOwn);
  EXPECT_EQ(some[1].Resolved(), ClipChoice::kNone);
  ExpectError([] { ParseSchemeVariants("oscar@best", false); }, ErrorCode::kInvalidArgument,
              "unknown clip suffix '@best'");
  ExpectError([] { ParseSchemeVariants("kivi3", false); }, ErrorCode::kInvalidArgument,
              "unknown scheme 'kivi3'");
  ExpectError([] { ParseSchemeVariants("naive,naive", false); }, ErrorCode::kInvalidArgument,
              "appears twice");
}

TEST(Ppl, StudentTQuantiles) {
  // Two-sided 95 %: tables give 12.706, 3.182, 2.201, 2.069, 1.962.
  EXPECT_NEAR(StudentTQuantile(0.95, 1), 12.7062, 1e-3);
  EXPECT_NEAR(StudentTQuantile(0.95, 3), 3.1824, 1e-4);
  EXPECT_NEAR(StudentTQuantile(0.95, 11), 2.2010, 1e-4);
  EXPECT_NEAR(StudentTQuantile(0.95, 23), 2.0687, 1e-4);
  EXPECT_NEAR(StudentTQuantile(0.95, 1000), 1.9623, 1e-4);
  EXPECT_NEAR(StudentTQuantile(0.99, 5), 4.0321, 1e-4);
}

TEST(Ppl, PairedDeltaAgainstOscar) {
  auto row = [](std::vector<double> kl) {
    RowResult r;
    for (double k : kl) {
      WindowScore w;
      w.tail.count = 10;
      w.tail.kl = 10 * k;
      r.windows.push_back(w);
    }
    return r;
  };
  const RowResult oscar = row({0.010, 0.020, 0.030, 0.040});
  const RowResult other = row({0.012, 0.021, 0.035, 0.039});
  const PairedDelta d = CompareWithOscar(other, oscar);
  ASSERT_TRUE(d.valid);
  // Differences 0.002, 0.001, 0.005, -0.001: mean 0.00175, sd 0.0025, t(3) = 3.1824.
  EXPECT_NEAR(d.mean, 0.00175, 1e-12);
  const double half = 3.1824463 * 0.0025 / 2.0;
  EXPECT_NEAR(d.low, 0.00175 - half, 1e-7);
  EXPECT_NEAR(d.high, 0.00175 + half, 1e-7);
  EXPECT_EQ(d.won, 1);
  EXPECT_EQ(d.windows, 4);
  EXPECT_FALSE(CompareWithOscar(row({0.01}), row({0.02})).valid);  // one window: no interval
}

TEST(Ppl, Rejections) {
  const Fixture& f = Shared();
  PplOptions o;
  o.schemes = ParseSchemeVariants("naive", false);
  o.scheme = f.scheme;
  const auto layers = BuildVariantLayers(f.model.config, nullptr, nullptr, o, cpu::BestBackend());
  o.threads = 0;
  ExpectError([&] { EvaluatePerplexity(f.model, f.eval, layers, o, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument, "threads 0");
  o.threads = 1;
  o.tail_from = kLength - 1;
  ExpectError([&] { EvaluatePerplexity(f.model, f.eval, layers, o, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument, "make no prediction at positions >= ");
  o.tail_from = -1;
  o.schemes = ParseSchemeVariants("naive,eigenbasis_only@oscar", false);
  ExpectError([&] { EvaluatePerplexity(f.model, f.eval, layers, o, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument, "1 built schemes for 2 scheme rows");
  ExpectError([&] { BuildVariantLayers(f.model.config, nullptr, nullptr, o, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument, "scheme 'eigenbasis_only' needs a calibration");
  o.schemes = ParseSchemeVariants("naive@own", false);
  ExpectError([&] { BuildVariantLayers(f.model.config, nullptr, nullptr, o, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument, "own clip ratios need the calibration capture");
}

// --scheme-windows shared: the schemes that keep no sink take the shared S0 and W, their flush
// (a tile format's whole tiles) stays; the others are left alone.
TEST(Ppl, ShareSchemeWindowsGivesTheSinklessSchemesTheSharedWindows) {
  SchemeShape shape;
  shape.num_kv_heads = 2;
  shape.num_q_heads = 4;
  shape.head_dim = 64;
  SchemeOptions o;
  o.sink = 16;
  o.recent = 32;
  for (const char* name : {"saw_int4", "kivi", "ots", "naive", "hadamard", "bf16"}) {
    SCOPED_TRACE(name);
    std::vector<LayerScheme> layers{BuildLayerScheme(name, shape, nullptr, 0, o)};
    const kvq::CacheParams before = layers[0].params;
    const bool shared = ShareSchemeWindows(ParseSchemeVariants(name, false)[0], o, &layers);
    const kvq::CacheParams& after = layers[0].params;
    EXPECT_EQ(shared, before.sink == 0 && before.quantized() &&
                          (std::string(name) == "saw_int4" || std::string(name) == "kivi" ||
                           std::string(name) == "ots"));
    EXPECT_EQ(after.flush, before.flush);
    if (shared) {
      EXPECT_EQ(after.sink, 16);
      EXPECT_EQ(after.recent, 32);
    } else {
      EXPECT_EQ(after.sink, before.sink);
      EXPECT_EQ(after.recent, before.recent);
    }
  }
}

}  // namespace
}  // namespace kvq::calib
