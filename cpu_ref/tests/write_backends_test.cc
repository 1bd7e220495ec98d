// Every backend of kvq::AllBackends() (each Highway target, and CUDA where a device is present)
// against the scalar reference, bit for bit: every stage of kvq/common/stages.inc over its
// parameter grid, and the whole QuantizeRows pipeline. Test names end in "<stage>__<backend>",
// so --gtest_filter='*__hwy_avx2' or '*__cuda' selects a backend. A mismatch names the stage,
// parameters, seed and row count, and dumps inputs, reference and result (testbed/compare.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <string>
#include <tuple>
#include <vector>

#include "kvq/backends.h"
#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/head_data.h"
#include "kvq/testbed/backends.h"
#include "kvq/common/stages.h"
#include "kvq/conformance/rows.h"
#include "kvq/cpu_ref/write_path.h"
#include "kvq/testbed/compare.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"
#include "kvq/testbed/stage_tester.h"

namespace kvq {
namespace {

using testbed::StageTester;
using testbed::Write;

constexpr int kHeadDims[] = {64, 128, 256};
constexpr int kGroups[] = {32, 64, 128};
constexpr int kBits[] = {2, 4};
constexpr float kClips[] = {1.0f, 0.96f, 0.92f, 0.8f, 0.5f, 0.001f};

// The parameter grid a stage is tested over: what its rule depends on.
std::vector<WriteParams> StageGrid(const StageSpec& stage) {
  std::vector<WriteParams> grid;
  for (int d : kHeadDims) {
    switch (stage.id) {
      case StageId::kFwht:
        for (int block = 16; block <= d; block *= 2) {
          grid.push_back(Write().head_dim(d).group(32).hadamard(block == d ? 0 : block));
        }
        break;
      case StageId::kClip:
        for (float rho : kClips) grid.push_back(Write().head_dim(d).group(32).clip(rho));
        break;
      case StageId::kRotateDense:
      case StageId::kBitrev:
        grid.push_back(Write().head_dim(d).group(32));
        break;
      case StageId::kQuantizeFp8:
      case StageId::kDequantizeFp8:
        // s^ = 1 (the engines' default), powers of two, and scales that are not: small ones
        // saturate the larger rows, a subnormal one saturates nearly everything.
        for (float s : {1.0f, 0.0078125f, 0.0123f, 37.5f, 1e-39f}) {
          grid.push_back(Write().head_dim(d).fp8(s));
        }
        break;
      case StageId::kNorm:
      case StageId::kDenorm:
        // Spans of 1, 2, 3 (padded to 4) and 8 KV heads' rows.
        for (int heads : {1, 2, 3, 8}) {
          grid.push_back(Write().head_dim(d).tile(32).norm().norm_heads(heads));
        }
        break;
      default:  // a codec stage: every quantizer shape of its format
        if (stage.format == Format::kCodebook) {
          // The uniform row at every width (the tester's widths are then all b), and rows
          // whose limits admit any widths (the tester draws uniform, two-width and random
          // layouts), both densities.
          for (int b = 1; b <= 8; ++b) grid.push_back(Write().head_dim(d).codebook_rows(b));
          for (CodebookDensity density : {CodebookDensity::kBeta, CodebookDensity::kGaussian}) {
            grid.push_back(Write().head_dim(d).codebook_rows(3).segments(8).code_bytes(d)
                               .codebook(density));
          }
          break;
        }
        for (int g : kGroups) {
          if (g > d && stage.format != Format::kAffineTile) continue;
          for (int b : kBits) {
            grid.push_back(Write().head_dim(d).format(stage.format).group(g).bits(b));
          }
        }
        // One (scale, min) per row (G = d), at d = 256 too.
        if (stage.format == Format::kAffineToken && d > 128) {
          for (int b : kBits) grid.push_back(Write().head_dim(d).group(d).bits(b));
        }
    }
  }
  return grid;
}

class StageTest
    : public ::testing::TestWithParam<std::tuple<const StageSpec*, const cpu::Backend*>> {};

TEST_P(StageTest, MatchesScalar) {
  const auto [stage, backend] = GetParam();
  uint64_t seed = 1000 * (static_cast<uint64_t>(stage->id) + 1);
  for (const WriteParams& p : StageGrid(*stage)) {
    StageTester(stage->id).params(p).seed(++seed).Test(*backend);
  }
}

std::vector<std::tuple<const StageSpec*, const cpu::Backend*>> StageBackendPairs() {
  std::vector<std::tuple<const StageSpec*, const cpu::Backend*>> pairs;
  for (const StageSpec& stage : AllStages()) {
    for (const cpu::Backend* backend : AllBackends()) {
      if (backend->name != "scalar") pairs.emplace_back(&stage, backend);
    }
  }
  return pairs;
}

INSTANTIATE_TEST_SUITE_P(
    Write, StageTest, ::testing::ValuesIn(StageBackendPairs()),
    [](const ::testing::TestParamInfo<StageTest::ParamType>& info) {
      return std::string(std::get<0>(info.param)->name) + "__" + std::get<1>(info.param)->name;
    });

// The whole validating pipeline, every field of QuantizedRows, over every supported
// configuration (rows that stay within the write path's range after any rotation).
class PipelineTest : public ::testing::TestWithParam<const cpu::Backend*> {};

testbed::NamedTensors Outputs(const cpu::QuantizedRows& q, const WriteParams& p) {
  testbed::NamedTensors named;
  for (auto& [name, tensor] : q.Tensors(p)) named.emplace_back(name, tensor);
  return named;
}

TEST_P(PipelineTest, QuantizeRowsMatchesScalar) {
  const cpu::Backend& backend = *GetParam();
  uint64_t seed = 8000;
  for (int d : kHeadDims) {
    conformance::SplitMix64 matrix_rng(77 + d);
    const std::vector<float> dense = testbed::RandomMatrix(d, &matrix_rng);
    std::vector<Write> rotations = {Write(), Write().rotation(RotationKind::kDense)};
    for (int block = 16; block <= d; block *= 2) rotations.push_back(Write().hadamard(block));
    for (int g : kGroups) {
      if (g > d) continue;
      for (int bits : kBits) {
        for (float rho : kClips) {
          for (const Write& rotation : rotations) {
            for (bool bitrev : {false, true}) {
              const WriteParams p =
                  Write(rotation.Unchecked()).head_dim(d).group(g).bits(bits).clip(rho).bitrev(bitrev);
              conformance::SplitMix64 rng(++seed);
              const std::vector<float> x =
                  conformance::MakeRows(conformance::TestRowKinds(), p, &rng, nullptr);
              const size_t n = x.size() / static_cast<size_t>(d);
              const cpu::QuantizedRows want = cpu::QuantizeRows(cpu::ScalarBackend(), p,
                                                                dense.data(), x.data(), n);
              const cpu::QuantizedRows got = cpu::QuantizeRows(backend, p, dense.data(),
                                                               x.data(), n);
              const int64_t rows = static_cast<int64_t>(n);
              ASSERT_TRUE(testbed::AllBitsEqual(
                  "QuantizeRows " + testbed::Describe(p) + " seed " + std::to_string(seed) +
                      " on " + backend.name,
                  Outputs(want, p), Outputs(got, p),
                  {{"x", Tensor::F32({rows, d}, x)}, {"rotation", Tensor::F32({d, d}, dense)}}));
            }
          }
        }
      }
    }
  }
}

// Spec 1.1's write paths: affine_tile (G_k = 32, 64, 128) with and without a per-head norm,
// the token-scope norm over 1, 2 and 3 KV heads (QuantizeTokens), and G = d at d = 256.
TEST_P(PipelineTest, QuantizeTokensMatchesScalar) {
  const cpu::Backend& backend = *GetParam();
  uint64_t seed = 9000;
  for (int d : kHeadDims) {
    conformance::SplitMix64 matrix_rng(91 + d);
    const std::vector<float> dense = testbed::RandomMatrix(d, &matrix_rng);
    const std::vector<Write> rotations = {Write(), Write().rotation(RotationKind::kDense),
                                          Write().hadamard(), Write().hadamard(16).bitrev()};
    std::vector<std::pair<Write, int>> formats;  // (params, KV heads)
    for (int gk : kGroups) {
      formats.push_back({Write().tile(gk), 1});
      formats.push_back({Write().tile(gk).norm(), 1});
    }
    for (int heads : {2, 3}) formats.push_back({Write().tile(32).norm().norm_heads(heads), heads});
    formats.push_back({Write().group(d), 1});
    for (const auto& [format, heads] : formats) {
      for (int bits : kBits) {
        for (float rho : {1.0f, 0.92f}) {
          for (const Write& rotation : rotations) {
            WriteParams p = Write(format.Unchecked()).head_dim(d).bits(bits).clip(rho).Unchecked();
            const WriteParams r = rotation.Unchecked();
            p.rotation = r.rotation;
            p.hadamard_block = r.hadamard_block;
            p.bitrev = r.bitrev;
            p = Write(p).Build();
            conformance::SplitMix64 rng(++seed);
            // Two tiles of every test row kind, heads laid end to end.
            const size_t n = static_cast<size_t>(2 * p.tile_tokens());
            std::vector<float> x;
            while (x.size() < n * heads * d) {
              const std::vector<float> more =
                  conformance::MakeRows(conformance::TestRowKinds(p), p, &rng, nullptr);
              x.insert(x.end(), more.begin(), more.end());
            }
            x.resize(n * heads * d);
            const std::vector<WriteParams> params(static_cast<size_t>(heads), p);
            const std::vector<const float*> rots(static_cast<size_t>(heads), dense.data());
            const std::vector<cpu::QuantizedRows> want =
                cpu::QuantizeTokens(cpu::ScalarBackend(), params, rots, x.data(), n);
            const std::vector<cpu::QuantizedRows> got =
                cpu::QuantizeTokens(backend, params, rots, x.data(), n);
            for (int h = 0; h < heads; ++h) {
              ASSERT_TRUE(testbed::AllBitsEqual(
                  "QuantizeTokens " + testbed::Describe(p) + " head " + std::to_string(h) + "/" +
                      std::to_string(heads) + " seed " + std::to_string(seed) + " on " +
                      backend.name,
                  Outputs(want[h], p), Outputs(got[h], p),
                  {{"x", Tensor::F32({static_cast<int64_t>(n), heads * d}, x)}}));
            }
          }
        }
      }
    }
  }
}

std::vector<const cpu::Backend*> NonScalarBackends() {
  std::vector<const cpu::Backend*> list;
  for (const cpu::Backend* b : AllBackends()) {
    if (b->name != "scalar") list.push_back(b);
  }
  return list;
}

// Spec 1.2's fp8_e4m3 write path: every test row kind through each rotation, two KV heads with
// their own s^ (a calibrated-looking scale and one small enough to saturate most rows), plus
// the fp8 boundary values times a power-of-two scale.
TEST_P(PipelineTest, Fp8MatchesScalar) {
  const cpu::Backend& backend = *GetParam();
  uint64_t seed = 9500;
  for (int d : kHeadDims) {
    conformance::SplitMix64 matrix_rng(93 + d);
    const std::vector<float> dense = testbed::RandomMatrix(d, &matrix_rng);
    const std::vector<Write> rotations = {Write(), Write().rotation(RotationKind::kDense),
                                          Write().hadamard(), Write().hadamard(16).bitrev()};
    for (const Write& rotation : rotations) {
      const Write base = Write(rotation.Unchecked()).head_dim(d);
      const std::vector<WriteParams> params = {Write(base).fp8(0.0123f).Build(),
                                               Write(base).fp8(1e-4f).Build()};
      conformance::SplitMix64 rng(++seed);
      std::vector<float> x =
          conformance::MakeRows(conformance::TestRowKinds(params[0]), params[0], &rng, nullptr);
      for (float v : conformance::Fp8BoundaryValues()) {
        if (std::isfinite(v) && std::fabs(v) < 1e30f) x.push_back(v * 0.0078125f);
      }
      x.resize((x.size() / (2 * d) + 1) * 2 * d, 0.5f);  // whole tokens of two heads
      const size_t n = x.size() / (2 * d);
      const std::vector<const float*> rots(2, dense.data());
      const std::vector<cpu::QuantizedRows> want =
          cpu::QuantizeTokens(cpu::ScalarBackend(), params, rots, x.data(), n);
      const std::vector<cpu::QuantizedRows> got =
          cpu::QuantizeTokens(backend, params, rots, x.data(), n);
      for (int h = 0; h < 2; ++h) {
        ASSERT_TRUE(testbed::AllBitsEqual(
            "fp8 QuantizeTokens " + testbed::Describe(params[h]) + " head " +
                std::to_string(h) + " seed " + std::to_string(seed) + " on " + backend.name,
            Outputs(want[h], params[h]), Outputs(got[h], params[h]),
            {{"x", Tensor::F32({static_cast<int64_t>(n), 2, d}, x)}}));
      }
    }
  }
}

// Spec 1.3's codebook write path: TurboQuant-MSE rows at widths 1..8 (both densities) and two
// Block-GTQ heads with different widths, through each rotation; every test row kind the
// validating path accepts (segment norms overflow on the others).
TEST_P(PipelineTest, CodebookMatchesScalar) {
  const cpu::Backend& backend = *GetParam();
  for (const StageSpec& stage : AllStages()) {
    if (!stage.transform && stage.format == Format::kCodebook &&
        !cpu::HasStage(backend.write, stage.id)) {
      GTEST_SKIP() << backend.name << " has no '" << stage.name << "' kernel yet (kCpuOnly)";
    }
  }
  uint64_t seed = 9700;
  for (int d : kHeadDims) {
    conformance::SplitMix64 matrix_rng(97 + d);
    const std::vector<float> dense = testbed::RandomMatrix(d, &matrix_rng);
    const std::vector<Write> rotations = {Write(), Write().rotation(RotationKind::kDense),
                                          Write().hadamard(), Write().hadamard(16).bitrev()};
    for (const Write& rotation : rotations) {
      for (int b = 0; b <= 8; ++b) {  // b = 0: the per-head widths
        conformance::SplitMix64 rng(++seed);
        std::vector<uint8_t> widths[2];
        WriteParams p = rotation.Unchecked();
        p.head_dim = d;
        p.format = Format::kCodebook;
        p.group = d;
        p.bits = b == 0 ? 3 : b;
        p.codebook = b % 2 == 1 ? CodebookDensity::kGaussian : CodebookDensity::kBeta;
        if (b == 0) {
          int segments = 1, bytes = 0;
          for (std::vector<uint8_t>& w : widths) {
            w.resize(static_cast<size_t>(d / 2));
            for (uint8_t& v : w) v = static_cast<uint8_t>(1 + rng.Below(rng.Bit() ? 8 : 3));
            const CodebookLayout layout = CodebookLayoutOf(d, w.data());
            segments = std::max(segments, layout.count);
            bytes = std::max(bytes, layout.code_bytes);
          }
          p.segments = segments;
          p.code_bytes = bytes;
        }
        p = Write(p).Build();
        const std::vector<WriteParams> params(2, p);
        std::vector<HeadArrays> heads(2);
        for (int h = 0; h < 2; ++h) {
          if (p.rotation == RotationKind::kDense) heads[h].rotation = dense.data();
          if (b == 0) heads[h].widths = widths[h].data();
        }
        std::vector<float> x = conformance::MakeRows(conformance::TestRowKinds(p), p, &rng, nullptr);
        x.resize((x.size() / (2 * d) + 1) * 2 * d, 0.25f);  // whole tokens of two heads
        const size_t n = x.size() / (2 * d);
        const std::vector<cpu::QuantizedRows> want =
            cpu::QuantizeTokens(cpu::ScalarBackend(), params, heads, x.data(), n);
        const std::vector<cpu::QuantizedRows> got =
            cpu::QuantizeTokens(backend, params, heads, x.data(), n);
        for (int h = 0; h < 2; ++h) {
          ASSERT_TRUE(testbed::AllBitsEqual(
              "codebook QuantizeTokens " + testbed::Describe(p) + " head " + std::to_string(h) +
                  " seed " + std::to_string(seed) + " on " + backend.name,
              Outputs(want[h], p), Outputs(got[h], p),
              {{"x", Tensor::F32({static_cast<int64_t>(n), 2, d}, x)}}));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Write, PipelineTest, ::testing::ValuesIn(NonScalarBackends()),
                         [](const ::testing::TestParamInfo<const cpu::Backend*>& info) {
                           return info.param->name;
                         });

}  // namespace
}  // namespace kvq
