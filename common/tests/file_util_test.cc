// Whole-file reads and atomic writes: a failed write leaves no file and no temporary behind.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::Bytes;
using testing::ExpectError;
using testing::ScratchDir;

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

TEST(FileUtil, WritesReadsAndOverwritesAtomically) {
  ScratchDir dir;
  const std::string path = dir.File("out.bin");
  WriteFileAtomic(path, Bytes("first version"));
  EXPECT_EQ(ReadFileBytes(path), Bytes("first version"));
  WriteFileAtomic(path, Bytes("2nd"));
  EXPECT_EQ(ReadFileBytes(path), Bytes("2nd"));
  WriteFileAtomic(path, {});
  EXPECT_TRUE(ReadFileBytes(path).empty());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"out.bin"});
  // Large enough to take several read() calls.
  std::vector<uint8_t> big(300000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7);
  WriteFileAtomic(path, big);
  EXPECT_EQ(ReadFileBytes(path), big);
}

TEST(FileUtil, MissingDirectoryLeavesNothing) {
  ScratchDir dir;
  const std::string path = dir.File("no/such/dir/out.bin");
  ExpectError([&] { WriteFileAtomic(path, Bytes("x")); }, ErrorCode::kIoError, {path});
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

TEST(FileUtil, RenameOntoADirectoryFailsAndCleansUp) {
  ScratchDir dir;
  ASSERT_EQ(::mkdir(dir.File("target").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(dir.File("target/inner").c_str(), 0755), 0);
  ExpectError([&] { WriteFileAtomic(dir.File("target"), Bytes("x")); }, ErrorCode::kIoError,
              {dir.File("target")});
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"target"});
  ExpectError([&] { WriteFileAtomic(dir.File("target/"), Bytes("x")); }, ErrorCode::kIoError,
              {"names a directory"});
  ExpectError([&] { WriteFileAtomic("", Bytes("x")); }, ErrorCode::kIoError, {"empty path"});
}

TEST(FileUtil, WriteErrorMidwayLeavesNoFile) {
  // A file-size limit makes write() fail after the first bytes (EFBIG), like a full disk.
  ScratchDir dir;
  const std::string path = dir.File("big.bin");
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  ExpectError([&] { WriteFileAtomic(path, std::vector<uint8_t>(100000, 1)); }, ErrorCode::kIoError,
              {"cannot write", path});
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

TEST(FileUtil, FailedSerializationKeepsTheOldFile) {
  ScratchDir dir;
  const std::string path = dir.File("t.npy");
  const Tensor good = Tensor::F32({2}, {1.0f, 2.0f});
  WriteNpy(path, good);
  ExpectError([&] { WriteNpy(path, Tensor::BF16({1}, {0x3f80})); }, ErrorCode::kInvalidArgument,
              {"BF16"});
  EXPECT_EQ(ReadNpy(path), good);
  ExpectError([&] { WriteNpy(dir.File("new.npy"), Tensor::BF16({1}, {0x3f80})); },
              ErrorCode::kInvalidArgument, {"BF16"});
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"t.npy"});
}

TEST(FileUtil, ReadErrorsNameThePath) {
  ScratchDir dir;
  ExpectError([&] { ReadFileBytes(dir.File("absent")); }, ErrorCode::kIoError,
              {dir.File("absent"), "No such file"});
  ExpectError([&] { ReadFileBytes(dir.path()); }, ErrorCode::kIoError,
              {dir.path(), "not a regular file"});
}

}  // namespace
}  // namespace kvq
