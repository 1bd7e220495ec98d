// Errors: one exception type with a code, thrown by every validating entry point.
// Kernels below the validating layer never throw; they assume checked inputs.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvq {

enum class ErrorCode {
  kInvalidArgument,   // a parameter value is not supported (head_dim, group, bits, clip, ...)
  kShapeMismatch,     // tensor shapes or sizes disagree
  kNonFinite,         // NaN or Inf (or a value whose rotation/range overflows) in the input
  kMalformedFile,     // a file does not follow its format
  kIoError,           // the OS refused a read or a write
  kUnsupported,       // a valid request this build cannot serve (e.g. no CUDA device)
  kMismatch,          // a conformance comparison failed
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string Concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws kvq::Error(code, message) unless `cond` holds. The message pieces are streamed
// together, so callers can name the offending value: KVQ_CHECK(d == 128, kInvalidArgument,
// "head_dim ", d, " is not supported").
#define KVQ_CHECK(cond, code, ...)                                                  \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      throw ::kvq::Error(::kvq::ErrorCode::code, ::kvq::detail::Concat(__VA_ARGS__)); \
    }                                                                               \
  } while (0)

}  // namespace kvq
