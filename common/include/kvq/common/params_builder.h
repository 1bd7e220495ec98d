// Fluent builders of the parameter structs, the one way tests, benchmarks, the golden-vector
// generator and the tools spell a configuration (XNNPACK tester style):
//   params::Write().head_dim(128).group(64).bits(2).rotation(RotationKind::kDense).clip(0.96f)
//   params::Write().tile(32).hadamard().norm().norm_heads(8)
//   params::Cache().kv_heads(2).q_heads(8).sink(4).recent(8).page(16).both(Write().bits(4))
// Unset fields keep the structs' defaults. Build() validates (kvq::Error naming the value);
// Unchecked() does not, for tests of the validation itself.
#pragma once

#include <string>

#include "kvq/common/params.h"

namespace kvq::params {

class Write {
 public:
  Write() = default;
  explicit Write(const WriteParams& p) : p_(p) {}

  // A setter per row of write_params.inc: head_dim(d), format(f), group(g), bits(b), clip(rho),
  // rotation(r), hadamard_block(h), bitrev(on), norm(on), norm_heads(n), head_scale(s).
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  Write& name(Type v) {                                                  \
    p_.name = v;                                                         \
    return *this;                                                        \
  }
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM

  // Presets of several fields.
  Write& bitrev() { return bitrev(true); }
  Write& norm() { return norm(true); }
  // FWHT with block h (0: the full transform).
  Write& hadamard(int block = 0) {
    p_.rotation = RotationKind::kHadamard;
    p_.hadamard_block = block;
    return *this;
  }
  // affine_tile over tiles of G_k tokens (G_k is the group field of a tile format).
  Write& tile(int tokens) {
    p_.format = Format::kAffineTile;
    p_.group = tokens;
    return *this;
  }
  // codebook rows (spec 1.3) at `bits` bits for every block without per-head widths: one
  // group a row (group = head_dim, so set head_dim first), no clip.
  Write& codebook_rows(int bits) {
    p_.format = Format::kCodebook;
    p_.bits = bits;
    p_.group = p_.head_dim;
    return *this;
  }
  // fp8_e4m3 (8-bit codes) with the fp32 scale s^ (spec 1.2).
  Write& fp8(float scale = 1.0f) {
    p_.format = Format::kFp8E4m3;
    p_.bits = 8;
    p_.head_scale = scale;
    return *this;
  }

  WriteParams Build() const;
  WriteParams Unchecked() const { return p_; }
  operator WriteParams() const { return Build(); }  // NOLINT: builders convert implicitly

 private:
  WriteParams p_;
};

class Cache {
 public:
  Cache() = default;
  explicit Cache(const CacheParams& p) : p_(p) {}

  Cache& kv_heads(int h) { p_.num_kv_heads = h; return *this; }
  Cache& q_heads(int h) { p_.num_q_heads = h; return *this; }
  Cache& sink(int s) { p_.sink = s; return *this; }
  Cache& recent(int w) { p_.recent = w; return *this; }
  Cache& flush(int f) { p_.flush = f; return *this; }
  Cache& page(int p) { p_.page_size = p; return *this; }
  Cache& softmax_scale(float s) { p_.softmax_scale = s; return *this; }
  Cache& key(const Write& w) { p_.key = w.Unchecked(); return *this; }
  Cache& value(const Write& w) { p_.value = w.Unchecked(); return *this; }
  Cache& both(const Write& w) { return key(w).value(w); }
  // The bf16 baseline cache (both formats bf16).
  Cache& bf16() {
    p_.key.format = p_.value.format = Format::kBf16;
    return *this;
  }

  CacheParams Build() const;
  CacheParams Unchecked() const { return p_; }
  operator CacheParams() const { return Build(); }  // NOLINT: builders convert implicitly

 private:
  CacheParams p_;
};

// One line for failure messages and test names: "d128 G64 b2 rho0.96 dense+br", and for a
// cache "Hq8 Hkv2 S4 W8 F1 P16 K[...] V[...]".
std::string Describe(const WriteParams& p);
std::string Describe(const CacheParams& p);

}  // namespace kvq::params
