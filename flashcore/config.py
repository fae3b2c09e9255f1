"""All of flashcore's configuration, in one place.

Each setting is read once from the environment when flashcore is imported, and can be changed
at run time with :func:`set` or, for a block, :func:`override`. The settings form one hashable
value, :func:`get`, that is part of every launch-cache key: a launcher's decisions depend on
the arrays' layouts, the call's options and this value only, so changing a setting never needs
a cache to be cleared.

The settings (environment variable in brackets):

* ``debug`` (``FLASHCORE_DEBUG=1``): check the *values* of ``cu_seqlens``, ``cache_seqlens``
  and ``block_table`` on the host, with named errors. Off by default: a default call never
  reads a device array back (no sync, CUDA-graph capturable); the kernels clamp every address
  formed from such values into its array, so a bad value gives a wrong result, never an access
  outside the arrays.
* ``sm90_fwd`` (``FLASHCORE_SM90=0`` turns it off): the Hopper (wgmma) forward where it
  applies; ``sm90_fwd_pipelined`` (``FLASHCORE_SM90_PIPE``): its v1 pipeline (the next block's
  softmax under P V) where the warp-specialised kernel does not apply; ``sm90_fwd_ws``
  (``FLASHCORE_SM90_WS``): the warp-specialised Hopper forward (TMA producer, two consumer
  warpgroups) for calls whose arrays TMA can read (varlen calls: one tile a CTA);
  ``sm90_fwd_pingpong``
  (``FLASHCORE_SM90_PINGPONG``): its consumers issue their products in turn (None, the
  default: chosen per call by ``flashcore.kernels.forward.sm90_ws_pingpong``);
  ``sm90_fwd_persistent`` (``FLASHCORE_SM90_PERSISTENT``): the warp-specialised kernels
  (16-bit and FP8) run one CTA per SM, each taking tiles from a dynamic scheduler (on by
  default, where such a kernel exists: ``flashcore.kernels.forward.ws_persistent_exists``);
  ``sm90_fwd_d64_min_seqlen_k``: head dim 64 takes the Hopper forward from
  this many keys (512: the warp-specialised kernel measured faster from there, session 28;
  shorter calls keep the Ampere-class kernel, unmeasured below 512).
* ``sm90_bwd`` (``FLASHCORE_SM90_BWD``): the Hopper dK/dV kernel where it applies;
  ``sm90_bwd_ws`` (``FLASHCORE_SM90_BWD_WS``): its warp-specialised TMA versions (head dims 64,
  128 and 256) for calls, varlen included, whose arrays TMA can read;
  ``sm90_bwd_d64_block_m`` (``FLASHCORE_SM90_BWD_D64_BM``): queries per step of the cp.async
  kernel (the others' calls) at head dim 64 (64 or 128).
* ``sm90_fp8_fwd`` (``FLASHCORE_SM90_FP8_FWD``): the Hopper FP8 forward kernel for
  float8_e4m3fn CuPy and torch CUDA inputs (on by default); off, such calls are refused by
  name (NumPy arrays and torch CPU tensors take the NumPy reference either way).
* ``sm90_defines`` (``FLASHCORE_SM90_DEFINES``, defines separated by spaces, e.g.
  ``-DFC_DIAG_SOFTMAX_FENCE``): extra NVRTC options of the kernels compiled for compute
  capability 9.0: the Hopper forward and backward, the Ampere-class backward and the decode
  kernels there (a diagnostic: the timing-only and candidate switches that the performance log
  measures; from the environment, the GPU tests run against a candidate before it becomes a
  default). Only ``-DNAME`` or ``-DNAME=VALUE`` options.
* ``decode_fused_combine`` (``FLASHCORE_DECODE_FUSED_COMBINE``): split-KV partials merged in
  the decode kernel (off: a separate combine kernel); ``decode_cluster``
  (``FLASHCORE_DECODE_CLUSTER``): merged inside a thread-block cluster (sm_90).
* ``cache_dir`` (``FLASHCORE_CACHE_DIR``; default ``$XDG_CACHE_HOME/flashcore/kernels`` or
  ``~/.cache/flashcore/kernels``): where compiled kernels are kept between processes
  (:mod:`flashcore.jit`).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import typing
from typing import NamedTuple

__all__ = ["Settings", "get", "set", "override", "debug"]


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


class Settings(NamedTuple):
    debug: bool
    sm90_fwd: bool
    sm90_fwd_pipelined: bool
    sm90_fwd_ws: bool
    sm90_fwd_pingpong: bool | None
    sm90_fwd_persistent: bool
    sm90_fwd_d64_min_seqlen_k: int
    sm90_bwd: bool
    sm90_bwd_ws: bool
    sm90_bwd_d64_block_m: int
    sm90_fp8_fwd: bool
    sm90_defines: tuple
    decode_fused_combine: bool
    decode_cluster: bool
    cache_dir: str


def _defines(text: str, name: str) -> tuple:
    """A space-separated list of ``-DNAME[=VALUE]`` options; anything else raises, naming
    ``name`` (the setting or the environment variable it came from)."""
    opts = tuple(text.split())
    bad = [o for o in opts if not re.fullmatch(r"-D[A-Za-z_]\w*(=\S*)?", o)]
    if bad:
        raise ValueError(f"{name}: expected -DNAME or -DNAME=VALUE options, got {bad}")
    return opts


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flashcore", "kernels")


def _from_environment() -> Settings:
    bm = os.environ.get("FLASHCORE_SM90_BWD_D64_BM", "128").strip()
    return Settings(
        debug=_env_flag("FLASHCORE_DEBUG", False),
        sm90_fwd=_env_flag("FLASHCORE_SM90", True),
        sm90_fwd_pipelined=_env_flag("FLASHCORE_SM90_PIPE", True),
        sm90_fwd_ws=_env_flag("FLASHCORE_SM90_WS", True),
        sm90_fwd_pingpong=(_env_flag("FLASHCORE_SM90_PINGPONG", True)
                           if os.environ.get("FLASHCORE_SM90_PINGPONG", "").strip() else None),
        sm90_fwd_persistent=_env_flag("FLASHCORE_SM90_PERSISTENT", True),
        sm90_fwd_d64_min_seqlen_k=512,
        sm90_bwd=_env_flag("FLASHCORE_SM90_BWD", True),
        sm90_bwd_ws=_env_flag("FLASHCORE_SM90_BWD_WS", True),
        sm90_bwd_d64_block_m=int(bm) if bm in ("64", "128") else 128,
        sm90_fp8_fwd=_env_flag("FLASHCORE_SM90_FP8_FWD", True),
        sm90_defines=_defines(os.environ.get("FLASHCORE_SM90_DEFINES", ""),
                              "FLASHCORE_SM90_DEFINES"),
        decode_fused_combine=_env_flag("FLASHCORE_DECODE_FUSED_COMBINE", True),
        decode_cluster=_env_flag("FLASHCORE_DECODE_CLUSTER", True),
        cache_dir=os.environ.get("FLASHCORE_CACHE_DIR", "").strip() or _default_cache_dir(),
    )


#: the settings that are flags (annotated bool)
_FLAGS = {n: t is bool for n, t in typing.get_type_hints(Settings).items()}

_CURRENT = [_from_environment()]
_LOCK = threading.Lock()


def get() -> Settings:
    """The settings in force (a hashable NamedTuple: launch caches key on it)."""
    return _CURRENT[0]


def debug() -> bool:
    return _CURRENT[0].debug


def set(**changes) -> Settings:      # noqa: A001  (config.set reads as intended)
    """Change settings by name (``config.set(debug=True)``). Returns the previous settings.
    Unknown names raise TypeError; values are checked where a wrong one would mislead."""
    unknown = sorted(n for n in changes if n not in Settings._fields)
    if unknown:
        raise TypeError(f"flashcore.config.set: unknown setting(s) {unknown}; "
                        f"expected names from {list(Settings._fields)}")
    for name, v in changes.items():      # a flag is a bool: debug="no" must not turn it on
        if _FLAGS.get(name) and not isinstance(v, bool):
            raise TypeError(f"argument '{name}': expected a bool, got {type(v).__name__} {v!r}")
    if "sm90_bwd_d64_block_m" in changes and changes["sm90_bwd_d64_block_m"] not in (64, 128):
        raise ValueError("argument 'sm90_bwd_d64_block_m': expected 64 or 128, got "
                         f"{changes['sm90_bwd_d64_block_m']!r}")
    if "sm90_defines" in changes:
        v = changes["sm90_defines"]
        if isinstance(v, str):
            raise TypeError("argument 'sm90_defines': expected a sequence of options, got the "
                            f"string {v!r}")
        changes["sm90_defines"] = _defines(" ".join(v), "argument 'sm90_defines'")
    with _LOCK:
        prev = _CURRENT[0]
        _CURRENT[0] = prev._replace(**changes)
    return prev


@contextlib.contextmanager
def override(**changes):
    """``with config.override(debug=True): ...``: the settings changed for the block, restored
    after it (process-wide, like :func:`set`)."""
    prev = set(**changes)
    try:
        yield get()
    finally:
        with _LOCK:
            _CURRENT[0] = prev
