"""The validation fuzzer of tests/test_fuzz_validation.py against the CuPy backend: a broken
argument is named before any kernel runs; a valid call runs, is finite and matches the NumPy
reference (head dims that are no multiple of 8 included: they are padded); a valid call the
kernels could not take would be refused with the reason. Never a crash, an illegal access or a
silent wrong answer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import flashcore
from flashcore.backends.base import NotSupportedError
from test_fuzz_validation import BREAKS, attention_args

pytestmark = pytest.mark.gpu

# NumPy dtype drawn by the generator -> the dtype the GPU array gets (mismatches stay mismatches)
_GPU_DTYPE = {np.dtype(np.float64): "float16", np.dtype(np.float32): "bfloat16",
              np.dtype(np.float16): "float32"}


def _to_gpu(x, mapped=True):
    """``x`` on the device with the same shape *and strides* (in elements), so a broken layout
    stays broken. q, k, v (mapped) change dtype by _GPU_DTYPE; other arrays keep theirs."""
    import cupy
    if not isinstance(x, np.ndarray):
        return x
    name = _GPU_DTYPE.get(x.dtype) if mapped else None
    if name == "bfloat16":
        import ml_dtypes
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(name) if name else x.dtype
    el = [st // x.itemsize for st in x.strides]
    assert all(e >= 0 for e in el) and all(st % x.itemsize == 0 for st in x.strides)
    span = 1 + sum((n - 1) * e for n, e in zip(x.shape, el)) if x.size else 1
    flat = np.zeros(span, dt)
    np.lib.stride_tricks.as_strided(flat, x.shape, [e * dt.itemsize for e in el])[...] = x
    dev = cupy.asarray(flat)
    out = cupy.lib.stride_tricks.as_strided(dev, x.shape, tuple(e * dt.itemsize for e in el))
    assert out.strides == tuple(e * dt.itemsize for e in el)
    return out


@settings(max_examples=300, deadline=None)
@given(attention_args())
def test_broken_argument_is_named_valid_call_runs_on_gpu(case):
    import cupy
    brk, a, kw = case
    q, k, v = (_to_gpu(a[n]) for n in "qkv")
    kw = {n: _to_gpu(x, mapped=False) for n, x in kw.items()}   # alibi keeps its dtype
    try:
        out, lse = flashcore.attention_forward(q, k, v, **kw)
    except NotSupportedError as e:
        d = a["q"].shape[-1] if hasattr(a["q"], "shape") else None
        raise AssertionError(f"{brk} (head dim {d}): refused unexpectedly: {e}")
    except (TypeError, ValueError) as e:
        assert brk != "none", f"a valid call was refused: {e}"
        assert f"argument '{BREAKS[brk]}'" in str(e), f"{brk}: {e}"
        return
    assert brk == "none", f"{brk}: a broken call was accepted"
    ref, ref_lse = flashcore.attention_forward(
        *(x.get().astype(np.float64) for x in (q, k, v)),
        **{n: (x.get() if isinstance(x, cupy.ndarray) else x) for n, x in kw.items()})
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all() and not np.isnan(lse.get()).any()
    assert np.abs(got - ref).max() < 2e-2 * max(1.0, np.abs(ref).max())
    assert np.array_equal(np.isneginf(lse.get()), np.isneginf(ref_lse))
