#!/usr/bin/env bash
# Builds the GPU binaries here (build-gpu, sm_90, Release) and stages them for the device
# machine in .carry/ (git-ignored): every gpu/ test binary, the GPU benchmarks, the kvq CLI
# when it builds, and the shared libraries they need that the device image lacks (Highway,
# Google Benchmark, the CUDA runtime this build was linked against). Prints the one device
# command to run (its `carry` is .carry).
#
# Usage: gpu/scripts/stage_device.sh [-j N]   (default -j2: the build machine is shared)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
build="$repo/build-gpu"
carry="$repo/.carry"
jobs=2
if [[ "${1:-}" == "-j" ]]; then jobs="$2"; fi

cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  >/dev/null

# One test target per gpu/tests/*_test.{cc,cu} (gpu_<name>), one bench per bench/bench_gpu_*.cu.
targets=()
for source in "$repo"/gpu/tests/*_test.cc "$repo"/gpu/tests/*_test.cu; do
  [[ -e "$source" ]] || continue
  name=$(basename "$source"); name=${name%.*}
  targets+=("gpu_$name")
done
for source in "$repo"/bench/bench_gpu_*.cu; do
  [[ -e "$source" ]] || continue
  name=$(basename "$source"); name=${name%.*}
  targets+=("kvq_$name")
done
echo "building: ${targets[*]}"
# Someone else's half-written file must not block staging: on failure, build target by target
# and stage what builds (the failures are listed).
if ! ninja -C "$build" -j "$jobs" "${targets[@]}"; then
  built=()
  for t in "${targets[@]}"; do
    if ninja -C "$build" -j "$jobs" "$t" >/dev/null 2>&1; then built+=("$t"); else
      echo "warning: $t does not build; not staged" >&2
    fi
  done
  targets=("${built[@]}")
fi
have_cli=0
if ninja -C "$build" -j "$jobs" kvq >/dev/null 2>&1; then have_cli=1; else
  echo "warning: the kvq CLI does not build right now; staging without it" >&2
fi

rm -rf "$carry"
mkdir -p "$carry/bin" "$carry/lib"
binaries=()
for t in "${targets[@]}"; do
  path=$(find "$build" -maxdepth 2 -type f -name "$t" -perm -u+x | head -n1)
  [[ -n "$path" ]] || { echo "error: built target $t not found" >&2; exit 1; }
  cp "$path" "$carry/bin/"
  binaries+=("$path")
done
if (( have_cli )); then cp "$build/tools/kvq" "$carry/bin/"; binaries+=("$build/tools/kvq"); fi
# The device call carries at most 64 MiB: drop host debug sections (device code stays).
strip --strip-debug "$carry"/bin/*

# Shared libraries the device image does not have (it has CUDA 13.0 and a newer libstdc++).
for b in "${binaries[@]}"; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -E 'libhwy|libbenchmark|libcudart|librapidcheck' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$carry/lib/"; done


# Every binary links all kernels statically, so the fatbins repeat: pack them (gzip is on every
# image) to stay under the 64 MiB a device call carries; on_device.sh unpacks the bundle.
tar -C "$carry" -czf "$carry/bundle.tar.gz" bin lib
staged_bins=$(ls "$carry/bin" | tr '\n' ' ')
staged_libs=$(ls "$carry/lib" | tr '\n' ' ')
rm -rf "$carry/bin" "$carry/lib"
du -sh "$carry"
echo "staged: $staged_bins"
echo "libs:   $staged_libs"
echo
echo "device command (run with carry=[\".carry\"], timeout_s <= 480):"
echo "  bash gpu/scripts/on_device.sh"
