"""flashcore: exact attention the FlashAttention way, for NumPy, CuPy and PyTorch arrays."""
from . import backends as _backends  # noqa: F401  (registers the backends)
from .api import (
    attention,
    attention_backward,
    attention_forward,
    attention_with_kvcache,
    available_backends,
    draw_rng_state,
    merge_attention_states,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from .backends.base import DeviceMemoryError, NotSupportedError

from ._version import __version__

__all__ = [
    "attention", "attention_forward", "attention_backward",
    "varlen_attention", "varlen_attention_forward", "varlen_attention_backward",
    "attention_with_kvcache", "merge_attention_states", "draw_rng_state",
    "available_backends", "NotSupportedError", "DeviceMemoryError", "__version__",
]
