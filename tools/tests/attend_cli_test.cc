// End-to-end tests of `kvq attend`: inputs written with the kvq I/O API, the real binary run
// through std::system, the output compared bit for bit with PagedKVCache + Attend called
// directly; every error exits non-zero with one `kvq: error:` line naming the value and leaves
// no output file.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "kvq/common/error.h"
#include "kvq/calib/rotation.h"
#include "kvq/common/io.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/tensor.h"
#include "kvq/cpu_ref/attention.h"
#include "kvq/cpu_ref/cache.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq {
namespace {

using cli_testing::RunKvq;
using cli_testing::RunResult;

// Every file of a case lives in one scratch directory, the binary's working directory.
class Scratch : public cli_testing::ScratchDir {
 public:
  Scratch() : ScratchDir("kvq_attend_test") {}
};

RunResult Run(const Scratch& dir, const std::string& args) {
  return RunKvq(dir, "attend " + args);
}

// `kvq attend <args> --out o.npy` must fail with one error line naming every needle and leave
// no o.npy.
void ExpectFailure(const Scratch& dir, const std::string& args,
                   const std::vector<std::string>& needles) {
  std::remove(dir.File("o.npy").c_str());
  cli_testing::ExpectFailure(dir, "attend " + args + " --out o.npy", dir.File("o.npy"), needles);
}

std::vector<float> Random(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// Bitwise agreement does not need an orthogonal matrix; a random orthogonal one (calib's)
// keeps the case meaningful.
std::vector<float> Orthogonal(int d, std::mt19937_64& rng) {
  return kvq::calib::ToRowMajorF32(kvq::calib::RandomOrthogonal(d, rng()));
}

struct Case {
  int hq, hkv, d, tokens, bits, group, sink, recent, page;
  std::string rotation;  // "shared", "per-head", "hadamard", "identity", "" (bits 16 only)
  float clip_k, clip_v;
};

// Runs the binary on a case and the library directly; outputs must agree bit for bit.
void ExpectSameAsLibrary(const Case& c, uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " rotation " + c.rotation + " bits " +
               std::to_string(c.bits));
  std::mt19937_64 rng(seed);
  Scratch dir;
  const size_t row = static_cast<size_t>(c.hkv * c.d);
  const std::vector<float> q = Random(static_cast<size_t>(c.hq * c.d), rng);
  const std::vector<float> k = Random(c.tokens * row, rng);
  const std::vector<float> v = Random(c.tokens * row, rng);
  WriteNpy(dir.File("q.npy"), Tensor::F32({c.hq, c.d}, q));
  WriteNpy(dir.File("k.npy"), Tensor::F32({c.tokens, c.hkv, c.d}, k));
  WriteNpy(dir.File("v.npy"), Tensor::F32({c.tokens, c.hkv, c.d}, v));
  std::vector<float> rk, rv;
  std::string rotation_args;
  if (c.rotation == "shared") {
    const std::vector<float> a = Orthogonal(c.d, rng), b = Orthogonal(c.d, rng);
    WriteNpy(dir.File("rk.npy"), Tensor::F32({c.d, c.d}, a));
    WriteNpy(dir.File("rv.npy"), Tensor::F32({c.d, c.d}, b));
    for (int h = 0; h < c.hkv; ++h) {
      rk.insert(rk.end(), a.begin(), a.end());
      rv.insert(rv.end(), b.begin(), b.end());
    }
    rotation_args = "--rotation-k rk.npy --rotation-v rv.npy";
  } else if (c.rotation == "per-head") {
    for (int h = 0; h < c.hkv; ++h) {
      const std::vector<float> a = Orthogonal(c.d, rng), b = Orthogonal(c.d, rng);
      rk.insert(rk.end(), a.begin(), a.end());
      rv.insert(rv.end(), b.begin(), b.end());
    }
    WriteNpy(dir.File("rk.npy"), Tensor::F32({c.hkv, c.d, c.d}, rk));
    WriteNpy(dir.File("rv.npy"), Tensor::F32({c.hkv, c.d, c.d}, rv));
    rotation_args = "--rotation-k rk.npy --rotation-v rv.npy";
  } else if (!c.rotation.empty()) {
    rotation_args = "--" + c.rotation;
  }
  std::ostringstream args;
  args << "--q q.npy --k k.npy --v v.npy " << rotation_args << " --clip-k " << c.clip_k
       << " --clip-v " << c.clip_v
       << (c.bits == 16 ? std::string(" --format bf16") : " --bits " + std::to_string(c.bits))
       << " --group " << c.group
       << " --sink " << c.sink << " --recent " << c.recent << " --page " << c.page
       << " --out o.npy";
  const RunResult r = Run(dir, args.str());
  ASSERT_EQ(r.exit_code, 0) << args.str() << "\n" << r.err;
  const Tensor o = ReadNpy(dir.File("o.npy"));
  ASSERT_EQ(o.dtype, DType::kF32);
  ASSERT_EQ(o.shape, (std::vector<int64_t>{c.hq, c.d}));

  CacheParams p;
  p.num_q_heads = c.hq;
  p.num_kv_heads = c.hkv;
  p.sink = c.sink;
  p.recent = c.recent;
  p.page_size = c.page;
  if (c.bits == 16) p.key.format = p.value.format = kvq::Format::kBf16;
  for (WriteParams* w : {&p.key, &p.value}) {
    w->head_dim = c.d;
    w->group = c.group;
    w->bits = c.bits == 16 ? 2 : c.bits;
    w->rotation = rk.empty() ? (c.rotation == "hadamard" ? RotationKind::kHadamard
                                                         : RotationKind::kIdentity)
                             : RotationKind::kDense;
  }
  p.key.clip = c.clip_k;
  p.value.clip = c.clip_v;
  if (!p.quantized()) rk.clear(), rv.clear();
  cpu::PagedKVCache cache(p, rk, rv, {}, {}, cpu::BestBackend());
  const int seq = cache.AddSequence();
  cache.Prefill(seq, k.data(), v.data(), static_cast<size_t>(c.tokens));
  std::vector<float> want(q.size());
  cpu::Attend(cpu::BestBackend(), cache, seq, q.data(), want.data());
  const std::vector<float> got = o.ToF32();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(F32Bits(got[i]), F32Bits(want[i]))
        << "head " << i / c.d << " channel " << i % c.d << ": CLI " << got[i] << " library "
        << want[i];
  }
  if (p.quantized()) {
    EXPECT_GT(cache.HistoryLength(seq), 0u);  // the case exercised the history
  }
}

TEST(AttendCli, MatchesLibraryBitForBit) {
  const Case cases[] = {
      {8, 2, 64, 100, 2, 32, 4, 8, 16, "shared", 0.95f, 0.9f},
      {8, 2, 64, 100, 2, 32, 4, 8, 16, "per-head", 1.0f, 1.0f},
      {32, 4, 128, 130, 4, 64, 8, 16, 32, "hadamard", 0.96f, 0.92f},
      {4, 4, 128, 70, 2, 128, 2, 5, 16, "identity", 1.0f, 1.0f},
      {8, 1, 64, 50, 16, 64, 4, 8, 16, "", 1.0f, 1.0f},
      {8, 1, 64, 50, 16, 64, 4, 8, 16, "hadamard", 1.0f, 1.0f},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) ExpectSameAsLibrary(c, seed++);
}

TEST(AttendCli, ErrorsNameTheValueAndWriteNothing) {
  Scratch dir;
  std::mt19937_64 rng(3);
  WriteNpy(dir.File("q.npy"), Tensor::F32({8, 64}, Random(8 * 64, rng)));
  WriteNpy(dir.File("q3.npy"), Tensor::F32({3, 64}, Random(3 * 64, rng)));
  WriteNpy(dir.File("q128.npy"), Tensor::F32({8, 128}, Random(8 * 128, rng)));
  WriteNpy(dir.File("k.npy"), Tensor::F32({40, 2, 64}, Random(40 * 128, rng)));
  WriteNpy(dir.File("v.npy"), Tensor::F32({40, 2, 64}, Random(40 * 128, rng)));
  WriteNpy(dir.File("v39.npy"), Tensor::F32({39, 2, 64}, Random(39 * 128, rng)));
  WriteNpy(dir.File("k0.npy"), Tensor::F32({0, 2, 64}, {}));
  std::vector<float> bad = Random(40 * 128, rng);
  bad[7 * 128 + 64 + 9] = std::numeric_limits<float>::quiet_NaN();
  WriteNpy(dir.File("knan.npy"), Tensor::F32({40, 2, 64}, bad));
  WriteNpy(dir.File("r.npy"), Tensor::F32({64, 64}, Orthogonal(64, rng)));
  WriteNpy(dir.File("r32.npy"), Tensor::F32({32, 32}, Orthogonal(32, rng)));
  const std::string base = "--q q.npy --k k.npy --v v.npy --sink 2 --recent 4 --page 16";

  ExpectFailure(dir, base + " --hadamard --bits 3", {"--bits 3"});
  ExpectFailure(dir, base + " --bits 2", {"needs one of"});
  ExpectFailure(dir, base + " --hadamard --identity", {"only one of"});
  ExpectFailure(dir, base + " --rotation-k r.npy", {"--rotation-k and --rotation-v"});
  ExpectFailure(dir, base + " --rotation-k r32.npy --rotation-v r.npy",
                {"key rotation", "r32.npy", "[32, 32]", "[64, 64]"});
  ExpectFailure(dir, base + " --hadamard --clip-k 1.5", {"clip", "1.5"});
  ExpectFailure(dir, base + " --hadamard --clip-v abc", {"--clip-v 'abc'"});
  ExpectFailure(dir, base + " --hadamard --group 48", {"group size 48"});
  const std::string files = "--q q.npy --k k.npy --v v.npy";
  ExpectFailure(dir, files + " --hadamard --page 24", {"page size 24"});
  ExpectFailure(dir, files + " --hadamard --recent -1", {"--recent: -1 tokens is negative"});
  ExpectFailure(dir, files + " --hadamard --sink -2", {"--sink: -2 tokens is negative"});
  ExpectFailure(dir, "--q q3.npy --k k.npy --v v.npy --hadamard", {"num_q_heads 3"});
  ExpectFailure(dir, "--q q128.npy --k k.npy --v v.npy --hadamard", {"head_dim 128"});
  ExpectFailure(dir, "--q q.npy --k k.npy --v v39.npy --hadamard", {"[39, 2, 64]"});
  ExpectFailure(dir, "--q q.npy --k k0.npy --v k0.npy --hadamard", {"no token"});
  ExpectFailure(dir, "--q q.npy --k knan.npy --v v.npy --hadamard",
                {"nan", "token 7", "KV head 1", "channel 9"});
  ExpectFailure(dir, "--q missing.npy --k k.npy --v v.npy --hadamard", {"missing.npy"});
  ExpectFailure(dir, base + " --hadamard --backend nope", {"backend 'nope'"});
}

}  // namespace
}  // namespace kvq
