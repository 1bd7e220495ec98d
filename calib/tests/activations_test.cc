// Activation files: round trip in every stored dtype, and each validation error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "kvq/calib/activations.h"
#include "kvq/calib/synth.h"
#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "test_util.h"

namespace kvq::calib {
namespace {

using testing::ExpectError;

Activations Small() { return Synthesize(testing::SmallSynthOptions(2, 16, 5)); }

TEST(Activations, RoundTripThroughAFileInEveryDtype) {
  const Activations acts = Small();
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    const std::string path = ::testing::TempDir() + "/acts_roundtrip.safetensors";
    WriteActivations(path, acts, dtype);
    const Activations back = ReadActivations(path);
    EXPECT_EQ(back.info.source, acts.info.source);
    EXPECT_EQ(back.info.num_layers, 2);
    EXPECT_EQ(back.info.num_q_heads, 4);
    EXPECT_EQ(back.info.num_kv_heads, 2);
    EXPECT_EQ(back.info.head_dim, 64);
    EXPECT_EQ(back.info.rope_base, 1e6);
    EXPECT_EQ(back.info.tokens, 16);
    EXPECT_EQ(back.info.calib_tokens, 8);
    for (int l = 0; l < 2; ++l) {
      for (size_t i = 0; i < acts.layers[l].k.size(); ++i) {
        const float original = acts.layers[l].k[i];
        // Synth values are bf16 already: bf16 and f32 storage keep them exactly, f16 rounds.
        const float expected = dtype == DType::kF16 ? F32FromF16(F16FromF32(original)) : original;
        ASSERT_EQ(back.layers[l].k[i], expected) << "layer " << l << " k element " << i;
      }
      if (dtype != DType::kF16) {
        EXPECT_EQ(back.layers[l].q, acts.layers[l].q);
        EXPECT_EQ(back.layers[l].v, acts.layers[l].v);
      }
    }
    std::remove(path.c_str());
  }
}

TEST(Activations, MetadataFollowsTheSpec) {
  const Safetensors file = ActivationsToSafetensors(Small(), DType::kBF16);
  EXPECT_EQ(file.metadata.at("format"), "kvq-activations");
  EXPECT_EQ(file.metadata.at("version"), "1");
  EXPECT_EQ(file.metadata.at("num_layers"), "2");
  EXPECT_EQ(file.metadata.at("rope_base"), "1e+06");  // shortest text that reads back exactly
  EXPECT_EQ(file.metadata.at("calib_tokens"), "8");
  EXPECT_EQ(file.Get("layers.1.q").shape, (std::vector<int64_t>{16, 4, 64}));
  EXPECT_EQ(file.Get("layers.0.v").shape, (std::vector<int64_t>{16, 2, 64}));
  EXPECT_EQ(file.Get("layers.0.v").dtype, DType::kBF16);
}

TEST(Activations, SegmentTokensRoundTripAndAreValidated) {
  Activations acts = Small();  // 16 tokens, 8 calibrate
  EXPECT_EQ(ActivationsToSafetensors(acts, DType::kBF16).metadata.count("segment_tokens"), 0u);
  acts.info.segment_tokens = 4;
  const Safetensors file = ActivationsToSafetensors(acts, DType::kBF16);
  EXPECT_EQ(file.metadata.at("segment_tokens"), "4");
  EXPECT_EQ(ActivationsFromSafetensors(file).info.segment_tokens, 4);
  EXPECT_EQ(acts.info.SegmentStart(0), 0);
  EXPECT_EQ(acts.info.SegmentStart(7), 4);
  EXPECT_EQ(acts.info.SegmentStart(8), 8);
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(RowsAfterSink(acts.info, 8, 1), (Ranges{{1, 4}, {5, 8}}));
  EXPECT_EQ(RowsAfterSink(acts.info, 10, 3), (Ranges{{3, 4}, {7, 8}}));  // [11, 10) is empty
  acts.info.segment_tokens = 0;
  EXPECT_EQ(RowsAfterSink(acts.info, 8, 2), (Ranges{{2, 8}}));
  acts.info.segment_tokens = 3;  // divides neither 16 nor 8
  ExpectError([&] { ValidateActivations(acts); }, ErrorCode::kInvalidArgument,
              "segment_tokens 3 must be 0 or divide tokens = 16 and calib_tokens = 8");
  acts.info.segment_tokens = 16;  // divides 16, not calib_tokens 8
  ExpectError([&] { ValidateActivations(acts); }, ErrorCode::kInvalidArgument,
              "segment_tokens 16");
}

TEST(Activations, NonFiniteValueIsNamedByLayerTensorTokenHeadChannel) {
  Activations acts = Small();
  acts.layers[1].k[(5 * 2 + 1) * 64 + 7] = std::nanf("");
  ExpectError([&] { ValidateActivations(acts); }, ErrorCode::kNonFinite,
              "layer 1 tensor k token 5 head 1 channel 7");
  // The same error surfaces through the reader.
  acts = Small();
  Safetensors file = ActivationsToSafetensors(acts, DType::kF32);
  for (auto& [name, t] : file.tensors) {
    if (name == "layers.0.q") t.data<float>()[(3 * 4 + 2) * 64 + 9] = INFINITY;
  }
  ExpectError([&] { ActivationsFromSafetensors(file); }, ErrorCode::kNonFinite,
              "layer 0 tensor q token 3 head 2 channel 9");
}

TEST(Activations, ReaderRejectsMalformedFiles) {
  const Safetensors good = ActivationsToSafetensors(Small(), DType::kBF16);
  {
    Safetensors f = good;
    f.metadata["format"] = "something-else";
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "format");
  }
  {
    Safetensors f = good;
    f.metadata["version"] = "2";
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "version 2");
  }
  {
    Safetensors f = good;
    f.metadata.erase("head_dim");
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "head_dim");
  }
  {
    Safetensors f = good;
    f.metadata["tokens"] = "16x";
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "tokens");
  }
  {  // a missing layer
    Safetensors f;
    f.metadata = good.metadata;
    for (const auto& [name, t] : good.tensors) {
      if (name != "layers.1.v") f.Add(name, t);
    }
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "layers.1.v");
  }
  {  // a layer beyond num_layers
    Safetensors f = good;
    f.metadata["num_layers"] = "1";
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "layers.1");
  }
  {  // inconsistent head count in one layer
    Safetensors f = good;
    for (auto& [name, t] : f.tensors) {
      if (name == "layers.1.k") t = Tensor::F32({16, 1, 64}, std::vector<float>(16 * 64, 0.0f));
    }
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kShapeMismatch, "layers.1.k");
  }
  {  // Hq not a multiple of Hkv
    Safetensors f = good;
    f.metadata["num_kv_heads"] = "3";
    EXPECT_THROW(ActivationsFromSafetensors(f), Error);
  }
  {  // unsupported head_dim
    Activations acts = Small();
    acts.info.head_dim = 32;
    ExpectError([&] { ValidateActivations(acts); }, ErrorCode::kInvalidArgument, "head_dim 32");
  }
  {  // calib_tokens beyond tokens
    Safetensors f = good;
    f.metadata["calib_tokens"] = "17";
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kInvalidArgument,
                "calib_tokens 17");
  }
  {  // integer dtype
    Safetensors f = good;
    for (auto& [name, t] : f.tensors) {
      if (name == "layers.0.k") t = Tensor::I32({16, 2, 64}, std::vector<int32_t>(16 * 2 * 64, 1));
    }
    ExpectError([&] { ActivationsFromSafetensors(f); }, ErrorCode::kMalformedFile, "I32");
  }
}

}  // namespace
}  // namespace kvq::calib
