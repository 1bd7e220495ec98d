#!/usr/bin/env python3
"""Decode attention through PyTorch scaled_dot_product_attention (cuDNN and flash backends), the
baseline for bench/bench_gpu_attention.cu on the same shapes: d = 128, Hq/Hkv = 32/8, dense bf16
K/V [B, Hkv, T, d], q [B, Hq, 1, d], enable_gqa=True.

Same method as the CUDA benchmark: L2 flushed before every timed run by reading a buffer twice
its size (clean lines, bench/l2_flush.cuh; --flush write: by writing it, which leaves the L2
dirty for the timed call to write back), CUDA events around the call,
median of --iters runs after 3 warm-ups; GB/s counts the K and V bytes (B * Hkv * T * d * 2
bytes each). Prints a markdown table (torch is on the device image only).

Usage: python3 bench/bench_sdpa.py [--iters N] [--quick] [--batch B] [--len T] [--flush read|write]
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

D, HQ, HKV = 128, 32, 8


def median_us(fn, flush, iters):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


def parse_args():
    """The flags both PyTorch baselines take (this one and bench_step_sdpa.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--flush", choices=["read", "write"], default="read")
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--len", type=int, default=0)
    return parser.parse_args()


def shapes(args):
    """The (B list, T list) of the table: the grid, --quick's, or the one --batch / --len name."""
    batches = [1, 32] if args.quick else [1, 8, 32, 128]
    lens = [32768] if args.quick else [8192, 32768, 131072]
    if args.batch:
        batches = [args.batch]
    if args.len:
        lens = [args.len]
    return batches, lens


def cuda_setup(args):
    """The device's properties, the L2 flush of --flush, and the device-to-device copy
    bandwidth (read + write, bytes per second) the tables are measured against."""
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    flush_buf = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=dev)
    # A read pass (sum) leaves clean lines; add_ reads and writes every word.
    flush = (lambda: flush_buf.add_(1)) if args.flush == "write" else (lambda: flush_buf.sum())

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = median_us(lambda: dst.copy_(src), flush, 20)
    copy_bw = 2 * src.numel() / (copy_us * 1e-6)
    del src, dst
    torch.cuda.empty_cache()
    return props, flush, copy_bw


def main():
    args = parse_args()
    props, flush, copy_bw = cuda_setup(args)
    dev = torch.device("cuda")

    print(f"# torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {props.name}, "
          f"{props.multi_processor_count} SMs")
    print(f"# device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write); median of "
          f"{args.iters} runs, cold L2 (flushed by a {args.flush} pass); d={D} Hq/Hkv={HQ}/{HKV}, bf16 K/V [B, Hkv, T, d]\n")
    print("| B | T | cuDNN us | cuDNN GB/s | of copy BW | flash us | flash GB/s | of copy BW |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    batches, lens = shapes(args)
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    for b in batches:
        for t in lens:
            kv_bytes = 2 * b * HKV * t * D * 2
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes + (3 << 30) > free:
                print(f"| {b} | {t} | skipped (memory) | | | skipped (memory) | | |")
                continue
            g = torch.Generator(device=dev).manual_seed(b * 1000003 + t)
            q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
            cells = []
            for name, backend in backends:
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        out = fn()
                        if not torch.isfinite(out).all():
                            raise RuntimeError("non-finite output")
                        us = median_us(fn, flush, args.iters)
                    gbs = kv_bytes / (us * 1e-6)
                    cells += [f"{us:.1f}", f"{gbs / 1e9:.0f}", f"{100 * gbs / copy_bw:.0f}%"]
                except Exception as e:  # a backend that refuses the shape: say so in the table
                    msg = str(e).splitlines()[0][:60] if str(e) else type(e).__name__
                    cells += [f"n/a ({msg})", "", ""]
            print(f"| {b} | {t} | " + " | ".join(cells) + " |")
            sys.stdout.flush()
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
