"""Every row of formats.inc, stages.inc and schemes.inc reaches Python, in list order. The rows
are read from the .inc files here, independently of the C++ expansion under test."""
import re

import pytest

import kvq
from conftest import SOURCE_DIR


def row_ids(relative_path, macro):
    text = (SOURCE_DIR / relative_path).read_text()
    return re.findall(r"^%s\((\w+)," % macro, text, flags=re.MULTILINE)


def test_formats_are_the_rows_of_formats_inc():
    rows = row_ids("common/include/kvq/common/formats.inc", "KVQ_FORMAT")
    assert rows and [f["name"] for f in kvq.formats()] == rows
    assert all(f["summary"] and re.fullmatch(r"\d+\.\d+", f["spec_version"])
               for f in kvq.formats())


def test_stages_are_the_rows_of_stages_inc():
    rows = row_ids("common/include/kvq/common/stages.inc", "KVQ_STAGE")
    stages = kvq.stages()
    assert rows and [s["name"] for s in stages] == rows
    families = {"transform"} | {f["name"] for f in kvq.formats()}
    for s in stages:
        assert s["family"] in families, s
        assert s["args"] and all(a["direction"] in ("in", "out", "inout") for a in s["args"])


def test_schemes_are_the_rows_of_schemes_inc():
    rows = row_ids("calib/include/kvq/calib/schemes.inc", "KVQ_SCHEME")
    schemes = kvq.schemes()
    assert rows and [s["name"] for s in schemes] == rows
    names = {f["name"] for f in kvq.formats()}
    assert all(s["summary"] and s["format_k"] in names and s["format_v"] in names
               for s in schemes)


def test_planes_are_the_rows_of_formats_inc():
    text = (SOURCE_DIR / "common/include/kvq/common/formats.inc").read_text()
    planes = re.findall(r"^KVQ_PLANE\(AffineToken, (\w+), (\w+),", text, flags=re.MULTILINE)
    p = kvq.WriteParams(format="affine_token", head_dim=64, group=32, bits=4)
    assert [(q["name"], q["source"]) for q in p.planes] == planes
    assert [q["elements"] for q in p.planes] == [64 * 4 // 8, 2, 2]


def test_write_params_keywords_are_the_rows_of_write_params_inc():
    text = (SOURCE_DIR / "common/include/kvq/common/write_params.inc").read_text()
    rows = re.findall(r"^KVQ_WRITE_PARAM\(\w+, (\w+),", text, flags=re.MULTILINE)
    doc = kvq.WriteParams.__init__.__doc__
    signature = re.search(r"WriteParams\(\*, ([^)]*)\)", doc).group(1)
    assert rows and [kw.split("=")[0] for kw in signature.split(", ")] == rows
    p = kvq.WriteParams()
    assert all(hasattr(p, name) for name in rows)
    with pytest.raises(TypeError, match="unexpected keyword argument 'groups'"):
        kvq.WriteParams(groups=32)
