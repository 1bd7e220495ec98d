"""Verdict tiers for kernels that do not promise kvq's bits (spec/verdicts.md).

A stage or pipeline case of a quantized format is judged element by element and the case gets
the worst tier of its elements (of its ordinary elements with edge_rows='apart'):
    exact        every stored bit matches (in kvq's plane form, after the Adapter)
    explained    the metadata rounds to kvq's bf16 bits and every code that differs differs by
                 one, at a rounding boundary (boundary_rule below)
    within_step  every dequantized value lies within one oracle step of the value quantized
    unexplained  anything else, or a violated invariant: a FAIL
Elements of edge groups (subnormal values, constant groups, a large offset against the spread)
are judged alike and reported apart (edge_tier). Invariants are checked on the target's own
output: codes in range, finite metadata and dequantized values, and, where the target offers
them, its pack/unpack round trip and its decode-flush writes (see conformance).

Everything here is numpy; the oracle's values come from the case's expect.* tensors.
"""
import numpy as np

from ._arrays import as_numpy
from ._errors import error
from ._kvq import run_stage

__all__ = ["TIERS", "DEFAULT_BOUND", "EDGE_CLASSES", "IDENTITY", "Adapter", "Judgement", "Oracle",
           "bf16_bits", "bf16_value", "boundary_rule", "e4m3_values", "edge_groups",
           "judge_affine", "judge_fp8", "tier_of"]

TIERS = ("exact", "explained", "within_step", "unexplained")
# Half-width, in code units, of the band around a rounding boundary k + 1/2 inside which a
# one-code disagreement is accepted (spec/verdicts.md §2): a target computing the pre-rounding
# value in fp32 in another order is within a few fp32 ulps of v <= 15 (about 1e-6); 1e-3 leaves
# room for fp32 reciprocal tricks and fused multiply-adds, not for fp16 arithmetic (which needs
# about L * 2^-10: pass bound= to check()).
DEFAULT_BOUND = 1e-3
# The edge classes of a group of the codec input (spec/verdicts.md §4).
EDGE_CLASSES = ("subnormal", "constant", "offset")
_FLT_MIN = np.float32(2.0 ** -126)
# The within-step tier's allowance for metadata held at fp16 precision or finer: 2^-10 of the
# group's magnitude (two fp16 roundings), spec/verdicts.md §3.
_META_PRECISION = 2.0 ** -10


def tier_of(index):
    """The tier name of a tier index (0 exact .. 3 unexplained)."""
    return TIERS[int(index)]


def bf16_value(bits):
    """float32 array of the bf16 values whose uint16 bits are `bits` (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def bf16_bits(values):
    """uint16 bits of float32(values) rounded to bf16, to nearest, ties to even (NaN stays a
    quiet NaN, Inf stays Inf): kvq's bf16_rne (spec/numerics.md §1)."""
    f = np.ascontiguousarray(np.asarray(values, np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded).astype(np.uint16)


class Adapter:
    """How a target's planes map to kvq's (spec/verdicts.md §5). Declared by the user, passed to
    kvq.conformance.check(adapter=...) or set as the target's `adapter` attribute.

    scale_dtype: the dtype of the target's 'scale' plane: "bfloat16" (kvq's: uint16 bits, or a
        torch.bfloat16 tensor), "float16" or "float32".
    min_dtype: the dtype of its 'min' plane (default: scale_dtype); ignored with zero_point.
    zero_point: None (the target returns kvq's 'min', x ~ s*q + min), or "float" / "integer":
        the target returns a 'zero' plane z (same shape as scale, a float or an integer array)
        with x ~ s*(q - z); kvq's min is then -s*z (fp64 product, rounded to fp32, then bf16).
    packing: None (kvq's packing, spec/numerics.md §8 / §8.1), "unpacked" (the 'codes' plane
        holds one integer code per element, [n, d] in row and channel order), or a permutation
        perm (integer array): the target's 'codes' plane, read per plane row (a token for
        affine_token, a tile for affine_tile) as a little-endian bit stream of b-bit fields
        (of any integer dtype: int32 words are their 4 little-endian bytes), has in field f
        the code of element perm[f] of the unit (affine_token: channel; affine_tile:
        token_in_tile * d + channel); or a callable perm_of(params) -> perm, for a target
        whose packing depends on the case (a permutation's length is the plane row's d or
        G_k * d), so one adapter serves a whole run.
    Raises kvq.Error (invalid argument) for an unknown dtype or zero_point, a perm that is not
    a permutation of 0..len-1."""

    _DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

    def __init__(self, scale_dtype="bfloat16", min_dtype=None, zero_point=None, packing=None):
        for what, value in (("scale_dtype", scale_dtype), ("min_dtype", min_dtype)):
            if value is not None and value not in self._DTYPES:
                raise error("Adapter %s '%s' is not one of %s" % (
                    what, value, ", ".join(self._DTYPES)), "invalid argument")
        if zero_point not in (None, "float", "integer"):
            raise error("Adapter zero_point '%s' is not None, 'float' or 'integer'"
                        % (zero_point,), "invalid argument")
        self.scale_dtype, self.zero_point = scale_dtype, zero_point
        self.min_dtype = min_dtype or scale_dtype
        if packing is None or (isinstance(packing, str) and packing == "unpacked") or \
                callable(packing):
            self.packing = packing
        else:
            self.packing = self._checked_perm(packing)

    @staticmethod
    def _checked_perm(packing):
        perm = np.asarray(packing).astype(np.int64).ravel()
        if not np.array_equal(np.sort(perm), np.arange(perm.size)):
            raise error("Adapter packing is not a permutation of 0..%d" % (perm.size - 1),
                        "invalid argument")
        return perm

    def perm(self, p):
        """The permutation of the declared packing under WriteParams p (a callable packing is
        asked for it and checked), or None / "unpacked" as declared."""
        if callable(self.packing):
            return self._checked_perm(self.packing(p))
        return self.packing

    @property
    def metadata_identity(self):
        """True when scale and min are kvq's bf16 planes (no zero point)."""
        return (self.scale_dtype == "bfloat16" and self.min_dtype == "bfloat16" and
                self.zero_point is None)

    @property
    def identity(self):
        """True for kvq's own plane form (bf16 scale and min, kvq's packing)."""
        return (self.scale_dtype == "bfloat16" and self.min_dtype == "bfloat16" and
                self.zero_point is None and self.packing is None)

    def describe(self):
        """A short text: 'scale float16, zero point integer, packing perm[64]'."""
        parts = ["scale " + self.scale_dtype]
        if self.zero_point:
            parts.append("zero point " + self.zero_point)
        elif self.min_dtype != self.scale_dtype:
            parts.append("min " + self.min_dtype)
        if self.packing is not None:
            parts.append("packing " + (self.packing if isinstance(self.packing, str) else
                                       "perm per params" if callable(self.packing) else
                                       "perm[%d]" % self.packing.size))
        return ", ".join(parts)

    def as_dict(self):
        return dict(scale_dtype=self.scale_dtype, min_dtype=self.min_dtype,
                    zero_point=self.zero_point,
                    packing=(self.packing if self.packing is None or
                             isinstance(self.packing, str) else
                             "per params" if callable(self.packing) else
                             self.packing.tolist()))

    # --- reading the target's planes -----------------------------------------------------

    def metadata_values(self, planes, what):
        """float64 array of the target's plane `what` ('scale' or 'min'), exact, from its
        declared dtype. Raises kvq.Error (shape mismatch) when the plane's dtype is not the
        declared one."""
        dtype = self.scale_dtype if what == "scale" else self.min_dtype
        a = np.ascontiguousarray(as_numpy(planes[what]))
        if a.dtype != self._DTYPES[dtype]:
            raise error("plane '%s' must be %s (the adapter's %s), got %s" % (
                what, dtype, "scale_dtype" if what == "scale" else "min_dtype", a.dtype),
                "shape mismatch")
        return (bf16_value(a) if dtype == "bfloat16" else a).astype(np.float64)

    def zero_values(self, planes):
        """float64 array of the target's 'zero' plane (zero_point adapters)."""
        a = np.ascontiguousarray(as_numpy(planes["zero"]))
        kind = "iu" if self.zero_point == "integer" else "f"
        if a.dtype.kind not in kind:
            raise error("plane 'zero' must be %s array (zero_point '%s'), got %s" % (
                "an integer" if kind == "iu" else "a floating-point", self.zero_point, a.dtype),
                "shape mismatch")
        return a.astype(np.float64)

    def codes(self, p, planes, n):
        """uint8-valued int64 codes [n, d] of the target's 'codes' plane, unpacked by the
        declared packing (kvq's own by kvq's unpack stage). Codes out of [0, 2^b - 1] are kept
        as they are (only "unpacked" can hold them): the range invariant reports them."""
        d, b = p.head_dim, p.bits
        raw = np.ascontiguousarray(as_numpy(planes["codes"]))
        perm = self.perm(p)
        if isinstance(perm, str):  # "unpacked"
            if raw.dtype.kind not in "iu" or raw.size != n * d:
                raise error("plane 'codes' (unpacked) must hold n*d = %d integer codes, got "
                            "%d of %s" % (n * d, raw.size, raw.dtype), "shape mismatch")
            return raw.reshape(n, d).astype(np.int64)
        if perm is None:
            if p.format == "fp8_e4m3":
                if raw.dtype != np.uint8 or raw.size != n * d:
                    raise error("plane 'codes' must hold n*d = %d uint8 codes, got %d of %s"
                                % (n * d, raw.size, raw.dtype), "shape mismatch")
                return raw.reshape(n, d).astype(np.int64)
            stage = "unpack_tile" if p.format == "affine_tile" else "unpack"
            return run_stage(stage, p, {"packed": raw}, n)["codes"].astype(np.int64)
        if raw.dtype.kind not in "iu":
            raise error("plane 'codes' must be an integer array, got %s" % raw.dtype,
                        "shape mismatch")
        tile = p.tile_tokens if p.format == "affine_tile" else 1
        unit = d * tile
        if perm.size != unit:
            raise error("the adapter's packing permutes %d elements, a plane row holds %d "
                        "(d = %d x %d tokens)" % (perm.size, unit, d, tile),
                        "invalid argument")
        data = raw.view(np.uint8).reshape(-1)
        units = n // tile
        if data.size != units * unit * b // 8:
            raise error("plane 'codes' holds %d bytes, expected %d (%d plane rows of %d %d-bit "
                        "codes)" % (data.size, units * unit * b // 8, units, unit, b),
                        "shape mismatch")
        bits = np.unpackbits(data.reshape(units, -1), axis=1, bitorder="little")
        fields = (bits.reshape(units, unit, b).astype(np.int64) << np.arange(b)).sum(axis=2)
        codes = np.empty_like(fields)
        codes[:, perm] = fields
        return codes.reshape(n, d)

    def pack(self, p, codes):
        """The target's 'codes' plane for codes [n, d] under the declared packing (the inverse
        of codes()): uint8 [plane rows, bytes] for a permutation, kvq's packing for None."""
        n, d = codes.shape
        perm = self.perm(p)
        if isinstance(perm, str):
            return codes.astype(np.uint8)
        if perm is None:
            if p.format == "fp8_e4m3":
                return codes.astype(np.uint8)
            stage = "pack_tile" if p.format == "affine_tile" else "pack"
            return run_stage(stage, p, {"codes": codes.astype(np.uint8)}, n)["packed"]
        b = p.bits
        tile = p.tile_tokens if p.format == "affine_tile" else 1
        units = codes.reshape(n // tile, d * tile)
        fields = units[:, perm]
        bits = ((fields[:, :, None] >> np.arange(b)) & 1).astype(np.uint8)
        return np.packbits(bits.reshape(units.shape[0], -1), axis=1, bitorder="little")


IDENTITY = Adapter()


class Oracle:
    """What the oracle knows of a case's codec: the input x it quantized, its codes, its stored
    metadata and its pre-rounding values, every array per element [n, d].

    x: float32 codec input (pipeline: the clipped row after rotation and norm; stage: in.x)
    codes: int64 expect.codes; sf, mf: float32 stored scale and min (bf16 values), per element
    lo, hi: float32 exact group min and max; v: float32 (x - mf) / sf, NaN where sf = 0
    group: int64 group id per element; scale_bits, min_bits: the expected bf16 bits
    (metadata shape) or None (fp8)."""

    def __init__(self, p, x, codes, scale_bits=None, min_bits=None):
        self.p, self.n, self.d = p, x.shape[0], x.shape[1]
        self.x, self.codes = x.astype(np.float32), codes.astype(np.int64)
        self.levels = 255 if p.format == "fp8_e4m3" else (1 << p.bits) - 1
        self.scale_bits, self.min_bits = scale_bits, min_bits
        n, d = self.n, self.d
        if p.format == "fp8_e4m3":
            self.group = np.repeat(np.arange(n), d).reshape(n, d)  # a row is a "group"
            self.expand = lambda meta: np.repeat(meta, d, axis=1)
            self.sf = np.full((n, d), np.float32(p.head_scale), np.float32)
            self.mf = np.zeros((n, d), np.float32)
        elif p.format == "affine_tile":
            g = p.tile_tokens
            self.group = (np.arange(n)[:, None] // g) * d + np.arange(d)[None, :]
            self.expand = lambda meta: np.repeat(np.asarray(meta).reshape(n // g, d), g, axis=0)
        else:
            g = p.group
            self.group = np.arange(n)[:, None] * (d // g) + np.arange(d)[None, :] // g
            self.expand = lambda meta: np.repeat(np.asarray(meta).reshape(n, d // g), g, axis=1)
        if scale_bits is not None:
            self.sf = self.expand(bf16_value(scale_bits))
            self.mf = self.expand(bf16_value(min_bits))
        flat = self.group.ravel()
        groups = flat.max() + 1
        lo = np.full(groups, np.inf, np.float32)
        hi = np.full(groups, -np.inf, np.float32)
        np.minimum.at(lo, flat, self.x.ravel())
        np.maximum.at(hi, flat, self.x.ravel())
        self.lo, self.hi = lo[self.group], hi[self.group]
        with np.errstate(all="ignore"):
            self.v = np.where(self.sf == 0, np.float32(np.nan),
                              (self.x - self.mf) / self.sf).astype(np.float32)

    def edge_classes(self):
        """{class: bool [n, d]}: elements of edge groups, by class (spec/verdicts.md §4)."""
        return edge_groups(self.x, self.lo, self.hi, self.group, self.levels,
                           fp8=self.p.format == "fp8_e4m3")


def edge_groups(x, lo, hi, group, levels, fp8=False):
    """{class: bool [n, d]} marking the elements of edge groups of codec input x float32 [n, d]
    (lo, hi: the group's min and max per element; group: group id per element):
      subnormal  the group holds a non-zero value below 2^-126 in magnitude, or its step
                 (hi - lo) / L is non-zero and below 2^-126
      constant   hi == lo (the step is 0)
      offset     |lo| > 2^8 * (hi - lo) / L: bf16(lo) may be more than half a step from lo
                 (not for fp8, which has no offset)."""
    ax = np.abs(x)
    sub_elem = (ax > 0) & (ax < _FLT_MIN)
    flat = group.ravel()
    sub_group = np.zeros(flat.max() + 1, bool)
    np.logical_or.at(sub_group, flat, sub_elem.ravel())
    spread = hi.astype(np.float64) - lo.astype(np.float64)
    step = spread / levels
    classes = {"subnormal": sub_group[group] | ((step > 0) & (step < float(_FLT_MIN))),
               "constant": spread == 0}
    classes["offset"] = (np.zeros_like(classes["constant"]) if fp8 else
                         (np.abs(lo.astype(np.float64)) > 256.0 * step) & (spread > 0))
    return classes


def boundary_rule(q_oracle, q_target, v_oracle, v_target, levels, bound):
    """bool array: a one-code disagreement at a rounding boundary (spec/verdicts.md §2).
    The codes differ by exactly one, k = min(q_oracle, q_target), and the boundary k + 1/2 lies
    within `bound` of the closed interval between the oracle's pre-rounding value and the
    target's (v_target NaN or None: the oracle's value alone; v_oracle NaN, a group whose
    oracle scale is 0: the target's value alone), both first clamped to [0, L]."""
    k = np.minimum(q_oracle, q_target).astype(np.float64)
    one = np.abs(q_oracle - q_target) == 1
    vo = np.clip(v_oracle.astype(np.float64), 0, levels)
    vt = vo if v_target is None else np.where(np.isnan(v_target), vo,
                                              np.clip(v_target, 0, levels))
    vo = np.where(np.isnan(vo), vt, vo)  # the oracle's scale is 0: the target's value alone
    low, high = np.minimum(vo, vt), np.maximum(vo, vt)
    edge = k + 0.5
    with np.errstate(invalid="ignore"):
        return one & (edge >= low - bound) & (edge <= high + bound)


def e4m3_values():
    """float64 [256]: the value of every OCP e4m3 byte (spec/numerics.md §5.3); NaN for 0x7f
    and 0xff."""
    c = np.arange(256)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7.0))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * mag)


_E4M3 = e4m3_values()
_E4M3_RANK = np.searchsorted(np.unique(_E4M3[~np.isnan(_E4M3)]), np.nan_to_num(_E4M3))


class Judgement:
    """The tiers of one case's elements and what they rest on.

    tiers: int8 [n, d] tier index per element; edge: bool [n, d] (elements of edge groups);
    edge_classes: {class: number of groups}; invariants: {name: True | False | None (not
    checked)}; notes: texts of the violated invariants and of the first unexplained element.
    """

    def __init__(self, tiers, edge, edge_classes):
        self.tiers, self.edge, self.edge_classes = tiers, edge, edge_classes
        self.invariants, self.notes = {}, []

    def violate(self, name, text):
        self.invariants[name] = False
        self.notes.append("%s: %s" % (name, text))

    def tier(self, part):
        """Worst tier index over 'ordinary' or 'edge' elements (0 when there are none); any
        violated invariant makes both 3."""
        if any(v is False for v in self.invariants.values()):
            return 3
        mask = self.edge if part == "edge" else ~self.edge
        return int(self.tiers[mask].max()) if mask.any() else 0

    def counts(self, part):
        """{tier: elements} over 'ordinary' or 'edge' elements."""
        mask = self.edge if part == "edge" else ~self.edge
        values = np.bincount(self.tiers[mask].ravel().astype(np.int64), minlength=4)
        return {t: int(c) for t, c in zip(TIERS, values)}


def _first(mask):
    index = np.argwhere(mask)
    return tuple(int(i) for i in index[0]) if index.size else None


def judge_affine(oracle, q_t, scale_t, min_t, zero_t, meta_equal, bound):
    """The Judgement of an affine quantizer's output (affine_token, affine_tile).

    oracle: an Oracle; q_t int64 [n, d] the target's codes (unpacked); scale_t, min_t, zero_t:
    float64 [n, d] the target's own metadata per element (zero_t None unless the adapter reads a
    zero point; all None for a target that returned none); meta_equal: bool [n, d], the
    element's metadata rounds to the oracle's bf16 bits. Tiers per element:
      exact        q_t == q_o and meta_equal
      explained    meta_equal and boundary_rule(q_o, q_t, v_o, v_t, L, bound)
      within_step  |xhat_t - x| <= sf + |mf - lo| + 2^-10 * max(|lo|, |hi|)
      unexplained  otherwise (NaN / Inf xhat_t included)."""
    o, L = oracle, oracle.levels
    x = o.x.astype(np.float64)
    if scale_t is None:
        v_t = None
        xhat = q_t * o.sf.astype(np.float64) + o.mf
    else:
        with np.errstate(all="ignore"):
            if zero_t is not None:
                v_t = np.where(scale_t == 0, np.nan, x / scale_t + zero_t)
                xhat = scale_t * (q_t - zero_t)
            else:
                v_t = np.where(scale_t == 0, np.nan, (x - min_t) / scale_t)
                xhat = q_t * scale_t + min_t
    lo, hi = o.lo.astype(np.float64), o.hi.astype(np.float64)
    allowance = (o.sf + np.abs(o.mf - lo) + _META_PRECISION * np.maximum(np.abs(lo), np.abs(hi)))
    with np.errstate(invalid="ignore"):
        within = np.isfinite(xhat) & (np.abs(xhat - x) <= allowance)
    same = q_t == o.codes
    explained = meta_equal & boundary_rule(o.codes, q_t, o.v, v_t, L, bound)
    tiers = np.where(same & meta_equal, 0, np.where(explained, 1, np.where(within, 2, 3)))
    j = _judgement(o, tiers, o.edge_classes())
    j.invariants["codes_in_range"] = bool(((q_t >= 0) & (q_t <= L)).all())
    if not j.invariants["codes_in_range"]:
        r, c = _first((q_t < 0) | (q_t > L))
        j.violate("codes_in_range", "code %d at row %d, column %d is outside [0, %d]"
                  % (q_t[r, c], r, c, L))
    finite = True
    for what, values in (("scale", scale_t), ("min", min_t), ("zero", zero_t),
                         ("dequantized", xhat)):
        if values is not None and not np.isfinite(values).all():
            r, c = _first(~np.isfinite(values))
            j.violate("finite", "%s is %r at row %d, column %d (group %d)"
                      % (what, float(values[r, c]), r, c, int(o.group[r, c])))
            finite = False
            break
    j.invariants.setdefault("finite", finite)
    bad = _first(tiers == 3)
    if bad is not None:
        r, c = bad
        j.notes.append("unexplained at row %d, column %d%s: code %d, oracle %d (oracle's "
                       "pre-rounding %.6g%s)%s" % (
                           r, c, _where(j, r, c), q_t[r, c], o.codes[r, c], o.v[r, c],
                           "" if v_t is None else ", target's %.6g" % v_t[r, c],
                           "" if meta_equal[r, c] else ", metadata off kvq's bf16"))
    return j


def _judgement(oracle, tiers, classes, edge_names=EDGE_CLASSES):
    """A Judgement of per-element `tiers` whose edge elements are those of `edge_names`."""
    edge = np.zeros(tiers.shape, bool)
    for name in edge_names:
        edge |= classes[name]
    groups = {name: int(np.unique(oracle.group[mask]).size) for name, mask in classes.items()}
    j = Judgement(tiers.astype(np.int8), edge, groups)
    j.classes = classes
    return j


def _where(judgement, r, c):
    """' (edge group: constant)' for an element of an edge group, else ''."""
    names = [n for n in EDGE_CLASSES if judgement.classes[n][r, c]]
    return " (edge group: %s)" % ", ".join(names) if names else ""


def judge_fp8(oracle, q_t, bound):
    """The Judgement of fp8_e4m3 codes q_t int64 [n, d] against the oracle's: exact where equal;
    explained where the two values are neighbours in e4m3 and x / s lies within bound * gap of
    their midpoint (after saturation to +-448); within_step where they are neighbours (ranks
    one apart, +0 and -0 one rank); unexplained otherwise (NaN codes included)."""
    o = oracle
    q_t = np.clip(q_t, 0, 255)
    e_o, e_t = _E4M3[o.codes], _E4M3[q_t]
    rank_gap = np.abs(_E4M3_RANK[o.codes] - _E4M3_RANK[q_t])
    v = np.clip(o.x.astype(np.float64) / float(o.p.head_scale), -448.0, 448.0)
    with np.errstate(invalid="ignore"):
        at_tie = (rank_gap == 1) & (np.abs(v - (e_o + e_t) / 2) <= bound * np.abs(e_t - e_o))
    nan = np.isnan(e_t)
    tiers = np.where(q_t == o.codes, 0, np.where(at_tie, 1, np.where(rank_gap <= 1, 2, 3)))
    tiers = np.where(nan, 3, tiers)
    j = _judgement(o, tiers, o.edge_classes(), ("subnormal", "constant"))
    j.invariants["codes_in_range"] = True
    j.invariants["finite"] = not nan.any()
    if nan.any():
        r, c = _first(nan)
        j.violate("finite", "code 0x%02x (NaN) at row %d, column %d" % (q_t[r, c], r, c))
    bad = _first(tiers == 3)
    if bad is not None:
        r, c = bad
        j.notes.append("unexplained at row %d, column %d%s: code 0x%02x (%g), oracle 0x%02x "
                       "(%g)" % (r, c, _where(j, r, c), q_t[r, c], e_t[r, c], o.codes[r, c],
                                 e_o[r, c]))
    return j
