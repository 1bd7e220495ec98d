// kvq attend --q Q.npy --k K.npy --v V.npy
//            (--scheme ID [--calibration C --layer L] |
//             --rotation-k RK.npy --rotation-v RV.npy | --hadamard | --identity |
//             --calibration C --layer L)
//            [--clip-k RHO] [--clip-v RHO] [--bits B] [--k-bits B] [--v-bits B]
//            [--format bf16] [--group G] [--tile GK] [--sink S0]
//            [--recent W] [--flush F] [--page P] [--norm-scope head|token] [--seed S]
//            [--saw-block H] [--protected] [--backend NAME] --out O.npy
// One decode step of one sequence: the T rows of K and V (float32 [T, Hkv, d], rounded to
// bf16 as the cache stores them) go into a paged cache (bf16 sink | quantized history | bf16
// recent), and O = attention(Q) over it, Q and O float32 [Hq, d], scale 1/sqrt(d).
//
// --scheme ID: any scheme of the catalogue (calib/schemes.inc; the schemes of `kvq eval`),
// built exactly as `kvq eval` builds it (calib::BuildLayerScheme) for layer L of calibration C
// where the scheme needs one, on the calibration's group, bits, sink and recent (without one:
// 64, 2, 64, 256), unless the scheme fixes its own (KIVI and OScaR: values in groups of 32,
// S0 = 0, W = 1, F = 128; SAW-INT4: INT4, G = d, S0 = W = 0; DESIGN.md). --tile GK (tokens per
// tile of a tiled side, default 32), --norm-scope (head | token: the key norm of kivi_norm and
// ots, default head) and --seed / --saw-block are options of the build. Every other flag given
// is applied afterwards, an override on top of the scheme (and of anything the scheme fixes for
// itself): --rotation-k/--rotation-v, --hadamard or --identity replace both rotations,
// --clip-k / --clip-v replace the per-head ratios, --bits B replaces the scheme's bits on both
// sides and --k-bits / --v-bits on one (K4V2: --k-bits 4 --v-bits 2), --format bf16 makes it
// the bf16 cache, --group the per-token sides' group, --sink/--recent/--flush/
// --page the cache's. So `--scheme saw_int4 --group 64 --sink 64 --recent 256` is the
// SAW-INT4 configuration of kvq before spec 1.1.
//
// The codebook schemes (spec 1.3): tq_mse (a Haar rotation per layer, KV head and side from
// --seed), tq_mse_fwht and blockgtq store codebook rows of --k-bits / --v-bits 1..8 (default
// --bits 2) with no windows; --protected gives them seeds/004's S0 = 4, W = 128 instead, and
// --rotation-k/--rotation-v replace the seeded rotations. blockgtq's keys take the per-head
// block widths of a kvq calibrate --scheme blockgtq file (--calibration C --layer L, which it
// needs; --bits / --k-bits do not apply to its keys), its values are TurboQuant-MSE at --v-bits.
//
// Without --scheme: the rotation flags say how rows are rotated (RK, RV: float32 [d, d] shared
// by the KV heads, or [Hkv, d, d]); --format bf16 is the bf16 baseline cache (rotation options then
// optional and unused); --calibration C --layer L alone is `--scheme oscar` without overrides
// of the rotation or the clip (those flags are refused).
#include <CLI/CLI.hpp>

#include <cmath>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cli_common.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/orthogonality.h"
#include "kvq/common/params.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

struct AttendOptions {
  std::string q, k, v, out;
  std::string scheme;       // --scheme: a catalogue id
  std::string rotation_k, rotation_v;
  bool hadamard = false;
  bool identity = false;
  std::string clip_k = "1", clip_v = "1";
  int bits = 2;
  int k_bits = 0, v_bits = 0;  // --k-bits / --v-bits: one side's bits (0: --bits)
  std::string format;       // --format: bf16 (the bf16 cache)
  int group = 64;
  int sink = 64;
  int recent = 256;
  int flush = 1;
  int page = 64;
  int tile = 32;            // --tile: G_k of a tiled side
  std::string norm_scope = "head";  // --norm-scope: head | token
  uint64_t seed = 0;        // --seed: random_orthogonal's
  int saw_block = 128;      // --saw-block: saw_int4's FWHT block
  bool protect = false;     // --protected: S0 = 4, W = 128 (calib::kProtectedWindows)
  std::string backend;
  std::string calibration;  // --calibration: a kvq calibrate file
  int layer = 0;            // --layer: which of its layers
  // Whether each of these was given on the command line (the calibration supplies defaults).
  bool has_layer = false, has_clip_k = false, has_clip_v = false, has_bits = false,
       has_k_bits = false, has_v_bits = false,
       has_group = false, has_sink = false, has_recent = false, has_flush = false,
       has_page = false, has_tile = false, has_norm_scope = false;
};

// --format and the widths, before any file is read. `codebook`: the scheme stores codebook rows
// (tq_mse, tq_mse_fwht, blockgtq), whose widths are 1..8.
void CheckBitsOptions(const AttendOptions& o, bool codebook = false) {
  KVQ_CHECK(o.format.empty() || o.format == "bf16", kInvalidArgument, "--format '", o.format,
            "': only bf16 (the bf16 cache) is chosen by name; a quantized format comes with "
            "--scheme or the rotation flags");
  KVQ_CHECK(o.bits != 16, kInvalidArgument,
            "--bits 16: the bf16 cache is --format bf16 (--bits is the quantized history's "
            "width)");
  for (const auto& [name, value, given] :
       {std::tuple<const char*, int, bool>{"--bits", o.bits, o.has_bits},
        {"--k-bits", o.k_bits, o.has_k_bits},
        {"--v-bits", o.v_bits, o.has_v_bits}}) {
    if (codebook) {
      KVQ_CHECK(!given || (value >= 1 && value <= 8), kInvalidArgument, name, " ", value,
                " is not supported by the codebook schemes (1..8)");
    } else {
      KVQ_CHECK(!given || value == 2 || value == 4 || value == 8, kInvalidArgument, name, " ",
                value, " is not supported (2 or 4; 8 for the fp8 schemes; 1..8 for the codebook "
                "schemes)");
    }
  }
}

// The first width option given, with its value ("--k-bits 4"); "" when none.
std::string GivenWidth(const AttendOptions& o) {
  if (o.has_bits) return "--bits " + std::to_string(o.bits);
  if (o.has_k_bits) return "--k-bits " + std::to_string(o.k_bits);
  if (o.has_v_bits) return "--v-bits " + std::to_string(o.v_bits);
  return "";
}

// What the cache is built from: params and the per-head data of K and V, as a scheme of the
// catalogue gives them (the flags alone give one too).
using CacheSetup = kvq::calib::LayerScheme;

// The inputs, read and checked against each other.
struct Inputs {
  kvq::Tensor q, k, v;
  int64_t tokens = 0;
  int hq = 0, hkv = 0, d = 0;
};

// A float tensor (float32, or float16 / bf16 converted exactly) of rank `rank`.
kvq::Tensor ReadFloatTensor(const std::string& path, size_t rank, const std::string& what) {
  kvq::Tensor t = kvq::ReadNpy(path);
  KVQ_CHECK(t.dtype == kvq::DType::kF32 || t.dtype == kvq::DType::kF16 ||
                t.dtype == kvq::DType::kBF16,
            kInvalidArgument, what, " ", path, " has dtype ", kvq::DTypeName(t.dtype),
            ", expected float32");
  KVQ_CHECK(t.shape.size() == rank, kShapeMismatch, what, " ", path, " has shape ",
            t.ShapeString(), ", expected rank ", rank);
  return t;
}

Inputs ReadInputs(const AttendOptions& o) {
  Inputs in;
  in.q = ReadFloatTensor(o.q, 2, "query");
  in.k = ReadFloatTensor(o.k, 3, "keys");
  in.v = ReadFloatTensor(o.v, 3, "values");
  const kvq::Tensor &q = in.q, &k = in.k, &v = in.v;
  KVQ_CHECK(k.shape == v.shape, kShapeMismatch, "keys ", o.k, " have shape ", k.ShapeString(),
            " but values ", o.v, " have shape ", v.ShapeString());
  in.tokens = k.shape[0];
  KVQ_CHECK(in.tokens >= 1, kShapeMismatch, "keys ", o.k, " hold no token (shape ",
            k.ShapeString(), ")");
  KVQ_CHECK(q.shape[1] == k.shape[2], kShapeMismatch, "query ", o.q, " has head_dim ",
            q.shape[1], " but keys ", o.k, " have head_dim ", k.shape[2]);
  KVQ_CHECK(k.shape[1] >= 1 && k.shape[1] <= 4096 && q.shape[0] >= 1 && q.shape[0] <= 4096 &&
                k.shape[2] <= 4096,
            kShapeMismatch, "head counts or head_dim out of range: query ", q.ShapeString(),
            ", keys ", k.ShapeString());
  in.hq = static_cast<int>(q.shape[0]);
  in.hkv = static_cast<int>(k.shape[1]);
  in.d = static_cast<int>(k.shape[2]);
  return in;
}

// [d, d] or [Hkv, d, d] -> [Hkv, d, d].
std::vector<float> ReadRotations(const std::string& path, const std::string& what, int hkv,
                                 int d) {
  kvq::Tensor t = kvq::ReadNpy(path);
  KVQ_CHECK(t.dtype == kvq::DType::kF32 || t.dtype == kvq::DType::kF16, kInvalidArgument, what,
            " ", path, " has dtype ", kvq::DTypeName(t.dtype), ", expected float32");
  const std::vector<int64_t> shared = {d, d}, per_head = {hkv, d, d};
  KVQ_CHECK(t.shape == shared || t.shape == per_head, kShapeMismatch, what, " ", path,
            " has shape ", t.ShapeString(), ", expected [", d, ", ", d, "] or [", hkv, ", ", d,
            ", ", d, "]");
  std::vector<float> values = t.ToF32();
  const size_t matrices = t.shape == per_head ? static_cast<size_t>(hkv) : 1;
  for (size_t h = 0; h < matrices; ++h) {
    const float* m = values.data() + h * static_cast<size_t>(d) * d;
    for (size_t i = 0; i < static_cast<size_t>(d) * d; ++i) {
      KVQ_CHECK(std::isfinite(m[i]), kNonFinite, what, " ", path, " has ", m[i],
                t.shape == per_head ? " in KV head " + std::to_string(h) : std::string(),
                " at row ", i / d, ", column ", i % d);
    }
    kvq::CheckOrthogonal(m, d, what + " " + path +
                              (t.shape == per_head ? " (KV head " + std::to_string(h) + ")" : ""));
  }
  if (t.shape == per_head) return values;
  std::vector<float> all;
  for (int h = 0; h < hkv; ++h) all.insert(all.end(), values.begin(), values.end());
  return all;
}

// --calibration and --layer go together; the layer must exist.
void CheckLayerOptions(const AttendOptions& o) {
  const bool calibrated = !o.calibration.empty();
  KVQ_CHECK(calibrated == o.has_layer, kInvalidArgument,
            calibrated ? "--calibration needs --layer" : "--layer needs --calibration");
  KVQ_CHECK(!o.has_layer || o.layer >= 0, kInvalidArgument, "--layer ", o.layer, " is negative");
}

kvq::calib::Calibration ReadLayerCalibration(const AttendOptions& o) {
  kvq::calib::Calibration cal = kvq::calib::ReadCalibration(o.calibration);
  KVQ_CHECK(o.layer < static_cast<int>(cal.layers.size()), kInvalidArgument, "--layer ",
            o.layer, " is out of range: ", o.calibration, " holds ", cal.layers.size(),
            " layers");
  return cal;
}

void CheckCalibrationShape(const AttendOptions& o, const kvq::calib::Calibration& cal,
                           const Inputs& in) {
  KVQ_CHECK(cal.info.num_kv_heads == in.hkv && cal.info.head_dim == in.d, kShapeMismatch,
            "calibration ", o.calibration, " is for Hkv = ", cal.info.num_kv_heads,
            ", d = ", cal.info.head_dim, " but keys ", o.k, " have shape ", in.k.ShapeString());
}

// --scheme ID: the catalogue's scheme, then the flags given as overrides.
CacheSetup SchemeSetup(const AttendOptions& o, Inputs& in) {
  const kvq::calib::SchemeInfo& scheme = kvq::calib::SchemeByName(o.scheme);
  // Option errors before any file is read.
  CheckLayerOptions(o);
  const bool calibrated = !o.calibration.empty();
  KVQ_CHECK(calibrated || scheme.widths != kvq::calib::WidthsPolicy::kCalibration,
            kInvalidArgument, "--scheme ", o.scheme, " needs a calibration with the per-head "
            "block widths (layers.{l}.k_bits, with its R_K and R_V): give --calibration C "
            "--layer L, C a file of kvq calibrate --scheme ", o.scheme);
  KVQ_CHECK(calibrated || !scheme.needs_calibration, kInvalidArgument, "--scheme ", o.scheme,
            " needs a calibration: give --calibration C --layer L (a kvq calibrate file)");
  KVQ_CHECK(!o.protect || (!o.has_sink && !o.has_recent), kInvalidArgument,
            "--protected sets the windows (S0 = 4, W = 128): drop ",
            o.has_sink ? "--sink" : "--recent");
  const bool codebook = scheme.format_k == kvq::Format::kCodebook ||
                        scheme.format_v == kvq::Format::kCodebook;
  KVQ_CHECK(!(o.has_bits || o.has_k_bits) ||
                scheme.widths != kvq::calib::WidthsPolicy::kCalibration,
            kInvalidArgument, o.has_bits ? "--bits" : "--k-bits", " does not apply to the keys of "
            "--scheme ", o.scheme, ": their widths are the calibration's allocation (kvq "
            "calibrate --scheme ", o.scheme, " --k-bits B); --v-bits sets the values'");
  const bool dense = !o.rotation_k.empty() || !o.rotation_v.empty();
  const int rotations = (dense ? 1 : 0) + (o.hadamard ? 1 : 0) + (o.identity ? 1 : 0);
  KVQ_CHECK(rotations <= 1, kInvalidArgument,
            "give only one of --rotation-k/--rotation-v, --hadamard, --identity");
  KVQ_CHECK(!dense || (!o.rotation_k.empty() && !o.rotation_v.empty()), kInvalidArgument,
            "--rotation-k and --rotation-v go together (got only ",
            o.rotation_k.empty() ? "--rotation-v" : "--rotation-k", ")");
  CheckBitsOptions(o, codebook);
  KVQ_CHECK(scheme.quantized() || GivenWidth(o).empty(), kInvalidArgument, GivenWidth(o),
            " does not apply to --scheme ", o.scheme,
            ", which stores no codes (--scheme naive is INT-b without rotation)");
  const bool bf16 = !scheme.quantized() || o.format == "bf16";
  if (bf16) {
    const char* moot = rotations > 0 ? (dense ? "--rotation-k/--rotation-v"
                                              : (o.hadamard ? "--hadamard" : "--identity"))
                       : o.has_clip_k ? "--clip-k"
                       : o.has_clip_v ? "--clip-v"
                                      : nullptr;
    KVQ_CHECK(moot == nullptr, kInvalidArgument, moot,
              " has no effect on the bf16 cache (--scheme ", o.scheme,
              o.format == "bf16" ? " --format bf16" : "", ")");
    KVQ_CHECK(GivenWidth(o).empty(), kInvalidArgument, GivenWidth(o),
              " has no effect on the bf16 cache (--format bf16 stores no codes)");
  }
  const float clip_k = kvq::cli::ParseFloatOption("--clip-k", o.clip_k);
  const float clip_v = kvq::cli::ParseFloatOption("--clip-v", o.clip_v);
  kvq::calib::ParseNormScope(o.norm_scope);
  KVQ_CHECK(!o.has_norm_scope || scheme.norm != kvq::calib::SchemeNorm::kNone, kInvalidArgument,
            "--norm-scope applies to the schemes with a key norm (kivi_norm, ots), not --scheme ",
            o.scheme);
  KVQ_CHECK(!o.has_tile || scheme.format_k == kvq::Format::kAffineTile ||
                scheme.format_v == kvq::Format::kAffineTile,
            kInvalidArgument, "--tile applies to the schemes with tiled keys (kivi, "
            "kivi_hadamard, kivi_norm, ots), not --scheme ", o.scheme);

  std::unique_ptr<kvq::calib::Calibration> cal;
  if (calibrated) {
    cal = std::make_unique<kvq::calib::Calibration>(ReadLayerCalibration(o));
  }
  in = ReadInputs(o);
  if (cal) CheckCalibrationShape(o, *cal, in);

  // The scheme is built on the calibration's cache options (or the defaults); the flags given
  // come after it, so they also beat whatever a scheme of the catalogue fixes for itself.
  kvq::calib::SchemeOptions options;
  if (cal) {
    options.group = cal->info.group;
    options.bits = cal->info.bits;
    options.sink = cal->info.sink;
    options.recent = cal->info.recent;
    // Block-GTQ's values are TurboQuant-MSE at the b_v its calibration was made for.
    if (scheme.widths == kvq::calib::WidthsPolicy::kCalibration) options.v_bits = cal->info.v_bits;
  }
  options.seed = o.seed;
  options.saw_block = o.saw_block;
  options.protect = o.protect;
  options.tile = o.tile;
  options.norm_scope = kvq::calib::ParseNormScope(o.norm_scope);
  kvq::calib::SchemeShape shape;
  shape.num_layers = cal ? cal->info.num_layers : 1;
  shape.num_kv_heads = in.hkv;
  shape.num_q_heads = in.hq;
  shape.head_dim = in.d;
  CacheSetup s =
      kvq::calib::BuildLayerScheme(o.scheme, shape, cal.get(), cal ? o.layer : 0, options);
  kvq::CacheParams& p = s.params;
  // --group is the per-token sides' G (a tiled side's G_k comes from --tile).
  for (kvq::WriteParams* w : {&p.key, &p.value}) {
    if (o.has_group && w->format != kvq::Format::kAffineTile) w->group = o.group;
  }
  if (o.has_sink) p.sink = o.sink;
  if (o.has_recent) p.recent = o.recent;
  if (o.has_flush) p.flush = o.flush;
  if (o.has_page) p.page_size = o.page;
  if (bf16) {
    // The bf16 baseline cache: original rows only, nothing rotated or clipped.
    for (kvq::WriteParams* w : {&p.key, &p.value}) {
      w->format = kvq::Format::kBf16;
      w->rotation = kvq::RotationKind::kIdentity;
      w->hadamard_block = 0;
      w->bitrev = false;
      w->clip = 1.0f;
    }
    s = CacheSetup{p, {}, {}};
  } else {
    // The scheme's own bits unless --bits / --k-bits / --v-bits say otherwise (saw_int4 is INT4
    // by default).
    if (o.has_bits) p.key.bits = p.value.bits = o.bits;
    if (o.has_k_bits) p.key.bits = o.k_bits;
    if (o.has_v_bits) p.value.bits = o.v_bits;
    if (rotations == 1) {
      for (kvq::WriteParams* w : {&p.key, &p.value}) {
        w->rotation = dense ? kvq::RotationKind::kDense
                            : (o.hadamard ? kvq::RotationKind::kHadamard
                                          : kvq::RotationKind::kIdentity);
        w->hadamard_block = 0;
        w->bitrev = false;
      }
      s.key.rotation.clear();
      s.value.rotation.clear();
      if (dense) {
        s.key.rotation = ReadRotations(o.rotation_k, "key rotation", in.hkv, in.d);
        s.value.rotation = ReadRotations(o.rotation_v, "value rotation", in.hkv, in.d);
      }
    }
    if (o.has_clip_k) {
      p.key.clip = clip_k;
      s.key.clip.clear();
    }
    if (o.has_clip_v) {
      p.value.clip = clip_v;
      s.value.clip.clear();
    }
  }
  p.Validate();
  return s;
}

// No --scheme: the rotation flags (or a calibration's OSCAR layer) say everything.
CacheSetup FlagSetup(const AttendOptions& o, Inputs& in) {
  CheckLayerOptions(o);
  KVQ_CHECK(!o.protect, kInvalidArgument, "--protected needs --scheme (it sets a scheme's "
            "windows; without one give --sink 4 --recent 128)");
  KVQ_CHECK(!o.has_tile && !o.has_norm_scope, kInvalidArgument,
            o.has_tile ? "--tile" : "--norm-scope", " needs --scheme (kivi, kivi_hadamard, "
            "kivi_norm or ots)");
  const bool dense = !o.rotation_k.empty() || !o.rotation_v.empty();
  const int chosen = (dense ? 1 : 0) + (o.hadamard ? 1 : 0) + (o.identity ? 1 : 0);
  CheckBitsOptions(o);
  const bool quantized = o.format != "bf16";
  KVQ_CHECK(quantized || GivenWidth(o).empty(), kInvalidArgument, GivenWidth(o),
            " has no effect on the bf16 cache (--format bf16 stores no codes)");
  KVQ_CHECK(chosen <= 1, kInvalidArgument,
            "give only one of --rotation-k/--rotation-v, --hadamard, --identity");
  KVQ_CHECK(chosen == 1 || !quantized, kInvalidArgument,
            "a quantized cache needs one of --scheme, --rotation-k/--rotation-v, --hadamard, "
            "--identity (or --format bf16 for the bf16 cache)");
  KVQ_CHECK(!dense || (!o.rotation_k.empty() && !o.rotation_v.empty()), kInvalidArgument,
            "--rotation-k and --rotation-v go together (got only ",
            o.rotation_k.empty() ? "--rotation-v" : "--rotation-k", ")");
  const float clip_k = kvq::cli::ParseFloatOption("--clip-k", o.clip_k);
  const float clip_v = kvq::cli::ParseFloatOption("--clip-v", o.clip_v);

  in = ReadInputs(o);
  CacheSetup s;
  kvq::CacheParams& p = s.params;
  p.num_q_heads = in.hq;
  p.num_kv_heads = in.hkv;
  p.sink = o.sink;
  p.recent = o.recent;
  p.flush = o.flush;
  p.page_size = o.page;
  if (!quantized) p.key.format = p.value.format = kvq::Format::kBf16;
  for (kvq::WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = in.d;
    w->group = o.group;
    w->bits = o.bits;  // (the bf16 cache writes no codes)
    w->rotation = dense ? kvq::RotationKind::kDense
                        : (o.hadamard ? kvq::RotationKind::kHadamard
                                      : kvq::RotationKind::kIdentity);
  }
  if (o.has_k_bits) p.key.bits = o.k_bits;
  if (o.has_v_bits) p.value.bits = o.v_bits;
  p.key.clip = clip_k;
  p.value.clip = clip_v;
  p.Validate();
  if (quantized && dense) {
    s.key.rotation = ReadRotations(o.rotation_k, "key rotation", p.num_kv_heads, in.d);
    s.value.rotation = ReadRotations(o.rotation_v, "value rotation", p.num_kv_heads, in.d);
  }
  return s;
}

void RunAttend(const AttendOptions& given) {
  AttendOptions o = given;
  if (o.scheme.empty() && !o.calibration.empty()) {
    // --calibration C --layer L alone: the calibration's OSCAR layer, as it always was.
    KVQ_CHECK(o.rotation_k.empty() && o.rotation_v.empty() && !o.hadamard && !o.identity,
              kInvalidArgument,
              "--calibration replaces --rotation-k/--rotation-v, --hadamard and --identity "
              "(with --scheme ID they are overrides)");
    KVQ_CHECK(!o.has_clip_k && !o.has_clip_v, kInvalidArgument,
              "--calibration supplies per-head clip ratios; drop --clip-k/--clip-v (with "
              "--scheme ID they are overrides)");
    o.scheme = "oscar";
  }
  // Option errors before any input is read (the backend name included).
  const kvq::cpu::Backend& backend =
      o.backend.empty() ? kvq::cpu::BestBackend() : kvq::cpu::BackendByName(o.backend);
  Inputs in;
  const CacheSetup s = o.scheme.empty() ? FlagSetup(o, in) : SchemeSetup(o, in);

  kvq::cpu::PagedKVCache cache(s.params, std::move(s.key), std::move(s.value), backend);
  const int seq = cache.AddSequence();
  const std::vector<float> kf = in.k.ToF32(), vf = in.v.ToF32(), qf = in.q.ToF32();
  cache.Prefill(seq, kf.data(), vf.data(), static_cast<size_t>(in.tokens));
  std::vector<float> out(qf.size());
  kvq::cpu::Attend(backend, cache, seq, qf.data(), out.data());
  kvq::WriteNpy(o.out, kvq::cli::F32Tensor(out, static_cast<size_t>(in.hq),
                                           static_cast<size_t>(in.d)));
}

std::string SchemeHelp() {
  std::string text = "a scheme of the catalogue (* needs --calibration C --layer L):";
  for (const kvq::calib::SchemeInfo& s : kvq::calib::Schemes()) {
    text += std::string("\n  ") + s.name + (s.needs_calibration ? "*" : "") + ": " +
            s.description;
  }
  return text;
}

}  // namespace

void setup_attend(CLI::App& app) {
  auto o = std::make_shared<AttendOptions>();
  CLI::App* command = app.add_subcommand(
      "attend", "decode attention of one query over a paged cache (sink | history | recent)");
  command->add_option("--q", o->q, "query Q: float32 [Hq, d] .npy")->required();
  command->add_option("--k", o->k, "keys K: float32 [T, Hkv, d] .npy (stored as bf16)")
      ->required();
  command->add_option("--v", o->v, "values V: float32 [T, Hkv, d] .npy (stored as bf16)")
      ->required();
  command->add_option("--out", o->out, "output O: float32 [Hq, d] .npy")
      ->required()
      ->check(kvq::cli::OutputFile());
  command->add_option("--scheme", o->scheme, SchemeHelp());
  command->add_option("--rotation-k", o->rotation_k, "key rotation: float32 [d, d] or [Hkv, d, d]");
  command->add_option("--rotation-v", o->rotation_v,
                      "value rotation: float32 [d, d] or [Hkv, d, d]");
  command->add_flag("--hadamard", o->hadamard, "rotate K and V by the normalised FWHT");
  command->add_flag("--identity", o->identity, "no rotation");
  command->add_option("--calibration", o->calibration,
                      "a `kvq calibrate` file: per-head R_K, R_V and clip ratios of --layer");
  CLI::Option* layer =
      command->add_option("--layer", o->layer, "the calibration layer to use (with --calibration)");
  CLI::Option* clip_k =
      command->add_option("--clip-k", o->clip_k, "key clip ratio in (0, 1] (default 1: no clip)");
  CLI::Option* clip_v =
      command->add_option("--clip-v", o->clip_v, "value clip ratio in (0, 1] (default 1)");
  CLI::Option* bits =
      command->add_option("--bits", o->bits, "history bits of K and V: 2 or 4 (fp8: 8)")
          ->capture_default_str();
  CLI::Option* k_bits =
      command->add_option("--k-bits", o->k_bits, "history bits of K alone (beats --bits)");
  CLI::Option* v_bits =
      command->add_option("--v-bits", o->v_bits, "history bits of V alone (beats --bits)");
  command->add_option("--format", o->format,
                      "bf16: the bf16 baseline cache, nothing quantized (the quantized formats "
                      "come with --scheme or the rotation flags)");
  CLI::Option* group = command->add_option("--group", o->group, "channels per (scale, min) group")
                           ->capture_default_str();
  CLI::Option* sink =
      command->add_option("--sink", o->sink, "bf16 sink tokens S0")
          ->capture_default_str()
          ->check(kvq::cli::WindowTokens());
  CLI::Option* recent =
      command->add_option("--recent", o->recent, "bf16 recent window W (0: none)")
          ->capture_default_str()
          ->check(kvq::cli::WindowTokens());
  CLI::Option* flush =
      command->add_option("--flush", o->flush, "history flush granularity F (tokens)")
          ->capture_default_str();
  CLI::Option* page =
      command->add_option("--page", o->page, "history tokens per page P")->capture_default_str();
  CLI::Option* tile = command->add_option("--tile", o->tile,
                                          "tokens per tile G_k of a tiled side (with --scheme: "
                                          "kivi, kivi_hadamard, kivi_norm, ots)")
                          ->capture_default_str();
  CLI::Option* norm_scope =
      command->add_option("--norm-scope", o->norm_scope,
                          "the key norm's scope, head or token (with --scheme kivi_norm, ots)")
          ->capture_default_str();
  command->add_option("--seed", o->seed, "random_orthogonal's seed (with --scheme)")
      ->capture_default_str()
      ->check(kvq::cli::Seed());
  command->add_option("--saw-block", o->saw_block,
                      "the SAW schemes' FWHT block (with --scheme; clamped to d)")
      ->capture_default_str();
  command->add_flag("--protected", o->protect,
                    "with --scheme: the protected windows of seeds/004 App. D, S0 = 4 bf16 sink "
                    "and W = 128 bf16 recent tokens (the codebook schemes have none by default)");
  command->add_option("--backend", o->backend,
                      "CPU backend (scalar, hwy_avx3, ...; default: the best one)");
  command->callback([=] {
    o->has_layer = layer->count() > 0;
    o->has_clip_k = clip_k->count() > 0;
    o->has_clip_v = clip_v->count() > 0;
    o->has_bits = bits->count() > 0;
    o->has_k_bits = k_bits->count() > 0;
    o->has_v_bits = v_bits->count() > 0;
    o->has_group = group->count() > 0;
    o->has_sink = sink->count() > 0;
    o->has_recent = recent->count() > 0;
    o->has_flush = flush->count() > 0;
    o->has_page = page->count() > 0;
    o->has_tile = tile->count() > 0;
    o->has_norm_scope = norm_scope->count() > 0;
    RunAttend(*o);
  });
}
