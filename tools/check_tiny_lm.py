#!/usr/bin/env python3
"""Independent check of a committed kvq tiny model folder, with numpy only (no torch).

Reads model.safetensors (I8 matrices + BF16 NAME_scale, F32 norms), config.json and
golden.safetensors with its own safetensors parser, dequantizes (w = float32(q) * float32(s)),
runs a float64 forward (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU, tied head,
Qwen3 q_norm/k_norm when present) over the first --tokens positions of the golden windows and
compares the per-position NLL, the top-5 logits at the golden positions inside that range and
the post-RoPE q/k/v of layers 0 and L-1 with the golden file. Also checks the int8 rule
(|q| <= 127, BF16 [out] scales, every matrix present) and the file's metadata.

usage: python3 tools/check_tiny_lm.py calib/models/tiny-llama-a [--tokens 256] [--windows 4]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

DT = {"F32": np.float32, "I32": np.int32, "I8": np.int8, "BF16": np.uint16, "F16": np.float16,
      "U8": np.uint8}


def read_safetensors(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", {})
    out, spans = {}, []
    for k, v in h.items():
        s, e = v["data_offsets"]
        a = np.frombuffer(b[8 + n + s:8 + n + e], dtype=DT[v["dtype"]]).reshape(v["shape"])
        if v["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[k] = (v["dtype"], a)
        spans.append((s, e))
    spans.sort()
    assert spans[0][0] == 0 and all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)) \
        and spans[-1][1] == len(b) - 8 - n, "tensors do not tile the data buffer"
    return out, meta


def rmsnorm(x, w, eps):
    x32 = x.astype(np.float64)
    return w * (x32 / np.sqrt((x32 ** 2).mean(-1, keepdims=True) + eps))


def rot(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    raw, meta = read_safetensors(os.path.join(a.model_dir, "model.safetensors"))
    gold, gmeta = read_safetensors(os.path.join(a.model_dir, "golden.safetensors"))
    assert meta.get("format") == "kvq-model", meta
    assert cfg["kvq_weight_format"] == "int8-row"
    L, D, Hq, Hkv, hd = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], cfg["head_dim"])
    eps, theta, V = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"]
    W = {}
    n_i8 = 0
    for k, (dt, t) in raw.items():
        if k.endswith("_scale"):
            assert dt == "BF16" and t.ndim == 1, k
            continue
        if dt == "I8":
            sdt, s = raw[k + "_scale"]
            assert s.shape == (t.shape[0],) and int(np.abs(t.astype(np.int32)).max()) <= 127, k
            assert not (t == -128).any(), k
            W[k] = t.astype(np.float32) * s.astype(np.float32)[:, None]  # one fp32 multiply
            W[k] = W[k].astype(np.float64)
            n_i8 += 1
        else:
            assert dt == "F32" and t.ndim == 1, (k, dt)
            W[k] = t.astype(np.float64)
    assert "lm_head.weight" not in W
    qwen = "model.layers.0.self_attn.q_norm.weight" in W
    want = 1 + 7 * L
    assert n_i8 == want, (n_i8, want)
    print(f"{a.model_dir}: {len(raw)} tensors, {n_i8} int8 matrices, qwen3 norms {qwen}, "
          f"arch {meta.get('arch')}, source {meta.get('source')}")

    T = a.tokens
    ids = gold["input_ids"][1][:a.windows, :T]
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, hd, 2).astype(np.float32) / np.float32(hd)))
    f = np.arange(T, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    emb = np.concatenate([f, f], -1).astype(np.float64)
    cos, sin = np.cos(emb), np.sin(emb)
    worst = {"nll": 0.0, "top5": 0.0, "qkv": 0.0}
    for w in range(ids.shape[0]):
        x = W["model.embed_tokens.weight"][ids[w]]
        for l in range(L):
            p = f"model.layers.{l}."
            h = rmsnorm(x, W[p + "input_layernorm.weight"], eps)
            q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, Hq, hd)
            k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, hd)
            v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, hd)
            if qwen:
                q = rmsnorm(q, W[p + "self_attn.q_norm.weight"], eps)
                k = rmsnorm(k, W[p + "self_attn.k_norm.weight"], eps)
            q = q * cos[:, None] + rot(q) * sin[:, None]
            k = k * cos[:, None] + rot(k) * sin[:, None]
            if w == 0 and f"layers.{l}.q" in gold:
                n = min(T, gold[f"layers.{l}.q"][1].shape[0])
                for nm, t in zip("qkv", (q, k, v)):
                    g = gold[f"layers.{l}.{nm}"][1][:n].astype(np.float64)
                    worst["qkv"] = max(worst["qkv"], float(np.abs(t[:n] - g).max() / np.abs(g).max()))
            g = Hq // Hkv
            o = np.zeros((T, Hq, hd))
            mask = np.triu(np.ones((T, T), bool), 1)
            for hh in range(Hq):
                s = q[:, hh] @ k[:, hh // g].T / np.sqrt(hd)
                s[mask] = -np.inf
                s = np.exp(s - s.max(-1, keepdims=True))
                s /= s.sum(-1, keepdims=True)
                o[:, hh] = s @ v[:, hh // g]
            x = x + o.reshape(T, Hq * hd) @ W[p + "self_attn.o_proj.weight"].T
            h = rmsnorm(x, W[p + "post_attention_layernorm.weight"], eps)
            gt = h @ W[p + "mlp.gate_proj.weight"].T
            x = x + ((gt / (1 + np.exp(-gt))) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        x = rmsnorm(x, W["model.norm.weight"], eps)
        logits = x @ W["model.embed_tokens.weight"].T
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        nll = lse[:-1] - logits[np.arange(T - 1), ids[w, 1:]]
        gn = gold["nll"][1][w, :T - 1]
        worst["nll"] = max(worst["nll"], float(np.abs(nll - gn).max()))
        pos = gold["positions"][1]
        for j, pp in enumerate(pos):
            if pp < T:
                top = np.argsort(-logits[pp])[:5]
                gi, gv = gold["top5_ids"][1][w, j], gold["top5_logits"][1][w, j]
                worst["top5"] = max(worst["top5"], float(np.abs(logits[pp][gi] - gv).max()))
                if list(top) != list(gi):
                    print(f"  window {w} pos {pp}: top-5 ids {list(top)} vs golden {list(gi)} "
                          f"(logits {logits[pp][top]} vs {gv})")
        print(f"  window {w}: mean NLL over positions 0..{T - 2}: numpy {nll.mean():.6f}, golden "
              f"{gn.mean():.6f}; max |dNLL| {np.abs(nll - gn).max():.2e}")
    print(f"max |dNLL| {worst['nll']:.2e}, max |dlogit| at golden top-5 {worst['top5']:.2e}, "
          f"max rel diff of q/k/v {worst['qkv']:.2e}")
    ok = worst["nll"] < 1e-3 and worst["top5"] < 1e-3 and worst["qkv"] < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
