"""tp_invariance: a kvq.hf.Cache under transformers' tensor parallelism, dumped per global KV head.

    torchrun --nproc-per-node 2 tools/python/tp_invariance.py --model DIR --scheme bf16,oscar \
        [--calibration C] --out OUT          # one file per rank and scheme
    torchrun --nproc-per-node 1 tools/python/tp_invariance.py ... --out REF   # the one-GPU run

Each rank loads the model (tensor parallel when the world has more than one rank:
from_pretrained(tp_plan="auto"), or distributed_config= from transformers 5.18, which removed
tp_plan=), checks that its k_proj / v_proj shards are the checkpoint's rows of the KV heads
rank_kv_heads() gives it, builds kvq.hf.Cache(kv_heads=those heads) per scheme, runs the prompt
(one prefill) and --steps one-token decode steps, and writes OUT/<scheme>.rank<r>.safetensors:
  layers.{l}.heads.{h}.{k|v}.pool.{plane}   u8: the pages of the sequence, in sequence order,
                                            of global KV head h (every plane of the format)
  layers.{l}.heads.{h}.{k|v}.window.{sink|recent}   u8: the head's bf16 window rows (quantized
                                            schemes only)
  layers.{l}.heads.{h}.{k|v}.inputs         bf16 [T, d]: the rows the cache was handed (what a
                                            one-GPU cache is replayed with, tests/test_hf_tp.py)
  argmax                                    i64 [steps + 1]: the argmax after the prompt and
                                            after each decode step
  logits                                    f32 [steps + 1, vocab]: those steps' last logits
and metadata (scheme, rank, world, kv_heads, prompt_length, steps, max_cache_len).

The decode steps feed the prompt's fixed continuation (teacher forcing), not the argmax: TP's
all-reduce order alone flips an argmax now and then (../shared/research/hf_probe.md, trap 4),
and feeding it back would make the two runs' caches hold different tokens from there on. The
argmax is recorded beside. No torch.compile (a compiled TP job hung at exit in that probe,
trap 8); the process group is destroyed at exit.
"""
import argparse
import os
import re
import sys

WINDOWS = ("sink", "recent")  # the window names, in kvq.hf.Layer.windows order per side


def rank_kv_heads(num_kv_heads, rank, world):
    """The global KV heads of `rank` under transformers' "colwise" plan for k_proj / v_proj
    (Shard(0) of [Hkv * d, hidden]: contiguous equal row blocks, rank r the r-th), as a range.
    ValueError for a rank outside [0, world) or Hkv not a multiple of world."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError("rank %r outside a world of %r" % (rank, world))
    if num_kv_heads % world:
        raise ValueError("%d KV heads do not split over %d ranks" % (num_kv_heads, world))
    n = num_kv_heads // world
    return range(rank * n, (rank + 1) * n)


def tp_load_kwargs(world, transformers_version, distributed_config=None):
    """from_pretrained's keyword arguments for a tensor-parallel load over `world` ranks: none
    for one rank; tp_plan="auto" before transformers 5.18; from 5.18 (tp_plan= removed; 5.17
    warns) distributed_config=distributed_config(tp_plan="auto"), `distributed_config` being
    transformers' DistributedConfig class (RuntimeError when there is none)."""
    if world == 1:
        return {}
    version = tuple(int(x) for x in re.findall(r"\d+", transformers_version)[:2])
    if version < (5, 18):
        return {"tp_plan": "auto"}
    if distributed_config is None:
        raise RuntimeError("transformers %s has no tp_plan= and no DistributedConfig found"
                           % transformers_version)
    return {"distributed_config": distributed_config(tp_plan="auto")}


def head_key(layer, head, side, what):
    """The file key of one global head's entry: side "k" / "v", what "pool.<plane>",
    "window.sink", "window.recent" or "inputs"."""
    return "layers.%d.heads.%d.%s.%s" % (layer, head, side, what)


def parse_head_key(key):
    """(layer, head, side, what) of a head_key, or None for another key."""
    m = re.fullmatch(r"layers\.(\d+)\.heads\.(\d+)\.([kv])\.(.+)", key)
    return None if m is None else (int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))


def _bytes(t):
    """t's bytes as a fresh u8 1-D tensor (a copy: safetensors refuses tensors sharing memory)."""
    import torch
    return t.contiguous().view(torch.uint8).reshape(-1).clone()


def head_bytes(layer, kv_heads, plane_names, pools, windows, pages):
    """{head_key: u8 1-D tensor} of one layer's cache, per global KV head.
    kv_heads: the global head of each local head, in order; plane_names: ([K plane names],
    [V plane names]); pools: ([K planes], [V planes]), each [pages, Hkv_local, rows, elements];
    windows: (sink K, sink V, recent K, recent V) [batch, S, Hkv_local, d] (sequence 0 is
    taken; an empty window is left out); pages: int64 [n], the sequence's pages in order.
    ValueError when a plane or window does not hold len(kv_heads) heads on its head axis."""
    out = {}
    for side, names, planes in zip("kv", plane_names, pools):
        for name, plane in zip(names, planes):
            if plane.shape[1] != len(kv_heads):
                raise ValueError("plane %s.%s has %d heads, kv_heads %s" % (
                    side, name, plane.shape[1], list(kv_heads)))
            rows = plane[pages]  # [n, Hkv_local, rows, elements]
            for i, h in enumerate(kv_heads):
                out[head_key(layer, h, side, "pool." + name)] = _bytes(rows[:, i])
    for j, window in enumerate(windows):
        side, name = "kv"[j % 2], WINDOWS[j // 2]
        if window.shape[1] == 0:
            continue
        if window.shape[2] != len(kv_heads):
            raise ValueError("window %s.%s has %d heads, kv_heads %s" % (
                side, name, window.shape[2], list(kv_heads)))
        for i, h in enumerate(kv_heads):
            out[head_key(layer, h, side, "window." + name)] = _bytes(window[0, :, i])
    return out


def merge_ranks(dumps):
    """One {key: tensor} of several ranks' dumps (head keys and others alike); ValueError when a
    head key comes from two ranks. Keys that are not head keys (argmax, logits) are taken from
    the first dump that has them."""
    out = {}
    for dump in dumps:
        for key, value in dump.items():
            if key in out:
                if parse_head_key(key) is not None:
                    raise ValueError("%s is held by two ranks" % key)
                continue
            out[key] = value
    return out


# ---- On the GPU machine -------------------------------------------------------------------


def cache_head_bytes(cache):
    """head_bytes of every layer of a kvq.hf.Cache, sequence 0, the pages its history uses."""
    from kvq import torch_ops
    out = {}
    for l, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            raise ValueError("layer %d of %r was never updated" % (l, cache))
        page = layer.dims["page_size"]
        used = -(-layer.history_tokens(layer.length) // page)
        pages = layer.tables[0, :used].long()
        names = tuple([n for n, _, _ in torch_ops.pool_planes(layer.params, side)]
                      for side in ("key", "value"))
        out.update(head_bytes(l, cache.kv_heads, names, layer.pools, layer.windows, pages))
    return out


def calibration_for(spec, scheme):
    """The calibration file of `scheme` under --calibration's `spec`: a path (every scheme's),
    or comma-separated SCHEME=PATH entries (a scheme without an entry gets None)."""
    if not spec:
        return None
    if "=" not in spec:
        return spec
    entries = dict(item.split("=", 1) for item in spec.split(",") if item)
    return entries.get(scheme)


def build_cache(scheme, calibration, config, kv_heads, max_cache_len):
    """The kvq.hf.Cache every run of this program and its replay use (batch 1, the scheme's own
    or calib::SchemeOptions' windows)."""
    from kvq import hf
    return hf.Cache(scheme, calibration=calibration, config=config, kv_heads=kv_heads,
                    max_batch_size=1, max_cache_len=max_cache_len)


def record_inputs(cache):
    """Wraps each layer's update to keep the bf16 K/V rows it is handed (batch 0, on the CPU):
    returns {layer: ([K [Hkv, q, d] per call], [V ...])}."""
    import torch
    records = {}
    for l, layer in enumerate(cache.layers):
        records[l] = ([], [])

        def update(key_states, value_states, *args, _update=layer.update, _rows=records[l],
                   **kwargs):
            _rows[0].append(key_states[0].to(torch.bfloat16).cpu())
            _rows[1].append(value_states[0].to(torch.bfloat16).cpu())
            return _update(key_states, value_states, *args, **kwargs)
        layer.update = update
    return records


def input_rows(records, kv_heads):
    """{head_key(..., "inputs"): bf16 [T, d]} of record_inputs' records, per global head."""
    import torch
    out = {}
    for l, sides in records.items():
        for side, calls in zip("kv", sides):
            rows = torch.cat(calls, dim=1)  # [Hkv_local, T, d]
            for i, h in enumerate(kv_heads):
                # A contiguous copy of its own: safetensors refuses views sharing memory.
                out[head_key(l, h, side, "inputs")] = rows[i].clone(
                    memory_format=torch.contiguous_format)
    return out


def replay(scheme, calibration, config, inputs, prompt_length, max_cache_len, device):
    """A one-device cache over every KV head fed `inputs` ({head_key(l, h, side, "inputs"):
    bf16 [T, d]} for every layer and head): the prompt's prompt_length rows in one update, then
    one row per update, as a model run hands them."""
    import torch
    from kvq.hf import _config_dims
    num_layers, _, hkv, _ = _config_dims(config)
    cache = build_cache(scheme, calibration, config, None, max_cache_len)
    for l in range(num_layers):
        k, v = (torch.stack([inputs[head_key(l, h, side, "inputs")] for h in range(hkv)])[None]
                .to(device) for side in "kv")  # [1, Hkv, T, d]
        total = k.shape[2]
        for a, b in [(0, prompt_length)] + [(t, t + 1) for t in range(prompt_length, total)]:
            cache.update(k[:, :, a:b], v[:, :, a:b], l)
    return cache


def check_shards(model, checkpoint, heads, head_dim):
    """Raises unless every k_proj / v_proj weight's local shard is the checkpoint's rows of
    global KV heads `heads` (bit for bit): the rank's head range is the one the TP plan gave."""
    import torch
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    checked = 0
    for name, module in model.named_modules():
        if not name.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            continue
        weight = module.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        full = checkpoint(name + ".weight")
        if tuple(local.shape) != (rows.stop - rows.start, full.shape[1]) or \
                not torch.equal(local.detach().cpu(), full[rows].to(local.dtype)):
            raise RuntimeError("%s: the local shard %s is not rows [%d, %d) of the checkpoint's "
                               "%s (KV heads %s)" % (name, tuple(local.shape), rows.start,
                                                     rows.stop, tuple(full.shape), list(heads)))
        checked += 1
    if checked == 0:
        raise RuntimeError("no self_attn.k_proj / v_proj module found to check")
    return checked


def checkpoint_reader(model_dir):
    """name -> CPU tensor of the model folder's safetensors files."""
    import glob
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))

    def read(name):
        for path in files:
            with safe_open(path, "pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
        raise KeyError("%s is in none of %s" % (name, files))
    return read


def load_model(model_dir, world, local_rank):
    import torch
    import transformers
    from kvq import hf
    config_class = getattr(transformers, "DistributedConfig", None)
    if config_class is None:
        try:
            from transformers.distributed import DistributedConfig as config_class
        except ImportError:
            config_class = None
    kwargs = tp_load_kwargs(world, transformers.__version__, config_class)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=hf.ATTENTION, **kwargs)
    if world == 1:
        model = model.to("cuda:%d" % local_rank)
    return model.eval()


def run_scheme(model, scheme, calibration, heads, args):
    """The dump of one scheme on this rank: head bytes, inputs, argmax, logits."""
    import torch
    cache = build_cache(scheme, calibration, model.config, heads, args.max_cache_len)
    records = record_inputs(cache)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (1, args.prompt_length + args.steps), generator=g)
    ids = ids.to(model.device)
    argmax, logits = [], []
    with torch.no_grad():
        bounds = [(0, args.prompt_length)] + \
            [(t, t + 1) for t in range(args.prompt_length, args.prompt_length + args.steps)]
        for a, b in bounds:
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            step_logits = out.logits
            if hasattr(step_logits, "full_tensor"):  # a DTensor: lm_head's plan did not gather
                step_logits = step_logits.full_tensor()
            last = step_logits[0, -1].float()
            logits.append(last.cpu())
            argmax.append(int(last.argmax()))
    dump = cache_head_bytes(cache)
    dump = {k: v.cpu() for k, v in dump.items()}
    dump.update(input_rows(records, heads))
    dump["argmax"] = torch.tensor(argmax, dtype=torch.int64)
    dump["logits"] = torch.stack(logits)
    return dump


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a transformers model folder")
    parser.add_argument("--scheme", required=True, help="kvq scheme ids, comma-separated")
    parser.add_argument("--calibration", help="a kvq calibration file (for the schemes that "
                        "read one; the others ignore it), or SCHEME=PATH,... per scheme")
    parser.add_argument("--out", required=True, help="folder for <scheme>.rank<r>.safetensors")
    parser.add_argument("--prompt-length", type=int, default=400)
    parser.add_argument("--steps", type=int, default=16, help="one-token decode steps")
    parser.add_argument("--max-cache-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1, help="of the token ids")
    args = parser.parse_args(argv)
    if args.prompt_length < 2 or args.steps < 0 or \
            args.prompt_length + args.steps > args.max_cache_len:
        parser.error("need 2 <= --prompt-length, 0 <= --steps and their sum <= --max-cache-len")

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from kvq.hf import _config_dims

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if world > 1:
        dist.init_process_group(backend="nccl")
    try:
        model = load_model(args.model, world, local_rank)
        _, _, hkv, d = _config_dims(model.config)
        heads = rank_kv_heads(hkv, rank, world)
        check_shards(model, checkpoint_reader(args.model), heads, d)
        os.makedirs(args.out, exist_ok=True)
        for scheme in args.scheme.split(","):
            calibration = calibration_for(args.calibration, scheme)
            dump = run_scheme(model, scheme, calibration, heads, args)
            metadata = dict(scheme=scheme, rank=str(rank), world=str(world),
                            kv_heads=",".join(map(str, heads)),
                            prompt_length=str(args.prompt_length), steps=str(args.steps),
                            max_cache_len=str(args.max_cache_len),
                            calibration=str(calibration or ""))
            path = os.path.join(args.out, "%s.rank%d.safetensors" % (scheme, rank))
            save_file(dump, path, metadata=metadata)
            print("rank %d/%d, KV heads %s, %s: %d tensors to %s, argmax %s" % (
                rank, world, list(heads), scheme, len(dump), path, dump["argmax"].tolist()))
            sys.stdout.flush()
            torch.cuda.empty_cache()
        if world > 1:
            dist.barrier()
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
