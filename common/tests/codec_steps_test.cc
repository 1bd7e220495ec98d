// formats.inc's codec rows bind: each format's encode steps read only the clipped rows, what an
// earlier step wrote and the KV head's per-head arrays (head_data.inc: codebook widths), and
// write the decoded rows `y`; its decode steps read only what an earlier step wrote, a per-head
// array or what a plane stores, and write `y`; every plane stores an output of the write path.
// (cpu_ref's RunCodecStep binds arguments by exactly these names.)
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "kvq/common/format.h"
#include "kvq/common/head_data.h"
#include "kvq/common/stages.h"

namespace kvq {
namespace {

// The per-head arrays a step may read (head_data.inc's KVQ_HEAD_ARRAY rows).
std::set<std::string> HeadArrayRows() {
  std::set<std::string> rows;
#define KVQ_HEAD_ARRAY(name, Type, extent, use, fill, noun, valid, code, ...) rows.insert(#name);
#include "kvq/common/head_data.inc"
#undef KVQ_HEAD_ARRAY
  return rows;
}

// The plane sources of a format, from every KVQ_PLANE row of it (whatever the parameters).
std::set<std::string> PlaneSources(Format format) {
  std::set<std::string> sources;
#define KVQ_PLANE(Fmt, plane, source, dtype, role, scope, elements) \
  if (format == Format::k##Fmt) sources.insert(#source);
#include "kvq/common/formats.inc"
#undef KVQ_PLANE
  return sources;
}

// Walks the steps, checking each input is bound; returns the outputs written (y included).
std::set<std::string> Bind(Format format, CodecPass pass, const std::set<std::string>& given) {
  std::set<std::string> known = given;
  std::set<std::string> written;
  for (StageId id : CodecSteps(format, pass)) {
    const StageSpec& stage = GetStage(id);
    const std::string where = std::string(FormatName(format)) + " step " + stage.name;
    EXPECT_FALSE(stage.transform) << where << ": a codec step is a codec stage";
    EXPECT_EQ(stage.format, format) << where << ": a step of another format's codec";
    for (int i = 0; i < stage.num_args; ++i) {
      const StageArg& a = stage.args[i];
      if (a.is_input()) {
        EXPECT_TRUE(known.count(a.name)) << where << " reads '" << a.name << "' unbound";
      }
    }
    for (int i = 0; i < stage.num_args; ++i) {
      const StageArg& a = stage.args[i];
      if (a.is_output()) {
        const std::string name = a.dir == ArgDir::kOut && std::strcmp(a.name, "y") == 0
                                     ? "y" : a.expect;
        known.insert(name);
        written.insert(name);
      }
    }
  }
  return written;
}

TEST(CodecSteps, EveryFormatsStepsBind) {
  for (Format format : AllFormats()) {
    const std::string name = FormatName(format);
    const std::set<std::string> sources = PlaneSources(format);
    ASSERT_FALSE(sources.empty()) << name << " stores no plane";
    if (CodecSteps(format, CodecPass::kEncode).empty()) {
      EXPECT_TRUE(CodecSteps(format, CodecPass::kDecode).empty()) << name;
      EXPECT_EQ(sources, std::set<std::string>{"rows"}) << name << ": a format without a codec "
                                                           "stores its rows";
      continue;
    }
    std::set<std::string> inputs = HeadArrayRows();
    inputs.insert("x");
    const std::set<std::string> encoded = Bind(format, CodecPass::kEncode, inputs);
    EXPECT_TRUE(encoded.count("y")) << name << "'s encode steps never write the decoded rows y";
    for (const std::string& source : sources) {
      EXPECT_TRUE(encoded.count(source) || source == "norm")
          << name << " stores '" << source << "', which no encode step writes";
    }
    std::set<std::string> stored = sources;
    for (const std::string& row : HeadArrayRows()) stored.insert(row);
    const std::set<std::string> decoded = Bind(format, CodecPass::kDecode, stored);
    EXPECT_TRUE(decoded.count("y")) << name << "'s decode steps never write the decoded rows y";
    for (StageId id : CodecSteps(format, CodecPass::kDecode)) {
      const StageSpec& stage = GetStage(id);
      for (int i = 0; i < stage.num_args; ++i) {
        EXPECT_FALSE(stage.args[i].is_input() && std::strcmp(stage.args[i].name, "x") == 0)
            << name << " decode step " << stage.name << " reads the rows it should produce";
      }
    }
  }
}

// Every codec stage of stages.inc is a step of its format's codec (a stage no codec runs is
// dead weight the backends must still implement).
TEST(CodecSteps, EveryCodecStageIsAStep) {
  for (const StageSpec& stage : AllStages()) {
    if (stage.transform) continue;
    bool used = false;
    for (CodecPass pass : {CodecPass::kEncode, CodecPass::kDecode}) {
      for (StageId id : CodecSteps(stage.format, pass)) used = used || id == stage.id;
    }
    EXPECT_TRUE(used) << "stage " << stage.name << " is in no step list of format "
                      << FormatName(stage.format);
  }
}

}  // namespace
}  // namespace kvq
