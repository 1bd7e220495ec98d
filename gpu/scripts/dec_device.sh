#!/usr/bin/env bash
# Issue 17's decode checks and timings in one device call (staged by stage_device.sh or by hand
# into a carried folder holding bundle.tar.gz, bench_sdpa.py and vectors/): the attention test,
# compute-sanitizer memcheck / racecheck / synccheck on the small configurations (every kernel
# family: INT2, tiled keys (ots), SAW, bf16), kvq conform --backend gpu on the carried vectors,
# the scheme rows of kvq_bench_gpu_attention and cuDNN (bench_sdpa.py) on the same shapes.
# Usage (from the repository root): bash CARRY/dec_device.sh CARRY [--no-bench]
set -uo pipefail
carry=$1; shift
bench=1; [[ ${1:-} == --no-bench ]] && bench=0
work=/tmp/kvq_dec; rm -rf "$work"; mkdir -p "$work"
tar -C "$work" -xzf "$carry/bundle.tar.gz"
export LD_LIBRARY_PATH="$work/lib:${LD_LIBRARY_PATH:-}"
bin=$work/bin
out=${OUT:-/tmp/out}; mkdir -p "$out"
date -u +"start %F %T UTC"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$bin/gpu_attention_test" --gtest_brief=1 > "$out/test.log" 2>&1; echo "attention test rc=$?"
grep -E "^\[  (PASSED|FAILED) |tests ran|FAILED" "$out/test.log" | head -20
grep -E "^\[ (Kivi|ots|kivi|Tile|saw|int4 K|int2 d64 K|int2 d256 K|ots T)" "$out/test.log" | head -60
for tool in memcheck racecheck synccheck; do
  timeout 240 compute-sanitizer --tool $tool --error-exitcode 99 "$bin/gpu_attention_test" \
    --gtest_brief=1 --gtest_filter='Configs/GpuAttentionConfig.MatchesReferences/Sanitizer_*' \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_$tool.log" | tail -n1)"
done
"$bin/kvq" conform --backend gpu --vectors "$carry/vectors" > "$out/conform.log" 2>&1
echo "conform rc=$? $(tail -n1 "$out/conform.log")"
grep -iE "skip|unsupported|fail" "$out/conform.log" | head -12
if (( bench )); then
  "$bin/kvq_bench_gpu_attention" --iters 20 --schemes kivi,ots,saw_int4,int4 --schemes-only \
    > "$out/bench.md" 2>&1; echo "bench rc=$?"
  python3 "$carry/bench_sdpa.py" --iters 20 >> "$out/bench.md" 2>&1; echo "sdpa rc=$?"
  cat "$out/bench.md"
fi
date -u +"end %F %T UTC"
