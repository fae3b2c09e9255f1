"""The benchmarks on a machine without a GPU: the asv suite imports and skips its GPU
benchmarks with a reason, ``python -m flashcore.bench`` says what is missing in one line and
exits 2, and its help works. (Their figures come from the GPU machine: see
asv_benchmarks/run_gpu.sh and asv_benchmarks/compare.sh.)"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import time
import re
import statistics
import subprocess
import sys

import pytest

from flashcore import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASV = os.path.join(ROOT, "asv_benchmarks")
MODULES = ["common", "bench_attention_gpu", "bench_decode_gpu", "bench_fp8_gpu", "bench_jit",
           "bench_numpy", "bench_transformers_gpu"]


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
                ("bench_attention_gpu", "TrainStepWallClock"),
                ("bench_transformers_gpu", "GenerateRatio"),
                ("bench_transformers_gpu", "PrefillRatio"),
                ("bench_transformers_gpu", "TrainStepRatio")]:
        assert new in names, names


def test_the_suite_uses_flashcore_bench_definitions(suite):
    """One problem definition and one timer: the suite's are flashcore.bench's."""
    common = suite["common"]
    assert common.Attention is bench.AttentionProblem
    assert common.DecodeProblem is bench.DecodeProblem
    assert common.gpu_time is bench.gpu_time and common.host_loop_us is bench.host_loop_us
    assert common.flops is bench.flops and common.shape_for is bench.shape_for
    assert common.speed_ratio is bench.speed_ratio


def test_parameters_are_fixed_values(suite):
    """asv compares results across commits by parameters: they never depend on what is
    installed (a missing backend skips, it does not disappear)."""
    d = suite["bench_decode_gpu"]
    assert d.DecodeWallClock.params == [["flashcore", "flashcore_paged", "flashcore_paged16",
                                         "sdpa_cudnn"],
                                        [1, 8, 64], [4096, 16384, 131072]]
    assert d.DecodeGraphReplay.params == d.DecodeWallClock.params
    a = suite["bench_attention_gpu"]
    assert a.TrainStepWallClock.params == [["flashcore", "sdpa_flash", "sdpa_cudnn"],
                                           ["forward", "forward_backward"]]
    t = suite["bench_transformers_gpu"]
    assert t.GenerateRatio.params == [["dynamic", "dynamic_new_lengths", "static"],
                                      ["1x512", "8x2048"]]
    assert t.PrefillRatio.params == [["all_ones", "left_padded"], ["1x512", "8x2048"]]
    assert t.TrainStepRatio.params == [["eager", "compiled"], ["1x16384", "4x4096"]]
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
                            sync=lambda: None, warmup_s=0.0)
    assert us > 0 and len(calls) == 2 + 3 * 10
    # the warm-up goes on until warmup_s has passed; none at all with warmup=0
    calls.clear()
    bench.host_loop_us(lambda: (calls.append(1), time.sleep(0.001)), steps=10, warmup=2,
                       rounds=1, sync=lambda: None, warmup_s=0.03)
    assert len(calls) >= 2 + 10 + 10
    calls.clear()
    bench.host_loop_us(lambda: calls.append(1), steps=10, warmup=0, rounds=1, sync=lambda: None)
    assert len(calls) == 10


def test_enqueue_timer_reads_the_clock_before_the_closing_sync():
    """enqueue_us: each round starts after a synchronisation and its clock stops before the
    one that ends it (a slow sync is not counted)."""
    calls, syncs = [], []
    us = bench.enqueue_us(lambda: (calls.append(1), time.sleep(0.001)), calls=5, rounds=3,
                          sync=lambda: (syncs.append(1), time.sleep(0.05)))
    assert len(calls) == 15 and len(syncs) == 6
    assert 1000 <= us < 20000          # the 1 ms of each call, not the 50 ms syncs


def test_wall_time_is_one_call_per_round_and_an_exact_warm_up():
    calls, syncs = [], []
    t = bench.wall_time(lambda: (calls.append(1), time.sleep(0.002)), reps=3, warmup=2,
                        sync=lambda: syncs.append(1))
    # exactly warm-up + reps calls (no clock-based warm-up: the ranks of a ring run agree)
    assert len(calls) == 2 + 3 and len(syncs) == 1 + 3
    assert 0.002 <= t < 1.0
    calls.clear()
    bench.wall_time(lambda: calls.append(1), sync=lambda: None)
    assert len(calls) == 1


def test_speed_ratio_pairs_each_round():
    """The median of each round's ratio, not the ratio of the medians: a host that slows for
    a while slows both models of a round. Here impl is 10% faster in every round but the
    third, in which the host slowed between the two: the paired figure says 1.11x, the ratio
    of the two medians (pairing the peer's slow rounds with impl's fast ones) 4.4x."""
    times = {"peer": [1.0, 1.0, 4.0, 4.0, 4.0], "impl": [0.9, 0.9, 0.9, 3.6, 3.6]}
    assert statistics.median(times["peer"]) / statistics.median(times["impl"]) == \
        pytest.approx(4.0 / 0.9)
    assert bench.speed_ratio(times, "impl", "peer") == pytest.approx(1 / 0.9)
    assert bench.speed_ratio(times, "peer", "impl") == pytest.approx(0.9)
    with pytest.raises(ValueError):
        bench.speed_ratio({"peer": [1.0, 2.0], "impl": [1.0]}, "impl", "peer")


def test_per_call_us_interleaved_takes_a_clock_a_sync_and_a_round_budget():
    now = [0.0]
    calls = {"slow": 0, "fast": 0}

    def make(name, cost):
        def fn():
            calls[name] += 1
            now[0] += cost
        return fn
    fns = {"slow": make("slow", 0.01), "fast": make("fast", 1e-6)}
    syncs = []
    us = bench.per_call_us_interleaved(fns, 1000, warmup=20, rounds=3,
                                       sync=lambda: syncs.append(1), clock=lambda: now[0],
                                       round_s=0.05)
    assert us["slow"] == pytest.approx(1e4) and us["fast"] == pytest.approx(1.0)
    # the slow one: 20 warm-up calls took 0.2 s, so 10 a round (the floor); the fast one: n
    assert calls == {"slow": 20 + 3 * 10, "fast": 20 + 3 * 1000}
    assert len(syncs) == 2 + 3 * 2
    calls.update(slow=0, fast=0)
    bench.per_call_us_interleaved(fns, 7, warmup=1, rounds=2, sync=lambda: None,
                                  clock=lambda: now[0])
    assert calls == {"slow": 1 + 2 * 7, "fast": 1 + 2 * 7}


def test_the_decode_table_times_its_host_loops_in_turn(monkeypatch):
    """``python -m flashcore.bench --decode`` (bench_callpath.py decode): per cell, both
    layouts' problems at once and the three host loops (flashcore contiguous and paged, the
    peer) in one interleaved timing, not one after the other; each row takes its own figure
    and the peer's."""
    torch = pytest.importorskip("torch")
    import contextlib
    made, timed = [], []

    class FakeProblem:
        def __init__(self, b, s, seed=None, page_size=None):
            made.append((b, s, page_size))
            self.page_size = page_size

        def api(self):
            pass

        def sdpa_unpinned(self):
            pass

    def interleaved(fns, n, round_s=None, **kw):
        timed.append((sorted(fns), len(made)))
        return {"contiguous": 30.0, "paged": 31.0, "peer": 40.0}
    monkeypatch.setattr(bench, "DecodeProblem", FakeProblem)
    monkeypatch.setattr(bench, "gpu_time", lambda fn: 1e-5)
    monkeypatch.setattr(bench, "sdpa_pinned", lambda peer: contextlib.nullcontext())
    monkeypatch.setattr(bench, "decode_graph", lambda impl, pb: impl)
    monkeypatch.setattr(bench, "graph_replay_time", lambda g: 2e-5)
    monkeypatch.setattr(bench, "per_call_us_interleaved", interleaved)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake", raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = bench.decode(batches=(1,), caches=(4096, 16384), page_size=256, out=lambda *a: None)
    assert made == [(1, 4096, None), (1, 4096, 256), (1, 16384, None), (1, 16384, 256)]
    assert timed == [(["contiguous", "paged", "peer"], 2), (["contiguous", "paged", "peer"], 4)]
    assert [(r["cache"], r["layout"], r["flashcore_host_us"], r["sdpa_cudnn_host_us"])
            for r in rows] == [(4096, "contiguous", 30.0, 40.0), (4096, "paged", 31.0, 40.0),
                               (16384, "contiguous", 30.0, 40.0), (16384, "paged", 31.0, 40.0)]
    assert all(r["flashcore_gpu_us"] == pytest.approx(10.0) for r in rows)


def test_enqueue_and_gpu_time_spins_then_times_the_loop_apart(monkeypatch):
    """The order of events on a stand-in device: warm-up, a synchronisation, three calls for
    the host estimate, spins, then the timed loop between the two events."""
    log = []

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self):
            log.append(("record", self.name))

    class FakeCuda:
        def __init__(self):
            self.names = iter("ab")

        def event(self):
            return Event(next(self.names))

        def sync(self):
            log.append("sync")

        def spin(self):
            log.append("spin")

        def seconds(self, a, b):
            assert (a.name, b.name) == ("a", "b")
            return 0.5

    monkeypatch.setitem(bench._STATE, "fake", FakeCuda())
    host, gpu = bench.enqueue_and_gpu_time(lambda: log.append("call"), steps=10, warmup=4,
                                           lib="fake")
    assert gpu == pytest.approx(0.05) and host >= 0
    first_spin = log.index("spin")
    assert log[:first_spin] == ["call"] * 4 + ["sync"] + ["call"] * 3 + ["sync"]
    rest = [x for x in log[first_spin:] if x != "spin"]
    assert rest == [("record", "a")] + ["call"] * 10 + [("record", "b"), "sync"]


# Where a diagnostic may still read a clock itself, and why (everything else times through
# flashcore.bench: one timer for asv, python -m flashcore.bench and tests/diagnostics)
_OWN_CLOCKS = {
    "probe_first_call.py": "the imports and the CUDA context, timed before flashcore.bench can "
                           "be imported, and before any synchronisation",
    "flash_attn_conformance.py": "how long pytest runs take, not GPU work",
    "probe_step_timeline.py": "perf_counter_ns stamps inside the autograd Function",
    "probe_route.py": "the clock it hands to flashcore.bench.per_call_us_interleaved",
}


def test_diagnostics_time_through_flashcore_bench():
    folder = os.path.join(ROOT, "tests", "diagnostics")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as f:
            src = f.read()
        for own in ("Event(enable_timing", "elapsed_time(", "do_bench(", "triton.testing",
                    "cuda._sleep("):
            assert own not in src, (name, own)
        if name not in _OWN_CLOCKS:
            assert "perf_counter" not in src and "time.time(" not in src, name


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


def _result_file(folder, commit, date, results):
    """An asv (0.6) result file: results {name: [[values], [[param reprs], ...]]}."""
    path = os.path.join(folder, "box", f"{commit[:8]}-existing-py.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"commit_hash": commit, "date": date, "version": 2,
                   "result_columns": ["result", "params", "version"],
                   "results": {k: [v, p, "0"] for k, (v, p) in results.items()}}, f)
    return path


def test_compare_flags_regressions_by_unit_direction(tmp_path, capsys):
    """compare.py: a ratio that drops, or a time that grows, beyond 5% is a regression; a
    figure the baseline had and this run lost is one too; improvements are reported only, and
    so are a peer's own figures (a time whose parameters name SDPA), whichever way they move."""
    sys.path.insert(0, ASV)
    try:
        compare = importlib.import_module("compare")
    finally:
        sys.path.remove(ASV)
    d = str(tmp_path)
    with open(os.path.join(d, "benchmarks.json"), "w") as f:
        json.dump({"m.Ratio.track_ratio": {"unit": "ratio"}, "m.Wall.track_us": {"unit": "us"},
                   "m.Peer.track_us": {"unit": "us"}, "version": 2}, f)
    p = [["'a'", "'b'"]]
    pp = [["'flashcore'", "'sdpa_cudnn'"]]
    old = _result_file(d, "1" * 40, 1, {"m.Ratio.track_ratio": ([1.00, 1.00], p),
                                        "m.Wall.track_us": ([10.0, 10.0], p),
                                        "m.Peer.track_us": ([10.0, 10.0], pp)})
    older = _result_file(d, "3" * 40, 0, {"m.Ratio.track_ratio": ([9.0, 9.0], p)})
    new = "2" * 40
    _result_file(d, new, 2, {"m.Ratio.track_ratio": ([0.90, 1.10], p),      # a worse, b better
                             "m.Wall.track_us": ([10.2, float("nan")], p),  # a within 5%, b lost
                             "m.New.track_us": ([1.0, 1.0], p),            # no baseline
                             "m.Peer.track_us": ([10.1, 20.0], pp)})       # the peer slower
    rc = compare.main(["--results", d, "--machine", "box", "--commit", new,
                       "--baseline-files", old, older])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "WORSE  0.90x m.Ratio.track_ratio('a')" in out, out
    assert "better  1.10x m.Ratio.track_ratio('b')" in out, out
    assert "LOST      m.Wall.track_us('b')" in out, out
    assert "m.Wall.track_us('a')" not in out
    assert "no committed baseline for m.New.track_us" in out
    assert "2 regression(s), 1 improvement(s)" in out
    assert "peer  2.00x m.Peer.track_us('sdpa_cudnn')" in out, out
    assert "m.Peer.track_us('flashcore')" not in out
    # the newest baseline of each benchmark counts (not the older 9.0), and a clean run is 0
    _result_file(d, new, 2, {"m.Ratio.track_ratio": ([0.99, 1.0], p)})
    assert compare.main(["--results", d, "--machine", "box", "--commit", new,
                         "--baseline-files", old, older]) == 0
    assert compare.main(["--results", d, "--machine", "box", "--commit", "4" * 40,
                         "--baseline-files", old]) == 2


def test_compare_sh_parses_and_its_groups_name_benchmarks(suite):
    script = os.path.join(ASV, "compare.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    line = next(l for l in open(script) if l.startswith("GROUPS_DEFAULT="))
    groups = line.split("=", 1)[1].strip().strip("'").split(";")
    names = [f"{m}.{c}.{meth}" for m, c, cls in _benchmark_classes(suite)
             for meth in dir(cls) if meth.startswith(("time_", "track_"))]
    for g in groups:
        assert any(re.search(g, n) for n in names), (g, names)


def test_compare_names_the_holes_in_the_published_history(tmp_path):
    """compare.holes: the commits after the oldest one with results (or after a given start)
    that change the kernels or backends and have no results; docs-only commits, commits with
    results and commits whose code equals a measured commit's are no holes."""
    sys.path.insert(0, ASV)
    try:
        compare = importlib.import_module("compare")
    finally:
        sys.path.remove(ASV)
    repo = tmp_path / "repo"
    (repo / "asv").mkdir(parents=True)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")

    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,
                              text=True, env=env).stdout.strip()

    def commit(path, text):
        f = repo / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", path)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    first = commit("cuda/a.cu", "1")                          # before any result: no hole
    measured = commit("flashcore/kernels/k.py", "1")          # has results
    hole1 = commit("flashcore/backends/b.py", "1")
    commit("docs/x.md", "1")                                  # docs only: no hole
    measured2 = commit("cuda/a.cu", "2")                      # has results
    hole2 = commit("cuda/a.cu", "3")
    commit("cuda/a.cu", "2")                                  # measured2's code again: no hole
    head = commit("flashcore/kernels/k.py", "2")              # the commit under test
    found = compare.holes(str(repo / "asv"), head, [measured, measured2[:8]])
    assert found == [hole2, hole1], (found, first)
    # from a start on (the tracking start): only the holes after it
    assert compare.holes(str(repo / "asv"), head, [measured, measured2], since=hole1) == [hole2]
    assert compare.holes(str(repo / "asv"), head, [measured, measured2], since=hole2[:8]) == []
    assert compare.holes(str(repo / "asv"), head, []) == []
    assert compare.holes(str(tmp_path), head, [measured]) == []   # not a repository: no answer


def test_the_gpu_check_ends_with_the_asv_compare_and_shows_its_verdict():
    """tests/gpu/check.sh runs asv_benchmarks/compare.sh on the commit under test, prints the
    comparison's report (the changes beyond 5%, not the tail of asv's own table) and fails
    when it fails."""
    script = os.path.join(ROOT, "tests", "gpu", "check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    run = text.index("bash asv_benchmarks/compare.sh")
    assert 'cat "$out/asv/compare.txt"' in text[run:]
    assert "asv_rc=$?" in text[run:] and "asv_rc != 0" in text.splitlines()[-1]
    # compare.sh writes that report where check.sh reads it
    sh = open(os.path.join(ASV, "compare.sh")).read()
    assert 'report="$OUT/asv/compare.txt"' in sh


def test_the_gpu_check_runs_in_parts_and_refuses_an_unknown_mode():
    """tests/gpu/check.sh's parts (tests, bench, asv) fit one device call each; an unknown mode
    is refused at once, before anything touches a GPU."""
    import subprocess
    script = os.path.join(ROOT, "tests", "gpu", "check.sh")
    text = open(script).read()
    for mode in ("quick", "full", "tests", "bench", "asv"):
        assert mode in text.split("case \"$mode\" in", 1)[1].split(")", 1)[0]
    r = subprocess.run(["bash", script, "nonsense"], capture_output=True, text=True,
                       env={**os.environ, "OUT": "/nonexistent-unused"}, timeout=60)
    assert r.returncode == 2 and "unknown mode 'nonsense'" in r.stderr, (r.returncode, r.stderr)


def test_the_benchmark_page_names_later_runs_of_its_groups(tmp_path):
    """docs/scripts/make_plots.py draws the page from one run (the newest with Ratio) and names
    the later commits that measured some of the page's groups again, without their figures."""
    sys.path.insert(0, os.path.join(ROOT, "docs", "scripts"))
    try:
        make_plots = importlib.import_module("make_plots")
    finally:
        sys.path.pop(0)
    d = str(tmp_path / "results")
    ratio = ([1.1, 0.9], [["'sdpa_flash'", "'sdpa_cudnn'"], ["'forward'"], ["1024"], ["64"],
                          ["False"]])
    wall = ([30.0, 20.0], [["'flashcore'", "'sdpa_cudnn'"], ["'forward'"]])
    full = "1" * 40
    later = "2" * 40
    unrelated = "3" * 40
    _result_file(d, full, 1_000, {"bench_attention_gpu.Ratio.track_ratio": ratio,
                                  "bench_attention_gpu.TrainStepWallClock.track_step_us": wall})
    _result_file(d, later, 2_000, {"bench_attention_gpu.TrainStepWallClock.track_step_us": wall})
    _result_file(d, unrelated, 3_000, {"bench_fp8_gpu.Fp8Forward.track_figure": wall})
    from pathlib import Path
    md = make_plots.generate(Path(d), tmp_path / "gen")
    assert f"**Commit `{full[:8]}`" in md
    assert f"`{later[:8]}`" in md and "`TrainStepWallClock`)" in md.split("Later commits")[1]
    assert unrelated[:8] not in md


def test_prefill_masks_are_all_ones_or_left_padded():
    """flashcore.bench.prefill_mask: all ones, or each row's padding on its left, row 0 whole
    (at batch 1 a quarter padded), every row keeping at least half."""
    torch = pytest.importorskip("torch")
    assert bench.prefill_mask(3, 16, False, "cpu").equal(torch.ones(3, 16, dtype=torch.int64))
    for batch, prompt in ((1, 512), (8, 2048)):
        m = bench.prefill_mask(batch, prompt, True, "cpu")
        kept = m.sum(1)
        assert m.dtype == torch.int64 and m.shape == (batch, prompt)
        assert bool((m[:, -1] == 1).all()) and bool((m.diff(dim=1) >= 0).all())   # left padding
        assert int(kept.min()) >= prompt // 2
        if batch == 1:
            assert int(kept[0]) == prompt - prompt // 4
        else:
            assert int(kept[0]) == prompt and int(kept[-1]) < prompt
