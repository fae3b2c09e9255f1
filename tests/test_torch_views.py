"""The CuPy views the torch backend builds for CUDA tensors (pointer, shape, strides, dtype),
checked here without a GPU: a CuPy array over foreign memory can be described on any machine
(no device call happens until a kernel runs). On the H200, tests/gpu/test_torch_gpu.py checks
that the kernels read and write the tensors' own memory through these views."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
tb = pytest.importorskip("flashcore.backends.torch_backend")


class _OnDevice0:
    """A CPU tensor that reports itself as living on cuda:0 (what _cp reads of a tensor)."""

    class _Dev:
        index = 0

    def __init__(self, t):
        self.t, self.device = t, self._Dev()

    def __getattr__(self, name):
        return getattr(self.t, name)

    @property
    def shape(self):
        return self.t.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "expanded"])
def test_view_matches_the_tensor(dtype, layout):
    base = torch.zeros(3, 10, 4, 16, dtype=dtype)
    t = {"contiguous": base, "transposed": base.transpose(1, 2),
         "sliced": base[:, 2:7, 1:3, :8], "expanded": base[:, :1].expand(3, 5, 4, 16)}[layout]
    a = tb._cp(_OnDevice0(t))
    isz = t.element_size()
    assert a.data.ptr == t.data_ptr()
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(s * isz for s in t.stride())
    assert a.dtype.name == str(t.dtype).split(".")[-1]
    assert a.device.id == 0
    # the memory the view claims ends at the tensor's last element
    last = t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * isz
    assert a.data.mem.size == last - t.data_ptr() + isz


def test_a_view_holds_no_reference_to_its_tensor():
    """The views serve one call's launch (the caller holds the tensors meanwhile)."""
    t = torch.zeros(2, 8, 2, 16, dtype=torch.float16)
    a = tb._cp(_OnDevice0(t))
    b = tb._cp(_OnDevice0(t[:, :4]))          # same pointer, other layout: another view
    assert b.shape == (2, 4, 2, 16) and b.data.ptr == a.data.ptr
    r = weakref.ref(t)
    del t
    gc.collect()
    assert r() is None, "a view kept the tensor alive"


def test_empty_tensor_uses_dlpack_path(monkeypatch):
    calls = []
    monkeypatch.setattr(cupy, "from_dlpack", lambda cap: calls.append(cap) or "dlpack")
    assert tb._cp(_OnDevice0(torch.zeros(0, 3, dtype=torch.float16))) == "dlpack"
    assert len(calls) == 1
    assert np.dtype("float16") == tb._np_dtype(torch, torch.float16)
