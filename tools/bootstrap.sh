#!/usr/bin/env bash
# Installs what is missing (Debian packages), configures and builds kvq (Release) into build/.
# Idempotent: a second run installs nothing and rebuilds only what changed.
#   tools/bootstrap.sh [--demo] [cmake options...]
# --demo builds the kvq binary (the CPU commands: `build/tools/kvq demo` runs after about
# 4 minutes on 2 cores) and the Python package kvq (build/tools/python, tools/python/README.md:
# `PYTHONPATH=build/tools/python /usr/bin/python3 -c "import kvq"`); without it everything is
# built: the CUDA kernels and the GPU module of the CLI, every test and benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=()
if [ "${1:-}" = "--demo" ]; then
  targets=(--target kvq)
  shift
fi

packages=(cmake ninja-build g++ clang libclang-rt-14-dev libhwy-dev libeigen3-dev
          librapidcheck-dev libcli11-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev
          pybind11-dev python3-dev python3-numpy python3-pytest)
# PyTorch (CPU) runs the tests' real torch targets (tools/python/tests/targets); --demo needs none.
((${#targets[@]})) || packages+=(python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
# The Python package's folder exists once the configure step found pybind11 (tools/python).
if ((${#targets[@]})) && [ -d build/tools/python/kvq ]; then
  targets+=(kvq_python)
fi
cmake --build build -j"$(nproc)" "${targets[@]}"
