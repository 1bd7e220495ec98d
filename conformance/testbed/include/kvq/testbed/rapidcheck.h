// RapidCheck generators of kvq's parameter structs, for the properties in fuzz/. Every value
// they produce passes Validate(); shrinking moves towards the defaults and small sizes.
// Replay a failure with RC_PARAMS="seed=<seed RapidCheck printed>".
#pragma once

#include <rapidcheck.h>

#include "kvq/common/params.h"

namespace kvq::testbed {

// Any supported affine_token quantizer with no rotation: d in {64, 128, 256}, G <= d, b in
// {2, 4}, a clip ratio from the grid or (0, 1].
rc::Gen<WriteParams> ArbitraryQuantizerParams();

// Any supported affine_token write path: d in {64, 128, 256}, G <= d (G = d included), b in
// {2, 4}, a clip ratio from the grid or (0, 1], identity / dense / full or block FWHT, with or
// without P_br.
rc::Gen<WriteParams> ArbitraryWriteParams();

// Any supported affine_tile write path (the transforms as above, G_k in {32, 64, 128}), with
// or without a norm; the norm spans 1 or `heads` KV heads.
rc::Gen<WriteParams> ArbitraryTileParams(int heads = 1);

// A small paged cache: Hkv 1..3, g = Hq/Hkv 1..4, S0 0..20, W 0..40, F 1..8, P 16..64, key and
// value write paths of one d (widths may differ); one in three has tiled keys (G_k 32 or 64, a
// norm per head or per token, sometimes tiled values too) with F and P whole tiles (F up to
// 128, P up to 128); one in eight is the bf16 cache.
rc::Gen<CacheParams> ArbitraryCacheParams();

}  // namespace kvq::testbed
