"""Shared pieces of the benchmark suite: the parameter space, and flashcore.bench's problems,
timers and availability checks under the names the benchmarks use.

The problems (sizes, FLOP count, inputs, the calls timed) and the timers are defined once, in
``flashcore/bench.py``, and used both here and by ``python -m flashcore.bench``: a figure of
the command and the asv figure of the same name are measured the same way.

Nothing here touches a GPU at import time. asv's forkserver imports every benchmark module
once and forks a process per benchmark; a CUDA call in the parent would poison the children,
so torch and CuPy are only *imported* here (to spare each child the import), and all device
work happens in ``setup`` or in the benchmark itself. Every refusal is a NotImplementedError
(asv records the benchmark as skipped); the parameters never depend on what is installed.
"""
from __future__ import annotations

try:  # imported, never initialised: see the module docstring
    import torch
except Exception:  # not installed, or broken on this machine
    torch = None

try:
    import cupy
except Exception:
    cupy = None

from flashcore.bench import (  # noqa: E402,F401  (the one definition of each, re-exported)
    DECODE_BATCHES, DECODE_CACHES, DECODE_HEADDIM, DECODE_HEADS, DECODE_HEADS_K,
    DECODE_PAGE_SIZE, HIDDEN, TOKENS_PER_BATCH, AttentionProblem, DecodeProblem, decode_graph,
    decode_step, flops, fp8_quantise, generate_ids, generate_new_length_rounds,
    generate_rounds, generate_setup, gpu_time,
    gpu_time_l2_flushed, graph_replay_time, host_loop_us, llama_model, prefill_mask,
    prefill_rounds, random_arrays, require, require_transformers, sdpa_backend, sdpa_pinned,
    shape_for, speed_ratio, tiny_calls, train_step_ms)

# --------------------------------------------------------------------------------------------
# The parameter space (fixed: it never depends on what is installed)
# --------------------------------------------------------------------------------------------

#: flashcore's three backends, then torch SDPA pinned to one kernel: the peers
BACKENDS = ["numpy", "cupy", "torch", "sdpa_flash", "sdpa_cudnn"]
GPU_BACKENDS = ["cupy", "torch", "sdpa_flash", "sdpa_cudnn"]
PEERS = ["sdpa_flash", "sdpa_cudnn"]

#: the flash-attn benchmark sizes (see ANCHORS.md), thinned so a full run takes minutes
SEQLENS = [1024, 4096, 16384]
HEADDIMS = [64, 128, 256]
CAUSAL = [False, True]

PASSES = ["forward", "backward", "forward_backward"]

#: the old names of flashcore.bench's pieces, for the benchmark modules
Attention = AttentionProblem
require_gpu_backend = require


def median_ms(lib: str, fn) -> float:
    """flashcore.bench.gpu_time in milliseconds."""
    return gpu_time(fn, lib) * 1e3
