"""The codec through Python against the golden vectors (bit for bit) and against itself:
encode stores the write path's outputs, decode gives the write path's decoded rows."""
import numpy as np
import pytest

import kvq
from conftest import cases_of_kind


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def rotation_of(case):
    r = case.rotation
    return None if r is None else r[0]


def test_quantize_reproduces_every_pipeline_case(vectors):
    cases = cases_of_kind(vectors, "pipeline")
    assert len(cases) > 100
    for case in cases:
        got = kvq.quantize(case.write_params, case.inputs["x"], rotation_of(case),
                           case.inputs.get("widths"))
        assert list(sorted(got)) == list(sorted(case.expected)), case.name
        for name, want in case.expected.items():
            assert got[name].shape == want.shape, (case.name, name)
            assert np.array_equal(bits(got[name]), bits(want)), (case.name, name)


def test_encode_stores_the_expected_planes_and_decode_reads_them(vectors):
    formats = set()
    for case in cases_of_kind(vectors, "pipeline"):
        p = case.write_params
        formats.add(p.format)
        widths = case.inputs.get("widths")
        planes = kvq.encode(p, case.inputs["x"], rotation_of(case), widths)
        assert list(planes) == [q["name"] for q in p.planes], case.name
        for plane in p.planes:
            want = case.expected[plane["source"]]
            assert bits(planes[plane["name"]]).tobytes() == bits(want).tobytes(), \
                (case.name, plane["name"])
        decoded = kvq.decode(p, planes, widths)
        assert np.array_equal(bits(decoded), bits(case.expected["dequantized"])), case.name
    assert {"affine_token", "affine_tile", "codebook"} <= formats


QUANTIZED = [
    dict(format="affine_token", head_dim=64, group=32, bits=2),
    dict(format="affine_token", head_dim=128, group=128, bits=4, rotation="hadamard",
         bitrev=True, clip=0.92),
    dict(format="affine_tile", head_dim=64, group=32, bits=2, norm=True),
    dict(format="affine_tile", head_dim=128, group=64, bits=4, rotation="hadamard", clip=0.96),
    dict(format="fp8_e4m3", head_dim=64, bits=8, head_scale=0.25),
    dict(format="codebook", head_dim=64, group=64, bits=3, rotation="hadamard"),
    dict(format="codebook", head_dim=128, group=128, bits=2, codebook="gaussian"),
]


@pytest.mark.parametrize("kwargs", QUANTIZED, ids=lambda k: "%(format)s_d%(head_dim)d" % k)
def test_decode_of_encode_is_the_write_paths_decoded_rows(kwargs):
    p = kvq.WriteParams(**kwargs)
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((128, p.head_dim)) * rng.uniform(0.01, 100, (128, 1)))
    x = x.astype(np.float32)
    planes = kvq.encode(p, x)
    for plane in p.planes:
        assert planes[plane["name"]].shape == (128 // plane["tokens_per_row"],
                                               plane["elements"])
    decoded = kvq.decode(p, planes)
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    assert np.array_equal(bits(decoded), bits(kvq.quantize(p, x)["dequantized"]))
    # A plane that is not C-contiguous is copied first and gives the same rows.
    fortran = {name: np.asfortranarray(a) for name, a in planes.items()}
    assert np.array_equal(bits(kvq.decode(p, fortran)), bits(decoded))


def test_codebook_widths_reach_encode_decode_and_quantize():
    # A Block-GTQ head: widths 1..8 over the 32 blocks of d = 64, row limits that fit them.
    widths = np.array([1 + i % 8 for i in range(32)], np.uint8)
    p = kvq.WriteParams(format="codebook", head_dim=64, group=64, bits=4, segments=8,
                        code_bytes=64)
    rng = np.random.default_rng(29)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    planes = kvq.encode(p, x, widths=widths)
    decoded = kvq.decode(p, planes, widths)
    full = kvq.quantize(p, x, widths=widths)
    assert "tau" not in full and full["segment_norm"].shape == (8, 8)
    assert np.array_equal(bits(decoded), bits(full["dequantized"]))
    # The widths are read: every block at 4 bits codes the same rows otherwise.
    assert not np.array_equal(bits(kvq.encode(p, x)["codes"]), bits(planes["codes"]))
    with pytest.raises(kvq.Error, match=r"widths is \[31\], expected \[32\]"):
        kvq.encode(p, x, widths=widths[:31])
    bad = widths.copy()
    bad[3] = 9
    with pytest.raises(kvq.Error, match="block widths of KV head 0 has 9 at block 3"):
        kvq.encode(p, x, widths=bad)


def test_bf16_stores_the_rows_rounded_to_nearest_even():
    p = kvq.WriteParams(format="bf16", head_dim=64)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    x[0, :4] = [1.00390625, 1.01171875, -0.0, 3.0e-39]  # ties to even, -0, a subnormal
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    planes = kvq.encode(p, x)
    assert list(planes) == ["rows"]
    assert np.array_equal(planes["rows"], rounded)
    widened = (rounded.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(bits(kvq.decode(p, planes)), bits(widened))


def test_results_own_kvq_buffers_without_a_copy():
    p = kvq.WriteParams(head_dim=64, group=32)
    planes = kvq.encode(p, np.ones((2, 64), np.float32))
    # The array wraps the C++ buffer (a capsule holds it), not a numpy allocation.
    assert not planes["codes"].flags.owndata and planes["codes"].base is not None
    assert planes["codes"].flags.writeable
