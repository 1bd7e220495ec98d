"""Cache cases replayed through a target's cache write (spec/cache.md; conformance/README.md,
'A cache script').

A cache case is a script of operations on kvq's paged cache: add a sequence, prefill it with n
tokens, append one token per decode step, remove it. The target gets
    params   the cache parameters, a dict as kvq.Cache.params gives it (num_kv_heads,
             num_q_heads, head_dim, sink S0, recent W, flush F, page_size P, softmax_scale,
             quantized, key and value: kvq.WriteParams) plus pages: the pool's page count
    heads    {"key": {"params": [kvq.WriteParams of each KV head: the side's with the head's
             clip ratio and fp8 scale], "rotation": float32 [Hkv, d, d] (dense) or None,
             "widths": uint8 [Hkv, d/2] where a codebook side holds per-head widths},
             "value": {...}}
    script   the operations in order, each a dict: op ("add", "prefill", "append" or "remove")
             and slot (sequences are slots 0, 1, ... in the order they are added); prefill and
             append add position (the sequence's length before the step) and key, value: bf16
             bits uint16 [tokens, Hkv, d] (append: one token); every step but add carries
             page_table: int32, the sequence's pages after the step (history token i lives in
             page page_table[i // P], slot i % P; remove: the pages it frees)
and returns what it wrote: {"key": {plane: array}, "value": {plane: array}} (the whole pool,
each plane [pages, heads per page, rows per page, elements] as kvq.Cache.pool gives it: pages
start zeroed, a removed sequence's pages are zeroed, so every slot not in use holds zeros),
"sink": {slot: {"key": bf16 [sink rows, Hkv, d], "value": ...}} and "recent": {slot: {...}}
(bf16 [rows, Hkv, d], positions in order, not in ring order) for each live slot; a bf16 cache
(format bf16 on both sides) has no pool and returns "dense": {slot: {"key": bf16 [t, Hkv, d],
"value": ...}} instead.

The page tables are kvq's allocation (a page is taken when the history reaches it: the most
recently freed first, else a new one), so the pool is laid out as kvq's. The verdict compares
what `kvq conform` compares, in its order, with its comparator (conformance::CompareBits):
pool_pages (the harness's allocation), every plane of the key then the value pool, then per
live slot its shape (length, sink rows, history = length - sink rows - recent rows, first recent
position: from the windows the target returned), page table (the harness's), and its windows
(key sink, key recent, value sink, value recent; or dense key, dense value). The first
difference fails the case; a pool mismatch also says which sequence, history token and position
the slot holds.
"""
import numpy as np

from ._arrays import as_numpy
from ._errors import error
from ._kvq import replay_cache

__all__ = ["judge", "oracle_write_cache", "script_of"]

_OPS = {0: "add", 1: "prefill", 2: "append", 3: "remove"}
_CODES = {name: code for code, name in _OPS.items()}


def _history_tokens(params, t):
    """H(t) = F floor(max(0, t - S0 - W) / F) (spec/cache.md §2); 0 for a bf16 cache."""
    if not params["quantized"]:
        return 0
    flush = params["flush"]
    return flush * (max(0, t - params["sink"] - params["recent"]) // flush)


class _Script:
    """A case's script as the target gets it, with the harness's bookkeeping: lengths[slot]
    and tables[slot] after the script (None once removed), pages created, the free stack."""

    def __init__(self, case):
        self.cache = case.cache()  # kvq's own replay: the parameters and the per-head data
        p = self.cache.params
        self.params = dict(p)
        hkv, d, page = p["num_kv_heads"], p["head_dim"], p["page_size"]
        self.heads = {kv: {"params": [self.cache.head_params(kv, h) for h in range(hkv)],
                           "rotation": _rotations(self.cache, kv, hkv)}
                      for kv in ("key", "value")}
        if self.params["quantized"]:  # the other per-head arrays (the codebook widths)
            for kv in ("key", "value"):
                for name, rows in self.cache.head_arrays(kv).items():
                    if name != "rotation":
                        self.heads[kv][name] = np.array(rows)
        k, v = case.inputs["k"].reshape(-1, hkv, d), case.inputs["v"].reshape(-1, hkv, d)
        self.steps, self.lengths, self.tables = [], {}, {}
        self.pages, free, next_row = 0, [], 0
        for code, slot, tokens in case.inputs["ops"].tolist():
            op = _OPS.get(code)
            if op is None:
                raise error("case %s: op code %d is not one of %s" % (case.name, code, _OPS),
                            "malformed file")
            step = dict(op=op, slot=slot)
            if op == "add":
                self.lengths[slot], self.tables[slot] = 0, []
            elif op == "remove":
                step["page_table"] = np.array(self.tables[slot], np.int32)
                free.extend(self.tables[slot])  # pushed in table order, popped from the end
                self.tables[slot] = None
            else:
                t0 = self.lengths[slot]
                self.lengths[slot] = t0 + tokens
                table = self.tables[slot]
                need = -(-_history_tokens(p, t0 + tokens) // page)
                while len(table) < need:
                    if free:
                        table.append(free.pop())
                    else:
                        table.append(self.pages)
                        self.pages += 1
                step.update(position=t0, key=k[next_row:next_row + tokens].copy(),
                            value=v[next_row:next_row + tokens].copy(),
                            page_table=np.array(table, np.int32))
                next_row += tokens
            self.steps.append(step)
        self.free = len(free)
        self.params["pages"] = self.pages

    def live_slots(self):
        return [s for s in sorted(self.tables) if self.tables[s] is not None]


def _rotations(cache, kv, hkv):
    """float32 [Hkv, d, d] of a dense side, else None (a bf16 cache has none)."""
    if not cache.params["quantized"]:
        return None
    matrices = [cache.rotation(kv, h) for h in range(hkv)]
    return None if matrices[0] is None else np.stack(matrices).astype(np.float32)


def script_of(case):
    """(params, heads, script): what a cache case hands target.write_cache (see the module's
    docstring)."""
    s = _Script(case)
    return s.params, s.heads, s.steps


def oracle_write_cache(params, heads, script):
    """kvq's own answer to a cache script: the script run through kvq's scalar cache
    (kvq.replay_cache) and read back in the form write_cache returns."""
    hkv, d = params["num_kv_heads"], params["head_dim"]
    ops, keys, values = [], [], []
    for step in script:
        rows = step.get("key")
        ops.append((_CODES[step["op"]], step["slot"], 0 if rows is None else len(rows)))
        if rows is not None:
            keys.append(as_numpy(rows).reshape(-1, hkv, d))
            values.append(as_numpy(step["value"]).reshape(-1, hkv, d))
    empty = np.zeros((0, hkv, d), np.uint16)
    cache = replay_cache(params, heads, np.array(ops, np.int32).reshape(-1, 3),
                         np.concatenate(keys) if keys else empty,
                         np.concatenate(values) if values else empty)
    slots = {step["slot"] for step in script if step["op"] == "add"} - {
        step["slot"] for step in script if step["op"] == "remove"}
    # kvq's cache allocates its own pages: it serves only scripts whose page tables are its.
    for step in script:
        if step["slot"] in slots and "page_table" in step:
            last = list(as_numpy(step["page_table"]))
            if last != list(cache.page_table(step["slot"]))[:len(last)]:
                raise error("the script's page tables %s (slot %d) are not kvq's allocation %s"
                            % (last, step["slot"], cache.page_table(step["slot"])),
                            "invalid argument")
    if not params["quantized"]:
        # A bf16 cache keeps every row in one run: the sink's rows, then the rest.
        return {"dense": {s: {kv: np.concatenate([cache.sink(s, kv), cache.recent(s, kv)])
                              for kv in ("key", "value")} for s in slots}}
    out = {kv: {name: np.array(plane) for name, plane in cache.pool(kv).items()}
           for kv in ("key", "value")}
    out["sink"] = {s: {kv: cache.sink(s, kv) for kv in ("key", "value")} for s in slots}
    out["recent"] = {s: {kv: cache.recent(s, kv) for kv in ("key", "value")} for s in slots}
    return out


def _rows(array, row):
    """Rows of Hkv * d values in a returned bf16 window (its size over the row)."""
    return as_numpy(array).size // row


def _pick(results, part, slot, kv):
    """results[part][slot][kv] (by slot: a dict, or a list indexed by slot), or a KeyError
    naming what is missing."""
    if part not in results:
        raise KeyError("'%s'" % part)
    try:
        windows = results[part][slot]
    except (KeyError, IndexError):
        raise KeyError("%s of slot %d" % (part, slot)) from None
    if windows is None or kv not in windows:
        raise KeyError("%s['%s'] of slot %d" % (part, kv, slot))
    return windows[kv]


def _where(script, case, mismatch, kv, plane_name):
    """Which sequence, history token and position a pool mismatch's slot holds."""
    shape = case.expected["pool.%s.%s" % (kv, plane_name)].shape
    if len(shape) != 4:
        return ""
    heads, rows = shape[1], shape[2]
    page, slot_row = mismatch["row"] // (heads * rows), mismatch["row"] % rows
    p = script.params
    per_row = p["page_size"] // rows  # tokens one row of the plane covers (a tile's)
    for s in script.live_slots():
        table = script.tables[s]
        if page in table:
            first = table.index(page) * p["page_size"] + slot_row * per_row
            if per_row == 1:
                return " (slot %d, history token %d = position %d)" % (
                    s, first, p["sink"] + first)
            return " (slot %d, the tile of history tokens %d..%d = positions %d..%d)" % (
                s, first, first + per_row - 1, p["sink"] + first,
                p["sink"] + first + per_row - 1)
    return " (page %d: no live sequence holds it)" % page


def judge(write_cache, case):
    """A cache case through write_cache: None when every compared bit agrees, else (message,
    mismatch: Case.compare's dict or None for a missing output)."""
    script = _Script(case)
    results = write_cache(dict(script.params), _copy_heads(script.heads),
                          [dict(step) for step in script.steps])
    p = script.params
    row = p["num_kv_heads"] * p["head_dim"]
    checks = [("pool_pages", np.array([script.pages, script.free], np.int32), "")]
    try:
        if p["quantized"]:
            for kv in ("key", "value"):
                planes = results[kv] if kv in results else None
                if planes is None:
                    raise KeyError("'%s' (its pool planes)" % kv)
                for plane in p[kv].planes:
                    name = plane["name"]
                    if name not in planes:
                        raise KeyError("plane '%s' of the %s pool" % (name, kv))
                    checks.append(("pool.%s.%s" % (kv, name), planes[name], (kv, name)))
        for s in script.live_slots():
            base, t = "seq%d" % s, script.lengths[s]
            if p["quantized"]:
                sink = _rows(_pick(results, "sink", s, "key"), row)
                recent = _rows(_pick(results, "recent", s, "key"), row)
                shape = [t, sink, t - sink - recent, t - recent]
            else:
                dense = _rows(_pick(results, "dense", s, "key"), row)
                shape = [dense, min(p["sink"], dense), 0, min(p["sink"], dense)]
            checks.append((base + ".shape", np.array(shape, np.int32), ""))
            checks.append((base + ".page_table", np.array(script.tables[s], np.int32), ""))
            for kv in ("key", "value"):
                parts = ("sink", "recent") if p["quantized"] else ("dense",)
                for part in parts:
                    checks.append(("%s.%s.%s" % (base, part, kv),
                                   _pick(results, part, s, kv), ""))
    except KeyError as e:
        return "%s is missing from the target's output" % e.args[0], None
    for name, got, pool in checks:
        mismatch = case.compare(name, as_numpy(got))
        if mismatch is not None:
            message = mismatch["message"]
            if pool:
                message += _where(script, case, mismatch, *pool)
            return message, mismatch
    return None


def _copy_heads(heads):
    """A copy the target may change: its params list and every per-head array (rotation,
    widths, ...)."""
    return {kv: {name: list(rows) if name == "params" else (None if rows is None else rows.copy())
                 for name, rows in side.items()}
            for kv, side in heads.items()}
