"""Shared pieces of the benchmark suite: sizes, FLOP counts, inputs, availability, timing.

Nothing here touches a GPU at import time. asv's forkserver imports every benchmark module
once and forks a process per benchmark; a CUDA call in the parent would poison the children,
so torch and CuPy are only *imported* here (to spare each child the import), and all device
work happens in ``setup`` or in the benchmark itself.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

try:  # imported, never initialised: see the module docstring
    import torch
except Exception:  # not installed, or broken on this machine
    torch = None

try:
    import cupy
except Exception:
    cupy = None

# --------------------------------------------------------------------------------------------
# The parameter space (fixed: it never depends on what is installed)
# --------------------------------------------------------------------------------------------

#: flashcore's three backends, then torch SDPA pinned to one kernel: the peers
BACKENDS = ["numpy", "cupy", "torch", "sdpa_flash", "sdpa_cudnn"]
GPU_BACKENDS = ["cupy", "torch", "sdpa_flash", "sdpa_cudnn"]
PEERS = ["sdpa_flash", "sdpa_cudnn"]

#: the flash-attn benchmark sizes (see ANCHORS.md), thinned so a full run takes minutes
TOKENS_PER_BATCH = 16384
HIDDEN = 2048
SEQLENS = [1024, 4096, 16384]
HEADDIMS = [64, 128, 256]
CAUSAL = [False, True]

PASSES = ["forward", "backward", "forward_backward"]


def shape_for(seqlen: int, headdim: int) -> tuple[int, int, int, int]:
    """(batch, seqlen, nheads, headdim) with 16k tokens per batch and hidden size 2048."""
    return TOKENS_PER_BATCH // seqlen, seqlen, HIDDEN // headdim, headdim


def flops(batch, seqlen, nheads, headdim, causal, which="forward") -> float:
    """FLOPs counted the flash-attn way: forward 4·b·h·s²·d (halved when causal),
    backward 2.5× that, forward+backward 3.5×."""
    f = 4.0 * batch * nheads * seqlen * seqlen * headdim
    if causal:
        f /= 2
    return f * {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}[which]


# --------------------------------------------------------------------------------------------
# Availability: every refusal is a NotImplementedError (asv records it as skipped)
# --------------------------------------------------------------------------------------------

def require_gpu_backend(backend: str) -> None:
    """Raise NotImplementedError, with the reason, unless ``backend`` runs on a GPU here."""
    if backend == "numpy":
        raise NotImplementedError("the NumPy backend runs on the CPU: see bench_numpy")
    if backend in ("torch", "sdpa_flash", "sdpa_cudnn"):
        if torch is None:
            raise NotImplementedError("PyTorch is not installed")
        if not torch.cuda.is_available():
            raise NotImplementedError("PyTorch sees no CUDA device")
    if backend in ("cupy", "torch"):
        import flashcore
        why = flashcore.available_backends().get(backend, f"flashcore has no {backend!r} backend")
        if why:
            raise NotImplementedError(f"flashcore's {backend!r} backend is unavailable: {why}")
    if backend in PEERS:
        sdpa_backend(backend)   # raises when this torch cannot pin that kernel


def sdpa_backend(backend: str):
    """The ``torch.nn.attention.SDPBackend`` a peer name stands for."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        raise NotImplementedError("this torch has no torch.nn.attention.SDPBackend") from None
    member = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}[backend]
    if not hasattr(SDPBackend, member):
        raise NotImplementedError(f"this torch has no SDPBackend.{member}")
    return getattr(SDPBackend, member)


# --------------------------------------------------------------------------------------------
# Inputs: random (never zeros), bfloat16, on the device
# --------------------------------------------------------------------------------------------

def _cupy_bfloat16(x32):
    """float32 CuPy array -> bfloat16 (ml_dtypes), rounding to nearest even."""
    import ml_dtypes
    try:
        return x32.astype(ml_dtypes.bfloat16)
    except Exception:   # a CuPy without bfloat16 arithmetic can still hold the bits
        u = x32.view(cupy.uint32)
        u = (u + (cupy.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
        return u.astype(cupy.uint16).view(ml_dtypes.bfloat16)


def random_arrays(lib: str, shapes, seed: int = 0, requires_grad: bool = False):
    """One random bfloat16 array per shape ('cupy' or 'torch' on the current device)."""
    if lib == "cupy":
        rng = cupy.random.default_rng(seed)
        return [_cupy_bfloat16(rng.standard_normal(s, dtype=cupy.float32)) for s in shapes]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16)
            .requires_grad_(requires_grad) for s in shapes]


# --------------------------------------------------------------------------------------------
# Timing: CUDA events, warm-up, L2 flushed before every repetition, median
# --------------------------------------------------------------------------------------------

L2_FLUSH_BYTES = 256 * 1024 * 1024   # > 4x the H200's 60 MB L2


class CudaTimer:
    """Times a callable with CUDA events on the current stream of ``lib`` ('cupy'|'torch')."""

    def __init__(self, lib: str):
        self.lib = lib
        if lib == "torch":
            self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        else:
            self._flush = cupy.empty(L2_FLUSH_BYTES, dtype=cupy.uint8)

    def _event(self):
        if self.lib == "torch":
            return torch.cuda.Event(enable_timing=True)
        return cupy.cuda.Event()

    def _sync(self):
        if self.lib == "torch":
            torch.cuda.synchronize()
        else:
            cupy.cuda.Device().synchronize()

    def _elapsed_ms(self, start, end):
        if self.lib == "torch":
            return start.elapsed_time(end)
        return cupy.cuda.get_elapsed_time(start, end)

    def median_ms(self, fn, warmup: int = 3, min_reps: int = 5, max_reps: int = 50,
                  target_ms: float = 100.0) -> float:
        """Median time of ``fn()`` in milliseconds after ``warmup`` calls.

        The number of repetitions aims at ``target_ms`` of measured time, within
        [min_reps, max_reps]; the L2 is overwritten before every repetition, outside the
        timed interval (as triton.testing.do_bench does).
        """
        start, end = self._event(), self._event()
        start.record()
        for _ in range(warmup):
            fn()
        end.record()
        self._sync()
        estimate = max(self._elapsed_ms(start, end) / max(warmup, 1), 1e-3)
        reps = int(min(max(math.ceil(target_ms / estimate), min_reps), max_reps))
        events = [(self._event(), self._event()) for _ in range(reps)]
        for s, e in events:
            self._flush.fill(0) if self.lib == "cupy" else self._flush.zero_()
            s.record()
            fn()
            e.record()
        self._sync()
        return statistics.median(self._elapsed_ms(s, e) for s, e in events)


# --------------------------------------------------------------------------------------------
# One attention implementation behind three calls: forward, backward, forward+backward
# --------------------------------------------------------------------------------------------

class Attention:
    """Builds the inputs for ``backend`` and exposes ``forward``, ``backward`` and
    ``forward_backward`` as argument-less callables, plus ``lib`` for the timer.

    flashcore's backends take (batch, seqlen, nheads, headdim); the SDPA peers get their own
    native layout, (batch, nheads, seqlen, headdim), contiguous.
    """

    def __init__(self, backend, batch, seqlen, nheads, headdim, causal, seed=0):
        self.backend, self.causal = backend, causal
        require_gpu_backend(backend)
        if backend == "cupy":
            self.lib = "cupy"
            self._setup_cupy((batch, seqlen, nheads, headdim), seed)
        else:
            self.lib = "torch"
            if backend == "torch":
                self._setup_flashcore_torch((batch, seqlen, nheads, headdim), seed)
            else:
                self._setup_sdpa((batch, nheads, seqlen, headdim), seed)

    # flashcore through CuPy: explicit forward and backward
    def _setup_cupy(self, shape, seed):
        import flashcore
        q, k, v, dout = random_arrays("cupy", [shape] * 4, seed)
        c = self.causal
        out, lse = flashcore.attention_forward(q, k, v, causal=c)

        def forward():
            return flashcore.attention_forward(q, k, v, causal=c)

        def backward():
            return flashcore.attention_backward(dout, q, k, v, out, lse, causal=c)

        def forward_backward():
            o, l = flashcore.attention_forward(q, k, v, causal=c)
            return flashcore.attention_backward(dout, q, k, v, o, l, causal=c)

        self.forward, self.backward, self.forward_backward = forward, backward, forward_backward
        backward()      # compiles (or loads) the backward kernels before any timing

    # torch tensors through autograd: flashcore.attention or SDPA
    def _setup_autograd(self, attn, shape, seed):
        q, k, v, dout = random_arrays("torch", [shape] * 4, seed, requires_grad=True)
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
        c = self.causal
        self._setup_autograd(lambda q, k, v: flashcore.attention(q, k, v, causal=c), shape, seed)

    def _setup_sdpa(self, shape, seed):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
        pinned, c = sdpa_backend(self.backend), self.causal

        def attn(q, k, v):
            with sdpa_kernel(pinned):
                return scaled_dot_product_attention(q, k, v, is_causal=c)

        try:
            self._setup_autograd(attn, shape, seed)
        except RuntimeError as e:   # "No available kernel": this peer cannot take the shape
            raise NotImplementedError(f"{self.backend} cannot run this shape here: "
                                      f"{str(e).splitlines()[0]}") from None

    def tflops(self, which: str, flop_count: float, timer: CudaTimer | None = None) -> float:
        timer = timer or CudaTimer(self.lib)
        ms = timer.median_ms(getattr(self, which))
        return flop_count / (ms * 1e-3) / 1e12
