// Fair ablations (issue 16, item 4): where a scheme's clip ratios come from, and the rule that
// gives every scheme its own.
//
// kvq calibrate selects OSCAR's ρ for OSCAR's R (clip_search.h: per layer, the grid point
// minimising Σ_heads Σ_rows eᵀ·(RᵀCR)·e over the calibration rows, C = C_Q for keys and the
// value target for values). The catalogue's ablations reuse those ratios, so a rotation that
// spreads outliers differently is judged with a clip chosen for another rotation (the pilot:
// eigenbasis_only goes from PPL +5–9 % with its own ρ to ×7 with OSCAR's). Here every scheme
// that clips chooses ρ for its OWN rotation by that same rule, on the same rows and targets;
// reusing OSCAR's ratios is an explicit, labelled choice (`NAME@oscar`).
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvq/calib/activations.h"
#include "kvq/calib/calibrate.h"
#include "kvq/calib/calibration_file.h"
#include "kvq/calib/schemes.h"
#include "kvq/cpu_ref/kernels.h"

namespace kvq::calib {

enum class ClipChoice {
  kCatalogue,  // the default: kOwn for schemes that clip (SchemeClipsWithCalibration), kNone else
  kOwn,        // ρ chosen for the scheme's own rotation on the calibration tokens
  kOscar,      // the calibration file's ratios (OSCAR's), as the catalogue's ablations have them
  kNone,       // ρ = 1
};
const char* ClipChoiceName(ClipChoice choice);  // "catalogue", "own", "oscar", "none"

// One row of an evaluation: a catalogue scheme and where its clip ratios come from.
struct SchemeVariant {
  std::string scheme;  // catalogue name
  ClipChoice clip = ClipChoice::kCatalogue;
  std::string label;   // "oscar", "eigenbasis_only@oscar", "hadamard@own"

  // The clip source in effect (kCatalogue resolved).
  ClipChoice Resolved() const;
};

// "all" or a comma-separated list of NAME or NAME@own / NAME@oscar / NAME@none. A plain NAME
// is kCatalogue; with `with_oscar_clip`, every plain NAME that clips by default is followed by
// NAME@oscar (the table then shows both). Throws kInvalidArgument naming an unknown scheme, an
// unknown suffix or a repeated label.
std::vector<SchemeVariant> ParseSchemeVariants(const std::string& list, bool with_oscar_clip);

// What calibrate weights the clip error with, per (layer, KV head), and the clip rows.
struct ClipTargets {
  int num_layers = 0, num_kv_heads = 0;
  std::vector<Eigen::MatrixXd> query;  // [L·Hkv] C_Q (QueryCovariance)
  std::vector<Eigen::MatrixXd> value;  // [L·Hkv] the value target (ValueTarget)
  std::vector<std::pair<int64_t, int64_t>> rows;  // RowsAfterSink(calib_tokens, sink)
};

// The targets of kvq calibrate over tokens [0, calib_tokens) of `acts` (segments respected),
// computed with the same functions (covariance.h), (layer, KV head) units on `threads` threads.
ClipTargets ComputeClipTargets(const Activations& acts, ValueTarget value_target, int sink,
                               int threads);

// The map p's write path applies to a row, as a d×d fp32 matrix (row i = e_i rotated, P_br
// included, no clip): the stored matrix itself for a dense rotation (rotating the identity's
// rows reproduces it exactly), the FWHT and bit reversal otherwise.
std::vector<float> EffectiveRotation(const WriteParams& p, const float* dense,
                                     const cpu::Backend& backend);

// ρ_K, ρ_V of layer `layer` for `scheme` (that layer's LayerScheme): its own rotation (dense
// matrices, FWHT, bit reversal: the effective d×d map, obtained by rotating the identity's
// rows through the scheme's write path), its own bits and group, the rule of clip_search.h.
std::pair<float, float> OwnClipRatios(const LayerScheme& scheme, const Activations& acts,
                                      const ClipTargets& targets, int layer,
                                      const std::vector<double>& grid,
                                      const cpu::Backend& backend);

// Sets `scheme`'s clip ratios (one per KV head, or none) by `choice` (resolved for
// `scheme_name`): kOwn → OwnClipRatios (acts and targets required), kOscar → the calibration's
// ratios of that layer (cal required), kNone → ρ = 1. A bf16 scheme is left as it is.
// Throws kInvalidArgument when what the choice needs is null.
void ApplyClipChoice(const SchemeVariant& variant, const Calibration* cal,
                     const Activations* acts, const ClipTargets* targets, int layer,
                     const std::vector<double>& grid, const cpu::Backend& backend,
                     LayerScheme* scheme);

}  // namespace kvq::calib
