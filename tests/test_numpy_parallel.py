"""The NumPy backend's large calls: (sequence, key head) units over a thread pool with BLAS on
one thread. The same bits as the tiles run one after another (BLAS on one thread), through the
public API, for every option that reaches a tile; BLAS's threads restored afterwards, also
when calls overlap; no threadpoolctl: one by one on the calling thread."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import flashcore
from flashcore.backends import numpy_backend as nb

threadpoolctl = pytest.importorskip("threadpoolctl")


def blas_threads():
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


@pytest.fixture
def spread(monkeypatch):
    """Every call takes the pool (two workers, whatever the machine), and the threads that ran
    units and the BLAS thread counts they saw are recorded."""
    seen = {"threads": set(), "blas": set()}
    run = nb._for_each_unit

    def recording(fn, batch, nheads_k, flops):
        def unit(z, heads):
            seen["threads"].add(threading.get_ident())
            seen["blas"].update(blas_threads())
            return fn(z, heads)
        return run(unit, batch, nheads_k, flops)

    monkeypatch.setattr(nb, "PARALLEL_MIN_FLOPS", 0)
    monkeypatch.setattr(nb, "_workers", lambda: 2)
    monkeypatch.setattr(nb, "_for_each_unit", recording)
    return seen


def one_by_one(monkeypatch, fn):
    """fn() with every call on the calling thread, BLAS on one thread: the reference bits."""
    with monkeypatch.context() as m:
        m.setattr(nb, "PARALLEL_MIN_FLOPS", float("inf"))
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            return fn()


OPTIONS = [
    dict(causal=True),
    dict(window_size=(9, 4), softcap=3.0),
    dict(alibi_slopes="per_batch", causal=True),
    dict(dropout_p=0.2),
    dict(),
]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(kw) or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_units_over_a_pool_give_the_bits_of_one_thread(spread, monkeypatch, kw, dtype):
    rng = np.random.default_rng(5)
    b, sq, sk, h, hk, d = 2, 300, 280, 6, 3, 32          # GQA, tiles cut at the edges
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k, v = (rng.standard_normal((b, sk, hk, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "per_batch":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (b, h)).astype(np.float32)
    if kw.get("dropout_p"):
        kw["rng_state"] = np.array([7, 11], np.int64)

    def run():
        out, lse = flashcore.attention_forward(q, k, v, backend="numpy", **kw)
        return (out, lse) + flashcore.attention_backward(dout, q, k, v, out, lse,
                                                         backend="numpy", **kw)

    pooled = run()
    assert len(spread["threads"]) >= 1 and spread["blas"] == {1}
    for name, a, ref in zip(("out", "lse", "dq", "dk", "dv"), pooled, one_by_one(monkeypatch, run)):
        assert a.dtype == ref.dtype
        np.testing.assert_array_equal(a, ref, err_msg=name)


def test_varlen_sequences_each_spread(spread, monkeypatch):
    rng = np.random.default_rng(6)
    cu = np.array([0, 70, 70, 300], np.int32)
    q = rng.standard_normal((300, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((300, 2, 16)).astype(np.float32) for _ in range(2))

    def run():
        return flashcore.varlen_attention_forward(q, k, v, cu, cu, causal=True, backend="numpy")

    for a, ref in zip(run(), one_by_one(monkeypatch, run)):
        np.testing.assert_array_equal(a, ref)


def test_blas_threads_restored_after_overlapping_calls(spread):
    before = blas_threads()
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 200, 4, 16)).astype(np.float32)
    errors = []

    def call():
        try:
            for _ in range(3):
                flashcore.attention_forward(q, q, q, backend="numpy")
        except Exception as e:       # pragma: no cover (reported below)
            errors.append(e)

    for _ in range(20):              # the last one out differs from round to round
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert blas_threads() == before
    assert spread["blas"] == {1}


def test_the_limit_is_restored_by_a_thread_other_than_the_one_that_set_it():
    """One thread sets the limit and is still alive when another leaves last: the other's
    restore must take effect (threadpoolctl 3.8 ignores a pthreads OpenBLAS's changes from any
    thread but the one in control)."""
    limit = nb._OneBlasThread()
    before = blas_threads()
    entered, leave, left, done = (threading.Event() for _ in range(4))

    def first():
        with limit:
            entered.set()
            leave.wait(10)
        left.set()
        done.wait(10)                 # alive while the main thread restores

    t = threading.Thread(target=first)
    t.start()
    try:
        assert entered.wait(10)
        limit.__enter__()
        assert blas_threads() == [1] * len(before)
        leave.set()
        assert left.wait(10)
        limit.__exit__(None, None, None)          # the last one out, not the one that set it
        assert t.is_alive()
        assert blas_threads() == before
    finally:
        leave.set()
        done.set()
        t.join()


def test_an_error_in_a_unit_reaches_the_caller_and_restores_blas(spread, monkeypatch):
    before = blas_threads()

    def broken(*a, **k):
        raise FloatingPointError("unit failed")

    monkeypatch.setattr(nb, "_Scores", broken)
    q = np.zeros((2, 8, 2, 8), np.float32)
    with pytest.raises(FloatingPointError, match="unit failed"):
        flashcore.attention_forward(q, q, q, backend="numpy")
    assert blas_threads() == before


def test_without_threadpoolctl_the_units_run_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(nb, "PARALLEL_MIN_FLOPS", 0)
    monkeypatch.setattr(nb, "_workers", lambda: 2)
    monkeypatch.setattr(nb._OneBlasThread, "available", staticmethod(lambda: False))
    ran = []
    nb._for_each_unit(lambda z, heads: ran.append((threading.get_ident(), z, heads)), 2, 3, 1e12)
    assert ran == [(threading.get_ident(), 0, slice(0, 3)), (threading.get_ident(), 1, slice(0, 3))]


def test_small_calls_and_few_units_stay_on_the_calling_thread(monkeypatch):
    """A small call: all heads at once on the calling thread, BLAS on one thread (its small
    products only lose by BLAS's threads). A large one with fewer units than cores: the
    calling thread too, BLAS's threads as they were (the only parallelism left)."""
    monkeypatch.setattr(nb, "_workers", lambda: 4)
    before = blas_threads()
    ran = []
    record = (lambda z, heads: ran.append((threading.get_ident(), heads, blas_threads())))
    nb._for_each_unit(record, 1, 8, nb.PARALLEL_MIN_FLOPS / 2)      # small
    nb._for_each_unit(record, 1, 2, nb.PARALLEL_MIN_FLOPS * 2)      # 2 units < 4 cores
    me = threading.get_ident()
    assert ran == [(me, slice(0, 8), [1] * len(before)), (me, slice(0, 2), before)]
    assert blas_threads() == before
