// Generated constant tables (tables.inc): the compiled words, the generators, and the text of
// each table's file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/lloyd_max.h"

namespace kvq::tables {

// Codebook tables (tables.inc: CodebookBeta, CodebookGaussian).
inline constexpr int kCodebookMaxBits = 8;    // widths b = 1..8
inline constexpr int kCodebookMaxSize = 256;  // segment sizes m = 2, 4, ..., 256
inline constexpr size_t kCodebookSizes = kCodebookMaxSize / 2;
// Within one m of kCodebookBeta, width b's positive half (2^(b−1) centroids, then the
// 2^(b−1) − 1 boundaries above 0) starts at word CodebookHalfOffset(b) and has 2^b − 1 words.
constexpr size_t CodebookHalfOffset(int bits) { return (size_t{1} << bits) - bits - 1; }
inline constexpr size_t kCodebookWordsPerSize = CodebookHalfOffset(kCodebookMaxBits + 1);
// kCodebookGaussian: width b's 2^(b−1) fp64 values start at value 2^(b−1) − 1.
inline constexpr size_t kCodebookGaussianValues = (size_t{1} << kCodebookMaxBits) - 1;

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

// A codebook: y in (boundaries[k−1], boundaries[k]] maps to centroids[k] (the format's encoder
// counts the boundaries strictly below y). Both arrays live as long as the program.
struct CodebookTable {
  int levels;               // 2^bits
  const float* centroids;   // [levels], ascending; centroids[i] == −centroids[levels − 1 − i]
  const float* boundaries;  // [levels − 1], ascending; the middle one is +0, the others are
                            // mirrored like the centroids
};

// m even in 2..256 and bits in 1..8: the frozen sizes and widths.
bool IsSupportedCodebook(int m, int bits);
// The Lloyd–Max codebook of one coordinate of a rotated unit vector in R^m at `bits` bits.
// kBeta (the default) reads kCodebookBeta; kGaussian derives N(0, 1/m)'s from
// kCodebookGaussian by one fp64 division by √m and CodebookHalf's rounding. Throws
// kInvalidArgument naming m or bits when !IsSupportedCodebook(m, bits).
CodebookTable Codebook(int m, int bits, CodebookDensity density = CodebookDensity::kBeta);
// The stored positive half of a width from its fp64 positive-half centroids c (ascending):
// fp32(c_i) for each i, then fp32((c_i + c_{i+1})/2) for each adjacent pair: the tables' one
// rounding rule.
std::vector<float> CodebookHalf(const std::vector<double>& centroids);

// Every table in list order.
const std::vector<TableSpec>& AllTables();
// The file's text: a first line naming the generator and the summary, then the words as
// hexadecimal literals, eight a line.
std::string TableText(const TableSpec& table);

}  // namespace kvq::tables
