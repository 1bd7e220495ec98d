// kvq dequantize --in Q.safetensors (--rotation R.npy | --hadamard [--block H] | --identity)
//                [--bitrev] --out X.npy
// Reads what `kvq quantize` wrote, in any of its formats, checks it (metadata, the tensors the
// format's write path produces with their dtypes and shapes, the code range, and that running
// the write path again on the stored `rotated` rows gives every stored tensor bit for bit, so
// the file is one write-path run, not a mix), then maps the dequantized rows back to the
// original space: X = dequantized · P_brᵀ · Rᵀ (kvq::cpu::RotateInverse). The rotation options
// must name the rotation recorded in the file, and a dense R must be the one whose fingerprint
// the file records (rotation_sha256).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/metadata.h"
#include "kvq/common/numeric.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

namespace {

struct DequantizeOptions {
  std::string in, out;
  kvq::cli::RotationOptions rotation;
};

std::string Hex(uint32_t bits) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(8) << std::setfill('0') << bits;
  return os.str();
}

// The parameters recorded by `kvq quantize`, checked against the command line.
kvq::WriteParams ReadParams(const kvq::Safetensors& file, const std::string& path,
                            const kvq::cli::RotationOptions& options) {
  const kvq::MetadataReader meta(file.metadata, "'" + path + "'");
  const std::string& format = meta.String("format");
  KVQ_CHECK(format == "kvq-quantized", kMalformedFile, "'", path, "' has format '", format,
            "', expected 'kvq-quantized'");
  const kvq::WriteParams p = kvq::GetWriteParams(meta, "");
  KVQ_CHECK(p.format != kvq::Format::kBf16, kMalformedFile, "'", path,
            "' has row format 'bf16': kvq quantize writes quantized formats only");
  const std::string& version = meta.String("spec_version");
  const std::string expected = kvq::FormatSpecVersion(p.format);
  KVQ_CHECK(version == expected, kMalformedFile, "'", path, "' has spec_version '", version,
            "', expected '", expected, "' for format ", kvq::FormatName(p.format));
  const std::string rotation = kvq::RotationKindName(p.rotation);
  const std::string bitrev = p.bitrev ? "1" : "0";

  const kvq::RotationKind asked = kvq::cli::SelectedRotation(options);
  KVQ_CHECK(asked == p.rotation, kInvalidArgument, "rotation '", kvq::RotationKindName(asked),
            "' given, but '", path, "' was quantized with rotation '", rotation, "'");
  KVQ_CHECK(options.bitrev == p.bitrev, kInvalidArgument, "--bitrev ",
            options.bitrev ? "given" : "missing", ", but '", path, "' has bitrev ", bitrev);
  KVQ_CHECK(options.block == 0 || options.block == p.fwht_block(), kInvalidArgument, "--block ",
            options.block, " given, but '", path, "' has hadamard_block ", p.fwht_block());
  return p;
}

// The write path run again on the stored `rotated` rows (no rotation: they are rotated
// already): every tensor the file must hold, with the bits it must hold.
kvq::cpu::QuantizedRows Rerun(const kvq::Safetensors& file, const std::string& path,
                              const kvq::WriteParams& p, const kvq::cpu::Backend& backend,
                              size_t rows) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const kvq::Tensor& rotated = file.Get("rotated");
  KVQ_CHECK(rotated.dtype == kvq::DType::kF32, kMalformedFile, "'", path,
            "' tensor 'rotated' is ", kvq::DTypeName(rotated.dtype), ", expected F32");
  kvq::ExpectShape(rotated, {static_cast<int64_t>(rows), p.head_dim},
                   "'" + path + "' tensor 'rotated'");
  const float* x = rotated.data<float>();
  for (size_t i = 0; i < rows * d; ++i) {
    // The kernels assume what the write path guarantees: finite, |x| <= 2^126.
    KVQ_CHECK(!kvq::IsNonFinite(x[i]) && std::fabs(x[i]) <= kvq::kMaxRotatedAbs, kMalformedFile,
              "'", path, "' rotated value ", x[i], " at row ", i / d, ", column ", i % d,
              " is not finite or exceeds 2^126");
  }
  kvq::WriteParams unrotated = p;
  unrotated.rotation = kvq::RotationKind::kIdentity;
  unrotated.hadamard_block = 0;
  unrotated.bitrev = false;
  return kvq::cpu::QuantizeRows(backend, unrotated, nullptr, x, rows);
}

// Where flat element i of t lies: "row r, column c" over t's first dimension.
std::string Where(const kvq::Tensor& t, size_t i) {
  const size_t width = t.shape.empty() || t.shape[0] == 0
                           ? 1
                           : static_cast<size_t>(t.numel() / t.shape[0]);
  return "row " + std::to_string(i / width) + ", column " + std::to_string(i % width);
}

void RunDequantize(const DequantizeOptions& o) {
  kvq::cli::SelectedRotation(o.rotation);  // option errors before any file is read
  const kvq::Safetensors file = kvq::ReadSafetensors(o.in);
  kvq::WriteParams p = ReadParams(file, o.in, o.rotation);  // validated

  const kvq::Tensor& dequantized = file.Get("dequantized");
  KVQ_CHECK(dequantized.dtype == kvq::DType::kF32 && dequantized.shape.size() == 2, kMalformedFile,
            "'", o.in, "' tensor 'dequantized' is ", kvq::DTypeName(dequantized.dtype), " ",
            dequantized.ShapeString(), ", expected F32 [N, ", p.head_dim, "]");
  const size_t rows = static_cast<size_t>(dequantized.shape[0]);
  const size_t d = static_cast<size_t>(p.head_dim);
  const kvq::cpu::Backend& backend = kvq::cpu::BestBackend();

  // The write path run again on the stored rows: the tensors of this format, by name, dtype
  // and shape, then their bits.
  const kvq::cpu::QuantizedRows q = Rerun(file, o.in, p, backend, rows);
  for (const auto& [name, want] : q.Tensors(p)) {
    const kvq::Tensor& t = file.Get(name);
    KVQ_CHECK(t.dtype == want.dtype, kMalformedFile, "'", o.in, "' tensor '", name, "' is ",
              kvq::DTypeName(t.dtype), ", expected ", kvq::DTypeName(want.dtype));
    kvq::ExpectShape(t, want.shape, "'" + o.in + "' tensor '" + name + "'");
  }
  if (p.format != kvq::Format::kFp8E4m3) {  // (an e4m3 code may be any byte)
    const kvq::Tensor& codes = file.Get("codes");
    for (size_t i = 0; i < codes.bytes.size(); ++i) {
      KVQ_CHECK(codes.bytes[i] <= p.levels(), kMalformedFile, "'", o.in, "' code ",
                static_cast<int>(codes.bytes[i]), " at ", Where(codes, i), " exceeds ",
                p.levels(), " for ", p.bits, "-bit codes");
    }
  }
  // Every stored tensor against the rerun, in write-path order: the first that differs names
  // the stage that does not follow from the ones before it.
  for (const auto& [name, want] : q.Tensors(p)) {
    if (name == "rotated") continue;
    const kvq::Tensor& t = file.Get(name);
    const size_t item = kvq::DTypeSize(t.dtype);
    for (size_t i = 0; i * item < t.bytes.size(); ++i) {
      if (std::memcmp(t.bytes.data() + i * item, want.bytes.data() + i * item, item) == 0) {
        continue;
      }
      if (name == "dequantized") {
        const float have = t.data<float>()[i], rerun = want.data<float>()[i];
        KVQ_CHECK(false, kMalformedFile, "'", o.in, "' dequantized value at ", Where(t, i),
                  " is ", have, " (", Hex(kvq::F32Bits(have)), ") but the stored codes give ",
                  rerun, " (", Hex(kvq::F32Bits(rerun)), ")");
      }
      if (name == "packed") {
        KVQ_CHECK(false, kMalformedFile, "'", o.in, "' packed byte at ", Where(t, i), " is ",
                  static_cast<int>(t.bytes[i]), " but the codes pack to ",
                  static_cast<int>(want.bytes[i]));
      }
      KVQ_CHECK(false, kMalformedFile, "'", o.in, "' ", name, " at ", Where(t, i),
                " is not what clipping and quantizing 'rotated' gives");
    }
  }

  const std::vector<float> r = kvq::cli::ApplyRotationOptions(o.rotation, &p);
  // A file that records its dense R's fingerprint (every file kvq quantize writes) maps back
  // only through that R.
  const auto recorded = file.metadata.find("rotation_sha256");
  if (!r.empty() && recorded != file.metadata.end()) {
    const std::string given = kvq::cli::RotationFingerprint(r);
    KVQ_CHECK(given == recorded->second, kInvalidArgument, "rotation matrix '",
              o.rotation.matrix_path, "' (sha256 ", given.substr(0, 16), "...) is not the one '",
              o.in, "' was quantized with (sha256 ", recorded->second.substr(0, 16), "...)");
  }
  std::vector<float> x(rows * d);
  kvq::cpu::RotateInverse(backend, p, r.empty() ? nullptr : r.data(), q.dequantized.data(),
                          x.data(), rows);
  kvq::WriteNpy(o.out, kvq::cli::F32Tensor(x, rows, d));
}

}  // namespace

void setup_dequantize(CLI::App& app) {
  auto o = std::make_shared<DequantizeOptions>();
  CLI::App* command = app.add_subcommand(
      "dequantize", "check a quantized safetensors file and map its rows back: X = x̂·P_brᵀ·Rᵀ");
  command->add_option("--in", o->in, "safetensors written by kvq quantize")->required();
  command->add_option("--out", o->out, "output rows: float32 [N, d] .npy")
      ->required()
      ->check(kvq::cli::OutputFile());
  kvq::cli::AddRotationOptions(command, &o->rotation, /*allow_identity=*/true);
  command->callback([o] { RunDequantize(*o); });
}
