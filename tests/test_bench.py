"""The benchmarks on a machine without a GPU: the asv suite imports and skips its GPU
benchmarks with a reason, ``python -m flashcore.bench`` says what is missing in one line and
exits 2, and its help works. (Their figures come from the GPU machine: see
asv_benchmarks/run_gpu.sh and asv_benchmarks/compare.sh.)"""
from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import pytest

from flashcore import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASV = os.path.join(ROOT, "asv_benchmarks")
MODULES = ["common", "bench_attention_gpu", "bench_decode_gpu", "bench_jit", "bench_numpy"]


def _gpu_here() -> bool:
    return bench.why_no_gpu() is None


@pytest.fixture(scope="module")
def suite():
    """The asv benchmark package, imported the way asv imports it (benchmark_dir's parent on
    sys.path, the folder as package ``benchmarks``)."""
    sys.path.insert(0, ASV)
    try:
        return {name: importlib.import_module(f"benchmarks.{name}") for name in MODULES}
    finally:
        sys.path.remove(ASV)


def _benchmark_classes(suite):
    for name, mod in suite.items():
        for cls_name, cls in vars(mod).items():
            if (inspect.isclass(cls) and cls.__module__ == mod.__name__ and hasattr(cls, "params")
                    and any(m.startswith(("time_", "track_")) for m in dir(cls))):
                yield name, cls_name, cls


def test_the_asv_modules_import(suite):
    assert set(suite) == set(MODULES)
    names = {(m, c) for m, c, _ in _benchmark_classes(suite)}
    for new in [("bench_decode_gpu", "DecodeWallClock"), ("bench_decode_gpu", "DecodeGraphReplay"),
                ("bench_attention_gpu", "TrainStepWallClock")]:
        assert new in names, names


def test_the_suite_uses_flashcore_bench_definitions(suite):
    """One problem definition and one timer: the suite's are flashcore.bench's."""
    common = suite["common"]
    assert common.Attention is bench.AttentionProblem
    assert common.DecodeProblem is bench.DecodeProblem
    assert common.gpu_time is bench.gpu_time and common.host_loop_us is bench.host_loop_us
    assert common.flops is bench.flops and common.shape_for is bench.shape_for


def test_parameters_are_fixed_values(suite):
    """asv compares results across commits by parameters: they never depend on what is
    installed (a missing backend skips, it does not disappear)."""
    d = suite["bench_decode_gpu"]
    assert d.DecodeWallClock.params == [["flashcore", "flashcore_paged", "sdpa_cudnn"],
                                        [1, 8, 64], [4096, 16384, 131072]]
    assert d.DecodeGraphReplay.params == d.DecodeWallClock.params
    a = suite["bench_attention_gpu"]
    assert a.TrainStepWallClock.params == [["flashcore", "sdpa_flash", "sdpa_cudnn"],
                                           ["forward", "forward_backward"]]
    for _, _, cls in _benchmark_classes(suite):
        for values in cls.params if isinstance(cls.params[0], list) else [cls.params]:
            assert all(isinstance(v, (bool, int, float, str)) for v in values), cls


def test_gpu_benchmarks_skip_with_a_reason_without_a_gpu(suite):
    if _gpu_here():
        pytest.skip("a GPU is here: the benchmarks run")
    skipped = 0
    for mod, cls_name, cls in _benchmark_classes(suite):
        if mod == "bench_numpy":
            continue
        params = [p[0] for p in cls.params]
        with pytest.raises(NotImplementedError) as e:
            cls().setup(*params)
        assert str(e.value), (cls_name, params)
        skipped += 1
    assert skipped >= 8


def test_host_loop_timer_counts_per_step():
    calls = []
    us = bench.host_loop_us(lambda: calls.append(1), steps=10, warmup=2, rounds=3,
                            sync=lambda: None)
    assert us > 0 and len(calls) == 2 + 3 * 10


def test_flops_and_sizes():
    assert bench.shape_for(4096, 128) == (4, 4096, 16, 128)
    assert bench.flops(4, 4096, 16, 128, False) == 4.0 * 4 * 16 * 4096 * 4096 * 128
    assert bench.flops(4, 4096, 16, 128, True, "forward_backward") == \
        3.5 * bench.flops(4, 4096, 16, 128, True)


# Python run first in the subprocess so that importing {name} fails as if it were not
# installed (sys.modules[name] = None would not do for torch: flashcore's import hook then
# takes torch for loaded).
_HIDE = """
import importlib.abc, importlib.machinery
class _Hide(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {name!r}:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}}")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Hide())
"""


def _bench(*args, prelude=""):
    code = f"import sys\n{prelude}\nfrom flashcore.bench import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


def test_bench_help():
    r = _bench("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--decode", "--overhead", "--seqlen", "--json"):
        assert flag in r.stdout


@pytest.mark.parametrize("args", [[], ["--overhead"], ["--decode"]], ids=["table", "overhead", "decode"])
@pytest.mark.parametrize("without", ["", "cupy", "torch"])
def test_bench_without_a_gpu_is_one_line_and_exit_2(args, without):
    if _gpu_here():
        pytest.skip("a GPU is here: the benchmark runs")
    prelude = _HIDE.format(name=without) if without else ""
    r = _bench(*args, prelude=prelude)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -m flashcore.bench: needs a CUDA GPU with CuPy and "
                               "PyTorch: "), lines
    if without == "torch":
        assert "PyTorch is not installed" in lines[0]
    assert r.stdout == ""


def test_diagnostics_hold_no_tests():
    """tests/diagnostics/ holds scripts, not tests: pytest collects nothing from it."""
    names = os.listdir(os.path.join(ROOT, "tests", "diagnostics"))
    assert "README.md" in names
    assert not [n for n in names if n.startswith("test_") or n.endswith("_test.py")]
