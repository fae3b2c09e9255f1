"""flashcore.merge_attention_states: attention over chunks of the keys, merged through the
LSE, equals attention over all the keys (the split-KV combine), for NumPy and torch arrays."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore.backends.numpy_backend import partial_forward
from flashcore.spec import forward_spec


def chunked(q, k, v, bounds, **kw):
    """Attention per key chunk [c0, c1) with the masks of the whole sequence."""
    spec = forward_spec(q, k, v, **kw)
    slopes = kw.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 1:
        slopes = np.broadcast_to(slopes[None], (q.shape[0], slopes.shape[0]))
    parts = [partial_forward(spec, q, k, v, slopes, c0, c1) for c0, c1 in bounds]
    return [p[0] for p in parts], [p[1] for p in parts]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(window_size=(4, 2)),
    dict(causal=True, softcap=2.0),
    dict(alibi_slopes=np.array([0.1, 0.3, 0.2, 0.05], np.float32)),
])
@pytest.mark.parametrize("bounds", [[(0, 50)], [(0, 7), (7, 30), (30, 50)],
                                    [(0, 1), (1, 2), (2, 49), (49, 50)]])
def test_chunks_merge_to_full_attention(kw, bounds):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 9, 4, 16))
    k = rng.standard_normal((2, 50, 2, 16))
    v = rng.standard_normal((2, 50, 2, 16))
    full_o, full_l = flashcore.attention_forward(q, k, v, **kw)
    outs, lses = chunked(q, k, v, bounds, **kw)
    o, l = flashcore.merge_attention_states(outs, lses)
    assert o.dtype == np.float64 and l.dtype == np.float64
    np.testing.assert_allclose(o, full_o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(l), np.isneginf(full_l))
    fin = np.isfinite(full_l)
    np.testing.assert_allclose(l[fin], full_l[fin], rtol=0, atol=1e-12)
    # the stacked form gives the same
    o2, l2 = flashcore.merge_attention_states(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(l, l2)


def test_fully_masked_chunks_and_rows():
    """A causal window over few keys: some chunks see nothing for some rows, some rows see
    nothing at all (out 0, lse -inf, never NaN)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 12, 2, 8))
    k = rng.standard_normal((1, 6, 2, 8))
    v = rng.standard_normal((1, 6, 2, 8))
    kw = dict(causal=True, window_size=(1, 0))
    full_o, full_l = flashcore.attention_forward(q, k, v, **kw)
    assert np.isneginf(full_l).any()                   # rows with no key at all
    outs, lses = chunked(q, k, v, [(0, 2), (2, 4), (4, 6)], **kw)
    assert all(np.isneginf(x).any() for x in lses)     # every chunk is fully masked somewhere
    o, l = flashcore.merge_attention_states(outs, lses)
    assert not np.isnan(o).any() and not np.isnan(l).any()
    np.testing.assert_allclose(o, full_o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(l), np.isneginf(full_l))
    assert (o[np.isneginf(full_l).transpose(0, 2, 1)] == 0).all()
    fin = np.isfinite(full_l)
    np.testing.assert_allclose(l[fin], full_l[fin], rtol=0, atol=1e-12)


def test_all_parts_empty_and_garbage_in_empty_parts():
    o = np.full((2, 1, 3, 2, 4), np.nan)        # a part with lse -inf may hold anything
    l = np.full((2, 1, 2, 3), -np.inf)
    out, lse = flashcore.merge_attention_states(o, l)
    assert (out == 0).all() and np.isneginf(lse).all()
    o[1] = 1.0
    l[1] = 0.5
    out, lse = flashcore.merge_attention_states(o, l)
    assert (out == 1.0).all() and (lse == 0.5).all()


def test_float32_and_float16_inputs():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, 2, 8))
    k = rng.standard_normal((1, 40, 2, 8))
    v = rng.standard_normal((1, 40, 2, 8))
    full_o, full_l = flashcore.attention_forward(q, k, v)
    outs, lses = chunked(q, k, v, [(0, 13), (13, 40)])
    for dt, tol in ((np.float32, 1e-6), (np.float16, 2e-3)):
        o, l = flashcore.merge_attention_states([x.astype(dt) for x in outs],
                                                [x.astype(np.float32) for x in lses])
        assert o.dtype == dt and l.dtype == np.float32
        np.testing.assert_allclose(o.astype(np.float64), full_o, rtol=0, atol=tol)
        np.testing.assert_allclose(l, full_l, rtol=0, atol=1e-5)


def test_packed_varlen_layout():
    """(total, h, d) outs with (h, total) lses, like the varlen forward."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 5, 2, 8))
    k = rng.standard_normal((1, 20, 2, 8))
    v = rng.standard_normal((1, 20, 2, 8))
    full_o, full_l = flashcore.attention_forward(q, k, v)
    outs, lses = chunked(q, k, v, [(0, 10), (10, 20)])
    o, l = flashcore.merge_attention_states([x[0] for x in outs], [x[0] for x in lses])
    np.testing.assert_allclose(o, full_o[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(l, full_l[0], rtol=0, atol=1e-12)


def test_torch_same_result_and_differentiable():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 2, 8))
    k = rng.standard_normal((2, 30, 1, 8))
    v = rng.standard_normal((2, 30, 1, 8))
    outs, lses = chunked(q, k, v, [(0, 11), (11, 30)], causal=True)
    o_np, l_np = flashcore.merge_attention_states(outs, lses)
    to = [torch.from_numpy(x.copy()).requires_grad_(True) for x in outs]
    tl = [torch.from_numpy(x.copy()) for x in lses]
    o, l = flashcore.merge_attention_states(to, tl)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
    np.testing.assert_allclose(o.detach().numpy(), o_np, rtol=0, atol=1e-14)
    np.testing.assert_allclose(l.numpy(), l_np, rtol=0, atol=1e-14)
    o.sum().backward()
    assert to[0].grad is not None and torch.isfinite(to[0].grad).all()
    o16, l16 = flashcore.merge_attention_states([x.half() for x in to],
                                                [x.float() for x in tl])
    assert o16.dtype == torch.float16 and l16.dtype == torch.float32


def test_merge_of_split_attention_calls_torch_cpu():
    """The intended use: shard the keys, attention on each shard with lse, merge."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 64, 4, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 64, 4, 16, generator=g, dtype=torch.float64)
    full = flashcore.attention(q, k, v)
    parts = [flashcore.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
             for a, b in ((0, 20), (20, 64))]
    o, _ = flashcore.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(o, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("outs,lses,exc,words", [
    ([], [], ValueError, ["'outs'", "at least one"]),
    ("x", [np.zeros((1, 2, 3))], TypeError, ["'outs'", "list of arrays", "str"]),
    ([np.zeros((1, 3, 2, 4))], [np.zeros((1, 2, 3))] * 2, ValueError, ["'lses'", "1 partial"]),
    ([np.zeros((1, 3, 2, 4))], [np.zeros((1, 3, 2))], ValueError, ["'lses[0]'", "(1, 2, 3)", "(1, 3, 2)"]),
    ([np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 5))], [np.zeros((1, 2, 3))] * 2, ValueError,
     ["'outs[1]'", "(1, 3, 2, 4)"]),
    ([np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4), np.float32)], [np.zeros((1, 2, 3))] * 2,
     TypeError, ["'outs[1]'", "float64"]),
    ([np.zeros((1, 3, 2, 4), np.int32)], [np.zeros((1, 2, 3))], TypeError, ["'outs[0]'", "floating"]),
    ([np.zeros((1, 3, 2, 4))], [np.zeros((1, 2, 3), np.int32)], TypeError, ["'lses[0]'", "float32"]),
    ([np.zeros((3, 2))], [np.zeros((2, 3))], ValueError, ["'outs[0]'", "dimensional"]),
    (np.zeros((0, 1, 3, 2, 4)), np.zeros((0, 1, 2, 3)), ValueError, ["'outs'", "non-empty"]),
])
def test_rejects(outs, lses, exc, words):
    with pytest.raises(exc) as e:
        flashcore.merge_attention_states(outs, lses)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_mixed_libraries_are_named_against_the_first_partial():
    """There is no 'q' in a merge: a part of another library is named against 'outs[0]'."""
    torch = pytest.importorskip("torch")
    o, l = np.zeros((1, 3, 2, 4)), np.zeros((1, 2, 3))
    for outs, lses, name in (([o, torch.zeros(1, 3, 2, 4, dtype=torch.float64)], [l, l], "outs[1]"),
                             ([o, o], [l, torch.zeros(1, 2, 3, dtype=torch.float64)], "lses[1]")):
        with pytest.raises(TypeError) as e:
            flashcore.merge_attention_states(outs, lses)
        msg = str(e.value)
        assert f"argument '{name}'" in msg and "like 'outs[0]'" in msg and "'q'" not in msg, msg
