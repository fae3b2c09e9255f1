"""Launch plans: the per-layout launch cache at the API boundary.

A call's first run with a given layout goes the whole way (validation, backend choice, the
launcher's decisions: tile, template, grid, shared memory, the ``FlashParams`` struct) and is
*recorded*: the kernels it launched, in order, with their geometry and the struct's bytes, and
which struct fields hold which of the call's arrays. Every later call with that layout only
allocates its outputs, writes its arrays' addresses into a copy of the struct and launches
through ``cuLaunchKernel``: no array view, no struct built, no Python decision.

The key is made where the arrays arrive, in the library they come in (the torch ops in
:mod:`flashcore.backends.torch_ops`, the CuPy functions in :mod:`flashcore.api`): shape,
strides, dtype, device and the address modulo 16 of every array (the launchers' copy
decisions depend on it), the scalar options, and the :mod:`flashcore.config` settings. So no
switch has to clear anything: a changed setting is a different key. Kernels unloaded since a
plan was made (``jit.generation()``) make it stale, and it is recorded again.

Only what is known to be complete is recorded: a backend offers the launchers' pieces
(:func:`offer`) from the branches where those launches are the whole of the call's device work,
and a launcher that copied an input, or formed an address from anything but the call's arrays,
its own scratch or its stream's split counters, offers nothing. A call that offered nothing
(or anything unrecordable) is simply run in full every time.
"""
from __future__ import annotations

import ctypes
import operator
import struct
import threading

import numpy as np

from .. import jit
from . import device
from .params import params_dtype
from .tma import Maps

__all__ = ["Plan", "Piece", "record", "offer", "lookup", "remember", "clear", "PLANS", "enter",
           "set_enabled", "enabled"]

PLANS: dict = {}
_MAX_PLANS = 1024
_STATE = {"enabled": True}
_WORD = struct.Struct("<Q")
_INT64, _INT32 = struct.Struct("<q"), struct.Struct("<i")


def set_enabled(on: bool) -> None:
    """Record and replay plans (on by default); off runs every call in full (a diagnostic)."""
    _STATE["enabled"] = bool(on)
    if not on:
        clear()


def enabled() -> bool:
    return _STATE["enabled"]


def clear() -> None:
    PLANS.clear()


def lookup(key):
    """The plan recorded under ``key``, or None (also when its kernels were since unloaded)."""
    plan = PLANS.get(key)
    if plan is not None and plan.generation != jit._GENERATION[0]:    # (jit.generation())
        return None
    return plan


def remember(key, plan) -> None:
    if plan is None or not _STATE["enabled"]:
        return
    if len(PLANS) >= _MAX_PLANS:
        clear()
    PLANS[key] = plan


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------

class Piece:
    """What one launcher did in one call: ``launches`` [(kernel, grid, block, shared_mem)], all
    taking the struct ``params`` (a 0-d structured array); ``scratch`` {field: nbytes}: buffers
    the launcher allocated for this call alone (contents never read before its kernels write
    them); ``counter`` (field, groups, lookup) or None: the stream's split counters, whose
    address ``lookup(device_id, stream, groups)`` gives, or None (decode's
    ``existing_split_counter``: the recording launcher names it, so plans imports no
    launcher); ``maps`` [(field, tma.MapSpec)] or None: the launches take a second parameter, tensor maps of the
    arrays whose addresses those struct fields hold (encoded again for every call);
    ``relength`` or None: ``relength(capacity, *layout)`` gives the struct fields {name: value}
    that the same launches take for a cache of another length, or None where that length
    would launch otherwise (a decode launch's; see :meth:`Plan.for_length`)."""

    __slots__ = ("launches", "params", "scratch", "counter", "maps", "relength")

    def __init__(self, launches, params, scratch=None, counter=None, maps=None, relength=None):
        self.launches = [(k, _dim3(g), _dim3(b), int(s)) for k, g, b, s in launches]
        self.params = params
        self.scratch = dict(scratch or {})
        self.counter = counter
        self.maps = tuple(maps) if maps else None
        self.relength = relength


def _dim3(d) -> tuple:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


class _Recorder:
    __slots__ = ("pieces", "spoiled", "generation")

    def __init__(self):
        self.pieces = None
        self.spoiled = False
        self.generation = jit.generation()   # before any kernel of the call is looked up


_LOCAL = threading.local()


class record:
    """``with plans.record() as rec:`` run a call in full; afterwards ``rec.plan(roles)`` is
    its Plan (or None), where ``roles`` names the call's arrays in the order their addresses
    will be given to :meth:`Plan.run`: ``(("q", q_address), ("k", k_address), ...)``."""

    def __enter__(self):
        self.rec = _Recorder()
        self.outer = getattr(_LOCAL, "rec", None)
        _LOCAL.rec = self.rec
        return self

    def __exit__(self, *exc):
        _LOCAL.rec = self.outer
        return False

    def plan(self, roles, device_id, result=None):
        rec = self.rec
        if rec.spoiled or not rec.pieces or not _STATE["enabled"]:
            return None
        if rec.generation != jit.generation():   # kernels unloaded meanwhile: not recorded
            return None
        return Plan.build(rec.pieces, roles, device_id, result, rec.generation)


def offer(*pieces) -> None:
    """Called by a backend where the pieces are the call's whole device work (a None among them
    marks the call unrecordable). A second offer in one call spoils it too (the backend's
    branches are not meant to add up)."""
    rec = getattr(_LOCAL, "rec", None)
    if rec is None:
        return
    if rec.pieces is not None or any(p is None for p in pieces):
        rec.spoiled = True
        return
    rec.pieces = pieces


def spoil() -> None:
    """The current call did device work outside the offered pieces: do not record it."""
    rec = getattr(_LOCAL, "rec", None)
    if rec is not None:
        rec.spoiled = True


_POINTER_FIELDS: list = []


def _pointer_fields():
    """(name, byte offset) of every pointer field of the struct."""
    if not _POINTER_FIELDS:
        dt = params_dtype()
        fields = [(name, dt.fields[name][1]) for name in dt.names
                  if dt.fields[name][0] == np.uint64]   # pointers (no other 64-bit unsigned)
        _POINTER_FIELDS[:] = fields                     # (one assignment: thread-safe)
    return _POINTER_FIELDS


_INT_FIELDS: dict = {}


def _int_fields() -> dict:
    """{name: (struct.Struct, byte offset)} of every integer field of the struct."""
    global _INT_FIELDS
    dt = params_dtype()
    fields = {name: (_INT64 if dt.fields[name][0] == np.int64 else _INT32, dt.fields[name][1])
              for name in dt.names if dt.fields[name][0] in (np.int64, np.int32)}
    _INT_FIELDS = fields        # (one assignment: a reader never sees it half made)
    return fields


class Plan:
    """A recorded call: for each launcher piece, the bytes of its ``cuLaunchKernel``
    kernelParams (one word, the struct's address, or two with the tensor maps') followed by the
    struct's, and where its addresses go (the pointer slots as :func:`_runs` packs them,
    ``scratch`` [(byte offset, offset in the call's one scratch buffer)], ``counter`` (byte
    offset, groups, lookup) or None, ``maps`` [(role index, MapSpec)] or None), and its launches
    [(CUfunction, gx, gy, gz, bx, by, bz, shared_mem)]; ``scratch_bytes``: that buffer's size
    (one allocation a call); ``counters``: whether any piece takes split counters."""

    __slots__ = ("generation", "device_id", "context", "groups", "result", "kernels",
                 "scratch_bytes", "counters", "relength")

    @classmethod
    def build(cls, pieces, roles, device_id, result=None, generation=None):
        """The plan of ``pieces``, or None when a struct holds an address that is none of the
        call's arrays (by the field's own name), its scratch or its counters."""
        index = {name: i for i, (name, _) in enumerate(roles)}
        given = dict(roles)
        groups = []
        scratch_bytes = 0
        for p in pieces:
            words = p.params.reshape(1).view(np.uint64)
            slots, scratch, counter = [], [], None
            for name, off in _pointer_fields():
                value = int(words[off // 8])
                if name in p.scratch:     # carved from one buffer, 256-byte aligned
                    scratch.append((off, scratch_bytes))
                    scratch_bytes += -(-int(p.scratch[name]) // 256) * 256
                elif p.counter is not None and name == p.counter[0]:
                    counter = (off, int(p.counter[1]), p.counter[2])
                elif value == 0:
                    continue
                elif name in index and given[name] == value:
                    slots.append((off, index[name]))
                else:
                    return None     # an address this plan could not fill in again
            maps = None
            if p.maps is not None:
                by_field = dict(_pointer_fields())
                maps = []
                for name, spec in p.maps:
                    value = int(words[by_field[name] // 8])
                    if name not in index or given[name] != value:
                        return None
                    maps.append((index[name], spec))
                maps = tuple(maps)
            # cuLaunchKernel's fixed arguments, converted once (ctypes passes its own objects
            # faster than it converts ints)
            launches = tuple((ctypes.c_void_p(int(k.ptr)), *map(ctypes.c_uint, (*g, *b, s)))
                             for k, g, b, s in p.launches)
            head = 8 if maps is None else 16      # kernelParams before the struct (see run)
            raw = bytes(head) + p.params.tobytes()
            if counter is not None:
                counter = (head + counter[0], *counter[1:])
            (first, get), *more = _runs(raw, head, slots)
            groups.append((ctypes.c_char * len(raw), raw, first, get, tuple(more),
                           tuple((head + off, rel) for off, rel in scratch), counter, launches,
                           maps))
        plan = cls()
        plan.generation = jit.generation() if generation is None else generation
        # the kernel objects own their modules: kept, so the CUfunctions stay loaded
        plan.kernels = tuple(k for p in pieces for k, *_ in p.launches)
        plan.device_id = device_id
        # the context the kernels were loaded in (jit.get_kernel: the device's primary one)
        plan.context = device.driver().primary_context(device_id)
        plan.groups = tuple(groups)
        plan.counters = any(g[6] is not None for g in groups)
        plan.scratch_bytes = scratch_bytes
        plan.result = result
        plan.relength = pieces[0].relength if len(pieces) == 1 else None
        return plan

    def for_length(self, capacity, *layout):
        """This plan for a KV cache of ``capacity`` keys (a decode plan's only, whose struct is
        the one thing that the cache's length changes: ``Piece.relength`` says how, given the
        cache's ``layout``), or None: the call is then run in full. The same launches, scratch
        and counters; the fields that the length sets written into a copy of the struct."""
        values = None if self.relength is None else self.relength(capacity, *layout)
        if values is None:
            return None
        at = _INT_FIELDS or _int_fields()
        groups = []
        for g in self.groups:
            raw = bytearray(g[1])
            head = 8 if g[8] is None else 16
            for name, value in values.items():
                st, off = at[name]
                off += head
                if (st.unpack_from(raw, off)[0] == 0) != (value == 0):
                    return None     # (a zero word more or fewer: run's word runs, see _runs)
                st.pack_into(raw, off, value)
            groups.append((g[0], bytes(raw)) + g[2:])
        plan = Plan()
        for name in Plan.__slots__:
            setattr(plan, name, getattr(self, name))
        plan.groups = tuple(groups)
        return plan

    def run(self, pointers, stream: int, alloc):
        """Launch on ``stream`` with the call's array addresses ``pointers`` (in role order).
        ``alloc(nbytes)`` returns ``(owner, address)`` for a scratch buffer. Returns the scratch
        owners (keep them until the launches are queued: both allocators free in stream
        order), or None, launching nothing, when the stream has no split counters yet (the
        caller then runs the call in full, which makes them)."""
        launch_kernel = device.driver().launch
        addrs = None
        if self.counters:       # (all looked up before anything is launched)
            addrs = []
            for g in self.groups:
                if g[6] is not None:
                    a = g[6][2](self.device_id, stream, g[6][1])
                    if a is None:
                        return None
                    addrs.append(a)
        keep = []
        base = 0
        if self.scratch_bytes:
            owner, base = alloc(self.scratch_bytes)
            keep.append(owner)
        pack = _WORD.pack_into
        for buftype, template, first, get, more, scratch, counter, launches, maps in self.groups:
            arg = buftype.from_buffer_copy(template)      # this call's kernelParams and struct
            params = ctypes.addressof(arg)
            if maps is None:        # kernelParams [the struct's address], then the struct
                first.pack_into(arg, 0, params + 8, *get(pointers))
            else:                   # ... [the struct's, the tensor maps'] (m kept alive too)
                m = Maps(len(maps))
                for j, (i, spec) in enumerate(maps):
                    if not m.encode(j, spec, pointers[i]):
                        raise RuntimeError("flashcore: the driver refused a tensor map that it "
                                           "encoded for the same layout before")
                first.pack_into(arg, 0, params + 16, m.address, *get(pointers))
            for st, off, get in more:
                st.pack_into(arg, off, *get(pointers))
            for off, rel in scratch:
                pack(arg, off, base + rel)
            if counter is not None:
                pack(arg, counter[0], addrs.pop(0))
            for launch in launches:
                rc = launch_kernel(*launch, stream, params, None)
                if rc:
                    raise device.CUDADriverError(rc, "cuLaunchKernel")
        return keep


def _runs(raw: bytes, head: int, slots) -> tuple:
    """How :meth:`Plan.run` writes a call's addresses into a copy of ``raw`` (the kernelParams
    words, ``head`` bytes, then the struct): runs of 8-byte words, each one ``struct.Struct``
    (what lies between two words of a run is zero in ``raw``: padding keeps it so) and a getter
    of its addresses from the call's pointers. The first run starts at byte 0 with the
    kernelParams words (given apart: run's own addresses), then the pointer slots that follow
    them; ``((Struct, getter), (Struct, offset, getter), ...)``."""
    slots = sorted((head + off, i) for off, i in slots)
    groups = [[0, head, []]]          # [start, end, role indices]
    for off, i in slots:
        g = groups[-1]
        if off >= g[1] and not any(raw[g[1]:off]):
            g[2].append((off - g[1], i))
            g[1] = off + 8
        else:
            groups.append([off, off + 8, [(0, i)]])
    runs = []
    for start, _end, members in groups:
        fmt = "<" + "Q" * ((head // 8) if start == 0 else 0)
        for gap, _i in members:
            fmt += f"{gap}xQ" if gap else "Q"
        st = struct.Struct(fmt)
        idx = tuple(i for _gap, i in members)
        get = _getter(idx)
        runs.append((st, get) if start == 0 else (st, start, get))
    return tuple(runs)


def _getter(idx):
    """``pointers -> tuple(pointers[i] for i in idx)`` in one C call where it can be."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    if idx:
        i = idx[0]
        return lambda pointers: (pointers[i],)
    return lambda pointers: ()


def enter(plan) -> bool:
    """Whether ``plan`` can run on the calling thread: its context is current, or made current
    here when the thread has none yet (as the runtime binds a device's primary context at a
    thread's first call: torch's autograd threads start so). False when another context is
    current (another device's): the call then runs in full, under its device's scope."""
    drv = device.driver()
    ctx = drv.current_context()
    if ctx == plan.context:
        return True
    if ctx:
        return False
    drv.set_current_context(plan.context)
    return True
