// WriteParams::Validate: every supported configuration passes, each rejection names the value.
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvq/common/error.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::ExpectError;

WriteParams Params(int d, int g, int bits) {
  return params::Write().head_dim(d).group(g).bits(bits).Unchecked();
}

TEST(WriteParams, AcceptsEverySupportedConfiguration) {
  int accepted = 0;
  for (int d : {64, 128, 256}) {
    for (int g : {32, 64, 128}) {
      if (g > d) continue;
      for (int bits : {2, 4}) {
        for (float clip : {1e-6f, 0.5f, 0.96f, 1.0f}) {
          WriteParams p = Params(d, g, bits);
          p.clip = clip;
          for (bool bitrev : {false, true}) {
            p.bitrev = bitrev;
            p.rotation = RotationKind::kIdentity;
            p.hadamard_block = 0;
            EXPECT_NO_THROW(p.Validate());
            p.rotation = RotationKind::kDense;
            EXPECT_NO_THROW(p.Validate());
            p.rotation = RotationKind::kHadamard;
            for (int block = 16; block <= d; block *= 2) {
              p.hadamard_block = block;
              EXPECT_NO_THROW(p.Validate()) << d << " " << block;
              ++accepted;
            }
            p.hadamard_block = 0;
            EXPECT_NO_THROW(p.Validate());
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 0);
  const WriteParams p = Params(128, 64, 2);
  EXPECT_EQ(p.levels(), 3);
  EXPECT_EQ(p.num_groups(), 2);
  EXPECT_EQ(p.code_bytes(), 32);
  EXPECT_EQ(LayoutOf(p).Bytes(PlaneRole::kCodes, 1) + LayoutOf(p).Bytes(PlaneRole::kMetadata, 1),
            40u);
  EXPECT_EQ(p.fwht_block(), 128);
  const FormatLayout l = LayoutOf(Params(256, 32, 4));
  EXPECT_EQ(l.Bytes(PlaneRole::kCodes, 1) + l.Bytes(PlaneRole::kMetadata, 1), 128u + 8 * 4);
}

TEST(WriteParams, RejectsEachUnsupportedValueByName) {
  using E = ErrorCode;
  for (int d : {0, 32, 96, 512, -128}) {
    ExpectError([&] { Params(d, 32, 2).Validate(); }, E::kInvalidArgument,
                {"head_dim " + std::to_string(d)});
  }
  for (int g : {0, 16, 48, 256}) {
    ExpectError([&] { Params(256, g, 2).Validate(); }, E::kInvalidArgument,
                {"group size " + std::to_string(g)});
  }
  ExpectError([] { Params(64, 128, 2).Validate(); }, E::kInvalidArgument,
              {"group size 128", "head_dim 64"});
  for (int bits : {0, 1, 3, 8}) {
    ExpectError([&] { Params(128, 64, bits).Validate(); }, E::kInvalidArgument,
                {"bits " + std::to_string(bits)});
  }
  const std::pair<float, const char*> clips[] = {
      {0.0f, "clip ratio 0 "},
      {-0.5f, "clip ratio -0.5"},
      {1.5f, "clip ratio 1.5"},
      {std::nanf(""), "clip ratio nan"},
      {std::numeric_limits<float>::infinity(), "clip ratio inf"}};
  for (const auto& [clip, needle] : clips) {
    WriteParams p = Params(128, 64, 2);
    p.clip = clip;
    ExpectError([&] { p.Validate(); }, E::kInvalidArgument, {needle});
  }
  WriteParams unknown = Params(128, 64, 2);
  unknown.rotation = static_cast<RotationKind>(7);
  ExpectError([&] { unknown.Validate(); }, E::kInvalidArgument, {"rotation kind 7"});
  for (int block : {8, 24, 256, -16}) {
    WriteParams p = Params(128, 64, 2);
    p.rotation = RotationKind::kHadamard;
    p.hadamard_block = block;
    ExpectError([&] { p.Validate(); }, E::kInvalidArgument,
                {"hadamard block " + std::to_string(block), "[16, 128]"});
  }
  for (RotationKind kind : {RotationKind::kIdentity, RotationKind::kDense}) {
    WriteParams p = Params(128, 64, 2);
    p.rotation = kind;
    p.hadamard_block = 32;
    ExpectError([&] { p.Validate(); }, E::kInvalidArgument,
                {"hadamard block 32", RotationKindName(kind)});
  }
}

}  // namespace
}  // namespace kvq
