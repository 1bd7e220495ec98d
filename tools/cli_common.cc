#include "cli_common.h"

#include <cmath>

#include "kvq/common/orthogonality.h"
#include "kvq/conformance/sha256.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "kvq/common/error.h"

namespace kvq::cli {

void AddRotationOptions(CLI::App* command, RotationOptions* options, bool allow_identity) {
  command->add_option("--rotation", options->matrix_path,
                      "dense rotation R: float32 [d, d] .npy (rows are multiplied as x·R)");
  command->add_flag("--hadamard", options->hadamard, "normalised Walsh-Hadamard rotation (FWHT)");
  command->add_option("--block", options->block,
                      "FWHT block size for --hadamard (power of two, 16..d; default d)");
  if (allow_identity) command->add_flag("--identity", options->identity, "no rotation");
  command->add_flag("--bitrev", options->bitrev, "apply the bit-reversal permutation after R");
}

RotationKind SelectedRotation(const RotationOptions& options) {
  const int chosen = (options.matrix_path.empty() ? 0 : 1) + (options.hadamard ? 1 : 0) +
                     (options.identity ? 1 : 0);
  KVQ_CHECK(chosen == 1, kInvalidArgument,
            "give exactly one of --rotation, --hadamard, --identity (got ", chosen, ")");
  KVQ_CHECK(options.block == 0 || options.hadamard, kInvalidArgument, "--block ", options.block,
            " needs --hadamard");
  if (options.hadamard) return RotationKind::kHadamard;
  if (options.identity) return RotationKind::kIdentity;
  return RotationKind::kDense;
}

std::vector<float> ApplyRotationOptions(const RotationOptions& options, WriteParams* p) {
  p->rotation = SelectedRotation(options);
  p->hadamard_block = options.hadamard ? options.block : 0;
  p->bitrev = options.bitrev;
  if (p->rotation != RotationKind::kDense) return {};
  const Rows matrix = ReadRows(options.matrix_path, "rotation matrix");
  KVQ_CHECK(matrix.n == static_cast<size_t>(p->head_dim) && matrix.d == p->head_dim, kShapeMismatch,
            "rotation matrix '", options.matrix_path, "' has shape [", matrix.n, ", ", matrix.d,
            "], expected [", p->head_dim, ", ", p->head_dim, "] (head_dim of the input)");
  for (size_t i = 0; i < matrix.values.size(); ++i) {
    KVQ_CHECK(std::isfinite(matrix.values[i]), kNonFinite, "rotation matrix '",
              options.matrix_path, "' has ", matrix.values[i], " at row ",
              i / static_cast<size_t>(p->head_dim), ", column ", i % static_cast<size_t>(p->head_dim));
  }
  CheckOrthogonal(matrix.values.data(), p->head_dim,
                  "rotation matrix '" + options.matrix_path + "'");
  return matrix.values;
}

std::string RotationFingerprint(const std::vector<float>& rotation) {
  return conformance::Sha256Hex(reinterpret_cast<const uint8_t*>(rotation.data()),
                                rotation.size() * sizeof(float));
}

Rows ReadRows(const std::string& path, const std::string& what) {
  const Tensor t = ReadNpy(path);
  KVQ_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kF16, kInvalidArgument, what, " '", path,
            "' has dtype ", DTypeName(t.dtype), "; expected float32 (or float16)");
  KVQ_CHECK(t.shape.size() == 2, kShapeMismatch, what, " '", path, "' has shape ", t.ShapeString(),
            "; expected 2-D [rows, head_dim]");
  KVQ_CHECK(t.shape[1] <= std::numeric_limits<int>::max(), kShapeMismatch, what, " '", path,
            "' has ", t.shape[1], " columns");
  Rows rows;
  rows.n = static_cast<size_t>(t.shape[0]);
  rows.d = static_cast<int>(t.shape[1]);
  rows.values = t.ToF32();
  return rows;
}

float ParseFloatOption(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const float value = std::strtof(text.c_str(), &end);
  KVQ_CHECK(!text.empty() && end == text.c_str() + text.size() && errno == 0, kInvalidArgument,
            option, " '", text, "' is not a number");
  return value;
}

int ParseIntField(const std::string& what, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  KVQ_CHECK(!text.empty() && end == text.c_str() + text.size() && errno == 0 &&
                value >= std::numeric_limits<int>::min() &&
                value <= std::numeric_limits<int>::max(),
            kInvalidArgument, what, " '", text, "' is not an integer");
  return static_cast<int>(value);
}

namespace {

// A CLI11 validator from a check that throws kvq::Error: its message is the validator's.
CLI::Validator FromCheck(void (*check)(const std::string&), const char* name) {
  return CLI::Validator(
      [check](std::string& value) -> std::string {
        try {
          check(value);
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      },
      "", name);
}

}  // namespace

CLI::Validator OutputFile() { return FromCheck(&CheckOutputFile, "OUTPUT_FILE"); }

CLI::Validator OutputFolder() { return FromCheck(&CheckOutputFolder, "OUTPUT_FOLDER"); }

CLI::Validator WindowTokens() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long tokens = std::strtoll(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0') return "";  // not an integer: CLI11 says so
        if (tokens < 0) return value + " tokens is negative";
        if (errno == ERANGE || tokens > kMaxWindowTokens) {
          return value + " tokens exceeds the limit of " + std::to_string(kMaxWindowTokens) +
                 " for a bf16 window";
        }
        return "";
      },
      "", "WINDOW_TOKENS");
}

CLI::Validator Seed() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (!value.empty() && value.find_first_not_of("0123456789") == std::string::npos) {
          errno = 0;
          std::strtoull(value.c_str(), nullptr, 10);
          if (errno != ERANGE) return "";
        }
        return "'" + value + "' is not a seed (decimal digits, 0 to 2^64 - 1)";
      },
      "", "SEED");
}

std::function<void(int, int)> StderrProgress(const std::string& phase) {
  if (isatty(fileno(stderr)) == 0) return {};
  const auto start = std::chrono::steady_clock::now();
  return [phase, start](int done, int total) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "\r%s %d/%d, %.0f s ", phase.c_str(), done, total, seconds);
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

Tensor F32Tensor(const std::vector<float>& values, size_t n, size_t d) {
  return Tensor::F32({static_cast<int64_t>(n), static_cast<int64_t>(d)}, values);
}

}  // namespace kvq::cli
