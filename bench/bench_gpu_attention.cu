// Decode attention on the GPU: kvq INT2 (OSCAR layout: bf16 sink + recent, INT2 history pages)
// and kvq's bf16 paged cache, over the shapes of seqs/000 §5.4: d = 128, Hq/Hkv = 32/8, G = 64,
// S0 = 64, W = 256, P = 64, batch x seq_len in {1, 8, 32, 128} x {8K, 32K, 128K} where the
// cache fits in device memory.
//
// Method: random cache contents (never zeros) with shuffled page tables; the L2 is flushed
// before every timed run by reading a buffer twice its size (bench/l2_flush.cuh: clean lines,
// as rotating input buffers would leave; --flush write: a write pass instead, whose dirty lines
// the step pays to write back); CUDA events around the whole
// decode step (query rotation + attention + merge); median of --iters runs after 3 warm-ups.
// Bytes are those the step must read: the cache rows of every sequence (codes + scale/min for
// the history, bf16 for sink/recent or the whole bf16 cache), the queries and rotations; the
// split partials (written and read once) are listed separately. The device-to-device copy
// bandwidth (bytes read + written) is measured in the same run, and so is each INT2 row's read
// floor: one kernel reading the same pools whole, timed the same way (ReadRangesKernel).
//
// Usage: kvq_bench_gpu_attention [--iters N] [--quick] [--batch B] [--len T] [--int2-only]
//                                [--int8-qk 0|1] [--aux-heads N] [--window-split N]
//                                [--hist-split N] [--timeline] [--flush read|write]
//                                [--schemes LIST | --schemes-only]
// (prints a markdown table; --batch / --len run one row, e.g. under ncu; the other flags
// override the plan. --schemes LIST (comma-separated scheme ids of calib/schemes.inc, and
// "int4", "k4v2", "k2v4": kvq's plain caches at those widths) first prints a table of those
// schemes' decode steps (every spec 1.1 scheme the GPU serves without a calibration, and the
// plain rows, with --schemes-only, which then skips the INT2 / bf16 table); the other flags
// apply to the INT2 table: --int8-qk 0 plans for the bf16-MMA loops (allow_int8_qk = false: the
// packed hi/lo loop at g <= 4), --int8-qk 1 takes the int8 QK loop.
// Without --int8-qk, when the plan takes the int8 QK loop (g <= 4) the INT2 step is also timed
// with the bf16-MMA loop the plan would take otherwise (packed hi/lo, allow_int8_qk = false) in
// the same process on the same data: column "INT2 us, bf16 QK loop". --aux-heads N: query heads
// per block of the rotation and merge kernels instead of the plan's; --window-split N: N
// window tokens per window block (the history split stays the plan's); --hist-split N: N
// history tokens per history block (a multiple of 64). --timeline: after the
// timings of each INT2 row, one more cold step records every block's entry / exit
// (DecodeAttentionInputs::timeline) and a per-kernel summary follows the table.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvq/calib/schemes.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/common/params_builder.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/attention_launch.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/formats.h"
#include "block_timeline.h"
#include "decode_rows.cuh"
#include "l2_flush.cuh"

namespace {

int g_int8_qk = -1;         // --int8-qk (-1: the plan's choice, and time the bf16 QK loop too)
int g_aux_heads = 0;        // --aux-heads (0: the plan's choice)
int g_window_split = 0;     // --window-split (0: the plan's choice)
int g_hist_split = 0;       // --hist-split (0: the plan's choice)
bool g_timeline = false;    // --timeline
std::string g_timelines;    // the summaries, printed after the table


using kvq::CacheParams;
using kvq::bench::FlushMode;
using kvq::bench::L2Flusher;
// The shapes, fills, timing, floor kernel, step buffers and scheme rows (decode_rows.cuh).
using kvq::bench::Alloc;
using kvq::bench::CheckFinite;
using kvq::bench::CopyBandwidth;
using kvq::bench::EmptyKernel;
using kvq::bench::FillFloatBf16Valued;
using kvq::bench::FloorMicros;
using kvq::bench::kGroup;
using kvq::bench::kHeadDim;
using kvq::bench::kHkv;
using kvq::bench::kHq;
using kvq::bench::kPage;
using kvq::bench::kRecent;
using kvq::bench::kSink;
using kvq::bench::MakeParams;
using kvq::bench::MedianMicros;
using kvq::bench::RandomBf16;
using kvq::bench::RandomBytes;
using kvq::bench::ReadRanges;
using kvq::bench::SchemeCache;
using kvq::bench::SchemeRow;
using kvq::bench::SchemeRows;
using kvq::bench::SummarizeTimeline;
using kvq::bench::StepBuffers;

struct Result {
  bool ran = false;
  double us = 0.0;
  double us_bf16_qk = 0.0;    // the plan takes int8 QK: the same step with the bf16-MMA loop
  double cache_bytes = 0.0;   // K/V rows read
  double other_bytes = 0.0;   // queries, rotations, partials (write + read)
  double floor_us = 0.0;      // ReadRangesKernel over the same pools
  int splits = 0;
};

Result RunOne(bool quantized, int batch, int seq_len, L2Flusher& flusher, int iters) {
  Result r;
  const CacheParams c = MakeParams(quantized);
  const int64_t paged = quantized ? std::max(0, seq_len - kSink - kRecent) : seq_len;
  const int pages_per_seq = static_cast<int>((paged + kPage - 1) / kPage);
  const int64_t pages = static_cast<int64_t>(pages_per_seq) * batch;
  const size_t row_codes = quantized ? kHeadDim * 2 / 8 : kHeadDim * 2;
  const size_t page_codes = static_cast<size_t>(kHkv) * kPage * row_codes;
  const size_t page_meta = quantized ? static_cast<size_t>(kHkv) * kPage * (kHeadDim / kGroup) : 0;
  const size_t window_elems = static_cast<size_t>(batch) * kHkv * kHeadDim;
  const size_t pool_bytes = 2 * pages * (page_codes + 2 * page_meta * 2);
  const size_t window_bytes = quantized ? 2 * window_elems * (kSink + kRecent) * 2 : 0;
  size_t free_bytes = 0, total_bytes = 0;
  KVQ_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (pool_bytes + window_bytes + (size_t{3} << 30) > free_bytes) return r;

  kvq::gpu::DecodeAttentionPlan plan =
      kvq::gpu::PlanDecodeAttention(c, batch, seq_len, 0, /*allow_int8_qk=*/g_int8_qk != 0);
  if (g_aux_heads > 0) plan.aux_heads_per_block = g_aux_heads;
  if (g_window_split > 0 && quantized) {
    plan.window_tokens_per_split = g_window_split;
    plan.window_splits = (std::min(seq_len, kSink + kRecent) + g_window_split - 1) / g_window_split;
  }
  if (g_hist_split > 0 && quantized) {
    plan.hist_tokens_per_split = g_hist_split;
    plan.hist_splits = static_cast<int>((paged + g_hist_split - 1) / g_hist_split);
  }
  plan.workspace_bytes = kvq::gpu::DecodeAttentionWorkspaceBytes(c, batch, plan);
  const bool plan_int8 = plan.quant_loop == kvq::gpu::QuantLoop::kInt8Qk;
  if (g_int8_qk == 1 && quantized) plan.quant_loop = kvq::gpu::QuantLoop::kInt8Qk;
  uint8_t* k_codes = Alloc<uint8_t>(pages * page_codes);
  uint8_t* v_codes = Alloc<uint8_t>(pages * page_codes);
  RandomBytes(k_codes, pages * page_codes, 11);
  RandomBytes(v_codes, pages * page_codes, 12);
  uint16_t *k_scale = nullptr, *k_min = nullptr, *v_scale = nullptr, *v_min = nullptr;
  uint16_t *sink_k = nullptr, *sink_v = nullptr, *recent_k = nullptr, *recent_v = nullptr;
  float *rot_k = nullptr, *rot_v = nullptr;
  if (quantized) {
    k_scale = Alloc<uint16_t>(pages * page_meta);
    k_min = Alloc<uint16_t>(pages * page_meta);
    v_scale = Alloc<uint16_t>(pages * page_meta);
    v_min = Alloc<uint16_t>(pages * page_meta);
    RandomBf16(k_scale, pages * page_meta, 0.2f, 0.8f, 21);
    RandomBf16(k_min, pages * page_meta, -1.5f, -0.5f, 22);
    RandomBf16(v_scale, pages * page_meta, 0.2f, 0.8f, 23);
    RandomBf16(v_min, pages * page_meta, -1.5f, -0.5f, 24);
    sink_k = Alloc<uint16_t>(window_elems * kSink);
    sink_v = Alloc<uint16_t>(window_elems * kSink);
    recent_k = Alloc<uint16_t>(window_elems * kRecent);
    recent_v = Alloc<uint16_t>(window_elems * kRecent);
    RandomBf16(sink_k, window_elems * kSink, -2.f, 2.f, 31);
    RandomBf16(sink_v, window_elems * kSink, -2.f, 2.f, 32);
    RandomBf16(recent_k, window_elems * kRecent, -2.f, 2.f, 33);
    RandomBf16(recent_v, window_elems * kRecent, -2.f, 2.f, 34);
    rot_k = Alloc<float>(static_cast<size_t>(kHkv) * kHeadDim * kHeadDim);
    rot_v = Alloc<float>(static_cast<size_t>(kHkv) * kHeadDim * kHeadDim);
    FillFloatBf16Valued<<<256, 256>>>(rot_k, static_cast<size_t>(kHkv) * kHeadDim * kHeadDim, 41);
    FillFloatBf16Valued<<<256, 256>>>(rot_v, static_cast<size_t>(kHkv) * kHeadDim * kHeadDim, 42);
  } else {
    // bf16 rows: reinterpret the random bytes' high halves as small finite values.
    RandomBf16(reinterpret_cast<uint16_t*>(k_codes), pages * page_codes / 2, -2.f, 2.f, 13);
    RandomBf16(reinterpret_cast<uint16_t*>(v_codes), pages * page_codes / 2, -2.f, 2.f, 14);
  }
  const StepBuffers buf(batch, seq_len, pages, plan.workspace_bytes);
  const size_t q_elems = buf.q_elems;
  float* const out = buf.out;
  void* const ws = buf.ws;
  kvq::gpu::DecodeAttentionInputs in;
  buf.Attach(in, batch, seq_len, pages_per_seq);
  // The planes of LayoutOf(c.key / c.value): affine_token codes, scale, min; bf16 rows.
  const int rows_plane = quantized ? kvq::gpu::kAffineCodesPlane : kvq::gpu::kBf16RowsPlane;
  in.key_planes[rows_plane] = k_codes;
  in.value_planes[rows_plane] = v_codes;
  if (quantized) {
    in.key_planes[kvq::gpu::kAffineScalePlane] = reinterpret_cast<const uint8_t*>(k_scale);
    in.key_planes[kvq::gpu::kAffineMinPlane] = reinterpret_cast<const uint8_t*>(k_min);
    in.value_planes[kvq::gpu::kAffineScalePlane] = reinterpret_cast<const uint8_t*>(v_scale);
    in.value_planes[kvq::gpu::kAffineMinPlane] = reinterpret_cast<const uint8_t*>(v_min);
  }
  in.sink_key = sink_k;
  in.sink_value = sink_v;
  in.recent_key = recent_k;
  in.recent_value = recent_v;
  in.key_heads.rotation = rot_k;
  in.value_heads.rotation = rot_v;
  r.us = MedianMicros(
      [&] {
        kvq::gpu::DecodeAttention(c, in, plan, ws, plan.workspace_bytes, out);
      },
      flusher, iters);
  if (quantized) {
    ReadRanges ranges;
    ranges.Add(k_codes, pages * page_codes);
    ranges.Add(v_codes, pages * page_codes);
    for (const uint16_t* meta : {k_scale, k_min, v_scale, v_min}) ranges.Add(meta, pages * page_meta * 2);
    for (const uint16_t* w : {sink_k, sink_v}) ranges.Add(w, window_elems * kSink * 2);
    for (const uint16_t* w : {recent_k, recent_v}) ranges.Add(w, window_elems * kRecent * 2);
    r.floor_us = FloorMicros(ranges, ws, flusher, iters);
  }
  if (quantized && plan_int8 && g_int8_qk < 0) {
    // The plan the bf16 QK loop would get (its waves sized for its own residency).
    kvq::gpu::DecodeAttentionPlan bf16_qk = kvq::gpu::PlanDecodeAttention(c, batch, seq_len, 0, false);
    if (g_aux_heads > 0) bf16_qk.aux_heads_per_block = g_aux_heads;
    r.us_bf16_qk = MedianMicros(
        [&] {
          kvq::gpu::DecodeAttention(c, in, bf16_qk, ws, bf16_qk.workspace_bytes, out);
        },
        flusher, iters);
  }
  if (g_timeline && quantized) {
    const kvq::gpu::DecodeStepBlocks blocks = kvq::gpu::DecodeAttentionBlocks(c, batch, plan);
    uint64_t* timeline = Alloc<uint64_t>(4 * blocks.total());
    in.timeline = timeline;
    flusher.Flush(nullptr);
    kvq::gpu::DecodeAttention(c, in, plan, ws, plan.workspace_bytes, out);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint64_t> rec(4 * blocks.total());
    KVQ_CUDA_CHECK(cudaMemcpy(rec.data(), timeline, rec.size() * 8, cudaMemcpyDeviceToHost));
    cudaFree(timeline);
    in.timeline = nullptr;
    const std::string title = "INT2 B=" + std::to_string(batch) + " T=" + std::to_string(seq_len) +
                              " (" + std::to_string(plan.hist_splits) + " history splits of " +
                              std::to_string(plan.hist_tokens_per_split) + " tokens, " +
                              std::to_string(plan.window_splits) + " window splits; step " +
                              std::to_string(r.us).substr(0, 6) + " us timed)";
    g_timelines += SummarizeTimeline(rec, title.c_str());
  }
  CheckFinite(out, q_elems, "B=" + std::to_string(batch) + " T=" + std::to_string(seq_len) +
                                (quantized ? " int2" : " bf16"));
  r.ran = true;
  r.splits = plan.hist_splits + plan.window_splits;
  const double per_token = quantized ? 2.0 * (row_codes + 2 * 2 * (kHeadDim / kGroup))
                                     : 2.0 * row_codes;
  r.cache_bytes = static_cast<double>(batch) * kHkv *
                  (paged * per_token + (quantized ? (seq_len - paged) * 2.0 * kHeadDim * 2 : 0.0));
  r.other_bytes = static_cast<double>(q_elems) * 4 * (quantized ? 3 : 2) +
                  (quantized ? 2.0 * kHkv * kHeadDim * kHeadDim * 4 : 0.0) +
                  static_cast<double>(batch) * kHq * r.splits * (kHeadDim + 2) * 4 * 2;
  for (void* p : std::vector<void*>{k_codes, v_codes, k_scale, k_min, v_scale, v_min, sink_k,
                                    sink_v, recent_k, recent_v, rot_k, rot_v}) {
    if (p) cudaFree(p);
  }
  buf.Free();
  return r;
}

// One scheme row at (batch, seq_len): the step's time, the bytes it must read (history planes
// by the format's accounting, the bf16 windows) and the read floor over the same pools.
Result RunScheme(const CacheParams& c, int batch, int seq_len, L2Flusher& flusher, int iters) {
  Result r;
  SchemeCache cache(c, batch, seq_len);
  if (!cache.fits) return r;
  const int64_t hist = cache.hist;
  const int64_t window = cache.window;  // sink + recent rows of the sequence
  const size_t row_elems = static_cast<size_t>(kHkv) * kHeadDim;

  const kvq::gpu::DecodeAttentionPlan plan = kvq::gpu::PlanDecodeAttention(c, batch, seq_len);
  kvq::gpu::DecodeAttentionInputs in;
  const StepBuffers buf(batch, seq_len, cache.pages, plan.workspace_bytes);
  buf.Attach(in, batch, seq_len, cache.pages_per_seq);
  cache.Attach(in);
  r.us = MedianMicros(
      [&] { kvq::gpu::DecodeAttention(c, in, plan, buf.ws, plan.workspace_bytes, buf.out); },
      flusher, iters);
  r.floor_us = FloorMicros(cache.ranges, buf.ws, flusher, iters);
  CheckFinite(buf.out, buf.q_elems, "B=" + std::to_string(batch) + " T=" + std::to_string(seq_len));
  r.ran = true;
  r.splits = plan.hist_splits + plan.window_splits;
  // The bytes a step must read: the history's planes as the cache counts them (tile planes per
  // tile, a shared norm once for the KV heads) and the bf16 window rows.
  double history = 0.0;
  for (const kvq::FormatLayout& layout : cache.layouts) {
    history += layout.Bytes(kvq::PlaneRole::kCodes, hist, kHkv) +
               layout.Bytes(kvq::PlaneRole::kMetadata, hist, kHkv);
  }
  r.cache_bytes = batch * (history + static_cast<double>(window) * 2 * row_elems * 2);
  cache.Free();
  buf.Free();
  return r;
}

// The scheme rows' table, cuDNN (bench_sdpa.py) beside it in the same device call.
void RunSchemeTable(const std::string& list, const std::vector<int>& batches,
                    const std::vector<int>& lens, L2Flusher& flusher, int iters, double copy_bw) {
  const std::vector<SchemeRow> rows = SchemeRows(list);
  std::printf("\n| scheme | B | T | us | GB/s (bytes read) | of copy BW | bytes read / step (MB) | "
              "splits | read floor us | us / floor |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int batch : batches) {
    for (int len : lens) {
      for (const SchemeRow& row : rows) {
        const Result a = RunScheme(row.params, batch, len, flusher, iters);
        if (!a.ran) {
          std::printf("| %s | %d | %d | skipped (memory) | | | | | | |\n", row.label.c_str(), batch,
                      len);
          continue;
        }
        const double rate = a.cache_bytes / (a.us * 1e-6);
        std::printf("| %s | %d | %d | %.1f | %.0f | %.0f%% | %.1f | %d | %.1f | %.2f |\n",
                    row.label.c_str(), batch, len, a.us, rate / 1e9, 100.0 * rate / copy_bw,
                    a.cache_bytes / 1e6, a.splits, a.floor_us, a.us / a.floor_us);
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  bool quick = false;
  bool int2_only = false;
  int only_batch = 0, only_len = 0;
  bool scheme_rows = false, schemes_only = false;
  std::string schemes;  // --schemes LIST (empty: every spec 1.1 scheme the GPU serves + int4)
  FlushMode flush = FlushMode::kRead;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--flush") && i + 1 < argc) {
      if (!kvq::bench::ParseFlushMode(argv[++i], &flush)) {
        std::fprintf(stderr, "error: --flush %s: expected read or write\n", argv[i]);
        return 2;
      }
      continue;
    }
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) only_batch = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--len") && i + 1 < argc) only_len = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--int2-only")) int2_only = true;
    else if (!std::strcmp(argv[i], "--int8-qk") && i + 1 < argc) g_int8_qk = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--aux-heads") && i + 1 < argc) g_aux_heads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--window-split") && i + 1 < argc) g_window_split = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--hist-split") && i + 1 < argc) g_hist_split = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--timeline")) g_timeline = true;
    else if (!std::strcmp(argv[i], "--schemes") && i + 1 < argc) {
      schemes = argv[++i];
      scheme_rows = true;
    } else if (!std::strcmp(argv[i], "--schemes-only")) {
      scheme_rows = true;
      schemes_only = true;
    }
  }
  try {
    kvq::gpu::RequireCudaDevice();
    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    L2Flusher flusher(flush);
    const double copy_bw = CopyBandwidth(flusher);
    const double empty_us = MedianMicros(
        [&] {
          EmptyKernel<<<1, 32>>>();
          KVQ_CUDA_CHECK(cudaGetLastError());
        },
        flusher, iters);
    std::printf("# kvq decode attention, %s, %d SMs, L2 %d MB; d=%d Hq/Hkv=%d/%d G=%d S0=%d W=%d P=%d\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, kHeadDim, kHq, kHkv,
                kGroup, kSink, kRecent, kPage);
    std::printf("# device-to-device copy: %.0f GB/s (read + write); median of %d runs, cold L2 "
                "(flushed by a %s pass)%s\n\n",
                copy_bw / 1e9, iters, kvq::bench::FlushModeName(flush),
                g_int8_qk < 0 ? "" : (g_int8_qk ? "; int8 QK loop" : "; bf16 QK loops"));
    std::printf("# an empty kernel, timed the same way: %.1f us\n\n", empty_us);
    std::vector<int> batches = quick ? std::vector<int>{1, 32} : std::vector<int>{1, 8, 32, 128};
    std::vector<int> lens = quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
    if (only_batch > 0) batches = {only_batch};
    if (only_len > 0) lens = {only_len};
    if (scheme_rows) RunSchemeTable(schemes, batches, lens, flusher, iters, copy_bw);
    if (schemes_only) return 0;
    std::printf("| B | T | kvq INT2 us | INT2 GB/s (cache) | of copy BW | INT2 splits | read floor us | "
                "INT2 / floor | INT2 us, bf16 QK loop | kvq BF16 us | BF16 GB/s | of copy BW | "
                "INT2 speedup vs kvq BF16 |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int batch : batches) {
      for (int len : lens) {
        const Result a = RunOne(true, batch, len, flusher, iters);
        const Result b = int2_only ? Result{} : RunOne(false, batch, len, flusher, iters);
        char int2[224] = "| skipped (memory) | | | | | | ", bf16[160] = "| skipped (memory) | | ";
        if (a.ran) {
          char alt[32] = "-";
          if (a.us_bf16_qk > 0) std::snprintf(alt, sizeof alt, "%.1f", a.us_bf16_qk);
          std::snprintf(int2, sizeof int2, "| %.1f | %.0f | %.0f%% | %d | %.1f | %.2f | %s ", a.us,
                        a.cache_bytes / (a.us * 1e-6) / 1e9,
                        100.0 * a.cache_bytes / (a.us * 1e-6) / copy_bw, a.splits, a.floor_us,
                        a.us / a.floor_us, alt);
        }
        if (b.ran) {
          std::snprintf(bf16, sizeof bf16, "| %.1f | %.0f | %.0f%% ", b.us,
                        b.cache_bytes / (b.us * 1e-6) / 1e9,
                        100.0 * b.cache_bytes / (b.us * 1e-6) / copy_bw);
        }
        std::printf("| %d | %d %s%s| %s |\n", batch, len, int2, bf16,
                    (a.ran && b.ran) ? (std::to_string(b.us / a.us).substr(0, 5) + "x").c_str() : "-");
        std::fflush(stdout);
      }
    }
    std::printf("\nGB/s counts the K/V cache bytes each step must read (INT2: 80 B per history token "
                "and KV head, 512 B per bf16 token); queries, rotations and split partials are "
                "extra traffic not counted. The read floor is one kernel reading the INT2 step's pools whole, "
                "in address order, timed the same way: what one plain streaming kernel takes for the bytes the "
                "step must read.\n");
    if (!g_timelines.empty()) std::printf("\n%s", g_timelines.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
