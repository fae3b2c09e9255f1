"""flashcore.flash_attn: flash-attn 2.x names, argument order, defaults and returns."""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")

import flashcore  # noqa: E402
from flashcore import flash_attn as fa  # noqa: E402

_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
         ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
         ("deterministic", False), ("return_attn_probs", False)]
_REQ = inspect.Parameter.empty

# flash-attn 2.x (flash_attn/flash_attn_interface.py), positional order included
SIGNATURES = {
    "flash_attn_func": [("q", _REQ), ("k", _REQ), ("v", _REQ)] + _TAIL,
    "flash_attn_qkvpacked_func": [("qkv", _REQ)] + _TAIL,
    "flash_attn_kvpacked_func": [("q", _REQ), ("kv", _REQ)] + _TAIL,
    "flash_attn_varlen_func": [("q", _REQ), ("k", _REQ), ("v", _REQ), ("cu_seqlens_q", _REQ),
                               ("cu_seqlens_k", _REQ), ("max_seqlen_q", _REQ),
                               ("max_seqlen_k", _REQ)] + _TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQ), ("cu_seqlens", _REQ),
                                         ("max_seqlen", _REQ)] + _TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", _REQ), ("kv", _REQ), ("cu_seqlens_q", _REQ),
                                        ("cu_seqlens_k", _REQ), ("max_seqlen_q", _REQ),
                                        ("max_seqlen_k", _REQ)] + _TAIL,
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signature_is_flash_attn_2s(name):
    fn = getattr(fa, name)
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind != p.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == SIGNATURES[name]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in positional)
    # beyond flash-attn 2's: only FlashAttention-3's FP8 descales, keyword only, default None
    extra = [(p.name, p.default) for p in params if p.kind == p.KEYWORD_ONLY]
    assert extra in ([], [("q_descale", None), ("k_descale", None), ("v_descale", None)])
    assert "(batch_size" in fn.__doc__ or "(total" in fn.__doc__    # shapes documented
    assert name in fa.__all__


def _rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)


def test_func_equals_flashcore_attention_and_returns_lse():
    q, k, v = _rand(2, 5, 4, 8), _rand(2, 6, 2, 8, seed=1), _rand(2, 6, 2, 8, seed=2)
    out = fa.flash_attn_func(q, k, v, 0.0, None, True)      # positional, as flash-attn code does
    ref, ref_lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, ref)
    res = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    o, lse, probs = res
    assert probs is None
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse)


def _grads(out, *inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out))


def test_qkvpacked_equals_unpacked_values_and_gradients():
    qkv = _rand(2, 5, 3, 4, 8)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, 0), softcap=1.0)
    (dqkv,) = _grads(out, qkv)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = fa.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), softcap=1.0)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dqkv, torch.stack(_grads(ref, q, k, v), dim=2))


def test_kvpacked_equals_unpacked_gqa():
    q, kv = _rand(2, 5, 4, 8), _rand(2, 7, 2, 2, 8, seed=3)
    slopes = torch.rand(4, dtype=torch.float32)
    out = fa.flash_attn_kvpacked_func(q, kv, alibi_slopes=slopes)
    dq, dkv = _grads(out, q, kv)
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    ref = fa.flash_attn_func(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref)
    rq, rk, rv = _grads(ref, q, k, v)
    torch.testing.assert_close(dq, rq)
    torch.testing.assert_close(dkv, torch.stack((rk, rv), dim=2))


def test_varlen_equals_one_dense_call_per_sequence():
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10], dtype=torch.int32)
    q, k, v = _rand(8, 4, 8), _rand(10, 2, 8, seed=1), _rand(10, 2, 8, seed=2)
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True,
                                                return_attn_probs=True)
    assert probs is None and lse.shape == (4, 8)
    for b in range(2):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = fa.flash_attn_func(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                          return_attn_probs=True)[:2]
        torch.testing.assert_close(out[sq], ref[0])
        torch.testing.assert_close(lse[:, sq], ref_lse[0])


def test_varlen_packed_variants_equal_unpacked():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qkv = _rand(8, 3, 4, 8)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    (dqkv,) = _grads(out, qkv)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    ref = fa.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dqkv, torch.stack(_grads(ref, q, k, v), dim=1))

    kv = _rand(8, 2, 2, 8, seed=4)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5)
    k2, v2 = (kv.detach()[:, i] for i in range(2))
    torch.testing.assert_close(out, fa.flash_attn_varlen_func(q, k2, v2, cu, cu, 5, 5))


@pytest.mark.parametrize("call", [
    lambda q, k, v: fa.flash_attn_func(q, k, v, 0.1),
    lambda q, k, v: fa.flash_attn_func(q, k, v, dropout_p=0.5),
    lambda q, k, v: fa.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), dropout_p=0.1),
    lambda q, k, v: fa.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), dropout_p=0.1),
    lambda q, k, v: fa.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 9], dtype=torch.int32),
                                              torch.tensor([0, 9], dtype=torch.int32), 9, 9,
                                              dropout_p=0.3)[None],
])
def test_dropout_drops_reproducibly_under_manual_seed(call):
    """dropout_p > 0: probabilities dropped (the output differs from dropout_p=0, and from a
    second draw), the same under the same torch.manual_seed, and differentiable."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    torch.manual_seed(7)
    a = call(q, k, v)
    torch.manual_seed(7)
    b = call(q, k, v)
    c = call(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, c)
    a.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_varlen_block_table_reads_a_paged_cache():
    """flash_attn_varlen_func with block_table (chunked prefill over a paged cache) equals the
    same call on the keys packed; with inputs requiring grad it is refused by name."""
    g = torch.Generator().manual_seed(3)
    page, lens_q, lens_k = 128, [5, 1, 9], [200, 7, 300]
    kc = torch.randn(8, page, 2, 16, generator=g)
    vc = torch.randn(8, page, 2, 16, generator=g)
    table = torch.tensor([[5, 1, 0], [7, 0, 0], [2, 6, 3]], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 16, generator=g)
    cu_q = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 207, 507], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 9, 300, causal=True,
                                    block_table=table)
    rows = torch.cat([table[b, torch.arange(n) // page] * page + torch.arange(n) % page
                      for b, n in enumerate(lens_k)])
    kp, vp = kc.reshape(-1, 2, 16)[rows], vc.reshape(-1, 2, 16)[rows]
    want = fa.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 9, 300, causal=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    # inputs that require grad are fine (flash-attn's own tests call it so); a backward
    # through the call raises, naming the argument
    out_g = fa.flash_attn_varlen_func(q.clone().requires_grad_(), kc, vc, cu_q, cu_k, 9, 300,
                                      causal=True, block_table=table)
    torch.testing.assert_close(out_g.detach(), out, atol=0, rtol=0)
    with pytest.raises(NotImplementedError, match="block_table.*forward only"):
        out_g.sum().backward()


def test_numpy_arrays_work_too():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)) for _ in range(3))
    out, lse, none = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and none is None
    np.testing.assert_allclose(out, flashcore.attention(q, k, v, causal=True))
