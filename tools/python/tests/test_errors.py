"""kvq's validation reaches Python as kvq.Error with kvq's message and code."""
import numpy as np
import pytest

import kvq


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), "bits 3 is not supported (2 or 4)"),
    (dict(group=48), "group size 48 is not supported"),
    (dict(head_dim=96), "96"),
    (dict(clip=1.5), "1.5"),
    (dict(format="affine_token", head_scale=2.0), "head scale 2 given for format 'affine_token'"),
    (dict(format="fp8_e4m3"), "bits 2 is not supported by format 'fp8_e4m3' (8)"),
    (dict(format="nope"), "nope"),
    (dict(rotation="spin"), "rotation 'spin' is not identity, dense or hadamard"),
])
def test_bad_parameters_raise_kvq_error_naming_the_value(kwargs, message):
    with pytest.raises(kvq.Error) as raised:
        kvq.WriteParams(**kwargs)
    assert isinstance(raised.value, ValueError)
    assert raised.value.code == "invalid argument"
    assert message in str(raised.value)


def test_rows_of_the_wrong_width_are_a_shape_mismatch():
    p = kvq.WriteParams(head_dim=64, group=32)
    with pytest.raises(kvq.Error, match=r"x is \[3, 128\], expected \[n, 64\]") as raised:
        kvq.encode(p, np.zeros((3, 128), np.float32))
    assert raised.value.code == "shape mismatch"


def test_non_finite_rows_are_refused():
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(kvq.Error) as raised:
        kvq.encode(kvq.WriteParams(head_dim=64, group=32), x)
    assert raised.value.code == "non-finite value"


def test_a_dense_rotation_needs_its_matrix():
    p = kvq.WriteParams(head_dim=64, group=32, rotation="dense")
    with pytest.raises(kvq.Error, match="needs the matrix"):
        kvq.encode(p, np.zeros((1, 64), np.float32))
    with pytest.raises(kvq.Error, match=r"rotation is \[64, 32\]"):
        kvq.encode(p, np.zeros((1, 64), np.float32), rotation=np.eye(64, 32, dtype=np.float32))


def test_decode_checks_the_planes():
    p = kvq.WriteParams(head_dim=64, group=32)
    planes = kvq.encode(p, np.ones((4, 64), np.float32))
    with pytest.raises(kvq.Error, match="plane 'min' of format 'affine_token' is missing"):
        kvq.decode(p, {"codes": planes["codes"], "scale": planes["scale"]})
    with pytest.raises(kvq.Error,
                       match=r"plane 'scale' must be a <u2 array \(BF16\), got float32"):
        kvq.decode(p, dict(planes, scale=planes["scale"].astype(np.float32)))
    with pytest.raises(kvq.Error, match="plane 'min' holds 6 elements, expected 4 rows of 2"):
        kvq.decode(p, dict(planes, min=planes["min"][:3]))


def test_run_stage_checks_its_stage_and_inputs():
    p = kvq.WriteParams(head_dim=64, group=32)
    with pytest.raises(kvq.Error, match=r"unknown stage 'nope' \(valid: rotate_dense, "):
        kvq.run_stage("nope", p, {}, 2)
    with pytest.raises(kvq.Error, match="stage 'quantize_tile' belongs to format 'affine_tile'"):
        kvq.run_stage("quantize_tile", p, {}, 32)
    with pytest.raises(kvq.Error, match="stage 'pack' needs input 'codes'"):
        kvq.run_stage("pack", p, {}, 2)
    with pytest.raises(kvq.Error,
                       match="input 'codes' of stage 'pack' holds 126 elements, expected 128"):
        kvq.run_stage("pack", p, {"codes": np.zeros((2, 63), np.uint8)}, 2)
