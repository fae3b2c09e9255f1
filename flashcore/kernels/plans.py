"""Launch plans: what a launcher decided for one layout, replayed with new pointers.

A launcher (forward, backward) spends tens of microseconds of Python per call deciding things
that depend only on the arrays' layouts and the options: tile, template name, grid, shared
memory, the ``FlashParams`` struct. A training step makes the same calls with the same layouts
every time, with new pointers. The first call of a layout runs the launcher in full and, when
nothing in it depends on the pointers beyond their alignment, records a :class:`Plan`: the
kernels it launched, in order, with their geometry, and the struct with its pointer fields
noted. Later calls of that layout fill in the pointers (and any scratch the plan names) and
launch.

What a plan may depend on is exactly what its key holds: shape, strides, dtype and the
address modulo 16 of every array, the device, and the scalar options. Anything that changes a
launcher's decisions otherwise (tile overrides, reloaded kernels) clears the plans. Calls that made copies (an
unaligned or strided input the kernels cannot read directly), varlen calls (whose maximum
lengths may be read from the device) and calls that launched nothing are never recorded.
``set_enabled(False)`` turns the replay off (the launchers then run in full every time).
"""
from __future__ import annotations

import threading

import numpy as np

from .params import as_kernel_arg, params_dtype

__all__ = ["Plan", "layout_key", "set_enabled", "enabled", "clear", "PLANS"]

PLANS: dict = {}
_MAX_PLANS = 1024
_STATE = {"enabled": True}


_DROP_LISTENERS: list = []


def on_drop(fn) -> None:
    """Call ``fn()`` whenever recorded plans are dropped (whoever copied launch data out of
    them, like the torch backend's native records, must stop using it: the kernels may be
    unloaded)."""
    _DROP_LISTENERS.append(fn)


def _dropped() -> None:
    for fn in _DROP_LISTENERS:
        fn()


def drop(keys) -> None:
    """Drop the entries under ``keys`` (missing ones ignored). The listeners hear of it first,
    so that nothing copied out of an entry outlives it in use."""
    _dropped()
    for key in keys:
        PLANS.pop(key, None)


def set_enabled(on: bool) -> None:
    _STATE["enabled"] = bool(on)
    if not on:
        clear()


def enabled() -> bool:
    return _STATE["enabled"]


def clear() -> None:
    _dropped()
    PLANS.clear()


def layout_key(a):
    """Everything of a CuPy array a launcher may depend on, except the pointer itself: the
    launchers decide copies on the base's alignment at 16 bytes (inputs) and at 4 (outputs),
    so the key holds the address modulo 16."""
    if a is None:
        return None
    return (a.shape, a.strides, a.dtype, a.data.ptr % 16)


def _ptr_slots() -> dict[str, int]:
    """Pointer field name -> index of its 8-byte word in the struct."""
    dt = params_dtype()
    out = {}
    for name in dt.names:
        fdt, off = dt.fields[name][:2]
        if fdt == np.uint64:   # pointers (the struct has no other 64-bit unsigned fields)
            assert off % 8 == 0
            out[name] = off // 8
    return out


_SLOTS: dict = {}


def slots() -> dict[str, int]:
    if not _SLOTS:
        _SLOTS.update(_ptr_slots())
    return _SLOTS


class Plan:
    """Recorded launches of one layout: ``launches`` [(kernel, grid, block, shared_mem)], the
    struct ``template`` (a 0-d structured array), ``scratch`` [(field, shape, zero)]: float32
    buffers the launcher allocated per call (pointer field, shape, zero-filled?), and the
    launcher's return value."""

    __slots__ = ("device_id", "launches", "template", "scratch", "result")

    def __init__(self, device_id, launches, template, scratch=(), result=None):
        self.device_id = device_id
        self.launches = tuple(launches)
        self.template = template.copy()
        self.scratch = tuple(scratch)
        self.result = result          # what the launcher returns (the decode's split count)

    def run(self, pointers: dict) -> list:
        """Launch with ``pointers`` (field -> address; fields not given keep the template's,
        scratch fields get new buffers). Returns the scratch arrays (kept alive by the caller
        until the launches are queued: CuPy's pool frees in stream order)."""
        import cupy
        p = self.template.copy()
        words = p.reshape(1).view(np.uint64)
        s = slots()
        for name, addr in pointers.items():
            words[s[name]] = 0 if addr is None else addr
        keep = []
        with cupy.cuda.Device(self.device_id):
            for name, shape, zero in self.scratch:
                buf = (cupy.zeros if zero else cupy.empty)(shape, dtype=cupy.float32)
                words[s[name]] = buf.data.ptr
                keep.append(buf)
            args = (as_kernel_arg(p),)
            for kern, grid, block, smem in self.launches:
                kern(grid, block, args, shared_mem=smem)
        return keep


def remember(key, plan: Plan) -> None:
    if key is None or not _STATE["enabled"]:
        return
    if len(PLANS) >= _MAX_PLANS:
        clear()
    PLANS[key] = plan
    _note(plan)


def lookup(key):
    if key is None or not _STATE["enabled"]:
        return None
    plan = PLANS.get(key)
    if plan is not None:
        _note(plan)
    return plan


# --------------------------------------------------------------------------------------------
# Which plans a call used (for front ends that record a faster path on top of them)
# --------------------------------------------------------------------------------------------

_TLS = threading.local()


def _note(plan) -> None:
    seen = getattr(_TLS, "seen", None)
    if seen is not None:
        seen.append(plan)


class capture:
    """``with plans.capture() as seen:`` lists, in order, the plans that the launchers run on
    this thread inside the block recorded or replayed (a launcher that made copies, or launched
    nothing, adds none). The torch backend uses it to know which plans a full call amounts to."""

    def __enter__(self):
        self._prev = getattr(_TLS, "seen", None)
        _TLS.seen = []
        return _TLS.seen

    def __exit__(self, *exc):
        _TLS.seen = self._prev
        return False


# Entries derived from plans (the torch backend's fast path) live in PLANS too, under keys of
# their own, so that whatever drops the plans (clear, set_enabled(False), tile overrides,
# kernel reloads, the size cap) drops them with it.

def derived_get(key):
    if not _STATE["enabled"]:
        return None
    return PLANS.get(key)


def derived_put(key, entry) -> None:
    if not _STATE["enabled"]:
        return
    if len(PLANS) >= _MAX_PLANS:
        clear()
    PLANS[key] = entry


# --------------------------------------------------------------------------------------------
# Direct launches: a plan's kernels through cuLaunchKernel, with a persistent parameter buffer
# --------------------------------------------------------------------------------------------

def _dim3(x) -> tuple:
    t = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return tuple(int(i) for i in t) + (1,) * (3 - len(t))


def function_ptr(kernel, device_id: int) -> int:
    """The ``CUfunction`` of a ``cupy.RawKernel`` on ``device_id`` (what its ``__call__``
    launches)."""
    import cupy
    with cupy.cuda.Device(device_id):
        return int(kernel.kernel.ptr)


class Direct:
    """The launches of ``plan`` made with the driver's ``cuLaunchKernel`` directly: no struct
    copy and no ``RawKernel.__call__`` per launch. The struct lives in a persistent buffer
    (``words``, the template's bytes) and ``argp`` points to a one-entry ``void*`` array holding
    its address: the kernels take the struct by value and the driver copies the parameters
    when the launch call returns, so the buffer may be rewritten after each call. A lock keeps
    two threads from interleaving fill and launch.

    Same kernels (the ``CUfunction`` of each recorded ``RawKernel``), grids, blocks, shared
    memory and struct bytes as :meth:`Plan.run` for the same pointers
    (tests/test_launch_plans.py compares them byte for byte)."""

    __slots__ = ("plan", "nbytes", "words", "argv", "argp", "launches", "lock")

    def __init__(self, plan: Plan, func_ptr=function_ptr):
        self.plan = plan
        raw = plan.template.tobytes()
        self.nbytes = len(raw)
        self.words = np.zeros((len(raw) + 7) // 8, dtype=np.uint64)
        self.words.view(np.uint8)[:len(raw)] = np.frombuffer(raw, np.uint8)
        self.argv = np.array([self.words.ctypes.data], dtype=np.uint64)    # void* params[1]
        self.argp = int(self.argv.ctypes.data)
        self.launches = tuple((func_ptr(kern, plan.device_id), *_dim3(grid), *_dim3(block),
                               int(smem)) for kern, grid, block, smem in plan.launches)
        self.lock = threading.Lock()

    def run(self, fills, stream_ptr: int, launch) -> None:
        """Write ``fills`` [(word index, address)] into the struct and launch every recorded
        kernel on ``stream_ptr`` with ``launch`` (``cupy.cuda.driver.launchKernel``'s
        signature). The caller sets the device (its context current) and keeps any scratch
        alive until this returns."""
        with self.lock:
            w = self.words
            for slot, addr in fills:
                w[slot] = addr
            argp = self.argp
            for f, gx, gy, gz, bx, by, bz, smem in self.launches:
                launch(f, gx, gy, gz, bx, by, bz, smem, stream_ptr, argp, 0)
