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

// Any supported affine_token write path: d in {64, 128, 256}, G <= d, b in {2, 4}, a clip ratio
// from the grid or (0, 1], identity / dense / full or block FWHT, with or without P_br.
rc::Gen<WriteParams> ArbitraryWriteParams();

// A small paged cache: Hkv 1..3, g = Hq/Hkv 1..4, S0 0..20, W 1..40, F 1..8, P 16..64, key and
// value write paths of one d (widths may differ); one in eight is the bf16 cache.
rc::Gen<CacheParams> ArbitraryCacheParams();

}  // namespace kvq::testbed
