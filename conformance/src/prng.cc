// Seed derivation for the golden-vector generator (prng.h).
#include "kvq/conformance/prng.h"

#include <cmath>
#include <vector>

namespace kvq::conformance {

uint64_t Fnv1a64(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

uint64_t CaseSeed(uint64_t global_seed, const std::string& name) {
  SplitMix64 mix(global_seed ^ Fnv1a64(name));
  return mix.NextU64();
}

// A random orthogonal matrix: modified Gram-Schmidt (twice) in double over rows of uniform
// values, rounded once to fp32. Only +, -, *, / and sqrt, all correctly rounded: the same
// matrix on every machine.
std::vector<float> RandomOrthogonal(int d, SplitMix64* rng) {
  const size_t n = static_cast<size_t>(d);
  std::vector<double> q(n * n);
  for (double& v : q) v = rng->Uniform();
  for (size_t i = 0; i < n; ++i) {
    double* v = q.data() + i * n;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t j = 0; j < i; ++j) {
        const double* u = q.data() + j * n;
        double dot = 0.0;
        for (size_t k = 0; k < n; ++k) dot += v[k] * u[k];
        for (size_t k = 0; k < n; ++k) v[k] -= dot * u[k];
      }
    }
    double norm = 0.0;
    for (size_t k = 0; k < n; ++k) norm += v[k] * v[k];
    norm = std::sqrt(norm);
    for (size_t k = 0; k < n; ++k) v[k] /= norm;
  }
  std::vector<float> r(n * n);
  for (size_t k = 0; k < n * n; ++k) r[k] = static_cast<float>(q[k]);
  return r;
}

}  // namespace kvq::conformance
