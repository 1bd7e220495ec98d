"""kvq's write path written again in PyTorch from spec/numerics.md, for kvq.conformance.check.

An independent implementation (it calls nothing of kvq): rotation (§3), norm (§5.1), clip (§4),
the affine_token quantizer and packing (§5, §8) and the affine_tile quantizer and packing
(§5.2, §8.1). Every step is an fp32 torch operation in the order the spec gives, so it
reproduces every stored bit on the CPU. The transforms are reused by the other targets of this
folder, which keep kvq's codec input and change only the quantizer.

    TARGET.write(params, x, rotation) -> {"codes": u8, "scale": bf16, "min": bf16} tensors
    TARGET.stage(name, params, inputs, rows) -> {output: tensor}, every stage but fp8's
"""
import math

import torch

__all__ = ["TARGET", "SpecTorch", "bf16_from_bits", "bf16_rne", "clip", "fp32_bits",
           "norm_spans", "pack_tile", "pack_token", "quantize_groups", "transform"]

F32 = torch.float32


def fp32_bits(x):
    """int64 tensor of the fp32 bit patterns of x (0 .. 2^32 - 1)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bf16_rne(x):
    """x (fp32) rounded to bf16, to nearest, ties to even (§1), as a torch.bfloat16 tensor.
    Done on the bits: add 0x7fff plus the lowest kept bit, drop the low 16 bits."""
    u = fp32_bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (rounded.to(torch.int32).to(torch.int16)).view(torch.bfloat16)


def _fwht(x, block):
    """§3.2: stages of stride 1, 2, ..., block/2 on each block of `block` channels, then one
    multiply by fp32(1/sqrt(block)) computed in double."""
    n, d = x.shape
    h = 1
    while h < block:
        pairs = x.reshape(n, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(n, d)
        h *= 2
    return x * torch.tensor(1.0 / math.sqrt(block), dtype=F32)


def _rotate_dense(x, rotation):
    """§3.1: y[j] = sum over i ascending of x[i] * R[i][j], from +0, each product and each sum
    rounded to fp32 (two torch operations: never fused)."""
    y = torch.zeros_like(x)
    for i in range(x.shape[1]):
        y = y + x[:, i:i + 1] * rotation[i:i + 1, :]
    return y


def _bitrev_index(d):
    bits = d.bit_length() - 1
    return torch.tensor([int(format(j, "0%db" % bits)[::-1], 2) for j in range(d)])


def _norm(x, heads):
    """§5.1 over spans of `heads` rows laid end to end. Returns (u [n, d], n^ bfloat16)."""
    n, d = x.shape
    u, norm = norm_spans(x.reshape(n // heads, d * heads))
    return u.reshape(n, d), norm


def norm_spans(span):
    """§5.1 on each row of span [rows, m]: squares, the stride-halving tree padded with +0 to
    a power of two, sqrtf, bf16; the span divided by n^ (n^ = 0: +0). Returns (u, n^ as
    bfloat16 [rows])."""
    m = span.shape[1]
    size = 1 << (m - 1).bit_length()
    a = torch.zeros(span.shape[0], size, dtype=F32)
    a[:, :m] = span * span
    h = size // 2
    while h >= 1:
        a = a[:, :h] + a[:, h:2 * h]
        h //= 2
    norm = bf16_rne(torch.sqrt(a[:, 0]))
    nf = norm.to(F32)[:, None]
    return torch.where(nf == 0, torch.zeros_like(span), span / nf), norm


def bf16_from_bits(bits):
    """fp32 tensor of the bf16 values whose uint16 bits are `bits` (numpy or tensor)."""
    b = torch.as_tensor(bits.astype("int32") if hasattr(bits, "astype") else bits)
    return (b.to(torch.int32) << 16).view(F32)


def transform(p, x, rotation):
    """The transforms before the codec (§3.5): rotate -> P_br -> norm. x float32 [n, d]
    (numpy or tensor); rotation [d, d] for dense. Returns (rows, norm or None)."""
    x = torch.as_tensor(x, dtype=F32)
    if p.rotation == "dense":
        x = _rotate_dense(x, torch.as_tensor(rotation, dtype=F32))
    elif p.rotation == "hadamard":
        x = _fwht(x, p.hadamard_block or p.head_dim)
    if p.bitrev:
        x = x[:, _bitrev_index(p.head_dim)]
    norm = None
    if p.norm:
        x, norm = _norm(x, p.norm_heads)
    return x, norm


def clip(p, x):
    """§4: tau = a[min(floor(rho d), d - 1)] of |x| sorted ascending; x clamped by comparisons
    (keeps +-0). Returns (clipped, tau [n])."""
    d = x.shape[1]
    k = min(int(math.floor(p.clip * d)), d - 1)
    tau = torch.sort(torch.abs(x), dim=1).values[:, k:k + 1]
    return torch.where(x > tau, tau, torch.where(x < -tau, -tau, x)), tau[:, 0]


def quantize_groups(groups, bits):
    """§5 on groups [..., G] (the last axis is one group): lo, hi with +0 normalisation,
    s = (hi - lo) / L, s^ = bf16(s), m^ = bf16(lo), q = clamp(rint((x - m^) / s^), 0, L),
    s^ = 0 -> q = 0. Returns (codes uint8 [..., G], scale, min bfloat16 [...])."""
    levels = (1 << bits) - 1
    lo = groups.min(dim=-1).values + 0.0
    hi = groups.max(dim=-1).values + 0.0
    s = (hi - lo) / torch.full_like(hi, float(levels))  # elementwise IEEE division
    scale, minimum = bf16_rne(s), bf16_rne(lo)
    sf, mf = scale.to(F32)[..., None], minimum.to(F32)[..., None]
    safe = torch.where(sf == 0, torch.ones_like(sf), sf)
    q = torch.round((groups - mf) / safe).clamp(0, levels)
    q = torch.where(sf == 0, torch.zeros_like(q), q)
    return q.to(torch.uint8), scale, minimum


def _split_pack(codes, bits):
    """§8's split rule along the last axis: INT2 byte i holds elements i, m/4 + i, m/2 + i,
    3m/4 + i in bits [1:0] .. [7:6]; INT4 byte i holds i (low nibble) and m/2 + i."""
    per_byte = 8 // bits
    parts = codes.to(torch.int32).reshape(*codes.shape[:-1], per_byte, -1)
    packed = torch.zeros_like(parts[..., 0, :])
    for k in range(per_byte):
        packed |= parts[..., k, :] << (bits * k)
    return packed.to(torch.uint8)


def _split_unpack(packed, bits):
    """The inverse of _split_pack along the last axis: bytes [..., m b / 8] -> codes [..., m]."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    packed = packed.to(torch.int32)
    parts = [(packed >> (bits * k)) & mask for k in range(per_byte)]
    return torch.cat(parts, dim=-1).to(torch.uint8)


def pack_token(codes, bits):
    """§8: codes uint8 [n, d] -> bytes [n, d b / 8]."""
    return _split_pack(codes, bits)


def pack_tile(codes, bits):
    """§8.1: codes uint8 [tiles, G_k, d] -> [tiles, d G_k b / 8], channel-major, each
    channel's G_k codes packed along the tokens by the split rule."""
    return _split_pack(codes.transpose(1, 2), bits).reshape(codes.shape[0], -1)


class SpecTorch:
    """The target: write() of the affine_token and affine_tile formats and stage() of every
    stage but fp8's (those cases are skipped)."""
    name = "spec_torch"

    def codec_input(self, p, x, rotation):
        """The rows the codec quantizes (transformed, then clipped) and the norm plane (a
        bfloat16 [n] tensor, or None without a norm)."""
        rows, norm = transform(p, x, rotation)
        return clip(p, rows)[0], norm

    def stage(self, name, p, inputs, rows):
        """One stage of kvq.stages() (§3-§8; fp8 skipped), inputs and outputs named as
        kvq.run_stage names them."""
        t = {k: torch.as_tensor(v.astype("int32") if v.dtype.kind == "u" and v.itemsize == 2
                                else v) for k, v in inputs.items()}
        d = p.head_dim
        if name == "rotate_dense":
            return {"y": _rotate_dense(t["x"], t["r"])}
        if name == "fwht":
            return {"y": _fwht(t["x"], p.hadamard_block or d)}
        if name == "bitrev":
            return {"y": t["x"][:, _bitrev_index(d)]}
        if name == "clip":
            x, tau = clip(p, t["x"])
            return {"x": x, "tau": tau}
        if name == "norm":
            u, norm = norm_spans(t["x"])
            return {"x": u, "norm": norm}
        if name == "denorm":
            return {"y": t["y"] * bf16_from_bits(inputs["norm"])[:, None]}
        if name in ("quantize", "quantize_tile"):
            x = t["x"]
            if name == "quantize":
                codes, scale, minimum = quantize_groups(x.reshape(rows, d // p.group, p.group),
                                                        p.bits)
                return {"codes": codes.reshape(rows, d), "scale": scale, "min": minimum}
            codes, scale, minimum = quantize_groups(
                x.reshape(rows // p.group, p.group, d).transpose(1, 2), p.bits)
            return {"codes": codes.transpose(1, 2).reshape(rows, d), "scale": scale,
                    "min": minimum}
        if name == "pack":
            return {"packed": pack_token(t["codes"], p.bits)}
        if name == "unpack":
            return {"codes": _split_unpack(t["packed"], p.bits)}
        if name == "pack_tile":
            return {"packed": pack_tile(t["codes"].reshape(rows // p.group, p.group, d),
                                        p.bits)}
        if name == "unpack_tile":
            codes = _split_unpack(t["packed"].reshape(rows // p.group, d, -1), p.bits)
            return {"codes": codes.transpose(1, 2).reshape(rows, d)}
        if name in ("dequantize", "dequantize_tile"):
            sf, mf = bf16_from_bits(inputs["scale"]), bf16_from_bits(inputs["min"])
            q = t["codes"].to(F32)
            if name == "dequantize":
                q = q.reshape(rows, -1, p.group)
                return {"y": (q * sf[..., None] + mf[..., None]).reshape(rows, d)}
            q = q.reshape(rows // p.group, p.group, d)
            return {"y": (q * sf[:, None, :] + mf[:, None, :]).reshape(rows, d)}
        raise NotImplementedError("spec_torch has no stage " + name)

    def write(self, p, x, rotation):
        if p.format not in ("affine_token", "affine_tile"):
            raise NotImplementedError("spec_torch writes affine_token and affine_tile, not "
                                      + p.format)
        rows, norm = self.codec_input(p, x, rotation)
        n, d = rows.shape
        if p.format == "affine_token":
            codes, scale, minimum = quantize_groups(rows.reshape(n, d // p.group, p.group),
                                                    p.bits)
            planes = {"codes": pack_token(codes.reshape(n, d), p.bits)}
        else:
            tiles = rows.reshape(n // p.group, p.group, d)  # [tiles, G_k, d]
            codes, scale, minimum = quantize_groups(tiles.transpose(1, 2), p.bits)
            planes = {"codes": pack_tile(codes.transpose(1, 2), p.bits)}
        planes.update(scale=scale, min=minimum)
        if norm is not None:
            planes["norm"] = norm
        return planes


TARGET = SpecTorch()
