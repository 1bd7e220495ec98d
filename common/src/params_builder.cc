#include "kvq/common/params_builder.h"

#include <sstream>

#include "kvq/common/metadata.h"

namespace kvq::params {

WriteParams Write::Build() const {
  p_.Validate();
  return p_;
}

CacheParams Cache::Build() const {
  p_.Validate();
  return p_;
}

namespace {

// A value as Describe prints it: ParamText's, but a flag is its label alone.
template <typename T>
std::string Shown(T v) {
  return ParamText(v);
}
std::string Shown(bool) { return ""; }

}  // namespace

std::string Describe(const WriteParams& p) {
  std::string out;
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) \
  if (shown) out += std::string(label) + Shown(p.name);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
  return out;
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
