"""Backends: one module each; importing this package registers them in priority order.

None of them imports torch or CuPy at import time.
"""
from . import numpy_backend  # noqa: F401
from . import cupy_backend  # noqa: F401
from . import torch_backend  # noqa: F401
from . import torch_ops  # noqa: F401  (defines the ops once torch is imported)
from .base import Backend, NotSupportedError, all_backends, choose, get_backend  # noqa: F401
