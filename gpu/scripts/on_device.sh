#!/usr/bin/env bash
# Runs on the device machine, from the repository root, over binaries staged by
# gpu/scripts/stage_device.sh in .carry/. Writes under $OUT (at most 8 files, flat; a device
# call brings back 8):
#   device.txt     nvidia-smi, compute-sanitizer / ncu versions
#   tests.log      every gpu test binary's gtest output
#   sanitizer.log  compute-sanitizer memcheck and racecheck on reduced runs of every kernel
#   bench.md       kvq_bench_gpu_write (and any other bench_gpu_* program)
#   ncu.txt        Nsight Compute speed of light / occupancy / warp state of the fused write
#                  kernels (dense: the tile kernel; FWHT rho = 1: the streaming kernel)
#   fwht_sass.csv  --sass only (with --write-only, so that the files stay within 8): executed
#                  instructions per SASS line of the FWHT launch
#   conform.log    kvq conform --backend gpu, then kvq bench --backend all
#   dump.log       tools/tests/dump_activations_test.py (torch + transformers on the device)
#   summary.md     the table printed last
#   attn_sass.csv  --attn-only --sass: executed instructions per SASS line of the INT2 decode
#                  kernel (B=1 T=128K)
# Usage: bash gpu/scripts/on_device.sh [--no-tests] [--no-sanitizer] [--no-bench] [--no-ncu]
#                                      [--write-only | --attn-only] [--sass]
#   --write-only: only the write path's tests (gpu_write_*), sanitizer runs and benchmark, no other
#                 engineers' gpu tests (saves device time when only write code changed)
#   --attn-only:  only the decode attention's test, sanitizer runs and benchmarks (with PyTorch
#                 SDPA); ncu on the INT2 decode kernel instead of the write kernels
set -uo pipefail

OUT=${OUT:-/tmp/kvq_device_out}
mkdir -p "$OUT"
carry=.carry
# stage_device.sh packs the binaries; unpack them once.
if [[ -f $carry/bundle.tar.gz && ! -d $carry/bin ]]; then tar -C "$carry" -xzf "$carry/bundle.tar.gz"; fi
export LD_LIBRARY_PATH="$PWD/$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
run_ncu=1; run_bench=1; run_tests=1; run_sanitizer=1; write_only=0; attn_only=0; run_sass=0
for arg in "$@"; do
  case "$arg" in
    --no-ncu) run_ncu=0 ;;
    --no-bench) run_bench=0 ;;
    --no-tests) run_tests=0 ;;
    --no-sanitizer) run_sanitizer=0 ;;
    --sass) run_sass=1 ;;
    --write-only) write_only=1 ;;
    --attn-only) attn_only=1 ;;
  esac
done
summary="$OUT/summary.md"
: > "$summary"
row() { printf '| %s | %s |\n' "$1" "$2" >> "$summary"; }
echo "| step | result |" >> "$summary"
echo "| --- | --- |" >> "$summary"

{
  date -u
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv
  command -v compute-sanitizer && compute-sanitizer --version | tail -n2
  command -v ncu && ncu --version | tail -n1
} > "$OUT/device.txt" 2>&1
row "device" "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -n1)"

# ---- Tests ----
: > "$OUT/tests.log"
(( run_tests )) && for t in "$carry"/bin/gpu_*_test; do
  [[ -x "$t" ]] || continue
  name=$(basename "$t")
  (( write_only )) && [[ $name != gpu_write_* ]] && continue
  (( attn_only )) && [[ $name != gpu_attention_test ]] && continue
  start=$(date +%s)
  one="$OUT/current_test.log"
  "$t" --gtest_brief=1 > "$one" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  total=$(grep -oE '^\[==========\] [0-9]+ tests' "$one" | grep -oE '[0-9]+ tests' | tail -n1)
  counts=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$one" | sed -E 's/^\[ +//; s/ +\]//' | tr '\n' ',' )
  { echo "===== $name (rc=$rc, ${secs}s) ====="; cat "$one"; } >> "$OUT/tests.log"
  rm -f "$one"
  row "$name" "rc=$rc, ${secs}s, ${total:-?}: ${counts:-no summary}"
done

# ---- compute-sanitizer: a reduced run of every kernel ----
: > "$OUT/sanitizer.log"
sanitize() {  # tool binary filter
  local tool=$1 bin=$carry/bin/$2 filter=$3
  [[ -x "$bin" ]] || { row "sanitizer $tool $2" "binary missing"; return; }
  echo "===== $tool $2 --gtest_filter=$filter =====" >> "$OUT/sanitizer.log"
  local start=$(date +%s)
  timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin" --gtest_brief=1 \
    --gtest_filter="$filter" >> "$OUT/sanitizer.log" 2>&1
  local rc=$?
  local errors
  errors=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -n1)
  row "sanitizer $tool $2" "rc=$rc, $(( $(date +%s) - start ))s, ${errors:-no summary line}"
}
if (( ! run_sanitizer )); then
  row "compute-sanitizer" "skipped (--no-sanitizer)"
elif command -v compute-sanitizer >/dev/null; then
  stages='Grid/WriteStagesTest.*/d64_g32_int2__cuda:Grid/WriteStagesTest.*/d256_g128_int4__cuda'
  fused='Grid/FusedWriteTest.*/d128_g64_int2_dense_bitrev__cuda:Grid/FusedWriteTest.*/d256_g32_int4_dense__cuda:Grid/FusedWriteTest.*/d64_g32_int2_fwht_bitrev__cuda:Grid/FusedWriteTest.*/d256_g64_int2_fwht_block32_bitrev__cuda:FusedWriteFlags.*:FusedWriteLarge.*'
  paged='Caches/PagedWriteTest.*'
  (( ! attn_only )) && for tool in memcheck racecheck; do
    sanitize "$tool" gpu_write_stages_test "$stages"
    sanitize "$tool" gpu_write_fused_test "$fused"
    sanitize "$tool" gpu_write_paged_test "$paged"
  done
  if (( ! write_only )); then
    # Decode attention: the reduced cases its tests provide for the sanitizers.
    attention='*Sanitizer_Small*:*RotateQueries*:*Int2Dense_Gqa16*:*Timeline*'
    for tool in memcheck racecheck synccheck; do
      sanitize "$tool" gpu_attention_test "$attention"
    done
    # The CPU-cache mirror (uploads, then the decode kernels).
    (( ! attn_only )) && for tool in memcheck racecheck; do
      sanitize "$tool" gpu_device_cache_test '*'
    done
  fi
else
  row "compute-sanitizer" "not found"
fi

# ---- Benchmarks ----
if (( run_bench )); then
  : > "$OUT/bench.md"
  for b in "$carry"/bin/kvq_bench_gpu_*; do
    [[ -x "$b" ]] || continue
    (( write_only )) && [[ $(basename "$b") != kvq_bench_gpu_write ]] && continue
    (( attn_only )) && [[ $(basename "$b") != kvq_bench_gpu_attention ]] && continue
    "$b" >> "$OUT/bench.md" 2>&1
    rc=$?
    row "$(basename "$b")" "rc=$rc"
  done
  # PyTorch SDPA (cuDNN and flash backends) on the attention benchmark's shapes, same method.
  if (( ! write_only )) && [[ -f bench/bench_sdpa.py ]]; then
    python3 bench/bench_sdpa.py --iters 30 >> "$OUT/bench.md" 2>&1
    row "bench_sdpa.py" "rc=$?"
    # The L2 flushed by a write pass instead (--flush write: the timed call pays the L2's
    # write-back), on the target shapes, for comparison with the tables above.
    if [[ -x $carry/bin/kvq_bench_gpu_attention ]]; then
      { echo; echo "## reference: L2 flushed by a write pass"; echo; } >> "$OUT/bench.md"
      rc=0
      for bt in "1 131072" "8 32768"; do
        set -- $bt
        "$carry/bin/kvq_bench_gpu_attention" --int2-only --iters 30 --flush write --batch "$1" --len "$2" \
          >> "$OUT/bench.md" 2>&1 || rc=$?
        python3 bench/bench_sdpa.py --iters 30 --flush write --batch "$1" --len "$2" \
          >> "$OUT/bench.md" 2>&1 || rc=$?
      done
      row "write-flush reference rows" "rc=$rc"
    fi
  fi
fi

# ---- The CLI on the device: GPU conformance and the CPU/GPU side-by-side benchmark ----
if (( ! write_only && ! attn_only )) && [[ -x $carry/bin/kvq ]]; then
  "$carry/bin/kvq" conform --backend gpu > "$OUT/conform.log" 2>&1
  row "kvq conform --backend gpu" "rc=$?, $(tail -n1 "$OUT/conform.log")"
  if (( run_bench )); then
    "$carry/bin/kvq" bench --backend all --batch 1 --seq-len 4096,32768 --iters 5 >> "$OUT/conform.log" 2>&1
    row "kvq bench --backend all" "rc=$?"
  fi
fi

# ---- The activation dumper (tools/dump_activations.py) on small random Llama/Qwen models ----
if (( ! write_only && ! attn_only )) && python3 -c 'import torch, transformers, safetensors' 2>/dev/null; then
  python3 tools/tests/dump_activations_test.py --out /tmp/kvq_dump > "$OUT/dump.log" 2>&1
  row "dump_activations_test.py" "rc=$?, $(tail -n1 "$OUT/dump.log")"
fi

# ---- Nsight Compute: the fused kernels, dense (first launch) and FWHT rho = 1 (after 104
# launches of the quick run: 2 dense variants x (new, baseline) x 13 calls x 2 launches) ----
# --attn-only: the INT2 decode kernel at B=1 T=128K and B=32 T=32K (the plan's loop), and with
# --sass its executed instructions per SASS line at B=1 T=128K.
if (( run_ncu && attn_only )) && command -v ncu >/dev/null; then
  : > "$OUT/ncu.txt"
  for shape in "1 131072" "32 32768"; do
    set -- $shape
    timeout 150 ncu --kernel-name regex:DecodeAttentionKernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section LaunchStats --section Occupancy \
      "$carry/bin/kvq_bench_gpu_attention" --batch "$1" --len "$2" --int2-only --iters 3 \
      --int8-qk 1 >> "$OUT/ncu.txt" 2>&1
    row "ncu decode B=$1 T=$2" "rc=$?"
  done
  # The three kernels of one B=1 step (rotation, decode, merge; ncu runs them one at a time, so
  # without the programmatic-launch overlap): duration each, at T = 8K and 128K.
  for len in 8192 131072; do
    echo "===== B=1 T=$len: the step's kernels =====" >> "$OUT/ncu.txt"
    timeout 100 ncu --kernel-name regex:"RotateQueries|DecodeAttentionKernel|MergePartials" \
      --launch-skip 9 --launch-count 3 --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second \
      "$carry/bin/kvq_bench_gpu_attention" --batch 1 --len "$len" --int2-only --iters 3 \
      --int8-qk 1 >> "$OUT/ncu.txt" 2>&1
    row "ncu step kernels B=1 T=$len" "rc=$?"
  done
  (( run_sass )) && timeout 150 ncu --kernel-name regex:DecodeAttentionKernel --launch-skip 3 \
    --launch-count 1 --section SourceCounters -o "$OUT/attn_sass" -f \
    "$carry/bin/kvq_bench_gpu_attention" --batch 1 --len 131072 --int2-only --iters 3 \
    --int8-qk 1 > /dev/null 2>&1 &&
    ncu -i "$OUT/attn_sass.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/attn_sass.csv" 2>&1 &&
    row "ncu SASS counts (decode B=1 T=128K)" "attn_sass.csv"
  rm -f "$OUT/attn_sass.ncu-rep"
fi
if (( run_ncu && ! attn_only )) && command -v ncu >/dev/null && [[ -x $carry/bin/kvq_bench_gpu_write ]]; then
  : > "$OUT/ncu.txt"
  for skip in 0 104; do
    timeout 120 ncu --clock-control none -k regex:FusedWrite --launch-skip "$skip" \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section InstructionStats \
      "$carry/bin/kvq_bench_gpu_write" --quick >> "$OUT/ncu.txt" 2>&1
    rc=$?
    row "ncu fused (launch-skip $skip)" "rc=$rc"
  done
  # --sass: executed instructions per SASS line of the FWHT rho = 1 launch (the write kernel's
  # instruction budget), as CSV.
  (( run_sass )) && timeout 120 ncu --clock-control none -k regex:FusedWrite --launch-skip 104 \
    --launch-count 1 --section SourceCounters -o "$OUT/fwht_sass" -f \
    "$carry/bin/kvq_bench_gpu_write" --quick > /dev/null 2>&1 &&
    ncu -i "$OUT/fwht_sass.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/fwht_sass.csv" 2>&1 &&
    row "ncu SASS counts (FWHT rho=1)" "fwht_sass.csv"
  rm -f "$OUT/fwht_sass.ncu-rep"
fi

echo
cat "$OUT/bench.md" 2>/dev/null | grep -E '^\|' || true
echo
cat "$summary"
