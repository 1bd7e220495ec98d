#!/usr/bin/env python3
"""Replays Block-GTQ's own allocator on a kvq capture and compares it with kvq's calibration.

Not part of the library: a check of `kvq calibrate --scheme blockgtq` (spec/numerics.md §9.1)
against the authors' code (JIA-Lab-research/blockgtq, blockgtq/allocator.py and
blockgtq/freq_analysis.py), which this script imports from --blockgtq-src (a folder holding
those two files: e.g. `git show HEAD:blockgtq/allocator.py > DIR/allocator.py`). It copies
nothing of theirs. For every layer and KV head of the capture:
  1. their energies: compute_freq_importance_energy(q_blocks, k_blocks) over the calibration
     tokens (the KV head's query heads as separate samples, torch float32, their default), the
     blocks split-half (rope_utils.decompose_freq_blocks: (x[i], x[i + d/2]));
  2. their allocation: greedy_bit_allocation(scores, int(d/2 * avg_bits)) on those energies,
     and again on kvq's stored energies (k_scores, fp32);
  3. kvq's k_bits from the calibration file.
It prints, per head, whether the allocations are identical and, where not, the blocks that
differ with both energies. Usage:
  /usr/bin/python3 tools/blockgtq_replay.py --activations A --calibration C --blockgtq-src DIR
"""
import argparse
import importlib.util
import json
import struct
import sys

import numpy as np
import torch

DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I32": np.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        raw = data[base + begin:base + end]
        if t["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=DTYPES[t["dtype"]])
        tensors[name] = arr.reshape(t["shape"]).astype(np.float32 if t["dtype"] in ("BF16", "F16")
                                                       else arr.dtype)
    return meta, tensors


def load(module, folder):
    spec = importlib.util.spec_from_file_location(module, f"{folder}/{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--activations", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--blockgtq-src", required=True)
    args = ap.parse_args()
    allocator = load("allocator", args.blockgtq_src)
    freq = load("freq_analysis", args.blockgtq_src)
    ameta, acts = read_safetensors(args.activations)
    cmeta, cal = read_safetensors(args.calibration)
    if cmeta.get("scheme") != "blockgtq":
        sys.exit(f"calibration scheme is {cmeta.get('scheme')!r}, not 'blockgtq'")
    layers = int(ameta["num_layers"])
    hq, hkv, d = int(ameta["num_q_heads"]), int(ameta["num_kv_heads"]), int(ameta["head_dim"])
    tokens = int(ameta["calib_tokens"])
    avg = float(cmeta["k_avg_bits"])
    L = d // 2
    budget = int(L * avg)
    g = hq // hkv
    same_theirs = same_scores = total = 0
    for layer in range(layers):
        q = acts[f"layers.{layer}.q"][:tokens].astype(np.float32)  # [T, Hq, d]
        k = acts[f"layers.{layer}.k"][:tokens].astype(np.float32)  # [T, Hkv, d]
        kvq_bits = cal[f"layers.{layer}.k_bits"]
        kvq_scores = cal[f"layers.{layer}.k_scores"]
        for h in range(hkv):
            qh = q[:, h * g:(h + 1) * g, :].transpose(1, 0, 2).reshape(-1, d)  # their layout
            kh = k[:, h, :]
            q_blocks = torch.from_numpy(np.stack([qh[:, :L], qh[:, L:]], axis=-1))
            k_blocks = torch.from_numpy(np.stack([kh[:, :L], kh[:, L:]], axis=-1))
            theirs_scores = freq.compute_freq_importance_energy(q_blocks, k_blocks)
            theirs = allocator.greedy_bit_allocation(theirs_scores, budget).numpy()
            on_kvq = allocator.greedy_bit_allocation(
                torch.from_numpy(kvq_scores[h].astype(np.float32)), budget).numpy()
            mine = kvq_bits[h].astype(np.int64)
            total += 1
            same_theirs += int(np.array_equal(theirs, mine))
            same_scores += int(np.array_equal(on_kvq, mine))
            status = "identical" if np.array_equal(theirs, mine) else "DIFFERENT"
            print(f"layer {layer} kv head {h}: sum {mine.sum()} (budget {budget}), "
                  f"their energies + their allocator vs kvq: {status}; "
                  f"their allocator on kvq's k_scores: "
                  f"{'identical' if np.array_equal(on_kvq, mine) else 'DIFFERENT'}")
            for i in np.nonzero(theirs != mine)[0]:
                print(f"    block {i}: theirs {theirs[i]} kvq {mine[i]}, energy theirs "
                      f"{float(theirs_scores[i]):.9g} kvq {float(kvq_scores[h][i]):.9g}")
    print(f"identical: {same_theirs}/{total} heads (their energies), "
          f"{same_scores}/{total} (their allocator on kvq's energies)")


if __name__ == "__main__":
    main()
