// The fp32 forward pass of a model (model.h) on the CPU: embedding, pre-norm decoder layers
// (RMSNorm, fused q|k|v projection, Qwen3's per-head q/k RMSNorm, rotate-half RoPE, GQA
// attention, output projection, RMSNorm, SwiGLU), final RMSNorm and the (tied) head. The
// arithmetic is tools/check_tiny_lm.py's and HF eager's, in fp32 with the Highway kernels of
// matmul.h.
//
// Structure, so that a CUDA twin can keep the same loop (issue 16, item 7): the layer loop
// (Forward) is a few lines over separable steps (the ForwardSteps below: embedding, norm,
// q/k/v + RoPE, output projection, MLP, logits), and attention is a hook (AttentionStep):
// that is where a KV cache lives. DenseAttention is the plain causal softmax (fp32, or with
// K/V rounded to bf16 as a bf16 cache holds them); CacheAttention (cache_attention.h) reads a
// scheme's real paged cache; CapturingAttention records q, k, v for `kvq capture`.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/model.h"

namespace kvq::calib {

// One layer's attention. q [rows, Hq, d]: post-RoPE queries of positions [first, first + rows);
// k, v [first + rows, Hkv, d]: post-RoPE keys and values of positions [0, first + rows), fp32 as
// the model computed them. Writes out [rows, Hq, d]: for each query, attention over positions
// [0, its own] (query head h reads KV head h / g). Called once per layer, in layer order.
class AttentionStep {
 public:
  virtual ~AttentionStep() = default;
  virtual void Attend(int layer, int64_t first, int64_t rows, const float* q, const float* k,
                      const float* v, float* out) = 0;
};

// What dense (uncached) attention does with K and V before using them.
enum class KvRounding {
  kNone,  // fp32 as computed: the model's own fp32 forward (the golden file's)
  kBf16,  // rounded to bf16 (RNE): what a bf16 KV cache holds, the reference of kvq ppl
};

// Exact causal attention, scale fp32(1/√d), softmax in fp32 per query row.
class DenseAttention : public AttentionStep {
 public:
  DenseAttention(const ModelConfig& config, KvRounding rounding)
      : config_(config), rounding_(rounding) {}
  void Attend(int layer, int64_t first, int64_t rows, const float* q, const float* k,
              const float* v, float* out) override;

 private:
  ModelConfig config_;
  KvRounding rounding_;
};

// The attention kernel every step uses (DenseAttention, CacheAttention): the g query heads of
// one KV head against plain rows and, optionally, a quantized history read in the rotated space.
//   q [rows, g, d]: query rows of positions [first, first + rows); position r starts at
//     q + r·q_stride, head j of the group at + j·d.
//   keys, values [first + rows, d] (row i at + i·kv_stride): what a query reads where it reads no
//     history (bf16-valued rows for a cache; fp32 ones for DenseAttention kNone).
//   history (optional): see HistoryView.
//   out [rows, g, d] (position r at out + r·out_stride): Σ_i p_i·v_i over the plain rows; when a
//     history is given, o_rot [rows, g, d] (contiguous) receives Σ_i p_i·ṽ_i over the history
//     rows, in the rotated space: the caller maps it back (x·R_Vᵀ) and adds it to out.
// Logits are scale·(q·k) (q̃·k̃ for history rows), softmax per query row in fp32 (Highway Exp),
// keys past the query masked; each query row's result depends on its own inputs only.
struct HistoryView {
  int64_t begin = 0;              // S0: history row t is position begin + t
  const float* keys = nullptr;    // [count, d] dequantized, rotated space
  const float* values = nullptr;  // [count, d] dequantized, rotated space
  int64_t count = 0;
  const float* q_rot = nullptr;   // [rows, g, d] contiguous: q·R_K (then P_br)
  // visible[r]: history rows query r reads (H(p + 1) at its cache length p + 1), ≤ count.
  const int64_t* visible = nullptr;
};
void AttendHead(int64_t first, int64_t rows, int g, int d, float scale, const float* q,
                int64_t q_stride, const float* keys, const float* values, int64_t kv_stride,
                const HistoryView* history, float* out, int64_t out_stride, float* o_rot);

// Wraps a step and records every layer's q, k, v of a whole window (first = 0) into
// layers[l].{q,k,v} at token `offset` (the buffers are sized for the whole capture).
class CapturingAttention : public AttentionStep {
 public:
  CapturingAttention(AttentionStep* inner, const ModelConfig& config, LayerActivations* layers,
                     int64_t offset)
      : inner_(inner),
        q_width_(config.q_width()),
        kv_width_(config.kv_width()),
        layers_(layers),
        offset_(offset) {}
  void Attend(int layer, int64_t first, int64_t rows, const float* q, const float* k,
              const float* v, float* out) override;

 private:
  AttentionStep* inner_;
  int q_width_, kv_width_;
  LayerActivations* layers_;  // [L]
  int64_t offset_;            // the window's first token in the capture
};

// Per layer, post-RoPE k and v of a window's rows [0, n): what a forward over rows [first, T)
// takes from an earlier forward of rows [0, first) (the shared prefix of kvq ppl).
struct LayerKv {
  std::vector<float> k, v;  // [n, Hkv, d]
};

struct ForwardRequest {
  const int32_t* ids = nullptr;  // the window's token ids [tokens]
  int64_t tokens = 0;            // T ≤ max_positions
  int64_t first = 0;             // compute positions [first, T); the rest come from `prefix`
  const std::vector<LayerKv>* prefix = nullptr;  // [L] k, v of at least rows [0, first)
  std::vector<LayerKv>* keep = nullptr;          // out: [L] k, v of rows [0, keep_rows)
  int64_t keep_rows = 0;                         // ≤ T (rows < first come from `prefix`)
  bool logits = true;  // false: stop after the last layer (kvq capture)
};

// Runs the layer loop. Returns logits [T − first, V] (empty when request.logits is false).
// Throws kvq::Error(kInvalidArgument): T outside [1, max_positions] or above the positions
// the model's RoPE tables cover (Model::rope_positions), first outside [0, T),
// first > 0 without a prefix of L layers holding ≥ first rows, keep_rows outside [0, T],
// null ids.
std::vector<float> Forward(const Model& model, AttentionStep& attention,
                           const ForwardRequest& request);

// The steps of the layer loop (CPU, fp32). x, h [rows, D]; q [rows, Hq, d]; k, v [rows, Hkv, d];
// positions [first, first + rows) for RoPE.
namespace steps {
void Embed(const Model& m, const int32_t* ids, int64_t rows, float* x);
// out = w ⊙ x / sqrt(mean(x²) + eps) per row of `width` values (mean in fp64, rest fp32).
void RmsNorm(const float* x, const float* w, int64_t rows, int width, double eps, float* out);
// The fused q|k|v projection of h, Qwen3's q/k norms, then RoPE.
void QkvRope(const Model& m, int layer, const float* h, int64_t rows, int64_t first, float* q,
             float* k, float* v);
// x += o · W_O, o [rows, Hq·d].
void OutputProjectionAdd(const Model& m, int layer, const float* o, int64_t rows, float* x);
// x += down(silu(gate(h))·up(h)), h = post-attention RMSNorm of x.
void MlpAdd(const Model& m, int layer, int64_t rows, float* x);
// logits [rows, V] = final RMSNorm(x) · head.
void Logits(const Model& m, const float* x, int64_t rows, float* logits);
}  // namespace steps

// `kvq capture`: runs the fp32 forward (DenseAttention kNone) over every window of `windows`
// and returns their q, k, v laid end to end as a segmented capture (segment_tokens = window
// length), the first `calib_windows` windows calibrating (all when < 0). Windows run on
// `threads` threads; the result does not depend on the count. `progress(done, total)` is called
// from the calling thread after each window.
Activations CaptureActivations(const Model& model, const std::vector<TokenWindows>& windows,
                               int calib_windows, int threads, const std::string& source,
                               const std::function<void(int done, int total)>& progress = {});

}  // namespace kvq::calib
