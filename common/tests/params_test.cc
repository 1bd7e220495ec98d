// WriteParams::Validate: every supported configuration passes, each rejection names the value.
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/metadata.h"
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
  EXPECT_EQ(p.packed_bytes(), 32);
  EXPECT_EQ(LayoutOf(p).Bytes(PlaneRole::kCodes, 1, 1) + LayoutOf(p).Bytes(PlaneRole::kMetadata, 1, 1),
            40u);
  EXPECT_EQ(p.fwht_block(), 128);
  const FormatLayout l = LayoutOf(Params(256, 32, 4));
  EXPECT_EQ(l.Bytes(PlaneRole::kCodes, 1, 1) + l.Bytes(PlaneRole::kMetadata, 1, 1), 128u + 8 * 4);
}

TEST(WriteParams, RejectsEachUnsupportedValueByName) {
  using E = ErrorCode;
  for (int d : {0, 32, 96, 512, -128}) {
    ExpectError([&] { Params(d, 32, 2).Validate(); }, E::kInvalidArgument,
                {"head_dim " + std::to_string(d)});
  }
  for (int g : {0, 16, 48, 512}) {
    ExpectError([&] { Params(256, g, 2).Validate(); }, E::kInvalidArgument,
                {"group size " + std::to_string(g)});
  }
  // G = d is one group per row (spec 1.1), at d = 256 too; 256 is no group of d = 128.
  EXPECT_NO_THROW(Params(256, 256, 2).Validate());
  EXPECT_NO_THROW(Params(256, 256, 4).Validate());
  ExpectError([&] { Params(128, 256, 2).Validate(); }, E::kInvalidArgument, {"group size 256"});
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

// Spec 1.1: affine_tile takes G_k in {32, 64, 128} tokens (at every d, 128 > d = 64 too) and
// an optional norm; the norm needs a tile format and norm_heads >= 1; norm_heads without a norm
// is rejected.
TEST(WriteParams, TileAndNormRules) {
  using E = ErrorCode;
  for (int d : {64, 128, 256}) {
    for (int gk : {32, 64, 128}) {
      WriteParams p = Params(d, gk, 2);
      p.format = Format::kAffineTile;
      EXPECT_NO_THROW(p.Validate()) << d << " " << gk;
      EXPECT_EQ(p.tile_tokens(), gk);
      EXPECT_EQ(p.tile_channel_bytes(), gk / 4);
      p.norm = true;
      for (int heads : {1, 2, 3, 8}) {
        p.norm_heads = heads;
        EXPECT_NO_THROW(p.Validate());
        EXPECT_EQ(p.norm_span(), d * heads);
      }
    }
  }
  for (int gk : {16, 48, 256, 0}) {
    WriteParams p = Params(256, gk, 2);
    p.format = Format::kAffineTile;
    ExpectError([&] { p.Validate(); }, E::kInvalidArgument, {"tile size " + std::to_string(gk)});
  }
  WriteParams token = Params(128, 64, 2);
  EXPECT_EQ(token.tile_tokens(), 1);
  token.norm = true;
  ExpectError([&] { token.Validate(); }, E::kInvalidArgument, {"norm", "affine_token"});
  WriteParams tile = Params(128, 32, 2);
  tile.format = Format::kAffineTile;
  tile.norm_heads = 2;
  ExpectError([&] { tile.Validate(); }, E::kInvalidArgument, {"norm_heads 2", "without a norm"});
  tile.norm = true;
  tile.norm_heads = 0;
  ExpectError([&] { tile.Validate(); }, E::kInvalidArgument, {"norm_heads 0"});
}

// The planes of affine_tile and what they cost: codes per tile [d, G_k*b/8], (scale, min) per
// tile and channel, a norm per token (per head) or per token for all heads (shared).
TEST(FormatLayout, AffineTilePlanesAndBytes) {
  WriteParams p = Params(128, 32, 2);
  p.format = Format::kAffineTile;
  FormatLayout l = LayoutOf(p);
  ASSERT_EQ(l.num_planes, 3);
  EXPECT_EQ(l.tile_tokens, 32);
  EXPECT_EQ(std::string(l.plane(0).name), "codes");
  EXPECT_EQ(l.plane(0).row_bytes(), 128u * 8);
  EXPECT_EQ(l.plane(1).row_bytes(), 256u);
  EXPECT_EQ(l.RowsPerPage(0, 128), 4);
  // 32 tokens of 2 KV heads: 2 bits + 32 bits per channel per tile = 3 bits per element.
  EXPECT_EQ(8 * (l.Bytes(PlaneRole::kCodes, 32, 2) + l.Bytes(PlaneRole::kMetadata, 32, 2)),
            3u * 32 * 2 * 128);
  // A started tile is counted whole.
  EXPECT_EQ(l.Bytes(PlaneRole::kMetadata, 1, 1), 512u);
  p.norm = true;
  l = LayoutOf(p);
  ASSERT_EQ(l.num_planes, 4);
  EXPECT_EQ(std::string(l.plane(3).name), "norm");
  EXPECT_EQ(l.plane(3).scope, PlaneScope::kToken);
  EXPECT_EQ(l.PageBytes(3, 64, 4), 4u * 64 * 2);
  EXPECT_EQ(l.Bytes(PlaneRole::kMetadata, 32, 4), 4u * (512 + 32 * 2));
  p.norm_heads = 4;
  l = LayoutOf(p);
  ASSERT_EQ(l.num_planes, 4);
  EXPECT_EQ(l.plane(3).scope, PlaneScope::kSharedToken);
  EXPECT_EQ(l.HeadsPerPage(3, 4), 1);
  EXPECT_EQ(l.PageBytes(3, 64, 4), 64u * 2);
  EXPECT_EQ(l.Bytes(PlaneRole::kMetadata, 32, 4), 4u * 512 + 32 * 2);
  // Every head's row of a shared plane is the one row of its page.
  EXPECT_EQ(l.RowOffset(3, 64, 4, 2, 3, 5), l.RowOffset(3, 64, 4, 2, 0, 5));
  EXPECT_EQ(l.RowOffset(3, 64, 4, 2, 0, 5), (2u * 64 + 5) * 2);
  EXPECT_EQ(l.RowOffset(0, 64, 4, 2, 3, 33), ((2u * 4 + 3) * 2 + 1) * 128 * 8);
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// The one metadata codec (metadata.h): spec 1.0's keys are unchanged for the formats of 1.0 (no
// row_format, no norm keys), and spec 1.1's parameters round-trip with row_format, norm and
// norm_heads; a file without the norm keys reads as "no norm".
TEST(MetadataCodec, Spec11KeysOnlyWhereSpec11Says) {
  WriteParams token = Params(128, 64, 2);
  Metadata m;
  PutWriteParams(token, "", &m);
  EXPECT_EQ(m.count("row_format"), 0u);
  EXPECT_EQ(m.count("norm"), 0u);
  EXPECT_EQ(m.count("norm_heads"), 0u);
  EXPECT_EQ(m.size(), 7u);  // head_dim, group, bits, clip, rotation, hadamard_block, bitrev

  WriteParams tile = Params(256, 32, 4);
  tile.format = Format::kAffineTile;
  tile.norm = true;
  tile.norm_heads = 3;
  tile.rotation = RotationKind::kHadamard;
  Metadata t;
  PutWriteParams(tile, "key.", &t);
  EXPECT_EQ(t.at("key.row_format"), "affine_tile");
  EXPECT_EQ(t.at("key.norm"), "1");
  EXPECT_EQ(t.at("key.norm_heads"), "3");
  const WriteParams back = GetWriteParams(MetadataReader(t, "test"), "key.");
  EXPECT_EQ(back.format, Format::kAffineTile);
  EXPECT_EQ(back.group, 32);
  EXPECT_EQ(back.bits, 4);
  EXPECT_TRUE(back.norm);
  EXPECT_EQ(back.norm_heads, 3);
  EXPECT_EQ(back.rotation, RotationKind::kHadamard);
  t.erase("key.norm");
  t.erase("key.norm_heads");
  EXPECT_FALSE(GetWriteParams(MetadataReader(t, "test"), "key.").norm);
  // A norm on a format without a norm plane is a malformed file.
  Metadata bad;
  PutWriteParams(token, "", &bad);
  bad["norm"] = "1";
  bad["norm_heads"] = "1";
  testing::ExpectError([&] { GetWriteParams(MetadataReader(bad, "test"), ""); },
                       ErrorCode::kMalformedFile, {"norm"});
}


// Every row of write_params.inc round-trips through the metadata codec for every format, a
// later spec's key may be absent (the default is read), a spec 1.0 key may not (named), and
// a value that does not parse is named with its key.
TEST(MetadataCodec, EveryParameterRowRoundTrips) {
  const std::vector<WriteParams> cases = {
      params::Write().head_dim(64).group(32).bits(4).clip(0.875f).hadamard(16).bitrev(),
      params::Write().head_dim(256).tile(128).bits(2).rotation(RotationKind::kDense).norm()
          .norm_heads(8).clip(0.5f),
      params::Write().head_dim(128).fp8(0.0625f).hadamard(),
  };
  for (const WriteParams& p : cases) {
    p.Validate();
    Metadata m;
    PutWriteParams(p, "value.", &m);
    const WriteParams back = GetWriteParams(MetadataReader(m, "case"), "value.");
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label)                   \
  EXPECT_EQ(std::memcmp(&back.name, &p.name, sizeof(Type)), 0) << #name << " of " \
                                                                << params::Describe(p);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
  }
  // A bf16 side stores no format: the cache's `quantized` key says it.
  Metadata cache;
  PutCacheParams(params::Cache().kv_heads(2).q_heads(4).bf16(), &cache);
  EXPECT_EQ(GetCacheParams(MetadataReader(cache, "case")).value.format, Format::kBf16);
  // Keys of spec 1.0 are required, later ones optional.
  Metadata m;
  PutWriteParams(cases[1], "", &m);
  for (const char* key : {"head_dim", "group", "bits", "clip", "rotation", "hadamard_block",
                          "bitrev"}) {
    Metadata missing = m;
    missing.erase(key);
    testing::ExpectError([&] { GetWriteParams(MetadataReader(missing, "case"), ""); },
                         ErrorCode::kMalformedFile, {"case", key, "missing"});
  }
  Metadata without_format = m;
  without_format.erase("row_format");  // a 1.0 file: affine_token, where a norm is an error
  testing::ExpectError([&] { GetWriteParams(MetadataReader(without_format, "case"), ""); },
                       ErrorCode::kMalformedFile, {"norm is not supported"});
  Metadata fp8;
  PutWriteParams(cases[2], "", &fp8);
  fp8.erase("head_scale");
  EXPECT_EQ(GetWriteParams(MetadataReader(fp8, "case"), "").head_scale, 1.0f);
  for (const auto& [key, text] : std::vector<std::pair<std::string, std::string>>{
           {"bits", "two"}, {"clip", "0.5x"}, {"bitrev", "yes"}, {"rotation", "spin"},
           {"row_format", "int3"}}) {
    Metadata bad = m;
    bad[key] = text;
    testing::ExpectError([&] { GetWriteParams(MetadataReader(bad, "case"), ""); },
                         ErrorCode::kMalformedFile, {"case", text});
  }
}

// Describe prints, per format, the rows it shows, in list order.
TEST(WriteParams, DescribeShowsTheRowsOfTheFormat) {
  EXPECT_EQ(params::Describe(params::Write().head_dim(128).group(64).bits(2).clip(0.96f)
                                 .rotation(RotationKind::kDense).bitrev()),
            "d128 G64 b2 rho0.96 dense+br");
  EXPECT_EQ(params::Describe(params::Write().head_dim(64).tile(32).bits(4).hadamard(16).norm()
                                 .norm_heads(2)),
            "d64 affine_tile Gk32 b4 rho1 hadamard/h16 norm/heads2");
  EXPECT_EQ(params::Describe(params::Write().head_dim(128).fp8(0.5f)),
            "d128 fp8_e4m3 rho1 identity s0.5");
  EXPECT_EQ(params::Describe(params::Write().head_dim(256).format(Format::kBf16).bits(4)),
            "d256 bf16");
}


// Every KVQ_FORMAT_PARAM row names a row of write_params.inc (a misspelt name would make
// FormatReads silently false), and each format reads what its rules constrain.
TEST(WriteParams, FormatParamRowsNameParameterRows) {
  std::vector<std::string> rows;
#define KVQ_WRITE_PARAM(Type, name, init, key, spec, stored, shown, label) rows.push_back(#name);
#include "kvq/common/write_params.inc"
#undef KVQ_WRITE_PARAM
  int format_rows = 0;
#define KVQ_FORMAT_PARAM(Fmt, name)                                                    \
  ++format_rows;                                                                       \
  EXPECT_NE(std::find(rows.begin(), rows.end(), #name), rows.end()) << #Fmt " " #name; \
  EXPECT_TRUE(FormatReads(Format::k##Fmt, #name));
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT_PARAM
  EXPECT_GT(format_rows, 0);
  EXPECT_FALSE(FormatReads(Format::kAffineToken, "norm"));
  EXPECT_FALSE(FormatReads(Format::kFp8E4m3, "group"));
  EXPECT_FALSE(FormatReads(Format::kBf16, "bits"));
}

}  // namespace
}  // namespace kvq
