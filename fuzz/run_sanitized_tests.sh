#!/usr/bin/env bash
# Builds the CPU test suite with AddressSanitizer + UndefinedBehaviorSanitizer (GCC, no CUDA,
# no benchmarks) in build-asan and runs it with ctest. Any sanitizer report fails the run.
# Usage: fuzz/run_sanitized_tests.sh [extra ctest args, e.g. -R Cache]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-asan"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_SANITIZE=ON \
  -DKVQ_ENABLE_CUDA=OFF -DKVQ_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j"${KVQ_BUILD_JOBS:-2}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The short fuzz pass runs in the ordinary build only; the vectors check regenerates 3 MB twice.
ctest --test-dir "$build" --output-on-failure -j"${KVQ_TEST_JOBS:-2}" "$@"
