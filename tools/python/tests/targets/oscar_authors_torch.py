"""The OSCAR authors' INT2 write, as shared/research/outside_kernel.md measured it, in PyTorch.

The authors' Triton kernels (prefill: oscar_rotation_clip_int2_kv.py; decode flush:
gpu_flush_int2.py) differ from kvq's spec in the choices §2.2 of the note lists; this target
makes those choices on the CPU, in fp32 and IEEE arithmetic (the grouped kernels' div_rn; the
G = d kernels' compiled reciprocal-FMA division of §2.3 is a GPU property and is not modelled):
- rotation: kvq's (spec_torch.transform), so the comparison isolates the quantizer (the note's
  mode Q);
- clip: prefill takes kvq's order statistic a[min(int(rho d), d - 1)]; decode flush runs the
  log2(d)-step bisection of gpu_flush_int2.py:204-218 (one index low, on a max|x|/d grid, and it
  clips at rho = 1 too);
- range floored at 1e-8: scale = max(hi - lo, 1e-8) / 3, fp32, stored fp32;
- a zero point z = (0 - lo) / scale, stored fp32, instead of a minimum;
- codes = trunc(x / scale + z + 0.5) (half up), no clamp, saturated to [0, 65535], low byte;
- split-quarter packing as kvq's, ORed without masks.
INT2 and affine_token only (the authors' kernels have no INT4 and no tiles): others skip.

    PREFILL.write(params, x, rotation) -> {"codes": u8, "scale": f32, "zero": f32}: the
        prefill kernel alone
    SERVING: the serving path: write() is the prefill kernel, flush(params, x, rotation) the
        decode flush writing the same rows (kvq.conformance's prefill = flush invariant)
    FLUSH: a target whose write() is the decode flush
Each declares its planes' form as `adapter` (fp32 scale, fp32 zero point, kvq's packing) for
kvq.conformance's verdict tiers.
"""
import math

import torch

from . import spec_torch

try:  # the planes' form, for kvq.conformance's verdict tiers (spec/verdicts.md §5)
    from kvq.conformance import Adapter as _Adapter
except ImportError:  # a kvq without the tiers: the exact check needs no adapter
    _Adapter = None

__all__ = ["FLUSH", "PREFILL", "SERVING", "OscarAuthors", "OscarServing", "bisection_threshold",
           "quantize"]

F32 = torch.float32


def _clip_index(p, d):
    """k = int(rho d) clamped to [0, d - 1] (Python double)."""
    return max(0, min(int(p.clip * d), d - 1))


def bisection_threshold(p, x):
    """The decode flush's threshold per row [n, 1]: lo = 0, hi = max|x|; log2(d) times
    mid = (lo + hi) * 0.5, lo = mid if #(|x| > mid) > d - k else hi = mid; the threshold is hi."""
    n, d = x.shape
    k = _clip_index(p, d)
    a = torch.abs(x)
    lo = torch.zeros(n, 1, dtype=F32)
    hi = a.max(dim=1, keepdim=True).values
    for _ in range(int(math.log2(d))):
        mid = (lo + hi) * 0.5
        above = (a > mid).sum(dim=1, keepdim=True)
        move_lo = above > d - k
        lo = torch.where(move_lo, mid, lo)
        hi = torch.where(move_lo, hi, mid)
    return hi


def quantize(groups):
    """The authors' INT2 quantizer on groups [..., G]: (codes uint8 [..., G] before packing,
    with the kernel's saturating conversion, scale, zero fp32 [...])."""
    lo = groups.min(dim=-1).values
    hi = groups.max(dim=-1).values
    scale = torch.clamp(hi - lo, min=1e-8) / torch.full_like(lo, 3.0)
    zero = (torch.zeros_like(lo) - lo) / scale  # unary minus compiles to 0 - x
    v = groups / scale[..., None] + zero[..., None] + 0.5
    v = torch.nan_to_num(v, nan=0.0)
    q = torch.trunc(v).clamp(0, 65535).to(torch.int64) & 0xFF  # cvt.rzi.u16.f32, low byte
    return q, scale, zero


def _pack_unmasked(codes, d):
    """Split-quarter packing ORed without masks: q[i] | q[d/4+i] << 2 | q[d/2+i] << 4 |
    q[3d/4+i] << 6, low byte."""
    parts = codes.reshape(codes.shape[0], 4, d // 4)
    packed = parts[:, 0] | (parts[:, 1] << 2) | (parts[:, 2] << 4) | (parts[:, 3] << 6)
    return (packed & 0xFF).to(torch.uint8)


class OscarAuthors:
    """write(): the prefill kernel (order-statistic clip) or, with flush_clip, the decode
    flush kernel (bisection clip)."""

    def __init__(self, name, flush_clip):
        self.name, self._flush_clip = name, flush_clip
        if _Adapter is not None:  # fp32 scale and zero point, kvq's packing
            self.adapter = _Adapter("float32", zero_point="float")

    def _write(self, p, x, rotation, flush_clip):
        if p.format != "affine_token" or p.bits != 2:
            raise NotImplementedError("the OSCAR authors' kernels write INT2 per-token groups "
                                      "only, not %s at %d bits" % (p.format, p.bits))
        if p.norm:
            raise NotImplementedError("the OSCAR authors' kernels have no norm")
        rows, _ = spec_torch.transform(p, x, rotation)
        if flush_clip:
            tau = bisection_threshold(p, rows)
            rows = torch.minimum(torch.maximum(rows, -tau), tau)
        else:
            tau = torch.sort(torch.abs(rows), dim=1).values[:, _clip_index(p, p.head_dim)][:, None]
            rows = torch.minimum(torch.maximum(rows, -tau), tau)
        n, d = rows.shape
        q, scale, zero = quantize(rows.reshape(n, d // p.group, p.group))
        return {"codes": _pack_unmasked(q.reshape(n, d), d), "scale": scale, "zero": zero}

    def write(self, p, x, rotation):
        return self._write(p, x, rotation, self._flush_clip)


class OscarServing(OscarAuthors):
    """The authors' serving path: prefill writes the prompt's rows, the decode flush the rows
    demoted from the recent window; flush() is the latter on the same rows."""

    def __init__(self, name):
        super().__init__(name, flush_clip=False)

    def flush(self, p, x, rotation):
        return self._write(p, x, rotation, True)


PREFILL = OscarAuthors("oscar_authors_torch", flush_clip=False)
FLUSH = OscarAuthors("oscar_authors_torch_flush", flush_clip=True)
SERVING = OscarServing("oscar_authors_torch_serving")
