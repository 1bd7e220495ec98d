#!/usr/bin/env python3
"""Capture post-RoPE q, k, v of a Hugging Face causal LM into a kvq activation file.

The file follows spec/formats.md section 4: tensors ``layers.{l}.q`` [T, Hq, d] and
``layers.{l}.k`` / ``layers.{l}.v`` [T, Hkv, d], metadata ``format = kvq-activations``,
``version``, ``source``, ``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim``,
``rope_base``, ``tokens``, ``calib_tokens``. ``kvq calibrate`` and ``kvq eval`` read it.

How the capture works (Llama, Qwen2, Qwen3 and other models whose attention module has
q_proj / k_proj / v_proj and receives ``position_embeddings = (cos, sin)``, as in transformers
4.48+ and 5.x): a forward pre-hook on every attention module takes its inputs (the normalised
hidden states and the (cos, sin) the model computed) and recomputes what the module computes
before attention: the projections, Qwen3's per-head q_norm / k_norm when present, and
rotate-half RoPE. Where the module's Python namespace has ``apply_rotary_pos_emb`` (it does
in these models), the script also wraps it during the forward pass and checks that the model's
own post-RoPE q and k equal the recomputation bit for bit, so a model whose attention differs
is reported instead of silently mis-captured.

Example:
  python3 tools/dump_activations.py --model Qwen/Qwen3-0.6B --text-file prompt.txt \
      --tokens 4096 --calib-tokens 2048 --out acts.safetensors
"""

import argparse
import contextlib
import sys

KVQ_FORMAT = "kvq-activations"
KVQ_VERSION = 1


def rotate_half(x):
    half = x.shape[-1] // 2
    return __import__("torch").cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_modules(model):
    """[(layer_index, module)] of every attention block, sorted by layer index."""
    found = []
    for module in model.modules():
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "layer_idx")):
            found.append((int(module.layer_idx), module))
    found.sort(key=lambda item: item[0])
    if not found:
        raise ValueError("no attention module with q_proj/k_proj/v_proj/layer_idx found")
    indices = [i for i, _ in found]
    if indices != list(range(len(found))):
        raise ValueError(f"attention layer indices are not 0..L-1: {indices}")
    return [m for _, m in found]


def rope_base_of(config):
    """RoPE base from a transformers 4.x (rope_theta) or 5.x (rope_parameters) config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def head_dim_of(module, config):
    d = getattr(module, "head_dim", None)
    if d is None:
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(d)


def recompute_qkv(module, hidden_states, position_embeddings, head_dim):
    """The module's post-RoPE q [B, T, Hq, d], k and v [B, T, Hkv, d] from its inputs."""
    cos, sin = position_embeddings
    if cos.shape[-1] != head_dim:
        raise ValueError(f"partial RoPE (cos has {cos.shape[-1]} of {head_dim} dims) is not "
                         "supported")
    b, t = hidden_states.shape[:2]
    q = module.q_proj(hidden_states).view(b, t, -1, head_dim)
    k = module.k_proj(hidden_states).view(b, t, -1, head_dim)
    v = module.v_proj(hidden_states).view(b, t, -1, head_dim)
    if hasattr(module, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
        q = module.q_norm(q)
    if hasattr(module, "k_norm"):
        k = module.k_norm(k)
    cos = cos.unsqueeze(2)  # [B, T, 1, d]: broadcast over heads
    sin = sin.unsqueeze(2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


@contextlib.contextmanager
def model_rope_probe(module, records):
    """Wraps the module namespace's apply_rotary_pos_emb (if any) to record its outputs."""
    namespace = sys.modules.get(type(module).__module__)
    original = getattr(namespace, "apply_rotary_pos_emb", None) if namespace else None
    if original is None:
        yield False
        return

    def probe(q, k, *args, **kwargs):
        q_out, k_out = original(q, k, *args, **kwargs)
        records.append((q_out.detach(), k_out.detach()))  # [B, H, T, d]
        return q_out, k_out

    setattr(namespace, "apply_rotary_pos_emb", probe)
    try:
        yield True
    finally:
        setattr(namespace, "apply_rotary_pos_emb", original)


def capture(model, input_ids, calib_tokens, source, storage="bf16"):
    """Runs one forward pass and returns (tensors, metadata, report).

    tensors: {"layers.{l}.q": [T, Hq, d], ...} CPU tensors of the storage dtype (bf16, f16, f32).
    report: {"verified_layers": n, "probe": bool} from the apply_rotary_pos_emb cross-check.
    """
    import torch

    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    if storage not in dtypes:
        raise ValueError(f"storage dtype {storage!r} (bf16, f16 or f32)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {list(input_ids.shape)}")
    tokens = int(input_ids.shape[1])
    if not 1 <= calib_tokens < tokens:
        raise ValueError(f"calib_tokens {calib_tokens} must lie in [1, {tokens})")
    config = model.config
    modules = attention_modules(model)
    captured = {}
    handles = []

    def make_hook(index, module):
        d = head_dim_of(module, config)

        def hook(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            pos = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if hidden is None or pos is None:
                raise RuntimeError(f"layer {index}: attention received no hidden_states or "
                                   "position_embeddings; this transformers version computes "
                                   "RoPE inside the module, which this script does not support")
            with torch.no_grad():
                captured[index] = recompute_qkv(mod, hidden, pos, d)

        return hook

    for index, module in enumerate(modules):
        handles.append(module.register_forward_pre_hook(make_hook(index, module),
                                                        with_kwargs=True))
    records = []
    try:
        with model_rope_probe(modules[0], records) as probing, torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    num_layers = len(modules)
    if sorted(captured) != list(range(num_layers)):
        raise RuntimeError(f"captured layers {sorted(captured)} of {num_layers}")
    verified = 0
    if probing and not records:
        probing = False  # the module calls RoPE through another name (kernelized): unverified
    if probing:
        if len(records) != num_layers:
            raise RuntimeError(f"apply_rotary_pos_emb ran {len(records)} times for "
                               f"{num_layers} layers")
        for index, (q_model, k_model) in enumerate(records):
            q, k, _ = captured[index]
            if not (torch.equal(q_model.transpose(1, 2), q) and
                    torch.equal(k_model.transpose(1, 2), k)):
                diff = (k_model.transpose(1, 2) - k).abs().max().item()
                raise RuntimeError(f"layer {index}: recomputed post-RoPE q/k differ from the "
                                   f"model's own (max |dk| = {diff})")
            verified += 1

    tensors = {}
    q0, k0, _ = captured[0]
    hq, hkv, d = q0.shape[2], k0.shape[2], q0.shape[3]
    if hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    for index in range(num_layers):
        for name, x in zip("qkv", captured[index]):
            x = x[0].to(torch.float32)
            if not torch.isfinite(x).all():
                raise ValueError(f"layer {index} {name} holds non-finite values")
            tensors[f"layers.{index}.{name}"] = x.to(dtypes[storage]).contiguous().cpu()
    metadata = {
        "format": KVQ_FORMAT,
        "version": str(KVQ_VERSION),
        "source": source,
        "num_layers": str(num_layers),
        "num_q_heads": str(hq),
        "num_kv_heads": str(hkv),
        "head_dim": str(d),
        "rope_base": repr(rope_base_of(config)),
        "tokens": str(tokens),
        "calib_tokens": str(calib_tokens),
    }
    return tensors, metadata, {"verified_layers": verified, "probe": probing}


def save(path, tensors, metadata):
    from safetensors.torch import save_file

    save_file(dict(sorted(tensors.items())), path, metadata=metadata)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model name or local path")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    parser.add_argument("--text-file", help="text to tokenize (default: seeded random token ids)")
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length T")
    parser.add_argument("--calib-tokens", type=int, default=0,
                        help="first tokens used for calibration (default T/2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"],
                        help="stored dtype")
    parser.add_argument("--torch-dtype", default="bfloat16",
                        help="dtype the model runs in (bfloat16, float16, float32)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model,
                                                 dtype=getattr(torch, args.torch_dtype))
    model.to(args.device).eval()
    if args.text_file:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with open(args.text_file, encoding="utf-8") as f:
            ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : args.tokens]
        source = f"{args.model} text={args.text_file}"
    else:
        generator = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=generator)
        source = f"{args.model} random_tokens seed={args.seed}"
    calib = args.calib_tokens or ids.shape[1] // 2
    tensors, metadata, report = capture(model, ids.to(args.device), calib, source, args.dtype)
    save(args.out, tensors, metadata)
    print(f"wrote {args.out}: {metadata['num_layers']} layers, T={metadata['tokens']}, "
          f"Hq={metadata['num_q_heads']} Hkv={metadata['num_kv_heads']} d={metadata['head_dim']}"
          f", rope_base={metadata['rope_base']}; model RoPE cross-check on "
          f"{report['verified_layers']} layers")
    return 0


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
