"""The native (C++) autograd node of the torch eager fast path: build, load, records.

``cuda/torch_native.cpp`` defines ``torch.ops.flashcore_native.attention``: a
``torch::autograd::Function`` that replays a recorded forward launch plan in C++ and whose
backward replays the recorded backward plan, with no Python on the step (see the file's
header). This module compiles it with the system's C++ compiler against the installed torch's
headers, at first use, in a background thread (about 15 s; until it is ready the Python fast path
serves), caches the shared library on disk, loads it, and hands it the records.

Nothing here is needed for correctness: without a compiler, with ``FLASHCORE_TORCH_NATIVE=0``,
or after a failed build, the Python autograd Function does the same work. ``status()`` says
which applies.

Environment: ``FLASHCORE_TORCH_NATIVE`` = ``1`` (default: build in the background at the first
fast-path call), ``sync`` (build in the calling thread at the first fast-path call, for
benchmarks), ``0`` (never); ``FLASHCORE_CACHE_DIR`` (default ``~/.cache/flashcore``); ``CXX``
(the compiler; default ``c++``, then ``g++``, then ``clang++``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .. import jit
from ..kernels import plans

__all__ = ["status", "build", "ops", "library_path", "build_command", "attach", "MAX_RECORDS"]

MAX_RECORDS = 4096      # distinct (layout, options) keys given a native record per process

_STATE: dict = {
    "mode": os.environ.get("FLASHCORE_TORCH_NATIVE", "1").strip().lower(),
    "status": "idle",     # idle | building | ready | failed | off
    "error": None,
    "thread": None,
    "result": None,       # [path or exception] from the build thread
    "ops": None,          # torch.ops.flashcore_native once loaded
    "lib": None,          # the torch.library.Library holding the Python miss kernels
    "fwd_miss": None,     # the Python implementations of fwd_miss and bwd_miss (set by the
    "bwd_miss": None,     # torch backend: set_misses)
}
_IDS: dict = {}           # record key -> native entry id (ids live as long as the process)
_KEEP: dict = {}          # native entry id -> the Python entry it was made from: keeps the
                          # record's kernels (their modules) loaded until it is overwritten
_LOCK = threading.Lock()


def source_path() -> Path:
    return jit.cuda_dir() / "torch_native.cpp"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or cxx
    for name in ("c++", "g++", "clang++"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _torch_dirs():
    import torch
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "include" / "torch" / "csrc" / "api" / "include", root / "lib"


def build_command(cxx: str, out: Path) -> list[str]:
    """The compiler command that builds the library into ``out``."""
    import torch
    inc, api_inc, lib = _torch_dirs()
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-I", str(inc), "-I", str(api_inc), str(source_path()), "-o", str(out),
            "-L", str(lib), "-lc10", "-ltorch_cpu", "-ldl", f"-Wl,-rpath,{lib}"]


def cache_dir() -> Path:
    d = os.environ.get("FLASHCORE_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "flashcore"


def library_path(cxx: str | None = None) -> Path:
    """Where the library for this source, torch, Python and compiler lives in the cache."""
    import torch
    cxx = cxx or _compiler() or "none"
    h = hashlib.sha256()
    for part in (source_path().read_bytes(), torch.__version__.encode(), str(_torch_dirs()[2]).encode(),
                 sys.version.encode(), cxx.encode(), " ".join(build_command("CXX", Path("o"))).encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"flashcore_native-{h.hexdigest()[:16]}.so"


def _remove_stale_partials(folder: Path, age_s: float = 3600.0) -> None:
    """Partial outputs of builds that were killed (a process ended mid-build) and are old."""
    import time
    for p in folder.glob("flashcore_native-*.tmp.so"):
        try:
            if time.time() - p.stat().st_mtime > age_s:
                p.unlink()
        except OSError:
            pass


def _compile(cxx: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path.parent)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp.so")
    os.close(fd)
    tmp = Path(name)
    cmd = build_command(cxx, tmp)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"flashcore: building the native autograd node failed to run "
                           f"{cmd[0]}: {exc}") from exc
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError("flashcore: building the native autograd node failed "
                           f"(exit {r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
    os.replace(tmp, path)      # atomic: a concurrent process sees the whole file or none
    return path


def _build_into(result: list) -> None:
    try:
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("flashcore: no C++ compiler found for the native autograd node "
                               "(set CXX, or install g++)")
        path = library_path(cxx)
        result.append(path if path.is_file() else _compile(cxx, path))
    except Exception as exc:   # reported through status(); the Python path serves meanwhile
        result.append(exc)


def _load(path: Path):
    import torch
    try:
        torch.ops.load_library(str(path))
    except Exception:
        # a cached library that no longer loads (e.g. a torch rebuilt in place): build it anew
        path.unlink(missing_ok=True)
        cxx = _compiler()
        if cxx is None:
            raise
        torch.ops.load_library(str(_compile(cxx, path)))
    ops = torch.ops.flashcore_native
    lib = torch.library.Library("flashcore_native", "IMPL")
    lib.impl("bwd_miss", _bwd_miss, "CompositeImplicitAutograd")
    lib.impl("fwd_miss", _fwd_miss, "CompositeImplicitAutograd")
    _STATE["lib"] = lib
    plans.on_drop(_invalidate)
    return ops


def _invalidate() -> None:
    ops_ = _STATE["ops"]
    if ops_ is not None:
        ops_.invalidate()


def _bwd_miss(dout, q, k, v, out, lse, alibi_slopes, entry):
    return _STATE["bwd_miss"](dout, q, k, v, out, lse, alibi_slopes, entry)


def _fwd_miss(q, k, v, alibi_slopes, entry):
    return _STATE["fwd_miss"](q, k, v, alibi_slopes, entry)


def set_misses(fwd, bwd) -> None:
    """What the node calls when it has no current record for a call (the torch backend's):
    ``fwd(q, k, v, alibi_slopes, entry) -> (out, lse)`` and
    ``bwd(dout, q, k, v, out, lse, alibi_slopes, entry) -> (dq, dk, dv)``."""
    _STATE["fwd_miss"], _STATE["bwd_miss"] = fwd, bwd


def _finish() -> None:
    """Load what the build thread produced (in the caller's thread)."""
    res = _STATE["result"][0]
    if isinstance(res, Exception):
        _STATE["status"], _STATE["error"] = "failed", str(res)
        return
    try:
        _STATE["ops"] = _load(res)
        _STATE["status"] = "ready"
    except Exception as exc:
        _STATE["status"], _STATE["error"] = "failed", f"flashcore: loading {res} failed: {exc}"


def ops():
    """``torch.ops.flashcore_native`` when loaded, else None (the first call starts the build,
    in the background unless FLASHCORE_TORCH_NATIVE=sync)."""
    st = _STATE["status"]
    if st == "ready":
        return _STATE["ops"]
    if st in ("failed", "off"):
        return None
    with _LOCK:
        st = _STATE["status"]
        if st == "idle":
            if _STATE["mode"] == "0":
                _STATE["status"] = "off"
                return None
            _STATE["result"] = []
            if _STATE["mode"] == "sync":
                _build_into(_STATE["result"])
                _finish()
            else:
                t = threading.Thread(target=_build_into, args=(_STATE["result"],),
                                     name="flashcore-native-build", daemon=True)
                _STATE["thread"], _STATE["status"] = t, "building"
                t.start()
        elif st == "building" and _STATE["result"]:
            _finish()
    return _STATE["ops"] if _STATE["status"] == "ready" else None


def build(wait: bool = True):
    """Build and load now (``wait``: block until done). Returns the ops or raises the reason."""
    if _STATE["mode"] == "0":
        raise RuntimeError("flashcore: the native autograd node is turned off "
                           "(FLASHCORE_TORCH_NATIVE=0)")
    ops()
    t = _STATE["thread"]
    if wait and t is not None:
        t.join()
        ops()
    if _STATE["status"] == "failed":
        raise RuntimeError(_STATE["error"])
    return _STATE["ops"]


def status() -> dict:
    """``{"status": idle|building|ready|failed|off, "error": str|None, "library": path|None}``."""
    res = (_STATE["result"] or [None])[0]
    return {"status": _STATE["status"], "error": _STATE["error"],
            "library": str(res) if isinstance(res, Path) else None}


def attach(key, entry, npointers: int) -> int:
    """Hand a recorded fast-path entry (torch_backend._Entry with a direct launcher) to C++.
    Returns its native id, or -1 when there is none to be had (no native library, no direct
    launcher, too many records). The same key keeps its id; a new record overwrites it."""
    ops_ = ops()
    d = entry.direct
    if ops_ is None or d is None:
        return -1
    import numpy as np
    import torch
    nid = _IDS.get(key)
    if nid is None:
        if len(_IDS) >= MAX_RECORDS:
            return -1
        nid = ops_.new_entry()
        _IDS[key] = nid
    words = torch.from_numpy(d.words.view(np.int64).copy())   # (Direct's words: contiguous)
    launches = [int(x) for launch in d.launches for x in launch]
    ops_.set_entry(words, launches, list(entry.slots), npointers,
                   list(entry.scratch_offsets) if entry.scratch else [],
                   int(entry.scratch_floats), bool(entry.scratch_zero),
                   list(entry.out_mods), list(entry.lse_shape or ()), bool(entry.out_like_q),
                   int(entry.index), int(entry.ctx), nid)
    _KEEP[nid] = entry
    return nid
