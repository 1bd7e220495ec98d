"""KIVI's quantizer (jy-yuan/KIVI quant/new_pack.py), as shared/research/outside_kivi.md
measured it on CUDA, in PyTorch on the CPU.

KIVI quantizes keys per channel over G tokens (kvq's affine_tile) and values per token over G
channels (affine_token), with kvq's semantics but its own arithmetic and layout (note §2):
- the model dtype, fp16: the input rows are rounded to fp16 and every operation is computed in
  fp32 and rounded to fp16, op by op;
- mn, mx exact in fp16; scale = fp16(fp16(mx - mn) * fl32(1/L)) (torch on CUDA divides a tensor
  by a Python int as a multiply by the fp32 reciprocal); mn and scale stored as fp16;
- codes = int(round_half_even(clamp(fp16(fp16(x - mn) / scale), 0, L))), against the unrounded
  (fp16) metadata; 0/0 = NaN becomes 0 (CUDA's conversion), x/0 = +Inf becomes L;
- packing: 32/b consecutive codes of the quantized axis per int32 word, code i in bits
  [b i, b i + b): values 32/b consecutive channels per word, keys 32/b consecutive tokens of one
  channel per word, the tile's words channel-major. packing_permutation(p) gives that order as
  the field -> element permutation a user hands to an adapter.
kvq's transforms (rotation, norm, clip) come first (spec_torch), so only the quantizer differs.
A range past 65504 overflows the fp16 scale to Inf: the codes become 0 and a dequantized value
0 * Inf + mn is NaN (note §4.4).

    TARGET.write(params, x, rotation) -> {"codes": int32 words, "scale": f16, "min": f16}
    TARGET_F32: the same formula in fp32 (scale and min float32)
"""
import torch

from . import spec_torch

__all__ = ["TARGET", "TARGET_F32", "Kivi", "packing_permutation", "quantize"]

F16, F32 = torch.float16, torch.float32


def quantize(groups, bits, dtype=F16):
    """KIVI's quantizer on groups [..., G] of model-dtype values held as fp32 (exact): (codes
    int64 [..., G], scale, mn [...] in the model dtype)."""
    def h(x):  # one op's fp32 result rounded to the model dtype
        return x.to(dtype).to(F32)
    levels = (1 << bits) - 1
    mn = groups.min(dim=-1).values
    mx = groups.max(dim=-1).values
    reciprocal = torch.tensor(1.0 / levels, dtype=F32)  # fl32(1/L)
    scale = h(h(mx - mn) * reciprocal)  # fp16: a range past 65504 is +Inf
    v = h(h(groups - mn[..., None]) / scale[..., None])
    v = torch.round(torch.clamp(v, 0, levels))  # clamp first: +Inf -> L, NaN stays NaN
    v = torch.nan_to_num(v, nan=0.0)            # CUDA's float -> int of NaN: 0
    return v.to(torch.int64), scale.to(dtype), mn.to(dtype)


def _words(codes, bits):
    """codes int64 [..., m] (m a multiple of 32/b) -> int32 words [..., m b / 32], code i of a
    word in bits [b i, b i + b)."""
    per_word = 32 // bits
    fields = codes.reshape(*codes.shape[:-1], -1, per_word)
    word = torch.zeros(fields.shape[:-1], dtype=torch.int64)
    for i in range(per_word):
        word |= fields[..., i] << (bits * i)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # the int32 bit pattern
    return word.to(torch.int32)


def packing_permutation(p):
    """KIVI's word order as a permutation: perm[f] is the element whose code is field f of a
    plane row's little-endian bit stream of b-bit fields (an int32 word is 4 little-endian
    bytes). affine_token: a row's fields are channels 0..d-1 in order (perm = identity);
    affine_tile: a tile's fields are channel-major, tokens in order inside a channel, and the
    element token t, channel j of the tile is t d + j."""
    d = p.head_dim
    if p.format == "affine_token":
        return list(range(d))
    gk = p.group
    return [(f % gk) * d + f // gk for f in range(gk * d)]


class Kivi:
    """KIVI's quantizer after kvq's transforms: affine_token (KIVI's value path) and
    affine_tile (its key path), in model dtype `dtype` (KIVI runs fp16; float32 isolates its
    formula from fp16 rounding, as the note's f32 mode)."""

    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype

    def write(self, p, x, rotation):
        if p.format not in ("affine_token", "affine_tile"):
            raise NotImplementedError("KIVI quantizes per token or per channel over tiles, not "
                                      + p.format)
        if p.norm:
            raise NotImplementedError("KIVI has no norm")
        rows, _ = spec_torch.TARGET.codec_input(p, x, rotation)
        rows = rows.to(self.dtype).to(F32)  # the model's rows
        n, d = rows.shape
        if p.format == "affine_token":
            codes, scale, mn = quantize(rows.reshape(n, d // p.group, p.group), p.bits,
                                        self.dtype)
            return {"codes": _words(codes.reshape(n, d), p.bits), "scale": scale, "min": mn}
        tiles = rows.reshape(n // p.group, p.group, d).transpose(1, 2)  # [tiles, d, G_k]
        codes, scale, mn = quantize(tiles, p.bits, self.dtype)
        return {"codes": _words(codes, p.bits).reshape(n // p.group, -1), "scale": scale,
                "min": mn}


TARGET = Kivi("kivi_torch", F16)
TARGET_F32 = Kivi("kivi_torch_f32", F32)
