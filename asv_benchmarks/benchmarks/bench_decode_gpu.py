"""KV-cache decoding on the GPU: flashcore's decode kernel against torch SDPA's fastest
backends, measured in the same process.

The shapes of the decode-speed target: one query token, 32 query heads over 8 kv heads,
headdim 128, bf16, a contiguous cache of 4k / 16k / 128k tokens per sequence, batch 1 / 8 /
64 (paged caches: tests/diagnostics/bench_decode.py). A decoding step is shorter than its Python
launch, so GPU time is measured the way tests/diagnostics/bench_decode.py does it
(flashcore.bench.gpu_time_l2_flushed: calls queued behind a spin kernel, L2 flushed before
each, one pair of CUDA events each). flashcore is timed through its launcher
(flashcore.kernels.decode.launch_decode, the split heuristic included): the public
attention_with_kvcache validates cache_seqlens on the host, which synchronises, so it cannot be
queued that way. SDPA is given the same K/V (enable_gqa) without cache lengths: the full cache
is read by everyone.
"""
from .common import PEERS, require_gpu_backend, sdpa_backend

H, HK, D = 32, 8, 128
BATCHES = [1, 8, 64]
CACHES = [4096, 16384, 131072]


class _Decode:
    """The shared setup; a benchmark's first parameter names the implementation or peer."""

    timeout = 240
    rounds = 1          # one process per parameter set (see bench_attention_gpu.Throughput)

    def setup(self, _which, batch, cache):
        from flashcore.bench import DecodeProblem
        require_gpu_backend("cupy")
        self.pb = DecodeProblem(batch, cache, H, HK, D, seed=batch * 100003 + cache)
        self.nbytes = self.pb.nbytes

    def _flashcore_time(self):
        from flashcore.bench import gpu_time_l2_flushed
        with self.pb.stream:
            return gpu_time_l2_flushed(self.pb.run)

    def _peer_time(self, peer):
        from flashcore.bench import gpu_time_l2_flushed
        require_gpu_backend(peer)
        backend = sdpa_backend(peer)
        return gpu_time_l2_flushed(lambda: self.pb.sdpa(backend))


class DecodeBandwidth(_Decode):
    """TB/s of K+V cache bytes read per decoding step (bytes / GPU time)."""

    params = [["flashcore"] + PEERS, BATCHES, CACHES]
    param_names = ["impl", "batch", "cache"]
    unit = "TB/s"

    def track_bandwidth(self, impl, batch, cache):
        t = self._flashcore_time() if impl == "flashcore" else self._peer_time(impl)
        return self.nbytes / t / 1e12


class DecodeRatio(_Decode):
    """flashcore's decoding speed divided by a peer's, both measured in this process
    (> 1: flashcore faster)."""

    params = [PEERS, BATCHES, CACHES]
    param_names = ["peer", "batch", "cache"]
    unit = "ratio"

    def track_ratio(self, peer, batch, cache):
        return self._peer_time(peer) / self._flashcore_time()
