"""The NumPy backend: the tiled FlashAttention path against the naive oracle, the oracle
against an element-by-element loop, gradients against finite differences."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flashcore
from flashcore.backends.numpy_backend import NumpyBackend, tiled_backward, tiled_forward
from flashcore.reference import naive_backward, naive_forward, round_to_dtype
from flashcore.spec import forward_spec
from refutils import make_problem, max_err, slopes_array

FEATURES = dict(
    causal=[False, True],
    window=[(-1, -1), (5, 0), (3, 7), (-1, 4), (0, 0)],
    softcap=[0.0, 2.5],
    alibi=[None, "per_head", "per_batch_head"],
    heads=[(4, 4), (4, 2), (6, 1)],
    seqlens=[(1, 1), (1, 19), (19, 1), (33, 47), (47, 33), (64, 64), (70, 129)],
)


def _random_cases(n, seed):
    rng = np.random.default_rng(seed)
    keys = list(FEATURES)
    for i in range(n):
        yield {k: FEATURES[k][rng.integers(len(FEATURES[k]))] for k in keys}, i


CASES = list(_random_cases(60, 1234))


def _kw(case, b, h, rng):
    return dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"],
                alibi_slopes=slopes_array(case["alibi"], b, h, rng))


def _slopes(kw, b):
    s = kw["alibi_slopes"]
    if s is not None and s.ndim == 1:
        s = np.broadcast_to(s[None], (b, s.shape[0]))
    return s


@pytest.mark.parametrize("case,i", CASES, ids=[f"case{i}" for _, i in CASES])
def test_tiled_matches_naive_float64(case, i):
    rng = np.random.default_rng(i)
    h, hk = case["heads"]
    sq, sk = case["seqlens"]
    b, d = 2, 8 + 8 * (i % 3)
    q, k, v = make_problem(rng, b, sq, sk, h, hk, d)
    dout = rng.standard_normal(q.shape)
    kw = _kw(case, b, h, rng)
    spec = forward_spec(q, k, v, **kw)
    slopes = _slopes(kw, b)
    bq, bk = [(16, 16), (64, 64), (7, 13)][i % 3]
    o1, l1 = naive_forward(spec, q, k, v, slopes)
    o2, l2 = tiled_forward(spec, q, k, v, slopes, bq, bk)
    assert max_err(o1, o2) < 1e-12 and max_err(l1, l2) < 1e-12
    assert np.array_equal(np.isneginf(l1), np.isneginf(l2))
    g1 = naive_backward(spec, dout, q, k, v, slopes)
    g2 = tiled_backward(spec, dout, q, k, v, o2, l2, slopes, bq, bk)
    for a, bb, name in zip(g1, g2, "qkv"):
        assert a.shape == bb.shape
        assert max_err(a, bb) < 1e-12, name
        assert np.isfinite(bb).all()


def _loop_reference(q, k, v, scale, causal, window, softcap, slopes):
    """Element-by-element attention in plain Python floats: independent of the vectorised code."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((b, h, sq), -np.inf)
    left, right = window
    if causal:
        right = 0
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        kh = hi // (h // hk)
        scores = {}
        for j in range(sk):
            lo = i + sk - sq - left if left >= 0 else -math.inf
            hi_ = i + sk - sq + right if right >= 0 else math.inf
            if not (lo <= j <= hi_):
                continue
            s = sum(float(q[bi, i, hi, t]) * float(k[bi, j, kh, t]) for t in range(d)) * scale
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s -= float(slopes[bi, hi]) * abs(i + sk - sq - j)
            scores[j] = s
        if not scores:
            continue
        m = max(scores.values())
        z = sum(math.exp(s - m) for s in scores.values())
        lse[bi, hi, i] = m + math.log(z)
        for j, s in scores.items():
            out[bi, i, hi] += math.exp(s - m) / z * v[bi, j, kh]
    return out, lse


@pytest.mark.parametrize("causal,window,softcap,alibi", [
    (False, (-1, -1), 0.0, None), (True, (-1, -1), 0.0, None), (False, (2, 1), 0.0, None),
    (True, (3, -1), 0.0, None), (False, (-1, -1), 1.5, None), (False, (-1, -1), 0.0, "per_head"),
    (True, (-1, -1), 3.0, "per_batch_head"),
])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (7, 7)])
def test_oracle_matches_elementwise_loop(causal, window, softcap, alibi, sq, sk):
    rng = np.random.default_rng(7)
    b, h, hk, d = 2, 4, 2, 8
    q, k, v = make_problem(rng, b, sq, sk, h, hk, d)
    slopes = slopes_array(alibi, b, h, rng)
    s2 = None if slopes is None else (np.broadcast_to(slopes[None], (b, h)) if slopes.ndim == 1 else slopes)
    out, lse = flashcore.attention_forward(q, k, v, causal=causal, window_size=window,
                                           softcap=softcap, alibi_slopes=slopes)
    ro, rl = _loop_reference(q, k, v, 1 / math.sqrt(d), causal, window, softcap, s2)
    assert max_err(out, ro) < 1e-12
    assert max_err(lse, rl) < 1e-12
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))


def test_causal_is_bottom_right_aligned():
    # seqlen_q = 2, seqlen_k = 5: row 0 sees keys 0..3, row 1 sees 0..4 (DESIGN.md).
    rng = np.random.default_rng(0)
    q, k, v = make_problem(rng, 1, 2, 5, 1, 1, 8)
    v = np.zeros_like(v)
    v[0, 4, 0, 0] = 1.0                      # only key 4 carries a signal
    out, _ = flashcore.attention_forward(q, k, v, causal=True)
    assert out[0, 0, 0, 0] == 0.0 and out[0, 1, 0, 0] > 0.0


def test_fully_masked_rows_give_zero_and_neg_inf():
    rng = np.random.default_rng(1)
    q, k, v = make_problem(rng, 2, 9, 4, 2, 1, 8)   # causal with sq > sk: first 5 rows see nothing
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    assert np.all(out[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 5:]).all()
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = flashcore.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert np.all(dq[:, :5] == 0)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()


def _loss_and_grads(q, k, v, dout, kw, backend):
    out, lse = flashcore.attention_forward(q, k, v, backend=backend, **kw)
    g = flashcore.attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
    return float((out * dout).sum()), g


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True), dict(window_size=(3, 2)), dict(softcap=1.5),
    dict(causal=True, softcap=2.0), dict(softmax_scale=0.9),
], ids=["plain", "causal", "window", "softcap", "causal_softcap", "scale"])
def test_gradients_match_finite_differences(kw):
    rng = np.random.default_rng(3)
    b, sq, sk, h, hk, d = 1, 6, 9, 4, 2, 8
    q, k, v = make_problem(rng, b, sq, sk, h, hk, d)
    kw = dict(kw)
    if "softcap" in kw and kw.get("causal"):
        kw["alibi_slopes"] = rng.uniform(0.1, 0.4, size=(h,)).astype(np.float32)
    dout = rng.standard_normal(q.shape)
    _, grads = _loss_and_grads(q, k, v, dout, kw, "numpy")
    eps = 1e-6
    for idx, (x, g) in enumerate(zip((q, k, v), grads)):
        direction = rng.standard_normal(x.shape)
        args = [q, k, v]
        args[idx] = x + eps * direction
        fp, _ = _loss_and_grads(*args, dout, kw, "numpy")
        args[idx] = x - eps * direction
        fm, _ = _loss_and_grads(*args, dout, kw, "numpy")
        fd = (fp - fm) / (2 * eps)
        an = float((g * direction).sum())
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), f"d{'qkv'[idx]}: fd {fd} vs {an}"


def test_naive_path_backend_agrees_with_default():
    rng = np.random.default_rng(4)
    q, k, v = make_problem(rng, 2, 17, 23, 4, 2, 16)
    spec = forward_spec(q, k, v, causal=True)
    o1, l1 = NumpyBackend(path="naive").forward(spec, q, k, v)
    o2, l2 = NumpyBackend().forward(spec, q, k, v)
    assert max_err(o1, o2) < 1e-12 and max_err(l1, l2) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_per_sequence_dense(causal):
    rng = np.random.default_rng(5)
    lens_q, lens_k = [3, 0, 17, 1, 8], [5, 4, 17, 0, 2]
    h, hk, d = 4, 2, 16
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], h, d))
    k = rng.standard_normal((cu_k[-1], hk, d))
    v = rng.standard_normal((cu_k[-1], hk, d))
    out, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=causal)
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = flashcore.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                     causal=causal)
    assert lse.shape == (h, q.shape[0])
    for i in range(len(lens_q)):
        a, bq = cu_q[i], cu_q[i + 1]
        c, bk = cu_k[i], cu_k[i + 1]
        if bq == a:
            continue
        o1, l1 = flashcore.attention_forward(q[None, a:bq], k[None, c:bk], v[None, c:bk],
                                             causal=causal)
        assert max_err(out[a:bq], o1[0]) < 1e-12
        assert max_err(lse[:, a:bq], l1[0]) < 1e-12
        g = flashcore.attention_backward(dout[None, a:bq], q[None, a:bq], k[None, c:bk],
                                         v[None, c:bk], o1, l1, causal=causal)
        assert max_err(dq[a:bq], g[0][0]) < 1e-12
        assert max_err(dk[c:bk], g[1][0]) < 1e-12
        assert max_err(dv[c:bk], g[2][0]) < 1e-12
    # a sequence with no keys: output 0, lse -inf
    assert np.all(out[cu_q[3]:cu_q[4]] == 0) and np.all(np.isneginf(lse[:, cu_q[3]:cu_q[4]]))


def test_low_precision_inputs_return_input_dtype():
    rng = np.random.default_rng(6)
    q, k, v = make_problem(rng, 1, 8, 8, 2, 2, 8, np.float16)
    out, lse = flashcore.attention_forward(q, k, v)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, _ = flashcore.attention_forward(q.astype(np.float64), k.astype(np.float64),
                                         v.astype(np.float64))
    assert max_err(out, ref) < 2e-3


def test_strided_inputs_accepted_and_equal_contiguous():
    rng = np.random.default_rng(8)
    big = rng.standard_normal((2, 40, 6, 16))
    q = big[:, ::2, :4]            # non-contiguous batch/seq/head strides, contiguous last dim
    k = big[:, 1::3, 4:6]
    v = big[:, 2::3, 4:6][:, :k.shape[1]]
    o1, l1 = flashcore.attention_forward(q, k, v, causal=True)
    o2, l2 = flashcore.attention_forward(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=True)
    assert max_err(o1, o2) == 0.0 and max_err(l1, l2) == 0.0


def test_bfloat16_rounding_helper():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.14159, np.inf, np.nan], np.float32)
    r = round_to_dtype(x, "bfloat16")
    assert r[0] == 1.0 and r[1] == 1.0          # halfway rounds to even
    assert r[2] == np.float32(1.015625)
    assert abs(r[3] + 3.140625) < 1e-6 and np.isinf(r[4]) and np.isnan(r[5])


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_propagates_only_where_the_math_says(where):
    """A NaN in one input element poisons exactly the outputs that depend on it: never other
    batches or heads, and for q never other rows."""
    rng = np.random.default_rng(9)
    q, k, v = make_problem(rng, 3, 12, 15, 4, 2, 8)
    x = {"q": q, "k": k, "v": v}[where]
    x[1, 5, 0, 3] = np.nan                        # batch 1, row 5, head 0 (kv head 0 for k/v)
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    bad = ~np.isfinite(out)
    assert not bad[0].any() and not bad[2].any(), "another batch was poisoned"
    if where == "q":
        assert bad[1, 5, 0].all() and bad[1].sum() == bad[1, 5, 0].size
        return
    # kv head 0 serves query heads 0 and 1: every row that sees key 5 (causal: i >= 5 - 3 = 2)
    # is NaN; nothing outside batch 1 / heads 0-1 is. (Rows for which key 5 is masked but that
    # share its key block may turn NaN too: a masked probability is 0 and 0·NaN is NaN, in the
    # tiled reference as in the kernels and in flash-attn.)
    cols = slice(None) if where == "k" else 3                   # v: only its own column
    assert bad[1, 2:, :2][..., cols].all()
    assert not bad[1, :, 2:].any()
    if where == "v":
        assert not np.delete(bad[1], 3, axis=-1).any()


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf: meant
def test_inf_propagates_only_where_the_math_says(where):
    """A +inf input element: the outputs exact attention makes non-finite are, and nothing
    else is (refutils.inf_case spells out which)."""
    from refutils import inf_case
    q, k, v, must, may = inf_case(np.random.default_rng(12), where, sq=13, sk=17, d=8)
    for q_, k_, v_ in ((q, k, v), tuple(x.astype(np.float64) for x in (q, k, v))):
        out, lse = flashcore.attention_forward(q_, k_, v_, causal=True)
        bad = ~np.isfinite(out)
        assert bad[must].all(), "an output the +inf reaches is finite"
        assert not bad[~may].any(), "the +inf reached an output it cannot reach"
