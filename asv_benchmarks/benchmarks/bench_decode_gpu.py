"""KV-cache decoding on the GPU: flashcore's decode kernel against torch SDPA's fastest
backends, measured in the same process.

The shapes of the decode-speed target: one query token, 32 query heads over 8 kv heads,
headdim 128, bf16, a contiguous cache of 4k / 16k / 128k tokens per sequence, batch 1 / 8 /
64 (paged caches: tests/gpu/bench_decode.py). A decoding step is shorter than its Python
launch, so GPU time is measured the way tests/gpu/bench_decode.py does it
(flashcore.bench.gpu_time_l2_flushed: calls queued behind a spin kernel, L2 flushed before
each, one pair of CUDA events each). flashcore is timed through its launcher
(flashcore.kernels.decode.launch_decode, the split heuristic included): the public
attention_with_kvcache validates cache_seqlens on the host, which synchronises, so it cannot be
queued that way. SDPA is given the same K/V (enable_gqa) without cache lengths: the full cache
is read by everyone.
"""
from .common import PEERS, require_gpu_backend, sdpa_backend, torch

H, HK, D = 32, 8, 128
BATCHES = [1, 8, 64]
CACHES = [4096, 16384, 131072]


class _Decode:
    def _setup(self, batch, cache):
        import math

        import cupy as cp
        require_gpu_backend("cupy")
        self.nbytes = 2 * batch * cache * HK * D * 2
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(batch * 100003 + cache)
        self.q = torch.randn(batch, 1, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        self.kc = torch.randn(batch, cache, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
        self.vc = torch.randn(batch, cache, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(batch, H, 1, device=dev, dtype=torch.float32)
        self.seqlens = torch.full((batch,), cache, device=dev, dtype=torch.int32)
        arrays = (self.q, self.kc, self.vc, self.out, self.lse, self.seqlens)
        self.cq, self.ck, self.cv, self.co, self.cl, self.cs = (cp.from_dlpack(x) for x in arrays)
        self.stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
        self.scale = 1.0 / math.sqrt(D)

    def _flashcore_time(self):
        from flashcore.bench import gpu_time_l2_flushed
        from flashcore.kernels.decode import launch_decode

        def call():
            launch_decode(self.cq, self.ck, self.cv, self.co, self.cl, cache_seqlens=self.cs,
                          softmax_scale=self.scale, window_left=-1, window_right=-1)
        with self.stream:
            return gpu_time_l2_flushed(call)

    def _peer_time(self, peer):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        from flashcore.bench import gpu_time_l2_flushed
        require_gpu_backend(peer)
        qt, kt, vt = (x.transpose(1, 2) for x in (self.q, self.kc, self.vc))

        def call():
            with sdpa_kernel(sdpa_backend(peer)):
                F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return gpu_time_l2_flushed(call)


class DecodeBandwidth(_Decode):
    """TB/s of K+V cache bytes read per decoding step (bytes / GPU time)."""

    params = [["flashcore"] + PEERS, BATCHES, CACHES]
    param_names = ["impl", "batch", "cache"]
    unit = "TB/s"
    timeout = 240
    rounds = 1

    def setup(self, impl, batch, cache):
        self._setup(batch, cache)

    def track_bandwidth(self, impl, batch, cache):
        t = self._flashcore_time() if impl == "flashcore" else self._peer_time(impl)
        return self.nbytes / t / 1e12


class DecodeRatio(_Decode):
    """flashcore's decoding speed divided by a peer's, both measured in this process
    (> 1: flashcore faster)."""

    params = [PEERS, BATCHES, CACHES]
    param_names = ["peer", "batch", "cache"]
    unit = "ratio"
    timeout = 240
    rounds = 1

    def setup(self, peer, batch, cache):
        self._setup(batch, cache)

    def track_ratio(self, peer, batch, cache):
        return self._peer_time(peer) / self._flashcore_time()
