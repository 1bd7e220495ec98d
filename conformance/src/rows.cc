// Row generators of the tests and the golden vectors (kvq/conformance/rows.h). Every value is
// built with exact arithmetic from the generator's bits, so a seed gives the same rows
// everywhere.
#include "kvq/conformance/rows.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/common/numeric.h"

namespace kvq::conformance {
namespace {

// 2^e for e in [-149, 127], built from the bits (no libm).
float PowerOfTwo(int e) {
  if (e >= -126) return F32FromBits(static_cast<uint32_t>(e + 127) << 23);
  return F32FromBits(1u << (e + 149));  // subnormal
}

// A value in [1, 2) with 23 random fraction bits.
float Mantissa(SplitMix64* rng) {
  return F32FromBits(0x3f800000u | static_cast<uint32_t>(rng->NextU64() >> 41));
}

// +-2^e * Mantissa() for e uniform in [lo, hi].
float SignedPower(int lo, int hi, SplitMix64* rng) {
  const uint32_t span = static_cast<uint32_t>(hi - lo + 1);
  const float power = PowerOfTwo(lo + static_cast<int>(rng->Below(span)));
  const float magnitude = power * Mantissa(rng);  // exact: a power of two times [1, 2)
  return rng->Bit() ? -magnitude : magnitude;
}

}  // namespace

namespace {

enum Draw { kVectors, kVectorsEdge, kTests, kVectorsNamed, kBeyondRange };

struct RowKindInfo {
  RowKind kind;
  const char* id;
  Draw draw;
  bool norm_ok;
};

const std::vector<RowKindInfo>& RowKindInfos() {
  static const std::vector<RowKindInfo> infos = {
#define KVQ_ROW_KIND(Name, id, draw, norm_ok, summary) {RowKind::k##Name, #id, draw, norm_ok},
#include "kvq/conformance/row_kinds.inc"
#undef KVQ_ROW_KIND
  };
  return infos;
}

std::vector<RowKind> KindsWhere(bool (*keep)(const RowKindInfo&)) {
  std::vector<RowKind> kinds;
  for (const RowKindInfo& info : RowKindInfos()) {
    if (keep(info)) kinds.push_back(info.kind);
  }
  return kinds;
}

}  // namespace

const char* RowKindName(RowKind kind) {
  for (const RowKindInfo& info : RowKindInfos()) {
    if (info.kind == kind) return info.id;
  }
  return "?";
}

const std::vector<RowKind>& EdgeRowKinds() {
  static const std::vector<RowKind> kinds =
      KindsWhere([](const RowKindInfo& i) { return i.draw == kVectorsEdge; });
  return kinds;
}

const std::vector<RowKind>& AllRowKinds() {
  static const std::vector<RowKind> kinds = KindsWhere(
      [](const RowKindInfo& i) { return i.draw == kVectors || i.draw == kVectorsEdge; });
  return kinds;
}

std::vector<RowKind> TestRowKinds(bool within_write_range) {
  return within_write_range
             ? KindsWhere([](const RowKindInfo& i) { return i.draw != kBeyondRange; })
             : KindsWhere([](const RowKindInfo&) { return true; });
}

std::vector<RowKind> TestRowKinds(const WriteParams& p) {
  // A codebook row's segment norms overflow where a §5.1 norm would (numerics.md §5.4.2).
  if (!p.norm && p.format != Format::kCodebook) return TestRowKinds(true);
  return KindsWhere([](const RowKindInfo& i) { return i.draw != kBeyondRange && i.norm_ok; });
}

void FillRow(RowKind kind, const WriteParams& p, SplitMix64* rng, float* row) {
  const int d = p.head_dim;
  switch (kind) {
    case RowKind::kRandom: {
      const float scale = PowerOfTwo(static_cast<int>(rng->Below(9)) - 4);
      for (int j = 0; j < d; ++j) row[j] = rng->Uniform() * scale;
      break;
    }
    case RowKind::kHeavyTail: {
      for (int j = 0; j < d; ++j) row[j] = rng->Bell();
      for (int k = 0; k < 2; ++k) row[rng->Below(d)] *= 8.0f;
      break;
    }
    case RowKind::kZeros:
      for (int j = 0; j < d; ++j) row[j] = 0.0f;
      break;
    case RowKind::kNegativeZeros:
      for (int j = 0; j < d; ++j) row[j] = -0.0f;
      break;
    case RowKind::kMixedZeros:
      for (int j = 0; j < d; ++j) row[j] = rng->Bit() ? -0.0f : 0.0f;
      break;
    case RowKind::kConstant: {
      const float c = rng->Uniform() * 4.0f;
      for (int j = 0; j < d; ++j) row[j] = c;
      break;
    }
    case RowKind::kOutlier: {
      for (int j = 0; j < d; ++j) row[j] = rng->Uniform() * 0.5f;
      const float big = 960.0f + rng->Uniform01() * 64.0f;
      const uint32_t channel = rng->Below(d);
      row[channel] = rng->Bit() ? big : -big;
      break;
    }
    case RowKind::kSubnormal: {
      for (int j = 0; j < d; ++j) {
        const uint32_t mantissa = static_cast<uint32_t>(rng->NextU64() >> 41);  // 23 bits
        const uint32_t sign = rng->Bit() ? 0x80000000u : 0u;
        const bool zero = rng->Below(8) == 0;
        row[j] = zero ? 0.0f : F32FromBits(sign | mantissa);
      }
      break;
    }
    case RowKind::kTies: {
      const int levels = p.levels();
      // Channel groups of G (a tile format's G_k counts tokens: groups of min(G_k, d) here).
      const int group = p.group < d ? p.group : d;
      for (int g0 = 0; g0 < d; g0 += group) {
        float* x = row + g0;
        const float unit = PowerOfTwo(static_cast<int>(rng->Below(5)) - 2);
        float lo, hi;
        if ((g0 / group) % 2 == 0) {
          // s = unit exactly, min exact in bf16: (x - m) / s = k + 0.5 exactly.
          lo = -static_cast<float>(rng->Below(8)) * unit;
          hi = lo + static_cast<float>(levels) * unit;
          for (int j = 0; j < group; ++j) {
            x[j] = lo + (static_cast<float>(rng->Below(levels)) + 0.5f) * unit;
          }
        } else {
          // s = (1 + 2^-8) * unit and min = -(1 + 2^-8) * unit: both halfway between two bf16
          // values (bf16 keeps 7 fraction bits), so RNE decides.
          const float tie = 1.00390625f;  // 1 + 2^-8
          lo = -tie * unit;
          hi = lo + static_cast<float>(levels) * tie * unit;
          for (int j = 0; j < group; ++j) x[j] = lo + (hi - lo) * rng->Uniform01();
        }
        // The extremes at random places of the group.
        const int a = static_cast<int>(rng->Below(group));
        int b = static_cast<int>(rng->Below(group - 1));
        if (b >= a) ++b;
        x[a] = lo;
        x[b] = hi;
      }
      break;
    }
    case RowKind::kHuge: {
      for (int j = 0; j < d; ++j) {
        // One draw per statement: the order of calls inside an expression is unspecified.
        float magnitude;
        if (rng->Bit()) {
          const float power = PowerOfTwo(96 + static_cast<int>(rng->Below(15)));
          magnitude = power * (1.0f + rng->Uniform01());
        } else {
          magnitude = rng->Uniform();
        }
        row[j] = rng->Bit() ? -magnitude : magnitude;
      }
      break;
    }
    case RowKind::kDuplicates: {
      static const float kValues[] = {0.0f, 0.5f, -0.5f, 1.0f, -1.0f, 1.5f, -1.5f, 2.0f, -2.0f};
      for (int j = 0; j < d; ++j) row[j] = kValues[rng->Below(9)];
      break;
    }
    case RowKind::kBf16Bell:
      for (int j = 0; j < d; ++j) row[j] = RoundToBf16(4.0f * rng->Bell());
      break;
    case RowKind::kCauchy:
      for (int j = 0; j < d; ++j) {
        const float u = std::fabs(rng->Uniform()) + 9.5367431640625e-07f;  // + 2^-20
        const float v = rng->Bell() / u;  // IEEE division: the same bits everywhere
        row[j] = v > 1e6f ? 1e6f : (v < -1e6f ? -1e6f : v);
      }
      break;
    case RowKind::kSparseSpikes:
      for (int j = 0; j < d; ++j) {
        const float v = rng->Bell();
        row[j] = rng->Below(32) == 0 ? 100.0f * v : v;
      }
      break;
    case RowKind::kLargeScale:
      for (int j = 0; j < d; ++j) row[j] = PowerOfTwo(66) * rng->Bell();
      break;
    case RowKind::kTinyScale:
      for (int j = 0; j < d; ++j) row[j] = PowerOfTwo(-100) * rng->Bell();
      break;
    case RowKind::kSmallIntegers:
      for (int j = 0; j < d; ++j) row[j] = static_cast<float>(static_cast<int>(rng->Below(9)) - 4);
      break;
    case RowKind::kLargeOffset:
      for (int j = 0; j < d; ++j) row[j] = 1001.0f + static_cast<float>(rng->Below(3)) * 0.5f;
      break;
    case RowKind::kNearLimit:
      for (int j = 0; j < d; ++j) row[j] = -8.0e37f + static_cast<float>(j % 5) * 2.0e37f;
      break;
    case RowKind::kMinimal:
      for (int j = 0; j < d; ++j) {
        const uint32_t pick = rng->Below(3);
        const float v = pick == 0 ? 1.17549435e-38f : (pick == 1 ? 1.4e-45f : 0.0f);
        row[j] = rng->Bit() ? -v : v;
      }
      break;
    case RowKind::kRamp:
      for (int j = 0; j < d; ++j) {
        row[j] = static_cast<float>(j % 2 == 0 ? 1 : -1) * static_cast<float>(j / 2) * 0.5f;
      }
      break;
    case RowKind::kFarOutliers:
      for (int j = 0; j < d; ++j) row[j] = rng->Bell();
      for (int k = 0; k < 3; ++k) {
        const uint32_t channel = rng->Below(d);
        row[channel] = SignedPower(0, 100, rng);
      }
      break;
    case RowKind::kEqualMagnitudes: {
      const float c = Mantissa(rng);
      for (int j = 0; j < d; ++j) {
        if (rng->Below(10) == 0) {
          row[j] = 4.0f * rng->Bell();
        } else {
          row[j] = rng->Bit() ? -c : c;
        }
      }
      break;
    }
    case RowKind::kWideRange:
      for (int j = 0; j < d; ++j) row[j] = SignedPower(-100, 100, rng);
      break;
    case RowKind::kSignedOffset: {
      const float offset = SignedPower(9, 11, rng);
      // offset + 2^-10 * bell: the product is exact, so the one rounding is the sum's.
      for (int j = 0; j < d; ++j) row[j] = offset + PowerOfTwo(-10) * rng->Bell();
      break;
    }
    case RowKind::kOffsetChannels: {
      // The groups the format quantizes: G channels of the row (affine_token), or one channel
      // over the tile's tokens (affine_tile: the offset depends on the channel alone, so every
      // row of this kind in a tile shares it).
      const bool tile = p.format == Format::kAffineTile;
      const int group = tile ? 1 : (p.group < d ? p.group : d);
      const uint64_t salt = tile ? 0 : rng->NextU64();
      for (int g0 = 0; g0 < d; g0 += group) {
        SplitMix64 key(salt ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(g0 / group + 1)));
        // One draw per statement: the order of calls inside an expression is unspecified.
        const int e = 2 + static_cast<int>(key.Below(8));  // |offset| in [4, 2048)
        const int spread = e - 8 - static_cast<int>(key.Below(5));  // 2^-8 .. 2^-12 of it
        const float sign = key.Bit() ? -1.0f : 1.0f;
        const float offset = sign * PowerOfTwo(e) * Mantissa(&key);  // exact
        // offset + 2^spread * uniform: the product is exact, the sum rounds once.
        const float unit = PowerOfTwo(spread);
        for (int j = g0; j < g0 + group; ++j) row[j] = offset + unit * rng->Uniform();
      }
      break;
    }
    case RowKind::kFp16OverflowRange: {
      // 2^15 (1 + k 2^-23) with k < 0x7fe000: [32768, 65504), every value finite in fp16.
      for (int j = 0; j < d; ++j) {
        const float m = F32FromBits(0x3f800000u | rng->Below(0x7fe000u));
        const float v = PowerOfTwo(15) * m;
        row[j] = rng->Bit() ? -v : v;
      }
      if (p.format != Format::kAffineTile) {  // both signs in every group of channels
        const int group = p.group < d ? p.group : d;
        for (int g0 = 0; g0 < d; g0 += group) {
          row[g0] = std::fabs(row[g0]);
          row[g0 + 1] = -std::fabs(row[g0 + 1]);
        }
      }
      break;
    }
  }
}

std::vector<float> MakeRows(const std::vector<RowKind>& kinds, const WriteParams& p,
                            SplitMix64* rng, std::string* names) {
  const size_t d = static_cast<size_t>(p.head_dim);
  std::vector<float> rows(kinds.size() * d);
  if (names != nullptr) names->clear();
  for (size_t r = 0; r < kinds.size(); ++r) {
    FillRow(kinds[r], p, rng, rows.data() + r * d);
    if (names != nullptr) *names += (r ? "," : "") + std::string(RowKindName(kinds[r]));
  }
  return rows;
}

std::vector<float> MixedRows(size_t n, const WriteParams& p, SplitMix64* rng,
                             const std::vector<RowKind>& kinds) {
  const size_t d = static_cast<size_t>(p.head_dim);
  std::vector<float> rows(n * d);
  for (size_t r = 0; r < n; ++r) FillRow(kinds[r % kinds.size()], p, rng, rows.data() + r * d);
  return rows;
}

std::vector<float> Fp8BoundaryValues() {
  std::vector<float> positive;
  float previous = 0.0f;
  for (int code = 0; code <= 0x7e; ++code) {
    const float v = F32FromE4m3(static_cast<uint8_t>(code));
    positive.push_back(v);
    if (code > 0) {
      const float mid = (previous + v) / 2;  // exact: e4m3 values have 4 significant bits
      positive.push_back(mid);
      positive.push_back(std::nextafter(mid, 0.0f));
      positive.push_back(std::nextafter(mid, std::numeric_limits<float>::infinity()));
    }
    previous = v;
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {std::nextafter(448.0f, inf), 464.0f, std::nextafter(464.0f, 0.0f), 480.0f,
                  1e30f, std::numeric_limits<float>::max(), inf, 0.0009765625f /* 2^-10 */,
                  std::numeric_limits<float>::denorm_min(), 1e-40f}) {
    positive.push_back(v);
  }
  std::vector<float> values = positive;
  for (float v : positive) values.push_back(-v);
  return values;
}

}  // namespace kvq::conformance
