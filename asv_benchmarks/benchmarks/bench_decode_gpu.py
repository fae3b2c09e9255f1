"""KV-cache decoding on the GPU: flashcore's decode kernel against torch SDPA's fastest
backends, measured in the same process.

The shapes of the decode-speed target: one query token, 32 query heads over 8 kv heads,
headdim 128, bf16, a contiguous cache of 4k / 16k / 128k tokens per sequence, batch 1 / 8 /
64 (paged caches: tests/diagnostics/bench_decode.py). A decoding step is shorter than its Python
launch, so GPU time is measured the way tests/diagnostics/bench_decode.py does it
(flashcore.bench.gpu_time_l2_flushed: calls queued behind a spin kernel, L2 flushed before
each, one pair of CUDA events each). flashcore is timed through its launcher
(flashcore.kernels.decode.launch_decode, the split heuristic included), as in every
result committed before the public attention_with_kvcache stopped reading cache_seqlens back to
the host (kept so that the figures stay comparable across commits). SDPA is given the same K/V (enable_gqa) without cache lengths: the full cache
is read by everyone.

Beside these GPU-time groups, what a user's decoding loop pays, through the public API
(``flashcore.attention_with_kvcache`` with ``cache_seqlens`` a CUDA int32 tensor), contiguous
and paged (pages of 256, and of 16), against SDPA's cuDNN backend on the contiguous cache:

* ``DecodeWallClock``: host wall-clock per step of a loop of steps ended by one
  synchronisation (flashcore.bench.host_loop_us);
* ``DecodeGraphReplay``: GPU time of one step captured in a CUDA graph and replayed
  (flashcore.bench.graph_replay_time). A step that cannot be captured is skipped, the reason
  printed on stderr (``asv run --show-stderr``).
"""
import sys

from .common import (
    DECODE_BATCHES, DECODE_CACHES, DECODE_HEADDIM, DECODE_HEADS, DECODE_HEADS_K,
    DECODE_PAGE_SIZE, PEERS, decode_graph, decode_step, graph_replay_time, host_loop_us,
    require_gpu_backend, sdpa_backend, sdpa_pinned)

H, HK, D = DECODE_HEADS, DECODE_HEADS_K, DECODE_HEADDIM
BATCHES = list(DECODE_BATCHES)
CACHES = list(DECODE_CACHES)
#: the public API on a contiguous and on a paged cache (pages of 256, and of 16 as vLLM's),
#: and SDPA's cuDNN kernel
API_IMPLS = ["flashcore", "flashcore_paged", "flashcore_paged16", "sdpa_cudnn"]
PAGE_SIZES = {"flashcore_paged": DECODE_PAGE_SIZE, "flashcore_paged16": 16}


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


class _DecodeAPI:
    """The shared setup of the public-API groups: one DecodeProblem of the implementation's
    layout (paged for 'flashcore_paged' and 'flashcore_paged16'), its step, and the SDPA kernel
    pinned for a peer."""

    timeout = 240
    rounds = 1          # see _Decode

    def setup(self, impl, batch, cache):
        from flashcore.bench import DecodeProblem
        require_gpu_backend("torch" if impl.startswith("flashcore") else impl)
        self.pb = DecodeProblem(batch, cache, H, HK, D, seed=batch * 100003 + cache,
                                page_size=PAGE_SIZES.get(impl))
        self.impl = impl
        self.peer = None if impl.startswith("flashcore") else impl
        try:        # the first step compiles flashcore's kernels, outside the timing
            with sdpa_pinned(self.peer):
                decode_step(impl, self.pb)()
        except RuntimeError as e:
            if self.peer is None:
                raise
            raise NotImplementedError(f"{impl} cannot run this shape here: "
                                      f"{str(e).splitlines()[0]}") from None


class DecodeWallClock(_DecodeAPI):
    """Microseconds of host wall-clock per decoding step, steps back to back through the
    public API (flashcore) or SDPA (peer), one synchronisation at the end of the loop."""

    params = [API_IMPLS, BATCHES, CACHES]
    param_names = ["impl", "batch", "cache"]
    unit = "us"

    def track_step_us(self, impl, batch, cache):
        with sdpa_pinned(self.peer):
            return host_loop_us(decode_step(impl, self.pb))


class DecodeGraphReplay(_DecodeAPI):
    """Microseconds of GPU time of one decoding step replayed from a CUDA graph (captured
    once in setup; L2 flushed before each replay, median)."""

    params = [API_IMPLS, BATCHES, CACHES]
    param_names = ["impl", "batch", "cache"]
    unit = "us"

    def setup(self, impl, batch, cache):
        super().setup(impl, batch, cache)
        try:
            self.graph = decode_graph(impl, self.pb)
        except NotImplementedError as exc:   # skipped, with the reason where asv shows it
            print(f"DecodeGraphReplay({impl}, {batch}, {cache}) skipped: {exc}", file=sys.stderr)
            raise

    def track_replay_us(self, impl, batch, cache):
        return graph_replay_time(self.graph) * 1e6
