#include "kvq/testbed/rapidcheck.h"

namespace kvq::testbed {
namespace {

WriteParams QuantizerFor(int d) {
  WriteParams p;
  p.head_dim = d;
  p.group = *rc::gen::element(32, 64, 128);
  if (p.group > d) p.group = d;
  p.bits = *rc::gen::element(2, 4);
  p.clip = *rc::gen::weightedOneOf<float>(
      {{3, rc::gen::element(1.0f, 0.96f, 0.92f, 0.8f, 0.5f)},
       {1, rc::gen::map(rc::gen::inRange(1, 1001), [](int i) { return i / 1000.0f; })}});
  return p;
}

WriteParams WriteFor(int d) {
  WriteParams p = QuantizerFor(d);
  p.rotation = *rc::gen::element(RotationKind::kIdentity, RotationKind::kDense,
                                 RotationKind::kHadamard);
  if (p.rotation == RotationKind::kHadamard) {
    const int block = *rc::gen::element(0, 16, 32, 64);
    p.hadamard_block = block <= d ? block : 0;
  }
  p.bitrev = *rc::gen::arbitrary<bool>();
  p.Validate();
  return p;
}

}  // namespace

rc::Gen<WriteParams> ArbitraryQuantizerParams() {
  return rc::gen::exec([] { return QuantizerFor(*rc::gen::element(64, 128, 256)); });
}

rc::Gen<WriteParams> ArbitraryWriteParams() {
  return rc::gen::exec([] { return WriteFor(*rc::gen::element(64, 128, 256)); });
}

rc::Gen<CacheParams> ArbitraryCacheParams() {
  return rc::gen::exec([] {
    CacheParams c;
    c.num_kv_heads = *rc::gen::inRange(1, 4);
    c.num_q_heads = c.num_kv_heads * *rc::gen::inRange(1, 5);
    c.sink = *rc::gen::inRange(0, 21);
    c.recent = *rc::gen::inRange(1, 41);
    c.flush = *rc::gen::inRange(1, 9);
    c.page_size = *rc::gen::element(16, 32, 64);
    const int d = *rc::gen::element(64, 128);
    c.key = WriteFor(d);
    c.value = WriteFor(d);
    if (*rc::gen::inRange(0, 8) == 0) c.key.format = c.value.format = Format::kBf16;
    c.Validate();
    return c;
  });
}

}  // namespace kvq::testbed
