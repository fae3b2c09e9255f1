"""Kernel sources, compilation and caching.

Sources live in the top-level ``cuda/`` folder of the repository; a wheel ships them as
``flashcore/cuda``. They are compiled at first use by NVRTC, one module per template
instantiation (a name expression), so only configurations that are actually called get
compiled; the cubins are kept in a disk cache of flashcore's own (``flashcore.config``'s
``cache_dir``) and loaded with the CUDA driver (``cuModuleLoadData``, through ctypes:
:mod:`flashcore.kernels.device`). NVRTC is reached through CuPy's low-level bindings
(``cupy_backends``), which import ``cupy`` at their first call: a process pays CuPy's import
when it compiles, not when it loads kernels from the disk cache.

A cache key covers the code string, the name, the options and the target. The code string
carries a fingerprint of every file in ``cuda/``: editing a header invalidates every cached
kernel that could include it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import threading
from pathlib import Path

import numpy as np

__all__ = [
    "cuda_dir",
    "source_fingerprint",
    "compile_options",
    "arch_for",
    "device_facts",
    "peak_memory_bandwidth",
    "get_kernel",
    "Kernel",
    "cache_dir",
    "clear_memory_cache",
    "generation",
    "compile_check",
]

_HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def cuda_dir() -> Path:
    """The folder that holds the kernel sources (wheel: flashcore/cuda; checkout: ../cuda)."""
    for cand in (_HERE / "cuda", _HERE.parent / "cuda"):
        if (cand / "flash_params.cuh").is_file():
            return cand
    raise FileNotFoundError(
        "flashcore's CUDA sources were not found next to the package "
        f"(looked in {_HERE / 'cuda'} and {_HERE.parent / 'cuda'}); the installation is incomplete"
    )


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """sha256 over the names and contents of every kernel source file."""
    h = hashlib.sha256()
    for p in sorted(cuda_dir().glob("*.cu*")):
        h.update(p.name.encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def device_facts(device_id: int) -> tuple[int, int, int]:
    """(compute capability as an int, e.g. 90; opt-in shared memory per block in bytes;
    multiprocessor count) of a device, queried once from the driver."""
    from .kernels import device
    attr = device.driver().device_attribute
    major, minor = attr(device.ATTR_CC_MAJOR, device_id), attr(device.ATTR_CC_MINOR, device_id)
    smem = attr(device.ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device_id)
    sms = attr(device.ATTR_MULTIPROCESSOR_COUNT, device_id)
    return major * 10 + minor, smem, sms


@functools.lru_cache(maxsize=None)
def peak_memory_bandwidth(device_id: int) -> float:
    """A device's peak DRAM bandwidth in bytes/s (double data rate: 2 x the memory clock x
    the bus width), from the driver's attributes, queried once: 3.35e12 for an H100 SXM
    (2619 MHz x 5120 bits); an H200's spec sheet says 4.8e12."""
    from .kernels import device
    attr = device.driver().device_attribute
    khz = attr(device.ATTR_MEMORY_CLOCK_RATE, device_id)
    bits = attr(device.ATTR_GLOBAL_MEMORY_BUS_WIDTH, device_id)
    return 2.0 * khz * 1e3 * bits / 8


def arch_for(compute_capability: int | str) -> str:
    """The NVRTC target for a device: Hopper gets sm_90a so that wgmma/setmaxnreg assemble."""
    cc = int(compute_capability)
    if cc == 90:
        return "sm_90a"
    return f"sm_{cc}"


def compile_options(arch: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Options shared by the runtime loader and the no-GPU compile check."""
    return (
        "--std=c++17",
        f"-I{cuda_dir()}",
        f"--gpu-architecture={arch}",
        "-DFC_FINGERPRINT=0x" + source_fingerprint(),
    ) + tuple(extra)


def _code_for(source_file: str) -> str:
    # The fingerprint in the code string makes a changed header a different cache key.
    return (
        f"// flashcore kernel module, sources {source_fingerprint()}\n"
        f'#include "{source_file}"\n'
    )


def _nvrtc_options(arch: str, extra_options: tuple = ()) -> list[str]:
    return ["-ftz=true", *compile_options(arch, tuple(extra_options))]


def _compile(source_file: str, names: list[str], arch: str, extra_options: tuple = (),
             want_log: bool = False):
    """NVRTC: ``(cubin, lowered names of names, log)``; RuntimeError with the log on failure."""
    from cupy_backends.cuda.libs import nvrtc
    opts = _nvrtc_options(arch, extra_options)
    if want_log:
        opts.append("--ptxas-options=-v")
    prog = nvrtc.createProgram(_code_for(source_file), "flashcore_kernel.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as e:  # nvrtc.NVRTCError
            raise RuntimeError(
                f"NVRTC failed to compile {names} from {source_file} for {arch}:\n"
                + nvrtc.getProgramLog(prog)
            ) from e
        return (nvrtc.getCUBIN(prog), [nvrtc.getLoweredName(prog, n) for n in names],
                nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def cache_dir() -> str:
    """The folder of compiled kernels (``flashcore.config``'s ``cache_dir``)."""
    from . import config
    return config.get().cache_dir


def _cache_key(source_file: str, name: str, arch: str, extra_options: tuple) -> str:
    """The sources (their fingerprint is in the code string), the name, the target and the
    options. Not NVRTC's version: asking it imports NVRTC's bindings (~35 ms), which a process
    that finds every kernel in the cache never needs; a cubin stays valid for its target
    whichever NVRTC made it (remove the folder to rebuild with a new one)."""
    what = "\0".join([_code_for(source_file), name, arch, *_nvrtc_options(arch, extra_options)])
    return hashlib.sha256(what.encode()).hexdigest()[:40]


_MAGIC = b"flashcore-cubin-1\n"


def _read_cached(path: str):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if raw.startswith(_MAGIC):
        lowered, _, cubin = raw[len(_MAGIC):].partition(b"\n")
        if cubin:
            return cubin, lowered.decode()
    return None


def _cubin(source_file: str, name: str, arch: str, extra_options: tuple):
    """``(cubin, lowered name)`` of one instantiation: from the disk cache, else compiled under
    the kernel's lock (:func:`_compile_lock`: processes that need it at once compile it once)
    and written there, a file per kernel, written whole and renamed into place, so a reader
    never sees half of one."""
    path = os.path.join(cache_dir(), _cache_key(source_file, name, arch, extra_options) + ".cubin")
    hit = _read_cached(path)
    if hit is not None:
        return hit
    with _compile_lock(path):
        hit = _read_cached(path)        # (another process may have compiled it meanwhile)
        if hit is not None:
            return hit
        cubin, (lowered,), _log = _compile(source_file, [name], arch, extra_options)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(_MAGIC + lowered.encode() + b"\n" + cubin)
            os.replace(tmp, path)
        except OSError:      # a read-only or full disk: the kernel runs, compiled per process
            pass
    return cubin, lowered


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Kernel:
    """One loaded kernel: ``ptr`` (its CUfunction); called as ``kernel(grid, block, args,
    shared_mem=0, stream=0)`` it launches through ``cuLaunchKernel``, every argument (NumPy
    scalars and 0-d arrays: the params struct as ``params.as_kernel_arg`` makes it, tensor
    maps) passed by value as its bytes."""

    __slots__ = ("ptr", "module", "name", "smem_limit")

    def __init__(self, module: int, ptr: int, name: str):
        self.module, self.ptr, self.name = module, ptr, name
        self.smem_limit = 48 * 1024

    def set_attribute(self, attribute: int, value: int) -> None:
        from .kernels.device import driver
        driver().set_function_attribute(self.ptr, attribute, int(value))

    def attribute(self, attribute: int) -> int:
        from .kernels.device import driver
        return driver().function_attribute(attribute, self.ptr)

    num_regs = property(lambda self: self.attribute(4))            # CU_FUNC_ATTRIBUTE_NUM_REGS
    local_size_bytes = property(lambda self: self.attribute(3))    # ..._LOCAL_SIZE_BYTES
    shared_size_bytes = property(lambda self: self.attribute(1))   # ..._SHARED_SIZE_BYTES

    def allow_shared_memory(self, nbytes: int) -> None:
        """Raise the kernel's opt-in limit of dynamic shared memory to ``nbytes``."""
        if nbytes > self.smem_limit:
            self.set_attribute(_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self.smem_limit = nbytes

    def __call__(self, grid, block, args, shared_mem: int = 0, stream: int = 0):
        from .kernels.device import driver
        g = (grid,) if isinstance(grid, int) else tuple(grid)
        b = (block,) if isinstance(block, int) else tuple(block)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        raw = [np.asarray(a).tobytes() for a in args]
        offs, n = [], 0
        for r in raw:            # each argument 64-byte aligned (tensor maps ask for 64)
            offs.append(n)
            n += -(-len(r) // 64) * 64
        buf = ctypes.create_string_buffer(n + 64)
        base = -(-ctypes.addressof(buf) // 64) * 64
        for off, r in zip(offs, raw):
            ctypes.memmove(base + off, r, len(r))
        ptrs = (ctypes.c_void_p * max(len(raw), 1))(*(base + off for off in offs))
        driver().launch_kernel(self.ptr, *g, *b, int(shared_mem), int(stream),
                               ctypes.addressof(ptrs))


_lock = threading.Lock()
_kernels: dict = {}


def get_kernel(source_file: str, name: str, device_id: int, compute_capability: int,
               dynamic_smem: int = 0, extra_options: tuple[str, ...] = ()) -> Kernel:
    """The :class:`Kernel` of template instantiation ``name`` of ``source_file`` on a device.

    Compiled by NVRTC once per (sources, name, target, options) and kept in the disk cache
    (:func:`cache_dir`), loaded once per device and process. ``dynamic_smem`` raises the
    kernel's opt-in limit for dynamic shared memory (needed above 48 KiB).
    """
    arch = arch_for(compute_capability)
    key = (device_id, arch, source_file, name, tuple(extra_options))
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                from .kernels.device import driver, scope
                cubin, lowered = _cubin(source_file, name, arch, tuple(extra_options))
                with scope(device_id):      # (the device's primary context)
                    module = driver().load_module(cubin)
                    k = Kernel(module, driver().get_function(module, lowered), name)
                _kernels[key] = k
    if dynamic_smem > k.smem_limit:
        with _lock:
            k.allow_shared_memory(dynamic_smem)
    return k


@contextlib.contextmanager
def _compile_lock(what: str):
    """Held while this process compiles kernel ``what`` (its cache path): processes that need the
    same kernel at once (the ranks of a multi-GPU job on one node, test workers) compile it
    once; the others wait, then read it from the disk cache, written before the lock is
    released.
    An exclusive ``flock`` on a file per kernel in the cache folder; where there is none to
    take (no ``fcntl``, a read-only folder, a file system without locks) every process
    compiles for itself."""
    try:
        import fcntl
        folder = os.path.join(cache_dir(), "locks")
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, hashlib.sha256(what.encode()).hexdigest()[:32] + ".lock"),
                 "a")
    except (ImportError, OSError):
        yield
        return
    with f:                      # (closing the file releases the lock)
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


_GENERATION = [0]


def generation() -> int:
    """How many times the loaded kernels were forgotten (launch plans made with older kernel
    objects are not replayed: flashcore.kernels.plans compares this number)."""
    return _GENERATION[0]


def clear_memory_cache() -> None:
    """Forget the kernels loaded in this process (the disk cache stays): the next
    :func:`get_kernel` loads again, and no launch plan recorded before is replayed. (The
    modules stay loaded: a plan or a kernel object held elsewhere may still launch them.)"""
    with _lock:
        _kernels.clear()
        _GENERATION[0] += 1


def compile_check(source_file: str, names: list[str], arch: str,
                  extra_options: tuple[str, ...] = (), want_log: bool = False):
    """Compile ``names`` from ``source_file`` for ``arch`` with NVRTC alone (no GPU needed),
    with the code string and options of :func:`get_kernel`. Returns ``(cubin_bytes, log)``;
    raises ``RuntimeError`` with the compiler log on failure."""
    cubin, _lowered, log = _compile(source_file, names, arch, extra_options, want_log)
    return cubin, log
