"""Cache cases replayed from Python: kvq's own cache write passes every one with kvq conform's
verdicts; a cache write in numpy over kvq.encode (what a kernel's test harness looks like)
passes the cases it serves; the bugs kernels have in the cache write (a flush one token late,
a prefill clipped unlike the decode path, the other side's rotation in the decode path) fail
with a first-mismatch line naming plane, page, slot, head, element and the token there; a
target without write_cache skips them."""
import io
import os
import subprocess

import numpy as np
import pytest

import kvq

_DTYPES = {"U8": np.uint8, "BF16": np.uint16, "F32": np.float32, "F16": np.float16,
           "I8": np.int8, "I32": np.int32}
_FIELDS = [name for name, value in vars(kvq.WriteParams).items()
           if isinstance(value, property) and name not in ("planes", "tile_tokens")]


def replaced(p, **changes):
    """p with some fields changed (kvq.WriteParams is immutable)."""
    return kvq.WriteParams(**dict({f: getattr(p, f) for f in _FIELDS}, **changes))


def history_tokens(params, t):
    flush = params["flush"]
    return flush * (max(0, t - params["sink"] - params["recent"]) // flush)


class NumpyCache:
    """kvq's paged cache written in numpy, one KV head at a time through kvq.encode: the pools
    and windows of spec/cache.md, the history demoted F tokens at a time. Its bugs on demand:
    late (the history lags one token behind), prefill_clip (prefill encodes with this clip
    ratio, decode with the head's), decode_rotation_of (decode encodes with that side's
    rotation)."""

    def __init__(self, name="numpy_cache", late=False, prefill_clip=None,
                 decode_rotation_of=None):
        self.name, self.late = name, late
        self.prefill_clip, self.decode_rotation_of = prefill_clip, decode_rotation_of

    def write_cache(self, params, heads, script):
        hkv, d = params["num_kv_heads"], params["head_dim"]
        if not params["quantized"]:
            rows = {}
            for step in script:
                if step["op"] == "add":
                    rows[step["slot"]] = {"key": [], "value": []}
                elif step["op"] == "remove":
                    del rows[step["slot"]]
                elif step["op"] in ("prefill", "append"):
                    for kv in ("key", "value"):
                        rows[step["slot"]][kv].append(step[kv])
            return {"dense": {s: {kv: np.concatenate(r[kv]) for kv in r} for s, r in
                              rows.items()}}
        for kv in ("key", "value"):
            if params[kv].norm and params[kv].norm_heads > 1:
                raise NotImplementedError("a norm over %d KV heads" % params[kv].norm_heads)
        pools = {kv: {plane["name"]: np.zeros(
            (params["pages"], 1 if plane["scope"] == "shared_token" else hkv,
             params["page_size"] // plane["tokens_per_row"], plane["elements"]),
            _DTYPES[plane["dtype"]]) for plane in params[kv].planes} for kv in ("key", "value")}
        rows, lengths = {}, {}
        for step in script:
            slot = step["slot"]
            if step["op"] == "add":
                rows[slot], lengths[slot] = {"key": [], "value": []}, 0
            elif step["op"] == "remove":
                for kv in pools:
                    for plane in pools[kv].values():
                        plane[step["page_table"]] = 0  # unused slots hold zeros, as kvq's
                del rows[slot], lengths[slot]
            else:
                for kv in ("key", "value"):
                    rows[slot][kv].extend(step[kv])
                t0 = lengths[slot]
                lengths[slot] = t1 = t0 + len(step["key"])
                self._demote(params, heads, pools, rows[slot], step, t0, t1)
        out = {kv: pools[kv] for kv in pools}
        out["sink"], out["recent"] = {}, {}
        for slot, r in rows.items():
            t, sink = lengths[slot], min(params["sink"], lengths[slot])
            begin = min(t, params["sink"] + self._history(params, t))
            out["sink"][slot] = {kv: np.array(r[kv][:sink], np.uint16).reshape(-1, hkv, d)
                                 for kv in r}
            out["recent"][slot] = {kv: np.array(r[kv][begin:t], np.uint16).reshape(-1, hkv, d)
                                   for kv in r}
        return out

    def _history(self, params, t):
        return history_tokens(params, t - 1 if self.late else t)

    def _demote(self, params, heads, pools, rows, step, t0, t1):
        """Encodes positions [S0 + H(t0), S0 + H(t1)) of each KV head into the pages."""
        s0, page = params["sink"], params["page_size"]
        e0, e1 = s0 + self._history(params, t0), s0 + self._history(params, t1)
        if e1 == e0:
            return
        table = step["page_table"]
        for kv in ("key", "value"):
            x = (np.array(rows[kv][e0:e1]).astype(np.uint32) << 16).view(np.float32)
            for head in range(params["num_kv_heads"]):
                p = heads[kv]["params"][head]
                rotation_side = kv
                if step["op"] == "prefill" and self.prefill_clip is not None:
                    p = replaced(p, clip=self.prefill_clip)
                if step["op"] == "append" and self.decode_rotation_of is not None:
                    rotation_side = self.decode_rotation_of
                rotation = heads[rotation_side]["rotation"]
                widths = heads[kv].get("widths")  # a codebook side's per-head block widths
                planes = kvq.encode(p, np.ascontiguousarray(x[:, head]),
                                    None if rotation is None else rotation[head],
                                    None if widths is None else widths[head])
                for plane in p.planes:
                    per_row = plane["tokens_per_row"]
                    pool = pools[kv][plane["name"]]
                    for r, values in enumerate(planes[plane["name"]]):
                        token = e0 - s0 + r * per_row  # history index of the row's first token
                        pool[table[token // page], 0 if pool.shape[1] == 1 else head,
                             (token % page) // per_row] = values


def cache_names(vectors):
    return [n for n in vectors.names() if n.startswith("cache/")]


def test_the_oracle_passes_every_cache_case(vectors):
    out = io.StringIO()
    report = kvq.conformance.check(kvq.conformance.ORACLE, kinds=["cache"], vectors=vectors,
                                   out=out)
    assert [r.name for r in report.results] == cache_names(vectors)
    assert report.passed == len(report.results) > 0, report.failures()[:3]
    assert {r.tier for r in report.results} == {"exact"}


@pytest.mark.skipif(not os.environ.get("KVQ_BINARY"), reason="KVQ_BINARY (ctest sets it) not set")
def test_cache_verdicts_are_the_clis(vectors):
    table = subprocess.run([os.environ["KVQ_BINARY"], "conform", "--backend", "scalar",
                            "--vectors", vectors.dir], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    cli = [tuple(line.split()) for line in table if line.startswith("cache/")]
    report = kvq.conformance.check(kvq.conformance.ORACLE, kinds=["cache"], vectors=vectors,
                                   out=None)
    assert cli and cli == [(r.name, r.status) for r in report.results]


def test_the_script_is_kvqs_own_allocation(vectors):
    for name in cache_names(vectors):
        case = vectors.case(name)
        params, heads, script = kvq.cache_write.script_of(case)
        cache = case.cache()
        assert params["pages"] == case.expected["pool_pages"][0], name
        for step in script:
            assert step["op"] in ("add", "prefill", "append", "remove")
            if step["op"] in ("prefill", "append"):
                assert step["key"].dtype == np.uint16 and step["key"].shape[1:] == (
                    params["num_kv_heads"], params["head_dim"])
                assert step["op"] == "prefill" or len(step["key"]) == 1
        last = {step["slot"]: step for step in script if "page_table" in step}
        for slot in cache.sequences():
            assert list(last[slot]["page_table"]) == list(cache.page_table(slot)), name
        if params["quantized"]:
            for kv in ("key", "value"):
                assert len(heads[kv]["params"]) == params["num_kv_heads"]


def test_a_cache_write_in_numpy_passes_what_it_serves(vectors):
    report = kvq.conformance.check(NumpyCache(), kinds=["cache"], vectors=vectors, out=None)
    assert report.failed == 0, report.failures()[:2]
    skipped = [r for r in report.results if r.status == "SKIP"]
    assert all(r.message.startswith("unsupported: a norm over") for r in skipped)
    assert report.passed >= len(report.results) - 1


def failures(vectors, target):
    report = kvq.conformance.check(target, kinds=["cache"], vectors=vectors, out=None)
    return report, {r.name: r for r in report.results if r.status == "FAIL"}


def test_a_flush_one_token_late_fails_at_the_first_token_it_missed(vectors):
    report, failed = failures(vectors, NumpyCache("late", late=True))
    # The cases compare the state after the script, as kvq conform does: with F = 1 the
    # history lags behind at the end; with F = 32 or 64 it may have caught up by then.
    per_token = [r.name for r in report.results if r.status != "SKIP" and
                 vectors.case(r.name).cache().params["quantized"] and
                 vectors.case(r.name).cache().params["flush"] == 1]
    assert per_token and set(per_token) <= set(failed)
    line = failed["cache/d64_b2_g32_dense_s4_w8_p16"].line()
    assert line.startswith("FAIL cache/d64_b2_g32_dense_s4_w8_p16: pool.key.")
    assert " (page, KV head, slot, element): expected " in line
    assert line.endswith(")") and "(slot " in line and "history token" in line


def test_a_prefill_clipped_unlike_decode_fails(vectors):
    def clips(name):
        case = vectors.case(name)
        params = case.cache().params
        return "clip_k" in case.inputs or "clip_v" in case.inputs or params["quantized"] and (
            params["key"].clip != 1.0 or params["value"].clip != 1.0)
    clipped = [n for n in cache_names(vectors) if clips(n)]
    assert clipped
    report, failed = failures(vectors, NumpyCache("prefill_clip", prefill_clip=1.0))
    assert failed and set(failed) <= set(clipped)
    first = next(iter(failed.values()))
    assert first.mismatch["output"].startswith("pool.")
    assert "differs at row" in first.message and "(slot " in first.message


def test_decode_with_the_other_sides_rotation_fails(vectors):
    # Both sides dense: the wrong matrix then gives other bits (a side without one, an error).
    dense = [n for n in cache_names(vectors)
             if all(vectors.case(n).cache().params[kv].rotation == "dense"
                    for kv in ("key", "value"))]
    assert dense
    report, failed = failures(vectors, NumpyCache("mixed", decode_rotation_of="value"))
    assert set(dense) <= set(failed)
    line = failed[dense[0]].line()
    assert "pool.key." in line and "(page, KV head, slot, element)" in line


def test_a_window_that_keeps_one_row_too_many_fails_on_the_shape(vectors):
    class LongRecent(NumpyCache):
        def write_cache(self, params, heads, script):
            out = super().write_cache(params, heads, script)
            if "recent" in out:
                for slot, windows in out["recent"].items():
                    for kv in windows:
                        windows[kv] = np.concatenate([windows[kv][:1], windows[kv]])
            return out
    report, failed = failures(vectors, LongRecent())
    assert failed
    first = failed[min(failed)]
    assert first.mismatch["output"] == "seq0.shape"
    assert "(length, sink, history, recent begin)" in first.message


def test_missing_outputs_fail_naming_them(vectors):
    class NoValues(NumpyCache):
        def write_cache(self, params, heads, script):
            out = super().write_cache(params, heads, script)
            out.pop("value", None)
            return out
    report, failed = failures(vectors, NoValues())
    assert failed and all(r.message == "'value' (its pool planes) is missing from the "
                          "target's output" for r in failed.values())


def test_a_target_without_write_cache_skips_cache_cases(vectors):
    report = kvq.conformance.check(lambda p, x, r: kvq.encode(p, x, r), kinds=["cache"],
                                   vectors=vectors, out=None)
    assert report.results and report.skipped == len(report.results)
    assert {r.message for r in report.results} == {"the target has no write_cache()"}


def test_replay_cache_builds_kvqs_cache_from_a_script(vectors):
    case = vectors.case("cache/d64_b2_g32_dense_s4_w8_p16")  # removal and page reuse
    params, heads, script = kvq.cache_write.script_of(case)
    ops = case.inputs["ops"]
    cache = kvq.replay_cache(params, heads, ops, case.inputs["k"], case.inputs["v"])
    reference = case.cache()
    assert cache.sequences() == reference.sequences()
    if params["quantized"]:
        for kv in ("key", "value"):
            for name, plane in reference.pool(kv).items():
                assert np.array_equal(cache.pool(kv)[name], plane)
    moved = [dict(step) for step in script]
    last = max(i for i, step in enumerate(moved) if len(step.get("page_table", ())) > 0)
    moved[last]["page_table"] = moved[last]["page_table"] + 1
    with pytest.raises(kvq.Error, match="page tables .* are not kvq's allocation"):
        kvq.conformance.ORACLE.write_cache(params, heads, moved)
    with pytest.raises(kvq.Error, match="cache params lack 'flush'"):
        kvq.replay_cache({k: v for k, v in params.items() if k != "flush"}, heads, ops,
                         case.inputs["k"], case.inputs["v"])
    with pytest.raises(kvq.Error, match="script: the script uses"):
        kvq.replay_cache(params, heads, ops, np.concatenate([case.inputs["k"]] * 2),
                         np.concatenate([case.inputs["v"]] * 2))
