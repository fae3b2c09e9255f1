"""Array-library detection without importing torch or CuPy (array-api-compat style)."""
from __future__ import annotations

import sys

import numpy as np

NUMPY, CUPY, TORCH = "numpy", "cupy", "torch"


def library_of(x) -> str | None:
    """'numpy', 'cupy', 'torch' or None. Never imports a library that is not already loaded."""
    if isinstance(x, np.ndarray):
        return NUMPY
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(x, cp.ndarray):
        return CUPY
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH
    return None


def dtype_name(x) -> str:
    """'float16', 'bfloat16', 'float32', 'float64', 'int32', ... for any supported array."""
    if library_of(x) == TORCH:
        return str(x.dtype).replace("torch.", "")
    return np.dtype(x.dtype).name


def device_of(x) -> str:
    lib = library_of(x)
    if lib == NUMPY:
        return "cpu"
    if lib == CUPY:
        return f"cuda:{x.device.id}"
    if lib == TORCH:
        d = x.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else 0}"
    return "?"


def strides_in_elements(x) -> tuple[int, ...]:
    if library_of(x) == TORCH:
        return tuple(x.stride())
    item = x.dtype.itemsize
    return tuple(s // item for s in x.strides)


def to_host(x) -> np.ndarray:
    """A small array (cu_seqlens, slopes) copied to a NumPy array for validation."""
    lib = library_of(x)
    if lib == NUMPY:
        return x
    if lib == CUPY:
        return x.get()
    if lib == TORCH:
        return x.detach().cpu().numpy()
    return np.asarray(x)
