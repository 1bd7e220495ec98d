// kvq dequantize --in Q.safetensors (--rotation R.npy | --hadamard [--block H] | --identity)
//                [--bitrev] --out X.npy
// Reads what `kvq quantize` wrote, checks it (metadata, shapes, code range, packing, that
// clipping and quantizing `rotated` again gives the stored tau/codes/scale/min, and that
// codes/scale/min re-dequantize to the stored `dequantized` bits), then maps the dequantized
// rows back to the original space: X = dequantized · P_brᵀ · Rᵀ (kvq::cpu::RotateInverse).
// The rotation options must name the rotation recorded in the file, and a dense R must be the
// one whose fingerprint the file records (rotation_sha256).
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
  const std::string& version = meta.String("spec_version");
  KVQ_CHECK(version == "1.0", kMalformedFile, "'", path, "' has spec_version '", version,
            "', expected '1.0'");
  const kvq::WriteParams p = kvq::GetWriteParams(meta, "");
  KVQ_CHECK(p.format == kvq::Format::kAffineToken, kMalformedFile, "'", path, "' has row format '",
            kvq::FormatName(p.format), "'; kvq dequantize reads affine_token rows");
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

// Clip and quantize the stored `rotated` rows again: tau, codes, scale and min must come out
// bit for bit as stored (the file is one write-path run, not a mix).
void CheckAgainstRotated(const kvq::Safetensors& file, const std::string& path,
                         const kvq::WriteParams& p, const kvq::cpu::Backend& backend, size_t rows) {
  const size_t d = static_cast<size_t>(p.head_dim), groups = static_cast<size_t>(p.num_groups());
  const kvq::Tensor& rotated = file.Get("rotated");
  std::vector<float> clipped(rotated.numel());
  std::memcpy(clipped.data(), rotated.bytes.data(), rotated.bytes.size());
  for (size_t i = 0; i < clipped.size(); ++i) {
    // The kernels assume what the write path guarantees: finite, |x| <= 2^126.
    KVQ_CHECK(!kvq::IsNonFinite(clipped[i]) && std::fabs(clipped[i]) <= kvq::kMaxRotatedAbs,
              kMalformedFile, "'", path, "' rotated value ", clipped[i], " at row ", i / d,
              ", column ", i % d, " is not finite or exceeds 2^126");
  }
  std::vector<float> tau(rows);
  std::vector<uint8_t> codes(rows * d);
  std::vector<uint16_t> scale(rows * groups), min(rows * groups);
  backend.write.clip(clipped.data(), tau.data(), rows, p);
  backend.write.quantize(clipped.data(), codes.data(), scale.data(), min.data(), rows, p);
  const auto compare = [&](const char* name, const void* want, size_t item, size_t width) {
    const kvq::Tensor& t = file.Get(name);
    for (size_t i = 0; i * item < t.bytes.size(); ++i) {
      KVQ_CHECK(std::memcmp(t.bytes.data() + i * item, static_cast<const uint8_t*>(want) + i * item,
                            item) == 0,
                kMalformedFile, "'", path, "' ", name, " at row ", i / width, ", column ",
                i % width, " is not what clipping and quantizing 'rotated' gives");
    }
  };
  compare("tau", tau.data(), sizeof(float), 1);
  compare("codes", codes.data(), 1, d);
  compare("scale", scale.data(), sizeof(uint16_t), groups);
  compare("min", min.data(), sizeof(uint16_t), groups);
}

void RunDequantize(const DequantizeOptions& o) {
  kvq::cli::SelectedRotation(o.rotation);  // option errors before any file is read
  const kvq::Safetensors file = kvq::ReadSafetensors(o.in);
  kvq::WriteParams p = ReadParams(file, o.in, o.rotation);  // validated

  const kvq::Tensor& dequantized = file.Get("dequantized");
  KVQ_CHECK(dequantized.dtype == kvq::DType::kF32 && dequantized.shape.size() == 2, kMalformedFile,
            "'", o.in, "' tensor 'dequantized' is ", kvq::DTypeName(dequantized.dtype), " ",
            dequantized.ShapeString(), ", expected F32 [N, ", p.head_dim, "]");
  const int64_t n = dequantized.shape[0];
  const int64_t d = p.head_dim, groups = p.num_groups();
  struct Expected {
    const char* name;
    kvq::DType dtype;
    std::vector<int64_t> shape;
  };
  const Expected expected[] = {
      {"dequantized", kvq::DType::kF32, {n, d}},
      {"rotated", kvq::DType::kF32, {n, d}},
      {"tau", kvq::DType::kF32, {n}},
      {"codes", kvq::DType::kU8, {n, d}},
      {"packed", kvq::DType::kU8, {n, p.code_bytes()}},
      {"scale", kvq::DType::kBF16, {n, groups}},
      {"min", kvq::DType::kBF16, {n, groups}},
  };
  for (const Expected& e : expected) {
    const kvq::Tensor& t = file.Get(e.name);
    KVQ_CHECK(t.dtype == e.dtype, kMalformedFile, "'", o.in, "' tensor '", e.name, "' is ",
              kvq::DTypeName(t.dtype), ", expected ", kvq::DTypeName(e.dtype));
    kvq::ExpectShape(t, e.shape, "'" + o.in + "' tensor '" + e.name + "'");
  }

  const size_t rows = static_cast<size_t>(n), dd = static_cast<size_t>(d);
  const kvq::Tensor& codes = file.Get("codes");
  for (size_t i = 0; i < codes.bytes.size(); ++i) {
    KVQ_CHECK(codes.bytes[i] <= p.levels(), kMalformedFile, "'", o.in, "' code ",
              static_cast<int>(codes.bytes[i]), " at row ", i / dd, ", column ", i % dd,
              " exceeds ", p.levels(), " for ", p.bits, "-bit codes");
  }
  const kvq::cpu::Backend& backend = kvq::cpu::BestBackend();
  CheckAgainstRotated(file, o.in, p, backend, rows);
  std::vector<uint8_t> packed(file.Get("packed").bytes.size());
  backend.write.pack(codes.bytes.data(), packed.data(), rows, p);
  const std::vector<uint8_t>& stored_packed = file.Get("packed").bytes;
  for (size_t i = 0; i < packed.size(); ++i) {
    const size_t width = static_cast<size_t>(p.code_bytes());
    KVQ_CHECK(packed[i] == stored_packed[i], kMalformedFile, "'", o.in, "' packed byte at row ",
              i / width, ", column ", i % width, " is ", static_cast<int>(stored_packed[i]),
              " but the codes pack to ", static_cast<int>(packed[i]));
  }

  std::vector<float> recomputed(rows * dd);
  backend.write.dequantize(codes.bytes.data(), file.Get("scale").data<uint16_t>(),
                           file.Get("min").data<uint16_t>(), recomputed.data(), rows, p);
  const float* stored = dequantized.data<float>();
  for (size_t i = 0; i < recomputed.size(); ++i) {
    const uint32_t want = kvq::F32Bits(recomputed[i]), have = kvq::F32Bits(stored[i]);
    KVQ_CHECK(want == have, kMalformedFile, "'", o.in, "' dequantized value at row ", i / dd,
              ", column ", i % dd, " is ", stored[i], " (", Hex(have),
              ") but codes/scale/min give ", recomputed[i], " (", Hex(want), ")");
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
  std::vector<float> x(rows * dd);
  kvq::cpu::RotateInverse(backend, p, r.empty() ? nullptr : r.data(), recomputed.data(), x.data(),
                          rows);
  kvq::WriteNpy(o.out, kvq::cli::F32Tensor(x, rows, dd));
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
