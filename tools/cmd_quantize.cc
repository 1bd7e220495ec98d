// kvq quantize --in X.npy (--rotation R.npy | --hadamard [--block H] | --identity) [--bitrev]
//              --clip RHO --bits {2,4} --group G --out Q.safetensors
// Runs the whole write path (kvq::cpu::QuantizeRows, best CPU backend) on X float32 [N, d] and
// stores every stage: rotated F32 [N, d], tau F32 [N], codes U8 [N, d], packed U8 [N, d·b/8],
// scale and min BF16 [N, d/G], dequantized F32 [N, d] (rotated space), plus the parameters as
// metadata (format "kvq-quantized", spec_version "1.0"; with a dense R its fingerprint
// `rotation_sha256`), which `kvq dequantize` checks. R must be orthogonal (CheckOrthogonal).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/common/io.h"
#include "kvq/common/metadata.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

namespace {

struct QuantizeOptions {
  std::string in, out, clip;
  int bits = 0, group = 0;
  kvq::cli::RotationOptions rotation;
};

template <typename T>
kvq::Tensor Rows2D(kvq::Tensor (*make)(std::vector<int64_t>, const std::vector<T>&),
                   const std::vector<T>& values, size_t n, size_t width) {
  return make({static_cast<int64_t>(n), static_cast<int64_t>(width)}, values);
}

void RunQuantize(const QuantizeOptions& o) {
  kvq::WriteParams p;
  p.clip = kvq::cli::ParseFloatOption("--clip", o.clip);
  p.bits = o.bits;
  p.group = o.group;
  kvq::cli::SelectedRotation(o.rotation);  // option errors before any file is read
  const kvq::cli::Rows x = kvq::cli::ReadRows(o.in, "input");
  p.head_dim = x.d;
  p.Validate();  // names an unsupported head_dim, group, bits or clip before R is read
  const std::vector<float> r = kvq::cli::ApplyRotationOptions(o.rotation, &p);
  p.Validate();
  const kvq::cpu::QuantizedRows q = kvq::cpu::QuantizeRows(
      kvq::cpu::BestBackend(), p, r.empty() ? nullptr : r.data(), x.values.data(), x.n);

  const size_t n = x.n, d = static_cast<size_t>(p.head_dim);
  const size_t groups = static_cast<size_t>(p.num_groups());
  kvq::Safetensors file;
  file.metadata = {{"format", "kvq-quantized"}, {"spec_version", "1.0"}};
  kvq::PutWriteParams(p, "", &file.metadata);
  // The dense R the rows depend on, so that `kvq dequantize` can refuse another one.
  if (!r.empty()) file.metadata["rotation_sha256"] = kvq::cli::RotationFingerprint(r);
  file.Add("rotated", Rows2D(&kvq::Tensor::F32, q.rotated, n, d));
  file.Add("tau", kvq::Tensor::F32({static_cast<int64_t>(n)}, q.tau));
  file.Add("codes", Rows2D(&kvq::Tensor::U8, q.codes, n, d));
  file.Add("packed", Rows2D(&kvq::Tensor::U8, q.packed, n, static_cast<size_t>(p.code_bytes())));
  file.Add("scale", Rows2D(&kvq::Tensor::BF16, q.scale, n, groups));
  file.Add("min", Rows2D(&kvq::Tensor::BF16, q.min, n, groups));
  file.Add("dequantized", Rows2D(&kvq::Tensor::F32, q.dequantized, n, d));
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
  command->add_option("--bits", o->bits, "bits per code: 2 or 4")->required();
  command->add_option("--group", o->group, "channels per (scale, min) group: 32, 64 or 128")
      ->required();
  kvq::cli::AddRotationOptions(command, &o->rotation, /*allow_identity=*/true);
  command->callback([o] { RunQuantize(*o); });
}
