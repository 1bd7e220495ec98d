"""kvq's CUDA write path and decode step as torch ops (torch >= 2.4, a CUDA device).

The ops call libkvq_gpu.so through its C ABI (gpu/include/kvq/gpu/c_api.h) with ctypes, so this
module depends on neither the Python nor the torch ABI: the library built once on the build
machine loads under any Python 3 and any torch (docs/architecture.md, "The torch ops").

    import torch
    from kvq import torch_ops as ops
    params = ops.cache_params(num_kv_heads=8, num_q_heads=32, head_dim=128, sink=64, recent=256,
                              page_size=64, key=dict(bits=2, group=64, rotation="dense",
                              clip=0.96), value=dict(bits=2, group=64, rotation="dense"))
    key_pool, value_pool = ops.allocate_pools(params, num_pages=1024)      # caller-owned
    sink_k, sink_v, ring_k, ring_v = ops.allocate_windows(params, batch=8)
    heads = ({"rotation": r_k}, {"rotation": r_v})                          # f32 [Hkv, d, d]
    ops.write_prefill(params, k, v, table, *heads, key_pool, value_pool,    # k, v bf16 [T, Hkv, d]
                      sink_k, sink_v, ring_k, ring_v, slot=0)
    ops.write_append(params, k1, v1, lengths, tables, *heads, key_pool, value_pool,
                     sink_k, sink_v, ring_k, ring_v)  # lengths before the step
    workspace = ops.allocate_workspace(params, batch=8, max_seq_len=4096)
    out = ops.decode(params, q, lengths + 1, tables, 4096, *heads, key_pool, value_pool,
                     sink_k, sink_v, ring_k, ring_v, workspace)              # f32 [B, Hq, d]

`params` is the cache's metadata text (spec/formats.md, the keys every kvq file stores);
cache_params() builds it. The registered ops are torch.ops.kvq.write_prefill, write_append and
decode (custom ops with fake implementations: torch.compile traces them, and they run on the
current stream without allocating, so a CUDA graph captures them; decode's output is allocated
by torch). Errors are TorchOpError (a ValueError) carrying kvq's message and .code.
"""
import ctypes
import os
import threading
import typing

try:
    import torch
except ImportError:  # the C ABI's queries (cache_params, pool_planes, ...) work without torch
    torch = None

__all__ = ["TorchOpError", "allocate_pools", "allocate_windows", "allocate_workspace",
           "cache_params", "decode", "decode_step", "head_row_names", "library", "library_path", "pool_planes",
           "registered", "write_append", "write_prefill", "workspace_bytes"]

Tensor = torch.Tensor if torch is not None else object
HeadRows = typing.List[typing.Optional[Tensor]]


class TorchOpError(ValueError):
    """A refusal of kvq's GPU library (or of this module's checks): kvq's message, and .code,
    the kvq::ErrorCode name ('invalid argument', 'unsupported', ...)."""

    def __init__(self, message, code="invalid argument"):
        super().__init__(message)
        self.code = code


_CODES = {1: "invalid argument", 2: "shape mismatch", 3: "non-finite", 4: "malformed file",
          5: "i/o error", 6: "unsupported", 7: "mismatch", 8: "internal"}
_DTYPES = {0: "uint8", 1: "bfloat16", 2: "float32"}  # torch dtype names
_DIMS = ("head_dim", "num_kv_heads", "num_q_heads", "sink", "recent", "flush", "page_size",
         "ring_slots", "quantized")
_REQUIRED, _ABSENT = 2, 0

# ---- The library ------------------------------------------------------------------------------

_lib = None
_lib_lock = threading.Lock()


def library_path():
    """The libkvq_gpu.so load() opens: $KVQ_GPU_LIB, else beside this package, else the build
    tree's (build/gpu/ above build/tools/python/kvq, or <repo>/build/gpu from the source tree).
    Raises TorchOpError naming every place tried."""
    here = os.path.dirname(os.path.abspath(__file__))
    places = []
    if os.environ.get("KVQ_GPU_LIB"):
        places.append(os.environ["KVQ_GPU_LIB"])
    places += [os.path.join(here, "libkvq_gpu.so"),
               os.path.normpath(os.path.join(here, "..", "..", "..", "gpu", "libkvq_gpu.so")),
               os.path.normpath(os.path.join(here, "..", "..", "..", "build", "gpu",
                                             "libkvq_gpu.so"))]
    for place in places:
        if os.path.isfile(place):
            return place
    raise TorchOpError("libkvq_gpu.so not found: tried " + ", ".join(places) +
                       " (set KVQ_GPU_LIB)", "i/o error")


def library():
    """The loaded libkvq_gpu.so with the C ABI's signatures (loaded once)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _declare(ctypes.CDLL(library_path()))
    return _lib


def _declare(lib):
    i32, i64, vp, cp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
    vpp = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "kvq_c_api_version": ([], ctypes.c_int),
        "kvq_last_error": ([], cp),
        "kvq_cache_create": ([cp, ctypes.POINTER(vp)], ctypes.c_int),
        "kvq_cache_destroy": ([vp], None),
        "kvq_cache_dims": ([vp, ctypes.POINTER(i32)], ctypes.c_int),
        "kvq_cache_history_tokens": ([vp, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "kvq_pool_num_planes": ([vp, ctypes.c_int, ctypes.POINTER(i32)], ctypes.c_int),
        "kvq_pool_plane": ([vp, ctypes.c_int, i32, i64, ctypes.POINTER(i64),
                            ctypes.POINTER(i32), ctypes.POINTER(i64), ctypes.POINTER(cp)],
                           ctypes.c_int),
        "kvq_head_rows": ([], ctypes.c_int),
        "kvq_head_row_name": ([i32], cp),
        "kvq_head_row_shape": ([vp, ctypes.c_int, i32, ctypes.POINTER(i64), ctypes.POINTER(i32),
                                ctypes.POINTER(i32)], ctypes.c_int),
        "kvq_write_prefill": ([vp, vp, vp, i32, vp, i64, vpp, vpp, vpp, vpp, i64, vp, vp, vp, vp,
                               vp, vp], ctypes.c_int),
        "kvq_write_append": ([vp, vp, vp, i32, vp, vp, i32, vpp, vpp, vpp, vpp, i64, vp, vp, vp,
                              vp, vp, vp], ctypes.c_int),
        "kvq_decode_workspace_bytes": ([vp, i32, i32, ctypes.POINTER(i64)], ctypes.c_int),
        "kvq_decode": ([vp, vp, i32, i32, vp, vp, i32, vpp, vpp, vpp, vpp, vp, vp, vp, vp, vp, vp,
                        i64, vp], ctypes.c_int),
        "kvq_decode_step": ([vp, vp, vp, vp, vp, i32, i32, vp, vp, i32, vpp, vpp, vpp, vpp, i64,
                             vp, vp, vp, vp, vp, vp, vp, i64, vp], ctypes.c_int),
    }
    for name, (args, result) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    if lib.kvq_c_api_version() != 1:
        raise TorchOpError("libkvq_gpu.so speaks C ABI version %d, this module version 1"
                           % lib.kvq_c_api_version(), "unsupported")
    return lib


def _check(status):
    if status != 0:
        message = library().kvq_last_error().decode("utf-8", "replace")
        raise TorchOpError(message, _CODES.get(status, "status %d" % status))


# ---- Describing a cache -----------------------------------------------------------------------

_WRITE_DEFAULTS = dict(group=64, bits=2, clip=1, rotation="identity", hadamard_block=0, bitrev=0)


def cache_params(num_kv_heads, num_q_heads, head_dim, sink, recent, page_size, key, value,
                 flush=1, softmax_scale=0.0):
    """The metadata text of a cache (c_api.h): key and value are dicts of write parameters by
    their metadata names (row_format, group, bits, clip, rotation, hadamard_block, bitrev, norm,
    norm_heads, head_scale); group 64, bits 2, clip 1, rotation identity, no FWHT block and no
    P_br unless given. row_format "bf16" on both sides is the bf16 baseline cache."""
    entries = dict(num_kv_heads=num_kv_heads, num_q_heads=num_q_heads, sink=sink, recent=recent,
                   flush=flush, page_size=page_size, softmax_scale=softmax_scale)
    formats = set()
    for side, given in (("key", key), ("value", value)):
        merged = dict(_WRITE_DEFAULTS, head_dim=head_dim)
        merged.update(given)
        formats.add(merged.get("row_format", "affine_token"))
        for name, v in merged.items():
            entries[side + "." + name] = int(v) if isinstance(v, bool) else v
    entries["quantized"] = 0 if formats == {"bf16"} else 1
    # One line: the text is a constant of the graphs torch.compile makes, and inductor writes
    # each graph node into a comment line of its generated code (a newline broke it).
    return "".join("%s=%s;" % (k, v) for k, v in entries.items())


class _Cache:
    """A kvq_cache handle and what the ops ask of it, made once per params text."""

    def __init__(self, params):
        if not isinstance(params, str):
            raise TorchOpError("params must be the cache's metadata text (cache_params), not %r"
                               % type(params).__name__)
        lib = library()
        handle = ctypes.c_void_p()
        _check(lib.kvq_cache_create(params.encode(), ctypes.byref(handle)))
        self.handle = handle
        dims = (ctypes.c_int32 * len(_DIMS))()
        _check(lib.kvq_cache_dims(handle, dims))
        self.dims = dict(zip(_DIMS, dims))
        self.planes = []
        for side in (0, 1):
            count = ctypes.c_int32()
            _check(lib.kvq_pool_num_planes(handle, side, ctypes.byref(count)))
            planes = []
            for i in range(count.value):
                shape, dtype, name = (ctypes.c_int64 * 4)(), ctypes.c_int32(), ctypes.c_char_p()
                _check(lib.kvq_pool_plane(handle, side, i, 1, shape, ctypes.byref(dtype), None,
                                          ctypes.byref(name)))
                planes.append((name.value.decode(), _DTYPES[dtype.value], tuple(shape[1:])))
            self.planes.append(planes)
        head_row_names()
        self.heads = []
        for side in (0, 1):
            rows = []
            for r in range(lib.kvq_head_rows()):
                elements, dtype, use = ctypes.c_int64(), ctypes.c_int32(), ctypes.c_int32()
                _check(lib.kvq_head_row_shape(handle, side, r, ctypes.byref(elements),
                                              ctypes.byref(dtype), ctypes.byref(use)))
                rows.append((lib.kvq_head_row_name(r).decode(), elements.value,
                             _DTYPES[dtype.value], use.value))
            self.heads.append(rows)

    def __del__(self):
        if _lib is not None and getattr(self, "handle", None):
            _lib.kvq_cache_destroy(self.handle)


_caches = {}


def _cache(params):
    with _lib_lock:
        found = _caches.get(params)
    if found is None:
        found = _Cache(params)
        with _lib_lock:
            found = _caches.setdefault(params, found)
    return found


_head_names = []


def head_row_names():
    """The per-head rows, in the order the ops' key_heads / value_heads lists take them."""
    if not _head_names:
        lib = library()
        _head_names.extend(lib.kvq_head_row_name(r).decode() for r in range(lib.kvq_head_rows()))
    return list(_head_names)


def pool_planes(params, side):
    """[(name, dtype name, (heads per page, rows per page, elements))] of the "key" or "value"
    pool ("uint8" / "bfloat16", torch's names)."""
    return _cache(params).planes[_side(side)]


def allocate_pools(params, num_pages, device="cuda"):
    """(key planes, value planes): zeroed tensors [num_pages, heads per page, rows per page,
    elements] of each plane's dtype (u8 codes, bf16 scale / min / norm / rows), the layout
    formats.inc gives; a serving engine may allocate them itself in these shapes."""
    if num_pages < 1:
        raise TorchOpError("num_pages %r is below 1" % (num_pages,))
    c = _cache(params)
    return tuple([torch.zeros((num_pages,) + shape, dtype=getattr(torch, dtype), device=device)
                  for _, dtype, shape in c.planes[side]] for side in (0, 1))


def allocate_windows(params, batch, device="cuda"):
    """(sink key, sink value, recent key, recent value): zeroed bf16 [batch, S0, Hkv, d] and
    [batch, W + F - 1, Hkv, d] (a bf16 cache: all four [batch, 0, Hkv, d])."""
    dims = _cache(params).dims
    rest = (dims["num_kv_heads"], dims["head_dim"])
    quantized = dims["quantized"] == 1
    sink = (batch, dims["sink"] if quantized else 0) + rest
    ring = (batch, dims["ring_slots"] if quantized else 0) + rest
    return tuple(torch.zeros(shape, dtype=torch.bfloat16, device=device)
                 for shape in (sink, sink, ring, ring))


def workspace_bytes(params, batch, max_seq_len, device=None):
    """Bytes of the decode workspace for `batch` sequences of at most max_seq_len tokens on
    `device` (default: the current CUDA device)."""
    c = _cache(params)
    out = ctypes.c_int64()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        _check(library().kvq_decode_workspace_bytes(c.handle, batch, max_seq_len,
                                                    ctypes.byref(out)))
    return out.value


def allocate_workspace(params, batch, max_seq_len, device="cuda"):
    """The decode workspace: uint8 [workspace_bytes] (at least 256; torch's allocations are
    256-byte aligned)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = max(workspace_bytes(params, batch, max_seq_len, index), 256)
    return torch.empty(size, dtype=torch.uint8, device=device)


# ---- Argument checks --------------------------------------------------------------------------


def _side(side):
    if side in ("key", 0):
        return 0
    if side in ("value", 1):
        return 1
    raise TorchOpError("side %r is neither 'key' nor 'value'" % (side,))


def _tensor(t, name, dtype, shape, device):
    """t checked: a contiguous CUDA tensor of `dtype` on `device` and `shape` (None: any extent
    in that axis)."""
    if not isinstance(t, torch.Tensor):
        raise TorchOpError("%s must be a tensor, not %s" % (name, type(t).__name__))
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if t.dtype != dtype:
        raise TorchOpError("%s has dtype %s, needs %s" % (name, t.dtype, dtype))
    if t.device != device:
        raise TorchOpError("%s is on %s, the op runs on %s" % (name, t.device, device))
    if len(shape) != t.dim() or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        raise TorchOpError("%s has shape %s, needs %s" % (
            name, list(t.shape), ["*" if s is None else s for s in shape]))
    if not t.is_contiguous():
        raise TorchOpError("%s is not contiguous" % name)
    return t


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() > 0 else None)


def _pool(c, side, planes, name, device):
    expected = c.planes[side]
    if len(planes) != len(expected):
        raise TorchOpError("%s has %d planes, the %s format has %d (%s)" % (
            name, len(planes), ("key", "value")[side], len(expected),
            ", ".join(n for n, _, _ in expected)))
    pages = None
    for (plane_name, dtype, shape), t in zip(expected, planes):
        _tensor(t, "%s plane '%s'" % (name, plane_name), dtype, (pages,) + shape, device)
        pages = t.shape[0]
    array = (ctypes.c_void_p * len(planes))(*[t.data_ptr() for t in planes])
    return array, pages


def _heads(c, side, rows, name, device):
    """The per-head rows as the C ABI's pointer array: `rows` a list in head_row_names() order
    (None for a row not given), or a dict by name."""
    spec = c.heads[side]
    if isinstance(rows, dict):
        unknown = set(rows) - {r[0] for r in spec}
        if unknown:
            raise TorchOpError("%s: unknown per-head rows %s (rows: %s)" % (
                name, sorted(unknown), ", ".join(r[0] for r in spec)))
        rows = [rows.get(r[0]) for r in spec]
    rows = list(rows) if rows is not None else [None] * len(spec)
    if len(rows) != len(spec):
        raise TorchOpError("%s has %d rows, the library has %d (%s)" % (
            name, len(rows), len(spec), ", ".join(r[0] for r in spec)))
    hkv = c.dims["num_kv_heads"]
    for (row, elements, dtype, use), t in zip(spec, rows):
        if t is None:
            if use == _REQUIRED:
                raise TorchOpError("%s: row '%s' is required by this cache" % (name, row))
            continue
        if use == _ABSENT:
            raise TorchOpError("%s: row '%s' is given but this cache does not read it" % (
                name, row))
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise TorchOpError("%s row '%s' must be a contiguous tensor" % (name, row))
        shape = (hkv,) if elements == 1 else (hkv, elements)
        _tensor(t.reshape(shape) if t.numel() == hkv * elements else t,
                "%s row '%s'" % (name, row), dtype, shape, device)
    return (ctypes.c_void_p * len(rows))(*[_ptr(t).value for t in rows])


def _stream(device):
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _windows(c, tensors, batch, device):
    dims = c.dims
    rest = (dims["num_kv_heads"], dims["head_dim"])
    quantized = dims["quantized"] == 1
    sink = dims["sink"] if quantized else 0
    ring = dims["ring_slots"] if quantized else 0
    names = ("sink_key", "sink_value", "recent_key", "recent_value")
    for name, t, rows in zip(names, tensors, (sink, sink, ring, ring)):
        _tensor(t, name, torch.bfloat16, (batch, rows) + rest, device)


# ---- The ops' bodies --------------------------------------------------------------------------


def _write_targets(c, key_pool, value_pool, key_heads, value_heads, error_flags, device):
    """What both writes check and hand the C ABI alike: the pools' plane pointers and their page
    count (the same on both sides), the error flags' shape, the per-head rows' pointers."""
    kp, pages = _pool(c, 0, key_pool, "key_pool", device)
    vp, value_pages = _pool(c, 1, value_pool, "value_pool", device)
    if value_pages != pages:
        raise TorchOpError("key_pool has %d pages, value_pool %d" % (pages, value_pages))
    if error_flags is not None:
        _tensor(error_flags, "error_flags", torch.int32, (1,), device)
    kh = _heads(c, 0, key_heads, "key_heads", device)
    vh = _heads(c, 1, value_heads, "value_heads", device)
    return kp, vp, pages, kh, vh


def _write_prefill(params: str, key: Tensor, value: Tensor, page_table: Tensor,
                   key_heads: HeadRows, value_heads: HeadRows, key_pool: typing.List[Tensor],
                   value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
                   recent_key: Tensor, recent_value: Tensor, slot: int,
                   error_flags: typing.Optional[Tensor]) -> None:
    c = _cache(params)
    device = key.device
    hkv, d = c.dims["num_kv_heads"], c.dims["head_dim"]
    _tensor(key, "key", torch.bfloat16, (None, hkv, d), device)
    _tensor(value, "value", torch.bfloat16, tuple(key.shape), device)
    _tensor(page_table, "page_table", torch.int32, (None,), device)
    batch = sink_key.shape[0] if sink_key.dim() == 4 else -1
    _windows(c, (sink_key, sink_value, recent_key, recent_value), batch, device)
    if not 0 <= slot < batch:
        raise TorchOpError("slot %d is outside the windows' batch [0, %d)" % (slot, batch))
    kp, vp, pages, kh, vh = _write_targets(c, key_pool, value_pool, key_heads, value_heads,
                                           error_flags, device)
    windows = [t[slot] if t.shape[1] > 0 else None
               for t in (sink_key, sink_value, recent_key, recent_value)]
    with torch.cuda.device(device):
        _check(library().kvq_write_prefill(
            c.handle, _ptr(key), _ptr(value), key.shape[0], _ptr(page_table),
            page_table.shape[0], kh, vh, kp, vp, pages, *[_ptr(w) for w in windows],
            _ptr(error_flags), _stream(device)))


def _write_append(params: str, key: Tensor, value: Tensor, lengths: Tensor, page_tables: Tensor,
                  key_heads: HeadRows, value_heads: HeadRows, key_pool: typing.List[Tensor],
                  value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
                  recent_key: Tensor, recent_value: Tensor,
                  error_flags: typing.Optional[Tensor]) -> None:
    c = _cache(params)
    device = key.device
    hkv, d = c.dims["num_kv_heads"], c.dims["head_dim"]
    _tensor(key, "key", torch.bfloat16, (None, hkv, d), device)
    batch = key.shape[0]
    _tensor(value, "value", torch.bfloat16, (batch, hkv, d), device)
    _tensor(lengths, "lengths", torch.int32, (batch,), device)
    _tensor(page_tables, "page_tables", torch.int32, (batch, None), device)
    _windows(c, (sink_key, sink_value, recent_key, recent_value), batch, device)
    kp, vp, pages, kh, vh = _write_targets(c, key_pool, value_pool, key_heads, value_heads,
                                           error_flags, device)
    with torch.cuda.device(device):
        _check(library().kvq_write_append(
            c.handle, _ptr(key), _ptr(value), batch, _ptr(lengths), _ptr(page_tables),
            page_tables.shape[1], kh, vh, kp, vp, pages, _ptr(sink_key), _ptr(sink_value),
            _ptr(recent_key), _ptr(recent_value), _ptr(error_flags), _stream(device)))


def _decode(params: str, q: Tensor, seq_lens: Tensor, page_tables: Tensor, max_seq_len: int,
            key_heads: HeadRows, value_heads: HeadRows, key_pool: typing.List[Tensor],
            value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
            recent_key: Tensor, recent_value: Tensor, workspace: Tensor) -> Tensor:
    c = _cache(params)
    device = q.device
    hq, d = c.dims["num_q_heads"], c.dims["head_dim"]
    _tensor(q, "q", torch.float32, (None, hq, d), device)
    batch = q.shape[0]
    _tensor(seq_lens, "seq_lens", torch.int32, (batch,), device)
    _tensor(page_tables, "page_tables", torch.int32, (batch, None), device)
    _windows(c, (sink_key, sink_value, recent_key, recent_value), batch, device)
    kp, _ = _pool(c, 0, key_pool, "key_pool", device)
    vp, _ = _pool(c, 1, value_pool, "value_pool", device)
    _tensor(workspace, "workspace", torch.uint8, (None,), device)
    kh = _heads(c, 0, key_heads, "key_heads", device)
    vh = _heads(c, 1, value_heads, "value_heads", device)
    out = torch.empty_like(q)
    with torch.cuda.device(device):
        _check(library().kvq_decode(
            c.handle, _ptr(q), batch, max_seq_len, _ptr(seq_lens), _ptr(page_tables),
            page_tables.shape[1], kh, vh, kp, vp, _ptr(sink_key), _ptr(sink_value),
            _ptr(recent_key), _ptr(recent_value), _ptr(out), _ptr(workspace), workspace.numel(),
            _stream(device)))
    return out


def _decode_step(params: str, key: Tensor, value: Tensor, lengths: Tensor, q: Tensor,
                 seq_lens: Tensor, page_tables: Tensor, max_seq_len: int, key_heads: HeadRows,
                 value_heads: HeadRows, key_pool: typing.List[Tensor],
                 value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
                 recent_key: Tensor, recent_value: Tensor, workspace: Tensor,
                 error_flags: typing.Optional[Tensor]) -> Tensor:
    c = _cache(params)
    device = q.device
    hkv, hq, d = c.dims["num_kv_heads"], c.dims["num_q_heads"], c.dims["head_dim"]
    _tensor(q, "q", torch.float32, (None, hq, d), device)
    batch = q.shape[0]
    _tensor(key, "key", torch.bfloat16, (batch, hkv, d), device)
    _tensor(value, "value", torch.bfloat16, (batch, hkv, d), device)
    _tensor(lengths, "lengths", torch.int32, (batch,), device)
    _tensor(seq_lens, "seq_lens", torch.int32, (batch,), device)
    _tensor(page_tables, "page_tables", torch.int32, (batch, None), device)
    _windows(c, (sink_key, sink_value, recent_key, recent_value), batch, device)
    _tensor(workspace, "workspace", torch.uint8, (None,), device)
    kp, vp, pages, kh, vh = _write_targets(c, key_pool, value_pool, key_heads, value_heads,
                                           error_flags, device)
    out = torch.empty_like(q)
    with torch.cuda.device(device):
        _check(library().kvq_decode_step(
            c.handle, _ptr(key), _ptr(value), _ptr(lengths), _ptr(q), batch, max_seq_len,
            _ptr(seq_lens), _ptr(page_tables), page_tables.shape[1], kh, vh, kp, vp, pages,
            _ptr(sink_key), _ptr(sink_value), _ptr(recent_key), _ptr(recent_value),
            _ptr(error_flags), _ptr(out), _ptr(workspace), workspace.numel(), _stream(device)))
    return out


# ---- Registration -----------------------------------------------------------------------------

_WINDOWS = ("sink_key", "sink_value", "recent_key", "recent_value")
_ops = {}


def registered():
    """Whether the torch ops are registered (torch.library.custom_op, torch >= 2.4)."""
    return bool(_ops)


def _register():
    library_api = getattr(torch, "library", None)
    if library_api is None or not (hasattr(library_api, "custom_op") and
                                   hasattr(library_api, "register_fake")):
        return
    prefill = library_api.custom_op(
        "kvq::write_prefill", _write_prefill, device_types="cuda",
        mutates_args=("key_pool", "value_pool") + _WINDOWS + ("error_flags",))
    append = library_api.custom_op(
        "kvq::write_append", _write_append, device_types="cuda",
        mutates_args=("key_pool", "value_pool") + _WINDOWS + ("error_flags",))
    decode_op = library_api.custom_op("kvq::decode", _decode, device_types="cuda",
                                      mutates_args=("workspace",))
    step_op = library_api.custom_op(
        "kvq::decode_step", _decode_step, device_types="cuda",
        mutates_args=("key_pool", "value_pool") + _WINDOWS + ("workspace", "error_flags"))

    @prefill.register_fake
    def _(params: str, key: Tensor, value: Tensor, page_table: Tensor, key_heads: HeadRows,
          value_heads: HeadRows, key_pool: typing.List[Tensor], value_pool: typing.List[Tensor],
          sink_key: Tensor, sink_value: Tensor, recent_key: Tensor, recent_value: Tensor,
          slot: int, error_flags: typing.Optional[Tensor]) -> None:
        return None

    @append.register_fake
    def _(params: str, key: Tensor, value: Tensor, lengths: Tensor, page_tables: Tensor,
          key_heads: HeadRows, value_heads: HeadRows, key_pool: typing.List[Tensor],
          value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
          recent_key: Tensor, recent_value: Tensor, error_flags: typing.Optional[Tensor]) -> None:
        return None

    @decode_op.register_fake
    def _(params: str, q: Tensor, seq_lens: Tensor, page_tables: Tensor, max_seq_len: int,
          key_heads: HeadRows, value_heads: HeadRows, key_pool: typing.List[Tensor],
          value_pool: typing.List[Tensor], sink_key: Tensor, sink_value: Tensor,
          recent_key: Tensor, recent_value: Tensor, workspace: Tensor) -> Tensor:
        return torch.empty_like(q)

    @step_op.register_fake
    def _(params: str, key: Tensor, value: Tensor, lengths: Tensor, q: Tensor, seq_lens: Tensor,
          page_tables: Tensor, max_seq_len: int, key_heads: HeadRows, value_heads: HeadRows,
          key_pool: typing.List[Tensor], value_pool: typing.List[Tensor], sink_key: Tensor,
          sink_value: Tensor, recent_key: Tensor, recent_value: Tensor, workspace: Tensor,
          error_flags: typing.Optional[Tensor]) -> Tensor:
        return torch.empty_like(q)

    _ops.update(write_prefill=prefill, write_append=append, decode=decode_op,
                decode_step=step_op)


_register()


def _one_line(params):
    """The metadata text without whitespace (its names and values have none): what the
    wrappers hand the ops, so that a caller's text with newlines compiles under inductor."""
    return "".join(params.split())


def _op(name):
    if not _ops:
        raise TorchOpError("kvq's torch ops need torch >= 2.4 (torch.library.custom_op); this is "
                           + ("torch " + torch.__version__ if torch is not None else "no torch"),
                           "unsupported")
    return _ops[name]


def write_prefill(params, key, value, page_table, key_heads, value_heads, key_pool, value_pool,
                  sink_key, sink_value, recent_key, recent_value, slot=0, error_flags=None):
    """torch.ops.kvq.write_prefill: the prefill of the empty sequence in window slot `slot`
    with key / value bf16 [T, Hkv, d]: its sink and ring rows into row `slot` of the windows,
    its history into the pages of page_table (int32 [>= ceil(H(T) / P)]). key_heads /
    value_heads: {row name: f32 tensor} (head_row_names(): "rotation" [Hkv, d, d] for a dense
    side, "clip" / "scale" [Hkv]) or lists in that order."""
    return _op("write_prefill")(_one_line(params), key, value, page_table,
                                _head_list(key_heads), _head_list(value_heads), list(key_pool),
                                list(value_pool), sink_key, sink_value, recent_key, recent_value,
                                slot, error_flags)


def write_append(params, key, value, lengths, page_tables, key_heads, value_heads, key_pool,
                 value_pool, sink_key, sink_value, recent_key, recent_value, error_flags=None):
    """torch.ops.kvq.write_append: one decode step's rows key / value bf16 [B, Hkv, d] for the
    sequences of lengths (int32 [B], before the step; the caller advances them), page_tables
    int32 [B, max_pages], windows [B, ...]."""
    return _op("write_append")(_one_line(params), key, value, lengths, page_tables,
                               _head_list(key_heads), _head_list(value_heads),
                               list(key_pool), list(value_pool), sink_key, sink_value,
                               recent_key, recent_value, error_flags)


def decode(params, q, seq_lens, page_tables, max_seq_len, key_heads, value_heads, key_pool,
           value_pool, sink_key, sink_value, recent_key, recent_value, workspace):
    """torch.ops.kvq.decode: f32 [B, Hq, d], the attention of q (f32 [B, Hq, d]) over each
    sequence's cache of seq_lens (int32 [B], the current token included, <= max_seq_len)."""
    return _op("decode")(_one_line(params), q, seq_lens, page_tables, max_seq_len,
                         _head_list(key_heads), _head_list(value_heads),
                         list(key_pool), list(value_pool), sink_key, sink_value, recent_key,
                         recent_value, workspace)


def decode_step(params, key, value, lengths, q, seq_lens, page_tables, max_seq_len, key_heads,
                value_heads, key_pool, value_pool, sink_key, sink_value, recent_key,
                recent_value, workspace, error_flags=None):
    """torch.ops.kvq.decode_step: a layer's whole decode step, write_append's append of key /
    value bf16 [B, Hkv, d] for the sequences of lengths (int32 [B], before the step; the caller
    advances them), then decode's f32 [B, Hq, d] attention of q over the caches of seq_lens
    (int32 [B], after it), each kernel launched while the one before it runs
    (kvq::gpu::DecodeStep). The cache's and the output's bits are write_append's then
    decode's."""
    return _op("decode_step")(_one_line(params), key, value, lengths, q, seq_lens, page_tables,
                              max_seq_len, _head_list(key_heads), _head_list(value_heads),
                              list(key_pool), list(value_pool), sink_key, sink_value,
                              recent_key, recent_value, workspace, error_flags)


def _head_list(rows):
    """Per-head rows as the ops take them: a list in head_row_names() order (None for a row not
    given). The wrappers stay traceable by torch.compile once the names are known (any cache
    made before, e.g. by allocate_pools, loaded them)."""
    names = _head_names or head_row_names()
    if rows is None:
        return [None] * len(names)
    if isinstance(rows, dict):
        unknown = set(rows) - set(names)
        if unknown:
            raise TorchOpError("unknown per-head rows %s (rows: %s)" % (
                sorted(unknown), ", ".join(names)))
        return [rows.get(n) for n in names]
    return list(rows)
