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
launcher's decisions otherwise is in the key too (the flashcore.config settings) or clears the
plans (tile overrides); plans made with kernels that were since unloaded are not replayed
(``jit.generation()``). Calls that made copies (an unaligned or strided input the kernels cannot
read directly), varlen calls (their keys would need the cu_seqlens layouts and lengths; not
done yet) and calls that launched nothing are never recorded.
``set_enabled(False)`` turns the replay off (the launchers then run in full every time).
"""
from __future__ import annotations

import numpy as np

from .. import jit
from .params import as_kernel_arg, params_dtype

__all__ = ["Plan", "layout_key", "set_enabled", "enabled", "clear", "PLANS"]

PLANS: dict = {}
_MAX_PLANS = 1024
_STATE = {"enabled": True}


def set_enabled(on: bool) -> None:
    _STATE["enabled"] = bool(on)
    if not on:
        clear()


def enabled() -> bool:
    return _STATE["enabled"]


def clear() -> None:
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

    __slots__ = ("device_id", "launches", "template", "scratch", "result", "generation")

    def __init__(self, device_id, launches, template, scratch=(), result=None):
        self.generation = jit.generation()      # the loaded kernels it launches
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


def lookup(key):
    if key is None or not _STATE["enabled"]:
        return None
    plan = PLANS.get(key)
    if plan is not None and plan.generation != jit.generation():
        return None          # its kernels were unloaded: the launcher runs in full again
    return plan
