// Generated constant tables (tables.inc): the compiled words, the generators, and the text of
// each table's file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvq::tables {

#define KVQ_TABLE(Name, file, count, summary) extern const uint32_t k##Name[count];
#include "kvq/common/tables.inc"
#undef KVQ_TABLE

struct TableSpec {
  const char* name;     // "E4m3Values"
  const char* file;     // "e4m3_values.inc"
  size_t count;
  const char* summary;
  std::vector<uint32_t> (*generate)();  // the definition
  const uint32_t* compiled;             // k<Name>, from the committed file
};

// Every table in list order.
const std::vector<TableSpec>& AllTables();
// The file's text: a first line naming the generator and the summary, then the words as
// hexadecimal literals, eight a line.
std::string TableText(const TableSpec& table);

}  // namespace kvq::tables
