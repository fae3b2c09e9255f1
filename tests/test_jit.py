"""flashcore.jit on the host: the cross-process compile lock (one process compiles a kernel that
several need at once; the others wait for it and load the disk cache)."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import pytest

from flashcore import jit


def _hold(what, cache_dir, seconds, out):
    os.environ["CUPY_CACHE_DIR"] = cache_dir
    with jit._compile_lock(what):
        t0 = time.monotonic()
        time.sleep(seconds)
        out.put((what, t0, time.monotonic()))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_one_process_at_a_time_per_kernel(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(w, str(tmp_path), 0.4, out))
             for w in ("sm_90a|f|flash_fwd.cu|a|()", "sm_90a|f|flash_fwd.cu|a|()",
                       "sm_90a|f|flash_fwd.cu|b|()")]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    same = sorted((t0, t1) for w, t0, t1 in got if w.endswith("|a|()"))
    assert same[0][1] <= same[1][0] + 1e-3          # the second waited for the first
    # another kernel's lock is another file
    assert len(os.listdir(tmp_path / "flashcore-locks")) == 2


def test_no_lock_folder_means_no_lock(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker))    # a file, not a folder: no locks there
    with jit._compile_lock("x"):
        pass
