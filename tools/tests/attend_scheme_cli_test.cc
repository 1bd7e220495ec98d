// kvq attend --scheme ID: every scheme of the catalogue (calib/schemes.inc) gives, bit for bit,
// what the library gives when called directly (calib::BuildLayerScheme + cpu::PagedKVCache +
// cpu::Attend); the other flags act as overrides on top of the scheme; misuse fails with one
// `kvq: error:` line naming the value.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/io.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::RunKvq;
using cli_testing::ScratchDir;

constexpr int kLayers = 2, kQHeads = 8, kKvHeads = 2, kHeadDim = 64;
constexpr int64_t kTokens = 400;  // > S0 + W = 320 (the calibration's): 80 history tokens

std::vector<float> Normal(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

class AttendSchemeCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("kvq_attend_scheme");
    const std::string shape = " --layers " + std::to_string(kLayers) + " --q-heads " +
                              std::to_string(kQHeads) + " --kv-heads " +
                              std::to_string(kKvHeads) + " --head-dim " +
                              std::to_string(kHeadDim);
    ASSERT_EQ(RunKvq(*dir_, "synth --out a.safetensors --tokens 512" + shape).exit_code, 0);
    ASSERT_EQ(RunKvq(*dir_, "calibrate --activations a.safetensors --out c.safetensors").exit_code,
              0);
    cal_ = new calib::Calibration(calib::ReadCalibration(dir_->File("c.safetensors")));
    // The same calibration as a format_version 1 file (no raw-target rotations).
    calib::Calibration old = *cal_;
    for (calib::LayerCalibration& l : old.layers) {
      l.raw_k_rotation.clear();
      l.raw_v_rotation.clear();
    }
    calib::WriteCalibration(dir_->File("c1.safetensors"), old);
    std::mt19937_64 rng(11);
    const size_t kv = static_cast<size_t>(kTokens) * kKvHeads * kHeadDim;
    q_ = Normal(static_cast<size_t>(kQHeads) * kHeadDim, rng);
    k_ = Normal(kv, rng);
    v_ = Normal(kv, rng);
    WriteNpy(dir_->File("q.npy"), Tensor::F32({kQHeads, kHeadDim}, q_));
    WriteNpy(dir_->File("k.npy"), Tensor::F32({kTokens, kKvHeads, kHeadDim}, k_));
    WriteNpy(dir_->File("v.npy"), Tensor::F32({kTokens, kKvHeads, kHeadDim}, v_));
    const std::vector<float>& rotations = cal_->layers[0].key.rotation;
    WriteNpy(dir_->File("r.npy"),
             Tensor::F32({kHeadDim, kHeadDim},
                         std::vector<float>(rotations.begin(),
                                            rotations.begin() + kHeadDim * kHeadDim)));
  }
  static void TearDownTestSuite() {
    delete cal_;
    delete dir_;
  }

  // The scheme options `kvq attend --scheme` starts from: the calibration's group, bits, sink
  // and recent when one is given, else SchemeOptions' defaults (the same values here).
  static calib::SchemeOptions Options(bool calibrated) {
    calib::SchemeOptions o;
    if (calibrated) {
      o.group = cal_->info.group;
      o.bits = cal_->info.bits;
      o.sink = cal_->info.sink;
      o.recent = cal_->info.recent;
    }
    return o;
  }

  static calib::SchemeShape Shape() {
    calib::SchemeShape shape;
    shape.num_layers = kLayers;
    shape.num_kv_heads = kKvHeads;
    shape.num_q_heads = kQHeads;
    shape.head_dim = kHeadDim;
    return shape;
  }

  // What the library gives for `scheme` after `edit`.
  static std::vector<float> Library(const calib::LayerScheme& built,
                                    const std::function<void(calib::LayerScheme&)>& edit = {}) {
    calib::LayerScheme s = built;
    if (edit) edit(s);
    cpu::PagedKVCache cache(s.params, s.key, s.value, cpu::BestBackend());
    const int seq = cache.AddSequence();
    cache.Prefill(seq, k_.data(), v_.data(), kTokens);
    std::vector<float> out(q_.size());
    cpu::Attend(cpu::BestBackend(), cache, seq, q_.data(), out.data());
    return out;
  }

  // Runs `kvq attend` with the common inputs plus `args` into `out`; returns the output.
  static std::vector<float> Cli(const std::string& args, const std::string& out) {
    const auto r = RunKvq(*dir_, "attend --q q.npy --k k.npy --v v.npy " + args + " --out " + out);
    EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.err;
    if (r.exit_code != 0) return {};
    const Tensor t = ReadNpy(dir_->File(out));
    EXPECT_EQ(t.shape, (std::vector<int64_t>{kQHeads, kHeadDim}));
    return t.ToF32();
  }

  static bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }

  static ScratchDir* dir_;
  static calib::Calibration* cal_;
  static std::vector<float> q_, k_, v_;
};
ScratchDir* AttendSchemeCli::dir_ = nullptr;
calib::Calibration* AttendSchemeCli::cal_ = nullptr;
std::vector<float> AttendSchemeCli::q_, AttendSchemeCli::k_, AttendSchemeCli::v_;

TEST_F(AttendSchemeCli, EverySchemeMatchesTheLibraryBitForBit) {
  std::set<std::vector<float>> distinct;
  for (const calib::SchemeInfo& s : calib::Schemes()) {
    const int layer = s.needs_calibration ? 1 : 0;
    // The fp8 schemes read a calibration made for them (their scales), blockgtq its own (its
    // key widths, at K2 as the others' bits), the others oscar's.
    const std::string kind = calib::CalibrationScheme(s.name);
    std::string file = "c.safetensors";
    std::unique_ptr<calib::Calibration> own;
    if (kind != "oscar") {
      file = "c_" + kind + ".safetensors";
      const std::string widths =
          s.widths == calib::WidthsPolicy::kCalibration ? " --k-bits 2" : "";
      ASSERT_EQ(RunKvq(*dir_, "calibrate --activations a.safetensors --scheme " + kind + widths +
                                  " --out " + file).exit_code, 0);
      own = std::make_unique<calib::Calibration>(calib::ReadCalibration(dir_->File(file)));
    }
    const std::string args =
        std::string("--scheme ") + s.name +
        (s.needs_calibration ? " --calibration " + file + " --layer 1" : "");
    const std::vector<float> got = Cli(args, std::string("o_") + s.name + ".npy");
    const calib::LayerScheme built = calib::BuildLayerScheme(
        s.name, Shape(), s.needs_calibration ? (own ? own.get() : cal_) : nullptr, layer,
        Options(s.needs_calibration));
    EXPECT_TRUE(SameBits(got, Library(built))) << s.name;
    distinct.insert(got);
  }
  // Each scheme is a different cache, so each output differs: the scheme is really used.
  EXPECT_EQ(distinct.size(), calib::Schemes().size());
}

TEST_F(AttendSchemeCli, CalibrationWithoutSchemeIsOscar) {
  const std::vector<float> plain = Cli("--calibration c.safetensors --layer 1", "o_plain.npy");
  const std::vector<float> oscar =
      Cli("--scheme oscar --calibration c.safetensors --layer 1", "o_oscar.npy");
  EXPECT_TRUE(SameBits(plain, oscar));
}

// A format_version 1 calibration serves every scheme but raw_target, which names what is missing.
TEST_F(AttendSchemeCli, VersionOneCalibration) {
  const std::vector<float> v2 = Cli("--scheme oscar --calibration c.safetensors --layer 0", "a.npy");
  const std::vector<float> v1 = Cli("--scheme oscar --calibration c1.safetensors --layer 0", "b.npy");
  EXPECT_TRUE(SameBits(v1, v2));
  ExpectFailure(*dir_,
                "attend --q q.npy --k k.npy --v v.npy --scheme raw_target --calibration "
                "c1.safetensors --layer 0 --out bad.npy",
                dir_->File("bad.npy"), {"raw_target", "layers.0.raw_k_rotation", "format_version 1"});
}

TEST_F(AttendSchemeCli, FlagsOverrideTheScheme) {
  const std::string cal0 = " --calibration c.safetensors --layer 0";
  const calib::LayerScheme oscar =
      calib::BuildLayerScheme("oscar", Shape(), cal_, 0, Options(true));
  const std::vector<float> plain = Library(oscar);
  // Each override must change the output (0.85 is off the calibration's clip grid), and give
  // what the library gives after the same edit.
  // Clip ratios: one for every head instead of the calibration's.
  const std::vector<float> clipped = Cli("--scheme oscar --clip-k 0.85" + cal0, "o1.npy");
  EXPECT_FALSE(SameBits(clipped, plain));
  EXPECT_TRUE(SameBits(clipped, Library(oscar, [](calib::LayerScheme& s) {
                         s.params.key.clip = 0.85f;
                         s.key.clip.clear();
                       })));
  // A rotation flag replaces both rotations.
  const std::vector<float> hadamard = Cli("--scheme oscar --hadamard" + cal0, "o2.npy");
  EXPECT_FALSE(SameBits(hadamard, plain));
  EXPECT_TRUE(SameBits(hadamard, Library(oscar, [](calib::LayerScheme& s) {
                         s.params.key.rotation = s.params.value.rotation = RotationKind::kHadamard;
                         s.key.rotation.clear();
                         s.value.rotation.clear();
                       })));
  const std::vector<float> dense =
      Cli("--scheme hadamard_bitrev --rotation-k r.npy --rotation-v r.npy", "o3.npy");
  EXPECT_FALSE(SameBits(dense, Cli("--scheme hadamard_bitrev", "o3b.npy")));
  EXPECT_TRUE(SameBits(dense,
                       Library(calib::BuildLayerScheme("hadamard_bitrev", Shape(), nullptr, 0,
                                                       Options(false)),
                               [](calib::LayerScheme& s) {
                                 for (WriteParams* w : {&s.params.key, &s.params.value}) {
                                   w->rotation = RotationKind::kDense;
                                   w->bitrev = false;
                                 }
                                 // r.npy is [d, d]: shared by the KV heads.
                                 const std::vector<float> r(
                                     cal_->layers[0].key.rotation.begin(),
                                     cal_->layers[0].key.rotation.begin() + kHeadDim * kHeadDim);
                                 s.key.rotation.clear();
                                 for (int h = 0; h < kKvHeads; ++h) {
                                   s.key.rotation.insert(s.key.rotation.end(), r.begin(), r.end());
                                 }
                                 s.value.rotation = s.key.rotation;
                               })));
  // --bits replaces even a scheme's own width (saw_int4 is INT4 unless told otherwise).
  const calib::LayerScheme saw = calib::BuildLayerScheme("saw_int4", Shape(), nullptr, 0, Options(false));
  ASSERT_EQ(saw.params.key.bits, 4);
  const std::vector<float> saw2 = Cli("--scheme saw_int4 --bits 2", "o4.npy");
  EXPECT_FALSE(SameBits(saw2, Library(saw)));
  EXPECT_TRUE(SameBits(saw2,
                       Library(saw, [](calib::LayerScheme& s) {
                         s.params.key.bits = s.params.value.bits = 2;
                       })));
  // Scheme options: the FWHT block, random_orthogonal's seed, the cache's windows.
  calib::SchemeOptions o = Options(false);
  o.saw_block = 16;
  const std::vector<float> block16 = Cli("--scheme saw_int4 --saw-block 16", "o5.npy");
  EXPECT_FALSE(SameBits(block16, Library(saw)));
  EXPECT_TRUE(SameBits(block16, Library(calib::BuildLayerScheme("saw_int4", Shape(), nullptr, 0, o))));
  o = Options(true);
  o.seed = 5;
  const std::vector<float> seeded = Cli("--scheme random_orthogonal --seed 5" + cal0, "o6.npy");
  EXPECT_TRUE(SameBits(seeded,
                       Library(calib::BuildLayerScheme("random_orthogonal", Shape(), cal_, 0, o))));
  EXPECT_FALSE(SameBits(seeded, Cli("--scheme random_orthogonal" + cal0, "o7.npy")));
  o = Options(false);
  o.group = 32;
  o.sink = 8;
  o.recent = 18;
  o.page = 16;
  // T - S0 - W = 374: F = 4 leaves 372 history tokens where F = 1 leaves 374.
  const std::vector<float> windows =
      Cli("--scheme naive --group 32 --sink 8 --recent 18 --page 16 --flush 4", "o8.npy");
  EXPECT_FALSE(SameBits(windows, Library(calib::BuildLayerScheme("naive", Shape(), nullptr, 0, o))))
      << "--flush 4 must matter";
  EXPECT_TRUE(SameBits(windows, Library(calib::BuildLayerScheme("naive", Shape(), nullptr, 0, o),
                                        [](calib::LayerScheme& s) { s.params.flush = 4; })));
  // --format bf16: the bf16 cache, whatever the scheme.
  const std::vector<float> bf16 = Cli("--scheme bf16", "o9.npy");
  EXPECT_TRUE(SameBits(Cli("--scheme oscar --format bf16" + cal0, "o10.npy"), bf16));
  EXPECT_TRUE(SameBits(Cli("--format bf16", "o11.npy"), bf16));
  // K and V apart: --k-bits / --v-bits set one side's width, over --bits and the scheme's own.
  o = Options(false);
  const auto widths = [](int k, int v) {
    return [k, v](calib::LayerScheme& s) {
      s.params.key.bits = k;
      s.params.value.bits = v;
    };
  };
  for (const char* scheme : {"naive", "kivi", "saw_int4"}) {
    SCOPED_TRACE(scheme);
    const std::vector<float> k4v2 =
        Cli(std::string("--scheme ") + scheme + " --k-bits 4 --v-bits 2", "o12.npy");
    EXPECT_TRUE(SameBits(
        k4v2, Library(calib::BuildLayerScheme(scheme, Shape(), nullptr, 0, o), widths(4, 2))));
    EXPECT_FALSE(SameBits(
        k4v2, Library(calib::BuildLayerScheme(scheme, Shape(), nullptr, 0, o), widths(4, 4))));
    EXPECT_TRUE(SameBits(Cli(std::string("--scheme ") + scheme + " --bits 4 --v-bits 2", "o13.npy"),
                         k4v2));
  }
}

// Issue 17's contract: `kvq attend --scheme ID [--bits B] [--group G] [--tile GK] [--flush F]
// [--sink S0] [--recent W] [--norm-scope head|token]` with the catalogue's defaults, each flag
// doing what the library does, and the output within the CPU oracle's tolerance of the fp64
// reference over the dequantized history.
TEST_F(AttendSchemeCli, Spec11SchemesAndFlags) {
  const calib::SchemeOptions o = Options(false);
  for (const char* name : {"kivi", "kivi_hadamard", "kivi_norm", "ots", "saw_int4", "saw_int4_k",
                           "saw_hessian"}) {
    const bool calibrated = calib::SchemeByName(name).needs_calibration;
    const std::string args = std::string("--scheme ") + name +
                             (calibrated ? " --calibration c.safetensors --layer 1" : "");
    const std::vector<float> got = Cli(args, std::string("c_") + name + ".npy");
    const calib::LayerScheme built = calib::BuildLayerScheme(name, Shape(), calibrated ? cal_ : nullptr,
                                                            calibrated ? 1 : 0, Options(calibrated));
    cpu::PagedKVCache cache(built.params, built.key, built.value, cpu::BestBackend());
    const int seq = cache.AddSequence();
    cache.Prefill(seq, k_.data(), v_.data(), kTokens);
    ASSERT_GT(cache.HistoryLength(seq), 0u) << name;
    std::vector<double> ref(q_.size());
    cpu::AttendReferenceF64(cache, seq, q_.data(), ref.data());
    for (double e : cpu::RelativeErrorPerHead(got.data(), ref.data(), kQHeads, kHeadDim)) {
      EXPECT_LE(e, cpu::kAttentionOracleTolerance) << name;
    }
  }
  // --norm-scope token: one norm per token over both KV heads.
  calib::SchemeOptions token = o;
  token.norm_scope = calib::NormScope::kToken;
  const std::vector<float> ots_token = Cli("--scheme ots --norm-scope token", "n1.npy");
  EXPECT_TRUE(SameBits(ots_token, Library(calib::BuildLayerScheme("ots", Shape(), nullptr, 0, token))));
  EXPECT_FALSE(SameBits(ots_token, Cli("--scheme ots --norm-scope head", "n2.npy")));
  EXPECT_TRUE(SameBits(Cli("--scheme ots --norm-scope head", "n3.npy"), Cli("--scheme ots", "n4.npy")));
  // --tile and --flush: tiles of 64 flushed 64 at a time (T = 400, W = 1: 384 history tokens
  // either way, so the tile alone changes the bits).
  calib::SchemeOptions tile64 = o;
  tile64.tile = 64;
  const std::vector<float> kivi64 = Cli("--scheme kivi --tile 64 --flush 64", "t1.npy");
  EXPECT_TRUE(SameBits(kivi64, Library(calib::BuildLayerScheme("kivi", Shape(), nullptr, 0, tile64),
                                       [](calib::LayerScheme& s) { s.params.flush = 64; })));
  EXPECT_FALSE(SameBits(kivi64, Cli("--scheme kivi --flush 64", "t2.npy")));
  // --group is the per-token side's group (KIVI's values), not the keys' tile.
  const calib::LayerScheme kivi = calib::BuildLayerScheme("kivi", Shape(), nullptr, 0, o);
  const std::vector<float> kivi_g64 = Cli("--scheme kivi --group 64", "t3.npy");
  EXPECT_TRUE(SameBits(kivi_g64, Library(kivi, [](calib::LayerScheme& s) {
                         s.params.value.group = 64;
                       })));
  EXPECT_FALSE(SameBits(kivi_g64, Library(kivi)));
  // --recent 0 and --sink 0: every token straight to the history.
  const std::vector<float> w0 = Cli("--scheme naive --sink 0 --recent 0", "w0.npy");
  EXPECT_TRUE(SameBits(w0, Library(calib::BuildLayerScheme("naive", Shape(), nullptr, 0, o),
                                   [](calib::LayerScheme& s) {
                                     s.params.sink = 0;
                                     s.params.recent = 0;
                                   })));
  // The SAW-INT4 configuration of kvq before spec 1.1, by flags: G = 64, S0 = 64, W = 256, the
  // FWHT (block min(128, d) = d) on K and V, INT4.
  const std::vector<float> old_saw = Cli("--scheme saw_int4 --group 64 --sink 64 --recent 256", "s1.npy");
  calib::LayerScheme legacy;
  CacheParams& p = legacy.params;
  p.num_kv_heads = kKvHeads;
  p.num_q_heads = kQHeads;
  p.sink = 64;
  p.recent = 256;
  p.page_size = 64;
  for (WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = kHeadDim;
    w->group = 64;
    w->bits = 4;
    w->rotation = RotationKind::kHadamard;
  }
  EXPECT_TRUE(SameBits(old_saw, Library(legacy)));
  EXPECT_FALSE(SameBits(old_saw, Cli("--scheme saw_int4", "s2.npy")));
}

// The contract's blockgtq (issue 22): `kvq attend --scheme blockgtq --calibration C --layer L`
// with C a file of kvq calibrate --scheme blockgtq is the library's blockgtq of that layer (the
// keys at the file's per-head widths, the values at its b_v, no windows), and --v-bits,
// --protected, --sink / --recent and --rotation-k / --rotation-v act as overrides on top.
TEST_F(AttendSchemeCli, BlockGtqContract) {
  const ScratchDir& dir = *dir_;
  ASSERT_EQ(RunKvq(dir, "calibrate --activations a.safetensors --scheme blockgtq --k-bits 2.5 "
                        "--v-bits 2 --out gtq.safetensors")
                .exit_code,
            0);
  const calib::Calibration gtq = calib::ReadCalibration(dir.File("gtq.safetensors"));
  // What kvq attend starts from: the file's bits (K's rounded-up average 3, V's 2).
  calib::SchemeOptions o;
  o.group = gtq.info.group;
  o.bits = gtq.info.bits;
  o.v_bits = gtq.info.v_bits;
  o.sink = gtq.info.sink;
  o.recent = gtq.info.recent;
  ASSERT_EQ(o.bits, 3);
  ASSERT_EQ(o.v_bits, 2);
  const calib::LayerScheme built = calib::BuildLayerScheme("blockgtq", Shape(), &gtq, 1, o);
  EXPECT_EQ(built.key.widths, gtq.layers[1].key.widths);
  EXPECT_EQ(built.params.value.bits, 2);
  EXPECT_EQ(built.params.sink, 0);
  EXPECT_EQ(built.params.recent, 0);
  const std::string cal = " --calibration gtq.safetensors --layer 1";
  const std::vector<float> plain = Cli("--scheme blockgtq" + cal, "g0.npy");
  EXPECT_TRUE(SameBits(plain, Library(built)));
  EXPECT_FALSE(SameBits(plain, Cli("--scheme tq_mse --k-bits 3 --v-bits 2", "g_tq.npy")));

  const std::vector<float> v3 = Cli("--scheme blockgtq --v-bits 3" + cal, "g1.npy");
  EXPECT_FALSE(SameBits(v3, plain));
  EXPECT_TRUE(SameBits(v3, Library(built, [](calib::LayerScheme& s) { s.params.value.bits = 3; })));
  calib::SchemeOptions protect = o;
  protect.protect = true;
  const std::vector<float> protected_out = Cli("--scheme blockgtq --protected" + cal, "g2.npy");
  EXPECT_FALSE(SameBits(protected_out, plain));
  EXPECT_TRUE(SameBits(protected_out,
                       Library(calib::BuildLayerScheme("blockgtq", Shape(), &gtq, 1, protect))));
  const std::vector<float> windows = Cli("--scheme blockgtq --sink 4 --recent 8" + cal, "g3.npy");
  EXPECT_TRUE(SameBits(windows, Library(built, [](calib::LayerScheme& s) {
                         s.params.sink = 4;
                         s.params.recent = 8;
                       })));
  const std::vector<float> dense =
      Cli("--scheme blockgtq --rotation-k r.npy --rotation-v r.npy" + cal, "g4.npy");
  EXPECT_FALSE(SameBits(dense, plain));
  EXPECT_TRUE(SameBits(dense, Library(built, [](calib::LayerScheme& s) {
                         const std::vector<float> r(
                             cal_->layers[0].key.rotation.begin(),
                             cal_->layers[0].key.rotation.begin() + kHeadDim * kHeadDim);
                         s.key.rotation.clear();
                         for (int h = 0; h < kKvHeads; ++h) {
                           s.key.rotation.insert(s.key.rotation.end(), r.begin(), r.end());
                         }
                         s.value.rotation = s.key.rotation;
                       })));

  const std::string base = "attend --q q.npy --k k.npy --v v.npy --out bad.npy --scheme blockgtq";
  const std::string bad = dir.File("bad.npy");
  ExpectFailure(dir, base, bad, {"needs a calibration", "layers.{l}.k_bits", "--calibration"});
  ExpectFailure(dir, base + cal + " --k-bits 3", bad, {"--k-bits", "kvq calibrate --scheme"});
  ExpectFailure(dir, base + cal + " --bits 3", bad, {"--bits"});
  ExpectFailure(dir, base + cal + " --v-bits 9", bad, {"--v-bits 9", "1..8"});
  // An OSCAR calibration holds no widths: the tensor it lacks, by name.
  ExpectFailure(dir, base + " --calibration c.safetensors --layer 1", bad,
                {"layers.1.k_bits", "blockgtq"});
}

TEST_F(AttendSchemeCli, MisuseFailsNamingTheValue) {
  const ScratchDir& dir = *dir_;
  const std::string base = "attend --q q.npy --k k.npy --v v.npy --out bad.npy ";
  const std::string bad = dir.File("bad.npy");
  // An unknown id names it and lists the valid ones (from the catalogue).
  std::vector<std::string> needles = {"unknown scheme 'kivi2'"};
  for (const calib::SchemeInfo& s : calib::Schemes()) needles.push_back(s.name);
  ExpectFailure(dir, base + "--scheme kivi2", bad, needles);
  for (const calib::SchemeInfo& s : calib::Schemes()) {
    if (!s.needs_calibration) continue;
    ExpectFailure(dir, base + "--scheme " + s.name, bad,
                  {std::string("--scheme ") + s.name + " needs a calibration", "--calibration"});
  }
  ExpectFailure(dir, base + "--scheme oscar --calibration c.safetensors", bad, {"--layer"});
  ExpectFailure(dir, base + "--scheme oscar --calibration c.safetensors --layer 2", bad,
                {"--layer 2", "2 layers"});
  ExpectFailure(dir, base + "--scheme bf16 --bits 2", bad, {"--bits 2", "bf16"});
  ExpectFailure(dir, base + "--scheme bf16 --hadamard", bad, {"--hadamard", "bf16"});
  ExpectFailure(dir, base + "--scheme naive --format bf16 --clip-v 0.9", bad, {"--clip-v", "bf16"});
  ExpectFailure(dir, base + "--scheme naive --bits 16", bad, {"--bits 16", "--format bf16"});
  ExpectFailure(dir, base + "--scheme naive --format bf16 --k-bits 4", bad, {"--k-bits", "bf16"});
  ExpectFailure(dir, base + "--scheme naive --format affine_token", bad,
                {"--format 'affine_token'", "bf16"});
  ExpectFailure(dir, base + "--scheme naive --k-bits 3", bad, {"--k-bits 3"});
  ExpectFailure(dir, base + "--scheme naive --v-bits 8", bad, {"bits 8"});
  ExpectFailure(dir, base + "--scheme naive --hadamard --identity", bad, {"only one of"});
  ExpectFailure(dir, base + "--scheme naive --rotation-v r.npy", bad,
                {"--rotation-k and --rotation-v"});
  ExpectFailure(dir, base + "--scheme naive --bits 3", bad, {"--bits 3"});
  ExpectFailure(dir, base + "--scheme naive --group 48", bad, {"group size 48"});
  ExpectFailure(dir, base + "--scheme naive --flush 0", bad, {"flush granularity 0"});
  ExpectFailure(dir, base + "--scheme saw_int4 --saw-block 48", bad, {"saw_block 48"});
  ExpectFailure(dir, base + "--scheme naive --clip-k 1.5", bad, {"clip", "1.5"});
  ExpectFailure(dir, base + "--scheme naive --norm-scope token", bad, {"--norm-scope", "naive"});
  ExpectFailure(dir, base + "--scheme ots --norm-scope layer", bad, {"norm scope 'layer'"});
  ExpectFailure(dir, base + "--scheme saw_int4 --tile 64", bad, {"--tile", "saw_int4"});
  ExpectFailure(dir, base + "--scheme kivi --tile 48", bad, {"tile size 48"});
  ExpectFailure(dir, base + "--scheme kivi --flush 48", bad, {"flush granularity 48"});
  ExpectFailure(dir, base + "--scheme kivi --page 16", bad, {"page size 16"});
  ExpectFailure(dir, base + "--hadamard --tile 32", bad, {"--tile", "needs --scheme"});
}

}  // namespace
}  // namespace kvq
