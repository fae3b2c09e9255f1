"""Tensor maps for the Hopper kernels' TMA loads (``cuTensorMapEncodeTiled`` of the CUDA driver).

A tensor map is 128 opaque bytes that tell the tensor memory accelerator where a tensor is, its
extents and strides, the box one copy moves, and how to swizzle it into shared memory. It holds
the tensor's address, so it is encoded for every call (a host-only driver call of about a
microsecond, no device work); the kernel receives it as a ``__grid_constant__`` parameter
(``FcTensorMap`` in ``cuda/sm90_pipeline.cuh``).

A (batch, seqlen, heads, headdim) array is described innermost first as the rank-4 tensor
(headdim, seqlen, heads, batch), boxes of 128 bytes x ``rows`` x 1 x 1 (64 16-bit elements, or
128 bytes of an FP8 array held as uint8: one 128-byte swizzled row), rows past ``seqlen``
zero-filled by the hardware. The driver is reached
through ctypes (``libcuda.so.1``): no CUDA Python package is needed.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

__all__ = ["MapSpec", "map_spec", "Maps", "maps_for"]

MAP_BYTES = 128
# CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8 (float8_e4m3fn bits: the FP8 forward)
_DTYPE_CODE = {"float16": 6, "bfloat16": 9, "uint8": 0}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "uint8": 1}
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0            # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read 0
_U64x4 = ctypes.c_uint64 * 4
_U64x3 = ctypes.c_uint64 * 3
_U32x4 = ctypes.c_uint32 * 4
_ONES = _U32x4(1, 1, 1, 1)
_ENCODE: list = []


def _encode_fn():
    if not _ENCODE:
        from .device import libcuda
        f = libcuda().cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _ENCODE.append(f)
    return _ENCODE[0]


class MapSpec(NamedTuple):
    """Everything of a tensor map but the address: the data type code, the extents, the byte
    strides of the outer three dimensions and the box (ctypes arrays, made once per layout)."""
    dtype_code: int
    dims: object
    strides: object
    box: object


def map_spec(arr, box_rows: int) -> MapSpec | None:
    """The map of a (batch, seqlen, heads, headdim) CuPy array with boxes of 128 bytes x
    box_rows, or None when TMA cannot read it (base or a used stride not a multiple of 16
    bytes, a row not a multiple of 128 bytes, an extent past the driver's limits)."""
    code = _DTYPE_CODE.get(arr.dtype.name)
    if code is None or arr.ndim != 4 or arr.data.ptr % 16:
        return None
    b, s, h, d = (int(x) for x in arr.shape)
    isz = _ITEMSIZE[arr.dtype.name]
    box_inner = 128 // isz
    if d % box_inner or arr.strides[3] != isz or min(b, s, h) < 1:
        return None
    strides = []
    for n, st in zip((s, h, b), (arr.strides[1], arr.strides[2], arr.strides[0])):
        if n == 1:
            st = 16          # never multiplied by a non-zero coordinate
        if st <= 0 or st % 16 or st >= 1 << 40:
            return None
        strides.append(st)
    if max(b, s, h, d) >= 1 << 31:
        return None
    return MapSpec(code, _U64x4(d, s, h, b), _U64x3(*strides), _U32x4(box_inner, box_rows, 1, 1))


class Maps:
    """A 64-byte-aligned host buffer of ``n`` tensor maps, the kernel parameter that holds them
    (``arg``: a NumPy void scalar for :class:`flashcore.jit.Kernel`, ``address`` for a plan's
    ``cuLaunchKernel``)."""

    __slots__ = ("_buf", "address", "n")

    def __init__(self, n: int):
        self.n = n
        self._buf = (ctypes.c_char * (n * MAP_BYTES + 64))()
        self.address = (ctypes.addressof(self._buf) + 63) & ~63

    def encode(self, i: int, spec: MapSpec, pointer: int) -> bool:
        """Map ``i`` for the tensor at ``pointer``; False when the driver refuses it."""
        rc = _encode_fn()(self.address + i * MAP_BYTES, spec.dtype_code, 4, pointer,
                          ctypes.addressof(spec.dims), ctypes.addressof(spec.strides),
                          ctypes.addressof(spec.box), ctypes.addressof(_ONES),
                          _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO)
        return rc == 0

    def arg(self):
        """The maps as a by-value kernel argument (params.as_kernel_arg's kind: a 0-d array of
        one opaque void, copied out of this buffer)."""
        import numpy as np
        raw = ctypes.string_at(self.address, self.n * MAP_BYTES)
        return np.frombuffer(raw, dtype=np.dtype((np.void, len(raw)))).reshape(())


def maps_for(*arrays_rows):
    """The tensor maps of ``(array, box_rows)`` pairs, in order, with their specs: ``(Maps,
    specs)``, or None when TMA cannot read one of the arrays (the caller then launches a
    kernel that loads with cp.async)."""
    specs = tuple(map_spec(a, rows) for a, rows in arrays_rows)
    if any(sp is None for sp in specs):
        return None
    maps = Maps(len(specs))
    for i, (sp, (a, _)) in enumerate(zip(specs, arrays_rows)):
        if not maps.encode(i, sp, a.data.ptr):
            return None
    return maps, specs
