"""kvq's conformance suite inside a project's own pytest run: one test per golden-vector case.

In the project's conftest.py (the one line):
    pytest_plugins = ["kvq.pytest_plugin"]
then name the kernel on the command line or in the ini file:
    pytest --kvq-target my_kernels:write [--kvq-kinds pipeline] [--kvq-formats affine_token]
    [pytest] kvq_target = my_kernels:write      (kvq_kinds, kvq_formats, kvq_vectors alike)
The target is what kvq.conformance.check takes (a write function, or an object with any of
write(), stage(), write_cache(), attend()). Each case of kvq.conformance.select() becomes the test
kvq::conformance[<case name>] (`-k tile_` selects cases as usual): it passes, fails with kvq
conform's first-mismatch line (and its tier), or skips with the target's reason.
--kvq-accept, --kvq-bound, --kvq-edge-rows (kvq_accept, ... in the ini file) are check()'s
accept, bound and edge_rows (spec/verdicts.md); the target's `adapter` attribute is used.
Without a target the plugin adds nothing.
"""
import pytest

from . import conformance, vectors as _vectors
from ._kvq import Error

_OPTIONS = (  # (name, help); --kvq-<name> on the command line, kvq_<name> in the ini file
    ("target", "module:attribute of the kernel replayed through kvq's golden vectors"),
    ("kinds", "case kinds, comma-separated (default: %s)" % ",".join(conformance.KINDS)),
    ("formats", "formats, comma-separated (default: every format)"),
    ("vectors", "golden-vector folder (default: kvq.vectors.default_dir())"),
    ("accept", "the worst verdict tier that passes: exact (default), explained, within_step"),
    ("bound", "the boundary rule's bound in code units (default: %g)"
     % conformance.DEFAULT_BOUND),
    ("edge-rows", "judged (default) or apart: whether edge groups gate a case"),
)


def pytest_addoption(parser):
    group = parser.getgroup("kvq", "kvq conformance (kvq.pytest_plugin)")
    for name, help_text in _OPTIONS:
        key = name.replace("-", "_")
        group.addoption("--kvq-" + name, dest="kvq_" + key, default=None, help=help_text)
        parser.addini("kvq_" + key, help_text)


def _option(config, name):
    """--kvq-<name> if given, else the ini's kvq_<name>; None when neither is set."""
    return config.getoption("kvq_" + name) or config.getini("kvq_" + name) or None


def _list_option(config, name):
    value = _option(config, name)
    return value.split(",") if value else None


class KvqCaseFailure(Exception):
    """A case's FAIL: its message is kvq conform's first-mismatch line."""


class KvqCase(pytest.Item):
    """One golden-vector case replayed through the target (kvq.conformance.replay)."""

    def __init__(self, *, suite, case_name, **kwargs):
        super().__init__(**kwargs)
        self.suite, self.case_name = suite, case_name

    def runtest(self):
        result = conformance.replay(self.suite.target, self.suite.vectors.case(self.case_name),
                                    self.suite.options)
        if result.status == "SKIP":
            pytest.skip(result.message)
        if result.status == "FAIL":
            raise KvqCaseFailure(result.line())

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, KvqCaseFailure):
            return "[%s] %s" % (self.suite.target_spec, excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.suite.vectors.dir, None, self.name


class KvqSuite(pytest.Collector):
    """The cases the options select, against the target they name (loaded once)."""

    def __init__(self, *, target_spec, kinds, formats, vectors_dir, options, **kwargs):
        super().__init__(**kwargs)
        self.target_spec = target_spec
        self.target = conformance.load_target(target_spec)
        self.options = conformance.options(self.target, **options)
        self.vectors = _vectors.load(vectors_dir)
        self.case_names = conformance.select(self.vectors, kinds or conformance.KINDS, formats)

    def collect(self):
        return [KvqCase.from_parent(self, name="conformance[%s]" % n, suite=self, case_name=n)
                for n in self.case_names]


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so they select cases too
def pytest_collection_modifyitems(session, config, items):
    target_spec = _option(config, "target")
    if target_spec is None:
        return
    try:
        suite = KvqSuite.from_parent(
            session, name="kvq", nodeid="kvq", target_spec=target_spec,
            kinds=_list_option(config, "kinds"), formats=_list_option(config, "formats"),
            vectors_dir=_option(config, "vectors"), options=dict(
                accept=_option(config, "accept") or "exact",
                bound=float(_option(config, "bound") or conformance.DEFAULT_BOUND),
                edge_rows=_option(config, "edge_rows") or "judged"))
    except (Error, ImportError, AttributeError, ValueError) as e:
        raise pytest.UsageError("kvq: --kvq-target %s: %s" % (target_spec, e)) from e
    # genitems reports the collection as pytest's own does (the "collected N items" count).
    items.extend(session.genitems(suite))
