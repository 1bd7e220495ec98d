"""kvq.pytest_plugin: one conftest line adds a test per golden-vector case to a project's suite;
run here in a scratch project through pytest's pytester."""
import pytest

import kvq

pytest_plugins = ["pytester"]

KERNELS = '''
import numpy as np, kvq

def packing_off_by_one(params, x, rotation):
    planes = dict(kvq.encode(params, x, rotation))
    planes["codes"] = np.roll(planes["codes"], 1, axis=1)
    return planes

def half_up(params, x, rotation):
    """kvq's quantizer rounding half up: differs only at exact ties (x - m) / s = k + 1/2."""
    if params.format != "affine_token":
        raise NotImplementedError("format %s" % params.format)
    out = kvq.quantize(params, x, rotation)
    tau = out["tau"][:, None]
    xc = np.where(out["rotated"] > tau, tau, np.where(out["rotated"] < -tau, -tau,
                                                      out["rotated"]))
    sf = np.repeat((out["scale"].astype(np.uint32) << 16).view(np.float32), params.group, 1)
    mf = np.repeat((out["min"].astype(np.uint32) << 16).view(np.float32), params.group, 1)
    with np.errstate(all="ignore"):
        q = np.where(sf == 0, 0, np.clip(np.floor((xc - mf) / sf + np.float32(0.5)), 0,
                                         (1 << params.bits) - 1))
    codes = kvq.run_stage("pack", params, {"codes": q.astype(np.uint8)}, x.shape[0])
    return {"codes": codes["packed"], "scale": out["scale"], "min": out["min"]}

def token_only(params, x, rotation):
    if params.format != "affine_token":
        raise NotImplementedError("format %s" % params.format)
    return kvq.encode(params, x, rotation)
'''


@pytest.fixture
def project(pytester):
    """A project whose conftest.py holds the one line, with kernels.py importable."""
    pytester.makeconftest('pytest_plugins = ["kvq.pytest_plugin"]')
    pytester.makepyfile(kernels=KERNELS)
    pytester.syspathinsert()
    return pytester


def count(vectors, kinds, formats=None):
    return len(kvq.conformance.select(vectors, kinds, formats))


def test_the_oracle_passes_a_test_per_case(project, vectors):
    result = project.runpytest("--kvq-target", "kvq.conformance:ORACLE")
    result.assert_outcomes(passed=count(vectors, kvq.conformance.KINDS))
    result.stdout.fnmatch_lines(["collected %d items" % count(vectors, kvq.conformance.KINDS)])


def test_a_wrong_kernel_fails_with_kvqs_first_mismatch(project, vectors):
    result = project.runpytest("--kvq-target", "kernels:packing_off_by_one",
                               "--kvq-formats", "affine_token", "-rs")
    result.assert_outcomes(failed=count(vectors, ["pipeline"], ["affine_token"]),
                           skipped=count(vectors, ["stage", "cache", "attention"],
                                         ["affine_token"]))
    result.stdout.fnmatch_lines([
        "*_ conformance[[]pipeline/d64_g32_b2_rho1_identity[]] _*",
        "[[]kernels:packing_off_by_one[]] FAIL pipeline/d64_g32_b2_rho1_identity: "
        "codes differs at row *, column *: expected *, got *",
        "SKIPPED * the target has no attend()",  # -rs groups skips in collection order
        "SKIPPED * the target has no stage()"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_ini_file_names_the_target_and_unsupported_cases_skip(project, vectors):
    project.makeini("[pytest]\nkvq_target = kernels:token_only\nkvq_kinds = pipeline\n")
    result = project.runpytest("-rs")
    token = count(vectors, ["pipeline"], ["affine_token"])
    result.assert_outcomes(passed=token, skipped=count(vectors, ["pipeline"]) - token)
    result.stdout.fnmatch_lines(["SKIPPED * unsupported: format affine_tile"])


def test_k_selects_cases_by_name(project, vectors):
    result = project.runpytest("--kvq-target", "kvq.conformance:ORACLE", "-k", "tile_")
    result.assert_outcomes(passed=sum("tile_" in n for n in kvq.conformance.select(
        vectors, kvq.conformance.KINDS)))


def test_without_a_target_the_plugin_adds_nothing(project):
    project.makepyfile(test_own="def test_own():\n    pass\n")
    project.runpytest().assert_outcomes(passed=1)


def test_a_target_that_cannot_be_loaded_is_a_usage_error(project):
    for target, message in [("kernels:nope", "has no attribute 'nope'"),
                            ("kernels", "expected module:attribute")]:
        result = project.runpytest("--kvq-target", target)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["ERROR: kvq: --kvq-target %s: *%s*" % (target, message)])
    result = project.runpytest("--kvq-target", "kernels:token_only", "--kvq-formats", "int3")
    result.stderr.fnmatch_lines(["ERROR: kvq: *format 'int3' is not one of*"])


def test_accept_explained_passes_a_half_up_kernel(project, vectors):
    args = ["--kvq-target", "kernels:half_up", "--kvq-kinds", "pipeline", "--kvq-formats",
            "affine_token"]
    strict = project.runpytest(*args)
    ties = strict.parseoutcomes().get("failed", 0)
    assert ties > 0
    strict.stdout.fnmatch_lines(["*FAIL pipeline/*: * differs at *; tier explained*"])
    project.runpytest(*args, "--kvq-accept", "explained").assert_outcomes(
        passed=count(vectors, ["pipeline"], ["affine_token"]))
    result = project.runpytest(*args, "--kvq-accept", "close")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: kvq: *accept 'close' is not one of*"])
