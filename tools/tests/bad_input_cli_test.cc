// The scripted bad-input suite of issue 25 ("Must hold"): every writer of the CLI pointed at a
// missing folder, a folder, a file used as a folder, a folder that takes no files (/proc, which
// refuses root too), a FIFO with and without a reader, device nodes like /dev/null and
// /dev/full, a symlink and /dev/stdout; FIFOs and files of the other format as inputs; sizes
// past the limits, from options and from a model's config.json; options that would be
// ignored; a capture whose held-out tokens all stay bf16; parse errors. Every case exits 2 with
// one `kvq: error:` line naming the offending value, or succeeds and writes what it should; no
// case creates or changes anything in the scratch folder but the named output.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cli_test_util.h"
#include "kvq/common/io.h"

#ifndef KVQ_MODELS_DIR
#error "KVQ_MODELS_DIR must point at calib/models"
#endif

namespace kvq {
namespace {

namespace fs = std::filesystem;
using cli_testing::RunKvq;
using cli_testing::RunResult;
using cli_testing::ScratchDir;
using cli_testing::Slurp;

const std::string kModelA = std::string(KVQ_MODELS_DIR) + "/tiny-llama-a";

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Everything under `root` but the command's own stdout/stderr capture: for each entry its type,
// and for files and links their size, modification time and inode (folders' times move when a
// probe file comes and goes; their entries are listed themselves).
using Listing = std::map<std::string, std::tuple<unsigned, int64_t, int64_t, uint64_t>>;

Listing List(const std::string& root) {
  Listing listing;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(root)) {
    const std::string relative = entry.path().lexically_relative(root).string();
    if (relative == "stdout.txt" || relative == "stderr.txt") continue;
    struct stat info;
    if (::lstat(entry.path().c_str(), &info) != 0) continue;
    const bool folder = S_ISDIR(info.st_mode);
    listing[relative] = {static_cast<unsigned>(info.st_mode & S_IFMT),
                         folder ? 0 : static_cast<int64_t>(info.st_size),
                         folder ? 0 : info.st_mtim.tv_sec * 1000000000LL + info.st_mtim.tv_nsec,
                         folder ? 0 : static_cast<uint64_t>(info.st_ino)};
  }
  return listing;
}

// `after` equals `before` except for `output` (and, for a folder output, what lies in it).
void ExpectOnlyOutputChanged(const Listing& before, const Listing& after,
                             const std::string& output, const std::string& command) {
  auto outside = [&](const Listing& l) {
    Listing kept;
    for (const auto& [path, info] : l) {
      if (path == output || path.rfind(output + "/", 0) == 0) continue;
      kept.emplace(path, info);
    }
    return kept;
  };
  const Listing a = outside(before), b = outside(after);
  if (a == b) return;
  std::string diff;
  for (const auto& [path, info] : b) {
    const auto it = a.find(path);
    if (it == a.end()) diff += " created " + path + ";";
    else if (it->second != info) diff += " changed " + path + ";";
  }
  for (const auto& [path, info] : a) {
    if (b.count(path) == 0) diff += " removed " + path + ";";
  }
  ADD_FAILURE() << command << " touched more than " << output << ":" << diff;
}

unsigned TypeOf(const std::string& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0 ? (info.st_mode & S_IFMT) : 0;
}

// The one way a case may fail: exit status 2, one line `kvq: error: ...` naming every needle.
void ExpectRejected(const RunResult& r, const std::string& command,
                    const std::vector<std::string>& needles) {
  EXPECT_EQ(r.exit_code, 2) << command << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << command << "\nstderr: " << r.err;
  EXPECT_TRUE(!r.err.empty() && r.err.find('\n') == r.err.size() - 1)
      << command << ": not one line: " << r.err;
  for (const std::string& needle : needles) {
    EXPECT_TRUE(Contains(r.err, needle)) << command << "\nstderr \"" << r.err << "\" lacks \""
                                         << needle << "\"";
  }
}

// A shared scratch folder with the inputs every writer needs, made by kvq itself, plus the
// special files the cases point at.
class Inputs {
 public:
  Inputs() : dir_("kvq_bad_input") {
    std::vector<float> x(4 * 128);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 17) - 8.0f;
    WriteNpy(dir_.File("x.npy"), Tensor::F32({4, 128}, x));
    std::vector<float> q(2 * 64), kv(32 * 64);
    for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 7) - 3.0f;
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>((i * 5) % 11) - 5.0f;
    WriteNpy(dir_.File("q.npy"), Tensor::F32({2, 64}, q));
    WriteNpy(dir_.File("k.npy"), Tensor::F32({32, 1, 64}, kv));
    WriteNpy(dir_.File("v.npy"), Tensor::F32({32, 1, 64}, kv));
    Must("quantize --in x.npy --identity --clip 1 --bits 2 --group 64 --out q.safetensors");
    Must("synth --layers 1 --tokens 640 --q-heads 2 --kv-heads 1 --dtype f32 "
         "--out acts.safetensors");
    fs::create_directory(dir_.File("sub"));
    EXPECT_EQ(::mkfifo(dir_.File("fifo").c_str(), 0600), 0);
    null_ = DeviceNode("null", 3);
    full_ = DeviceNode("full", 7);
  }

  const ScratchDir& dir() const { return dir_; }
  std::string File(const std::string& name) const { return dir_.File(name); }
  // The device nodes, relative to the folder when private (see DeviceNode).
  const std::string& null() const { return null_; }
  const std::string& full() const { return full_; }

 private:
  void Must(const std::string& args) {
    const RunResult r = RunKvq(dir_, args);
    ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.err;
  }

  // A node like /dev/<name> made here, so that a broken policy damages a private node and not
  // the system's; the system's node where mknod is not permitted (then no process of this
  // user can replace it either) or the file system is mounted nodev.
  std::string DeviceNode(const std::string& name, unsigned minor) {
    const std::string path = dir_.File(name);
    if (::mknod(path.c_str(), S_IFCHR | 0666, makedev(1, minor)) == 0) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::close(fd);
        return name;
      }
      ::unlink(path.c_str());
    }
    return "/dev/" + name;
  }

  ScratchDir dir_;
  std::string null_, full_;
};

const Inputs& SharedInputs() {
  static const Inputs inputs;  // removed with its folder at exit
  return inputs;
}

// A writer: a command line with `{}` where its output path goes.
struct Writer {
  enum Cost { kQuick, kSeconds, kMinutes };  // how long a successful run takes
  std::string option;  // the output option, as the error line names it
  std::string args;
  bool folder;         // the output is a folder the command creates and fills
  Cost cost;           // what succeeds is run for kQuick writers (kSeconds: /dev/null only)
};

std::ostream& operator<<(std::ostream& os, const Writer& w) { return os << w.args; }

std::string With(const Writer& w, const std::string& output) {
  std::string args = w.args;
  args.replace(args.find("{}"), 2, "'" + output + "'");
  return args;
}

const std::string kPpl = "ppl --model '" + kModelA +
                         "' --windows heldout_en:0 --length 48 --no-fp32 --tail-from 8 "
                         "--threads 2 ";
const std::string kAttend = "attend --q q.npy --k k.npy --v v.npy --hadamard --sink 4 --recent 8 ";
const std::string kEval =
    "eval --activations acts.safetensors --schemes naive --sink 16 --recent 32 ";
const std::string kQview = "qview --activations acts.safetensors --calib-activations "
                           "acts.safetensors --schemes naive,hadamard --sink 16 --recent 32 ";

const Writer kWriters[] = {
    {"--out", "quantize --in x.npy --identity --clip 1 --bits 2 --group 64 --out {}", false,
     Writer::kQuick},
    {"--out", "rotate --in x.npy --hadamard --out {}", false, Writer::kQuick},
    {"--out", "dequantize --in q.safetensors --identity --out {}", false, Writer::kQuick},
    {"--out", kAttend + "--out {}", false, Writer::kQuick},
    {"--out", "synth --layers 1 --tokens 64 --q-heads 2 --kv-heads 1 --out {}", false,
     Writer::kQuick},
    {"--out", "calibrate --activations acts.safetensors --sink 16 --recent 32 --out {}", false,
     Writer::kQuick},
    {"--json", kEval + "--json {}", false, Writer::kQuick},
    {"--report", kEval + "--report {}", true, Writer::kQuick},
    {"--csv", kQview + "--csv {}", false, Writer::kQuick},
    {"--plots", kQview + "--plots {}", true, Writer::kQuick},
    {"--out", "capture --model '" + kModelA + "' --windows calib:0 --length 32 --out {}", false,
     Writer::kSeconds},
    {"--json", kPpl + "--schemes bf16 --json {}", false, Writer::kSeconds},
    {"--save-calibration",
     kPpl + "--schemes oscar --clip oscar --calib-windows calib:0 --calib-length 48 --sink 16 "
            "--recent 16 --page 16 --save-calibration {}",
     false, Writer::kSeconds},
    {"--out", "demo --synthetic --out {}", true, Writer::kMinutes},
    {"--json", "demo --json {}", false, Writer::kMinutes},
    {"--out", "vectors generate --out {}", true, Writer::kSeconds},
};

// Reads a FIFO, open from before its writer comes, until the writer has closed it after
// writing, or `writer_done` is set (the command ended without writing), or 60 s pass.
class FifoReader {
 public:
  explicit FifoReader(const std::string& path)
      : fd_(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)) {
    bytes_ = std::async(std::launch::async, [this] { return ReadAll(); });
  }
  ~FifoReader() {
    if (bytes_.valid()) Received();
  }
  // The byte count received; call after the writer's command returned.
  size_t Received() {
    writer_done_ = true;
    return bytes_.get();
  }

 private:
  size_t ReadAll() {
    size_t got = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    uint8_t buffer[1 << 16];
    while (fd_ >= 0 && std::chrono::steady_clock::now() < deadline) {
      const ssize_t n = ::read(fd_, buffer, sizeof buffer);
      if (n > 0) {
        got += static_cast<size_t>(n);
        continue;
      }
      // 0: no writer (yet, or any more); EAGAIN: a writer, no data yet.
      if (n == 0 && (got > 0 || writer_done_)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (fd_ >= 0) ::close(fd_);
    return got;
  }

  int fd_;
  std::atomic<bool> writer_done_{false};
  std::future<size_t> bytes_;
};

class WriterTest : public ::testing::TestWithParam<Writer> {
 protected:
  // Runs the writer on `output` and checks that nothing but `output` moved.
  RunResult Run(const std::string& output) {
    const Inputs& in = SharedInputs();
    const std::string args = With(GetParam(), output);
    const Listing before = List(in.File(""));
    const RunResult r = RunKvq(in.dir(), args, /*timeout_seconds=*/120);
    ExpectOnlyOutputChanged(before, List(in.File("")), output, args);
    return r;
  }

  void ExpectRefused(const std::string& output, std::vector<std::string> needles) {
    needles.push_back(GetParam().option + ": ");
    const RunResult r = Run(output);
    ExpectRejected(r, With(GetParam(), output), needles);
    // Refused while the command line was parsed: no work was started.
    EXPECT_EQ(r.out, "") << With(GetParam(), output);
  }
};

TEST_P(WriterTest, RefusesUnusableOutputPathsBeforeAnyWork) {
  const Writer& w = GetParam();
  const Inputs& in = SharedInputs();
  if (w.folder) {
    ExpectRefused("x.npy", {"'x.npy' is a regular file, not a folder"});
    ExpectRefused("x.npy/out", {"'x.npy/out'", "not a folder"});
    ExpectRefused("fifo", {"'fifo' is a FIFO, not a folder"});
    ExpectRefused(in.null(), {"a character device, not a folder"});
    ExpectRefused("/proc/kvq_bad_input", {"'/proc/kvq_bad_input'",
                                          "folder '/proc' does not accept new files"});
  } else {
    ExpectRefused("nodir/out", {"'nodir/out'", "folder 'nodir' does not exist"});
    ExpectRefused("sub", {"'sub'", "is a folder"});
    ExpectRefused("x.npy/out", {"'x.npy/out'", "'x.npy' is not a folder"});
    ExpectRefused("/proc/kvq_bad_input", {"'/proc/kvq_bad_input'",
                                          "folder '/proc' does not accept new files"});
    // A FIFO that no process reads: refused at once instead of waiting (or working) first.
    ExpectRefused("fifo", {"'fifo'", "no process has it open for reading"});
    EXPECT_EQ(TypeOf(in.File("fifo")), static_cast<unsigned>(S_IFIFO));
  }
}

// The device node like /dev/null takes the output and stays a device node.
// The cases that need a whole successful run take the writers that allow it: a file output for
// the devices and the FIFO, and a run of seconds (a null device) or well under one (the rest).
class FileWriterTest : public WriterTest {};
class QuickFileWriterTest : public WriterTest {};
class QuickWriterTest : public WriterTest {};

TEST_P(FileWriterTest, WritesThroughANullDevice) {
  const Writer& w = GetParam();
  const Inputs& in = SharedInputs();
  const RunResult r = Run(in.null());
  EXPECT_EQ(r.exit_code, 0) << With(w, in.null()) << "\n" << r.err;
  const std::string node = in.null()[0] == '/' ? in.null() : in.File(in.null());
  EXPECT_EQ(TypeOf(node), static_cast<unsigned>(S_IFCHR)) << node << " was replaced";
}

TEST_P(QuickFileWriterTest, ReportsAFullDeviceAndLeavesItADevice) {
  const Writer& w = GetParam();
  const Inputs& in = SharedInputs();
  const RunResult r = Run(in.full());
  ExpectRejected(r, With(w, in.full()), {in.full(), "No space left on device"});
  const std::string node = in.full()[0] == '/' ? in.full() : in.File(in.full());
  EXPECT_EQ(TypeOf(node), static_cast<unsigned>(S_IFCHR)) << node << " was replaced";
}

// A symlink: its target is written, the link stays a link.
TEST_P(QuickWriterTest, WritesASymlinksTargetAndKeepsTheLink) {
  const Writer& w = GetParam();
  const Inputs& in = SharedInputs();
  const std::string target = w.folder ? "linked_folder" : "linked_target";
  ASSERT_EQ(::symlink(target.c_str(), in.File("link").c_str()), 0);
  if (w.folder) fs::create_directory(in.File(target));
  const Listing before = List(in.File(""));
  const RunResult r = RunKvq(in.dir(), With(w, "link"));
  EXPECT_EQ(r.exit_code, 0) << With(w, "link") << "\n" << r.err;
  ExpectOnlyOutputChanged(before, List(in.File("")), target, With(w, "link"));
  EXPECT_EQ(TypeOf(in.File("link")), static_cast<unsigned>(S_IFLNK));
  if (w.folder) {
    EXPECT_FALSE(fs::is_empty(in.File(target)));
  } else {
    EXPECT_GT(fs::file_size(in.File(target)), 0u);
  }
  fs::remove_all(in.File(target));
  fs::remove(in.File("link"));
}

// A FIFO with a reader receives the whole output.
TEST_P(QuickFileWriterTest, WritesIntoAFifoThatIsRead) {
  const Writer& w = GetParam();
  const Inputs& in = SharedInputs();
  const std::string fifo = in.File("fifo");
  FifoReader reader(fifo);
  const RunResult r = Run("fifo");
  EXPECT_EQ(r.exit_code, 0) << With(w, "fifo") << "\n" << r.err;
  EXPECT_GT(reader.Received(), 0u) << With(w, "fifo");
  EXPECT_EQ(TypeOf(fifo), static_cast<unsigned>(S_IFIFO));
}

std::vector<Writer> Writers(bool (*keep)(const Writer&)) {
  std::vector<Writer> kept;
  for (const Writer& w : kWriters) {
    if (keep(w)) kept.push_back(w);
  }
  return kept;
}

std::string WriterName(const ::testing::TestParamInfo<Writer>& info) {
  std::string name = info.param.args.substr(0, info.param.args.find(' '));
  for (char c : info.param.option) {
    if (std::isalnum(static_cast<unsigned char>(c))) name += c;
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(EveryWriter, WriterTest, ::testing::ValuesIn(kWriters), WriterName);
INSTANTIATE_TEST_SUITE_P(
    FileWriters, FileWriterTest,
    ::testing::ValuesIn(Writers([](const Writer& w) {
      return !w.folder && w.cost != Writer::kMinutes;
    })),
    WriterName);
INSTANTIATE_TEST_SUITE_P(
    QuickFileWriters, QuickFileWriterTest,
    ::testing::ValuesIn(Writers([](const Writer& w) {
      return !w.folder && w.cost == Writer::kQuick;
    })),
    WriterName);
INSTANTIATE_TEST_SUITE_P(
    QuickWriters, QuickWriterTest,
    ::testing::ValuesIn(Writers([](const Writer& w) { return w.cost == Writer::kQuick; })),
    WriterName);

// /dev/stdout: the bytes go to the command's standard output (a file here), nothing replaced.
TEST(BadInput, OutputToDevStdoutGoesToStandardOutput) {
  const Inputs& in = SharedInputs();
  const RunResult r = RunKvq(
      in.dir(), "quantize --in x.npy --identity --clip 1 --bits 2 --group 64 --out /dev/stdout");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Safetensors file =
      ParseSafetensors(reinterpret_cast<const uint8_t*>(r.out.data()), r.out.size());
  EXPECT_EQ(file.metadata.at("format"), "kvq-quantized");
  EXPECT_EQ(ReadSafetensors(in.File("q.safetensors")).Get("codes").bytes,
            file.Get("codes").bytes);
  // A command that prints after writing: the file's bytes, then its line, in that order.
  const RunResult synth =
      RunKvq(in.dir(), "synth --layers 1 --tokens 64 --q-heads 2 --kv-heads 1 --out /dev/stdout");
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  const size_t line = synth.out.rfind("wrote /dev/stdout: 1 layers");
  ASSERT_NE(line, std::string::npos) << synth.out.substr(0, 40);
  const Safetensors capture =
      ParseSafetensors(reinterpret_cast<const uint8_t*>(synth.out.data()), line);
  EXPECT_EQ(capture.metadata.at("format"), "kvq-activations");
}

// A FIFO (or any non-regular file) as an input is refused at once, naming it (the time limit
// turns a hang into a failure instead of a stuck test).
TEST(BadInput, InputsNeverBlockAndAreRecognisedByTheirBytes) {
  const Inputs& in = SharedInputs();
  const std::vector<std::string> fifo_inputs = {
      "info fifo",
      "quantize --in fifo --identity --clip 1 --bits 2 --group 64 --out o.safetensors",
      "dequantize --in fifo --identity --out o.npy",
      "attend --q q.npy --k fifo --v v.npy --hadamard --out o.npy",
      "calibrate --activations fifo --out o.safetensors",
      "eval --activations fifo",
      "eval --activations acts.safetensors --calibration fifo --schemes oscar",
      "qview --activations fifo --calib-activations acts.safetensors",
  };
  for (const std::string& args : fifo_inputs) {
    const Listing before = List(in.File(""));
    const RunResult r = RunKvq(in.dir(), args, /*timeout_seconds=*/30);
    ExpectRejected(r, args, {"'fifo'", "a FIFO, not a regular file"});
    ExpectOnlyOutputChanged(before, List(in.File("")), "", args);
  }
  // An .npy where safetensors is expected, and the reverse: named by what the file is.
  for (const std::string& args : {std::string("dequantize --in x.npy --identity --out o.npy"),
                                  std::string("calibrate --activations x.npy --out o.safetensors"),
                                  std::string("eval --activations x.npy"),
                                  std::string("attend --q q.npy --k k.npy --v v.npy --scheme "
                                              "oscar --calibration x.npy --layer 0 --out o.npy")}) {
    ExpectRejected(RunKvq(in.dir(), args), args, {"x.npy is a .npy file, expected safetensors"});
  }
  for (const std::string& args :
       {std::string("quantize --in q.safetensors --identity --clip 1 --bits 2 --group 64 "
                    "--out o.safetensors"),
        std::string("attend --q q.npy --k acts.safetensors --v v.npy --hadamard --out o.npy")}) {
    ExpectRejected(RunKvq(in.dir(), args), args,
                   {".safetensors is a safetensors file, expected .npy"});
  }
  EXPECT_FALSE(fs::exists(in.File("o.npy")) || fs::exists(in.File("o.safetensors")));
}

// kvq ppl --json nodir/x.json fails before loading anything (it used to fail after the run);
// so do the other outputs of the long commands.
TEST(BadInput, OutputPathsAreCheckedBeforeTheWork) {
  const Inputs& in = SharedInputs();
  for (const std::string& args : std::vector<std::string>{
           "ppl --model '" + kModelA + "' --json nodir/x.json",
        "ppl --model '" + kModelA + "' --schemes oscar --save-calibration nodir/c.safetensors",
        "demo --json nodir/x.json", "eval --activations acts.safetensors --json nodir/x.json",
        "capture --model '" + kModelA + "' --out nodir/a.safetensors",
        "qview --activations acts.safetensors --calib-activations acts.safetensors --csv "
        "nodir/v.csv"}) {
    const auto start = std::chrono::steady_clock::now();
    const RunResult r = RunKvq(in.dir(), args);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ExpectRejected(r, args, {"nodir/", "folder 'nodir' does not exist"});
    EXPECT_EQ(r.out, "") << args << ": work started before the output path was checked";
    EXPECT_LT(seconds, 5.0) << args;
  }
}

// Options that the chosen schemes would leave unused are refused, naming the option.
TEST(BadInput, OptionsThatWouldBeIgnoredAreRefused) {
  const Inputs& in = SharedInputs();
  const std::string ppl = "ppl --model '" + kModelA + "' --schemes naive,hadamard ";
  ExpectRejected(RunKvq(in.dir(), ppl + "--save-calibration c.safetensors"), "save",
                 {"--save-calibration c.safetensors", "naive,hadamard", "needs a calibration"});
  ExpectRejected(RunKvq(in.dir(), ppl + "--calib-activations acts.safetensors"), "calib-acts",
                 {"--calib-activations acts.safetensors", "naive,hadamard"});
  ExpectRejected(RunKvq(in.dir(), "ppl --model '" + kModelA +
                                      "' --schemes oscar --calibration q.safetensors "
                                      "--save-calibration c.safetensors"),
                 "save with --calibration",
                 {"--save-calibration c.safetensors", "--calibration q.safetensors"});
  EXPECT_FALSE(fs::exists(in.File("c.safetensors")));
}

// Negative values and sizes past the limits: named with the option, before any allocation.
TEST(BadInput, SizesFromOptionsAreCheckedBeforeAllocating) {
  const Inputs& in = SharedInputs();
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"eval --activations acts.safetensors --sink -5", {"--sink: -5 tokens is negative"}},
      {"eval --activations acts.safetensors --recent 100000000",
       {"--recent: 100000000 tokens exceeds the limit of 65536"}},
      {kAttend + "--sink 1000000 --out o.npy", {"--sink: 1000000 tokens exceeds the limit"}},
      {kAttend + "--recent 2000000000 --out o.npy", {"--recent: 2000000000 tokens"}},
      {"calibrate --activations acts.safetensors --sink 20000000 --out o.safetensors",
       {"--sink: 20000000 tokens"}},
      {"qview --activations acts.safetensors --calib-activations acts.safetensors --recent "
       "1000000",
       {"--recent: 1000000 tokens"}},
      {"ppl --model '" + kModelA + "' --sink 1000000", {"--sink: 1000000 tokens"}},
      {"bench --sink 1000000", {"--sink: 1000000 tokens"}},
      {"vectors generate --out v --seed -1", {"--seed: '-1' is not a seed"}},
      {"synth --out o.safetensors --seed -1", {"--seed: '-1' is not a seed"}},
      {"eval --activations acts.safetensors --seed 99999999999999999999999",
       {"--seed: '99999999999999999999999'"}},
      {"synth --out o.safetensors --tokens 100000000", {"tokens 100000000", "exceeds the"}},
      {"synth --out o.safetensors --q-heads 100000 --kv-heads 100000",
       {"kv_heads 100000", "exceeds the"}},
      {"bench --backend cpu --seq-len 100000000", {"--seq-len 100000000", "exceeds the"}},
      {"bench --backend cpu --seq-len 0", {"--seq-len 0 must be positive"}},
  };
  for (const auto& [args, needles] : cases) {
    const Listing before = List(in.File(""));
    ExpectRejected(RunKvq(in.dir(), args), args, needles);
    ExpectOnlyOutputChanged(before, List(in.File("")), "", args);
  }
}

// A model folder beside `in`'s scratch with config.json edited: `key` set to `value`; the
// weights and tokens are links to model A's.
std::string EditedModel(const Inputs& in, const std::string& name, const std::string& key,
                        const std::string& value) {
  const std::string dir = in.File(name);
  fs::create_directory(dir);
  std::string config = Slurp(kModelA + "/config.json");
  const size_t at = config.find("\"" + key + "\": ");
  const size_t begin = config.find(' ', at) + 1, end = config.find(',', begin);
  config.replace(begin, end - begin, value);
  std::ofstream(dir + "/config.json") << config;
  fs::create_symlink(kModelA + "/model.safetensors", dir + "/model.safetensors");
  fs::create_symlink(kModelA + "/tokens.safetensors", dir + "/tokens.safetensors");
  return name;
}

// Sizes from a config.json allocate no more than the run needs: RoPE tables only for the
// positions the windows hold (2^30 allowed positions used to mean 550 GB of tables), layers
// only as far as the file holds them.
TEST(BadInput, SizesFromAModelConfigAllocateOnlyWhatTheRunNeeds) {
  const Inputs& in = SharedInputs();
  const std::string long_context =
      EditedModel(in, "long_context", "max_position_embeddings", "1073741824");
  RunResult r = RunKvq(in.dir(), "capture --model " + long_context +
                                     " --windows calib:0 --length 32 --out long.safetensors");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(in.File("long.safetensors")));
  const std::string deep = EditedModel(in, "deep", "num_hidden_layers", "1073741824");
  r = RunKvq(in.dir(), "capture --model " + deep + " --windows calib:0 --length 32 --out "
                       "deep.safetensors");
  ExpectRejected(r, "deep", {"no tensor 'model.layers.8.input_layernorm.weight'"});
  EXPECT_FALSE(fs::exists(in.File("deep.safetensors")));
  fs::remove_all(in.File(long_context));
  fs::remove_all(in.File(deep));
  fs::remove(in.File("long.safetensors"));
}

// Held-out tokens that all stay in the bf16 windows: an error naming the counts and windows,
// not a table of exact INT2 schemes and a "-nanx" ratio.
TEST(BadInput, EvalRefusesACaptureThatNeverReachesTheQuantizedHistory) {
  const Inputs& in = SharedInputs();
  ASSERT_EQ(RunKvq(in.dir(), "synth --layers 1 --tokens 512 --q-heads 2 --kv-heads 1 --out "
                             "short.safetensors")
                .exit_code,
            0);
  const RunResult r = RunKvq(in.dir(), "eval --activations short.safetensors --schemes "
                                       "naive,hadamard,bf16");
  ExpectRejected(r, "eval short",
                 {"no token reaches the quantized history of naive, hadamard",
                  "(S0 = 64, W = 256, F = 1)", "320 tokens", "64 capture tokens",
                  "256 held out"});
  EXPECT_FALSE(Contains(r.out + r.err, "nan"));
  // With windows that leave a history, the same capture is scored.
  const RunResult ok = RunKvq(in.dir(), "eval --activations short.safetensors --schemes "
                                        "naive,hadamard --sink 16 --recent 32");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_FALSE(Contains(ok.out, "nan")) << ok.out;
  fs::remove(in.File("short.safetensors"));
}

TEST(BadInput, ParseErrorsExitTwoAndNameTheArgument) {
  const Inputs& in = SharedInputs();
  RunResult r = RunKvq(in.dir(), "");
  ExpectRejected(r, "kvq", {"no subcommand", "kvq --help"});
  r = RunKvq(in.dir(), "vectors");
  ExpectRejected(r, "kvq vectors", {"no subcommand", "kvq vectors --help"});
  // A mistyped option is reported as such, not as the required option it was meant to be.
  r = RunKvq(in.dir(),
             "quantize --inn x.npy --identity --clip 1 --bits 2 --group 64 --out o.safetensors");
  ExpectRejected(r, "--inn", {"unrecognised arguments '--inn x.npy'", "kvq quantize --help"});
  EXPECT_FALSE(Contains(r.err, "is required"));
  r = RunKvq(in.dir(), "quantize --in x.npy --identity --clip 1 --bits two --group 64 --out "
                       "o.safetensors");
  ExpectRejected(r, "--bits two", {"--bits", "two"});
  r = RunKvq(in.dir(), "quantize --in x.npy --identity --clip 1 --bits 2 --out o.safetensors");
  ExpectRejected(r, "no --group", {"--group is required"});
  r = RunKvq(in.dir(), "quantise --in x.npy");
  ExpectRejected(r, "quantise", {"quantise"});
  EXPECT_FALSE(fs::exists(in.File("o.safetensors")));
}

// One version string: the spec version kvq --version states is the one the vectors carry.
TEST(BadInput, VersionIsTheSpecVersionOfTheVectors) {
  const Inputs& in = SharedInputs();
  const RunResult r = RunKvq(in.dir(), "--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json manifest =
      nlohmann::json::parse(Slurp(std::string(KVQ_SOURCE_VECTORS) + "/manifest.json"));
  const std::string spec = manifest.at("spec_version").get<std::string>();
  EXPECT_TRUE(Contains(r.out, "(spec " + spec + ")")) << r.out << " vs spec " << spec;
}

// kvq vectors generate removes only the files its earlier manifest listed: a stale case goes,
// a file it never wrote stays.
TEST(BadInput, VectorsGenerateRemovesOnlyWhatItsManifestListed) {
  ScratchDir dir("kvq_vectors_generate");
  ASSERT_EQ(RunKvq(dir, "vectors generate --out v").exit_code, 0);
  const std::string manifest_path = dir.File("v/manifest.json");
  nlohmann::ordered_json manifest = nlohmann::ordered_json::parse(Slurp(manifest_path));
  // An earlier set's case that this set does not write, listed by its manifest.
  nlohmann::ordered_json stale = manifest["files"][0];
  stale["path"] = "stage/zz_stale_case.safetensors";
  manifest["files"].push_back(stale);
  std::ofstream(manifest_path) << manifest.dump(2) << "\n";
  std::ofstream(dir.File("v/stage/zz_stale_case.safetensors")) << "stale";
  // Files kvq never wrote, in a case folder and beside the manifest.
  std::ofstream(dir.File("v/stage/mine.safetensors")) << "mine";
  std::ofstream(dir.File("v/notes.txt")) << "notes";
  const RunResult r = RunKvq(dir, "vectors generate --out v");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, "removed 1 stale file")) << r.out;
  EXPECT_FALSE(fs::exists(dir.File("v/stage/zz_stale_case.safetensors")));
  EXPECT_EQ(Slurp(dir.File("v/stage/mine.safetensors")), "mine");
  EXPECT_EQ(Slurp(dir.File("v/notes.txt")), "notes");
  // A manifest that cannot be read: nothing is removed or written, the error names it.
  std::ofstream(manifest_path) << "{ not json";
  const RunResult bad = RunKvq(dir, "vectors generate --out v");
  ExpectRejected(bad, "bad manifest", {"cannot regenerate into 'v'", "manifest.json"});
  EXPECT_EQ(Slurp(dir.File("v/stage/mine.safetensors")), "mine");
  EXPECT_EQ(Slurp(manifest_path), "{ not json");
}

// Without a GPU the bench tables have no GPU columns, rather than rows of gpu_us 0.0.
TEST(BadInput, BenchOnTheCpuPrintsNoGpuColumns) {
  const Inputs& in = SharedInputs();
  const RunResult r = RunKvq(in.dir(), "bench --backend cpu --seq-len 64 --iters 1 --kv-heads 1 "
                                       "--q-heads 2 --head-dim 64 --schemes naive,bf16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, "cpu_us")) << r.out;
  EXPECT_FALSE(Contains(r.out, "gpu")) << r.out;
}

}  // namespace
}  // namespace kvq
