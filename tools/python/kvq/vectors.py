"""The golden vectors (conformance/README.md) through conformance's C++ reader.

    vs = kvq.vectors.load()                  # verified: every SHA-256 of manifest.json
    for name in vs.names(): case = vs.case(name)
    case.kind, case.write_params, case.inputs["x"], case.expected["packed"], case.tolerance
"""
import os

from ._errors import error
from ._kvq import Case, VectorSet, load_vectors

__all__ = ["Case", "VectorSet", "default_dir", "load"]


def default_dir():
    """The vectors folder load() reads without an argument: the first holding manifest.json of
    vectors/ beside this package (the build tree links conformance/vectors there) and
    $KVQ_VECTORS_DIR. Raises kvq.Error naming both places when neither holds one."""
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")
    places = [beside] + ([os.environ["KVQ_VECTORS_DIR"]] if os.environ.get("KVQ_VECTORS_DIR")
                         else [])
    for place in places:
        if os.path.isfile(os.path.join(place, "manifest.json")):
            return place
    raise error("no golden vectors: no manifest.json in " + " or ".join(places) +
                ("" if len(places) > 1 else " and KVQ_VECTORS_DIR is not set"), "i/o error")


def load(dir=None):
    """A VectorSet of `dir` (default: default_dir()), its manifest verified and every case
    parsed once; cases are read by name with .case(name), listed by .names()."""
    return load_vectors(dir if dir is not None else default_dir())
