"""The torch fast path's C++ autograd node (flashcore.backends.torch_native) without a GPU: it
builds with the system compiler against the installed torch, loads, takes records and reads
them back, goes stale when the launch plans are dropped; a failed or disabled build leaves the
Python path in charge. Its launches and gradients are tested on the GPU
(tests/gpu/test_torch_gpu.py)."""
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")

from flashcore.backends import torch_native  # noqa: E402
from flashcore.kernels import plans  # noqa: E402

needs_cxx = pytest.mark.skipif(torch_native._compiler() is None, reason="no C++ compiler here")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("native-cache")
    mp.setenv("FLASHCORE_CACHE_DIR", str(cache))
    # a partial output left by a build that was killed two hours ago, and one in progress now
    old, new = cache / "flashcore_native-0.1.2.tmp.so", cache / "flashcore_native-0.3.4.tmp.so"
    old.write_bytes(b"partial")
    new.write_bytes(b"partial")
    os.utime(old, (os.path.getmtime(old) - 7200,) * 2)
    try:
        ops = torch_native.build()
        if torch_native.status()["status"] == "ready" and os.path.isfile(torch_native.library_path()):
            assert not old.exists() and new.exists()      # the build cleared the stale one only
        yield ops
    finally:
        mp.undo()


@needs_cxx
def test_builds_loads_and_caches(native):
    st = torch_native.status()
    assert st["status"] == "ready" and st["error"] is None
    assert os.path.isfile(st["library"])
    assert st["library"] == str(torch_native.library_path())
    # every op of the library's schema is there, and bwd_miss has its Python kernel
    for name in ("attention", "bwd_miss", "fwd_miss", "new_entry", "set_entry", "set_backward",
                 "invalidate", "entry_state", "driver_status"):
        assert hasattr(native, name), name
    for name in ("bwd_miss", "fwd_miss"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            f"flashcore_native::{name}", "CompositeImplicitAutograd")


@needs_cxx
def test_records_round_trip_and_go_stale_when_plans_drop(native):
    i = native.new_entry()
    j = native.new_entry()
    assert j == i + 1
    words = torch.tensor([7, -1, 2 ** 40, 0, 5], dtype=torch.int64)
    launches = [0x1234, 3, 2, 1, 128, 1, 1, 49152, 0x5678, 1, 1, 1, 32, 1, 1, 0]
    native.set_entry(words, launches, [0, 3, 4], 2, [256], 1024, True, [0, 0], [2, 4, 8],
                     True, 0, 0, i)
    st = native.entry_state(i)
    assert st[0] == 5 and st[1:6] == [7, -1, 2 ** 40, 0, 5]
    assert st[6:-2] == launches
    assert st[-2:] == [1, -1]               # current, no backward record yet
    native.set_entry(words, launches[:8], [1], 1, [], 0, False, [0], [], False, 0, 0, j)
    with pytest.raises(RuntimeError, match="dout, q, k, v, out, lse, alibi_slopes"):
        native.set_backward(i, j, [torch.empty(2, 3)])
    native.set_backward(i, j, [torch.empty(2, 3)] * 6 + [None])
    assert native.entry_state(i)[-1] == j
    plans.clear()                           # dropped plans: every record goes stale
    assert native.entry_state(i)[-2:] == [0, j]
    assert native.entry_state(j)[-2] == 0
    native.set_entry(words, launches, [0, 3, 4], 2, [256], 1024, True, [0, 0], [2, 4, 8],
                     True, 0, 0, i)         # re-recorded: current, backward to be recorded anew
    assert native.entry_state(i)[-2:] == [1, -1]


@needs_cxx
def test_bad_records_are_refused(native):
    i = native.new_entry()
    w = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="outside the struct"):
        native.set_entry(w, [1, 1, 1, 1, 1, 1, 1, 0], [9], 1, [], 0, False, [0], [], False, 0, 0, i)
    with pytest.raises(RuntimeError, match="8 integers per launch"):
        native.set_entry(w, [1, 2, 3], [0], 1, [], 0, False, [0], [], False, 0, 0, i)
    with pytest.raises(RuntimeError, match="int64 CPU tensor"):
        native.set_entry(w.int(), [1] * 8, [0], 1, [], 0, False, [0], [], False, 0, 0, i)
    with pytest.raises(RuntimeError, match="no native record"):
        native.entry_state(10 ** 6)


def _child(code, **env):
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_turned_off_by_the_environment(tmp_path):
    out = _child("from flashcore.backends import torch_native as t\n"
                 "assert t.ops() is None\n"
                 "print(t.status()['status'])\n"
                 "try:\n    t.build()\nexcept RuntimeError as e:\n    print('refused', e)\n",
                 FLASHCORE_TORCH_NATIVE="0", FLASHCORE_CACHE_DIR=str(tmp_path))
    assert out.splitlines()[0] == "off"
    assert "refused" in out and "FLASHCORE_TORCH_NATIVE=0" in out
    assert not list(tmp_path.iterdir())


def test_a_failed_build_is_reported_not_raised_on_the_call_path(tmp_path):
    false = shutil.which("false") or "/bin/false"
    out = _child("from flashcore.backends import torch_native as t\n"
                 "import time\n"
                 "assert t.ops() is None\n"          # starts the background build
                 "t._STATE['thread'].join()\n"
                 "assert t.ops() is None\n"          # loads nothing, records the failure
                 "st = t.status()\n"
                 "print(st['status']); print(st['error'])\n",
                 CXX=false, FLASHCORE_CACHE_DIR=str(tmp_path))
    lines = out.splitlines()
    assert lines[0] == "failed"
    assert "building the native autograd node failed" in out and false in out


def test_pointer_orders_match_the_python_names():
    """The C++ node passes the pointers in the order of torch_backend's _FWD_NAMES and
    _BWD_NAMES (the record's slots are laid out in that order): read it from the source."""
    import re
    from flashcore.backends import torch_backend as tb
    src = torch_native.source_path().read_text()
    calls = re.findall(r"launch\((?:e|b), \{([^}]*)\}", src)
    as_names = [tuple(re.findall(r"addr\((\w+)\)", c)) for c in calls]
    cpp = {"out": "o", "alibi": "alibi_slopes"}
    as_names = [tuple(cpp.get(n, n) for n in names) for names in as_names]
    assert as_names == [tb._FWD_NAMES, tb._BWD_NAMES]
