// Seeded pseudo-random numbers whose every bit is fixed by the seed on any machine: SplitMix64
// for seeding, xoshiro256** for the stream, and normals by Box–Muller through the portable
// math below (never the standard library's distributions, whose algorithms differ between
// implementations, nor libm, whose last bits may differ between CPUs).
#pragma once

#include <cstdint>
#include <initializer_list>

namespace kvq::calib {

// SplitMix64 step: advances `state` and returns the next output (Steele et al. 2014).
uint64_t SplitMix64(uint64_t& state);

// A stream key from a seed and a path of integers (layer, head, ...): hashing the path
// lets every unit of work draw its own stream, so results do not depend on thread order.
uint64_t DeriveSeed(uint64_t seed, std::initializer_list<uint64_t> path);

// Portable elementary functions in fp64 built from + - * / only (no FMA: the project compiles
// with -ffp-contract=off), accurate to a few ulp over the ranges used here.
double PortableLog(double x);                         // x > 0 and finite
double PortableExp(double x);                         // |x| < 700
void PortableSinCos(double x, double* sin_x, double* cos_x);  // any finite x; |x| ≲ 1e6 keeps ~1e-10 accuracy

class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed);
  uint64_t Next();
  // Uniform in [0, 1) with 53 random bits.
  double Uniform();
  // Uniform in (0, 1]: never 0, so its logarithm is finite.
  double UniformOpenZero();
  // Standard normal by Box–Muller; the second value of each pair is kept for the next call.
  double Normal();

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0.0;
};

}  // namespace kvq::calib
