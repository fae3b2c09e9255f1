"""Decoding over an FP8 (float8_e4m3fn) KV cache: FlashAttention-3's semantics, the cache's
values being ``k_cache[b, t, hk, :] * k_descale[b, hk]`` (v likewise), with a float16 /
bfloat16 q, out in q's dtype and lse float32.

On the NumPy backend (ml_dtypes caches) and torch CPU tensors (torch.float8_e4m3fn): against a
float64 reference over the dequantised caches (contiguous and paged, GQA/MQA, causal, windows,
softcap, ALiBi, varying cache_seqlens, cache_leftpad, split-KV), bit for bit against the same
call over the float32 dequantised cache, descale broadcasting, every refusal with its message,
the flash-attn compatible function, the torch op (opcheck) and torch.compile.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashcore
from flashcore.backends.base import NotSupportedError
from flashcore.flash_attn import flash_attn_with_kvcache
from flashcore.reference import round_to_dtype

from refutils import reference

ml_dtypes = pytest.importorskip("ml_dtypes", reason="float8_e4m3fn arrays need ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
Q_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class FP8Problem:
    """A random decoding step over an FP8 cache: per-(sequence, key head) scales, the FP8
    cache laid out contiguously or in shuffled pages, and the float64 values it stands for."""

    def __init__(self, rng, *, b=3, sq=1, h=4, hk=2, d=64, before=(5, 0, 37), page_size=None,
                 capacity=80, q_dtype="float16"):
        self.b, self.sq, self.h, self.hk, self.d = b, sq, h, hk, d
        self.before = np.array(before, np.int32)
        self.page_size = page_size
        if page_size:
            self.max_blocks = -(-capacity // page_size)
            capacity = self.max_blocks * page_size
        self.capacity = capacity
        self.q = (rng.standard_normal((b, sq, h, d)) * 2.0).astype(Q_DTYPES[q_dtype])
        logical, self.descales = [], []
        for _ in range(2):                                     # K, then V
            x = rng.standard_normal((b, capacity, hk, d)) * rng.uniform(0.5, 4.0, (b, 1, hk, 1))
            scale = (np.abs(x).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)    # (b, hk)
            logical.append((x / scale[:, None, :, None]).astype(E4M3))
            self.descales.append(scale)
        self.K8, self.V8 = logical                # logical FP8 contents (b, capacity, hk, d)
        self.k_descale, self.v_descale = self.descales
        if page_size:
            nblocks = b * self.max_blocks + 3                  # some blocks nobody uses
            perm = rng.permutation(nblocks)
            self.block_table = perm[:b * self.max_blocks].reshape(b, self.max_blocks) \
                .astype(np.int32)
            noise = lambda: (rng.standard_normal((nblocks, page_size, hk, d)) * 100)  # noqa: E731
            self.k_cache, self.v_cache = noise().astype(E4M3), noise().astype(E4M3)
            for i in range(b):
                for t in range(capacity):
                    blk = self.block_table[i, t // page_size]
                    self.k_cache[blk, t % page_size] = self.K8[i, t]
                    self.v_cache[blk, t % page_size] = self.V8[i, t]
        else:
            self.block_table = None
            self.k_cache, self.v_cache = self.K8.copy(), self.V8.copy()

    def values(self, x8, descale):
        """The float64 values an FP8 logical cache stands for."""
        return x8.astype(np.float64) * descale.astype(np.float64)[:, None, :, None]

    def reference(self, *, cache_leftpad=None, alibi_slopes=None, **kw):
        """(out, lse) in float64: the naive attention of each sequence over its keys."""
        K, V = self.values(self.K8, self.k_descale), self.values(self.V8, self.v_descale)
        lp = np.zeros(self.b, np.int64) if cache_leftpad is None else cache_leftpad
        outs, lses = [], []
        for i in range(self.b):
            n0, n = int(lp[i]), int(self.before[i])
            sl = alibi_slopes
            if sl is not None and sl.ndim == 2:
                sl = sl[i:i + 1]
            o, l_ = reference(self.q[i:i + 1].astype(np.float64), K[i:i + 1, n0:n],
                              V[i:i + 1, n0:n], alibi_slopes=sl, **kw)
            outs.append(o[0])
            lses.append(l_[0])
        return np.stack(outs), np.stack(lses)

    def run(self, fn=flashcore.attention_with_kvcache, descales=None, **kw):
        kd, vd = (self.k_descale, self.v_descale) if descales is None else descales
        return fn(self.q, self.k_cache, self.v_cache, cache_seqlens=kw.pop("cache_seqlens",
                                                                           self.before),
                  block_table=self.block_table, k_descale=kd, v_descale=vd, return_lse=True,
                  **kw)


def check_against_reference(out, lse, ref_out, ref_lse, q_dtype):
    """The flash-attn rule: the error against float64 at most twice that of float64 rounded to
    q's dtype (plus what the float32 computation adds); lse within float32's reach."""
    assert out.dtype == Q_DTYPES[q_dtype] and lse.dtype == np.float32
    rounded = round_to_dtype(ref_out.astype(np.float32), q_dtype).astype(np.float64)
    err = np.abs(out.astype(np.float64) - ref_out).max()
    assert err <= 2 * np.abs(rounded - ref_out).max() + 1e-5, err
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=0, atol=2e-5)


LAYOUTS = {
    "contiguous": dict(page_size=None, capacity=80, before=(5, 0, 37)),
    "paged16": dict(page_size=16, capacity=80, before=(5, 0, 37)),      # 37 = 2 pages + 5
    "paged64": dict(page_size=64, capacity=200, before=(130, 1, 64)),
    "paged48": dict(page_size=48, capacity=200, before=(100, 1, 47)),   # neither divides a key
}                                                                       # block nor a multiple

CASES = {
    "plain": dict(),
    "gqa4_causal_sq4": dict(h=8, hk=2, sq=4, kw=dict(causal=True)),
    "mqa": dict(h=6, hk=1, kw=dict(causal=True)),
    "mha_d128": dict(h=3, hk=3, d=128),
    "window_causal_sq3": dict(sq=3, kw=dict(causal=True, window_size=(7, 0))),
    "softcap": dict(kw=dict(softcap=2.5)),
    "softcap_causal_sq2_bf16": dict(sq=2, q_dtype="bfloat16", kw=dict(softcap=4.0, causal=True)),
    "alibi_batch_head_causal": dict(sq=2, alibi=True, kw=dict(causal=True)),
    "split_kv_3": dict(kw=dict(num_splits=3, causal=True)),
    "scale_d256": dict(d=256, kw=dict(softmax_scale=0.05)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_numpy_against_float64_reference(layout, case):
    c = dict(CASES[case])
    kw = dict(c.pop("kw", {}))
    alibi = c.pop("alibi", False)
    rng = np.random.default_rng(zlib.crc32(f"fp8/{layout}/{case}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], **c)
    if alibi:
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (p.b, p.h)).astype(np.float32)
    k_before, v_before = p.k_cache.copy(), p.v_cache.copy()
    ref_kw = {x: kw[x] for x in ("causal", "window_size", "softcap", "alibi_slopes",
                                 "softmax_scale") if x in kw}
    out, lse = p.run(**kw)
    ref_out, ref_lse = p.reference(**ref_kw)
    check_against_reference(out, lse, ref_out, ref_lse, c.get("q_dtype", "float16"))
    # read only: the cache is untouched
    np.testing.assert_array_equal(p.k_cache.view(np.uint8), k_before.view(np.uint8))
    np.testing.assert_array_equal(p.v_cache.view(np.uint8), v_before.view(np.uint8))


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_the_same_bits_as_the_float32_dequantised_cache(q_dtype, layout):
    """An FP8 cache is its float32 values x * descale: the call gives bit for bit what the
    same call over those values (float32 q and cache) gives, rounded to q's dtype."""
    rng = np.random.default_rng(zlib.crc32(f"bits/{q_dtype}/{layout}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], q_dtype=q_dtype, sq=2, h=4, hk=2)
    kw = dict(causal=True, softcap=3.0)
    out, lse = p.run(**kw)
    # (e4m3 times a float32 is exact in float64: rounded to float32 it is float32's product)
    dense = [p.values(x, d).astype(np.float32)
             for x, d in ((p.K8, p.k_descale), (p.V8, p.v_descale))]
    o32, l32 = flashcore.attention_with_kvcache(p.q.astype(np.float32), *dense,
                                                cache_seqlens=p.before, return_lse=True, **kw)
    np.testing.assert_array_equal(out, o32.astype(out.dtype))
    np.testing.assert_array_equal(lse, l32)


def test_paged_equals_contiguous():
    rng = np.random.default_rng(21)
    p = FP8Problem(rng, **LAYOUTS["paged16"], sq=3, h=6, hk=3)
    c = FP8Problem(np.random.default_rng(21), **LAYOUTS["contiguous"], sq=3, h=6, hk=3)
    c.q, c.k_cache, c.v_cache, c.descales = p.q, p.K8, p.V8, p.descales
    c.k_descale, c.v_descale = p.k_descale, p.v_descale
    for kw in (dict(), dict(causal=True, window_size=(9, 0)), dict(num_splits=4)):
        o1, l1 = p.run(**kw)
        o2, l2 = c.run(**kw)
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(l1, l2)


@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad_and_varying_lengths(causal):
    """Left padding: sequence b's keys are rows cache_leftpad[b] to cache_seqlens[b]; an empty
    sequence (leftpad == length) gets out 0 and lse -inf."""
    rng = np.random.default_rng(22 + causal)
    p = FP8Problem(rng, b=4, sq=2, h=4, hk=2, before=(30, 17, 3, 80), capacity=80)
    lp = np.array([4, 0, 3, 61], np.int32)
    out, lse = p.run(cache_leftpad=lp, causal=causal, softcap=5.0)
    ref_out, ref_lse = p.reference(cache_leftpad=lp, causal=causal, softcap=5.0)
    check_against_reference(out, lse, ref_out, ref_lse, "float16")
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))


def test_cache_seqlens_as_an_int_and_whole_cache_through_flash_attn():
    rng = np.random.default_rng(23)
    p = FP8Problem(rng, b=2, before=(40, 40), capacity=40)
    out_arr, lse_arr = p.run()
    out_int, lse_int = p.run(cache_seqlens=40)
    np.testing.assert_array_equal(out_arr, out_int)
    np.testing.assert_array_equal(lse_arr, lse_int)
    # flash_attn_with_kvcache: no cache_seqlens means the whole cache; the FA3 keywords
    out_fa, lse_fa = flash_attn_with_kvcache(p.q, p.k_cache, p.v_cache, k_descale=p.k_descale,
                                             v_descale=p.v_descale, return_softmax_lse=True)
    np.testing.assert_array_equal(out_fa, out_arr)
    np.testing.assert_array_equal(lse_fa, lse_arr)


def test_flash_attn_with_kvcache_paged_and_causal():
    rng = np.random.default_rng(24)
    p = FP8Problem(rng, **LAYOUTS["paged16"], sq=2)
    out = flash_attn_with_kvcache(p.q, p.k_cache, p.v_cache, cache_seqlens=p.before,
                                  block_table=p.block_table, causal=True,
                                  k_descale=p.k_descale, v_descale=p.v_descale)
    ref, _ = p.run(causal=True)
    np.testing.assert_array_equal(out, ref)


# --------------------------------------------------------------------------------------------
# Descales: None is 1; anything broadcastable to (batch, nheads_k)
# --------------------------------------------------------------------------------------------

def test_descale_broadcasting():
    rng = np.random.default_rng(25)
    p = FP8Problem(rng, b=3, h=4, hk=2)
    full = lambda d: np.ascontiguousarray(np.broadcast_to(d, (3, 2)), np.float32)  # noqa: E731
    forms = [
        np.full((), 0.03, np.float32),                             # scalar (0-d)
        np.array([0.02], np.float32),                              # per tensor, (1,)
        np.array([[0.05]], np.float32),                            # per tensor, (1, 1)
        rng.uniform(0.01, 0.1, (3, 1)).astype(np.float32),         # per sequence
        rng.uniform(0.01, 0.1, (1, 2)).astype(np.float32),         # per key head
        rng.uniform(0.01, 0.1, (2,)).astype(np.float32),           # per key head, (nheads_k,)
        rng.uniform(0.01, 0.1, (3, 2)).astype(np.float32),         # per (sequence, key head)
        np.asfortranarray(rng.uniform(0.01, 0.1, (3, 2)).astype(np.float32)),   # strided
    ]
    for i, kd in enumerate(forms):
        vd = forms[-1 - i]
        got = p.run(descales=(kd, vd), causal=True)
        want = p.run(descales=(full(kd), full(vd)), causal=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    ones = np.ones((3, 2), np.float32)
    for a, b in (((None, None), (ones, ones)), ((None, p.v_descale), (ones, p.v_descale))):
        np.testing.assert_array_equal(p.run(descales=a)[0], p.run(descales=b)[0])


def test_a_query_head_takes_its_key_heads_descale():
    """Scaling v_descale[b, j] scales exactly the outputs of sequence b's query heads of key
    head j (GQA groups of 2); k_descale scales those heads' scores."""
    rng = np.random.default_rng(26)
    p = FP8Problem(rng, b=2, h=4, hk=2, before=(30, 20), capacity=40)
    base, base_lse = p.run()
    vd = p.v_descale.copy()
    vd[1, 0] *= 2
    scaled, scaled_lse = p.run(descales=(p.k_descale, vd))
    np.testing.assert_allclose(scaled[1, :, :2].astype(np.float64),
                               2 * base[1, :, :2].astype(np.float64), rtol=1e-3)
    np.testing.assert_array_equal(scaled[1, :, 2:], base[1, :, 2:])
    np.testing.assert_array_equal(scaled[0], base[0])
    np.testing.assert_array_equal(scaled_lse, base_lse)
    kd = p.k_descale.copy()
    kd[0, 1] *= 1.5
    _, lse2 = p.run(descales=(kd, p.v_descale))
    assert not np.allclose(lse2[0, 2:], base_lse[0, 2:])
    np.testing.assert_array_equal(lse2[0, :2], base_lse[0, :2])
    np.testing.assert_array_equal(lse2[1], base_lse[1])


# --------------------------------------------------------------------------------------------
# Refusals, each before anything runs, naming the argument
# --------------------------------------------------------------------------------------------

def _fp8(*shape, rng=np.random.default_rng(27)):
    return (rng.standard_normal(shape) * 50).astype(E4M3)


def _f16(*shape, rng=np.random.default_rng(28)):
    return rng.standard_normal(shape).astype(np.float16)


BASE = dict(q=_f16(2, 1, 4, 64), k_cache=_fp8(2, 40, 2, 64), v_cache=_fp8(2, 40, 2, 64),
            cache_seqlens=np.array([3, 7], np.int32))
ONE = np.ones((2, 2), np.float32)


def fp8call(**over):
    a = dict(BASE)
    a.update(over)
    return flashcore.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)


@pytest.mark.parametrize("over,exc,words", [
    # appending to an FP8 cache: quantising the new tokens is the caller's job
    (dict(k=_f16(2, 1, 2, 64), v=_f16(2, 1, 2, 64)), ValueError,
     ["'k'", "None with float8_e4m3fn caches", "quantise"]),
    (dict(k=_fp8(2, 1, 2, 64), v=_fp8(2, 1, 2, 64), k_descale=ONE), ValueError,
     ["'k'", "None with float8_e4m3fn caches"]),
    # rotary goes with appending (flash-attn's rule), so with no FP8 cache
    (dict(rotary_cos=_f16(64, 8), rotary_sin=_f16(64, 8)), ValueError,
     ["'rotary_cos'", "None when no new"]),
    # q: 16-bit only
    (dict(q=_fp8(2, 1, 4, 64)), TypeError, ["'q'", "never an FP8 q", "float8_e4m3fn"]),
    (dict(q=_f16(2, 1, 4, 64).astype(np.float32)), TypeError,
     ["'q'", "float16 or bfloat16 with float8_e4m3fn caches", "float32"]),
    (dict(q=_f16(2, 1, 4, 64).astype(np.float64)), TypeError, ["'q'", "float16 or bfloat16"]),
    # both caches FP8, or neither
    (dict(v_cache=_f16(2, 40, 2, 64)), TypeError,
     ["'v_cache'", "float8_e4m3fn like 'k_cache'", "float16"]),
    (dict(k_cache=_f16(2, 40, 2, 64)), TypeError,
     ["'v_cache'", "float16 like 'k_cache'", "float8_e4m3fn"]),
    # NumPy uint8 caches are no FP8 caches (only CuPy's, which has no float8 dtype)
    (dict(k_cache=_fp8(2, 40, 2, 64).view(np.uint8), v_cache=_fp8(2, 40, 2, 64).view(np.uint8)),
     TypeError, ["'k_cache'", "dtype float16 like 'q'", "uint8"]),
    # descales
    (dict(k_descale=ONE.astype(np.float64)), TypeError, ["'k_descale'", "float32", "float64"]),
    (dict(v_descale=ONE.astype(np.float16)), TypeError, ["'v_descale'", "float32", "float16"]),
    (dict(v_descale=np.ones((3, 2), np.float32)), ValueError,
     ["'v_descale'", "broadcastable to (batch, nheads_k) = (2, 2)", "(3, 2)"]),
    (dict(k_descale=np.ones((2, 4), np.float32)), ValueError, ["'k_descale'", "(2, 4)"]),
    (dict(k_descale=np.ones((1, 1, 1), np.float32)), ValueError, ["'k_descale'", "(1, 1, 1)"]),
    (dict(k_descale=0.5), TypeError, ["'k_descale'", "numpy.ndarray"]),
    (dict(k_descale=np.float32(0.5)), TypeError, ["'k_descale'", "numpy.ndarray"]),
    (dict(k_descale=[[1.0, 1.0], [1.0, 1.0]]), TypeError, ["'k_descale'", "numpy.ndarray"]),
])
def test_refusals(over, exc, words):
    kc, vc = (over.get(n, BASE[n]) for n in ("k_cache", "v_cache"))
    before = kc.copy(), vc.copy()
    with pytest.raises(exc) as e:
        fp8call(**over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    np.testing.assert_array_equal(kc.view(np.uint8), before[0].view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), before[1].view(np.uint8))


@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
def test_descales_with_16bit_caches_are_refused(name):
    q, kc = _f16(2, 1, 4, 64), _f16(2, 40, 2, 64)
    with pytest.raises(ValueError) as e:
        flashcore.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=3, **{name: ONE})
    assert f"argument '{name}'" in str(e.value)
    assert "None unless k_cache and v_cache are float8_e4m3fn" in str(e.value)
    with pytest.raises(ValueError, match=f"'{name}'"):     # (and with appending too)
        flashcore.attention_with_kvcache(q, kc, kc.copy(), _f16(2, 1, 2, 64), _f16(2, 1, 2, 64),
                                         cache_seqlens=3, **{name: ONE})
    with pytest.raises(ValueError, match=f"'{name}'"):
        flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=3, **{name: ONE})


def test_the_cuda_kernels_take_fp8_caches_of_head_dims_128_256(monkeypatch):
    """The CuPy backend's reasons (asked here without a GPU, the probes answered): an FP8 cache
    of another head dim is refused by name, 16-bit ones of any head dim are not."""
    from flashcore.backends import cupy_backend
    from flashcore.spec import kvcache_spec
    monkeypatch.setattr(cupy_backend, "_probe", lambda: None)
    monkeypatch.setattr(cupy_backend, "_decode_kernels_reason", lambda: None)
    monkeypatch.setattr(cupy_backend, "_decode_fp8_reason", lambda: None)
    cb = cupy_backend.CupyBackend()
    for d, refused in ((64, True), (128, False), (256, False), (96, True), (32, True),
                       (80, True)):
        spec = kvcache_spec(_f16(2, 1, 4, d), _fp8(2, 40, 2, d), _fp8(2, 40, 2, d),
                            cache_seqlens=3)
        reasons = cb.kvcache_not_supported_reasons(spec)
        named = [r for r in reasons if "float8_e4m3fn caches take headdim 128 or 256" in r]
        assert bool(named) == refused, (d, reasons)
        if refused:
            assert "argument 'k_cache'" in named[0] and f"headdim {d}" in named[0]
        spec16 = kvcache_spec(_f16(2, 1, 4, d), _f16(2, 40, 2, d), _f16(2, 40, 2, d),
                              cache_seqlens=3)
        assert not any("headdim" in r for r in cb.kvcache_not_supported_reasons(spec16))


def test_backends_without_fp8_caches_say_so():
    from flashcore.backends.base import Backend
    from flashcore.spec import kvcache_spec

    class NoFP8(Backend):
        name, libraries, dtypes, supports_kvcache = "nofp8", ("numpy",), ("float16",), True

    spec = kvcache_spec(BASE["q"], BASE["k_cache"], BASE["v_cache"], cache_seqlens=3)
    assert spec.fp8 and spec.cache_dtype == "float8_e4m3fn"
    assert NoFP8().kvcache_not_supported_reasons(spec) == [
        "float8_e4m3fn (FP8) caches are not supported"]
    spec16 = kvcache_spec(BASE["q"], _f16(2, 40, 2, 64), _f16(2, 40, 2, 64), cache_seqlens=3)
    assert not spec16.fp8 and NoFP8().kvcache_not_supported_reasons(spec16) == []


def test_cupy_backend_on_numpy_fp8_arrays_is_refused_with_reasons():
    with pytest.raises(NotSupportedError, match="cupy"):
        fp8call(backend="cupy")


# --------------------------------------------------------------------------------------------
# torch CPU tensors: torch.float8_e4m3fn caches, through the kvcache_read op
# --------------------------------------------------------------------------------------------

def _t8(torch, x8):
    """A torch.float8_e4m3fn tensor with the bits of an ml_dtypes float8_e4m3fn array."""
    return torch.from_numpy(x8.view(np.uint8).copy()).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_torch_cpu_the_same_bits_as_numpy(layout):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(zlib.crc32(f"torch/{layout}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], sq=2, h=4, hk=2)
    slopes = rng.uniform(0.05, 0.5, (p.h,)).astype(np.float32)
    kw = dict(causal=True, softcap=3.0, num_splits=2)
    want, want_lse = p.run(alibi_slopes=slopes, **kw)
    T = lambda x: None if x is None else torch.from_numpy(x.copy())  # noqa: E731
    kc, vc = _t8(torch, p.k_cache), _t8(torch, p.v_cache)
    kc0, vc0 = kc.clone(), vc.clone()
    q = T(p.q)
    q.requires_grad_(True)
    out, lse = flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=T(p.before), block_table=T(p.block_table),
        alibi_slopes=T(slopes), k_descale=T(p.k_descale), v_descale=T(p.v_descale),
        return_lse=True, **kw)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert not out.requires_grad
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    assert torch.equal(kc.view(torch.uint8), kc0.view(torch.uint8))     # read only
    assert torch.equal(vc.view(torch.uint8), vc0.view(torch.uint8))
    # an int cache_seqlens and plain options validated first: the same call
    out2 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=T(p.before),
                                   block_table=T(p.block_table), alibi_slopes=T(slopes),
                                   k_descale=T(p.k_descale), v_descale=T(p.v_descale), **kw)
    np.testing.assert_array_equal(out2.numpy(), want)


def test_torch_cpu_descale_broadcasting_and_none():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    p = FP8Problem(rng, b=3, h=4, hk=2)
    q, kc, vc, lens = (torch.from_numpy(p.q), _t8(torch, p.k_cache), _t8(torch, p.v_cache),
                       torch.from_numpy(p.before))
    per_seq = rng.uniform(0.01, 0.1, (3, 1)).astype(np.float32)
    for kd, vd in ((np.full((), 0.04, np.float32), per_seq),
                   (per_seq, np.array([[0.02, 0.07]], np.float32)),
                   (None, np.full((1,), 0.5, np.float32)), (None, None)):
        got = flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=lens, causal=True,
            k_descale=None if kd is None else torch.from_numpy(kd),
            v_descale=None if vd is None else torch.from_numpy(vd))
        want, _ = p.run(descales=(kd, vd), causal=True)
        np.testing.assert_array_equal(got.numpy(), want)
    # a non-contiguous (expanded) descale tensor
    kd = torch.tensor([0.03, 0.06]).expand(3, 2)
    got = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd)
    want, _ = p.run(descales=(kd.contiguous().numpy(), None))
    np.testing.assert_array_equal(got.numpy(), want)


def test_torch_cpu_refusals():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    kc = (torch.randn(2, 40, 2, 64) * 20).to(torch.float8_e4m3fn)
    vc = (torch.randn(2, 40, 2, 64) * 20).to(torch.float8_e4m3fn)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    one = torch.ones(2, 2)
    new = torch.randn(2, 1, 2, 64, dtype=torch.float16)
    kc0 = kc.clone()
    with pytest.raises(ValueError, match="'k'.*None with float8_e4m3fn caches"):
        flashcore.attention_with_kvcache(q, kc, vc, new, new.clone(), cache_seqlens=lens)
    with pytest.raises(ValueError, match="'k'.*None with float8_e4m3fn caches"):
        flashcore.attention_with_kvcache(q, kc, vc, new.to(torch.float8_e4m3fn),
                                         new.to(torch.float8_e4m3fn), cache_seqlens=lens,
                                         k_descale=one)
    assert torch.equal(kc.view(torch.uint8), kc0.view(torch.uint8))
    with pytest.raises(TypeError, match="'q'.*never an FP8 q"):
        flashcore.attention_with_kvcache(q.to(torch.float8_e4m3fn), kc, vc, cache_seqlens=lens)
    with pytest.raises(TypeError, match="'q'.*float16 or bfloat16"):
        flashcore.attention_with_kvcache(q.float(), kc, vc, cache_seqlens=lens)
    with pytest.raises(TypeError, match="'v_cache'.*like 'k_cache'"):
        flashcore.attention_with_kvcache(q, kc, torch.randn(2, 40, 2, 64, dtype=torch.float16),
                                         cache_seqlens=lens)
    with pytest.raises(TypeError, match="'k_descale'.*torch array like 'q'"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                         k_descale=np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match="'v_descale'.*float32"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                         v_descale=one.to(torch.float64))
    with pytest.raises(ValueError, match="'v_descale'.*\\(2, 2\\)"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                         v_descale=torch.ones(2, 3))
    q16, c16 = q, torch.randn(2, 40, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="'k_descale'.*None unless"):
        flashcore.attention_with_kvcache(q16, c16, c16.clone(), cache_seqlens=lens, k_descale=one)
    with pytest.raises(ValueError, match="'v_descale'.*None unless"):
        flashcore.attention_with_kvcache(q16, c16, c16.clone(), new, new.clone(),
                                         cache_seqlens=lens, v_descale=one)
    # (bfloat16 CPU tensors have no NumPy view: refused as for 16-bit caches)
    with pytest.raises(NotSupportedError, match="bfloat16 CPU tensors"):
        flashcore.attention_with_kvcache(q.to(torch.bfloat16), kc, vc, cache_seqlens=lens)


def test_opcheck_kvcache_read_with_descales():
    """The read-only op with the new arguments. (opcheck's schema test compares float8 CPU
    tensors with torch.allclose, which torch does not implement for them: it runs on the
    16-bit call, the FP8 call gets the other tests.)"""
    torch = pytest.importorskip("torch")
    from flashcore.backends.torch_ops import torch_ops
    ops = torch_ops()
    g = torch.Generator().manual_seed(32)
    q = torch.randn(2, 2, 4, 64, generator=g).to(torch.float16)
    kc = (torch.randn(2, 40, 2, 64, generator=g) * 20).to(torch.float8_e4m3fn)
    vc = (torch.randn(2, 40, 2, 64, generator=g) * 20).to(torch.float8_e4m3fn)
    lens = torch.tensor([5, 33], dtype=torch.int32)
    kd = torch.rand(2, 2, generator=g) * 0.1 + 0.01
    vd = torch.rand(2, 2, generator=g) * 0.1 + 0.01
    # options: [cache_seqlens_int, rotary_interleaved, causal, softmax_scale, window_left,
    # window_right, softcap, num_splits]
    opts = [0.0, 0.0, 1.0, 0.125, -1.0, 0.0, 2.0, 0.0]
    args = (q, kc, vc, lens, opts, None, None, None, None, kd, vd)
    for test in ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"):
        torch.library.opcheck(ops.kvcache_read.default, args, test_utils=test)
    torch.library.opcheck(ops.kvcache_read.default, args[:5], {"k_descale": kd,
                                                               "v_descale": None},
                          test_utils="test_faketensor")
    c16 = torch.randn(2, 40, 2, 64, generator=g).to(torch.float16)
    torch.library.opcheck(ops.kvcache_read.default, (q, c16, c16.clone(), lens, opts))
    out, lse = ops.kvcache_read(*args)
    want = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                            softmax_scale=0.125, softcap=2.0, k_descale=kd,
                                            v_descale=vd, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_torch_compile_fullgraph():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    rng = np.random.default_rng(33)
    p = FP8Problem(rng, **LAYOUTS["paged16"], sq=1)
    q, kc, vc = torch.from_numpy(p.q), _t8(torch, p.k_cache), _t8(torch, p.v_cache)
    lens, bt = torch.from_numpy(p.before), torch.from_numpy(p.block_table)
    kd, vd = torch.from_numpy(p.k_descale), torch.from_numpy(p.v_descale[:, :1].copy())

    def f(q, kc, vc, lens, bt, kd, vd):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt,
                                                causal=True, k_descale=kd, v_descale=vd)

    got = torch.compile(f, fullgraph=True)(q, kc, vc, lens, bt, kd, vd)
    np.testing.assert_array_equal(got.numpy(), f(q, kc, vc, lens, bt, kd, vd).numpy())
    want, _ = p.run(descales=(p.k_descale, p.v_descale[:, :1]), causal=True)
    np.testing.assert_array_equal(got.numpy(), want)


# --------------------------------------------------------------------------------------------
# GPU (skipped without one, or while the decode kernels take no FP8 cache): CuPy uint8 caches
# and torch.float8_e4m3fn CUDA tensors against the float64 reference
# --------------------------------------------------------------------------------------------

def _skip_without_fp8_decode():
    from flashcore.backends import cupy_backend
    why = cupy_backend._decode_kernels_reason() or cupy_backend._decode_fp8_reason()
    if why:
        pytest.skip(why)


GPU_CASES = {
    "plain": dict(),
    "gqa4_causal_sq4": dict(h=8, hk=2, sq=4, kw=dict(causal=True)),
    "softcap_window": dict(sq=2, kw=dict(causal=True, softcap=3.0, window_size=(20, 0))),
    "split_kv_4": dict(kw=dict(num_splits=4)),
    "d128_mqa": dict(d=128, h=4, hk=1, kw=dict(causal=True)),
    "d256": dict(d=256, h=2, hk=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cupy_uint8_caches_against_reference(q_dtype, layout, case):
    import cupy
    _skip_without_fp8_decode()
    c = dict(GPU_CASES[case])
    c.setdefault("d", 128)           # (the kernels' FP8 head dims: 128 and 256)
    kw = dict(c.pop("kw", {}))
    rng = np.random.default_rng(zlib.crc32(f"gpu/{q_dtype}/{layout}/{case}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], q_dtype=q_dtype, **c)
    ref_out, ref_lse = p.reference(**{x: kw[x] for x in ("causal", "window_size", "softcap")
                                      if x in kw})
    C = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    kc, vc = C(p.k_cache.view(np.uint8)), C(p.v_cache.view(np.uint8))
    kc0 = kc.copy()
    out, lse = flashcore.attention_with_kvcache(
        C(p.q), kc, vc, cache_seqlens=C(p.before), block_table=C(p.block_table),
        k_descale=C(p.k_descale), v_descale=C(p.v_descale), return_lse=True, **kw)
    check_against_reference(cupy.asnumpy(out), cupy.asnumpy(lse), ref_out, ref_lse, q_dtype)
    assert bool((kc == kc0).all())
    # a second call of the layout (its launch plan replayed) with other descales: they count
    kd2 = C(p.k_descale * 1.25)
    vd2 = C(p.v_descale[:, :1] * 0.5)         # (batch, 1): broadcast by the API
    out2, lse2 = flashcore.attention_with_kvcache(
        C(p.q), kc, vc, cache_seqlens=C(p.before), block_table=C(p.block_table),
        k_descale=kd2, v_descale=vd2, return_lse=True, **kw)
    p.k_descale, p.v_descale = cupy.asnumpy(kd2), np.repeat(cupy.asnumpy(vd2), p.hk, axis=1)
    ref2, ref2_lse = p.reference(**{x: kw[x] for x in ("causal", "window_size", "softcap")
                                    if x in kw})
    check_against_reference(cupy.asnumpy(out2), cupy.asnumpy(lse2), ref2, ref2_lse, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_torch_cuda_float8_caches_against_reference(layout):
    torch = pytest.importorskip("torch")
    _skip_without_fp8_decode()
    rng = np.random.default_rng(zlib.crc32(f"torch-gpu/{layout}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], q_dtype="bfloat16", sq=2, h=8, hk=2, d=128)
    ref_out, ref_lse = p.reference(causal=True, softcap=4.0)
    dev = torch.device("cuda")
    T = lambda x: None if x is None else torch.from_numpy(x.copy()).to(dev)  # noqa: E731
    q = torch.from_numpy(p.q.view(np.uint16).copy()).view(torch.bfloat16).to(dev)
    kc, vc = _t8(torch, p.k_cache).to(dev), _t8(torch, p.v_cache).to(dev)
    for _ in range(2):                                  # (the second call replays its plan)
        out, lse = flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=T(p.before), block_table=T(p.block_table), causal=True,
            softcap=4.0, k_descale=T(p.k_descale), v_descale=T(p.v_descale), return_lse=True)
        check_against_reference(out.float().cpu().numpy().astype(ml_dtypes.bfloat16),
                                lse.cpu().numpy(), ref_out, ref_lse, "bfloat16")


def _cupy_call(p, cupy, **kw):
    C = lambda x: None if x is None else cupy.asarray(x)  # noqa: E731
    out, lse = flashcore.attention_with_kvcache(
        C(p.q), C(p.k_cache.view(np.uint8)), C(p.v_cache.view(np.uint8)),
        cache_seqlens=C(p.before), block_table=C(p.block_table), k_descale=C(p.k_descale),
        v_descale=C(p.v_descale), return_lse=True,
        **{x: C(y) if isinstance(y, np.ndarray) else y for x, y in kw.items()})
    return cupy.asnumpy(out), cupy.asnumpy(lse)


# The decode tiles a sweep may set for the FP8 kernels (set_config_override, head dim 128):
# every merge path and the features the tile touches, against the reference.
FP8_TILES = [(64, 4, 2), (64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 4, 4)]
FP8_TILE_CASES = {
    "plain": dict(layout="contiguous", kw=dict()),
    "paged_split4": dict(layout="paged16", kw=dict(num_splits=4, causal=True)),
    "paged_split3_global_merge": dict(layout="paged64", cluster=False,
                                      kw=dict(num_splits=3, softcap=3.0)),
    "alibi_leftpad_causal_sq2": dict(layout="contiguous", sq=2, alibi=True, leftpad=True,
                                     kw=dict(causal=True)),
    "two_m_slices_sq5_gqa4": dict(layout="contiguous", sq=5, h=8, hk=2,
                                  kw=dict(causal=True, window_size=(40, 0))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None] + FP8_TILES)
@pytest.mark.parametrize("case", list(FP8_TILE_CASES))
def test_cupy_fp8_decode_tiles_against_reference(tile, case):
    import cupy
    from flashcore.kernels import decode
    _skip_without_fp8_decode()
    c = dict(FP8_TILE_CASES[case])
    layout, kw = c.pop("layout"), dict(c.pop("kw"))
    cluster, alibi = c.pop("cluster", True), c.pop("alibi", False)
    leftpad = c.pop("leftpad", False)
    q_dtype = "bfloat16" if zlib.crc32(f"{tile}/{case}".encode()) & 1 else "float16"
    rng = np.random.default_rng(zlib.crc32(f"tiles/{tile}/{case}".encode()))
    p = FP8Problem(rng, **LAYOUTS[layout], q_dtype=q_dtype, d=128, **c)
    ref_kw = {x: kw[x] for x in ("causal", "window_size", "softcap") if x in kw}
    if alibi:
        kw["alibi_slopes"] = ref_kw["alibi_slopes"] = \
            rng.uniform(0.05, 0.5, (p.b, p.h)).astype(np.float32)
    if leftpad:
        kw["cache_leftpad"] = np.array([2, 0, 30], np.int32)
        ref_kw["cache_leftpad"] = kw["cache_leftpad"]
    ref_out, ref_lse = p.reference(**ref_kw)
    was = decode.cluster_merge_enabled()
    decode.set_config_override(128, tile)
    decode.set_cluster_merge(cluster and was)
    try:
        out, lse = _cupy_call(p, cupy, **kw)
    finally:
        decode.set_config_override(128, None)
        decode.set_cluster_merge(was)
    check_against_reference(out, lse, ref_out, ref_lse, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_cupy_fp8_nan_bytes_reach_exactly_the_rows_that_see_them(d):
    """A NaN byte (0x7f) in K at one key of one (sequence, kv head) makes NaN exactly the rows
    whose causal window holds that key (other rows, heads and sequences: the reference of the
    cache without it); a NaN byte in V, at a key every row sees, makes NaN that (sequence, kv
    head)'s rows only."""
    import cupy
    _skip_without_fp8_decode()
    rng = np.random.default_rng(41 + d)
    p = FP8Problem(rng, b=3, sq=4, h=4, hk=2, d=d, before=(40, 70, 37), capacity=80)
    ref_out, ref_lse = p.reference(causal=True)
    sk = 70                                              # sequence 1, kv head 1
    p.k_cache.view(np.uint8)[1, sk - 2, 1, 37] = 0x7F    # seen by query rows 2, 3 (causal)
    out, lse = _cupy_call(p, cupy, causal=True)
    nan = np.zeros(out.shape, bool)
    nan[1, 2:, 2:4, :] = True                            # query heads 2, 3 share kv head 1
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(np.isnan(lse), nan[..., 0].transpose(0, 2, 1))
    check_against_reference(np.where(nan, 0, out).astype(out.dtype), np.where(
        nan[..., 0].transpose(0, 2, 1), 0, lse), np.where(nan, 0, ref_out),
        np.where(nan[..., 0].transpose(0, 2, 1), 0, ref_lse), "float16")
    p.k_cache.view(np.uint8)[1, sk - 2, 1, 37] = p.K8.view(np.uint8)[1, sk - 2, 1, 37]
    p.v_cache.view(np.uint8)[0, 3, 0, d - 1] = 0x7F     # key 3 of sequence 0: every row sees it
    out, lse = _cupy_call(p, cupy, causal=True)
    nan = np.zeros(out.shape, bool)
    nan[0, :, 0:2, d - 1] = True                          # only that column (P V is per column)
    np.testing.assert_array_equal(np.isnan(out), nan)
    assert not np.isnan(lse).any()
