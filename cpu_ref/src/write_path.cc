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
    KVQ_CHECK(!StageApplies(stage, p) || HasStage(backend.write, stage.id), kUnsupported,
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

QuantizedRows QuantizeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                           const float* x, size_t n) {
  QuantizedRows out;
  KVQ_CHECK(p.format == Format::kAffineToken, kInvalidArgument, "QuantizeRows runs the ",
            "affine_token write path, not format '", FormatName(p.format), "'");
  CheckInputs(backend, p, rotation, x, n);
  const size_t d = static_cast<size_t>(p.head_dim);
  const size_t count = n * d;
  const size_t groups = static_cast<size_t>(p.num_groups());
  out.rows = n;
  out.rotated.resize(count);
  out.tau.resize(n);
  out.codes.resize(count);
  out.packed.resize(n * static_cast<size_t>(p.code_bytes()));
  out.scale.resize(n * groups);
  out.min.resize(n * groups);
  out.dequantized.resize(count);
  if (n == 0) return out;

  internal::RotateRows(backend, p, rotation, x, out.rotated.data(), n);
  // Magnitudes up to 2^126 keep hi - lo, the scale and every dequantized value finite.
  for (size_t row = 0; row < n; ++row) {
    for (size_t col = 0; col < d; ++col) {
      const float v = out.rotated[row * d + col];
      KVQ_CHECK(std::fabs(v) <= kMaxRotatedAbs, kNonFinite, "rotated value ", v, " at row ", row,
                ", column ", col, " exceeds the supported magnitude 2^126");
    }
  }
  std::vector<float> clipped(out.rotated);
  backend.write.clip(clipped.data(), out.tau.data(), n, p);
  backend.write.quantize(clipped.data(), out.codes.data(), out.scale.data(), out.min.data(), n,
                         p);
  backend.write.pack(out.codes.data(), out.packed.data(), n, p);
  backend.write.dequantize(out.codes.data(), out.scale.data(), out.min.data(),
                           out.dequantized.data(), n, p);
  return out;
}

namespace {

// ---- The codec of each format (formats.inc): Encode<Name> and Decode<Name> ----

void EncodeBf16(const Backend&, const WriteParams& p, const float*, const float* x, size_t n,
                EncodedRows* out) {
  CheckedElements(n, p.head_dim);
  if (n == 0) return;
  KVQ_CHECK(x != nullptr, kInvalidArgument, "input rows are null (", n, " rows)");
  CheckFinite(x, n, p.head_dim, "input");
  const size_t count = n * static_cast<size_t>(p.head_dim);
  out->plane[0].resize(count * sizeof(uint16_t));
  for (size_t i = 0; i < count; ++i) {
    const uint16_t bits = Bf16FromF32(x[i]);
    KVQ_CHECK(!IsNonFinite(F32FromBf16(bits)), kNonFinite, "value ", x[i], " at row ",
              i / static_cast<size_t>(p.head_dim), ", column ", i % static_cast<size_t>(p.head_dim),
              " rounds to inf in bf16");
    std::memcpy(out->plane[0].data() + i * sizeof(uint16_t), &bits, sizeof bits);
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

void EncodeAffineToken(const Backend& backend, const WriteParams& p, const float* rotation,
                       const float* x, size_t n, EncodedRows* out) {
  QuantizedRows q = QuantizeRows(backend, p, rotation, x, n);
  out->plane[0] = std::move(q.packed);
  for (int i = 1; i <= 2; ++i) {
    const std::vector<uint16_t>& bits = i == 1 ? q.scale : q.min;
    out->plane[i].resize(bits.size() * sizeof(uint16_t));
    if (!bits.empty()) std::memcpy(out->plane[i].data(), bits.data(), out->plane[i].size());
  }
}

void DecodeAffineToken(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                       size_t n, float* y) {
  std::vector<uint8_t> codes(n * static_cast<size_t>(p.head_dim));
  backend.write.unpack(rows.plane[0], codes.data(), n, p);
  backend.write.dequantize(codes.data(), reinterpret_cast<const uint16_t*>(rows.plane[1]),
                           reinterpret_cast<const uint16_t*>(rows.plane[2]), y, n, p);
}

struct Codec {
  void (*encode)(const Backend&, const WriteParams&, const float*, const float*, size_t,
                 EncodedRows*);
  void (*decode)(const Backend&, const WriteParams&, const HistoryRunView&, size_t, float*);
};

Codec CodecOf(Format format) {
  switch (format) {
#define KVQ_FORMAT(id, Name, tile_tokens, summary) \
  case Format::k##Name:                            \
    return {&Encode##Name, &Decode##Name};
#include "kvq/common/formats.inc"
#undef KVQ_FORMAT
  }
  KVQ_CHECK(false, kInvalidArgument, "format ", static_cast<int>(format), " has no codec");
  return {};
}

}  // namespace

EncodedRows EncodeRows(const Backend& backend, const WriteParams& p, const float* rotation,
                       const float* x, size_t n) {
  p.Validate();
  const FormatLayout layout = LayoutOf(p);
  KVQ_CHECK(n % static_cast<size_t>(layout.tile_tokens) == 0, kInvalidArgument, "format '",
            FormatName(p.format), "' stores tiles of ", layout.tile_tokens, " tokens; ", n,
            " rows is not a whole number of tiles");
  EncodedRows out;
  out.rows = n;
  CodecOf(p.format).encode(backend, p, rotation, x, n, &out);
  return out;
}

void DecodeRows(const Backend& backend, const WriteParams& p, const HistoryRunView& rows,
                size_t n, float* y) {
  if (n == 0) return;
  CodecOf(p.format).decode(backend, p, rows, n, y);
}

}  // namespace kvq::cpu
