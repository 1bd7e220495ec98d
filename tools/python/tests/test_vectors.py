"""kvq.vectors reads the golden vectors through conformance's reader: every case of the
manifest, its parameters, inputs, expected outputs and tolerance; a tampered file is refused."""
import json
import shutil

import numpy as np
import pytest

import kvq


def test_every_case_of_the_manifest_is_listed(vectors):
    manifest = json.loads(open(vectors.dir + "/manifest.json").read())
    cases = [f["path"][:-len(".safetensors")] for f in manifest["files"] if f["role"] == "case"]
    assert vectors.names() == cases and len(vectors) == len(cases)
    assert vectors.spec_version == manifest["spec_version"]


def test_each_case_has_inputs_expectations_and_its_tolerance(vectors):
    kinds = set()
    for name in vectors.names():
        case = vectors.case(name)
        kinds.add(case.kind)
        assert name.startswith(case.kind + "/"), name
        assert case.inputs and case.expected, name
        assert case.metadata["case"] == name
        if case.kind == "attention":
            assert case.tolerance == float(case.metadata["tolerance"]) > 0
            assert case.tolerance_gpu == float(case.metadata["tolerance_gpu"]) > 0
        else:
            assert case.tolerance == 0.0
        assert (case.write_params is None) == (case.kind in ("cache", "attention")), name
    assert kinds == {"stage", "pipeline", "cache", "attention"}


def test_parameters_and_views(vectors):
    name = next(n for n in vectors.names()
                if n.startswith("pipeline/") and "dense" in n)
    case = vectors.case(name)
    p = case.write_params
    assert p.rotation == "dense" and str(p.head_dim) == case.metadata["head_dim"]
    assert case.rotation.shape == (1, p.head_dim, p.head_dim)
    r = case.rotation[0].astype(np.float64)
    assert np.allclose(r @ r.T, np.eye(p.head_dim), atol=1e-5)  # an orthogonal fixture
    x = case.inputs["x"]
    assert x.dtype == np.float32 and x.shape == (int(case.metadata["rows"]), p.head_dim)
    assert not x.flags.writeable
    with pytest.raises(kvq.Error, match="no case 'pipeline/none'") as raised:
        vectors.case("pipeline/none")
    assert raised.value.code == "invalid argument"


def test_a_tampered_case_is_refused(vectors, tmp_path):
    copy = tmp_path / "vectors"
    shutil.copytree(vectors.dir, copy)
    victim = copy / (vectors.names()[0] + ".safetensors")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(kvq.Error, match="manifest check failed") as raised:
        kvq.vectors.load(str(copy))
    assert raised.value.code == "mismatch"


def test_the_new_vectors_hold_offset_channels_and_ranges_past_fp16(vectors):
    """What the offset_range cases were added for: groups whose bf16 min lies code steps from
    the min, and groups whose range overflows fp16 (outside_kivi.md §4.4)."""
    far, wide = 0, 0
    for name in kvq.conformance.select(vectors, ["pipeline"], ["affine_token", "affine_tile"]):
        if "offset" not in name:
            continue
        case = vectors.case(name)
        p = case.write_params
        scale = (case.expected["scale"].astype(np.uint32) << 16).view(np.float32)
        minimum = (case.expected["min"].astype(np.uint32) << 16).view(np.float32)
        x, tau = case.expected["rotated"], case.expected["tau"][:, None]
        x = np.where(x > tau, tau, np.where(x < -tau, -tau, x))
        if p.format == "affine_tile":
            groups = x.reshape(-1, p.group, p.head_dim).transpose(0, 2, 1)
        else:
            groups = x.reshape(x.shape[0], -1, p.group)
        lo, hi = groups.min(axis=-1), groups.max(axis=-1)
        step = (hi - lo) / ((1 << p.bits) - 1)
        with np.errstate(all="ignore"):
            far += int(np.sum(np.abs(lo - minimum.reshape(lo.shape)) > 2 * step))
        wide += int(np.sum(hi.astype(np.float64) - lo > 65504))
        assert np.all(np.isfinite(scale))
    assert far >= 50 and wide >= 64
