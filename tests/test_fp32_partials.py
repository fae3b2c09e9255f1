"""Forward outputs in float32 for 16-bit inputs (``out_dtype``): partial results kept unrounded
for merging through their lse (ring attention's hops)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore.reference import round_to_dtype

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("spelling", ["float32", np.float32, np.dtype("float32")])
def test_float32_output_is_the_unrounded_one(spelling):
    rng = np.random.default_rng(0)
    q, k, v = _bf16(rng, (2, 9, 4, 16)), _bf16(rng, (2, 13, 2, 16)), _bf16(rng, (2, 13, 2, 16))
    o32, lse32 = flashcore.attention_forward(q, k, v, causal=True, out_dtype=spelling)
    o16, lse16 = flashcore.attention_forward(q, k, v, causal=True)
    assert o32.dtype == np.float32 and o16.dtype == q.dtype
    np.testing.assert_array_equal(round_to_dtype(o32, "bfloat16"), o16.astype(np.float32))
    np.testing.assert_array_equal(lse32, lse16)
    assert not np.array_equal(o32, o16.astype(np.float32))    # (really not rounded)


def test_varlen_and_merge():
    rng = np.random.default_rng(1)
    q, k, v = _bf16(rng, (11, 4, 16)), _bf16(rng, (20, 2, 16)), _bf16(rng, (20, 2, 16))
    cu_q, cu_k = np.array([0, 4, 11], np.int32), np.array([0, 9, 20], np.int32)
    o, _ = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, out_dtype="float32")
    assert o.dtype == np.float32
    # two halves of the keys merged in float32 equal the whole call (to float32 rounding)
    qd, kd, vd = q[None, :4], k[None, :9], v[None, :9]
    parts = [flashcore.attention_forward(qd, kd[:, a:b], vd[:, a:b], out_dtype="float32")
             for a, b in ((0, 5), (5, 9))]
    mo, _ = flashcore.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(mo[0], o[:4], atol=1e-6, rtol=0)


def test_refusals():
    rng = np.random.default_rng(2)
    q = _bf16(rng, (1, 3, 2, 8))
    with pytest.raises(TypeError, match="'out_dtype'.*None or float32"):
        flashcore.attention_forward(q, q, q, out_dtype="float16")
    q64 = rng.standard_normal((1, 3, 2, 8))
    with pytest.raises(ValueError, match="'out_dtype'.*float64"):
        flashcore.attention_forward(q64, q64, q64, out_dtype="float32")


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 7, 4, 16, generator=g).to(torch.float16)   # (bf16 CPU tensors: refused)
    k = torch.randn(1, 10, 2, 16, generator=g).to(torch.float16)
    o32, _ = flashcore.attention_forward(q, k, k, causal=True, out_dtype=torch.float32)
    o16, _ = flashcore.attention_forward(q, k, k, causal=True)
    assert o32.dtype == torch.float32 and o16.dtype == torch.float16
    torch.testing.assert_close(o32.to(torch.float16), o16, atol=0, rtol=0)
    assert not torch.equal(o32, o16.float())
