#!/usr/bin/env bash
# Builds the GPU programs here (sm_90, Release) and stages them for the device machine, with
# on_device.sh and the PyTorch baselines (bench_sdpa.py, bench_step_sdpa.py) beside them, in one
# folder a device call carries: every gpu/ test, the tests of
# other folders that expand the CUDA backend (testbed::TestBackends / AllBackends), the GPU
# benchmarks, the kvq CLI, the one GPU library (libkvq_gpu.so) and the shared libraries the
# device image lacks (Highway, Google Benchmark, RapidCheck, the CUDA runtime this build linked).
# Optionally the benchmark programs of a previous tree's build, under old/, so that one device
# call times both (on_device.sh --part timing).
#
# Usage: gpu/scripts/stage_device.sh [-j N] [--build DIR] [--carry DIR] [--old-build DIR]
#   -j N             build jobs (default 2: the build machine is shared)
#   --build DIR      build folder (default <repo>/build-gpu, configured here when missing)
#   --carry DIR      staging folder (default <repo>/.carry). A device call sends the checkout
#                    the session started in plus the ignored folders named in `carry`: from a
#                    helper's worktree, stage into that checkout's ignored .carry.
#   --old-build DIR  a previous tree's build folder: its kvq_bench_gpu_attention,
#                    kvq_bench_gpu_write and kvq_bench_gpu_step (where built there) are staged
#                    as old/bin with old/lib.
#   --timing-only    stage the benchmarks and the CLI only (what --part timing runs), no tests:
#                    with --old-build the bundle then stays inside the 64 MiB a call carries.
# The device command (carry: the staging folder's name, e.g. [".carry"]):
#   bash .carry/on_device.sh --part checks     (tests, compute-sanitizer, kvq conform)
#   bash .carry/on_device.sh --part timing     (old vs new benchmark rounds, benchmarks)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
build="$repo/build-gpu"
carry="$repo/.carry"
old_build=""
timing_only=0
jobs=2
while (( $# )); do
  case "$1" in
    -j) jobs="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --carry) carry="$2"; shift 2 ;;
    --old-build) old_build="$2"; shift 2 ;;
    --timing-only) timing_only=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    >/dev/null
fi

# gpu_<name> per gpu/tests/*_test.{cc,cu}; <folder>_<name> per test elsewhere that expands the
# CUDA backend; kvq_<name> per bench/bench_gpu_*.cu; the CLI.
targets=()
backend_tests=()
(( timing_only )) || for source in "$repo"/gpu/tests/*_test.cc "$repo"/gpu/tests/*_test.cu; do
  [[ -e "$source" ]] || continue
  name=$(basename "$source"); targets+=("gpu_${name%.*}")
done
(( timing_only )) ||
  for source in $(grep -l -E 'TestBackends|AllBackends' "$repo"/cpu_ref/tests/*_test.cc \
                    "$repo"/conformance/tests/*_test.cc "$repo"/fuzz/*_test.cc 2>/dev/null); do
  name=$(basename "$source" .cc)
  case "$source" in
    */cpu_ref/tests/*) backend_tests+=("cpu_ref_$name") ;;
    */conformance/tests/*) backend_tests+=("conformance_$name") ;;
    */fuzz/*) backend_tests+=("fuzz_$name") ;;
  esac
done
targets+=("${backend_tests[@]}")
for source in "$repo"/bench/bench_gpu_*.cu; do
  [[ -e "$source" ]] || continue
  name=$(basename "$source"); targets+=("kvq_${name%.*}")
done
targets+=(kvq)
echo "building: ${targets[*]} kvq_cuda"
ninja -C "$build" -j "$jobs" "${targets[@]}" kvq_cuda

rm -rf "$carry"
mkdir -p "$carry/stage/bin" "$carry/stage/lib"
binaries=()
for t in "${targets[@]}"; do
  path=$(find "$build" -maxdepth 3 -type f -name "$t" -perm -u+x | head -n1)
  [[ -n "$path" ]] || { echo "error: built target $t not found" >&2; exit 1; }
  cp "$path" "$carry/stage/bin/"
  binaries+=("$path")
done
printf '%s\n' "${backend_tests[@]}" > "$carry/stage/backend_tests.txt"
cp "$build/gpu/libkvq_gpu.so" "$carry/stage/lib/"
# The CLI's GPU module lives beside the binary (tools/cli_gpu.cc looks there).
cp "$build/tools/libkvq_cuda.so" "$carry/stage/bin/"

# Shared libraries the device image does not have (it has CUDA 13.0 and a newer libstdc++).
copy_libs() {  # destination binaries...
  local dest=$1; shift
  for b in "$@"; do
    ldd "$b" | awk '/=> \// {print $3}' | grep -E 'libhwy|libbenchmark|libcudart|librapidcheck' || true
  done | sort -u | while read -r lib; do cp -L "$lib" "$dest/"; done
}
copy_libs "$carry/stage/lib" "${binaries[@]}" "$build/gpu/libkvq_gpu.so" \
  "$build/tools/libkvq_cuda.so"

if [[ -n "$old_build" ]]; then
  mkdir -p "$carry/stage/old/bin" "$carry/stage/old/lib"
  old_bins=()
  for t in kvq_bench_gpu_attention kvq_bench_gpu_write kvq_bench_gpu_step; do
    [[ -e "$old_build/bench/$t" ]] || continue  # the step benchmark is newer than some trees
    cp "$old_build/bench/$t" "$carry/stage/old/bin/"
    old_bins+=("$old_build/bench/$t")
  done
  copy_libs "$carry/stage/old/lib" "${old_bins[@]}"
  # The old programs load the old tree's CUDA library, not this one (the dynamic loader finds
  # old/lib first).
  [[ -e "$old_build/gpu/libkvq_gpu.so" ]] && cp "$old_build/gpu/libkvq_gpu.so" "$carry/stage/old/lib/"
fi

# The device call carries at most 64 MiB: drop host debug sections (device code stays), then
# pack; on_device.sh unpacks the bundle (with xz, or with python3's lzma where xz is missing).
strip --strip-debug "$carry"/stage/bin/* "$carry"/stage/lib/libkvq_gpu.so
[[ -d "$carry/stage/old" ]] && strip --strip-debug "$carry"/stage/old/bin/* "$carry"/stage/old/lib/*
# xz, not gzip: the bundle and the tracked tree travel together under 64 MiB, and gzip
# leaves the CUDA library a quarter larger.
rm -f "$carry/bundle.tar.gz"
XZ_OPT="-9e -T${jobs}" tar -C "$carry/stage" -cJf "$carry/bundle.tar.xz" .
rm -rf "$carry/stage"
cp "$repo/gpu/scripts/on_device.sh" "$carry/on_device.sh"
cp "$repo/bench/bench_sdpa.py" "$carry/bench_sdpa.py"
cp "$repo/bench/bench_step_sdpa.py" "$carry/bench_step_sdpa.py"
du -sh "$carry"
echo "staged: ${targets[*]} libkvq_gpu.so libkvq_cuda.so${old_build:+ old: ${old_bins[*]##*/}}"
echo
echo "device commands (carry: [\"$(basename "$carry")\"], timeout_s <= 600):"
echo "  bash $(basename "$carry")/on_device.sh --part checks"
echo "  bash $(basename "$carry")/on_device.sh --part timing"
