// kvq attend --q Q.npy --k K.npy --v V.npy
//            (--rotation-k RK.npy --rotation-v RV.npy | --hadamard | --identity |
//             --calibration C.safetensors --layer L)
//            [--clip-k RHO] [--clip-v RHO] [--bits B] [--group G] [--sink S0] [--recent W]
//            [--page P] [--backend NAME] --out O.npy
// One decode step of one sequence: the T rows of K and V (float32 [T, Hkv, d], rounded to
// bf16 as the cache stores them) go into an OSCAR paged cache (bf16 sink | INT-b history |
// bf16 recent), and O = attention(Q) over it, Q and O float32 [Hq, d], scale 1/sqrt(d).
// RK, RV: float32 [d, d] (shared by the KV heads) or [Hkv, d, d]. --bits 16: the bf16
// baseline cache (rotation options then optional and unused). --calibration C --layer L takes
// layer L's per-KV-head R_K, R_V and clip ratios from a `kvq calibrate` file, and its group,
// bits, sink and recent unless those options are given.
#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/params.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace {

struct AttendOptions {
  std::string q, k, v, out;
  std::string rotation_k, rotation_v;
  bool hadamard = false;
  bool identity = false;
  std::string clip_k = "1", clip_v = "1";
  int bits = 2;
  int group = 64;
  int sink = 64;
  int recent = 256;
  int page = 64;
  std::string backend;
  std::string calibration;  // --calibration: a kvq calibrate file
  int layer = 0;            // --layer: which of its layers
  // Whether each of these was given on the command line (the calibration supplies defaults).
  bool has_layer = false, has_clip = false, has_bits = false, has_group = false, has_sink = false,
       has_recent = false;
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
  if (t.shape == per_head) return values;
  std::vector<float> all;
  for (int h = 0; h < hkv; ++h) all.insert(all.end(), values.begin(), values.end());
  return all;
}

void RunAttend(const AttendOptions& given) {
  AttendOptions o = given;
  // Option errors before any file is read, except the calibration's own, which needs it read.
  const bool calibrated = !o.calibration.empty();
  KVQ_CHECK(calibrated == o.has_layer, kInvalidArgument,
            calibrated ? "--calibration needs --layer" : "--layer needs --calibration");
  KVQ_CHECK(!o.has_layer || o.layer >= 0, kInvalidArgument, "--layer ", o.layer, " is negative");
  kvq::calib::Calibration cal;
  if (calibrated) {
    KVQ_CHECK(o.rotation_k.empty() && o.rotation_v.empty() && !o.hadamard && !o.identity,
              kInvalidArgument,
              "--calibration replaces --rotation-k/--rotation-v, --hadamard and --identity");
    KVQ_CHECK(!o.has_clip, kInvalidArgument,
              "--calibration supplies per-head clip ratios; drop --clip-k/--clip-v");
    cal = kvq::calib::ReadCalibration(o.calibration);
    KVQ_CHECK(o.layer < static_cast<int>(cal.layers.size()), kInvalidArgument, "--layer ",
              o.layer, " is out of range: ", o.calibration, " holds ", cal.layers.size(),
              " layers");
    if (!o.has_bits) o.bits = cal.info.bits;
    if (!o.has_group) o.group = cal.info.group;
    if (!o.has_sink) o.sink = cal.info.sink;
    if (!o.has_recent) o.recent = cal.info.recent;
  }
  const bool dense = calibrated || !o.rotation_k.empty() || !o.rotation_v.empty();
  const int chosen = (dense ? 1 : 0) + (o.hadamard ? 1 : 0) + (o.identity ? 1 : 0);
  KVQ_CHECK(o.bits == 2 || o.bits == 4 || o.bits == 16, kInvalidArgument, "--bits ", o.bits,
            " is not supported (2, 4, or 16 for the bf16 cache)");
  const bool quantized = o.bits != 16;
  KVQ_CHECK(chosen <= 1, kInvalidArgument,
            "give only one of --rotation-k/--rotation-v, --hadamard, --identity");
  KVQ_CHECK(chosen == 1 || !quantized, kInvalidArgument,
            "--bits ", o.bits, " needs one of --rotation-k/--rotation-v, --hadamard, --identity");
  KVQ_CHECK(calibrated || !dense || (!o.rotation_k.empty() && !o.rotation_v.empty()),
            kInvalidArgument,
            "--rotation-k and --rotation-v go together (got only ",
            o.rotation_k.empty() ? "--rotation-v" : "--rotation-k", ")");
  const float clip_k = kvq::cli::ParseFloatOption("--clip-k", o.clip_k);
  const float clip_v = kvq::cli::ParseFloatOption("--clip-v", o.clip_v);
  const kvq::cpu::Backend& backend =
      o.backend.empty() ? kvq::cpu::BestBackend() : kvq::cpu::BackendByName(o.backend);

  const kvq::Tensor q = ReadFloatTensor(o.q, 2, "query");
  const kvq::Tensor k = ReadFloatTensor(o.k, 3, "keys");
  const kvq::Tensor v = ReadFloatTensor(o.v, 3, "values");
  KVQ_CHECK(k.shape == v.shape, kShapeMismatch, "keys ", o.k, " have shape ", k.ShapeString(),
            " but values ", o.v, " have shape ", v.ShapeString());
  const int64_t tokens = k.shape[0];
  KVQ_CHECK(tokens >= 1, kShapeMismatch, "keys ", o.k, " hold no token (shape ",
            k.ShapeString(), ")");
  KVQ_CHECK(q.shape[1] == k.shape[2], kShapeMismatch, "query ", o.q, " has head_dim ",
            q.shape[1], " but keys ", o.k, " have head_dim ", k.shape[2]);
  KVQ_CHECK(k.shape[1] >= 1 && k.shape[1] <= 4096 && q.shape[0] >= 1 && q.shape[0] <= 4096 &&
                k.shape[2] <= 4096,
            kShapeMismatch, "head counts or head_dim out of range: query ", q.ShapeString(),
            ", keys ", k.ShapeString());

  kvq::CacheParams p;
  p.num_q_heads = static_cast<int>(q.shape[0]);
  p.num_kv_heads = static_cast<int>(k.shape[1]);
  p.sink = o.sink;
  p.recent = o.recent;
  p.page_size = o.page;
  if (!quantized) p.key.format = p.value.format = kvq::Format::kBf16;
  const int d = static_cast<int>(k.shape[2]);
  for (kvq::WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = d;
    w->group = o.group;
    w->bits = quantized ? o.bits : 2;  // the bf16 cache writes no codes
    w->rotation = dense ? kvq::RotationKind::kDense
                        : (o.hadamard ? kvq::RotationKind::kHadamard
                                      : kvq::RotationKind::kIdentity);
  }
  p.key.clip = clip_k;
  p.value.clip = clip_v;
  p.Validate();

  std::vector<float> rk, rv, clip_k_heads, clip_v_heads;
  if (calibrated) {
    KVQ_CHECK(cal.info.num_kv_heads == p.num_kv_heads && cal.info.head_dim == d, kShapeMismatch,
              "calibration ", o.calibration, " is for Hkv = ", cal.info.num_kv_heads,
              ", d = ", cal.info.head_dim, " but keys ", o.k, " have shape ", k.ShapeString());
    const kvq::calib::LayerCalibration& layer = cal.layers[static_cast<size_t>(o.layer)];
    if (quantized) {
      rk = layer.k_rotation;
      rv = layer.v_rotation;
      clip_k_heads = layer.k_clip;
      clip_v_heads = layer.v_clip;
    }
  } else if (quantized && dense) {
    rk = ReadRotations(o.rotation_k, "key rotation", p.num_kv_heads, d);
    rv = ReadRotations(o.rotation_v, "value rotation", p.num_kv_heads, d);
  }
  kvq::cpu::PagedKVCache cache(p, rk, rv, clip_k_heads, clip_v_heads, backend);
  const int seq = cache.AddSequence();
  const std::vector<float> kf = k.ToF32(), vf = v.ToF32(), qf = q.ToF32();
  cache.Prefill(seq, kf.data(), vf.data(), static_cast<size_t>(tokens));
  std::vector<float> out(qf.size());
  kvq::cpu::Attend(backend, cache, seq, qf.data(), out.data());
  kvq::WriteNpy(o.out, kvq::cli::F32Tensor(out, static_cast<size_t>(p.num_q_heads),
                                           static_cast<size_t>(d)));
}

}  // namespace

void setup_attend(CLI::App& app) {
  auto o = std::make_shared<AttendOptions>();
  CLI::App* command = app.add_subcommand(
      "attend", "decode attention of one query over an OSCAR paged cache (sink | INT-b | recent)");
  command->add_option("--q", o->q, "query Q: float32 [Hq, d] .npy")->required();
  command->add_option("--k", o->k, "keys K: float32 [T, Hkv, d] .npy (stored as bf16)")
      ->required();
  command->add_option("--v", o->v, "values V: float32 [T, Hkv, d] .npy (stored as bf16)")
      ->required();
  command->add_option("--out", o->out, "output O: float32 [Hq, d] .npy")->required();
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
      command->add_option("--bits", o->bits, "history bits: 2, 4, or 16 for the bf16 cache")
          ->capture_default_str();
  CLI::Option* group = command->add_option("--group", o->group, "channels per (scale, min) group")
                           ->capture_default_str();
  CLI::Option* sink =
      command->add_option("--sink", o->sink, "bf16 sink tokens S0")->capture_default_str();
  CLI::Option* recent =
      command->add_option("--recent", o->recent, "bf16 recent window W")->capture_default_str();
  command->add_option("--page", o->page, "history tokens per page P")->capture_default_str();
  command->add_option("--backend", o->backend,
                      "CPU backend (scalar, hwy_avx3, ...; default: the best one)");
  command->callback([=] {
    o->has_layer = layer->count() > 0;
    o->has_clip = clip_k->count() + clip_v->count() > 0;
    o->has_bits = bits->count() > 0;
    o->has_group = group->count() > 0;
    o->has_sink = sink->count() > 0;
    o->has_recent = recent->count() > 0;
    RunAttend(*o);
  });
}
