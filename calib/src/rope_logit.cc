#include "kvq/calib/rope_logit.h"

#include <cmath>

#include "kvq/calib/random.h"
#include "kvq/common/error.h"

namespace kvq::calib {
namespace {

void CheckRope(int head_dim, double rope_base) {
  KVQ_CHECK(head_dim >= 2 && head_dim % 2 == 0, kInvalidArgument, "RoPE-logit MAE: head_dim ",
            head_dim, " must be even and >= 2");
  KVQ_CHECK(std::isfinite(rope_base) && rope_base > 0, kInvalidArgument,
            "RoPE-logit MAE: rope_base ", rope_base,
            " must be positive and finite (the capture's RoPE base undoes its RoPE)");
}

// θ_i = base^(−2i/d), i < d/2.
double Theta(int i, int head_dim, double rope_base) {
  return PortableExp(-(2.0 * i / head_dim) * PortableLog(rope_base));
}

// x ← R_angle·x on the rotate-half pairs, angle_i = a·θ_i.
void Rotate(double* x, int head_dim, double rope_base, double a) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    double s = 0, c = 0;
    PortableSinCos(a * Theta(i, head_dim, rope_base), &s, &c);
    const double lo = x[i], hi = x[i + half];
    x[i] = lo * c - hi * s;
    x[i + half] = hi * c + lo * s;
  }
}

}  // namespace

const std::vector<double>& RopeLogitOffsets() {
  static const std::vector<double> offsets = [] {
    std::vector<double> d(50);
    for (int j = 0; j < 50; ++j) d[j] = -1024.0 + 2048.0 * j / 49.0;
    return d;
  }();
  return offsets;
}

void UndoRope(double* x, int head_dim, double rope_base, double position) {
  CheckRope(head_dim, rope_base);
  Rotate(x, head_dim, rope_base, -position);
}

double RotatedLogit(const double* q, const double* k, int head_dim, double rope_base,
                    double delta) {
  CheckRope(head_dim, rope_base);
  std::vector<double> rk(k, k + head_dim);
  Rotate(rk.data(), head_dim, rope_base, delta);
  double dot = 0;
  for (int c = 0; c < head_dim; ++c) dot += q[c] * rk[c];
  return dot;
}

RopeLogitMae::RopeLogitMae(int head_dim, double rope_base, const std::vector<double>& offsets)
    : head_dim_(head_dim), half_(head_dim / 2) {
  CheckRope(head_dim, rope_base);
  KVQ_CHECK(!offsets.empty(), kInvalidArgument, "RoPE-logit MAE: no offset");
  theta_.resize(half_);
  for (int i = 0; i < half_; ++i) theta_[i] = Theta(i, head_dim, rope_base);
  cos_.resize(offsets.size() * half_);
  sin_.resize(cos_.size());
  for (size_t j = 0; j < offsets.size(); ++j) {
    KVQ_CHECK(std::isfinite(offsets[j]), kInvalidArgument, "RoPE-logit MAE: offset ", j, " is ",
              offsets[j]);
    for (int i = 0; i < half_; ++i) {
      PortableSinCos(offsets[j] * theta_[i], &sin_[j * half_ + i], &cos_[j * half_ + i]);
    }
  }
  e_.resize(head_dim);
  q_.resize(head_dim);
  a_.resize(half_);
  b_.resize(half_);
}

void RopeLogitMae::Add(const double* key_error, const double* query, int queries,
                       double position) {
  // R_{−p} on this row's pairs, shared by the key error and its queries.
  std::vector<double> c(half_), s(half_);
  for (int i = 0; i < half_; ++i) PortableSinCos(-position * theta_[i], &s[i], &c[i]);
  auto undo = [&](const double* x, double* y) {
    for (int i = 0; i < half_; ++i) {
      const double lo = x[i], hi = x[i + half_];
      y[i] = lo * c[i] - hi * s[i];
      y[i + half_] = hi * c[i] + lo * s[i];
    }
  };
  undo(key_error, e_.data());
  const size_t offsets = cos_.size() / half_;
  for (int r = 0; r < queries; ++r) {
    undo(query + static_cast<size_t>(r) * head_dim_, q_.data());
    // qᵀ·R_Δ·e = Σ_i cos(Δθ_i)·(q_i e_i + q_i' e_i') + sin(Δθ_i)·(q_i' e_i − q_i e_i'),
    // i' = i + d/2.
    for (int i = 0; i < half_; ++i) {
      const double ql = q_[i], qh = q_[i + half_], el = e_[i], eh = e_[i + half_];
      a_[i] = ql * el + qh * eh;
      b_[i] = qh * el - ql * eh;
    }
    for (size_t j = 0; j < offsets; ++j) {
      const double* cj = cos_.data() + j * half_;
      const double* sj = sin_.data() + j * half_;
      double logit = 0;
      for (int i = 0; i < half_; ++i) logit += cj[i] * a_[i] + sj[i] * b_[i];
      sum_ += std::fabs(logit);
    }
    terms_ += static_cast<int64_t>(offsets);
  }
}

}  // namespace kvq::calib
