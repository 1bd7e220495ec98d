"""kvq.conformance.check: kvq's own kernels pass every stage, pipeline, cache and attention
case; a wrong kernel fails with kvq conform's first-mismatch line; unsupported cases are
skipped. Cache targets: test_cache_cases.py."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvq


def replayed_names(vectors, kinds):
    return [n for n in vectors.names() if n.split("/")[0] in kinds]


def test_the_oracle_passes_every_replayed_case(vectors):
    out = io.StringIO()
    report = kvq.conformance.check(kvq.conformance.ORACLE, vectors=vectors, out=out)
    assert [r.name for r in report.results] == replayed_names(vectors, kvq.conformance.KINDS)
    assert report.failed == 0 and report.skipped == 0, report.failures()[:3]
    assert {r.kind for r in report.results} == {"stage", "pipeline", "cache", "attention"}
    table = out.getvalue().splitlines()
    assert table[0].startswith("case") and table[0].endswith("kvq")
    assert table[-1] == ("%d cases x 1 target (%s, spec %s): %d passed, 0 failed, 0 skipped"
                         % (report.passed, vectors.dir, vectors.spec_version, report.passed))
    json.dumps(report.as_dict())


def packing_off_by_one(params, x, rotation):
    planes = dict(kvq.encode(params, x, rotation))
    planes["codes"] = np.roll(planes["codes"], 1, axis=1)
    return planes


def test_a_kernel_packing_off_by_one_fails_with_its_first_mismatch(vectors):
    out = io.StringIO()
    report = kvq.conformance.check(packing_off_by_one, kinds=["pipeline"],
                                   formats=["affine_token"], vectors=vectors, out=out)
    assert report.results and report.failed == len(report.results)
    first = report.results[0]
    assert first.mismatch["output"] == "codes" and first.mismatch["column"] >= 0
    expected = vectors.case(first.name).expected["packed"]
    row, column = first.mismatch["row"], first.mismatch["column"]
    assert first.mismatch["expected"] == str(expected[row, column])
    assert ("  [packing_off_by_one] FAIL %s: codes differs at row %d, column %d"
            % (first.name, row, column)) in out.getvalue()


def test_a_kernel_of_the_wrong_width_fails_on_the_size(vectors):
    def four_bits(params, x, rotation):
        wider = kvq.WriteParams(format=params.format, head_dim=params.head_dim,
                                group=params.group, bits=4, clip=params.clip,
                                rotation=params.rotation, hadamard_block=params.hadamard_block,
                                bitrev=params.bitrev)
        return kvq.encode(wider, x, rotation)
    report = kvq.conformance.check(four_bits, kinds=["pipeline"], formats=["affine_token"],
                                   vectors=vectors, out=None)
    two_bit = [r for r in report.results if vectors.case(r.name).write_params.bits == 2]
    assert two_bit and all(r.status == "FAIL" for r in two_bit)
    assert two_bit[0].message.startswith("error: codes: the result has ")
    assert all(r.status == "PASS" for r in report.results if r not in two_bit)


def test_a_kernel_returning_another_dtype_fails_naming_it(vectors):
    def int32_codes(params, x, rotation, widths=None):
        planes = dict(kvq.encode(params, x, rotation, widths))
        planes["codes"] = planes["codes"].astype(np.int32)
        return planes
    report = kvq.conformance.check(int32_codes, kinds=["pipeline"], vectors=vectors, out=None)
    assert report.results and report.failed == len(report.results)
    assert report.results[0].message == "error: codes must be a |u1 array (U8), got int32"


def test_unsupported_cases_are_skipped_with_the_reason(vectors):
    class TokenOnly:
        name = "token_only"

        def write(self, params, x, rotation):
            if params.format != "affine_token":
                raise NotImplementedError("format %s" % params.format)
            return kvq.encode(params, x, rotation)

    out = io.StringIO()
    report = kvq.conformance.check(TokenOnly(), vectors=vectors, out=out)
    skipped = [r for r in report.results if r.status == "SKIP"]
    assert {r.message for r in skipped if r.kind == "stage"} == {"the target has no stage()"}
    assert any(r.message == "unsupported: format affine_tile" for r in skipped)
    assert report.failed == 0
    tile = next(r.name for r in skipped if r.message == "unsupported: format affine_tile")
    assert any(line.split() == [tile, "SKIP", "(unsupported:", "format", "affine_tile)"]
               for line in out.getvalue().splitlines())
    assert {c["message"] for c in report.as_dict()["cases"] if c["name"] == tile} == {
        "unsupported: format affine_tile"}


def test_a_stage_kernel_is_replayed_through_its_arguments(vectors):
    def flipped_scale(name, params, inputs, rows):
        outputs = kvq.run_stage(name, params, inputs, rows)
        if name == "quantize":
            outputs["scale"] = outputs["scale"] ^ np.uint16(1)  # one bf16 ulp
        return outputs
    report = kvq.conformance.check(type("T", (), {"stage": staticmethod(flipped_scale),
                                                  "name": "flip"})(),
                                   kinds=["stage"], vectors=vectors, out=None)
    failed = [r for r in report.results if r.status == "FAIL"]
    assert failed and all(vectors.case(r.name).metadata["stage"] == "quantize" for r in failed)
    assert all(r.mismatch["output"] == "scale" for r in failed)


def test_unknown_kinds_and_formats_are_refused(vectors):
    with pytest.raises(kvq.Error, match="kind 'fixtures' is not replayed from Python"):
        kvq.conformance.check(kvq.conformance.ORACLE, kinds=["fixtures"], vectors=vectors)
    with pytest.raises(kvq.Error, match="format 'int3' is not one of"):
        kvq.conformance.check(kvq.conformance.ORACLE, formats=["int3"], vectors=vectors)


@pytest.mark.skipif(not os.environ.get("KVQ_BINARY"), reason="KVQ_BINARY (ctest sets it) not set")
def test_the_verdicts_are_the_clis(vectors):
    table = subprocess.run([os.environ["KVQ_BINARY"], "conform", "--backend", "scalar",
                            "--vectors", vectors.dir], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    cli = [tuple(line.split()) for line in table
           if line.split("/")[0] in kvq.conformance.KINDS]
    report = kvq.conformance.check(kvq.conformance.ORACLE, vectors=vectors, out=None)
    assert cli == [(r.name, r.status) for r in report.results]


def test_the_command_line_replays_a_module_target(vectors, tmp_path):
    (tmp_path / "my_kernels.py").write_text(
        "import numpy as np, kvq\n"
        "def good(p, x, r, widths=None):\n    return kvq.encode(p, x, r, widths)\n"
        "def bad(p, x, r):\n"
        "    planes = dict(kvq.encode(p, x, r))\n"
        "    planes['codes'] = np.roll(planes['codes'], 1, axis=1)\n"
        "    return planes\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), os.path.dirname(os.path.dirname(kvq.__file__))]))

    def conform(target, *extra):
        return subprocess.run([sys.executable, "-m", "kvq.conform", "--target", target,
                               "--kinds", "pipeline", "--vectors", vectors.dir, *extra],
                              env=env, capture_output=True, text=True)

    good = conform("my_kernels:good", "--json", str(tmp_path / "good.json"))
    assert good.returncode == 0, good.stderr
    report = json.loads((tmp_path / "good.json").read_text())
    assert report["failed"] == 0 and report["passed"] == len(replayed_names(vectors,
                                                                            ("pipeline",)))
    bad = conform("my_kernels:bad", "--formats", "affine_tile", "--failures-only")
    assert bad.returncode == 2
    assert "[my_kernels:bad] FAIL pipeline/tile_" in bad.stdout
    assert conform("my_kernels:good", "--formats", "int3").returncode == 1
    # A rolled code plane is unexplained at any accepted tier; the JSON says so per case.
    within = conform("my_kernels:bad", "--formats", "affine_token", "--accept", "within_step",
                     "--edge-rows", "apart", "--json", str(tmp_path / "bad.json"))
    assert within.returncode == 2
    data = json.loads((tmp_path / "bad.json").read_text())
    assert data["accept"] == "within_step" and data["edge_rows"] == "apart"
    assert data["tiers"]["unexplained"] == data["failed"] > 0
    assert "tiers (accept within_step, bound 0.001): " in within.stdout
