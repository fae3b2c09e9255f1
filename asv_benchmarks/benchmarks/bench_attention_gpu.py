"""GPU throughput and memory of flashcore and of its peers, at the flash-attn benchmark sizes.

Every figure of flashcore is only meaningful next to the peers measured in the same run:
torch's scaled_dot_product_attention pinned to its FlashAttention-2 kernel (``sdpa_flash``)
and to cuDNN (``sdpa_cudnn``). The peers are benchmark parameters like flashcore's backends,
so each commit's results carry the peers of that run, and ``TimeRatio`` measures flashcore and
a peer in one process.
"""
from .common import (
    BACKENDS, CAUSAL, GPU_BACKENDS, HEADDIMS, PEERS, SEQLENS, Attention, CudaTimer, flops,
    require_gpu_backend, shape_for, torch, cupy,
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
        fc = CudaTimer("cupy").median_ms(getattr(self.flashcore, which))
        other = CudaTimer("torch").median_ms(getattr(self.peer, which))
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
__all__ = ["Throughput", "Ratio", "PeakMemory", "GPU_BACKENDS"]
