"""Targets may return tensors: kvq reads anything with .cpu() / .numpy() or __array__, duck-typed
(torch is not a dependency; FakeTensor stands in for a torch tensor, on 'cuda' until .cpu())."""
import sys
import types

import numpy as np

import kvq
from kvq._arrays import as_numpy


class FakeTensor:
    """A torch-like tensor: no __array__; .numpy() refuses a device tensor, as torch does."""

    def __init__(self, array, device="cuda", dtype=None):
        self.array, self.device = np.asarray(array), device
        self.dtype = dtype or "torch." + str(self.array.dtype)

    def cpu(self):
        return FakeTensor(self.array, "cpu", self.dtype)

    def detach(self):
        return self

    def numpy(self):
        assert self.device == "cpu", "can't convert cuda tensor to numpy; use .cpu() first"
        assert self.dtype != "torch.bfloat16", "Got unsupported ScalarType BFloat16"
        return self.array

    def view(self, dtype):
        return FakeTensor(self.array.view(np.int16), self.device, str(dtype))


def fake_torch(monkeypatch):
    """sys.modules['torch'] as the bf16 reading needs it (torch.int16)."""
    monkeypatch.setitem(sys.modules, "torch",
                        types.SimpleNamespace(int16="torch.int16"))


def test_a_device_tensor_is_moved_to_the_host_and_read():
    got = as_numpy(FakeTensor(np.arange(6, dtype=np.uint8).reshape(2, 3)))
    assert got.dtype == np.uint8 and got.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_bf16_tensor_is_read_as_its_bits(monkeypatch):
    fake_torch(monkeypatch)
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    got = as_numpy(FakeTensor(bits, dtype="torch.bfloat16"))
    assert got.dtype == np.uint16 and got.tolist() == bits.tolist()


def test_numpy_arrays_pass_through_and_array_likes_are_converted():
    a = np.zeros(3, np.float32)
    assert as_numpy(a) is a
    assert as_numpy([1, 2]).tolist() == [1, 2]


def test_a_kernel_returning_tensors_passes_every_pipeline_case(vectors, monkeypatch):
    fake_torch(monkeypatch)

    def tensor_kernel(params, x, rotation, widths=None):
        # Every plane as a device tensor; bf16 planes (uint16 bits in kvq) as torch.bfloat16.
        return {name: FakeTensor(plane, dtype="torch.bfloat16" if plane.dtype == np.uint16
                                 else None)
                for name, plane in kvq.encode(params, x, rotation, widths).items()}

    report = kvq.conformance.check(tensor_kernel, kinds=["pipeline"], vectors=vectors, out=None)
    assert report.results and report.passed == len(report.results), report.failures()[:3]
