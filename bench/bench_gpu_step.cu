// The whole decode step of one layer on the GPU, in one CUDA graph (issue 26): the append of one
// token per sequence through the scheme's real write (rotation, clip, quantize, the demotion
// into the history or the tile flush when it falls due, the new rows into the bf16 ring) and
// the decode step (query rotation, attention, merge), as gpu::DecodeStep queues them (each
// kernel launched while the one before it runs, the rotation before the append where a side has
// a dense rotation; column "serial step": gpu::AppendStep, then gpu::DecodeAttention launched
// after all of it), captured
// on a non-default stream (cudaStreamBeginCapture, global mode: an allocation, a
// synchronisation or a synchronous copy would fail the capture), instantiated once and replayed.
// Shapes of seqs/000 §5.4: d = 128, Hq/Hkv = 32/8, B x T in {1, 8, 32, 128} x {8K, 32K, 128K}
// where the cache fits in device memory (3 GB kept free, as kvq_bench_gpu_attention keeps).
//
// Rows: kvq's bf16 cache (its pages, the decode's bf16 path; kvq has no bf16 write, as
// AppendStep refuses a bf16 cache, so its append is this program's index copy of the new rows
// into their page slot, what index_copy_ does in the PyTorch baseline), "oscar" (the attention
// benchmark's INT2 cache: dense R + P_br per KV head, G = 64, S0 = 64, W = 256, with OSCAR's
// clip ρ = 0.96 on the write), and the catalogue rows of decode_rows.cuh (SchemeRows): hadamard
// (INT2, FWHT, G = 64, S0 = 64, W = 256), kivi, ots (tiles of 32, S0 = 0, W = 1, F = 128),
// saw_int4 (S0 = W = 0), fp8_unscaled and fp8_hadamard (S0 = W = 0; fp8 scales 0.05 a head)
// and int4 (hadamard at 4 bits). Random cache contents, shuffled page tables, as the attention
// benchmark builds them (SchemeCache).
//
// Equal work in every replay: the sequence lengths live in device memory and the graph does not
// advance them (a serving engine's length update, a host write or one tiny kernel before the
// next step, is not in the graph). Every replay is therefore the step at one length: the
// sequences hold `before` tokens, the append writes position `before` (its ring slot, and the
// demotion of position before - W or the flush of F rows when one falls due at that length,
// into the same history slots each time), and the decode attends over before + 1 tokens. A
// replay rewrites the same slots with other values of the same distribution; the work, the
// addresses and the bytes are those of the step. Column "step" is the step at before = T - 1
// (the decode reads T tokens, the attention benchmark's T). Schemes with F = 1 and W >= 1
// (oscar, hadamard, int4) demote one token every step, and S0 = W = 0 (saw_int4, fp8) writes
// the new token into the history every step, so one graph is every step. With F > 1 (kivi,
// ots: F = 128) the history grows F tokens at once: "step" is a step without a flush, "flush
// step" the next length at which the flush falls due for every sequence (a graph of its own),
// and "us / step" the mean over F steps, ((F - 1) step + flush step) / F: what each generated
// token pays when the B sequences flush together (in a serving batch they flush at different
// steps: the same bytes on average, not necessarily the same time).
//
// Timing: 3 unflushed replays, then --iters replays, before each the L2 flushed by reading a
// buffer twice its size (bench/l2_flush.cuh, --flush write: a write pass), queued on the graph's
// stream outside the events; CUDA events on that stream around cudaGraphLaunch; the median.
// The append alone and the decode alone (the step without a flush) are graphs of their own,
// timed the same way, and so is a graph of one empty kernel (the replay's fixed cost).
//
// The floor: what the step must move at least, each byte once: the cache state it reads (the
// history planes of the tokens stored before the step, the bf16 sink and ring rows, a bf16
// cache's rows), the new K and V rows, the queries (fp32) and the dense rotations R_K, R_V
// (oscar); and what it writes: the new rows where they stay bf16, the history bytes of the
// tokens demoted or flushed, the output (fp32). Not counted: split partials (written and read
// back inside the step), page tables and lengths (4 bytes a page or sequence). One streaming
// kernel (StepFloorKernel: 16-byte loads, 4 in flight a thread, over prefixes of the real
// buffers of those sizes; 16-byte stores of the written bytes into a scratch buffer) in a graph
// of its own, timed the same way. "of copy BW" is those bytes over the step's time against the
// device-to-device copy of the same run (bytes read + written).
//
// The baseline: bench/bench_step_sdpa.py (PyTorch: index_copy_ of the new rows into dense bf16
// K / V [B, Hkv, T, d] + cuDNN SDPA, one CUDA graph), run in the same device call; with
// --baseline FILE (its markdown output) column "vs cuDNN step" is its step time over this one.
// "vs kvq bf16" divides kvq's bf16 cache step (the bf16 row, run first) by the row's.
//
// Usage: kvq_bench_gpu_step [--iters N] [--quick] [--batch B] [--len T] [--schemes LIST]
//                           [--flush read|write] [--baseline FILE] [--timeline]
// (prints a markdown table; --batch / --len: one shape; --schemes: comma-separated rows among
// bf16, oscar and the catalogue ids SchemeRows builds (int4, k4v2, k2v4 too); --quick: B in
// {1, 32}, T = 32K; --timeline: after the table, each quantized row's step graph replayed with
// the block records on (DecodeAttentionInputs::timeline: the rotation's, the decode's and the
// merge's blocks, per kind: entries, exits, when their inputs were ready).)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/params.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/write.h"
#include "block_timeline.h"
#include "decode_rows.cuh"
#include "l2_flush.cuh"

namespace {

using kvq::CacheParams;
using kvq::bench::FlushMode;
using kvq::bench::L2Flusher;
// The shapes, fills, timing, step buffers, scheme rows and caches (decode_rows.cuh).
using kvq::bench::Alloc;
using kvq::bench::CheckFinite;
using kvq::bench::CopyBandwidth;
using kvq::bench::EmptyKernel;
using kvq::bench::kHeadDim;
using kvq::bench::kHkv;
using kvq::bench::kHq;
using kvq::bench::MakeParams;
using kvq::bench::MedianMicros;
using kvq::bench::PlaneBytes;
using kvq::bench::RandomBf16;
using kvq::bench::ReadRanges;
using kvq::bench::XorOfRanges;
using kvq::bench::SchemeCache;
using kvq::bench::SchemeRow;
using kvq::bench::SchemeRows;
using kvq::bench::StepBuffers;

constexpr const char* kDefaultRows =
    "bf16,oscar,hadamard,kivi,ots,saw_int4,fp8_unscaled,fp8_hadamard,int4";
constexpr size_t kTokenRowBytes = static_cast<size_t>(kHkv) * kHeadDim * 2;  // bf16, all heads

bool g_timeline = false;   // --timeline
std::string g_timelines;   // the summaries, printed after the table

// ---- Kernels ----

// The bf16 cache's append: the new token of each sequence (key, value [B, Hkv, d] bf16) into
// its page at position lengths[b]: page page_tables[b * max_pages + pos / P], slot pos % P, of
// the pools [pages, Hkv, P, d] bf16 (the decode's bf16 layout). 16 bytes a thread.
struct Bf16AppendArgs {
  const uint4* key = nullptr;
  const uint4* value = nullptr;
  uint4* key_pool = nullptr;
  uint4* value_pool = nullptr;
  const int32_t* lengths = nullptr;  // [B], before the append
  const int32_t* page_tables = nullptr;
  int max_pages = 0;
  int batch = 0;
  int page_size = 0;
};
constexpr int kRowVectors = kHeadDim * 2 / 16;  // uint4s a bf16 row of d values

__global__ void Bf16AppendKernel(const __grid_constant__ Bf16AppendArgs a) {
  const int64_t per_tensor = static_cast<int64_t>(a.batch) * kHkv * kRowVectors;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= 2 * per_tensor) return;
  const bool value = i >= per_tensor;
  const int64_t j = value ? i - per_tensor : i;  // [B, Hkv, kRowVectors]
  const int v = static_cast<int>(j % kRowVectors);
  const int h = static_cast<int>(j / kRowVectors % kHkv);
  const int b = static_cast<int>(j / (kRowVectors * kHkv));
  const int pos = a.lengths[b];
  const int64_t page = a.page_tables[static_cast<int64_t>(b) * a.max_pages + pos / a.page_size];
  const int64_t row = (page * kHkv + h) * a.page_size + pos % a.page_size;
  (value ? a.value_pool : a.key_pool)[row * kRowVectors + v] = (value ? a.value : a.key)[j];
}

// The floor of a step: reads the ranges of `r` (XorOfRanges, as ReadRangesKernel does) and
// stores `n_out` 16-byte words into `out` (streaming stores, issued first: they depend on
// nothing). The XOR of what it read goes to `sink` only when it equals a
// constant, so that the loads stay.
__global__ void __launch_bounds__(256) StepFloorKernel(const __grid_constant__ ReadRanges r,
                                                       uint4* out, size_t n_out,
                                                       uint32_t* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (size_t i = first; i < n_out; i += stride) {
    __stcs(out + i, make_uint4(static_cast<uint32_t>(i), 1u, 2u, 3u));
  }
  const uint32_t x = XorOfRanges(r, first, stride);
  if (x == 0x9e3779b9u) *sink = x;
}

// ---- CUDA graphs ----

// A CUDA graph of what `enqueue()` queues on `stream`, instantiated. The capture is global
// (cudaStreamCaptureModeGlobal): a call that cannot be captured (cudaMalloc, a synchronous
// copy, a synchronisation) fails it. A kvq::Error thrown inside ends the capture first.
class Graph {
 public:
  template <typename Enqueue>
  Graph(cudaStream_t stream, Enqueue&& enqueue) {
    KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      enqueue();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);  // the stream leaves capture mode either way
      if (partial) cudaGraphDestroy(partial);
      throw;
    }
    KVQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    const cudaError_t instantiated = cudaGraphInstantiate(&exec_, graph_, 0);
    if (instantiated != cudaSuccess) cudaGraphDestroy(graph_);
    KVQ_CUDA_CHECK(instantiated);
  }
  ~Graph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  void Launch(cudaStream_t stream) const { KVQ_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }
  // Nodes of the graph: its kernel launches (and memsets / copies, of which a step has none).
  size_t Nodes() const {
    size_t n = 0;
    KVQ_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
    return n;
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Median µs of `iters` replays of `graph` on `stream` (MedianMicros: 3 warm-ups, the L2 flushed
// before each timed replay, events on the stream).
double GraphMicros(const Graph& graph, cudaStream_t stream, L2Flusher& flusher, int iters) {
  return MedianMicros([&] { graph.Launch(stream); }, flusher, iters, stream);
}

// ---- Rows ----

// The step benchmark's rows: "bf16" and "oscar" are the attention benchmark's two caches
// (MakeParams; oscar with ρ = 0.96 on the write, which only the write reads), every other name a
// scheme row of SchemeRows. kvq's bf16 row goes first, so that the others can be divided by it.
std::vector<SchemeRow> StepRows(const std::string& list) {
  std::vector<SchemeRow> rows;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, comma - at);
    at = comma + 1;
    if (name == "bf16") {
      rows.insert(rows.begin(), SchemeRow{name, MakeParams(false)});
    } else if (name == "oscar") {
      CacheParams c = MakeParams(true);
      c.key.clip = 0.96f;
      c.value.clip = 0.96f;
      rows.push_back(SchemeRow{name, c});
    } else {
      rows.push_back(SchemeRows(name).front());
    }
  }
  return rows;
}

// What a step must move at least when its sequences hold `before` tokens (the floor; see the
// header): `reads` names prefixes of the real buffers, as many bytes as the step reads from each.
struct StepTraffic {
  ReadRanges reads;
  double read_bytes = 0.0;
  double write_bytes = 0.0;
};

StepTraffic Traffic(const CacheParams& c, const SchemeCache& cache, const StepBuffers& buf,
                    const uint16_t* new_k, const uint16_t* new_v, int batch, int64_t before) {
  StepTraffic t;
  const auto read = [&t](const void* p, double bytes) {
    t.reads.Add(p, static_cast<size_t>(bytes));
    t.read_bytes += bytes;
  };
  const double rows = static_cast<double>(batch) * kTokenRowBytes;  // one token a sequence
  if (c.quantized()) {
    const int64_t stored = c.HistoryTokens(before);
    const int64_t after = c.HistoryTokens(before + 1);
    for (int kv = 0; kv < 2; ++kv) {
      const kvq::FormatLayout& layout = cache.layouts[kv];
      for (int i = 0; i < layout.num_planes; ++i) {
        const size_t old_bytes = PlaneBytes(layout, i, stored, kHkv);
        read(cache.planes[kv][i], static_cast<double>(batch) * old_bytes);
        t.write_bytes +=
            static_cast<double>(batch) * (PlaneBytes(layout, i, after, kHkv) - old_bytes);
      }
      read(cache.windows[kv], rows * std::min<int64_t>(c.sink, before));
      read(cache.windows[2 + kv], rows * (before - c.RecentBegin(before)));
      if (cache.rotations[kv]) {
        read(cache.rotations[kv], static_cast<double>(kHkv) * kHeadDim * kHeadDim * 4);
      }
    }
    // The new token stays bf16 in the sink or the ring unless it enters the history at once.
    if (before < c.sink || before >= c.sink + after) t.write_bytes += 2 * rows;
  } else {
    read(cache.planes[0][0], rows * before);
    read(cache.planes[1][0], rows * before);
    t.write_bytes += 2 * rows;
  }
  read(new_k, rows);
  read(new_v, rows);
  read(buf.q, static_cast<double>(buf.q_elems) * 4);
  t.write_bytes += static_cast<double>(buf.q_elems) * 4;  // the output
  return t;
}

// One graph's figures: the step with `before` tokens stored.
struct StepTiming {
  int64_t before = 0;
  double us = 0.0;
  double serial_us = 0.0;  // the append, then the decode waiting for all of it (steady step)
  double append_us = 0.0;  // the append alone in a graph (steady step only)
  double decode_us = 0.0;  // the decode alone in a graph (steady step only)
  double floor_us = 0.0;
  double bytes = 0.0;      // read + written (StepTraffic)
  size_t nodes = 0;
};

struct RowResult {
  bool ran = false;
  StepTiming step;
  bool has_flush = false;  // F > 1: the flush step timed apart
  StepTiming flush;
  int flush_every = 1;     // F
  // Means over F steps (F = 1: the step's own figures).
  double Mean(double StepTiming::*field) const {
    if (!has_flush) return step.*field;
    return ((flush_every - 1) * step.*field + flush.*field) / flush_every;
  }
};

// The row `c` at (batch, seq_len): the step graph at before = seq_len - 1 and, for F > 1, the
// flush step's graph at the next length where the flush falls due.
RowResult RunRow(const std::string& label, const CacheParams& c, int batch, int seq_len, L2Flusher& flusher, int iters,
                 cudaStream_t stream, int sms) {
  RowResult r;
  const bool quantized = c.quantized();
  const auto due = [&c](int64_t before) {
    return c.HistoryTokens(before + 1) - c.HistoryTokens(before);
  };
  std::vector<int64_t> befores = {seq_len - 1};
  if (quantized && c.flush > 1) {
    r.flush_every = c.flush;
    if (due(befores[0]) > 0) ++befores[0];  // flushes are F > 1 apart: the next one has none
    for (int64_t before = seq_len - 1; before < seq_len - 1 + c.flush; ++before) {
      if (due(before) > 0) {
        befores.push_back(before);
        r.has_flush = true;
        break;
      }
    }
  }
  const int64_t longest = *std::max_element(befores.begin(), befores.end()) + 1;
  SchemeCache cache(c, batch, static_cast<int>(longest));
  if (!cache.fits) return r;

  std::vector<kvq::gpu::DecodeAttentionPlan> plans;
  size_t workspace = 0;
  for (int64_t before : befores) {
    plans.push_back(kvq::gpu::PlanDecodeAttention(c, batch, static_cast<int>(before + 1)));
    workspace = std::max(workspace, plans.back().workspace_bytes);
  }
  const StepBuffers buf(batch, seq_len, cache.pages, workspace);
  const size_t token_elems = static_cast<size_t>(batch) * kHkv * kHeadDim;
  uint16_t* new_k = Alloc<uint16_t>(token_elems);
  uint16_t* new_v = Alloc<uint16_t>(token_elems);
  RandomBf16(new_k, token_elems, -2.f, 2.f, 61);
  RandomBf16(new_v, token_elems, -2.f, 2.f, 62);
  int* flags = Alloc<int>(1);
  KVQ_CUDA_CHECK(cudaMemset(flags, 0, sizeof(int)));
  std::vector<void*> owned = {new_k, new_v, flags};

  kvq::gpu::PagePool pools[2];
  for (int kv = 0; kv < 2; ++kv) {
    for (int i = 0; i < kvq::kMaxPlanes; ++i) pools[kv].planes[i] = cache.planes[kv][i];
    pools[kv].num_pages = static_cast<int>(cache.pages);
  }
  kvq::gpu::Windows windows;
  windows.sink_key = cache.windows[0];
  windows.sink_value = cache.windows[1];
  windows.recent_key = cache.windows[2];
  windows.recent_value = cache.windows[3];
  const int max_pages = std::max(cache.pages_per_seq, 1);

  std::vector<StepTraffic> traffic;
  size_t most_written = 16;
  for (int64_t before : befores) {
    traffic.push_back(Traffic(c, cache, buf, new_k, new_v, batch, before));
    most_written = std::max(most_written, static_cast<size_t>(traffic.back().write_bytes));
  }
  uint4* scratch = Alloc<uint4>((most_written + 15) / 16);
  owned.push_back(scratch);
  // The fills above ran on the default stream; the step's stream does not wait for it.
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());

  for (size_t g = 0; g < befores.size(); ++g) {
    const int64_t before = befores[g];
    const kvq::gpu::DecodeAttentionPlan& plan = plans[g];
    // Lengths before the append (the write's) and after it (the decode's), on the device.
    int32_t* lengths = Alloc<int32_t>(2 * batch);
    owned.push_back(lengths);
    {
      std::vector<int32_t> host(2 * batch, static_cast<int32_t>(before));
      std::fill(host.begin() + batch, host.end(), static_cast<int32_t>(before + 1));
      KVQ_CUDA_CHECK(cudaMemcpy(lengths, host.data(), host.size() * sizeof(int32_t),
                                cudaMemcpyHostToDevice));
    }
    kvq::gpu::DecodeAttentionInputs in;
    buf.Attach(in, batch, static_cast<int>(before + 1), cache.pages_per_seq);
    in.seq_lens = lengths + batch;
    cache.Attach(in);

    Bf16AppendArgs copy;
    copy.key = reinterpret_cast<const uint4*>(new_k);
    copy.value = reinterpret_cast<const uint4*>(new_v);
    copy.key_pool = reinterpret_cast<uint4*>(cache.planes[0][0]);
    copy.value_pool = reinterpret_cast<uint4*>(cache.planes[1][0]);
    copy.lengths = lengths;
    copy.page_tables = buf.tables;
    copy.max_pages = max_pages;
    copy.batch = batch;
    copy.page_size = c.page_size;
    const auto append = [&] {
      if (quantized) {
        kvq::gpu::AppendStep(c, new_k, new_v, batch, lengths, buf.tables, max_pages,
                             cache.Heads(0), cache.Heads(1), pools[0], pools[1], windows, flags,
                             stream);
      } else {
        const int64_t threads = 2 * static_cast<int64_t>(batch) * kHkv * kRowVectors;
        Bf16AppendKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(copy);
        KVQ_CUDA_CHECK(cudaGetLastError());
      }
    };
    const auto decode = [&] {
      kvq::gpu::DecodeAttention(c, in, plan, buf.ws, plan.workspace_bytes, buf.out, stream);
    };
    // The step as DecodeStep runs it, the decode launched while the append runs (kvq has no
    // bf16 append, so the bf16 cache's step is its copy, then the decode).
    const auto step = [&] {
      if (quantized) {
        kvq::gpu::DecodeStep(c, new_k, new_v, lengths, pools[0], pools[1], windows, flags, in,
                             plan, buf.ws, plan.workspace_bytes, buf.out, stream);
      } else {
        append();
        decode();
      }
    };
    const auto serial = [&] {
      append();
      decode();
    };
    const std::string what = "step B=" + std::to_string(batch) + " T=" +
                             std::to_string(before + 1);
    // One eager step first: the arguments are validated outside any capture, and the launchers'
    // one-time setup (shared-memory limits, occupancy queries) happens here.
    step();
    kvq::gpu::CheckErrorFlags(flags, what.c_str(), stream);

    StepTiming& s = g == 0 ? r.step : r.flush;
    s.before = before;
    {
      const Graph graph(stream, step);
      s.nodes = graph.Nodes();
      s.us = GraphMicros(graph, stream, flusher, iters);
    }
    kvq::gpu::CheckErrorFlags(flags, what.c_str(), stream);
    CheckFinite(buf.out, buf.q_elems, what);
    if (g == 0) {
      const Graph serial_graph(stream, serial);
      s.serial_us = GraphMicros(serial_graph, stream, flusher, iters);
      const Graph append_graph(stream, append);
      s.append_us = GraphMicros(append_graph, stream, flusher, iters);
      const Graph decode_graph(stream, decode);
      s.decode_us = GraphMicros(decode_graph, stream, flusher, iters);
      kvq::gpu::CheckErrorFlags(flags, what.c_str(), stream);
    }
    if (g == 0 && quantized && g_timeline) {
      // The step's graph again with the block records on (the rotation's, the decode's and the
      // merge's blocks; the append's are not recorded): the third of three flushed replays.
      const kvq::gpu::DecodeStepBlocks blocks =
          kvq::gpu::DecodeAttentionBlocks(c, batch, plan);
      uint64_t* timeline = Alloc<uint64_t>(4 * blocks.total());
      in.timeline = timeline;
      {
        const Graph graph(stream, step);
        for (int k = 0; k < 3; ++k) {
          flusher.Flush(stream);
          graph.Launch(stream);
        }
      }
      in.timeline = nullptr;
      KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint64_t> rec(4 * blocks.total());
      KVQ_CUDA_CHECK(cudaMemcpy(rec.data(), timeline, rec.size() * 8, cudaMemcpyDeviceToHost));
      KVQ_CUDA_CHECK(cudaFree(timeline));
      const std::string title = label + " " + what + " (" +
                                std::to_string(plan.hist_splits) + " history splits of " +
                                std::to_string(plan.hist_tokens_per_split) + " tokens, " +
                                std::to_string(plan.window_splits) + " window splits)";
      g_timelines += kvq::bench::SummarizeTimeline(rec, title.c_str());
    }
    const StepTraffic& t = traffic[g];
    s.bytes = t.read_bytes + t.write_bytes;
    const size_t words = static_cast<size_t>(t.write_bytes) / 16;
    const Graph floor(stream, [&] {
      StepFloorKernel<<<8 * sms, 256, 0, stream>>>(t.reads, scratch, words,
                                                   static_cast<uint32_t*>(buf.ws));
      KVQ_CUDA_CHECK(cudaGetLastError());
    });
    s.floor_us = GraphMicros(floor, stream, flusher, iters);
  }
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (void* p : owned) KVQ_CUDA_CHECK(cudaFree(p));
  cache.Free();
  buf.Free();
  r.ran = true;
  return r;
}

// The PyTorch baseline's table (bench_step_sdpa.py): (B, T) -> its first time column, the
// cuDNN step in µs. Lines that are not a row of numbers ("skipped", "n/a") are left out.
std::map<std::pair<int, int>, double> ReadBaseline(const std::string& path) {
  std::map<std::pair<int, int>, double> rows;
  std::ifstream file(path);
  if (!file) {
    std::fprintf(stderr, "error: --baseline %s: cannot open\n", path.c_str());
    std::exit(2);
  }
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] != '|') continue;
    std::vector<std::string> cells;
    size_t at = 1;
    while (at < line.size()) {
      const size_t bar = std::min(line.find('|', at), line.size());
      std::string cell = line.substr(at, bar - at);
      cell.erase(0, cell.find_first_not_of(' '));
      cell.erase(cell.find_last_not_of(' ') + 1);
      cells.push_back(cell);
      at = bar + 1;
    }
    if (cells.size() < 3) continue;
    char* end[3] = {};
    const long b = std::strtol(cells[0].c_str(), &end[0], 10);
    const long t = std::strtol(cells[1].c_str(), &end[1], 10);
    const double us = std::strtod(cells[2].c_str(), &end[2]);
    if (cells[0].empty() || cells[1].empty() || cells[2].empty() || *end[0] || *end[1] ||
        *end[2] || us <= 0) {
      continue;
    }
    rows[{static_cast<int>(b), static_cast<int>(t)}] = us;
  }
  return rows;
}

std::string Ratio(double numerator, double denominator) {
  if (numerator <= 0 || denominator <= 0) return "-";
  char cell[32];
  std::snprintf(cell, sizeof cell, "%.2fx", numerator / denominator);
  return cell;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  bool quick = false;
  int only_batch = 0, only_len = 0;
  std::string schemes = kDefaultRows;
  std::string baseline_path;
  FlushMode flush = FlushMode::kRead;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--flush") && i + 1 < argc) {
      if (!kvq::bench::ParseFlushMode(argv[++i], &flush)) {
        std::fprintf(stderr, "error: --flush %s: expected read or write\n", argv[i]);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) {
      only_batch = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--len") && i + 1 < argc) {
      only_len = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--schemes") && i + 1 < argc) {
      schemes = argv[++i];
    } else if (!std::strcmp(argv[i], "--timeline")) {
      g_timeline = true;
    } else if (!std::strcmp(argv[i], "--baseline") && i + 1 < argc) {
      baseline_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else {
      std::fprintf(stderr, "error: unknown argument %s (see the usage in bench_gpu_step.cu)\n",
                   argv[i]);
      return 2;
    }
  }
  if (iters < 1 || only_batch < 0 || only_len < 0 || (only_len > 0 && only_len < 2)) {
    std::fprintf(stderr, "error: --iters %d, --batch %d, --len %d: expected >= 1, >= 1, >= 2\n",
                 iters, only_batch, only_len);
    return 2;
  }
  cudaStream_t stream = nullptr;
  try {
    kvq::gpu::RequireCudaDevice();
    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const std::map<std::pair<int, int>, double> baseline =
        baseline_path.empty() ? std::map<std::pair<int, int>, double>{}
                              : ReadBaseline(baseline_path);
    const std::vector<SchemeRow> rows = StepRows(schemes);
    // The graphs are captured on (and replayed on) a stream that does not synchronise with the
    // legacy default stream; the setup's fills run on the default stream and end in a device
    // synchronisation (StepBuffers) before any capture.
    KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    L2Flusher flusher(flush);
    const double copy_bw = CopyBandwidth(flusher);
    double empty_us = 0.0;
    {
      const Graph empty(stream, [&] {
        EmptyKernel<<<1, 32, 0, stream>>>();
        KVQ_CUDA_CHECK(cudaGetLastError());
      });
      empty_us = GraphMicros(empty, stream, flusher, iters);
    }
    std::printf("# kvq whole decode step (append + decode) in one CUDA graph, %s, %d SMs, L2 %d "
                "MB; d=%d Hq/Hkv=%d/%d\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, kHeadDim, kHq, kHkv);
    std::printf("# device-to-device copy: %.0f GB/s (read + write); median of %d graph replays, "
                "cold L2 (flushed by a %s pass before each)\n",
                copy_bw / 1e9, iters, kvq::bench::FlushModeName(flush));
    std::printf("# one empty kernel in a graph, replayed and timed the same way: %.1f us\n",
                empty_us);
    std::printf("# baseline: %s\n\n",
                baseline_path.empty() ? "none given (--baseline FILE: bench_step_sdpa.py's table)"
                                      : baseline_path.c_str());
    std::vector<int> batches = quick ? std::vector<int>{1, 32} : std::vector<int>{1, 8, 32, 128};
    std::vector<int> lens = quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
    if (only_batch > 0) batches = {only_batch};
    if (only_len > 0) lens = {only_len};
    int sms = 0;
    KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    std::printf("| scheme | B | T | step us | flush step us | us / step | vs kvq bf16 | "
                "vs cuDNN step | serial step us | append alone us | decode alone us | graph nodes "
                "| MB / step | of copy BW | floor us | us / floor |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
                "--- | --- | --- |\n");
    for (int batch : batches) {
      for (int len : lens) {
        double bf16_us = 0.0;
        const auto base = baseline.find({batch, len});
        const double cudnn_us = base == baseline.end() ? 0.0 : base->second;
        for (const SchemeRow& row : rows) {
          const RowResult a = RunRow(row.label, row.params, batch, len, flusher, iters, stream, sms);
          if (!a.ran) {
            std::printf("| %s | %d | %d | skipped (memory) | | | | | | | | | | | | |\n",
                        row.label.c_str(), batch, len);
            std::fflush(stdout);
            continue;
          }
          const double mean_us = a.Mean(&StepTiming::us);
          const double mean_bytes = a.Mean(&StepTiming::bytes);
          const double mean_floor = a.Mean(&StepTiming::floor_us);
          if (row.label == "bf16") bf16_us = mean_us;
          char flush_cell[32] = "-";
          if (a.has_flush) std::snprintf(flush_cell, sizeof flush_cell, "%.1f", a.flush.us);
          std::printf("| %s | %d | %d | %.1f | %s | %.1f | %s | %s | %.1f | %.1f | %.1f | %zu | "
                      "%.2f | %.0f%% | %.1f | %.2f |\n",
                      row.label.c_str(), batch, len, a.step.us, flush_cell, mean_us,
                      Ratio(bf16_us, mean_us).c_str(), Ratio(cudnn_us, mean_us).c_str(),
                      a.step.serial_us, a.step.append_us, a.step.decode_us, a.step.nodes, mean_bytes / 1e6,
                      100.0 * mean_bytes / (mean_us * 1e-6) / copy_bw, mean_floor,
                      mean_us / mean_floor);
          std::fflush(stdout);
        }
      }
    }
    std::printf(
        "\nstep: the graph of the append and the decode with T - 1 tokens stored (the decode "
        "reads T), as gpu::DecodeStep queues them (each kernel launched while the one before "
        "it runs); serial step: AppendStep, then DecodeAttention launched after all of it; "
        "flush step (F > 1: kivi, ots): the graph at the next length where the F-token "
        "flush falls due for every sequence; us / step: the mean over F steps ((F - 1) step + "
        "flush step) / F, the step itself when F = 1. vs kvq bf16 / vs cuDNN step: that step's "
        "time (kvq's bf16 row; bench_step_sdpa.py's index_copy_ + cuDNN SDPA graph) over this "
        "row's us / step. append alone / decode alone: each half in a graph of its own (the "
        "step without a flush). graph nodes: kernels in the step's graph. MB / step: bytes the "
        "step must read and write (history planes, windows, new rows, queries, dense rotations, "
        "the history bytes and bf16 rows written, the output; split partials, page tables and "
        "lengths not counted), a mean over F steps; of copy BW: those bytes over us / step "
        "against the device-to-device copy; floor: one streaming kernel moving those bytes, in a "
        "graph, timed the same way.\n");
    if (!g_timelines.empty()) std::printf("\n%s", g_timelines.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_gpu_step: error: %s\n", e.what());
    if (stream) cudaStreamDestroy(stream);
    return 1;
  }
  cudaStreamDestroy(stream);
  return 0;
}
