"""Decoding with a KV cache (flashcore.attention_with_kvcache) against an independent dense
reference: the test itself writes the new keys into a dense copy of the cache, rotates them by
hand, gathers each sequence's keys and runs flashcore.attention_forward on them.

Covers contiguous and paged caches (pages of 16 and 256), lengths that are not multiples of
the page size, empty sequences, append with and without rotary (interleaved or not, rotary_dim
< headdim), GQA/MQA, causal with 1 and 4 queries, windows, softcap, ALiBi, split-KV, the
in-place update (and that nothing else in the cache moves), every validation rule, the torch
CPU path (zero-copy, in place) and the flash-attn compatible function.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashcore
from flashcore.backends.base import NotSupportedError
from flashcore.flash_attn import flash_attn_with_kvcache

# --------------------------------------------------------------------------------------------
# The problem and the independent reference
# --------------------------------------------------------------------------------------------


def rope_ref(x, cos, sin, pos, interleaved):
    """x (s, h, d) rotated at positions pos (s,), written out pair by pair."""
    r = 2 * cos.shape[1]
    a = np.arange(r // 2) * 2 if interleaved else np.arange(r // 2)
    b = a + 1 if interleaved else a + r // 2
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]      # (s, 1, r/2)
    y = x.copy()
    y[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
    y[:, :, b] = x[:, :, a] * s + x[:, :, b] * c
    return y


class Problem:
    """A random decoding step: logical (dense) cache contents, and the same contents laid out
    contiguously or in shuffled pages."""

    def __init__(self, rng, *, b=3, sq=1, h=4, hk=2, d=32, before=(5, 0, 37), s_new=0,
                 page_size=None, capacity=80, rotary_dim=0, dtype=np.float64, pad_table=False):
        self.b, self.sq, self.h, self.hk, self.d, self.s_new = b, sq, h, hk, d, s_new
        self.before = np.array(before, np.int32)
        self.page_size = page_size
        if page_size:
            self.max_blocks = -(-capacity // page_size)
            capacity = self.max_blocks * page_size
        self.capacity = capacity
        f = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
        self.q = f(b, sq, h, d)
        self.K = f(b, capacity, hk, d)     # logical contents (garbage beyond the lengths)
        self.V = f(b, capacity, hk, d)
        self.k = f(b, s_new, hk, d) if s_new else None
        self.v = f(b, s_new, hk, d) if s_new else None
        self.cos = self.sin = None
        if rotary_dim:
            ang = rng.uniform(0, 2 * np.pi, size=(capacity + 4, rotary_dim // 2))
            self.cos, self.sin = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
        if page_size:
            nblocks = b * self.max_blocks + 5                  # some blocks nobody uses
            perm = rng.permutation(nblocks)
            self.block_table = perm[:b * self.max_blocks].reshape(b, self.max_blocks).astype(np.int32)
            if pad_table:   # entries beyond what a sequence uses: -1 (must be ignored)
                used = -(-(self.before + s_new) // page_size)
                for i in range(b):
                    self.block_table[i, used[i]:] = -1
            self.k_cache = f(nblocks, page_size, hk, d)
            self.v_cache = f(nblocks, page_size, hk, d)
            for i in range(b):
                for t in range(capacity):
                    blk = self.block_table[i, t // page_size]
                    if blk >= 0:
                        self.k_cache[blk, t % page_size] = self.K[i, t]
                        self.v_cache[blk, t % page_size] = self.V[i, t]
        else:
            self.block_table = None
            self.k_cache, self.v_cache = self.K.copy(), self.V.copy()

    def slot(self, i, t):
        """The index of logical row t of sequence i in the cache arrays."""
        if self.page_size:
            return (self.block_table[i, t // self.page_size], t % self.page_size)
        return (i, t)

    def read_logical(self, cache):
        """The dense logical view of a (possibly paged) cache array, rows < capacity."""
        out = np.zeros((self.b, self.capacity, self.hk, self.d), cache.dtype)
        for i in range(self.b):
            for t in range(self.capacity):
                if not self.page_size or self.block_table[i, t // self.page_size] >= 0:
                    out[i, t] = cache[self.slot(i, t)]
        return out

    def reference(self, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, rotary_interleaved=False):
        """(out, lse, K_after, V_after) computed densely, one sequence at a time."""
        K, V, q = self.K.copy(), self.V.copy(), self.q.copy()
        for i in range(self.b):
            n0 = int(self.before[i])
            if self.s_new:
                kn = self.k[i]
                if self.cos is not None:
                    kn = rope_ref(kn, self.cos, self.sin, n0 + np.arange(self.s_new),
                                  rotary_interleaved)
                K[i, n0:n0 + self.s_new] = kn
                V[i, n0:n0 + self.s_new] = self.v[i]
            if self.cos is not None:
                per_row = causal or tuple(window_size) != (-1, -1)
                pos = n0 + np.arange(self.sq) if per_row else np.full(self.sq, n0)
                q[i] = rope_ref(q[i], self.cos, self.sin, pos, rotary_interleaved)
        outs, lses = [], []
        for i in range(self.b):
            n = int(self.before[i]) + self.s_new
            sl = alibi_slopes
            if sl is not None and sl.ndim == 2:
                sl = sl[i:i + 1]
            o, l = flashcore.attention_forward(
                q[i:i + 1], K[i:i + 1, :n], V[i:i + 1, :n], causal=causal,
                window_size=window_size, softcap=softcap, alibi_slopes=sl,
                softmax_scale=softmax_scale)
            outs.append(o[0])
            lses.append(l[0])
        return np.stack(outs), np.stack(lses), K, V

    def run(self, fn=flashcore.attention_with_kvcache, **kw):
        return fn(self.q, self.k_cache, self.v_cache, self.k, self.v,
                  cache_seqlens=kw.pop("cache_seqlens", self.before),
                  block_table=self.block_table, rotary_cos=self.cos, rotary_sin=self.sin,
                  return_lse=True, **kw)


def check_in_place(p, k_before, v_before, K_ref, V_ref, atol=0.0):
    """Valid rows hold the expected (appended, rotated) keys; no other memory changed."""
    written = np.zeros(p.k_cache.shape[:2], bool)
    for i in range(p.b):
        for t in range(int(p.before[i]), int(p.before[i]) + p.s_new):
            written[p.slot(i, t)] = True
    np.testing.assert_array_equal(p.k_cache[~written], k_before[~written])
    np.testing.assert_array_equal(p.v_cache[~written], v_before[~written])
    K_got, V_got = p.read_logical(p.k_cache), p.read_logical(p.v_cache)
    for i in range(p.b):
        n = int(p.before[i]) + p.s_new
        np.testing.assert_allclose(K_got[i, :n], K_ref[i, :n], rtol=0, atol=atol)
        np.testing.assert_allclose(V_got[i, :n], V_ref[i, :n], rtol=0, atol=atol)


def slopes(kind, b, h, rng):
    if kind is None:
        return None
    return rng.uniform(0.05, 0.5, size=(h,) if kind == "per_head" else (b, h)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Against the reference: layouts x features
# --------------------------------------------------------------------------------------------

LAYOUTS = {
    "contiguous": dict(page_size=None, capacity=80, before=(5, 0, 37)),
    "paged16": dict(page_size=16, capacity=80, before=(5, 0, 37)),      # 37 = 2 pages + 5
    "paged256": dict(page_size=256, capacity=600, before=(300, 0, 257)),
}

CASES = {
    "decode_no_append": dict(),
    "append1_causal": dict(s_new=1, kw=dict(causal=True)),
    "append4_causal_sq4_rotary_half": dict(s_new=4, sq=4, rotary_dim=16,
                                           kw=dict(causal=True)),
    "append3_rotary_interleaved_noncausal": dict(s_new=3, sq=3, rotary_dim=32,
                                                 kw=dict(rotary_interleaved=True)),
    "append2_rotary_interleaved_causal_d64": dict(s_new=2, sq=2, rotary_dim=48, d=64,
                                                  kw=dict(rotary_interleaved=True, causal=True)),
    "rotary_window_noncausal": dict(s_new=4, sq=4, rotary_dim=16, kw=dict(window_size=(6, 1))),
    "window_causal_sq4": dict(s_new=4, sq=4, kw=dict(causal=True, window_size=(7, 0))),
    "window_left_only_sq1": dict(kw=dict(window_size=(3, -1))),
    "softcap_alibi_head": dict(s_new=1, alibi="per_head", kw=dict(softcap=2.0)),
    "alibi_batch_head_causal_sq4": dict(s_new=4, sq=4, alibi="per_batch_head",
                                        kw=dict(causal=True)),
    "mqa": dict(h=6, hk=1, s_new=1, kw=dict(causal=True)),
    "mha": dict(h=3, hk=3, s_new=2, sq=2),
    "causal_more_queries_than_keys": dict(s_new=1, sq=4, kw=dict(causal=True)),
    "split_kv_3": dict(s_new=1, kw=dict(num_splits=3, causal=True, softcap=1.5)),
    "split_kv_7_window": dict(s_new=2, sq=2, kw=dict(num_splits=7, window_size=(9, 0))),
    "scale": dict(kw=dict(softmax_scale=0.3)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_against_dense_reference(layout, case):
    c = dict(CASES[case])
    kw = dict(c.pop("kw", {}))
    alibi = c.pop("alibi", None)
    rng = np.random.default_rng(zlib.crc32(f"{layout}/{case}".encode()))
    p = Problem(rng, **LAYOUTS[layout], **c)
    kw["alibi_slopes"] = slopes(alibi, p.b, p.h, rng)
    k_before, v_before = p.k_cache.copy(), p.v_cache.copy()
    ref_kw = {x: kw[x] for x in ("causal", "window_size", "softcap", "alibi_slopes",
                                 "softmax_scale", "rotary_interleaved") if x in kw}
    out_ref, lse_ref, K_ref, V_ref = p.reference(**ref_kw)
    out, lse = p.run(**kw)
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    assert lse.shape == (p.b, p.h, p.sq)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=0, atol=1e-12)
    check_in_place(p, k_before, v_before, K_ref, V_ref, atol=1e-14)


def test_empty_sequence_gives_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    p = Problem(rng, before=(0, 3, 0), page_size=16, capacity=32)
    out, lse = p.run()
    assert (out[0] == 0).all() and (out[2] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    assert np.isfinite(lse[1]).all() and np.abs(out[1]).sum() > 0


def test_causal_rows_without_keys():
    """1 key after the append, 4 queries, causal: the first 3 query rows see nothing."""
    rng = np.random.default_rng(2)
    p = Problem(rng, b=1, before=(0,), s_new=1, sq=4)
    out, lse = p.run(causal=True)
    assert (out[0, :3] == 0).all() and np.isneginf(lse[0, :, :3]).all()
    assert np.isfinite(lse[0, :, 3]).all()


def test_cache_seqlens_as_int_and_padded_block_table():
    rng = np.random.default_rng(3)
    p = Problem(rng, before=(21, 21, 21), s_new=2, page_size=16, capacity=64, pad_table=True,
                rotary_dim=16)
    k_before, v_before = p.k_cache.copy(), p.v_cache.copy()
    out_ref, lse_ref, K_ref, V_ref = p.reference(causal=True)
    out, lse = p.run(cache_seqlens=21, causal=True)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-12)
    check_in_place(p, k_before, v_before, K_ref, V_ref, atol=1e-14)


def test_full_cache_after_append():
    """The append fills the cache exactly to its capacity."""
    for page_size in (None, 16):
        p = Problem(np.random.default_rng(4), b=2, before=(77, 76), s_new=3, capacity=80,
                    page_size=page_size)
        out_ref, lse_ref, *_ = p.reference(causal=True)
        out, lse = p.run(causal=True)
        np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,atol", [(np.float32, 2e-5), (np.float16, 2e-3)])
def test_low_precision(dtype, atol):
    rng = np.random.default_rng(5)
    p = Problem(rng, page_size=16, s_new=2, sq=2, rotary_dim=16, dtype=dtype)
    p64 = Problem(np.random.default_rng(5), page_size=16, s_new=2, sq=2, rotary_dim=16)
    for name in ("q", "K", "V", "k", "v", "cos", "sin", "k_cache", "v_cache"):
        setattr(p64, name, getattr(p, name).astype(np.float64))
    out_ref, lse_ref, *_ = p64.reference(causal=True)
    out, lse = p.run(causal=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), out_ref, rtol=0, atol=atol)
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=atol)


def test_successive_decoding_steps_equal_full_causal_attention():
    """Prefill by appending 5 tokens, then 3 single-token steps: each step's output equals the
    causal attention over the whole sequence so far (the use case)."""
    rng = np.random.default_rng(6)
    b, h, hk, d, n = 2, 4, 2, 16, 8
    q = rng.standard_normal((b, n, h, d))
    k = rng.standard_normal((b, n, hk, d))
    v = rng.standard_normal((b, n, hk, d))
    full, _ = flashcore.attention_forward(q, k, v, causal=True)
    for page_size in (None, 16):
        kc = np.zeros((b, 32, hk, d)) if page_size is None else np.zeros((5, 16, hk, d))
        vc = np.zeros_like(kc)
        bt = None if page_size is None else np.array([[3, 1], [0, 4]], np.int32)
        seqlens = np.zeros(b, np.int32)
        out = flashcore.attention_with_kvcache(q[:, :5], kc, vc, k[:, :5], v[:, :5],
                                               cache_seqlens=seqlens, block_table=bt, causal=True)
        np.testing.assert_allclose(out, full[:, :5], rtol=0, atol=1e-12)
        seqlens += 5
        for t in range(5, n):
            out = flashcore.attention_with_kvcache(q[:, t:t + 1], kc, vc, k[:, t:t + 1],
                                                   v[:, t:t + 1], cache_seqlens=seqlens,
                                                   block_table=bt, causal=True)
            np.testing.assert_allclose(out, full[:, t:t + 1], rtol=0, atol=1e-12)
            seqlens += 1


def test_strided_cache_view_is_updated_in_place():
    """A slice of a larger cache (batch and head strides) is written through the view."""
    rng = np.random.default_rng(7)
    big_k = rng.standard_normal((4, 40, 3, 16))
    big_v = rng.standard_normal((4, 40, 3, 16))
    kc, vc = big_k[1:3, :, :2], big_v[1:3, :, :2]
    assert not kc.flags.c_contiguous
    q = rng.standard_normal((2, 1, 4, 16))
    k = rng.standard_normal((2, 1, 2, 16))
    v = rng.standard_normal((2, 1, 2, 16))
    sl = np.array([3, 10], np.int32)
    out = flashcore.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl)
    assert np.array_equal(big_k[1, 3, :2], k[0, 0]) and np.array_equal(big_k[2, 10, :2], k[1, 0])
    assert np.array_equal(big_v[2, 10, :2], v[1, 0])
    ref, _ = flashcore.attention_forward(q[1:], big_k[2:3, :11, :2], big_v[2:3, :11, :2])
    np.testing.assert_allclose(out[1:], ref, rtol=0, atol=1e-12)


def test_naive_path_agrees():
    from flashcore.backends.numpy_backend import NumpyBackend
    from flashcore.spec import kvcache_spec
    rng = np.random.default_rng(8)
    p = Problem(rng, page_size=16, sq=4, s_new=4, rotary_dim=16)
    arrays = dict(cache_seqlens=p.before, block_table=p.block_table, rotary_cos=p.cos,
                  rotary_sin=p.sin)
    spec = kvcache_spec(p.q, p.k_cache, p.v_cache, p.k, p.v, causal=True, softcap=2.0, **arrays)
    kc, vc = p.k_cache.copy(), p.v_cache.copy()
    o1, l1 = NumpyBackend("naive").forward_kvcache(spec, p.q, p.k_cache, p.v_cache, p.k, p.v,
                                                   **arrays)
    o2, l2 = NumpyBackend("tiled", 16, 16).forward_kvcache(spec, p.q, kc, vc, p.k, p.v, **arrays)
    np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-12)
    np.testing.assert_allclose(l1, l2, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(kc, p.k_cache)


# --------------------------------------------------------------------------------------------
# Validation: every rule, the argument named
# --------------------------------------------------------------------------------------------

_rng = np.random.default_rng(11)


def _a(*s, dtype=np.float32):
    return _rng.standard_normal(s).astype(dtype)


BASE = dict(q=_a(2, 1, 4, 32), k_cache=_a(2, 40, 2, 32), v_cache=_a(2, 40, 2, 32),
            cache_seqlens=np.array([3, 7], np.int32))
PAGED = dict(q=_a(2, 1, 4, 32), k_cache=_a(6, 16, 2, 32), v_cache=_a(6, 16, 2, 32),
             cache_seqlens=np.array([3, 17], np.int32),
             block_table=np.array([[0, 1], [2, 3]], np.int32))
NEW = dict(k=_a(2, 2, 2, 32), v=_a(2, 2, 2, 32))
ROT = dict(rotary_cos=_a(64, 8), rotary_sin=_a(64, 8))


def kvcall(base=BASE, **over):
    a = dict(base)
    a.update(over)
    a = {x: y for x, y in a.items() if not (isinstance(y, str) and y == "DROP")}
    q, kc, vc = a.pop("q"), a.pop("k_cache"), a.pop("v_cache")
    return flashcore.attention_with_kvcache(q, kc.copy(order="K"), vc.copy(order="K"), **a)


@pytest.mark.parametrize("over,exc,words", [
    (dict(q=_a(1, 4, 32)), ValueError, ["'q'", "4-dimensional"]),
    (dict(q=_a(2, 1, 4, 32).astype(np.int64)), TypeError, ["'q'", "floating dtype", "int64"]),
    (dict(q=[[1.0]]), TypeError, ["'q'", "numpy.ndarray"]),
    (dict(k_cache=_a(2, 40, 32)), ValueError, ["'k_cache'", "4-dimensional"]),
    (dict(k_cache=_a(2, 40, 2, 32, dtype=np.float64)), TypeError, ["'k_cache'", "float32", "float64"]),
    (dict(v_cache=_a(2, 40, 2, 32, dtype=np.float16)), TypeError, ["'v_cache'", "float32", "float16"]),
    (dict(v_cache=_a(2, 41, 2, 32)), ValueError, ["'v_cache'", "(2, 40, 2, 32)", "(2, 41, 2, 32)"]),
    (dict(k_cache=_a(2, 40, 2, 16), v_cache=_a(2, 40, 2, 16)), ValueError, ["'k_cache'", "headdim 32"]),
    (dict(k_cache=_a(2, 40, 3, 32), v_cache=_a(2, 40, 3, 32)), ValueError, ["'k_cache'", "divides", "3 heads"]),
    (dict(k_cache=_a(2, 40, 0, 32), v_cache=_a(2, 40, 0, 32)), ValueError, ["'k_cache'", "at least one head"]),
    (dict(k_cache=_a(3, 40, 2, 32), v_cache=_a(3, 40, 2, 32)), ValueError, ["'k_cache'", "batch 2"]),
    (dict(k_cache=np.asfortranarray(_a(2, 40, 2, 32))), ValueError, ["'k_cache'", "contiguous last dimension"]),
    (dict(q=np.asfortranarray(_a(2, 1, 4, 32))), ValueError, ["'q'", "contiguous last dimension"]),
    # new keys and values
    (dict(k=_a(2, 2, 2, 32)), ValueError, ["'v'", "both or neither"]),
    (dict(v=_a(2, 2, 2, 32)), ValueError, ["'k'", "both or neither"]),
    (dict(k=_a(2, 2, 2, 16), v=_a(2, 2, 2, 16)), ValueError, ["'k'", "(2, seqlen_new, 2, 32)"]),
    (dict(k=_a(3, 2, 2, 32), v=_a(3, 2, 2, 32)), ValueError, ["'k'", "(2, seqlen_new, 2, 32)"]),
    (dict(k=_a(2, 2, 4, 32), v=_a(2, 2, 4, 32)), ValueError, ["'k'", "(2, seqlen_new, 2, 32)"]),
    (dict(k=_a(2, 2, 2, 32), v=_a(2, 3, 2, 32)), ValueError, ["'v'", "(2, 2, 2, 32)"]),
    (dict(k=_a(2, 2, 2, 32, dtype=np.float64), v=_a(2, 2, 2, 32)), TypeError, ["'k'", "float32"]),
    (dict(k=_a(2, 2, 2, 32), v=_a(2, 2, 2, 32, dtype=np.float16)), TypeError, ["'v'", "float32"]),
    (dict(k=_a(2, 2, 2, 32), v=_a(2, 2, 2, 32)[..., ::-1]), ValueError, ["'v'", "contiguous last"]),
    (dict(k=_a(2, 2, 2, 32), v=_a(3, 2, 2)), ValueError, ["'v'", "4-dimensional"]),
    # cache_seqlens
    (dict(cache_seqlens=None), ValueError, ["'cache_seqlens'", "int32", "None"]),
    (dict(cache_seqlens=3.0), TypeError, ["'cache_seqlens'", "int", "float"]),
    (dict(cache_seqlens=-1), ValueError, ["'cache_seqlens'", ">= 0", "-1"]),
    (dict(cache_seqlens=np.array([3, 7], np.int64)), TypeError, ["'cache_seqlens'", "int32", "int64"]),
    (dict(cache_seqlens=np.array([3, 7, 1], np.int32)), ValueError, ["'cache_seqlens'", "(2,)", "(3,)"]),
    (dict(cache_seqlens=np.array([[3, 7]], np.int32)), ValueError, ["'cache_seqlens'", "1-dimensional"]),
    (dict(cache_seqlens=np.array([3, -2], np.int32)), ValueError, ["'cache_seqlens'", ">= 0", "cache_seqlens[1] = -2"]),
    (dict(cache_seqlens=np.array([3, 41], np.int32)), ValueError, ["'cache_seqlens'", "capacity 40", "sequence 1", "41"]),
    (dict(cache_seqlens=np.array([39, 7], np.int32), **NEW), ValueError,
     ["'cache_seqlens'", "capacity 40", "sequence 0: 39 cached + 2 new = 41"]),
    (dict(cache_seqlens=39, **NEW), ValueError, ["'cache_seqlens'", "capacity 40"]),
    # rotary
    (dict(**ROT), ValueError, ["'rotary_cos'", "None when no new"]),
    (dict(rotary_cos=ROT["rotary_cos"], **NEW), ValueError, ["'rotary_sin'", "both or neither"]),
    (dict(rotary_sin=ROT["rotary_sin"], **NEW), ValueError, ["'rotary_cos'", "both or neither"]),
    (dict(rotary_cos=_a(64, 8, dtype=np.float64), rotary_sin=_a(64, 8), **NEW), TypeError,
     ["'rotary_cos'", "float32", "float64"]),
    (dict(rotary_cos=_a(64, 8), rotary_sin=_a(64, 8, dtype=np.float16), **NEW), TypeError,
     ["'rotary_sin'", "float32", "float16"]),
    (dict(rotary_cos=_a(64, 8), rotary_sin=_a(64, 4), **NEW), ValueError, ["'rotary_sin'", "(64, 8)"]),
    (dict(rotary_cos=_a(64, 4), rotary_sin=_a(64, 4), **NEW), ValueError,
     ["'rotary_cos'", "multiple of 16", "rotary_dim 8"]),
    (dict(rotary_cos=_a(64, 24), rotary_sin=_a(64, 24), **NEW), ValueError,
     ["'rotary_cos'", "at most headdim 32", "rotary_dim 48"]),
    (dict(rotary_cos=_a(64, 8, 1), rotary_sin=_a(64, 8, 1), **NEW), ValueError, ["'rotary_cos'", "2-dimensional"]),
    (dict(rotary_cos=_a(8, 8), rotary_sin=_a(8, 8), **NEW), ValueError,
     ["'rotary_cos'", "at least 9 rows", "(8, 8)"]),
    (dict(rotary_interleaved=1, **NEW, **ROT), TypeError, ["'rotary_interleaved'", "bool"]),
    # options
    (dict(num_splits=-1), ValueError, ["'num_splits'", ">= 0"]),
    (dict(num_splits=2.0), TypeError, ["'num_splits'", "int"]),
    (dict(window_size=(-2, 0)), ValueError, ["window_size[0]", ">= -1"]),
    (dict(window_size=5), TypeError, ["window_size", "pair"]),
    (dict(softcap=-1.0), ValueError, ["'softcap'", ">= 0"]),
    (dict(softmax_scale=0.0), ValueError, ["'softmax_scale'", "> 0"]),
    (dict(softmax_scale="x"), TypeError, ["'softmax_scale'", "real number"]),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, ["'alibi_slopes'", "(4,)", "(2, 4)"]),
    (dict(alibi_slopes=np.ones(4, np.int32)), TypeError, ["'alibi_slopes'", "float32", "int32"]),
    (dict(backend="nope"), ValueError, ["'backend'", "'nope'"]),
    (dict(backend=1), TypeError, ["'backend'", "int"]),
    (dict(cache_leftpad=np.zeros(2, np.int64)), TypeError, ["'cache_leftpad'", "int32"]),
    (dict(cache_leftpad=np.zeros(3, np.int32)), ValueError, ["'cache_leftpad'", "shape (2,)"]),
    (dict(cache_leftpad=np.array([0, 8], np.int32)), ValueError,
     ["'cache_leftpad'", "cache_leftpad[1] = 8", "cache_seqlens[1] = 7"]),
    (dict(cache_leftpad=np.array([-1, 0], np.int32)), ValueError, ["'cache_leftpad'", "[0] = -1"]),
])
def test_rejects(over, exc, words):
    with pytest.raises(exc) as e:
        kvcall(**over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("over,exc,words", [
    (dict(block_table=np.array([[0, 1], [2, 3]], np.int64)), TypeError, ["'block_table'", "int32", "int64"]),
    (dict(block_table=np.array([0, 1, 2, 3], np.int32)), ValueError, ["'block_table'", "2-dimensional"]),
    (dict(block_table=np.array([[0, 1]], np.int32)), ValueError, ["'block_table'", "(2, max_blocks_per_seq"]),
    (dict(block_table=np.zeros((2, 0), np.int32)), ValueError, ["'block_table'", "max_blocks_per_seq >= 1"]),
    (dict(k_cache=_a(6, 8, 2, 32), v_cache=_a(6, 8, 2, 32)), ValueError,
     ["'k_cache'", "page_size a multiple of 16", "page_size 8"]),
    (dict(k_cache=_a(6, 24, 2, 32), v_cache=_a(6, 24, 2, 32)), ValueError,
     ["'k_cache'", "multiple of 16", "page_size 24"]),
    (dict(k_cache=_a(0, 16, 2, 32), v_cache=_a(0, 16, 2, 32)), ValueError, ["'k_cache'", "at least one block"]),
    (dict(block_table=np.array([[0, 1], [2, 6]], np.int32)), ValueError,
     ["'block_table'", "[0, 6)", "block_table[1, 1] = 6"]),
    (dict(block_table=np.array([[-1, 1], [2, 3]], np.int32)), ValueError,
     ["'block_table'", "block_table[0, 0] = -1"]),
    (dict(cache_seqlens=np.array([3, 31], np.int32), **NEW), ValueError,
     ["'cache_seqlens'", "capacity 32", "2 blocks of 16", "sequence 1: 31 cached + 2 new = 33"]),
    (dict(block_table=np.array([[0, 1], [2, 3]], np.int32)[:, ::-1]), None, []),   # strided: fine
])
def test_rejects_paged(over, exc, words):
    if exc is None:
        kvcall(PAGED, **over)
        return
    with pytest.raises(exc) as e:
        kvcall(PAGED, **over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unused_block_table_entries_are_not_checked():
    kvcall(PAGED, block_table=np.array([[0, -1], [2, 3]], np.int32))   # seq 0 uses 1 block
    kvcall(PAGED, block_table=np.array([[0, 99], [2, 3]], np.int32))


def test_no_cache_mutation_when_refused():
    kc, vc = BASE["k_cache"].copy(), BASE["v_cache"].copy()
    with pytest.raises(ValueError):
        flashcore.attention_with_kvcache(BASE["q"], kc, vc, **NEW,
                                         cache_seqlens=np.array([3, 39], np.int32))
    assert np.array_equal(kc, BASE["k_cache"]) and np.array_equal(vc, BASE["v_cache"])


def test_cupy_backend_on_numpy_arrays_is_refused_with_reasons():
    with pytest.raises(NotSupportedError, match="cupy"):
        kvcall(backend="cupy")


# --------------------------------------------------------------------------------------------
# flash-attn compatible function
# --------------------------------------------------------------------------------------------

def test_flash_attn_with_kvcache_signature_and_defaults():
    import inspect
    sig = inspect.signature(flash_attn_with_kvcache)
    assert list(sig.parameters) == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
        "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
        "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
        "return_softmax_lse", "k_descale", "v_descale"]
    # (FlashAttention-3's FP8 cache descales: keyword only, after flash-attn 2's arguments)
    assert [n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY] == [
        "k_descale", "v_descale"]
    d = {n: p.default for n, p in sig.parameters.items()}
    assert d["k_descale"] is None and d["v_descale"] is None
    assert d["rotary_interleaved"] is True and d["causal"] is False
    assert d["window_size"] == (-1, -1) and d["softcap"] == 0.0 and d["num_splits"] == 0
    assert d["return_softmax_lse"] is False and d["cache_seqlens"] is None


def test_flash_attn_with_kvcache_matches_and_defaults_to_interleaved():
    rng = np.random.default_rng(12)
    p = Problem(rng, page_size=16, s_new=2, sq=2, rotary_dim=16)
    out_ref, lse_ref, *_ = p.reference(causal=True, rotary_interleaved=True)
    out, lse = flash_attn_with_kvcache(p.q, p.k_cache, p.v_cache, p.k, p.v, p.cos, p.sin,
                                       p.before, block_table=p.block_table, causal=True,
                                       return_softmax_lse=True)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-12)
    only_out = flash_attn_with_kvcache(p.q, p.k_cache, p.v_cache, cache_seqlens=p.before + 2,
                                       block_table=p.block_table, causal=False)
    assert only_out.shape == p.q.shape


def test_flash_attn_with_kvcache_no_seqlens_means_whole_cache():
    rng = np.random.default_rng(13)
    q, kc, vc = rng.standard_normal((2, 1, 2, 16)), rng.standard_normal((2, 9, 1, 16)), \
        rng.standard_normal((2, 9, 1, 16))
    out = flash_attn_with_kvcache(q, kc, vc)
    ref, _ = flashcore.attention_forward(q, kc, vc)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)


def test_flash_attn_with_kvcache_unsupported_arguments():
    with pytest.raises(NotImplementedError, match="'cache_batch_idx'"):
        flash_attn_with_kvcache(BASE["q"], BASE["k_cache"], BASE["v_cache"],
                                cache_seqlens=BASE["cache_seqlens"],
                                cache_batch_idx=np.zeros(2, np.int32))


# ---------------- cache_leftpad (flash-attn's left padding of the cache) ----------------

@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0))])
@pytest.mark.parametrize("append", [False, True])
def test_cache_leftpad_equals_the_cache_without_its_padding(causal, window, append):
    """Sequence b's keys start at row cache_leftpad[b]: the same as a call on the cache from
    that row on, with cache_seqlens - cache_leftpad; appended keys still land at row
    cache_seqlens[b] of the full cache."""
    rng = np.random.default_rng(7)
    b, sq, h, hk, d, cap, s_new = 3, 2, 4, 2, 32, 40, 2 if append else 0
    q = rng.standard_normal((b, sq, h, d))
    kc, vc = rng.standard_normal((b, cap, hk, d)), rng.standard_normal((b, cap, hk, d))
    before = np.array([9, 4, 20], np.int32)
    leftpad = np.array([3, 4, 0], np.int32)          # sequence 1 has no cached key left
    kw = dict(causal=causal, window_size=window)
    new = {}
    if append:
        new = dict(k=rng.standard_normal((b, s_new, hk, d)), v=rng.standard_normal((b, s_new, hk, d)))
    k1, v1 = kc.copy(), vc.copy()
    out, lse = flashcore.attention_with_kvcache(q, k1, v1, cache_seqlens=before,
                                                cache_leftpad=leftpad, return_lse=True,
                                                **new, **kw)
    for i in range(b):
        lp = int(leftpad[i])
        k2, v2 = kc[i:i + 1, lp:].copy(), vc[i:i + 1, lp:].copy()
        sub = {n: (x[i:i + 1] if n in ("k", "v") else x) for n, x in new.items()}
        o2, l2 = flashcore.attention_with_kvcache(
            q[i:i + 1], k2, v2, cache_seqlens=np.array([before[i] - lp], np.int32),
            return_lse=True, **sub, **kw)
        np.testing.assert_allclose(out[i:i + 1], o2, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[i:i + 1], l2, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(k1[i, lp:], k2[0])   # written at the same rows
        np.testing.assert_array_equal(k1[i, :lp], kc[i, :lp])   # the padding untouched


def test_cache_leftpad_keeps_rotary_at_the_cache_rows():
    """flash-attn's rule: with cache_leftpad the new keys and q are still rotated at positions
    cache_seqlens[b] + t (the rows they occupy); only the keys attended move."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 4, 32), (2, 2, 2, 32), (2, 2, 2, 32)))
    kc, vc = rng.standard_normal((2, 40, 2, 32)), rng.standard_normal((2, 40, 2, 32))
    rot = dict(rotary_cos=rng.standard_normal((64, 8)), rotary_sin=rng.standard_normal((64, 8)))
    before, lp = np.array([9, 20], np.int32), np.array([3, 0], np.int32)
    k1, v1, k2, v2 = kc.copy(), vc.copy(), kc.copy(), vc.copy()
    flashcore.attention_with_kvcache(q, k1, v1, k, v, cache_seqlens=before, cache_leftpad=lp,
                                     causal=True, **rot)
    flashcore.attention_with_kvcache(q, k2, v2, k, v, cache_seqlens=before, causal=True, **rot)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)


def test_cache_leftpad_not_with_a_paged_cache():
    with pytest.raises(ValueError, match="'cache_leftpad'.*paged"):
        kvcall(PAGED, cache_leftpad=np.zeros(2, np.int32))


def test_flash_attn_with_kvcache_takes_cache_leftpad():
    lp = np.array([1, 2], np.int32)
    out = flash_attn_with_kvcache(BASE["q"], BASE["k_cache"].copy(), BASE["v_cache"].copy(),
                                  cache_seqlens=BASE["cache_seqlens"], cache_leftpad=lp)
    ref = flashcore.attention_with_kvcache(BASE["q"], BASE["k_cache"].copy(),
                                           BASE["v_cache"].copy(),
                                           cache_seqlens=BASE["cache_seqlens"], cache_leftpad=lp)
    np.testing.assert_array_equal(out, ref)


# --------------------------------------------------------------------------------------------
# torch (CPU): same results, zero-copy in-place append, no autograd
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_torch_cpu_same_results_and_in_place(layout):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(14)
    p = Problem(rng, **LAYOUTS[layout], s_new=3, sq=3, rotary_dim=16)
    slopes_ = slopes("per_batch_head", p.b, p.h, rng)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes_)
    out_ref, lse_ref, K_ref, V_ref = p.reference(**kw)
    T = lambda x: None if x is None else torch.from_numpy(x.copy())  # noqa: E731
    q, kc, vc, k, v = (T(x) for x in (p.q, p.k_cache, p.v_cache, p.k, p.v))
    q.requires_grad_(True)
    ptr_k, ptr_v = kc.data_ptr(), vc.data_ptr()
    ver = kc._version
    out, lse = flashcore.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=T(p.before), block_table=T(p.block_table),
        rotary_cos=T(p.cos), rotary_sin=T(p.sin), causal=True, softcap=3.0,
        alibi_slopes=T(slopes_), return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert not out.requires_grad and not lse.requires_grad
    np.testing.assert_allclose(out.numpy(), out_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=0, atol=1e-12)
    assert kc.data_ptr() == ptr_k and vc.data_ptr() == ptr_v      # same memory, written in place
    assert kc._version > ver                                       # autograd was told
    p.k_cache, p.v_cache = kc.numpy(), vc.numpy()
    K_got, V_got = p.read_logical(p.k_cache), p.read_logical(p.v_cache)
    for i in range(p.b):
        n = int(p.before[i]) + p.s_new
        np.testing.assert_allclose(K_got[i, :n], K_ref[i, :n], rtol=0, atol=1e-14)
        np.testing.assert_allclose(V_got[i, :n], V_ref[i, :n], rtol=0, atol=1e-14)


def test_torch_cpu_float16_int_seqlens_and_flash_attn_compat():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(15)
    p = Problem(rng, page_size=16, s_new=1, rotary_dim=16, dtype=np.float16)
    T = lambda x: torch.from_numpy(x.copy())  # noqa: E731
    kc, vc = T(p.k_cache), T(p.v_cache)
    out = flash_attn_with_kvcache(T(p.q), kc, vc, T(p.k), T(p.v), T(p.cos), T(p.sin),
                                  cache_seqlens=5, block_table=T(p.block_table), causal=True)
    out_np = flash_attn_with_kvcache(p.q, p.k_cache, p.v_cache, p.k, p.v, p.cos, p.sin,
                                     cache_seqlens=5, block_table=p.block_table, causal=True)
    assert out.dtype == torch.float16
    np.testing.assert_array_equal(out.numpy(), out_np)
    np.testing.assert_array_equal(kc.numpy(), p.k_cache)


def test_torch_cpu_bfloat16_refused_with_reason():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    kc = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(NotSupportedError, match="bfloat16 CPU tensors"):
        flashcore.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=3)


def test_torch_mixed_with_numpy_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="'k_cache'.*torch array like 'q'|'k_cache'.*torch"):
        flashcore.attention_with_kvcache(torch.from_numpy(BASE["q"]), BASE["k_cache"],
                                         BASE["v_cache"], cache_seqlens=3)


def test_torch_inference_mode():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    p = Problem(rng, s_new=1)
    with torch.inference_mode():
        kc, vc = torch.from_numpy(p.k_cache.copy()), torch.from_numpy(p.v_cache.copy())
        q, k, v = (torch.from_numpy(x) for x in (p.q, p.k, p.v))
        out = flashcore.attention_with_kvcache(q, kc, vc, k, v,
                                               cache_seqlens=torch.from_numpy(p.before))
    out_ref, *_ = p.reference()
    np.testing.assert_allclose(out.numpy(), out_ref, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# GPU (skipped without one): the CuPy decode kernels against the float64 reference
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("case", ["decode_no_append", "append4_causal_sq4_rotary_half",
                                  "append3_rotary_interleaved_noncausal", "mqa",
                                  "softcap_alibi_head", "window_causal_sq4", "split_kv_3",
                                  "causal_more_queries_than_keys"])
def test_cupy_against_reference(dtype, layout, case):
    import cupy
    from flashcore.reference import round_to_dtype
    c = dict(CASES[case])
    kw = dict(c.pop("kw", {}))
    alibi = c.pop("alibi", None)
    c.setdefault("d", 64)
    if c.get("rotary_dim", 0) > c["d"]:
        c["rotary_dim"] = c["d"]
    rng = np.random.default_rng(zlib.crc32(f"{layout}/{case}/{dtype}".encode()))
    p = Problem(rng, **LAYOUTS[layout], **c)
    for name in ("q", "K", "V", "k", "v", "cos", "sin", "k_cache", "v_cache"):
        x = getattr(p, name)
        if x is not None:     # the values the GPU sees
            setattr(p, name, round_to_dtype(x.astype(np.float32), dtype).astype(np.float64))
    kw["alibi_slopes"] = slopes(alibi, p.b, p.h, rng)
    ref_kw = {x: kw[x] for x in ("causal", "window_size", "softcap", "alibi_slopes",
                                 "rotary_interleaved") if x in kw}
    out_ref, lse_ref, K_ref, _ = p.reference(**ref_kw)

    def dev(x):
        if x is None or x.dtype.kind != "f":
            return None if x is None else cupy.asarray(x)
        if dtype == "bfloat16":
            import ml_dtypes
            return cupy.asarray(x.astype(np.float32).astype(ml_dtypes.bfloat16))
        return cupy.asarray(x.astype(dtype))
    kc, vc = dev(p.k_cache), dev(p.v_cache)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = cupy.asarray(kw["alibi_slopes"])
    out, lse = flashcore.attention_with_kvcache(
        dev(p.q), kc, vc, dev(p.k), dev(p.v), cache_seqlens=cupy.asarray(p.before),
        block_table=None if p.block_table is None else cupy.asarray(p.block_table),
        rotary_cos=dev(p.cos), rotary_sin=dev(p.sin), return_lse=True, **kw)
    got = out.astype(cupy.float32).get().astype(np.float64)
    assert np.isfinite(got).all()
    tol = 2e-2 if dtype == "bfloat16" else 3e-3
    np.testing.assert_allclose(got, out_ref, rtol=0, atol=tol)
    lse_h = lse.get().astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(lse_h), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse_h[fin], lse_ref[fin], rtol=0, atol=tol)
    p.k_cache = kc.astype(cupy.float32).get().astype(np.float64)
    K_got = p.read_logical(p.k_cache)
    for i in range(p.b):
        n = int(p.before[i]) + p.s_new
        np.testing.assert_allclose(K_got[i, :n], K_ref[i, :n], rtol=0, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("case", ["split_kv_3", "split_kv_7_window"])
def test_cupy_split_kv_with_the_combine_kernel(layout, case, monkeypatch):
    """The split cases again on the two-kernel path (FLASHCORE_DECODE_FUSED_COMBINE=0); the
    test above runs them with the default fused combine."""
    from flashcore import config
    with config.override(decode_fused_combine=False):
        test_cupy_against_reference("bfloat16", layout, case)


def _flash_attn_leftpad_reference(q, kc, vc, after, lp, causal, window, slopes, scale, h, hk,
                                  key_mask=None):
    """flash-attn's own test reference for cache_leftpad (tests/test_flash_attn.py): the whole
    cache under a key padding mask (lp <= j < after), the key columns shifted by lp for the
    causal/local mask and ALiBi (construct_local_mask, attn_bias_from_alibi_slopes). With
    ``key_mask`` (bool (b, cap)), keys where it is False are masked out too (positions, and so
    the causal/local masks, unchanged)."""
    b_, sq = q.shape[0], q.shape[1]
    cap = kc.shape[1]
    outs = []
    for b in range(b_):
        keep = (np.arange(cap) < after[b]) & (np.arange(cap) >= lp[b])
        sk = keep.sum()
        col = np.where(np.arange(cap) >= lp[b], np.arange(cap) - lp[b], 2**32)
        row = np.arange(sq)[:, None]
        left, right = window
        if causal:
            right = 0
        if left < 0 and right < 0:
            masked = np.zeros((sq, cap), bool)
        elif left < 0:
            masked = col[None] > row + sk - sq + right
        else:
            r = right if right >= 0 else 10**9
            masked = (col[None] > np.minimum(row + sk - sq + r, sk)) | \
                (col[None] < row + sk - sq - left)
        masked |= ~keep[None]
        if key_mask is not None:
            masked |= ~key_mask[b][None]
        kk, vv = np.repeat(kc[b], h // hk, axis=1), np.repeat(vc[b], h // hk, axis=1)
        s = np.einsum("qhd,khd->hqk", q[b], kk) * scale
        if slopes is not None:
            s = s - slopes[b][:, None, None] * np.abs(row + sk - sq - col[None])[None]
        s = np.where(masked[None], -np.inf, s)
        mx = s.max(-1, keepdims=True)
        p = np.exp(s - np.where(np.isinf(mx), 0, mx))
        outs.append(np.einsum("hqk,khd->qhd", p / np.maximum(p.sum(-1, keepdims=True), 1e-300),
                              vv))
    return np.stack(outs)


def _decode_inputs(rng, b, sq, cap, h, hk, d, append, rotary):
    """q, the caches and the new keys/values (with rotary tables) of a random decoding step."""
    q = rng.standard_normal((b, sq, h, d))
    kc, vc = rng.standard_normal((b, cap, hk, d)), rng.standard_normal((b, cap, hk, d))
    new = {}
    if append:
        new = dict(k=rng.standard_normal((b, append, hk, d)), v=rng.standard_normal((b, append, hk, d)))
    if rotary:
        ang = rng.random((cap, 8)) * 6.28
        new.update(rotary_cos=np.cos(ang), rotary_sin=np.sin(ang))
    return q, kc, vc, new


def _appended_by_hand(q, kc, vc, before, new, causal, window):
    """(q rotated, caches with the new keys written): what the call does, done independently.
    flash-attn's test rule: new keys rotated at cache_seqlens + t (the cache rows); q at
    cache_seqlens + i when causal or windowed, else every row at cache_seqlens."""
    from flashcore.reference import apply_rotary
    kc, vc, qr = kc.copy(), vc.copy(), q
    if "k" not in new:
        return qr, kc, vc
    sq, append = q.shape[1], new["k"].shape[1]
    kn = new["k"]
    if "rotary_cos" in new:
        kn = apply_rotary(kn, new["rotary_cos"], new["rotary_sin"],
                          before[:, None] + np.arange(append)[None], False)
        per_row = causal or window != (-1, -1)
        pos = before[:, None] + (np.arange(sq)[None] if per_row else np.zeros((1, sq), int))
        qr = apply_rotary(q, new["rotary_cos"], new["rotary_sin"], pos, False)
    for i in range(q.shape[0]):
        rows = slice(before[i], before[i] + append)
        kc[i, rows], vc[i, rows] = kn[i], new["v"][i]
    return qr, kc, vc


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)),
                                           (True, (5, -1)), (False, (-1, 2))])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("sq,append,rotary", [(1, 0, False), (3, 2, False), (3, 2, True)])
def test_cache_leftpad_matches_flash_attn_test_reference(causal, window, alibi, sq, append, rotary):
    rng = np.random.default_rng(17)
    b, cap, h, hk, d = 3, 24, 4, 2, 16
    q, kc, vc, new = _decode_inputs(rng, b, sq, cap, h, hk, d, append, rotary)
    before, lp = np.array([10, 5, 12], np.int32), np.array([3, 5, 0], np.int32)
    slopes = rng.random((b, h)) * 0.3 if alibi else None
    qr, kc0, vc0 = _appended_by_hand(q, kc, vc, before, new, causal, window)
    out = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=before, cache_leftpad=lp,
                                           causal=causal, window_size=window, alibi_slopes=slopes,
                                           rotary_interleaved=False, **new)
    want = _flash_attn_leftpad_reference(qr, kc0, vc0, before + append, lp, causal, window,
                                         slopes, d ** -0.5, h, hk)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-9)


# ---------------- key_mask (a per-key mask: padding with holes) ----------------

@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)),
                                           (False, (2, 1))])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("sq,append,rotary", [(1, 0, False), (3, 2, True)])
@pytest.mark.parametrize("leftpad", [False, True])
@pytest.mark.parametrize("splits", [0, 3])
def test_key_mask_against_the_masked_dense_reference(causal, window, alibi, sq, append, rotary,
                                                     leftpad, splits):
    """Keys where key_mask is False are left out, the causal/local masks and ALiBi still
    counting positions (cache rows, from cache_leftpad); whole rows masked give 0 and -inf."""
    rng = np.random.default_rng(23)
    b, cap, h, hk, d = 4, 24, 4, 2, 16
    q, kc, vc, new = _decode_inputs(rng, b, sq, cap, h, hk, d, append, rotary)
    before = np.array([10, 5, 12, 7], np.int32)
    lp = np.array([3, 5, 0, 2], np.int32) if leftpad else np.zeros(b, np.int32)
    keep = rng.random((b, cap)) < 0.6
    keep[3] = False                         # a sequence with every key masked
    slopes = rng.random((b, h)) * 0.3 if alibi else None
    qr, kc0, vc0 = _appended_by_hand(q, kc, vc, before, new, causal, window)
    out, lse = flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=before, cache_leftpad=lp if leftpad else None, causal=causal,
        window_size=window, alibi_slopes=slopes, rotary_interleaved=False, num_splits=splits,
        key_mask=keep, return_lse=True, **new)
    after = before + append
    want = _flash_attn_leftpad_reference(qr, kc0, vc0, after, lp, causal, window, slopes,
                                         d ** -0.5, h, hk, key_mask=keep)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-9)
    assert (out[3] == 0).all() and np.isneginf(lse[3]).all()
    # the mask matters: without it the result differs
    kc2, vc2 = kc0.copy(), vc0.copy()
    plain = flashcore.attention_with_kvcache(q if not append else qr, kc2, vc2,
                                             cache_seqlens=after,
                                             cache_leftpad=lp if leftpad else None,
                                             causal=causal, window_size=window,
                                             alibi_slopes=slopes)
    assert not np.allclose(plain[:3], out[:3])


def test_key_mask_on_a_paged_cache():
    """Paged: the mask indexes positions of the sequence (its pages' rows in order)."""
    rng = np.random.default_rng(5)
    p = Problem(rng, page_size=16, capacity=80, before=(5, 0, 37), s_new=1)
    keep = rng.random((p.b, p.capacity)) < 0.5
    out = p.run(causal=True, key_mask=keep, num_splits=2)[0]
    _, _, K, V = p.reference(causal=True)
    want = _flash_attn_leftpad_reference(p.q, K, V, p.before + 1, np.zeros(p.b, np.int32), True,
                                         (-1, -1), None, p.d ** -0.5, p.h, p.hk, key_mask=keep)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("over,exc,words", [
    (dict(key_mask=np.ones((2, 40), np.uint8)), TypeError, ["'key_mask'", "bool", "uint8"]),
    (dict(key_mask=np.ones((2, 39), bool)), ValueError, ["'key_mask'", "(2, 40)", "(2, 39)"]),
    (dict(key_mask=np.ones((3, 40), bool)), ValueError, ["'key_mask'", "(2, 40)"]),
    (dict(key_mask=np.ones(40, bool)), ValueError, ["'key_mask'", "2-dimensional"]),
    (dict(key_mask=np.ones((40, 2), bool).T), ValueError, ["'key_mask'", "contiguous last"]),
    (dict(key_mask=[[True] * 40] * 2), TypeError, ["'key_mask'", "numpy.ndarray"]),
])
def test_key_mask_rejects(over, exc, words):
    with pytest.raises(exc) as e:
        kvcall(**over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_key_mask_paged_shape_is_the_table_capacity():
    with pytest.raises(ValueError, match=r"\(2, 32\)"):
        kvcall(PAGED, key_mask=np.ones((2, 96), bool))
    kvcall(PAGED, key_mask=np.ones((2, 32), bool))


def test_key_mask_torch_cpu_matches_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, 40, 2, 32)).astype(np.float32) for _ in range(2))
    keep = rng.random((2, 40)) < 0.5
    lens = np.array([30, 17], np.int32)
    want = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, key_mask=keep)
    got = flashcore.attention_with_kvcache(*(torch.from_numpy(x) for x in (q, kc, vc)),
                                           cache_seqlens=torch.from_numpy(lens),
                                           key_mask=torch.from_numpy(keep))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)
