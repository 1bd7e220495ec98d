#!/usr/bin/env bash
# Configures the clang libFuzzer build (ASan + UBSan) in build-fuzz, builds the harnesses and
# runs each for SECONDS (default 30) on a temporary copy of its seed corpus.
# Usage: fuzz/run_fuzzers.sh [SECONDS]        (0 only builds and replays the seeds)
# Crashes are written to build-fuzz/fuzz/artifacts/<harness>/; the script exits non-zero.
set -euo pipefail
seconds="${1:-30}"
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzz"
jobs="${KVQ_FUZZ_BUILD_JOBS:-2}"

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVQ_FUZZERS=ON -DKVQ_SANITIZE=ON -DKVQ_ENABLE_CUDA=OFF -DKVQ_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target fuzz_npy fuzz_safetensors fuzz_vectors -j"$jobs"

work="$(mktemp -d /tmp/kvq_fuzz.XXXXXX)"
trap 'rm -rf "$work"' EXIT
status=0
for name in npy safetensors vectors; do
  harness="$build/fuzz/fuzz_$name"
  artifacts="$build/fuzz/artifacts/fuzz_$name/"
  mkdir -p "$work/$name" "$artifacts"
  cp "$root/fuzz/corpus/$name/"* "$work/$name/"
  if [ "$seconds" -eq 0 ]; then
    args=(-runs=0)
  else
    args=(-max_total_time="$seconds")
  fi
  echo "== fuzz_$name: ${seconds}s"
  if ! "$harness" "${args[@]}" -max_len=16384 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts" \
       "$work/$name" 2>"$work/$name.log"; then
    status=1
    tail -n 40 "$work/$name.log"
    echo "fuzz_$name FAILED (artifacts in $artifacts)"
  else
    grep -E "stat::number_of_executed_runs|Done|INFO: seed corpus" "$work/$name.log" || true
  fi
done
exit $status
