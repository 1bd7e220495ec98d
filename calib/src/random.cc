#include "kvq/calib/random.h"

#include <cmath>

namespace kvq::calib {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t DeriveSeed(uint64_t seed, std::initializer_list<uint64_t> path) {
  uint64_t state = seed;
  uint64_t key = SplitMix64(state);
  for (uint64_t part : path) {
    state = key ^ (part * 0xd1342543de82ef95ULL + 0x2545f4914f6cdd1dULL);
    key = SplitMix64(state);
  }
  return key;
}

// log(x) = e·ln2 + log(m), m in [√½, √2): log(m) = 2·atanh(f), f = (m−1)/(m+1), |f| ≤ 0.1716,
// by its odd series to f^17 (relative error < 1e-14), Horner with constant coefficients.
double PortableLog(double x) {
  int e = 0;
  double m = std::frexp(x, &e);  // exact: x = m·2^e, m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    e -= 1;
  }
  const double f = (m - 1.0) / (m + 1.0);
  const double s = f * f;
  static constexpr double kOddInverse[] = {1.0 / 3,  1.0 / 5,  1.0 / 7,  1.0 / 9,
                                           1.0 / 11, 1.0 / 13, 1.0 / 15, 1.0 / 17};
  double series = 0.0;
  for (int k = 7; k >= 0; --k) series = (series + kOddInverse[k]) * s;
  const double log_m = 2.0 * f * (1.0 + series);
  const double ln2_hi = 6.93147180369123816490e-01;  // fdlibm split of ln 2
  const double ln2_lo = 1.90821492927058770002e-10;
  return (static_cast<double>(e) * ln2_hi + log_m) + static_cast<double>(e) * ln2_lo;
}

// exp(x) = 2^n·exp(r), r = x − n·ln2 in [−ln2/2, ln2/2], Taylor series to degree 18.
double PortableExp(double x) {
  const double ln2_hi = 6.93147180369123816490e-01;
  const double ln2_lo = 1.90821492927058770002e-10;
  const double n = std::nearbyint(x / 0.69314718055994530942);
  const double r = (x - n * ln2_hi) - n * ln2_lo;
  double poly = 1.0;
  for (int k = 18; k >= 1; --k) poly = 1.0 + poly * r / k;
  return std::ldexp(poly, static_cast<int>(n));
}

// Cody–Waite reduction by π/2 with fdlibm's split constants (k·pio2_1 is exact for
// |k| < 2^20), then Taylor polynomials on [−π/4, π/4] (sin to r^15, cos to r^16: error
// < 1e-15) evaluated by Horner with constant coefficients, then the quadrant.
void PortableSinCos(double x, double* sin_x, double* cos_x) {
  const double pio2_1 = 1.57079632673412561417e+00;
  const double pio2_1t = 6.07710050650619224932e-11;
  const double k = std::nearbyint(x / 1.57079632679489661923);
  const double r = (x - k * pio2_1) - k * pio2_1t;
  const double r2 = r * r;
  // (−1)^n / (2n+1)! and (−1)^n / (2n)!, n = 1..8.
  static constexpr double kSin[] = {-1.0 / 6,           1.0 / 120,          -1.0 / 5040,
                                    1.0 / 362880,       -1.0 / 39916800,    1.0 / 6227020800,
                                    -1.0 / 1307674368000, 1.0 / 355687428096000};
  static constexpr double kCos[] = {-1.0 / 2,          1.0 / 24,          -1.0 / 720,
                                    1.0 / 40320,       -1.0 / 3628800,    1.0 / 479001600,
                                    -1.0 / 87178291200, 1.0 / 20922789888000};
  double s = 0.0;
  double c = 0.0;
  for (int n = 7; n >= 0; --n) {
    s = (s + kSin[n]) * r2;
    c = (c + kCos[n]) * r2;
  }
  s = r + r * s;
  c = 1.0 + c;
  const long quadrant = static_cast<long>(k) & 3;
  switch (quadrant) {
    case 0: *sin_x = s; *cos_x = c; break;
    case 1: *sin_x = c; *cos_x = -s; break;
    case 2: *sin_x = -s; *cos_x = -c; break;
    default: *sin_x = -c; *cos_x = s; break;
  }
}

Xoshiro256::Xoshiro256(uint64_t seed) {
  uint64_t state = seed;
  for (uint64_t& word : s_) word = SplitMix64(state);
}

uint64_t Xoshiro256::Next() {
  auto rotl = [](uint64_t v, int k) { return (v << k) | (v >> (64 - k)); };
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Xoshiro256::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

double Xoshiro256::UniformOpenZero() {
  return static_cast<double>((Next() >> 11) + 1) * 0x1.0p-53;
}

double Xoshiro256::Normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  const double radius = std::sqrt(-2.0 * PortableLog(UniformOpenZero()));
  double sin_a = 0.0;
  double cos_a = 0.0;
  PortableSinCos(6.28318530717958647692 * Uniform(), &sin_a, &cos_a);
  spare_ = radius * sin_a;
  has_spare_ = true;
  return radius * cos_a;
}

}  // namespace kvq::calib
