"""kvq.hf: a Hugging Face transformers Cache whose layers are kvq's paged pools (transformers 5.x).

    from kvq import hf
    cache = hf.Cache(scheme="oscar", calibration="cal.safetensors", config=model.config)
    model.set_attn_implementation(hf.ATTENTION)          # "kvq", registered on import
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Each layer owns its pools, windows, page tables and sequence lengths (kvq.torch_ops allocates
them; they are ordinary CUDA tensors): the prompt is written with torch.ops.kvq.write_prefill,
every generated token with torch.ops.kvq.write_append, and the attention function registered as
"kvq" (AttentionInterface, with sdpa's mask function in AttentionMaskInterface under the same
name) answers a one-token query with torch.ops.kvq.decode over the cache. A prompt's own
attention is exact (transformers' sdpa over the bf16 prompt rows), since kvq's decode serves one
query token. Per-head calibration rows (rotations, clip ratios, fp8 scales, Block-GTQ's key
widths) come from a kvq calibration file (spec/formats.md §5), sliced by global KV head: a
tensor-parallel rank passes kv_heads=range(first, last) and gets only its heads. tq_mse's seeded
Haar rotations come from a `kvq calibrate --scheme tq_mse` file, which holds exactly the matrices
kvq's C++ derives from the seed.

Not served, each refused with its reason (no fallback): the schemes whose rotations only kvq's
C++ builds and no calibration file holds (random_orthogonal, oscar_no_hadamard,
oscar_no_bitrev, saw_hessian: SCHEMES below), a calibration file made for another scheme where
the scheme needs its own (fp8, fp8_hadamard, blockgtq, tq_mse), a multi-token step over a
non-empty cache (chunked prefill, speculative verification), padded batches (kvq's decode has
no padding mask), beam search (reorder_cache), crop. Needs torch >= 2.4 with CUDA and
libkvq_gpu.so (kvq.torch_ops); importable without transformers or torch (Cache then raises
ImportError with the reason).
"""
import json
import math
import pathlib
import struct
import threading
import weakref

from . import torch_ops

torch = torch_ops.torch

try:  # transformers 5.x: Cache(layers=[...]) over CacheLayerMixin layers
    from transformers import AttentionInterface as _AttentionInterface
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as _sdpa_forward
    from transformers.masking_utils import AttentionMaskInterface as _AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask as _sdpa_mask
    TRANSFORMERS_ERROR = None
except Exception as _error:  # noqa: BLE001 (no transformers, or one without the 5.x API)
    _HFCache = _HFLayer = object
    TRANSFORMERS_ERROR = "kvq.hf needs transformers 5.x (Cache(layers=...), CacheLayerMixin, " \
        "AttentionInterface, AttentionMaskInterface): %s: %s" % (type(_error).__name__, _error)

__all__ = ["ATTENTION", "Cache", "Layer", "SCHEMES", "attention", "cache_params_for",
           "calibration_for", "register", "scheme_recipe"]

ATTENTION = "kvq"

# ---- The schemes (calib/include/kvq/calib/schemes.inc, as BuildLayerScheme builds them) -------
#
# kvq's scheme catalogue reaches Python only through the extension module kvq._kvq
# (kvq.schemes()), which is built for the build machine's Python and does not load on the GPU
# machine's; the C ABI takes a cache's metadata text and knows no scheme. So this table restates
# the rows the CUDA path can run, from schemes.inc and calib/src/schemes.cc (BuildLayerScheme),
# and names why every other row is refused. tests/test_hf_cache.py checks it against
# schemes.inc's ids, each served row's parameters key for key against those BuildLayerScheme
# made for the scheme's golden attention case (conformance/vectors/attention/scheme_<id>), and
# its formats against kvq.schemes() where the extension loads.
#   rotation: None | "hadamard" | "hadamard_bitrev" | "block_hadamard" (SchemeOptions::saw_block,
#             128 clamped to d) | "calibration:<tensor>" (a dense R per head from the
#             calibration tensor layers.{l}.<tensor>)
#   format:   the history format of K / V (formats.inc ids)
#   bits:     None: the cache's `bits` (kSharedBits); else the scheme's own
#   group:    None: `group` (kSharedGroup); "row": G = d (kRowGroup); "tile": an affine_tile side's
#             tokens per tile (`tile`, SchemeOptions::tile); else the scheme's own G
#   windows:  None: the cache's sink / recent / flush=1 (kSharedWindows); else (S0, W, F)
#   clip:     read the calibration's k_clip / v_clip (ClipPolicy::kCalibration)
#   scale:    "calibration": the calibration's k_scale / v_scale (ScalePolicy::kCalibration, the
#             file's scheme must be this one); "one": every head s^ = 1
#   norm:     keys divided by their stored norm, per KV head (SchemeNorm::kKeys, norm scope head)
#   widths:   codebook keys with per-head block widths from the calibration's layers.{l}.k_bits
#             (WidthsPolicy::kCalibration: Block-GTQ); the side's row limits (segments, code
#             bytes) are the most any (layer, KV head) of the file needs (FitCodebookRows)
#   own:      None, or what the scheme reads that only a file of `kvq calibrate --scheme <id>`
#             holds (its metadata "scheme" must be this id; Cache refuses any other file): fp8
#             scales computed after its rotation, Block-GTQ's widths, tq_mse's seeded rotations
# A codebook side codes with the tables a codebook file records (its "codebook" key, beta or
# gaussian: kvq calibrate --codebook), beta without one, as BuildLayerScheme's.
#
# tq_mse: BuildLayerScheme derives each (layer, KV head, side)'s Haar rotation from
# SchemeOptions::seed (RandomOrthogonal of DeriveSeed(seed, {layer, head, side})), which Python
# cannot; `kvq calibrate --scheme tq_mse --seed S` stores exactly those matrices (the same
# derivation, bit for bit: tools/tests/calibrate_codebook_cli_test.cc), as layers.{l}.k_rotation
# and v_rotation of a format_version 4 file. So the row reads them from such a file, and the
# file's seed is the scheme's: kvq eval / ppl --seed S match a file made with --seed S.


def _row(rotation_k=None, rotation_v=None, format_k="affine_token", format_v="affine_token",
         bits=None, group=None, windows=None, clip=False, scale=None, norm=False, widths=False,
         own=None):
    if own is None and scale == "calibration":
        own = "fp8 scales computed after its own rotation"
    if own is None and widths:
        own = "its own widths and rotations"
    return dict(rotation=(rotation_k, rotation_v), format=(format_k, format_v), bits=bits,
                group=group, windows=windows, clip=clip, scale=scale, norm=norm, widths=widths,
                own=own)


_KIVI = dict(format_k="affine_tile", group=32, windows=(0, 1, 128))
_NO_WINDOWS = (0, 0, 1)
_CXX_ROTATION = ("its rotations are built by kvq's C++ (calib/src/schemes.cc, %s), which Python "
                 "reaches only through the extension module kvq._kvq")
SCHEMES = {
    "bf16": _row(format_k="bf16", format_v="bf16"),
    "naive": _row(),
    "hadamard": _row("hadamard", "hadamard"),
    "hadamard_bitrev": _row("hadamard_bitrev", "hadamard_bitrev"),
    "clip_only": _row(clip=True),
    "random_orthogonal": _CXX_ROTATION % "RandomOrthogonal of a seed",
    "raw_target": _row("calibration:raw_k_rotation", "calibration:raw_v_rotation", clip=True),
    "eigenbasis_only": _row("calibration:k_basis", "calibration:v_basis", clip=True),
    "oscar_no_hadamard": _CXX_ROTATION % "BasisBitReversal of the calibration's bases",
    "oscar_no_bitrev": _CXX_ROTATION % "BasisHadamard of the calibration's bases",
    "oscar": _row("calibration:k_rotation", "calibration:v_rotation", clip=True),
    "kivi": _row(**_KIVI),
    "kivi_hadamard": _row("hadamard", "hadamard", **_KIVI),
    "kivi_norm": _row(norm=True, **_KIVI),
    "ots": _row("hadamard", "hadamard", norm=True, **_KIVI),
    "saw_int4": _row("block_hadamard", "block_hadamard", bits=4, group="row",
                     windows=_NO_WINDOWS),
    "saw_int4_k": _row("block_hadamard", None, bits=4, group="row", windows=_NO_WINDOWS),
    "saw_hessian": _CXX_ROTATION % "HessianBlockRotation of the calibration's C_Q",
    "fp8": _row(format_k="fp8_e4m3", format_v="fp8_e4m3", bits=8, windows=_NO_WINDOWS,
                scale="calibration"),
    "fp8_unscaled": _row(format_k="fp8_e4m3", format_v="fp8_e4m3", bits=8, windows=_NO_WINDOWS,
                         scale="one"),
    "fp8_hadamard": _row("hadamard", "hadamard", format_k="fp8_e4m3", format_v="fp8_e4m3",
                         bits=8, windows=_NO_WINDOWS, scale="calibration"),
    "tq_mse": _row("calibration:k_rotation", "calibration:v_rotation", format_k="codebook",
                   format_v="codebook", group="row", windows=_NO_WINDOWS,
                   own="its own seeded Haar rotations (the seed's, which only kvq's C++ derives)"),
    "tq_mse_fwht": _row("hadamard", "hadamard", format_k="codebook", format_v="codebook",
                        group="row", windows=_NO_WINDOWS),
    "blockgtq": _row("calibration:k_rotation", "calibration:v_rotation", format_k="codebook",
                     format_v="codebook", group="row", windows=_NO_WINDOWS, widths=True),
}


class SchemeError(torch_ops.TorchOpError):
    """A scheme (or its calibration) the CUDA path cannot serve; the message names the scheme."""


def scheme_recipe(scheme):
    """SCHEMES' row of `scheme` (a dict), or SchemeError naming the scheme and why it is not
    served from Python."""
    row = SCHEMES.get(scheme)
    if row is None:
        raise SchemeError("unknown scheme %r (kvq's schemes: %s)" % (scheme, ", ".join(SCHEMES)),
                          "invalid argument")
    if isinstance(row, str):
        raise SchemeError("scheme '%s' is not served by kvq.hf: %s" % (scheme, row), "unsupported")
    return row


def cache_params_for(scheme, num_kv_heads, num_q_heads, head_dim, bits=2, group=64, sink=64,
                     recent=256, page_size=64, tile=32, saw_block=128, value_bits=None,
                     codebook_rows=None, codebook="beta"):
    """The metadata text (kvq.torch_ops.cache_params) of one layer's cache under `scheme`, with
    the defaults of calib::SchemeOptions (b 2, G 64, S0 64, W 256, P 64, G_k 32): what
    BuildLayerScheme sets, except the per-head rows (rotations, clips, scales, widths), which are
    data. value_bits: V's width where it differs from `bits` (K3V2); codebook_rows: the keys' row
    limits (segments, code_bytes, bits) when they hold per-head widths (codebook_limits);
    codebook: the tables the codebook sides are coded by, "beta" or "gaussian".
    SchemeError for a scheme not served; TorchOpError (from kvq_cache_create) for parameters
    kvq's CUDA path refuses, both naming the scheme."""
    params = _scheme_params(scheme, num_kv_heads, num_q_heads, head_dim, bits, group, sink,
                            recent, page_size, tile, saw_block, value_bits, codebook_rows,
                            codebook)
    try:
        torch_ops.pool_planes(params, "key")  # kvq_cache_create: the CUDA path's own refusals
    except torch_ops.TorchOpError as e:
        raise SchemeError("scheme '%s' is not served by kvq's CUDA path: %s" % (scheme, e),
                          e.code) from None
    return params


def _scheme_params(scheme, num_kv_heads, num_q_heads, head_dim, bits, group, sink, recent,
                   page_size, tile, saw_block, value_bits, codebook_rows, codebook="beta"):
    """cache_params_for's text before kvq_cache_create has seen it (no library needed)."""
    row = scheme_recipe(scheme)
    if codebook not in ("beta", "gaussian"):
        raise SchemeError("scheme '%s': codebook density %r is not beta or gaussian" % (
            scheme, codebook), "invalid argument")
    sink, recent, flush = row["windows"] if row["windows"] is not None else (sink, recent, 1)
    page = page_size
    sides = []
    for side in (0, 1):
        fmt, rotation = row["format"][side], row["rotation"][side]
        w = dict(row_format=fmt, bits=row["bits"] or (value_bits if side and value_bits
                                                      else bits), clip=1)
        if fmt == "codebook":
            w["group"] = head_dim
            w["codebook"] = codebook
            if side == 0 and codebook_rows is not None:
                w["segments"], w["code_bytes"], w["bits"] = codebook_rows
        elif fmt == "affine_tile":
            w["group"] = tile
            page = max(page, tile)  # a page holds whole tiles (BuildLayerScheme)
        elif row["group"] == "row" or fmt in ("bf16", "fp8_e4m3"):
            w["group"] = head_dim if row["group"] == "row" else group
        else:
            w["group"] = row["group"] or group
        if fmt == "bf16":
            w["bits"] = 16
        if rotation in ("hadamard", "hadamard_bitrev", "block_hadamard"):
            w["rotation"] = "hadamard"
            w["bitrev"] = 1 if rotation == "hadamard_bitrev" else 0
            block = min(saw_block, head_dim)
            w["hadamard_block"] = 0 if rotation != "block_hadamard" or block == head_dim \
                else block
        elif rotation is not None:
            w["rotation"] = "dense"
        if side == 0 and row["norm"]:
            w.update(norm=1, norm_heads=1)
        sides.append(w)
    return torch_ops.cache_params(num_kv_heads=num_kv_heads, num_q_heads=num_q_heads,
                                  head_dim=head_dim, sink=sink, recent=recent, page_size=page,
                                  key=sides[0], value=sides[1], flush=flush)


# ---- Calibration files (spec/formats.md §5) ---------------------------------------------------


def _codebook_scheme(scheme):
    """Whether `scheme` stores codebook rows (calib::IsCodebookScheme: its calibration file, if
    any, is a format_version 4 one)."""
    row = SCHEMES.get(scheme)
    return isinstance(row, dict) and "codebook" in row["format"]


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "U8": "uint8", "I32": "int32",
              "F64": "float64"}


def _read_safetensors(path):
    """(metadata, {name: CPU tensor}) of a safetensors file (no safetensors package needed)."""
    blob = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, h in header.items():
        if h["dtype"] not in _ST_DTYPES:
            continue
        begin, end = h["data_offsets"]
        data = bytearray(blob[8 + n + begin:8 + n + end])
        dtype = getattr(torch, _ST_DTYPES[h["dtype"]])
        t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(h["shape"])
    return metadata, tensors


class Calibration:
    """A kvq calibration file's per-(layer, KV head) tensors, checked against a model's shape.
    rows(layer, side, stem, kv_heads): f32 [len(kv_heads), ...] of layers.{layer}.<k|v>_<stem>,
    the global KV heads `kv_heads` in that order."""

    def __init__(self, path, num_layers, num_kv_heads, head_dim):
        self.path = str(path)
        self.metadata, self.tensors = _read_safetensors(path)
        m = self.metadata
        if m.get("format") != "kvq-calibration":
            raise SchemeError("%s is not a kvq calibration (format %r)" % (
                self.path, m.get("format")), "malformed file")
        self.check_shape(num_layers, num_kv_heads, head_dim)
        self.scheme = m.get("scheme", "oscar")
        self.version = int(m.get("format_version", 1))
        if _codebook_scheme(self.scheme) != (self.version == 4):  # ReadCalibration's rule
            raise SchemeError("calibration %s: scheme '%s' with format_version %d (4 is the "
                              "codebook calibrations' version, and only theirs)" % (
                                  self.path, self.scheme, self.version), "malformed file")
        self.num_kv_heads = num_kv_heads

    def check_shape(self, num_layers, num_kv_heads, head_dim):
        """SchemeError (shape mismatch) unless the file was made for a model of this shape."""
        m = self.metadata
        got = (int(m.get("num_layers", -1)), int(m.get("num_kv_heads", -1)),
               int(m.get("head_dim", -1)))
        if got != (num_layers, num_kv_heads, head_dim):
            raise SchemeError("calibration %s has %d layers x %d KV heads x d=%d, the model %d x "
                              "%d x d=%d" % ((self.path,) + got + (num_layers, num_kv_heads,
                                                                  head_dim)), "shape mismatch")

    def rows(self, layer, side, stem, kv_heads, dtype=None):
        """[len(kv_heads), ...] of the tensor, f32 (or `dtype`)."""
        return self.layer_rows(layer, "%s_%s" % ("kv"[side], stem), kv_heads, dtype)

    def layer_rows(self, layer, tensor, kv_heads, dtype=None):
        """[len(kv_heads), ...] of layers.{layer}.<tensor>, f32 (or `dtype`)."""
        name = "layers.%d.%s" % (layer, tensor)
        if name not in self.tensors:
            raise SchemeError("calibration %s (scheme '%s', format_version %d) has no tensor %s"
                              % (self.path, self.scheme, self.version, name), "invalid argument")
        t = self.tensors[name]
        return t.to(dtype or torch.float32)[list(kv_heads)].contiguous()


def calibration_for(scheme, calibration, num_layers, num_kv_heads, head_dim):
    """The Calibration `scheme` reads (None for a scheme that reads none): `calibration` (a path,
    read and checked against the model's shape; or a Calibration already read) checked against
    the scheme. SchemeError, naming the scheme, for a scheme not served, a missing file, a
    codebook file (format_version 4) for another scheme, or, for a scheme that needs its own
    file (SCHEMES' `own`), a file of another scheme, naming the command that makes the right
    one."""
    recipe = scheme_recipe(scheme)
    needs_file = any(r and r.startswith("calibration:") for r in recipe["rotation"]) or \
        recipe["clip"] or recipe["scale"] == "calibration" or recipe["widths"]
    if not needs_file:
        return None
    own = recipe["own"]
    if calibration is None:
        raise SchemeError("scheme '%s' needs a calibration file (kvq calibrate%s)" % (
            scheme, " --scheme " + scheme if own else ""))
    if isinstance(calibration, Calibration):  # read before, perhaps for another model
        calibration.check_shape(num_layers, num_kv_heads, head_dim)
        cal = calibration
    else:
        cal = Calibration(calibration, num_layers, num_kv_heads, head_dim)
    # A codebook calibration (format_version 4: Haar rotations, widths) serves only the scheme it
    # was made for (the check below), and holds none of the fitted tensors (clip ratios, bases)
    # the others read.
    if cal.version == 4 and own is None:
        raise SchemeError("scheme '%s' cannot use calibration %s, made for the codebook scheme "
                          "'%s'" % (scheme, cal.path, cal.scheme))
    if own and cal.scheme != scheme:
        raise SchemeError("scheme '%s' needs %s; calibration %s was made for scheme '%s' (kvq "
                          "calibrate --scheme %s)" % (scheme, own, cal.path, cal.scheme, scheme))
    return cal


def codebook_density(cal):
    """The tables a codebook calibration's rows are to be coded by (its metadata "codebook",
    written by kvq calibrate --codebook beta|gaussian), as BuildLayerScheme reads them; "beta"
    without a file or for any other file. SchemeError naming a value that is neither."""
    if cal is None or cal.version != 4:
        return "beta"
    density = cal.metadata.get("codebook", "beta")
    if density not in ("beta", "gaussian"):
        raise SchemeError("calibration %s: codebook %r is not beta or gaussian" % (
            cal.path, density), "malformed file")
    return density


def codebook_layout(widths):
    """(segments, code bytes) of a codebook row whose RoPE blocks have `widths` (kvq/common/
    codebook.h's CodebookLayoutOf: one segment per width present, ceil(2 n_w w / 8) bytes)."""
    counts = {}
    for w in widths:
        counts[int(w)] = counts.get(int(w), 0) + 1
    return len(counts), sum((2 * n * w + 7) // 8 for w, n in counts.items())


def codebook_limits(cal, num_layers):
    """The keys' (segments, code_bytes, bits) over every (layer, KV head) of a widths
    calibration (calib/src/schemes.cc FitCodebookRows: the row limits any head needs, and the
    budget width rounded up, the largest over heads)."""
    segments, code_bytes, bits = 1, 0, 1
    for layer in range(num_layers):
        rows = cal.rows(layer, 0, "bits", range(cal.num_kv_heads), torch.uint8)
        for head in rows.tolist():
            s, c = codebook_layout(head)
            segments, code_bytes = max(segments, s), max(code_bytes, c)
            bits = max(bits, -(-sum(head) // len(head)))
    return segments, code_bytes, bits


# ---- The cache ------------------------------------------------------------------------------

# The side channel from a layer's update to the attention function (which never sees the cache):
# per thread, per layer index, the layer that took the last update and the data_ptr of the key
# it returned, so that attention() can check that the key it is given is that layer's. The layer
# is held by a weak reference: a strong one kept a dropped cache's pools alive until another
# cache's update of the same layer index replaced it (in bench_hf_generate.py, the previous
# row's whole cache through the next row's prefill: OSCAR's 128K peak held kvq_bf16's 16 GiB).
_updates = threading.local()


def _last_updates():
    if not hasattr(_updates, "by_layer"):
        _updates.by_layer = {}
    return _updates.by_layer


def _note_update(layer, key):
    """Records that `layer` returned `key` from its update (for attention())."""
    _last_updates()[layer.layer_idx] = (weakref.ref(layer), key.data_ptr())


def _updated_layer(layer_idx, key):
    """The live layer whose last update of `layer_idx` returned `key`, else None."""
    entry = _last_updates().get(layer_idx)
    if entry is None or entry[1] != key.data_ptr():
        return None
    return entry[0]()


class Layer(_HFLayer):
    """One decoder layer's kvq cache: pools [pages, ...] per plane (page_table[b] = pages
    [b * pages_per_seq, (b + 1) * pages_per_seq)), windows [max_batch_size, ...], lengths
    int32 [max_batch_size] on the device; all allocated at the first update (on the K/V's
    device). Every sequence of a batch has the same length (HF's batches are rectangular)."""

    is_compileable = False  # host-side length and Python checks per step; ops are graph-safe
    is_sliding = False

    def __init__(self, cache, layer_idx, params, heads):
        super().__init__()
        self.cache, self.layer_idx, self.params = cache, layer_idx, params
        self.key_heads, self.value_heads = heads  # {row name: f32 tensor on the CPU}
        self.length = 0
        # Plain attributes here: transformers' Cache derives its max_batch_size / max_cache_len
        # properties from its layers'.
        self.max_batch_size, self.max_cache_len = cache.batch_limit, cache.length_limit
        self.is_initialized = False

    # The CacheLayerMixin API (transformers 5.x).
    def lazy_initialization(self, key_states, value_states=None):
        device = key_states.device if self.cache.pool_device is None else \
            torch.device(self.cache.pool_device)
        dims = torch_ops._cache(self.params).dims
        self.dims = dims
        self.quantized = dims["quantized"] == 1
        page = dims["page_size"]
        history = self.history_tokens(self.max_cache_len)
        self.pages_per_seq = max(1, -(-history // page))
        batch = self.max_batch_size
        self.pools = torch_ops.allocate_pools(self.params, batch * self.pages_per_seq, device)
        self.windows = list(torch_ops.allocate_windows(self.params, batch, device))
        self.tables = torch.arange(batch * self.pages_per_seq, dtype=torch.int32,
                                   device=device).reshape(batch, self.pages_per_seq)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.heads = tuple({k: v.to(device) for k, v in rows.items()}
                           for rows in (self.key_heads, self.value_heads))
        self.dtype, self.device = key_states.dtype, device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Writes K / V [B, Hkv, q, d] (any float dtype, rounded to bf16 as kvq's cache stores
        rows) for positions [length, length + q); returns (key_states, value_states), which
        the kvq attention function reads for a prompt and ignores for a decode step."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, hkv, q, d = key_states.shape
        if hkv != self.dims["num_kv_heads"] or d != self.dims["head_dim"]:
            raise torch_ops.TorchOpError(
                "layer %d: K/V have %d heads of d=%d, this cache %d heads of d=%d (kv_heads %s)"
                % (self.layer_idx, hkv, d, self.dims["num_kv_heads"], self.dims["head_dim"],
                   self.cache.kv_heads), "shape mismatch")
        if batch > self.max_batch_size:
            raise torch_ops.TorchOpError("layer %d: batch %d exceeds max_batch_size %d" % (
                self.layer_idx, batch, self.max_batch_size), "invalid argument")
        if self.length + q > self.max_cache_len:
            raise torch_ops.TorchOpError("layer %d: length %d + %d tokens exceeds max_cache_len "
                                         "%d" % (self.layer_idx, self.length, q,
                                                 self.max_cache_len), "invalid argument")
        if self.length > 0 and q != 1:
            raise torch_ops.TorchOpError(
                "layer %d: a %d-token step over a cache of %d tokens (chunked prefill, "
                "speculative verification) is not served: kvq's decode attends one query token "
                "and the prompt is written by one prefill" % (self.layer_idx, q, self.length),
                "unsupported")
        keys = key_states.transpose(1, 2).to(torch.bfloat16).contiguous()  # [B, q, Hkv, d]
        values = value_states.transpose(1, 2).to(torch.bfloat16).contiguous()
        windows = [w[:batch] for w in self.windows]
        if not self.quantized:
            self._copy_rows(keys, values, self.length)
        elif self.length == 0:
            for b in range(batch):
                torch_ops.write_prefill(self.params, keys[b], values[b], self.tables[b],
                                        *self.heads, *self.pools, *windows, slot=b)
        else:
            torch_ops.write_append(self.params, keys[:, 0], values[:, 0], self.lengths[:batch],
                                   self.tables[:batch], *self.heads, *self.pools, *windows)
        if self.length == 0:
            self.lengths.fill_(q)
        else:
            self.lengths.add_(q)
        self.length += q
        _note_update(self, key_states)
        return key_states, value_states

    def _copy_rows(self, keys, values, t0):
        """The bf16 cache: rows [B, q, Hkv, d] into plane "rows" [pages, Hkv, P, d]."""
        batch, q = keys.shape[:2]
        page = self.dims["page_size"]
        position = torch.arange(t0, t0 + q, device=keys.device)
        pages = self.tables[:batch].long()[:, position // page]  # [B, q]
        slots = (position % page).expand(batch, q)
        for pool, rows in zip(self.pools, (keys, values)):
            pool[0][pages, :, slots] = rows  # advanced indices apart: [B, q, Hkv, d]

    def history_tokens(self, t):
        """H(t): history tokens of a sequence of length t (every token for a bf16 cache)."""
        dims = torch_ops._cache(self.params).dims
        if dims["quantized"] == 0:
            return t
        s0, w, f = dims["sink"], dims["recent"], dims["flush"]
        return f * (max(0, t - s0 - w) // f)

    def get_seq_length(self):
        return self.length

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_max_length(self):
        return self.max_cache_len

    def get_max_cache_shape(self):  # the pre-5.16 name of get_max_length
        return self.max_cache_len

    def reset(self):
        """Empties the layer (its pools need no zeroing: a prefill rewrites what a sequence
        reads)."""
        self.length = 0
        if self.is_initialized:
            self.lengths.zero_()

    def reorder_cache(self, beam_idx):
        raise torch_ops.TorchOpError("kvq.hf.Cache does not reorder sequences (beam search): "
                                     "their pages and windows would have to move", "unsupported")

    def crop(self, max_length):
        raise torch_ops.TorchOpError("kvq.hf.Cache cannot crop: history rows are already "
                                     "quantized", "unsupported")

    def batch_repeat_interleave(self, repeats):
        raise torch_ops.TorchOpError("kvq.hf.Cache does not expand a batch (num_return_"
                                     "sequences / beams > 1)", "unsupported")

    def batch_select_indices(self, indices):
        raise torch_ops.TorchOpError("kvq.hf.Cache does not select sequences of a batch",
                                     "unsupported")

    def offload(self):
        raise torch_ops.TorchOpError("kvq.hf.Cache does not offload", "unsupported")

    def prefetch(self):
        raise torch_ops.TorchOpError("kvq.hf.Cache does not offload", "unsupported")

    def workspace(self, batch):
        """The decode workspace, shared by the layers of the cache (one decode at a time)."""
        return self.cache._workspace(self.params, self.device)


def _config_dims(config):
    """(layers, Hq, Hkv, d) of a Llama / Qwen3-style config (text_config for a composite one)."""
    config = getattr(config, "text_config", None) or config
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise SchemeError("kvq.hf.Cache serves full-attention layers only; layer_types has %s"
                          % sorted(set(types)), "unsupported")
    return config.num_hidden_layers, hq, hkv, d


class Cache(_HFCache):
    """A transformers Cache over kvq's paged pools: one kvq.hf.Layer per decoder layer.

    scheme        a kvq scheme id (SCHEMES; "bf16", "oscar", "kivi", "fp8", ...)
    calibration   a kvq calibration file (kvq calibrate; spec/formats.md §5) for the schemes
                  that read one (rotations, clip ratios, fp8 scales, widths), else None; fp8,
                  fp8_hadamard, blockgtq and tq_mse take only a file of `kvq calibrate
                  --scheme <that scheme>` (SCHEMES' `own`)
    config        the model's config (layers, heads, head_dim)
    device        where the pools live (default: the first K/V's device, at the first update)
    max_batch_size, max_cache_len   the sequences and tokens each the pools are sized for
    kv_heads      the global KV heads this cache holds, in order (default: all); under tensor
                  parallelism each rank passes its own (e.g. range(rank * n, (rank + 1) * n))
    page_size, bits, group, sink, recent, tile, saw_block   calib::SchemeOptions' defaults
                  (64, 2, 64, 64, 256, 32, 128); a scheme's own values win, as in kvq eval
    value_bits    V's width where it differs from `bits`; None: a codebook file's v_bits if it
                  has one (as kvq ppl reads it), else `bits`
    Raises SchemeError for a scheme kvq's CUDA path does not serve (naming the scheme and why),
    ImportError without transformers 5.x."""

    def __init__(self, scheme, calibration=None, config=None, device=None, max_batch_size=1,
                 max_cache_len=4096, page_size=64, kv_heads=None, bits=2, group=64, sink=64,
                 recent=256, tile=32, saw_block=128, value_bits=None):
        if TRANSFORMERS_ERROR is not None:
            raise ImportError(TRANSFORMERS_ERROR)
        if config is None:
            raise torch_ops.TorchOpError("kvq.hf.Cache needs the model's config (config=model."
                                         "config)")
        num_layers, hq, hkv, d = _config_dims(config)
        if hq % hkv:
            raise torch_ops.TorchOpError("num_attention_heads %d is not a multiple of "
                                         "num_key_value_heads %d" % (hq, hkv))
        self.scheme = scheme
        self.kv_heads = list(range(hkv)) if kv_heads is None else [int(h) for h in kv_heads]
        if not self.kv_heads or any(not 0 <= h < hkv for h in self.kv_heads) or \
                len(set(self.kv_heads)) != len(self.kv_heads):
            raise torch_ops.TorchOpError("kv_heads %s must be distinct KV heads of [0, %d)"
                                         % (self.kv_heads, hkv))
        self.batch_limit, self.length_limit = int(max_batch_size), int(max_cache_len)
        local = len(self.kv_heads)
        recipe = scheme_recipe(scheme)
        cal = calibration_for(scheme, calibration, num_layers, hkv, d)
        limits = codebook_limits(cal, num_layers) if recipe["widths"] else None
        # V's width of a codebook file (kvq ppl's rule, CacheOptions): value_bits, else the
        # file's v_bits, else `bits`. A tq_mse file's rotations do not depend on either width.
        if cal is not None and cal.version == 4 and value_bits is None and \
                "v_bits" in cal.metadata:
            value_bits = int(cal.metadata["v_bits"])
        self.params = cache_params_for(scheme, local, local * (hq // hkv), d, bits=bits,
                                       group=group, sink=sink, recent=recent,
                                       page_size=page_size, tile=tile, saw_block=saw_block,
                                       value_bits=value_bits, codebook_rows=limits,
                                       codebook=codebook_density(cal))
        self.scaling = 1.0 / math.sqrt(d)  # softmax_scale 0: fp32(1/sqrt(d)) (params.h)
        self.calibration = cal
        layers = [Layer(self, l, self.params, self._heads(recipe, cal, l, local, d))
                  for l in range(num_layers)]
        super().__init__(layers=layers)
        self._workspaces = {}
        self.pool_device = device
        register()

    def _heads(self, recipe, cal, layer, local, d):
        """({row: f32 [local, ...]} of K, of V) for `layer`: the per-head rows the scheme reads,
        global KV heads self.kv_heads."""
        out = []
        for side in (0, 1):
            rows = {}
            rotation = recipe["rotation"][side]
            if rotation and rotation.startswith("calibration:"):
                tensor = rotation.split(":", 1)[1]  # "k_rotation", "raw_v_rotation", ...
                rows["rotation"] = cal.layer_rows(layer, tensor, self.kv_heads) \
                    .reshape(local, d, d)
            if recipe["clip"]:
                rows["clip"] = cal.rows(layer, side, "clip", self.kv_heads).reshape(local)
            if recipe["widths"] and side == 0:
                rows["widths"] = cal.rows(layer, 0, "bits", self.kv_heads, torch.uint8)
            if recipe["scale"] == "calibration":
                rows["scale"] = cal.rows(layer, side, "scale", self.kv_heads).reshape(local)
            elif recipe["scale"] == "one":
                rows["scale"] = torch.ones(local, dtype=torch.float32)
            out.append(rows)
        return tuple(out)

    def _workspace(self, params, device):
        key = (params, str(device))
        if key not in self._workspaces:
            self._workspaces[key] = torch_ops.allocate_workspace(
                params, self.batch_limit, self.length_limit, device)
        return self._workspaces[key]

    def get_max_cache_shape(self, layer_idx=0):  # the pre-5.16 name of get_max_length
        return self.length_limit

    def reset(self):
        for layer in self.layers:
            layer.reset()

    def __repr__(self):
        return "kvq.hf.Cache(scheme=%r, layers=%d, kv_heads=%s, max_batch_size=%d, " \
            "max_cache_len=%d)" % (self.scheme, len(self.layers), self.kv_heads,
                                   self.batch_limit, self.length_limit)


# ---- The attention function ------------------------------------------------------------------


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface (AttentionInterface "kvq"): query [B, Hq, q, d], key /
    value [B, Hkv, T, d] as the kvq.hf.Layer of module.layer_idx returned them; returns
    ([B, q, Hq, d] in query's dtype, None). q == 1: torch.ops.kvq.decode over the layer's cache
    (q to f32, out back to query's dtype); q > 1 (the prompt, written to an empty cache by
    this step): transformers' sdpa over the bf16 prompt rows, causal."""
    layer = _updated_layer(getattr(module, "layer_idx", None), key)
    if layer is None:
        raise torch_ops.TorchOpError(
            "attention '%s' (layer %s) runs over a kvq.hf.Cache: pass past_key_values=kvq.hf."
            "Cache(...) (with use_cache=True), or set another attn_implementation"
            % (ATTENTION, getattr(module, "layer_idx", None)), "invalid argument")
    if dropout:
        raise torch_ops.TorchOpError("attention '%s' has no dropout (got %r): eval() the model"
                                     % (ATTENTION, dropout), "unsupported")
    if scaling is not None and abs(scaling - layer.cache.scaling) > 1e-6 * layer.cache.scaling:
        raise torch_ops.TorchOpError("layer %d scales logits by %r; kvq's cache by 1/sqrt(d) = %r"
                                     % (layer.layer_idx, scaling, layer.cache.scaling),
                                     "unsupported")
    batch, hq, q, d = query.shape
    if q > 1:  # the prompt: update() just wrote it to an empty cache
        return _sdpa_forward(module, query, key, value, attention_mask, dropout=0.0,
                             scaling=scaling, **kwargs)
    if attention_mask is not None and not _all_visible(attention_mask):
        raise torch_ops.TorchOpError("attention '%s': a padded batch (a masked key) is not served: "
                                     "kvq's decode has no padding mask" % ATTENTION,
                                     "unsupported")
    if hq != layer.dims["num_q_heads"]:
        raise torch_ops.TorchOpError("layer %d: %d query heads, the cache serves %d" % (
            layer.layer_idx, hq, layer.dims["num_q_heads"]), "shape mismatch")
    out = torch_ops.decode(layer.params, query[:, :, 0, :].float().contiguous(),
                           layer.lengths[:batch], layer.tables[:batch], layer.length,
                           *layer.heads, *layer.pools, *[w[:batch] for w in layer.windows],
                           layer.workspace(batch))
    return out.to(query.dtype).unsqueeze(1), None  # [B, 1, Hq, d]


def _all_visible(mask):
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


_registered = []


def register(name=ATTENTION):
    """Registers attention() under `name` with transformers' AttentionInterface and sdpa's mask
    function under the same name with AttentionMaskInterface (without it, a custom name gets no
    mask at all: masking_utils' _preprocess_mask_arguments). Idempotent; returns the name."""
    if TRANSFORMERS_ERROR is not None:
        raise ImportError(TRANSFORMERS_ERROR)
    if name not in _registered:
        _AttentionInterface.register(name, attention)
        _AttentionMaskInterface.register(name, _sdpa_mask)
        _registered.append(name)
    return name


if TRANSFORMERS_ERROR is None:
    register()
