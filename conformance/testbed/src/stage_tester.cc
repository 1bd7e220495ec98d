#include "kvq/testbed/stage_tester.h"

#include <cstring>

#include "kvq/common/codebook.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/testbed/data.h"
#include "kvq/testbed/params.h"

namespace kvq::testbed {
namespace {

using conformance::SplitMix64;

// A finite bf16: sign (when allowed), an exponent below 2^123 (so q*s + m stays finite), any
// fraction; now and then +0 or a subnormal.
uint16_t RandomBf16(SplitMix64* rng, bool non_negative) {
  switch (rng->Below(16)) {
    case 0: return 0;
    case 1: return static_cast<uint16_t>(1 + rng->Below(127));  // subnormal
    default: break;
  }
  const uint32_t sign = non_negative || !rng->Bit() ? 0u : 0x8000u;
  return static_cast<uint16_t>(sign | (rng->Below(250) << 7) | rng->Below(128));
}

// Codebook block widths [d/2] whose layout fits p's segments and code_bytes: in turn every
// block at p.bits (the uniform row), two widths, or any widths in 1..8 (draws that do not fit
// are drawn again; the uniform row is the last resort).
void FillWidths(const WriteParams& p, SplitMix64* rng, uint8_t* widths) {
  const size_t blocks = static_cast<size_t>(p.head_dim / 2);
  const auto fits = [&] {
    const CodebookLayout layout = CodebookLayoutOf(p.head_dim, widths);
    return layout.count <= p.segments && layout.code_bytes <= p.row_code_bytes();
  };
  for (int attempt = 0; attempt < 16; ++attempt) {
    switch (rng->Below(3)) {
      case 0:
        for (size_t i = 0; i < blocks; ++i) widths[i] = static_cast<uint8_t>(p.bits);
        break;
      case 1: {
        const uint32_t a = 1 + rng->Below(8), b = 1 + rng->Below(8);
        for (size_t i = 0; i < blocks; ++i) widths[i] = static_cast<uint8_t>(rng->Bit() ? a : b);
        break;
      }
      default:
        for (size_t i = 0; i < blocks; ++i) widths[i] = static_cast<uint8_t>(1 + rng->Below(8));
    }
    if (fits()) return;
  }
  for (size_t i = 0; i < blocks; ++i) widths[i] = static_cast<uint8_t>(p.bits);
}

// The stage's block widths argument, filled before the other inputs (MakeStageBuffers).
const uint8_t* FilledWidths(const StageSpec& stage, const std::vector<Tensor>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (stage.args[i].domain == Domain::kWidths) return args[i].data<uint8_t>();
  }
  KVQ_CHECK(false, kInvalidArgument, "stage '", stage.name,
            "' draws codes per segment width but takes no block widths");
  return nullptr;
}

void FillInput(const StageSpec& stage, const StageArg& arg, const WriteParams& p,
               const std::vector<Tensor>& args, SplitMix64* rng, Tensor* t) {
  const size_t count = t->numel();
  switch (arg.dtype) {
    case DType::kF32: {
      float* out = t->data<float>();
      const size_t d = static_cast<size_t>(p.head_dim);
      if (arg.extent == Extent::kMatrix) {
        const std::vector<float> r = RandomMatrix(p.head_dim, rng);
        std::memcpy(out, r.data(), r.size() * sizeof(float));
      } else if (arg.extent == Extent::kRows || arg.extent == Extent::kNormRows) {
        // Rows of d values (a norm's span is norm_heads of them), cycling through the kinds.
        const size_t rows = count / d;
        const std::vector<float> mixed = conformance::MixedRows(rows, p, rng);
        std::memcpy(out, mixed.data(), mixed.size() * sizeof(float));
        // A stage over tiles: every third tile repeats its first row, so every channel of it
        // is constant (scale 0).
        const size_t tile = StageRowMultiple(stage, p);
        for (size_t t0 = 2 * tile; tile > 1 && t0 + tile <= rows; t0 += 3 * tile) {
          for (size_t r = 1; r < tile; ++r) {
            std::memcpy(out + (t0 + r) * d, out + t0 * d, d * sizeof(float));
          }
        }
      } else {
        for (size_t i = 0; i < count; ++i) out[i] = rng->Bell();
      }
      break;
    }
    case DType::kU8: {
      uint8_t* out = t->data<uint8_t>();
      if (arg.domain == Domain::kWidths) {
        FillWidths(p, rng, out);
        break;
      }
      if (arg.domain == Domain::kSegmentCodes) {  // value j of a segment of width w: < 2^w
        const CodebookLayout layout = CodebookLayoutOf(p.head_dim, FilledWidths(stage, args));
        const size_t d = static_cast<size_t>(p.head_dim);
        for (size_t row = 0; row < count / d; ++row) {
          for (int s = 0; s < layout.count; ++s) {
            const CodebookSegment& seg = layout.segment[s];
            for (int j = 0; j < seg.values; ++j) {
              out[row * d + static_cast<size_t>(seg.offset + j)] =
                  static_cast<uint8_t>(rng->Below(1u << seg.width));
            }
          }
        }
        break;
      }
      if (arg.domain == Domain::kFp8) {  // 254 codes: 0x00..0x7e and 0x80..0xfe
        for (size_t i = 0; i < count; ++i) {
          const uint32_t r = rng->Below(254);
          out[i] = static_cast<uint8_t>(r < 0x7f ? r : r + 1);
        }
        break;
      }
      const uint32_t values = arg.domain == Domain::kCodes
                                  ? static_cast<uint32_t>(p.levels()) + 1
                                  : 256u;  // codes, or packed bytes
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<uint8_t>(rng->Below(values));
      break;
    }
    case DType::kBF16: {
      uint16_t* out = t->data<uint16_t>();
      const bool non_negative = arg.domain == Domain::kNonNegative;
      for (size_t i = 0; i < count; ++i) out[i] = RandomBf16(rng, non_negative);
      break;
    }
    default: {
      for (size_t i = 0; i < t->bytes.size(); ++i) t->bytes[i] = static_cast<uint8_t>(rng->Below(256));
    }
  }
}

}  // namespace

std::vector<void*> StageBuffers::Pointers() {
  std::vector<void*> pointers;
  for (Tensor& t : args) pointers.push_back(t.bytes.data());
  return pointers;
}

NamedTensors StageBuffers::Inputs() const {
  NamedTensors named;
  for (int i = 0; i < stage->num_args; ++i) {
    if (stage->args[i].is_input()) named.emplace_back(stage->args[i].name, args[i]);
  }
  return named;
}

NamedTensors StageBuffers::Outputs() const {
  NamedTensors named;
  for (int i = 0; i < stage->num_args; ++i) {
    if (stage->args[i].is_output()) named.emplace_back(stage->args[i].expect, args[i]);
  }
  return named;
}

StageBuffers MakeStageBuffers(const StageSpec& stage, size_t n, const WriteParams& p,
                              uint64_t seed, uint8_t poison) {
  StageBuffers b;
  b.stage = &stage;
  b.params = p;
  b.rows = n;
  SplitMix64 rng(seed);
  for (int i = 0; i < stage.num_args; ++i) {
    const StageArg& arg = stage.args[i];
    Tensor t;
    t.dtype = arg.dtype;
    t.shape = ArgShape(arg.extent, static_cast<int64_t>(n), p);
    t.bytes.assign(t.numel() * DTypeSize(t.dtype), poison);
    b.args.push_back(std::move(t));
  }
  // Codebook block widths first: the codes of a codebook stage are drawn per segment width.
  for (bool widths : {true, false}) {
    for (int i = 0; i < stage.num_args; ++i) {
      const StageArg& arg = stage.args[i];
      if (arg.is_input() && (arg.domain == Domain::kWidths) == widths) {
        FillInput(stage, arg, p, b.args, &rng, &b.args[static_cast<size_t>(i)]);
      }
    }
  }
  return b;
}

std::string StageTester::Name(size_t n) const {
  return std::string(stage_->name) + " " + Describe(params_) + " rows " + std::to_string(n) +
         " seed " + std::to_string(seed_);
}

void StageTester::Test(const cpu::Backend& backend) const {
  // Row counts in whole tiles for a stage over tiles (StageRowMultiple).
  const size_t unit = StageRowMultiple(*stage_, params_);
  const size_t wanted = rows_ != 0 ? rows_ : 2 * conformance::TestRowKinds().size();
  const size_t full = (wanted + unit - 1) / unit * unit;
  std::vector<size_t> sizes;
  if (edge_sizes_) {
    for (size_t n : {size_t{1}, size_t{3}, size_t{4}, size_t{5}}) {
      if (n * unit < full) sizes.push_back(n * unit);
    }
  }
  sizes.push_back(full);
  for (size_t n : sizes) {
    const std::string name = Name(n) + " on " + backend.name;
    StageBuffers want = MakeStageBuffers(*stage_, n, params_, seed_, 0xA5);
    std::vector<void*> want_args = want.Pointers();
    cpu::RunStage(cpu::ScalarBackend().write, stage_->id, want_args.data(), n, params_);
    for (uint8_t poison : {uint8_t{0x00}, uint8_t{0xFF}}) {
      StageBuffers got = MakeStageBuffers(*stage_, n, params_, seed_, poison);
      const NamedTensors inputs = got.Inputs();
      std::vector<void*> got_args = got.Pointers();
      try {
        cpu::RunStage(backend.write, stage_->id, got_args.data(), n, params_);
      } catch (const Error& e) {
        // A backend without this stage (or this configuration of it) says so with
        // kUnsupported, and the test is skipped with its reason; any other error fails.
        if (e.code() != ErrorCode::kUnsupported) throw;
        GTEST_SKIP() << name << ": " << e.what();
      }
      EXPECT_TRUE(AllBitsEqual(name, want.Outputs(), got.Outputs(), inputs))
          << "(outputs poisoned with 0x" << std::hex << static_cast<int>(poison) << std::dec
          << ")";
    }
  }
}

}  // namespace kvq::testbed
