#include "kvq/calib/ppl.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/calib/cache_attention.h"
#include "kvq/calib/clip_search.h"
#include "kvq/calib/forward.h"
#include "kvq/calib/matmul.h"
#include "kvq/calib/parallel.h"
#include "kvq/common/error.h"
#include "kvq/common/io.h"

namespace kvq::calib {
namespace {

constexpr const char* kReferenceLabel = "bf16 (reference)";
constexpr const char* kFp32Label = "fp32 (no cache)";

// ---- Student t ----

// Regularized incomplete beta I_x(a, b) by its continued fraction (modified Lentz).
double BetaContinuedFraction(double a, double b, double x) {
  const double tiny = 1e-300;
  double c = 1.0, d = 1.0 - (a + b) * x / (a + 1.0);
  d = 1.0 / (std::abs(d) < tiny ? tiny : d);
  double h = d;
  for (int m = 1; m <= 400; ++m) {
    const int m2 = 2 * m;
    double aa = m * (b - m) * x / ((a + m2 - 1) * (a + m2));
    d = 1.0 + aa * d;
    d = 1.0 / (std::abs(d) < tiny ? tiny : d);
    c = 1.0 + aa / c;
    c = std::abs(c) < tiny ? tiny : c;
    h *= d * c;
    aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1));
    d = 1.0 + aa * d;
    d = 1.0 / (std::abs(d) < tiny ? tiny : d);
    c = 1.0 + aa / c;
    c = std::abs(c) < tiny ? tiny : c;
    const double delta = d * c;
    h *= delta;
    if (std::abs(delta - 1.0) < 1e-15) break;
  }
  return h;
}

double IncompleteBeta(double a, double b, double x) {
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  const double front = std::exp(std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) +
                                a * std::log(x) + b * std::log1p(-x));
  if (x < (a + 1) / (a + b + 2)) return front * BetaContinuedFraction(a, b, x) / a;
  return 1.0 - front * BetaContinuedFraction(b, a, 1 - x) / b;
}

// ---- Per window ----

// What the reference forward leaves for the rows of its window.
struct Reference {
  std::vector<LayerKv> prefix;  // k, v of rows [0, keep_rows) per layer
  std::vector<float> logits;    // [T, V]
  std::vector<float> probs;     // [T, V] softmax of the logits
  std::vector<double> lse;      // [T]
  std::vector<int> argmax;      // [T]
  std::vector<double> nll;      // [T − 1], computed as Score computes a scheme's
};

int ArgMax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// Scores logits rows [first, T) (rows before `first` are the reference's, bit for bit).
WindowScore Score(const int32_t* ids, int64_t tokens, int64_t first, const float* logits,
                  const Reference& ref, int vocab, int64_t tail_from, bool per_position) {
  WindowScore w;
  if (per_position) {
    w.nll.resize(tokens - 1);
    w.kl.resize(tokens - 1);
  }
  for (int64_t p = 0; p + 1 < tokens; ++p) {
    double nll, kl = 0.0;
    bool agree = true;
    if (p < first) {
      nll = ref.nll[p];
    } else {
      const float* row = logits + (p - first) * vocab;
      const double lse = LogSumExp(row, vocab);
      nll = lse - row[ids[p + 1]];
      const float* x_ref = ref.logits.data() + p * vocab;
      const float* p_ref = ref.probs.data() + p * vocab;
      const double lse_ref = ref.lse[p];
      for (int v = 0; v < vocab; ++v) {
        kl += static_cast<double>(p_ref[v]) * ((x_ref[v] - lse_ref) - (row[v] - lse));
      }
      agree = ArgMax(row, vocab) == ref.argmax[p];
    }
    for (PositionSums* s : {&w.all, p >= tail_from ? &w.tail : nullptr}) {
      if (s == nullptr) continue;
      ++s->count;
      s->nll += nll;
      s->kl += kl;
      s->top1 += agree;
    }
    if (per_position) {
      w.nll[p] = static_cast<float>(nll);
      w.kl[p] = static_cast<float>(kl);
    }
  }
  return w;
}

// First position p whose cache at length p + 1 holds a history row, in any layer (T if none).
int64_t FirstHistoryPosition(const std::vector<LayerScheme>& layers, int64_t tokens) {
  int64_t first = tokens;
  for (const LayerScheme& s : layers) {
    if (!s.params.quantized()) continue;
    for (int64_t p = 0; p < first; ++p) {
      if (s.params.HistoryTokens(p + 1) > 0) {
        first = p;
        break;
      }
    }
  }
  return first;
}

std::string Fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

}  // namespace

// ---- Results ----

PositionSums RowResult::Total(bool tail) const {
  PositionSums t;
  for (const WindowScore& w : windows) {
    const PositionSums& s = tail ? w.tail : w.all;
    t.count += s.count;
    t.nll += s.nll;
    t.kl += s.kl;
    t.top1 += s.top1;
  }
  return t;
}

double RowResult::Ppl(bool tail) const { return std::exp(Total(tail).MeanNll()); }
double RowResult::MeanKl(bool tail) const { return Total(tail).MeanKl(); }
double RowResult::Top1(bool tail) const {
  const PositionSums t = Total(tail);
  return t.count > 0 ? static_cast<double>(t.top1) / t.count : 0.0;
}

double StudentTQuantile(double level, int df) {
  KVQ_CHECK(level > 0 && level < 1 && df >= 1, kInvalidArgument, "t quantile: level ", level,
            " must be in (0, 1) and df ", df, " >= 1");
  // P(|T| <= t) = 1 − I_{df/(df+t²)}(df/2, 1/2), increasing in t: bisect.
  double lo = 0, hi = 1e6;
  for (int i = 0; i < 200; ++i) {
    const double t = 0.5 * (lo + hi);
    const double p = 1.0 - IncompleteBeta(df / 2.0, 0.5, df / (df + t * t));
    (p < level ? lo : hi) = t;
  }
  return 0.5 * (lo + hi);
}

PairedDelta CompareWithOscar(const RowResult& row, const RowResult& oscar) {
  PairedDelta d;
  const size_t n = std::min(row.windows.size(), oscar.windows.size());
  d.windows = static_cast<int>(n);
  if (n < 2 || row.windows.size() != oscar.windows.size()) return d;
  std::vector<double> diff(n);
  for (size_t i = 0; i < n; ++i) {
    diff[i] = row.windows[i].tail.MeanKl() - oscar.windows[i].tail.MeanKl();
    d.won += row.windows[i].tail.MeanKl() < oscar.windows[i].tail.MeanKl();
  }
  double mean = 0;
  for (double x : diff) mean += x;
  mean /= n;
  double var = 0;
  for (double x : diff) var += (x - mean) * (x - mean);
  var /= static_cast<double>(n - 1);
  const double half = StudentTQuantile(0.95, static_cast<int>(n) - 1) * std::sqrt(var / n);
  d.mean = mean;
  d.low = mean - half;
  d.high = mean + half;
  d.valid = true;
  return d;
}

const RowResult* WindowSetResult::Find(const std::string& label) const {
  for (const RowResult& r : rows) {
    if (r.label == label) return &r;
  }
  return nullptr;
}

const WindowSetResult& PplResult::Get(const std::string& set) const {
  for (const WindowSetResult& s : sets) {
    if (s.name == set) return s;
  }
  KVQ_CHECK(false, kInvalidArgument, "no window set '", set, "' in the result");
  return sets.front();
}

// ---- Building the schemes ----

bool ShareSchemeWindows(const SchemeVariant& variant, const SchemeOptions& o,
                        std::vector<LayerScheme>* layers) {
  const SchemeInfo& info = SchemeByName(variant.scheme);
  if (info.windows.shared() || info.windows.sink > 0) return false;
  for (LayerScheme& l : *layers) {
    l.params.sink = o.sink;
    l.params.recent = o.recent;
    l.params.Validate();
  }
  return true;
}

std::vector<std::vector<LayerScheme>> BuildVariantLayers(const ModelConfig& config,
                                                         const Activations* calib_acts,
                                                         const Calibration* cal,
                                                         const PplOptions& options,
                                                         const cpu::Backend& backend,
                                                         const PplProgress& progress) {
  SchemeShape shape;
  shape.num_layers = config.num_layers;
  shape.num_kv_heads = config.num_kv_heads;
  shape.num_q_heads = config.num_q_heads;
  shape.head_dim = config.head_dim;
  if (calib_acts != nullptr) {
    const ActivationsInfo& a = calib_acts->info;
    KVQ_CHECK(a.num_layers == config.num_layers && a.num_q_heads == config.num_q_heads &&
                  a.num_kv_heads == config.num_kv_heads && a.head_dim == config.head_dim,
              kShapeMismatch, "the calibration capture has ", a.num_layers, " layers, Hq=",
              a.num_q_heads, ", Hkv=", a.num_kv_heads, ", d=", a.head_dim, "; the model ",
              config.num_layers, ", ", config.num_q_heads, ", ", config.num_kv_heads, ", ",
              config.head_dim);
  }
  bool own = false;
  for (const SchemeVariant& v : options.schemes) own = own || v.Resolved() == ClipChoice::kOwn;
  const std::vector<double> grid =
      options.clip_grid.empty() ? DefaultClipGrid() : options.clip_grid;
  ValidateClipGrid(grid);
  ClipTargets targets;
  if (own) {
    KVQ_CHECK(calib_acts != nullptr, kInvalidArgument,
              "own clip ratios need the calibration capture");
    const ValueTarget value_target =
        cal != nullptr ? ParseValueTarget(cal->info.value_target) : ValueTarget::kAttnOutput;
    const int sink = cal != nullptr ? cal->info.sink : options.scheme.sink;
    targets = ComputeClipTargets(*calib_acts, value_target, sink, options.threads);
  }
  const int L = config.num_layers;
  const int n = static_cast<int>(options.schemes.size());
  // The fp8 schemes' scales and blockgtq's widths from the calibration capture where the
  // calibration has none of theirs (CalibrationForScheme, at the options the schemes are built
  // with).
  std::vector<Calibration> own_cal(static_cast<size_t>(n));
  std::vector<const Calibration*> cal_of(static_cast<size_t>(n), cal);
  for (int i = 0; i < n; ++i) {
    const std::string& name = options.schemes[i].scheme;
    if (cal != nullptr && !CalibrationServes(*cal, name)) {
      own_cal[i] = CalibrationForScheme(name, *cal, calib_acts, backend, options.scheme);
      cal_of[i] = &own_cal[i];
    }
  }
  std::vector<std::vector<LayerScheme>> out(n, std::vector<LayerScheme>(L));
  int done = 0;
  ParallelItems(
      n * L, options.threads,
      [&](int unit) {
        const SchemeVariant& v = options.schemes[unit / L];
        const int l = unit % L;
        LayerScheme s = BuildLayerScheme(v.scheme, shape, cal_of[unit / L], l, options.scheme);
        ApplyClipChoice(v, cal, calib_acts, own ? &targets : nullptr, l, grid, backend, &s);
        out[unit / L][l] = std::move(s);
      },
      progress ? std::function<void()>([&] { progress(++done, n * L); }) : nullptr);
  return out;
}

// ---- The CPU forwards ----

std::vector<float> CpuPplForwards::Reference(const ForwardRequest& request) {
  DenseAttention bf16(model_->config, KvRounding::kBf16);
  return Forward(*model_, bf16, request);
}

std::vector<float> CpuPplForwards::Fp32(const ForwardRequest& request) {
  DenseAttention fp32(model_->config, KvRounding::kNone);
  return Forward(*model_, fp32, request);
}

std::vector<float> CpuPplForwards::Scheme(int /*scheme*/, const std::vector<LayerScheme>& layers,
                                          const ForwardRequest& request,
                                          double* bits_per_element) {
  CacheAttention cached(model_->config, layers, *backend_);
  std::vector<float> logits = Forward(*model_, cached, request);
  if (bits_per_element != nullptr) *bits_per_element = cached.bits_per_element();
  return logits;
}

// ---- The evaluation ----

PplResult EvaluatePerplexity(const Model& model, const std::vector<TokenWindows>& sets,
                             const std::vector<std::vector<LayerScheme>>& layers,
                             const PplOptions& options_in, const cpu::Backend& backend,
                             const PplProgress& progress, PplForwards* forwards) {
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig& c = model.config;
  CpuPplForwards cpu_forwards(model, backend);
  PplForwards& engine = forwards != nullptr ? *forwards : cpu_forwards;
  PplOptions options = options_in;
  KVQ_CHECK(options.threads >= 1, kInvalidArgument, "threads ", options.threads,
            " must be at least 1");
  KVQ_CHECK(layers.size() == options.schemes.size(), kInvalidArgument, layers.size(),
            " built schemes for ", options.schemes.size(), " scheme rows");
  if (options.tail_from < 0) options.tail_from = options.scheme.sink + options.scheme.recent;
  const int V = c.vocab;

  // Rows of the table: the reference, the fp32 forward, the schemes.
  struct RowPlan {
    enum Kind { kReference, kFp32, kScheme } kind;
    int scheme = -1;  // index into options.schemes
  };
  std::vector<RowPlan> plan = {{RowPlan::kReference}};
  if (options.fp32_baseline) plan.push_back({RowPlan::kFp32});
  for (int s = 0; s < static_cast<int>(options.schemes.size()); ++s) {
    KVQ_CHECK(static_cast<int>(layers[s].size()) == c.num_layers, kInvalidArgument, "scheme '",
              options.schemes[s].label, "' has ", layers[s].size(), " layers, the model ",
              c.num_layers);
    plan.push_back({RowPlan::kScheme, s});
  }

  PplResult result;
  result.model = model.where;
  result.config = c;
  result.options = options;
  struct Window {
    int set, index;
    const int32_t* ids;
    int64_t tokens;
  };
  std::vector<Window> windows;
  for (size_t s = 0; s < sets.size(); ++s) {
    const TokenWindows& set = sets[s];
    KVQ_CHECK(set.length >= 2 && set.length <= c.max_positions, kInvalidArgument, "window set '",
              set.name, "': windows of ", set.length, " tokens (2 to max_position_embeddings = ",
              c.max_positions, ")");
    KVQ_CHECK(options.tail_from < set.length - 1, kInvalidArgument, "window set '", set.name,
              "': windows of ", set.length, " tokens make no prediction at positions >= ",
              options.tail_from, " (the tail set, default S0 + W): longer windows or --tail-from");
    WindowSetResult r;
    r.name = set.name;
    r.windows = set.rows;
    r.length = set.length;
    for (const RowPlan& row : plan) {
      RowResult rr;
      if (row.kind == RowPlan::kReference) {
        rr.label = kReferenceLabel;
        rr.scheme = "bf16";
      } else if (row.kind == RowPlan::kFp32) {
        rr.label = kFp32Label;
        rr.bits_per_element = 32;
        rr.history_bits = 32;
      } else {
        const SchemeVariant& v = options.schemes[row.scheme];
        rr.label = v.label;
        rr.scheme = v.scheme;
        rr.clip = ClipChoiceName(v.Resolved());
        double history_bits = 0;
        for (const LayerScheme& ls : layers[row.scheme]) {
          // KV head 0's ratio: its own, else the params'.
          rr.clip_k.push_back(ls.key.Apply(ls.params.key, 0).clip);
          rr.clip_v.push_back(ls.value.Apply(ls.params.value, 0).clip);
          history_bits += ls.params.history_bits_per_element();
        }
        if (!layers[row.scheme].empty()) rr.history_bits = history_bits / layers[row.scheme].size();
      }
      rr.windows.resize(set.count());
      r.rows.push_back(std::move(rr));
    }
    result.sets.push_back(std::move(r));
    for (size_t i = 0; i < set.count(); ++i) {
      windows.push_back({static_cast<int>(s), static_cast<int>(i), set.window(i), set.length});
    }
  }

  // Where each row's forward starts (the reference keeps k and v up to the latest start).
  auto first_row = [&](size_t row, int64_t tokens) -> int64_t {
    const RowPlan& r = plan[row];
    if (r.kind != RowPlan::kScheme || !options.share_prefix) return 0;
    if (options.schemes[r.scheme].scheme == "bf16") return 0;  // the live KL = 0 check
    return FirstHistoryPosition(layers[r.scheme], tokens);
  };

  // Work items in order: the reference of a window comes `lookahead` windows before that
  // window's other rows, so workers seldom wait on it.
  struct Item {
    int window;
    size_t row;
  };
  std::vector<Item> order;
  const int lookahead = std::max(1, options.threads - 1);
  int refs = 0;
  const int num_windows = static_cast<int>(windows.size());
  for (int w = 0; w < num_windows; ++w) {
    while (refs < std::min(num_windows, w + 1 + lookahead)) order.push_back({refs++, 0});
    for (size_t row = 1; row < plan.size(); ++row) order.push_back({w, row});
  }

  std::vector<std::unique_ptr<Reference>> references(num_windows);
  std::vector<int> pending(num_windows, static_cast<int>(plan.size()) - 1);
  std::vector<char> ready(num_windows, 0);
  std::mutex mutex;  // guards references, pending, ready and reference_failed
  std::condition_variable changed;
  bool reference_failed = false;  // a waiting row gives up: the evaluation fails anyway

  auto run_item = [&](const Item& item) {
    const Window& win = windows[item.window];
    const int64_t T = win.tokens;
    RowResult& row = result.sets[win.set].rows[item.row];
    const RowPlan& rp = plan[item.row];
    if (rp.kind == RowPlan::kReference) {
      auto ref = std::make_unique<Reference>();
      int64_t keep = 0;
      for (size_t r = 1; r < plan.size(); ++r) keep = std::max(keep, std::min(first_row(r, T), T - 1));
      ForwardRequest req;
      req.ids = win.ids;
      req.tokens = T;
      req.keep = &ref->prefix;
      req.keep_rows = keep;
      ref->logits = engine.Reference(req);
      ref->probs = ref->logits;
      ref->lse.resize(T);
      ref->argmax.resize(T);
      ref->nll.resize(T - 1);
      for (int64_t p = 0; p < T; ++p) {
        const float* x = ref->logits.data() + p * V;
        ref->lse[p] = LogSumExp(x, V);
        ref->argmax[p] = ArgMax(x, V);
        float* pr = ref->probs.data() + p * V;
        for (int v = 0; v < V; ++v) pr[v] = static_cast<float>(std::exp(x[v] - ref->lse[p]));
        if (p + 1 < T) ref->nll[p] = ref->lse[p] - x[win.ids[p + 1]];
      }
      // The reference's own row: its NLL, KL 0, top-1 agreement 1.
      row.windows[win.index] =
          Score(win.ids, T, T - 1, nullptr, *ref, V, options.tail_from, options.per_position);
      std::lock_guard<std::mutex> lock(mutex);
      references[item.window] = std::move(ref);
      ready[item.window] = 1;
      changed.notify_all();
      return;
    }
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] { return ready[item.window] != 0 || reference_failed; });
      if (reference_failed) return;
    }
    const Reference& ref = *references[item.window];
    const int64_t first = std::min(first_row(item.row, T), T - 1);
    if (rp.kind == RowPlan::kScheme && first >= T - 1) {
      // No scored position reads a history: the reference's numbers, exactly.
      row.windows[win.index] =
          Score(win.ids, T, T - 1, nullptr, ref, V, options.tail_from, options.per_position);
    } else {
      ForwardRequest req;
      req.ids = win.ids;
      req.tokens = T;
      req.first = first;
      req.prefix = &ref.prefix;
      std::vector<float> logits;
      if (rp.kind == RowPlan::kFp32) {
        logits = engine.Fp32(req);
      } else {
        double bits = 0.0;
        logits = engine.Scheme(rp.scheme, layers[rp.scheme], req, &bits);
        if (win.index == 0) row.bits_per_element = bits;
      }
      row.windows[win.index] = Score(win.ids, T, first, logits.data(), ref, V, options.tail_from,
                                     options.per_position);
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (--pending[item.window] == 0) references[item.window].reset();
  };

  // A reference is queued before the rows that wait for it, so a row never waits for one no
  // worker has taken; if it fails, the rows waiting for it are woken to give up.
  const int total = static_cast<int>(order.size());
  int reported = 0;
  ParallelItems(
      total, options.threads,
      [&](int i) {
        try {
          run_item(order[i]);
        } catch (...) {
          if (plan[order[i].row].kind == RowPlan::kReference) {
            std::lock_guard<std::mutex> lock(mutex);
            reference_failed = true;
            changed.notify_all();
          }
          throw;
        }
      },
      progress ? std::function<void()>([&] { progress(++reported, total); })
               : std::function<void()>());
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// ---- Output ----

std::string FormatPplTable(const PplResult& result) {
  std::ostringstream os;
  const PplOptions& o = result.options;
  for (const WindowSetResult& set : result.sets) {
    const RowResult* ref = set.Find(kReferenceLabel);
    const RowResult* oscar = set.Find("oscar");
    const RowResult* fp32 = set.Find(kFp32Label);
    const int64_t tail = std::max<int64_t>(0, set.length - 1 - o.tail_from);
    os << set.name << ": " << set.windows.size() << " windows x " << set.length
       << " tokens; PPL over all " << set.length - 1 << " predictions per window and over the "
       << tail << " at positions >= " << o.tail_from << " (S0 + W: where the history exists)\n";
    os << "  reference: bf16 cache PPL " << Fixed(ref->Ppl(false), 4) << " (>= " << o.tail_from
       << ": " << Fixed(ref->Ppl(true), 4) << ")";
    if (fp32 != nullptr) {
      os << "; fp32 forward, no cache rounding: PPL " << Fixed(fp32->Ppl(false), 4) << " ("
         << Fixed(fp32->Ppl(true), 4) << "), KL(bf16||fp32) " << std::scientific
         << std::setprecision(1) << fp32->MeanKl(false) << std::defaultfloat;
    }
    os << "\n";
    char line[512];
    std::snprintf(line, sizeof line, "  %-24s %-5s %5s %6s %9s %7s %9s %9s %7s  %-29s %s\n",
                  "scheme", "clip", "hist", "+win", "PPL", "dPPL%", "PPL>=tail", "KL>=tail", "top1",
                  "dKL vs oscar [95% CI]", "won");
    os << line;
    for (const RowResult& r : set.rows) {
      if (&r == ref || &r == fp32) continue;
      std::string delta = "-", won = "-";
      if (oscar != nullptr && &r != oscar) {
        const PairedDelta d = CompareWithOscar(r, *oscar);
        if (d.valid) {
          char text[96];
          std::snprintf(text, sizeof text, "%+.5f [%+.5f, %+.5f]", d.mean, d.low, d.high);
          delta = text;
          won = std::to_string(d.won) + "/" + std::to_string(d.windows);
        }
      }
      std::snprintf(line, sizeof line,
                    "  %-24s %-5s %5.2f %6.2f %9.4f %+7.2f %9.4f %9.6f %7.4f  %-29s %s\n",
                    r.label.c_str(), r.clip.empty() ? "-" : r.clip.c_str(), r.history_bits,
                    r.bits_per_element,
                    r.Ppl(false), 100.0 * (r.Ppl(false) / ref->Ppl(false) - 1.0), r.Ppl(true),
                    r.MeanKl(true), r.Top1(true), delta.c_str(), won.c_str());
      os << line;
    }
    os << "\n";
  }
  os << "Bits per element of K and V: hist = what the quantized history stores (codes and "
        "metadata); +win = the whole cache at the window's length, the bf16 sink and recent "
        "windows included (mean over layers).\n";
  os << "KL(p_bf16 || p_scheme) in nats and top-1 agreement with the bf16 reference at positions "
        ">= "
     << o.tail_from << "; dKL per window vs OSCAR, mean with a paired Student-t 95% interval; "
                       "won = windows where the scheme's KL is below OSCAR's. Clip: own = chosen "
                       "for the scheme's rotation on the calibration tokens (kvq calibrate's "
                       "rule), oscar = OSCAR's ratios reused, none = no clip.\n";
  return os.str();
}

std::string SummarizePpl(const PplResult& result) {
  std::ostringstream os;
  for (const WindowSetResult& set : result.sets) {
    std::vector<const RowResult*> quantized;
    for (const RowResult& r : set.rows) {
      if (!r.scheme.empty() && r.scheme != "bf16") quantized.push_back(&r);
    }
    if (quantized.empty()) continue;
    std::stable_sort(quantized.begin(), quantized.end(), [](const RowResult* a, const RowResult* b) {
      return a->MeanKl(true) > b->MeanKl(true);
    });
    os << set.name << ", KL at positions >= " << result.options.tail_from << ", worst to best: ";
    for (size_t i = 0; i < quantized.size(); ++i) {
      os << (i ? " > " : "") << quantized[i]->label << " " << Fixed(quantized[i]->MeanKl(true), 4);
    }
    os << ".";
    const RowResult* oscar = set.Find("oscar");
    if (oscar != nullptr) {
      for (const char* other : {"hadamard", "naive"}) {
        const RowResult* r = set.Find(other);
        if (r == nullptr || oscar->MeanKl(true) <= 0) continue;
        const PairedDelta d = CompareWithOscar(*r, *oscar);
        os << " OSCAR's KL is " << Fixed(r->MeanKl(true) / oscar->MeanKl(true), 2) << "x below "
           << other << "'s";
        if (d.valid) {
          os << " (" << other << " worse in " << d.windows - d.won << "/" << d.windows
             << " windows; 95% interval of the difference "
             << (d.low > 0 ? "excludes 0" : "includes 0") << ")";
        }
        os << ".";
      }
      os << " PPL: OSCAR " << Fixed(100.0 * (oscar->Ppl(false) / set.rows.front().Ppl(false) - 1.0), 2)
         << "% above the bf16 cache.";
    }
    os << "\n";
  }
  // Pooled over every window of every set (one paired interval with more windows).
  if (result.sets.size() > 1) {
    auto pooled = [&](const std::string& label) {
      RowResult all;
      for (const WindowSetResult& set : result.sets) {
        const RowResult* r = set.Find(label);
        if (r == nullptr) return RowResult{};
        all.windows.insert(all.windows.end(), r->windows.begin(), r->windows.end());
      }
      all.label = label;
      return all;
    };
    const RowResult oscar = pooled("oscar");
    std::string line;
    for (const char* other : {"hadamard", "naive", "raw_target"}) {
      const RowResult r = pooled(other);
      if (oscar.windows.empty() || r.windows.empty()) continue;
      const PairedDelta d = CompareWithOscar(r, oscar);
      if (!d.valid) continue;
      char text[200];
      std::snprintf(text, sizeof text, "%s%s %+.5f [%+.5f, %+.5f] (below OSCAR in %d/%d)",
                    line.empty() ? "" : "; ", other, d.mean, d.low, d.high, d.won, d.windows);
      line += text;
    }
    if (!line.empty()) {
      os << "All " << oscar.windows.size() << " windows pooled, dKL vs OSCAR at positions >= "
         << result.options.tail_from << " with its 95% interval: " << line << ".\n";
    }
  }
  return os.str();
}

std::string PplJson(const PplResult& result) {
  using Json = nlohmann::ordered_json;
  const PplOptions& o = result.options;
  Json j;
  j["format"] = "kvq-ppl";
  j["version"] = 1;
  j["model"] = result.model;
  j["arch"] = ModelArchName(result.config.arch);
  j["options"] = {{"group", o.scheme.group},
                  {"bits", o.scheme.bits},
                  {"k_bits", o.scheme.k_bits != 0 ? o.scheme.k_bits : o.scheme.bits},
                  {"v_bits", o.scheme.v_bits != 0 ? o.scheme.v_bits : o.scheme.bits},
                  {"sink", o.scheme.sink},
                  {"recent", o.scheme.recent},
                  {"page", o.scheme.page},
                  {"saw_block", o.scheme.saw_block},
                  {"tail_from", o.tail_from},
                  {"share_prefix", o.share_prefix},
                  {"threads", o.threads}};
  j["calibration_source"] = result.calibration_source;
  j["seconds"] = result.seconds;
  auto sums = [](const PositionSums& s) {
    return Json{{"count", s.count}, {"nll", s.nll}, {"kl", s.kl}, {"top1", s.top1}};
  };
  Json sets = Json::array();
  for (const WindowSetResult& set : result.sets) {
    Json js;
    js["name"] = set.name;
    js["windows"] = set.windows;
    js["length"] = set.length;
    const RowResult* oscar = set.Find("oscar");
    const RowResult* ref = set.Find(kReferenceLabel);
    Json rows = Json::array();
    for (const RowResult& r : set.rows) {
      Json jr;
      jr["label"] = r.label;
      jr["scheme"] = r.scheme;
      jr["clip"] = r.clip;
      jr["clip_k"] = r.clip_k;
      jr["clip_v"] = r.clip_v;
      jr["bits_per_element"] = r.bits_per_element;
      jr["history_bits_per_element"] = r.history_bits;
      jr["ppl"] = r.Ppl(false);
      jr["ppl_tail"] = r.Ppl(true);
      jr["ppl_rel_to_reference"] = r.Ppl(false) / ref->Ppl(false) - 1.0;
      jr["kl"] = r.MeanKl(false);
      jr["kl_tail"] = r.MeanKl(true);
      jr["top1"] = r.Top1(false);
      jr["top1_tail"] = r.Top1(true);
      if (oscar != nullptr && &r != oscar) {
        const PairedDelta d = CompareWithOscar(r, *oscar);
        if (d.valid) {
          jr["delta_kl_vs_oscar"] = {{"mean", d.mean}, {"low95", d.low}, {"high95", d.high},
                                     {"won", d.won}, {"windows", d.windows}};
        }
      }
      Json wins = Json::array();
      for (const WindowScore& w : r.windows) {
        Json jw{{"all", sums(w.all)}, {"tail", sums(w.tail)}};
        if (!w.nll.empty()) {
          jw["nll"] = w.nll;
          jw["kl"] = w.kl;
        }
        wins.push_back(std::move(jw));
      }
      jr["per_window"] = std::move(wins);
      rows.push_back(std::move(jr));
    }
    js["rows"] = std::move(rows);
    sets.push_back(std::move(js));
  }
  j["sets"] = std::move(sets);
  return j.dump(1);
}

void WritePplJson(const std::string& path, const PplResult& result) {
  const std::string text = PplJson(result) + "\n";
  WriteFile(path, std::vector<uint8_t>(text.begin(), text.end()));
}

}  // namespace kvq::calib
