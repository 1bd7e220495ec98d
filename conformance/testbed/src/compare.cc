#include "kvq/testbed/compare.h"

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "kvq/common/io.h"
#include "kvq/conformance/bits.h"

namespace kvq::testbed {
namespace {

std::string FileName(const std::string& case_name) {
  std::string name;
  for (char c : case_name) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '-' || c == '_';
    name += plain ? c : '_';
  }
  return name.empty() ? "case" : name;
}

std::string WriteDump(const std::string& case_name, const NamedTensors& expected,
                      const NamedTensors& got, const NamedTensors& inputs) {
  Safetensors file;
  file.metadata["case"] = case_name;
  file.metadata["format"] = "kvq-test-failure";
  for (const auto& [name, t] : inputs) file.Add("in." + name, t);
  for (const auto& [name, t] : expected) file.Add("expect." + name, t);
  for (const auto& [name, t] : got) file.Add("got." + name, t);
  const std::filesystem::path dir = DumpDir();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = (dir / (FileName(case_name) + ".safetensors")).string();
  try {
    WriteSafetensors(path, file);
  } catch (const std::exception& e) {
    return std::string("(could not write the dump: ") + e.what() + ")";
  }
  return path;
}

}  // namespace

std::string DescribeFloat(float v) {
  Tensor t = Tensor::F32({1}, {v});
  const std::string bits_and_value = conformance::FormatElement(t, 0);  // "0x3fc00000 (1.5)"
  const size_t space = bits_and_value.find(' ');
  return bits_and_value.substr(space + 2, bits_and_value.size() - space - 3) + " (" +
         bits_and_value.substr(0, space) + ")";
}

std::string DumpDir() {
  if (const char* env = std::getenv("KVQ_TEST_DUMP_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return (std::filesystem::path(::testing::TempDir()) / "kvq_failures").string();
}

::testing::AssertionResult AllBitsEqual(const std::string& case_name,
                                        const NamedTensors& expected, const NamedTensors& got,
                                        const NamedTensors& inputs) {
  std::ostringstream failures;
  bool failed = expected.size() != got.size();
  if (failed) {
    failures << "\n  " << expected.size() << " reference outputs but " << got.size() << " results";
  }
  for (size_t i = 0; i < expected.size() && i < got.size(); ++i) {
    const Tensor& want = expected[i].second;
    const Tensor& have = got[i].second;
    const std::string& what = expected[i].first;
    if (want.dtype != have.dtype || want.shape != have.shape) {
      failed = true;
      failures << "\n  " << what << ": reference " << DTypeName(want.dtype) << " "
               << want.ShapeString() << ", result " << DTypeName(have.dtype) << " "
               << have.ShapeString();
      continue;
    }
    const auto m = conformance::FirstBitMismatch(want, have.bytes.data(), have.bytes.size());
    if (!m) continue;
    failed = true;
    failures << "\n  " << what << " differs at " << m->where << " (row " << m->row;
    if (m->column >= 0) failures << ", column " << m->column;
    failures << "): reference " << m->expected << ", result " << m->got << "; " << m->count
             << " of " << want.numel() << " elements differ";
  }
  if (!failed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << case_name << ":" << failures.str()
                                       << "\n  inputs, reference and result: "
                                       << WriteDump(case_name, expected, got, inputs);
}

::testing::AssertionResult BitsEqual(const std::string& case_name, const std::string& what,
                                     const Tensor& expected, const Tensor& got,
                                     const NamedTensors& inputs) {
  return AllBitsEqual(case_name, {{what, expected}}, {{what, got}}, inputs);
}

}  // namespace kvq::testbed
