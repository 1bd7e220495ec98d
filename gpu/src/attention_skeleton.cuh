// The one loop every split of the decode kernel runs (history of any format, the bf16 window,
// the bf16 cache's pages), with the format's hooks: FlashInfer's variant hooks
// (include/flashinfer/attention/variants.cuh) taken to history formats. A split reads tokens
// [begin, end) of one sequence and KV head for the block's query heads and leaves the block's
// partial (m, l, acc: attention_split_state.cuh).
//
// A split loop L is a struct; SplitLoop below calls its hooks in this order:
//   L(a)                  load-tile setup: the copy pipeline (the split's page ids, barriers)
//                         and the first tiles in flight where no barrier must come first; a
//                         page copy from the tile FirstAppendedTile names on waits for a
//                         DecodeStep's append first
//   FoldQuery(a)          the query in the form the key operands take: bf16 / fp16 hi + lo MMA
//                         fragments, int8 digits with per-group scales, or a shared-memory copy
//                         a key tile's scales are folded into. It waits for the rotated
//                         queries (WaitForQueries) and ends with what the loop must
//                         publish to every warp (a barrier, which also publishes the page ids
//                         where the loop loads them here), so no hook after it needs one
//                         before the first tile.
//   FirstTile(), kTileStep   the pipeline tiles this warp reads (every tile, or one in
//                         kTileStep from its group's first)
//   LoadTile(tile)        waits until the tile's stage is in shared memory (and keeps the
//                         pipeline full); returns the stage
//   HasRows(tile)         whether the warp holds rows of the tile (none past `end`: then
//                         nothing below runs for it)
//   Logits(stage, tile, s)   QK^T of the warp's rows of the tile with the format's epilogue
//                         (affine scale and min per group, x norm, x s^_K, x the softmax scale
//                         in the exp2 domain), -inf where a row is past `end`
//   Softmax(s, pr)        the online-softmax update: probabilities pr, the accumulators
//                         rescaled where the running max moved (WarpSoftmax for the loops whose
//                         logits are in the accumulator layout; the int8 loop keeps its own)
//   Values(stage, tile, s, pr)   PV of the warp's rows into the accumulators
//   ReleaseTile(tile)     the warp is done with the stage (the refill may reuse it)
//   Epilogue(a)           the accumulators unscaled (PV's operand scales, the V min terms,
//                         s^_V), the warps combined, the partial stored
// L::Scores (the logits) and L::Probs are the types the hooks exchange. A new history format is
// a loop struct of these hooks in its own header, a HistoryLoop specialization naming it and
// its rows in kvq/gpu/formats.h; this file and the kernel (attention_decode.cuh) do not change.
#pragma once

#include <cuda_runtime.h>

#include "attention_common.cuh"
#include "attention_split_state.cuh"
#include "kvq/gpu/attention_launch.h"

namespace kvq::gpu::attention::detail {

// Where a split lies: what every loop's constructor and FoldQuery / Epilogue take.
struct SplitArgs {
  const DecodeKernelParams& p;
  unsigned char* smem;  // the block's dynamic shared memory
  int kvh;              // KV head
  int head0;            // the block's first query head
  int b;                // sequence
  int split;            // blockIdx.z: the partial's index
  int begin, end;       // tokens [begin, end) of the split's segment (history or window)
  int n_sink = 0;       // the window: its first n_sink tokens are sink rows,
  int recent_begin = 0; // the rest the recent ring's tokens from recent_begin on
};

template <class L>
__device__ __forceinline__ void SplitLoop(const SplitArgs& a) {
  L loop(a);
  loop.FoldQuery(a);
  for (int tile = loop.FirstTile(); tile < loop.n_tiles; tile += L::kTileStep) {
    const unsigned char* stage = loop.LoadTile(tile);
    // One condition around the whole step, its scores local to it: deciding it inside Logits
    // (returning whether the warp has rows) leaves a second branch on that result and the
    // scores live across it, which costs ptxas up to ~200 bytes of spills at 128 registers.
    if (loop.HasRows(tile)) {
      typename L::Scores s;
      loop.Logits(stage, tile, s);
      typename L::Probs pr;
      loop.Softmax(s, pr);
      loop.Values(stage, tile, s, pr);
    }
    loop.ReleaseTile(tile);
  }
  loop.Epilogue(a);
}

// The logits of M 16-row chunks in the accumulator layout (rows gi, gi + 8 x heads 2 t4,
// 2 t4 + 1: WarpState's), exp2 domain, -inf past the end; valid[m]: rows gi, gi + 8 of chunk m
// hold tokens.
template <int M>
struct ChunkScores {
  float s[M][4];
  bool valid[M][2];
};
template <int M>
struct ChunkProbs {
  float p[M][4];
};

// The online softmax of the loops whose logits are in WarpState's layout: WarpState's update,
// and PV's own running sums (min terms) rescaled when the max moved (PV::Rescale; NoRescale
// when the values keep none).
struct NoRescale {
  __device__ __forceinline__ void Rescale(const float (&)[2]) {}
};
template <int D, int M, class PV>
__device__ __forceinline__ void WarpSoftmax(WarpState<D>& st, PV& pv, const ChunkScores<M>& s,
                                            ChunkProbs<M>& pr) {
  float alpha[2];
  if (st.template UpdateN<M>(s.s, pr.p, alpha)) pv.Rescale(alpha);  // alpha == 1 where kept
}

}  // namespace kvq::gpu::attention::detail
