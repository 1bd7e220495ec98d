// Seed derivation for the golden-vector generator (prng.h).
#include "kvq/conformance/prng.h"

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

}  // namespace kvq::conformance
