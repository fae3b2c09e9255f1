"""Helpers shared by the kernel launchers."""
from __future__ import annotations

import numpy as np

from .device import lib_of
from .params import WINDOW_NONE


def window_arg(w) -> int:
    """A window side as the kernels take it: WINDOW_NONE for unbounded (None, -1, or wider)."""
    return WINDOW_NONE if w is None or w < 0 or w >= WINDOW_NONE else int(w)


def tpl_bool(x: bool) -> str:
    """A bool as a C++ template argument."""
    return "true" if x else "false"


ELEM_TAGS = {"float16": "fc_fp16", "bfloat16": "fc_bf16"}


def elem_tag(dtype_name: str) -> str:
    """The kernels' element type (cuda/ptx.cuh) for a 16-bit dtype name."""
    try:
        return ELEM_TAGS[dtype_name]
    except KeyError:
        raise ValueError(f"the kernels support float16 and bfloat16, not {dtype_name}") from None


def kernel_dtype_name(arr) -> str:
    """'float16' or 'bfloat16' for an array the kernels take, else ValueError."""
    name = arr.dtype.name
    if name in ELEM_TAGS:
        return name
    raise ValueError(f"expected a float16 or bfloat16 array, got {arr.dtype}")


def smallest_tile(headdim: int, tiles) -> int:
    """The smallest head-dim tile in ``tiles`` (ascending) that holds ``headdim``."""
    for d in tiles:
        if headdim <= d:
            return d
    raise ValueError(f"headdim {headdim} exceeds the largest supported tile ({tiles[-1]})")


def _strides(arr):
    isz = arr.dtype.itemsize
    return tuple(s // isz for s in arr.strides)


def _strides_fit(shape, strides, multiple: int) -> bool:
    """Element ``strides`` of a ``shape`` that the kernels read in 16-byte pieces: the last
    dimension contiguous, every other stride a multiple of ``multiple`` elements. The stride
    of a size-1 dimension is never multiplied by a non-zero index: it is ignored."""
    return strides[-1] == 1 and all(s % multiple == 0
                                    for s, n in zip(strides[:-1], shape[:-1]) if n > 1)


def _used_strides_ok(arr, multiple: int, align: int) -> bool:
    return arr.data.ptr % align == 0 and _strides_fit(arr.shape, _strides(arr), multiple)


def _as_input(arr, multiple: int = 8):
    """cp.async moves 16 bytes: base 16-byte aligned, strides multiples of ``multiple``
    elements (8 for 16-bit elements, 16 for the bytes of an FP8 cache); else a copy into a
    fresh (aligned, contiguous) array. Not ``ascontiguousarray``: it returns a contiguous array
    as it is, however its base is aligned."""
    if arr.size == 0 or _used_strides_ok(arr, multiple, 16):
        return arr
    out = lib_of(arr).empty(arr.shape, arr.dtype)
    out[...] = arr
    return out


def _as_output(arr):
    """Gradients are stored two elements (4 bytes) at a time; returns (array to write, copy-back)."""
    if arr.size == 0 or _used_strides_ok(arr, 2, 4):
        return arr, None
    return lib_of(arr).empty(arr.shape, arr.dtype), arr


def _int64_pair(arr):
    """Dropout's rng_state (int64 (seed, offset), validated by flashcore.spec) as the kernels
    read it: a contiguous int64 array."""
    if arr.dtype != np.int64 or not arr.flags.c_contiguous:
        arr = lib_of(arr).ascontiguousarray(arr, dtype=np.int64)
    return arr
