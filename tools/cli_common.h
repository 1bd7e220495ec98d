// Option parsing and file loading shared by the kvq subcommands. Every helper throws
// kvq::Error with a one-line message naming the offending option, file or value; main.cc turns
// it into `kvq: error: ...` and a non-zero exit. Outputs go through the atomic writers, so a
// failed command leaves no partial file.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/params.h"

namespace kvq::cli {

// How rows are rotated: exactly one of --rotation R.npy, --hadamard [--block H], --identity,
// plus an optional --bitrev.
struct RotationOptions {
  std::string matrix_path;  // --rotation: float32 [d, d] npy (fp16 converted exactly)
  bool hadamard = false;    // --hadamard: normalised FWHT
  int block = 0;            // --block: FWHT block size, 0 = head_dim (only with --hadamard)
  bool identity = false;    // --identity
  bool bitrev = false;      // --bitrev: apply P_br after the rotation
};

// Registers --rotation, --hadamard, --block, --bitrev and (if allow_identity) --identity.
void AddRotationOptions(CLI::App* command, RotationOptions* options, bool allow_identity);

// The rotation the options name. Throws kInvalidArgument unless exactly one is given, or when
// --block comes without --hadamard.
RotationKind SelectedRotation(const RotationOptions& options);

// Sets p->rotation, p->hadamard_block and p->bitrev from the options and returns the dense
// matrix, row-major [d, d] with d = p->head_dim (empty for identity and Hadamard). Throws
// kShapeMismatch naming the file and both shapes when R is not [d, d].
std::vector<float> ApplyRotationOptions(const RotationOptions& options, WriteParams* p);

// Rows read from an npy file: float32 [n, d] used bit for bit as stored; float16 [n, d]
// converted exactly to fp32. Other dtypes and ranks are rejected (kInvalidArgument /
// kShapeMismatch) naming the file.
struct Rows {
  size_t n = 0;
  int d = 0;
  std::vector<float> values;  // [n, d]
};
Rows ReadRows(const std::string& path, const std::string& what);

// Parses a decimal float option exactly (strtof: correctly rounded); throws naming option and text.
float ParseFloatOption(const std::string& option, const std::string& text);
// Parses a base-10 integer (no sign tricks, no trailing characters); throws naming both.
int ParseIntField(const std::string& what, const std::string& text);

// Tensor factories for [n, d]-shaped outputs.
Tensor F32Tensor(const std::vector<float>& values, size_t n, size_t d);

}  // namespace kvq::cli
