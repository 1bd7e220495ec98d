"""kvq: the oracle of kvq's KV-cache quantization (the C++ scalar reference) for Python.

Everything listed here comes from kvq's own lists (formats.inc, stages.inc, schemes.inc)
through the C++ tables that expand them: a new row appears with no Python edit.

    import numpy as np, kvq
    p = kvq.WriteParams(format="affine_token", head_dim=64, group=32, bits=2)
    planes = kvq.encode(p, np.random.randn(4, 64).astype(np.float32))  # {"codes", "scale", "min"}
    rows = kvq.decode(p, planes)                                        # float32 [4, 64]
    case = kvq.vectors.load().case("pipeline/d64_g32_b2_rho1_identity")
    kvq.conformance.check(my_write_kernel, kinds=["pipeline"])         # kvq conform's table
    kvq.conformance.check(foreign, accept="explained",                 # verdict tiers
                          adapter=kvq.conformance.Adapter(scale_dtype="float16"))

Errors are kvq.Error (a ValueError) with kvq's message and e.code.

kvq.torch_ops (kvq's CUDA write and decode as torch ops, over libkvq_gpu.so's C ABI) needs
neither the extension module nor this interpreter's ABI: where kvq._kvq does not load (a Python
other than the one it was built for, as on the GPU machine), `import kvq.torch_ops` (and
`from kvq import torch_ops`, `kvq.hf`) still works and every name above raises an ImportError
that carries the extension's own.
"""
try:
    from ._kvq import (Cache, Error, WriteParams, attend, decode, encode, formats, quantize,
                       replay_cache, run_stage, schemes, stages)
    from . import cache_write, conformance, own_attention, vectors, verdicts
except ImportError as _extension_error:  # noqa: F841 (kept for __getattr__)
    _EXTENSION_ERROR = _extension_error

    def __getattr__(name):
        if name in ("torch_ops", "hf"):  # `from kvq import torch_ops` asks here first
            import importlib
            return importlib.import_module("." + name, __name__)
        # Another name is an AttributeError, so that hasattr() and getattr() with a default read
        # it as absent (torch.compile's inductor probes kvq.torch for the op namespace `kvq`).
        if name not in __all__:
            raise AttributeError("module 'kvq' has no attribute %r" % name)
        raise ImportError("kvq.%s needs the extension module kvq._kvq, which did not load: "
                          "%s (kvq.torch_ops works without it)" % (name, _EXTENSION_ERROR))

__all__ = ["Cache", "Error", "WriteParams", "attend", "cache_write", "conformance", "decode",
           "encode", "formats", "own_attention", "quantize", "replay_cache", "run_stage",
           "schemes", "stages", "vectors", "verdicts"]
