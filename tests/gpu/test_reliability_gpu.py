"""Scale and failure behaviour of the CuPy kernels: 64-bit offsets, a million tokens, memory
that grows linearly, out-of-memory errors that leave the process working."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _bf16(cp, x32):
    import ml_dtypes
    return cp.asarray(x32.astype(ml_dtypes.bfloat16))


def _rows_reference(q_rows, k, v, rows, sq, sk, causal, scale):
    """Exact attention of a few query rows (float64 on the host)."""
    out = []
    for qi, i in zip(q_rows, rows):
        s = (k @ qi) * scale
        if causal:
            s[np.arange(sk) > i + sk - sq] = -np.inf
        p = np.exp(s - s.max())
        out.append((p / p.sum()) @ v)
    return np.array(out)


def test_more_than_2_pow_31_elements_in_q():
    """Offsets past 2^31 elements: the last batch entries must be right, not wrapped."""
    import cupy as cp
    import flashcore
    b, s, h, d = 16400, 1024, 1, 128            # 2.15e9 elements in q
    assert b * s * h * d > 2**31
    rs = cp.random.RandomState(1)
    q = rs.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16)
    v = rs.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16)
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    dq, dk, dv = flashcore.attention_backward(out, q, k, v, out, lse, causal=True)
    for bi in (0, b // 2, b - 1):
        rows = np.array([0, 511, s - 1])
        qh = q[bi, rows, 0].get().astype(np.float64)
        kh, vh = k[bi, :, 0].get().astype(np.float64), v[bi, :, 0].get().astype(np.float64)
        ref = _rows_reference(qh, kh, vh, rows, s, s, True, 1 / math.sqrt(d))
        got = out[bi, rows, 0].get().astype(np.float64)
        assert np.abs(got - ref).max() < 2e-2, bi
        for g in (dq, dk, dv):
            assert bool(cp.isfinite(g[bi]).all())
    del q, k, v, out, dq, dk, dv


def test_one_million_tokens_forward_backward_memory_linear():
    """1M tokens, one head group, causal: right rows and a peak within inputs+outputs+scratch."""
    import cupy as cp
    import flashcore
    s, h, hk, d = 1 << 20, 2, 1, 128
    # A pool of this test's own: the process's default pool may hold blocks that a small
    # long-lived allocation (a stream's split counter, say) keeps from being released after
    # an earlier test freed gigabytes around it, and total_bytes would count them.
    pool, prev = _own_pool(cp)
    try:
        _one_million_tokens(cp, flashcore, pool, s, h, hk, d)
    finally:
        cp.cuda.set_allocator(prev)


def _own_pool(cp):
    """A fresh CuPy memory pool as the allocator, and the allocator it replaces."""
    pool, prev = cp.cuda.MemoryPool(), cp.cuda.get_allocator()
    cp.cuda.set_allocator(pool.malloc)
    return pool, prev


def _one_million_tokens(cp, flashcore, pool, s, h, hk, d):
    q = _bf16(cp, np.random.default_rng(2).standard_normal((1, s, h, d), dtype=np.float32))
    k = _bf16(cp, np.random.default_rng(3).standard_normal((1, s, hk, d), dtype=np.float32))
    v = _bf16(cp, np.random.default_rng(4).standard_normal((1, s, hk, d), dtype=np.float32))
    do = _bf16(cp, np.random.default_rng(5).standard_normal((1, s, h, d), dtype=np.float32))
    base = pool.used_bytes()
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    cp.cuda.Device().synchronize()
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
    cp.cuda.Device().synchronize()
    peak = pool.total_bytes()
    elem = 2
    inputs = (q.size + k.size + v.size + do.size) * elem
    outputs = (out.size + dq.size + dk.size + dv.size) * elem + lse.size * 4
    scratch = q.size * 4 + lse.size * 4 * 2           # fp32 dQ accumulator, D, slack for lse
    bound = inputs + outputs + scratch
    assert peak <= 1.10 * bound + (64 << 20), f"peak {peak / 2**30:.2f} GiB > bound {bound / 2**30:.2f} GiB"
    rows = np.array([0, 1000, s // 2, s - 1])
    qh = q[0, rows, 1].get().astype(np.float64)
    ref = _rows_reference(qh, k[0, :, 0].get().astype(np.float64), v[0, :, 0].get().astype(np.float64),
                          rows, s, s, True, 1 / math.sqrt(d))
    assert np.abs(out[0, rows, 1].get().astype(np.float64) - ref).max() < 2e-2
    for g in (dq, dk, dv):
        assert bool(cp.isfinite(g).all())
    print(f"1M tokens: peak {peak / 2**30:.2f} GiB, bound {bound / 2**30:.2f} GiB (used before {base / 2**30:.2f})")


def test_out_of_memory_raises_library_error_and_recovers():
    import cupy as cp
    import flashcore
    rs = cp.random.RandomState(3)
    q = rs.standard_normal((2, 4096, 8, 64), dtype=cp.float32).astype(cp.float16)   # 8 MiB
    # (a pool of the test's own, with no room for the 8 MiB output: the default pool may hold
    # free blocks it cannot release, see above, from which the output would be carved)
    from flashcore.kernels import plans
    flashcore.attention_forward(q, q, q)      # (the stream's split counter exists now)
    pool, prev = _own_pool(cp)
    pool.set_limit(size=4096)
    try:
        for replayed in (True, False):        # the layout's launch plan, then the full call
            if not replayed:
                plans.clear()
            with pytest.raises(flashcore.DeviceMemoryError) as e:
                flashcore.attention_forward(q, q, q)
            assert e.value.nbytes and e.value.nbytes >= q.nbytes
            assert "bytes" in str(e.value)
    finally:
        cp.cuda.set_allocator(prev)
    out, lse = flashcore.attention_forward(q, q, q)   # the process keeps working
    assert bool(cp.isfinite(out).all())
