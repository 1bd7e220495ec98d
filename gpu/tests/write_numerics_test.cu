// Device-level checks of the write kernel's two exactness arguments (gpu/src/write_row.cuh):
//  * QuantizeCode (reciprocal estimate, division only near half-integers) gives the code of
//    clamp(rint(__fdiv_rn(a, sf)), 0, L) for every positive finite bf16 scale, against
//    quotients placed at, and a few ulps around, every half-integer (the double-rounding trap),
//    plus random pairs over the whole fp32 range and quantizer-like pairs a = x - mf.
//  * ClipRow's exact order statistic (max, merge-from-the-top, radix select) equals the k-th
//    smallest |x| of a host sort, for EVERY rank k at d = 64, 128, 256, on rows with ties,
//    zeros of both signs and wide ranges; the clipped values match the spec's comparisons.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "../src/write_row.cuh"
#include "gpu_test_util.h"
#include "kvq/conformance/prng.h"
#include "kvq/conformance/rows.h"
#include "kvq/testbed/compare.h"

namespace kvq::gpu {
namespace {

using namespace kvq::gpu::testing;
using conformance::SplitMix64;
using testbed::DescribeFloat;

// ---- QuantizeCode ------------------------------------------------------------------------------

struct CodeMismatch {
  unsigned long long count;    // pairs whose codes differ
  unsigned long long divided;  // pairs that took the division (fallback) path
  unsigned long long pairs;    // pairs checked
  float a;                     // the first mismatching pair (any one, for the message)
  float sf;
  uint32_t got;
  uint32_t want;
};

__device__ uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

template <int BITS>
__device__ uint32_t ReferenceCode(float a, float sf) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  return static_cast<uint32_t>(
      __float2int_rn(fminf(fmaxf(__fdiv_rn(a, sf), 0.0f), kLevels)));
}

template <int BITS>
__device__ void CheckPair(float a, float sf, CodeMismatch* out) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const float inv = detail::QuantizeReciprocal(sf);
  const uint32_t got = detail::QuantizeCode<BITS>(a, sf, inv);
  const uint32_t want = ReferenceCode<BITS>(a, sf);
  // Would the fast path have divided? (Recomputed here only to report the fallback rate.)
  const float c = fminf(fmaxf(__fmul_rn(a, inv), 0.0f), kLevels);
  const float frac = __fsub_rn(c, rintf(c));
  const bool divided = inv == 0.0f || fabsf(frac) > detail::kHalfMinusMargin;
  atomicAdd(&out->pairs, 1ull);
  if (divided) atomicAdd(&out->divided, 1ull);
  if (got != want) {
    if (atomicAdd(&out->count, 1ull) == 0) {
      out->a = a;
      out->sf = sf;
      out->got = got;
      out->want = want;
    }
  }
}

// Thread per (bf16 scale, half-integer h = k + 1/2 for k = -2 .. L + 1, ulp offset -4 .. 4):
// a = fl(h * sf) moved by the offset, i.e. quotients at and next to every rounding boundary,
// and a few more just outside [0, L]. Scale bits 0x0001 .. 0x7f7f: every positive finite bf16.
template <int BITS>
__global__ void HalfIntegerKernel(CodeMismatch* out) {
  constexpr int kLevels = (1 << BITS) - 1;
  constexpr int kHalves = kLevels + 4;  // k = -2 .. L + 1
  constexpr int kOffsets = 9;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_scale = int64_t{kHalves} * kOffsets;
  if (idx >= 0x7f7f * per_scale) return;
  const uint32_t scale_bits = 1u + static_cast<uint32_t>(idx / per_scale);
  const int rest = static_cast<int>(idx % per_scale);
  const int k = rest / kOffsets - 2;
  const int offset = rest % kOffsets - 4;
  const float sf = __uint_as_float(scale_bits << 16);
  const float h = static_cast<float>(k) + 0.5f;
  const float base = __fmul_rn(h, sf);
  // Moving by ulps: step the bit pattern (toward +inf for positive, mirrored for negative).
  const int32_t bits = static_cast<int32_t>(__float_as_uint(base));
  const float a = __int_as_float(bits + offset);
  if (isfinite(a)) CheckPair<BITS>(a, sf, out);
  if (offset == 0) {  // signed zeros, once per scale and half-integer
    CheckPair<BITS>(0.0f, sf, out);
    CheckPair<BITS>(-0.0f, sf, out);
  }
}

// Random pairs: (1) a and sf from random bits over the whole finite range (sf > 0, a bf16 value
// as the quantizer's scale always is); (2) quantizer-like: sf random bf16 in a moderate range,
// mf random bf16, x = mf + u * L * sf for u uniform in [-0.1, 1.1], a = fl(x - mf).
template <int BITS>
__global__ void RandomPairKernel(uint32_t seed, int64_t pairs, CodeMismatch* out) {
  constexpr float kLevels = static_cast<float>((1 << BITS) - 1);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const uint32_t r0 = Hash(seed ^ static_cast<uint32_t>(idx) * 0x9e3779b9u);
  const uint32_t r1 = Hash(r0 + 0x632be5abu);
  const uint32_t r2 = Hash(r1 + 0x85157af5u);
  {
    const float sf = __uint_as_float(((r0 % 0x7f7fu) + 1u) << 16);
    const float a = __uint_as_float(r1 & 0xff7fffffu);  // finite, either sign
    CheckPair<BITS>(a, sf, out);
  }
  {
    // Exponents of sf in [2^-40, 2^40], mf in [-2^20, 2^20].
    const float sf = __uint_as_float(((87u + r0 % 81u) << 23 | (r0 >> 9 & 0x7fu) << 16));
    const float mf = __uint_as_float(((107u + (r1 % 41u)) << 23 | (r1 >> 9 & 0x7fu) << 16) |
                                     (r1 & 0x80000000u));
    const float u = -0.1f + 1.2f * static_cast<float>(r2 >> 8) * (1.0f / 16777216.0f);
    const float x = __fadd_rn(mf, __fmul_rn(__fmul_rn(u, kLevels), sf));
    CheckPair<BITS>(__fsub_rn(x, mf), sf, out);
  }
}

template <int BITS>
void ExpectCodesMatchDivision(const char* name) {
  DeviceBuffer<CodeMismatch> result(1);
  result.Fill(0);
  constexpr int kLevels = (1 << BITS) - 1;
  const int64_t half_threads = int64_t{0x7f7f} * (kLevels + 4) * 9;
  HalfIntegerKernel<BITS><<<static_cast<unsigned>((half_threads + 255) / 256), 256>>>(
      result.get());
  KVQ_CUDA_CHECK(cudaGetLastError());
  const int64_t random_pairs = int64_t{1} << 24;
  for (uint32_t seed : {1u, 2u, 3u}) {
    RandomPairKernel<BITS><<<static_cast<unsigned>(random_pairs / 256), 256>>>(
        seed, random_pairs, result.get());
    KVQ_CUDA_CHECK(cudaGetLastError());
  }
  const CodeMismatch r = result.Download()[0];
  std::ostringstream first;
  first << "a=" << DescribeFloat(r.a) << " sf=" << DescribeFloat(r.sf) << " got=" << r.got
        << " want=" << r.want;
  EXPECT_EQ(r.count, 0ull) << name << ": " << r.count << " of " << r.pairs
                           << " pairs differ from __fdiv_rn; first: " << first.str();
  EXPECT_GT(r.pairs, static_cast<unsigned long long>(3 * random_pairs));
  // The division must stay the exception on the random pairs (the half-integer sweep takes it
  // on purpose): the fallback count is a small fraction of all pairs.
  std::printf("[ info ] %s: %llu pairs, %llu (%.3f%%) took the division\n", name, r.pairs,
              r.divided, 100.0 * static_cast<double>(r.divided) / static_cast<double>(r.pairs));
  EXPECT_LT(r.divided, r.pairs / 4) << name;
}

TEST(QuantizeCodeTest, Int2MatchesIeeeDivisionEverywhere) {
  KVQ_SKIP_WITHOUT_CUDA();
  ExpectCodesMatchDivision<2>("int2");
}

TEST(QuantizeCodeTest, Int4MatchesIeeeDivisionEverywhere) {
  KVQ_SKIP_WITHOUT_CUDA();
  ExpectCodesMatchDivision<4>("int4");
}

// ---- ClipRow: every rank ---------------------------------------------------------------------

// Slice i (d/16 lanes) handles row i / D with rank k = i % D: the slices of one warp ask for
// different ranks.
template <int D>
__global__ void ClipEveryRankKernel(const float* rows, int num_rows, float* tau, float* clipped) {
  constexpr int kLanes = detail::SliceTraits<D>::kLanes;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t slice = warp * detail::SliceTraits<D>::kRowsPerWarp + detail::SliceIndex<D>();
  const int64_t total = static_cast<int64_t>(num_rows) * D;
  if (__all_sync(detail::kFullMask, slice >= total)) return;
  const bool active = slice < total;
  const int64_t row = active ? slice / D : 0;
  const int k = active ? static_cast<int>(slice % D) : D - 1;
  const int r = detail::SliceLane<D>();
  float v[16];
#pragma unroll
  for (int s = 0; s < 16; ++s) v[s] = rows[row * D + r + kLanes * s];
  const float t = __uint_as_float(
      detail::ClipThresholdBits<D>(v, k, detail::SliceMaxMagnitudeBits<D>(v)));
  if (!active) return;
#pragma unroll
  for (int s = 0; s < 16; ++s) {
    clipped[slice * D + r + kLanes * s] = detail::ClipValue(v[s], t);
  }
  if (r == 0) tau[slice] = t;
}

// One row of every row kind (conformance::TestRowKinds(false): near-limit magnitudes too, the
// clip has no range limit), shaped for G = 32, INT2.
std::vector<float> SelectRows(int d, SplitMix64* rng) {
  std::vector<float> rows = conformance::MakeRows(
      conformance::TestRowKinds(/*within_write_range=*/false),
      testbed::Write().head_dim(d).group(32).bits(2), rng, nullptr);
  // Runs of ties around every rank: values from a tiny set, and a row of one repeated value
  // with a few larger ones.
  for (int variant = 0; variant < 4; ++variant) {
    std::vector<float> row(d);
    for (int j = 0; j < d; ++j) {
      const int pick = static_cast<int>(rng->Below(static_cast<uint32_t>(variant + 2)));
      row[j] = (rng->Bit() ? 1.0f : -1.0f) * static_cast<float>(pick) * 0.25f;
      if (variant == 3 && rng->Below(8) == 0) row[j] = -0.0f;
    }
    rows.insert(rows.end(), row.begin(), row.end());
  }
  return rows;
}

template <int D>
void ExpectEveryRankMatchesSort() {
  SplitMix64 rng(977u * D);
  const std::vector<float> rows = SelectRows(D, &rng);
  const int num_rows = static_cast<int>(rows.size() / D);
  DeviceBuffer<float> d_rows(rows);
  DeviceBuffer<float> tau(static_cast<size_t>(num_rows) * D);
  DeviceBuffer<float> clipped(static_cast<size_t>(num_rows) * D * D);
  tau.Fill(0xFF);
  clipped.Fill(0xFF);
  const int64_t threads = static_cast<int64_t>(num_rows) * D * (D / 16);
  ClipEveryRankKernel<D><<<static_cast<unsigned>((threads + 255) / 256), 256>>>(
      d_rows.get(), num_rows, tau.get(), clipped.get());
  KVQ_CUDA_CHECK(cudaGetLastError());
  // Expected: tau [row, k] = the k-th smallest |x| of the row (a host sort), clipped [row, k, j]
  // = x_j clipped to +-tau by the spec's comparisons.
  std::vector<float> want_tau(static_cast<size_t>(num_rows) * D);
  std::vector<float> want_clipped(static_cast<size_t>(num_rows) * D * D);
  for (int r = 0; r < num_rows; ++r) {
    std::vector<float> mags(D);
    for (int j = 0; j < D; ++j) mags[j] = std::fabs(rows[r * D + j]);
    std::sort(mags.begin(), mags.end());
    for (int k = 0; k < D; ++k) {
      const size_t w = static_cast<size_t>(r) * D + k;
      const float want = mags[k];
      want_tau[w] = want;
      for (int j = 0; j < D; ++j) {
        const float x = rows[r * D + j];
        want_clipped[w * D + j] = (x > want) ? want : ((x < -want) ? -want : x);
      }
    }
  }
  const std::vector<int64_t> tau_shape = {num_rows, D}, clipped_shape = {num_rows, D, D};
  EXPECT_TRUE(testbed::AllBitsEqual(
      "ClipRow every rank d" + std::to_string(D),
      {{"tau", Tensor::F32(tau_shape, want_tau)},
       {"clipped", Tensor::F32(clipped_shape, want_clipped)}},
      {{"tau", Tensor::F32(tau_shape, tau.Download())},
       {"clipped", Tensor::F32(clipped_shape, clipped.Download())}},
      {{"rows", testbed::AsTensor(rows, D)}}));
}

TEST(ClipRowTest, EveryRankMatchesSortD64) {
  KVQ_SKIP_WITHOUT_CUDA();
  ExpectEveryRankMatchesSort<64>();
}
TEST(ClipRowTest, EveryRankMatchesSortD128) {
  KVQ_SKIP_WITHOUT_CUDA();
  ExpectEveryRankMatchesSort<128>();
}
TEST(ClipRowTest, EveryRankMatchesSortD256) {
  KVQ_SKIP_WITHOUT_CUDA();
  ExpectEveryRankMatchesSort<256>();
}

}  // namespace
}  // namespace kvq::gpu
