"""Helpers shared by the kernel launchers."""
from __future__ import annotations


def _strides(arr):
    isz = arr.dtype.itemsize
    return tuple(s // isz for s in arr.strides)


def _used_strides_ok(arr, multiple: int, align: int) -> bool:
    # The stride of a size-1 dimension is never multiplied by a non-zero index: ignore it.
    st = _strides(arr)
    return (arr.data.ptr % align == 0 and st[-1] == 1 and
            all(s % multiple == 0 for s, n in zip(st[:-1], arr.shape[:-1]) if n > 1))


def _as_input(arr):
    """cp.async moves 16 bytes: base 16-byte aligned, strides multiples of 8 elements; else a
    copy into a fresh (aligned, contiguous) array. Not ``ascontiguousarray``: it returns a
    contiguous array as it is, however its base is aligned."""
    import cupy
    if arr.size == 0 or _used_strides_ok(arr, 8, 16):
        return arr
    out = cupy.empty(arr.shape, arr.dtype)
    out[...] = arr
    return out


def _as_output(arr):
    """Gradients are stored two elements (4 bytes) at a time; returns (array to write, copy-back)."""
    import cupy
    if arr.size == 0 or _used_strides_ok(arr, 2, 4):
        return arr, None
    return cupy.empty(arr.shape, arr.dtype), arr
