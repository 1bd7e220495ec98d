// The golden-vector generator's random numbers: splitmix64 and floats built from its bits with
// exact integer arithmetic, so a seed gives the same values with every compiler, standard
// library and CPU (std:: distributions are implementation-defined, so they are never used).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq::conformance {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t NextU64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // An integer in [0, n), n >= 1 (multiply-shift; the tiny bias does not matter here).
  uint32_t Below(uint32_t n) {
    return static_cast<uint32_t>(((NextU64() >> 32) * static_cast<uint64_t>(n)) >> 32);
  }
  bool Bit() { return (NextU64() >> 63) != 0; }
  // A multiple of 2^-23 in [-1, 1), built exactly from 24 random bits.
  float Uniform() {
    const int32_t k = static_cast<int32_t>(NextU64() >> 40) - (1 << 23);
    return static_cast<float>(k) * 1.1920928955078125e-07f;  // 2^-23: exact
  }
  // A multiple of 2^-24 in [0, 1).
  float Uniform01() {
    return static_cast<float>(NextU64() >> 40) * 5.9604644775390625e-08f;  // 2^-24
  }
  // A bell-shaped value in (-2, 2) with mean 0: the sum of four Uniform()s halved, summed as
  // integers (exact whatever the order) and rounded once to fp32.
  float Bell() {
    int64_t sum = 0;
    for (int i = 0; i < 4; ++i) sum += static_cast<int64_t>(NextU64() >> 40) - (1 << 23);
    return static_cast<float>(sum) * 5.9604644775390625e-08f;  // 2^-24: exact scaling
  }

 private:
  uint64_t state_;
};

// A random orthogonal d x d matrix, row-major fp32: modified Gram-Schmidt (twice) in double
// over rows of Uniform() values, rounded once to fp32. Only +, -, *, / and sqrt, all correctly
// rounded: the same matrix on every machine (the golden vectors' rotation fixtures use it).
std::vector<float> RandomOrthogonal(int d, SplitMix64* rng);

// FNV-1a of a string: turns a case name into a seed component, so adding or removing one case
// never changes another case's data.
uint64_t Fnv1a64(const std::string& text);

// The seed of one case: splitmix64 of (global seed XOR Fnv1a64(name)).
uint64_t CaseSeed(uint64_t global_seed, const std::string& name);

}  // namespace kvq::conformance
