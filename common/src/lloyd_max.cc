#include "kvq/common/lloyd_max.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "kvq/common/error.h"

namespace kvq {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr double kHalfPi = 1.57079632679489661923;  // fp64(π/2), as std::asin(1.0) returns
constexpr double kGaussianZMax = 40.0;   // exp(−z²/2) underflows to 0 from z ≈ 38.6
constexpr int kNodes = 16;               // Gauss–Legendre points per piece
constexpr int kMaxNewtonSteps = 50;
constexpr int kMaxHalvings = 30;

struct GaussLegendre {
  double x[kNodes];
  double w[kNodes];
};

// P_n(x) and P_n'(x) by the three-term recurrence.
void Legendre(double x, double* p, double* dp) {
  double p0 = 1.0, p1 = x;
  for (int k = 2; k <= kNodes; ++k) {
    const double p2 = ((2 * k - 1) * x * p1 - (k - 1) * p0) / k;
    p0 = p1;
    p1 = p2;
  }
  *p = p1;
  *dp = kNodes * (x * p1 - p0) / (x * x - 1.0);
}

// The 16 nodes on [−1, 1]: Newton's method on P_16 from the usual cosine guesses (a fixed
// procedure, so the nodes are the same bits every run).
GaussLegendre MakeGaussLegendre() {
  GaussLegendre g;
  for (int i = 0; i < kNodes; ++i) {
    double x = std::cos(kPi * (i + 0.75) / (kNodes + 0.5));
    double p, dp;
    for (int it = 0; it < 100; ++it) {
      Legendre(x, &p, &dp);
      const double dx = p / dp;
      x -= dx;
      if (std::fabs(dx) < 1e-17) break;
    }
    Legendre(x, &p, &dp);
    g.x[i] = x;
    g.w[i] = 2.0 / ((1.0 - x * x) * dp * dp);
  }
  return g;
}

const GaussLegendre& Nodes() {
  static const GaussLegendre nodes = MakeGaussLegendre();
  return nodes;
}

// Neumaier's compensated sum: the quadrature adds up to a few thousand terms per cell.
class CompensatedSum {
 public:
  void Add(double x) {
    const double t = sum_ + x;
    error_ += std::fabs(sum_) >= std::fabs(x) ? (sum_ - t) + x : (x - t) + sum_;
    sum_ = t;
  }
  double Value() const { return sum_ + error_; }

 private:
  double sum_ = 0.0, error_ = 0.0;
};

// One coordinate's density in the integration variable u (lloyd_max.h): y = YOf(u), the
// (unnormalised) weight w(u) with f(y) dy = w(u) du.
class Marginal {
 public:
  Marginal(CodebookDensity density, int m) : beta_(density == CodebookDensity::kBeta), m_(m) {
    if (beta_) {
      n_ = m - 2.0;
      // cos^n θ has width ~1/√n around 0; a piece is at most that wide (and at most 0.25).
      piece_ = std::min(0.25, 1.0 / std::sqrt(n_ + 1.0));
    } else {
      sqrt_m_ = std::sqrt(static_cast<double>(m));
      piece_ = 1.0;
    }
  }

  double YMax() const { return beta_ ? 1.0 : kGaussianZMax / sqrt_m_; }

  double UOf(double y) const {
    if (y >= YMax()) return UMax();
    if (y <= -YMax()) return -UMax();
    return beta_ ? std::asin(y) : y * sqrt_m_;
  }

  double YOf(double u) const { return beta_ ? std::sin(u) : u / sqrt_m_; }

  // cos^n θ as exp(n·log1p(−2 sin²(θ/2))): pow(cos θ, n) would carry cos θ's rounding times n.
  double Weight(double u) const {
    if (!beta_) return std::exp(-0.5 * u * u);
    if (n_ == 0.0) return 1.0;
    const double s = std::sin(0.5 * u);
    return std::exp(n_ * std::log1p(-2.0 * s * s));
  }

  // f(y) = w(u)·du/dy on the scale of Weight (the Newton Jacobian needs it at boundaries).
  double DensityAtY(double y) const {
    if (beta_) return std::pow((1.0 - y) * (1.0 + y), 0.5 * (m_ - 3));
    const double z = y * sqrt_m_;
    return std::exp(-0.5 * z * z) * sqrt_m_;
  }

  // Visits the quadrature nodes of ∫_{ya}^{yb} … f(y) dy as visit(y, weight): composite
  // 16-point Gauss–Legendre in u on equal pieces no wider than piece_.
  template <typename Visit>
  void Integrate(double ya, double yb, Visit visit) const {
    const double ua = UOf(ya), ub = UOf(yb);
    if (!(ub > ua)) return;
    const int pieces = std::max(1, static_cast<int>(std::ceil((ub - ua) / piece_)));
    const double width = (ub - ua) / pieces, half = 0.5 * width;
    const GaussLegendre& gl = Nodes();
    for (int p = 0; p < pieces; ++p) {
      const double mid = ua + p * width + half;
      for (int i = 0; i < kNodes; ++i) {
        const double u = mid + half * gl.x[i];
        visit(YOf(u), gl.w[i] * half * Weight(u));
      }
    }
  }

  // Mass and first moment of [ya, yb].
  void Moments(double ya, double yb, double* m0, double* m1) const {
    CompensatedSum s0, s1;
    Integrate(ya, yb, [&](double y, double w) {
      s0.Add(w);
      s1.Add(w * y);
    });
    *m0 = s0.Value();
    *m1 = s1.Value();
  }

 private:
  double UMax() const { return beta_ ? kHalfPi : kGaussianZMax; }

  bool beta_;
  int m_;
  double n_ = 0.0, sqrt_m_ = 1.0, piece_ = 1.0;
};

// The Lloyd map on the positive half: cell i is [t_{i−1}, t_i] with t_{−1} = 0, t_{N−1} = y_max
// and t_i = (c_i + c_{i+1})/2 between; T_i = E[y | cell i]. Returns max |T_i − c_i|. With
// `lower, diagonal, upper` it also writes the tridiagonal Jacobian of T(c) − c:
// ∂T_i/∂t_i = f(t_i)(t_i − T_i)/M0_i, ∂T_i/∂t_{i−1} = f(t_{i−1})(T_i − t_{i−1})/M0_i, and
// ∂t/∂c = 1/2 for both neighbours.
double LloydMap(const Marginal& f, const std::vector<double>& c, std::vector<double>* t_out,
                std::vector<double>* lower = nullptr, std::vector<double>* diagonal = nullptr,
                std::vector<double>* upper = nullptr) {
  const size_t n = c.size();
  std::vector<double>& t = *t_out;
  t.resize(n);
  if (lower != nullptr) {
    lower->assign(n, 0.0);
    diagonal->assign(n, -1.0);
    upper->assign(n, 0.0);
  }
  double residual = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double ya = i == 0 ? 0.0 : 0.5 * (c[i - 1] + c[i]);
    const double yb = i + 1 == n ? f.YMax() : 0.5 * (c[i] + c[i + 1]);
    double m0, m1;
    f.Moments(ya, yb, &m0, &m1);
    t[i] = m1 / m0;
    residual = std::max(residual, std::fabs(t[i] - c[i]));
    if (lower != nullptr) {
      if (i > 0) {
        const double d = 0.5 * f.DensityAtY(ya) * (t[i] - ya) / m0;
        (*lower)[i] = d;
        (*diagonal)[i] += d;
      }
      if (i + 1 < n) {
        const double d = 0.5 * f.DensityAtY(yb) * (yb - t[i]) / m0;
        (*upper)[i] = d;
        (*diagonal)[i] += d;
      }
    }
  }
  return residual;
}

// Solves the tridiagonal system (Thomas algorithm, no pivoting: I − J_T is an M-matrix here).
std::vector<double> SolveTridiagonal(const std::vector<double>& lower,
                                     const std::vector<double>& diagonal,
                                     const std::vector<double>& upper,
                                     const std::vector<double>& rhs) {
  const size_t n = rhs.size();
  std::vector<double> up(n), x(n);
  for (size_t i = 0; i < n; ++i) {
    const double den = diagonal[i] - (i > 0 ? lower[i] * up[i - 1] : 0.0);
    up[i] = upper[i] / den;
    x[i] = (rhs[i] - (i > 0 ? lower[i] * x[i - 1] : 0.0)) / den;
  }
  for (size_t i = n - 1; i-- > 0;) x[i] -= up[i] * x[i + 1];
  return x;
}

bool Increasing(const Marginal& f, const std::vector<double>& c) {
  if (!(c.front() > 0.0) || !(c.back() < f.YMax())) return false;
  for (size_t i = 1; i < c.size(); ++i) {
    if (!(c[i] > c[i - 1])) return false;
  }
  return true;
}

// Width b+1's starting point: each cell of width b split at its centroid, the conditional mean
// of each half.
std::vector<double> SplitCells(const Marginal& f, const std::vector<double>& c) {
  std::vector<double> split;
  for (size_t i = 0; i < c.size(); ++i) {
    const double ya = i == 0 ? 0.0 : 0.5 * (c[i - 1] + c[i]);
    const double yb = i + 1 == c.size() ? f.YMax() : 0.5 * (c[i] + c[i + 1]);
    double m0, m1;
    f.Moments(ya, c[i], &m0, &m1);
    split.push_back(m1 / m0);
    f.Moments(c[i], yb, &m0, &m1);
    split.push_back(m1 / m0);
  }
  return split;
}

LloydMaxHalf Newton(const Marginal& f, std::vector<double> c, CodebookDensity density, int m,
                    int bits) {
  const size_t n = c.size();
  std::vector<double> t, lower, diagonal, upper, trial(n), trial_t;
  double residual = LloydMap(f, c, &t, &lower, &diagonal, &upper);
  for (int step = 0; step <= kMaxNewtonSteps; ++step) {
    KVQ_CHECK(step < kMaxNewtonSteps, kUnsupported, "Lloyd-Max (", CodebookDensityName(density),
              ", m ", m, ", bits ", bits, ") did not settle in ", kMaxNewtonSteps,
              " Newton steps (residual ", residual, ")");
    std::vector<double> rhs(n);  // (J_T − I)·δ = c − T
    for (size_t i = 0; i < n; ++i) rhs[i] = c[i] - t[i];
    const std::vector<double> delta = SolveTridiagonal(lower, diagonal, upper, rhs);
    bool accepted = false;
    double scale = 1.0;
    for (int halving = 0; halving <= kMaxHalvings && !accepted; ++halving, scale *= 0.5) {
      for (size_t i = 0; i < n; ++i) trial[i] = c[i] + scale * delta[i];
      accepted = Increasing(f, trial) && LloydMap(f, trial, &trial_t) < residual;
    }
    if (!accepted) return {c, step, residual};
    c = trial;
    residual = LloydMap(f, c, &t, &lower, &diagonal, &upper);
  }
  return {};  // not reached: the check above throws first
}

void CheckDimension(CodebookDensity density, int m) {
  const int min_m = density == CodebookDensity::kBeta ? 2 : 1;
  KVQ_CHECK(m >= min_m, kInvalidArgument, "m ", m, " is below ", min_m, " for the ",
            CodebookDensityName(density), " density");
}

}  // namespace

const char* CodebookDensityName(CodebookDensity density) {
  switch (density) {
    case CodebookDensity::kBeta: return "beta";
    case CodebookDensity::kGaussian: return "gaussian";
  }
  return "unknown";
}

CodebookDensity ParseCodebookDensity(const std::string& name) {
  for (CodebookDensity density : {CodebookDensity::kBeta, CodebookDensity::kGaussian}) {
    if (name == CodebookDensityName(density)) return density;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "codebook density '" + name + "' is not beta or gaussian");
}

std::vector<LloydMaxHalf> SolveLloydMax(CodebookDensity density, int m, int max_bits) {
  CheckDimension(density, m);
  KVQ_CHECK(max_bits >= 1 && max_bits <= 8, kInvalidArgument, "codebook width ", max_bits,
            " is not in 1..8");
  const Marginal f(density, m);
  std::vector<LloydMaxHalf> widths;
  double m0, m1;
  f.Moments(0.0, f.YMax(), &m0, &m1);
  widths.push_back({{m1 / m0}, 0, 0.0});  // one cell: T does not depend on c
  for (int bits = 2; bits <= max_bits; ++bits) {
    widths.push_back(Newton(f, SplitCells(f, widths.back().centroids), density, m, bits));
  }
  return widths;
}

double QuantizerMse(CodebookDensity density, int m, int bits, const float* centroids,
                    const float* boundaries) {
  CheckDimension(density, m);
  KVQ_CHECK(bits >= 1 && bits <= 8, kInvalidArgument, "codebook width ", bits,
            " is not in 1..8");
  const Marginal f(density, m);
  const int levels = 1 << bits;
  CompensatedSum mass, error;
  for (int i = 0; i < levels; ++i) {
    const double ya = i == 0 ? -f.YMax() : boundaries[i - 1];
    const double yb = i + 1 == levels ? f.YMax() : boundaries[i];
    const double c = centroids[i];
    f.Integrate(ya, yb, [&](double y, double w) {
      mass.Add(w);
      error.Add(w * (y - c) * (y - c));
    });
  }
  return m * (error.Value() / mass.Value());
}

}  // namespace kvq
