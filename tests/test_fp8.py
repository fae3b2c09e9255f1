"""FP8 (float8_e4m3fn) attention forward on the NumPy backend: FlashAttention-3's semantics
(per-(batch, key head) descales, P rounded to e4m3 for the product with V, bfloat16 output),
checked with the flash-attn rule in FP8, and what is refused."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore.reference import fp8_dequantize, fp8_forward, naive_forward
from flashcore.spec import forward_spec

ml_dtypes = pytest.importorskip("ml_dtypes", reason="float8_e4m3fn arrays need ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn


def _quantised(rng, b=2, sq=70, sk=90, h=4, hk=2, d=64):
    """q, k, v as float8_e4m3fn with per-(batch, key head) scales (the descales), and the
    float64 values they stand for."""
    xs, q8s, scales = [], [], []
    for n, heads in ((sq, h), (sk, hk), (sk, hk)):
        x = rng.standard_normal((b, n, heads, d)) * 3.0
        amax = np.abs(x).reshape(b, n, hk, heads // hk, d).max(axis=(1, 3, 4))   # (b, hk)
        scale = (amax / 448.0).astype(np.float32)                              # e4m3's max
        per_head = np.repeat(scale, heads // hk, axis=1)[:, None, :, None]
        q8s.append((x / per_head).astype(E4M3))
        scales.append(scale)
    exact = [fp8_dequantize(x8, s, hk).astype(np.float64) for x8, s in zip(q8s, scales)]
    return q8s, scales, exact


CASES = [dict(), dict(causal=True), dict(window_size=(20, 5)), dict(softcap=8.0, causal=True)]


@pytest.mark.parametrize("kw", CASES)
def test_error_within_twice_the_emulated_fp8_computation(kw):
    """The flash-attn rule in FP8: against the float64 attention of the dequantised inputs, the
    backend's error is at most twice that of the FP8 computation emulated untiled
    (flashcore.reference.fp8_forward), with bfloat16 output and with float32."""
    rng = np.random.default_rng(0)
    (q8, k8, v8), ds, exact = _quantised(rng)
    spec64 = forward_spec(*exact, **kw)
    want, want_lse = naive_forward(spec64, *exact)
    emul, _ = fp8_forward(forward_spec(q8, k8, v8, **kw), q8, k8, v8, tuple(ds))
    emul_err = np.abs(emul - want).max()
    assert 1e-3 < emul_err < 0.2        # P in e4m3 costs accuracy, and not more than that
    for out_dtype, dt in ((None, "bfloat16"), ("float32", "float32")):
        out, lse = flashcore.attention_forward(q8, k8, v8, q_descale=ds[0], k_descale=ds[1],
                                               v_descale=ds[2], out_dtype=out_dtype, **kw)
        assert out.dtype == np.dtype(dt) and lse.dtype == np.float32
        assert np.abs(out.astype(np.float64) - want).max() <= 2 * emul_err
        np.testing.assert_allclose(lse, want_lse, atol=1e-4)


def test_descales_per_batch_and_key_head():
    """A scalar descale is the per-tensor case of the (batch, nheads_k) one; a query head takes
    its key head's descale; no descale means 1."""
    rng = np.random.default_rng(1)
    (q8, k8, v8), _, _ = _quantised(rng)
    base, _ = flashcore.attention_forward(q8, k8, v8, out_dtype="float32")
    ones = np.ones((2, 2), np.float32)
    same, _ = flashcore.attention_forward(q8, k8, v8, q_descale=ones,
                                          k_descale=np.ones((), np.float32), v_descale=ones[:1],
                                          out_dtype="float32")
    np.testing.assert_array_equal(base, same)
    vd = ones.copy()
    vd[1, 0] = 2.0          # sequence 1, key head 0: query heads 0 and 1 (groups of 2)
    scaled, _ = flashcore.attention_forward(q8, k8, v8, v_descale=vd, out_dtype="float32")
    np.testing.assert_allclose(scaled[1, :, :2], 2 * base[1, :, :2], rtol=1e-6)
    np.testing.assert_array_equal(scaled[1, :, 2:], base[1, :, 2:])
    np.testing.assert_array_equal(scaled[0], base[0])


def test_varlen_is_the_dense_call_per_sequence():
    rng = np.random.default_rng(2)
    (q8, k8, v8), ds, _ = _quantised(rng, sq=40, sk=40)
    cu = np.array([0, 40, 80], np.int32)
    dense, dlse = flashcore.attention_forward(q8, k8, v8, causal=True, q_descale=ds[0],
                                              k_descale=ds[1], v_descale=ds[2])
    out, lse = flashcore.varlen_attention_forward(
        q8.reshape(80, 4, 64), k8.reshape(80, 2, 64), v8.reshape(80, 2, 64), cu, cu,
        causal=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    np.testing.assert_array_equal(out, dense.reshape(80, 4, 64))
    np.testing.assert_allclose(lse, dlse.transpose(1, 0, 2).reshape(4, 80), rtol=1e-6)
    # attention() and varlen_attention() take the same arguments (forward only here)
    np.testing.assert_array_equal(
        flashcore.attention(q8, k8, v8, causal=True, q_descale=ds[0], k_descale=ds[1],
                            v_descale=ds[2]), dense)
    np.testing.assert_array_equal(
        flashcore.varlen_attention(q8.reshape(80, 4, 64), k8.reshape(80, 2, 64),
                                   v8.reshape(80, 2, 64), cu, cu, causal=True,
                                   q_descale=ds[0], k_descale=ds[1], v_descale=ds[2]), out)
    assert flashcore.varlen_attention_forward(
        q8.reshape(80, 4, 64), k8.reshape(80, 2, 64), v8.reshape(80, 2, 64), cu, cu,
        out_dtype="float16")[0].dtype == np.float16


def _refused(exc, words, fn, *args, **kw):
    with pytest.raises(exc, match=words):
        fn(*args, **kw)


def test_refusals_name_the_argument():
    rng = np.random.default_rng(3)
    (q8, k8, v8), ds, exact = _quantised(rng, sq=8, sk=8)
    f32 = [x.astype(np.float32) for x in exact]
    _refused(TypeError, "'q'.*forward only", flashcore.attention_backward,
             q8, q8, k8, v8, q8, np.zeros((2, 4, 8), np.float32))
    _refused(ValueError, "'dropout_p'", flashcore.attention_forward, q8, k8, v8,
             dropout_p=0.1, rng_state=np.array([1, 2], np.int64))
    _refused(ValueError, "'q_descale'.*float8_e4m3fn", flashcore.attention_forward, *f32,
             q_descale=ds[0])
    _refused(TypeError, "'k_descale'.*float32", flashcore.attention_forward, q8, k8, v8,
             k_descale=ds[1].astype(np.float64))
    _refused(ValueError, "'v_descale'.*\\(2, 2\\)", flashcore.attention_forward, q8, k8, v8,
             v_descale=np.ones((3, 2), np.float32))
    _refused(TypeError, "'out_dtype'", flashcore.attention_forward, q8, k8, v8,
             out_dtype="int8")
    _refused(TypeError, "'k'.*float8_e4m3fn like 'q'", flashcore.attention_forward,
             q8, f32[1], v8)
    _refused(TypeError, "'q'", flashcore.attention_with_kvcache, q8, k8, v8,
             cache_seqlens=np.array([8, 8], np.int32))


def test_torch_cpu_fp8_tensors_run_on_the_numpy_reference():
    """torch.float8_e4m3fn CPU tensors: the NumPy backend's result (bfloat16 rounded by torch,
    the same rounding), forward only: inputs that require grad and the backward are refused
    by name; descales with 16-bit tensors too."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    rng = np.random.default_rng(4)
    (q8, k8, v8), ds, _ = _quantised(rng, sq=24, sk=40)
    want, want_lse = flashcore.attention_forward(q8, k8, v8, causal=True, q_descale=ds[0],
                                                 k_descale=ds[1], v_descale=ds[2])
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)
                  for x in (q8, k8, v8))
    td = [torch.from_numpy(d) for d in ds]
    out, lse = flashcore.attention_forward(tq, tk, tv, causal=True, q_descale=td[0],
                                           k_descale=td[1], v_descale=td[2])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    o2 = flashcore.attention(tq, tk, tv, causal=True, q_descale=td[0], k_descale=td[1],
                             v_descale=td[2])
    np.testing.assert_array_equal(o2.float().numpy(), want.astype(np.float32))
    assert flashcore.attention_forward(tq, tk, tv, out_dtype="float16")[0].dtype == torch.float16
    with pytest.raises(TypeError, match="'q'.*forward only"):
        flashcore.attention(tq.clone().requires_grad_(True), tk, tv)
    with pytest.raises(TypeError, match="'q'.*forward only"):
        flashcore.attention_backward(tq, tq, tk, tv, tq, torch.zeros(2, 4, 24))
    with pytest.raises(ValueError, match="'q_descale'"):
        flashcore.attention(torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64),
                            torch.zeros(1, 8, 2, 64), q_descale=torch.ones(1, 2))


def test_flash_attn_drop_in_takes_fa3_descales():
    """FlashAttention-3's FP8 forward through the flash-attn drop-in: keyword-only q_descale,
    k_descale, v_descale; the same result as attention_forward, dense and varlen."""
    from flashcore.flash_attn import flash_attn_func, flash_attn_varlen_func
    rng = np.random.default_rng(3)
    (q8, k8, v8), ds, _ = _quantised(rng, b=1, sq=40, sk=50)
    want, want_lse = flashcore.attention_forward(q8, k8, v8, q_descale=ds[0], k_descale=ds[1],
                                                 v_descale=ds[2], causal=True)
    out, lse, probs = flash_attn_func(q8, k8, v8, causal=True, return_attn_probs=True,
                                      q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert out.dtype == want.dtype and probs is None
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    cu_q, cu_k = np.array([0, 40], np.int32), np.array([0, 50], np.int32)
    out_v = flash_attn_varlen_func(q8[0], k8[0], v8[0], cu_q, cu_k, 40, 50, causal=True,
                                   q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    np.testing.assert_array_equal(out_v, want[0])
    with pytest.raises(ValueError, match="'q_descale'"):
        flash_attn_func(*(x.astype(np.float32) for x in (q8, k8, v8)), q_descale=ds[0])
