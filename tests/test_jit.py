"""flashcore.jit on the host: the cross-process compile lock (one process compiles a kernel that
several need at once; the others wait for it and load the disk cache), and the disk cache of
compiled kernels itself (NVRTC runs without a GPU)."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import pytest

from flashcore import config, jit


def _hold(what, cache_dir, seconds, out):
    config.set(cache_dir=cache_dir)
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
    assert len(os.listdir(tmp_path / "locks")) == 2


def test_no_lock_folder_means_no_lock(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with config.override(cache_dir=str(blocker)):    # a file, not a folder: no locks there
        with jit._compile_lock("x"):
            pass


_NAME = "flash_bwd_convert_dq_kernel<fc_fp16>"      # a small kernel: a quick compile


def test_disk_cache_compiles_once_and_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    with config.override(cache_dir=str(tmp_path)):
        cubin, lowered = jit._cubin("flash_bwd.cu", _NAME, "sm_80", ())
        assert cubin[:4] == b"\x7fELF" and lowered.startswith("_Z")
        files = [f for f in os.listdir(tmp_path) if f.endswith(".cubin")]
        assert len(files) == 1

        def no_compile(*a, **k):
            raise AssertionError("compiled again although the cache holds the kernel")
        monkeypatch.setattr(jit, "_compile", no_compile)
        assert jit._cubin("flash_bwd.cu", _NAME, "sm_80", ()) == (cubin, lowered)
        # other options or another target: another key, another file
        assert jit._cache_key("flash_bwd.cu", _NAME, "sm_80", ()) != \
            jit._cache_key("flash_bwd.cu", _NAME, "sm_90a", ())
        assert jit._cache_key("flash_bwd.cu", _NAME, "sm_80", ()) != \
            jit._cache_key("flash_bwd.cu", _NAME, "sm_80", ("-DX=1",))


def test_disk_cache_ignores_a_damaged_file(tmp_path):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    with config.override(cache_dir=str(tmp_path)):
        path = tmp_path / (jit._cache_key("flash_bwd.cu", _NAME, "sm_80", ()) + ".cubin")
        path.write_bytes(b"not a cubin")
        cubin, lowered = jit._cubin("flash_bwd.cu", _NAME, "sm_80", ())
        assert cubin[:4] == b"\x7fELF"
        assert path.read_bytes().endswith(cubin)        # rewritten whole


def test_kernels_import_without_cupy():
    """The launchers, the plans and the torch backend import neither CuPy nor torch (a torch
    process must never pay CuPy's import: flashcore.kernels.device)."""
    import subprocess
    code = ("import sys; import flashcore.backends.torch_backend, flashcore.backends.cupy_backend, "
            "flashcore.kernels.forward, flashcore.kernels.backward, flashcore.kernels.decode, "
            "flashcore.kernels.plans, flashcore.jit; "
            "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_driver_calls_go_through_the_c_signatures():
    """flashcore.kernels.device's CUDA calls (ctypes prototypes of the driver's C signatures,
    so that no call imports CuPy): stand-ins of the same prototypes receive what each method
    passes, their results come back, a failing call raises CUDADriverError with the CUresult,
    and ``scope`` makes a device's primary context current and restores the previous one."""
    import ctypes
    from flashcore.kernels import device
    seen = {"ctx": 0x3000, "sets": []}

    def init(flags):
        seen["init"] = flags
        return 0

    def count(n_p):
        n_p[0] = 2
        return 0

    def attr(out_p, attribute, dev):
        out_p[0] = {75: 9, 76: 0, 16: 132, 97: 232448}[attribute] + 1000 * dev
        return 0

    def retain(ctx_p, dev):
        seen["retained"] = seen.get("retained", 0) + 1
        ctx_p[0] = 0x5000 + dev
        return 0

    def get_ctx(ctx_p):
        ctypes.c_void_p.from_address(ctx_p).value = seen["ctx"]
        return 0

    def set_ctx(ctx):
        seen["ctx"] = ctx or 0
        seen["sets"].append(ctx or 0)
        return 0

    def ctx_device(dev_p):
        dev_p[0] = seen["ctx"] - 0x5000
        return 0

    def load(module_p, image):
        seen["image"] = ctypes.string_at(image, 6)
        module_p[0] = 0x1000
        return 0

    def getf(function_p, module, name):
        seen["getf"] = (module, name)
        function_p[0] = 0x2000
        return 0

    def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen["launch"] = (f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        return seen.get("rc", 0)

    def fset(f, attribute, value):
        seen["fset"] = (f, attribute, value)
        return 0

    def fget(out_p, attribute, f):
        out_p[0] = 168
        return 0
    impl = {"cuInit": init, "cuDeviceGetCount": count, "cuDeviceGetAttribute": attr,
            "cuDevicePrimaryCtxRetain": retain, "cuCtxGetCurrent": get_ctx,
            "cuCtxSetCurrent": set_ctx, "cuCtxGetDevice": ctx_device, "cuModuleLoadData": load,
            "cuModuleGetFunction": getf, "cuLaunchKernel": launch, "cuFuncSetAttribute": fset,
            "cuFuncGetAttribute": fget}
    assert set(impl) == set(device._Driver._PROTOS)

    drv = object.__new__(device._Driver)     # the stand-ins behind the same C prototypes
    drv._fn = {name: ctypes.CFUNCTYPE(ctypes.c_int, *args)(impl[name])
               for name, args in device._Driver._PROTOS.items()}
    drv.launch = drv._fn["cuLaunchKernel"]
    drv._primary = {}
    drv._call("cuInit", 0)
    assert seen["init"] == 0
    assert drv.device_count() == 2
    assert drv.device_attribute(75, 1) == 1009 and drv.device_attribute(97, 0) == 232448
    cubin = b"\x7fELF\x00\x01" + bytes(50)
    assert drv.load_module(cubin) == 0x1000 and seen["image"] == cubin[:6]
    assert drv.get_function(0x1000, "_Z3fooi") == 0x2000
    assert seen["getf"] == (0x1000, b"_Z3fooi")
    drv.launch_kernel(0x2000, 3, 2, 1, 384, 1, 1, 200_000, 0x7000, 0x8000)
    assert seen["launch"] == (0x2000, 3, 2, 1, 384, 1, 1, 200_000, 0x7000, 0x8000, None)
    drv.launch_kernel(0x2000, 1, 1, 1, 32, 1, 1, 0, 0, 0x8000)      # the legacy stream: NULL
    assert seen["launch"][8] is None
    assert drv.launch(0x2000, 1, 1, 1, 32, 1, 1, 0, 0, 0x8000, None) == 0
    drv.set_function_attribute(0x2000, 8, 100_000)
    assert seen["fset"] == (0x2000, 8, 100_000)
    assert drv.function_attribute(4, 0x2000) == 168
    seen["rc"] = 912
    with pytest.raises(device.CUDADriverError, match="cuLaunchKernel failed") as e:
        drv.launch_kernel(0x2000, 1, 1, 1, 32, 1, 1, 0, 0, 0x8000)
    assert e.value.status == 912
    assert drv.launch(0x2000, 1, 1, 1, 32, 1, 1, 0, 0, 0x8000, None) == 912
    # contexts: the primary context retained once per device; scope switches and restores
    seen["ctx"] = 0
    assert drv.current_context() == 0 and drv.current_device() == 0   # (none: device 0)
    seen["ctx"] = 0x5000
    assert drv.current_device() == 0
    import flashcore.kernels.device as dmod
    real = dmod.driver
    dmod.driver = lambda: drv
    try:
        with dmod.scope(1):
            assert seen["ctx"] == 0x5001 and drv.current_device() == 1
            with dmod.scope(1):          # already current: nothing set
                pass
        assert seen["ctx"] == 0x5000 and seen["sets"] == [0x5001, 0x5000]
        with dmod.scope(None):
            assert seen["ctx"] == 0x5000
        with dmod.scope(1):
            pass
        assert seen["retained"] == 1
        seen["ctx"], seen["sets"] = 0, []     # a thread with no context keeps the scope's
        with dmod.scope(1):
            pass
        assert seen["ctx"] == 0x5001 and seen["sets"] == [0x5001]
        # plans.enter: the plan's context current (made so on a thread with none), or not
        from flashcore.kernels import plans
        plan = type("P", (), {"context": 0x5000})()
        seen["ctx"] = 0
        assert plans.enter(plan) and seen["ctx"] == 0x5000
        assert plans.enter(plan) and seen["sets"][-1] == 0x5000
        seen["ctx"] = 0x5001
        assert not plans.enter(plan) and seen["ctx"] == 0x5001
    finally:
        dmod.driver = real


def test_peak_memory_bandwidth_from_the_driver_attributes(monkeypatch):
    """2 x the memory clock x the bus width, each queried once per device (the H100 SXM's
    attributes, then the H200's)."""
    from flashcore.kernels import device
    asked = []
    facts = {0: {36: 2_619_000, 37: 5120}, 1: {36: 3_201_000, 37: 6144}}

    class Driver:
        def device_attribute(self, attribute, device_id):
            asked.append((attribute, device_id))
            return facts[device_id][attribute]
    monkeypatch.setattr(device, "driver", lambda: Driver())
    jit.peak_memory_bandwidth.cache_clear()
    try:
        assert jit.peak_memory_bandwidth(0) == pytest.approx(3.352e12, rel=1e-3)
        assert jit.peak_memory_bandwidth(1) == pytest.approx(4.917e12, rel=1e-3)
        assert jit.peak_memory_bandwidth(0) == pytest.approx(3.352e12, rel=1e-3)
        assert sorted(asked) == [(36, 0), (36, 1), (37, 0), (37, 1)]
    finally:
        jit.peak_memory_bandwidth.cache_clear()
