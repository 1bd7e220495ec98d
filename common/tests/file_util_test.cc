// Whole-file reads and the output-file policy (io.h, WriteFile): regular files atomically (a
// failed write leaves no file and no temporary behind), devices, FIFOs and descriptor links
// written through and never replaced, symlinks followed and kept, folders refused; reads that
// never block; the format sniffing that names an .npy given for safetensors.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <future>
#include <string>
#include <thread>
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
  std::sort(names.begin(), names.end());
  return names;
}

TEST(FileUtil, WritesReadsAndOverwritesAtomically) {
  ScratchDir dir;
  const std::string path = dir.File("out.bin");
  WriteFile(path, Bytes("first version"));
  EXPECT_EQ(ReadFileBytes(path), Bytes("first version"));
  WriteFile(path, Bytes("2nd"));
  EXPECT_EQ(ReadFileBytes(path), Bytes("2nd"));
  WriteFile(path, {});
  EXPECT_TRUE(ReadFileBytes(path).empty());
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"out.bin"});
  // Large enough to take several read() calls.
  std::vector<uint8_t> big(300000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7);
  WriteFile(path, big);
  EXPECT_EQ(ReadFileBytes(path), big);
}

TEST(FileUtil, MissingDirectoryLeavesNothing) {
  ScratchDir dir;
  const std::string path = dir.File("no/such/dir/out.bin");
  ExpectError([&] { WriteFile(path, Bytes("x")); }, ErrorCode::kIoError, {path});
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

TEST(FileUtil, RenameOntoADirectoryFailsAndCleansUp) {
  ScratchDir dir;
  ASSERT_EQ(::mkdir(dir.File("target").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(dir.File("target/inner").c_str(), 0755), 0);
  ExpectError([&] { WriteFile(dir.File("target"), Bytes("x")); }, ErrorCode::kIoError,
              {dir.File("target")});
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"target"});
  ExpectError([&] { WriteFile(dir.File("target/"), Bytes("x")); }, ErrorCode::kIoError,
              {"names a directory"});
  ExpectError([&] { WriteFile("", Bytes("x")); }, ErrorCode::kIoError, {"empty path"});
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
  ExpectError([&] { WriteFile(path, std::vector<uint8_t>(100000, 1)); }, ErrorCode::kIoError,
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
              {dir.path(), "a folder, not a regular file"});
}

bool IsCharDevice(const std::string& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0 && S_ISCHR(info.st_mode);
}

bool IsSymlink(const std::string& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0 && S_ISLNK(info.st_mode);
}

// A character device node like /dev/<name> (major 1, `minor`) made in `dir`, so that a broken
// policy damages a private node and not the system's; the system's node where mknod is not
// permitted (then this process cannot replace it either).
std::string DeviceNode(const ScratchDir& dir, const std::string& name, unsigned minor) {
  const std::string path = dir.File(name);
  if (::mknod(path.c_str(), S_IFCHR | 0666, makedev(1, minor)) == 0) {
    // A file system mounted nodev refuses to open it: use the system's node then.
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      return path;
    }
    ::unlink(path.c_str());
  }
  return "/dev/" + name;
}

TEST(FileUtil, WritesThroughDeviceNodesAndNeverReplacesThem) {
  ScratchDir dir;
  const std::string null = DeviceNode(dir, "null", 3), full = DeviceNode(dir, "full", 7);
  WriteFile(null, Bytes("discarded"));
  EXPECT_TRUE(IsCharDevice(null)) << null << " was replaced";
  CheckOutputFile(null);
  ExpectError([&] { WriteFile(full, std::vector<uint8_t>(10000, 1)); }, ErrorCode::kIoError,
              {"'" + full + "'", "No space left on device"});
  EXPECT_TRUE(IsCharDevice(full)) << full << " was replaced";
  // Through a symlink: the device is written, the link stays, nothing else appears.
  ASSERT_EQ(::symlink(null.c_str(), dir.File("to_null").c_str()), 0);
  const std::vector<std::string> before = ListDir(dir.path());
  WriteFile(dir.File("to_null"), Bytes("x"));
  EXPECT_TRUE(IsSymlink(dir.File("to_null")));
  EXPECT_TRUE(IsCharDevice(null));
  EXPECT_EQ(ListDir(dir.path()), before);
}

TEST(FileUtil, WritesIntoAFifoWithAReaderAndRefusesOneWithout) {
  ScratchDir dir;
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No reader: refused at once, by the check and by the write, instead of waiting.
  ExpectError([&] { CheckOutputFile(fifo); }, ErrorCode::kIoError,
              {"'" + fifo + "'", "no process has it open for reading"});
  ExpectError([&] { WriteFile(fifo, Bytes("x")); }, ErrorCode::kIoError,
              {"no process has it open for reading"});
  // A reader: every byte arrives (more than a pipe buffer), and the FIFO stays a FIFO.
  std::vector<uint8_t> big(200000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 13);
  std::promise<void> opened;
  std::future<std::vector<uint8_t>> received = std::async(std::launch::async, [&] {
    const int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    opened.set_value();
    std::vector<uint8_t> got;
    if (fd < 0) return got;
    ::fcntl(fd, F_SETFL, 0);
    uint8_t buffer[4096];
    // Wait for the writer, then read to its end.
    for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) != 0 || got.empty();) {
      if (n > 0) got.insert(got.end(), buffer, buffer + n);
      if (n == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ::close(fd);
    return got;
  });
  opened.get_future().wait();
  CheckOutputFile(fifo);  // holds the FIFO open: the reader must not see its input end here
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  WriteFile(fifo, big);
  ASSERT_EQ(received.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(received.get(), big);
  struct stat info;
  ASSERT_EQ(::lstat(fifo.c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
}

TEST(FileUtil, FollowsSymlinksAndKeepsThem) {
  ScratchDir dir;
  ASSERT_EQ(::mkdir(dir.File("real").c_str(), 0755), 0);
  WriteFile(dir.File("real/target.bin"), Bytes("old"));
  // A relative link, and a chain ending in it.
  ASSERT_EQ(::symlink("real/target.bin", dir.File("link").c_str()), 0);
  ASSERT_EQ(::symlink("link", dir.File("link2").c_str()), 0);
  WriteFile(dir.File("link2"), Bytes("new"));
  EXPECT_TRUE(IsSymlink(dir.File("link")));
  EXPECT_TRUE(IsSymlink(dir.File("link2")));
  EXPECT_EQ(ReadFileBytes(dir.File("real/target.bin")), Bytes("new"));
  EXPECT_EQ(ListDir(dir.File("real")), std::vector<std::string>{"target.bin"});
  // A dangling link: its target is created, the link stays.
  ASSERT_EQ(::symlink("real/made.bin", dir.File("dangling").c_str()), 0);
  WriteFile(dir.File("dangling"), Bytes("made"));
  EXPECT_TRUE(IsSymlink(dir.File("dangling")));
  EXPECT_EQ(ReadFileBytes(dir.File("real/made.bin")), Bytes("made"));
  // A link to a folder is refused naming both; a loop is refused.
  ASSERT_EQ(::symlink("real", dir.File("to_folder").c_str()), 0);
  ExpectError([&] { WriteFile(dir.File("to_folder"), Bytes("x")); }, ErrorCode::kIoError,
              {"'" + dir.File("to_folder") + "'", "is a folder"});
  ASSERT_EQ(::symlink("loop_b", dir.File("loop_a").c_str()), 0);
  ASSERT_EQ(::symlink("loop_a", dir.File("loop_b").c_str()), 0);
  ExpectError([&] { WriteFile(dir.File("loop_a"), Bytes("x")); }, ErrorCode::kIoError,
              {"symbolic links"});
}

TEST(FileUtil, WritesThroughADescriptorLink) {
  // /proc/self/fd/N of a pipe (as /dev/stdout is when stdout is a pipe): the bytes go into the
  // pipe, nothing is replaced.
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  const std::string link = "/proc/self/fd/" + std::to_string(ends[1]);
  CheckOutputFile(link);
  WriteFile(link, Bytes("through the pipe"));
  ::close(ends[1]);
  std::vector<uint8_t> got(64);
  const ssize_t n = ::read(ends[0], got.data(), got.size());
  ::close(ends[0]);
  ASSERT_GT(n, 0);
  got.resize(static_cast<size_t>(n));
  EXPECT_EQ(got, Bytes("through the pipe"));
  // A descriptor open on a regular file (stdout redirected to a file): the bytes follow what
  // the process wrote through it, at its offset, and what it writes next follows them; the
  // file is not replaced.
  ScratchDir dir;
  const int fd = ::open(dir.File("log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "before ", 7), 7);
  WriteFile("/dev/fd/" + std::to_string(fd), Bytes("output"));
  ASSERT_EQ(::write(fd, " after", 6), 6);
  ::close(fd);
  EXPECT_EQ(ReadFileBytes(dir.File("log")), Bytes("before output after"));
  const int read_only = ::open(dir.File("log").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  ExpectError([&] { CheckOutputFile("/proc/self/fd/" + std::to_string(read_only)); },
              ErrorCode::kIoError,
              {"descriptor " + std::to_string(read_only), "not open for writing"});
  ::close(read_only);
}

TEST(FileUtil, ChecksOutputsWithoutWriting) {
  ScratchDir dir;
  WriteFile(dir.File("file"), Bytes("x"));
  const std::vector<std::string> before = ListDir(dir.path());
  CheckOutputFile(dir.File("new.bin"));
  CheckOutputFile(dir.File("file"));
  CheckOutputFolder(dir.File("new/deeper"));
  CheckOutputFolder(dir.path());
  EXPECT_EQ(ListDir(dir.path()), before);  // the probes leave nothing
  ExpectError([&] { CheckOutputFile(dir.File("nodir/x.json")); }, ErrorCode::kIoError,
              {"'" + dir.File("nodir/x.json") + "'", "folder '" + dir.File("nodir") +
                                                         "' does not exist"});
  ExpectError([&] { CheckOutputFile(dir.File("file/x.json")); }, ErrorCode::kIoError,
              {"'" + dir.File("file") + "' is not a folder"});
  ExpectError([&] { CheckOutputFile(dir.path()); }, ErrorCode::kIoError, {"is a folder"});
  // A folder that takes no new files (as root too: /proc refuses them).
  ExpectError([&] { CheckOutputFile("/proc/kvq_out.json"); }, ErrorCode::kIoError,
              {"'/proc/kvq_out.json'", "folder '/proc' does not accept new files"});
  ExpectError([&] { WriteFile("/proc/kvq_out.json", Bytes("x")); }, ErrorCode::kIoError,
              {"folder '/proc' does not accept new files"});
  ExpectError([&] { CheckOutputFolder("/proc/kvq_plots"); }, ErrorCode::kIoError,
              {"'/proc/kvq_plots'", "folder '/proc' does not accept new files"});
  ExpectError([&] { CheckOutputFolder(dir.File("file")); }, ErrorCode::kIoError,
              {"'" + dir.File("file") + "'", "not a folder"});
  ExpectError([&] { CheckOutputFolder(dir.File("file/plots")); }, ErrorCode::kIoError,
              {"not a folder"});
  EXPECT_EQ(ListDir(dir.path()), before);
}

TEST(FileUtil, ReadingAFifoDoesNotWaitForAWriter) {
  ScratchDir dir;
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::future<void> read = std::async(std::launch::async, [&] {
    ExpectError([&] { ReadFileBytes(fifo); }, ErrorCode::kIoError,
                {"'" + fifo + "'", "a FIFO, not a regular file"});
  });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "ReadFileBytes blocked on a FIFO";
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // releases the reader
    if (fd >= 0) ::close(fd);
  }
  read.get();
}

TEST(FileUtil, ReadersNameAFileOfTheOtherFormat) {
  ScratchDir dir;
  WriteNpy(dir.File("x.npy"), Tensor::F32({2}, {1.0f, 2.0f}));
  Safetensors st;
  st.Add("t", Tensor::F32({2}, {1.0f, 2.0f}));
  WriteSafetensors(dir.File("x.safetensors"), st);
  ExpectError([&] { ReadSafetensors(dir.File("x.npy")); }, ErrorCode::kMalformedFile,
              {dir.File("x.npy") + " is a .npy file, expected safetensors"});
  ExpectError([&] { ReadNpy(dir.File("x.safetensors")); }, ErrorCode::kMalformedFile,
              {dir.File("x.safetensors") + " is a safetensors file, expected .npy"});
  const std::vector<uint8_t> npy = ReadFileBytes(dir.File("x.npy"));
  const std::vector<uint8_t> safetensors = ReadFileBytes(dir.File("x.safetensors"));
  EXPECT_EQ(SniffFileKind(npy.data(), npy.size()), FileKind::kNpy);
  EXPECT_EQ(SniffFileKind(safetensors.data(), safetensors.size()), FileKind::kSafetensors);
  const std::vector<uint8_t> text = Bytes("plain text, not a tensor file");
  EXPECT_EQ(SniffFileKind(text.data(), text.size()), FileKind::kUnknown);
}

}  // namespace
}  // namespace kvq
