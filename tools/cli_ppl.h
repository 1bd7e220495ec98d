// `kvq ppl` and `kvq demo`'s options and their run: the pipeline itself (load a model folder and
// its token windows, capture the calibration windows with the fp32 forward, calibrate OSCAR or
// read a calibration, build every scheme with its clip choice, run the teacher-forced
// evaluation, compare the GPU with the CPU) is calib::RunPplPipeline (calib/ppl_pipeline.h);
// this translates the options, supplies the GPU module's forwards and prints.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace kvq::cli {

struct PplCommand {
  std::string model;                 // --model DIR
  std::string tokens;                // --tokens FILE (default: the model's tokens file)
  std::string windows = "heldout_en:0-3,heldout_code:0-3";  // --windows
  int64_t length = 0;                // --length: tokens per evaluated window (0 = whole)
  std::string calibration;           // --calibration FILE (default: calibrate here)
  std::string calib_activations;     // --calib-activations FILE (default: capture here)
  std::string calib_windows = "calib";  // --calib-windows
  int64_t calib_length = 0;          // --calib-length (0 = whole windows)
  std::string save_calibration;      // --save-calibration FILE
  std::string schemes = "all";       // --schemes
  std::string clip = "own";          // --clip own|oscar|both
  std::vector<double> clip_grid;     // --clip-grid
  int group = 64, bits = 2, sink = 64, recent = 256, page = 64;
  int k_bits = 0, v_bits = 0;  // --k-bits / --v-bits: one side's b (0: --bits)
  uint64_t seed = 0;
  int saw_block = 128;               // --saw-block: the SAW schemes' FWHT block (BDR-h)
  int64_t tail_from = -1;            // --tail-from (default S0 + W)
  int threads = 0;                   // --threads (0: every core)
  std::string json;                  // --json FILE
  bool per_position = false;         // --per-position
  bool no_share_prefix = false;      // --no-share-prefix
  bool no_fp32 = false;              // --no-fp32
  bool quiet_progress = false;       // progress as quarter lines on stdout instead of a bar
  std::string backend = "cpu";       // --backend cpu|gpu|both (gpu/ppl: the forward on the device)
  std::string gpu_decode = "batch";  // --gpu-decode batch|steps
  std::string gpu_qk = "int8";       // --gpu-qk int8|bf16 (the quantized history's QK^T loop)
  std::string scheme_windows = "own";  // --scheme-windows own|shared
  double max_rel_ppl = 1e-3;         // --max-rel-ppl (both: GPU vs CPU tolerance)
  std::string banner;                // printed first (the demo's)
  // Set by AddPplOptions: which cache options the user gave (the others follow a calibration
  // file's when one is given).
  CLI::Option* group_option = nullptr;
  CLI::Option* bits_option = nullptr;
  CLI::Option* sink_option = nullptr;
  CLI::Option* recent_option = nullptr;
};

// Registers the options above on `command` (`demo` registers a subset with its own defaults).
void AddPplOptions(CLI::App* command, PplCommand* cmd, bool demo);

// Runs the pipeline, printing steps, timings and the table on stdout. Throws kvq::Error
// naming the offending option, file or value (the library's, and --gpu-decode, --gpu-qk, a
// missing GPU module, and GPU and CPU perplexities further apart than --max-rel-ppl).
void RunPplCommand(const PplCommand& cmd);

}  // namespace kvq::cli
