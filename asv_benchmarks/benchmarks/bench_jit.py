"""How long a kernel configuration takes to become callable.

* cold: compiled by NVRTC from source, into an empty CuPy kernel cache, with flashcore's
  in-memory kernel tables cleared: what a user waits for on the very first call;
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

CACHE_ENV_VARS = ("CUPY_CACHE_DIR", "FLASHCORE_CACHE_DIR")


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
    """Send CuPy's (and flashcore's, if it has one) on-disk kernel cache to ``path``."""
    for var in CACHE_ENV_VARS:
        os.environ[var] = path
    # CuPy >= 14 builds its disk cache object when imported (the forkserver imported it
    # before this process existed); CuPy 13 reads CUPY_CACHE_DIR on every compile.
    compiler = cupy.cuda.compiler
    setter = getattr(compiler, "_set_kernel_cache_backend", None)
    if setter is not None:
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend
        setter(DiskKernelCacheBackend(path))


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
        self.saved_env = {v: os.environ.get(v) for v in CACHE_ENV_VARS}
        point_kernel_cache_at(self.cache_dir)
        shape = (1, 128, 1, headdim)
        self.q, self.k, self.v, self.dout = random_arrays("cupy", [shape] * 4, seed=1)
        self.causal = causal
        self.which = which
        # Everything but the kernels under test is warmed up: CuPy's own start-up, NVRTC's
        # version probe, and for the backward, the forward that produces out and lse.
        cupy.cuda.Device().synchronize()
        if which == "backward":
            self.out, self.lse = flashcore.attention_forward(self.q, self.k, self.v, causal=causal)
            cupy.cuda.Device().synchronize()

    def teardown(self, *params):
        if not hasattr(self, "saved_env"):    # setup refused (asv tears down regardless)
            return
        for var, value in self.saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
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
