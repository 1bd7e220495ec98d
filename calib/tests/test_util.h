// Shared by the calib/ tests (header only; not a test file itself): the small synthetic capture
// and scheme options most tests run on, an error expectation and a bitwise comparison.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/calib/schemes.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"

namespace kvq::calib::testing {

// Sanitizer builds (fuzz/run_sanitized_tests.sh) run the model-forward tests on smaller inputs:
// the instrumented fp32 GEMMs run ~30x slower there.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitizerBuild = true;
#else
inline constexpr bool kSanitizerBuild = false;
#endif

// The committed trained model A (calib/models/tiny-llama-a; the test targets define
// KVQ_MODELS_DIR).
inline const std::string kModelA = std::string(KVQ_MODELS_DIR) + "/tiny-llama-a";

// Synthetic capture options of the given shape; every other field keeps its default.
inline SynthOptions SynthShape(int num_layers, int num_q_heads, int num_kv_heads, int head_dim,
                               int64_t tokens, uint64_t seed) {
  SynthOptions o;
  o.seed = seed;
  o.num_layers = num_layers;
  o.num_q_heads = num_q_heads;
  o.num_kv_heads = num_kv_heads;
  o.head_dim = head_dim;
  o.tokens = tokens;
  return o;
}

// A small capture: 4 query heads over 2 KV heads, head_dim 64; the layer count, the token
// count and the seed are each test's own.
inline SynthOptions SmallSynthOptions(int num_layers, int64_t tokens, uint64_t seed) {
  return SynthShape(num_layers, 4, 2, 64, tokens, seed);
}

// Cache shape for the small captures: G = 32, 16 sink tokens, a recent window of 32, pages of
// 16 tokens, so a few hundred tokens already reach the quantized history.
inline SchemeOptions SmallSchemeOptions() {
  SchemeOptions o;
  o.group = 32;
  o.sink = 16;
  o.recent = 32;
  o.page = 16;
  return o;
}

// Expects `fn` to throw kvq::Error with `code` and a message containing `needle`.
template <typename Fn>
void ExpectError(Fn fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}


}  // namespace kvq::calib::testing
