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
                           skipped=count(vectors, ["stage", "attention"], ["affine_token"]))
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
