"""What a target returns, as numpy: arrays, or tensors of any library, duck-typed (no torch
import here, so kvq needs no torch)."""
import sys

import numpy as np

__all__ = ["as_numpy"]


def as_numpy(value):
    """`value` as a numpy array: a numpy array as it is; else an object with .cpu() is moved to
    the host first (a CUDA tensor), .detach() drops autograd, .numpy() or __array__ reads it. A
    torch.bfloat16 tensor (numpy has no bf16) is read as its bits: uint16, as kvq's bf16 planes
    are. Anything else goes through np.asarray (lists, scalars)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "cpu"):
        value = value.cpu()
    if hasattr(value, "detach"):
        value = value.detach()
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":
        # torch is imported wherever a torch tensor exists; its int16 view keeps the bits.
        return np.asarray(value.view(sys.modules["torch"].int16).numpy()).view(np.uint16)
    if hasattr(value, "numpy") and not hasattr(value, "__array__"):
        return np.asarray(value.numpy())
    return np.asarray(value)
