"""The NumPy mirror of ``struct FlashParams`` (cuda/flash_params.cuh).

The dtype is derived by parsing the header, so the struct has a single definition. Every field
is a 4- or 8-byte scalar laid out with C alignment rules (``align=True``).
"""
from __future__ import annotations

import functools
import re

import numpy as np

from ..jit import cuda_dir

WINDOW_NONE = 1 << 30  # FC_WINDOW_NONE

_CTYPES = {
    "const void*": np.uint64, "void*": np.uint64, "float*": np.uint64,
    "const int*": np.uint64, "const float*": np.uint64, "int*": np.uint64,
    "long long": np.int64, "int": np.int32, "float": np.float32,
}


@functools.lru_cache(maxsize=None)
def params_dtype() -> np.dtype:
    text = (cuda_dir() / "flash_params.cuh").read_text()
    body = text[text.index("struct FlashParams {"):]
    body = body[: body.index("};")]
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split("{", 1)[1].split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"^(const void\*|void\*|const int\*|const float\*|float\*|int\*|long long|int|float)\s*(.*)$", decl)
        if not m:
            raise RuntimeError(f"flash_params.cuh: cannot parse declaration {decl!r}")
        ctype, names = m.groups()
        for n in names.split(","):
            fields.append((n.strip(), _CTYPES[ctype]))
    return np.dtype(fields, align=True)


@functools.lru_cache(maxsize=None)
def _field_index() -> dict[str, int]:
    return {n: i for i, n in enumerate(params_dtype().names)}


def make_params(**values) -> np.ndarray:
    """A 0-d structured scalar with the given fields set and every other field 0.

    Pointers are given as ints (``array.data.ptr``) or None (null). Unknown names raise.
    Built from one tuple in a single call: this runs on every kernel launch.
    """
    index = _field_index()
    row = [0] * len(index)
    for name, val in values.items():
        try:
            row[index[name]] = 0 if val is None else val
        except KeyError:
            raise KeyError(f"FlashParams has no field {name!r}") from None
    return np.array(tuple(row), dtype=params_dtype())


def as_kernel_arg(p: np.ndarray) -> np.ndarray:
    """The struct as a kernel argument: a 0-d array of one opaque ``numpy.void`` of the same
    bytes, which :class:`flashcore.jit.Kernel` passes by value as they are."""
    return p.view(np.dtype((np.void, p.dtype.itemsize)))
