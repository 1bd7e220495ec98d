// Every generated constant table (tables.inc): the committed file is what its generator writes
// today, byte for byte, and the compiled words are the generator's. A failure names the table
// and the command that regenerates it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common/numeric.h"
#include "kvq/common/tables.h"

namespace kvq::tables {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Tables, CommittedFilesAreWhatTheGeneratorsWrite) {
  ASSERT_FALSE(AllTables().empty());
  for (const TableSpec& table : AllTables()) {
    const std::string path = std::string(KVQ_TABLES_DIR) + "/" + table.file;
    EXPECT_EQ(ReadText(path), TableText(table))
        << path << " is not what Generate" << table.name << " writes; regenerate with "
        << "`kvq tables --out common/include/kvq/common/tables` and commit it with the change";
  }
}

TEST(Tables, CompiledWordsAreTheGenerators) {
  for (const TableSpec& table : AllTables()) {
    const std::vector<uint32_t> words = table.generate();
    ASSERT_EQ(words.size(), table.count) << table.name;
    for (size_t i = 0; i < words.size(); ++i) {
      ASSERT_EQ(table.compiled[i], words[i]) << table.name << " word " << i;
    }
  }
}

// The e4m3 table against the format's definition written out here: sign, 4 exponent bits
// (bias 7), 3 mantissa bits, subnormals m * 2^-9, S.1111.111 NaN, no infinities.
TEST(Tables, E4m3ValuesFollowTheOcpDefinition) {
  for (int c = 0; c < 256; ++c) {
    const int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
    float f;
    std::memcpy(&f, &kE4m3Values[c], sizeof f);
    if (e == 15 && m == 7) {
      EXPECT_TRUE(f != f) << "code " << c;
      continue;
    }
    const double magnitude = e == 0 ? m / 512.0 : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    EXPECT_EQ(static_cast<double>(f), sign ? -magnitude : magnitude) << "code " << c;
  }
}

}  // namespace
}  // namespace kvq::tables
