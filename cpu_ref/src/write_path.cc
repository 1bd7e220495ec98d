// Validating entry points of the write path (write_path.h). The kernels below assume checked
// inputs; everything a caller can get wrong is rejected here with a kvq::Error that names the
// offending value.
#include "kvq/cpu_ref/write_path.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/numeric.h"
#include "kvq/common/params.h"
#include "kvq/common/stages.h"
#include "write_internal.h"

namespace kvq::cpu {
namespace {

// n rows of d floats, without overflowing size_t.
size_t CheckedElements(size_t n, int d) {
  KVQ_CHECK(n <= std::numeric_limits<size_t>::max() / sizeof(float) / static_cast<size_t>(d),
            kInvalidArgument, "row count ", n, " is too large for head_dim ", d);
  return n * static_cast<size_t>(d);
}

void CheckFinite(const float* x, size_t n, int d, const char* what) {
  const size_t dd = static_cast<size_t>(d);
  for (size_t row = 0; row < n; ++row) {
    for (size_t col = 0; col < dd; ++col) {
      const float v = x[row * dd + col];
      KVQ_CHECK(!IsNonFinite(v), kNonFinite, what, " value ", v, " at row ", row, ", column ",
                col, " is not finite");
    }
  }
}

void CheckRotation(const WriteParams& p, const float* rotation) {
  if (p.rotation != RotationKind::kDense) return;
  KVQ_CHECK(rotation != nullptr, kInvalidArgument,
            "dense rotation requested but the rotation matrix is null");
  const size_t d = static_cast<size_t>(p.head_dim);
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) {
      const float v = rotation[i * d + j];
      KVQ_CHECK(!IsNonFinite(v), kNonFinite, "rotation matrix entry R[", i, "][", j, "] = ", v,
                " is not finite");
    }
  }
}

// Everything Rotate, RotateInverse and QuantizeRows reject before touching the data.
void CheckInputs(const Backend& backend, const WriteParams& p, const float* rotation,
                 const float* x, size_t n) {
  p.Validate();
  for (const StageSpec& stage : AllStages()) {
    KVQ_CHECK(!StageRuns(stage, p) || HasStage(backend.write, stage.id), kUnsupported,
              "backend '", backend.name, "' has no '", stage.name, "' kernel");
  }
  CheckedElements(n, p.head_dim);
  if (n == 0) return;
  KVQ_CHECK(x != nullptr, kInvalidArgument, "input rows are null (", n, " rows)");
  CheckRotation(p, rotation);
  CheckFinite(x, n, p.head_dim, "input");
}

bool Overlap(const float* a, const float* b, size_t count) {
  return a < b + count && b < a + count;
}

}  // namespace

namespace internal {

void RotateRows(const Backend& backend, const WriteParams& p, const float* rotation,
                const float* x, float* y, size_t n) {
  const size_t count = n * static_cast<size_t>(p.head_dim);
  switch (p.rotation) {
    case RotationKind::kIdentity:
      if (x != y) std::memmove(y, x, count * sizeof(float));
      break;
    case RotationKind::kDense:
      if (Overlap(x, y, count)) {
        std::vector<float> rotated(count);
        backend.write.rotate_dense(x, rotation, rotated.data(), n, p);
        std::memcpy(y, rotated.data(), count * sizeof(float));
      } else {
        backend.write.rotate_dense(x, rotation, y, n, p);
      }
      break;
    case RotationKind::kHadamard:
      if (x != y) std::memmove(y, x, count * sizeof(float));
      backend.write.fwht(y, n, p);
      break;
  }
  if (p.bitrev) {
    std::vector<float> permuted(count);
    backend.write.bitrev(y, permuted.data(), n, p);
    std::memcpy(y, permuted.data(), count * sizeof(float));
  }
}

void RotateRowsInverse(const Backend& backend, const WriteParams& p, const float* r_transposed,
                       const float* x, float* y, size_t n) {
  const size_t count = n * static_cast<size_t>(p.head_dim);
  // P_br is an involution: undo it first (the forward map applied it last).
  std::vector<float> work(x, x + count);
  if (p.bitrev) {
    std::vector<float> permuted(count);
    backend.write.bitrev(work.data(), permuted.data(), n, p);
    work.swap(permuted);
  }
  switch (p.rotation) {
    case RotationKind::kIdentity:
      break;
    case RotationKind::kDense: {
      std::vector<float> rotated(count);
      backend.write.rotate_dense(work.data(), r_transposed, rotated.data(), n, p);
      work.swap(rotated);
      break;
    }
    case RotationKind::kHadamard:
      // The normalised Sylvester matrix is symmetric and orthogonal: H⁻¹ = H.
      backend.write.fwht(work.data(), n, p);
      break;
  }
  std::memcpy(y, work.data(), count * sizeof(float));
}

}  // namespace internal

void Rotate(const Backend& backend, const WriteParams& p, const float* rotation, const float* x,
            float* y, size_t n) {
  CheckInputs(backend, p, rotation, x, n);
  if (n == 0) return;
  KVQ_CHECK(y != nullptr, kInvalidArgument, "output rows are null (", n, " rows)");
  internal::RotateRows(backend, p, rotation, x, y, n);
}

void RotateInverse(const Backend& backend, const WriteParams& p, const float* rotation,
                   const float* x, float* y, size_t n) {
  CheckInputs(backend, p, rotation, x, n);
  if (n == 0) return;
  KVQ_CHECK(y != nullptr, kInvalidArgument, "output rows are null (", n, " rows)");
  const size_t d = static_cast<size_t>(p.head_dim);
  // x·Rᵀ with the same dense kernel: transpose once.
  std::vector<float> transposed;
  if (p.rotation == RotationKind::kDense) {
    transposed.resize(d * d);
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) transposed[j * d + i] = rotation[i * d + j];
    }
  }
  internal::RotateRowsInverse(backend, p, transposed.data(), x, y, n);
}

namespace {

// One head's arrays with only the rotation given (the overloads that take rotations).
std::vector<HeadArrays> RotationsOnly(const std::vector<const float*>& rotations) {
  std::vector<HeadArrays> heads(rotations.size());
  for (size_t h = 0; h < rotations.size(); ++h) heads[h].rotation = rotations[h];
  return heads;
}

// Each head's arrays with the optional ones it lacks filled in (codebook widths: p.bits).
std::vector<FilledHeadArrays> FillHeads(const std::vector<WriteParams>& params,
                                        const std::vector<HeadArrays>& heads) {
  std::vector<FilledHeadArrays> filled;
  filled.reserve(heads.size());
  for (size_t h = 0; h < heads.size(); ++h) filled.emplace_back(params[h], heads[h]);
  return filled;
}

// The per-head arrays the codec steps of p read (inputs named after a head_data.inc row),
// checked against their rows' rules (codebook widths: 1..8, the row limits).
void CheckCodecArrays(const WriteParams& p, const HeadArrays& arrays, size_t head) {
  for (CodecPass pass : {CodecPass::kEncode, CodecPass::kDecode}) {
    for (StageId id : CodecSteps(p.format, pass)) {
      const StageSpec& stage = GetStage(id);
      for (int i = 0; i < stage.num_args; ++i) {
        const StageArg& a = stage.args[i];
        if (a.is_input() && HeadArrays::IsRow(a.name)) ValidateHeadArray(p, arrays, head, a.name);
      }
    }
  }
}

// Everything QuantizeTokens rejects before touching the data: each head's parameters (one
// format, d and norm), the backend's stages, the tile, the rotations and codec arrays, the
// input.
void CheckTokenInputs(const Backend& backend, const std::vector<WriteParams>& params,
                      const std::vector<HeadArrays>& arrays, const float* x, size_t n) {
  KVQ_CHECK(!params.empty() && arrays.size() == params.size(), kInvalidArgument,
            "the write path of ", params.size(), " KV heads got ", arrays.size(),
            " heads' rotations and arrays");
  const WriteParams& p0 = params.front();
  for (size_t h = 0; h < params.size(); ++h) {
    const WriteParams& p = params[h];
    p.Validate();
    KVQ_CHECK(p.quantized(), kInvalidArgument, "the quantizing write path does not run format '",
              FormatName(p.format), "'");
    KVQ_CHECK(p.format == p0.format && p.head_dim == p0.head_dim && p.group == p0.group &&
                  p.norm == p0.norm && p.norm_heads == p0.norm_heads,
              kInvalidArgument, "KV head ", h, " has write params [", p.head_dim, " ",
              FormatName(p.format), "] that differ from KV head 0's in format, d, group or norm");
    for (const StageSpec& stage : AllStages()) {
      KVQ_CHECK(!StageRuns(stage, p) || HasStage(backend.write, stage.id), kUnsupported,
                "backend '", backend.name, "' has no '", stage.name, "' kernel");
    }
  }
  const size_t heads = params.size();
  KVQ_CHECK(!p0.norm || p0.norm_heads == 1 || static_cast<size_t>(p0.norm_heads) == heads,
            kInvalidArgument, "a norm over ", p0.norm_heads, " KV heads needs the rows of all ",
            p0.norm_heads, " heads of each token (got ", heads, ")");
  const size_t tile = static_cast<size_t>(p0.tile_tokens());
  KVQ_CHECK(n % tile == 0, kInvalidArgument, "format '", FormatName(p0.format),
            "' stores tiles of ", tile, " tokens; ", n, " rows is not a whole number of tiles");
  CheckedElements(n, p0.head_dim * static_cast<int>(heads));
  if (n == 0) return;
  KVQ_CHECK(x != nullptr, kInvalidArgument, "input rows are null (", n, " rows)");
  for (size_t h = 0; h < heads; ++h) {
    CheckRotation(params[h], arrays[h].rotation);
    CheckCodecArrays(params[h], FilledHeadArrays(params[h], arrays[h]).view(), h);
  }
  CheckFinite(x, n, p0.head_dim * static_cast<int>(heads), "input");
}

// The latest output called `name` (a later step's output of a name shadows an earlier one).
const std::pair<std::string, Tensor>* FindOutput(
    const std::vector<std::pair<std::string, Tensor>>& outputs, const std::string& name) {
  for (auto it = outputs.rbegin(); it != outputs.rend(); ++it) {
    if (it->first == name) return &*it;
  }
  return nullptr;
}

// Runs one codec step (formats.inc's KVQ_CODEC_STEP) over n rows, binding its arguments by
// name: `x` to `x`, `y` to `y`, another input to the output of that name in `named`, else to
// the head's per-head array of that name (`head`, filled: head_data.inc), else to
// `lookup(name)` (the stored planes of a decode); another output is appended to `named`,
// shaped by its extent. common_codec_steps_test checks that every
// format's steps bind; a missing input here is still a kvq::Error naming it, not a crash.
// The lookup of an encode: nothing is stored yet.
const void* NoPlanes(const char*) { return nullptr; }

template <class Lookup>
void RunCodecStep(const Backend& backend, const WriteParams& p, const HeadArrays& head,
                  StageId id, const float* x, float* y, size_t n,
                  std::vector<std::pair<std::string, Tensor>>* named, const Lookup& lookup) {
  const StageSpec& stage = GetStage(id);
  // Allocate the step's new outputs first: appending moves nothing the pointers then see.
  for (int i = 0; i < stage.num_args; ++i) {
    const StageArg& a = stage.args[i];
    if (a.dir != ArgDir::kOut || std::strcmp(a.name, "y") == 0) continue;
    Tensor t;
    t.dtype = a.dtype;
    t.shape = ArgShape(a.extent, static_cast<int64_t>(n), p);
    t.bytes.resize(ArgElements(a.extent, static_cast<int64_t>(n), p) * DTypeSize(a.dtype));
    named->emplace_back(a.expect, std::move(t));
  }
  void* args[kMaxStageArgs] = {};
  for (int i = 0; i < stage.num_args; ++i) {
    const StageArg& a = stage.args[i];
    if (std::strcmp(a.name, "x") == 0 && a.dir == ArgDir::kIn) {
      args[i] = const_cast<float*>(x);
    } else if (std::strcmp(a.name, "y") == 0 && a.dir == ArgDir::kOut) {
      args[i] = y;
    } else if (a.dir == ArgDir::kOut) {  // allocated above
      args[i] = const_cast<uint8_t*>(FindOutput(*named, a.expect)->second.bytes.data());
    } else if (const auto* found = FindOutput(*named, a.name)) {
      args[i] = const_cast<uint8_t*>(found->second.bytes.data());
    } else if (HeadArrays::IsRow(a.name)) {
      args[i] = const_cast<void*>(head.Find(a.name));
      KVQ_CHECK(args[i] != nullptr, kInvalidArgument, "codec step '", stage.name,
                "' of format '", FormatName(p.format), "' reads the per-head array '", a.name,
                "', which the KV head does not hold");
    } else {
      args[i] = const_cast<void*>(lookup(a.name));
      KVQ_CHECK(args[i] != nullptr, kInvalidArgument, "codec step '", stage.name,
                "' of format '", FormatName(p.format), "' reads '", a.name,
                "', which no earlier step writes and no plane stores");
    }
  }
  if (n > 0) RunStage(backend.write, id, args, n, p);
}

}  // namespace

std::vector<QuantizedRows> QuantizeTokens(const Backend& backend,
                                          const std::vector<WriteParams>& params,
                                          const std::vector<const float*>& rotations,
                                          const float* x, size_t n) {
  return QuantizeTokens(backend, params, RotationsOnly(rotations), x, n);
}

std::vector<QuantizedRows> QuantizeTokens(const Backend& backend,
                                          const std::vector<WriteParams>& params,
                                          const std::vector<HeadArrays>& arrays, const float* x,
                                          size_t n) {
  CheckTokenInputs(backend, params, arrays, x, n);
  const std::vector<FilledHeadArrays> filled = FillHeads(params, arrays);
  const bool clips = StageRuns(GetStage(StageId::kClip), params.front());
  const WriteParams& p0 = params.front();
  const size_t heads = params.size();
  const size_t d = static_cast<size_t>(p0.head_dim);
  const size_t count = n * d;
  // Names the head in messages only when there are several.
  const auto where = [heads](size_t h) {
    return heads > 1 ? detail::Concat(", KV head ", h) : std::string();
  };
  std::vector<QuantizedRows> out(heads);
  for (size_t h = 0; h < heads; ++h) {
    QuantizedRows& q = out[h];
    q.rows = n;
    q.rotated.resize(count);
    if (clips) q.tau.resize(n);
    q.dequantized.resize(count);
    if (p0.norm) {
      q.outputs.emplace_back("norm", Tensor::BF16({static_cast<int64_t>(n)},
                                                  std::vector<uint16_t>(n)));
      q.normalized.resize(count);
    }
    if (n == 0) continue;
    std::vector<float> rows(count);
    for (size_t r = 0; r < n; ++r) {
      std::memcpy(&rows[r * d], x + (r * heads + h) * d, d * sizeof(float));
    }
    internal::RotateRows(backend, params[h], arrays[h].rotation, rows.data(), q.rotated.data(),
                         n);
    // Magnitudes up to 2^126 keep hi - lo, the scale and every dequantized value finite.
    for (size_t row = 0; row < n; ++row) {
      for (size_t col = 0; col < d; ++col) {
        const float v = q.rotated[row * d + col];
        KVQ_CHECK(std::fabs(v) <= kMaxRotatedAbs, kNonFinite, "rotated value ", v, " at row ",
                  row, where(h), ", column ", col, " exceeds the supported magnitude 2^126");
      }
    }
  }
  if (n == 0) {  // the record still names every output, each empty
    for (size_t h = 0; h < heads; ++h) {
      for (StageId step : CodecSteps(params[h].format, CodecPass::kEncode)) {
        RunCodecStep(backend, params[h], filled[h].view(), step, nullptr, nullptr, 0,
                     &out[h].outputs, NoPlanes);
      }
    }
    return out;
  }

  // The norm: per head, or one over each token's heads laid end to end (norm_heads == H).
  if (p0.norm) {
    const size_t span_heads = static_cast<size_t>(p0.norm_heads);
    const size_t span = span_heads * d;
    std::vector<float> spans(n * span);
    std::vector<uint16_t> norms(n);
    for (size_t first = 0; first < heads; first += span_heads) {
      for (size_t r = 0; r < n; ++r) {
        for (size_t k = 0; k < span_heads; ++k) {
          std::memcpy(&spans[r * span + k * d], &out[first + k].rotated[r * d], d * sizeof(float));
        }
      }
      backend.write.norm(spans.data(), norms.data(), n, params[first]);
      for (size_t r = 0; r < n; ++r) {
        KVQ_CHECK(!IsNonFinite(F32FromBf16(norms[r])), kNonFinite, "the norm of row ", r,
                  span_heads > 1 ? " (all KV heads)" : where(first).c_str(),
                  " overflows: its squared length exceeds the fp32 range (a norm supports rows "
                  "of length up to about 2^63)");
      }
      for (size_t k = 0; k < span_heads; ++k) {
        QuantizedRows& q = out[first + k];
        std::memcpy(q.outputs.front().second.bytes.data(), norms.data(),
                    n * sizeof(uint16_t));
        for (size_t r = 0; r < n; ++r) {
          std::memcpy(&q.normalized[r * d], &spans[r * span + k * d], d * sizeof(float));
        }
      }
    }
  }

  for (size_t h = 0; h < heads; ++h) {
    const WriteParams& p = params[h];
    QuantizedRows& q = out[h];
    std::vector<float> clipped(p.norm ? q.normalized : q.rotated);
    if (clips) backend.write.clip(clipped.data(), q.tau.data(), n, p);
    for (StageId step : CodecSteps(p.format, CodecPass::kEncode)) {
      RunCodecStep(backend, p, filled[h].view(), step, clipped.data(), q.dequantized.data(), n,
                   &q.outputs, NoPlanes);
    }
    // A codebook segment whose square sum overflows stores an infinite norm (numerics.md
    // §5.4.2): rejected like the §5.1 norm's.
    if (const auto* segment_norm = FindOutput(q.outputs, "segment_norm")) {
      const uint16_t* norms = segment_norm->second.data<uint16_t>();
      const size_t slots = static_cast<size_t>(p.segments);
      for (size_t r = 0; r < n; ++r) {
        for (size_t s = 0; s < slots; ++s) {
          KVQ_CHECK(!IsNonFinite(F32FromBf16(norms[r * slots + s])), kNonFinite,
                    "the norm of row ", r, where(h), ", segment ", s,
                    " overflows: its squared length exceeds the fp32 range (a segment norm "
                    "supports segments of length up to about 2^63)");
        }
      }
    }
    if (p.norm) {
      backend.write.denorm(q.dequantized.data(), q.Output("norm").data<uint16_t>(), n, p);
    }
  }
  return out;
}

QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                           const float* x, size_t n) {
  KVQ_CHECK(p.format != Format::kBf16, kInvalidArgument, "QuantizeRows runs the write path of ",
            "a quantized format, not format '", FormatName(p.format), "'");
  KVQ_CHECK(!p.norm || p.norm_heads == 1, kInvalidArgument, "a norm over ", p.norm_heads,
            " KV heads needs every head's rows (QuantizeTokens)");
  HeadArrays head;
  head.rotation = rotation;
  return QuantizeRows(backend, p, head, x, n);
}

QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const HeadArrays& head,
                           const float* x, size_t n) {
  KVQ_CHECK(p.format != Format::kBf16, kInvalidArgument, "QuantizeRows runs the write path of ",
            "a quantized format, not format '", FormatName(p.format), "'");
  KVQ_CHECK(!p.norm || p.norm_heads == 1, kInvalidArgument, "a norm over ", p.norm_heads,
            " KV heads needs every head's rows (QuantizeTokens)");
  return std::move(
      QuantizeTokens(backend, {p}, std::vector<HeadArrays>{head}, x, n).front());
}

const Tensor& QuantizedRows::Output(const std::string& name) const {
  const auto* found = FindOutput(outputs, name);
  if (found == nullptr) {
    std::string names;
    for (const auto& entry : outputs) names += (names.empty() ? "" : ", ") + entry.first;
    KVQ_CHECK(false, kInvalidArgument, "the write path has no output '", name, "' (it has: ",
              names.empty() ? "none" : names, ")");
  }
  return found->second;
}

std::vector<std::pair<std::string, Tensor>> QuantizedRows::Tensors(const WriteParams& p) const {
  const int64_t n = static_cast<int64_t>(rows), d = p.head_dim;
  std::vector<std::pair<std::string, Tensor>> t;
  t.emplace_back("rotated", Tensor::F32({n, d}, rotated));
  size_t codec = 0;
  if (p.norm) {
    t.push_back(outputs.front());  // the norm stage's output comes first
    t.emplace_back("normalized", Tensor::F32({n, d}, normalized));
    codec = 1;
  }
  if (StageRuns(GetStage(StageId::kClip), p)) t.emplace_back("tau", Tensor::F32({n}, tau));
  for (size_t i = codec; i < outputs.size(); ++i) t.push_back(outputs[i]);
  t.emplace_back("dequantized", Tensor::F32({n, d}, dequantized));
  return t;
}

namespace {

// ---- The codecs: bf16 rows, or the steps of a quantized format (formats.inc) ----
// Encode: n tokens of the heads of `params` from x [n, H, d]; one EncodedRows per head.

void EncodeBf16(const Backend&, const std::vector<WriteParams>& params,
                const std::vector<HeadArrays>&, const float* x, size_t n,
                std::vector<EncodedRows>* out) {
  const size_t heads = params.size();
  const int d = params.front().head_dim;
  const size_t dd = static_cast<size_t>(d);
  CheckedElements(n, d * static_cast<int>(heads));
  if (n == 0) return;
  KVQ_CHECK(x != nullptr, kInvalidArgument, "input rows are null (", n, " rows)");
  CheckFinite(x, n, d * static_cast<int>(heads), "input");
  for (size_t h = 0; h < heads; ++h) {
    std::vector<uint8_t>& plane = (*out)[h].plane[0];
    plane.resize(n * dd * sizeof(uint16_t));
    for (size_t r = 0; r < n; ++r) {
      for (size_t j = 0; j < dd; ++j) {
        const float v = x[(r * heads + h) * dd + j];
        const uint16_t bits = Bf16FromF32(v);
        KVQ_CHECK(!IsNonFinite(F32FromBf16(bits)), kNonFinite, "value ", v, " at row ", r,
                  heads > 1 ? detail::Concat(", KV head ", h) : std::string(), ", column ", j,
                  " rounds to inf in bf16");
        std::memcpy(plane.data() + (r * dd + j) * sizeof(uint16_t), &bits, sizeof bits);
      }
    }
  }
}

void DecodeBf16(const Backend&, const WriteParams& p, const HistoryRunView& rows, size_t n,
                float* y) {
  const size_t count = n * static_cast<size_t>(p.head_dim);
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, rows.plane[0] + i * sizeof(uint16_t), sizeof bits);
    y[i] = F32FromBf16(bits);
  }
}

// The planes of a quantized format: each stores the write-path output its source column names.
void EncodeQuantized(const Backend& backend, const std::vector<WriteParams>& params,
                     const std::vector<HeadArrays>& arrays, const float* x, size_t n,
                     std::vector<EncodedRows>* out) {
  std::vector<QuantizedRows> q = QuantizeTokens(backend, params, arrays, x, n);
  const FormatLayout layout = LayoutOf(params.front());
  for (size_t h = 0; h < params.size(); ++h) {
    for (int i = 0; i < layout.num_planes; ++i) {
      (*out)[h].plane[i] = q[h].Output(layout.plane(i).source).bytes;
    }
  }
}

// The decode steps over the whole tiles covering the run; its rows are kept, then times n^.
void DecodeQuantized(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                     size_t n, float* y) {
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t tile = static_cast<size_t>(p.tile_tokens());
  const size_t offset = static_cast<size_t>(rows.tile_offset);
  const size_t covered = (offset + n + tile - 1) / tile * tile;
  const FormatLayout layout = LayoutOf(p);
  const auto plane = [&](const char* source) -> const void* {
    for (int i = 0; i < layout.num_planes; ++i) {
      if (std::strcmp(layout.plane(i).source, source) == 0) return rows.plane[i];
    }
    return nullptr;
  };
  // A run of whole rows (every per-token format) decodes straight into y; a run inside tiles
  // decodes the covering tiles aside and keeps its rows.
  const bool whole = offset == 0 && covered == n;
  std::vector<float> decoded(whole ? 0 : covered * d);
  float* out = whole ? y : decoded.data();
  std::vector<std::pair<std::string, Tensor>> scratch;
  const FilledHeadArrays head(p, rows.heads);
  for (StageId step : CodecSteps(p.format, CodecPass::kDecode)) {
    RunCodecStep(backend, p, head.view(), step, nullptr, out, covered, &scratch, plane);
  }
  if (!whole) std::memcpy(y, decoded.data() + offset * d, n * d * sizeof(float));
  if (p.norm) backend.write.denorm(y, static_cast<const uint16_t*>(plane("norm")), n, p);
}

// A format with a codec runs its steps; bf16, the one without, stores rounded rows.
bool HasCodec(Format format) { return !CodecSteps(format, CodecPass::kEncode).empty(); }

}  // namespace

std::vector<EncodedRows> EncodeTokens(const Backend& backend,
                                      const std::vector<WriteParams>& params,
                                      const std::vector<const float*>& rotations,
                                      const float* x, size_t n) {
  return EncodeTokens(backend, params, RotationsOnly(rotations), x, n);
}

std::vector<EncodedRows> EncodeTokens(const Backend& backend,
                                      const std::vector<WriteParams>& params,
                                      const std::vector<HeadArrays>& arrays, const float* x,
                                      size_t n) {
  KVQ_CHECK(!params.empty() && arrays.size() == params.size(), kInvalidArgument,
            "the write path of ", params.size(), " KV heads got ", arrays.size(),
            " heads' rotations and arrays");
  for (const WriteParams& p : params) p.Validate();
  const WriteParams& p0 = params.front();
  const size_t tile = static_cast<size_t>(p0.tile_tokens());
  KVQ_CHECK(n % tile == 0, kInvalidArgument, "format '", FormatName(p0.format),
            "' stores tiles of ", tile, " tokens; ", n, " rows is not a whole number of tiles");
  std::vector<EncodedRows> out(params.size());
  for (EncodedRows& e : out) e.rows = n;
  (HasCodec(p0.format) ? EncodeQuantized : EncodeBf16)(backend, params, arrays, x, n, &out);
  return out;
}

EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                       const float* x, size_t n) {
  p.Validate();
  KVQ_CHECK(!p.norm || p.norm_heads == 1, kInvalidArgument, "a norm over ", p.norm_heads,
            " KV heads needs every head's rows (EncodeTokens)");
  HeadArrays head;
  head.rotation = rotation;
  return EncodeRows(backend, p, head, x, n);
}

EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const HeadArrays& head,
                       const float* x, size_t n) {
  p.Validate();
  KVQ_CHECK(!p.norm || p.norm_heads == 1, kInvalidArgument, "a norm over ", p.norm_heads,
            " KV heads needs every head's rows (EncodeTokens)");
  return std::move(EncodeTokens(backend, {p}, std::vector<HeadArrays>{head}, x, n).front());
}

void DecodeRows(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                size_t n, float* y) {
  if (n == 0) return;
  (HasCodec(p.format) ? DecodeQuantized : DecodeBf16)(backend, p, rows, n, y);
}

}  // namespace kvq::cpu
