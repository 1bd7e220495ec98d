// kvq tables --out DIR: writes every generated constant table of tables.inc into DIR (its file
// name from the list), as common_tables_test expects it. DIR must exist; nothing else is
// written. Regenerate the committed tables with
//   kvq tables --out common/include/kvq/common/tables
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvq/common/io.h"
#include "kvq/common/tables.h"

void setup_tables(CLI::App& app) {
  auto out = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "tables", "Write the generated constant tables (e4m3 values, codebooks) into a folder");
  sub->add_option("--out", *out, "Existing folder to write the table files into")->required();
  sub->callback([out]() {
    // Every path is checked before anything is written (a missing DIR is refused).
    for (const kvq::tables::TableSpec& table : kvq::tables::AllTables()) {
      kvq::CheckOutputFile(*out + "/" + table.file);
    }
    for (const kvq::tables::TableSpec& table : kvq::tables::AllTables()) {
      const std::string text = kvq::tables::TableText(table);
      const std::string path = *out + "/" + table.file;
      kvq::WriteFile(path, std::vector<uint8_t>(text.begin(), text.end()));
      std::printf("wrote %s (%zu words: %s)\n", path.c_str(), table.count, table.summary);
    }
  });
}
