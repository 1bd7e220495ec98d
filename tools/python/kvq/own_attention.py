"""Attention judged over the target's own codes (spec/verdicts.md §7).

For an attention case whose history is quantized, a target with write() and an attend() taking
a `history` keyword is replayed as follows: the history rows of the queried sequence (the
case's original bf16 rows at positions S0 .. S0 + H - 1) are written by target.write, one KV
head at a time (with that head's rotation, clip ratio and fp8 scale), and handed to
attend(cache, seq, q, history={"key": [planes of head 0, ...], "value": [...], "key_params":
[the kvq.WriteParams each head was written with], "value_params": [...]}); the sink and the
recent window stay kvq's (cache). The reference is an fp64 attention over the same
history, dequantized here from the target's own codes and metadata (through the Adapter), so
quantization error cancels and the tolerance is the arithmetic's alone: a per-channel bound
derived from the unit roundoffs the target declares (Arithmetic), not the quantization-sized
tolerance of the case.
"""
import inspect

import numpy as np

from ._arrays import as_numpy
from ._errors import error
from ._kvq import WriteParams, run_stage
from .verdicts import IDENTITY, bf16_value, e4m3_values

__all__ = ["Arithmetic", "SAFETY", "accepts_history", "judge"]

_UNIT = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp64": 2.0 ** -53}
# The bound is first order in the unit roundoffs; SAFETY covers the second-order terms and the
# few roundings folded into the constants (exp, the division by l) with room to spare.
SAFETY = 2.0
_E4M3 = e4m3_values()


class Arithmetic:
    """The precisions a target's decode step computes in, each 'fp32', 'bf16', 'fp16' or
    'fp64' (its unit roundoff u: 2^-24, 2^-8, 2^-11, 2^-53). Declared as the target's
    `arithmetic` attribute; the default is fp32 throughout (kvq's CPU oracle).

    operands: q (and q~) and the key and value rows as the products read them;
    logits: the stored logits s; probabilities: the stored p (or exp(s - m)) fed to P.V;
    output: the stored output o; accumulate: the sums (dot products, l, P.V)."""

    def __init__(self, operands="fp32", logits="fp32", probabilities="fp32", output="fp32",
                 accumulate="fp32"):
        values = dict(operands=operands, logits=logits, probabilities=probabilities,
                      output=output, accumulate=accumulate)
        for name, value in values.items():
            if value not in _UNIT:
                raise error("Arithmetic %s '%s' is not one of %s" % (
                    name, value, ", ".join(_UNIT)), "invalid argument")
        self.names = values
        self.u = {name: _UNIT[value] for name, value in values.items()}

    def as_dict(self):
        return dict(self.names)


def accepts_history(attend):
    """True when attend() takes a `history` keyword (the own-codes protocol)."""
    try:
        return "history" in inspect.signature(attend).parameters
    except (TypeError, ValueError):
        return False


def _slot_rows(case):
    """{slot: [row index of in.k / in.v per position]} after the case's script (in.ops):
    0 adds a slot, 1 prefills `tokens` rows, 2 appends one, 3 removes the slot; rows are taken
    in order (conformance/README.md, 'A cache script')."""
    rows, next_row = {}, 0
    for op, slot, tokens in case.inputs["ops"].tolist():
        if op == 0:
            rows[slot] = []
        elif op == 1:
            rows[slot] += list(range(next_row, next_row + tokens))
            next_row += tokens
        elif op == 2:
            rows[slot].append(next_row)
            next_row += 1
        elif op == 3:
            rows.pop(slot, None)
    return rows


def _head_params(side, case, kv, head):
    """The write parameters of KV head `head` of side `kv`: the side's, with the head's clip
    ratio (in.clip_k / in.clip_v) and fp8 scale (in.scale_k / in.scale_v) when the case has
    them."""
    suffix = "k" if kv == "key" else "v"
    clip = case.inputs.get("clip_" + suffix)
    scale = case.inputs.get("scale_" + suffix)
    return WriteParams(format=side.format, head_dim=side.head_dim, group=side.group,
                       bits=side.bits, clip=float(clip[head]) if clip is not None else side.clip,
                       rotation=side.rotation, hadamard_block=side.hadamard_block,
                       bitrev=side.bitrev, norm=side.norm, norm_heads=side.norm_heads,
                       head_scale=float(scale[head]) if scale is not None
                       else side.head_scale)


def _dequantize(p, planes, adapter, n):
    """float64 [n, d]: the target's history rows from its own planes (rotated space), exact:
    q*s + m (or s*(q - z)) with its metadata as it returned it, times its norm; fp8: s^*e4m3."""
    d = p.head_dim
    codes = adapter.codes(p, planes, n)
    if p.format == "fp8_e4m3":
        return float(p.head_scale) * _E4M3[np.clip(codes, 0, 255)]
    scale = adapter.metadata_values(planes, "scale")
    if p.format == "affine_tile":
        expand = lambda m: np.repeat(m.reshape(n // p.tile_tokens, d), p.tile_tokens, 0)  # noqa
    else:
        expand = lambda m: np.repeat(m.reshape(n, d // p.group), p.group, 1)  # noqa: E731
    if adapter.zero_point:
        rows = expand(scale) * (codes - expand(adapter.zero_values(planes)))
    else:
        rows = codes * expand(scale) + expand(adapter.metadata_values(planes, "min"))
    if p.norm:
        rows = rows * bf16_value(as_numpy(planes["norm"])).astype(np.float64).reshape(n, 1)
    return rows


def _rotate_query(p, q, rotation):
    """float64 [d]: q~ = q rotated by the key side's write-path stages (kvq's fp32 bits)."""
    x = q.astype(np.float32).reshape(1, -1)
    if p.rotation == "dense":
        x = run_stage("rotate_dense", p, {"x": x, "r": rotation}, 1)["y"]
    elif p.rotation == "hadamard":
        x = run_stage("fwht", p, {"x": x}, 1)["y"]
    if p.bitrev:
        x = run_stage("bitrev", p, {"x": x}, 1)["y"]
    return x.reshape(-1).astype(np.float64)


def _inverse(p, rotation):
    """float64 [d, d] M with o = o~ @ M: P_br (when asked) then R^T, or H (spec/numerics.md
    §3.4), in fp64."""
    d = p.head_dim
    m = np.eye(d)
    if p.bitrev:
        bits = d.bit_length() - 1
        beta = [int(format(j, "0%db" % bits)[::-1], 2) for j in range(d)]
        m = np.zeros((d, d))
        m[beta, np.arange(d)] = 1.0
    if p.rotation == "dense":
        m = m @ rotation.astype(np.float64).T
    elif p.rotation == "hadamard":
        hb = p.hadamard_block or d
        i = np.arange(hb)
        block = np.array([[(-1.0) ** bin(a & b).count("1") for b in i] for a in i]) / np.sqrt(hb)
        m = m @ np.kron(np.eye(d // hb), block)
    return m


def _bf16_rows(bits):
    return bf16_value(bits).astype(np.float64)


def judge(target, case, adapter=None, arithmetic=None):
    """(failure message or None, note): the target's attention over its own history written
    by target.write, per query, against the fp64 reference over that history within the
    derived bound (spec/verdicts.md §7). Raises NotImplementedError for what the protocol does
    not cover (a norm spanning several KV heads, a codebook side, a bf16 cache), kvq.Error for
    planes the adapter cannot read."""
    adapter = adapter or getattr(target, "adapter", None) or IDENTITY
    arithmetic = arithmetic or getattr(target, "arithmetic", None) or Arithmetic()
    u = arithmetic.u
    cache = case.cache()
    params = cache.params
    if not params["quantized"]:
        raise NotImplementedError("own codes: a bf16 cache has no history codes")
    for kv in ("key", "value"):
        if params[kv].norm and params[kv].norm_heads > 1:
            raise NotImplementedError("own codes: a %s norm spanning %d KV heads" % (
                kv, params[kv].norm_heads))
        if params[kv].format == "codebook":  # its rows are not q*s + m: no derived bound yet
            raise NotImplementedError("own codes: a %s codebook side (the bound covers the "
                                      "affine and fp8 formats)" % kv)
    hkv, hq, d = params["num_kv_heads"], params["num_q_heads"], params["head_dim"]
    scale = float(params["softmax_scale"])
    slots = _slot_rows(case)
    raw = {"key": case.inputs["k"], "value": case.inputs["v"]}
    worst = 0.0
    for query, slot in enumerate(case.inputs["query_slots"].tolist()):
        seq = case.query_sequence(cache, query)
        positions = slots[slot]
        t, s0 = cache.length(seq), cache.sink_length(seq)
        h_len, recent = cache.history_length(seq), cache.recent_begin(seq)
        if len(positions) != t or not np.array_equal(
                cache.sink(seq, "key"), raw["key"][positions[:s0]]) or not np.array_equal(
                cache.recent(seq, "value"), raw["value"][positions[recent:]]):
            raise error("own codes: the script of %s does not give sequence %d's rows"
                        % (case.name, seq), "mismatch")
        history = {"key": [], "value": [], "key_params": [], "value_params": []}
        rows = {"key": [], "value": []}
        for kv in ("key", "value"):
            for head in range(hkv):
                p = _head_params(params[kv], case, kv, head)
                rotation = cache.rotation(kv, head)
                x = _bf16_rows(raw[kv][positions[s0:s0 + h_len], head]).astype(np.float32)
                planes = {} if h_len == 0 else dict(target.write(p, x.copy(), rotation))
                history[kv].append(planes)
                history[kv + "_params"].append(p)
                rows[kv].append(np.zeros((0, d)) if h_len == 0
                                else _dequantize(p, planes, adapter, h_len))
        q = case.inputs["q"][query]
        out = as_numpy(target.attend(cache, seq, q.copy(), history=history))
        out = np.asarray(out, np.float64).reshape(hq, d)
        for h in range(hq):
            g = h // (hq // hkv)
            kp, vp = (_head_params(params[kv], case, kv, g) for kv in ("key", "value"))
            ref, bound = _reference(
                q[h].astype(np.float64), _rotate_query(kp, q[h], cache.rotation("key", g)),
                [_bf16_rows(cache.sink(seq, kv)[:, g]) for kv in ("key", "value")],
                [rows["key"][g], rows["value"][g]],
                [_bf16_rows(cache.recent(seq, kv)[:, g]) for kv in ("key", "value")],
                _inverse(vp, cache.rotation("value", g)), scale, u)
            err = np.abs(out[h] - ref)
            if not np.isfinite(out[h]).all():
                j = int(np.argmin(np.isfinite(out[h])))
                return ("attention output over the target's own codes is %r at query %d, "
                        "head %d, channel %d" % (float(out[h, j]), query, h, j)), None
            ratio = err / bound
            j = int(np.argmax(ratio))
            worst = max(worst, float(ratio[j]))
            if ratio[j] > 1:
                return ("attention over the target's own codes out of the arithmetic bound at "
                        "query %d, head %d, channel %d: got %.9g, fp64 reference %.9g, |diff| "
                        "%.3g > bound %.3g (%s)" % (query, h, j, out[h, j], ref[j], err[j],
                                                    bound[j], _describe(arithmetic))), None
    return None, "own codes: max |o - ref| / bound %.3g (%s)" % (worst, _describe(arithmetic))


def _describe(arithmetic):
    return ", ".join("%s %s" % kv for kv in arithmetic.names.items())


def _reference(q, q_rot, sink, history, recent, inverse, scale, u):
    """(o float64 [d], bound float64 [d]) for one query head: the fp64 decode step over
    sink / history / recent key and value rows (history in the rotated space, read with q~,
    its values mapped back by `inverse`), and the per-channel arithmetic bound of
    spec/verdicts.md §7 times SAFETY. q~ is kvq's (the write path's spec'd bits, as in
    spec/cache.md §5): a target's own rotation of q is not part of the bound."""
    d = q.size
    keys_win = np.concatenate([sink[0], recent[0]])
    values_win = np.concatenate([sink[1], recent[1]])
    logits = np.concatenate([scale * keys_win @ q, scale * history[0] @ q_rot])
    magnitude = np.concatenate([scale * np.abs(keys_win) @ np.abs(q),
                                scale * np.abs(history[0]) @ np.abs(q_rot)])
    n_win, T = keys_win.shape[0], logits.size
    weights = np.exp(logits - logits.max())
    p = weights / weights.sum()
    o_hist_rot = p[n_win:] @ history[1]
    o = p[:n_win] @ values_win + o_hist_rot @ inverse
    # Logit error: q and k rounded to the operand precision (2 u_op), d products summed and
    # the scale multiplied (d + 2 roundings of the accumulator), the stored logit (u_s).
    e_logit = ((2 * u["operands"] + (d + 2) * u["accumulate"]) * magnitude +
               u["logits"] * np.abs(logits)).max()
    # Relative error of each p times its value: the two logit errors that move p_t (its own and,
    # through l, the largest), p's storage, the value operand, exp and the division, and the
    # T-term sums of l and of P.V (T u_acc each).
    rel = 2 * e_logit + u["probabilities"] + u["operands"] + (2 * T + 4) * u["accumulate"]
    bound_win = rel * (p[:n_win] @ np.abs(values_win))
    bound_rot = rel * (p[n_win:] @ np.abs(history[1]))
    bound_hist = bound_rot @ np.abs(inverse) + (d * u["accumulate"]) * (
        np.abs(o_hist_rot) @ np.abs(inverse))
    bound = SAFETY * (bound_win + bound_hist + u["output"] * np.abs(o)) + 2.0 ** -126
    return o, bound
