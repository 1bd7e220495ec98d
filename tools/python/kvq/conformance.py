"""Replays the golden vectors through your kernel and prints the table `kvq conform` prints.

Stage and pipeline cases are held to the exact tier: every stored bit must match (the spec
fixes them); attention cases to the case's tolerance on the relative error per query head
against the fp64 reference, as kvq conform holds them (spec/cache.md §5). A target is an
object with any of
    write(params, x, rotation) -> {plane name: array}   the stored planes of rows x, as
                                                        kvq.encode gives them (pipeline cases)
    stage(name, params, inputs, rows) -> {output: array}  one stage of kvq.stages(), as
                                                        kvq.run_stage does (stage cases)
    attend(cache, seq, q) -> out float32 [Hq, d]        one decode step of q float32 [Hq, d]
                                                        over sequence seq of cache (a
                                                        kvq.Cache), as kvq.attend (attention
                                                        cases; a target whose `device` is
                                                        'cuda' gets the case's GPU tolerance)
or a plain callable, taken as write. The target gets numpy arrays; it may return numpy arrays
or tensors (anything with .cpu() / .numpy() or __array__, e.g. torch tensors on any device: see
kvq._arrays.as_numpy); bf16 values are uint16 bits (a torch.bfloat16 tensor is read as its
bits). A target that raises NotImplementedError, or kvq.Error with code 'unsupported', skips
the case with its reason; a target without the method a case calls skips it.

    report = kvq.conformance.check(kvq.conformance.ORACLE)   # every case passes
    report = kvq.conformance.check(my_write, kinds=["pipeline"], formats=["affine_token"])
    assert report.failed == 0, report.failures()
"""
import importlib
import sys

from . import vectors as _vectors
from ._arrays import as_numpy
from ._errors import error
from ._kvq import Error, attend, encode, formats as _formats, run_stage, stages

__all__ = ["KINDS", "ORACLE", "CaseResult", "Report", "check", "load_target", "replay", "select"]

# The case kinds replayed from Python (cache cases need a cache write target: not yet), and the
# target method each calls.
KINDS = ("stage", "pipeline", "attention")
_METHODS = {"stage": "stage", "pipeline": "write", "attention": "attend"}


class _Oracle:
    """kvq's own scalar reference as a target: passes every case."""
    name = "kvq"

    def write(self, params, x, rotation):
        return encode(params, x, rotation)

    def stage(self, name, params, inputs, rows):
        return run_stage(name, params, inputs, rows)

    def attend(self, cache, seq, q):
        return attend(cache, seq, q)


ORACLE = _Oracle()


class CaseResult:
    """One case's verdict: status 'PASS' | 'FAIL' | 'SKIP', message (why it failed or was
    skipped), mismatch (the first differing element as Case.compare gives it, or None)."""

    def __init__(self, name, kind, status, message="", mismatch=None):
        self.name, self.kind, self.status = name, kind, status
        self.message, self.mismatch = message, mismatch

    def line(self):
        """As kvq conform prints a result: 'FAIL pipeline/...: codes differs at ...'."""
        return self.status + " " + self.name + (": " + self.message if self.message else "")

    def as_dict(self):
        return dict(name=self.name, kind=self.kind, status=self.status, message=self.message,
                    mismatch=self.mismatch)


class Report:
    """Every case's result in manifest order; passed / failed / skipped counts."""

    def __init__(self, target_name, vectors_dir, spec_version, results):
        self.target, self.dir, self.spec_version = target_name, vectors_dir, spec_version
        self.results = results
        self.passed = sum(r.status == "PASS" for r in results)
        self.failed = sum(r.status == "FAIL" for r in results)
        self.skipped = sum(r.status == "SKIP" for r in results)

    def failures(self):
        return [r.line() for r in self.results if r.status == "FAIL"]

    def as_dict(self):
        """The report as JSON-ready data."""
        return dict(target=self.target, vectors=self.dir, spec_version=self.spec_version,
                    passed=self.passed, failed=self.failed, skipped=self.skipped,
                    cases=[r.as_dict() for r in self.results])


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
                              "%s '%s' is missing from the target's output" % (what, key))
        mismatch = case.compare(output, as_numpy(results[key]), key)
        if mismatch is not None:
            return CaseResult(case.name, case.kind, "FAIL", mismatch["message"], mismatch)
    return CaseResult(case.name, case.kind, "PASS")


def _replay_pipeline(write, case):
    p = case.write_params
    rotation = None if case.rotation is None else case.rotation[0].copy()
    planes = write(p, case.inputs["x"].copy(), rotation)
    return _compare_all(case, planes, [(q["source"], q["name"], "plane") for q in p.planes])


_STAGES = {s["name"]: s for s in stages()}


def _replay_stage(stage, case):
    name = case.metadata["stage"]
    inputs = {}
    for arg in _STAGES[name]["args"]:
        if arg["direction"] == "out":
            continue
        # The matrix argument comes from the case's rotation fixture, the rest from in.<name>.
        source = case.inputs.get(arg["name"])
        inputs[arg["name"]] = (case.rotation[0] if source is None else source).copy()
    outputs = stage(name, case.write_params, inputs, int(case.metadata["rows"]))
    return _compare_all(case, outputs, [(a["expect"], a["expect"], "output")
                                        for a in _STAGES[name]["args"] if a["direction"] != "in"])


def _replay_attention(attend_method, case, tolerance):
    cache = case.cache()
    q = case.inputs["q"]
    for query in range(q.shape[0]):
        out = attend_method(cache, case.query_sequence(cache, query), q[query].copy())
        mismatch = case.compare_attention(query, as_numpy(out), tolerance)
        if mismatch is not None:
            return CaseResult(case.name, case.kind, "FAIL", mismatch["message"], mismatch)
    return CaseResult(case.name, case.kind, "PASS")


def _tolerance(target, case):
    """The attention tolerance kvq conform holds the target's backend to: the CUDA path's for a
    target whose `device` is 'cuda', else the CPU oracle's (spec/cache.md §5)."""
    return case.tolerance_gpu if getattr(target, "device", "cpu") == "cuda" else case.tolerance


def replay(target, case):
    """One case's CaseResult: `case` (a kvq.vectors.Case of KINDS) replayed through `target`."""
    method = _method(target, _METHODS[case.kind])
    if method is None:
        return CaseResult(case.name, case.kind, "SKIP",
                          "the target has no %s()" % _METHODS[case.kind])
    try:
        if case.kind == "attention":
            return _replay_attention(method, case, _tolerance(target, case))
        return (_replay_pipeline if case.kind == "pipeline" else _replay_stage)(method, case)
    except NotImplementedError as e:
        return CaseResult(case.name, case.kind, "SKIP", "unsupported: %s" % e)
    except Error as e:
        if getattr(e, "code", "") == "unsupported":
            return CaseResult(case.name, case.kind, "SKIP", "unsupported: %s" % e)
        return CaseResult(case.name, case.kind, "FAIL", "error: %s" % e)
    except Exception as e:  # a target's own failure is a verdict, never a crash of the suite
        return CaseResult(case.name, case.kind, "FAIL", "error: %s: %s" % (type(e).__name__, e))


def _print(report, out, failures_only):
    width = max([4] + [len(r.name) for r in report.results])
    print("case".ljust(width + 2) + report.target, file=out)
    for r in report.results:
        if not failures_only or r.status == "FAIL":
            print(r.name.ljust(width + 2) + r.status, file=out)
    if report.failed:
        print("\nfirst mismatch of each failure:", file=out)
        for line in report.failures():
            print("  [%s] %s" % (report.target, line), file=out)
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
    """The formats a case exercises: its write params', or its cache's key and value formats."""
    if case.write_params is not None:
        return {case.write_params.format}
    params = case.cache().params
    return {params["key"].format, params["value"].format}


def select(vectors, kinds=KINDS, formats=None):
    """The names of the cases check() replays, in manifest order: those of `kinds` (of KINDS)
    exercising a format of `formats` (names of kvq.formats(), None for all; an attention
    case exercises its key and value formats).
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
          name=None):
    """Replays the cases of `kinds` in `vectors` (a kvq.vectors.VectorSet, a folder, or None:
    kvq.vectors.load()) through `target` and prints kvq conform's table to `out` (None:
    silent). kinds, formats: as select(). Returns a Report. Raises kvq.Error (invalid argument)
    for an unknown kind or format."""
    if vectors is None or isinstance(vectors, str):
        vectors = _vectors.load(vectors)
    results = [replay(target, vectors.case(n)) for n in select(vectors, kinds, formats)]
    target_name = name or getattr(target, "name", None) or getattr(target, "__name__", "target")
    report = Report(target_name, vectors.dir, vectors.spec_version, results)
    if out is not None:
        _print(report, out, failures_only)
    return report
