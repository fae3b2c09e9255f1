"""How long a kernel configuration takes to become callable.

* cold: compiled by NVRTC from source, into an empty kernel cache (flashcore's own,
  ``config.cache_dir``), with flashcore's in-memory kernel tables cleared: what a user waits
  for on the very first call;
* warm: loaded from the disk cache that the cold call just filled: what every later process
  waits for.

Measured through the public API on a tiny problem (1 x 128 tokens, 1 head, bf16), so the time
is that of getting the kernel, not of running it.
"""
import os
import shutil
import sys
import tempfile
import time

from .common import cupy, random_arrays, require_gpu_backend

def clear_flashcore_memory_caches():
    """Forget every kernel flashcore holds in memory (so the next call goes to the disk)."""
    import flashcore.jit
    clear = getattr(flashcore.jit, "clear_memory_cache", None)
    if callable(clear):
        clear()
    for name, mod in list(sys.modules.items()):
        if not (name == "flashcore.jit" or name.startswith("flashcore.kernels")) or mod is None:
            continue
        for value in list(vars(mod).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()     # functools.lru_cache'd factories
        kernels = getattr(mod, "_kernels", None)
        if isinstance(kernels, dict):
            kernels.clear()


def point_kernel_cache_at(path):
    """Send flashcore's on-disk kernel cache to ``path``; returns the previous settings."""
    from flashcore import config
    return config.set(cache_dir=path)


class KernelCompile:
    """Seconds until a kernel configuration is ready: 'cold' compile or 'warm' disk load."""

    # one configuration per pass: each cold compile costs seconds to tens of seconds
    params = [["forward", "backward"], [128], [False]]
    param_names = ["pass", "headdim", "causal"]
    unit = "seconds"
    timeout = 600       # a cold Hopper kernel compile can take a while

    def setup(self, which, headdim, causal):
        require_gpu_backend("cupy")
        import flashcore
        self.flashcore = flashcore
        self.cache_dir = tempfile.mkdtemp(prefix="flashcore-asv-kernel-cache-")
        self.saved_settings = point_kernel_cache_at(self.cache_dir)
        shape = (1, 128, 1, headdim)
        self.q, self.k, self.v, self.dout = random_arrays("cupy", [shape] * 4, seed=1)
        self.causal = causal
        self.which = which
        # Everything but the kernels under test is warmed up: CuPy's own start-up, NVRTC's
        # version probe, and for the backward, the forward that produces out and lse (compiled
        # into the fresh cache: the backward's kernels are what the timed call compiles).
        cupy.cuda.Device().synchronize()
        if which == "backward":
            self.out, self.lse = flashcore.attention_forward(self.q, self.k, self.v, causal=causal)
            cupy.cuda.Device().synchronize()

    def teardown(self, *params):
        if not hasattr(self, "saved_settings"):    # setup refused (asv tears down regardless)
            return
        from flashcore import config
        config.set(cache_dir=self.saved_settings.cache_dir)
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def _call(self):
        fc, c = self.flashcore, self.causal
        if self.which == "forward":
            fc.attention_forward(self.q, self.k, self.v, causal=c)
        else:
            fc.attention_backward(self.dout, self.q, self.k, self.v, self.out, self.lse, causal=c)
        cupy.cuda.Device().synchronize()

    def _seconds(self):
        clear_flashcore_memory_caches()
        t0 = time.perf_counter()
        self._call()
        return time.perf_counter() - t0

    def _cache_files(self):
        return sum(len(files) for _, _, files in os.walk(self.cache_dir))

    def track_cold_compile(self, *params):
        before = self._cache_files()
        seconds = self._seconds()
        if self._cache_files() == before:
            raise NotImplementedError(
                "nothing was written to the fresh kernel cache: the kernels were not compiled "
                "here (the cache could not be redirected), so this is not a cold compile")
        return seconds

    def track_warm_load(self, *params):
        self._seconds()             # fills the fresh disk cache
        return self._seconds()      # memory cleared again: loaded from disk
