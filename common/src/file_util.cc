// Whole-file reads and atomic writes (temporary file beside the target, then rename), so a
// reader never sees a half-written file and a failed write leaves nothing behind.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"

namespace kvq {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// Closes the descriptor on every path out of a scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closes now and reports close()'s error (a delayed write error surfaces here).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

}  // namespace

std::vector<uint8_t> ReadFileBytes(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  KVQ_CHECK(fd >= 0, kIoError, "cannot open '", path, "': ", ErrnoText(errno));
  FileDescriptor file(fd);
  struct stat info;
  KVQ_CHECK(::fstat(fd, &info) == 0, kIoError, "cannot stat '", path, "': ", ErrnoText(errno));
  KVQ_CHECK(S_ISREG(info.st_mode), kIoError, "'", path, "' is not a regular file");
  std::vector<uint8_t> bytes;
  bytes.reserve(static_cast<size_t>(info.st_size));
  uint8_t buffer[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    KVQ_CHECK(got >= 0, kIoError, "cannot read '", path, "': ", ErrnoText(errno));
    if (got == 0) break;
    bytes.insert(bytes.end(), buffer, buffer + got);
  }
  return bytes;
}

void WriteFileAtomic(const std::string& path, const std::vector<uint8_t>& bytes) {
  KVQ_CHECK(!path.empty(), kIoError, "cannot write to an empty path");
  KVQ_CHECK(path.back() != '/', kIoError, "cannot write to '", path, "': it names a directory");
  // The temporary lives in the target's directory so rename() stays on one file system.
  static std::atomic<unsigned> counter{0};
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  std::string temp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp = dir + "." + base + ".tmp." + std::to_string(::getpid()) + "." +
           std::to_string(counter.fetch_add(1));
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST && errno != EINTR) break;
  }
  KVQ_CHECK(fd >= 0, kIoError, "cannot create a temporary file for '", path,
            "': ", ErrnoText(errno));
  FileDescriptor file(fd);
  auto fail = [&](const char* what, int err) {
    if (file.get() >= 0) file.Close();
    ::unlink(temp.c_str());
    throw Error(ErrorCode::kIoError,
                detail::Concat("cannot ", what, " '", path, "': ", ErrnoText(err)));
  };
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t put = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail("write", errno);
    written += static_cast<size_t>(put);
  }
  if (::fsync(fd) != 0) fail("flush", errno);
  if (file.Close() != 0) fail("close", errno);
  if (::rename(temp.c_str(), path.c_str()) != 0) fail("rename a temporary onto", errno);
}

}  // namespace kvq
