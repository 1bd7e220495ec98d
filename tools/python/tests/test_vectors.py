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
