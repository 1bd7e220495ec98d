#include "kvq/common/stages.h"

#include <cstring>

#include "kvq/common/error.h"

namespace kvq {
namespace {

// An argument's domain without a KVQ_ARG_DOMAIN row (stages.h).
Domain DefaultDomain(const StageArg& a, bool codebook) {
  if (a.dtype == DType::kU8 && a.extent == Extent::kRows) {
    return codebook ? Domain::kSegmentCodes : Domain::kCodes;
  }
  if (a.extent == Extent::kBlockWidths) return Domain::kWidths;
  if (a.dtype == DType::kBF16 && std::strcmp(a.name, "scale") == 0) return Domain::kNonNegative;
  return Domain::kAny;
}

StageSpec MakeSpec(StageId id, const char* name, const char* family, StageBackends backends,
                   std::initializer_list<StageArg> args) {
  StageSpec s{};
  s.id = id;
  s.name = name;
  s.family = family;
  s.backends = backends;
  s.transform = std::strcmp(family, "transform") == 0;
  s.format = s.transform ? Format::kAffineToken : ParseFormat(family);
  s.num_args = 0;
  for (const StageArg& a : args) {
    StageArg& arg = s.args[s.num_args++];
    arg = a;
    arg.domain = DefaultDomain(a, !s.transform && s.format == Format::kCodebook);
#define KVQ_ARG_DOMAIN(stage_name, arg_name, domain_)                               \
    if (std::strcmp(name, #stage_name) == 0 && std::strcmp(a.name, #arg_name) == 0) { \
      arg.domain = Domain::domain_;                                                    \
    }
#include "kvq/common/stages.inc"
#undef KVQ_ARG_DOMAIN
  }
  return s;
}

}  // namespace

const std::vector<StageSpec>& AllStages() {
  static const std::vector<StageSpec> stages = {
#define KVQ_ARG(name, expect, dtype, dir, extent) \
  StageArg{#name, #expect, DType::dtype, ArgDir::dir, Extent::extent, Domain::kAny},
#define KVQ_STAGE(name, Name, family, backends, params, args) \
  MakeSpec(StageId::k##Name, #name, #family, StageBackends::backends, {args}),
#include "kvq/common/stages.inc"
#undef KVQ_STAGE
#undef KVQ_ARG
  };
  return stages;
}

const StageSpec& GetStage(StageId id) { return AllStages()[static_cast<size_t>(id)]; }

const StageSpec* FindStage(const std::string& name) {
  for (const StageSpec& s : AllStages()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

const StageSpec& StageByName(const std::string& name) {
  if (const StageSpec* s = FindStage(name)) return *s;
  std::string names;
  for (const StageSpec& s : AllStages()) names += (names.empty() ? "" : ", ") + std::string(s.name);
  KVQ_CHECK(false, kInvalidArgument, "unknown stage '", name, "' (valid: ", names, ")");
  return AllStages().front();
}

bool StageApplies(const StageSpec& stage, const WriteParams& p) {
  return stage.transform || stage.format == p.format;
}

bool StageRuns(const StageSpec& stage, const WriteParams& p) {
  if (!StageApplies(stage, p)) return false;
  const std::string name = stage.name;
#define KVQ_STAGE_WHEN(stage_name, condition) \
  if (name == #stage_name) return (condition);
#include "kvq/common/stages.inc"
#undef KVQ_STAGE_WHEN
  return true;
}

size_t StageRowMultiple(const StageSpec& stage, const WriteParams& p) {
  for (int i = 0; i < stage.num_args; ++i) {
    const Extent e = stage.args[i].extent;
    if (e == Extent::kTileChannels || e == Extent::kTilePacked) {
      return static_cast<size_t>(p.tile_tokens());
    }
  }
  return 1;
}

std::vector<int64_t> ArgShape(Extent extent, int64_t n, const WriteParams& p) {
  const int64_t d = p.head_dim;
  switch (extent) {
    case Extent::kRows: return {n, d};
    case Extent::kRowScalars: return {n};
    case Extent::kMatrix: return {d, d};
    case Extent::kPacked: return {n, p.packed_bytes()};
    case Extent::kGroups: return {n, p.num_groups()};
    case Extent::kNormRows: return {n, p.norm_span()};
    case Extent::kTileChannels: return {n / p.tile_tokens(), d};
    case Extent::kTilePacked: return {n / p.tile_tokens(), d, p.tile_channel_bytes()};
    case Extent::kSegments: return {n, p.segments};
    case Extent::kCodeBytes: return {n, p.row_code_bytes()};
    case Extent::kBlockWidths: return {d / 2};
  }
  return {};
}

const char* ExtentAxes(Extent extent) {
  switch (extent) {
    case Extent::kRows: return "row, column";
    case Extent::kRowScalars: return "row";
    case Extent::kMatrix: return "row, column";
    case Extent::kPacked: return "row, byte";
    case Extent::kGroups: return "row, group";
    case Extent::kNormRows: return "row, column of the norm's span";
    case Extent::kTileChannels: return "tile, channel";
    case Extent::kTilePacked: return "tile, channel, byte";
    case Extent::kSegments: return "row, segment";
    case Extent::kCodeBytes: return "row, byte";
    case Extent::kBlockWidths: return "block";
  }
  return "";
}

size_t ArgElements(Extent extent, int64_t n, const WriteParams& p) {
  size_t count = 1;
  for (int64_t e : ArgShape(extent, n, p)) count *= static_cast<size_t>(e);
  return count;
}

const std::vector<StageId>& CodecSteps(Format format, CodecPass pass) {
  static const std::vector<std::vector<StageId>> steps = [] {
    std::vector<std::vector<StageId>> list(AllFormats().size() * 2);
#define KVQ_CODEC_STEP(Fmt, pass_, Stage)                                                 \
  list[static_cast<size_t>(Format::k##Fmt) * 2 + static_cast<size_t>(CodecPass::pass_)] \
      .push_back(StageId::k##Stage);
#include "kvq/common/formats.inc"
#undef KVQ_CODEC_STEP
    return list;
  }();
  const size_t i = static_cast<size_t>(format) * 2 + static_cast<size_t>(pass);
  KVQ_CHECK(i < steps.size(), kInvalidArgument, "format ", static_cast<int>(format),
            " is unknown");
  return steps[i];
}

}  // namespace kvq
