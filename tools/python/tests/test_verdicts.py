"""Verdict tiers (spec/verdicts.md): numpy kernels that do not promise kvq's bits, each judged
to the tier its arithmetic deserves: half-up rounding is explained, fp32 / fp16 metadata through
an Adapter is explained or within one step, a wrong packing or width is unexplained, an fp16
scale that overflows breaks the finite invariant, and edge groups are counted apart."""
import io
import json

import numpy as np
import pytest

import kvq
from kvq.verdicts import bf16_value
from kvq.verdicts import Adapter, boundary_rule, edge_groups

TOKEN_GRID = ["affine_token"]
# The d x G x bits x rho x rotation grid: random rows beside a few edge rows (zeros,
# subnormal, constant, ties: the row_kinds metadata).
GRID = lambda name: name.startswith("pipeline/d")  # noqa: E731
# Cases with every edge row kind (constant, subnormal, huge, ties, ...).
EDGES = lambda name: name.startswith("pipeline/edges_")  # noqa: E731


def codec_input(p, x, rotation):
    """The oracle's write-path outputs and its codec input float32 [n, d] (the clipped rows):
    the numpy kernels below reuse kvq's rotation, norm and clip and replace only the
    quantizer."""
    out = kvq.quantize(p, x, rotation)
    rows = out["normalized"] if p.norm else out["rotated"]
    tau = out["tau"][:, None]
    return out, np.where(rows > tau, tau, np.where(rows < -tau, -tau, rows)).astype(np.float32)


def grouped(p, a):
    """a [n, d] as [groups, members]: per token and G channels, or per tile and channel."""
    n, d = a.shape
    if p.format == "affine_tile":
        g = p.tile_tokens
        return a.reshape(n // g, g, d).transpose(0, 2, 1).reshape(-1, g)
    return a.reshape(n * d // p.group, p.group)


def ungrouped(p, a, n, d):
    """The inverse of grouped(): [groups, members] back to [n, d]."""
    if p.format == "affine_tile":
        g = p.tile_tokens
        return a.reshape(n // g, d, g).transpose(0, 2, 1).reshape(n, d)
    return a.reshape(n, d)


def metadata_shape(p, n, d):
    return (n // p.tile_tokens, d) if p.format == "affine_tile" else (n, d // p.group)


def pack(p, codes):
    stage = "pack_tile" if p.format == "affine_tile" else "pack"
    return kvq.run_stage(stage, p, {"codes": codes.astype(np.uint8)}, codes.shape[0])["packed"]


def half_up(p, x, rotation):
    """kvq's quantizer with rint replaced by floor(v + 1/2) (round half up), in fp32."""
    if p.format not in ("affine_token", "affine_tile"):
        raise NotImplementedError("format %s" % p.format)
    out, xc = codec_input(p, x, rotation)
    n, d = xc.shape
    shape = metadata_shape(p, n, d)
    sf = bf16_value(out["scale"]).reshape(-1, 1)
    mf = bf16_value(out["min"]).reshape(-1, 1)
    with np.errstate(all="ignore"):
        v = (grouped(p, xc) - mf) / sf
        q = np.where(sf == 0, 0, np.clip(np.floor(v + np.float32(0.5)), 0, (1 << p.bits) - 1))
    planes = {"codes": pack(p, ungrouped(p, q, n, d)), "scale": out["scale"].reshape(shape),
              "min": out["min"].reshape(shape)}
    if p.norm:
        planes["norm"] = out["norm"]
    return planes


class ZeroPointFp32:
    """A zero-point quantizer in fp32 (x ~ s * (q - z), s = (hi - lo) / L, z = -lo / s, codes
    rint(x / s + z) against the unrounded fp32 values), its scale floored at `floor` (an
    OSCAR-like 1e-8 / L floor makes constant and subnormal groups differ from kvq)."""
    name = "zero_point_fp32"
    adapter = Adapter(scale_dtype="float32", zero_point="float")

    def __init__(self, floor=0.0):
        self.floor = np.float32(floor)

    def write(self, p, x, rotation):
        out, xc = codec_input(p, x, rotation)
        if p.format != "affine_token":
            raise NotImplementedError("format %s" % p.format)
        n, d = xc.shape
        g = grouped(p, xc)
        levels = np.float32((1 << p.bits) - 1)
        lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
        s = np.maximum(hi - lo, self.floor) / levels
        with np.errstate(all="ignore"):
            z = np.where(s == 0, np.float32(0), -lo / s).astype(np.float32)
            q = np.where(s == 0, 0, np.clip(np.rint(g / s + z), 0, levels))
        shape = metadata_shape(p, n, d)
        return {"codes": pack(p, ungrouped(p, q, n, d)), "scale": s.reshape(shape),
                "zero": z.reshape(shape)}


class Fp16Words:
    """A KIVI-like quantizer: fp16 scale and min, codes against them in fp32, packed 32/b codes
    per int32 word in channel order (code i of a word in bits [b*i, b*i + b))."""
    name = "fp16_words"

    def __init__(self, d):
        self.adapter = Adapter(scale_dtype="float16", packing=np.arange(d))

    def write(self, p, x, rotation):
        out, xc = codec_input(p, x, rotation)
        if p.format != "affine_token" or p.head_dim != self.adapter.packing.size:
            raise NotImplementedError("format %s, d %d" % (p.format, p.head_dim))
        n, d = xc.shape
        g = grouped(p, xc)
        levels = (1 << p.bits) - 1
        lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
        with np.errstate(all="ignore"):
            s16 = ((hi - lo) / np.float32(levels)).astype(np.float16)
            m16 = lo.astype(np.float16)
            sf, mf = s16.astype(np.float32), m16.astype(np.float32)
            q = np.where(sf == 0, 0, np.clip(np.rint((g - mf) / sf), 0, levels))
        codes = ungrouped(p, np.nan_to_num(q), n, d).astype(np.int64)  # Inf scale: NaN -> 0
        per_word = 32 // p.bits
        fields = codes.reshape(n, d // per_word, per_word) << (p.bits * np.arange(per_word))
        words = fields.sum(axis=2).astype(np.uint32).view(np.int32)
        shape = metadata_shape(p, n, d)
        return {"codes": words, "scale": s16.reshape(shape), "min": m16.reshape(shape)}


def differing_codes(vectors, target, name):
    """The number of codes the target's planes hold that differ from the case's expect.codes."""
    case = vectors.case(name)
    p = case.write_params
    planes = target(p, case.inputs["x"].copy(), None if case.rotation is None
                    else case.rotation[0].copy())
    stage = "unpack_tile" if p.format == "affine_tile" else "unpack"
    codes = kvq.run_stage(stage, p, {"packed": planes["codes"]}, case.inputs["x"].shape[0])
    return int((codes["codes"] != case.expected["codes"]).sum())


# --- (a) round half up: every mismatch explained ------------------------------------------

def test_round_half_up_is_explained_everywhere(vectors):
    report = kvq.conformance.check(half_up, kinds=["pipeline"], formats=["affine_token",
                                   "affine_tile"], vectors=vectors, out=None, accept="explained")
    judged = [r for r in report.results if r.status != "SKIP"]
    assert judged and report.failed == 0, report.failures()[:3]
    explained = [r for r in judged if r.tier == "explained"]
    assert explained, "no case holds a tie: the vectors' ties rows should"
    for r in explained:
        mismatches = differing_codes(vectors, half_up, r.name)
        assert mismatches > 0
        assert r.counts["explained"] + r.edge_counts["explained"] == mismatches, r.name
        assert r.counts["unexplained"] + r.edge_counts["unexplained"] == 0
    # Held to kvq conform's rule the same kernel fails exactly those cases.
    strict = kvq.conformance.check(half_up, kinds=["pipeline"], formats=["affine_token",
                                   "affine_tile"], vectors=vectors, out=None)
    assert {r.name for r in strict.results if r.status == "FAIL"} == {r.name for r in explained}
    assert all("; tier explained" in r.message for r in strict.results if r.status == "FAIL")


def test_the_boundary_rule():
    q0, q1 = np.array([0]), np.array([1])
    at = lambda vo, qt=q1, vt=None, bound=1e-3: bool(boundary_rule(  # noqa: E731
        q0, qt, np.array([vo], np.float32), None if vt is None else np.array([vt]), 3,
        bound)[0])
    assert at(0.5) and at(0.5 - 0.0009) and not at(0.5 - 0.0011)
    assert not at(0.3) and at(0.3, vt=0.6) and at(0.3, vt=0.4995)
    assert not at(0.3, vt=0.45)                # the target's own value is not at the boundary
    assert not at(0.5, qt=np.array([2]))       # two codes apart: never a rounding boundary
    assert at(0.3, bound=0.2) and not at(0.3, bound=0.19)
    assert not at(np.nan)                      # the oracle's scale is 0: no value, no boundary
    assert at(np.nan, vt=0.5)                  # ... unless the target's own value is at one


# --- (b) foreign metadata through an adapter ---------------------------------------------

def test_fp32_zero_point_metadata_is_explained_or_within_one_step(vectors):
    report = kvq.conformance.check(ZeroPointFp32(), kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step",
                                   edge_rows="apart")
    grid = [r for r in report.results if GRID(r.name)]
    assert grid and all(r.status == "PASS" for r in grid), [r.line() for r in grid][:3]
    tiers = {r.tier for r in grid}
    assert "explained" in tiers and "unexplained" not in tiers, tiers
    assert sum(r.counts["explained"] for r in grid) > 0
    assert report.as_dict()["adapter"] == dict(scale_dtype="float32", min_dtype="float32",
                                               zero_point="float", packing=None)


def test_an_integer_zero_point_is_within_one_step(vectors):
    def integer_zero(p, x, rotation):
        """x ~ s * (q - z) with z = rint(-lo / s) an integer: the grid moves by up to s / 2."""
        if p.format != "affine_token":
            raise NotImplementedError(p.format)
        out, xc = codec_input(p, x, rotation)
        n, d = xc.shape
        g = grouped(p, xc)
        levels = np.float32((1 << p.bits) - 1)
        lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
        s = ((hi - lo) / levels).astype(np.float32)
        with np.errstate(all="ignore"):
            z = np.where(s == 0, 0, np.rint(-lo / s)).astype(np.int32)
            q = np.where(s == 0, 0, np.clip(np.rint(g / s + z), 0, levels))
        shape = metadata_shape(p, n, d)
        return {"codes": pack(p, ungrouped(p, q, n, d)), "scale": s.reshape(shape),
                "zero": z.reshape(shape)}
    adapter = Adapter(scale_dtype="float32", zero_point="integer")
    report = kvq.conformance.check(integer_zero, kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step",
                                   edge_rows="apart", adapter=adapter)
    grid = [r for r in report.results if GRID(r.name)]
    assert grid and all(r.status == "PASS" for r in grid), [r.line() for r in grid][:3]
    assert "within_step" in {r.tier for r in grid}
    assert sum(r.counts["within_step"] for r in grid) > sum(r.counts["explained"] for r in grid)
    float_zero = kvq.conformance.check(integer_zero, kinds=["pipeline"], formats=TOKEN_GRID,
                                       vectors=vectors, out=None, adapter=Adapter(
                                           scale_dtype="float32", zero_point="float"))
    refused = "error: plane 'zero' must be a floating-point array (zero_point 'float'), got int32"
    assert all(r.message.startswith(refused) for r in float_zero.results if GRID(r.name))


def test_fp16_metadata_in_int32_words_is_within_one_step(vectors):
    target = Fp16Words(128)
    report = kvq.conformance.check(target, kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step",
                                   edge_rows="apart")
    grid = [r for r in report.results if GRID(r.name) and r.status != "SKIP" and "huge" not in
            vectors.case(r.name).metadata["row_kinds"]]  # huge rows overflow fp16: test (d)
    assert grid and all(r.status == "PASS" for r in grid), [r.line() for r in grid][:3]
    assert "within_step" in {r.tier for r in grid}
    assert all(r.invariants["codes_in_range"] and r.invariants["finite"] for r in grid)
    # Without the adapter the int32 words are not kvq's planes: an error, not a verdict.
    plain = kvq.conformance.check(target, kinds=["pipeline"], formats=TOKEN_GRID,
                                  vectors=vectors, out=None, accept="within_step",
                                  adapter=Adapter())
    assert any(r.message.startswith("error: codes must be") for r in plain.results)


def test_kvqs_own_packing_is_a_permutation():
    """The split-quarter INT2 layout (spec/numerics.md §8) written as a permutation packs as
    kvq's pack stage does, and reads back."""
    d = 64
    perm = np.array([(f % 4) * (d // 4) + f // 4 for f in range(d)])
    p = kvq.WriteParams(format="affine_token", head_dim=d, group=32, bits=2)
    codes = np.random.default_rng(1).integers(0, 4, (5, d))
    mine = Adapter(packing=perm)
    assert np.array_equal(mine.pack(p, codes), pack(p, codes))
    assert np.array_equal(mine.codes(p, {"codes": pack(p, codes)}, 5), codes)
    with pytest.raises(kvq.Error, match="not a permutation"):
        Adapter(packing=[0, 0, 1])


def test_kvqs_tile_packing_is_a_permutation():
    """spec/numerics.md §8.1 as a permutation of a tile's elements (token * d + channel):
    channel j owns G_k / 4 bytes, byte i of them holds tokens i, G_k/4 + i, ... (INT2)."""
    d, gk = 64, 32
    quarter = gk // 4
    perm = [((f % 4) * quarter + (f // 4) % quarter) * d + (f // 4) // quarter
            for f in range(d * gk)]
    p = kvq.WriteParams(format="affine_tile", head_dim=d, group=gk, bits=2)
    codes = np.random.default_rng(2).integers(0, 4, (2 * gk, d))
    mine = Adapter(packing=perm)
    assert np.array_equal(mine.pack(p, codes).reshape(-1), pack(p, codes).reshape(-1))
    assert np.array_equal(mine.codes(p, {"codes": pack(p, codes)}, 2 * gk), codes)


# --- (c) a wrong packing or width: unexplained, with its first mismatch ------------------

def test_packing_off_by_one_is_unexplained_even_within_a_step(vectors):
    def rolled(p, x, rotation):
        planes = dict(kvq.encode(p, x, rotation))
        planes["codes"] = np.roll(planes["codes"], 1, axis=1)
        return planes
    out = io.StringIO()
    report = kvq.conformance.check(rolled, kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=out, accept="within_step")
    first = next(r for r in report.results if GRID(r.name))
    assert first.status == "FAIL" and first.tier == "unexplained"
    assert first.message.startswith("codes differs at row 0, column ")
    assert "; tier unexplained; unexplained at row " in first.message
    assert first.counts["unexplained"] > 0
    assert "  [rolled] FAIL %s: codes differs" % first.name in out.getvalue()


def test_codes_of_the_wrong_width_break_the_range_invariant(vectors):
    class FourBitCodes:
        name = "four_bit_codes"
        adapter = Adapter(packing="unpacked")

        def write(self, p, x, rotation):
            if p.format != "affine_token":
                raise NotImplementedError(p.format)
            wider = kvq.WriteParams(format=p.format, head_dim=p.head_dim, group=p.group,
                                    bits=4, clip=p.clip, rotation=p.rotation,
                                    hadamard_block=p.hadamard_block, bitrev=p.bitrev)
            out = kvq.quantize(wider, x, rotation)
            return {"codes": out["codes"], "scale": out["scale"], "min": out["min"]}
    report = kvq.conformance.check(FourBitCodes(), kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step")
    two_bit = [r for r in report.results if vectors.case(r.name).write_params.bits == 2]
    assert two_bit and all(r.status == "FAIL" and r.tier == "unexplained" for r in two_bit)
    broken = [r for r in two_bit if r.invariants.get("codes_in_range") is False]
    assert broken, [r.line() for r in two_bit][:2]
    assert "codes_in_range: code " in broken[0].message and "outside [0, 3]" in \
        broken[0].message


# --- (d) an fp16 scale that overflows ----------------------------------------------------

def test_an_fp16_scale_overflowing_is_flagged_non_finite(vectors):
    report = kvq.conformance.check(Fp16Words(64), kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step",
                                   edge_rows="apart")
    huge = [r for r in report.results if EDGES(r.name) and "huge" in
            vectors.case(r.name).metadata["row_kinds"]]
    assert huge
    for r in huge:
        assert r.invariants["finite"] is False and r.status == "FAIL", r.line()
        assert r.tier == "unexplained" and "finite: scale is inf at row" in r.message


# --- (e) edge groups counted apart -------------------------------------------------------

def test_edge_groups_are_judged_apart(vectors):
    target = ZeroPointFp32(floor=1e-8)
    apart = kvq.conformance.check(target, kinds=["pipeline"], formats=TOKEN_GRID,
                                  vectors=vectors, out=io.StringIO(), accept="within_step",
                                  edge_rows="apart")
    edges = [r for r in apart.results if EDGES(r.name)]
    assert edges and all(r.status == "PASS" for r in edges), [r.line() for r in edges][:2]
    assert {r.edge_tier for r in edges} == {"unexplained"}
    assert all(r.edge_counts["unexplained"] > 0 and r.counts["unexplained"] == 0 for r in edges)
    for r in (r for r in edges if r.name.endswith("_identity")):
        # Unrotated, every constant row (zeros, -0, mixed, constant) is constant groups.
        kinds = vectors.case(r.name).metadata["row_kinds"].split(",")
        groups = vectors.case(r.name).write_params.head_dim // vectors.case(
            r.name).write_params.group
        flat = sum(k in ("zeros", "negative_zeros", "mixed_zeros", "constant") for k in kinds)
        assert r.edge_classes["constant"] >= flat * groups
        assert r.edge_classes["subnormal"] >= kinds.count("subnormal") * groups
    judged = kvq.conformance.check(target, kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step")
    assert all(judged_r.status == "FAIL" for judged_r in judged.results if EDGES(judged_r.name))
    out = io.StringIO()
    kvq.conformance.check(target, kinds=["pipeline"], formats=TOKEN_GRID, vectors=vectors,
                          out=out, accept="within_step", edge_rows="apart")
    text = out.getvalue()
    assert "\nedge rows (judged apart; groups: subnormal / constant / offset):\n" in text
    assert "  %s: unexplained (" % edges[0].name in text
    assert "(edge group: constant)" in edges[0].message or "(edge group: subnormal)" in \
        edges[0].message


def test_edge_classes_of_synthetic_groups():
    x = np.array([[1.0, 1.0, 1.0, 1.0],          # constant
                  [1e-40, -2e-40, 0.0, 3e-40],   # subnormal
                  [20.0, 20.02, 19.98, 20.01],   # offset: |lo| > 2^8 * step
                  [-1.0, 0.5, 2.0, 0.25]], np.float32)  # ordinary
    lo = np.repeat(x.min(axis=1, keepdims=True), 4, axis=1)
    hi = np.repeat(x.max(axis=1, keepdims=True), 4, axis=1)
    group = np.repeat(np.arange(4)[:, None], 4, axis=1)
    classes = edge_groups(x, lo, hi, group, 3)
    assert classes["constant"][:, 0].tolist() == [True, False, False, False]
    assert classes["subnormal"][:, 0].tolist() == [False, True, False, False]
    assert classes["offset"][:, 0].tolist() == [False, False, True, False]


# --- invariants that need the target's own methods ---------------------------------------

def test_prefill_must_equal_decode_flush(vectors):
    class Flushing:
        name = "flushing"

        def __init__(self, shift):
            self.shift = shift

        def write(self, p, x, rotation):
            if p.format != "affine_token":
                raise NotImplementedError(p.format)
            return kvq.encode(p, x, rotation)

        def flush(self, p, x, rotation):  # one row at a time, as demotion writes them
            rows = [kvq.encode(p, x[i:i + 1], rotation) for i in range(x.shape[0])]
            planes = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
            planes["scale"] = planes["scale"] + np.uint16(self.shift)
            return planes
    same = kvq.conformance.check(Flushing(0), kinds=["pipeline"], formats=TOKEN_GRID,
                                 vectors=vectors, out=None)
    assert same.failed == 0 and all(r.invariants["prefill_equals_flush"] is True
                                    for r in same.results if r.status == "PASS")
    other = kvq.conformance.check(Flushing(1), kinds=["pipeline"], formats=TOKEN_GRID,
                                  vectors=vectors, out=None, accept="within_step")
    assert other.results and all(r.status == "FAIL" for r in other.results)
    assert other.results[0].invariants["prefill_equals_flush"] is False
    assert "prefill_equals_flush: plane 'scale' of flush() differs first at byte " in \
        other.results[0].message


def test_a_declared_packing_the_targets_unpack_disagrees_with(vectors):
    class Misdeclared:
        name = "misdeclared"
        adapter = Adapter(packing=np.arange(64))  # declared natural order, writes kvq's

        def write(self, p, x, rotation):
            if p.format != "affine_token" or p.head_dim != 64:
                raise NotImplementedError(p.format)
            return kvq.encode(p, x, rotation)

        def stage(self, name, p, inputs, rows):
            return kvq.run_stage(name, p, inputs, rows)
    report = kvq.conformance.check(Misdeclared(), kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="within_step")
    judged = [r for r in report.results if r.status != "SKIP"]
    assert judged and all(r.invariants.get("pack_round_trip") is False for r in judged)
    assert all(r.status == "FAIL" for r in judged)


# --- the report -------------------------------------------------------------------------

def test_the_table_and_json_carry_the_tiers(vectors):
    out = io.StringIO()
    report = kvq.conformance.check(half_up, kinds=["pipeline"], formats=["affine_token"],
                                   vectors=vectors, out=out, accept="explained")
    data = json.loads(json.dumps(report.as_dict()))
    assert data["accept"] == "explained" and data["bound"] == kvq.conformance.DEFAULT_BOUND
    assert sum(data["tiers"].values()) == len(data["cases"]) - report.skipped
    assert data["tiers"]["explained"] == sum(c["tier"] == "explained" for c in data["cases"])
    lines = out.getvalue().splitlines()
    explained = next(c["name"] for c in data["cases"] if c["tier"] == "explained")
    assert any(line.split() == [explained, "PASS", "explained"] or
               line.split()[:3] == [explained, "PASS", "explained"] for line in lines)
    assert lines[-3].startswith("tiers (accept explained, bound 0.001): ")
    assert ("%d explained" % data["tiers"]["explained"]) in lines[-3]


def test_check_refuses_unknown_options(vectors):
    with pytest.raises(kvq.Error, match="accept 'close' is not one of"):
        kvq.conformance.check(half_up, vectors=vectors, accept="close")
    with pytest.raises(kvq.Error, match="edge_rows 'hidden'"):
        kvq.conformance.check(half_up, vectors=vectors, edge_rows="hidden")
    with pytest.raises(kvq.Error, match="Adapter scale_dtype 'float64'"):
        Adapter(scale_dtype="float64")


# --- fp8, codes-only targets, stage packing through an adapter ---------------------------

E4M3 = kvq.verdicts.e4m3_values()


def fp8_ties_away(p, x, rotation):
    """e4m3 codes of x / s^ rounded to nearest with ties away from zero (kvq: ties to even)."""
    if p.format != "fp8_e4m3":
        raise NotImplementedError(p.format)
    out, xc = codec_input(p, x, rotation)
    v = np.clip((xc / np.float32(p.head_scale)).astype(np.float64), -448, 448)
    positive = np.arange(0x7F)  # 0x00 .. 0x7e: the non-negative values, ascending
    i = np.clip(np.searchsorted(E4M3[positive], np.abs(v)), 1, 0x7E)
    lower, upper = E4M3[positive][i - 1], E4M3[positive][i]
    code = np.where(np.abs(v) - lower < upper - np.abs(v), i - 1, i)  # a tie goes up
    code = np.where(np.abs(v) <= lower, i - 1, code)
    return {"codes": (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)}


def test_fp8_ties_away_from_zero_are_explained(vectors):
    report = kvq.conformance.check(fp8_ties_away, kinds=["pipeline"], formats=["fp8_e4m3"],
                                   vectors=vectors, out=None, accept="explained")
    assert report.results and report.failed == 0, report.failures()[:2]
    assert "explained" in {r.tier for r in report.results}
    strict = kvq.conformance.check(fp8_ties_away, kinds=["pipeline"], formats=["fp8_e4m3"],
                                   vectors=vectors, out=None)
    assert strict.failed == sum(r.tier == "explained" for r in report.results)


def test_a_codes_only_target_is_judged_on_the_oracles_values(vectors):
    def codes_only(p, x, rotation):
        return {"codes": half_up(p, x, rotation)["codes"]}
    report = kvq.conformance.check(codes_only, kinds=["pipeline"], formats=TOKEN_GRID,
                                   vectors=vectors, out=None, accept="explained")
    assert report.results and report.failed == 0, report.failures()[:2]
    assert {r.tier for r in report.results} == {"explained"}  # never exact without metadata
    assert all(r.notes[0].startswith("codes only: ") for r in report.results)


def test_stage_packing_through_a_permutation(vectors):
    class NaturalOrder:
        """pack / unpack with code i of a byte in bits [b*i, b*i + b), channels in order."""
        name = "natural_order"
        adapter = Adapter(packing=np.arange(64))

        def stage(self, name, p, inputs, rows):
            if name not in ("pack", "unpack") or p.head_dim != 64:
                raise NotImplementedError(name)
            per_byte = 8 // p.bits
            if name == "pack":
                fields = inputs["codes"].astype(np.uint8).reshape(rows, -1, per_byte)
                return {"packed": (fields << (p.bits * np.arange(per_byte, dtype=np.uint8)))
                        .sum(axis=2).astype(np.uint8)}
            shifts = p.bits * np.arange(per_byte, dtype=np.uint8)
            codes = (inputs["packed"][:, :, None] >> shifts) & ((1 << p.bits) - 1)
            return {"codes": codes.reshape(rows, -1).astype(np.uint8)}
    report = kvq.conformance.check(NaturalOrder(), kinds=["stage"], vectors=vectors, out=None)
    ran = [r for r in report.results if r.status != "SKIP"]
    assert len(ran) == 4 and all(r.status == "PASS" for r in ran), [r.line() for r in ran]
    plain = kvq.conformance.check(NaturalOrder(), kinds=["stage"], vectors=vectors, out=None,
                                  adapter=Adapter())
    assert all(r.status == "FAIL" for r in plain.results if r.status != "SKIP")
