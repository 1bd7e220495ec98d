#include "kvq/common/params_builder.h"

#include <sstream>

namespace kvq::params {

WriteParams Write::Build() const {
  p_.Validate();
  return p_;
}

CacheParams Cache::Build() const {
  p_.Validate();
  return p_;
}

std::string Describe(const WriteParams& p) {
  std::ostringstream os;
  os << "d" << p.head_dim;
  if (p.format != Format::kAffineToken) os << " " << FormatName(p.format);
  if (p.format == Format::kBf16) return os.str();
  if (p.format == Format::kFp8E4m3) {
    os << " s" << p.head_scale;
  } else {
    os << (p.format == Format::kAffineToken ? " G" : " Gk") << p.group << " b" << p.bits;
  }
  os << " rho" << p.clip << " " << RotationKindName(p.rotation);
  if (p.rotation == RotationKind::kHadamard && p.fwht_block() != p.head_dim) {
    os << "/h" << p.fwht_block();
  }
  if (p.bitrev) os << "+br";
  if (p.norm) os << " norm" << (p.norm_heads > 1 ? "/" + std::to_string(p.norm_heads) + "heads" : "");
  return os.str();
}

std::string Describe(const CacheParams& p) {
  std::ostringstream os;
  os << "Hq" << p.num_q_heads << " Hkv" << p.num_kv_heads << " S" << p.sink << " W" << p.recent
     << " F" << p.flush << " P" << p.page_size << " K[" << Describe(p.key) << "] V["
     << Describe(p.value) << "]";
  if (p.softmax_scale != 0.0f) os << " scale" << p.softmax_scale;
  return os.str();
}

}  // namespace kvq::params
