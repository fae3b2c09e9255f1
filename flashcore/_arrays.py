"""Array-library detection without importing torch or CuPy (array-api-compat style).

An array's library is read from its class alone (the classes in its MRO, by module and name),
through a constant table: no ``sys.modules`` lookup, no import, nothing that changes while a
program runs. So the detection is safe to call while another thread is still importing CuPy or
torch, and torch.compile (dynamo) traces it like any pure function of its argument.
"""
from __future__ import annotations

import numpy as np

NUMPY, CUPY, TORCH = "numpy", "cupy", "torch"

_LIBRARY_OF_CLASS = {("numpy", "ndarray"): NUMPY, ("cupy", "ndarray"): CUPY,
                     ("cupy._core.core", "_ndarray_base"): CUPY, ("torch", "Tensor"): TORCH}


_PLAIN = (bool, int, float, complex, str, bytes, tuple, list, dict, np.generic)


def library_of(x) -> str | None:
    """'numpy', 'cupy', 'torch' or None. Never imports a library."""
    t = type(x)
    # The plain values that calls pass (None, a window pair, lengths, scales) by identity
    # first: dynamo cannot trace the ``__module__`` of a builtin type as a dictionary key
    # (torch 2.11 refuses it, torch 2.13 traces it), and identity checks cost less than the
    # isinstance walk below.
    if x is None or t is tuple or t is int or t is float or t is bool or t is list:
        return None
    lib = _LIBRARY_OF_CLASS.get((t.__module__, t.__name__))    # (the classes themselves: the
    if lib is not None:                                         # common case, one lookup)
        return lib
    if isinstance(x, np.ndarray):
        return NUMPY
    if isinstance(x, _PLAIN):                  # (dynamo cannot walk the MRO of these)
        return None
    for cls in t.__mro__:
        lib = _LIBRARY_OF_CLASS.get((cls.__module__, cls.__name__))
        if lib is not None:
            return lib
    return None


def is_host(x) -> bool:
    """Whether the array's memory is host memory (reading its values costs no device sync)."""
    lib = library_of(x)
    return lib == NUMPY or (lib == TORCH and x.device.type == "cpu")


def torch_compiling(x) -> bool:
    """Whether torch.compile is tracing, asked of torch only when ``x`` is a torch tensor (so
    torch is imported already: the import below is a lookup)."""
    if library_of(x) != TORCH:
        return False
    import torch
    return bool(torch.compiler.is_compiling())


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
