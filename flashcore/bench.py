"""``python -m flashcore.bench``: flashcore against torch SDPA's flash and cuDNN backends,
measured in the same run, at the flash-attn benchmark sizes (16k tokens per batch, hidden 2048).

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls, median) when Triton
is installed, else CUDA events around each call after warm-up (median). Inputs are random,
never zeros. FLOPs are counted as flash-attn does: forward 4·b·h·s²·d (halved for causal),
backward 2.5× forward, forward+backward 3.5× forward. Prints a table and the ratios; writes
JSON with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys


def _timer():
    import torch
    try:
        from triton.testing import do_bench

        def t(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
        return t, "triton.do_bench median"
    except Exception:
        def t(fn):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            times.sort()
            return times[len(times) // 2]
        return t, "CUDA events median"


def run(seqlens, headdims, causals, modes, dtype="bfloat16", tokens=16384, hidden=2048,
        peers=("sdpa_flash", "sdpa_cudnn"), impls=("cupy",), out=print):
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcore
    timer, how = _timer()
    tdt = getattr(torch, dtype)
    rows = []
    out(f"# flashcore vs torch SDPA ({torch.__version__}), {dtype}, {how}; "
        f"GPU {torch.cuda.get_device_name()}")
    for d in headdims:
        h = hidden // d
        for causal in causals:
            for s in seqlens:
                b = max(1, tokens // s)
                g = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
                mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=tdt, generator=g)
                q, k, v, do = mk(), mk(), mk(), mk()
                # SDPA's preferred layout is (b, h, s, d) contiguous
                qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
                fl = 4.0 * b * h * s * s * d / (2 if causal else 1)
                res = {"seqlen": s, "headdim": d, "causal": causal, "batch": b, "nheads": h}
                for mode in modes:
                    flops = fl * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]
                    for impl in tuple(impls) + tuple(peers):
                        try:
                            fn = _make(impl, mode, q, k, v, do, qt, kt, vt, dot, causal,
                                       F, sdpa_kernel, SDPBackend, cupy, flashcore, torch)
                            t = timer(fn)
                            res[f"{impl}_{mode}_tflops"] = flops / t / 1e12
                        except Exception as e:  # a peer that cannot run this shape
                            res[f"{impl}_{mode}_tflops"] = float("nan")
                            res[f"{impl}_{mode}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                rows.append(res)
                _print_row(res, modes, impls, peers, out)
                del q, k, v, do, qt, kt, vt, dot
                torch.cuda.empty_cache()
    return rows


def _make(impl, mode, q, k, v, do, qt, kt, vt, dot, causal, F, sdpa_kernel, SDPBackend,
          cupy, flashcore, torch):
    if impl.startswith("sdpa"):
        be = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        if mode == "fwd":
            def fn():
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return fn
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        with sdpa_kernel(be):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        if mode == "bwd":
            return lambda: torch.autograd.grad(o, (qg, kg, vg), dot, retain_graph=True)

        def fn():
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            torch.autograd.grad(o, (qg, kg, vg), dot)
        return fn
    if impl == "cupy":
        cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
        o, l = flashcore.attention_forward(cq, ck, cv, causal=causal)
        if mode == "fwd":
            return lambda: flashcore.attention_forward(cq, ck, cv, causal=causal)
        if mode == "bwd":
            return lambda: flashcore.attention_backward(cdo, cq, ck, cv, o, l, causal=causal)

        def fn():
            o, l = flashcore.attention_forward(cq, ck, cv, causal=causal)
            flashcore.attention_backward(cdo, cq, ck, cv, o, l, causal=causal)
        return fn
    if impl == "torch":
        if mode == "fwd":
            return lambda: flashcore.attention(q, k, v, causal=causal)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o = flashcore.attention(qg, kg, vg, causal=causal)
        if mode == "bwd":
            return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

        def fn():
            o = flashcore.attention(qg, kg, vg, causal=causal)
            torch.autograd.grad(o, (qg, kg, vg), do)
        return fn
    raise ValueError(impl)


def _print_row(r, modes, impls, peers, out):
    parts = [f"d{r['headdim']:<3d} {'causal' if r['causal'] else 'full  '} s{r['seqlen']:<6d}"]
    for mode in modes:
        for impl in tuple(impls) + tuple(peers):
            parts.append(f"{impl}:{mode} {r.get(f'{impl}_{mode}_tflops', float('nan')):6.1f}")
        for impl in impls:
            for p in peers:
                a, b = r.get(f"{impl}_{mode}_tflops"), r.get(f"{p}_{mode}_tflops")
                if a and b and not math.isnan(a) and not math.isnan(b):
                    parts.append(f"{impl}/{p.split('_')[1]} {a / b:5.2f}x")
    out("  ".join(parts))
    sys.stdout.flush()


def per_call_us(fn, n, warmup=50, rounds=5):
    """Host time per call of ``fn`` in microseconds: the best of ``rounds`` rounds of ``n``
    calls back to back, each round ended by a device synchronisation."""
    import time

    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


class DecodeProblem:
    """One decoding step on the shapes of the decode-speed target (a GPU tool): one query
    token, ``nheads`` query heads over ``nheads_k`` kv heads, bf16, a full contiguous cache of
    ``cache`` tokens per sequence. Holds the torch tensors (random, never zeros), their CuPy
    views, torch's current stream as a CuPy stream, and the K+V bytes a step reads; ``run``
    calls flashcore's launcher (no host synchronisation, so it can be queued for
    gpu_time_l2_flushed), ``sdpa`` torch SDPA pinned to one backend on the same K/V."""

    def __init__(self, batch, cache, nheads=32, nheads_k=8, headdim=128, seed=None):
        import cupy as cp
        import torch
        dev = torch.device("cuda")
        g = None if seed is None else torch.Generator(device=dev).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
        self.q = randn(batch, 1, nheads, headdim)
        self.k_cache = randn(batch, cache, nheads_k, headdim)
        self.v_cache = randn(batch, cache, nheads_k, headdim)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(batch, nheads, 1, device=dev, dtype=torch.float32)
        self.cache_seqlens = torch.full((batch,), cache, device=dev, dtype=torch.int32)
        self.nbytes = 2 * batch * cache * nheads_k * headdim * 2
        self.scale = 1.0 / math.sqrt(headdim)
        self.cq, self.ck, self.cv, self.co, self.cl, self.cs = (cp.from_dlpack(x) for x in (
            self.q, self.k_cache, self.v_cache, self.out, self.lse, self.cache_seqlens))
        self.stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())

    def run(self, num_splits=0, paged=None):
        """flashcore's decode launcher on the current CuPy stream; ``paged``: (k pages, v pages,
        block table) CuPy arrays in place of the contiguous cache. Returns the split count."""
        from flashcore.kernels.decode import launch_decode
        k, v, table = paged if paged is not None else (self.ck, self.cv, None)
        return launch_decode(self.cq, k, v, self.co, self.cl, cache_seqlens=self.cs,
                             block_table=table, softmax_scale=self.scale, window_left=-1,
                             window_right=-1, num_splits=num_splits)

    def sdpa(self, backend):
        """torch SDPA pinned to ``backend`` (a torch.nn.attention.SDPBackend), same K/V."""
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2) for x in (self.q, self.k_cache, self.v_cache))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


_FLUSH: list = []


def gpu_time_l2_flushed(fn, iters=30, warmup=5):
    """Median GPU time of ``fn()`` in seconds: the device time of the call itself, not the
    host's (for calls shorter than their Python launch, such as decoding steps).

    A spin kernel holds the GPU while every repetition is queued behind it; each repetition
    overwrites the L2 (256 MB, outside the timed interval, as triton's do_bench does: a cache of
    a few MB would otherwise be read from L2 rather than HBM) and is bracketed by its own pair
    of CUDA events. ``fn`` must not synchronise with the host. Every implementation compared
    is timed the same way (tests/diagnostics/bench_decode.py, the asv Decode benchmarks)."""
    import numpy as np
    import torch
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    flush = _FLUSH[0]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    torch.cuda._sleep(50_000_000)      # ~25 ms at H200 clocks: longer than the queueing below
    for a, b in ev:
        flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e-3 for a, b in ev]))


def per_call_us_interleaved(fns, n, warmup=50, rounds=7):
    """``per_call_us`` for several callables at once: each round times ``n`` calls of every
    callable in turn, so a host that runs faster or slower for a while affects all of them
    alike. Returns {name: best round's microseconds per call}."""
    import time

    import torch
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / n)
    return {name: t * 1e6 for name, t in best.items()}


def tiny_calls():
    """The per-call cost probes on a tiny, launch-bound problem (1 x 128 x 2 x 64 bf16, causal):
    argument-less callables for flashcore through CuPy and through torch, forward (no grad) and
    forward+backward (autograd), plus the torch tensors they use."""
    import cupy
    import torch

    import flashcore
    q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def cupy_fwd():
        flashcore.attention_forward(cq, ck, cv, causal=True)

    def cupy_fwdbwd():
        o, l_ = flashcore.attention_forward(cq, ck, cv, causal=True)
        flashcore.attention_backward(cdo, cq, ck, cv, o, l_, causal=True)

    def torch_fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def torch_fwdbwd():
        o = flashcore.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(o, (qg, kg, vg), do)

    calls = {"cupy_fwd": cupy_fwd, "torch_fwd": torch_fwd, "cupy_fwdbwd": cupy_fwdbwd,
             "torch_fwdbwd": torch_fwdbwd}
    return calls, (q, k, v, do)


def overhead(n=2000, out=print):
    """Host cost per call on a tiny problem (launch-bound): the CuPy backend called directly
    against the same call through torch (no grad, and forward+backward with autograd)."""
    from .backends import torch_native
    try:       # the torch fast path's C++ node: built now, so that the calls below use it
        torch_native.build()
    except RuntimeError as exc:
        out(f"# native autograd node unavailable, the Python Function serves: {exc}")
    calls, _ = tiny_calls()
    r = {f"{name}_us": us for name, us in per_call_us_interleaved(calls, n).items()}
    out(f"# per-call host overhead, tiny problem (1x128x2x64 bf16, causal), best of 7 rounds "
        f"of {n} calls, the four probes interleaved (torch node: "
        f"{'C++' if torch_native.status()['status'] == 'ready' else 'Python'}):")
    out(f"forward:          CuPy direct {r['cupy_fwd_us']:.1f} us, through torch {r['torch_fwd_us']:.1f} us "
        f"(+{r['torch_fwd_us'] - r['cupy_fwd_us']:.1f} us)")
    out(f"forward+backward: CuPy direct {r['cupy_fwdbwd_us']:.1f} us, through torch autograd "
        f"{r['torch_fwdbwd_us']:.1f} us (+{r['torch_fwdbwd_us'] - r['cupy_fwdbwd_us']:.1f} us)")
    return r


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashcore.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--mode", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "bwd", "fwdbwd"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--impl", nargs="+", default=["cupy"], choices=["cupy", "torch"])
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--family", choices=["default", "ampere", "v0", "v1"], default="default",
                   help="kernel family on compute capability 9.0: the default (the Hopper "
                        "wgmma kernels where they apply, forward v1), 'ampere' (the mma.sync "
                        "kernels everywhere), or the Hopper forward v0 / v1 explicitly")
    p.add_argument("--overhead", action="store_true",
                   help="only measure the per-call host overhead (CuPy direct vs through torch)")
    a = p.parse_args(argv)
    if a.family != "default":
        from .kernels import backward, forward
        forward.set_sm90(a.family != "ampere", pipelined=a.family == "v1")
        backward.set_sm90(a.family != "ampere")
    if a.overhead:
        r = overhead()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    rows = run(a.seqlen, a.headdim, causals, a.mode, a.dtype, impls=tuple(a.impl))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
