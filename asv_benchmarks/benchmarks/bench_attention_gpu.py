"""GPU throughput and memory of flashcore and of its peers, at the flash-attn benchmark sizes.

Every figure of flashcore is only meaningful next to the peers measured in the same run:
torch's scaled_dot_product_attention pinned to its FlashAttention-2 kernel (``sdpa_flash``)
and to cuDNN (``sdpa_cudnn``). The peers are benchmark parameters like flashcore's backends,
so each commit's results carry the peers of that run, and ``TimeRatio`` measures flashcore and
a peer in one process.
"""
from .common import (
    BACKENDS, CAUSAL, GPU_BACKENDS, HEADDIMS, PEERS, SEQLENS, TOKENS_PER_BATCH, Attention, flops,
    host_loop_us, median_ms, require_gpu_backend, sdpa_pinned, shape_for, tiny_calls, torch,
    cupy,
)


class Throughput:
    """TFLOP/s of one backend (flash-attn FLOP count), 16k tokens per batch, hidden 2048, bf16."""

    params = [BACKENDS, SEQLENS, HEADDIMS, CAUSAL]
    param_names = ["backend", "seqlen", "headdim", "causal"]
    unit = "TFLOP/s"
    timeout = 180       # the first call of a configuration may compile its kernels
    # One process per parameter set (asv's default is 2 rounds): each figure is already the
    # median of many CUDA-event samples, and a second round doubles a suite that must fit
    # into 10-minute device calls.
    rounds = 1

    def setup(self, backend, seqlen, headdim, causal):
        self.shape = shape_for(seqlen, headdim)
        self.attn = Attention(backend, *self.shape, causal)

    def _track(self, which):
        return self.attn.tflops(which, flops(*self.shape, self.attn.causal, which))

    def track_forward(self, *params):
        return self._track("forward")

    def track_backward(self, *params):
        return self._track("backward")

    def track_forward_backward(self, *params):
        return self._track("forward_backward")


class Ratio:
    """flashcore's speed divided by a peer's, both measured in this process (> 1: faster).

    flashcore is called through its CuPy API (the kernels themselves, no autograd layer); the
    peer through torch autograd. Both are timed by the same method on the same inputs' sizes.
    """

    params = [PEERS, ["forward", "forward_backward"], SEQLENS, HEADDIMS, CAUSAL]
    param_names = ["peer", "pass", "seqlen", "headdim", "causal"]
    unit = "ratio"
    timeout = 180
    rounds = 1          # see Throughput

    def setup(self, peer, which, seqlen, headdim, causal):
        shape = shape_for(seqlen, headdim)
        self.flashcore = Attention("cupy", *shape, causal)
        self.peer = Attention(peer, *shape, causal)

    def track_ratio(self, peer, which, *params):
        fc = median_ms("cupy", getattr(self.flashcore, which))
        other = median_ms("torch", getattr(self.peer, which))
        return other / fc


class DropoutRatio:
    """Attention dropout (p = 0.1), forward+backward through autograd on torch tensors (the
    random state drawn per call, as a training step does), 16k tokens per batch, hidden 2048:
    a peer's time divided by flashcore's (> 1: faster), both in this process. Peers: SDPA's
    flash and cuDNN kernels with the same dropout, and flashcore itself without dropout
    ('flashcore_p0': what dropout costs)."""

    params = [PEERS + ["flashcore_p0"], [4096, 16384], [64, 128], CAUSAL]
    param_names = ["peer", "seqlen", "headdim", "causal"]
    unit = "ratio"
    timeout = 180
    rounds = 1          # see Throughput

    def setup(self, peer, seqlen, headdim, causal):
        shape = shape_for(seqlen, headdim)
        self.flashcore = Attention("torch", *shape, causal, dropout_p=0.1)
        self.peer = Attention("torch" if peer == "flashcore_p0" else peer, *shape, causal,
                              dropout_p=0.0 if peer == "flashcore_p0" else 0.1)

    def track_ratio(self, peer, *params):
        fc = median_ms("torch", self.flashcore.forward_backward)
        other = median_ms("torch", self.peer.forward_backward)
        return other / fc


class OddHeadDimRatio:
    """Head dims that are no multiple of 8 (59, 111: flashcore pads them to 64 / 112 inside
    the call), forward+backward, 16k tokens per batch: the time of the call a user would make
    at the padded head dim -- flashcore itself ('flashcore_padded') or SDPA's kernels, which
    take only multiples of 8 -- divided by flashcore's at the odd one (> 1: faster)."""

    params = [PEERS + ["flashcore_padded"], [4096], [59, 111], CAUSAL]
    param_names = ["peer", "seqlen", "headdim", "causal"]
    unit = "ratio"
    timeout = 180
    rounds = 1

    def setup(self, peer, seqlen, headdim, causal):
        b, s, h, _ = shape_for(seqlen, headdim)
        padded = -(-headdim // 8) * 8          # the same heads, each padded
        self.flashcore = Attention("cupy", b, s, h, headdim, causal)
        self.peer = Attention("cupy" if peer == "flashcore_padded" else peer, b, s, h, padded,
                              causal)

    def track_ratio(self, peer, *params):
        fc = median_ms("cupy", self.flashcore.forward_backward)
        other = median_ms("cupy" if peer == "flashcore_padded" else "torch",
                          self.peer.forward_backward)
        return other / fc


class PeakMemory:
    """Device memory a call allocates at its peak, beyond what existed before it (bytes).

    batch 1, 16 heads of 128, bf16, long sequences: an exact-attention kernel that never
    materialises the seqlen x seqlen scores grows linearly (x4 per step here); the fp32 scores
    of the 16 heads alone would need 16 GiB at 16k and 256 GiB at 64k.
    """

    # Not causal only: a causal mask changes no allocation (and halves a suite that must fit
    # into 10-minute device calls); the parameter stays so that results keep one layout.
    params = [BACKENDS, [4096, 16384, 65536], [False]]
    param_names = ["backend", "seqlen", "causal"]
    unit = "bytes"
    timeout = 180
    rounds = 1          # see Throughput (and the figure is deterministic)

    def setup(self, backend, seqlen, causal):
        require_gpu_backend(backend)
        self.attn = Attention(backend, 1, seqlen, 16, 128, causal)

    def _peak(self, fn):
        if self.attn.lib == "torch":
            # flashcore's torch backend runs CuPy kernels whose scratch (the backward's fp32 dQ
            # accumulator) comes from CuPy's pool, which torch's counters do not see. The
            # pool is emptied first; what it holds afterwards is what it had to obtain during
            # the call (CuPy memory hooks are per thread and miss the autograd engine's). The
            # sum is an upper bound when the two peaks do not coincide. Results of 960bf83
            # and before counted torch's allocator only.
            pool = cupy.get_default_memory_pool() if self.attn.backend == "torch" else None
            torch.cuda.synchronize()
            if pool is not None:
                pool.free_all_blocks()
                pool_before = pool.total_bytes()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            result = fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            del result
            if pool is not None:
                peak += pool.total_bytes() - pool_before
            return peak
        hook = _PeakHook()
        cupy.cuda.Device().synchronize()
        with hook:
            result = fn()
            cupy.cuda.Device().synchronize()
            del result
        return hook.peak

    def track_peak_memory_forward(self, *params):
        return self._peak(self.attn.forward)

    def track_peak_memory_backward(self, *params):
        return self._peak(self.attn.backward)


class TrainStepWallClock:
    """Host wall-clock per step of the tiny training step (1 x 128 x 2 x 64 bf16, causal), in
    microseconds: a loop of steps back to back ended by one synchronisation (launch-bound:
    what the host pays per call). flashcore through ``flashcore.attention`` on torch tensors,
    the peers through torch SDPA pinned to their kernel (pinned once, outside the loop);
    'forward' runs under ``torch.no_grad()``, 'forward_backward' through autograd
    (``torch.autograd.grad``). flashcore.bench.tiny_calls defines the steps."""

    params = [["flashcore"] + PEERS, ["forward", "forward_backward"]]
    param_names = ["impl", "pass"]
    unit = "us"
    timeout = 180       # the first call may compile kernels
    rounds = 1          # see Throughput: the figure is already the best of several loops

    def setup(self, impl, which):
        require_gpu_backend("torch" if impl == "flashcore" else impl)
        calls, _ = tiny_calls(peers=() if impl == "flashcore" else (impl,))
        name = "torch" if impl == "flashcore" else impl
        self.step = calls[f"{name}_{'fwd' if which == 'forward' else 'fwdbwd'}"]
        self.peer = None if impl == "flashcore" else impl
        with sdpa_pinned(self.peer):
            _first_call(impl, self.step)

    def track_step_us(self, *params):
        with sdpa_pinned(self.peer):
            return host_loop_us(self.step)


def _first_call(impl, step):
    """Call ``step`` once (compiling what it needs outside the timing); a peer that cannot take
    the shape ("No available kernel") is skipped with the reason."""
    try:
        step()
    except RuntimeError as e:
        if impl == "flashcore":
            raise
        raise NotImplementedError(f"{impl} cannot run this shape here: "
                                  f"{str(e).splitlines()[0]}") from None


def _PeakHook():
    """A CuPy memory hook that follows the bytes allocated from the pool while it is active."""
    from cupy.cuda.memory_hook import MemoryHook

    class PeakHook(MemoryHook):
        name = "flashcore_peak"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.current += kw["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kw):
            self.current -= kw["mem_size"]

    return PeakHook()


# the GPU backends listed for readers of this module; the parameters above use BACKENDS so
# that the NumPy backend shows up as "skipped on the GPU" rather than disappearing
__all__ = ["Throughput", "Ratio", "PeakMemory", "TrainStepWallClock", "GPU_BACKENDS"]


class PagedPrefillRatio:
    """Prefill over a paged KV cache (``flash_attn_varlen_func`` with ``block_table``, torch
    tensors, device ``cu_seqlens``): the same call over the packed keys divided by the paged
    call's time (1: pages cost nothing). Sequences of random lengths around ``seqlen``, ~16k
    tokens, hidden 2048, bf16; the pages in a shuffled order of the pool. Pages of 16 (vLLM's)
    and 256 (flash-attn's). No SDPA kernel reads a paged cache: the packed call is the peer."""

    params = [[16, 256], [4096], [128], CAUSAL]
    param_names = ["page", "seqlen", "headdim", "causal"]
    unit = "ratio"
    timeout = 180
    rounds = 1          # see Throughput

    def setup(self, page, seqlen, headdim, causal):
        require_gpu_backend("torch")
        import numpy as np
        from flashcore.flash_attn import flash_attn_varlen_func
        _, _, h, d = shape_for(seqlen, headdim)
        rng = np.random.default_rng(0)
        lens = []
        while sum(lens) < TOKENS_PER_BATCH - seqlen // 2:
            lens.append(int(rng.integers(seqlen // 2, 3 * seqlen // 2)) | 1)
        total, dev = sum(lens), "cuda"
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
        q, k, v = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        per = max(-(-n // page) for n in lens)
        table = torch.from_numpy(rng.permutation(len(lens) * per).astype(np.int32)).to(dev)
        table = table.view(len(lens), per)
        kc, vc = (torch.zeros(len(lens) * per, page, h, d, device=dev, dtype=torch.bfloat16)
                  for _ in range(2))
        for i, n in enumerate(lens):
            t = torch.arange(n, device=dev)
            a = int(cu[i])
            kc[table[i, t // page], t % page] = k[a:a + n]
            vc[table[i, t // page], t % page] = v[a:a + n]
        s = max(lens)
        self.packed = lambda: flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=causal)
        self.paged = lambda: flash_attn_varlen_func(q, kc, vc, cu, cu, s, s, causal=causal,
                                                    block_table=table)

    def track_ratio(self, *params):
        return median_ms("torch", self.packed) / median_ms("torch", self.paged)
