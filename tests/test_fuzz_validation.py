"""Property-based tests of the validation layer: a randomly broken argument always gives the
documented exception (TypeError/ValueError; NotSupportedError is a ValueError) with a message
naming that argument, before anything runs; an unbroken call always runs and returns finite,
well-shaped results. Never a crash or a silent wrong answer."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import flashcore

BREAKS = {
    # name: (argument named in the message, mutation of (shapes, dtypes, kw, arrays))
    "ndim_q": "q", "ndim_k": "k", "batch": "k", "headdim": "k", "heads": "k", "vshape": "v",
    "dtype_k": "k", "dtype_v": "v", "intdtype": "q", "window_left": "window_size[0]",
    "window_right": "window_size[1]", "window_pair": "window_size", "softcap_neg": "softcap",
    "softcap_nan": "softcap", "scale_nan": "softmax_scale", "scale_str": "softmax_scale",
    "alibi_shape": "alibi_slopes", "alibi_dtype": "alibi_slopes", "lastdim_q": "q",
    "lastdim_v": "v", "list_q": "q", "dropout_range": "dropout_p", "dropout_type": "dropout_p",
    "rng_missing": "rng_state", "rng_dtype": "rng_state", "rng_shape": "rng_state",
    "out_dtype": "out_dtype",
}


@st.composite
def attention_args(draw):
    b = draw(st.integers(1, 3))
    sq, sk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 8, 16]))
    shapes = {"q": [b, sq, h, d], "k": [b, sk, hk, d], "v": [b, sk, hk, d]}
    dtypes = {"q": np.float64, "k": np.float64, "v": np.float64}
    kw = {"causal": draw(st.booleans())}
    brk = draw(st.sampled_from(["none"] + sorted(BREAKS)))
    if brk == "ndim_q":
        shapes["q"] = shapes["q"][:3]
    elif brk == "ndim_k":
        shapes["k"] = shapes["k"] + [1]
    elif brk == "batch":
        shapes["k"][0] = shapes["v"][0] = b + draw(st.integers(1, 3))
    elif brk == "headdim":
        shapes["k"][3] = shapes["v"][3] = d + draw(st.integers(1, 4))
    elif brk == "heads":
        hk2 = draw(st.integers(2, 5))
        shapes["k"][2] = shapes["v"][2] = hk2
        shapes["q"][2] = hk2 * draw(st.integers(1, 3)) + draw(st.integers(1, hk2 - 1))
    elif brk == "vshape":
        shapes["v"][1] += draw(st.integers(1, 3))
    elif brk in ("dtype_k", "dtype_v"):
        dtypes[brk[-1]] = draw(st.sampled_from([np.float32, np.float16]))
    elif brk == "intdtype":
        dtypes = {n: draw(st.sampled_from([np.int32, np.int64, np.bool_])) for n in dtypes}
    elif brk == "window_left":
        kw["window_size"] = (draw(st.integers(-100, -2)), draw(st.integers(-1, 5)))
    elif brk == "window_right":
        kw["window_size"] = (draw(st.integers(-1, 5)), draw(st.integers(-100, -2)))
    elif brk == "window_pair":
        kw["window_size"] = draw(st.sampled_from([(1,), (1, 2, 3), "ab", 3]))
    elif brk == "softcap_neg":
        kw["softcap"] = -draw(st.floats(1e-6, 1e6))
    elif brk == "softcap_nan":
        kw["softcap"] = draw(st.sampled_from([float("nan"), float("inf")]))
    elif brk == "scale_nan":
        kw["softmax_scale"] = draw(st.sampled_from([float("nan"), float("-inf"), float("inf")]))
    elif brk == "scale_str":
        kw["softmax_scale"] = draw(st.sampled_from(["1", [1.0], None and 0]))
        if kw["softmax_scale"] is None:
            kw["softmax_scale"] = "x"
    elif brk == "alibi_shape":
        kw["alibi_slopes"] = np.ones((h + draw(st.integers(1, 3)),), np.float32)
    elif brk == "alibi_dtype":
        kw["alibi_slopes"] = np.ones((h,), draw(st.sampled_from([np.int32, np.float16])))
    elif brk == "dropout_range":
        kw["dropout_p"] = draw(st.sampled_from([1.0, 1.5, -0.1, float("nan")]))
        kw["rng_state"] = np.array([1, 2], np.int64)
    elif brk == "dropout_type":
        kw["dropout_p"] = draw(st.sampled_from(["0.1", [0.1], True]))
        kw["rng_state"] = np.array([1, 2], np.int64)
    elif brk == "rng_missing":
        kw["dropout_p"] = draw(st.floats(1e-3, 0.9))
    elif brk == "rng_dtype":
        kw["dropout_p"] = draw(st.floats(1e-3, 0.9))
        kw["rng_state"] = np.array([1, 2], draw(st.sampled_from([np.int32, np.float64])))
    elif brk == "rng_shape":
        kw["dropout_p"] = draw(st.floats(1e-3, 0.9))
        kw["rng_state"] = np.arange(draw(st.sampled_from([1, 3, 4])), dtype=np.int64)
    elif brk == "out_dtype":
        kw["out_dtype"] = draw(st.sampled_from(["float16", "int8", np.float64, "bogus"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    arrays = {n: (rng.standard_normal(s) * 3).astype(dtypes[n]) for n, s in shapes.items()}
    if brk in ("lastdim_q", "lastdim_v"):
        n = brk[-1]
        big = np.repeat(arrays[n], 2, axis=-1)
        arrays[n] = big[..., ::2]          # stride 2 in the last dimension
    elif brk == "list_q":
        arrays["q"] = arrays["q"].tolist()
    elif brk == "none" and draw(st.booleans()):
        kw["window_size"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
        kw["softcap"] = draw(st.sampled_from([0.0, 0.5, 30.0]))
        kw["alibi_slopes"] = rng.uniform(0, 1, size=(h,)).astype(np.float32)
        if draw(st.booleans()):
            kw["dropout_p"] = draw(st.floats(0.0, 0.95))
            kw["rng_state"] = rng.integers(-2**62, 2**62, size=2).astype(np.int64)
    return brk, arrays, kw


@settings(max_examples=500, deadline=None)
@given(attention_args())
def test_broken_argument_is_named_and_valid_call_runs(case):
    brk, a, kw = case
    try:
        out, lse = flashcore.attention_forward(a["q"], a["k"], a["v"], **kw)
    except (TypeError, ValueError) as e:
        assert brk != "none", f"a valid call was refused: {e}"
        assert f"argument '{BREAKS[brk]}'" in str(e), f"{brk}: message does not name " \
            f"'{BREAKS[brk]}': {e}"
        return
    assert brk == "none", f"{brk}: a broken call was accepted"
    q = a["q"]
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert np.isfinite(out).all() and not np.isnan(lse).any()


@st.composite
def cu_seqlens_args(draw):
    lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    mutation = draw(st.sampled_from(["none", "dtype", "decrease", "first", "last", "len",
                                     "max", "ndim"]))
    max_seqlen, named = None, "cu_seqlens_q"
    if mutation == "dtype":
        cu = cu.astype(draw(st.sampled_from([np.int64, np.float32, np.uint32])))
    elif mutation == "decrease":
        if len(cu) < 3:
            cu = np.array([0, 2, 1, total], np.int32)
        else:
            cu[1] = cu[2] + 1
    elif mutation == "first":
        cu = cu + 1
    elif mutation == "last":
        cu[-1] += 1
    elif mutation == "len":
        cu = cu[:1]
    elif mutation == "max":
        if max(lens) == 0:
            mutation = "none"
        else:
            max_seqlen, named = max(lens) - 1, "max_seqlen_q"
    elif mutation == "ndim":
        cu = cu[None]
    return mutation, cu, total, max_seqlen, named, lens


@settings(max_examples=300, deadline=None)
@given(cu_seqlens_args())
def test_random_cu_seqlens(case):
    mutation, cu, total, max_seqlen, named, lens = case
    rng = np.random.default_rng(0)
    q = rng.standard_normal((total, 2, 8))
    k = rng.standard_normal((total, 1, 8))
    good_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    try:
        out, lse = flashcore.varlen_attention_forward(q, k, k, cu, good_k, max_seqlen_q=max_seqlen)
    except (TypeError, ValueError) as e:
        assert mutation != "none", f"valid cu_seqlens refused: {e}"
        assert f"argument '{named}'" in str(e), str(e)
        return
    assert mutation == "none", f"{mutation}: broken cu_seqlens accepted"
    assert np.isfinite(out).all()
