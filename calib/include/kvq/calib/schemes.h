// The scheme catalogue: every KV-cache quantization scheme kvq evaluates, one entry per name,
// each turning (activations, calibration, layer, options) into what a kvq::cpu::PagedKVCache
// of that layer needs: CacheParams plus per-KV-head rotation matrices and clip ratios.
//
// The OSCAR ablations (seeds/000 table 4) change ONE thing relative to `oscar`: the rotation.
// They keep the calibration's clip ratios (selected for R = U·H·P_br), so a difference in the
// metrics is the rotation's doing alone (docs/accuracy.md discusses what that means).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/common/params.h"

namespace kvq::calib {

// The knobs every scheme shares. bits applies to every quantized scheme except saw_int4,
// which is INT4 by definition.
struct SchemeOptions {
  int group = 64;     // G
  int bits = 2;       // b
  int sink = 64;      // S0 (BF16 sink tokens)
  int recent = 256;   // W (BF16 recent window)
  int page = 64;      // P (history tokens per page)
  uint64_t seed = 0;  // random_orthogonal's seed
  int saw_block = 128;  // saw_int4's FWHT block (16..d, a power of two; clamped to d)
};

struct SchemeInfo {
  const char* name;
  const char* description;  // one line, for --help and reports
  bool needs_calibration;   // reads R, U or ρ from the calibration
};

// Every scheme, in the order tables list them: bf16, naive, hadamard, hadamard_bitrev,
// clip_only, random_orthogonal, raw_target, eigenbasis_only, oscar_no_hadamard,
// oscar_no_bitrev, oscar, saw_int4. (KIVI's per-channel keys are not here: they need a
// quantizer grouped along tokens, which the cache layout does not have.)
const std::vector<SchemeInfo>& Schemes();
// Throws kvq::Error(kInvalidArgument) naming `name` and listing every valid name.
const SchemeInfo& SchemeByName(const std::string& name);
// "all" or a comma-separated list of names (each checked as SchemeByName does; duplicates and
// empty entries rejected naming them). Keeps the order given.
std::vector<std::string> ParseSchemeList(const std::string& list);

// Whether the scheme's catalogue entry clips with the calibration's ratios (clip_only and the
// rotation ablations: ρ selected by kvq calibrate for OSCAR's R; oscar itself). naive,
// hadamard, hadamard_bitrev, saw_int4 and bf16 never clip. The fair-clip policy of kvq ppl
// (fair_clip.h) re-chooses ρ for exactly these. Throws as SchemeByName does.
bool SchemeClipsWithCalibration(const std::string& name);

// One layer of one scheme: what PagedKVCache's constructor takes.
struct LayerScheme {
  CacheParams params;                         // Hkv, Hq, d from the activations
  std::vector<float> rotation_k, rotation_v;  // [Hkv, d, d] fp32 row-major when dense; else empty
  std::vector<float> clip_k, clip_v;          // [Hkv] ρ per KV head
};

// Builds scheme `name` for layer `layer`. `cal` may be null only for schemes that do not need
// a calibration. Throws kvq::Error: unknown name (kInvalidArgument, listing the names), layer
// out of range, a calibration missing where needed or whose shape (layers, Hkv, d) differs from
// the activations (kShapeMismatch naming both), options the cache rejects (group, bits, sink,
// recent, page; kInvalidArgument from CacheParams::Validate), a saw_block that is not a power
// of two in [16, 256].
LayerScheme BuildLayerScheme(const std::string& name, const Activations& acts,
                             const Calibration* cal, int layer, const SchemeOptions& options);

// The same scheme restricted to one KV head (Hkv = 1, Hq = the head's g query heads): the
// matrices and clip ratio of `kv_head` only. Throws kInvalidArgument for a head out of range.
LayerScheme SliceKvHead(const LayerScheme& scheme, int kv_head);

}  // namespace kvq::calib
