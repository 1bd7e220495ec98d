#include "gpu_ppl.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "forward_kernels.h"
#include "kvq/common/error.h"
#include "kvq/common/format.h"
#include "kvq/common/params_builder.h"
#include "kvq/gpu/attention.h"
#include "kvq/gpu/cuda_check.h"
#include "kvq/gpu/device_array.h"
#include "kvq/gpu/formats.h"
#include "kvq/gpu/write.h"

namespace kvq::gpu {
namespace {

using calib::ForwardRequest;
using calib::LayerKv;
using calib::LayerScheme;
using calib::Model;
using calib::ModelConfig;
using Clock = std::chrono::steady_clock;

#define KVQ_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                      \
    const cublasStatus_t kvq_cublas_status_ = (expr);                                       \
    KVQ_CHECK(kvq_cublas_status_ == CUBLAS_STATUS_SUCCESS, kIoError, #expr, " failed: ",     \
              cublasGetStatusName(kvq_cublas_status_), " (", __FILE__, ":", __LINE__, ")"); \
  } while (0)

// A device buffer that only grows (contents are not kept across a growth).
template <typename T>
class Scratch {
 public:
  T* Get(size_t count) {
    if (count > array_.size()) array_ = DeviceArray<T>(std::max<size_t>(count, 1));
    return array_.get();
  }

 private:
  DeviceArray<T> array_;
};

DeviceArray<float> Upload(const std::vector<float>& host) { return DeviceArray<float>(host); }

struct LayerWeightsDev {
  DeviceArray<float> input_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down;
};

// A scheme layer's per-head write data on the device.
struct SchemeLayerDev {
  DeviceHeadData key, value;
  HeadData key_heads() const { return key.View(); }
  HeadData value_heads() const { return value.View(); }
};

int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Whether a batch of sequences sharing one prefill's history pages, with gathered windows, holds
// for each length t what a cache of that length holds: F = 1 and per-token history rows (a tile
// format's rows depend on the tile, and its demotion timing on F).
bool BatchFaithful(const CacheParams& p) {
  return p.flush == 1 && p.key.tile_tokens() == 1 && p.value.tile_tokens() == 1;
}

}  // namespace

// ---- Without a device ----

double CacheBitsPerElement(const CacheParams& p, int64_t t) {
  if (t <= 0) return 0.0;
  const size_t row_bytes = static_cast<size_t>(p.num_kv_heads) * p.head_dim() * sizeof(uint16_t);
  const int64_t sink_rows = std::min<int64_t>(p.sink, t);
  size_t bytes = 2 * static_cast<size_t>(sink_rows) * row_bytes;
  bytes += 2 * static_cast<size_t>(t - p.RecentBegin(t)) * row_bytes;
  if (p.quantized()) {
    const int64_t used = p.HistoryTokens(t);
    for (const WriteParams* w : {&p.key, &p.value}) {
      const FormatLayout layout = LayoutOf(*w);
      bytes += layout.Bytes(PlaneRole::kCodes, used, p.num_kv_heads);
      bytes += layout.Bytes(PlaneRole::kMetadata, used, p.num_kv_heads);
    }
  }
  const double elements = 2.0 * static_cast<double>(t) * p.num_kv_heads * p.head_dim();
  return 8.0 * static_cast<double>(bytes) / elements;
}

std::string GpuPplUnsupported(const std::vector<LayerScheme>& layers) {
  for (size_t l = 0; l < layers.size(); ++l) {
    const CacheParams& c = layers[l].params;
    try {
      c.Validate();
      KVQ_CHECK(c.key.quantized() == c.value.quantized(), kUnsupported, "K is ",
                FormatName(c.key.format), ", V ", FormatName(c.value.format));
      if (c.quantized()) {
        // Validates without launching (no rows).
        PrefillWrite(c, nullptr, nullptr, 0, nullptr, HeadData{}, HeadData{}, PagePool{},
                     PagePool{}, Windows{});
      }
      // The decode plan validates the formats the decode kernels serve (num_sms given: no
      // device query).
      PlanDecodeAttention(c, 1, c.sink + c.recent + c.page_size + 1, /*num_sms=*/132);
    } catch (const Error& e) {
      return std::string("layer ") + std::to_string(l) + ": " + e.what();
    }
  }
  return "";
}

const char* GpuDecodeModeName(GpuDecodeMode mode) {
  return mode == GpuDecodeMode::kBatch ? "batch" : "steps";
}

GpuDecodeMode ParseGpuDecodeMode(const std::string& name) {
  if (name == "batch") return GpuDecodeMode::kBatch;
  if (name == "steps") return GpuDecodeMode::kSteps;
  KVQ_CHECK(false, kInvalidArgument, "GPU decode mode '", name, "' (batch or steps)");
  return GpuDecodeMode::kBatch;
}

// ---- The device forward ----

struct GpuPplForwards::Impl {
  const Model* model;
  ModelConfig c;
  GpuDecodeMode mode;
  bool int8_qk = true;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int num_sms = 0;
  std::string device;

  // Weights.
  DeviceArray<float> embed, head, final_norm, rope_cos, rope_sin;
  std::vector<LayerWeightsDev> layers;

  // Activations, sized for max_positions rows.
  DeviceArray<int32_t> ids;
  DeviceArray<float> x, h, qkv, q, o, gu, act, k_rows, v_rows, logits;
  DeviceArray<uint16_t> k_bf16, v_bf16;
  DeviceArray<int32_t> lengths;  // [max_positions + 1]: lengths[i] = i
  DeviceArray<int> error_flags;

  // Caches (grown on demand).
  Scratch<uint8_t> pool[2][kMaxPlanes];
  Scratch<int32_t> page_tables;
  Scratch<uint16_t> sink[2], recent[2];
  Scratch<uint8_t> workspace;
  size_t workspace_bytes = 0;

  // Per scheme (index, its layers' address): the rotations and clips, uploaded once.
  std::map<std::pair<int, const LayerScheme*>, std::vector<SchemeLayerDev>> schemes;

  GpuPplStats stats;

  Impl(const Model& m, GpuDecodeMode decode_mode, bool allow_int8_qk)
      : model(&m), c(m.config), mode(decode_mode), int8_qk(allow_int8_qk) {
    RequireCudaDevice();
    int dev = 0;
    KVQ_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    KVQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    num_sms = prop.multiProcessorCount;
    device = std::string(prop.name) + " (" + std::to_string(num_sms) + " SMs)";
    KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KVQ_CUBLAS_CHECK(cublasCreate(&blas));
    KVQ_CUBLAS_CHECK(cublasSetStream(blas, stream));
    // fp32 as the CPU computes it: no TF32 or other reduced-precision shortcut.
    KVQ_CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_PEDANTIC_MATH));

    embed = Upload(m.embed);
    head = Upload(m.head);
    final_norm = Upload(m.final_norm);
    rope_cos = Upload(m.rope_cos);
    rope_sin = Upload(m.rope_sin);
    for (const calib::LayerWeights& w : m.layers) {
      LayerWeightsDev d;
      d.input_norm = Upload(w.input_norm);
      d.post_norm = Upload(w.post_norm);
      if (!w.q_norm.empty()) d.q_norm = Upload(w.q_norm);
      if (!w.k_norm.empty()) d.k_norm = Upload(w.k_norm);
      d.qkv = Upload(w.qkv);
      d.o = Upload(w.o);
      d.gate_up = Upload(w.gate_up);
      d.down = Upload(w.down);
      layers.push_back(std::move(d));
    }
    const size_t T = static_cast<size_t>(c.max_positions);
    const size_t fused = static_cast<size_t>(c.q_width()) + 2 * c.kv_width();
    ids = DeviceArray<int32_t>(T);
    x = DeviceArray<float>(T * c.hidden);
    h = DeviceArray<float>(T * c.hidden);
    qkv = DeviceArray<float>(T * fused);
    q = DeviceArray<float>(T * c.q_width());
    o = DeviceArray<float>(T * c.q_width());
    gu = DeviceArray<float>(T * 2 * c.intermediate);
    act = DeviceArray<float>(T * c.intermediate);
    k_rows = DeviceArray<float>(T * c.kv_width());
    v_rows = DeviceArray<float>(T * c.kv_width());
    logits = DeviceArray<float>(T * c.vocab);
    k_bf16 = DeviceArray<uint16_t>(T * c.kv_width());
    v_bf16 = DeviceArray<uint16_t>(T * c.kv_width());
    lengths = DeviceArray<int32_t>(T + 1);
    KVQ_CUDA_CHECK(ppl::LaunchIota(lengths.get(), static_cast<int>(T + 1), 0, stream));
    error_flags = DeviceArray<int>(1);
    error_flags.Fill(0);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  ~Impl() {
    if (blas != nullptr) cublasDestroy(blas);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Row-major C [m, n] = A [m, k] · B [k, n] (+ C when accumulate), fp32.
  void Gemm(const float* a, int lda, const float* b, int ldb, float* out, int ldc, int64_t m,
            int n, int k, bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    // Column-major view: Cᵀ [n, m] = Bᵀ [n, k] · Aᵀ [k, m].
    KVQ_CUBLAS_CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, static_cast<int>(m), k,
                                 &alpha, b, ldb, a, lda, &beta, out, ldc));
  }

  const std::vector<SchemeLayerDev>& SchemeData(int index, const std::vector<LayerScheme>& ls) {
    const std::pair<int, const LayerScheme*> key(index, ls.data());
    auto it = schemes.find(key);
    if (it != schemes.end()) return it->second;
    std::vector<SchemeLayerDev> dev(ls.size());
    for (size_t l = 0; l < ls.size(); ++l) {
      const CacheParams& c = ls[l].params;
      dev[l].key = DeviceHeadData(ls[l].key, c.key, c.num_kv_heads);
      dev[l].value = DeviceHeadData(ls[l].value, c.value, c.num_kv_heads);
    }
    return schemes.emplace(key, std::move(dev)).first->second;
  }

  void* Workspace(size_t bytes) {
    workspace_bytes = std::max(workspace_bytes, bytes);
    return workspace.Get(workspace_bytes);
  }

  // The bf16 cache over rows [0, T): every position p in [first, T) reads [0, p].
  void AttendBf16(int64_t first, int64_t T) {
    const CacheParams p = params::Cache()
                              .kv_heads(c.num_kv_heads)
                              .q_heads(c.num_q_heads)
                              .both(params::Write().head_dim(c.head_dim).format(Format::kBf16))
                              .sink(0)
                              .recent(0)
                              .Build();
    const int P = p.page_size;
    const int max_pages = CeilDiv(T, P);
    const FormatLayout layout = LayoutOf(p.key);
    uint16_t* pools[2];
    for (int kv = 0; kv < 2; ++kv) {
      pools[kv] = reinterpret_cast<uint16_t*>(
          pool[kv][kBf16RowsPlane].Get(max_pages * layout.PageBytes(kBf16RowsPlane, P,
                                                                    c.num_kv_heads)));
      KVQ_CUDA_CHECK(ppl::LaunchPageBf16(kv == 0 ? k_bf16.get() : v_bf16.get(), T,
                                         c.num_kv_heads, c.head_dim, P, pools[kv], stream));
    }
    const int batch = static_cast<int>(T - first);
    DecodeAttentionInputs in;
    in.batch = batch;
    in.max_seq_len = static_cast<int>(T);
    in.seq_lens = lengths.get() + first + 1;
    in.page_tables = IdentityPageTables(batch, max_pages);
    in.max_pages = max_pages;
    in.key_planes[kBf16RowsPlane] = reinterpret_cast<const uint8_t*>(pools[0]);
    in.value_planes[kBf16RowsPlane] = reinterpret_cast<const uint8_t*>(pools[1]);
    in.q = q.get();
    const DecodeAttentionPlan plan =
        PlanDecodeAttention(p, batch, in.max_seq_len, num_sms, int8_qk);
    void* ws = Workspace(plan.workspace_bytes);  // grows workspace_bytes: before the call
    DecodeAttention(p, in, plan, ws, workspace_bytes, o.get(), stream);
  }

  // [batch, max_pages], every row 0 .. max_pages − 1 (the pages every sequence shares).
  const int32_t* IdentityPageTables(int batch, int max_pages) {
    const size_t n = static_cast<size_t>(batch) * max_pages;
    int32_t* tables = page_tables.Get(n);
    std::vector<int32_t> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<int32_t>(i % max_pages);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(tables, host.data(), n * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` goes out of scope
    return tables;
  }

  // A quantized scheme's cache over rows [0, T).
  void AttendQuantized(const CacheParams& p, const SchemeLayerDev& data, int64_t first,
                       int64_t T) {
    const int P = p.page_size, hkv = p.num_kv_heads, d = p.head_dim();
    const int64_t row = static_cast<int64_t>(hkv) * d;
    const int max_pages = std::max(1, CeilDiv(std::max<int64_t>(0, T - p.sink - p.recent), P));
    const FormatLayout layouts[2] = {LayoutOf(p.key), LayoutOf(p.value)};
    PagePool pools[2];
    for (int kv = 0; kv < 2; ++kv) {
      pools[kv].num_pages = max_pages;
      for (int i = 0; i < layouts[kv].num_planes; ++i) {
        pools[kv].planes[i] = pool[kv][i].Get(max_pages * layouts[kv].PageBytes(i, P, hkv));
      }
    }
    // The batched decode is faithful when every history row's bits are a function of that row
    // alone and the windows follow F = 1 (what the gather reproduces); any other cache runs the
    // decoding loop itself, whatever the mode.
    const bool steps = mode == GpuDecodeMode::kSteps || !BatchFaithful(p);
    const int batch = steps ? 1 : static_cast<int>(T - first);
    // Windows: one per sequence of the batch (steps: the one sequence; batch: also the scratch
    // windows PrefillWrite fills for length T, batch entry 0's, rewritten by the gather).
    const size_t sink_elems = std::max<size_t>(static_cast<size_t>(batch) * p.sink * row, 8);
    const size_t ring_elems = static_cast<size_t>(batch) * p.ring_slots() * row;
    Windows w;
    w.sink_key = sink[0].Get(sink_elems);
    w.sink_value = sink[1].Get(sink_elems);
    w.recent_key = recent[0].Get(ring_elems);
    w.recent_value = recent[1].Get(ring_elems);
    const int32_t* tables = IdentityPageTables(batch, max_pages);
    const int32_t* table = tables;  // row 0: the prefill's (and the one sequence's) page table

    DecodeAttentionInputs in;
    in.batch = batch;
    in.max_seq_len = static_cast<int>(T);
    in.page_tables = tables;
    in.max_pages = max_pages;
    for (int i = 0; i < layouts[0].num_planes; ++i) in.key_planes[i] = pools[0].planes[i];
    for (int i = 0; i < layouts[1].num_planes; ++i) in.value_planes[i] = pools[1].planes[i];
    in.sink_key = w.sink_key;
    in.sink_value = w.sink_value;
    in.recent_key = w.recent_key;
    in.recent_value = w.recent_value;
    in.key_heads = data.key_heads();
    in.value_heads = data.value_heads();
    const DecodeAttentionPlan plan =
        PlanDecodeAttention(p, batch, in.max_seq_len, num_sms, int8_qk);
    void* ws = Workspace(plan.workspace_bytes);

    if (!steps) {
      PrefillWrite(p, k_bf16.get(), v_bf16.get(), static_cast<int>(T), table, data.key_heads(),
                   data.value_heads(), pools[0], pools[1], w, error_flags.get(), stream);
      KVQ_CUDA_CHECK(ppl::LaunchGatherWindows(k_bf16.get(), v_bf16.get(), first, batch, hkv, d,
                                              p.sink, p.recent, w.sink_key, w.sink_value,
                                              w.recent_key, w.recent_value, stream));
      in.seq_lens = lengths.get() + first + 1;
      in.q = q.get();
      DecodeAttention(p, in, plan, ws, workspace_bytes, o.get(), stream);
      return;
    }
    PrefillWrite(p, k_bf16.get(), v_bf16.get(), static_cast<int>(first), table,
                 data.key_heads(), data.value_heads(), pools[0], pools[1], w, error_flags.get(),
                 stream);
    const int64_t qw = c.q_width();
    for (int64_t pos = first; pos < T; ++pos) {
      AppendStep(p, k_bf16.get() + pos * row, v_bf16.get() + pos * row, 1,
                 lengths.get() + pos, table, max_pages, data.key_heads(), data.value_heads(),
                 pools[0], pools[1], w, error_flags.get(), stream);
      in.seq_lens = lengths.get() + pos + 1;
      in.q = q.get() + (pos - first) * qw;
      DecodeAttention(p, in, plan, ws, workspace_bytes, o.get() + (pos - first) * qw, stream);
    }
  }

  // The layer loop of calib::Forward with attention through `layers` (null: the bf16 cache).
  std::vector<float> Forward(const ForwardRequest& req, const std::vector<LayerScheme>* schemes_l,
                             const std::vector<SchemeLayerDev>* data, double* bits) {
    KVQ_CHECK(req.ids != nullptr, kInvalidArgument, "forward: null token ids");
    KVQ_CHECK(req.tokens >= 1 && req.tokens <= c.max_positions, kInvalidArgument,
              "forward: window of ", req.tokens, " tokens is outside [1, ", c.max_positions, "]");
    KVQ_CHECK(req.first >= 0 && req.first < req.tokens, kInvalidArgument,
              "forward: first position ", req.first, " is outside [0, ", req.tokens, ")");
    KVQ_CHECK(req.keep_rows >= 0 && req.keep_rows <= req.tokens, kInvalidArgument,
              "forward: keep_rows ", req.keep_rows, " is outside [0, ", req.tokens, "]");
    const int L = c.num_layers, D = c.hidden, kvw = c.kv_width(), qw = c.q_width();
    const int I = c.intermediate, V = c.vocab;
    const int fused = qw + 2 * kvw;
    const int64_t first = req.first, T = req.tokens, rows = T - first;
    if (first > 0) {
      KVQ_CHECK(req.prefix != nullptr && static_cast<int>(req.prefix->size()) == L,
                kInvalidArgument, "forward: positions [0, ", first, ") need a prefix of ", L,
                " layers");
      for (const LayerKv& pk : *req.prefix) {
        KVQ_CHECK(pk.k.size() >= static_cast<size_t>(first) * kvw &&
                      pk.v.size() >= static_cast<size_t>(first) * kvw,
                  kInvalidArgument, "forward: the prefix holds fewer than ", first, " rows");
      }
    }
    const float eps = static_cast<float>(c.rms_eps);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(ids.get(), req.ids, T * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
    KVQ_CUDA_CHECK(ppl::LaunchEmbed(embed.get(), ids.get() + first, rows, D, x.get(), stream));
    if (req.keep != nullptr) req.keep->assign(L, LayerKv{});
    double bits_sum = 0.0;
    for (int l = 0; l < L; ++l) {
      const LayerWeightsDev& w = layers[l];
      KVQ_CUDA_CHECK(ppl::LaunchRmsNorm(x.get(), w.input_norm.get(), rows, D, eps, h.get(),
                                        stream));
      Gemm(h.get(), D, w.qkv.get(), fused, qkv.get(), fused, rows, fused, D, false);
      KVQ_CUDA_CHECK(ppl::LaunchQkvRope(qkv.get(), rows, first, c.num_q_heads, c.num_kv_heads,
                                        c.head_dim, w.q_norm.get(), w.k_norm.get(), eps,
                                        rope_cos.get(), rope_sin.get(), q.get(),
                                        k_rows.get() + first * kvw, v_rows.get() + first * kvw,
                                        stream));
      if (first > 0) {
        const LayerKv& pk = (*req.prefix)[l];
        KVQ_CUDA_CHECK(cudaMemcpyAsync(k_rows.get(), pk.k.data(), first * kvw * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
        KVQ_CUDA_CHECK(cudaMemcpyAsync(v_rows.get(), pk.v.data(), first * kvw * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
      }
      if (req.keep != nullptr && req.keep_rows > 0) {
        LayerKv& kept = (*req.keep)[l];
        kept.k.resize(static_cast<size_t>(req.keep_rows) * kvw);
        kept.v.resize(kept.k.size());
        KVQ_CUDA_CHECK(cudaMemcpyAsync(kept.k.data(), k_rows.get(),
                                       kept.k.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                       stream));
        KVQ_CUDA_CHECK(cudaMemcpyAsync(kept.v.data(), v_rows.get(),
                                       kept.v.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                       stream));
      }
      KVQ_CUDA_CHECK(ppl::LaunchRoundBf16(k_rows.get(), T * kvw, k_bf16.get(), stream));
      KVQ_CUDA_CHECK(ppl::LaunchRoundBf16(v_rows.get(), T * kvw, v_bf16.get(), stream));
      if (schemes_l == nullptr || !(*schemes_l)[l].params.quantized()) {
        AttendBf16(first, T);
        if (schemes_l != nullptr) bits_sum += CacheBitsPerElement((*schemes_l)[l].params, T);
      } else {
        const CacheParams& p = (*schemes_l)[l].params;
        AttendQuantized(p, (*data)[l], first, T);
        bits_sum += CacheBitsPerElement(p, T);
      }
      Gemm(o.get(), qw, w.o.get(), D, x.get(), D, rows, D, qw, true);
      KVQ_CUDA_CHECK(ppl::LaunchRmsNorm(x.get(), w.post_norm.get(), rows, D, eps, h.get(),
                                        stream));
      Gemm(h.get(), D, w.gate_up.get(), 2 * I, gu.get(), 2 * I, rows, 2 * I, D, false);
      KVQ_CUDA_CHECK(ppl::LaunchSwiGlu(gu.get(), rows, I, act.get(), stream));
      Gemm(act.get(), I, w.down.get(), D, x.get(), D, rows, D, I, true);
    }
    KVQ_CUDA_CHECK(ppl::LaunchRmsNorm(x.get(), final_norm.get(), rows, D, eps, h.get(), stream));
    Gemm(h.get(), D, head.get(), V, logits.get(), V, rows, V, D, false);
    std::vector<float> out(static_cast<size_t>(rows) * V);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(out.data(), logits.get(), out.size() * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream));
    CheckErrorFlags(error_flags.get(), "kvq ppl (GPU) cache writes", stream);  // synchronises
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (bits != nullptr) *bits = bits_sum / L;
    stats.positions += rows;
    return out;
  }
};

GpuPplForwards::GpuPplForwards(const Model& model, GpuDecodeMode mode, bool int8_qk)
    : impl_(std::make_unique<Impl>(model, mode, int8_qk)) {}

GpuPplForwards::~GpuPplForwards() = default;

std::vector<float> GpuPplForwards::Reference(const ForwardRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = Clock::now();
  std::vector<float> logits = impl_->Forward(request, nullptr, nullptr, nullptr);
  impl_->stats.reference_forwards += 1;
  impl_->stats.reference_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  return logits;
}

std::vector<float> GpuPplForwards::Fp32(const ForwardRequest& /*request*/) {
  KVQ_CHECK(false, kUnsupported,
            "the GPU path has no fp32 (unrounded K and V) attention: a cache stores bf16 or "
            "quantized rows (--no-fp32)");
  return {};
}

std::vector<float> GpuPplForwards::Scheme(int scheme, const std::vector<LayerScheme>& layers,
                                          const ForwardRequest& request,
                                          double* bits_per_element) {
  KVQ_CHECK(static_cast<int>(layers.size()) == impl_->c.num_layers, kShapeMismatch,
            "GPU forward: ", layers.size(), " layer schemes for a model of ",
            impl_->c.num_layers, " layers");
  for (size_t l = 0; l < layers.size(); ++l) {
    const CacheParams& p = layers[l].params;
    KVQ_CHECK(p.num_q_heads == impl_->c.num_q_heads && p.num_kv_heads == impl_->c.num_kv_heads &&
                  p.head_dim() == impl_->c.head_dim,
              kShapeMismatch, "GPU forward: layer ", l, "'s scheme is Hq=", p.num_q_heads,
              " Hkv=", p.num_kv_heads, " d=", p.head_dim(), ", the model Hq=",
              impl_->c.num_q_heads, " Hkv=", impl_->c.num_kv_heads, " d=", impl_->c.head_dim);
  }
  const std::string why = GpuPplUnsupported(layers);
  KVQ_CHECK(why.empty(), kUnsupported, "the CUDA cache cannot serve this scheme: ", why);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = Clock::now();
  const std::vector<SchemeLayerDev>& data = impl_->SchemeData(scheme, layers);
  std::vector<float> logits = impl_->Forward(request, &layers, &data, bits_per_element);
  impl_->stats.scheme_forwards += 1;
  impl_->stats.scheme_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  return logits;
}

GpuPplStats GpuPplForwards::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->stats;
}

std::string GpuPplForwards::device_name() const { return impl_->device; }

}  // namespace kvq::gpu
