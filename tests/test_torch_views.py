"""How the kernels' launchers see a torch tensor: :class:`flashcore.kernels.device.TorchArray`
(pointer, shape, strides in bytes, NumPy dtype) and its namespace ``TORCH`` (the few CuPy
functions the launchers call, made by torch). Checked here on CPU tensors, which answer the
same questions; on the H200, tests/gpu/test_torch_gpu.py checks that the kernels read and write
the tensors' own memory through them, and that a torch process never imports CuPy."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

from flashcore.kernels import device  # noqa: E402
from flashcore.kernels.device import TORCH, TorchArray  # noqa: E402
from flashcore.reference import apply_rotary  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    """TORCH allocates on the CPU (the current CUDA device's stand-in)."""
    monkeypatch.setattr(type(TORCH), "_device", staticmethod(lambda: torch.device("cpu")))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32,
                                   torch.uint8])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "expanded"])
def test_array_matches_the_tensor(dtype, layout):
    base = torch.zeros(3, 10, 4, 16, dtype=dtype)
    t = {"contiguous": base, "transposed": base.transpose(1, 2),
         "sliced": base[:, 2:7, 1:3, :8], "expanded": base[:, :1].expand(3, 5, 4, 16)}[layout]
    a = TorchArray(t)
    isz = t.element_size()
    assert a.data.ptr == t.data_ptr()
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(s * isz for s in t.stride())
    assert a.dtype.name == str(t.dtype).split(".")[-1]
    assert a.dtype.itemsize == isz
    assert a.size == t.numel() and a.nbytes == t.numel() * isz and a.ndim == 4
    assert a.flags.c_contiguous == t.is_contiguous() == (layout == "contiguous")


def test_views_casts_and_namespace(on_cpu):
    t = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    a = TorchArray(t)
    assert a.view(np.uint8).dtype == np.uint8 and a.view(np.uint8).shape == (2, 3, 16)
    b = a.astype(np.int64)
    assert b.dtype == np.int64 and b.t.dtype == torch.int64 and b.t is not t
    # ascontiguousarray: the array itself when nothing changes (the launchers' plans compare
    # identities), else a contiguous copy of the asked dtype
    assert TORCH.ascontiguousarray(a) is a
    assert TORCH.ascontiguousarray(a, dtype=np.int32) is a
    tr = TorchArray(t.transpose(0, 2))
    c = TORCH.ascontiguousarray(tr, dtype=np.float32)
    assert c.flags.c_contiguous and c.dtype == np.float32
    assert torch.equal(c.t, t.transpose(0, 2).float())
    e = TORCH.empty((2, 5), np.float32)
    assert e.shape == (2, 5) and e.dtype == np.float32
    z = TORCH.zeros((7,), np.int32)
    assert int(z.t.abs().sum()) == 0 and z.dtype == np.int32
    f = TORCH.full((3,), 9, dtype=np.int32)
    assert f.t.tolist() == [9, 9, 9]
    g = f + np.int32(2)               # (NumPy scalars as Python numbers: int32 stays int32)
    assert g.t.tolist() == [11, 11, 11] and g.dtype == np.int32
    # assignment and slicing, as the padded head-dim path uses them
    p = TORCH.zeros((2, 3, 8), np.float32)
    p[..., :4] = TorchArray(torch.ones(2, 3, 4))
    p[..., 4:] = 0
    assert float(p.t.sum()) == 24.0
    p[...] = -TORCH.inf
    assert torch.isinf(p.t).all()
    bc = TORCH.broadcast_to(f[:, None].astype(np.int64), (3, 4))
    assert bc.shape == (3, 4) and bc.dtype == np.int64


def test_rotary_reference_on_torch_arrays_matches_numpy(on_cpu):
    """The non-fused rotary of the decode path (all query rows at one position) runs the NumPy
    reference's code on TorchArrays."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    cos = rng.standard_normal((40, 5)).astype(np.float32)
    sin = rng.standard_normal((40, 5)).astype(np.float32)
    pos = rng.integers(0, 40, (2, 3))
    for interleaved in (False, True):
        want = apply_rotary(x, cos, sin, pos, interleaved)
        got = apply_rotary(*(TorchArray(torch.from_numpy(a)) for a in (x, cos, sin, pos)),
                           interleaved, xp=TORCH)
        assert isinstance(got, TorchArray)
        np.testing.assert_allclose(got.t.numpy(), want, rtol=1e-6, atol=1e-6)


def test_lib_of():
    assert device.lib_of(TorchArray(torch.zeros(1))) is TORCH
    cupy = pytest.importorskip("cupy")
    assert device.lib_of(object()) is cupy      # (whatever is not a TorchArray: CuPy's)
