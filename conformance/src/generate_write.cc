// Golden-vector cases of the write path: one family per WriteKernels stage (called directly)
// and the whole QuantizeRows pipeline over the spec's parameter grid. Expected values are the
// scalar backend's outputs.
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params_builder.h"
#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"
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
// `widths`: a codebook head's block widths (spec 1.3), stored as in.widths; null for none.
void AddPipelineCase(VectorCollector* out, const cpu::Backend& scalar, const std::string& name,
                     const WriteParams& p, const std::vector<RowKind>& kinds, int rotation_index,
                     bool constant_last_tile = false,
                     const std::vector<uint8_t>* widths = nullptr) {
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
  HeadArrays head;
  if (p.rotation == RotationKind::kDense) {
    out->UseRotations(&file, d, "in.rotation_index", {rotation_index});
    rotation = GatherRotations(file, out->fixtures(), "in.rotation_index", d);
    head.rotation = rotation.data();
  }
  if (widths != nullptr) head.widths = widths->data();
  const cpu::QuantizedRows q = cpu::QuantizeRows(scalar, p, head, x.data(), n);
  file.Add("in.x", Tensor::F32({I(n), d}, x));
  if (widths != nullptr) file.Add("in.widths", Tensor::U8({d / 2}, *widths));
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


// ---- spec 1.3: the codebook format (TurboQuant-MSE, Block-GTQ) ----

// Block widths in the shape of a Block-GTQ allocation: most blocks at 2..4 bits, a few at every
// other width, so the row has segments of every width 1..8 and of sizes m = 2 (one block), 6
// (padded to 8 in the tree), and m = 2 mod 4 at width 2 (split-quarter padding).
std::vector<uint8_t> AllocationWidths(int d, SplitMix64* rng) {
  const size_t blocks = static_cast<size_t>(d / 2);
  std::vector<uint8_t> widths(blocks);
  for (uint8_t& w : widths) w = static_cast<uint8_t>(2 + rng->Below(3));
  // Then, at distinct blocks from the start of a shuffled order: one block at 8, three at 1,
  // one at 7, two at 6, one at 5.
  std::vector<size_t> order(blocks);
  for (size_t i = 0; i < blocks; ++i) order[i] = i;
  for (size_t i = blocks - 1; i > 0; --i) std::swap(order[i], order[rng->Below(static_cast<uint32_t>(i + 1))]);
  const uint8_t rare[] = {8, 1, 1, 1, 7, 6, 6, 5};
  size_t next = 0;
  for (uint8_t w : rare) widths[order[next++]] = w;
  size_t twos = 0;
  for (uint8_t w : widths) twos += w == 2 ? 1 : 0;
  // An odd count of width-2 blocks: m = 2 mod 4 at width 2 (a padded split-quarter byte).
  for (; twos % 2 == 0 && next < blocks; ++next) {
    if (widths[order[next]] != 2) {
      widths[order[next]] = 2;
      ++twos;
    }
  }
  return widths;
}

// Codebook params of d at b bits whose row limits are exactly the layout of `widths` (or, with
// slack, segments 8 and code_bytes d: unused slots and bytes hold zeros).
WriteParams CodebookParams(int d, int bits, const std::vector<uint8_t>* widths, bool slack = false,
                           CodebookDensity density = CodebookDensity::kBeta) {
  params::Write w = params::Write().head_dim(d).codebook_rows(bits).codebook(density);
  if (slack) {
    w.segments(8).code_bytes(d);
  } else if (widths != nullptr) {
    const CodebookLayout layout = CodebookLayoutOf(d, widths->data());
    w.segments(layout.count).code_bytes(layout.code_bytes);
  }
  return w.Build();
}

std::vector<uint8_t> UniformWidths(const WriteParams& p) {
  return std::vector<uint8_t>(static_cast<size_t>(p.head_dim / 2), static_cast<uint8_t>(p.bits));
}

// "_b3", or "_blockgtq" for per-head widths, then "_gaussian" for that density.
std::string CodebookTag(const WriteParams& p, bool per_head) {
  std::string tag = "_d" + std::to_string(p.head_dim) +
                    (per_head ? std::string("_blockgtq") : "_b" + std::to_string(p.bits));
  if (p.codebook == CodebookDensity::kGaussian) tag += "_gaussian";
  return tag;
}

// A unit value of a segment's table: in turn a boundary, the fp32 values either side of it,
// +-0, a centroid, and +-1 (the ends of the unit range), so every tie of the encoder occurs.
float TableProbe(const tables::CodebookTable& t, SplitMix64* rng) {
  const float boundary = t.boundaries[rng->Below(static_cast<uint32_t>(t.levels - 1))];
  switch (rng->Below(8)) {
    case 0:
    case 1: return boundary;
    case 2: return std::nextafter(boundary, 2.0f);
    case 3: return std::nextafter(boundary, -2.0f);
    case 4: return rng->Bit() ? 0.0f : -0.0f;
    case 5: return t.centroids[rng->Below(static_cast<uint32_t>(t.levels))];
    case 6: return rng->Bit() ? 1.0f : -1.0f;
    default: return rng->Uniform();
  }
}

// Non-negative bf16 norms: zero, subnormal, normal from 2^-20 to 2^19, and large (2^73..).
uint16_t RandomNormBf16(SplitMix64* rng) {
  switch (rng->Below(6)) {
    case 0: return 0;
    case 1: return static_cast<uint16_t>(1 + rng->Below(127));
    case 2: return static_cast<uint16_t>(((200 + rng->Below(20)) << 7) | rng->Below(128));
    default: return static_cast<uint16_t>(((107 + rng->Below(40)) << 7) | rng->Below(128));
  }
}

void AddCodebookStages(VectorCollector* out, const cpu::Backend& scalar) {
  // segment_norm: zero and underflowing segments (n^ = 0, u = +0), subnormals, a huge row
  // (squares overflow: n^ = +Inf, u = +-0; the write path rejects it), random rows.
  const std::vector<RowKind> norm_kinds = {RowKind::kRandom, RowKind::kHeavyTail,
                                           RowKind::kZeros, RowKind::kMixedZeros,
                                           RowKind::kSubnormal, RowKind::kOutlier,
                                           RowKind::kHuge};
  for (const auto& [d, per_head] : {std::pair<int, bool>{64, false}, {128, true}}) {
    SplitMix64 widths_rng(CaseSeed(out->seed(), "codebook_widths_d" + std::to_string(d)));
    const std::vector<uint8_t> allocation = AllocationWidths(d, &widths_rng);
    const WriteParams p = CodebookParams(d, 3, per_head ? &allocation : nullptr);
    const std::vector<uint8_t> widths = per_head ? allocation : UniformWidths(p);
    const std::string name = "stage/segment_norm" + CodebookTag(p, per_head);
    std::vector<float> x;
    Safetensors file = NewRowsStageCase(out, name, "segment_norm", p, norm_kinds, &x, "1.3");
    const size_t n = norm_kinds.size(), dd = static_cast<size_t>(d);
    std::vector<float> unit(n * dd);
    std::vector<uint16_t> norms(n * static_cast<size_t>(p.segments));
    scalar.write.segment_norm(x.data(), widths.data(), unit.data(), norms.data(), n, p);
    file.Add("in.x", Tensor::F32({I(n), d}, x));
    file.Add("in.widths", Tensor::U8({d / 2}, widths));
    file.Add("expect.unit", Tensor::F32({I(n), d}, unit));
    file.Add("expect.segment_norm", Tensor::BF16({I(n), p.segments}, norms));
    out->AddCase(name, CaseKind::kStage, file);
  }
  // quantize_codebook: unit values on and beside every segment's boundaries, +-0, centroids,
  // +-1; segment norms zero, subnormal, normal and large.
  struct Quantize {
    int d, bits;
    bool per_head;
    CodebookDensity density;
  };
  const Quantize quantize[] = {{64, 1, false, CodebookDensity::kBeta},
                               {64, 3, false, CodebookDensity::kGaussian},
                               {64, 8, false, CodebookDensity::kBeta},
                               {128, 3, true, CodebookDensity::kBeta}};
  for (const Quantize& c : quantize) {
    SplitMix64 widths_rng(CaseSeed(out->seed(), "codebook_widths_d" + std::to_string(c.d)));
    const std::vector<uint8_t> allocation = AllocationWidths(c.d, &widths_rng);
    const WriteParams p = CodebookParams(c.d, c.bits, c.per_head ? &allocation : nullptr, false,
                                         c.density);
    const std::vector<uint8_t> widths = c.per_head ? allocation : UniformWidths(p);
    const std::string name = "stage/quantize_codebook" + CodebookTag(p, c.per_head);
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.3");
    const size_t n = 4, dd = static_cast<size_t>(c.d), slots = static_cast<size_t>(p.segments);
    const CodebookLayout layout = CodebookLayoutOf(c.d, widths.data());
    std::vector<float> unit(n * dd);
    std::vector<uint16_t> norms(n * slots);
    for (size_t r = 0; r < n; ++r) {
      for (int s = 0; s < layout.count; ++s) {
        const CodebookSegment& seg = layout.segment[s];
        const tables::CodebookTable t = tables::Codebook(seg.values, seg.width, p.codebook);
        for (int j = 0; j < seg.values; ++j) {
          unit[r * dd + static_cast<size_t>(seg.offset + j)] = TableProbe(t, &rng);
        }
        norms[r * slots + static_cast<size_t>(s)] = RandomNormBf16(&rng);
      }
    }
    SetStage(&file, "quantize_codebook", p, n, "table_boundaries_and_neighbours,norms_zero_"
             "subnormal_normal_large");
    std::vector<uint8_t> codes(n * dd);
    std::vector<uint16_t> corrected(n * slots);
    scalar.write.quantize_codebook(unit.data(), widths.data(), norms.data(), codes.data(),
                                   corrected.data(), n, p);
    file.Add("in.unit", Tensor::F32({I(n), c.d}, unit));
    file.Add("in.widths", Tensor::U8({c.d / 2}, widths));
    file.Add("in.segment_norm", Tensor::BF16({I(n), p.segments}, norms));
    file.Add("expect.codes", Tensor::U8({I(n), c.d}, codes));
    file.Add("expect.norm", Tensor::BF16({I(n), p.segments}, corrected));
    out->AddCase(name, CaseKind::kStage, file);
  }
  // pack_codebook / unpack_codebook: a uniform row of each width 1..8 over every byte value,
  // then one random row; and the Block-GTQ layout (every width, padded segments) with slack
  // (zeros past its segments).
  for (int bits = 1; bits <= 9; ++bits) {
    const bool per_head = bits == 9;
    SplitMix64 widths_rng(CaseSeed(out->seed(), "codebook_widths_d128"));
    const std::vector<uint8_t> allocation = AllocationWidths(128, &widths_rng);
    const WriteParams p = per_head ? CodebookParams(128, 3, &allocation, true)
                                   : CodebookParams(64, bits, nullptr);
    const std::vector<uint8_t> widths = per_head ? allocation : UniformWidths(p);
    const size_t d = static_cast<size_t>(p.head_dim);
    const size_t cb = static_cast<size_t>(p.row_code_bytes());
    const size_t used = static_cast<size_t>(CodebookLayoutOf(p.head_dim, widths.data()).code_bytes);
    const size_t enumerating = (256 + used - 1) / used;
    const size_t n = enumerating + 1;
    for (const char* stage : {"pack_codebook", "unpack_codebook"}) {
      const std::string name = std::string("stage/") + stage + CodebookTag(p, per_head);
      SplitMix64 rng(0);
      Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.3");
      std::vector<uint8_t> packed(n * cb, 0);
      size_t value = 0;
      for (size_t r = 0; r < n; ++r) {
        for (size_t i = 0; i < used; ++i) {
          packed[r * cb + i] = static_cast<uint8_t>(r < enumerating ? value++ % 256
                                                                    : rng.Below(256));
        }
      }
      std::vector<uint8_t> codes(n * d);
      scalar.write.unpack_codebook(packed.data(), widths.data(), codes.data(), n, p);
      SetStage(&file, stage, p, n, "every_byte_value,random");
      file.Add("in.widths", Tensor::U8({I(d / 2)}, widths));
      if (std::string(stage) == "pack_codebook") {
        std::vector<uint8_t> repacked(n * cb);
        scalar.write.pack_codebook(codes.data(), widths.data(), repacked.data(), n, p);
        file.Add("in.codes", Tensor::U8({I(n), I(d)}, codes));
        file.Add("expect.packed", Tensor::U8({I(n), I(cb)}, repacked));
      } else {
        file.Add("in.packed", Tensor::U8({I(n), I(cb)}, packed));
        file.Add("expect.codes", Tensor::U8({I(n), I(d)}, codes));
      }
      out->AddCase(name, CaseKind::kStage, file);
    }
  }
  // dequantize_codebook: random codes of each segment's width, corrected norms zero,
  // subnormal, normal and large.
  for (const auto& [d, bits, per_head] :
       {std::tuple<int, int, bool>{64, 4, false}, {128, 3, true}}) {
    SplitMix64 widths_rng(CaseSeed(out->seed(), "codebook_widths_d" + std::to_string(d)));
    const std::vector<uint8_t> allocation = AllocationWidths(d, &widths_rng);
    const WriteParams p = CodebookParams(d, bits, per_head ? &allocation : nullptr);
    const std::vector<uint8_t> widths = per_head ? allocation : UniformWidths(p);
    const std::string name = "stage/dequantize_codebook" + CodebookTag(p, per_head);
    SplitMix64 rng(0);
    Safetensors file = out->NewCase(name, CaseKind::kStage, &rng, "1.3");
    const size_t n = 4, dd = static_cast<size_t>(d), slots = static_cast<size_t>(p.segments);
    const CodebookLayout layout = CodebookLayoutOf(d, widths.data());
    std::vector<uint8_t> codes(n * dd);
    std::vector<uint16_t> norms(n * slots);
    for (size_t r = 0; r < n; ++r) {
      for (int s = 0; s < layout.count; ++s) {
        const CodebookSegment& seg = layout.segment[s];
        for (int j = 0; j < seg.values; ++j) {
          codes[r * dd + static_cast<size_t>(seg.offset + j)] =
              static_cast<uint8_t>(rng.Below(1u << seg.width));
        }
        norms[r * slots + static_cast<size_t>(s)] = RandomNormBf16(&rng);
      }
    }
    SetStage(&file, "dequantize_codebook", p, n, "random_codes,norms_zero_subnormal_normal_large");
    std::vector<float> y(n * dd);
    scalar.write.dequantize_codebook(codes.data(), widths.data(), norms.data(), y.data(), n, p);
    file.Add("in.codes", Tensor::U8({I(n), d}, codes));
    file.Add("in.widths", Tensor::U8({d / 2}, widths));
    file.Add("in.norm", Tensor::BF16({I(n), p.segments}, norms));
    file.Add("expect.y", Tensor::F32({I(n), d}, y));
    out->AddCase(name, CaseKind::kStage, file);
  }
}

// The codebook write path: TurboQuant-MSE rows (one segment) at widths 1..8 through identity,
// dense, FWHT and FWHT + P_br, the Gaussian density, and Block-GTQ heads (per-head widths,
// tight and slack row limits). Edge rows in turn; huge rows are left out (their segment norms
// overflow, which the write path rejects).
void AddCodebookPipelines(VectorCollector* out, const cpu::Backend& scalar) {
  struct Case {
    int d, bits;
    RotationVariant rotation;
    bool per_head, slack;
    CodebookDensity density;
  };
  const CodebookDensity beta = CodebookDensity::kBeta;
  const Case cases[] = {
      {64, 2, kGridRotations[0], false, false, beta},
      {64, 1, kGridRotations[2], false, false, beta},
      {64, 8, kGridRotations[3], false, false, beta},
      {128, 3, kGridRotations[1], false, false, beta},
      {128, 4, kGridRotations[2], false, false, CodebookDensity::kGaussian},
      {256, 5, kEdgeRotations[3], false, false, beta},
      {128, 3, kGridRotations[1], true, false, beta},
      {64, 3, kGridRotations[0], true, true, beta},
  };
  const std::vector<RowKind>& all = AllRowKinds();
  size_t next_kind = 0, index = 0;
  for (const Case& c : cases) {
    SplitMix64 widths_rng(CaseSeed(out->seed(), "codebook_widths_d" + std::to_string(c.d)));
    const std::vector<uint8_t> allocation = AllocationWidths(c.d, &widths_rng);
    WriteParams p = CodebookParams(c.d, c.bits, c.per_head ? &allocation : nullptr, c.slack,
                                   c.density);
    p.rotation = c.rotation.kind;
    p.hadamard_block = c.rotation.block;
    p.bitrev = c.rotation.bitrev;
    p = params::Write(p).Build();
    std::vector<RowKind> kinds = {RowKind::kRandom, RowKind::kHeavyTail};
    while (kinds.size() < 5) {
      const RowKind k = all[2 + next_kind++ % (all.size() - 2)];
      if (k != RowKind::kHuge) kinds.push_back(k);
    }
    const std::string name = "pipeline/codebook" + CodebookTag(p, c.per_head) +
                             (c.slack ? "_slack" : "") + "_" + c.rotation.name;
    AddPipelineCase(out, scalar, name, p, kinds,
                    static_cast<int>(index++ % out->FixtureMatrices(c.d)), false,
                    c.per_head ? &allocation : nullptr);
  }
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
  AddCodebookStages(out, scalar);
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
  AddCodebookPipelines(out, scalar);
}

}  // namespace kvq::conformance::internal
