"""The torch layer on CUDA: zero-copy DLPack, torch's stream and device, gradients within the
flash-attn rule, CUDA graphs, torch.compile, a transformers model. Needs a GPU."""
import copy

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")
import flashcore  # noqa: E402
from flashcore.backends import get_backend  # noqa: E402

_CUPY_REASON = get_backend("cupy").unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch"),
    pytest.mark.skipif(_CUPY_REASON is not None, reason=f"CuPy backend unavailable: {_CUPY_REASON}"),
]

DTYPES = [torch.float16, torch.bfloat16]


def _qkv(b=2, sq=128, sk=160, h=8, hk=2, d=64, dtype=torch.float16, device="cuda", seed=0,
         requires_grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def _sdpa(q, k, v, causal, dtype=None, math=True):
    """SDPA in (b, s, h, d) layout, bottom-right causal, optionally upcast; math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if dtype is not None:
        qt, kt, vt = (x.to(dtype) for x in (qt, kt, vt))
    g = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    mask = causal_lower_right(qt.shape[2], kt.shape[2]) if causal else None
    with sdpa_kernel(SDPBackend.MATH if math else SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


@pytest.fixture
def slow_path(monkeypatch):
    """Spying tests watch the full path (CupyBackend.forward/backward): the eager fast path
    (torch_backend._FAST), which replays earlier calls' launches, is off for them."""
    from flashcore.backends import torch_backend as tb
    monkeypatch.setitem(tb._FAST, "enabled", False)


def _spy(monkeypatch, backend, method):
    seen = []
    orig = getattr(backend, method)

    def spy(*args, **kwargs):
        import cupy
        seen.append((args, kwargs, cupy.cuda.get_current_stream().ptr, cupy.cuda.Device().id))
        return orig(*args, **kwargs)
    monkeypatch.setattr(backend, method, spy)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_copy_inputs_and_outputs(monkeypatch, slow_path, dtype):
    cb = get_backend("cupy")
    fwd, bwd = _spy(monkeypatch, cb, "forward"), _spy(monkeypatch, cb, "backward")
    base = torch.randn(2, 8, 128, 64, device="cuda", dtype=dtype)
    q = base.transpose(1, 2).requires_grad_()          # strided view, requires grad
    _, k, v = _qkv(dtype=dtype)
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    (args, kw, _, _), = fwd
    _spec, cq, ck, cv = args
    assert (cq.data.ptr, ck.data.ptr, cv.data.ptr) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert cq.data.ptr == base.data_ptr() and cq.strides == tuple(s * q.element_size() for s in q.stride())
    assert str(cq.dtype) == str(dtype).replace("torch.", "")
    assert kw["out"].data.ptr == out.data_ptr() and kw["lse"].data.ptr == lse.data_ptr()
    dout = torch.randn_like(out)
    out.backward(dout)
    (args, kw, _, _), = bwd
    assert args[1].data.ptr == dout.data_ptr()
    assert (kw["dq"].data.ptr, kw["dk"].data.ptr, kw["dv"].data.ptr) == \
        (q.grad.data_ptr(), k.grad.data_ptr(), v.grad.data_ptr())


def test_runs_on_torchs_current_stream(monkeypatch, slow_path):
    fwd = _spy(monkeypatch, get_backend("cupy"), "forward")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = _qkv(requires_grad=False, sq=1024, sk=1024)
        torch.cuda._sleep(10_000_000)                  # work queued ahead on the same stream
        q.mul_(2.0)
        out = flashcore.attention(q, k, v, causal=True)
        ref = _sdpa(q, k, v, True, torch.float32)
    s.synchronize()
    assert fwd[0][2] == s.cuda_stream
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device(monkeypatch, slow_path):
    fwd = _spy(monkeypatch, get_backend("cupy"), "forward")
    q, k, v = _qkv(device="cuda:1", requires_grad=False)
    out = flashcore.attention(q, k, v)
    assert out.device == torch.device("cuda:1") and fwd[0][3] == 1
    torch.testing.assert_close(out.float(), _sdpa(q, k, v, False, torch.float32), atol=2e-2, rtol=0)


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _attn_ref(q, k, v, causal, upcast):
    """flash-attn's attention_ref: explicit matmul/softmax, in float32 (upcast) or in the inputs'
    own precision (every intermediate rounded to it), bottom-right causal, GQA by repetition."""
    dt = q.dtype
    if upcast:
        q, k, v = (x.float() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.einsum("bhst,bthd->bshd", p, v).to(dt if not upcast else torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_within_the_flash_attn_rule(dtype, causal):
    q, k, v = _qkv(dtype=dtype)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    out = flashcore.attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _attn_ref(q32, k32, v32, causal, upcast=True)        # the truth, in float32
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    low = _attn_ref(q, k, v, causal, upcast=False)             # the same math in low precision
    low_grads = torch.autograd.grad(low, (q, k, v), dout)
    assert _max_err(low, ref) > 0, "the low-precision reference is not low precision"
    assert _max_err(out, ref) <= 2 * _max_err(low, ref) + 1e-5
    for g, r, lg in zip(grads, ref_grads, low_grads):
        assert _max_err(g, r) <= 3 * _max_err(lg, r) + 1e-5


def test_cuda_graph_capture_of_a_forward():
    q, k, v = _qkv(requires_grad=False)
    flashcore.attention(q, k, v, causal=True)                   # compile the kernels first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashcore.attention(q, k, v, causal=True)
    for seed in (1, 2):
        nq, nk, nv = _qkv(requires_grad=False, seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, flashcore.attention(q, k, v, causal=True))


def test_torch_compile_fullgraph_on_cuda():
    torch._dynamo.reset()
    q, k, v = _qkv(dtype=torch.bfloat16)

    def f(q, k, v):
        return flashcore.attention(q, k, v, causal=True).float().square().mean()
    loss = torch.compile(f, fullgraph=True)(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    f(q, k, v).backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_llama_bf16_matches_sdpa():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from flashcore.integrations import transformers as fct
    name = fct.register()
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).cuda().to(torch.bfloat16)
    ref = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).cuda().to(torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(name)
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    lo, lr = ours(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(lo.logits.float(), lr.logits.float(), atol=5e-2, rtol=5e-2)
    lo.loss.backward()
    lr.loss.backward()
    for (n, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
        scale = pr.grad.float().abs().max().item() + 1e-6
        assert _max_err(p.grad, pr.grad) <= 5e-2 * scale, n
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits.float(), lr.logits.float(), atol=5e-2, rtol=5e-2)


# ---------------- the eager fast path (torch_backend._fast_*, plans.Direct) ----------------

def _fast_calls(q, k, v, dout, grad, **kw):
    if not grad:
        with torch.no_grad():
            return flashcore.attention(q, k, v, return_lse=True, **kw)
    for x in (q, k, v):
        x.grad = None
    out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def _fast_entries():
    from flashcore.kernels import plans
    return [k for k in plans.PLANS if type(k) is tuple and str(k[0]).startswith("torch-")]


FAST_CASES = [dict(causal=True), dict(causal=False), dict(window_size=(37, 5)),
              dict(causal=True, softcap=30.0), dict(causal=True, deterministic=True)]


def _set_launch(monkeypatch, launch):
    """The fast path's replay: "native" (the C++ autograd node, built now), "direct" (the
    Python Function, cuLaunchKernel from Python) or "rawkernel" (the recorded plans' RawKernels)."""
    from flashcore.backends import torch_backend as tb
    from flashcore.backends import torch_native
    if launch == "native":
        torch_native.build()
    monkeypatch.setitem(tb._FAST, "native", launch == "native")
    monkeypatch.setitem(tb._FAST, "direct", launch != "rawkernel")


def _native_state(q, k, v, grad, **kw):
    """(forward record current?, its backward record id) of the native entry for this call."""
    from flashcore.backends import torch_backend as tb
    from flashcore.backends import torch_native
    from flashcore.kernels import plans
    fk = tb._fast_key(torch, q, k, v, kw.get("alibi_slopes"), None, kw.get("causal", False), None,
                      kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                      kw.get("deterministic", False), grad)
    e = plans.derived_get(fk)
    assert e is not None and e.native is not None and e.native >= 0
    st = torch_native.ops().entry_state(e.native)
    return st[-2], st[-1]


@pytest.mark.parametrize("launch", ["native", "direct", "rawkernel"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("kw", FAST_CASES + ["alibi"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_is_bitwise_the_full_path(monkeypatch, dtype, kw, grad, launch):
    """Same bits with the fast path (its replay: the C++ node, direct driver launches from
    Python, or the recorded plans' RawKernels) as with the full path, on a non-default stream
    with work queued ahead, GQA, after a layout change."""
    from flashcore.backends import torch_backend as tb
    from flashcore.kernels import plans
    _set_launch(monkeypatch, launch)
    plans.clear()
    if kw == "alibi":     # ALiBi slopes per head (a sixth pointer, saved for the backward)
        kw = dict(causal=True, alibi_slopes=torch.rand(8, device="cuda", dtype=torch.float32))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = _qkv(dtype=dtype, h=8, hk=2, requires_grad=grad)
        dout = torch.randn_like(q)
        monkeypatch.setitem(tb._FAST, "enabled", False)
        ref = _fast_calls(q, k, v, dout, grad, **kw)
        ref = [x.clone() for x in ref]
        assert not _fast_entries()
        monkeypatch.setitem(tb._FAST, "enabled", True)
        first = _fast_calls(q, k, v, dout, grad, **kw)          # full path, records
        assert len(_fast_entries()) == (2 if grad else 1)
        first = [x.clone() for x in first]
        torch.cuda._sleep(5_000_000)                            # queued work ahead on s
        q2, k2, v2 = (x.detach().clone().requires_grad_(grad) for x in (q, k, v))
        again = _fast_calls(q2, k2, v2, dout, grad, **kw)       # fast path, new pointers
        again = [x.clone() for x in again]
        torch.cuda._sleep(5_000_000)
        # native: the first replay's backward attached its record; this one replays it in C++
        again2 = _fast_calls(q2, k2, v2, dout, grad, **kw)
        again2 = [x.clone() for x in again2]
        if launch == "native":
            current, bwd = _native_state(q2, k2, v2, grad, **kw)
            assert current == 1 and (bwd >= 0) == grad
        n = len(_fast_entries())
        # a layout change: a strided q (a view of a (b, h, s, d) buffer) misses, runs in full
        qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(grad)
        changed = _fast_calls(qt, k2, v2, dout, grad, **kw)
        assert len(_fast_entries()) > n
        changed = [x.clone() for x in changed]
        changed2 = _fast_calls(qt, k2, v2, dout, grad, **kw)    # and replays that layout
    s.synchronize()
    # out and lse bitwise; gradients bitwise when deterministic (otherwise dQ is accumulated
    # with atomics, whose order may change the last bit from one run to the next)
    for i, (a, *others) in enumerate(zip(ref, first, again, again2, changed, changed2)):
        if i < 2 or kw.get("deterministic"):
            for j, x in enumerate(others):
                assert torch.equal(a, x), (i, j)
        else:
            for x in others:
                torch.testing.assert_close(x, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_node_gradient_layouts_create_graph_and_double_backward(monkeypatch, dtype):
    """The C++ node's backward: an incoming gradient of another layout (strided, expanded)
    misses its record and runs the Python backward, with the same values; create_graph=True
    works until the attention backward itself is differentiated, which is refused."""
    from flashcore.backends import torch_backend as tb
    _set_launch(monkeypatch, "native")
    monkeypatch.setitem(tb._FAST, "enabled", True)
    q, k, v = _qkv(dtype=dtype, h=4, hk=4, d=64, sq=96, sk=96, seed=3)
    dout = torch.randn_like(q)
    for _ in range(3):       # record, attach, replay
        out = flashcore.attention(q, k, v, causal=True)
        ref = torch.autograd.grad(out, (q, k, v), dout)
    assert _native_state(q, k, v, True, causal=True)[1] >= 0
    dstrided = dout.transpose(1, 2).contiguous().transpose(1, 2)      # same values, other strides
    for _ in range(2):
        out = flashcore.attention(q, k, v, causal=True)
        got = torch.autograd.grad(out, (q, k, v), dstrided)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    out = flashcore.attention(q, k, v, causal=True)
    (gs,) = torch.autograd.grad(out.float().sum(), (q,))               # expanded ones
    out = flashcore.attention(q, k, v, causal=True)
    (gd,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    torch.testing.assert_close(gs.float(), gd.float(), atol=2e-2, rtol=2e-2)
    out = flashcore.attention(q, k, v, causal=True)
    g = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    for a, b in zip(ref, g):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="double backward"):
        g[0].float().sum().backward()


def test_fast_path_still_validates_and_misses_on_options(monkeypatch):
    from flashcore.backends import torch_backend as tb
    monkeypatch.setitem(tb._FAST, "enabled", True)
    q, k, v = _qkv(requires_grad=False)
    with torch.no_grad():
        flashcore.attention(q, k, v, causal=True)
        flashcore.attention(q, k, v, causal=True)
        with pytest.raises(Exception):
            flashcore.attention(q, k, v, causal=True, softmax_scale=-1.0)
        with pytest.raises(Exception):
            flashcore.attention(q, k[..., :32], v, causal=True)
        a = flashcore.attention(q, k, v, window_size=(8, 0))     # other options: a miss
        b = flashcore.attention(q, k, v, causal=True)
    assert not torch.equal(a, b)


def test_fast_path_and_torch_compile_coexist(monkeypatch):
    from flashcore.backends import torch_backend as tb
    monkeypatch.setitem(tb._FAST, "enabled", True)
    q, k, v = _qkv(requires_grad=False)
    with torch.no_grad():
        eager = [flashcore.attention(q, k, v, causal=True) for _ in range(3)]
        f = torch.compile(lambda a, b, c: flashcore.attention(a, b, c, causal=True),
                          fullgraph=True)
        compiled = f(q, k, v)
    assert torch.equal(eager[0], eager[2]) and torch.equal(eager[0], compiled)


@pytest.mark.parametrize("launch", ["native", "direct"])
def test_fast_path_backward_with_saved_tensor_hooks(monkeypatch, launch):
    """Saved-tensor hooks (torch.autograd.graph.save_on_cpu) hand q, k, v, out and lse back to
    the backward in another layout than the forward's (contiguous copies of a strided q): the
    backward must not replay a record made for the forward's layouts."""
    import contextlib
    from flashcore.backends import torch_backend as tb
    _set_launch(monkeypatch, launch)
    monkeypatch.setitem(tb._FAST, "enabled", True)
    g = torch.Generator(device="cuda").manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float16)  # noqa: E731
    q = mk(2, 8, 96, 64).transpose(1, 2).requires_grad_()       # a strided (b, s, h, d) view
    k, v = (mk(2, 96, 8, 64).requires_grad_() for _ in range(2))
    dout = mk(2, 96, 8, 64)

    def step(hooks):
        for x in (q, k, v):
            x.grad = None
        with torch.autograd.graph.save_on_cpu() if hooks else contextlib.nullcontext():
            out = flashcore.attention(q, k, v, causal=True, deterministic=True)
        out.backward(dout)
        return [x.detach().clone() for x in (out, q.grad, k.grad, v.grad)]

    ref = [step(False) for _ in range(3)][-1]        # record, attach, replay
    for hooks in (True, True, False, True):          # the hooks' layouts: a miss, then replays
        got = step(hooks)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
