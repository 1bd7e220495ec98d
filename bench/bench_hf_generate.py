#!/usr/bin/env python3
"""Decode throughput and peak memory of a transformers model on each KV cache (issue 24, item 5):
HF's DynamicCache with sdpa (the bf16 baseline), HF's QuantizedCache where one of its backends
(optimum-quanto, hqq) is installed (said so where not), and kvq.hf.Cache with the schemes bf16,
oscar, kivi, fp8_unscaled, tq_mse and blockgtq, on one GPU.

The model: a random-init Llama with Llama-3.1-8B's shape (hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 14336; --layers of them, 32 by default; vocab 32000), bf16, seed 0. Random
weights say nothing about accuracy; the timings depend on the shapes alone. The calibration
files are random stand-ins with the shapes of the real ones (test_hf_cache.py's fixtures):
OSCAR's a random orthonormal R per (layer, KV head, side) and clip 0.95; Block-GTQ's key widths
drawn in 1..5, V at 2 bits, random R_K, R_V; tq_mse's a random orthonormal R per (layer, KV
head, side) in a format_version 4 file naming tq_mse, where `kvq calibrate --scheme tq_mse`
would store the seed's Haar matrices (it needs an activation capture of this shape, and the
matrices' values do not change the work: dense d x d rotations either way).

Before any timed row, every cache of --caches runs once untimed (a 1024-token prefill, past
every scheme's windows so that history rows are written, and 4 decode steps, at the first
--batch): the process's first forward and each scheme's first calls (its kernels' lazy module
loading, its C handle, codebook tables) are not in any row.
Per (B, context T, cache): the prompt of B x T random tokens in one forward (transformers'
sdpa over the prompt for every cache: kvq's caches take the rows through
torch.ops.kvq.write_prefill), then --repeats timed runs of --new greedy decode steps each, back
to back on the same cache (run r starts at length T + r * new), each step one
model(next_token, past_key_values=cache) call: what generate runs per step, without its logits
processors. Columns: prefill seconds (one run), decode tokens / s (B * new / the run's
CUDA-synchronised wall clock: the median of the runs, then their min and max), its ratio to
hf_dynamic's median at the same (B, T), peak memory allocated during the row (GiB, torch's
allocator: weights + cache + workspace + activations; each row starts from the weights alone,
else a note says what was still allocated), and the cache's own bytes at the end. A row that
fails (out of memory, a cache not installed) prints dashes and a note.

Usage: python3 bench/bench_hf_generate.py [--contexts 8192,32768,131072] [--batch 1,8]
           [--new 32] [--repeats 3] [--caches LIST] [--layers N]
(torch, transformers 5.x and kvq's libkvq_gpu.so (KVQ_GPU_LIB) on the device image only.)
"""
import argparse
import gc
import pathlib
import statistics
import sys
import tempfile
import time

try:
    import torch
except ImportError:  # --help works without torch
    torch = None

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "python"))
sys.path.insert(0, str(ROOT / "tools" / "python" / "tests"))

CACHES = ["hf_dynamic", "hf_quantized", "kvq_bf16", "oscar", "kivi", "fp8_unscaled", "tq_mse",
          "blockgtq"]
WARMUP_TOKENS, WARMUP_STEPS = 1024, 4  # > S0 + W + F - 1 of every scheme


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


def calibration_files(folder, config):
    """{scheme: path} of the random stand-in calibrations (the module docstring)."""
    from test_hf_cache import blockgtq_calibration, oscar_calibration, tq_mse_calibration
    return {"oscar": oscar_calibration(folder / "oscar.safetensors", config),
            "blockgtq": blockgtq_calibration(folder / "blockgtq.safetensors", config),
            "tq_mse": tq_mse_calibration(folder / "tq_mse.safetensors", config)}


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


def build_cache(name, model, batch, max_len, files):
    """(the cache of `name` for `batch` sequences of up to max_len tokens, None), or (None, why
    it cannot be built here)."""
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
                    max_batch_size=batch, max_cache_len=max_len), None


def decode_steps(model, cache, token, steps):
    """`steps` greedy steps from `token` [B, 1]; returns the last token."""
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return token


def run(name, model, batch, context, new, repeats, files):
    """One row: (dict of its figures, None) or (None, why there is none)."""
    from kvq import hf
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cache, why = build_cache(name, model, batch, context + max(repeats, 1) * new + 1, files)
    if cache is None:
        return None, why
    model.set_attn_implementation("sdpa" if name.startswith("hf_") else hf.ATTENTION)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).cuda()
    seconds = []
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        del out
        for _ in range(repeats):
            t0 = time.perf_counter()
            token = decode_steps(model, cache, token, new)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
    median, low, high = decode_rates(batch, new, seconds)
    row = dict(prefill_s=prefill, start_gib=start / 2**30, tok_s=median, tok_s_min=low,
               tok_s_max=high, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
               cache_gib=cache_bytes(cache) / 2**30)
    return row, None


def decode_rates(batch, new, seconds):
    """(median, min, max) tokens / s of decode runs of `new` steps over `batch` sequences that
    took `seconds` each: B * new / s per run."""
    rates = [batch * new / s for s in seconds]
    return statistics.median(rates), min(rates), max(rates)


def warm_up(caches, model, batch, files):
    """Each cache once, untimed: a WARMUP_TOKENS prefill and WARMUP_STEPS decode steps."""
    began = time.perf_counter()
    failed = []
    for name in caches:
        try:
            row, why = run(name, model, batch, WARMUP_TOKENS, WARMUP_STEPS, 1, files)
        except Exception as e:  # noqa: BLE001 (its timed rows will say why)
            row, why = None, type(e).__name__
        if row is None:
            failed.append("%s (%s)" % (name, why.split(":")[0]))
    return time.perf_counter() - began, failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="8192,32768,131072",
                        help="prompt lengths T, comma-separated")
    parser.add_argument("--batch", default="1", help="batch sizes B, comma-separated (e.g. 1,8)")
    parser.add_argument("--new", type=int, default=32, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed decode runs per row (tokens / s: their median, min, max)")
    parser.add_argument("--caches", default=",".join(CACHES),
                        help="comma-separated, of: " + ", ".join(CACHES))
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the model")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    caches = args.caches.split(",")
    unknown = [c for c in caches if c not in CACHES]
    if unknown:
        parser.error("unknown caches %s (the caches: %s)" % (unknown, ", ".join(CACHES)))
    for option, values in (("--new", [args.new]), ("--repeats", [args.repeats]),
                           ("--batch", batches), ("--contexts", contexts)):
        if min(values) < 1:
            parser.error("%s %s below 1" % (option, min(values)))
    if torch is None:
        sys.exit("bench_hf_generate.py needs torch (and transformers 5.x, libkvq_gpu.so)")
    import transformers
    model = make_model(args.layers)
    weights = torch.cuda.memory_allocated() / 2**30
    files = calibration_files(pathlib.Path(tempfile.mkdtemp()), model.config)
    warm_s, warm_failed = warm_up(caches, model, batches[0], files)
    print("# %s, torch %s, transformers %s; Llama-3.1-8B shape, %d layers, random init, bf16 "
          "weights %.1f GiB; B %s; %d greedy steps a run, %d runs a row; warm-up %.1f s%s" % (
              torch.cuda.get_device_name(), torch.__version__, transformers.__version__,
              args.layers, weights, args.batch, args.new, args.repeats, warm_s,
              " (failed: %s)" % ", ".join(warm_failed) if warm_failed else ""))
    print("| cache | B | T | prefill s | decode tok/s (median) | min | max | vs hf_dynamic | "
          "peak GiB | cache GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    notes = []
    for batch in batches:
        for context in contexts:
            base = None
            for name in caches:
                try:
                    row, why = run(name, model, batch, context, args.new, args.repeats, files)
                except Exception as e:  # noqa: BLE001 (one row's failure must not hide others)
                    row, why = None, "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
                where = "%s at B = %d, T = %d" % (name, batch, context)
                if row is None:
                    notes.append("%s: %s" % (where, why))
                    print("| %s | %d | %d | - | - | - | - | - | - | - |" % (name, batch, context))
                    sys.stdout.flush()
                    continue
                if name == "hf_dynamic":
                    base = row["tok_s"]
                if row["start_gib"] > weights + 0.25:
                    notes.append("%s started with %.2f GiB allocated beyond the weights (an "
                                 "earlier row's tensors still held)"
                                 % (where, row["start_gib"] - weights))
                print("| %s | %d | %d | %.2f | %.1f | %.1f | %.1f | %s | %.1f | %.2f |" % (
                    name, batch, context, row["prefill_s"], row["tok_s"], row["tok_s_min"],
                    row["tok_s_max"], "%.2fx" % (row["tok_s"] / base) if base else "-",
                    row["peak_gib"], row["cache_gib"]))
                sys.stdout.flush()
    for note in notes:
        print("- " + note)


if __name__ == "__main__":
    main()
