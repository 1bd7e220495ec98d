// Option parsing and file loading shared by the kvq subcommands. Every helper throws
// kvq::Error with a one-line message naming the offending option, file or value; main.cc turns
// it into `kvq: error: ...` and exit status 2. Outputs go through kvq::WriteFile (io.h), so a
// failed command leaves no partial file, and their paths are checked before the work starts.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
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
// The fingerprint a file records of the dense rotation it depends on: the SHA-256 of R's fp32
// bytes (row-major, little-endian), lowercase hex.
std::string RotationFingerprint(const std::vector<float>& rotation);

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

// Option checks that CLI11 runs while it parses the command line, so a bad value fails before
// the command does any work (a typo in --json fails at once, not after a long run). CLI11
// reports "--option: <message>" and main.cc exits 2. Attach them to every option of their kind:
//   add_option("--out", ...)->check(OutputFile())
// OutputFile: kvq::CheckOutputFile (io.h): the folder exists and takes new files, the path is
// not a folder; a device, FIFO or descriptor link is written through (WriteFile's policy).
CLI::Validator OutputFile();
// OutputFolder: kvq::CheckOutputFolder: a folder that the command creates and fills.
CLI::Validator OutputFolder();
// WindowTokens: a bf16 window length (--sink S0, --recent W): an integer in
// [0, kMaxWindowTokens].
CLI::Validator WindowTokens();
// Seed: decimal digits only (CLI11 would wrap -1 to 2^64 - 1 and read 010 as octal 8).
CLI::Validator Seed();

// The largest bf16 sink or recent window the CLI takes: 65536 tokens. The CPU cache allocates
// both windows of every sequence up front (S0 + W rows of Hkv·d bf16 per side), whatever the
// sequence's length; a window of more than 64 Ki bf16 tokens makes a bf16 cache, not a
// quantized one, so no real run comes near the limit.
inline constexpr int64_t kMaxWindowTokens = 65536;

// A progress line on stderr for a long phase: "<phase> <done>/<total>, <elapsed> s", redrawn
// in place, ended with a newline when done == total. Only when stderr is a terminal (logs, and
// the single error line a failing command prints, stay clean); otherwise an empty callback.
std::function<void(int done, int total)> StderrProgress(const std::string& phase);


// Tensor factories for [n, d]-shaped outputs.
Tensor F32Tensor(const std::vector<float>& values, size_t n, size_t d);

}  // namespace kvq::cli
