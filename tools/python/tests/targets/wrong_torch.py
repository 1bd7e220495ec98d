"""spec_torch with deliberate defects, for the tests of the failure report.

    PACKING_OFF_BY_ONE.write: spec_torch's planes with each row of the codes plane rotated by
        one byte (byte i holds what belongs in byte i + 1)
    WRONG_WIDTH.write: spec_torch's planes at the other width (4 bits for 2, 2 for 4)
"""
import torch

from . import spec_torch

__all__ = ["PACKING_OFF_BY_ONE", "WRONG_WIDTH"]


class _Params:
    """params with some fields replaced."""

    def __init__(self, params, **changes):
        self._params, self._changes = params, changes

    def __getattr__(self, name):
        return self._changes[name] if name in self._changes else getattr(self._params, name)


class PackingOffByOne:
    name = "wrong_torch_packing"

    def write(self, p, x, rotation):
        planes = spec_torch.TARGET.write(p, x, rotation)
        planes["codes"] = torch.roll(planes["codes"], 1, dims=-1)
        return planes


class WrongWidth:
    name = "wrong_torch_width"

    def write(self, p, x, rotation):
        return spec_torch.TARGET.write(_Params(p, bits=6 - p.bits), x, rotation)


PACKING_OFF_BY_ONE = PackingOffByOne()
WRONG_WIDTH = WrongWidth()
