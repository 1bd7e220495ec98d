// End-to-end tests of the kvq CLI: inputs written with the kvq I/O API, the real binary run
// through std::system, outputs compared bit for bit with kvq::cpu::QuantizeRows / Rotate /
// RotateInverse called directly; every error exits non-zero with one `kvq: error:` line naming
// the value and leaves no output file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/calib/rotation.h"
#include "kvq/calib/schemes.h"
#include "kvq/common/error.h"
#include "kvq/common/params_builder.h"
#include "kvq/common/io.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/common/tables.h"
#include "kvq/cpu_ref/write_path.h"

namespace kvq {
namespace {

using cli_testing::ExpectFailure;
using cli_testing::Exists;
using cli_testing::RunKvq;
using cli_testing::RunResult;

class Scratch : public cli_testing::ScratchDir {
 public:
  Scratch() : ScratchDir("kvq_cli_test") {}
};

std::vector<float> RandomRows(size_t n, int d, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n * static_cast<size_t>(d));
  for (float& v : x) v = normal(rng);
  // A few edge values: an outlier, exact zeros of both signs, a subnormal.
  if (!x.empty()) x[0] = 40.0f * scale;
  if (x.size() > 3) {
    x[1] = 0.0f;
    x[2] = -0.0f;
    x[3] = 1e-40f;
  }
  return x;
}

Tensor Matrix(const std::vector<float>& values, size_t rows, size_t cols) {
  return Tensor::F32({static_cast<int64_t>(rows), static_cast<int64_t>(cols)}, values);
}

// Bitwise equality, reporting the first differing element as (row, column).
template <typename T>
void ExpectSameBits(const char* what, const std::vector<T>& want, const T* have, size_t have_count,
                    size_t width, uint32_t seed) {
  ASSERT_EQ(want.size(), have_count) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &have[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << " differs at row " << i / width << ", column " << i % width
                    << " (seed " << seed << "): library " << +want[i] << ", CLI " << +have[i];
      return;
    }
  }
}

struct Case {
  int d, group, bits;
  const char* clip;
  RotationKind rotation;
  int block;
  bool bitrev;
};

std::string RotationArgs(const Case& c, const std::string& matrix_path) {
  std::string args;
  switch (c.rotation) {
    case RotationKind::kDense:
      args = " --rotation '" + matrix_path + "'";
      break;
    case RotationKind::kHadamard:
      args = " --hadamard" + (c.block ? " --block " + std::to_string(c.block) : std::string());
      break;
    case RotationKind::kIdentity:
      args = " --identity";
      break;
  }
  return args + (c.bitrev ? " --bitrev" : "");
}

WriteParams ParamsOf(const Case& c) {
  return params::Write().head_dim(c.d).group(c.group).bits(c.bits)
      .clip(std::strtof(c.clip, nullptr)).rotation(c.rotation)
      .hadamard_block(c.rotation == RotationKind::kHadamard ? c.block : 0).bitrev(c.bitrev);
}

const Case kCases[] = {
    {128, 64, 2, "0.96", RotationKind::kDense, 0, true},
    {128, 32, 4, "1", RotationKind::kDense, 0, false},
    {64, 64, 2, "0.9", RotationKind::kHadamard, 0, false},
    {256, 128, 2, "0.92", RotationKind::kHadamard, 32, true},
    {64, 32, 4, "0.5", RotationKind::kIdentity, 0, false},
    {128, 128, 2, "0.8", RotationKind::kIdentity, 0, true},
};

TEST(Cli, QuantizeDequantizeAndRotateMatchTheLibraryBitForBit) {
  uint32_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE("d=" + std::to_string(c.d) + " G=" + std::to_string(c.group) +
                 " b=" + std::to_string(c.bits) + " rotation=" + RotationKindName(c.rotation) +
                 " seed=" + std::to_string(seed));
    Scratch dir;
    const size_t n = 7;
    const std::vector<float> x = RandomRows(n, c.d, seed, 3.0f);
    // A rotation must be orthogonal (kvq refuses another matrix): a Haar-random one.
    const std::vector<float> r = calib::ToRowMajorF32(calib::RandomOrthogonal(c.d, seed + 1));
    WriteNpy(dir.File("x.npy"), Matrix(x, n, static_cast<size_t>(c.d)));
    WriteNpy(dir.File("r.npy"), Matrix(r, static_cast<size_t>(c.d), static_cast<size_t>(c.d)));
    const WriteParams p = ParamsOf(c);
    const float* rp = c.rotation == RotationKind::kDense ? r.data() : nullptr;
    const cpu::Backend& backend = cpu::BestBackend();
    const std::string rotation = RotationArgs(c, dir.File("r.npy"));
    const size_t d = static_cast<size_t>(c.d);

    // quantize
    RunResult run =
        RunKvq(dir, "quantize --in '" + dir.File("x.npy") + "'" + rotation + " --clip " + c.clip +
                        " --bits " + std::to_string(c.bits) + " --group " +
                        std::to_string(c.group) + " --out '" + dir.File("q.safetensors") + "'");
    ASSERT_EQ(run.exit_code, 0) << run.err;
    EXPECT_EQ(run.err, "");
    const cpu::QuantizedRows want = cpu::QuantizeRows(backend, p, rp, x.data(), n);
    const Safetensors q = ReadSafetensors(dir.File("q.safetensors"));
    const auto check = [&](const char* name, DType dtype, std::vector<int64_t> shape) {
      const Tensor& t = q.Get(name);
      EXPECT_EQ(t.dtype, dtype) << name;
      EXPECT_EQ(t.shape, shape) << name;
      return &t;
    };
    const int64_t ni = static_cast<int64_t>(n), di = c.d, groups = c.d / c.group;
    const Tensor* t = check("rotated", DType::kF32, {ni, di});
    ExpectSameBits("rotated", want.rotated, t->data<float>(), t->numel(), d, seed);
    t = check("tau", DType::kF32, {ni});
    ExpectSameBits("tau", want.tau, t->data<float>(), t->numel(), 1, seed);
    t = check("codes", DType::kU8, {ni, di});
    ExpectSameBits("codes", want.Values<uint8_t>("codes"), t->data<uint8_t>(), t->numel(), d, seed);
    t = check("packed", DType::kU8, {ni, di * c.bits / 8});
    ExpectSameBits("packed", want.Values<uint8_t>("packed"), t->data<uint8_t>(), t->numel(), d * c.bits / 8, seed);
    t = check("scale", DType::kBF16, {ni, groups});
    ExpectSameBits("scale", want.Values<uint16_t>("scale"), t->data<uint16_t>(), t->numel(), groups, seed);
    t = check("min", DType::kBF16, {ni, groups});
    ExpectSameBits("min", want.Values<uint16_t>("min"), t->data<uint16_t>(), t->numel(), groups, seed);
    t = check("dequantized", DType::kF32, {ni, di});
    ExpectSameBits("dequantized", want.dequantized, t->data<float>(), t->numel(), d, seed);
    EXPECT_EQ(q.metadata.at("format"), "kvq-quantized");
    EXPECT_EQ(q.metadata.at("spec_version"), "1.0");
    EXPECT_EQ(q.metadata.at("head_dim"), std::to_string(c.d));
    EXPECT_EQ(q.metadata.at("group"), std::to_string(c.group));
    EXPECT_EQ(q.metadata.at("bits"), std::to_string(c.bits));
    EXPECT_EQ(q.metadata.at("clip"), c.clip);
    EXPECT_EQ(q.metadata.at("rotation"), RotationKindName(c.rotation));
    EXPECT_EQ(q.metadata.at("bitrev"), c.bitrev ? "1" : "0");
    EXPECT_EQ(q.metadata.at("hadamard_block"), std::to_string(p.hadamard_block));
    EXPECT_EQ(q.metadata.count("row_format"), 0u);  // affine_token: the spec-1.0 keys only

    // dequantize
    run = RunKvq(dir, "dequantize --in '" + dir.File("q.safetensors") + "'" + rotation +
                          " --out '" + dir.File("back.npy") + "'");
    ASSERT_EQ(run.exit_code, 0) << run.err;
    std::vector<float> back(n * d);
    cpu::RotateInverse(backend, p, rp, want.dequantized.data(), back.data(), n);
    const Tensor back_cli = ReadNpy(dir.File("back.npy"));
    EXPECT_EQ(back_cli.shape, (std::vector<int64_t>{ni, di}));
    ExpectSameBits("dequantize output", back, back_cli.data<float>(), back_cli.numel(), d, seed);

    // rotate
    run = RunKvq(dir, "rotate --in '" + dir.File("x.npy") + "'" + rotation + " --out '" +
                          dir.File("y.npy") + "'");
    ASSERT_EQ(run.exit_code, 0) << run.err;
    std::vector<float> y(n * d);
    cpu::Rotate(backend, p, rp, x.data(), y.data(), n);
    const Tensor y_cli = ReadNpy(dir.File("y.npy"));
    EXPECT_EQ(y_cli.shape, (std::vector<int64_t>{ni, di}));
    ExpectSameBits("rotate output", y, y_cli.data<float>(), y_cli.numel(), d, seed);
    seed += 10;
  }
}

// Every quantized format of formats.inc through `kvq quantize --format` and back through
// `kvq dequantize`: the file holds the library's QuantizedRows::Tensors bit for bit, records
// the version that brought the format, and the rows come back as RotateInverse maps the
// library's dequantized rows. A stored tensor that the write path does not give from the
// stored rows is refused, naming it.
TEST(Cli, QuantizeAndDequantizeServeEveryFormat) {
  struct FormatCase {
    const char* args;
    WriteParams p;
    const char* version;
  };
  const auto params = [](Format format, int group, int bits, bool norm, float scale) {
    WriteParams p;
    p.head_dim = 128;
    p.format = format;
    p.group = group;
    p.bits = bits;
    p.norm = norm;
    p.head_scale = scale;
    p.clip = 0.96f;
    p.rotation = RotationKind::kHadamard;
    return p;
  };
  const FormatCase cases[] = {
      {"--format affine_tile --bits 2 --group 32", params(Format::kAffineTile, 32, 2, false, 1),
       "1.1"},
      {"--format affine_tile --bits 4 --group 32 --norm",
       params(Format::kAffineTile, 32, 4, true, 1), "1.1"},
      {"--format fp8_e4m3 --scale 0.03125", params(Format::kFp8E4m3, 64, 8, false, 0.03125f),
       "1.2"},
  };
  Scratch dir;
  const size_t n = 64, d = 128;
  const std::vector<float> x = RandomRows(n, 128, 77, 3.0f);
  WriteNpy(dir.File("x.npy"), Matrix(x, n, d));
  const cpu::Backend& backend = cpu::BestBackend();
  for (const FormatCase& c : cases) {
    SCOPED_TRACE(c.args);
    const RunResult run = RunKvq(dir, std::string("quantize --in x.npy --hadamard --clip 0.96 ") +
                                          c.args + " --out q.safetensors");
    ASSERT_EQ(run.exit_code, 0) << run.err;
    const cpu::QuantizedRows want = cpu::QuantizeRows(backend, c.p, nullptr, x.data(), n);
    const Safetensors q = ReadSafetensors(dir.File("q.safetensors"));
    EXPECT_EQ(q.metadata.at("spec_version"), c.version);
    EXPECT_EQ(q.metadata.at("row_format"), FormatName(c.p.format));
    const std::vector<std::pair<std::string, Tensor>> tensors = want.Tensors(c.p);
    EXPECT_EQ(q.tensors.size(), tensors.size());
    for (const auto& [name, t] : tensors) {
      EXPECT_TRUE(q.Get(name) == t) << name;
    }
    const RunResult back = RunKvq(dir, "dequantize --in q.safetensors --hadamard --out back.npy");
    ASSERT_EQ(back.exit_code, 0) << back.err;
    std::vector<float> rows(n * d);
    cpu::RotateInverse(backend, c.p, nullptr, want.dequantized.data(), rows.data(), n);
    const Tensor got = ReadNpy(dir.File("back.npy"));
    ExpectSameBits("dequantize output", rows, got.data<float>(), got.numel(), d, 77);
    // One stored code changed: not what the write path gives from the stored rows.
    Safetensors bad = q;
    for (auto& [name, t] : bad.tensors) {
      if (name == "codes") t.bytes[3 * d + 5] ^= 1;
    }
    WriteSafetensors(dir.File("bad.safetensors"), bad);
    ExpectFailure(dir, "dequantize --in bad.safetensors --hadamard --out bad.npy",
                  dir.File("bad.npy"), {"codes at row 3, column 5"});
  }
  ExpectFailure(dir, "quantize --in x.npy --hadamard --clip 1 --format bf16 --out b.safetensors",
                dir.File("b.safetensors"), {"--format bf16", "nothing to quantize"});
  ExpectFailure(dir, "quantize --in x.npy --hadamard --clip 1 --format affine_tile --bits 2 "
                     "--out b.safetensors",
                dir.File("b.safetensors"), {"--group is required", "tokens per tile"});
  ExpectFailure(dir, "quantize --in x.npy --hadamard --clip 1 --format fp8_e4m3 --bits 4 "
                     "--out b.safetensors",
                dir.File("b.safetensors"), {"bits 4", "fp8_e4m3"});
  ExpectFailure(dir, "quantize --in x.npy --hadamard --clip 1 --format fp8_e4m3 --scale 0 "
                     "--out b.safetensors",
                dir.File("b.safetensors"), {"head scale 0"});
  ExpectFailure(dir, "quantize --in x.npy --hadamard --clip 1 --format fp9 --out b.safetensors",
                dir.File("b.safetensors"), {"fp9"});
}

TEST(Cli, Float16InputIsConvertedExactly) {
  Scratch dir;
  const size_t n = 3;
  const int d = 64;
  std::vector<uint16_t> halves(n * d);
  std::mt19937 rng(5);
  for (uint16_t& h : halves) h = static_cast<uint16_t>(rng() & 0xbbffu);  // finite fp16 patterns
  std::vector<float> x(halves.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = F32FromF16(halves[i]);
  WriteNpy(dir.File("x16.npy"), Tensor::F16({3, 64}, halves));
  WriteNpy(dir.File("x32.npy"), Matrix(x, n, d));
  ASSERT_EQ(RunKvq(dir, "rotate --hadamard --in '" + dir.File("x16.npy") + "' --out '" +
                            dir.File("a.npy") + "'")
                .exit_code,
            0);
  ASSERT_EQ(RunKvq(dir, "rotate --hadamard --in '" + dir.File("x32.npy") + "' --out '" +
                            dir.File("b.npy") + "'")
                .exit_code,
            0);
  EXPECT_EQ(ReadNpy(dir.File("a.npy")), ReadNpy(dir.File("b.npy")));
}

TEST(Cli, InfoListsTensorsAndMetadata) {
  Scratch dir;
  const std::vector<float> x = RandomRows(2, 64, 9);
  WriteNpy(dir.File("x.npy"), Matrix(x, 2, 64));
  RunResult r = RunKvq(dir, "info '" + dir.File("x.npy") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("npy, 1 tensor"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("F32   [2, 64]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("512 bytes"), std::string::npos) << r.out;
  ASSERT_EQ(RunKvq(dir, "quantize --identity --clip 1 --bits 4 --group 32 --in '" +
                            dir.File("x.npy") + "' --out '" + dir.File("q.safetensors") + "'")
                .exit_code,
            0);
  r = RunKvq(dir, "info '" + dir.File("q.safetensors") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* needle :
       {"safetensors, 7 tensors", "codes", "U8", "[2, 64]", "128 bytes", "scale", "BF16", "[2, 2]",
        "format = kvq-quantized", "bits = 4", "spec_version = 1.0", "rotation = identity"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " not in:\n" << r.out;
  }
  ExpectFailure(dir, "info '" + dir.File("absent.npy") + "'", dir.File("absent.npy"),
                {"absent.npy"});
}

// `kvq bench` on the CPU alone (the GPU columns are covered on the device machine, where the
// command also compares the two write paths bit for bit): both tables, one attention row per
// (scheme, length) and one write row per (quantized scheme, length), schemes from the catalogue.
size_t CountRows(const std::string& out, const std::string& first_column) {
  size_t rows = 0;
  for (size_t at = out.find("\n" + first_column + " "); at != std::string::npos;
       at = out.find("\n" + first_column + " ", at + 1)) {
    ++rows;
  }
  return rows;
}

TEST(Cli, BenchPrintsAttentionAndWriteTables) {
  Scratch dir;
  RunResult r = RunKvq(dir, "bench --backend cpu --seq-len 64,320 --iters 1 --kv-heads 2 --q-heads 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* needle : {"decode attention, d=128 Hq/Hkv=4/2", "write path (rotate, clip",
                             "T x Hkv=2 fp32 rows"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " not in:\n" << r.out;
  }
  // Default schemes oscar, saw_int4, bf16: attention rows at both lengths; write rows for the
  // two quantized ones.
  EXPECT_EQ(CountRows(r.out, "oscar"), 4u) << r.out;
  EXPECT_EQ(CountRows(r.out, "saw_int4"), 4u) << r.out;
  EXPECT_EQ(CountRows(r.out, "bf16"), 2u) << r.out;

  r = RunKvq(dir, "bench --backend cpu --seq-len 96 --iters 1 --kv-heads 2 --q-heads 4 "
                  "--head-dim 64 --schemes all");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const calib::SchemeInfo& s : calib::Schemes()) {
    EXPECT_EQ(CountRows(r.out, s.name), s.quantized() ? 2u : 1u) << s.name << " in:\n" << r.out;
  }
  ExpectFailure(dir, "bench --backend tpu", dir.File("none"), {"--backend", "tpu"});
  ExpectFailure(dir, "bench --backend cpu --schemes oscar,kivi2", dir.File("none"),
                {"unknown scheme 'kivi2'", "oscar", "saw_int4"});
}

TEST(Cli, ParameterErrorsAreOneLineAndLeaveNoOutput) {
  Scratch dir;
  const std::vector<float> x = RandomRows(4, 128, 21);
  WriteNpy(dir.File("x.npy"), Matrix(x, 4, 128));
  const std::string in = " --in '" + dir.File("x.npy") + "'";
  const std::string out_path = dir.File("q.safetensors");
  const std::string out = " --out '" + out_path + "'";
  ExpectFailure(dir, "quantize --identity --clip 1 --bits 3 --group 64" + in + out, out_path,
                {"bits 3"});
  ExpectFailure(dir, "quantize --identity --clip 1 --bits 2 --group 48" + in + out, out_path,
                {"group size 48"});
  ExpectFailure(dir, "quantize --identity --clip 1.5 --bits 2 --group 64" + in + out, out_path,
                {"clip ratio 1.5"});
  ExpectFailure(dir, "quantize --identity --clip abc --bits 2 --group 64" + in + out, out_path,
                {"--clip 'abc'"});
  ExpectFailure(dir, "quantize --clip 1 --bits 2 --group 64" + in + out, out_path,
                {"exactly one of --rotation, --hadamard, --identity"});
  ExpectFailure(dir, "quantize --identity --hadamard --clip 1 --bits 2 --group 64" + in + out,
                out_path, {"exactly one of"});
  ExpectFailure(dir, "quantize --hadamard --block 24 --clip 1 --bits 2 --group 64" + in + out,
                out_path, {"hadamard block 24"});
  ExpectFailure(dir, "quantize --identity --block 32 --clip 1 --bits 2 --group 64" + in + out,
                out_path, {"--block 32"});
  ExpectFailure(dir, "quantize --identity --clip 1 --bits 2" + in + out, out_path, {"--group"});
  ExpectFailure(dir, "quantize --identity --clip 1 --bits two --group 64" + in + out, out_path,
                {"two"});
  ExpectFailure(dir, "quantize --identity --clip 1 --bits 2 --group 64 --bogus" + in + out,
                out_path, {"--bogus"});
  const std::string y_path = dir.File("y.npy");
  ExpectFailure(dir, "rotate --hadamard --block 256" + in + " --out '" + y_path + "'", y_path,
                {"hadamard block 256"});
}

TEST(Cli, InputErrorsAreOneLineAndLeaveNoOutput) {
  Scratch dir;
  const std::string out_path = dir.File("q.safetensors");
  const std::string out = " --out '" + out_path + "'";
  const std::string args =
      "quantize --rotation '" + dir.File("r.npy") + "' --clip 1 --bits 2 --group 64";
  // R of the wrong shape.
  WriteNpy(dir.File("x.npy"), Matrix(RandomRows(4, 128, 1), 4, 128));
  WriteNpy(dir.File("r.npy"), Matrix(RandomRows(64, 64, 2), 64, 64));
  ExpectFailure(dir, args + " --in '" + dir.File("x.npy") + "'" + out, out_path,
                {"r.npy", "[64, 64]", "[128, 128]"});
  ExpectFailure(dir,
                "rotate --rotation '" + dir.File("r.npy") + "' --in '" + dir.File("x.npy") +
                    "' --out '" + dir.File("y.npy") + "'",
                dir.File("y.npy"), {"[64, 64]", "[128, 128]"});
  // NaN in X, named with its row and column.
  std::vector<float> x = RandomRows(4, 128, 3);
  x[2 * 128 + 5] = std::nanf("");
  WriteNpy(dir.File("nan.npy"), Matrix(x, 4, 128));
  WriteNpy(dir.File("r.npy"), Matrix(calib::ToRowMajorF32(calib::RandomOrthogonal(128, 2)), 128, 128));
  ExpectFailure(dir, args + " --in '" + dir.File("nan.npy") + "'" + out, out_path,
                {"nan", "row 2", "column 5"});
  // `quantize` with valid options on the scratch file `name`: only the input can be at fault.
  const auto quantize_identity = [&](const std::string& name) {
    return "quantize --identity --clip 1 --bits 2 --group 32 --in '" + dir.File(name) + "'" + out;
  };
  // Unsupported head_dim, dtype and rank.
  WriteNpy(dir.File("d96.npy"), Matrix(RandomRows(2, 96, 4), 2, 96));
  ExpectFailure(dir, quantize_identity("d96.npy"), out_path, {"head_dim 96"});
  WriteNpy(dir.File("i32.npy"), Tensor::I32({1, 64}, std::vector<int32_t>(64)));
  ExpectFailure(dir, quantize_identity("i32.npy"), out_path, {"i32.npy", "I32"});
  WriteNpy(dir.File("1d.npy"), Tensor::F32({64}, std::vector<float>(64)));
  ExpectFailure(dir, quantize_identity("1d.npy"), out_path, {"1d.npy", "[64]"});
  // Malformed npy: bad magic, and a truncated file.
  WriteFile(dir.File("bad.npy"), {'N', 'O', 'T', 'N', 'P', 'Y', 1, 0, 0, 0, 0});
  ExpectFailure(dir, quantize_identity("bad.npy"), out_path, {"bad.npy", "magic", "NOTNPY"});
  std::vector<uint8_t> truncated = ReadFileBytes(dir.File("x.npy"));
  truncated.resize(truncated.size() - 4);
  WriteFile(dir.File("short.npy"), truncated);
  ExpectFailure(dir, quantize_identity("short.npy"), out_path, {"short.npy", "truncated"});
  ExpectFailure(dir, quantize_identity("absent.npy"), out_path, {"absent.npy"});
  // An output directory that does not exist: the write fails, nothing is created.
  ExpectFailure(dir,
                "quantize --identity --clip 1 --bits 2 --group 32 --in '" + dir.File("x.npy") +
                    "' --out '" + dir.File("no/dir/q.safetensors") + "'",
                dir.File("no"), {"no/dir/q.safetensors"});
}

TEST(Cli, DequantizeChecksTheFileAgainstItself) {
  Scratch dir;
  const size_t n = 3;
  WriteNpy(dir.File("x.npy"), Matrix(RandomRows(n, 64, 8), n, 64));
  ASSERT_EQ(RunKvq(dir, "quantize --hadamard --bitrev --clip 0.9 --bits 2 --group 32 --in '" +
                            dir.File("x.npy") + "' --out '" + dir.File("q.safetensors") + "'")
                .exit_code,
            0);
  const Safetensors good = ReadSafetensors(dir.File("q.safetensors"));
  const std::string out_path = dir.File("x_back.npy");
  const std::string out = " --out '" + out_path + "'";
  const auto in = [&](const std::string& name) { return " --in '" + dir.File(name) + "'"; };
  // The rotation options must match the recorded ones.
  ExpectFailure(dir, "dequantize --identity --bitrev" + in("q.safetensors") + out, out_path,
                {"'identity'", "'hadamard'"});
  ExpectFailure(dir, "dequantize --hadamard" + in("q.safetensors") + out, out_path,
                {"--bitrev missing"});
  ExpectFailure(dir, "dequantize --hadamard --block 16 --bitrev" + in("q.safetensors") + out,
                out_path, {"--block 16", "hadamard_block 64"});
  // `good` changed by `change`, written to `file`: dequantizing it must fail naming `needles`.
  const auto expect_rejected = [&](const std::string& file,
                                   const std::function<void(Safetensors&)>& change,
                                   const std::vector<std::string>& needles) {
    Safetensors bad = good;
    change(bad);
    WriteSafetensors(dir.File(file), bad);
    ExpectFailure(dir, "dequantize --hadamard --bitrev" + in(file) + out, out_path, needles);
  };
  // A change to the tensor called `tensor` alone.
  const auto in_tensor = [](const std::string& tensor, const std::function<void(Tensor&)>& change) {
    return [=](Safetensors& file) {
      for (auto& [name, t] : file.tensors) {
        if (name == tensor) change(t);
      }
    };
  };
  // A stored dequantized value that codes/scale/min do not produce.
  expect_rejected("tampered.safetensors",
                  in_tensor("dequantized", [](Tensor& t) { t.data<float>()[1 * 64 + 7] += 1.0f; }),
                  {"dequantized value at row 1, column 7"});
  // Stored rotated rows that do not give the stored tau/codes/scale/min.
  expect_rejected("bad_rotated.safetensors",
                  in_tensor("rotated", [](Tensor& t) { t.data<float>()[2 * 64 + 0] = 1e6f; }),
                  {"at row 2", "not what clipping and quantizing 'rotated' gives"});
  // A code out of range, and packed bytes that disagree with the codes.
  expect_rejected("big_code.safetensors", in_tensor("codes", [](Tensor& t) { t.bytes[5] = 9; }),
                  {"code 9 at row 0, column 5"});
  expect_rejected("bad_pack.safetensors",
                  in_tensor("packed", [](Tensor& t) { t.bytes[16 + 3] ^= 1; }),
                  {"packed byte at row 1, column 3"});
  // Metadata and shapes.
  expect_rejected(
      "format.safetensors", [](Safetensors& f) { f.metadata["format"] = "other"; }, {"'other'"});
  expect_rejected(
      "group.safetensors", [](Safetensors& f) { f.metadata["group"] = "64"; },
      {"'scale'", "[3, 2]", "[3, 1]"});
  expect_rejected(
      "missing.safetensors", [](Safetensors& f) { f.tensors.erase(f.tensors.begin()); },
      {"no tensor '" + good.tensors.front().first + "'"});
  ExpectFailure(dir, "dequantize --hadamard --bitrev" + in("x.npy") + out, out_path, {"x.npy"});
  // And the untouched file still works.
  ASSERT_EQ(RunKvq(dir, "dequantize --hadamard --bitrev" + in("q.safetensors") + out).exit_code, 0);
  EXPECT_TRUE(Exists(out_path));
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// kvq tables writes each generated table as its generator does (the text common_tables_test
// holds the committed files to), and refuses a missing folder naming it, writing nothing.
TEST(Cli, TablesWritesEveryGeneratedTable) {
  cli_testing::ScratchDir dir("kvq_tables");
  const cli_testing::RunResult run = cli_testing::RunKvq(dir, "tables --out .");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (const tables::TableSpec& table : tables::AllTables()) {
    EXPECT_EQ(cli_testing::Slurp(dir.File(table.file)), tables::TableText(table)) << table.file;
    EXPECT_NE(run.out.find(table.file), std::string::npos) << run.out;
  }
  cli_testing::ExpectFailure(dir, "tables --out missing", dir.File("missing"),
                             {"missing", "does not exist"});
}

}  // namespace
}  // namespace kvq
