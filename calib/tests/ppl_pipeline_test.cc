// The kvq ppl pipeline as a library call (ppl_pipeline.h) on reference model A with short
// windows (S0 = 16, W = 32): the phases run in order with the result filled as they go, the
// bf16 row is the reference bit for bit, a calibration computed here and one read back give the
// same rows, unset cache options follow the calibration file, the GPU hooks run the evaluation
// and compare it with the CPU's, and every bad option value fails naming the option.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvq/calib/ppl.h"
#include "kvq/calib/ppl_pipeline.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testing::ExpectError;
using testing::kModelA;
// Window lengths (smaller in sanitizer builds); the history starts at S0 + W = 48.
constexpr int64_t kLength = testing::kSanitizerBuild ? 80 : 112;
constexpr int64_t kCalibLength = testing::kSanitizerBuild ? 64 : 96;

PplPipelineOptions SmallRun(const std::string& schemes) {
  PplPipelineOptions o;
  o.model = kModelA;
  o.windows = "heldout_en:0-1";
  o.length = kLength;
  o.calib_windows = "calib:0";
  o.calib_length = kCalibLength;
  o.schemes = schemes;
  o.sink = 16;
  o.recent = 32;
  o.page = 16;
  o.threads = 2;
  o.fp32_baseline = false;
  return o;
}

// Each phase as the hooks saw it: "begin load", "end load", ...
struct Trace {
  std::vector<std::string> events;
  std::vector<PplPhase> progress_asked;

  PplPipelineHooks Hooks() {
    PplPipelineHooks hooks;
    hooks.begin = [this](PplPhase p, const PplPipelineResult&) { Add("begin", p); };
    hooks.end = [this](PplPhase p, const PplPipelineResult&) { Add("end", p); };
    hooks.progress = [this](PplPhase p) {
      progress_asked.push_back(p);
      return PplProgress();
    };
    return hooks;
  }
  void Add(const char* what, PplPhase p) {
    events.push_back(std::string(what) + " " + std::to_string(static_cast<int>(p)));
  }
};

std::vector<std::string> Events(const std::vector<std::pair<const char*, PplPhase>>& list) {
  std::vector<std::string> out;
  for (const auto& [what, p] : list) {
    out.push_back(std::string(what) + " " + std::to_string(static_cast<int>(p)));
  }
  return out;
}

std::vector<std::string> Labels(const WindowSetResult& set) {
  std::vector<std::string> labels;
  for (const RowResult& row : set.rows) labels.push_back(row.label);
  return labels;
}

void ExpectBf16IsTheReference(const PplResult& r) {
  for (const WindowSetResult& set : r.sets) {
    const RowResult* ref = set.Find("bf16 (reference)");
    const RowResult* bf16 = set.Find("bf16");
    ASSERT_NE(ref, nullptr) << set.name;
    ASSERT_NE(bf16, nullptr) << set.name;
    EXPECT_EQ(bf16->MeanKl(false), 0.0) << set.name;
    EXPECT_EQ(bf16->Ppl(false), ref->Ppl(false)) << set.name;
    EXPECT_EQ(bf16->Ppl(true), ref->Ppl(true)) << set.name;
  }
}

class TempFile {
 public:
  explicit TempFile(const std::string& name)
      : path_((std::filesystem::temp_directory_path() /
               ("kvq_ppl_pipeline_test_" + std::to_string(getpid()) + "_" + name))
                  .string()) {}
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The calibrated run: capture, calibration, build, evaluation, each phase announced in order;
// a row per requested scheme after the reference; the calibration saved and read back gives the
// same numbers.
TEST(PplPipeline, CalibratesEvaluatesAndReportsEachPhase) {
  const TempFile saved("cal.safetensors");
  PplPipelineOptions o = SmallRun("bf16,naive,oscar");
  o.save_calibration = saved.path();
  Trace trace;
  const PplPipelineResult r = RunPplPipeline(o, cpu::BestBackend(), trace.Hooks());

  EXPECT_EQ(trace.events,
            Events({{"begin", PplPhase::kLoad}, {"end", PplPhase::kLoad},
                    {"begin", PplPhase::kCapture}, {"end", PplPhase::kCapture},
                    {"begin", PplPhase::kCalibrate}, {"end", PplPhase::kCalibrate},
                    {"begin", PplPhase::kBuild}, {"end", PplPhase::kBuild},
                    {"begin", PplPhase::kEvaluate}, {"end", PplPhase::kEvaluate}}));
  EXPECT_EQ(trace.progress_asked,
            (std::vector<PplPhase>{PplPhase::kCapture, PplPhase::kCalibrate, PplPhase::kBuild,
                                   PplPhase::kEvaluate}));
  EXPECT_EQ(r.threads, 2);
  EXPECT_EQ(r.config.num_layers, 8);
  EXPECT_EQ(r.capture, PplOrigin::kComputed);
  EXPECT_EQ(r.capture_tokens, kCalibLength);
  EXPECT_EQ(r.calibration_origin, PplOrigin::kComputed);
  EXPECT_EQ(r.calibration.layers.size(), 8u);
  EXPECT_EQ(r.calibration.info.sink, 16);
  EXPECT_EQ(r.evaluation.scheme.sink, 16);
  EXPECT_EQ(r.evaluation.scheme.recent, 32);
  EXPECT_EQ(r.evaluation.scheme.group, 64);  // SchemeOptions' default
  EXPECT_FALSE(r.gpu.has_value());
  EXPECT_FALSE(r.comparison.has_value());
  ASSERT_TRUE(r.cpu.has_value());
  EXPECT_EQ(r.cpu->calibration_source, r.calibration.info.source);
  ASSERT_EQ(r.cpu->sets.size(), 1u);
  EXPECT_EQ(r.cpu->sets[0].windows, (std::vector<int>{0, 1}));
  EXPECT_EQ(Labels(r.cpu->sets[0]),
            (std::vector<std::string>{"bf16 (reference)", "bf16", "naive", "oscar"}));
  ExpectBf16IsTheReference(*r.cpu);
  EXPECT_GT(r.cpu->sets[0].Find("naive")->MeanKl(true), 0.0);

  // The saved calibration, read back instead of computed: the same rows, bit for bit (oscar's
  // own clip still needs the capture).
  PplPipelineOptions again = SmallRun("bf16,naive,oscar");
  again.calibration = saved.path();
  const PplPipelineResult read = RunPplPipeline(again, cpu::BestBackend());
  EXPECT_EQ(read.calibration_origin, PplOrigin::kFile);
  EXPECT_EQ(read.capture, PplOrigin::kComputed);
  ASSERT_TRUE(read.cpu.has_value());
  for (const RowResult& row : r.cpu->sets[0].rows) {
    const RowResult* same = read.cpu->sets[0].Find(row.label);
    ASSERT_NE(same, nullptr) << row.label;
    EXPECT_EQ(same->Ppl(false), row.Ppl(false)) << row.label;
    EXPECT_EQ(same->MeanKl(true), row.MeanKl(true)) << row.label;
  }

  // G, b, S0, W left unset follow the file; one given overrides it. Only bf16: no capture.
  PplPipelineOptions follow = SmallRun("bf16");
  follow.calibration = saved.path();
  follow.sink.reset();
  follow.recent = 40;
  const PplPipelineResult followed = RunPplPipeline(follow, cpu::BestBackend());
  EXPECT_EQ(followed.capture, PplOrigin::kUnneeded);
  EXPECT_EQ(followed.evaluation.scheme.sink, 16);
  EXPECT_EQ(followed.evaluation.scheme.recent, 40);
  EXPECT_EQ(followed.cpu->options.tail_from, 56);
}

// --backend both through the GPU hooks, here the CPU's own forwards: the "GPU" run has no fp32
// row, and the comparison finds no difference at all.
TEST(PplPipeline, GpuHooksEvaluateAndCompareWithTheCpu) {
  PplPipelineOptions o = SmallRun("bf16,naive");
  o.backend = "both";
  o.fp32_baseline = true;
  std::unique_ptr<CpuPplForwards> device;
  int asked = 0;
  Trace trace;
  PplPipelineHooks hooks = trace.Hooks();
  hooks.gpu.unsupported = [&](const std::vector<LayerScheme>& layers) {
    ++asked;
    return layers.size() == 8 ? "" : "not 8 layers";
  };
  hooks.gpu.forwards = [&](const Model& model) -> PplForwards& {
    device = std::make_unique<CpuPplForwards>(model, cpu::BestBackend());
    return *device;
  };
  const PplPipelineResult r = RunPplPipeline(o, cpu::BestBackend(), hooks);

  EXPECT_EQ(asked, 2);
  EXPECT_NE(device, nullptr);
  EXPECT_EQ(trace.events,
            Events({{"begin", PplPhase::kLoad}, {"end", PplPhase::kLoad},
                    {"begin", PplPhase::kCapture}, {"end", PplPhase::kCapture},
                    {"begin", PplPhase::kCalibrate}, {"end", PplPhase::kCalibrate},
                    {"begin", PplPhase::kBuild}, {"end", PplPhase::kBuild},
                    {"begin", PplPhase::kGpuSelect}, {"end", PplPhase::kGpuSelect},
                    {"begin", PplPhase::kEvaluate}, {"end", PplPhase::kEvaluate},
                    {"begin", PplPhase::kCompare}, {"end", PplPhase::kCompare}}));
  EXPECT_TRUE(r.gpu_unsupported.empty());
  ASSERT_TRUE(r.gpu.has_value());
  ASSERT_TRUE(r.cpu.has_value());
  EXPECT_EQ(Labels(r.gpu->sets[0]),
            (std::vector<std::string>{"bf16 (reference)", "bf16", "naive"}));
  EXPECT_EQ(Labels(r.cpu->sets[0]), (std::vector<std::string>{"bf16 (reference)",
                                                              "fp32 (no cache)", "bf16", "naive"}));
  ExpectBf16IsTheReference(*r.gpu);
  ASSERT_TRUE(r.comparison.has_value());
  EXPECT_TRUE(r.comparison->within);
  EXPECT_EQ(r.comparison->max_rel_ppl, o.max_rel_ppl);
  EXPECT_EQ(r.comparison->worst_rel_ppl, 0.0);
  EXPECT_EQ(r.comparison->worst_rel_kl, 0.0);
  ASSERT_EQ(r.comparison->rows.size(), 3u);  // the GPU's rows the CPU has
  EXPECT_EQ(r.comparison->rows[2].row, "naive");
  EXPECT_EQ(r.comparison->rows[2].ppl_gpu, r.comparison->rows[2].ppl_cpu);
}

// A scheme named in --schemes that the GPU cannot serve is refused, naming it and the reason.
TEST(PplPipeline, RefusesANamedSchemeTheGpuCannotServe) {
  PplPipelineOptions o = SmallRun("bf16,naive");
  o.backend = "gpu";
  PplPipelineHooks hooks;
  hooks.gpu.unsupported = [](const std::vector<LayerScheme>& layers) {
    return layers[0].params.key.format == Format::kBf16 ? "" : "no history on this device";
  };
  hooks.gpu.forwards = [](const Model&) -> PplForwards& {
    throw Error(ErrorCode::kMismatch, "the forwards must not be asked for");
  };
  ExpectError([&] { RunPplPipeline(o, cpu::BestBackend(), hooks); }, ErrorCode::kUnsupported,
              "scheme 'naive' has no CUDA path: no history on this device");
}

// Bad values fail before anything is read, naming the option and the value.
TEST(PplPipeline, BadOptionValuesAreRefusedNamingTheOption) {
  const std::vector<std::pair<std::function<void(PplPipelineOptions&)>, std::string>> cases = {
      {[](PplPipelineOptions& o) { o.clip = "mine"; }, "--clip 'mine' (own, oscar or both)"},
      {[](PplPipelineOptions& o) { o.backend = "tpu"; }, "--backend 'tpu' (cpu, gpu or both)"},
      {[](PplPipelineOptions& o) { o.scheme_windows = "x"; }, "--scheme-windows 'x'"},
      {[](PplPipelineOptions& o) { o.threads = -1; }, "--threads -1 must be >= 0"},
      {[](PplPipelineOptions& o) { o.k_bits = 3; },
       "--k-bits 3 is not supported by scheme 'naive' (2 or 4)"},
      {[](PplPipelineOptions& o) { o.v_bits = 8; },
       "--v-bits 8 is not supported by scheme 'naive' (2 or 4)"},
      {[](PplPipelineOptions& o) { o.schemes = "bf16,tq_mse"; o.k_bits = 9; },
       "--k-bits 9 is not supported by scheme 'tq_mse' (1..8)"},
      {[](PplPipelineOptions& o) { o.schemes = "bf16,nosuch"; }, "nosuch"},
      {[](PplPipelineOptions& o) { o.backend = "gpu"; }, "--backend gpu: no GPU forwards given"},
      {[](PplPipelineOptions& o) { o.save_calibration = "c.safetensors"; },
       "--save-calibration c.safetensors: no scheme of --schemes bf16,naive"},
      {[](PplPipelineOptions& o) { o.calib_activations = "a.safetensors"; },
       "--calib-activations a.safetensors: no scheme of --schemes bf16,naive"},
      {[](PplPipelineOptions& o) { o.model = "/nonexistent/model"; }, "/nonexistent/model"},
  };
  for (const auto& [edit, needle] : cases) {
    PplPipelineOptions o = SmallRun("bf16,naive");
    edit(o);
    try {
      RunPplPipeline(o, cpu::BestBackend());
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  PplPipelineOptions both = SmallRun("oscar");
  both.calibration = "q.safetensors";
  both.save_calibration = "c.safetensors";
  ExpectError([&] { RunPplPipeline(both, cpu::BestBackend()); },
              ErrorCode::kInvalidArgument,
              "--save-calibration c.safetensors saves a calibration computed here, but "
              "--calibration q.safetensors is given");
}

}  // namespace
}  // namespace kvq::calib
