#include "kvq/testbed/rapidcheck.h"

#include <algorithm>

#include "kvq/common/codebook.h"

namespace kvq::testbed {
namespace {

WriteParams QuantizerFor(int d) {
  WriteParams p;
  p.head_dim = d;
  p.group = *rc::gen::element(32, 64, 128, d);  // G = d: one (scale, min) per row
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

rc::Gen<WriteParams> ArbitraryTileParams(int heads) {
  return rc::gen::exec([heads] {
    WriteParams p = WriteFor(*rc::gen::element(64, 128, 256));
    p.format = Format::kAffineTile;
    p.group = *rc::gen::element(32, 64, 128);
    p.norm = *rc::gen::arbitrary<bool>();
    p.norm_heads = p.norm && heads > 1 && *rc::gen::arbitrary<bool>() ? heads : 1;
    p.Validate();
    return p;
  });
}

// A codebook side (spec 1.3) of head_dim d: widths 1..8, any transform but the clip (codebook
// rows are not clipped), Beta or Gaussian tables. Half of them take per-head block widths
// (MakeCache draws them), so their row limits are the largest any widths need: every width
// present (8 segments) and d code bytes (B_s = ceil(m_s w_s / 8) <= m_s).
WriteParams CodebookFor(int d) {
  WriteParams p = WriteFor(d);
  p.format = Format::kCodebook;
  p.bits = *rc::gen::inRange(1, 9);
  p.group = d;
  p.clip = 1.0f;
  p.codebook = *rc::gen::element(CodebookDensity::kBeta, CodebookDensity::kGaussian);
  if (*rc::gen::arbitrary<bool>()) {
    p.segments = kCodebookMaxSegments;
    p.code_bytes = d;
  }
  p.Validate();
  return p;
}

rc::Gen<CacheParams> ArbitraryCacheParams() {
  return rc::gen::exec([] {
    CacheParams c;
    c.num_kv_heads = *rc::gen::inRange(1, 4);
    c.num_q_heads = c.num_kv_heads * *rc::gen::inRange(1, 5);
    c.sink = *rc::gen::inRange(0, 21);
    c.recent = *rc::gen::inRange(0, 41);  // W = 0: every token after the sink is history
    c.flush = *rc::gen::inRange(1, 9);
    c.page_size = *rc::gen::element(16, 32, 64);
    const int d = *rc::gen::element(64, 128);
    c.key = WriteFor(d);
    c.value = WriteFor(d);
    // One in three: tiled keys (KIVI / OScaR), with a norm per head or per token; values tiled
    // or per token. F and P are then whole tiles.
    if (*rc::gen::inRange(0, 3) == 0) {
      c.key = *ArbitraryTileParams(c.num_kv_heads);
      c.key.head_dim = d;
      c.key.group = *rc::gen::element(32, 64);
      if (*rc::gen::inRange(0, 4) == 0) {
        c.value = *ArbitraryTileParams(1);
        c.value.head_dim = d;
        c.value.group = c.key.group;
      }
      c.flush = c.key.group * *rc::gen::inRange(1, 3);
      c.page_size = std::max(c.page_size, c.key.group) * *rc::gen::element(1, 2);
    } else if (*rc::gen::inRange(0, 4) == 0) {
      // One in four of the others: codebook keys (TurboQuant-MSE or per-head Block-GTQ widths)
      // over codebook values (K3V2 and the like: each side its own widths) or per-token ones.
      c.key = CodebookFor(d);
      if (*rc::gen::inRange(0, 3) != 0) c.value = CodebookFor(d);
    }
    if (*rc::gen::inRange(0, 8) == 0) c.key.format = c.value.format = Format::kBf16;
    c.Validate();
    return c;
  });
}

}  // namespace kvq::testbed
