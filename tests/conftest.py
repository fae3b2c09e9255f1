import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_reason():
    from flashcore.backends.cupy_backend import _probe
    return _probe()


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = _gpu_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU tests need a CUDA GPU: {reason}"))
