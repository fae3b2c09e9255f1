"""Host-side launchers for the CUDA kernels in ``cuda/`` (used by the CuPy and torch backends)."""
