// Whole-file reads that never block, and the one output-file policy of kvq (io.h): regular
// files are replaced atomically (a temporary beside the target, then rename), existing devices,
// FIFOs and descriptor links are written through in place, symlinks are followed to their
// target and kept, folders are refused.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
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

int OpenRetrying(const std::string& path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// What a non-regular file is, for messages.
const char* FileTypeName(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

// The folder holding `path` ("." when the path has no '/') and the prefix that names a sibling.
std::string FolderOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Whether `folder` lies in /proc, where the links in fd/ name open descriptors, not files.
// `*own_fd`: N when the link is /proc/<this process>/fd/N (what /dev/stdout and /dev/fd/N
// lead to), else -1.
bool InProc(const std::string& folder, const std::string& name, int* own_fd) {
  *own_fd = -1;
  char* real = ::realpath(folder.c_str(), nullptr);
  if (real == nullptr) return false;
  const std::string resolved = real;
  std::free(real);
  if (resolved != "/proc" && resolved.rfind("/proc/", 0) != 0) return false;
  if (resolved == "/proc/" + std::to_string(::getpid()) + "/fd" && !name.empty() &&
      name.size() < 10 && name.find_first_not_of("0123456789") == std::string::npos) {
    *own_fd = std::stoi(name);
  }
  return true;
}

std::string ReadLink(const std::string& path, const std::string& shown) {
  std::vector<char> buffer(PATH_MAX + 1);
  const ssize_t n = ::readlink(path.c_str(), buffer.data(), buffer.size() - 1);
  KVQ_CHECK(n >= 0, kIoError, "cannot read the symbolic link ", shown, ": ", ErrnoText(errno));
  return std::string(buffer.data(), static_cast<size_t>(n));
}

// Where the bytes of an output path go.
struct OutputTarget {
  enum Kind { kNew, kRegular, kWriteThrough } kind;
  std::string path;  // the path itself or the end of its symlink chain
  std::string shown;  // 'path' or 'path' (-> 'target'), for messages
  // kWriteThrough of one of this process's own descriptors (/dev/stdout: 1): written through
  // that descriptor, so the bytes land where the process's other output to it goes.
  int own_fd = -1;
};

OutputTarget ResolveOutput(const std::string& path) {
  KVQ_CHECK(!path.empty(), kIoError, "cannot write to an empty path");
  std::string current = path;
  auto shown = [&] {
    return current == path ? "'" + path + "'" : "'" + path + "' (-> '" + current + "')";
  };
  for (int hop = 0; hop < 40; ++hop) {
    KVQ_CHECK(current.back() != '/', kIoError, "cannot write ", shown(),
              ": it names a directory");
    struct stat info;
    if (::lstat(current.c_str(), &info) != 0) {
      // A new file; a missing or unusable folder is named when the temporary is made.
      if (errno == ENOENT || errno == ENOTDIR) return {OutputTarget::kNew, current, shown()};
      KVQ_CHECK(false, kIoError, "cannot write ", shown(), ": ", ErrnoText(errno));
    }
    if (S_ISLNK(info.st_mode)) {
      const std::string folder = FolderOf(current);
      // /dev/stdout, /dev/fd/N, /proc/self/fd/N: the descriptor, whatever it is open on.
      int own_fd;
      if (InProc(folder, current.substr(current.rfind('/') + 1), &own_fd)) {
        return {OutputTarget::kWriteThrough, current, shown(), own_fd};
      }
      std::string target = ReadLink(current, shown());
      if (target.empty() || target[0] != '/') {
        if (folder != ".") target = (folder == "/" ? "/" : folder + "/") + target;
      }
      current = target;
      continue;
    }
    KVQ_CHECK(!S_ISDIR(info.st_mode), kIoError, "cannot write ", shown(),
              ": it is a folder");
    return {S_ISREG(info.st_mode) ? OutputTarget::kRegular : OutputTarget::kWriteThrough, current,
            shown()};
  }
  KVQ_CHECK(false, kIoError, "cannot write '", path, "': more than 40 symbolic links");
  return {};
}

// Why no file could be created beside `target` (create_errno: what open() said).
std::string FolderProblem(const std::string& target, int create_errno) {
  const std::string folder = FolderOf(target);
  struct stat info;
  if (::stat(folder.c_str(), &info) != 0) {
    if (errno == ENOENT) return "folder '" + folder + "' does not exist";
    if (errno == ENOTDIR) return "a component of '" + folder + "' is not a folder";
    return "cannot reach folder '" + folder + "': " + ErrnoText(errno);
  }
  if (!S_ISDIR(info.st_mode)) return "'" + folder + "' is not a folder";
  return "folder '" + folder + "' does not accept new files (" + ErrnoText(create_errno) + ")";
}

// A new, empty file beside `target`: .<name>.tmp.<pid>.<n>. Throws naming `shown` and why the
// folder refuses.
int CreateTemporary(const std::string& target, const std::string& shown, std::string* temp) {
  static std::atomic<unsigned> counter{0};
  const size_t slash = target.rfind('/');
  const std::string prefix = slash == std::string::npos ? "" : target.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? target : target.substr(slash + 1);
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    *temp = prefix + "." + base + ".tmp." + std::to_string(::getpid()) + "." +
            std::to_string(counter.fetch_add(1));
    fd = OpenRetrying(*temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  KVQ_CHECK(fd >= 0, kIoError, "cannot write ", shown, ": ", FolderProblem(target, errno));
  return fd;
}

void WriteAll(int fd, const std::vector<uint8_t>& bytes, const std::function<void(int)>& fail) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t put = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail(errno);
    written += static_cast<size_t>(put);
  }
}

void WriteAtomically(const OutputTarget& target, const std::vector<uint8_t>& bytes) {
  std::string temp;
  FileDescriptor file(CreateTemporary(target.path, target.shown, &temp));
  auto fail = [&](const char* what, int err) {
    if (file.get() >= 0) file.Close();
    ::unlink(temp.c_str());
    throw Error(ErrorCode::kIoError,
                detail::Concat("cannot ", what, " ", target.shown, ": ", ErrnoText(err)));
  };
  WriteAll(file.get(), bytes, [&](int err) { fail("write", err); });
  if (::fsync(file.get()) != 0) fail("flush", errno);
  if (file.Close() != 0) fail("close", errno);
  if (::rename(temp.c_str(), target.path.c_str()) != 0) fail("rename a temporary onto", errno);
}

// Opens an existing non-regular target for writing without waiting for a FIFO's reader.
int OpenWriteThrough(const OutputTarget& target) {
  const int fd =
      OpenRetrying(target.path, O_WRONLY | O_APPEND | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    KVQ_CHECK(errno != ENXIO, kIoError, "cannot write ", target.shown,
              ": no process has it open for reading");
    KVQ_CHECK(false, kIoError, "cannot write ", target.shown, ": ", ErrnoText(errno));
  }
  return fd;
}

// FIFOs that CheckOutputFile found a reader on: it keeps them open until WriteFile writes
// them, because closing the only writer would end the reader's input before the output came.
class HeldFifos {
 public:
  static HeldFifos& Get() {
    static HeldFifos held;
    return held;
  }
  void Hold(const std::string& path, int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!fds_.emplace(path, fd).second) ::close(fd);
  }
  // The held descriptor of `path` (now the caller's), or -1.
  int Take(const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = fds_.find(path);
    if (it == fds_.end()) return -1;
    const int fd = it->second;
    fds_.erase(it);
    return fd;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, int> fds_;
};

void WriteThrough(const OutputTarget& target, const std::vector<uint8_t>& bytes) {
  int fd;
  if (target.own_fd >= 0) {
    // The process's own descriptor: what its stdio buffers hold goes first, and the bytes
    // follow at the descriptor's offset (a file that stdout was redirected to is not
    // overwritten from its start, as a second open would do).
    std::fflush(nullptr);
    fd = ::fcntl(target.own_fd, F_DUPFD_CLOEXEC, 0);
    KVQ_CHECK(fd >= 0, kIoError, "cannot write ", target.shown, ": ", ErrnoText(errno));
  } else {
    const int held = HeldFifos::Get().Take(target.path);
    fd = held >= 0 ? held : OpenWriteThrough(target);
    // A reader exists: from here on, wait for it like any writer of a pipe.
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  }
  FileDescriptor file(fd);
  auto fail = [&](int err) {
    throw Error(ErrorCode::kIoError,
                detail::Concat("cannot write ", target.shown, ": ", ErrnoText(err)));
  };
  WriteAll(file.get(), bytes, fail);
  if (file.Close() != 0) fail(errno);
}

}  // namespace

FileKind SniffFileKind(const uint8_t* data, size_t size) {
  if (size >= 6 && std::memcmp(data, "\x93NUMPY", 6) == 0) return FileKind::kNpy;
  if (size >= 9 && data[8] == '{') {
    uint64_t header_length = 0;
    for (int i = 0; i < 8; ++i) header_length |= static_cast<uint64_t>(data[i]) << (8 * i);
    if (header_length <= size - 8) return FileKind::kSafetensors;
  }
  return FileKind::kUnknown;
}

std::vector<uint8_t> ReadFileBytes(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  const int fd = OpenRetrying(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  KVQ_CHECK(fd >= 0, kIoError, "cannot open '", path, "': ", ErrnoText(errno));
  FileDescriptor file(fd);
  struct stat info;
  KVQ_CHECK(::fstat(fd, &info) == 0, kIoError, "cannot stat '", path, "': ", ErrnoText(errno));
  KVQ_CHECK(S_ISREG(info.st_mode), kIoError, "cannot read '", path, "': it is ",
            FileTypeName(info.st_mode), ", not a regular file");
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

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  const OutputTarget target = ResolveOutput(path);
  if (target.kind == OutputTarget::kWriteThrough) {
    WriteThrough(target, bytes);
  } else {
    WriteAtomically(target, bytes);
  }
}

void CheckOutputFile(const std::string& path) {
  const OutputTarget target = ResolveOutput(path);
  if (target.own_fd >= 0) {
    const int flags = ::fcntl(target.own_fd, F_GETFL);
    KVQ_CHECK(flags >= 0 && (flags & O_ACCMODE) != O_RDONLY, kIoError, "cannot write ",
              target.shown, ": descriptor ", target.own_fd, " is not open for writing");
    return;
  }
  if (target.kind == OutputTarget::kWriteThrough) {
    struct stat info;
    if (::stat(target.path.c_str(), &info) == 0 && S_ISFIFO(info.st_mode)) {
      // Whether a reader is there shows only by opening it; the descriptor stays open for
      // WriteFile (closing it would end the reader's input).
      HeldFifos::Get().Hold(target.path, OpenWriteThrough(target));
      return;
    }
    KVQ_CHECK(::access(target.path.c_str(), W_OK) == 0, kIoError, "cannot write ",
              target.shown, ": ", ErrnoText(errno));
    return;
  }
  // The folder must take the temporary file that the write will rename onto the target.
  std::string temp;
  FileDescriptor probe(CreateTemporary(target.path, target.shown, &temp));
  probe.Close();
  ::unlink(temp.c_str());
}

void CheckOutputFolder(const std::string& path) {
  KVQ_CHECK(!path.empty(), kIoError, "cannot write into an empty folder path");
  // The nearest existing folder on the way up: the path itself, or where its missing parents
  // will be created.
  std::string folder = path;
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  for (;;) {
    struct stat info;
    if (::stat(folder.c_str(), &info) == 0) {
      KVQ_CHECK(S_ISDIR(info.st_mode), kIoError, "cannot write into '", path, "': '", folder,
                "' is ", FileTypeName(info.st_mode), ", not a folder");
      break;
    }
    KVQ_CHECK(errno == ENOENT, kIoError, "cannot write into '", path, "': ",
              errno == ENOTDIR ? "a component of it is not a folder" : ErrnoText(errno));
    const std::string parent = FolderOf(folder);
    if (parent == folder) break;
    folder = parent;
  }
  std::string temp;
  const std::string shown = "into '" + path + "'";
  FileDescriptor probe(CreateTemporary(folder + "/.kvq-check", shown, &temp));
  probe.Close();
  ::unlink(temp.c_str());
}

}  // namespace kvq
