"""Kernel sources, compilation and caching.

Sources live in the top-level ``cuda/`` folder of the repository; a wheel ships them as
``flashcore/cuda``. They are compiled at first use by NVRTC through ``cupy.RawModule``, one
module per template instantiation (``name_expressions``), so only configurations that are
actually called get compiled.

CuPy's disk cache keys on the ``code`` string, not on files pulled in by ``#include``. The
code string we hand it therefore carries a fingerprint of every file in ``cuda/``: editing a
header invalidates every cached kernel that could include it.

Nothing here imports CuPy at module import time.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from pathlib import Path

__all__ = [
    "cuda_dir",
    "source_fingerprint",
    "compile_options",
    "arch_for",
    "device_facts",
    "get_kernel",
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
    multiprocessor count) of a device, queried once: ``Device.attributes`` asks the driver
    for every attribute, far too slow for each launch."""
    import cupy
    from cupy.cuda import runtime
    dev = cupy.cuda.Device(device_id)
    smem = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)
    sms = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id)
    return int(dev.compute_capability), int(smem), int(sms)


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
    # The fingerprint in the code string is what makes CuPy's disk cache safe (see module doc).
    return (
        f"// flashcore kernel module, sources {source_fingerprint()}\n"
        f'#include "{source_file}"\n'
    )


_lock = threading.Lock()
_kernels: dict = {}
_smem_opted: dict = {}   # key -> (kernel, the largest dynamic shared memory allowed)


def get_kernel(source_file: str, name: str, device_id: int, compute_capability: int,
               dynamic_smem: int = 0, extra_options: tuple[str, ...] = ()):
    """Return the ``cupy.RawKernel`` for template instantiation ``name`` of ``source_file``.

    Compiled once per (device, arch, file, name, options) and memoised; later processes load
    the cubin from CuPy's disk cache. ``dynamic_smem`` raises the kernel's opt-in limit for
    dynamic shared memory (needed above 48 KiB).
    """
    import cupy

    arch = arch_for(compute_capability)
    key = (device_id, arch, source_file, name, tuple(extra_options))
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                with cupy.cuda.Device(device_id), _compile_lock(
                        f"{arch}|{source_fingerprint()}|{source_file}|{name}|{extra_options}"):
                    mod = cupy.RawModule(
                        code=_code_for(source_file),
                        options=compile_options(arch, tuple(extra_options)),
                        name_expressions=[name],
                    )
                    k = mod.get_function(name)
                _kernels[key] = k
    # The opt-in limit is a driver attribute: read it (a driver call) only when a larger
    # request than any seen for this kernel comes.
    if dynamic_smem > 48 * 1024:
        seen = _smem_opted.get(key)
        if seen is None or seen[0] is not k or seen[1] < dynamic_smem:
            if k.max_dynamic_shared_size_bytes < dynamic_smem:
                k.max_dynamic_shared_size_bytes = dynamic_smem
            _smem_opted[key] = (k, dynamic_smem)
    return k


@contextlib.contextmanager
def _compile_lock(what: str):
    """Held while this process compiles (or loads) kernel ``what``: processes that need the same
    kernel at once (the ranks of a multi-GPU job on one node, test workers) compile it once;
    the others wait, then load it from CuPy's disk cache, which CuPy writes before the compile
    returns. An exclusive ``flock`` on a file per kernel in the cache folder (``CUPY_CACHE_DIR``
    or ``~/.cupy/kernel_cache``); where there is none to take (no ``fcntl``, a read-only
    folder, a file system without locks) every process compiles for itself, as before."""
    try:
        import fcntl
        folder = os.path.join(os.environ.get("CUPY_CACHE_DIR")
                              or os.path.expanduser("~/.cupy/kernel_cache"), "flashcore-locks")
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
    :func:`get_kernel` compiles or loads again, and no launch plan recorded before is replayed."""
    with _lock:
        _kernels.clear()
        _smem_opted.clear()
        _GENERATION[0] += 1


def compile_check(source_file: str, names: list[str], arch: str,
                  extra_options: tuple[str, ...] = (), want_log: bool = False):
    """Compile ``names`` from ``source_file`` for ``arch`` with NVRTC alone (no GPU needed).

    Uses the same code string and options as :func:`get_kernel` (plus CuPy's own include
    flags, as ``cupy.RawModule`` adds them). Returns ``(cubin_bytes, log)``; raises
    ``RuntimeError`` with the compiler log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc
    from cupy._core import core

    opts = core.assemble_cupy_compiler_options(
        ("-ftz=true",) + compile_options(arch, tuple(extra_options))
    )
    if want_log:
        opts = opts + ("--ptxas-options=-v",)
    prog = nvrtc.createProgram(_code_for(source_file), "flashcore_kernel.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except Exception as e:  # nvrtc.NVRTCError
            raise RuntimeError(
                f"NVRTC failed to compile {names} from {source_file} for {arch}:\n"
                + nvrtc.getProgramLog(prog)
            ) from e
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
