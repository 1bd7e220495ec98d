// The decode kernel's loop over INT-b history pages with QK^T on the int8 tensor cores
// (QuantInt8Loop, the plan's loop for at most 4 query heads per block).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_quant_rows.cuh"
#include "attention_skeleton.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"

namespace kvq::gpu::attention::detail {

// ------------------------------------------------------------------------------------------
// INT-b history with QK^T on the integer tensor cores (QuantLoop::kInt8Qk; at most 4
// query heads per block).
//
// QK^T: mma.sync m16n8k32, A = code bytes as u8, B = the query as int8 digits, int32
// accumulators (exact). A k-step of 32 takes one field of 32 code bytes straight from the
// packed words with one mask: INT2 fields 0 and 1 as q (field 1 from the word shifted by 2),
// fields 2 and 3 as 16 q; INT4 field 0 as q, field 1 as 16 q ("class" 0 and 1). On the
// channels of K group g, the query of head h is q~ ~ sq * Q with Q = round(q~ / sq),
// sq = max over the group of |q~_h| / 32512 (so |Q| <= 127 * 256), and Q = 256 * hi + lo with
// int8 digits hi, lo: column 2h of the MMA carries hi, column 2h + 1 lo, so a thread
// (lane % 4 = h) ends up with both digit sums of head h for its two rows and adds them exactly:
// sum_c code_c * Q_c. Per (token, group) the fp32 epilogue is
// s = scale * sq * sum + min * sum_c sq * Q_c. Logits keep ~15 significant bits of the query
// relative to the largest channel of each group (the bf16 loops: ~16 bits per channel); the
// tolerance the tests hold is unchanged.
//
// PV is the bf16 loop's (A = V^T codes, exact), but the hi and lo parts of p * scale ride in
// columns 2h and 2h + 1, so a thread's softmax covers one head for two rows and the two columns
// add up in-thread at the end of the split.

// mma.sync m16n8k32, u8 x s8 -> s32.
__device__ __forceinline__ void MmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Field f of the four code bytes of a word as u8 16^kClass * q: one mask of the word (w) or of
// the word shifted right by 2 (w2, INT2 odd fields).
template <int BITS, int FIELD>
struct CodeByteField {
  static constexpr int kClass = BITS == 2 ? FIELD / 2 : FIELD;
  static constexpr bool kShifted = BITS == 2 && (FIELD & 1);
  static constexpr uint32_t kMask =
      (BITS == 2 ? 0x03030303u : 0x0F0F0F0Fu) << (4 * kClass);
  __device__ __forceinline__ static uint32_t Get(uint32_t w, uint32_t w2) {
    return (kShifted ? w2 : w) & kMask;
  }
};

// The largest |Q| of the int8-digit query (127 * 256: the hi digit stays in int8).
inline constexpr float kQueryIntMax = 32512.0f;

// The int8 MMAs of a 16-token chunk: MMA i takes slots (word, field) s0 into a0 / a1 (rows gi,
// gi + 8) and s1 into a2 / a3. A thread holds NW words of a row (bytes [4 NW t4, 4 NW (t4 + 1))).
// NW >= 2: MMA (f, j) takes words 2j and 2j + 1 of field f; NW = 1 (d = 64 INT2): fields 2i and
// 2i + 1 of the one word (same group: G >= 32 = 2 RB, and the same class).
template <int D, int BITS>
struct Int8QkSlots {
  using Geo = QuantGeometry<D, BITS>;
  static constexpr int kFields = Geo::kFields;
  static constexpr int kWords = Geo::kQkWords;
  static constexpr int kMmas = kWords * kFields / 2;
  static_assert(kWords >= 2 || BITS == 2, "one word a thread only for INT2 (d = 64)");
  static constexpr int Word(int mma, int half) {
    return kWords >= 2 ? 2 * (mma % (kWords / 2)) + half : 0;
  }
  static constexpr int Field(int mma, int half) {
    return kWords >= 2 ? mma / (kWords / 2) : 2 * mma + half;
  }
  // Channel of byte i (0..3) of slot `half` of MMA `mma` for thread t4.
  __device__ __forceinline__ static int Channel(int mma, int half, int t4, int i) {
    return Field(mma, half) * Geo::kRowBytes + 4 * (t4 * kWords + Word(mma, half)) + i;
  }
};

// Packs x into bf16x2 {hi = bf16(x), lo = bf16(x - hi)} (low half: hi).
__device__ __forceinline__ uint32_t PackHiLo(float x) {
  const float hi = __bfloat162float(__float2bfloat16_rn(x));
  return BitsOf(__floats2bfloat162_rn(x, __fsub_rn(x, hi)));
}

// The split loop (attention_skeleton.cuh) with QK^T on the int8 tensor cores. KBITS, VBITS:
// the widths of the K codes (the int8 QK^T) and of the V codes (PV, as PvLoop's); FPGK, FPGV:
// fields per group of each side. Its softmax is its own: a lane holds head t4 for rows gi and
// gi + 8 (the MMA's column pair 2 t4, 2 t4 + 1 carries one head's two digits), not WarpState's
// two heads, so Scores and Probs are per (row a, row b) and the accumulators take the p * scale
// hi and lo parts in columns 2 t4 and 2 t4 + 1 until the epilogue adds them.
struct Int8Scores {
  float s[2];      // head t4's logits of rows a and b (exp2 domain; -inf past the end)
  bool valid[2];
};
struct Int8Probs {
  float p[2];
};
template <int D, int KBITS, int VBITS, int FPGK, int FPGV>
struct QuantInt8Loop {
  using Stage = QuantStage<D, KBITS, VBITS>;
  using Geo = typename Stage::KeyRow;
  using VGeo = typename Stage::ValueRow;
  using Slots = Int8QkSlots<D, KBITS>;
  using Scores = Int8Scores;
  using Probs = Int8Probs;
  static constexpr int kTileStep = 1;
  static constexpr int F = Geo::kFields;
  static constexpr int FV = VGeo::kFields;
  static constexpr int RB = Geo::kRowBytes;
  static constexpr int RBV = VGeo::kRowBytes;
  static constexpr int NW = Geo::kQkWords;
  static constexpr int NGK = F / FPGK;
  static constexpr int NGV = FV / FPGV;
  static constexpr int G = FPGK * RB;  // channels of a K group: [g G, (g + 1) G)
  static_assert(FPGK >= 1 && FPGV >= 1 && F % FPGK == 0 && FV % FPGV == 0, "fields per group");
  static_assert(NW >= 2 || FPGK >= 2, "d = 64: an MMA's two fields share a group");

  const DecodeKernelParams& p;
  int begin, end;
  int lane, warp, gi, t4;
  QuantTilePipeline<Stage> pipe;
  int n_tiles;
  float* q_s;
  uint32_t bq[Slots::kMmas][2];
  float sqg[NGK], qsg[NGK];
  // Online softmax of head t4 over rows (gi, gi + 8); acc columns 2 t4 (hi part of p * scale)
  // and 2 t4 + 1 (lo part), rows as the PV channel map says.
  float acc[D / 16][4];
  float m_run, l_run;
  float min_sum[NGV];
  int row_a, row_b;
  int vrow[4];

  __device__ __forceinline__ explicit QuantInt8Loop(const SplitArgs& a)
      : p(a.p), begin(a.begin), end(a.end), pipe(a.p, a.smem, a.kvh, a.b, a.begin, a.end) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    gi = lane >> 2;
    t4 = lane & 3;
    n_tiles = pipe.n_tiles;
    q_s = reinterpret_cast<float*>(a.smem + Stage::kQueryOffset);
    pipe.Start(Stage::kStages - 1);
  }

  // Per head h and K group g the scale sq = max|q~| / kQueryIntMax over the group's channels
  // (a group's sum has its own epilogue, so its query needs no common scale with the others);
  // the query as int8 digits in registers; every warp for itself, after the one barrier of
  // LoadRotatedQueries.
  __device__ __forceinline__ void FoldQuery(const SplitArgs& a) {
    LoadRotatedQueries<D>(p, a.b, a.head0, q_s);
    // A lane keeps the inverse scales of head gi >> 1 (its B column) and the scales of head t4
    // (its epilogue).
    const int hb = gi >> 1;
    float inv_b[NGK], inv_t[NGK], sq_t[NGK];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
#pragma unroll
      for (int g = 0; g < NGK; ++g) {
        float m = 0.0f;
#pragma unroll
        for (int c = lane; c < G; c += 32) m = fmaxf(m, fabsf(q_s[h * D + g * G + c]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float inv = m > 0.0f ? kQueryIntMax / m : 0.0f;
        if (h == hb) inv_b[g] = inv;
        if (h == t4) {
          inv_t[g] = inv;
          sq_t[g] = m / kQueryIntMax;
        }
      }
    }
    // Q of head h, channel c (the same rounding wherever it is formed).
    auto q_int = [&](int h, float inv, int c) { return __float2int_rn(q_s[h * D + c] * inv); };
    // B fragments: column gi = digit (gi & 1: 0 hi, 1 lo) of head gi >> 1.
    {
      const bool lo_digit = gi & 1;
#pragma unroll
      for (int m = 0; m < Slots::kMmas; ++m) {
        const float inv = inv_b[Slots::Field(m, 0) / FPGK];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t word = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int qi = q_int(hb, inv, Slots::Channel(m, half, t4, i));
            const int lo = ((qi + 128) & 255) - 128;
            const int digit = lo_digit ? lo : (qi - lo) >> 8;
            word |= (static_cast<uint32_t>(digit) & 0xffu) << (8 * i);
          }
          bq[m][half] = word;
        }
      }
    }
    // Epilogue factors of head t4 per K group, with the logit scale (exp2 domain) folded in:
    // sqg = sq * 16^-class (classes mixed in a group: the sum is formed as 16 * class 0 +
    // class 1), qsg = sum over the group's channels of sq * Q.
    const float fac = p.logit_scale_log2;
    {
      int qsum[NGK];
#pragma unroll
      for (int g = 0; g < NGK; ++g) qsum[g] = 0;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        // Channel gi + 8 i lies in group 8 i / G (G is a multiple of 16).
        qsum[(8 * i) / G] += q_int(t4, inv_t[(8 * i) / G], gi + 8 * i);
      }
      StaticFor<NGK>([&](auto gc) {
        constexpr int g = decltype(gc)::value;
        constexpr int kLo = CodeByteField<KBITS, g * FPGK>::kClass;
        constexpr int kHi = CodeByteField<KBITS, g * FPGK + FPGK - 1>::kClass;
        constexpr float kUnscale = kHi == 0 ? 1.0f : 1.0f / 16.0f;  // kLo != kHi: 16 c0 + c1
        static_assert(kLo == kHi || (kLo == 0 && kHi == 1), "classes of a group");
        int s = qsum[g];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        sqg[g] = sq_t[g] * kUnscale * fac;
        qsg[g] = static_cast<float>(s) * sq_t[g] * fac;
      });
    }
#pragma unroll
    for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    m_run = -INFINITY;
    l_run = 0.0f;
#pragma unroll
    for (int g = 0; g < NGV; ++g) min_sum[g] = 0.0f;
    row_a = ChunkRow(gi);
    row_b = ChunkRow(gi + 8);
    vrow[0] = ChunkRow(2 * t4);
    vrow[1] = ChunkRow(2 * t4 + 1);
    vrow[2] = ChunkRow(2 * t4 + 8);
    vrow[3] = ChunkRow(2 * t4 + 9);
  }

  // The warp's 16 rows of the tile start at begin + 64 tile + 16 warp.
  __device__ __forceinline__ bool HasRows(int tile) const {
    return begin + tile * kTileTokens + warp * kChunkTokens < end;
  }

  __device__ __forceinline__ int FirstTile() const { return 0; }

  __device__ __forceinline__ const unsigned char* LoadTile(int tile) const {
    pipe.WaitFull(tile);
    return pipe.Stage(tile);
  }

  // QK^T on the int8 tensor cores, then per group s = scale * sq * sum + min * sum sq * Q.
  __device__ __forceinline__ void Logits(const unsigned char* stage, int tile, Scores& sc) const {
    const int chunk_first = begin + tile * kTileTokens + warp * kChunkTokens;
    sc.valid[0] = chunk_first + row_a < end;
    sc.valid[1] = chunk_first + row_b < end;
    float s_a = 0.0f, s_b = 0.0f;
    uint32_t ka[NW], kb[NW], ka2[NW], kb2[NW];
    const unsigned char* kc = stage + warp * kChunkTokens * RB;
    LoadWords<NW>(kc + row_a * RB + t4 * NW * 4, ka);
    LoadWords<NW>(kc + row_b * RB + t4 * NW * 4, kb);
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      ka2[w] = ka[w] >> 2;
      kb2[w] = kb[w] >> 2;
    }
    const unsigned char* meta = stage + Stage::kMetaOffset + warp * kChunkTokens * NGK * 2;
    uint32_t sa[(NGK + 1) / 2], sb[(NGK + 1) / 2], ma[(NGK + 1) / 2], mb[(NGK + 1) / 2];
    LoadBf16Row<NGK>(meta + row_a * NGK * 2, sa);
    LoadBf16Row<NGK>(meta + row_b * NGK * 2, sb);
    LoadBf16Row<NGK>(meta + Stage::kMetaBytes + row_a * NGK * 2, ma);
    LoadBf16Row<NGK>(meta + Stage::kMetaBytes + row_b * NGK * 2, mb);
    // c[g][class]: the group's digit sums per class.
    int c[NGK][2][4];
#pragma unroll
    for (int g = 0; g < NGK; ++g) {
#pragma unroll
      for (int k = 0; k < 2; ++k) c[g][k][0] = c[g][k][1] = c[g][k][2] = c[g][k][3] = 0;
    }
    StaticFor<Slots::kMmas>([&](auto mc) {
      constexpr int m = decltype(mc)::value;
      constexpr int w0 = Slots::Word(m, 0), w1 = Slots::Word(m, 1);
      using F0 = CodeByteField<KBITS, Slots::Field(m, 0)>;
      using F1 = CodeByteField<KBITS, Slots::Field(m, 1)>;
      static_assert(F0::kClass == F1::kClass, "an MMA's slots share a class");
      constexpr int g = Slots::Field(m, 0) / FPGK;
      MmaU8S8(c[g][F0::kClass], F0::Get(ka[w0], ka2[w0]), F0::Get(kb[w0], kb2[w0]),
              F1::Get(ka[w1], ka2[w1]), F1::Get(kb[w1], kb2[w1]), bq[m][0], bq[m][1]);
    });
    StaticFor<NGK>([&](auto gc) {
      constexpr int g = decltype(gc)::value;
      constexpr int kLo = CodeByteField<KBITS, g * FPGK>::kClass;
      constexpr int kHi = CodeByteField<KBITS, g * FPGK + FPGK - 1>::kClass;
      int v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = kLo == kHi ? c[g][kLo][i] : 16 * c[g][0][i] + c[g][1][i];
      // Columns 2 t4 (hi digit) and 2 t4 + 1 (lo digit) of head t4: sum_c code_c * Q_c.
      const float dot_a = static_cast<float>(v[0] * 256 + v[1]);
      const float dot_b = static_cast<float>(v[2] * 256 + v[3]);
      s_a = fmaf(Bf16OfRow<g>(sa), dot_a * sqg[g], fmaf(Bf16OfRow<g>(ma), qsg[g], s_a));
      s_b = fmaf(Bf16OfRow<g>(sb), dot_b * sqg[g], fmaf(Bf16OfRow<g>(mb), qsg[g], s_b));
    });
    sc.s[0] = sc.valid[0] ? s_a : -INFINITY;
    sc.s[1] = sc.valid[1] ? s_b : -INFINITY;
  }

  // Online softmax (head t4, rows a and b). Lazy max as in WarpState::UpdateN (m = -inf before
  // the first chunk): the reduction runs only when some lane's logit is above its head's
  // max + the threshold.
  __device__ __forceinline__ void Softmax(const Scores& sc, Probs& pr) {
    const float sl_a = sc.s[0];
    const float sl_b = sc.s[1];
    float mx = fmaxf(sl_a, sl_b);
    float alpha = 1.0f;
    if (__any_sync(0xffffffffu, mx > m_run + kRescaleThresholdLog2)) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = mx > m_run + kRescaleThresholdLog2 ? mx : m_run;
      alpha = Exp2(m_run - m_new);
      m_run = m_new;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        acc[i][0] *= alpha;
        acc[i][1] *= alpha;
        acc[i][2] *= alpha;
        acc[i][3] *= alpha;
      }
#pragma unroll
      for (int g = 0; g < NGV; ++g) min_sum[g] *= alpha;
    }
    pr.p[0] = Exp2(sl_a - m_run);
    pr.p[1] = Exp2(sl_b - m_run);
    l_run = fmaf(l_run, alpha, pr.p[0] + pr.p[1]);
  }

  // PV: A = code (bf16, exact), B = p * scale hi | lo; min term on the side.
  __device__ __forceinline__ void Values(const unsigned char* stage, int, const Scores& sc,
                                         const Probs& pr) {
    const bool va = sc.valid[0], vb = sc.valid[1];
    const float pa = pr.p[0], pb = pr.p[1];
    const unsigned char* vc = stage + Stage::kValueCodesOffset + warp * kChunkTokens * RBV;
    const unsigned char* vmeta = stage + Stage::kValueMetaOffset + warp * kChunkTokens * NGV * 2;
    const PvCodes<D, VBITS> codes(vc, vrow, gi);
    // B = p * scale * 2^64 against the in-place (subnormal) code fields.
    const float pa_v = pa * kPvOperandScale, pb_v = pb * kPvOperandScale;
    uint32_t vsa[(NGV + 1) / 2], vsb[(NGV + 1) / 2], vma[(NGV + 1) / 2], vmb[(NGV + 1) / 2];
    LoadBf16Row<NGV>(vmeta + row_a * NGV * 2, vsa);
    LoadBf16Row<NGV>(vmeta + row_b * NGV * 2, vsb);
    LoadBf16Row<NGV>(vmeta + Stage::kMetaBytes + row_a * NGV * 2, vma);
    LoadBf16Row<NGV>(vmeta + Stage::kMetaBytes + row_b * NGV * 2, vmb);
    uint32_t b0 = 0, b1 = 0;
    StaticFor<FV>([&](auto fc) {
      constexpr int f = decltype(fc)::value;
      if constexpr (f % FPGV == 0) {
        constexpr int g = f / FPGV;
        // Select, not multiply: rows past the end may hold any bits.
        const float sfa = va ? Bf16OfRow<g>(vsa) : 0.0f;
        const float sfb = vb ? Bf16OfRow<g>(vsb) : 0.0f;
        const float mfa = va ? Bf16OfRow<g>(vma) : 0.0f;
        const float mfb = vb ? Bf16OfRow<g>(vmb) : 0.0f;
        b0 = Transpose8x8(PackHiLo(pa_v * sfa));
        b1 = Transpose8x8(PackHiLo(pb_v * sfb));
        min_sum[g] = fmaf(pa, mfa, fmaf(pb, mfb, min_sum[g]));
      }
#pragma unroll
      for (int jp = 0; jp < VGeo::kPvPairs; ++jp) {
        uint32_t a[4];
        codes.template A<f>(jp, a);
        MmaBf16(acc[f * VGeo::kPvPairs + jp], a[0], a[1], a[2], a[3], b0, b1);
      }
    });
  }

  __device__ __forceinline__ void ReleaseTile(int tile) const { pipe.Done(tile); }

  // Head t4's accumulator = column 2 t4 (hi part) + column 2 t4 + 1 (lo part); field f
  // accumulated 2^(f*b - 69) * sum p * scale * q (PvUnscale); then the min term of each field's
  // group. Then into the bf16 loops' layout (heads 2 t4', 2 t4' + 1 in lane t4' < 2) for
  // CombineAndStore.
  __device__ __forceinline__ void Epilogue(const SplitArgs& a) {
    float msum[NGV];
#pragma unroll
    for (int g = 0; g < NGV; ++g) msum[g] = SumOverRows(min_sum[g]);
    const int src0 = (lane & ~3) | ((2 * t4) & 3);
    const int src1 = src0 + 1;
    WarpState<D> st;
    StaticFor<FV>([&](auto fc) {
      constexpr int f = decltype(fc)::value;
      constexpr float kUnscale = PvUnscale<VBITS, f>();
#pragma unroll
      for (int jp = 0; jp < VGeo::kPvPairs; ++jp) {
        const int mt = f * VGeo::kPvPairs + jp;
        const float ra = (acc[mt][0] + acc[mt][1]) * kUnscale + msum[f / FPGV];
        const float rb = (acc[mt][2] + acc[mt][3]) * kUnscale + msum[f / FPGV];
        st.acc[mt][0] = __shfl_sync(0xffffffffu, ra, src0);
        st.acc[mt][1] = __shfl_sync(0xffffffffu, ra, src1);
        st.acc[mt][2] = __shfl_sync(0xffffffffu, rb, src0);
        st.acc[mt][3] = __shfl_sync(0xffffffffu, rb, src1);
      }
    });
    st.m[0] = __shfl_sync(0xffffffffu, m_run, src0);
    st.m[1] = __shfl_sync(0xffffffffu, m_run, src1);
    st.l[0] = __shfl_sync(0xffffffffu, l_run, src0);
    st.l[1] = __shfl_sync(0xffffffffu, l_run, src1);
    __syncthreads();
    const int g = gi;
    CombineAndStore<D>(
        p, st, [&](int mt, int upper) { return PvChannel<D, VBITS>(mt, upper, g); }, a.smem,
        a.b, a.head0, a.split);
  }
};

// The quantized history's split in loop LOOP (QuantInt8Loop or QuantRowsLoop) over KBITS-bit keys
// and VBITS-bit values, with FPGK = fpg_k and FPGV = fpg_v as compile-time values (fields per
// group of K and of V; the launcher admits only valid groups).
template <int D, int KBITS, int VBITS, QuantLoop LOOP, int FPGK, int FPGV = 1>
__device__ __forceinline__ void QuantSplitGroupedV(const DecodeKernelParams& p, unsigned char* smem,
                                                   int kvh, int head0, int b, int split,
                                                   int begin, int end, int fpg_v) {
  if constexpr (kFieldsPerGroupValid<D, VBITS, FPGV>) {
    if (fpg_v == FPGV) {
      const SplitArgs a{p, smem, kvh, head0, b, split, begin, end};
      if constexpr (LOOP == QuantLoop::kInt8Qk) {
        SplitLoop<QuantInt8Loop<D, KBITS, VBITS, FPGK, FPGV>>(a);
      } else {
        SplitLoop<QuantRowsLoop<D, KBITS, VBITS, LOOP == QuantLoop::kPacked, FPGK, FPGV>>(a);
      }
      return;
    }
  }
  if constexpr (FPGV < 4) {
    QuantSplitGroupedV<D, KBITS, VBITS, LOOP, FPGK, 2 * FPGV>(p, smem, kvh, head0, b, split,
                                                              begin, end, fpg_v);
  } else {
    __trap();  // unreachable: the launcher refuses other groups
  }
}
template <int D, int KBITS, int VBITS, QuantLoop LOOP, int FPGK = 1>
__device__ __forceinline__ void QuantSplitGrouped(const DecodeKernelParams& p, unsigned char* smem,
                                                  int kvh, int head0, int b, int split, int begin,
                                                  int end) {
  constexpr int RBK = QuantGeometry<D, KBITS>::kRowBytes;
  constexpr int RBV = QuantGeometry<D, VBITS>::kRowBytes;
  if constexpr (kFieldsPerGroupValid<D, KBITS, FPGK>) {
    if (p.key_group == FPGK * RBK) {
      QuantSplitGroupedV<D, KBITS, VBITS, LOOP, FPGK>(p, smem, kvh, head0, b, split, begin, end,
                                                      p.value_group / RBV);
      return;
    }
  }
  if constexpr (FPGK < 4) {
    QuantSplitGrouped<D, KBITS, VBITS, LOOP, 2 * FPGK>(p, smem, kvh, head0, b, split, begin, end);
  } else {
    __trap();  // unreachable: the launcher refuses other groups
  }
}

// affine_token keys: the int8 QK loop (QuantInt8Loop) or the bf16-MMA loops (QuantRowsLoop) over
// per-token values.
template <>
struct HistoryLoop<Format::kAffineToken> {
  template <int D, class K, class V, QuantLoop LOOP>
  __device__ __forceinline__ static void Split(const DecodeKernelParams& p, unsigned char* smem,
                                               int kvh, int head0, int b, int split, int begin,
                                               int end) {
    QuantSplitGrouped<D, K::kBits, V::kBits, LOOP>(p, smem, kvh, head0, b, split, begin, end);
  }
  template <int D, class K, class V>
  static constexpr int SharedBytes() {
    return QuantStage<D, K::kBits, V::kBits>::kSharedBytes;
  }
};

}  // namespace kvq::gpu::attention::detail
