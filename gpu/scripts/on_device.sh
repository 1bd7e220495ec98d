#!/usr/bin/env bash
# Runs on the device machine over the bundle gpu/scripts/stage_device.sh made, from the folder
# it was staged into (this script's copy there). Two parts, one device call each (each fits the
# 10-minute limit of a call; run them back to back while the machine is warm):
#   --part checks   device.txt     nvidia-smi, compute-sanitizer / ncu versions
#                   tests.log      every gpu test, and every other test's CUDA backend cases
#                                  (--gtest_filter='*cuda*' of the tests that expand the list)
#                   torch_ops.log  tools/python/tests/test_torch_ops.py and test_hf_cache.py
#                                  (the image's torch and transformers)
#                   sanitizer.log  compute-sanitizer memcheck, racecheck and synccheck on reduced
#                                  runs that reach every kernel
#                   conform.log    kvq conform --backend gpu
#   --part timing   timing.md      the previous tree's benchmark programs (old/, when staged)
#                                  against this tree's, interleaved, --rounds times: decode
#                                  INT2 / bf16-QK loop / BF16 per (B, T), every scheme row
#                                  (--schemes-only) at B=1 T=128K and B=8 T=32K, the write rows
#                   timing.log     their raw output
#                   bench.md       the GPU benchmarks' full tables (the spec 1.1 schemes' decode
#                                  rows too), PyTorch SDPA, kvq bench
#                   step.md        the whole decode step (append + decode) in one CUDA graph:
#                                  bench_step_sdpa.py (index_copy_ + cuDNN, a graph), then
#                                  kvq_bench_gpu_step against it (--baseline); in bench.md too
#                   step_old.md    the previous tree's kvq_bench_gpu_step (old/, when staged)
#   --part ppl      ppl.log        kvq ppl --backend both on the committed model A: every scheme
#                                  of the catalogue (own windows) on the CPU (the device
#                                  machine's cores) and through the CUDA write and decode,
#                   ppl_A.json     and the comparison of their perplexities
#   --part hf       hf_ppl.log     issue 24's PPL check: model A exported to an HF folder
#                                  (tools/train_tiny_lm.py --export-hf), kvq ppl --backend gpu
#                                  --gpu-decode steps on one window a domain (512 tokens), and
#                                  test_hf_cache.py's teacher-forced PPL through kvq.hf.Cache on
#                                  the same windows against it (every GPU scheme of the call's
#                                  sets; Block-GTQ and tq_mse each with a calibration of its own:
#                                  kvq calibrate --scheme, whose tq_mse file holds the scheme's
#                                  seed-0 Haar rotations, the ones kvq ppl builds), 1e-3 relative
#                                  (2e-2 where the sink is quantized)
#   every part      summary.md     one row per step, printed last
# Usage: bash .carry/on_device.sh --part checks|timing|ppl|hf [--rounds N] [--ncu] [--dump]
#   --rounds N  old/new rounds of the timing comparison (default 3)
#   --ncu       (timing) Nsight Compute on the INT2 decode kernel, B=1 T=128K, into bench.md
#   --dump      (checks) tools/tests/dump_activations_test.py (torch + transformers)
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/kvq_device_out}
mkdir -p "$OUT"
part=""; rounds=3; run_ncu=0; run_dump=0
while (( $# )); do
  case "$1" in
    --part) part="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --ncu) run_ncu=1; shift ;;
    --dump) run_dump=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $part == checks || $part == timing || $part == ppl || $part == hf ]] ||
  { echo "--part checks|timing|ppl|hf" >&2; exit 2; }

# Unpacked once per bundle: a warm machine keeps /tmp between calls, so the stamp (the bundle's
# checksum) decides whether the binaries there are this call's.
stage=/tmp/kvq_stage
stamp=$(sha256sum "$here/bundle.tar.xz" | cut -c1-64)
if [[ ! -d $stage/bin || "$(cat "$stage/.bundle" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$stage" && mkdir -p "$stage"
  if command -v xz > /dev/null; then
    tar -C "$stage" -xJf "$here/bundle.tar.xz"
  else  # the image's python3 reads xz (lzma) without the xz program
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
      "$here/bundle.tar.xz" "$stage"
  fi
  echo "$stamp" > "$stage/.bundle"
fi
bin=$stage/bin
export LD_LIBRARY_PATH="$stage/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
summary="$OUT/summary.md"
: > "$summary"
row() { printf '| %s | %s |\n' "$1" "$2" >> "$summary"; }
echo "| step | result |" >> "$summary"
echo "| --- | --- |" >> "$summary"
row "device" "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -n1)"
row "bundle" "$(ls "$bin" | grep -vc "\.so$") programs; libkvq_gpu.so $(du -h "$stage/lib/libkvq_gpu.so" | cut -f1); libkvq_cuda.so (the CLI's GPU module) beside kvq"

if [[ $part == checks ]]; then
  {
    date -u
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv
    command -v compute-sanitizer && compute-sanitizer --version | tail -n2
    command -v ncu && ncu --version | tail -n1
    ldd "$bin/gpu_attention_test" | grep -E 'kvq_gpu|cudart'
  } > "$OUT/device.txt" 2>&1

  # ---- Tests: every gpu test; the CUDA cases of the tests that expand the backend list ----
  : > "$OUT/tests.log"
  run_test() {  # binary [gtest args...]
    local t=$1; shift
    local name; name=$(basename "$t")
    local start; start=$(date +%s)
    local one="$OUT/current_test.log"
    "$t" --gtest_brief=1 "$@" > "$one" 2>&1
    local rc=$?
    local total counts
    total=$(grep -oE '^\[==========\] [0-9]+ tests?' "$one" | grep -oE '[0-9]+ tests?' | tail -n1)
    counts=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$one" | sed -E 's/^\[ +//; s/ +\]//' | tr '\n' ',')
    { echo "===== $name $* (rc=$rc, $(( $(date +%s) - start ))s) ====="; cat "$one"; } >> "$OUT/tests.log"
    rm -f "$one"
    row "$name $*" "rc=$rc, $(( $(date +%s) - start ))s, ${total:-?}: ${counts:-no summary}"
  }
  for t in "$bin"/gpu_*_test; do run_test "$t"; done
  while read -r t; do
    [[ -n $t && -x $bin/$t ]] && run_test "$bin/$t" --gtest_filter='*cuda*'
  done < "$stage/backend_tests.txt"

  # ---- The torch ops (kvq.torch_ops over libkvq_gpu.so's C ABI): the image's python3 and
  # torch, the package's pure-Python files from the checkout (its extension module is built for
  # the build machine's Python and is not needed), the staged library ----
  if python3 -c 'import torch, pytest' 2>/dev/null; then
    start=$(date +%s)
    KVQ_GPU_LIB="$stage/lib/libkvq_gpu.so" PYTHONPATH="$PWD/tools/python" PYTHONDONTWRITEBYTECODE=1 \
      python3 -m pytest -q -rs -p no:cacheprovider tools/python/tests/test_torch_ops.py \
      tools/python/tests/test_hf_cache.py > "$OUT/torch_ops.log" 2>&1
    row "pytest test_torch_ops.py test_hf_cache.py" \
      "rc=$?, $(( $(date +%s) - start ))s, $(tail -n1 "$OUT/torch_ops.log")"
  else
    row "pytest test_torch_ops.py test_hf_cache.py" "not run: python3 lacks torch or pytest"
  fi

  # ---- compute-sanitizer: reduced runs that reach every kernel ----
  : > "$OUT/sanitizer.log"
  sanitize() {  # tool binary filter
    local tool=$1 b=$bin/$2 filter=$3
    [[ -x "$b" ]] || { row "sanitizer $tool $2" "binary missing"; return; }
    echo "===== $tool $2 --gtest_filter=$filter =====" >> "$OUT/sanitizer.log"
    local start; start=$(date +%s)
    timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 99 "$b" --gtest_brief=1 \
      --gtest_filter="$filter" >> "$OUT/sanitizer.log" 2>&1
    local rc=$?
    local errors
    errors=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -n1)
    row "sanitizer $tool $2" "rc=$rc, $(( $(date +%s) - start ))s, ${errors:-no summary line}"
  }
  if command -v compute-sanitizer >/dev/null; then
    # The stage kernels (through the CUDA backend's host wrappers), the fused write's tile and
    # stream kernels, the tile write (per-head and token norms) and G = d = 256, the paged modes
    # (spec 1.1's flushes and W = 0 included) with the window kernels, the decode-step kernels in
    # every loop (two-MMA, packed, int8 QK, tiled keys, fp8, codebook rows at every fragment width
    # and through the decoded tiles; bf16 cache; window blocks; no windows), the DeviceCache path.
    stages='Write/StageTest.*__cuda'
    fused='Grid/FusedWriteTest.*/d128_g64_int2_dense_bitrev__cuda:Grid/FusedWriteTest.*/d256_g32_int4_dense__cuda:Grid/FusedWriteTest.*/d64_g32_int2_fwht_bitrev__cuda:Grid/FusedWriteTest.*/d256_g64_int2_fwht_block32_bitrev__cuda:FusedWriteFlags.*:FusedWriteLarge.*:Grid/TileWriteTest.*/d128_tile32_int2_fwht_bitrev_norm__cuda:Grid/TileWriteTest.*/d128_tile128_int4_fwht_bitrev_norm__cuda:Grid/FusedWriteTest.*/d256_g256_int2_fwht_bitrev__cuda:Grid/FusedWriteTest.*/d256_g256_int4_dense__cuda:TileWriteRefuses.*:Grid/Fp8FusedWriteTest.*/d128_fp8_*:Grid/Fp8FusedWriteTest.*/d256_fp8_dense*'
    paged='Caches/PagedWriteTest.*'
    attention='*Sanitizer_Small*:*RotateQueries*:*Int2Dense_Gqa16*:*Timeline*:*Fp8*:*Codebook*'
    for tool in memcheck racecheck synccheck; do
      sanitize "$tool" cpu_ref_write_backends_test "$stages"
      sanitize "$tool" gpu_write_fused_test "$fused"
      sanitize "$tool" gpu_write_paged_test "$paged"
      sanitize "$tool" gpu_attention_test "$attention"
      sanitize "$tool" gpu_device_cache_test '*'
      sanitize "$tool" gpu_c_api_test '*'
    done
  else
    row "compute-sanitizer" "not found"
  fi

  # ---- The CLI: GPU conformance ----
  # The vectors of the checkout the call runs in (the binary's compiled-in folder is the build
  # machine's).
  "$bin/kvq" conform --backend gpu --vectors conformance/vectors > "$OUT/conform.log" 2>&1
  row "kvq conform --backend gpu" "rc=$?, $(tail -n1 "$OUT/conform.log")"

  if (( run_dump )) && [[ -f tools/tests/dump_activations_test.py ]] &&
     python3 -c 'import torch, transformers, safetensors' 2>/dev/null; then
    python3 tools/tests/dump_activations_test.py --out /tmp/kvq_dump >> "$OUT/conform.log" 2>&1
    row "dump_activations_test.py" "rc=$?"
  fi
fi

if [[ $part == timing ]]; then
  : > "$OUT/timing.log"
  : > "$OUT/bench.md"
  # ---- Old (previous tree, staged under old/) against new, interleaved, same process setup ----
  if [[ -d $stage/old/bin ]]; then
    for r in $(seq 1 "$rounds"); do
      for bt in "1 32768" "1 131072" "8 32768" "8 131072" "32 32768" "32 131072"; do
        set -- $bt
        for which in old new; do
          if [[ $which == old ]]; then
            b=$stage/old/bin/kvq_bench_gpu_attention; lib=$stage/old/lib
          else
            b=$bin/kvq_bench_gpu_attention; lib=$stage/lib
          fi
          echo "===== attention $which round $r B=$1 T=$2 =====" >> "$OUT/timing.log"
          LD_LIBRARY_PATH="$lib:/usr/local/cuda/lib64" "$b" --iters 30 --batch "$1" --len "$2" \
            >> "$OUT/timing.log" 2>&1
        done
      done
      # Every other loop of the decode kernel (tiled keys: kivi / ots, fp8, INT4, K != V, the
      # two-MMA loop of saw_int4's groups): the scheme rows at two shapes.
      for bt in "1 131072" "8 32768"; do
        set -- $bt
        for which in old new; do
          if [[ $which == old ]]; then
            b=$stage/old/bin/kvq_bench_gpu_attention; lib=$stage/old/lib
          else
            b=$bin/kvq_bench_gpu_attention; lib=$stage/lib
          fi
          echo "===== schemes $which round $r B=$1 T=$2 =====" >> "$OUT/timing.log"
          LD_LIBRARY_PATH="$lib:/usr/local/cuda/lib64" "$b" --iters 30 --schemes-only \
            --batch "$1" --len "$2" >> "$OUT/timing.log" 2>&1
        done
      done
      for which in old new; do
        if [[ $which == old ]]; then
          b=$stage/old/bin/kvq_bench_gpu_write; lib=$stage/old/lib
        else
          b=$bin/kvq_bench_gpu_write; lib=$stage/lib
        fi
        echo "===== write $which round $r =====" >> "$OUT/timing.log"
        LD_LIBRARY_PATH="$lib:/usr/local/cuda/lib64" "$b" >> "$OUT/timing.log" 2>&1
      done
    done
    python3 - "$OUT/timing.log" > "$OUT/timing.md" <<'PY'
import re, statistics, sys
# Medians per (what, which) over the rounds; ratio new / old.
att = {}  # (B, T, column) -> {which: [us]}
wr = {}   # row name -> {which: [ms]}
which = kind = None
for line in open(sys.argv[1]):
    m = re.match(r'===== (attention|schemes|write) (old|new) round (\d+)', line)
    if m:
        kind, which = m.group(1), m.group(2)
        continue
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if kind == 'attention' and len(cells) >= 13 and cells[0].isdigit():
        b, t = int(cells[0]), int(cells[1])
        for col, idx in (('INT2 us', 2), ('INT2 bf16-QK loop us', 8), ('BF16 us', 9)):
            try:
                att.setdefault((b, t, col), {}).setdefault(which, []).append(float(cells[idx]))
            except ValueError:
                pass
    if kind == 'schemes' and len(cells) >= 10 and cells[1].isdigit():
        try:
            key = (int(cells[1]), int(cells[2]), cells[0] + ' us')
            att.setdefault(key, {}).setdefault(which, []).append(float(cells[3]))
        except ValueError:
            pass
    if kind == 'write' and len(cells) >= 3 and cells[2].endswith(' ms'):
        name = cells[0] + ': ' + cells[1]
        wr.setdefault(name, {}).setdefault(which, []).append(float(cells[2][:-3]))
def fmt(d, unit):
    f = '%.1f' if unit == 'us' else '%.4f'
    o, n = d.get('old', []), d.get('new', [])
    cells = '| %s | %s ' % (' / '.join(f % x for x in o), ' / '.join(f % x for x in n))
    if not o or not n:
        return cells + '| - |'
    return cells + '| %.3f |' % (statistics.median(n) / statistics.median(o))
print('| decode step | old (each round) | new (each round) | new / old (medians) |')
print('| --- | --- | --- | --- |')
for key in sorted(att):
    print('| B=%d T=%d %s ' % key + fmt(att[key], 'us'))
print()
print('| write (ms) | old (each round) | new (each round) | new / old (medians) |')
print('| --- | --- | --- | --- |')
for key in wr:
    if 'cudaMemcpy' in key:
        continue
    print('| %s ' % key + fmt(wr[key], 'ms'))
PY
    row "old vs new timing ($rounds rounds)" "rc=$?, timing.md"
  else
    row "old vs new timing" "no old/ programs staged"
  fi

  # ---- This tree's benchmarks: full tables, PyTorch SDPA, kvq bench ----
  for b in "$bin"/kvq_bench_gpu_*; do
    [[ $(basename "$b") == kvq_bench_gpu_step ]] && continue  # below, beside its baseline
    "$b" >> "$OUT/bench.md" 2>&1
    row "$(basename "$b")" "rc=$?"
  done
  # The spec 1.1 schemes' decode steps (kivi, ots, saw_int4, plain INT4, K4V2, K2V4; B x T grid).
  "$bin/kvq_bench_gpu_attention" --schemes-only >> "$OUT/bench.md" 2>&1
  row "kvq_bench_gpu_attention --schemes-only" "rc=$?"
  if [[ -f $here/bench_sdpa.py ]]; then
    python3 "$here/bench_sdpa.py" --iters 30 >> "$OUT/bench.md" 2>&1
    row "bench_sdpa.py" "rc=$?"
  fi
  "$bin/kvq" bench --backend all --schemes oscar,kivi,ots,saw_int4,bf16 --batch 1 \
    --seq-len 4096,32768 --iters 5 >> "$OUT/bench.md" 2>&1
  row "kvq bench --backend all" "rc=$?"
  # The whole decode step in one CUDA graph (issue 26): the PyTorch bf16 step first, then every
  # kvq scheme's step with that table as its baseline (about a minute together on an H100).
  : > "$OUT/step.md"
  step_baseline=()
  if [[ -f $here/bench_step_sdpa.py ]]; then
    python3 "$here/bench_step_sdpa.py" --iters 30 > "$OUT/step_sdpa.md" 2>&1
    row "bench_step_sdpa.py" "rc=$?"
    cat "$OUT/step_sdpa.md" >> "$OUT/step.md"
    echo >> "$OUT/step.md"
    step_baseline=(--baseline "$OUT/step_sdpa.md")
  fi
  if [[ -x $bin/kvq_bench_gpu_step ]]; then
    "$bin/kvq_bench_gpu_step" --iters 30 ${step_baseline[@]+"${step_baseline[@]}"} >> "$OUT/step.md" 2>&1
    row "kvq_bench_gpu_step" "rc=$?"
  fi
  # The previous tree's step benchmark (old/, when staged) right after, against the same
  # baseline: step_old.md, for new / old per row.
  if [[ -x $stage/old/bin/kvq_bench_gpu_step ]]; then
    LD_LIBRARY_PATH="$stage/old/lib:/usr/local/cuda/lib64" "$stage/old/bin/kvq_bench_gpu_step" --iters 30 \
      ${step_baseline[@]+"${step_baseline[@]}"} > "$OUT/step_old.md" 2>&1
    row "kvq_bench_gpu_step (old tree)" "rc=$?"
  fi
  cat "$OUT/step.md" >> "$OUT/bench.md"
  if (( run_ncu )) && command -v ncu >/dev/null; then
    timeout 150 ncu --kernel-name regex:DecodeAttentionKernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      "$bin/kvq_bench_gpu_attention" --batch 1 --len 131072 --int2-only --iters 3 \
      >> "$OUT/bench.md" 2>&1
    row "ncu decode B=1 T=128K" "rc=$?"
  fi
fi

if [[ $part == ppl ]]; then
  "$bin/kvq" ppl --model calib/models/tiny-llama-a --schemes all --backend both --threads 0 \
    --json "$OUT/ppl_A.json" > "$OUT/ppl.log" 2>&1
  row "kvq ppl --backend both (model A)" "rc=$?, ppl.log"
fi

if [[ $part == hf ]]; then
  model=calib/models/tiny-llama-a hf=/tmp/kvq_hf_A work=/tmp/kvq_hf_work
  rm -rf "$hf" "$work" && mkdir -p "$work"
  windows=(--windows heldout_en:0-0,heldout_code:0-0 --length 512)
  {
    python3 tools/train_tiny_lm.py --export-hf "$hf" --from "$model" &&
    "$bin/kvq" ppl --model "$model" "${windows[@]}" --backend gpu --gpu-decode steps \
      --schemes bf16,oscar,kivi,ots,saw_int4,tq_mse_fwht --json "$work/ppl.json" \
      --save-calibration "$work/oscar.safetensors" &&
    "$bin/kvq" capture --model "$model" --windows calib:0-1 --length 1024 --calib-windows 1 \
      --out "$work/capture.safetensors" &&
    "$bin/kvq" calibrate --activations "$work/capture.safetensors" --scheme blockgtq \
      --k-bits 2 --v-bits 2 --out "$work/blockgtq.safetensors" &&
    "$bin/kvq" ppl --model "$model" "${windows[@]}" --backend gpu --gpu-decode steps \
      --schemes blockgtq --calibration "$work/blockgtq.safetensors" --json "$work/ppl_b.json" &&
    "$bin/kvq" calibrate --activations "$work/capture.safetensors" --scheme tq_mse \
      --k-bits 2 --v-bits 2 --out "$work/tq_mse.safetensors" &&
    "$bin/kvq" ppl --model "$model" "${windows[@]}" --backend gpu --gpu-decode steps \
      --schemes tq_mse --calibration "$work/tq_mse.safetensors" --json "$work/ppl_t.json"
  } > "$OUT/hf_ppl.log" 2>&1
  row "export + kvq ppl --backend gpu (hf part)" "rc=$?, hf_ppl.log"
  cp "$work"/ppl*.json "$OUT/" 2>/dev/null
  for set in "ppl.json oscar" "ppl_b.json blockgtq" "ppl_t.json tq_mse"; do
    read -r json cal <<< "$set"
    start=$(date +%s)
    KVQ_PPL_JSON="$work/$json" KVQ_HF_MODEL="$hf" KVQ_CALIBRATION="$work/$cal.safetensors" \
      KVQ_TOKENS="$model/tokens.safetensors" KVQ_GPU_LIB="$stage/lib/libkvq_gpu.so" \
      PYTHONPATH="$PWD/tools/python" PYTHONDONTWRITEBYTECODE=1 \
      python3 -m pytest -q -rs -s -p no:cacheprovider tools/python/tests/test_hf_cache.py \
      -k teacher_forced >> "$OUT/hf_ppl.log" 2>&1
    row "pytest teacher_forced ($json)" "rc=$?, $(( $(date +%s) - start ))s, $(tail -n1 "$OUT/hf_ppl.log")"
  done
fi

echo
[[ -f $OUT/timing.md ]] && cat "$OUT/timing.md"
[[ -f $OUT/ppl.log ]] && tail -n 60 "$OUT/ppl.log"
[[ -f $OUT/hf_ppl.log ]] && grep -E "HF path PPL|passed|failed|Error|error" "$OUT/hf_ppl.log" | tail -n 40
echo
cat "$summary"
