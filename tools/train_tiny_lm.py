#!/usr/bin/env python3
"""Train kvq's tiny reference language model in one GPU command (issue 16, training half).

One run, on a machine with one CUDA GPU, torch >= 2.5, tokenizers, transformers 5.x, safetensors
and numpy:

 1. corpus: English documents from the NUL-separated xz that tools/fetch_corpus.sh builds
    (Debian linux-doc-6.1 + dict-gcide) plus the Python source files found on the machine itself
    (stdlib + site-packages, 1..200 KB each, deduplicated by sha256, shuffled with a fixed seed,
    capped at --code-cap-mb). Held-out and calibration documents are set aside per domain BEFORE
    anything is trained (tokenizer included).
 2. tokenizer: byte-level BPE, vocabulary 8192, special token <|endoftext|> = id 0 (HF tokenizers).
 3. model: Llama-style (--arch llama) or Qwen3-style (--arch qwen3: per-head q/k RMSNorm before
    RoPE) decoder, trained with AdamW, bf16 autocast, torch.compile, lr warm-up then cosine decay
    in wall-clock time (or in tokens, whichever is further along, so that at most
    --max-epochs epochs of unique data are seen).
 4. export: weights quantized to int8 per row (symmetric, bf16 scale); the model is DEFINED as
    the dequantized weights w = float32(q) * float32(s). Everything after this step (validation
    loss, golden file, phenomena, HF export) uses the dequantized weights.
 5. golden: a Hugging Face {Llama,Qwen3}ForCausalLM loaded from the exported standard HF folder,
    fp32, eager attention, TF32 off: per-position NLL, top-5 logits at 64 positions and post-RoPE
    q/k/v of layers 0 and L-1; cross-checked against this script's own fp32 forward.
 6. tools/dump_activations.py (unchanged) is run on the exported HF folder and its q/k/v are
    compared with this script's own forward.
 7. phenomena card (phenomena.json): massive activations, attention sinks, key outliers, key
    mean energy, C_Q spectrum, per layer / head, on the held-out windows.

Outputs under --out (at most 8 files, each <= 16 MiB, because of the device tool): the model
folder's files are written to OUT/model/ and packed as OUT/bundle.tar (all small files) plus
OUT/model.safetensors.part0/1 (the int8 weights split in two); the log goes to
OUT/train_log.txt as it is written. Reassemble with `cat part0 part1 > model.safetensors`.

Other modes (no GPU needed):
  --export-hf DIR --from MODEL_DIR   write a standard HF folder (fp32 or --hf-dtype bf16
                                     safetensors, config.json, tokenizer files) from a committed
                                     int8 kvq model folder, e.g. for tools/dump_activations.py.

Example (the real runs):
  PYTHONUNBUFFERED=1 python3 .train/train_tiny_lm.py --arch llama --out $OUT \
      --corpus .corpus/english.txt.xz --time-budget 560
"""

import argparse
import datetime
import hashlib
import io
import json
import lzma
import math
import os
import random
import re
import shutil
import sys
import tarfile
import time

EOT = "<|endoftext|>"
T0 = time.time()
_LOG = None


def log(*args):
    msg = " ".join(str(a) for a in args)
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------

def english_docs(path):
    with lzma.open(path) as f:
        text = f.read().decode("utf-8")
    docs = [d for d in text.split("\0") if d.strip()]
    return docs


def english_source(doc):
    """Label only (for the metadata): gcide documents carry its bracketed source tags."""
    return "gcide" if re.search(r"\[(1913 Webster|WordNet|PJC)", doc[:4000]) else "linux-doc"


def python_roots():
    import site
    import sysconfig
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(p)
    try:
        roots.update(site.getsitepackages())
    except Exception:
        pass
    for base in ("/usr/lib", "/usr/local/lib"):
        if os.path.isdir(base):
            for n in os.listdir(base):
                if n.startswith("python3"):
                    roots.add(os.path.join(base, n))
    out = []
    for r in sorted(roots):
        r = os.path.realpath(r)
        if os.path.isdir(r) and not any(r == o or r.startswith(o + os.sep) for o in out):
            out = [o for o in out if not o.startswith(r + os.sep)] + [r]
    return sorted(out)


def code_docs(seed, min_bytes=1000, max_bytes=200_000):
    """Every distinct .py file (by content) of min..max bytes under the Python roots, shuffled."""
    roots = python_roots()
    paths = set()
    for r in roots:
        for dp, dns, fns in os.walk(r):
            dns.sort()
            for fn in fns:
                if fn.endswith(".py"):
                    p = os.path.join(dp, fn)
                    try:
                        if os.path.islink(p):
                            continue
                        sz = os.path.getsize(p)
                    except OSError:
                        continue
                    if min_bytes <= sz <= max_bytes:
                        paths.add(p)
    seen = set()
    files = []
    for p in sorted(paths):
        try:
            raw = open(p, "rb").read()
        except OSError:
            continue
        h = hashlib.sha256(raw).hexdigest()
        if h in seen:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "\0" in text:
            continue
        seen.add(h)
        files.append((p, h, text.replace("\r\n", "\n")))
    random.Random(seed).shuffle(files)
    return roots, len(paths), files


def build_windows(doc_iter, encode, eot_id, n_windows, seq):
    """Windows of `seq` ids: [eot] + one document (+ [eot] + next documents if it is short)."""
    windows, used = [], []
    cur, cur_docs = [], []
    for i, doc in doc_iter:
        ids = encode(doc)
        cur += [eot_id] + ids
        cur_docs.append(i)
        if len(cur) >= seq:
            windows.append(cur[:seq])
            used.append(cur_docs)
            cur, cur_docs = [], []
            if len(windows) == n_windows:
                break
    if len(windows) < n_windows:
        raise RuntimeError(f"only {len(windows)} of {n_windows} windows could be built")
    return windows, used


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------

def make_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):  # the HF Llama/Qwen3 formula
            dt = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dt)

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c
            d, hq, hkv, hd = c["d_model"], c["heads"], c["kv_heads"], c["head_dim"]
            self.q_proj = nn.Linear(d, hq * hd, bias=False)
            self.k_proj = nn.Linear(d, hkv * hd, bias=False)
            self.v_proj = nn.Linear(d, hkv * hd, bias=False)
            self.o_proj = nn.Linear(hq * hd, d, bias=False)
            if c["arch"] == "qwen3":
                self.q_norm = RMSNorm(hd, c["eps"])
                self.k_norm = RMSNorm(hd, c["eps"])

        def forward(self, x, cos, sin, collect=None, layer=None):
            c = self.c
            b, t, _ = x.shape
            hq, hkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
            q = self.q_proj(x).view(b, t, hq, hd)
            k = self.k_proj(x).view(b, t, hkv, hd)
            v = self.v_proj(x).view(b, t, hkv, hd)
            if c["arch"] == "qwen3":
                q = self.q_norm(q)
                k = self.k_norm(k)
            cs, sn = cos[None, :, None, :].to(q.dtype), sin[None, :, None, :].to(q.dtype)
            q = q * cs + rotate_half(q) * sn
            k = k * cs + rotate_half(k) * sn
            if collect is not None:
                collect[f"q{layer}"], collect[f"k{layer}"], collect[f"v{layer}"] = q, k, v
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            g = hq // hkv
            if g > 1:
                k = k[:, :, None].expand(b, hkv, g, t, hd).reshape(b, hq, t, hd)
                v = v[:, :, None].expand(b, hkv, g, t, hd).reshape(b, hq, t, hd)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, hq * hd))

    class MLP(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.gate_proj = nn.Linear(c["d_model"], c["intermediate"], bias=False)
            self.up_proj = nn.Linear(c["d_model"], c["intermediate"], bias=False)
            self.down_proj = nn.Linear(c["intermediate"], c["d_model"], bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.input_layernorm = RMSNorm(c["d_model"], c["eps"])
            self.self_attn = Attention(c)
            self.post_attention_layernorm = RMSNorm(c["d_model"], c["eps"])
            self.mlp = MLP(c)

        def forward(self, x, cos, sin, collect=None, layer=None):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, collect, layer)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.embed_tokens = nn.Embedding(c["vocab"], c["d_model"])
            self.layers = nn.ModuleList([Block(c) for _ in range(c["layers"])])
            self.norm = RMSNorm(c["d_model"], c["eps"])

    class TinyLM(nn.Module):
        """Parameter names are the HF Llama/Qwen3 names (model.*); the LM head is tied."""

        def __init__(self, c):
            super().__init__()
            self.c = c
            self.model = Inner(c)
            hd = c["head_dim"]
            inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
            self.register_buffer("inv_freq", inv, persistent=False)

        def rope(self, t, device):
            pos = torch.arange(t, device=device, dtype=torch.float32)
            f = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((f, f), dim=-1)
            return emb.cos(), emb.sin()

        def forward(self, idx, targets=None, collect=None):
            b, t = idx.shape
            cos, sin = self.rope(t, idx.device)
            x = self.model.embed_tokens(idx)
            for i, blk in enumerate(self.model.layers):
                x = blk(x, cos, sin, collect, i)
                if collect is not None:
                    collect[f"h{i}"] = x
            x = self.model.norm(x)
            logits = F.linear(x, self.model.embed_tokens.weight)
            if targets is None:
                return logits
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def init_weights(model, seed):
        g = torch.Generator().manual_seed(seed)
        n_layers = model.c["layers"]
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    std = 0.02 / math.sqrt(2 * n_layers)
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    return TinyLM, init_weights


# ----------------------------------------------------------------------------------------------
# int8 weights and HF export
# ----------------------------------------------------------------------------------------------

def quantize_rows(w):
    """Symmetric per-row int8: s = bf16(max|w_row|/127), q = clamp(round(w/s), -127, 127)."""
    import torch
    w = w.detach().float()
    s = (w.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    sf = s.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = torch.clamp(torch.round(w / safe[:, None]), -127, 127)
    q = torch.where(sf[:, None] > 0, q, torch.zeros_like(q)).to(torch.int8)
    return q, s


def dequantize_rows(q, s):
    import torch
    return q.to(torch.float32) * s.to(torch.float32)[:, None]


def hf_config(c, tok_eot):
    """config dict from transformers' own config class, plus rope_theta at top level."""
    common = dict(vocab_size=c["vocab"], hidden_size=c["d_model"], intermediate_size=c["intermediate"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                  num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"], hidden_act="silu",
                  max_position_embeddings=c["seq"], rms_norm_eps=c["eps"], tie_word_embeddings=True,
                  attention_bias=False, bos_token_id=tok_eot, eos_token_id=tok_eot,
                  initializer_range=0.02, use_cache=True)
    rope = {"rope_type": "default", "rope_theta": float(c["rope_theta"])}
    try:
        if c["arch"] == "llama":
            from transformers import LlamaConfig as Cfg
            extra = dict(mlp_bias=False)
        else:
            from transformers import Qwen3Config as Cfg
            extra = dict(use_sliding_window=False)
        try:
            cfg = Cfg(rope_parameters=rope, **common, **extra)
        except TypeError:
            cfg = Cfg(rope_theta=float(c["rope_theta"]), **common, **extra)
        d = cfg.to_dict()
    except ImportError:
        d = dict(common)
        d["model_type"] = c["arch"]
        d["rope_parameters"] = rope
    d["architectures"] = ["LlamaForCausalLM" if c["arch"] == "llama" else "Qwen3ForCausalLM"]
    d["model_type"] = c["arch"]
    d["rope_theta"] = float(c["rope_theta"])
    d["head_dim"] = c["head_dim"]
    d["num_key_value_heads"] = c["kv_heads"]
    d["tie_word_embeddings"] = True
    for junk in ("torch_dtype", "dtype", "_name_or_path", "id2label", "label2id",
                 "chunk_size_feed_forward", "output_attentions", "output_hidden_states",
                 "return_dict", "problem_type", "is_encoder_decoder", "pad_token_id",
                 "tf_legacy_loss", "torchscript", "pruned_heads", "add_cross_attention",
                 "cross_attention_hidden_size", "finetuning_task", "tokenizer_class", "prefix",
                 "sep_token_id", "decoder_start_token_id", "task_specific_params",
                 "use_bfloat16", "is_decoder", "output_scores", "return_dict_in_generate"):
        d.pop(junk, None)
    d.pop("transformers_version", None)
    return dict(sorted(d.items()))


def tokenizer_config(seq):
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
            "unk_token": None, "pad_token": None, "add_bos_token": False, "add_eos_token": False,
            "model_max_length": seq, "clean_up_tokenization_spaces": False}


def load_kvq_model(model_dir):
    """(config dict, {HF name: fp32 tensor} of the dequantized weights) of an int8 kvq folder."""
    import torch
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    raw = load_file(os.path.join(model_dir, "model.safetensors"))
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale"):
            continue
        if t.dtype == torch.int8:
            out[name] = dequantize_rows(t, raw[name + "_scale"])
        else:
            out[name] = t.to(torch.float32)
    return cfg, out


def export_hf(model_dir, hf_dir, dtype="float32"):
    """Standard HF folder (config.json, model.safetensors, tokenizer files) from a kvq folder."""
    import torch
    from safetensors.torch import save_file
    cfg, weights = load_kvq_model(model_dir)
    os.makedirs(hf_dir, exist_ok=True)
    cfg = dict(cfg)
    cfg.pop("kvq_weight_format", None)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    save_file({k: v.to(dt).contiguous() for k, v in sorted(weights.items())},
              os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(model_dir, "tokenizer.json"), os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(cfg.get("max_position_embeddings", 2048)), f, indent=2)
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")},
                  f, indent=2)
    return hf_dir


# ----------------------------------------------------------------------------------------------
# the training run
# ----------------------------------------------------------------------------------------------

def main_train(args):
    global _LOG
    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(args.out, exist_ok=True)
    mdir = os.path.join(args.out, "model")
    os.makedirs(mdir, exist_ok=True)
    _LOG = open(os.path.join(args.out, "train_log.txt"), "w")
    deadline = T0 + args.time_budget
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    log(f"train_tiny_lm.py arch={args.arch} seed={args.seed} time_budget={args.time_budget}s "
        f"date={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    log(f"argv: {' '.join(sys.argv)}")
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, python {sys.version.split()[0]}")
    try:
        import tokenizers as _t
        import transformers as _tr
        log(f"tokenizers {_t.__version__}, transformers {_tr.__version__}, numpy {np.__version__}")
    except Exception as e:  # pragma: no cover
        log(f"version probe failed: {e}")

    # ---- corpus --------------------------------------------------------------------------
    en = english_docs(args.corpus)
    en_bytes = sum(len(d.encode()) for d in en)
    log(f"english: {len(en)} docs, {en_bytes / 1e6:.1f} MB from {args.corpus}")
    roots, n_candidates, code = code_docs(args.seed)
    code_total = sum(len(t.encode()) for _, _, t in code)
    log(f"python roots: {roots}")
    log(f"python files: {n_candidates} of 1..200 KB, {len(code)} distinct, {code_total / 1e6:.1f} MB available")
    rng = random.Random(args.seed + 1)
    en_order = list(range(len(en)))
    rng.shuffle(en_order)
    code_order = list(range(len(code)))  # already shuffled with the seed

    # held-out windows need a tokenizer; documents are set aside first by count, generously,
    # then the windows are cut from them after the tokenizer exists. Documents reserved but not
    # used by the windows stay out of training too.
    n_hold_en, n_hold_code = args.holdout_docs_en, args.holdout_docs_code
    hold_en, train_en = en_order[:n_hold_en], en_order[n_hold_en:]
    hold_code, rest_code = code_order[:n_hold_code], code_order[n_hold_code:]
    cap = int(args.code_cap_mb * 1e6)
    train_code, acc = [], 0
    for i in rest_code:
        if acc >= cap:
            break
        train_code.append(i)
        acc += len(code[i][2].encode())
    log(f"held out (reserved): {len(hold_en)} English docs, {len(hold_code)} code files; "
        f"train: {len(train_en)} English docs, {len(train_code)} code files ({acc / 1e6:.1f} MB, cap {args.code_cap_mb} MB)")
    # manifest of every Python file used (train or reserved/held out)
    man = io.StringIO()
    man.write("# role\tsha256\tbytes\tpath\n")
    for role, idxs in (("heldout", hold_code), ("train", train_code)):
        for i in sorted(idxs, key=lambda j: code[j][0]):
            p, h, t = code[i]
            man.write(f"{role}\t{h}\t{len(t.encode())}\t{p}\n")
    with lzma.open(os.path.join(mdir, "code_manifest.tsv.xz"), "wt", preset=9) as f:
        f.write(man.getvalue())

    # ---- tokenizer -----------------------------------------------------------------------
    t_tok = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    srng = random.Random(args.seed + 2)
    sample = [en[i] for i in train_en if srng.random() < args.tok_sample] + \
             [code[i][2] for i in train_code if srng.random() < args.tok_sample]
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0 and tok.get_vocab_size() == args.vocab, (eot_id, tok.get_vocab_size())
    tok.save(os.path.join(mdir, "tokenizer.json"))
    log(f"tokenizer: byte-level BPE vocab {tok.get_vocab_size()}, eot id {eot_id}, trained on "
        f"{len(sample)} docs ({sum(len(s.encode()) for s in sample) / 1e6:.1f} MB) in {time.time() - t_tok:.1f}s")
    del sample

    fast = getattr(tok, "encode_batch_fast", None) or tok.encode_batch

    def enc(s):
        return tok.encode(s).ids

    # held-out / calibration windows (each: [eot] + doc (+ [eot] + more docs))
    S = args.seq
    nw = args.heldout_windows
    win_en, used_en = build_windows(((i, en[i]) for i in hold_en), enc, eot_id, nw + 4, S)
    win_code, used_code = build_windows(((i, code[i][2]) for i in hold_code), enc, eot_id, nw + 4, S)
    heldout_en, calib_en = win_en[:nw], win_en[nw:]
    heldout_code, calib_code = win_code[:nw], win_code[nw:]
    log(f"windows: heldout_en {len(heldout_en)}, heldout_code {len(heldout_code)}, calib 4+4; "
        f"English docs consumed {sum(len(u) for u in used_en)} of {len(hold_en)} reserved, code files "
        f"{sum(len(u) for u in used_code)} of {len(hold_code)}")

    # training stream
    t_enc = time.time()
    docs = [("en", i) for i in train_en] + [("code", i) for i in train_code]
    random.Random(args.seed + 3).shuffle(docs)
    parts, n_tok = {"en": 0, "code": 0}, 0
    chunks = []
    B = 2048
    for s in range(0, len(docs), B):
        batch = docs[s:s + B]
        texts = [en[i] if d == "en" else code[i][2] for d, i in batch]
        encs = fast(texts)
        for (d, _), e in zip(batch, encs):
            ids = e.ids
            parts[d] += len(ids) + 1
            chunks.append(np.asarray([eot_id] + ids, dtype=np.uint16))
    stream = np.concatenate(chunks)
    del chunks
    n_unique = int(stream.size)
    log(f"train stream: {n_unique / 1e6:.2f}M tokens (English {parts['en'] / 1e6:.2f}M = "
        f"{en_bytes and sum(len(en[i].encode()) for i in train_en) / max(parts['en'], 1):.2f} B/tok, "
        f"code {parts['code'] / 1e6:.2f}M = {acc / max(parts['code'], 1):.2f} B/tok), "
        f"tokenized in {time.time() - t_enc:.1f}s")

    # ---- model ---------------------------------------------------------------------------
    c = dict(arch=args.arch, vocab=args.vocab, d_model=args.d_model, layers=args.layers,
             heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
             intermediate=args.intermediate, eps=1e-5, rope_theta=args.rope_theta, seq=S)
    TinyLM, init_weights = make_model_classes()
    model = TinyLM(c)
    init_weights(model, args.seed)
    model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel()
    log(f"model {args.arch}: {json.dumps(c)}; {n_params / 1e6:.3f}M params "
        f"({(n_params - n_emb) / 1e6:.3f}M non-embedding)")
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    nodecay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    cmodel = torch.compile(model)

    data = torch.from_numpy(stream.astype(np.int32)).to(dev)
    n_chunks = (n_unique - 1) // S
    offs = torch.arange(S + 1, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 4)
    max_tokens = int(args.max_epochs * n_chunks * S)
    heldout_t = {"en": torch.tensor(heldout_en, dtype=torch.int64, device=dev),
                 "code": torch.tensor(heldout_code, dtype=torch.int64, device=dev)}

    def quick_val(m, n=4):
        out = {}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for dname, w in heldout_t.items():
                x = w[:n]
                out[dname] = float(m(x[:, :-1], x[:, 1:]))
        return out

    # train until the wall clock (minus the post-training reserve) or max_epochs is reached
    train_end = deadline - args.post_reserve
    perm, pos, epoch_i = torch.randperm(n_chunks, generator=gen), 0, 0
    step, tokens_seen = 0, 0
    t_start = None
    t_first = time.time()
    losses = []
    loss_acc = torch.zeros((), device=dev)
    loss_n = 0
    log(f"training: batch {args.batch}x{S}, {n_chunks} chunks per epoch, lr {args.lr} warmup "
        f"{args.warmup} steps, cosine to {args.lr_min_frac} of peak in wall clock until "
        f"{train_end - T0:.0f}s or {args.max_epochs} epochs ({max_tokens / 1e6:.0f}M tokens)")
    model.train()
    progress, time_progress = 0.0, 0.0
    while True:
        if tokens_seen + args.batch * S > max_tokens:  # never more than max_epochs of unique data
            log(f"stopping: the next step would pass {args.max_epochs} epochs")
            break
        progress = max(time_progress, tokens_seen / max_tokens)
        if pos + args.batch > n_chunks:
            perm, pos, epoch_i = torch.randperm(n_chunks, generator=gen), 0, epoch_i + 1
        idx = perm[pos:pos + args.batch].to(dev, non_blocking=True)
        pos += args.batch
        xy = data[idx[:, None] * S + offs[None, :]].long()
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            lr = args.lr * (args.lr_min_frac + (1 - args.lr_min_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cmodel(xy[:, :-1], xy[:, 1:])
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += loss.detach()
        loss_n += 1
        step += 1
        tokens_seen += args.batch * S
        if step == 1:
            torch.cuda.synchronize()
            t_start = time.time()
            tokens_at_start = tokens_seen
            log(f"step 1 (torch.compile + first step) took {t_start - t_first:.1f}s, loss {loss.item():.4f}")
            loss_acc.zero_()
            loss_n = 0
            continue
        if step % args.log_every == 0:
            lv = (loss_acc / loss_n).item()  # synchronizes
            losses.append((step, tokens_seen, lv))
            loss_acc.zero_()
            loss_n = 0
            now = time.time()
            el = now - t_start
            tps = (tokens_seen - tokens_at_start) / el
            time_progress = (now - t_start) / max(train_end - t_start, 1e-6)
            progress = max(time_progress, tokens_seen / max_tokens)
            extra = ""
            if step % (args.log_every * args.val_every) == 0:
                v = quick_val(model)  # eager: a new shape would make the compiled model recompile
                extra = f" | val4 en {v['en']:.4f} code {v['code']:.4f}"
            log(f"step {step:5d} tok {tokens_seen / 1e6:8.1f}M ep {tokens_seen / (n_chunks * S):5.3f} "
                f"lr {lr:.2e} loss {lv:.4f} gnorm {float(gn):.3f} {tps / 1e6:.3f}M tok/s{extra}")
            if progress >= 1.0:
                break
    if loss_n > 0:
        lv = (loss_acc / loss_n).item()
        losses.append((step, tokens_seen, lv))
        log(f"step {step:5d} tok {tokens_seen / 1e6:8.1f}M ep {tokens_seen / (n_chunks * S):5.3f} "
            f"lr {lr:.2e} loss {lv:.4f} (mean of the last {loss_n} steps)")
    torch.cuda.synchronize()
    t_train = time.time() - t_start
    tps = (tokens_seen - tokens_at_start) / t_train
    epochs = tokens_seen / (n_chunks * S)
    final_train = float(np.mean([l for _, _, l in losses[-5:]]))
    log(f"training done: {step} steps, {tokens_seen / 1e6:.1f}M tokens seen, {epochs:.3f} epochs of "
        f"{n_chunks * S / 1e6:.2f}M unique tokens, {t_train:.1f}s after step 1, {tps / 1e6:.3f}M tok/s; "
        f"final train loss (mean of last 5 logs = last {5 * args.log_every} steps) {final_train:.4f}")
    del opt, data
    torch.cuda.empty_cache()

    # ---- evaluation before and after int8 ------------------------------------------------
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model.eval()

    def val_fp32(m):
        res = {}
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            for dname, w in heldout_t.items():
                tot = []
                for i in range(w.shape[0]):
                    x = w[i:i + 1]
                    logits = m(x[:, :-1])
                    nll = F.cross_entropy(logits[0].float(), x[0, 1:], reduction="none")
                    tot.append(nll)
                res[dname] = torch.stack(tot)  # [n, S-1]
        return res

    v_pre = val_fp32(model)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    qsd, deq = {}, {}
    for k, v in sd.items():
        if v.dim() == 2:
            q, s = quantize_rows(v)
            qsd[k], qsd[k + "_scale"] = q, s
            deq[k] = dequantize_rows(q, s)
        else:
            qsd[k] = v.float()
            deq[k] = v.float()
    worst = max(float(((deq[k] - sd[k]).abs().max() / sd[k].abs().max())) for k in sd if sd[k].dim() == 2)
    with torch.no_grad():
        for k, p in model.state_dict().items():
            p.copy_(deq[k].to(dev))
    v_post = val_fp32(model)
    val = {d: float(v_post[d].mean()) for d in v_post}
    log(f"int8 per-row quantization: worst max|w-deq|/max|w| over matrices {worst:.2e}")
    for d in ("en", "code"):
        log(f"val loss fp32 ({d}, {heldout_t[d].shape[0]} windows x {S - 1} positions): trained "
            f"weights {float(v_pre[d].mean()):.4f}, dequantized int8 {float(v_post[d].mean()):.4f} "
            f"(ppl {math.exp(float(v_post[d].mean())):.3f})")

    # ---- write the model folder ----------------------------------------------------------
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    source = f"tools/train_tiny_lm.py {args.source} {date}".strip()
    cfg = hf_config(c, eot_id)
    cfg["kvq_weight_format"] = "int8-row"
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
    save_file(dict(sorted(qsd.items())), os.path.join(mdir, "model.safetensors"),
              metadata={"format": "kvq-model", "arch": args.arch, "source": source,
                        "weight_format": "int8-row: matrices I8 [out,in] + NAME_scale BF16 [out]; "
                                         "w = float32(q) * float32(scale); norms F32; lm_head tied "
                                         "to model.embed_tokens.weight"})
    tok_meta = {"format": "kvq-tokens", "eos_id": str(eot_id), "bos_id": str(eot_id),
                "eos_token": EOT, "seq": str(S), "source": source,
                "calib": "rows 0-3 English, rows 4-7 Python code (held-out documents, never trained on)",
                "heldout_en": "English (linux-doc-6.1 + dict-gcide) held-out documents",
                "heldout_code": "Python source files of the GPU image, held out",
                "window": "each row = [eos] + one document's tokens, further documents appended as "
                          "[eos] + doc when it is shorter, truncated to seq",
                "heldout_en_sources": ",".join(english_source(en[u[0]]) for u in used_en[:nw]),
                "calib_en_sources": ",".join(english_source(en[u[0]]) for u in used_en[nw:]),
                "heldout_code_paths": ",".join(code[u[0]][0] for u in used_code[:nw]),
                "calib_code_paths": ",".join(code[u[0]][0] for u in used_code[nw:])}
    tokens = {"calib": torch.tensor(calib_en + calib_code, dtype=torch.int32),
              "heldout_en": torch.tensor(heldout_en, dtype=torch.int32),
              "heldout_code": torch.tensor(heldout_code, dtype=torch.int32)}
    save_file(tokens, os.path.join(mdir, "tokens.safetensors"), metadata=tok_meta)

    # ---- HF export, golden from HF, cross-check with own forward -------------------------
    hf_dir = os.path.join("/tmp", f"kvq_hf_{args.arch}")
    export_hf(mdir, hf_dir, "float32")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                              attn_implementation="eager").to(dev).eval()
    log(f"HF model loaded from {hf_dir}: {type(hf).__name__}, tied "
        f"{hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()}")
    gold_in = torch.cat([heldout_t["en"][0:2], heldout_t["code"][0:2]], 0)  # [4, S]
    last = c["layers"] - 1
    caught = {}

    def hook_for(li):
        mod = hf.model.layers[li].self_attn

        def hook(m, a, kw):
            h = kw.get("hidden_states", a[0] if a else None)
            cs, sn = kw.get("position_embeddings", a[1] if len(a) > 1 else None)
            b, t = h.shape[:2]
            hd = c["head_dim"]
            q = m.q_proj(h).view(b, t, -1, hd)
            k = m.k_proj(h).view(b, t, -1, hd)
            v = m.v_proj(h).view(b, t, -1, hd)
            if hasattr(m, "q_norm"):
                q, k = m.q_norm(q), m.k_norm(k)
            cs, sn = cs.unsqueeze(2), sn.unsqueeze(2)
            rh = lambda x: torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1)
            caught[li] = (q * cs + rh(q) * sn, k * cs + rh(k) * sn, v)
        return mod.register_forward_pre_hook(hook, with_kwargs=True)

    handles = [hook_for(0), hook_for(last)]
    with torch.no_grad():
        hf_logits = hf(input_ids=gold_in, use_cache=False).logits.float()  # [4, S, V]
    for h in handles:
        h.remove()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        col = {}
        own_logits = model(gold_in, collect=col).float()
    nll = F.cross_entropy(hf_logits[:, :-1].reshape(-1, args.vocab), gold_in[:, 1:].reshape(-1),
                          reduction="none").view(4, S - 1)
    own_nll = F.cross_entropy(own_logits[:, :-1].reshape(-1, args.vocab), gold_in[:, 1:].reshape(-1),
                              reduction="none").view(4, S - 1)
    positions = torch.arange(0, S, S // 64)[:64]
    top_v, top_i = hf_logits[:, positions].topk(5, dim=-1)
    rel = float((hf_logits - own_logits).norm() / hf_logits.norm())
    log(f"golden: HF eager fp32 vs own fp32 forward: logits rel diff {rel:.2e}, max |dlogit| "
        f"{float((hf_logits - own_logits).abs().max()):.2e}, max |dNLL| {float((nll - own_nll).abs().max()):.2e}; "
        f"mean NLL per window {[round(float(x), 4) for x in nll.mean(1)]}")
    golden = {"input_ids": gold_in.to(torch.int32).cpu(), "nll": nll.cpu().contiguous(),
              "mean_nll": nll.mean(1).cpu().contiguous(), "positions": positions.to(torch.int32),
              "top5_ids": top_i.to(torch.int32).cpu().contiguous(),
              "top5_logits": top_v.cpu().contiguous()}
    qkv_diff = 0.0
    for li in (0, last):
        q, k, v = caught[li]
        for nm, x in zip("qkv", (q, k, v)):
            golden[f"layers.{li}.{nm}"] = x[0, :256].float().cpu().contiguous()
            own = col[f"{nm}{li}"][0, :256].float()
            qkv_diff = max(qkv_diff, float((own - x[0, :256]).abs().max() / x[0, :256].abs().max()))
    log(f"golden q/k/v (layers 0 and {last}, window 0, positions 0..255): HF hook vs own forward "
        f"max rel diff {qkv_diff:.2e}")
    gmeta = {"format": "kvq-golden", "source": source, "arch": args.arch,
             "definition": (
                 "PyTorch fp32 forward of the model defined by the DEQUANTIZED int8 weights "
                 "(w = float32(q)*float32(scale)), transformers "
                 f"{__import__('transformers').__version__} {type(hf).__name__}, "
                 "attn_implementation=eager, TF32 off, on CUDA; input_ids [4, S] = "
                 "tokens.heldout_en[0:2] then tokens.heldout_code[0:2]; nll[w, p] = -log softmax("
                 "logits[w, p])[input_ids[w, p+1]] for p = 0..S-2; mean_nll[w] = mean over p; "
                 "top5_ids/top5_logits [4, 64, 5]: the 5 largest fp32 logits (descending) at "
                 "positions[j] = 32*j (the logits predicting token positions[j]+1); layers.{l}.q "
                 "[256, Hq, d], layers.{l}.k / .v [256, Hkv, d]: window 0 (heldout_en[0]), "
                 "positions 0..255 of the full-window forward, post-RoPE q and k (after q_norm/"
                 "k_norm for qwen3), v as projected, for l = 0 and L-1"),
             "windows": "heldout_en[0], heldout_en[1], heldout_code[0], heldout_code[1]",
             "layers_with_qkv": f"0,{last}", "own_forward_logits_rel_diff": f"{rel:.3e}"}
    save_file(golden, os.path.join(mdir, "golden.safetensors"), metadata=gmeta)

    # ---- tools/dump_activations.py, unchanged, on the exported HF folder -----------------
    dump_ok = "not run"
    try:
        sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
        import dump_activations
        pool = [code[i][2] for i in hold_code] if args.dump_domain == "code" else [en[i] for i in hold_en]
        text = next(t for t in reversed(pool) if len(t) >= 4000)[:6000]  # a reserved, unused doc
        tf = "/tmp/kvq_dump_prompt.txt"
        with open(tf, "w") as f:
            f.write(text)
        dump_out = "/tmp/kvq_dump.safetensors"
        rc = dump_activations.main(["--model", hf_dir, "--text-file", tf, "--tokens", "320",
                                    "--calib-tokens", "160", "--dtype", "f32", "--torch-dtype",
                                    "float32", "--out", dump_out])
        from safetensors import safe_open
        hf_tok = AutoTokenizer.from_pretrained(hf_dir)
        ids_auto = hf_tok(text)["input_ids"][:320]
        ids_own = tok.encode(text).ids[:320]
        with safe_open(dump_out, "pt") as f:
            meta = f.metadata()
            dq = {k: f.get_tensor(k) for k in f.keys()}
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            col2 = {}
            model(torch.tensor([ids_own], device=dev), collect=col2)
        dmax = 0.0
        for li in range(c["layers"]):
            for nm in "qkv":
                a, b_ = dq[f"layers.{li}.{nm}"].float(), col2[f"{nm}{li}"][0].float().cpu()
                dmax = max(dmax, float((a - b_).abs().max() / b_.abs().max()))
        dump_ok = (f"rc {rc}, {len(dq)} tensors, tokens {meta.get('tokens')}, rope_base "
                   f"{meta.get('rope_base')}, AutoTokenizer ids == own tokenizer ids: "
                   f"{ids_auto == ids_own}, max rel diff vs own forward {dmax:.2e}")
    except Exception as e:  # report, do not lose the run
        import traceback
        traceback.print_exc()
        dump_ok = f"FAILED: {type(e).__name__}: {e}"
    log(f"dump_activations.py on the exported HF folder: {dump_ok}")
    del hf, hf_logits, own_logits
    torch.cuda.empty_cache()

    # ---- phenomena card ------------------------------------------------------------------
    tk = tok
    L, Hq, hd = c["layers"], c["heads"], c["head_dim"]
    card = {"model": f"tiny-{args.arch}", "source": source,
            "definitions": {
                "windows": "tokens.heldout_en (24) and tokens.heldout_code (24), each [eos]+document, "
                           "fp32 forward of the dequantized weights",
                "residual": "hidden state after block l (the residual stream); max |x| over all "
                            "windows/positions/dims with its position, token and dim; median |x| over all entries",
                "sink": "per head: attention probability on key position 0, mean over query positions "
                        "1..S-1 and windows (softmax(q k^T/sqrt(d)) with causal mask, post-RoPE)",
                "k_max_over_median": "max |k| / median |k| over all entries of the post-RoPE keys",
                "k_mean_energy": "||E k||^2 / E||k - E k||^2, E over all tokens of all windows, "
                                 "post-RoPE keys, per KV head (averaged if several)",
                "cq": "C_Q = mean over the KV head's query heads and all tokens of q^T q (post-RoPE, "
                      "d x d, fp64); top_over_mean = lambda_1 / mean(lambda); top8_share = sum of "
                      "the 8 largest / trace"}, "layers": []}
    stats = {}
    mask = torch.ones(S, S, dtype=torch.bool, device=dev).triu(1)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for dname, w in heldout_t.items():
            st = {li: {"rmax": -1.0, "rarg": None, "rabs": [], "sink": torch.zeros(Hq, dtype=torch.float64),
                       "kabs": [], "ksum": torch.zeros(c["kv_heads"], hd, dtype=torch.float64),
                       "ksq": torch.zeros(c["kv_heads"], dtype=torch.float64), "kn": 0,
                       "cq": torch.zeros(c["kv_heads"], hd, hd, dtype=torch.float64), "qn": 0}
                  for li in range(L)}
            for wi in range(w.shape[0]):
                x = w[wi:wi + 1]
                col = {}
                model(x, collect=col)
                for li in range(L):
                    s = st[li]
                    h = col[f"h{li}"][0].abs()  # [S, D]
                    m = float(h.max())
                    if m > s["rmax"]:
                        flat = int(h.argmax())
                        p, dm = divmod(flat, h.shape[1])
                        s["rmax"], s["rarg"] = m, (wi, p, dm, int(x[0, p]))
                    s["rabs"].append(h.flatten()[::7].cpu())  # subsample for the median
                    q = col[f"q{li}"][0].transpose(0, 1)  # [Hq, S, d]
                    k = col[f"k{li}"][0].transpose(0, 1)  # [Hkv, S, d]
                    g = Hq // c["kv_heads"]
                    kk = k.repeat_interleave(g, 0)
                    sc = (q @ kk.transpose(1, 2)) / math.sqrt(hd)
                    pr = sc.masked_fill(mask, float("-inf")).softmax(-1)
                    s["sink"] += pr[:, 1:, 0].mean(1).double().cpu()
                    s["kabs"].append(k.abs().flatten()[::3].cpu())
                    kd = k.double()
                    s["ksum"] += kd.sum(1).cpu()
                    s["ksq"] += (kd ** 2).sum((1, 2)).cpu()
                    s["kn"] += S
                    qd = q.double().reshape(c["kv_heads"], g * S, hd)
                    s["cq"] += (qd.transpose(1, 2) @ qd).cpu()
                    s["qn"] += g * S
                    s["kmax"] = max(s.get("kmax", 0.0), float(k.abs().max()))
            stats[dname] = st
    for li in range(L):
        entry = {"layer": li}
        for dname in ("en", "code"):
            s = stats[dname][li]
            nwin = heldout_t[dname].shape[0]
            wi, p, dm, tid = s["rarg"]
            med = float(torch.cat(s["rabs"]).median())
            kmed = float(torch.cat(s["kabs"]).median())
            mean = s["ksum"] / s["kn"]  # [Hkv, d]
            mean_e = (mean ** 2).sum(1)
            var_e = s["ksq"] / s["kn"] - mean_e  # E||k||^2 - ||Ek||^2 per head (summed over heads in ksq)
            cq = s["cq"] / s["qn"]
            ev = torch.linalg.eigvalsh(cq)  # ascending, [Hkv, d]
            entry[dname] = {
                "residual_max_abs": s["rmax"], "residual_median_abs": med,
                "residual_max_over_median": s["rmax"] / med,
                "residual_max_at": {"window": wi, "position": p, "dim": dm, "token_id": tid,
                                    "token": tk.decode([tid], skip_special_tokens=False)},
                "sink_per_head": [round(float(v) / nwin, 5) for v in s["sink"]],
                "k_max_abs": s["kmax"], "k_median_abs": kmed, "k_max_over_median": s["kmax"] / kmed,
                "k_mean_energy": float((mean_e.sum() / var_e.sum()) if c["kv_heads"] == 1
                                       else (mean_e / (var_e / 1)).mean()),
                "cq_top_over_mean": [float(e[-1] / e.mean()) for e in ev],
                "cq_top8_share": [float(e[-8:].sum() / e.sum()) for e in ev]}
        card["layers"].append(entry)
    with open(os.path.join(mdir, "phenomena.json"), "w") as f:
        json.dump(card, f, indent=1)
    log("phenomena card (per layer; en | code):")
    for e in card["layers"]:
        a, b_ = e["en"], e["code"]
        log(f"  L{e['layer']}: resid max/med {a['residual_max_over_median']:.1f} (max {a['residual_max_abs']:.1f} "
            f"pos {a['residual_max_at']['position']} dim {a['residual_max_at']['dim']} tok {a['residual_max_at']['token']!r})"
            f" | {b_['residual_max_over_median']:.1f} (pos {b_['residual_max_at']['position']} dim {b_['residual_max_at']['dim']});"
            f" sink {a['sink_per_head']} | {b_['sink_per_head']}; maxK/medK {a['k_max_over_median']:.1f} | "
            f"{b_['k_max_over_median']:.1f}; Kmean {a['k_mean_energy']:.3f} | {b_['k_mean_energy']:.3f}; "
            f"CQ l1/mean {a['cq_top_over_mean'][0]:.1f} | {b_['cq_top_over_mean'][0]:.1f}, top8 "
            f"{a['cq_top8_share'][0]:.3f} | {b_['cq_top8_share'][0]:.3f}")

    # ---- summary + packing ---------------------------------------------------------------
    summary = {"arch": args.arch, "config": c, "params": n_params, "steps": step,
               "tokens_seen": tokens_seen, "unique_train_tokens": n_chunks * S, "epochs": epochs,
               "train_seconds_after_step1": t_train, "tokens_per_s": tps,
               "final_train_loss": final_train,
               "val_loss_fp32_dequant": val,
               "val_loss_fp32_trained": {d: float(v_pre[d].mean()) for d in v_pre},
               "stream_tokens": {"en": parts["en"], "code": parts["code"]},
               "code_bytes_train": acc, "english_docs_train": len(train_en),
               "code_files_train": len(train_code), "golden_mean_nll": [float(x) for x in nll.mean(1)],
               "golden_own_rel_diff": rel, "dump_activations": dump_ok,
               "loss_curve": losses, "device": torch.cuda.get_device_name(0),
               "date": date, "total_seconds": time.time() - T0}
    with open(os.path.join(mdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"total {time.time() - T0:.1f}s; summary: " + json.dumps({k: v for k, v in summary.items() if k != 'loss_curve'}))
    msz = os.path.getsize(os.path.join(mdir, "model.safetensors"))
    with open(os.path.join(mdir, "model.safetensors"), "rb") as f:
        blob = f.read()
    half = (len(blob) + 1) // 2
    for i, part in enumerate((blob[:half], blob[half:])):
        with open(os.path.join(args.out, f"model.safetensors.part{i}"), "wb") as f:
            f.write(part)
    log(f"model.safetensors {msz} bytes, sha256 {hashlib.sha256(blob).hexdigest()}, split in 2 parts")
    log("done")
    _LOG.flush()
    shutil.copy(os.path.join(args.out, "train_log.txt"), os.path.join(mdir, "train_log.txt"))
    with tarfile.open(os.path.join(args.out, "bundle.tar"), "w") as tf_:
        for n in sorted(os.listdir(mdir)):
            if n != "model.safetensors":
                tf_.add(os.path.join(mdir, n), arcname=n)
    shutil.rmtree(mdir)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    p.add_argument("--out", help="output folder (training mode)")
    p.add_argument("--corpus", default=".corpus/english.txt.xz")
    p.add_argument("--time-budget", type=float, default=560.0,
                   help="seconds from start by which the whole script should end")
    p.add_argument("--post-reserve", type=float, default=60.0,
                   help="seconds kept after training for evaluation and export")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="", help="provenance string for the metadata (git commit)")
    p.add_argument("--code-cap-mb", type=float, default=420.0)
    p.add_argument("--tok-sample", type=float, default=0.25, help="fraction of training docs for the BPE")
    p.add_argument("--holdout-docs-en", type=int, default=80)
    p.add_argument("--holdout-docs-code", type=int, default=150)
    p.add_argument("--heldout-windows", type=int, default=24)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--lr-min-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-epochs", type=float, default=4.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--val-every", type=int, default=10, help="quick val every N logs")
    p.add_argument("--dump-domain", choices=["en", "code"], default="en")
    p.add_argument("--export-hf", metavar="DIR", help="write a standard HF folder and exit")
    p.add_argument("--from", dest="from_dir", metavar="MODEL_DIR", help="int8 kvq model folder")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    if args.export_hf:
        if not args.from_dir:
            p.error("--export-hf needs --from MODEL_DIR")
        export_hf(args.from_dir, args.export_hf, args.hf_dtype)
        print(f"wrote {args.export_hf} from {args.from_dir}")
        return 0
    if not args.out:
        p.error("--out is required for training")
    main_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
