// kvq rotate --in X.npy (--rotation R.npy | --hadamard [--block H] | --identity) [--bitrev]
//            --out Y.npy
// Y = X·R (then P_br with --bitrev) for X float32 [N, d], R float32 [d, d], computed by the
// best CPU backend with the spec's bit-exact rotation (kvq::cpu::Rotate).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "kvq/common/io.h"
#include "kvq/common/params_builder.h"
#include "kvq/cpu_ref/kernels.h"
#include "kvq/cpu_ref/write_path.h"

namespace {

struct RotateOptions {
  std::string in, out;
  kvq::cli::RotationOptions rotation;
};

void RunRotate(const RotateOptions& o) {
  kvq::cli::SelectedRotation(o.rotation);  // option errors before any file is read
  const kvq::cli::Rows x = kvq::cli::ReadRows(o.in, "input");
  // (the group is unused by the rotation; 32 is valid for every head_dim)
  kvq::WriteParams p = kvq::params::Write().head_dim(x.d).group(32).Unchecked();
  const std::vector<float> r = kvq::cli::ApplyRotationOptions(o.rotation, &p);
  std::vector<float> y(x.values.size());
  kvq::cpu::Rotate(kvq::cpu::BestBackend(), p, r.empty() ? nullptr : r.data(), x.values.data(),
                   y.data(), x.n);
  kvq::WriteNpy(o.out, kvq::cli::F32Tensor(y, x.n, static_cast<size_t>(x.d)));
}

}  // namespace

void setup_rotate(CLI::App& app) {
  auto o = std::make_shared<RotateOptions>();
  CLI::App* command = app.add_subcommand("rotate", "rotate rows: Y = X·R (then P_br)");
  command
      ->add_option("--in", o->in,
                   "input rows X: float32 [N, d] .npy (float16 is converted exactly)")
      ->required();
  command->add_option("--out", o->out, "output rows Y: float32 [N, d] .npy")
      ->required()
      ->check(kvq::cli::OutputFile());
  kvq::cli::AddRotationOptions(command, &o->rotation, /*allow_identity=*/true);
  command->callback([o] { RunRotate(*o); });
}
