"""Where the per-call host time of the torch path goes, against baselines that bound it
(a diagnostic for the per-call overhead target: a few microseconds over the CuPy backend).

Rows, each the best of 5 x N calls on a tiny problem (1 x 128 x 2 x 64 bf16, causal):
  cupy fwd / fwd+bwd          flashcore on CuPy arrays (the reference)
  torch fwd / fwd+bwd         flashcore.attention on torch tensors (no grad / autograd), the
                              fast path's replay in the C++ node (torch_native), when it builds
  torch ..., Python node      the same with the replay in the Python autograd Function
  sdpa fwd / fwd+bwd          torch SDPA (C++ autograd node): torch's own floor
  Function noop fwd+bwd       a Python autograd.Function whose forward and backward launch
                              one tiny CuPy kernel each: the floor of any Python custom op
  torch ... (full path)       the same torch calls with the eager fast path off
                              (torch_backend.set_fast_path(False)): every call validated,
                              CuPy views, launcher
  torch ... (fast, RawKernel) the fast path launching through the recorded plans' RawKernels
  pieces                      forward_spec, choose, _cp, _cupy_stream, torch.empty, the raw
                              stream query, a fast-path key
  summary                     torch over cupy (fwd, fwd+bwd), and over the noop Function floor
    python tests/diagnostics/overhead_breakdown.py [N]
"""
from __future__ import annotations

import sys
import time


def main(n=1000):
    import cupy
    import torch
    import torch.nn.functional as F

    from flashcore.backends import torch_backend as tb
    from flashcore.bench import per_call_us, per_call_us_interleaved, tiny_calls
    from flashcore.backends.base import choose
    import flashcore
    from flashcore.kernels import plans
    from flashcore.spec import forward_spec

    from flashcore.backends import torch_native
    try:
        torch_native.build()
    except RuntimeError as exc:
        print(f"# native node unavailable: {exc}")
    print(f"# native node: {torch_native.status()}")
    dev = torch.device("cuda")
    calls, (q, k, v, do) = tiny_calls()

    def python_node(fn):
        def go():
            tb._FAST["native"] = False
            try:
                fn()
            finally:
                tb._FAST["native"] = True
        return go
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    rows = []

    def row(name, fn):
        rows.append((name, per_call_us(fn, n, warmup=20)))

    def sdpa_f():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def sdpa_fb():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(o, (qt, kt, vt), dot)

    noop = cupy.ElementwiseKernel("T x", "T y", "y = x", "flashcore_noop_copy")

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = torch.empty_like(x)
            with tb._cupy_stream(torch, x.device):
                noop(tb._cp(x), tb._cp(out))
            return out

        @staticmethod
        def backward(ctx, g):
            gi = torch.empty_like(g)
            with tb._cupy_stream(torch, g.device):
                noop(tb._cp(g), tb._cp(gi))
            return gi

    xq = q.float().requires_grad_()
    gq = do.float()

    def noop_fb():
        torch.autograd.grad(Noop.apply(xq), (xq,), gq)

    def with_fast(enabled, direct, fn):
        def go():
            tb.set_fast_path(enabled, direct)
            try:
                row_us = per_call_us(fn, n, warmup=20)
            finally:
                tb.set_fast_path(True, True)
            return row_us
        return go

    # the comparison that the target is about, interleaved round by round (the host's speed
    # drifts between rounds; each row is its best round)
    head = per_call_us_interleaved({
        "cupy fwd": calls["cupy_fwd"], "torch fwd (no grad)": calls["torch_fwd"],
        "sdpa fwd (no grad)": sdpa_f, "cupy fwd+bwd": calls["cupy_fwdbwd"],
        "torch fwd+bwd (autograd)": calls["torch_fwdbwd"], "sdpa fwd+bwd (autograd)": sdpa_fb,
        "Function noop fwd+bwd": noop_fb,
        "torch fwd (no grad), Python node": python_node(calls["torch_fwd"]),
        "torch fwd+bwd (autograd), Python node": python_node(calls["torch_fwdbwd"])},
        n, warmup=20)
    rows.extend((f"[interleaved] {k}", v) for k, v in head.items())
    row("cupy fwd", calls["cupy_fwd"])
    rows.append(("torch fwd (no grad), full path", with_fast(False, True, calls["torch_fwd"])()))
    rows.append(("torch fwd (no grad), fast RawKernel",
                 with_fast(True, False, calls["torch_fwd"])()))
    row("torch fwd (no grad)", calls["torch_fwd"])
    row("sdpa fwd (no grad)", sdpa_f)
    row("cupy fwd+bwd", calls["cupy_fwdbwd"])
    rows.append(("torch fwd+bwd, full path", with_fast(False, True, calls["torch_fwdbwd"])()))
    rows.append(("torch fwd+bwd, fast RawKernel",
                 with_fast(True, False, calls["torch_fwdbwd"])()))
    row("torch fwd+bwd (autograd)", calls["torch_fwdbwd"])
    row("sdpa fwd+bwd (autograd)", sdpa_fb)
    row("Function noop fwd+bwd", noop_fb)
    # ---- inside the autograd path: what the Function's own bodies take, on their threads ----
    qg2, kg2, vg2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    F_ = tb._eager_function()
    orig_f, orig_b = F_.forward, F_.backward

    def timer(fn, acc):
        """fn, timed into acc = [seconds, calls]"""
        def timed(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            acc[0] += time.perf_counter() - t0
            acc[1] += 1
            return r
        return timed

    # the Function's bodies, and the helpers they call (module globals, looked up per call)
    body = {"Function.forward": [0.0, 0], "Function.backward": [0.0, 0]}
    helpers = {}
    patched = []
    for mod, name in ((tb, "_fast_forward"), (tb, "_fast_backward"), (tb, "_run_entry"),
                      (tb, "_fast_bwd_key"), (tb, "_fast_key"), (plans, "derived_get")):
        fn0 = getattr(mod, name)
        helpers[name] = [0.0, 0]
        setattr(mod, name, timer(fn0, helpers[name]))
        patched.append((mod, name, fn0))
    tb._FAST["native"] = False       # (these rows are about the Python Function)
    F_.forward = staticmethod(timer(orig_f, body["Function.forward"]))
    F_.backward = staticmethod(timer(orig_b, body["Function.backward"]))
    try:
        for _ in range(20):
            calls["torch_fwdbwd"]()
        best = None
        accs = {**body, **helpers}
        for _ in range(5):      # keep the round with the best total, and its inside figures
            for acc in accs.values():
                acc[:] = [0.0, 0]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                calls["torch_fwdbwd"]()
            torch.cuda.synchronize()
            tot = (time.perf_counter() - t0) / n * 1e6
            if best is None or tot < best[0]:
                best = (tot, {k: list(v) for k, v in accs.items()})
        rows.append(("torch fwd+bwd (autograd, timed bodies)", best[0]))
    finally:
        tb._FAST["native"] = True
        F_.forward, F_.backward = orig_f, orig_b
        for mod, name, fn0 in patched:
            setattr(mod, name, fn0)
    calls_per_step = max(1, best[1]["Function.backward"][1])
    for name, (tot, cnt) in best[1].items():
        rows.append((f"  inside {name} (x{cnt / calls_per_step:.0f}/call)",
                     tot / calls_per_step * 1e6))

    class Mirror(torch.autograd.Function):   # our Function's shape, no flashcore work at all
        @staticmethod
        def forward(ctx, q, k, v, alibi_slopes, cu_q, cu_k, spec, fast, box):
            out = torch.empty_like(q)
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                              device=q.device)
            box.append(lse)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.spec = spec
            ctx.fast_key = fast[0]
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None,
                    None, None, None, None)

    def mirror_fb():
        o = Mirror.apply(qg2, kg2, vg2, None, None, None, None, (None, None), [])
        torch.autograd.grad(o, (qg2, kg2, vg2), do)
    row("Mirror Function (our shape, no work) fwd+bwd", mirror_fb)
    def fwd_grad_only():
        flashcore.attention(qg2, kg2, vg2, causal=True)
    row("torch fwd with grad (node built, no backward)", fwd_grad_only)

    def sdpa_fwd_grad_only():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    row("sdpa fwd with grad (no backward)", sdpa_fwd_grad_only)

    class Pure(torch.autograd.Function):     # no kernels at all: Function + engine floor
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    def pure_fb():
        torch.autograd.grad(Pure.apply(xq), (xq,), gq)
    row("Function pure (view) fwd+bwd", pure_fb)

    def cpp_fb():               # a C++ node, one elementwise kernel each way
        torch.autograd.grad(xq * 2.0, (xq,), gq)
    row("C++ mul fwd+bwd", cpp_fb)
    e_f = plans.derived_get(tb._fast_key(torch, qg2, kg2, vg2, None, None, True, None,
                                         (-1, -1), 0.0, False, True))
    if e_f is not None:
        row("piece: _fast_forward (direct, no autograd)",
            lambda: tb._fast_forward(torch, e_f, qg2, kg2, vg2, None))
    spec = forward_spec(q, k, v, causal=True)
    row("piece: forward_spec (memo hit)", lambda: forward_spec(q, k, v, causal=True))
    row("piece: choose", lambda: choose(spec, None))
    row("piece: _cp (memo hit)", lambda: tb._cp(q))
    row("piece: _cupy_stream", lambda: tb._cupy_stream(torch, dev))
    row("piece: torch.empty", lambda: torch.empty(q.shape, dtype=q.dtype, device=dev))
    row("piece: cupy.empty", lambda: cupy.empty(tuple(q.shape), cupy.float16))
    row("piece: raw stream", lambda: tb._raw_stream(torch, dev.index or 0))
    row("piece: fast key", lambda: tb._fast_key(torch, q, k, v, None, None, True, None,
                                                (-1, -1), 0.0, False))
    print(f"# per-call host time, best of 5 x {n} calls (microseconds)")
    print(f"# torch._C._cuda_getCurrentRawStream: "
          f"{'yes' if hasattr(torch._C, '_cuda_getCurrentRawStream') else 'no (fallback)'}")
    for name, us in rows:
        print(f"{name:36s} {us:9.1f}")
    r = dict(rows)
    r.update({k[len("[interleaved] "):]: v for k, v in rows if k.startswith("[interleaved] ")})
    print("# summary (microseconds per call; the interleaved rows)")
    print(f"torch fwd (no grad) - cupy fwd           {r['torch fwd (no grad)'] - r['cupy fwd']:9.1f}")
    print(f"torch fwd+bwd - cupy fwd+bwd             "
          f"{r['torch fwd+bwd (autograd)'] - r['cupy fwd+bwd']:9.1f}")
    print(f"torch fwd+bwd (Python node) - cupy       "
          f"{r['torch fwd+bwd (autograd), Python node'] - r['cupy fwd+bwd']:9.1f}")
    print(f"torch fwd+bwd - sdpa fwd+bwd             "
          f"{r['torch fwd+bwd (autograd)'] - r['sdpa fwd+bwd (autograd)']:9.1f}")
    print(f"torch fwd+bwd - Function noop fwd+bwd    "
          f"{r['torch fwd+bwd (autograd)'] - r['Function noop fwd+bwd']:9.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
