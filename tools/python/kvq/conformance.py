"""Replays the golden vectors through your kernel and prints the table `kvq conform` prints.

Every stage and pipeline case of a quantized format gets a verdict tier (spec/verdicts.md):
exact (every stored bit matches: kvq conform's rule), explained (one-code flips at rounding
boundaries, metadata rounding to kvq's bf16), within_step (dequantized within one oracle step)
or unexplained; check(accept=) names the worst that passes (default 'exact'), an Adapter reads
foreign metadata and packings, edge groups are reported apart, invariants are checked on the
target's own output. Attention cases are held to the case's tolerance on the relative error
per query head against the fp64 reference, as kvq conform holds them (spec/cache.md §5), or,
for a target offering attend(..., history=), over its own codes within a bound derived from
its arithmetic (kvq.own_attention). Cache cases (a script of prefills, appends and removals on
kvq's paged cache) are held to every bit of the pool and the bf16 windows, whatever accept says,
as kvq conform holds them (kvq.cache_write). A target is an object with any of
    write(params, x, rotation) -> {plane name: array}   the stored planes of rows x, as
                                                        kvq.encode gives them (pipeline cases;
                                                        a codebook case with per-head block
                                                        widths calls write(params, x,
                                                        rotation, widths=uint8 [d/2]) and is
                                                        skipped for a write without `widths`)
    stage(name, params, inputs, rows) -> {output: array}  one stage of kvq.stages(), as
                                                        kvq.run_stage does (stage cases)
    write_cache(params, heads, script) -> {"key": {plane: array}, "value": {plane: array},
            "sink": {slot: {"key": bf16, "value": bf16}}, "recent": {slot: {...}}}
                                                        the pools and windows a cache script
                                                        leaves (cache cases; a bf16 cache
                                                        returns "dense": {slot: {...}}):
                                                        kvq.cache_write says what params,
                                                        heads and script hold
    attend(cache, seq, q) -> out float32 [Hq, d]        one decode step of q float32 [Hq, d]
                                                        over sequence seq of cache (a
                                                        kvq.Cache), as kvq.attend (attention
                                                        cases; a target whose `device` is
                                                        'cuda' gets the case's GPU tolerance)
    flush(params, x, rotation) -> planes                optional: the planes its decode-time
                                                        path writes for the same rows (the
                                                        prefill_equals_flush invariant)
    adapter, arithmetic                                 optional attributes: a kvq.conformance
                                                        .Adapter, a kvq.conformance.Arithmetic
or a plain callable, taken as write. The target gets numpy arrays; it may return numpy arrays
or tensors (anything with .cpu() / .numpy() or __array__, e.g. torch tensors on any device: see
kvq._arrays.as_numpy); bf16 values are uint16 bits (a torch.bfloat16 tensor is read as its
bits). A target that raises NotImplementedError, or kvq.Error with code 'unsupported', skips
the case with its reason; a target without the method a case calls skips it.

    report = kvq.conformance.check(kvq.conformance.ORACLE)   # every case passes
    report = kvq.conformance.check(my_write, kinds=["pipeline"], formats=["affine_token"])
    assert report.failed == 0, report.failures()
    report = kvq.conformance.check(foreign, accept="within_step", edge_rows="apart",
                                   adapter=kvq.conformance.Adapter(scale_dtype="float16"))
"""
import importlib
import inspect
import sys

import numpy as np

from . import cache_write, own_attention, vectors as _vectors
from .own_attention import Arithmetic
from ._arrays import as_numpy
from ._errors import error
from ._kvq import Error, attend, encode, formats as _formats, run_stage, stages
from .verdicts import (DEFAULT_BOUND, EDGE_CLASSES, IDENTITY, TIERS, Adapter, Oracle, bf16_bits,
                       judge_affine, judge_fp8)

__all__ = ["Adapter", "Arithmetic", "DEFAULT_BOUND", "KINDS", "ORACLE", "TIERS", "CaseResult",
           "Report", "check", "load_target", "options", "replay", "select"]

# The case kinds replayed from Python (all of kvq conform's), and the target method each calls.
KINDS = ("stage", "pipeline", "cache", "attention")
_METHODS = {"stage": "stage", "pipeline": "write", "cache": "write_cache",
            "attention": "attend"}


class _Oracle:
    """kvq's own scalar reference as a target: passes every case."""
    name = "kvq"

    def write(self, params, x, rotation, widths=None):
        return encode(params, x, rotation, widths)

    def stage(self, name, params, inputs, rows):
        return run_stage(name, params, inputs, rows)

    def write_cache(self, params, heads, script):
        return cache_write.oracle_write_cache(params, heads, script)

    def attend(self, cache, seq, q):
        return attend(cache, seq, q)


ORACLE = _Oracle()


class CaseResult:
    """One case's verdict.

    status: 'PASS' | 'FAIL' | 'SKIP' (the tier held against check()'s `accept`);
    message: why it failed or was skipped (kvq conform's first-mismatch line first);
    mismatch: the first differing element as Case.compare gives it, or None;
    tier: the case's tier (verdicts.TIERS; 'tolerance' for a passing attention case; None when
        skipped); edge_tier: the tier of its edge elements (None when it has none or was not
        judged per element); counts / edge_counts: {tier: elements} over ordinary / edge
        elements (stage and pipeline cases of a quantized format); edge_classes: {class: number
        of edge groups}; invariants: {name: True | False | None (not checked)}; notes: the
        texts behind a violated invariant or an unexplained element."""

    def __init__(self, name, kind, status, message="", mismatch=None, tier=None):
        self.name, self.kind, self.status = name, kind, status
        self.message, self.mismatch, self.tier = message, mismatch, tier
        self.edge_tier, self.counts, self.edge_counts = None, None, None
        self.edge_classes, self.invariants, self.notes = {}, {}, []

    def line(self):
        """As kvq conform prints a result: 'FAIL pipeline/...: codes differs at ...'."""
        return self.status + " " + self.name + (": " + self.message if self.message else "")

    def as_dict(self):
        return dict(name=self.name, kind=self.kind, status=self.status, message=self.message,
                    mismatch=self.mismatch, tier=self.tier, edge_tier=self.edge_tier,
                    counts=self.counts, edge_counts=self.edge_counts,
                    edge_classes=self.edge_classes, invariants=self.invariants,
                    notes=self.notes)


class Report:
    """Every case's result in manifest order; passed / failed / skipped counts; tiers: {tier:
    cases} over judged cases (TIERS, and 'tolerance' for passing attention cases); edge_tiers:
    {tier: cases} over the edge elements of cases that have any; accept, bound, adapter: what
    the cases were held to."""

    def __init__(self, target_name, vectors_dir, spec_version, results, options=None):
        self.target, self.dir, self.spec_version = target_name, vectors_dir, spec_version
        self.results = results
        self.options = options or _Options()
        self.passed = sum(r.status == "PASS" for r in results)
        self.failed = sum(r.status == "FAIL" for r in results)
        self.skipped = sum(r.status == "SKIP" for r in results)
        self.tiers = {t: sum(r.tier == t for r in results) for t in TIERS + ("tolerance",)}
        self.edge_tiers = {t: sum(r.edge_tier == t for r in results) for t in TIERS}

    def failures(self):
        return [r.line() for r in self.results if r.status == "FAIL"]

    def as_dict(self):
        """The report as JSON-ready data."""
        return dict(target=self.target, vectors=self.dir, spec_version=self.spec_version,
                    passed=self.passed, failed=self.failed, skipped=self.skipped,
                    accept=self.options.accept, bound=self.options.bound,
                    edge_rows=self.options.edge_rows,
                    adapter=None if self.options.adapter in (None, IDENTITY)
                    else self.options.adapter.as_dict(),
                    tiers=self.tiers, edge_tiers=self.edge_tiers,
                    cases=[r.as_dict() for r in self.results])


class _Options:
    """What check() holds the cases to (its keyword arguments)."""

    def __init__(self, accept="exact", bound=DEFAULT_BOUND, adapter=None, edge_rows="judged"):
        if accept not in TIERS[:3]:
            raise error("accept '%s' is not one of %s" % (accept, ", ".join(TIERS[:3])),
                        "invalid argument")
        if edge_rows not in ("judged", "apart"):
            raise error("edge_rows '%s' is not 'judged' or 'apart'" % edge_rows,
                        "invalid argument")
        if not bound >= 0:
            raise error("bound %r is not >= 0" % (bound,), "invalid argument")
        self.accept, self.bound, self.adapter, self.edge_rows = accept, bound, adapter, edge_rows

    def adapter_of(self, target):
        return self.adapter or getattr(target, "adapter", None) or IDENTITY


def options(target, accept="exact", bound=DEFAULT_BOUND, adapter=None, edge_rows="judged"):
    """check()'s keyword arguments, validated, the adapter resolved for `target` (its
    `adapter` attribute when none is given): what replay() takes as its third argument.
    Raises kvq.Error (invalid argument) as check() does."""
    resolved = _Options(accept, bound, adapter, edge_rows)
    resolved.adapter = resolved.adapter_of(target)
    return resolved


def _method(target, name):
    if name == "write" and not hasattr(target, "write") and callable(target):
        return target
    return getattr(target, name, None)


def _compare_all(case, results, checks):
    """The case's verdict on the target's `results`: checks are (expected output, result key,
    what the key names), compared in order; the first mismatch or missing key fails it."""
    for output, key, what in checks:
        if key not in results:
            return CaseResult(case.name, case.kind, "FAIL",
                              "%s '%s' is missing from the target's output" % (what, key),
                              tier="unexplained")
        mismatch = case.compare(output, as_numpy(results[key]), key)
        if mismatch is not None:
            return CaseResult(case.name, case.kind, "FAIL", mismatch["message"], mismatch,
                              tier="unexplained")
    return CaseResult(case.name, case.kind, "PASS", tier="exact")


def _clipped(expected, p):
    """float32 [n, d]: the codec input of a pipeline case, the oracle's rotated (or normalized)
    rows clipped at its tau (spec/numerics.md §4, the comparison form)."""
    x = expected["normalized"] if p.norm else expected["rotated"]
    tau = expected["tau"][:, None]
    return np.where(x > tau, tau, np.where(x < -tau, -tau, x)).astype(np.float32)


def _kvq_form(adapter, p, results, n):
    """The target's codec outputs in kvq's plane form and its own values: (planes {codes
    (kvq-packed, or unpacked when `results` holds stage outputs: see caller), scale, min as bf16
    bits}, codes int64 [n, d], scale, min, zero float64 in metadata shape or None). Raises
    kvq.Error for a plane the adapter cannot read."""
    codes = adapter.codes(p, results, n)
    if p.format == "fp8_e4m3" or "scale" not in results:
        return {}, codes, None, None, None
    scale = adapter.metadata_values(results, "scale")
    zero = None
    if adapter.zero_point:
        if "zero" not in results:
            raise error("plane 'zero' is missing from the target's output (zero_point '%s')"
                        % adapter.zero_point, "shape mismatch")
        zero = adapter.zero_values(results)
        minimum = -scale * zero + 0.0  # a zero point of +0 is kvq's min +0, not -0
    else:
        if "min" not in results:
            raise error("plane 'min' is missing from the target's output", "shape mismatch")
        minimum = adapter.metadata_values(results, "min")
    with np.errstate(all="ignore"):
        planes = {"scale": bf16_bits(scale.astype(np.float32)),
                  "min": bf16_bits(minimum.astype(np.float32))}
    return planes, codes, scale, minimum, zero


def _judge(case, oracle, adapter, bound, codes, scale, minimum, zero, kvq_planes):
    """verdicts.judge_* over the target's codec output; meta_equal from the bf16 planes."""
    p = oracle.p
    if p.format == "fp8_e4m3":
        return judge_fp8(oracle, codes, bound)
    if scale is None:  # a target returning codes only: the oracle's values, never exact
        judgement = judge_affine(oracle, codes, None, None, None, np.ones(codes.shape, bool),
                                 bound)
        judgement.tiers = np.maximum(judgement.tiers, 1).astype(np.int8)
        judgement.codes_only = True
        judgement.notes.insert(0, "codes only: judged against the oracle's pre-rounding values "
                                  "and metadata")
        return judgement
    shape = oracle.scale_bits.shape
    try:
        sb = kvq_planes["scale"].reshape(shape)
        mb = kvq_planes["min"].reshape(shape)
        scale, minimum = scale.reshape(shape), minimum.reshape(shape)
        zero = None if zero is None else zero.reshape(shape)
    except ValueError:
        raise error("scale / min hold %d values, expected %s" % (
            kvq_planes["scale"].size, "x".join(map(str, shape))), "shape mismatch")
    meta_equal = oracle.expand((sb == oracle.scale_bits) & (mb == oracle.min_bits))
    return judge_affine(oracle, codes, oracle.expand(scale), oracle.expand(minimum),
                        None if zero is None else oracle.expand(zero), meta_equal, bound)


def _apply(result, judgement, options):
    """Fills `result` (the exact comparison's CaseResult) from `judgement` and decides its
    status: the tier that gates it is the ordinary elements' (edge_rows 'apart') or the worst
    of all (edge_rows 'judged'), PASS when it is no worse than options.accept."""
    if result.status == "PASS" and not getattr(judgement, "codes_only", False):
        judgement.tiers[...] = 0  # every stored bit matched: exact by definition
    ordinary, edge = judgement.tier("ordinary"), judgement.tier("edge")
    has_edge = bool(judgement.edge.any())
    gate = ordinary if options.edge_rows == "apart" else max(ordinary, edge)
    result.tier = TIERS[gate]
    result.edge_tier = TIERS[edge] if has_edge else None
    result.counts, result.edge_counts = judgement.counts("ordinary"), judgement.counts("edge")
    result.edge_classes, result.invariants = judgement.edge_classes, judgement.invariants
    result.notes = judgement.notes
    result.status = "PASS" if gate <= TIERS.index(options.accept) else "FAIL"
    if gate == 0 and edge == 0:
        return result
    parts = [result.message] if result.message else []
    parts.append("tier " + result.tier)
    if options.edge_rows == "apart" and has_edge and edge != ordinary:
        parts[-1] += " (edge rows: %s)" % result.edge_tier
    result.message = "; ".join(parts + judgement.notes)
    return result


def _check_flush(target, p, x, rotation, planes, judgement):
    """Invariant prefill_equals_flush: target.flush(p, x, rotation) (the target's decode-time
    writes of the same rows) must return the planes write() returned, bit for bit."""
    flush = getattr(target, "flush", None)
    if flush is None:
        judgement.invariants["prefill_equals_flush"] = None
        return
    try:
        flushed = flush(p, x.copy(), None if rotation is None else rotation.copy())
    except NotImplementedError:
        judgement.invariants["prefill_equals_flush"] = None
        return
    for name, plane in planes.items():
        a, b = as_numpy(plane), as_numpy(flushed.get(name)) if name in flushed else None
        if b is None or a.shape != b.shape or a.tobytes() != b.tobytes():
            where = "missing" if b is None else "differs"
            if b is not None and a.shape == b.shape:
                diff = np.argwhere(a.view(np.uint8).reshape(-1) != b.view(np.uint8).reshape(-1))
                where += " first at byte %d" % int(diff[0][0]) if diff.size else ""
            judgement.violate("prefill_equals_flush", "plane '%s' of flush() %s" % (name, where))
            return
    judgement.invariants["prefill_equals_flush"] = True


def _check_pack_round_trip(target, p, codes, plane, judgement):
    """Invariant pack_round_trip: a target with stage('unpack'/'unpack_tile') and
    stage('pack'/'pack_tile') must unpack its own written codes plane to the codes the adapter
    read and pack those back to the plane, bit for bit."""
    stage = getattr(target, "stage", None)
    suffix = "_tile" if p.format == "affine_tile" else ""
    judgement.invariants["pack_round_trip"] = None
    if stage is None or p.format not in ("affine_token", "affine_tile"):
        return
    n = codes.shape[0]
    try:
        unpacked = as_numpy(stage("unpack" + suffix, p, {"packed": as_numpy(plane).copy()},
                                  n)["codes"])
        packed = as_numpy(stage("pack" + suffix, p, {"codes": unpacked.copy()}, n)["packed"])
    except NotImplementedError:
        return
    if not np.array_equal(unpacked.reshape(codes.shape).astype(np.int64), codes):
        judgement.violate("pack_round_trip", "the target's unpack%s of its own plane differs "
                          "from the codes its declared packing reads" % suffix)
    elif packed.tobytes() != as_numpy(plane).tobytes():
        judgement.violate("pack_round_trip", "pack%s(unpack%s(plane)) differs from the plane"
                          % (suffix, suffix))
    else:
        judgement.invariants["pack_round_trip"] = True


def _takes_widths(write):
    """Whether write() accepts the keyword `widths` (or any keyword)."""
    try:
        parameters = inspect.signature(write).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return True
    return any(q.name == "widths" or q.kind == q.VAR_KEYWORD for q in parameters)


def _replay_pipeline(target, write, case, options):
    p = case.write_params
    rotation = None if case.rotation is None else case.rotation[0].copy()
    x = case.inputs["x"]
    extra = {}
    if "widths" in case.inputs:  # a codebook head with per-head block widths (spec 1.3)
        if not _takes_widths(write):
            return CaseResult(case.name, case.kind, "SKIP",
                              "per-head block widths: write() takes no `widths`")
        extra["widths"] = case.inputs["widths"].copy()
    planes = write(p, x.copy(), rotation, **extra)
    checks = [(q["source"], q["name"], "plane") for q in p.planes]
    adapter = options.adapter_of(target)
    if p.format not in _CODECS:
        return _compare_all(case, planes, checks)
    n = x.shape[0]
    if p.format != "fp8_e4m3" and not any(k in planes for k in ("scale", "min", "zero")):
        # Codes only: judged against the oracle's pre-rounding values and bound, never exact.
        checks = [c for c in checks if c[1] == "codes"]
    if adapter.identity:
        exact = _compare_all(case, planes, checks)
        if exact.status == "FAIL" and exact.mismatch is None:  # a plane is missing
            return exact
        kvq_planes, codes, scale, minimum, zero = _kvq_form(adapter, p, planes, n)
    else:
        kvq_planes, codes, scale, minimum, zero = _kvq_form(adapter, p, planes, n)
        mapped = dict(kvq_planes, codes=_kvq_pack(p, codes))
        mapped.update({k: v for k, v in planes.items() if k not in mapped and k != "zero"})
        exact = _compare_all(case, mapped, checks)
    e = case.expected
    oracle = Oracle(p, _clipped(e, p), e["codes"], e.get("scale"), e.get("min"))
    judgement = _judge(case, oracle, adapter, options.bound, codes, scale, minimum, zero,
                       kvq_planes)
    for q in p.planes:  # planes other than codes / scale / min (the norm) must be exact
        if q["name"] not in ("codes", "scale", "min") and exact.mismatch is not None and \
                exact.mismatch["output"] == q["name"]:
            judgement.violate("exact_" + q["name"], exact.message)
    _check_flush(target, p, x, rotation, planes, judgement)
    _check_pack_round_trip(target, p, codes, planes["codes"], judgement)
    return _apply(exact, judgement, options)


def _kvq_pack(p, codes):
    """kvq's codes plane of codes int64 [n, d] (out-of-range codes masked to b bits: the range
    invariant reports them)."""
    return IDENTITY.pack(p, codes & (255 if p.format == "fp8_e4m3" else (1 << p.bits) - 1))


_STAGES = {s["name"]: s for s in stages()}
# Formats whose codes are judged per element (verdicts.judge_*), and their quantize stages.
_CODECS = ("affine_token", "affine_tile", "fp8_e4m3")
_QUANTIZE_STAGES = ("quantize", "quantize_tile", "quantize_fp8")


def _replay_stage(target, stage, case, options):
    name = case.metadata["stage"]
    p = case.write_params
    adapter = options.adapter_of(target)
    rows = int(case.metadata["rows"])
    inputs = {}
    for arg in _STAGES[name]["args"]:
        if arg["direction"] == "out":
            continue
        # The matrix argument comes from the case's rotation fixture, the rest from in.<name>.
        source = case.inputs.get(arg["name"])
        inputs[arg["name"]] = (case.rotation[0] if source is None else source).copy()
    foreign_packing = (adapter.packing is not None and name.startswith("unpack") and
                       p.format in ("affine_token", "affine_tile"))
    if foreign_packing:  # the target reads its own packing: kvq's bytes re-laid by the adapter
        inputs["packed"] = adapter.pack(p, case.expected["codes"].astype(np.int64))
    outputs = stage(name, p, inputs, rows)
    checks = [(a["expect"], a["expect"], "output") for a in _STAGES[name]["args"]
              if a["direction"] != "in"]
    if name.startswith("pack") and adapter.packing is not None and "packed" in outputs:
        outputs = dict(outputs, packed=_kvq_pack(p, adapter.codes(
            p, {"codes": outputs["packed"]}, rows)))
    if name not in _QUANTIZE_STAGES:
        result = _compare_all(case, outputs, checks)
        _check_finite_outputs(case, outputs, checks, result)
        return result
    codes_adapter = Adapter(adapter.scale_dtype, adapter.min_dtype, adapter.zero_point,
                            "unpacked")
    if adapter.metadata_identity:
        exact = _compare_all(case, outputs, checks)
        if exact.status == "FAIL" and exact.mismatch is None:  # an output is missing
            return exact
    kvq_planes, codes, scale, minimum, zero = _kvq_form(codes_adapter, p, outputs, rows)
    if not adapter.metadata_identity:
        exact = _compare_all(case, dict(kvq_planes, codes=codes.astype(np.uint8)), checks)
    e = case.expected
    oracle = Oracle(p, case.inputs["x"], e["codes"], e.get("scale"), e.get("min"))
    judgement = _judge(case, oracle, adapter, options.bound, codes, scale, minimum, zero,
                       kvq_planes)
    return _apply(exact, judgement, options)


def _check_finite_outputs(case, outputs, checks, result):
    """Invariant finite on a stage's float outputs: NaN / Inf where the oracle's is finite."""
    result.invariants["finite"] = True
    for output, key, _ in checks:
        if key not in outputs:
            continue
        got, want = as_numpy(outputs[key]), case.expected[output]
        if got.dtype.kind != "f" or got.size != want.size:
            continue
        bad = ~np.isfinite(got.reshape(want.shape)) & np.isfinite(want)
        if bad.any():
            result.invariants["finite"] = False
            result.notes.append("finite: %s is %r at %s where the oracle's is finite" % (
                key, float(got.reshape(want.shape)[tuple(np.argwhere(bad)[0])]),
                list(map(int, np.argwhere(bad)[0]))))
            result.status, result.tier = "FAIL", "unexplained"
            result.message = "; ".join([result.message] + result.notes[-1:]).lstrip("; ")


def _replay_attention(target, attend_method, case, options):
    """The attention verdict: over the target's own codes when it offers the protocol
    (own_attention: write() and attend(..., history=)), else the case's tolerance against
    kvq's fp64 reference over kvq's cache."""
    if _method(target, "write") is not None and own_attention.accepts_history(attend_method):
        message, note = own_attention.judge(target, case, options.adapter_of(target))
        result = CaseResult(case.name, case.kind, "FAIL" if message else "PASS",
                            message or "", tier="unexplained" if message else "tolerance")
        result.notes = [note] if note else []
        result.invariants["own_codes"] = message is None
        return result
    tolerance = _tolerance(target, case)
    cache = case.cache()
    q = case.inputs["q"]
    for query in range(q.shape[0]):
        out = attend_method(cache, case.query_sequence(cache, query), q[query].copy())
        mismatch = case.compare_attention(query, as_numpy(out), tolerance)
        if mismatch is not None:
            return CaseResult(case.name, case.kind, "FAIL", mismatch["message"], mismatch,
                              tier="unexplained")
    return CaseResult(case.name, case.kind, "PASS", tier="tolerance")


def _replay_cache(write_cache, case):
    """The cache verdict (kvq.cache_write.judge): every compared bit, as kvq conform."""
    verdict = cache_write.judge(write_cache, case)
    if verdict is None:
        return CaseResult(case.name, case.kind, "PASS", tier="exact")
    message, mismatch = verdict
    return CaseResult(case.name, case.kind, "FAIL", message, mismatch, tier="unexplained")


def _tolerance(target, case):
    """The attention tolerance kvq conform holds the target's backend to: the CUDA path's for a
    target whose `device` is 'cuda', else the CPU oracle's (spec/cache.md §5)."""
    return case.tolerance_gpu if getattr(target, "device", "cpu") == "cuda" else case.tolerance


def replay(target, case, accept="exact", bound=DEFAULT_BOUND, adapter=None, edge_rows="judged"):
    """One case's CaseResult: `case` (a kvq.vectors.Case of KINDS) replayed through `target`,
    its tier held against `accept` (see check(); `accept` may also be what options() returns,
    which then stands for every keyword)."""
    held = accept if isinstance(accept, _Options) else options(target, accept, bound, adapter,
                                                               edge_rows)
    method = _method(target, _METHODS[case.kind])
    if method is None:
        return CaseResult(case.name, case.kind, "SKIP",
                          "the target has no %s()" % _METHODS[case.kind])
    try:
        if case.kind == "attention":
            return _replay_attention(target, method, case, held)
        if case.kind == "pipeline":
            return _replay_pipeline(target, method, case, held)
        if case.kind == "cache":
            return _replay_cache(method, case)
        return _replay_stage(target, method, case, held)
    except NotImplementedError as e:
        return CaseResult(case.name, case.kind, "SKIP", "unsupported: %s" % e)
    except Error as e:
        if getattr(e, "code", "") == "unsupported":
            return CaseResult(case.name, case.kind, "SKIP", "unsupported: %s" % e)
        return CaseResult(case.name, case.kind, "FAIL", "error: %s" % e, tier="unexplained")
    except Exception as e:  # a target's own failure is a verdict, never a crash of the suite
        return CaseResult(case.name, case.kind, "FAIL", "error: %s: %s" % (type(e).__name__, e),
                          tier="unexplained")


def _print(report, out, failures_only):
    width = max([4] + [len(r.name) for r in report.results])
    print("case".ljust(width + 2) + report.target, file=out)
    for r in report.results:
        if not failures_only or r.status == "FAIL":
            tier = "" if r.tier is None else "  " + r.tier
            if r.edge_tier is not None and r.edge_tier != "exact":
                tier += "  edge: " + r.edge_tier
            if r.status == "SKIP":
                tier = "  (%s)" % r.message
            print(r.name.ljust(width + 2) + r.status + tier, file=out)
    if report.failed:
        print("\nfirst mismatch of each failure:", file=out)
        for line in report.failures():
            print("  [%s] %s" % (report.target, line), file=out)
    edges = [r for r in report.results if r.edge_tier not in (None, "exact")]
    if edges:
        print("\nedge rows (%s; groups: subnormal / constant / offset):" % (
            "judged apart" if report.options.edge_rows == "apart" else "judged with the case"),
            file=out)
        for r in edges:
            print("  %s: %s (%s elements unexplained, %s)" % (
                r.name, r.edge_tier, r.edge_counts["unexplained"], " / ".join(
                    str(r.edge_classes.get(c, 0)) for c in EDGE_CLASSES)), file=out)
    o = report.options
    print("\ntiers (accept %s, bound %g%s): %s" % (
        o.accept, o.bound, "" if o.adapter in (None, IDENTITY) else
        ", adapter " + o.adapter.describe(),
        ", ".join("%d %s" % (n, t) for t, n in report.tiers.items() if n or t in TIERS)),
        file=out)
    print("\n%d cases x 1 target (%s, spec %s): %d passed, %d failed, %d skipped"
          % (len(report.results), report.dir, report.spec_version, report.passed,
             report.failed, report.skipped), file=out)


def load_target(spec):
    """The object named by 'module:attribute' (attribute may be dotted), imported. Raises
    kvq.Error (invalid argument) when spec has no ':'; ImportError / AttributeError as Python
    raises them."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise error("target '%s': expected module:attribute" % spec, "invalid argument")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _formats_of(case):
    """The formats a case exercises: its write params', or its cache's key and value formats
    (cache and attention cases)."""
    if case.write_params is not None:
        return {case.write_params.format}
    params = case.cache().params
    return {params["key"].format, params["value"].format}


def select(vectors, kinds=KINDS, formats=None):
    """The names of the cases check() replays, in manifest order: those of `kinds` (of KINDS)
    exercising a format of `formats` (names of kvq.formats(), None for all; a cache or
    attention case exercises its key and value formats).
    Raises kvq.Error (invalid argument) for an unknown kind or format."""
    for kind in kinds:
        if kind not in KINDS:
            raise error("kind '%s' is not replayed from Python (%s)" % (kind, ", ".join(KINDS)),
                        "invalid argument")
    known = {f["name"] for f in _formats()}
    for f in formats or ():
        if f not in known:
            raise error("format '%s' is not one of %s" % (f, ", ".join(sorted(known))),
                        "invalid argument")
    return [name for name in vectors.names() if name.split("/", 1)[0] in kinds and
            (formats is None or _formats_of(vectors.case(name)) & set(formats))]


def check(target, kinds=KINDS, formats=None, vectors=None, out=sys.stdout, failures_only=False,
          name=None, accept="exact", bound=DEFAULT_BOUND, adapter=None, edge_rows="judged"):
    """Replays the cases of `kinds` in `vectors` (a kvq.vectors.VectorSet, a folder, or None:
    kvq.vectors.load()) through `target` and prints kvq conform's table, with each case's tier,
    to `out` (None: silent). kinds, formats: as select(). Returns a Report.

    accept: the worst tier that passes (spec/verdicts.md): 'exact' (the default: every stored
        bit, kvq conform's rule), 'explained' or 'within_step'; 'unexplained' always fails.
    bound: the declared error bound of the boundary rule, in code units (DEFAULT_BOUND = 1e-3).
    adapter: a kvq.conformance.Adapter mapping the target's planes to kvq's (default: the
        target's `adapter` attribute, else kvq's own form).
    edge_rows: 'judged' (edge elements count toward the case's tier) or 'apart' (the case's
        tier is its ordinary elements'; the edge elements' tier is reported beside it).
    Raises kvq.Error (invalid argument) for an unknown kind, format, accept or edge_rows."""
    held = options(target, accept, bound, adapter, edge_rows)
    if vectors is None or isinstance(vectors, str):
        vectors = _vectors.load(vectors)
    results = [replay(target, vectors.case(n), held) for n in select(vectors, kinds, formats)]
    target_name = name or getattr(target, "name", None) or getattr(target, "__name__", "target")
    report = Report(target_name, vectors.dir, vectors.spec_version, results, held)
    if out is not None:
        _print(report, out, failures_only)
    return report
