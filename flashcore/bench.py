"""``python -m flashcore.bench``: flashcore against torch SDPA's flash and cuDNN backends,
measured in the same run, at the flash-attn benchmark sizes (16k tokens per batch, hidden 2048).

Modes: the throughput table (the default), ``--decode`` (one decoding step through the public
API against SDPA's cuDNN backend: GPU time, host loop and CUDA-graph replay) and
``--overhead`` (the per-call host cost on a tiny problem). Needs a CUDA GPU, CuPy and PyTorch;
without them it says what is missing in one line and exits 2.

This module is also the benchmark suite's library: ``asv_benchmarks/benchmarks/`` imports its
problem definitions and its timers, so that a figure of this command and the figure of the same
name in the asv results are measured the same way.

* Problems: :func:`shape_for` and :func:`flops` (the flash-attn sizes and FLOP count),
  :class:`AttentionProblem` (forward, backward, forward+backward of flashcore's CuPy or torch
  API or of a pinned SDPA backend), :class:`DecodeProblem` (one decoding step),
  :func:`tiny_calls` (the launch-bound training step).
* Timers: :func:`gpu_time` (CUDA events around each call, the L2 flushed before each, median;
  the calls queued behind a spin kernel so that a call shorter than its launch is timed on the
  GPU, not on the host), :func:`host_loop_us` (host wall-clock per step of a loop of steps
  ended by one synchronisation; :func:`per_call_us`, :func:`per_call_us_interleaved` and
  :func:`wall_time` are uses of it), :func:`graph_replay_time` (GPU time of a CUDA-graph replay
  of one step), :func:`enqueue_and_gpu_time` (the host's enqueue time and the GPU time of a
  loop of steps, timed apart).

The diagnostics in tests/diagnostics/ use these problems and timers too (its README lists the
few timings that stay there, and why).

Inputs are random, never zeros. FLOPs are counted as flash-attn does: forward 4·b·h·s²·d
(halved for causal), backward 2.5× forward, forward+backward 3.5× forward.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time

# --------------------------------------------------------------------------------------------
# Sizes and FLOPs
# --------------------------------------------------------------------------------------------

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
#: torch SDPA pinned to one kernel: the peers every figure is compared with
PEERS = ("sdpa_flash", "sdpa_cudnn")


def shape_for(seqlen: int, headdim: int, tokens: int = TOKENS_PER_BATCH,
              hidden: int = HIDDEN) -> tuple[int, int, int, int]:
    """(batch, seqlen, nheads, headdim) with ``tokens`` per batch and hidden size ``hidden``."""
    return max(1, tokens // seqlen), seqlen, hidden // headdim, headdim


def flops(batch, seqlen, nheads, headdim, causal, which="forward") -> float:
    """FLOPs counted the flash-attn way: forward 4·b·h·s²·d (halved when causal),
    backward 2.5× that, forward+backward 3.5×."""
    f = 4.0 * batch * nheads * seqlen * seqlen * headdim
    if causal:
        f /= 2
    return f * {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}[which]


# --------------------------------------------------------------------------------------------
# Availability: every refusal is a NotImplementedError with the reason (asv: skipped)
# --------------------------------------------------------------------------------------------

def _torch():
    try:
        import torch
    except Exception as exc:   # not installed, or broken on this machine
        raise NotImplementedError(f"PyTorch is not installed ({type(exc).__name__}: {exc})") from None
    return torch


def why_no_gpu() -> str | None:
    """Why this machine cannot run the GPU benchmarks (CuPy, PyTorch and a CUDA device), or
    None. Decided without compiling or launching anything."""
    try:
        torch = _torch()
    except NotImplementedError as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    import flashcore
    why = flashcore.available_backends().get("cupy")
    return f"flashcore's CuPy backend is unavailable: {why}" if why else None


def require(impl: str) -> None:
    """Raise NotImplementedError, with the reason, unless ``impl`` ('cupy', 'torch',
    'sdpa_flash', 'sdpa_cudnn') can run on a GPU here."""
    if impl == "numpy":
        raise NotImplementedError("the NumPy backend runs on the CPU: see bench_numpy")
    if impl != "cupy":          # flashcore's CuPy API needs no torch
        torch = _torch()
        if not torch.cuda.is_available():
            raise NotImplementedError("PyTorch sees no CUDA device")
    if impl in ("cupy", "torch"):
        import flashcore
        why = flashcore.available_backends().get(impl, f"flashcore has no {impl!r} backend")
        if why:
            raise NotImplementedError(f"flashcore's {impl!r} backend is unavailable: {why}")
    elif impl in PEERS:
        sdpa_backend(impl)
    else:
        raise ValueError(f"unknown implementation {impl!r}")


def sdpa_backend(peer: str):
    """The ``torch.nn.attention.SDPBackend`` a peer name stands for."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        raise NotImplementedError("this torch has no torch.nn.attention.SDPBackend") from None
    member = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}[peer]
    if not hasattr(SDPBackend, member):
        raise NotImplementedError(f"this torch has no SDPBackend.{member}")
    return getattr(SDPBackend, member)


def sdpa_pinned(peer: str | None):
    """A context in which torch SDPA runs ``peer``'s kernel only (no-op for None)."""
    if peer is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(sdpa_backend(peer))


# --------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------

L2_FLUSH_BYTES = 256 << 20          # > 4x the H200's 60 MB L2
_SPIN_CYCLES = 50_000_000           # one spin kernel: ~25 ms at H200 clocks
_SPIN_SECONDS = 0.02                # what one spin is counted as (less than it lasts)
_SPIN_SRC = r"""
extern "C" __global__ void flashcore_bench_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
_STATE: dict = {}


class _Cuda:
    """Events, synchronisation, an L2 flush and a spin kernel on the current stream of one
    library ('torch' or 'cupy'), so that the timers serve both."""

    def __init__(self, lib: str):
        self.lib = lib
        if lib == "torch":
            import torch
            self.torch = torch
            self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        else:
            import cupy
            self.cupy = cupy
            self.flush_buf = cupy.empty(L2_FLUSH_BYTES, dtype=cupy.uint8)
            self._spin = cupy.RawKernel(_SPIN_SRC, "flashcore_bench_spin")

    def event(self):
        if self.lib == "torch":
            return self.torch.cuda.Event(enable_timing=True)
        return self.cupy.cuda.Event()

    @staticmethod
    def record(e):
        e.record()

    def seconds(self, a, b) -> float:
        if self.lib == "torch":
            return a.elapsed_time(b) * 1e-3
        return self.cupy.cuda.get_elapsed_time(a, b) * 1e-3

    def sync(self):
        if self.lib == "torch":
            self.torch.cuda.synchronize()
        else:
            self.cupy.cuda.Device().synchronize()

    def flush(self):
        # Read the buffer through (a sum): the L2 then holds its lines, clean. Writing it (as
        # triton's do_bench does) would leave the L2 full of dirty lines, whose write-back to
        # HBM then runs inside the timed call as its own reads evict them: about 10 us of a
        # decoding step on an H100 (tests/diagnostics/probe_flush.py, performance log session
        # 48), the harness's cost and not the call's.
        if self.lib == "torch":
            self.flush_buf.view(self.torch.int64).sum()
        else:
            self.flush_buf.view(self.cupy.int64).sum()

    def spin(self):
        if self.lib == "torch":
            self.torch.cuda._sleep(_SPIN_CYCLES)
        else:
            import numpy as np
            self._spin((1,), (1,), (np.int64(_SPIN_CYCLES),))


def _hold(cu, calls: int, per_call_s: float) -> None:
    """Queue spin kernels that hold the device while the host enqueues ``calls`` calls of
    ``per_call_s`` seconds each (outlasting the queueing twice over), so that what follows is
    timed on the device, not on the host."""
    for _ in range(1 + int(2 * calls * per_call_s / _SPIN_SECONDS)):
        cu.spin()


def _cuda(lib: str) -> _Cuda:
    if lib not in _STATE:
        _STATE[lib] = _Cuda(lib)
    return _STATE[lib]


def gpu_time(fn, lib: str = "torch", reps: int | None = None, warmup: int = 3,
             min_reps: int = 5, max_reps: int = 50, target_s: float = 0.1) -> float:
    """Median GPU time of ``fn()`` in seconds: the device time of the call itself.

    After ``warmup`` calls, ``reps`` repetitions (default: as many as fill ``target_s``, within
    [min_reps, max_reps]) are queued behind a spin kernel that holds the GPU while the host
    enqueues them, so that calls shorter than their Python launch (decoding steps) are timed on
    the device, not on the host. Before every repetition a 256 MB buffer is read through, outside
    the timed interval, so that the call's inputs are not in the L2 (inputs of a few MB would
    otherwise be read from L2 rather than HBM) and the L2's lines are clean: no write-back of
    the flush's own data runs inside the timed call. Each repetition has its own pair of CUDA
    events on the current stream of ``lib`` ('torch' or 'cupy'). ``fn`` must not synchronise
    with the host."""
    cu = _cuda(lib)
    for _ in range(warmup):
        fn()
    cu.sync()
    a, b = cu.event(), cu.event()
    a.record()
    for _ in range(3):
        fn()
    b.record()
    cu.sync()
    if reps is None:
        estimate = max(cu.seconds(a, b) / 3, 1e-6)
        reps = int(min(max(math.ceil(target_s / estimate), min_reps), max_reps))
    events = [(cu.event(), cu.event()) for _ in range(reps)]
    # the host's time to issue one repetition: the flush, two events and the call
    t0 = time.perf_counter()
    for x, y in events[:3]:
        cu.flush()
        x.record()
        fn()
        y.record()
    host = (time.perf_counter() - t0) / min(3, reps)
    cu.sync()
    _hold(cu, reps, host)
    for a, b in events:
        cu.flush()
        a.record()
        fn()
        b.record()
    cu.sync()
    return statistics.median(cu.seconds(a, b) for a, b in events)


def gpu_time_l2_flushed(fn, iters=30, warmup=5):
    """:func:`gpu_time` with a fixed number of repetitions (on torch's current stream)."""
    return gpu_time(fn, "torch", reps=iters, warmup=warmup)


def enqueue_us(fn, calls: int = 100, rounds: int = 5, sync=None) -> float:
    """The host's own microseconds per call of ``fn``: ``calls`` calls started on an idle device
    (right after a synchronisation), the clock read before the synchronisation that ends them,
    the best of ``rounds``. Where this exceeds the call's GPU time, a loop of such calls runs at
    the host's pace (tests/diagnostics/bench_callpath.py decode_host). ``sync`` defaults to
    ``torch.cuda.synchronize``."""
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        sync()
    return best / calls * 1e6


def host_loop_us(fn, steps: int | None = None, warmup: int = 20, rounds: int = 5,
                 target_s: float = 0.05, sync=None, warmup_s: float = 0.05) -> float:
    """Host wall-clock per step of ``fn``, in microseconds: ``steps`` calls back to back, ended
    by one device synchronisation, the best of ``rounds`` such loops. What a loop of decoding or
    training steps costs the host, the launches and the Python around them included (the GPU
    work too where it is the longer of the two).

    The warm-up is ``warmup`` calls and then more until ``warmup_s`` seconds have passed (none
    with ``warmup=0``): an idle GPU runs at low clocks at first (the suspected cause of the
    first cell of each implementation reading high in an asv run, session 17). ``steps`` defaults to as many as
    fill ``target_s`` (10 to 2000). ``sync`` defaults to ``torch.cuda.synchronize``."""
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    t_end = time.perf_counter() + (warmup_s if warmup > 0 else 0.0)
    for _ in range(warmup):
        fn()
    while time.perf_counter() < t_end:
        fn()
    sync()
    if steps is None:
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        sync()
        estimate = max((time.perf_counter() - t0) / 10, 1e-7)
        steps = int(min(max(target_s / estimate, 10), 2000))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e6


def per_call_us(fn, n, warmup=50, rounds=5):
    """:func:`host_loop_us` with a fixed number of calls per round."""
    return host_loop_us(fn, steps=n, warmup=warmup, rounds=rounds)


def per_call_us_interleaved(fns, n, warmup=50, rounds=7, sync=None, clock=time.perf_counter,
                            round_s=None):
    """:func:`host_loop_us` for several callables at once: each round times ``n`` calls of
    every callable in turn, so that a host that runs faster or slower for a while affects all
    of them alike. Returns {name: best round's microseconds per call}.

    Each callable is warmed up by ``warmup`` calls, then a synchronisation. ``round_s``: each
    callable's calls per round are fewer than ``n`` where its warm-up (at least one call, then)
    says that ``n`` would take longer than about ``round_s`` seconds (at least min(n, 10)).
    ``sync`` defaults to
    ``torch.cuda.synchronize``; ``clock`` may be ``time.process_time`` for a run without a
    device (tests/diagnostics/probe_route.py, stubbed)."""
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    counts = {}
    for name, fn in fns.items():
        t0 = clock()
        calls = warmup if round_s is None else max(warmup, 1)
        for _ in range(calls):
            fn()
        sync()
        counts[name] = n if round_s is None else \
            int(min(n, max(10, round_s * calls / max(clock() - t0, 1e-6))))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(counts[name]):
                fn()
            sync()
            best[name] = min(best[name], (clock() - t0) / counts[name])
    return {name: t * 1e6 for name, t in best.items()}


def wall_time(fn, reps: int = 1, warmup: int = 0, sync=None) -> float:
    """Host wall-clock seconds of one call of ``fn`` ended by a device synchronisation, the best
    of ``reps``: :func:`host_loop_us` with one step per round, for calls long enough that one
    is a measurement (a transformers training step or ``generate``, a ring-attention pass, the
    first calls of a process). The warm-up is ``warmup`` calls exactly, with no clock-based
    extension, so that every rank of a distributed run makes the same calls. ``sync`` defaults
    to ``torch.cuda.synchronize``; CPU-only work passes its own (``lambda: None``)."""
    return host_loop_us(fn, steps=1, warmup=warmup, rounds=reps, sync=sync, warmup_s=0.0) * 1e-6


def enqueue_and_gpu_time(fn, steps: int = 200, warmup: int = 20,
                         lib: str = "torch") -> tuple[float, float]:
    """(host, gpu) seconds per call of ``steps`` calls of ``fn`` issued back to back while a
    spin kernel holds the device: ``host`` the host's time to enqueue one call, ``gpu`` the
    device time of the calls back to back (one pair of CUDA events around all of them, the L2
    not flushed between them: a loop of steps as a training loop runs them) divided by
    ``steps``. The spin outlasts the enqueueing, so the two are timed apart. ``fn`` must not
    synchronise with the host. (:func:`gpu_time` is the GPU time of one call, L2 flushed.)"""
    cu = _cuda(lib)
    for _ in range(warmup):
        fn()
    cu.sync()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    estimate = (time.perf_counter() - t0) / 3      # the host's time to issue one call
    cu.sync()
    a, b = cu.event(), cu.event()
    _hold(cu, steps, estimate)
    a.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - t0) / steps
    b.record()
    cu.sync()
    return host, cu.seconds(a, b) / steps


def capture_graph(fn, warmup: int = 3):
    """A ``torch.cuda.CUDAGraph`` of one call of ``fn`` (warmed up on a side stream first, as
    torch requires). Whatever the capture raises propagates: the caller reports it."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_replay_time(graph, reps: int | None = None) -> float:
    """GPU time of one replay of ``graph`` in seconds (:func:`gpu_time`: L2 flushed, median)."""
    return gpu_time(graph.replay, "torch", reps=reps)


def kernel_events(fn, warmup: int = 3) -> list[dict]:
    """The kernels one call of ``fn`` launches, as torch.profiler's trace events (``name``,
    ``dur`` in µs, ``args``: grid, block, registers, shared memory), after ``warmup`` calls. A
    profile, not a timing (one call, the L2 not flushed): for the diagnostics that take a call
    apart kernel by kernel."""
    import os
    import tempfile
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


# --------------------------------------------------------------------------------------------
# Inputs: random (never zeros), bfloat16, on the device
# --------------------------------------------------------------------------------------------

def _cupy_bfloat16(x32):
    """float32 CuPy array -> bfloat16 (ml_dtypes), rounding to nearest even."""
    import cupy
    import ml_dtypes
    try:
        return x32.astype(ml_dtypes.bfloat16)
    except Exception:   # a CuPy without bfloat16 arithmetic can still hold the bits
        u = x32.view(cupy.uint32)
        u = (u + (cupy.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
        return u.astype(cupy.uint16).view(ml_dtypes.bfloat16)


def random_arrays(lib: str, shapes, seed: int = 0, requires_grad: bool = False,
                  dtype: str = "bfloat16"):
    """One random array per shape ('cupy' or 'torch' on the current device)."""
    if lib == "cupy":
        import cupy
        rng = cupy.random.default_rng(seed)
        xs = [rng.standard_normal(s, dtype=cupy.float32) for s in shapes]
        return [_cupy_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype) for x in xs]
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=g, device="cuda", dtype=getattr(torch, dtype))
            .requires_grad_(requires_grad) for s in shapes]


# --------------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------------

class AttentionProblem:
    """The inputs of one implementation and its ``forward``, ``backward`` and
    ``forward_backward`` as argument-less callables, plus ``lib`` for the timer.

    ``impl``: 'cupy' (flashcore's CuPy API: explicit forward and backward, the kernels without
    an autograd layer), 'torch' (``flashcore.attention`` on torch tensors, through autograd),
    or a peer, 'sdpa_flash' / 'sdpa_cudnn' (torch SDPA pinned to that kernel, through autograd,
    in its native layout (batch, nheads, seqlen, headdim), contiguous). flashcore's take
    (batch, seqlen, nheads, headdim). A shape a peer cannot take raises NotImplementedError.
    ``window_size``: flashcore's (left, right) sliding window on every call (peers: refused).
    """

    def __init__(self, impl, batch, seqlen, nheads, headdim, causal, seed=0, dtype="bfloat16",
                 dropout_p=0.0, window_size=None):
        self.impl, self.causal, self.dtype, self.dropout_p = impl, causal, dtype, dropout_p
        # flashcore's window_size=(left, right); None: the calls do not pass it
        self._window = {} if window_size is None else {"window_size": tuple(window_size)}
        require(impl)
        if self._window and impl in PEERS:
            raise NotImplementedError(f"{impl}: torch SDPA takes no sliding window")
        if impl == "cupy":
            self.lib = "cupy"
            self._setup_cupy((batch, seqlen, nheads, headdim), seed)
        else:
            self.lib = "torch"
            if impl == "torch":
                self._setup_flashcore_torch((batch, seqlen, nheads, headdim), seed)
            else:
                self._setup_sdpa((batch, nheads, seqlen, headdim), seed)

    def _setup_cupy(self, shape, seed):
        import flashcore
        import cupy
        q, k, v, dout = random_arrays("cupy", [shape] * 4, seed, dtype=self.dtype)
        c = self.causal
        kw = dict(self._window)
        if self.dropout_p:  # one fixed random state (a user's loop would draw one per step)
            kw.update(dropout_p=self.dropout_p, rng_state=cupy.asarray([seed + 1, 0], cupy.int64))
        out, lse = flashcore.attention_forward(q, k, v, causal=c, **kw)

        def forward():
            return flashcore.attention_forward(q, k, v, causal=c, **kw)

        def backward():
            return flashcore.attention_backward(dout, q, k, v, out, lse, causal=c, **kw)

        def forward_backward():
            o, l_ = flashcore.attention_forward(q, k, v, causal=c, **kw)
            return flashcore.attention_backward(dout, q, k, v, o, l_, causal=c, **kw)

        self.forward, self.backward, self.forward_backward = forward, backward, forward_backward
        backward()      # compiles (or loads) the backward kernels before any timing

    def _setup_autograd(self, attn, shape, seed):
        import torch
        q, k, v, dout = random_arrays("torch", [shape] * 4, seed, requires_grad=True,
                                      dtype=self.dtype)
        dout = dout.detach()
        out = attn(q, k, v)
        inputs = (q, k, v)

        def forward():
            with torch.no_grad():
                return attn(q, k, v)

        def backward():
            return torch.autograd.grad(out, inputs, dout, retain_graph=True)

        def forward_backward():
            return torch.autograd.grad(attn(q, k, v), inputs, dout)

        self.forward, self.backward, self.forward_backward = forward, backward, forward_backward
        backward()

    def _setup_flashcore_torch(self, shape, seed):
        import flashcore
        c, p, w = self.causal, self.dropout_p, self._window
        self._setup_autograd(lambda q, k, v: flashcore.attention(q, k, v, causal=c, dropout_p=p,
                                                                 **w), shape, seed)

    def _setup_sdpa(self, shape, seed):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
        pinned, c, p = sdpa_backend(self.impl), self.causal, self.dropout_p

        def attn(q, k, v):
            with sdpa_kernel(pinned):
                return scaled_dot_product_attention(q, k, v, is_causal=c, dropout_p=p)

        try:
            self._setup_autograd(attn, shape, seed)
        except RuntimeError as e:   # "No available kernel": this peer cannot take the shape
            raise NotImplementedError(f"{self.impl} cannot run this shape here: "
                                      f"{str(e).splitlines()[0]}") from None

    def seconds(self, which: str) -> float:
        """GPU time of one ``which`` ('forward', 'backward', 'forward_backward') call."""
        return gpu_time(getattr(self, which), self.lib)

    def tflops(self, which: str, flop_count: float) -> float:
        return flop_count / self.seconds(which) / 1e12


#: the decode-speed target's shapes (one query token, GQA 32/8, d128, bf16)
DECODE_HEADS, DECODE_HEADS_K, DECODE_HEADDIM = 32, 8, 128
DECODE_BATCHES = (1, 8, 64)
DECODE_CACHES = (4096, 16384, 131072)
DECODE_PAGE_SIZE = 256


class DecodeProblem:
    """One decoding step: one query token, ``nheads`` query heads over ``nheads_k`` kv heads,
    bf16, a full cache of ``cache`` tokens per sequence, ``cache_seqlens`` a CUDA int32 tensor.

    The cache is contiguous ``(batch, cache, nheads_k, headdim)``, or with ``page_size`` paged:
    ``(batch * cache / page_size, page_size, nheads_k, headdim)`` pages in a random order named
    by an int32 ``block_table``. Holds the torch tensors (random, never zeros), their CuPy views
    and torch's current stream as a CuPy stream (where CuPy is installed), and the K+V bytes a
    step reads. Steps:

    * ``api()``: the public ``flashcore.attention_with_kvcache``, as a user calls it;
    * ``run()``: flashcore's decode launcher alone (the split heuristic included), on the
      current CuPy stream: the asv DecodeBandwidth / DecodeRatio groups time this;
    * ``sdpa(backend)``: torch SDPA pinned to ``backend`` (an SDPBackend) on the same K/V
      (contiguous caches only; ``enable_gqa``, no cache lengths: the full cache is read).
    """

    def __init__(self, batch, cache, nheads=DECODE_HEADS, nheads_k=DECODE_HEADS_K,
                 headdim=DECODE_HEADDIM, seed=None, page_size=None):
        import torch
        dev = torch.device("cuda")
        g = None if seed is None else torch.Generator(device=dev).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
        self.batch, self.cache, self.page_size = batch, cache, page_size
        self.q = randn(batch, 1, nheads, headdim)
        if page_size is None:
            self.k_cache = randn(batch, cache, nheads_k, headdim)
            self.v_cache = randn(batch, cache, nheads_k, headdim)
            self.block_table = None
        else:
            if cache % page_size:
                raise ValueError(f"cache {cache} is not a multiple of page_size {page_size}")
            blocks = batch * (cache // page_size)
            self.k_cache = randn(blocks, page_size, nheads_k, headdim)
            self.v_cache = randn(blocks, page_size, nheads_k, headdim)
            order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed or 0))
            self.block_table = order.to(dev, torch.int32).reshape(batch, cache // page_size)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(batch, nheads, 1, device=dev, dtype=torch.float32)
        self.cache_seqlens = torch.full((batch,), cache, device=dev, dtype=torch.int32)
        self.nbytes = 2 * batch * cache * nheads_k * headdim * 2
        self.scale = 1.0 / math.sqrt(headdim)
        try:
            import cupy as cp
        except ImportError:
            self.stream = self.cq = self.ck = self.cv = self.co = self.cl = self.cs = None
            self.ct = None
        else:
            self.cq, self.ck, self.cv, self.co, self.cl, self.cs = (cp.from_dlpack(x) for x in (
                self.q, self.k_cache, self.v_cache, self.out, self.lse, self.cache_seqlens))
            self.ct = None if self.block_table is None else cp.from_dlpack(self.block_table)
            self.stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())

    def api(self):
        """The step through the public API (``cache_seqlens`` a CUDA int32 tensor)."""
        import flashcore
        return flashcore.attention_with_kvcache(self.q, self.k_cache, self.v_cache,
                                                cache_seqlens=self.cache_seqlens,
                                                block_table=self.block_table)

    def run(self, num_splits=0, paged=None):
        """flashcore's decode launcher on the current CuPy stream; ``paged``: (k pages, v pages,
        block table) CuPy arrays in place of this problem's cache. Returns the split count."""
        from flashcore.kernels.decode import launch_decode
        k, v, table = paged if paged is not None else (self.ck, self.cv, self.ct)
        return launch_decode(self.cq, k, v, self.co, self.cl, cache_seqlens=self.cs,
                             block_table=table, softmax_scale=self.scale, window_left=-1,
                             window_right=-1, num_splits=num_splits)

    def sdpa(self, backend):
        """torch SDPA pinned to ``backend`` (a torch.nn.attention.SDPBackend), same K/V."""
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        if self.block_table is not None:
            raise NotImplementedError("torch SDPA takes no paged cache")
        qt, kt, vt = (x.transpose(1, 2) for x in (self.q, self.k_cache, self.v_cache))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def sdpa_unpinned(self):
        """:meth:`sdpa` without the backend context (for loops that pin it once, outside)."""
        import torch.nn.functional as F
        if self.block_table is not None:
            raise NotImplementedError("torch SDPA takes no paged cache")
        qt, kt, vt = (x.transpose(1, 2) for x in (self.q, self.k_cache, self.v_cache))
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


def decode_step(impl: str, pb: DecodeProblem):
    """The argument-less step of ``impl`` on ``pb``, with the SDPA peer pinned by the caller
    (:func:`sdpa_pinned`): 'flashcore' / 'flashcore_paged' -> :meth:`DecodeProblem.api`,
    a peer -> :meth:`DecodeProblem.sdpa_unpinned`."""
    return pb.api if impl.startswith("flashcore") else pb.sdpa_unpinned


def decode_graph(impl: str, pb: DecodeProblem):
    """One step of ``impl`` captured in a CUDA graph; a step that cannot be captured raises
    NotImplementedError with the reason (asv: skipped; the tables: n/a)."""
    try:
        with sdpa_pinned(None if impl.startswith("flashcore") else impl):
            return capture_graph(decode_step(impl, pb))
    except NotImplementedError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise NotImplementedError(f"{impl}: the decoding step cannot be captured in a CUDA "
                                  f"graph: {type(exc).__name__}: {first}") from None


#: the tiny, launch-bound training step (1 x 128 x 2 x 64 bf16, causal)
def fp8_quantise(x):
    """A torch tensor ``x`` (batch, seqlen, heads, headdim) -> (float8_e4m3fn values, float32
    descales (batch, heads)), each (batch, head)'s largest magnitude at e4m3's 448: the FP8
    inputs of the FP8 benchmarks (asv and tests/diagnostics), ``values * descale`` ~ ``x``."""
    import torch
    ds = (x.float().abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-6)
    return (x.float() / ds[:, None, :, None]).to(torch.float8_e4m3fn), ds


TINY_SHAPE = (1, 128, 2, 64)


def tiny_calls(peers=()):
    """The per-call cost probes on the tiny training step (1 x 128 x 2 x 64 bf16, causal):
    argument-less callables for flashcore through CuPy and through torch, forward (no grad) and
    forward+backward (autograd), and for each SDPA peer in ``peers`` (run them inside
    :func:`sdpa_pinned`), plus the torch tensors they use."""
    import torch
    import torch.nn.functional as F

    import flashcore
    q, k, v, do = (torch.randn(*TINY_SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    calls = {}
    if flashcore.available_backends().get("cupy") is None:
        import cupy
        cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))

        def cupy_fwd():
            flashcore.attention_forward(cq, ck, cv, causal=True)

        def cupy_fwdbwd():
            o, l_ = flashcore.attention_forward(cq, ck, cv, causal=True)
            flashcore.attention_backward(cdo, cq, ck, cv, o, l_, causal=True)
        calls.update(cupy_fwd=cupy_fwd, cupy_fwdbwd=cupy_fwdbwd)

    def torch_fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def torch_fwdbwd():
        o = flashcore.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(o, (qg, kg, vg), do)

    calls.update(torch_fwd=torch_fwd, torch_fwdbwd=torch_fwdbwd)
    if peers:
        qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()

        def sdpa_fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        def sdpa_fwdbwd():
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            torch.autograd.grad(o, (qt, kt, vt), dot)
        for p in peers:
            calls[f"{p}_fwd"], calls[f"{p}_fwdbwd"] = sdpa_fwd, sdpa_fwdbwd
    return calls, (q, k, v, do)


# --------------------------------------------------------------------------------------------
# End to end: the transformers Llama of issues #14 and #15
# --------------------------------------------------------------------------------------------

#: the model the end-to-end figures use: a transformers Llama, random init, 8 layers, hidden
#: 2048, 16 query heads over 4 kv heads (head dim 128), bf16
LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768)
#: the attention implementations compared: "sdpa" (torch's, cuDNN by default on Hopper),
#: flashcore as ``register()`` installs it, and flashcore reading masks as left padding
LLAMA_IMPLS = ("sdpa", "flashcore", "flashcore_lp")


def require_transformers() -> None:
    """NotImplementedError (a benchmark's skip) unless transformers imports."""
    try:
        import transformers
        del transformers
    except Exception as e:
        raise NotImplementedError(f"transformers is not available: {e}") from None


def llama_model(impl: str, layers: int = LLAMA["num_hidden_layers"]):
    """:data:`LLAMA` on the GPU in bf16 (the same weights for every ``impl``: seed 0), its
    attention ``impl``: one of :data:`LLAMA_IMPLS`, or any name registered with transformers'
    ``AttentionInterface`` (diagnostics' variants)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import flashcore.integrations.transformers as fct
    # (the reading of a mask belongs to the registered name, so the models can be held together)
    name = impl
    if impl in ("flashcore", "flashcore_lp"):
        name = fct.register()
        if impl == "flashcore_lp":
            name = fct.register(name + "_lp", left_padding=True)
    cfg = LlamaConfig(**{**LLAMA, "num_hidden_layers": layers}, attn_implementation=name)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def generate_rounds(models: dict, ids, kw: dict, rounds: int):
    """Timed greedy generates of every model in turn, ``rounds`` times (a host that runs faster
    or slower for a while moves them alike; timed once each, one model after the other,
    static-cache generate at batch 1 read 0.87x "sdpa" in run 214 and 1.04x / 1.06x in run 215
    on one tree). The order turns by one model each round, so that no model always runs
    first: ``({impl: [seconds]}, {impl: the last generated ids})``."""
    import torch
    times, outs = {impl: [] for impl in models}, {}
    order = list(models.items())
    with torch.no_grad():
        for r in range(rounds):
            for impl, model in order[r % len(order):] + order[:r % len(order)]:
                gen = []
                times[impl].append(wall_time(lambda: gen.append(model.generate(ids, **kw))))
                outs[impl] = gen[0][:, ids.shape[1]:]
    return times, outs


def speed_ratio(times: dict, impl: str, peer: str) -> float:
    """``impl``'s speed over ``peer``'s from timed rounds (``{name: [seconds]}`` as
    :func:`generate_rounds` gives them): the median over rounds of peer's seconds / impl's in
    the same round. The two ran one after the other, so a host that drifts slower or faster
    for a while moves both (on session 64's noisy H100 host the rounds of one model spread by
    +-20%); a ratio of the two medians pairs rounds far apart."""
    return statistics.median(p / i for p, i in zip(times[peer], times[impl], strict=True))


def prefill_mask(batch: int, prompt: int, padded: bool, device="cuda"):
    """The 2D attention mask of a prefill figure, int64 (batch, prompt) on ``device``, as
    ``generate`` passes it: all ones, or (``padded``) left padding, row b keeping its last
    ``prompt - b * prompt // (2 * batch)`` tokens and at least half (row 0 the whole prompt, at
    batch 1 a quarter padded)."""
    import torch
    mask = torch.ones(batch, prompt, dtype=torch.int64, device=device)
    if padded:
        for b in range(batch):
            mask[b, :max(b * prompt // (2 * batch), prompt // 4 if batch == 1 else 0)] = 0
    return mask


def prefill_rounds(models: dict, ids, mask, rounds: int, calls: int = 3):
    """Timed prefills: one forward of each model over ``ids`` under ``mask`` into a fresh
    ``DynamicCache`` (what ``generate``'s first step runs), synchronised before and after
    (host and GPU time together: the time to the first token's logits), the models in turn,
    the order turning each round; each round's figure is the best of ``calls`` forwards
    (:func:`wall_time`). ``{impl: [seconds]}`` for :func:`speed_ratio`."""
    import torch
    from transformers import DynamicCache
    times = {impl: [] for impl in models}
    order = list(models.items())

    def forward(model):
        model(input_ids=ids, attention_mask=mask, use_cache=True,
              past_key_values=DynamicCache(config=model.config))
    with torch.no_grad():
        for model in models.values():      # (warm: plans recorded, kernels loaded)
            forward(model)
        for r in range(rounds):
            for impl, model in order[r % len(order):] + order[:r % len(order)]:
                times[impl].append(wall_time(lambda: forward(model), reps=calls))
    return times


def generate_new_length_rounds(models: dict, batch: int, prompt: int, new: int, kw: dict,
                               rounds: int):
    """:func:`generate_rounds` over cache lengths that no model has met in this process (after
    :func:`generate_setup`'s warm-up, which covered prompt .. prompt + new - 1): round j
    generates from prompts of prompt + j * new tokens (j = 1 .. ``rounds``), the models in
    turn, the order turning each round. What a fresh process or a server pays for a length
    the first time (cuDNN builds a plan for every new shape; a flashcore decoding step makes
    its launch plan from the last length's): ``{impl: [seconds]}``."""
    times = {impl: [] for impl in models}
    names = list(models)
    for j in range(1, rounds + 1):
        ids = generate_ids(batch, prompt + j * new, seed=1 + j)
        order = names[j % len(names):] + names[:j % len(names)]
        t, _ = generate_rounds({impl: models[impl] for impl in order}, ids, kw, 1)
        for impl in order:
            times[impl] += t[impl]
    return times


def generate_ids(batch: int, prompt: int, seed: int = 1):
    """The prompts of the generate figures: random token ids, (batch, prompt), on the GPU."""
    import torch
    return torch.randint(0, LLAMA["vocab_size"], (batch, prompt), device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(seed))


def generate_setup(impls, batch: int, prompt: int, new: int, static: bool = False):
    """A generate figure's pieces: ``(models, ids, kw, warm_s)``, the models of ``impls``
    (:func:`llama_model`, eval mode), the prompts (:func:`generate_ids`), greedy generate's
    keywords for ``new`` tokens (the static cache's with ``static``, after a dynamo reset), and
    the seconds of each model's warm-up generate (the static cache's compiles), done here."""
    import torch
    if static:
        torch._dynamo.reset()
    models = {impl: llama_model(impl).eval() for impl in impls}
    ids = generate_ids(batch, prompt)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if static:
        kw["cache_implementation"] = "static"
    warm_s = {}
    with torch.no_grad():
        for impl, model in models.items():
            warm_s[impl] = wall_time(lambda: model.generate(ids, **kw))
    return models, ids, kw, warm_s


def train_step_ms(model, batch: int, seqlen: int, steps: int = 8, warmup: int = 3,
                  compiled: bool = False):
    """(ms a training step (forward with labels, backward) in a loop of ``steps`` ended by one
    synchronisation, the loss of the last warm-up step, the ``warmup`` steps' seconds:
    torch.compile's compilation when ``compiled``). The warm-up is timed apart, not folded into
    host_loop_us's own warm-up, since its time is a figure too."""
    import torch
    ids = torch.randint(0, LLAMA["vocab_size"], (batch, seqlen), device="cuda")
    fwd = torch.compile(model) if compiled else model
    last = [None]

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        last[0] = loss
    warm_s = wall_time(lambda: [step() for _ in range(warmup)])
    loss = float(last[0])
    return host_loop_us(step, steps=steps, warmup=0, rounds=1) / 1e3, loss, warm_s


# --------------------------------------------------------------------------------------------
# The command's modes
# --------------------------------------------------------------------------------------------

def run(seqlens, headdims, causals, modes, dtype="bfloat16", tokens=16384, hidden=2048,
        peers=PEERS, impls=("cupy",), out=print):
    """The throughput table: TFLOP/s of each implementation and peer (:class:`AttentionProblem`,
    :func:`gpu_time`) and flashcore's ratio to each peer. Returns the rows."""
    import torch
    modes_full = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward_backward"}
    rows = []
    out(f"# flashcore vs torch SDPA ({torch.__version__}), {dtype}, GPU time: CUDA events, "
        f"L2 flushed, median (flashcore.bench.gpu_time); GPU {torch.cuda.get_device_name()}")
    for d in headdims:
        for causal in causals:
            for s in seqlens:
                b, _, h, _ = shape_for(s, d, tokens, hidden)
                res = {"seqlen": s, "headdim": d, "causal": causal, "batch": b, "nheads": h}
                for impl in tuple(impls) + tuple(peers):
                    try:
                        pb = AttentionProblem(impl, b, s, h, d, causal, seed=s * 1000 + d,
                                              dtype=dtype)
                    except Exception as e:  # a peer that cannot run this shape
                        for mode in modes:
                            res[f"{impl}_{mode}_tflops"] = float("nan")
                            res[f"{impl}_{mode}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                        continue
                    for mode in modes:
                        which = modes_full[mode]
                        try:
                            res[f"{impl}_{mode}_tflops"] = pb.tflops(which, flops(b, s, h, d, causal, which))
                        except Exception as e:
                            res[f"{impl}_{mode}_tflops"] = float("nan")
                            res[f"{impl}_{mode}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                    del pb
                    torch.cuda.empty_cache()
                rows.append(res)
                _print_row(res, modes, impls, peers, out)
    return rows


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


def overhead(n=2000, out=print):
    """Host cost per call on a tiny problem (launch-bound): the CuPy backend called directly
    against the same call through torch (no grad, and forward+backward with autograd)."""
    calls, _ = tiny_calls()
    r = {f"{name}_us": us for name, us in per_call_us_interleaved(calls, n).items()}
    out(f"# per-call host overhead, tiny problem (1x128x2x64 bf16, causal), best of 7 rounds "
        f"of {n} calls, the four probes interleaved:")
    out(f"forward:          CuPy direct {r['cupy_fwd_us']:.1f} us, through torch {r['torch_fwd_us']:.1f} us "
        f"(+{r['torch_fwd_us'] - r['cupy_fwd_us']:.1f} us)")
    out(f"forward+backward: CuPy direct {r['cupy_fwdbwd_us']:.1f} us, through torch autograd "
        f"{r['torch_fwdbwd_us']:.1f} us (+{r['torch_fwdbwd_us'] - r['cupy_fwdbwd_us']:.1f} us)")
    return r


def decode(batches=DECODE_BATCHES, caches=DECODE_CACHES, page_size=DECODE_PAGE_SIZE,
           peer="sdpa_cudnn", out=print):
    """The decode table: flashcore (contiguous and paged) against ``peer`` on the contiguous
    cache, three figures each, with ratios (peer / flashcore: > 1 means flashcore is faster):

    * GPU time with the L2 flushed (:func:`gpu_time`) of one step through the public
      ``attention_with_kvcache`` (``cache_seqlens`` a CUDA int32 tensor);
    * host loop: such steps back to back, one synchronisation at the end, the best of 7 rounds
      in which the three calls (flashcore contiguous and paged, the peer) take turns
      (:func:`per_call_us_interleaved`); the two layouts' caches are held together for it;
    * CUDA-graph replay (:func:`graph_replay_time`): one such step captured, replayed. A step
      that cannot be captured shows n/a and the reason is printed once.

    The peer (SDPA) runs on the contiguous cache, timed the same three ways.

    Returns the rows (microseconds; NaN where n/a)."""
    import torch
    nan = float("nan")
    reasons: dict[str, str] = {}
    out(f"# decode: 1 query token, {DECODE_HEADS} q heads / {DECODE_HEADS_K} kv heads, "
        f"d{DECODE_HEADDIM}, bf16, full caches, cache_seqlens a CUDA int32 tensor; paged: pages "
        f"of {page_size}; {peer} on the contiguous cache; GPU {torch.cuda.get_device_name()}")
    out("# microseconds per step; ratio = peer / flashcore (> 1: flashcore faster)")
    head = (f"{'batch':>5s} {'cache':>6s} {'layout':10s} | {'GPU time, L2 flushed':^26s} | "
            f"{'host loop':^26s} | {'CUDA graph replay':^26s}")
    out(head)
    out(f"{'':>5s} {'':>6s} {'':10s} |" + f" {'flashcore':>9s} {'peer':>8s} {'ratio':>6s} |" * 3)
    rows = []
    layouts = ("contiguous", "paged")
    for b in batches:
        for s in caches:
            pbs = {layout: DecodeProblem(b, s, seed=b * 100003 + s,
                                         page_size=page_size if layout == "paged" else None)
                   for layout in layouts}
            contiguous = pbs["contiguous"]
            peer_us = {}
            with sdpa_pinned(peer):
                peer_us["gpu"] = gpu_time(contiguous.sdpa_unpinned) * 1e6
            gpu_us = {layout: gpu_time(pb.api) * 1e6 for layout, pb in pbs.items()}
            # The three host loops interleaved, round by round: a host that runs faster or
            # slower for a while (the first cell of a sweep, timed alone, read high: sessions
            # 17 and 24 of the performance log) then affects them alike.
            with sdpa_pinned(peer):
                host_us = per_call_us_interleaved(
                    {"contiguous": contiguous.api, "paged": pbs["paged"].api,
                     "peer": contiguous.sdpa_unpinned}, 2000, round_s=0.05)
            peer_us["host"] = host_us["peer"]
            try:
                peer_us["graph"] = graph_replay_time(decode_graph(peer, contiguous)) * 1e6
            except NotImplementedError as exc:
                peer_us["graph"] = nan
                reasons.setdefault(peer, str(exc))
            for layout, pb in pbs.items():
                impl = "flashcore" if layout == "contiguous" else "flashcore_paged"
                row = {"batch": b, "cache": s, "layout": layout,
                       "flashcore_gpu_us": gpu_us[layout], "flashcore_host_us": host_us[layout]}
                if impl in reasons:
                    row["flashcore_graph_us"] = nan
                else:
                    try:
                        row["flashcore_graph_us"] = graph_replay_time(decode_graph(impl, pb)) * 1e6
                    except NotImplementedError as exc:
                        row["flashcore_graph_us"] = nan
                        reasons[impl] = str(exc)
                cells = []
                for fig in ("gpu", "host", "graph"):
                    mine, theirs = row[f"flashcore_{fig}_us"], peer_us[fig]
                    row[f"{peer}_{fig}_us"] = theirs
                    cells.append(f" {_us(mine):>9s} {_us(theirs):>8s} {_ratio(theirs, mine):>6s} |")
                out(f"{b:5d} {s:6d} {layout:10s} |" + "".join(cells))
                sys.stdout.flush()
                rows.append(row)
            del pbs, contiguous
            torch.cuda.empty_cache()
    for why in reasons.values():
        out(f"# n/a: {why}")
    return rows


def _us(x):
    return "n/a" if x is None or math.isnan(x) else f"{x:.1f}"


def _ratio(theirs, mine):
    if any(x is None or math.isnan(x) for x in (theirs, mine)) or not mine:
        return "n/a"
    return f"{theirs / mine:.2f}x"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashcore.bench",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--mode", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "bwd", "fwdbwd"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--impl", nargs="+", default=["cupy"], choices=["cupy", "torch"])
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--family", choices=["default", "ampere", "v0", "v1", "ws"], default="default",
                   help="kernel family on compute capability 9.0: the default (the Hopper "
                        "wgmma kernels where they apply, the warp-specialised forward for dense "
                        "calls), 'ampere' (the mma.sync kernels everywhere), or one Hopper "
                        "forward explicitly: the cp.async v0 / v1, or ws")
    p.add_argument("--overhead", action="store_true",
                   help="only measure the per-call host overhead (CuPy direct vs through torch)")
    p.add_argument("--decode", action="store_true",
                   help="only the decode table: flashcore.attention_with_kvcache (contiguous "
                        "and paged) against SDPA's cuDNN backend, GPU time with the L2 flushed, "
                        "host loop and CUDA-graph replay, with ratios")
    p.add_argument("--batch", type=int, nargs="+", default=list(DECODE_BATCHES),
                   help="--decode: batch sizes (default 1 8 64)")
    p.add_argument("--cache", type=int, nargs="+", default=list(DECODE_CACHES),
                   help="--decode: cache lengths (default 4096 16384 131072)")
    p.add_argument("--page-size", type=int, default=DECODE_PAGE_SIZE,
                   help=f"--decode: the paged rows' page size (default {DECODE_PAGE_SIZE}; a "
                        "multiple of 16 that divides the cache lengths, e.g. 16 as vLLM's)")
    a = p.parse_args(argv)
    why = why_no_gpu()
    if why:
        print(f"python -m flashcore.bench: needs a CUDA GPU with CuPy and PyTorch: {why}",
              file=sys.stderr)
        return 2
    if a.family != "default":
        from .kernels import backward, forward
        forward.set_sm90(a.family != "ampere", pipelined=a.family == "v1", ws=a.family == "ws")
        backward.set_sm90(a.family != "ampere")
    if a.overhead:
        rows = overhead()
    elif a.decode:
        rows = decode(a.batch, a.cache, a.page_size)
    else:
        causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
        rows = run(a.seqlen, a.headdim, causals, a.mode, a.dtype, impls=tuple(a.impl))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
