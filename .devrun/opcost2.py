import time, torch, cProfile, pstats, cupy, flashcore
from flashcore.backends import torch_backend as tb, get_backend
from flashcore.spec import forward_spec
from flashcore.kernels import plans
q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
spec = forward_spec(q, q, q, causal=True)
def bench(fn, n=3000):
    for _ in range(200): fn()
    torch.cuda.synchronize(); best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize(); best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best
def ontorch():
    with tb._OnTorch(torch, 0): pass
def dev_only():
    with cupy.cuda.Device(0): pass
def stream_only():
    tb._cupy_stream(torch, q.device)
def alloc_ctx():
    with cupy.cuda.using_allocator(tb._torch_allocator(torch, 0)): pass
def cp_fresh():
    tb._cp(torch.empty(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16))
cq = tb._cp(q); out = cupy.empty_like(cq); lse = cupy.empty((1, 2, 128), cupy.float32)
cb = get_backend("cupy"); cspec = tb._on_library(spec, "cupy")
def cupy_backend():
    cb.forward(cspec, cq, cq, cq, out=out, lse=lse)
plan = [p for p in plans.PLANS.values()] if plans.PLANS else None
with torch.no_grad():
    for name, fn in {"OnTorch": ontorch, "Device ctx": dev_only, "cupy_stream": stream_only,
                     "using_allocator": alloc_ctx, "_cp fresh": cp_fresh,
                     "cupy backend fwd": cupy_backend,
                     "torch backend fwd": lambda: tb._BACKEND.forward(spec, q, q, q),
                     "cupy public fwd": lambda: flashcore.attention_forward(cq, cq, cq, causal=True)}.items():
        print(f"{name:22s} {bench(fn):8.1f} us", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500): tb._BACKEND.forward(spec, q, q, q)
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
