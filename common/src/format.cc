#include "kvq/common/format.h"

#include <cstring>
#include <string>

#include "kvq/common/error.h"
#include "kvq/common/params.h"

namespace kvq {
namespace {

struct FormatEntry {
  Format format;
  const char* name;
  const char* spec;
  const char* summary;
};

constexpr FormatEntry kFormats[] = {
#define KVQ_FORMAT(id, Name, tile_tokens, spec, summary) {Format::k##Name, #id, spec, summary},
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
};

const FormatEntry& Entry(Format format) {
  for (const FormatEntry& e : kFormats) {
    if (e.format == format) return e;
  }
  KVQ_CHECK(false, kInvalidArgument, "format ", static_cast<int>(format), " is unknown");
  return kFormats[0];
}

}  // namespace

const std::vector<Format>& AllFormats() {
  static const std::vector<Format> formats = [] {
    std::vector<Format> list;
    for (const FormatEntry& e : kFormats) list.push_back(e.format);
    return list;
  }();
  return formats;
}

const char* FormatName(Format format) { return Entry(format).name; }
const char* FormatSummary(Format format) { return Entry(format).summary; }
const char* FormatSpecVersion(Format format) { return Entry(format).spec; }

bool FormatReads(Format format, const char* param) {
#define KVQ_FORMAT_PARAM(Fmt, name) \
  if (format == Format::k##Fmt && std::strcmp(param, #name) == 0) return true;
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT_PARAM
  return false;
}

Format ParseFormat(const std::string& name) {
  std::string names;
  for (const FormatEntry& e : kFormats) {
    if (name == e.name) return e.format;
    names += names.empty() ? e.name : std::string(", ") + e.name;
  }
  KVQ_CHECK(false, kInvalidArgument, "unknown format '", name, "' (valid: ", names, ")");
  return kFormats[0].format;
}

int FormatLayout::Find(const std::string& name) const {
  for (int i = 0; i < num_planes; ++i) {
    if (name == planes[i].name) return i;
  }
  return -1;
}

int64_t FormatLayout::RowsPerPage(int plane, int page_size) const {
  return planes[plane].scope == PlaneScope::kTile ? page_size / tile_tokens : page_size;
}

int64_t FormatLayout::HeadsPerPage(int plane, int num_kv_heads) const {
  return planes[plane].scope == PlaneScope::kSharedToken ? 1 : num_kv_heads;
}

size_t FormatLayout::PageBytes(int plane, int page_size, int num_kv_heads) const {
  return static_cast<size_t>(HeadsPerPage(plane, num_kv_heads)) *
         static_cast<size_t>(RowsPerPage(plane, page_size)) * planes[plane].row_bytes();
}

size_t FormatLayout::RowOffset(int plane, int page_size, int num_kv_heads, int64_t page,
                               int head, int64_t token_in_page) const {
  const PlaneSpec& s = planes[plane];
  const int64_t per_row = s.scope == PlaneScope::kTile ? tile_tokens : 1;
  const int64_t h = s.scope == PlaneScope::kSharedToken ? 0 : head;
  const int64_t row = (page * HeadsPerPage(plane, num_kv_heads) + h) * RowsPerPage(plane, page_size) +
                      token_in_page / per_row;
  return static_cast<size_t>(row) * s.row_bytes();
}

size_t FormatLayout::Bytes(PlaneRole role, int64_t tokens, int num_kv_heads) const {
  size_t bytes = 0;
  for (int i = 0; i < num_planes; ++i) {
    const PlaneSpec& s = planes[i];
    if (s.role != role) continue;
    const int64_t rows =
        s.scope == PlaneScope::kTile ? (tokens + tile_tokens - 1) / tile_tokens : tokens;
    bytes += static_cast<size_t>(HeadsPerPage(i, num_kv_heads)) * static_cast<size_t>(rows) *
             s.row_bytes();
  }
  return bytes;
}

int WriteParams::tile_tokens() const {
  const WriteParams& p = *this;
  switch (p.format) {
#define KVQ_FORMAT(id, Name, tile, spec, summary) \
  case Format::k##Name:                     \
    return (tile);
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  }
  return 1;
}

FormatLayout LayoutOf(const WriteParams& p) {
  FormatLayout layout;
  layout.format = p.format;
  layout.tile_tokens = p.tile_tokens();
  // The format's rows of formats.inc's plane table, in list order (absent planes skipped).
  const auto add = [&](const PlaneSpec& spec) {
    if (spec.elements <= 0) return;
    KVQ_CHECK(layout.num_planes < kMaxPlanes, kInvalidArgument, "format '",
              FormatName(p.format), "' lists more than ", kMaxPlanes, " planes");
    layout.planes[layout.num_planes++] = spec;
  };
#define KVQ_PLANE(Fmt, plane, source, dtype_, role_, scope_, count)                      \
  if (p.format == Format::k##Fmt) {                                                        \
    add({#plane, #source, DType::dtype_, PlaneRole::role_, PlaneScope::scope_, (count)});  \
  }
#include "kvq/common/formats.inc"
#undef KVQ_PLANE
  return layout;
}

}  // namespace kvq
