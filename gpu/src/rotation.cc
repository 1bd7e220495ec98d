#include "kvq/gpu/rotation.h"

namespace kvq::gpu {

RotationArgs MakeRotationArgs(const WriteParams& p, const HeadData& heads) {
  RotationArgs r;
  r.kind = static_cast<int>(p.rotation);
  r.matrices = heads.rotation;  // read only for kDense
  r.fwht_block = p.fwht_block();
  r.fwht_scale = p.fwht_scale();
  r.bitrev = p.bitrev;
  return r;
}

}  // namespace kvq::gpu
