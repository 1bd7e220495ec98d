// kvq quantize --in X.npy (--rotation R.npy | --hadamard [--block H] | --identity) [--bitrev]
//              --clip RHO [--format F] [--bits B] [--group G] [--norm] [--scale S]
//              --out Q.safetensors
// Runs the whole write path (kvq::cpu::QuantizeRows, best CPU backend) on X float32 [N, d] in
// any quantized format of formats.inc and stores every stage the format's write path produces
// (QuantizedRows::Tensors: rotated, the norm and normalized rows of a normed side, tau, the
// format's metadata planes, codes, packed codes, dequantized in the rotated space), plus the
// parameters as metadata (format "kvq-quantized"; spec_version "1.0" for affine_token, the
// version that brought the format otherwise; with a dense R its fingerprint
// `rotation_sha256`), which `kvq dequantize` checks. R must be orthogonal (CheckOrthogonal).
// --group is the channel group of affine_token and the tile's tokens of affine_tile (N must be
// a multiple of it); --norm divides affine_tile rows by their bf16 norm; --scale is fp8_e4m3's
// s^ (default 1); --bits is 2 or 4 (fp8_e4m3: 8, its default).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/metadata.h"
#include "kvq/common/params_builder.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

namespace {

struct QuantizeOptions {
  std::string in, out, clip, format = "affine_token", scale = "1";
  int bits = 0, group = 0;
  bool norm = false;
  kvq::cli::RotationOptions rotation;
};

void RunQuantize(const QuantizeOptions& o) {
  const kvq::Format format = kvq::ParseFormat(o.format);
  KVQ_CHECK(format != kvq::Format::kBf16, kInvalidArgument,
            "--format bf16 stores the rows themselves: nothing to quantize");
  const bool fp8 = format == kvq::Format::kFp8E4m3;
  const int bits = o.bits != 0 ? o.bits : (fp8 ? 8 : 0);
  KVQ_CHECK(bits != 0, kInvalidArgument, "--bits is required for --format ", o.format,
            " (2 or 4)");
  KVQ_CHECK(fp8 || o.group != 0, kInvalidArgument, "--group is required for --format ",
            o.format, format == kvq::Format::kAffineTile ? " (tokens per tile: 32, 64 or 128)"
                                                         : " (channels per group)");
  kvq::params::Write w = kvq::params::Write()
                             .format(format)
                             .bits(bits)
                             .group(o.group != 0 ? o.group : 64)  // (fp8_e4m3 has no groups)
                             .norm(o.norm)
                             .clip(kvq::cli::ParseFloatOption("--clip", o.clip))
                             .head_scale(kvq::cli::ParseFloatOption("--scale", o.scale));
  kvq::cli::SelectedRotation(o.rotation);  // option errors before any file is read
  const kvq::cli::Rows x = kvq::cli::ReadRows(o.in, "input");
  // Names an unsupported head_dim, group, bits, clip or scale before R is read.
  kvq::WriteParams p = w.head_dim(x.d).Build();
  const std::vector<float> r = kvq::cli::ApplyRotationOptions(o.rotation, &p);
  p.Validate();
  const kvq::cpu::QuantizedRows q = kvq::cpu::QuantizeRows(
      kvq::cpu::BestBackend(), p, r.empty() ? nullptr : r.data(), x.values.data(), x.n);

  kvq::Safetensors file;
  file.metadata = {{"format", "kvq-quantized"},
                   {"spec_version", kvq::FormatSpecVersion(p.format)}};
  kvq::PutWriteParams(p, "", &file.metadata);
  // The dense R the rows depend on, so that `kvq dequantize` can refuse another one.
  if (!r.empty()) file.metadata["rotation_sha256"] = kvq::cli::RotationFingerprint(r);
  for (auto& [name, tensor] : q.Tensors(p)) file.Add(name, std::move(tensor));
  kvq::WriteSafetensors(o.out, file);
}

}  // namespace

void setup_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* command = app.add_subcommand(
      "quantize", "rotate, clip, quantize and pack rows; store every stage in a safetensors file");
  command
      ->add_option("--in", o->in,
                   "input rows X: float32 [N, d] .npy (float16 is converted exactly)")
      ->required();
  command->add_option("--out", o->out, "output .safetensors")
      ->required()
      ->check(kvq::cli::OutputFile());
  command->add_option("--clip", o->clip, "clip ratio rho in (0, 1]; 1 never clips")->required();
  command->add_option("--format", o->format,
                      "history format: affine_token (default), affine_tile, fp8_e4m3")
      ->capture_default_str();
  command->add_option("--bits", o->bits, "bits per code: 2 or 4 (fp8_e4m3: 8, the default)");
  command->add_option("--group", o->group,
                      "affine_token: channels per (scale, min) group (32, 64, 128 or d); "
                      "affine_tile: tokens per tile (32, 64 or 128)");
  command->add_flag("--norm", o->norm, "affine_tile: divide each row by its bf16 norm");
  command->add_option("--scale", o->scale, "fp8_e4m3: the scale s^ (codes are e4m3(x / s^))")
      ->capture_default_str();
  kvq::cli::AddRotationOptions(command, &o->rotation, /*allow_identity=*/true);
  command->callback([o] { RunQuantize(*o); });
}
