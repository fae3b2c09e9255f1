"""Varlen attention over a paged KV cache (flash-attn's ``block_table`` in
``flash_attn_varlen_func``): prefill and chunked prefill reading a cache of pages. The oracle is
the same call on the keys gathered into packed rows."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore


def _case(rng, page=128, lens_q=(5, 0, 9, 130), lens_k=(200, 0, 9, 300), hk=2, h=4, d=16,
          extra_blocks=3):
    per = max(-(-n // page) for n in lens_k) or 1
    b = len(lens_q)
    pool = b * per + extra_blocks
    kc = rng.standard_normal((pool, page, hk, d))
    vc = rng.standard_normal((pool, page, hk, d))
    table = rng.permutation(pool)[: b * per].reshape(b, per).astype(np.int32)
    q = rng.standard_normal((sum(lens_q), h, d))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rows = np.concatenate([table[i, np.arange(n) // page] * page + np.arange(n) % page
                           for i, n in enumerate(lens_k)])
    kp = kc.reshape(-1, hk, d)[rows]
    vp = vc.reshape(-1, hk, d)[rows]
    return q, kc, vc, table, cu_q, cu_k, kp, vp


@pytest.mark.parametrize("page", [128, 16, 48])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(40, 3)),
                                dict(softcap=3.0, causal=True)])
def test_paged_equals_packed(kw, page):
    rng = np.random.default_rng(page)
    q, kc, vc, table, cu_q, cu_k, kp, vp = _case(rng, page=page)
    out, lse = flashcore.varlen_attention_forward(q, kc, vc, cu_q, cu_k, block_table=table, **kw)
    want, wlse = flashcore.varlen_attention_forward(q, kp, vp, cu_q, cu_k, **kw)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, wlse, atol=1e-12, rtol=0)


def test_default_max_seqlen_and_longer_pages():
    rng = np.random.default_rng(1)
    q, kc, vc, table, cu_q, cu_k, kp, vp = _case(rng, page=256, lens_q=(3, 4), lens_k=(600, 4))
    out = flashcore.varlen_attention(q, kc, vc, cu_q, cu_k, block_table=table, causal=True)
    want = flashcore.varlen_attention(q, kp, vp, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    rng = np.random.default_rng(2)
    q, kc, vc, table, cu_q, cu_k, kp, vp = (torch.from_numpy(x) for x in _case(rng))
    out = flashcore.varlen_attention(q, kc, vc, cu_q, cu_k, 130, 300, block_table=table,
                                     causal=True)
    want = flashcore.varlen_attention(q, kp, vp, cu_q, cu_k, 130, 300, causal=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("change, exc, words", [
    (dict(page=40), ValueError, "'k'.*page_size a multiple of 16"),
    (dict(table_rows=2), ValueError, "'block_table'.*shape"),
    (dict(bad_block=True), ValueError, "'block_table'.*block indices"),
    (dict(long_seq=True), ValueError, "cu_seqlens_k.*at most the keys block_table holds"),
    (dict(padded=True), ValueError, "'block_table'.*varlen"),
    (dict(table_dtype=np.int64), TypeError, "'block_table'"),
])
def test_refusals_name_the_argument(change, exc, words):
    rng = np.random.default_rng(3)
    page = change.get("page", 128)
    q, kc, vc, table, cu_q, cu_k, _, _ = _case(rng, page=page, lens_q=(2, 3), lens_k=(100, 120))
    if "table_rows" in change:
        table = table[:1]
    if "bad_block" in change:
        table = table.copy()
        table[1, 0] = kc.shape[0]
    if "long_seq" in change:
        cu_k = np.array([0, 100, 100 + table.shape[1] * page + 1], np.int32)
    if "table_dtype" in change:
        table = table.astype(change["table_dtype"])
    with pytest.raises(exc, match=words):
        if "padded" in change:
            flashcore.attention_forward(q[None], kc[:1], vc[:1]) if False else \
                flashcore.api._forward(q[None], kc, vc, None, False, block_table=table)
        else:
            flashcore.varlen_attention_forward(q, kc, vc, cu_q, cu_k, block_table=table)


def test_backward_is_refused_on_torch():
    """The forward runs with inputs that require grad (as flash-attn's does); a backward
    through it raises, naming the argument."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    rng = np.random.default_rng(4)
    q, kc, vc, table, cu_q, cu_k, _, _ = (torch.from_numpy(x) for x in _case(rng))
    with torch.no_grad():
        want = flashcore.varlen_attention(q, kc, vc, cu_q, cu_k, block_table=table)
    qg = q.clone().requires_grad_()
    out = flashcore.varlen_attention(qg, kc, vc, cu_q, cu_k, block_table=table)
    assert out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(NotImplementedError, match="'block_table'.*forward only"):
        out.sum().backward()
