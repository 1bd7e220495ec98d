#!/usr/bin/env python3
"""The bf16 decode step of one layer as a PyTorch serving loop runs it, in one CUDA graph: the
baseline of bench/bench_gpu_step.cu (issue 26) on the same shapes, d = 128, Hq/Hkv = 32/8,
B in {1, 8, 32, 128}, T in {8K, 32K, 128K}.

The step: dense bf16 K / V caches [B, Hkv, T, d] (preallocated, random), the new token's
K / V [B, Hkv, 1, d] written at position T - 1 by index_copy_ (two launches, as transformers'
StaticCache does), then F.scaled_dot_product_attention(q [B, Hq, 1, d], K, V, enable_gqa=True)
under the cuDNN backend, captured in one torch.cuda.CUDAGraph (warm-up on a side stream first, as
PyTorch's graph capture requires) and replayed. Every replay writes the same slot and reads the
whole cache: the same work each time, the step at length T (as kvq_bench_gpu_step times its
graphs). The SDPA alone and the append alone are graphs of their own.

Same method as the CUDA benchmarks: before every timed replay the L2 is flushed by reading a
buffer twice its size (bench/l2_flush.cuh; --flush write: by writing it), CUDA events around the
replay, median of --iters replays after 3 warm-ups. GB/s counts what the step must move: the
K / V rows of the T - 1 tokens stored before it, the new rows (read, then written), the query
and the output (bf16). Prints a markdown table whose first three columns (B, T, cuDNN step us)
kvq_bench_gpu_step --baseline reads; torch is on the device image only.

Usage: python3 bench/bench_step_sdpa.py [--iters N] [--quick] [--batch B] [--len T]
                                        [--flush read|write]
"""
import gc
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The timing method, flags, shape grid and copy bandwidth are bench_sdpa.py's (beside this file
# in bench/ and in the device call's staging folder).
from bench_sdpa import D, HKV, HQ, cuda_setup, median_us, parse_args, shapes


def capture(fn):
    """fn captured in a CUDA graph (after 3 eager runs on a side stream) and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def run_shape(b, t, flush, iters, copy_bw):
    """The table cells of shape (B, T): the step, the SDPA alone and the append alone, each a
    graph of its own (the tensors and graphs are freed on return)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(b * 1000003 + t)
    k_cache = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
    k_new = torch.randn(b, HKV, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    v_new = torch.randn(b, HKV, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.tensor([t - 1], device=dev, dtype=torch.long)

    def append():
        k_cache.index_copy_(2, pos, k_new)
        v_cache.index_copy_(2, pos, v_new)

    def attend():
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)

    def step():
        append()
        return attend()

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        step_graph, out = capture(step)
        attend_graph, _ = capture(attend)
    append_graph, _ = capture(append)
    step_graph.replay()
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite output")
    step_us = median_us(step_graph.replay, flush, iters)
    attend_us = median_us(attend_graph.replay, flush, iters)
    append_us = median_us(append_graph.replay, flush, iters)
    # Moved at least: the rows stored before the step, the new rows read and written, q and
    # the output.
    step_bytes = 2 * b * HKV * (t - 1) * D * 2 + 2 * 2 * b * HKV * D * 2 + 2 * b * HQ * D * 2
    gbs = step_bytes / (step_us * 1e-6)
    return [f"{step_us:.1f}", f"{attend_us:.1f}", f"{append_us:.1f}", f"{step_bytes / 1e6:.2f}",
            f"{gbs / 1e9:.0f}", f"{100 * gbs / copy_bw:.0f}%"]


def main():
    args = parse_args()
    props, flush, copy_bw = cuda_setup(args)

    print(f"# bf16 decode step (index_copy_ append + cuDNN SDPA) in one CUDA graph: torch "
          f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {props.name}, "
          f"{props.multi_processor_count} SMs")
    print(f"# device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write); median of "
          f"{args.iters} graph replays, cold L2 (flushed by a {args.flush} pass); d={D} "
          f"Hq/Hkv={HQ}/{HKV}, bf16 K/V [B, Hkv, T, d], the new token at T - 1\n")
    print("| B | T | cuDNN step us | SDPA alone us | append alone us | MB / step | step GB/s | "
          "of copy BW |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    batches, lens = shapes(args)
    for b in batches:
        for t in lens:
            kv_bytes = 2 * b * HKV * t * D * 2
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes + (3 << 30) > free:
                print(f"| {b} | {t} | skipped (memory) | | | | | |")
                sys.stdout.flush()
                continue
            try:
                cells = run_shape(b, t, flush, args.iters, copy_bw)
            except torch.cuda.OutOfMemoryError:
                cells = ["skipped (memory)", "", "", "", "", ""]
            except Exception as e:  # cuDNN refusing the shape or the capture: say so in the table
                msg = str(e).splitlines()[0][:60] if str(e) else type(e).__name__
                cells = [f"n/a ({msg})", "", "", "", "", ""]
            print(f"| {b} | {t} | " + " | ".join(cells) + " |")
            sys.stdout.flush()
            gc.collect()  # a failed shape's frame (its tensors) may sit in a reference cycle
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
