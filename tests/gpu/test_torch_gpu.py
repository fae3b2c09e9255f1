"""The torch layer on CUDA: zero-copy DLPack, torch's stream and device, gradients within the
flash-attn rule, CUDA graphs, torch.compile, a transformers model. Needs a GPU."""
import contextlib
import copy
import types

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


def _spy(monkeypatch, backend, method):
    seen = []
    orig = getattr(backend, method)

    def spy(*args, **kwargs):
        from flashcore.kernels import device
        # the stream the launchers take for these arrays, and the current device
        seen.append((args, kwargs, device.current_stream(device.lib_of(args[1]), args[1].device.id),
                     args[1].device.id))
        return orig(*args, **kwargs)
    monkeypatch.setattr(backend, method, spy)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_copy_inputs_and_outputs(monkeypatch, dtype):
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


def test_a_torch_process_never_imports_cupy():
    """The torch route makes its CUDA calls through flashcore.kernels.device (the driver,
    through ctypes), so a fresh process whose kernels are in the disk cache leaves CuPy
    unimported through forward, backward, varlen and decoding calls. (Compiling a kernel does
    import it: NVRTC's bindings. The first process here fills the cache.) On failure the
    stack of CuPy's first import is shown."""
    import subprocess
    import sys
    code = """
import sys, traceback
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "cupy" and "stack" not in Watch.__dict__:
            Watch.stack = "".join(traceback.format_stack(limit=25))
        return None
sys.meta_path.insert(0, Watch())
import torch, flashcore
q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
out = flashcore.attention(q, k, v, causal=True)
out.sum().backward()
cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
flashcore.varlen_attention(q[0].detach(), k[0].detach(), v[0].detach(), cu, cu, 200, 200)
kc = torch.randn(2, 1024, 4, 64, device="cuda", dtype=torch.bfloat16)
lens = torch.tensor([500, 1000], device="cuda", dtype=torch.int32)
flashcore.attention_with_kvcache(q[:, :1].detach(), kc, kc.clone(), cache_seqlens=lens)
torch.cuda.synchronize()
print("cupy" in sys.modules, sorted(m for m in sys.modules if m.startswith("cupy"))[:3])
print(getattr(Watch, "stack", ""))
"""
    for _ in range(2):      # (the first run may compile: it fills the disk cache)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == "False", r.stdout


def test_repeated_steps_replay_their_plans(monkeypatch):
    """After a layout's first step, forward and backward replay their launch plans, on the
    calling thread and on autograd's device thread alike (a thread with no current CUDA
    context gets the plan's: plans.enter): the backend's full path runs no more. (Run 23 found
    every backward on the full path, 1.4 ms a tiny step, when the device scope unbound the
    context again on autograd's thread.)"""
    from flashcore.backends import torch_ops
    q, k, v = _qkv()
    for _ in range(2):
        flashcore.attention(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    calls = []
    for name in ("forward", "backward"):
        orig = getattr(torch_ops._BACKEND, name)

        def spy(*a, _orig=orig, _name=name, **kw):
            calls.append(_name)
            return _orig(*a, **kw)
        monkeypatch.setattr(torch_ops._BACKEND, name, spy)
    for _ in range(5):
        flashcore.attention(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    assert calls == []


def test_runs_on_torchs_current_stream(monkeypatch):
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
def test_runs_on_the_tensors_device(monkeypatch):
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


@pytest.mark.parametrize("layout", ["heads_first", "seq_first"])
@pytest.mark.parametrize("s", [300, 1000])
@pytest.mark.parametrize("grad", [False, True])
def test_transformers_padded_batch_within_the_flash_attn_rule(grad, s, layout):
    """A padded batch through the transformers route (a prefill, or with ``grad`` a training
    step): the varlen packing on the GPU, gathering from transformers' (b, h, s, d) tensors,
    contiguous (``heads_first``, as transformers 5 hands them) or views of (b, s, h, d) memory.
    Rows: whole, left-padded, right-padded, with a hole. Each row's kept queries against
    float32 attention over its kept keys (causal among them), within the flash-attn rule, and
    the gradients within 3x; padded queries give exactly 0 and send no gradient."""
    from flashcore.integrations import transformers as fct
    b, h, hk, d = 4, 4, 2, 64
    g = torch.Generator(device="cuda").manual_seed(s)

    def make(heads):
        shape = (b, heads, s, d) if layout == "heads_first" else (b, s, heads, d)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        return x if layout == "heads_first" else x.transpose(1, 2)
    q, k, v = make(h), make(hk), make(hk)
    mask = torch.ones(b, s, dtype=torch.int64, device="cuda")
    mask[1, :s // 3] = 0
    mask[2, s - s // 4:] = 0
    mask[3, s // 5:s // 2] = 0
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    keep = mask.bool()
    layer = types.SimpleNamespace(is_causal=True)
    leaves = [x.detach().clone().requires_grad_(grad) for x in (q, k, v)]
    fct._SHARED.entries.clear()
    with torch.set_grad_enabled(grad):
        out = fct.flashcore_attention_forward(layer, *leaves, fct.padding_mask(
            attention_mask=mask, kv_length=s), scaling=d ** -0.5)[0]
        grads = torch.autograd.grad(out, leaves, dout) if grad else ()
    assert out.shape == (b, s, h, d) and out.is_contiguous()
    assert out[~keep].abs().max().item() == 0, "a padded query's output is not 0"

    def rows(upcast):
        """Each row's kept tokens through _attn_ref, and its gradients, as full tensors."""
        xs = [x.detach().float() if upcast else x.detach().clone() for x in (q, k, v)]
        xs = [x.requires_grad_(grad) for x in xs]
        res = torch.zeros(b, s, h, d, device="cuda")
        loss = 0
        with torch.set_grad_enabled(grad):
            for r in range(b):
                idx = keep[r].nonzero().flatten()
                qr, kr, vr = (x.transpose(1, 2)[r, idx][None] for x in xs)
                o = _attn_ref(qr, kr, vr, True, upcast)
                res[r, idx] = o[0].float().detach()
                loss = loss + (o[0].float() * dout[r, idx].float()).sum()
            return res, (torch.autograd.grad(loss, xs) if grad else ())
    ref, ref_grads = rows(True)
    low, low_grads = rows(False)
    assert _max_err(low[keep], ref[keep]) > 0
    assert _max_err(out[keep], ref[keep]) <= 2 * _max_err(low[keep], ref[keep]) + 1e-5
    for gr, r, lg in zip(grads, ref_grads, low_grads):
        assert _max_err(gr, r) <= 3 * _max_err(lg, r) + 1e-5
    if grad:
        assert grads[0].transpose(1, 2)[~keep].abs().max().item() == 0
        assert grads[1].transpose(1, 2)[~keep].abs().max().item() == 0


# ---------------- CUDA graphs: capture, replay, bit for bit ----------------

def _replay_matches(step, fill, deterministic_bits=True):
    """Capture ``step()`` (returning a tuple of tensors) in a CUDA graph after an eager warm-up
    on a side stream, then for two fresh inputs (``fill(seed)`` writes them in place) compare
    the replay with an eager call: bit for bit, or allclose when atomics reorder sums."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (11, 12):
        fill(seed)
        for t in captured:
            t.fill_(float("nan"))   # poison: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(captured, eager):
            if deterministic_bits:
                assert torch.equal(a, b), (a - b).abs().max()
            else:
                torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    return graph


def _refill(*tensors):
    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in tensors:
                t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
    return fill


@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_forward_and_backward(deterministic):
    q, k, v = _qkv(dtype=torch.bfloat16, sq=200, sk=333, h=8, hk=2, d=128)
    dout = torch.randn_like(q)

    def step():
        out, lse = flashcore.attention(q, k, v, causal=True, deterministic=deterministic,
                                       return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out, lse, dq, dk, dv
    _replay_matches(step, _refill(q, k, v, dout), deterministic_bits=deterministic)


def test_cuda_graph_varlen_forward_and_backward():
    lens = [37, 300, 1, 128]
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32,
                      device="cuda")
    total = int(sum(lens))
    mk = lambda h: torch.randn(total, h, 64, device="cuda", dtype=torch.float16).requires_grad_()  # noqa: E731
    q, k, v = mk(8), mk(2), mk(2)
    dout = torch.randn_like(q)

    def step():
        out = flashcore.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                         deterministic=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)
    _replay_matches(step, _refill(q, k, v, dout))


def _decode_case(paged, batch=3, cache=1000, page=256, h=32, hk=8, d=128, new=0, rotary=False,
                 dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=dtype)  # noqa: E731
    q = mk(batch, 1, h, d)
    seqlens = torch.tensor([(cache * (i + 1)) // (batch + 1) for i in range(batch)],
                           dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=seqlens, causal=True)
    if paged:
        blocks = -(-cache // page)
        kc, vc = mk(batch * blocks + 3, page, hk, d), mk(batch * blocks + 3, page, hk, d)
        perm = torch.randperm(batch * blocks + 3, generator=g, device="cuda")[:batch * blocks]
        kw["block_table"] = perm.view(batch, blocks).to(torch.int32)
    else:
        kc, vc = mk(batch, cache, hk, d), mk(batch, cache, hk, d)
    if new:
        kw["k"], kw["v"] = mk(batch, new, hk, d), mk(batch, new, hk, d)
        if rotary:
            ang = torch.rand(cache + new, d // 4, generator=g, device="cuda") * 6.28
            kw["rotary_cos"], kw["rotary_sin"] = ang.cos().to(dtype), ang.sin().to(dtype)
    return q, kc, vc, kw


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged256"])
@pytest.mark.parametrize("splits", [1, 0, 4, 12, 40], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("api", ["flashcore", "flash_attn"])
def test_cuda_graph_decode(paged, splits, api):
    """attention_with_kvcache / flash_attn_with_kvcache under torch.cuda.graph, cache_seqlens
    a CUDA tensor: every merge path (none, the cluster merge up to 16 splits, the global merge
    beyond), contiguous and paged."""
    from flashcore.flash_attn import flash_attn_with_kvcache
    q, kc, vc, kw = _decode_case(paged)

    def step():
        if api == "flashcore":
            out, lse = flashcore.attention_with_kvcache(q, kc, vc, num_splits=splits,
                                                        return_lse=True, **kw)
            return out, lse
        out = flash_attn_with_kvcache(q, kc, vc, num_splits=splits, **kw)
        return (out,)
    _replay_matches(step, _refill(q))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged256"])
@pytest.mark.parametrize("splits", [1, 0, 40], ids=lambda n: f"splits{n}")
def test_cuda_graph_decode_key_mask(paged, splits):
    """attention_with_kvcache with a key_mask (a CUDA bool tensor, refilled between replays)
    under torch.cuda.graph: replays equal eager calls bit for bit."""
    q, kc, vc, kw = _decode_case(paged)
    cap = kc.shape[1] if not paged else kw["block_table"].shape[1] * kc.shape[1]
    keep = torch.ones(q.shape[0], cap, dtype=torch.bool, device="cuda")

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda", dtype=q.dtype))
        keep.copy_(torch.rand(keep.shape, generator=g, device="cuda") < 0.6)

    def step():
        return (flashcore.attention_with_kvcache(q, kc, vc, num_splits=splits, key_mask=keep,
                                                 **kw),)
    _replay_matches(step, fill)


@pytest.mark.parametrize("route", ["positions", "key_mask", "left_padding"])
def test_cuda_graph_transformers_decoding_layers(route):
    """Two layers of a transformers decoding step through flashcore's attention function (the
    cache lengths from position_ids or from the mask, which the layers of an eager forward
    share) under torch.cuda.graph, the positions and the mask changed in place between
    replays: each layer's length ops are captured, so replays equal eager calls bit for bit.
    The static cache's written slots end well before its length (up to 600 of 1100), so an
    end taken otherwise under capture than eagerly would split the keys otherwise."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from flashcore.integrations import transformers as fct
    b, h, hk, sk, d = 3, 8, 2, 1100, 64
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.full((b, 1), sk - 1, device="cuda", dtype=torch.int64)
    mask = torch.ones(b, sk, device="cuda", dtype=torch.bool)
    forward = (fct.flashcore_attention_forward_left_padded if route == "left_padding"
               else fct.flashcore_attention_forward)

    class M(torch.nn.Module):
        is_causal = True

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda", dtype=q.dtype))
        n = torch.randint(100, 600, (b, 1), generator=g, device="cuda")
        pos.copy_(n - 1)
        mask.copy_(torch.arange(sk, device="cuda") < n)   # a static cache: slots past n unwritten
        if route == "left_padding":
            mask[:, :seed % 7] = False

    def step():
        m = None if route == "positions" else mask
        with torch.no_grad():
            return tuple(forward(M(), q, k, v, m, position_ids=pos)[0] for _ in range(2))
    fill(3)
    _replay_matches(step, fill)


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("extra", ["none", "key_mask", "leftpad"])
def test_kvcache_read_heads_first_replays_equal_the_full_call(extra, sq, monkeypatch):
    """The transformers route's read op on (b, h, s, d) tensors (heads_first): its first call
    runs in full and records a plan, later calls replay it (counted); every call's output
    (b, s, h, d), contiguous, equals attention_with_kvcache's on (b, s, h, d) copies bit for
    bit, with fresh values each call and each output poisoned before it is freed."""
    from flashcore.backends import torch_ops
    from flashcore.backends.torch_ops import kvcache_read
    replayed = []
    replay = torch_ops.replay

    def counted(torch_, plan, pointers, device):
        ok = replay(torch_, plan, pointers, device)
        replayed.append(ok and pointers[0] == q.data_ptr())
        return ok
    monkeypatch.setattr(torch_ops, "replay", counted)
    g = torch.Generator(device="cuda").manual_seed(21)
    b, h, hk, sk, d = 3, 16, 4, 700, 128
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa
    q, kc, vc = mk(b, h, sq, d), mk(b, hk, sk, d), mk(b, hk, sk, d)
    lens = torch.tensor([sk, 450, 123], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 40, 7], dtype=torch.int32, device="cuda") \
        if extra == "leftpad" else None
    mask = (torch.rand(b, sk, generator=g, device="cuda") < 0.7) if extra == "key_mask" else None
    for step in range(4):
        for t in (q, kc, vc):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype))
        got = kvcache_read(q, kc, vc, lens, leftpad, mask, True, 0.09, (-1, -1), 0.0,
                           heads_first=True)
        want = flashcore.attention_with_kvcache(
            q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(),
            vc.transpose(1, 2).contiguous(), cache_seqlens=lens, cache_leftpad=leftpad,
            key_mask=mask, causal=True, softmax_scale=0.09)
        assert got.shape == (b, sq, h, d) and got.is_contiguous()
        assert torch.equal(got, want), (step, (got.float() - want.float()).abs().max())
        assert got.isfinite().all() and got.abs().sum() > 0
        got.fill_(float("nan"))     # poisoned and freed: the next call's output likely reuses
        del got, want               # the block, so a replay that skipped a write would show
    assert sum(replayed) >= 3, replayed     # (the heads-first calls after the first replayed)


@pytest.mark.parametrize("extra", ["none", "key_mask", "leftpad"])
def test_kvcache_read_shared_binds_the_plan_for_calls_alike(extra, monkeypatch):
    """kvcache_read with ``shared`` (a forward's decoding layers in the transformers route):
    the first call binds its launch plan in the list; later calls alike launch it from there
    (counted: the bound log-sum-exp buffer is the one their launches write), and calls that
    differ go the usual way: another layout of q, another scale, another setting, a dispatch
    mode on (FlopCounterMode: the op must be seen). Every output equals
    attention_with_kvcache's bit for bit, with fresh values each call, poisoned afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    from flashcore.backends import torch_ops
    shared = []
    launched = []       # per replay: whether it wrote the bound log-sum-exp buffer
    replay = torch_ops.replay

    def counted(torch_, plan, pointers, device):
        ok = replay(torch_, plan, pointers, device)
        launched.append(bool(ok and shared and pointers[4] == shared[5].data_ptr()))
        return ok
    monkeypatch.setattr(torch_ops, "replay", counted)
    g = torch.Generator(device="cuda").manual_seed(22)
    b, h, hk, sk, d = 3, 16, 4, 700, 128
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa
    q, kc, vc = mk(b, h, 1, d), mk(b, hk, sk, d), mk(b, hk, sk, d)
    q_strided = mk(b, 1, h, d).transpose(1, 2)      # (b, h, 1, d) of other strides
    lens = torch.tensor([sk, 450, 123], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 40, 7], dtype=torch.int32, device="cuda") \
        if extra == "leftpad" else None
    mask = (torch.rand(b, sk, generator=g, device="cuda") < 0.7) if extra == "key_mask" else None
    setting = {"decode_cluster": not flashcore.config.get().decode_cluster}
    layers = ["alike", "alike", "strided_q", "alike", "scale", "setting", "mode", "alike"]
    bound_launches = []
    for i, kind in enumerate(layers):
        qq = q_strided if kind == "strided_q" else q
        for t in (qq, kc, vc):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype))
        scale = 0.1 if kind == "scale" else 0.09
        n = len(launched)
        with flashcore.config.override(**setting) if kind == "setting" else \
                contextlib.nullcontext(), \
                FlopCounterMode(display=False) if kind == "mode" else contextlib.nullcontext():
            got = torch_ops.kvcache_read(qq, kc, vc, lens, leftpad, mask, True, scale, (-1, -1),
                                         0.0, True, shared)
            want = flashcore.attention_with_kvcache(
                qq.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(),
                vc.transpose(1, 2).contiguous(), cache_seqlens=lens, cache_leftpad=leftpad,
                key_mask=mask, causal=True, softmax_scale=scale)
        assert len(shared) == 7, (i, kind)          # (bound by the first call)
        bound_launches.append(any(launched[n:]))
        assert got.shape == (b, 1, h, d) and got.is_contiguous()
        assert torch.equal(got, want), (i, kind, (got.float() - want.float()).abs().max())
        assert got.isfinite().all() and got.abs().sum() > 0
        got.fill_(float("nan"))
        del got, want
    assert bound_launches == [False, True, False, True, False, False, False, True], \
        list(zip(layers, bound_launches))


@pytest.mark.parametrize("extra", ["none", "key_mask"])
def test_kvcache_read_on_a_growing_cache_takes_its_plans_from_another_length(extra, monkeypatch):
    """A cache that grows by a key a call (a transformers DynamicCache: (b, hk, s, d),
    contiguous, concatenated anew each step), read through kvcache_read as the transformers
    route reads it: after the first length, a length whose launch is alike is not run in full
    but launched from the plan of another length written for it (Plan.for_length; counted:
    the backend's decode runs only where the launch differs). Every output equals a full run's
    (debug mode: no plan) bit for bit, at every length, with fresh values, poisoned afterwards."""
    from flashcore.backends import torch_ops
    full = []
    forward_kvcache = torch_ops._BACKEND.forward_kvcache

    def counted(*a, **k):
        full.append(1)
        return forward_kvcache(*a, **k)
    monkeypatch.setattr(torch_ops._BACKEND, "forward_kvcache", counted)
    g = torch.Generator(device="cuda").manual_seed(23)
    b, h, hk, d = 2, 16, 4, 128
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa
    kc, vc = mk(b, hk, 1000, d), mk(b, hk, 1000, d)
    lengths = list(range(1000, 1040)) + [1100, 2047, 2048, 2049, 5000, 5001]
    runs = []
    for n in lengths:
        grow = n - kc.shape[2]
        kc, vc = torch.cat([kc, mk(b, hk, grow, d)], 2), torch.cat([vc, mk(b, hk, grow, d)], 2)
        q = mk(b, h, 1, d)
        lens = torch.tensor([n, n - 37], dtype=torch.int32, device="cuda")
        mask = (torch.rand(b, n, generator=g, device="cuda") < 0.8) \
            if extra == "key_mask" else None
        k0 = len(full)
        got = torch_ops.kvcache_read(q, kc, vc, lens, None, mask, True, 0.09, (-1, -1), 0.0, True)
        runs.append(len(full) - k0)
        with flashcore.config.override(debug=True):    # (no plan: validated, run in full)
            want = torch_ops.kvcache_read(q, kc, vc, lens, None, mask, True, 0.09, (-1, -1), 0.0,
                                          True)
        assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        assert got.isfinite().all() and got.abs().sum() > 0
        got.fill_(float("nan"))
        del got, want
    assert runs[0] == 1 and sum(runs[1:40]) <= 4, runs


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged256"])
def test_cuda_graph_decode_in_place_append_with_rotary(paged):
    q, kc, vc, kw = _decode_case(paged, new=1, rotary=True)
    snap = (kc.clone(), vc.clone())

    def step():
        with torch.no_grad():       # the same cache state before every step
            kc.copy_(snap[0])
            vc.copy_(snap[1])
        out = flashcore.attention_with_kvcache(q, kc, vc, **kw)
        return out, kc, vc
    _replay_matches(step, _refill(q, kw["k"], kw["v"]))


def test_decode_with_device_lengths_never_syncs():
    """The default call reads no device array back: under a sync-debug mode that raises on
    synchronising operations the call still runs."""
    q, kc, vc, kw = _decode_case(True, new=1)
    flashcore.attention_with_kvcache(q, kc, vc, **kw)        # kernels compiled, plans recorded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashcore.attention_with_kvcache(q, kc, vc, **kw)
        out = flashcore.attention(*(_qkv(requires_grad=False)[:3]), causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.isfinite().all()


def test_bad_index_values_are_memory_safe_and_named_in_debug_mode():
    """Lengths past the cache, negative lengths and block indices past the pool: in default mode
    the call runs (the kernels clamp every address: compute-sanitizer's run of this test proves
    no access outside the arrays); in debug mode each is refused with its argument named."""
    from flashcore import config
    q, kc, vc, kw = _decode_case(True, batch=2, cache=512, new=1)
    bad = [dict(cache_seqlens=torch.tensor([5000, -7], dtype=torch.int32, device="cuda")),
           dict(block_table=torch.full_like(kw["block_table"], 10_000)),
           dict(block_table=torch.full_like(kw["block_table"], -3))]
    for b in bad:
        args = dict(kw, **b)
        out = flashcore.attention_with_kvcache(q, kc.clone(), vc.clone(), **args)
        torch.cuda.synchronize()
        assert out.shape == q.shape
        with config.override(debug=True):
            name = "cache_seqlens" if "cache_seqlens" in b else "block_table"
            with pytest.raises(ValueError, match=f"argument '{name}'"):
                flashcore.attention_with_kvcache(q, kc, vc, **args)
    qv = torch.randn(50, 4, 64, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 30, 9999], dtype=torch.int32, device="cuda")   # past the packed rows
    out = flashcore.varlen_attention(qv, qv, qv, cu, cu, 64, 64)
    torch.cuda.synchronize()
    with config.override(debug=True), pytest.raises(ValueError, match="argument 'cu_seqlens_q'"):
        flashcore.varlen_attention(qv, qv, qv, cu, cu, 64, 64)


def test_first_calls_from_threads_at_once():
    """Four threads whose first flashcore calls start together in a fresh process, each on its
    own stream: no import race, and the results equal the serial ones."""
    import subprocess
    import sys
    code = r"""
import threading, torch, flashcore
torch.manual_seed(0)
qs = [torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
res, errs = [None] * 4, []
barrier = threading.Barrier(4)
def work(i):
    try:
        s = torch.cuda.Stream()
        barrier.wait()
        with torch.cuda.stream(s):
            res[i] = flashcore.attention(qs[i], qs[i], qs[i], causal=True)
        s.synchronize()
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
assert not errs, errs
for i in range(4):
    assert torch.equal(res[i], flashcore.attention(qs[i], qs[i], qs[i], causal=True)), i
print("ok")
"""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_cupy_stream_capture_with_the_stream_ordered_pool():
    """CuPy users capture with cupy.cuda.Stream.begin_capture and CuPy's stream-ordered pool
    (MemoryAsyncPool): forward, backward and decode replay equal to eager calls."""
    import cupy
    pool = cupy.cuda.MemoryAsyncPool()
    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        rs = cupy.random.RandomState(3)
        mk = lambda *s: rs.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)  # noqa: E731
        q, k, v, do = mk(2, 150, 8, 64), mk(2, 190, 2, 64), mk(2, 190, 2, 64), mk(2, 150, 8, 64)
        kc, vc = mk(2, 700, 2, 64), mk(2, 700, 2, 64)
        qd = mk(2, 1, 8, 64)
        lens = cupy.array([333, 699], dtype=cupy.int32)

        # the outputs outlive the graph: preallocated, written in place; the scratch of each
        # call is allocated and freed inside the graph (stream-ordered pool)
        outs = dict(out=cupy.empty_like(q), lse=cupy.empty((2, 8, 150), cupy.float32),
                    dq=cupy.empty_like(q), dk=cupy.empty_like(k), dv=cupy.empty_like(v),
                    od=cupy.empty_like(qd), lsed=cupy.empty((2, 8, 1), cupy.float32))

        def step(o=outs):
            out, lse = flashcore.attention_forward(q, k, v, causal=True, out=o["out"],
                                                   lse=o["lse"])
            dq, dk, dv = flashcore.attention_backward(do, q, k, v, out, lse, causal=True,
                                                      deterministic=True, dq=o["dq"],
                                                      dk=o["dk"], dv=o["dv"])
            od = flashcore.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=4,
                                                  out=o["od"], lse=o["lsed"])
            return out, lse, dq, dk, dv, od
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            step()
            step()
            s.begin_capture()
            captured = step()
            graph = s.end_capture()
        for seed in (1, 2):
            rs2 = cupy.random.RandomState(seed)
            with s:   # (the new inputs on the graph's stream: s does not wait for the null one)
                for t in (q, k, v, do, qd):
                    t[...] = rs2.standard_normal(t.shape, dtype=cupy.float32).astype(t.dtype)
                graph.launch()
            s.synchronize()
            captured_now = [a.copy() for a in captured]
            eager = step({n: cupy.empty_like(a) for n, a in outs.items()})
            for a, b in zip(captured_now, eager):
                assert bool(cupy.array_equal(a, b, equal_nan=True))
    finally:
        cupy.cuda.set_allocator(prev)


@pytest.mark.parametrize("layout, world, causal", [("zigzag", 4, True), ("contiguous", 4, True),
                                                   ("zigzag", 2, False)])
def test_ring_chunked_schedule_on_one_gpu(layout, world, causal):
    """Ring attention's local work (flashcore.distributed.hop_forward over every rank's blocks,
    the code the ring runs, its in-place float32 merges and joined blocks) on one GPU, bf16:
    within the flash-attn rule of one call over the whole sequence, against float64."""
    from flashcore.distributed import _chunks, _hop_blocks, hop_forward, shard, unshard
    q, k, v = _qkv(b=1, sq=1024, sk=1024, h=4, hk=2, d=64, dtype=torch.bfloat16,
                   requires_grad=False)
    want = _sdpa(q, k, v, causal, dtype=torch.float64)
    one = flashcore.attention(q, k, v, causal=causal)
    per = len(_chunks(layout, world, 0))
    window = (-1, 0) if causal else (-1, -1)
    outs = []
    for rank in range(world):
        ql = shard(q, world, rank, layout).contiguous()
        acc = (torch.zeros(ql.shape, device="cuda"),
               torch.full((1, 4, ql.shape[1]), float("-inf"), device="cuda"))
        for step in range(world):
            src = (rank - step) % world
            hop_forward(acc, ql, shard(k, world, src, layout).contiguous(),
                        shard(v, world, src, layout).contiguous(),
                        _hop_blocks(layout, world, rank, src, window, ql.shape[1] // per), None)
        outs.append(acc[0])
    got = unshard(outs, layout).to(torch.bfloat16)
    err_one = (one.double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * err_one + 1e-6
