"""The torch layer on CPU: zero-copy hand-off to the NumPy backend, autograd, custom ops,
torch.compile. Runs in CI without a GPU."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")

import flashcore  # noqa: E402
from flashcore.backends import get_backend  # noqa: E402
from flashcore.reference import naive_backward, naive_forward  # noqa: E402
from flashcore.backends.torch_ops import DOUBLE_BACKWARD_MESSAGE, torch_ops  # noqa: E402
from flashcore.spec import forward_spec  # noqa: E402


def _qkv(b=2, sq=5, sk=7, h=4, hk=2, d=8, dtype=torch.float64, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def _np(t):
    return t.detach().numpy()


def test_importing_flashcore_does_not_import_torch():
    code = "import flashcore, sys; assert 'torch' not in sys.modules; print(flashcore.available_backends()['torch'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_numpy_oracle(dtype, causal):
    q, k, v = _qkv(dtype=dtype, requires_grad=False)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (2, 4, 5)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    spec = forward_spec(_np(q), _np(k), _np(v), causal=causal)
    ref_out, ref_lse = naive_forward(spec, _np(q), _np(k), _np(v))
    tol = 1e-3 if dtype == torch.float16 else 1e-6
    np.testing.assert_allclose(_np(out).astype(np.float64), ref_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(_np(lse), ref_lse, atol=1e-6, rtol=1e-6)


def _spy(monkeypatch, backend, method):
    seen = []
    orig = getattr(backend, method)

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return orig(*args, **kwargs)
    monkeypatch.setattr(backend, method, spy)
    return seen


def _ptr(a):
    return a.__array_interface__["data"][0]


def test_cpu_tensors_reach_the_numpy_backend_without_a_copy(monkeypatch):
    nb = get_backend("numpy")
    fwd = _spy(monkeypatch, nb, "forward")
    bwd = _spy(monkeypatch, nb, "backward")
    # q as a strided view (b, s, h, d) of (b, h, s, d) memory: still no copy
    qh = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    q = qh.transpose(1, 2).requires_grad_()
    _, k, v = _qkv()
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    (args, _), = fwd
    _spec, nq, nk, nv = args
    assert _ptr(nq) == q.data_ptr() == qh.data_ptr()
    assert nq.strides == tuple(s * 8 for s in q.stride())
    assert _ptr(nk) == k.data_ptr() and _ptr(nv) == v.data_ptr()
    dout = torch.randn_like(out)
    out.backward(dout)
    (args, _), = bwd
    _spec, ndout, nq, nk, nv, nout, nlse = args
    assert _ptr(ndout) == dout.data_ptr()
    assert (_ptr(nq), _ptr(nk), _ptr(nv)) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert _ptr(nout) == out.data_ptr() and _ptr(nlse) == lse.data_ptr()


def test_results_are_numpy_buffers_wrapped_by_torch(monkeypatch):
    nb = get_backend("numpy")
    returned = []
    orig = nb.forward

    def spy(*a, **kw):
        res = orig(*a, **kw)
        returned.append(res)
        return res
    monkeypatch.setattr(nb, "forward", spy)
    q, k, v = _qkv(requires_grad=False)
    out, lse = flashcore.attention_forward(q, k, v)
    (n_out, n_lse), = returned
    assert lse.data_ptr() == _ptr(n_lse)                     # wrapped, not copied
    assert out.is_contiguous() and lse.is_contiguous()


GRADCHECK_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa_causal": dict(causal=True),
    "window": dict(window_size=(2, 1)),
    "softcap": dict(softcap=1.5, softmax_scale=0.7),
    "alibi": dict(alibi_slopes="per_head", causal=True),
    "alibi_per_batch": dict(alibi_slopes="per_batch_head"),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_float64(case):
    kw = dict(GRADCHECK_CASES[case])
    hk = 2 if case.startswith("gqa") else 4
    q, k, v = _qkv(b=2, sq=4, sk=6, h=4, hk=hk, d=4)
    if kw.get("alibi_slopes") == "per_head":
        kw["alibi_slopes"] = torch.rand(4, dtype=torch.float32)
    elif kw.get("alibi_slopes") == "per_batch_head":
        kw["alibi_slopes"] = torch.rand(2, 4, dtype=torch.float32)
    assert torch.autograd.gradcheck(lambda q, k, v: flashcore.attention(q, k, v, **kw), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_varlen_float64(causal):
    g = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)    # includes an empty sequence
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q = torch.randn(7, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(11, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(11, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, dtype=torch.float32)
    f = lambda q, k, v: flashcore.varlen_attention(q, k, v, cu_q, cu_k, causal=causal,  # noqa: E731
                                                    alibi_slopes=slopes)
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_backward_matches_the_numpy_oracle_with_an_expanded_gradient():
    q, k, v = _qkv()
    out = flashcore.attention(q, k, v, causal=True)
    out.sum().backward()            # the incoming gradient is an expanded scalar (stride 0)
    spec = forward_spec(_np(q), _np(k), _np(v), causal=True)
    ref = naive_backward(spec, np.ones(q.shape), _np(q), _np(k), _np(v))
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        np.testing.assert_allclose(_np(got), want, atol=1e-10, rtol=1e-10)


def test_lse_is_not_differentiable():
    q, k, v = _qkv()
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    assert lse.grad_fn is None


def test_double_backward_is_refused():
    q, k, v = _qkv()
    out = flashcore.attention(q, k, v)
    (dq,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="flashcore: double backward is not supported"):
        dq.sum().backward()
    # a constant incoming gradient: the gradients still depend on q, k, v (refused, not
    # handed back as constants)
    out = flashcore.attention(q, k, v)
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out), create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="flashcore: double backward is not supported"):
        dq.sum().backward()
    assert DOUBLE_BACKWARD_MESSAGE.startswith("flashcore: double backward is not supported")


def test_no_grad_and_the_non_autograd_functions():
    q, k, v = _qkv()
    with torch.no_grad():
        out = flashcore.attention(q, k, v)
    assert not out.requires_grad
    out2, lse = flashcore.attention_forward(q, k, v)
    dq, dk, dv = flashcore.attention_backward(torch.ones_like(out2), q, k, v, out2, lse)
    assert all(isinstance(t, torch.Tensor) for t in (dq, dk, dv))
    assert dk.shape == k.shape


def test_bfloat16_on_cpu_is_refused_with_the_reason():
    q, k, v = _qkv(dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(flashcore.NotSupportedError, match="bfloat16 CPU tensors"):
        flashcore.attention(q, k, v)


def test_cuda_tensors_without_a_usable_gpu_are_explained():
    import dataclasses
    q, k, v = _qkv(dtype=torch.float16, requires_grad=False)
    spec = dataclasses.replace(forward_spec(q, k, v), device="cuda:0")
    reasons = get_backend("torch").not_supported_reasons(spec)
    if get_backend("cupy").unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    assert reasons and all("CUDA tensors run on the CuPy kernels" in r for r in reasons)
    spec32 = dataclasses.replace(spec, dtype="float32")
    assert get_backend("torch").not_supported_reasons(spec32)


def test_validation_happens_before_any_op():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="argument 'k'"):
        flashcore.attention(q, torch.randn(2, 7, 3, 8, dtype=q.dtype),
                            torch.randn(2, 7, 3, 8, dtype=q.dtype))     # 4 % 3 heads
    with pytest.raises(ValueError, match="contiguous last dimension"):
        flashcore.attention(torch.randn(2, 5, 4, 16, dtype=q.dtype)[..., ::2], k, v)
    with pytest.raises(flashcore.NotSupportedError):
        flashcore.attention(q, k, v, backend="numpy")       # numpy takes numpy arrays


def test_opcheck_forward_and_backward():
    # the ops are the non-differentiable layer (autograd is the Function above them, as in
    # flash-attn): checked with inputs that do not require grad
    ops = torch_ops()
    q, k, v = _qkv(dtype=torch.float32, requires_grad=False)
    fwd_args = (q, k, v, [0, 0, True, 0.3, -1, 0, 0.0, False])
    torch.library.opcheck(ops.fwd.default, fwd_args)
    out, lse = ops.fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse,
                [0, 0, True, 0.3, -1, 0, 0.0, False])
    torch.library.opcheck(ops.bwd.default, bwd_args)


def test_opcheck_varlen_with_alibi_window_softcap():
    ops = torch_ops()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 4, 8)
    k = torch.randn(7, 2, 8)
    v = torch.randn(7, 2, 8)
    torch.library.opcheck(ops.fwd.default, (q, k, v, [4, 4, True, 0.35, 2, 0, 3.0, False],
                                            torch.rand(4), cu, cu))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def f(q, k, v):
        return flashcore.attention(q, k, v, causal=True, softcap=2.0).sin().sum()

    q, k, v = _qkv(dtype=torch.float32)
    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = f(q, k, v)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_compile_first_call_and_varlen_fullgraph():
    """torch imported first, flashcore's first call inside torch.compile(fullgraph=True), varlen
    with explicit max_seqlen: compiles and matches eager."""
    import subprocess
    import sys
    code = r"""
import torch
import flashcore
q = torch.randn(10, 4, 16, dtype=torch.float64, requires_grad=True)
k = torch.randn(12, 2, 16, dtype=torch.float64, requires_grad=True)
cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
def f(q, k):
    return flashcore.varlen_attention(q, k, k, cu_q, cu_k, 7, 7, causal=True).square().sum()
c = torch.compile(f, fullgraph=True)(q, k)
gc = torch.autograd.grad(c, (q, k))
e = f(q, k)
ge = torch.autograd.grad(e, (q, k))
assert torch.allclose(c, e), (c, e)
assert all(torch.allclose(a, b) for a, b in zip(gc, ge))
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ---- the plain-options route names bad arguments as validation does (review findings) ----

def test_plain_route_still_names_bad_arguments():
    import flashcore
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="'k'"):
        flashcore.attention(q, q.numpy(), q)
    with pytest.raises(TypeError, match="'alibi_slopes'"):
        flashcore.attention(q, q, q, alibi_slopes=[0.1, 0.2])
    with pytest.raises(ValueError, match="'cu_seqlens_q'"):
        flashcore.varlen_attention(q[0], q[0], q[0], None, torch.tensor([0, 8], dtype=torch.int32),
                                   8, 8)
    with pytest.raises(TypeError, match="'k'"):
        flashcore.attention_forward(q, q.numpy(), q)


def test_kvcache_rotary_without_new_keys_is_refused_on_tensors():
    import flashcore
    q = torch.randn(2, 1, 4, 32, dtype=torch.float64)
    kc = torch.randn(2, 16, 2, 32, dtype=torch.float64)
    cos = torch.randn(16, 8, dtype=torch.float64)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="'rotary_cos'"):
        flashcore.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens, rotary_cos=cos,
                                         rotary_sin=cos)
    with pytest.raises(TypeError, match="'block_table'"):
        flashcore.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens,
                                         block_table=lens.numpy())


@pytest.mark.parametrize("heads_first", [False, True], ids=["bshd", "heads_first"])
@pytest.mark.parametrize("extra", ["none", "key_mask", "leftpad", "both", "not_plain", "grad"])
def test_kvcache_read_is_attention_with_kvcache(extra, heads_first):
    """torch_ops.kvcache_read (the transformers route's decoding steps) gives what
    attention_with_kvcache gives for the same call, bit for bit, from (b, s, h, d) tensors or
    (b, h, s, d) ones (heads_first, as transformers holds them); options that are not plain
    values go the whole way (named errors), and a cache that requires grad is read without
    a graph."""
    import flashcore
    from flashcore.backends.torch_ops import kvcache_read
    g = torch.Generator().manual_seed(11)
    b, sk, h, hk, d = 3, 13, 4, 2, 16
    q = torch.randn(b, 2, h, d, dtype=torch.float64, generator=g)
    kc, vc = (torch.randn(b, sk, hk, d, dtype=torch.float64, generator=g) for _ in range(2))
    lens = torch.tensor([5, 13, 9], dtype=torch.int32)
    leftpad = torch.tensor([0, 3, 2], dtype=torch.int32) if extra in ("leftpad", "both") else None
    mask = None
    if extra in ("key_mask", "both"):
        mask = torch.rand(b, sk, generator=g) > 0.3
        mask[:, 4] = True
    scale, window, cap = 0.3, (4, -1), 2.0
    if extra == "grad":
        kc.requires_grad_()
    want = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=leftpad,
                                            key_mask=mask, causal=True, softmax_scale=scale,
                                            window_size=window, softcap=cap)
    if heads_first:     # (b, h, s, d) tensors of their own, the values the same
        q, kc, vc = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                     for t in (q, kc, vc))
    if extra == "not_plain":
        with pytest.raises(TypeError, match="'softmax_scale'"):
            kvcache_read(q, kc, vc, lens, None, None, True, "0.3", window, cap,
                         heads_first=heads_first)
        scale = np.float64(scale)    # (not a plain float: validated in full, the same result)
    got = kvcache_read(q, kc, vc, lens, leftpad, mask, True, scale, window, cap,
                       heads_first=heads_first)
    assert got.shape == want.shape and got.is_contiguous()
    assert got.equal(want) and not got.requires_grad
    assert np.isfinite(got.detach().numpy()).all() and got.abs().sum() > 0


@pytest.mark.parametrize("op", ["kvcache_read", "fwd", "fwd_varlen", "explicit"])
@pytest.mark.parametrize("context", ["eager", "profiler", "flop_counter", "function_mode",
                                     "fake_tensors", "meta", "make_fx", "jit_trace", "vmap",
                                     "subclass_cache", "compile"])
def test_ops_go_through_the_dispatcher_when_anything_must_see_them(op, context, monkeypatch):
    """A plain eager decode call, a forward with nothing to differentiate (a prefill's layers,
    dense or varlen), or the functional forward and backward (``explicit``: the bwd op
    counted), runs the op's implementation directly (the dispatcher's round
    trip costs a decoding step ~4%); under the profiler, a dispatch mode (FlopCounterMode,
    FakeTensorMode, make_fx's), a torch function mode, torch.jit tracing, vmap or
    torch.compile, on meta tensors or with a tensor subclass among the arguments, the op is
    called, and the result is the same (fake and meta tensors: the fake's shapes)."""
    import flashcore
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flashcore.backends import torch_ops
    from flashcore.backends.torch_ops import kvcache_read
    torch_ops.torch_ops()
    calls = []
    name = {"kvcache_read": "kvcache_read", "explicit": "bwd"}.get(op, "fwd")
    overload = torch_ops._OVERLOADS[name]
    monkeypatch.setitem(torch_ops._OVERLOADS, name,
                        lambda *a: (calls.append(1), overload(*a))[1])
    g = torch.Generator().manual_seed(4)
    if op == "kvcache_read":
        q = torch.randn(2, 4, 1, 16, generator=g)
        kc, vc = (torch.randn(2, 2, 20, 16, generator=g) for _ in range(2))
        lens = torch.tensor([20, 9], dtype=torch.int32)

        def call(q, kc, vc, lens):
            return kvcache_read(q, kc, vc, lens, None, None, True, 0.25, (-1, -1), 0.0,
                                heads_first=True)
    elif op == "fwd":
        q = torch.randn(2, 9, 4, 16, generator=g)
        kc, vc = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
        lens = torch.zeros(1)       # (unused)

        def call(q, kc, vc, lens):
            return flashcore.attention(q, kc, vc, causal=True)
    elif op == "fwd_varlen":
        q = torch.randn(18, 4, 16, generator=g)
        kc, vc = (torch.randn(18, 2, 16, generator=g) for _ in range(2))
        lens = torch.tensor([0, 5, 18], dtype=torch.int32)

        def call(q, kc, vc, lens):
            return flashcore.varlen_attention(q, kc, vc, lens, lens, 13, 13, causal=True)
    else:
        q = torch.randn(2, 9, 4, 16, generator=g)
        kc, vc = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
        lens = torch.zeros(1)       # (unused)

        def call(q, kc, vc, lens):
            out, lse = flashcore.attention_forward(q, kc, vc, causal=True)
            return flashcore.attention_backward(out, q, kc, vc, out, lse, causal=True)[0]
    want = call(q, kc, vc, lens)
    assert not calls         # (eager: the implementation, directly)

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    if context == "eager":
        got = call(q, kc, vc, lens)
    elif context == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = call(q, kc, vc, lens)
        assert any(f"flashcore::{name}" in e.name for e in prof.events())
    elif context == "flop_counter":
        with FlopCounterMode(display=False):
            got = call(q, kc, vc, lens)
    elif context == "function_mode":
        with Passing():
            got = call(q, kc, vc, lens)
    elif context == "fake_tensors":
        with FakeTensorMode() as mode:
            fq, fkc, fvc, flens = (mode.from_tensor(t) for t in (q, kc, vc, lens))
            got = call(fq, fkc, fvc, flens)
        assert got.shape == want.shape and got.dtype == want.dtype
    elif context == "meta":
        got = call(*(t.to("meta") for t in (q, kc, vc, lens)))
        assert got.shape == want.shape and got.device.type == "meta"
    elif context == "make_fx":      # (real tensors, make_fx's proxy mode on)
        from torch.fx.experimental.proxy_tensor import make_fx
        gm = make_fx(call, tracing_mode="real")(q, kc, vc, lens)
        assert f"flashcore.{name}" in str(gm.graph)
        got = gm(q, kc, vc, lens)
    elif context == "jit_trace":
        got = torch.jit.trace(call, (q, kc, vc, lens), check_trace=False)(q, kc, vc, lens)
    elif context == "vmap":
        import warnings
        with warnings.catch_warnings():     # (no batching rule: vmap's loop over the op)
            warnings.simplefilter("ignore")
            got = torch.vmap(lambda x: call(x, kc, vc, lens))(torch.stack([q, q]))[1]
    elif context == "subclass_cache":       # (one argument a subclass, q plain)
        class Sub(torch.Tensor):
            pass
        got = call(q, kc, vc.as_subclass(Sub), lens).as_subclass(torch.Tensor)
    else:
        calls.clear()
        torch._dynamo.reset()
        got = torch.compile(call, backend="eager", fullgraph=True)(q, kc, vc, lens)
    if context == "eager":
        assert not calls
    elif context != "compile":   # (compiled: the op is in the graph, not called through _OVERLOADS)
        assert calls
    if context not in ("fake_tensors", "meta"):
        assert got.equal(want)


@pytest.mark.parametrize("varlen", [False, True])
def test_a_training_step_calls_the_ops_implementations_unless_anything_must_see_them(
        varlen, monkeypatch):
    """The autograd Function's forward and backward run the fwd and bwd ops' implementations
    directly in a plain eager step (torch_ops._run); under the profiler both ops are called
    through the dispatcher; the gradients are the same bit for bit either way."""
    import flashcore
    from flashcore.backends import torch_ops
    torch_ops.torch_ops()
    calls = []
    for name in ("fwd", "bwd"):
        overload = torch_ops._OVERLOADS[name]
        monkeypatch.setitem(torch_ops._OVERLOADS, name,
                            lambda *a, n=name, o=overload: (calls.append(n), o(*a))[1])
    g = torch.Generator().manual_seed(8)
    if varlen:
        q = torch.randn(18, 4, 16, generator=g)
        k, v = (torch.randn(18, 2, 16, generator=g) for _ in range(2))
        cu = torch.tensor([0, 5, 18], dtype=torch.int32)
    else:
        q = torch.randn(2, 9, 4, 16, generator=g)
        k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))

    def step():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashcore.varlen_attention(*x, cu, cu, 13, 13, causal=True) if varlen else \
            flashcore.attention(*x, causal=True)
        (out * out).sum().backward()
        return [out.detach()] + [t.grad for t in x]

    direct = step()
    assert not calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        seen = step()
    assert calls == ["fwd", "bwd"]
    assert all(a.equal(b) for a, b in zip(direct, seen))
    assert all(t.abs().sum() > 0 for t in direct)


def test_opcheck_kvcache_read_heads_first():
    """The read op with (b, h, s, d) tensors (options' ninth entry): its fake gives the real
    output's (b, s, h, d) shape and the lse's (b, h, s), opcheck's tests pass, and the outputs
    equal the (b, s, h, d) call's bit for bit; a 3D tensor is refused by name."""
    from flashcore.backends.torch_ops import torch_ops
    ops = torch_ops()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 32, generator=g)
    kc, vc = (torch.randn(2, 2, 40, 32, generator=g) for _ in range(2))
    lens = torch.tensor([7, 40], dtype=torch.int32)
    mask = torch.rand(2, 40, generator=g) > 0.2
    opts = [0.0, 0.0, 1.0, 0.2, -1.0, 0.0, 0.0, 0.0]
    args = (q, kc, vc, lens, opts + [1.0], None, mask)
    torch.library.opcheck(ops.kvcache_read.default, args)
    out, lse = ops.kvcache_read(*args)
    want = ops.kvcache_read(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), lens,
                            opts, None, mask)
    assert out.shape == (2, 3, 4, 32) and out.is_contiguous() and lse.shape == (2, 4, 3)
    assert out.equal(want[0]) and lse.equal(want[1]) and out.abs().sum() > 0
    with pytest.raises(ValueError, match="'k_cache'"):
        ops.kvcache_read(q, kc[0], vc, lens, opts + [1.0])


@pytest.mark.parametrize("alias", ["qkv", "kv", "qk"])
def test_one_tensor_passed_as_several_arguments_gets_the_summed_gradient(alias):
    """q is k is v (self-attention on one tensor), k is v, q is k: the Function's inputs are
    deduplicated and each tensor receives the sum of the gradients of its roles."""
    import flashcore
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 9, 2, 16, dtype=torch.float64, generator=g)
    y = torch.randn(1, 9, 2, 16, dtype=torch.float64, generator=g)
    do = torch.randn(1, 9, 2, 16, dtype=torch.float64, generator=g)
    a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
    args = {"qkv": (a, a, a), "kv": (b, a, a), "qk": (a, a, b)}[alias]
    flashcore.attention(*args, causal=True).backward(do)
    ref = [t.detach().clone().requires_grad_() for t in args]
    flashcore.attention(*ref, causal=True).backward(do)
    want_a = sum(r.grad for r, t in zip(ref, args) if t is a)
    torch.testing.assert_close(a.grad, want_a, atol=1e-12, rtol=0)
    if alias != "qkv":
        want_b = sum(r.grad for r, t in zip(ref, args) if t is b)
        torch.testing.assert_close(b.grad, want_b, atol=1e-12, rtol=0)


def test_a_growing_cache_takes_its_plan_from_another_length(monkeypatch):
    """torch_ops' length-free key (_length_free_key): the decode key of a contiguous cache
    (heads first or not) with the cache's length left out and nothing else; None for a cache
    that is not contiguous, a mask of another length, a paged call or the append op. And
    _other_length asks the plan kept under it for the call's length with the cache's strides
    in the launcher's (batch, seq, heads, headdim) order (CPU tensors, a stand-in plan)."""
    import types

    from flashcore import config, jit
    from flashcore.backends import torch_ops
    from flashcore.kernels import plans
    g = torch.Generator().manual_seed(9)

    def call(n, heads_first=True, masked=True, **over):
        q = torch.randn(2, 4, 1, 8, generator=g)
        kc = torch.randn(2, 2, n, 8) if heads_first else torch.randn(2, n, 2, 8)
        vc = torch.randn(kc.shape)
        mask = (torch.rand(2, n, generator=g) < 0.5) if masked else None
        c = dict(q=q, kc=kc, vc=vc, lens=torch.tensor([n, 3], dtype=torch.int32), mask=mask,
                 block_table=None, rest=None, heads_first=heads_first)
        c.update(over)
        opts = (0, False, True, 0.35, -1, 0, 0.0, 0) + ((True,) if c["heads_first"] else ())
        key = torch_ops._kvcache_key(c["q"], c["kc"], c["vc"], c["lens"], opts, config.get(),
                                     c["block_table"], c["mask"], None, c["rest"])
        free = torch_ops._length_free_key(key, c["kc"], c["vc"], c["heads_first"], c["mask"],
                                          c["block_table"], c["rest"])
        return key, free, c

    for hf in (True, False):
        for masked in (True, False):
            (k1, f1, _), (k2, f2, _) = call(700, hf, masked), call(701, hf, masked)
            assert k1 != k2 and f1 is not None and f1 == f2
            assert f1 != call(700, not hf, masked)[1] and f1 != call(700, hf, not masked)[1]
    assert call(700, q=torch.randn(2, 4, 1, 8).double())[1] != call(700)[1]
    assert call(700, kc=torch.randn(2, 2, 8, 700).transpose(2, 3))[1] is None
    assert call(700, mask=torch.rand(2, 701) < 0.5)[1] is None
    assert call(700, mask=(torch.rand(700, 2) < 0.5).t())[1] is None
    assert call(700, block_table=torch.zeros(2, 3, dtype=torch.int32))[1] is None
    assert call(700, rest=(None,) * 5)[1] is None
    assert call(700, heads_first=None)[1] is None
    asked = []
    made = types.SimpleNamespace(generation=jit.generation())
    kept = types.SimpleNamespace(generation=jit.generation(),
                                 for_length=lambda *a: asked.append(a) or made)
    monkeypatch.setattr(plans, "PLANS", {})
    monkeypatch.setattr(torch_ops, "PLANS", plans.PLANS)
    for hf in (True, False):
        asked.clear()
        plans.PLANS.clear()
        key, free, c = call(901, hf)
        assert torch_ops._other_length(key, free, c["kc"], c["vc"], hf, c["mask"]) is None
        plans.PLANS[free] = kept
        assert torch_ops._other_length(key, free, c["kc"], c["vc"], hf, c["mask"]) is made
        assert asked == [(901, (2 * 901 * 8, 8, 901 * 8, 1) if hf else (901 * 16, 16, 8, 1),
                          (2 * 901 * 8, 8, 901 * 8, 1) if hf else (901 * 16, 16, 8, 1), 901)]
        assert plans.PLANS[key] is made and plans.PLANS[free] is made


def test_a_bound_read_launches_only_what_it_was_bound_to(monkeypatch):
    """torch_ops._bound_read (kvcache_read's ``shared`` list, bound by a forward's first
    decoding layer): a call like the bound one launches the bound plan with its addresses in
    the plan's role order and the list's log-sum-exp buffer; a call that differs in any one
    respect the plan's key would have told -- the lengths, left-padding or mask tensor, an
    option, q's strides or dtype, the settings, plans switched off, kernels reloaded -- or that
    something must see (a dispatch mode, a tensor subclass, a gradient wanted) is not launched
    (None: the caller goes the usual way). (CPU tensors and a stand-in plan: the launch is
    recorded, not made.)"""
    import types

    from torch.utils.flop_counter import FlopCounterMode

    from flashcore import config, jit
    from flashcore.backends import torch_ops
    from flashcore.kernels import plans
    launched = []
    monkeypatch.setattr(torch_ops, "replay",
                        lambda torch_, plan, ptrs, dev: launched.append(ptrs) or True)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 1, 8, generator=g)
    kc, vc = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    lens = torch.tensor([9, 5], dtype=torch.int32)
    mask = torch.rand(2, 9, generator=g) < 0.5
    lse = torch.empty(2, 4, 1)
    args = (True, 0.35, (-1, 0), 0.0, True)
    shared = [types.SimpleNamespace(generation=jit.generation()), config.get(),
              (lens, None, mask), args, torch_ops._bound_layout(q, kc, vc), lse, True]

    def read(q=q, kc=kc, vc=vc, lens=lens, leftpad=None, mask=mask, args=args):
        n = len(launched)
        out = torch_ops._bound_read(torch, shared, q, kc, vc, lens, leftpad, mask, args)
        assert (out is not None) == (len(launched) == n + 1)
        return out

    out = read()
    assert out.shape == (2, 1, 4, 8) and out.dtype == q.dtype
    assert launched[-1] == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(),
                            lse.data_ptr(), lens.data_ptr(), 0, 0, 0, 0, 0, mask.data_ptr())
    grad_k = kc.clone().requires_grad_()
    with torch.no_grad():
        assert read(kc=grad_k) is not None          # (no gradient wanted: launched)
    differing = {
        "an equal lengths tensor": dict(lens=lens.clone()),
        "left padding": dict(leftpad=torch.zeros(2, dtype=torch.int32)),
        "no mask": dict(mask=None),
        "another scale": dict(args=(True, 0.36, (-1, 0), 0.0, True)),
        "another window": dict(args=(True, 0.35, (3, 0), 0.0, True)),
        "q of other strides": dict(q=torch.randn(2, 1, 4, 8).transpose(1, 2)),
        "q of another dtype": dict(q=q.double()),
        "k_cache of another length": dict(kc=torch.randn(2, 2, 10, 8)),
        "k_cache of other strides": dict(kc=torch.randn(2, 9, 2, 8).transpose(1, 2)),
        "v_cache of other strides": dict(vc=torch.randn(2, 9, 2, 8).transpose(1, 2)),
        "v_cache of another dtype": dict(vc=vc.double()),
        "q at another alignment": dict(q=torch.randn(2 * 4 * 8 + 1)[1:].view(2, 4, 1, 8)),
        "k_cache at another alignment": dict(
            kc=torch.randn(2 * 2 * 9 * 8 + 1)[1:].view(2, 2, 9, 8)),
        "q of another batch": dict(q=q[:1]),
        "k_cache shorter, of the same strides": dict(kc=kc[:, :, :8]),
        "k_cache of another dtype": dict(kc=kc.double()),
        "k_cache a subclass": dict(kc=torch.nn.Parameter(kc.clone(), requires_grad=False)),
        "v_cache a subclass": dict(vc=torch.nn.Parameter(vc.clone(), requires_grad=False)),
        "q on another device": dict(q=q.to("meta")),
        "k_cache on another device": dict(kc=kc.to("meta")),
        "v_cache on another device": dict(vc=vc.to("meta")),
        "q heads-last against a heads-first binding": dict(q=q.transpose(1, 2).contiguous()),
        "a subclass": dict(q=torch.nn.Parameter(q.clone(), requires_grad=False)),
        "a gradient wanted": dict(kc=grad_k),
    }
    for name, kw in differing.items():
        assert read(**kw) is None, name
    toggled = {"decode_cluster": not config.get().decode_cluster}
    for name, ctx in (("another setting", lambda: config.override(**toggled)),
                      ("a dispatch mode", lambda: FlopCounterMode(display=False)),
                      ("plans off", lambda: _plans_off(plans)),
                      ("kernels reloaded", lambda: _generation_bumped(jit))):
        with ctx():
            assert read() is None, name
    assert read() is not None       # (and like the bound call again afterwards)


def _plans_off(plans):
    import contextlib

    @contextlib.contextmanager
    def off():
        plans.set_enabled(False)
        try:
            yield
        finally:
            plans.set_enabled(True)
    return off()


def _generation_bumped(jit):
    import contextlib

    @contextlib.contextmanager
    def bumped():
        jit._GENERATION[0] += 1
        try:
            yield
        finally:
            jit._GENERATION[0] -= 1
    return bumped()


@pytest.mark.parametrize("made_by", ["a plan launched", "a plan recorded"])
def test_a_forwards_first_read_binds_the_plan_it_ran(made_by, monkeypatch):
    """kvcache_read with an empty ``shared`` list (a forward's first decoding layer): the call
    launches its plan (or records one), and binds that plan with the settings it was keyed
    under, making no key a second time; the next layer's call, alike, launches the bound plan
    with no key made at all. (CPU tensors read as CUDA ones; the launch and the recording are
    stand-ins: nothing runs on a device.)"""
    import contextlib
    import types

    from flashcore import config, jit
    from flashcore.backends import torch_ops
    from flashcore.kernels import plans
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    launched, keys = [], []
    monkeypatch.setattr(torch_ops, "replay",
                        lambda torch_, plan, ptrs, dev: launched.append((plan, ptrs)) or True)
    real_key = torch_ops._kvcache_key
    monkeypatch.setattr(torch_ops, "_kvcache_key",
                        lambda *a, **k: keys.append(1) or real_key(*a, **k))
    plan = types.SimpleNamespace(generation=jit.generation(), relength=None)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g)            # (batch, heads, seq, headdim)
    kc, vc = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    lens = torch.tensor([9, 9], dtype=torch.int32)
    mask = torch.rand(2, 9, generator=g) < 0.5
    mask[:, -1] = True
    call = (q, kc, vc, lens, None, mask, True, 0.35, (-1, -1), 0.0, True)
    plans.clear()
    if made_by == "a plan launched":
        options = (0, False, True, 0.35, -1, 0, 0.0, 0, True)
        plans.remember(real_key(q, kc, vc, lens, options, config.get(), None, mask, None), plan)
    else:
        class Recording:
            def plan(self, roles, device):
                return plan

        class StandIn:
            @staticmethod
            def forward_kvcache(spec, q, *a, **k):
                return (torch.empty(q.shape, dtype=q.dtype),
                        torch.empty(spec.attn.batch, spec.attn.nheads, spec.attn.seqlen_q))
        monkeypatch.setattr(plans, "record", lambda: contextlib.nullcontext(Recording()))
        monkeypatch.setattr(torch_ops, "_BACKEND", StandIn())
        monkeypatch.setattr(torch_ops, "choose_kvcache", lambda *a, **k: None)
    shared = []
    try:
        torch_ops.kvcache_read(*call, shared=shared)
        assert len(keys) == 1, "the first read made its key more than once"
        assert shared and shared[0] is plan and shared[1] is config.get()
        assert len(launched) == (made_by == "a plan launched")
        torch_ops.kvcache_read(*call, shared=shared)
        assert len(keys) == 1, "the bound read made a key"
        assert launched[-1][0] is plan and launched[-1][1][4] == shared[5].data_ptr()
    finally:
        plans.clear()
