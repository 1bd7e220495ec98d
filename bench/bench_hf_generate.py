#!/usr/bin/env python3
"""Decode throughput and peak memory of a transformers model on each KV cache (issue 24, item 5):
HF's DynamicCache with sdpa (the bf16 baseline), HF's QuantizedCache where one of its backends
(optimum-quanto, hqq) is installed (said so where not), and kvq.hf.Cache with the schemes bf16,
oscar, kivi, fp8_unscaled and blockgtq, on one GPU.

The model: a random-init Llama with Llama-3.1-8B's shape (hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 14336; --layers of them, 32 by default; vocab 32000), bf16, seed 0. Random
weights say nothing about accuracy; the timings depend on the shapes alone. OSCAR's and
Block-GTQ's calibration files are random too (a random orthonormal R per (layer, KV head, side),
OSCAR's clip 0.95; Block-GTQ's key widths drawn in 1..5, V at 2 bits: test_hf_cache.py's
fixtures).

Per (cache, context T): the prompt of T random tokens in one forward (transformers' sdpa over the
prompt for every cache: kvq's caches take the rows through torch.ops.kvq.write_prefill), then
--new greedy decode steps, each one model(next_token, past_key_values=cache) call: what generate
runs per step, without its logits processors. Columns: prefill seconds, decode tokens / s (the
--new steps, CUDA-synchronised wall clock), peak memory allocated during the run (GiB, torch's
allocator: weights + cache + workspace + activations), and the cache's own bytes at the end.

Usage: python3 bench/bench_hf_generate.py [--contexts 8192,32768,131072] [--new 32]
                                          [--caches LIST] [--layers N]
(torch, transformers 5.x and kvq's libkvq_gpu.so (KVQ_GPU_LIB) on the device image only.)
"""
import argparse
import gc
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "python"))
sys.path.insert(0, str(ROOT / "tools" / "python" / "tests"))

CACHES = ["hf_dynamic", "hf_quantized", "kvq_bf16", "oscar", "kivi", "fp8_unscaled", "blockgtq"]


def make_model(layers):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=262144, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def cache_bytes(cache):
    """The bytes the cache's own tensors hold (kvq: pools and windows; HF: its layers' keys and
    values)."""
    total = 0
    for layer in cache.layers:
        for name in ("pools", "windows"):
            group = getattr(layer, name, None)
            if group:
                for item in group:
                    for t in (item if isinstance(item, (list, tuple)) else [item]):
                        if isinstance(t, torch.Tensor):
                            total += t.numel() * t.element_size()
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def build_cache(name, model, context, new, files):
    """The cache of `name`, or (None, reason) when it cannot be built here."""
    import transformers
    from kvq import hf
    if name == "hf_dynamic":
        return transformers.DynamicCache(config=model.config), None
    if name == "hf_quantized":
        try:
            return transformers.QuantizedCache(backend="quanto", config=model.config, nbits=2), None
        except Exception as e:  # noqa: BLE001 (no backend installed: say so)
            return None, "HF QuantizedCache unavailable: %s: %s" % (type(e).__name__,
                                                                    str(e).split("\n")[0][:160])
    scheme = "bf16" if name == "kvq_bf16" else name
    return hf.Cache(scheme, calibration=files.get(scheme), config=model.config,
                    max_batch_size=1, max_cache_len=context + new + 1), None


def run(name, model, context, new, files):
    from kvq import hf
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache, why = build_cache(name, model, context, new, files)
    if cache is None:
        return None, why
    model.set_attn_implementation("sdpa" if name.startswith("hf_") else hf.ATTENTION)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=g).cuda()
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(new):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    row = dict(prefill_s=t1 - t0, tok_s=new / (t2 - t1),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30,
               cache_gib=cache_bytes(cache) / 2**30)
    del cache, out
    gc.collect()
    return row, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    import transformers
    from test_hf_cache import blockgtq_calibration, oscar_calibration
    model = make_model(args.layers)
    weights = torch.cuda.memory_allocated() / 2**30
    tmp = pathlib.Path(tempfile.mkdtemp())
    files = {"oscar": oscar_calibration(tmp / "oscar.safetensors", model.config),
             "blockgtq": blockgtq_calibration(tmp / "blockgtq.safetensors", model.config)}
    print("# %s, torch %s, transformers %s; Llama-3.1-8B shape, %d layers, random init, bf16 "
          "weights %.1f GiB; B = 1, %d greedy steps" % (
              torch.cuda.get_device_name(), torch.__version__, transformers.__version__,
              args.layers, weights, args.new))
    print("| cache | T | prefill s | decode tok/s | vs hf_dynamic | peak GiB | cache GiB |")
    print("|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    notes = []
    for context in [int(c) for c in args.contexts.split(",")]:
        base = None
        for name in args.caches.split(","):
            try:
                row, why = run(name, model, context, args.new, files)
            except Exception as e:  # noqa: BLE001 (one row's failure must not hide the others)
                row, why = None, "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
                torch.cuda.empty_cache()
            if row is None:
                notes.append("%s at T = %d: %s" % (name, context, why))
                print("| %s | %d | - | - | - | - | - |" % (name, context))
            else:
                if name == "hf_dynamic":
                    base = row["tok_s"]
                print("| %s | %d | %.2f | %.1f | %s | %.1f | %.2f |" % (
                    name, context, row["prefill_s"], row["tok_s"],
                    "%.2fx" % (row["tok_s"] / base) if base else "-", row["peak_gib"],
                    row["cache_gib"]))
            sys.stdout.flush()
    for note in notes:
        print("- " + note)


if __name__ == "__main__":
    main()
