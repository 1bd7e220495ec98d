#!/usr/bin/env python3
"""Tests of tools/dump_activations.py on small randomly initialised models (no download).

For a Llama-style, a Qwen2-style (q/k/v biases) and a Qwen3-style (per-head q_norm/k_norm)
model built from a config: dump the activations of a seeded random token sequence, read the file
back, check shapes and metadata against spec/formats.md section 4, and check q, k, v of one layer
against an independent recomputation: the layer's input from output_hidden_states, its
input_layernorm, the projections, and RoPE with cos/sin computed here from rope_base (not the
model's rotary module). If a kvq binary is given (--kvq or build*/tools/kvq), `kvq info` must
accept the file.

Usage: python3 tools/tests/dump_activations_test.py --out DIR   (prints PASS/FAIL lines; exit
status 0 only if every check passes).
"""

import argparse
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import dump_activations  # noqa: E402

FAILURES = []


def check(name, condition, detail=""):
    print(f"{'PASS' if condition else 'FAIL'} {name}{(': ' + detail) if detail else ''}")
    if not condition:
        FAILURES.append(name)


def tiny_models():
    import torch
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=2048)
    specs = [("llama", "LlamaConfig", "LlamaForCausalLM", 10000.0),
             ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", 1000000.0),
             ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", 1000000.0)]
    for name, config_class, model_class, base in specs:
        if not hasattr(tf, config_class):
            print(f"SKIP {name}: transformers {tf.__version__} has no {config_class}")
            continue
        config = getattr(tf, config_class)(rope_theta=base, **common)
        # transformers 5.x keeps RoPE settings in rope_parameters; set the base there as well.
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict):
            params["rope_theta"] = base
        torch.manual_seed(0)
        model = getattr(tf, model_class)(config).to(torch.float32).eval()
        # Random init gives tiny projections; scale them so RoPE and the norms matter.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
        yield name, model, base


def independent_layer(model, input_ids, layer, base):
    """q, k, v [T, H, d] of `layer` recomputed without the model's rotary module."""
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        decoder = model.model.layers[layer]
        attn = decoder.self_attn
        x = decoder.input_layernorm(out.hidden_states[layer])[0]  # [T, hidden]
        d = dump_activations.head_dim_of(attn, model.config)
        t = x.shape[0]
        q = attn.q_proj(x).view(t, -1, d)
        k = attn.k_proj(x).view(t, -1, d)
        v = attn.v_proj(x).view(t, -1, d)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(torch.float32)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(torch.float32)[:, None, :]
        half = d // 2
        rot = lambda y: torch.cat((-y[..., half:], y[..., :half]), dim=-1)  # noqa: E731
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin, v


def find_kvq(explicit):
    if explicit:
        return explicit
    root = os.path.dirname(os.path.dirname(HERE))
    for path in sorted(glob.glob(os.path.join(root, "build*", "tools", "kvq"))):
        if os.access(path, os.X_OK):
            return path
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="folder for the dumped files")
    parser.add_argument("--kvq", help="kvq binary to read the files back (optional)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    from safetensors import safe_open

    kvq = find_kvq(args.kvq)
    tokens, calib = 300, 128
    for name, model, base in tiny_models():
        generator = torch.Generator().manual_seed(7)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
        tensors, metadata, report = dump_activations.capture(model, ids, calib,
                                                             f"test {name}", storage="f32")
        check(f"{name} model apply_rotary_pos_emb equals the capture",
              report["verified_layers"] == 3 or not report["probe"],
              f"verified {report['verified_layers']} layers, probe={report['probe']}")
        path = os.path.join(args.out, f"{name}.safetensors")
        dump_activations.save(path, tensors, metadata)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            names = sorted(f.keys())
            loaded = {n: f.get_tensor(n) for n in names}
        expected_meta = {"format": "kvq-activations", "version": "1", "source": f"test {name}",
                         "num_layers": "3", "num_q_heads": "8", "num_kv_heads": "2",
                         "head_dim": "64", "tokens": str(tokens), "calib_tokens": str(calib)}
        check(f"{name} metadata", all(meta.get(k) == v for k, v in expected_meta.items()) and
              float(meta["rope_base"]) == base, str(meta))
        expected_names = sorted(f"layers.{l}.{x}" for l in range(3) for x in "qkv")
        check(f"{name} tensor names", names == expected_names, str(names))
        shapes_ok = all(
            list(loaded[f"layers.{l}.{x}"].shape) == [tokens, 8 if x == "q" else 2, 64] and
            loaded[f"layers.{l}.{x}"].dtype == torch.float32 for l in range(3) for x in "qkv")
        check(f"{name} shapes [T, H, d] and dtype F32", shapes_ok)
        q_ref, k_ref, v_ref = independent_layer(model, ids, 1, base)
        for label, ref in (("k", k_ref), ("q", q_ref), ("v", v_ref)):
            got = loaded[f"layers.1.{label}"]
            err = (got - ref).abs().max().item()
            scale = ref.abs().max().item()
            check(f"{name} layer 1 {label} = RoPE(proj(norm(x))) recomputed independently",
                  err <= 1e-5 * max(scale, 1.0), f"max abs diff {err:.3g} (max |ref| {scale:.3g})")
        # RoPE really was applied: position 0 is unrotated, later positions are not.
        k_plain = independent_layer_unrotated(model, ids, 1)
        moved = (loaded["layers.1.k"][5:] - k_plain[5:]).abs().max().item()
        check(f"{name} keys are post-RoPE", moved > 1e-3 and
              (loaded["layers.1.k"][0] - k_plain[0]).abs().max().item() <= 1e-5,
              f"max change from RoPE {moved:.3g}")
        bf16_tensors, _, _ = dump_activations.capture(model, ids, calib, f"test {name}", "bf16")
        check(f"{name} bf16 storage", bf16_tensors["layers.0.k"].dtype == torch.bfloat16)
        if kvq:
            run = subprocess.run([kvq, "info", path], capture_output=True, text=True)
            check(f"{name} kvq info reads the file", run.returncode == 0,
                  (run.stdout + run.stderr).strip().splitlines()[0] if (run.stdout + run.stderr)
                  else "")
    try:
        dump_activations.capture(next(tiny_models())[1], torch.zeros(1, 10, dtype=torch.long),
                                 10, "bad")
        check("calib_tokens == tokens is rejected", False)
    except ValueError:
        check("calib_tokens == tokens is rejected", True)
    print("PASS all" if not FAILURES else f"FAIL {len(FAILURES)} checks: {FAILURES}")
    return 0 if not FAILURES else 1


def independent_layer_unrotated(model, input_ids, layer):
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        decoder = model.model.layers[layer]
        attn = decoder.self_attn
        x = decoder.input_layernorm(out.hidden_states[layer])[0]
        d = dump_activations.head_dim_of(attn, model.config)
        k = attn.k_proj(x).view(x.shape[0], -1, d)
        return attn.k_norm(k) if hasattr(attn, "k_norm") else k


if __name__ == "__main__":
    sys.exit(main())
