"""Compare one commit's asv results with the newest committed results of each benchmark.

    python asv_benchmarks/compare.py [--machine nvidia-h200] [--commit HASH] [--factor 1.05]
                                     [--bench REGEX] [--baseline-files F ...]

For every benchmark in the commit's result file (``results/<machine>/<hash8>-*.json``), and
every parameter combination in it, the baseline is the value in the newest result file (by its
date) that git tracks, other than the commit's own, and that has that benchmark. Changes beyond
``factor`` are printed; a change for the worse is a regression, and so is a figure that the
baseline had and this run lost (failed or skipped). Exits 1 on any regression, else 0. A
peer's own figure (a time or throughput whose parameters name torch's SDPA, cuDNN or
flash-attn: ``PEERS``) is not flashcore's to regress: its moves are listed apart, as what the
machine did that day. Ratios against a peer are flashcore's figures.
It also names the holes in the published history: the commits that change the kernels or
backends (``CODE_PATHS``) and have no committed results, where a commit whose code under
``CODE_PATHS`` is identical to that of a measured commit (a revert, say) counts as measured.
From ``TRACKING_START`` on, every such commit must carry results: a hole after it is a failure
(exit 1) like a regression. The commits before it were measured by hand at some commits only
and are not backfilled (each would need its own run of the suite on an H200, about seven
minutes; the count is printed as information): docs/benchmarks.md, "History".

Which way is worse comes from the benchmark's unit (results/benchmarks.json): ratio, TFLOP/s
and TB/s are better higher; times, microseconds and bytes are better lower. (``asv compare``
takes larger as worse for every benchmark, which is wrong for ratios and throughput, so its
table is informative only: asv_benchmarks/compare.sh prints it when it works.)
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HIGHER_IS_BETTER = {"ratio", "TFLOP/s", "TB/s", "GB/s", "GFLOP/s"}
#: where a change can move the figures: a commit that touches these and has no committed
#: results is a hole in the published history
CODE_PATHS = ("cuda", "flashcore/kernels", "flashcore/backends", "flashcore/jit.py",
              "flashcore/api.py")
#: the first commit from which every commit that changes CODE_PATHS carries committed results
#: (c75b705, 2026-12-04); holes after it fail the comparison
TRACKING_START = "c75b705f19f5523fa5610e408488181713243154"
#: parameter values (as asv writes them) that name a peer, not flashcore
PEERS = ("'sdpa", "'cudnn", "'flash_attn", "'torch")


def load(path):
    """{benchmark name: {params tuple: value or None}} and the file's date."""
    with open(path) as f:
        d = json.load(f)
    cols = d.get("result_columns", ["result", "params"])
    out = {}
    for name, entry in d.get("results", {}).items():
        row = dict(zip(cols, entry)) if isinstance(entry, list) else {"result": entry}
        values, params = row.get("result"), row.get("params") or []
        if not isinstance(values, list):
            values = [values]
        combos = list(itertools.product(*params)) if params else [()]
        out[name] = {c: (None if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                     for c, v in zip(combos, values)}
    return out, d.get("date", 0), d.get("commit_hash", "")


def committed(results_dir, machine):
    """Result files of ``machine`` that git tracks (the committed results); where git lists
    none (a copied checkout whose .git is stale or has no index), every result file there."""
    listed = []
    try:
        listed = subprocess.run(["git", "-C", results_dir, "ls-files", "--", machine],
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pass
    paths = ([os.path.join(results_dir, p) for p in listed] if listed else
             glob.glob(os.path.join(results_dir, machine, "*.json")))
    return [p for p in paths if p.endswith(".json") and not p.endswith("machine.json")
            and os.path.exists(p)]


def units(results_dir):
    try:
        with open(os.path.join(results_dir, "benchmarks.json")) as f:
            return {k: v.get("unit", "") for k, v in json.load(f).items() if isinstance(v, dict)}
    except (OSError, ValueError):
        return {}


def higher_is_better(unit):
    return unit in HIGHER_IS_BETTER


def fmt(v):
    if v is None:
        return "n/a"
    return f"{v:.4g}"


def is_peer(unit, combo):
    """A peer's own figure: not a ratio, and a parameter names a peer."""
    return unit != "ratio" and any(str(c).startswith(PEERS) for c in combo)


def compare(new, baselines, unit_of, factor, bench=None):
    """Returns (regressions, improvements, unmatched, peers' moves) as lists of printable
    rows."""
    regressions, improvements, missing, peers = [], [], [], []
    for name in sorted(new):
        if bench and not re.search(bench, name):
            continue
        base_file = next((b for b in baselines if name in b[0]), None)
        if base_file is None:
            missing.append(name)
            continue
        old_values, _, old_commit = base_file
        better_high = higher_is_better(unit_of.get(name, ""))
        for combo, value in new[name].items():
            old = old_values[name].get(combo)
            if old is None:
                continue
            label = f"{name}({', '.join(str(c) for c in combo)})"
            where = f"{old_commit[:8]} {fmt(old)} -> {fmt(value)} {unit_of.get(name, '')}".rstrip()
            peer = is_peer(unit_of.get(name, ""), combo)
            if value is None:
                (peers if peer else regressions).append(
                    f"LOST      {label}: {where} (failed or skipped now)")
                continue
            if old == 0 or value == 0:
                continue
            change = value / old
            worse = change < 1 / factor if better_high else change > factor
            better = change > factor if better_high else change < 1 / factor
            if peer:
                if worse or better:
                    peers.append(f"peer {change:5.2f}x {label}: {where}")
            elif worse:
                regressions.append(f"WORSE {change:5.2f}x {label}: {where}")
            elif better:
                improvements.append(f"better {change:5.2f}x {label}: {where}")
    return regressions, improvements, missing, peers


def holes(repo, commit, result_commits, paths=CODE_PATHS, since=None):
    """Commits up to ``commit``, after the oldest of ``result_commits`` in its history (or after
    ``since`` where given and in that history), that change ``paths`` and have no results
    (newest first; ``commit`` itself left out: its results are this run's). A commit whose
    ``paths`` are identical to a measured commit's is measured. [] when git cannot tell (a
    copied checkout without history)."""
    def git(*args):
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                              check=True).stdout

    def code(c):       # the ids of the trees and files under paths at commit c
        return git("ls-tree", "--full-tree", c, "--", *paths)
    try:
        history = git("rev-list", commit).split()        # newest first
        measured = {c for c in history if any(c.startswith(r) for r in result_commits)}
        if not measured:
            return []
        oldest = [c for c in history if c in measured][-1]
        if since is not None:
            start = [c for c in history if c.startswith(since)]
            if not start:
                return []
            oldest = start[0]
        changed = git("rev-list", f"{oldest}..{commit}", "--",
                      *(f":(top){p}" for p in paths)).split()
        gaps = [c for c in changed if c not in measured and c != history[0]]
        if gaps:
            known = {code(c) for c in measured}
            gaps = [c for c in gaps if code(c) not in known]
    except (OSError, subprocess.CalledProcessError):
        return []
    return gaps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default=os.environ.get("ASV_MACHINE", "nvidia-h200"))
    ap.add_argument("--commit", default="HEAD", help="the commit whose results are compared")
    ap.add_argument("--factor", type=float, default=1.05,
                    help="a change beyond this factor is reported (default 1.05: 5%%)")
    ap.add_argument("--bench", help="only benchmarks whose name matches this regex")
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--baseline-files", nargs="*",
                    help="compare against these files instead of the committed results")
    a = ap.parse_args(argv)
    commit = a.commit
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", commit], capture_output=True,
                                text=True, check=True).stdout.strip()
    mine = glob.glob(os.path.join(a.results, a.machine, f"{commit[:8]}-*.json"))
    if not mine:
        print(f"compare: no results of {commit[:8]} for machine {a.machine} in {a.results}",
              file=sys.stderr)
        return 2
    new, _, _ = load(mine[0])
    files = a.baseline_files if a.baseline_files is not None else committed(a.results, a.machine)
    baselines = []
    for path in files:
        if os.path.basename(path).startswith(commit[:8]):
            continue
        baselines.append(load(path))
    baselines.sort(key=lambda b: b[1], reverse=True)       # newest first
    regressions, improvements, missing, peers = compare(new, baselines, units(a.results),
                                                        a.factor, a.bench)
    print(f"compare: {commit[:8]} against the newest committed result of each benchmark "
          f"({a.machine}; changes beyond {a.factor:g}x)")
    for row in improvements:
        print("  " + row)
    for row in regressions:
        print("  " + row)
    for name in missing:
        print(f"  (no committed baseline for {name}: this run's results, once committed, are)")
    if peers:
        print("compare: the peers' own figures that moved (information, not regressions):")
        for row in peers:
            print("  " + row)
    compared = sum(1 for n in new if n not in missing and (not a.bench or re.search(a.bench, n)))
    print(f"compare: {len(regressions)} regression(s), {len(improvements)} improvement(s) "
          f"beyond {a.factor:g}x over {compared} benchmark(s) with a baseline")
    measured = [b[2] for b in baselines if b[2]]
    gaps = holes(HERE, commit, measured, since=TRACKING_START)
    if gaps:
        print(f"compare: FAIL: {len(gaps)} commit(s) since {TRACKING_START[:8]} (where the "
              f"history is complete) change {', '.join(CODE_PATHS)} and have no committed "
              f"results: {' '.join(c[:8] for c in gaps[:20])}{' ...' if len(gaps) > 20 else ''}")
    before = [c for c in holes(HERE, commit, measured) if c not in gaps]
    if before:
        print(f"compare: (information) {len(before)} commit(s) before {TRACKING_START[:8]} "
              f"change the code and were never measured; they are not backfilled")
    return 1 if regressions or gaps else 0


if __name__ == "__main__":
    sys.exit(main())
