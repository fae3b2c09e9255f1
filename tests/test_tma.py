"""Tensor-map specs of the Hopper forward's TMA loads (flashcore.kernels.tma): which arrays TMA
can read, and the extents and strides the driver is given. The encoding itself needs the CUDA
driver (tests/gpu/test_sm90_gpu.py runs the kernel that reads the maps)."""
from __future__ import annotations

import types

import numpy as np

from flashcore.kernels import tma


def _arr(shape, dtype="bfloat16", strides=None, ptr=1 << 20):
    """What map_spec reads of a CuPy array: dtype name, shape, byte strides, address."""
    if strides is None:
        strides = tuple(int(s) * 2 for s in np.cumprod((1,) + tuple(shape[::-1]))[:-1][::-1])
    return types.SimpleNamespace(dtype=types.SimpleNamespace(name=dtype), ndim=len(shape),
                                 shape=shape, strides=strides,
                                 data=types.SimpleNamespace(ptr=ptr))


def test_dense_layout_is_described_innermost_first():
    sp = tma.map_spec(_arr((2, 300, 8, 128)), 128)
    assert list(sp.dims) == [128, 300, 8, 2]
    # byte strides of seqlen, heads, batch
    assert list(sp.strides) == [8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2]
    assert list(sp.box) == [64, 128, 1, 1]
    assert sp.dtype_code == 9 and tma.map_spec(_arr((2, 300, 8, 128), "float16"), 64).dtype_code == 6


def test_size_one_dimensions_get_a_valid_stride():
    # torch gives any stride to a size-1 dimension; it is never multiplied by a coordinate
    sp = tma.map_spec(_arr((1, 300, 1, 64), strides=(3, 128, 5, 2)), 128)
    assert list(sp.strides) == [128, 16, 16]


def test_refusals():
    assert tma.map_spec(_arr((2, 30, 4, 128), ptr=(1 << 20) + 8), 128) is None    # base
    assert tma.map_spec(_arr((2, 30, 4, 96)), 128) is None                        # headdim
    assert tma.map_spec(_arr((2, 30, 4, 128), strides=(30 * 4 * 136 * 2, 4 * 136 * 2, 136 * 2 + 2, 2)),
                        128) is None                                               # head stride
    assert tma.map_spec(_arr((2, 30, 4, 128), "float32"), 128) is None             # dtype
    assert tma.map_spec(_arr((30, 4, 128)), 128) is None                           # rank
    # a padded head stride that stays a multiple of 16 bytes is fine (a strided view)
    assert tma.map_spec(_arr((2, 30, 4, 128), strides=(30 * 4 * 136 * 2, 4 * 136 * 2, 136 * 2, 2)),
                        128) is not None


def test_fp8_bytes_take_boxes_of_128_elements():
    """The FP8 forward's uint8 arrays (float8_e4m3fn bits): 128 one-byte elements per
    128-byte swizzled row; head dims that are not a multiple of 128 are refused."""
    shape = (2, 300, 8, 256)
    strides = tuple(int(s) for s in np.cumprod((1,) + shape[::-1])[:-1][::-1])
    sp = tma.map_spec(_arr(shape, "uint8", strides), 128)
    assert sp.dtype_code == 0
    assert list(sp.dims) == [256, 300, 8, 2] and list(sp.box) == [128, 128, 1, 1]
    assert list(sp.strides) == [8 * 256, 256, 300 * 8 * 256]
    assert tma.map_spec(_arr((2, 30, 4, 64), "uint8", (30 * 4 * 64, 4 * 64, 64, 1)), 128) is None
