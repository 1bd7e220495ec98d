// Golden-vector cases of the write path: one family per WriteKernels stage (called directly)
// and the whole QuantizeRows pipeline over the spec's parameter grid. Expected values are the
// scalar backend's outputs.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params_builder.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"
#include "generator_internal.h"
#include "kvq/conformance/rows.h"

namespace kvq::conformance::internal {
namespace {

constexpr int kHeadDims[] = {64, 128, 256};
constexpr int kGroups[] = {32, 64, 128};
constexpr int kBits[] = {2, 4};
constexpr float kGridClips[] = {1.0f, 0.96f, 0.92f};

int64_t I(size_t v) { return static_cast<int64_t>(v); }

// The rotation variants of the pipeline grid and the edge cases.
struct RotationVariant {
  const char* name;
  RotationKind kind;
  int block;
  bool bitrev;
};
constexpr RotationVariant kGridRotations[] = {
    {"identity", RotationKind::kIdentity, 0, false},
    {"dense", RotationKind::kDense, 0, false},
    {"hadamard", RotationKind::kHadamard, 0, false},
    {"hadamard_bitrev", RotationKind::kHadamard, 0, true},
};
// Every edge row goes through these (the grid's dense and hadamard_bitrev are close cousins).
constexpr RotationVariant kEdgeRotations[] = {
    {"identity", RotationKind::kIdentity, 0, false},
    {"dense_bitrev", RotationKind::kDense, 0, true},
    {"hadamard", RotationKind::kHadamard, 0, false},
    {"hadamard_h16", RotationKind::kHadamard, 16, false},
};

// The stage case's metadata: which stage, its parameters, the rows.
void SetStage(Safetensors* file, const std::string& stage, const WriteParams& p, size_t rows,
              const std::string& row_kinds) {
  file->metadata["stage"] = stage;
  PutWriteParams(p, "", &file->metadata);
  file->metadata["rows"] = std::to_string(rows);
  file->metadata["row_kinds"] = row_kinds;
}

// A new stage case `name` of `stage` whose input is one row of each of `kinds`, drawn from the
// case's own generator; the rows go to *x.
Safetensors NewRowsStageCase(VectorCollector* out, const std::string& name,
                             const std::string& stage, const WriteParams& p,
                             const std::vector<RowKind>& kinds, std::vector<float>* x,
                             const char* spec_version = "1.0") {
  SplitMix64 rng(0);
  Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, spec_version);
  std::string names;
  *x = MakeRows(kinds, p, &rng, &names);
  SetStage(&file, stage, p, kinds.size(), names);
  return file;
}

// The stage case `name` of `quantize` (affine_token) over rows of `kinds`: the rows and the
// scalar oracle's codes, scales and mins.
void AddQuantizeCase(VectorCollector* out, const cpu::Backend& scalar, const std::string& name,
                     const WriteParams& p, const std::vector<RowKind>& kinds) {
  std::vector<float> x;
  Safetensors file = NewRowsStageCase(out, name, "quantize", p, kinds, &x);
  const size_t n = kinds.size(), d = static_cast<size_t>(p.head_dim);
  const size_t groups = static_cast<size_t>(p.num_groups());
  std::vector<uint8_t> codes(n * d);
  std::vector<uint16_t> scale(n * groups), min(n * groups);
  scalar.write.quantize(x.data(), codes.data(), scale.data(), min.data(), n, p);
  file.Add("in.x", Tensor::F32({I(n), I(d)}, x));
  file.Add("expect.codes", Tensor::U8({I(n), I(d)}, codes));
  file.Add("expect.scale", Tensor::BF16({I(n), I(groups)}, scale));
  file.Add("expect.min", Tensor::BF16({I(n), I(groups)}, min));
  out->AddCase(name, CaseKind::kStage, file);
}

// ---- rotate_dense, fwht, bitrev ----
void AddRotationStages(VectorCollector* out, const cpu::Backend& scalar) {
  for (int d : kHeadDims) {
    const std::string name = "stage/rotate_dense_d" + std::to_string(d);
    const WriteParams p =
        params::Write().head_dim(d).group(32).bits(2).rotation(RotationKind::kDense);
    const std::vector<RowKind> kinds = {RowKind::kRandom,    RowKind::kHeavyTail,
                                        RowKind::kOutlier,   RowKind::kSubnormal,
                                        RowKind::kHuge,      RowKind::kMixedZeros};
    std::vector<float> x;
    Safetensors file = NewRowsStageCase(out, name, "rotate_dense", p, kinds, &x);
    out->UseRotations(&file, d, "in.rotation_index", {0});
    const std::vector<float> r = GatherRotations(file, out->fixtures(), "in.rotation_index", d);
    std::vector<float> y(x.size());
    scalar.write.rotate_dense(x.data(), r.data(), y.data(), kinds.size(), p);
    file.Add("in.x", Tensor::F32({I(kinds.size()), d}, x));
    file.Add("expect.y", Tensor::F32({I(kinds.size()), d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
  const std::pair<int, int> fwht_sizes[] = {{64, 0},   {128, 0},  {256, 0},  {64, 16},
                                            {128, 16}, {128, 32}, {256, 64}, {256, 128}};
  for (const auto& [d, block] : fwht_sizes) {
    const std::string name = "stage/fwht_d" + std::to_string(d) + "_h" +
                             std::to_string(block == 0 ? d : block);
    const WriteParams p = params::Write().head_dim(d).group(32).bits(2).hadamard(block);
    const std::vector<RowKind> kinds = {RowKind::kRandom,  RowKind::kHeavyTail,
                                        RowKind::kConstant, RowKind::kOutlier,
                                        RowKind::kSubnormal, RowKind::kHuge};
    std::vector<float> x;
    Safetensors file = NewRowsStageCase(out, name, "fwht", p, kinds, &x);
    std::vector<float> y = x;
    scalar.write.fwht(y.data(), kinds.size(), p);
    file.Add("in.x", Tensor::F32({I(kinds.size()), d}, x));
    file.Add("expect.y", Tensor::F32({I(kinds.size()), d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
  for (int d : kHeadDims) {
    const std::string name = "stage/bitrev_d" + std::to_string(d);
    const WriteParams p = params::Write().head_dim(d).group(32).bits(2).bitrev();
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.0");
    // Two ramps (each output value names its source channel) and two random rows.
    const size_t rows = 4;
    std::vector<float> x(rows * d);
    for (int j = 0; j < d; ++j) {
      x[j] = static_cast<float>(j + 1);
      x[d + j] = -static_cast<float>(1000 + j);
    }
    FillRow(RowKind::kRandom, p, &rng, x.data() + 2 * d);
    FillRow(RowKind::kMixedZeros, p, &rng, x.data() + 3 * d);
    SetStage(&file, "bitrev", p, rows, "ramp,ramp,random,mixed_zeros");
    std::vector<float> y(x.size());
    scalar.write.bitrev(x.data(), y.data(), rows, p);
    file.Add("in.x", Tensor::F32({I(rows), d}, x));
    file.Add("expect.y", Tensor::F32({I(rows), d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
}

// ---- clip ----
void AddClipStages(VectorCollector* out, const cpu::Backend& scalar) {
  // The grid's ratios and the minimum (k = 0) at every d; at d = 64 also an exact floor
  // (0.96875 * 64 = 62) and the median.
  const std::vector<RowKind> kinds = {
      RowKind::kRandom,        RowKind::kHeavyTail,  RowKind::kDuplicates, RowKind::kOutlier,
      RowKind::kNegativeZeros, RowKind::kMixedZeros, RowKind::kSubnormal,  RowKind::kHuge};
  for (int d : kHeadDims) {
    std::vector<float> clips = {1.0f, 0.92f, 0.001f};
    if (d != 256) clips.push_back(0.96f);
    if (d == 64) clips.insert(clips.end(), {0.96875f, 0.5f});
    for (float rho : clips) {
      const std::string name = "stage/clip_d" + std::to_string(d) + "_" + RhoTag(rho);
      const WriteParams p = params::Write().head_dim(d).group(32).bits(2).clip(rho);
      std::vector<float> x;
      Safetensors file = NewRowsStageCase(out, name, "clip", p, kinds, &x);
      std::vector<float> y = x;
      std::vector<float> tau(kinds.size());
      scalar.write.clip(y.data(), tau.data(), kinds.size(), p);
      file.Add("in.x", Tensor::F32({I(kinds.size()), d}, x));
      file.Add("expect.x", Tensor::F32({I(kinds.size()), d}, y));
      file.Add("expect.tau", Tensor::F32({I(kinds.size())}, tau));
      out->AddCase(name, CaseKind::kStage, file);
    }
  }
}

// ---- quantize, dequantize ----
void AddQuantizerStages(VectorCollector* out, const cpu::Backend& scalar) {
  for (int d : kHeadDims) {
    for (int g : kGroups) {
      if (g > d) continue;
      for (int b : kBits) {
        const WriteParams p = params::Write().head_dim(d).group(g).bits(b);
        const std::string suffix =
            "_d" + std::to_string(d) + "_g" + std::to_string(g) + "_b" + std::to_string(b);
        const size_t groups = static_cast<size_t>(p.num_groups());
        // Every row kind; at d = 256 the edge rows only (the pipeline grid has random rows).
        AddQuantizeCase(out, scalar, "stage/quantize" + suffix, p,
                        d == 256 ? EdgeRowKinds() : AllRowKinds());
        {
          const std::string name = "stage/dequantize" + suffix;
          SplitMix64 rng(0);
          Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.0");
          const size_t n = 4;
          std::vector<uint8_t> codes(n * d);
          for (uint8_t& c : codes) c = static_cast<uint8_t>(rng.Below(p.levels() + 1));
          // Scales: zero, normal, bf16 subnormal, large; minimums of both signs (and -0).
          std::vector<uint16_t> scale(n * groups), min(n * groups);
          // One draw per statement: the order of calls inside an expression is unspecified.
          auto bf16_bits = [&rng](uint32_t sign, uint32_t first_exponent, uint32_t exponents) {
            const uint32_t exponent = first_exponent + rng.Below(exponents);
            const uint32_t mantissa = rng.Below(128);
            return static_cast<uint16_t>(sign | (exponent << 7) | mantissa);
          };
          for (size_t i = 0; i < n * groups; ++i) {
            switch (rng.Below(4)) {
              case 0:
                scale[i] = 0;
                break;
              case 1:
                scale[i] = bf16_bits(0, 107, 40);  // 2^-20 .. 2^19
                break;
              case 2:
                scale[i] = static_cast<uint16_t>(1 + rng.Below(127));  // subnormal
                break;
              default:
                scale[i] = bf16_bits(0, 200, 20);  // 2^73 .. 2^92
            }
            const uint32_t sign = rng.Bit() ? 0x8000u : 0u;
            const bool zero = rng.Below(8) == 0;
            min[i] = zero ? static_cast<uint16_t>(sign) : bf16_bits(sign, 107, 40);
          }
          SetStage(&file, "dequantize", p, n, "random_codes,scales_zero_normal_subnormal_large");
          std::vector<float> y(n * d);
          scalar.write.dequantize(codes.data(), scale.data(), min.data(), y.data(), n, p);
          file.Add("in.codes", Tensor::U8({I(n), d}, codes));
          file.Add("in.scale", Tensor::BF16({I(n), I(groups)}, scale));
          file.Add("in.min", Tensor::BF16({I(n), I(groups)}, min));
          file.Add("expect.y", Tensor::F32({I(n), d}, y));
          out->AddCase(name, CaseKind::kStage, file);
        }
      }
    }
  }
}

// ---- pack, unpack: every byte value, then one random row ----
void AddPackingStages(VectorCollector* out, const cpu::Backend& scalar) {
  for (int d : kHeadDims) {
    for (int b : kBits) {
      const WriteParams p = params::Write().head_dim(d).group(32).bits(b);
      const size_t cb = static_cast<size_t>(p.packed_bytes());
      const size_t enumerating = (256 + cb - 1) / cb;
      const size_t n = enumerating + 1;
      const std::string suffix = "_d" + std::to_string(d) + "_b" + std::to_string(b);
      for (const char* stage : {"pack", "unpack"}) {
        const std::string name = std::string("stage/") + stage + suffix;
        SplitMix64 rng(0);
        Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.0");
        std::vector<uint8_t> packed(n * cb);
        for (size_t i = 0; i < enumerating * cb; ++i) packed[i] = static_cast<uint8_t>(i % 256);
        for (size_t i = enumerating * cb; i < n * cb; ++i) {
          packed[i] = static_cast<uint8_t>(rng.Below(256));
        }
        std::vector<uint8_t> codes(n * d);
        scalar.write.unpack(packed.data(), codes.data(), n, p);
        SetStage(&file, stage, p, n, "every_byte_value,random");
        if (std::string(stage) == "pack") {
          std::vector<uint8_t> repacked(n * cb);
          scalar.write.pack(codes.data(), repacked.data(), n, p);
          file.Add("in.codes", Tensor::U8({I(n), d}, codes));
          file.Add("expect.packed", Tensor::U8({I(n), I(cb)}, repacked));
        } else {
          file.Add("in.packed", Tensor::U8({I(n), I(cb)}, packed));
          file.Add("expect.codes", Tensor::U8({I(n), d}, codes));
        }
        out->AddCase(name, CaseKind::kStage, file);
      }
    }
  }
}

// ---- the whole write path ----
void AddPipelineCase(VectorCollector* out, const cpu::Backend& scalar, const std::string& name,
                     const WriteParams& p, const std::vector<RowKind>& kinds, int rotation_index,
                     bool constant_last_tile = false) {
  SplitMix64 rng(0);
  Safetensors file = out->NewCase(name, CaseKind::kPipeline, &rng, SpecVersionOf(p));
  std::string names;
  std::vector<float> x = MakeRows(kinds, p, &rng, &names);
  const size_t n = kinds.size();
  if (constant_last_tile) {  // every row of the last tile repeats its first: constant channels
    const size_t tile = static_cast<size_t>(p.tile_tokens()), dd = static_cast<size_t>(p.head_dim);
    for (size_t r = n - tile + 1; r < n; ++r) {
      std::copy(x.begin() + (n - tile) * dd, x.begin() + (n - tile + 1) * dd, x.begin() + r * dd);
    }
    names += ",last_tile_constant_along_tokens";
  }
  const int d = p.head_dim;
  PutWriteParams(p, "", &file.metadata);
  file.metadata["rows"] = std::to_string(n);
  file.metadata["row_kinds"] = names;
  std::vector<float> rotation;
  if (p.rotation == RotationKind::kDense) {
    out->UseRotations(&file, d, "in.rotation_index", {rotation_index});
    rotation = GatherRotations(file, out->fixtures(), "in.rotation_index", d);
  }
  const cpu::QuantizedRows q =
      cpu::QuantizeRows(scalar, p, rotation.empty() ? nullptr : rotation.data(), x.data(), n);
  file.Add("in.x", Tensor::F32({I(n), d}, x));
  for (auto& [field, tensor] : q.Tensors(p)) file.Add("expect." + field, std::move(tensor));
  out->AddCase(name, CaseKind::kPipeline, file);
}

// ---- spec 1.1: norm, denorm and the affine_tile codec ----

// A random finite bf16: zero now and then, subnormals, normal values from 2^-20 to 2^92.
uint16_t RandomBf16(SplitMix64* rng, bool non_negative) {
  const uint32_t sign = non_negative || rng->Bit() == 0 ? 0u : 0x8000u;
  switch (rng->Below(6)) {
    case 0: return static_cast<uint16_t>(sign);
    case 1: return static_cast<uint16_t>(sign | (1 + rng->Below(127)));  // subnormal
    case 2: {
      const uint32_t exponent = 200 + rng->Below(20);  // 2^73 .. 2^92
      return static_cast<uint16_t>(sign | (exponent << 7) | rng->Below(128));
    }
    default: {
      const uint32_t exponent = 107 + rng->Below(40);  // 2^-20 .. 2^19
      return static_cast<uint16_t>(sign | (exponent << 7) | rng->Below(128));
    }
  }
}

void AddNormStages(VectorCollector* out, const cpu::Backend& scalar) {
  // Every row kind: the zero rows (n^ = 0), subnormals whose squares underflow, huge rows whose
  // squares overflow (n^ = +Inf, the stage is total; the write path rejects it).
  const std::vector<RowKind> kinds = {
      RowKind::kRandom,   RowKind::kHeavyTail, RowKind::kZeros,    RowKind::kNegativeZeros,
      RowKind::kConstant, RowKind::kOutlier,   RowKind::kSubnormal, RowKind::kHuge,
      RowKind::kDuplicates};
  for (int d : kHeadDims) {
    for (int heads : {1, 3}) {
      if (d == 256 && heads == 3) continue;
      const WriteParams p = params::Write().head_dim(d).tile(32).norm().norm_heads(heads);
      const std::string name =
          "stage/norm_d" + std::to_string(d) + "_heads" + std::to_string(heads);
      SplitMix64 rng(0);
      Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.1");
      // Span r is `heads` rows of kind r laid end to end.
      std::vector<RowKind> rows;
      for (RowKind k : kinds) rows.insert(rows.end(), static_cast<size_t>(heads), k);
      std::string names;
      const std::vector<float> x = MakeRows(rows, p, &rng, &names);
      const size_t n = kinds.size();
      SetStage(&file, "norm", p, n, names);
      std::vector<float> y = x;
      std::vector<uint16_t> norm(n);
      scalar.write.norm(y.data(), norm.data(), n, p);
      file.Add("in.x", Tensor::F32({I(n), p.norm_span()}, x));
      file.Add("expect.x", Tensor::F32({I(n), p.norm_span()}, y));
      file.Add("expect.norm", Tensor::BF16({I(n)}, norm));
      out->AddCase(name, CaseKind::kStage, file);
    }
  }
  for (int d : {64, 256}) {
    const WriteParams p = params::Write().head_dim(d).tile(32).norm();
    const std::string name = "stage/denorm_d" + std::to_string(d);
    const std::vector<RowKind> kinds = {RowKind::kRandom, RowKind::kHeavyTail,
                                        RowKind::kSubnormal, RowKind::kMixedZeros,
                                        RowKind::kOutlier, RowKind::kRandom};
    std::vector<float> y;
    Safetensors file = NewRowsStageCase(out, name, "denorm", p, kinds, &y, "1.1");
    SplitMix64 rng(CaseSeed(out->seed(), name + "/norms"));
    std::vector<uint16_t> norm(kinds.size());
    for (uint16_t& v : norm) v = RandomBf16(&rng, true);
    std::vector<float> got = y;
    scalar.write.denorm(got.data(), norm.data(), kinds.size(), p);
    file.Add("in.y", Tensor::F32({I(kinds.size()), d}, y));
    file.Add("in.norm", Tensor::BF16({I(kinds.size())}, norm));
    file.Add("expect.y", Tensor::F32({I(kinds.size()), d}, got));
    out->AddCase(name, CaseKind::kStage, file);
  }
}

void AddTileStages(VectorCollector* out, const cpu::Backend& scalar) {
  struct Shape {
    int d, gk, bits;
  };
  // quantize_tile: rows cycle through every row kind the vectors draw; a second tile at
  // G_k = 32 repeats one row (every channel constant: scale 0, codes 0).
  const Shape quantize[] = {{64, 32, 2},  {64, 32, 4},  {64, 64, 2},  {64, 128, 4},
                            {128, 32, 2}, {128, 64, 4}, {256, 32, 4}};
  for (const Shape& sh : quantize) {
    const WriteParams p = params::Write().head_dim(sh.d).tile(sh.gk).bits(sh.bits);
    const std::string suffix = "_d" + std::to_string(sh.d) + "_gk" + std::to_string(sh.gk) +
                               "_b" + std::to_string(sh.bits);
    const size_t tiles = sh.gk == 32 && sh.d <= 128 ? 2 : 1;
    const size_t n = tiles * static_cast<size_t>(sh.gk);
    std::vector<RowKind> kinds;
    for (size_t r = 0; r < n; ++r) kinds.push_back(AllRowKinds()[r % AllRowKinds().size()]);
    const std::string name = "stage/quantize_tile" + suffix;
    std::vector<float> x;
    Safetensors file = NewRowsStageCase(out, name, "quantize_tile", p, kinds, &x, "1.1");
    if (tiles == 2) {
      const size_t dd = static_cast<size_t>(sh.d), first = static_cast<size_t>(sh.gk);
      for (size_t r = first + 1; r < n; ++r) {
        std::copy(x.begin() + first * dd, x.begin() + (first + 1) * dd, x.begin() + r * dd);
      }
      file.metadata["row_kinds"] += ",tile1_constant_along_tokens";
    }
    std::vector<uint8_t> codes(n * sh.d);
    std::vector<uint16_t> scale(tiles * sh.d), min(tiles * sh.d);
    scalar.write.quantize_tile(x.data(), codes.data(), scale.data(), min.data(), n, p);
    file.Add("in.x", Tensor::F32({I(n), sh.d}, x));
    file.Add("expect.codes", Tensor::U8({I(n), sh.d}, codes));
    file.Add("expect.scale", Tensor::BF16({I(tiles), sh.d}, scale));
    file.Add("expect.min", Tensor::BF16({I(tiles), sh.d}, min));
    out->AddCase(name, CaseKind::kStage, file);
  }
  // pack_tile / unpack_tile: every byte value of the packed tiles, then random bytes.
  const Shape packing[] = {{64, 32, 2}, {64, 32, 4}, {64, 64, 2}, {64, 128, 4}, {256, 32, 2}};
  for (const Shape& sh : packing) {
    const WriteParams p = params::Write().head_dim(sh.d).tile(sh.gk).bits(sh.bits);
    const std::string suffix = "_d" + std::to_string(sh.d) + "_gk" + std::to_string(sh.gk) +
                               "_b" + std::to_string(sh.bits);
    const size_t n = static_cast<size_t>(sh.gk);
    const size_t bytes = n * static_cast<size_t>(sh.d * sh.bits / 8);
    for (const char* stage : {"pack_tile", "unpack_tile"}) {
      const std::string name = std::string("stage/") + stage + suffix;
      SplitMix64 rng(0);
      Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.1");
      std::vector<uint8_t> packed(bytes);
      for (size_t i = 0; i < bytes; ++i) {
        packed[i] = i < 256 ? static_cast<uint8_t>(i) : static_cast<uint8_t>(rng.Below(256));
      }
      std::vector<uint8_t> codes(n * sh.d);
      scalar.write.unpack_tile(packed.data(), codes.data(), n, p);
      SetStage(&file, stage, p, n, "every_byte_value,random");
      const std::vector<int64_t> packed_shape = ArgShape(Extent::kTilePacked, I(n), p);
      if (std::string(stage) == "pack_tile") {
        std::vector<uint8_t> repacked(bytes);
        scalar.write.pack_tile(codes.data(), repacked.data(), n, p);
        file.Add("in.codes", Tensor::U8({I(n), sh.d}, codes));
        file.Add("expect.packed", Tensor::U8(packed_shape, repacked));
      } else {
        file.Add("in.packed", Tensor::U8(packed_shape, packed));
        file.Add("expect.codes", Tensor::U8({I(n), sh.d}, codes));
      }
      out->AddCase(name, CaseKind::kStage, file);
    }
  }
  // dequantize_tile: random codes, zero / normal / subnormal / large scales, mins of both signs.
  const Shape dequantize[] = {{64, 32, 2}, {64, 64, 4}, {256, 32, 4}};
  for (const Shape& sh : dequantize) {
    const WriteParams p = params::Write().head_dim(sh.d).tile(sh.gk).bits(sh.bits);
    const std::string name = "stage/dequantize_tile_d" + std::to_string(sh.d) + "_gk" +
                             std::to_string(sh.gk) + "_b" + std::to_string(sh.bits);
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.1");
    const size_t tiles = sh.d <= 128 ? 2 : 1, n = tiles * static_cast<size_t>(sh.gk);
    std::vector<uint8_t> codes(n * sh.d);
    for (uint8_t& c : codes) c = static_cast<uint8_t>(rng.Below(p.levels() + 1));
    std::vector<uint16_t> scale(tiles * sh.d), min(tiles * sh.d);
    for (size_t i = 0; i < scale.size(); ++i) {
      scale[i] = RandomBf16(&rng, true);
      min[i] = RandomBf16(&rng, false);
    }
    SetStage(&file, "dequantize_tile", p, n, "random_codes,scales_zero_normal_subnormal_large");
    std::vector<float> y(n * sh.d);
    scalar.write.dequantize_tile(codes.data(), scale.data(), min.data(), y.data(), n, p);
    file.Add("in.codes", Tensor::U8({I(n), sh.d}, codes));
    file.Add("in.scale", Tensor::BF16({I(tiles), sh.d}, scale));
    file.Add("in.min", Tensor::BF16({I(tiles), sh.d}, min));
    file.Add("expect.y", Tensor::F32({I(n), sh.d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
}

// The write paths of spec 1.1, one tile of rows each: KIVI (tiles, no rotation), OScaR (FWHT,
// norm, tiles), the edges through a tile, dense + P_br + clip + norm, and SAW-INT4's one group
// per row (G = d, d = 256 included).
void AddSpec11Pipelines(VectorCollector* out, const cpu::Backend& scalar) {
  struct Case {
    const char* name;
    params::Write p;
    bool constant_last_tile;
  };
  const params::Write w;
  const Case cases[] = {
      {"tile_d64_gk32_b2_identity", params::Write(w).head_dim(64).tile(32), true},
      {"tile_d128_gk32_b2_identity", params::Write(w).head_dim(128).tile(32), false},
      {"tile_d64_gk32_b2_hadamard_norm", params::Write(w).head_dim(64).tile(32).hadamard().norm(),
       true},
      {"tile_d128_gk32_b2_hadamard_norm",
       params::Write(w).head_dim(128).tile(32).hadamard().norm(), false},
      {"tile_d256_gk32_b2_hadamard_norm",
       params::Write(w).head_dim(256).tile(32).hadamard().norm(), false},
      {"tile_d64_gk64_b4_dense_bitrev_norm_rho0p92",
       params::Write(w).head_dim(64).tile(64).bits(4).rotation(RotationKind::kDense).bitrev()
           .clip(0.92f).norm(),
       false},
      {"tile_d64_gk64_b2_hadamard_h16", params::Write(w).head_dim(64).tile(64).hadamard(16),
       false},
      {"tile_d64_gk32_b4_identity_norm", params::Write(w).head_dim(64).tile(32).bits(4).norm(),
       true},
      {"group_d_d128_b4_hadamard", params::Write(w).head_dim(128).group(128).bits(4).hadamard(),
       false},
      {"group_d_d256_b4_hadamard_h128",
       params::Write(w).head_dim(256).group(256).bits(4).hadamard(128), false},
      {"group_d_d256_b2_identity", params::Write(w).head_dim(256).group(256).bits(2), false},
  };
  for (const Case& c : cases) {
    const WriteParams p = c.p.Build();
    const size_t n = static_cast<size_t>(p.format == Format::kAffineTile ? p.tile_tokens() : 6);
    // Edge rows in turn through the tile (norms cannot take huge rows: their squares overflow).
    std::vector<RowKind> kinds;
    const std::vector<RowKind>& all = AllRowKinds();
    for (size_t r = 0; r < n; ++r) {
      RowKind k = all[r % all.size()];
      if (p.norm && k == RowKind::kHuge) k = RowKind::kHeavyTail;
      kinds.push_back(k);
    }
    AddPipelineCase(out, scalar, std::string("pipeline/") + c.name, p, kinds, 0,
                    c.constant_last_tile);
  }
}

// ---- spec 1.2: fp8_e4m3 ----

std::string ScaleTag(float s) {
  std::string tag = ShortestFloat(s);
  for (char& c : tag) {
    if (c == '.') c = 'p';
    if (c == '-') c = 'm';
  }
  return tag;
}

// quantize_fp8 over every conversion boundary (times s = 1 and s = 2^-7, so x / s lands on the
// boundaries exactly), then over every row kind with scales that are not powers of two (small
// enough that huge rows saturate); dequantize_fp8 over every non-NaN code.
void AddFp8Stages(VectorCollector* out, const cpu::Backend& scalar) {
  const std::vector<float> boundaries = Fp8BoundaryValues();
  for (const auto& [d, s] : {std::pair<int, float>{64, 1.0f}, {128, 0.0078125f}}) {
    const WriteParams p = params::Write().head_dim(d).fp8(s);
    const std::string name = "stage/quantize_fp8_d" + std::to_string(d) + "_s" + ScaleTag(s) +
                             "_boundaries";
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.2");
    const size_t n = (boundaries.size() + static_cast<size_t>(d) - 1) / static_cast<size_t>(d);
    std::vector<float> x(n * static_cast<size_t>(d), 0.0f);
    for (size_t i = 0; i < boundaries.size(); ++i) x[i] = boundaries[i] * s;
    SetStage(&file, "quantize_fp8", p, n, "fp8_boundaries_times_s,zero_padding");
    std::vector<uint8_t> codes(x.size());
    scalar.write.quantize_fp8(x.data(), codes.data(), n, p);
    file.Add("in.x", Tensor::F32({I(n), d}, x));
    file.Add("expect.codes", Tensor::U8({I(n), d}, codes));
    out->AddCase(name, CaseKind::kStage, file);
  }
  for (const auto& [d, s] : {std::pair<int, float>{64, 0.0123f}, {128, 3.5f}, {256, 1e-3f}}) {
    const WriteParams p = params::Write().head_dim(d).fp8(s);
    const std::string name = "stage/quantize_fp8_d" + std::to_string(d) + "_s" + ScaleTag(s);
    std::vector<float> x;
    Safetensors file = NewRowsStageCase(out, name, "quantize_fp8", p, AllRowKinds(), &x, "1.2");
    const size_t n = AllRowKinds().size();
    std::vector<uint8_t> codes(x.size());
    scalar.write.quantize_fp8(x.data(), codes.data(), n, p);
    file.Add("in.x", Tensor::F32({I(n), d}, x));
    file.Add("expect.codes", Tensor::U8({I(n), d}, codes));
    out->AddCase(name, CaseKind::kStage, file);
  }
  for (const auto& [d, s] : {std::pair<int, float>{64, 1.0f}, {128, 0.0123f}, {256, 37.5f}}) {
    const WriteParams p = params::Write().head_dim(d).fp8(s);
    const std::string name = "stage/dequantize_fp8_d" + std::to_string(d) + "_s" + ScaleTag(s);
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.2");
    // The 254 non-NaN codes in order, then random ones, to whole rows.
    const size_t n = (254 + static_cast<size_t>(d) - 1) / static_cast<size_t>(d) + 1;
    std::vector<uint8_t> codes(n * static_cast<size_t>(d));
    for (size_t i = 0; i < codes.size(); ++i) {
      const uint32_t c = i < 254 ? static_cast<uint32_t>(i) : rng.Below(254);
      codes[i] = static_cast<uint8_t>(c < 0x7f ? c : c + 1);
    }
    SetStage(&file, "dequantize_fp8", p, n, "every_non_nan_code,random");
    std::vector<float> y(codes.size());
    scalar.write.dequantize_fp8(codes.data(), y.data(), n, p);
    file.Add("in.codes", Tensor::U8({I(n), d}, codes));
    file.Add("expect.y", Tensor::F32({I(n), d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
}

// The fp8 write path: every row kind through identity, FWHT (whole and blocks), FWHT + P_br
// and a dense rotation, at scales that are and are not powers of two.
void AddFp8Pipelines(VectorCollector* out, const cpu::Backend& scalar) {
  struct Case {
    int d;
    float s;
    RotationVariant rotation;
  };
  const Case cases[] = {
      {64, 1.0f, kGridRotations[0]},      {64, 0.0123f, kGridRotations[2]},
      {128, 0.0045f, kGridRotations[0]},  {128, 0.0625f, kGridRotations[3]},
      {128, 0.021f, kGridRotations[1]},   {256, 0.5f, kEdgeRotations[3]},
      {256, 3.0e-3f, kGridRotations[2]},
  };
  size_t index = 0;
  for (const Case& c : cases) {
    const WriteParams p = params::Write().head_dim(c.d).fp8(c.s).rotation(c.rotation.kind)
                              .hadamard_block(c.rotation.block).bitrev(c.rotation.bitrev);
    const std::string name = "pipeline/fp8_d" + std::to_string(c.d) + "_s" + ScaleTag(c.s) +
                             "_" + c.rotation.name;
    AddPipelineCase(out, scalar, name, p, AllRowKinds(),
                    static_cast<int>(index++ % out->FixtureMatrices(c.d)));
  }
}

// ---- added with spec 1.2's set: offset channels and ranges past fp16 ----
// Groups the older cases lack (shared/research/outside_kivi.md §4.4): a large offset with a
// small spread, where m^ = bf16(lo) lies code steps away from lo, and ranges past 65504, where
// an fp16 scale overflows. Their rules are 1.0's (affine_token) and 1.1's (affine_tile), so
// they carry those labels (spec/formats.md §6); their names are new, so no older file changes.
const std::vector<RowKind> kOffsetRangeRows = {
    RowKind::kRandom,         RowKind::kOffsetChannels,    RowKind::kOffsetChannels,
    RowKind::kOffsetChannels, RowKind::kOffsetChannels,    RowKind::kFp16OverflowRange,
    RowKind::kFp16OverflowRange};

void AddOffsetRangeStages(VectorCollector* out, const cpu::Backend& scalar) {
  for (const auto& [d, g, b] : {std::tuple<int, int, int>{64, 32, 2}, {128, 128, 4}}) {
    AddQuantizeCase(out, scalar,
                    "stage/quantize_offset_range_d" + std::to_string(d) + "_g" +
                        std::to_string(g) + "_b" + std::to_string(b),
                    params::Write().head_dim(d).group(g).bits(b), kOffsetRangeRows);
  }
  // One tile of offset channels (each channel keeps its offset over the tile's tokens).
  const WriteParams p = params::Write().head_dim(64).tile(32).bits(4);
  const std::string name = "stage/quantize_tile_offset_d64_gk32_b4";
  const size_t n = 32, d = 64;
  const std::vector<RowKind> kinds(n, RowKind::kOffsetChannels);
  std::vector<float> x;
  Safetensors file = NewRowsStageCase(out, name, "quantize_tile", p, kinds, &x, "1.1");
  std::vector<uint8_t> codes(n * d);
  std::vector<uint16_t> scale(d), min(d);
  scalar.write.quantize_tile(x.data(), codes.data(), scale.data(), min.data(), n, p);
  file.Add("in.x", Tensor::F32({I(n), I(d)}, x));
  file.Add("expect.codes", Tensor::U8({I(n), I(d)}, codes));
  file.Add("expect.scale", Tensor::BF16({1, I(d)}, scale));
  file.Add("expect.min", Tensor::BF16({1, I(d)}, min));
  out->AddCase(name, CaseKind::kStage, file);
}

// The same groups through the whole write path, identity rotation (a rotation would spread
// an offset over every channel): per-token groups at G < d and G = d (OSCAR's G = d = 128,
// KIVI's value groups), with and without a binding clip; tiles of offset channels, then a
// tile whose channels span both signs of +-[2^15, 65504).
void AddOffsetRangePipelines(VectorCollector* out, const cpu::Backend& scalar) {
  struct TokenCase {
    int d, g, b;
    float rho;
  };
  const TokenCase token_cases[] = {
      {64, 32, 2, 1.0f}, {64, 32, 4, 0.92f}, {128, 128, 2, 0.96f}, {128, 128, 4, 1.0f}};
  for (const TokenCase& c : token_cases) {
    const WriteParams p = params::Write().head_dim(c.d).group(c.g).bits(c.b).clip(c.rho);
    const std::string name = "pipeline/offset_range_d" + std::to_string(c.d) + "_g" +
                             std::to_string(c.g) + "_b" + std::to_string(c.b) + "_" +
                             RhoTag(c.rho) + "_identity";
    AddPipelineCase(out, scalar, name, p, kOffsetRangeRows, 0);
  }
  std::vector<RowKind> two_tiles(32, RowKind::kOffsetChannels);
  two_tiles.insert(two_tiles.end(), 32, RowKind::kFp16OverflowRange);
  AddPipelineCase(out, scalar, "pipeline/tile_offset_range_d64_gk32_b2_identity",
                  params::Write().head_dim(64).tile(32).bits(2).Build(), two_tiles, 0);
  AddPipelineCase(out, scalar, "pipeline/tile_offset_d64_gk32_b4_identity",
                  params::Write().head_dim(64).tile(32).bits(4).Build(),
                  std::vector<RowKind>(32, RowKind::kOffsetChannels), 0);
}

}  // namespace


void AddStageCases(VectorCollector* out) {
  const cpu::Backend& scalar = cpu::ScalarBackend();
  AddRotationStages(out, scalar);
  AddClipStages(out, scalar);
  AddQuantizerStages(out, scalar);
  AddPackingStages(out, scalar);
  AddNormStages(out, scalar);
  AddTileStages(out, scalar);
  AddFp8Stages(out, scalar);
  AddOffsetRangeStages(out, scalar);
}

void AddPipelineCases(VectorCollector* out) {
  const cpu::Backend& scalar = cpu::ScalarBackend();
  // The grid: d x G x bits x rho x rotation. Few rows per case, to keep the set small: one
  // random row (uniform or heavy-tailed in turn) and edge rows taken in turn from the edge
  // list (two at d = 64 and 128, one at d = 256), so every edge kind meets many
  // configurations.
  const std::vector<RowKind>& edges = EdgeRowKinds();
  size_t index = 0, next_edge = 0;
  for (int d : kHeadDims) {
    const int edge_rows = d == 256 ? 1 : 2;
    for (int g : kGroups) {
      if (g > d) continue;
      for (int b : kBits) {
        for (float rho : kGridClips) {
          for (const RotationVariant& rot : kGridRotations) {
            const WriteParams p = params::Write().head_dim(d).group(g).bits(b).clip(rho)
                                      .rotation(rot.kind).hadamard_block(rot.block).bitrev(rot.bitrev);
            const std::string name = "pipeline/d" + std::to_string(d) + "_g" + std::to_string(g) +
                                     "_b" + std::to_string(b) + "_" + RhoTag(rho) + "_" +
                                     rot.name;
            std::vector<RowKind> kinds = {index % 2 == 0 ? RowKind::kRandom
                                                         : RowKind::kHeavyTail};
            for (int e = 0; e < edge_rows; ++e) {
              kinds.push_back(edges[next_edge++ % edges.size()]);
            }
            AddPipelineCase(out, scalar, name, p, kinds,
                            static_cast<int>(index % out->FixtureMatrices(d)));
            ++index;
          }
        }
      }
    }
  }
  // Every edge row through every rotation variant at the smallest size.
  for (int b : kBits) {
    for (float rho : {1.0f, 0.92f}) {
      for (const RotationVariant& rot : kEdgeRotations) {
        const WriteParams p = params::Write().head_dim(64).group(32).bits(b).clip(rho)
                                  .rotation(rot.kind).hadamard_block(rot.block).bitrev(rot.bitrev);
        const std::string name = "pipeline/edges_d64_g32_b" + std::to_string(b) + "_" +
                                 RhoTag(rho) + "_" + rot.name;
        AddPipelineCase(out, scalar, name, p, AllRowKinds(), 1);
      }
    }
  }
  AddSpec11Pipelines(out, scalar);
  AddFp8Pipelines(out, scalar);
  // Block-diagonal Hadamard (SAW-INT4 style).
  struct Block {
    int d, g, b;
    float rho;
    int block;
    bool bitrev;
  };
  const Block blocks[] = {{128, 32, 4, 1.0f, 16, false},   {128, 32, 4, 1.0f, 32, false},
                          {128, 32, 4, 0.96f, 64, false},  {256, 128, 4, 0.96f, 32, false},
                          {256, 64, 2, 0.92f, 128, true}};
  const std::vector<RowKind> block_kinds = {RowKind::kRandom, RowKind::kHeavyTail,
                                            RowKind::kOutlier, RowKind::kTies};
  for (const Block& bl : blocks) {
    const WriteParams p =
        params::Write().head_dim(bl.d).group(bl.g).bits(bl.b).clip(bl.rho).hadamard(bl.block)
            .bitrev(bl.bitrev);
    const std::string name = "pipeline/block_d" + std::to_string(bl.d) + "_g" +
                             std::to_string(bl.g) + "_b" + std::to_string(bl.b) + "_" +
                             RhoTag(bl.rho) + "_h" + std::to_string(bl.block) +
                             (bl.bitrev ? "_bitrev" : "");
    AddPipelineCase(out, scalar, name, p, block_kinds, 0);
  }
  AddOffsetRangePipelines(out, scalar);
}

}  // namespace kvq::conformance::internal
