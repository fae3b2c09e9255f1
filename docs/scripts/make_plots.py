"""Turn the committed asv results into the benchmark page's plots and tables.

Reads ``asv_benchmarks/results/<machine>/<commit>-<env>.json`` (asv's own result files) and
picks ONE run (one machine, commit and environment): the newest commit whose run measured the
``Ratio`` group, the page's core (by asv's commit date; a run of a group or two, as a session
short of device time commits, does not displace a complete one; with none, the newest with GPU
results, then the newest with any), or the commit named by
``--commit`` (a hash prefix; ``--machine`` narrows it to one machine). The environment
variables ``FLASHCORE_BENCH_COMMIT`` and ``FLASHCORE_BENCH_MACHINE`` do the same for the
documentation build, which calls :func:`generate` from ``docs/conf.py``. Every figure of the
page comes from that run; a group the run did not measure is left out and named as such, never
filled in from another commit. It writes into the output folder:

* ``benchmarks.md``: the text the documentation includes: the run's machine, commit and dates,
  then the tables (ratios to the peers, wall-clock, decoding) and plots of the groups it holds;
* ``throughput_<pass>.png`` (only when the run measured ``Throughput``): TFLOP/s against
  sequence length, one panel per head dim and mask, one line per implementation;
* ``memory.png`` (only when the run measured ``PeakMemory``): peak device memory against
  sequence length, with the seqlen x seqlen score matrix for scale.

PNGs already in the folder are deleted first, so no plot of another commit survives. When no
results are committed, the page says so: no figure here is ever typed by hand.

    python docs/scripts/make_plots.py [--commit 9786d372] [--machine nvidia-h200]
                                      [--results asv_benchmarks/results] [--out docs/_generated]
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import itertools
import json
import math
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_MODULE = "bench_attention_gpu."
DECODE_MODULE = "bench_decode_gpu."
IMPLEMENTATIONS = {          # parameter value -> legend label (order = drawing order)
    "cupy": "flashcore (CuPy)",
    "torch": "flashcore (PyTorch)",
    "sdpa_flash": "SDPA flash (FlashAttention-2)",
    "sdpa_cudnn": "SDPA cuDNN",
}
STYLE = {"cupy": ("C0", "o"), "torch": ("C1", "s"), "sdpa_flash": ("C2", "^"),
         "sdpa_cudnn": ("C3", "v")}
PASS_TITLES = {"forward": "forward", "backward": "backward",
               "forward_backward": "forward + backward"}


# --------------------------------------------------------------------------------------------
# Reading asv results
# --------------------------------------------------------------------------------------------

def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Run:
    """One asv result file: a machine, a commit, an environment, and its benchmark values."""

    def __init__(self, path: Path):
        self.path = path
        d = json.loads(path.read_text())
        self.commit = d["commit_hash"]
        self.env = d.get("env_name", "")
        self.machine = d.get("params", {}).get("machine", path.parent.name)
        self.date = d.get("date") or 0
        self.python = d.get("python", "")
        cols = d.get("result_columns", ["result", "params"])
        self.values: dict[str, dict[tuple, float]] = {}
        self.param_names: dict[str, list] = {}
        self.started = 0
        for name, row in d.get("results", {}).items():
            row = dict(zip(cols, row))
            self.started = max(self.started, row.get("started_at") or 0)
            result, params = row.get("result"), row.get("params") or []
            if result is None:
                continue
            keys = list(itertools.product(*[[ast.literal_eval(p) for p in ps] for ps in params]))
            self.values[name] = {k: v for k, v in zip(keys, result) if _finite(v)}

    def n_gpu(self) -> int:
        return sum(len(v) for n, v in self.values.items()
                   if n.startswith((GPU_MODULE, DECODE_MODULE)))

    def groups(self) -> set[str]:
        """The benchmark classes ('Ratio', 'DecodeWallClock', ...) with at least one value."""
        return {n.split(".")[1] for n, v in self.values.items() if v and n.count(".") >= 2}

    def get(self, name: str) -> dict[tuple, float]:
        return self.values.get(name, {})


def load_runs(results_dir: Path) -> list[Run]:
    runs = []
    for p in sorted(results_dir.glob("*/*.json")):
        if p.name in ("machine.json", "benchmarks.json"):
            continue
        try:
            runs.append(Run(p))
        except (ValueError, KeyError, SyntaxError) as e:
            print(f"make_plots: skipping unreadable {p}: {e}")
    return runs


def machine_info(results_dir: Path, machine: str) -> dict:
    p = results_dir / machine / "machine.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _newest(runs: list[Run]) -> Run | None:
    return max(runs, key=lambda r: (r.date, r.started, r.n_gpu())) if runs else None


def select_run(runs: list[Run], commit: str | None = None,
               machine: str | None = None) -> Run | None:
    """The one run the page is drawn from: the run of ``commit`` (a hash prefix), or by default
    the newest commit whose run measured ``Ratio`` (then the newest with GPU results, then the
    newest with any).
    ``machine`` restricts the choice to one machine's folder. A commit that matches no run,
    or runs on several machines or environments, is an error (a ValueError that lists them)."""
    runs = [r for r in runs if r.values]
    if machine:
        machines = sorted({r.machine for r in runs})
        runs = [r for r in runs if r.machine == machine]
        if not runs:
            raise ValueError(f"no results on machine {machine!r}; machines with results: "
                             f"{', '.join(machines) or 'none'}")
    if commit:
        want = commit.strip().lower()
        hits = [r for r in runs if r.commit.lower().startswith(want)]
        if not hits:
            have = sorted({f"{r.commit[:8]} ({r.machine})" for r in runs})
            raise ValueError(f"no results for commit {commit!r}"
                             f"{f' on machine {machine!r}' if machine else ''}; "
                             f"results exist for: {', '.join(have) or 'none'}")
        if len({(r.commit, r.machine, r.env) for r in hits}) > 1:
            raise ValueError(f"commit {commit!r} matches several runs: "
                             + ", ".join(f"{r.commit[:8]} on {r.machine} ({r.env})" for r in hits)
                             + "; give a longer hash or --machine")
        return hits[0]
    return (_newest([r for r in runs if "Ratio" in r.groups()])
            or _newest([r for r in runs if r.n_gpu()]) or _newest(runs))


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _seqlen_axis(ax, seqlens):
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens)
    ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
    ax.set_xlabel("sequence length")


def plot_throughput(run: Run, which: str, out: Path) -> Path | None:
    data = run.get(f"{GPU_MODULE}Throughput.track_{which}")
    if not data:
        return None
    seqlens = sorted({k[1] for k in data})
    headdims = sorted({k[2] for k in data})
    plt = _plt()
    fig, axes = plt.subplots(2, len(headdims), figsize=(4.2 * len(headdims), 7), squeeze=False,
                             sharey=True)
    for row, causal in enumerate((False, True)):
        for col, hd in enumerate(headdims):
            ax = axes[row][col]
            for impl, label in IMPLEMENTATIONS.items():
                pts = sorted((k[1], v) for k, v in data.items()
                             if k[0] == impl and k[2] == hd and k[3] == causal)
                if pts:
                    color, marker = STYLE[impl]
                    ax.plot(*zip(*pts), marker=marker, color=color, label=label)
            ax.set_title(f"headdim {hd}, {'causal' if causal else 'no mask'}")
            _seqlen_axis(ax, seqlens)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s (bf16)")
    axes[0][0].set_ylim(0, 1.08 * max(data.values()))   # shared by every panel
    handles, labels = axes[0][0].get_legend_handles_labels()
    for a in axes.flat:   # a panel may hold implementations that the first one lacks
        for h, lab in zip(*a.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(f"{PASS_TITLES[which]}: 16k tokens per batch, hidden 2048 "
                 f"({run.machine}, commit {run.commit[:8]})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = out / f"throughput_{which}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(run: Run, out: Path) -> Path | None:
    fwd = run.get(f"{GPU_MODULE}PeakMemory.track_peak_memory_forward")
    bwd = run.get(f"{GPU_MODULE}PeakMemory.track_peak_memory_backward")
    if not (fwd or bwd):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    seqlens = sorted({k[1] for k in list(fwd) + list(bwd)})
    for ax, data, title in ((axes[0], fwd, "forward"), (axes[1], bwd, "backward")):
        for impl, label in IMPLEMENTATIONS.items():
            for causal, ls in ((False, "-"), (True, "--")):
                pts = sorted((k[1], v / 2**20) for k, v in data.items()
                             if k[0] == impl and k[2] == causal)
                if pts:
                    color, marker = STYLE[impl]
                    ax.plot(*zip(*pts), ls=ls, marker=marker, color=color,
                            label=f"{label}{', causal' if causal else ''}")
        # the fp32 score matrix of all 16 heads, which tiling never materialises, for scale
        ax.plot(seqlens, [16 * s * s * 4 / 2**20 for s in seqlens], ":", color="grey",
                label="seqlen² scores, 16 heads, fp32 (not tiled)")
        ax.set_yscale("log")
        ax.set_ylabel("peak extra device memory (MiB)")
        ax.set_title(f"{title}: batch 1, 16 heads x 128, bf16")
        _seqlen_axis(ax, seqlens)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Tables (Markdown)
# --------------------------------------------------------------------------------------------

def _cell(v, fmt: str) -> str:
    return "–" if v is None else fmt.format(v)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def ratio_table(run: Run) -> list[str]:
    data = run.get(f"{GPU_MODULE}Ratio.track_ratio")
    if not data:
        return []
    seqlens = sorted({k[2] for k in data})
    lines = ["| peer | pass | headdim | mask | " + " | ".join(_k(s) for s in seqlens) + " |",
             "| --- " * (4 + len(seqlens)) + "|"]
    for peer, which, hd, causal in sorted({(k[0], k[1], k[3], k[4]) for k in data}):
        cells = [data.get((peer, which, s, hd, causal)) for s in seqlens]
        lines.append(f"| {peer} | {PASS_TITLES[which]} | {hd} | {'causal' if causal else 'none'} | "
                     + " | ".join(_cell(c, "{:.2f}") for c in cells) + " |")
    return lines


def peer_ratio_table(run: Run, group: str, key_names: tuple[str, ...]) -> list[str]:
    """A ``track_ratio`` group whose first parameter is the peer: one row per remaining
    parameter combination, one column per peer."""
    data = run.get(f"{GPU_MODULE}{group}.track_ratio")
    if not data:
        return []
    peers = sorted({k[0] for k in data})
    rows = sorted({k[1:] for k in data})
    lines = ["| " + " | ".join(key_names) + " | " + " | ".join(peers) + " |",
             "| --- " * (len(key_names) + len(peers)) + "|"]
    for r in rows:
        cells = [data.get((peer,) + r) for peer in peers]
        shown = [_k(x) if isinstance(x, int) and not isinstance(x, bool) and x >= 1024 else
                 ("causal" if x is True else "none" if x is False else str(x)) for x in r]
        lines.append("| " + " | ".join(shown) + " | "
                     + " | ".join(_cell(c, "{:.2f}") for c in cells) + " |")
    return lines


#: the ratio groups whose first parameter is the peer: (asv class, section title, text)
PEER_RATIO_SECTIONS = [
    ("DropoutRatio", "Attention dropout",
     "Forward + backward through autograd with dropout p = 0.1 (`DropoutRatio`), 16k tokens per "
     "batch, hidden 2048, bf16: each peer's time divided by flashcore's with dropout (above 1, "
     "flashcore is faster). The peers are SDPA's kernels with the same dropout and flashcore "
     "itself without dropout (`flashcore_p0`: what dropout costs)."),
    ("OddHeadDimRatio", "Head dims that are no multiple of 8",
     "Forward + backward (`OddHeadDimRatio`), 16k tokens per batch: the time of the call at the "
     "head dim padded to a multiple of 8 (flashcore itself, or SDPA's kernels, which take only "
     "multiples of 8) divided by flashcore's at the odd one."),
]


def _flashcore_first(impls) -> list[str]:
    return sorted(impls, key=lambda i: (not i.startswith("flashcore"), i != "flashcore", i))


def train_step_table(run: Run) -> list[str]:
    """The tiny training step: microseconds per step of each implementation, per pass, and each
    peer's time over flashcore's (computed here from the two measured times)."""
    data = run.get(f"{GPU_MODULE}TrainStepWallClock.track_step_us")
    if not data:
        return []
    impls = _flashcore_first({k[0] for k in data})
    peers = [i for i in impls if not i.startswith("flashcore")]
    lines = ["| pass | " + " | ".join(f"{i} (µs)" for i in impls) + " | "
             + " | ".join(f"{p} / flashcore" for p in peers) + " |",
             "| --- " * (1 + len(impls) + len(peers)) + "|"]
    for which in [w for w in PASS_TITLES if any(k[1] == w for k in data)]:
        fc = data.get(("flashcore", which))
        times = [data.get((i, which)) for i in impls]
        ratios = [data.get((p, which)) / fc if fc and data.get((p, which)) else None
                  for p in peers]
        lines.append(f"| {PASS_TITLES[which]} | " + " | ".join(_cell(t, "{:.1f}") for t in times)
                     + " | " + " | ".join(_cell(r, "{:.2f}") for r in ratios) + " |")
    return lines


def decode_us_table(data: dict[tuple, float]) -> list[str]:
    """Microseconds per decoding step, one row per (batch, cache), one column per
    implementation, then each peer's time over each flashcore variant's."""
    if not data:
        return []
    impls = _flashcore_first({k[0] for k in data})
    ours = [i for i in impls if i.startswith("flashcore")]
    peers = [i for i in impls if not i.startswith("flashcore")]
    pairs = [(p, f) for p in peers for f in ours]
    lines = ["| batch | cache | " + " | ".join(f"{i} (µs)" for i in impls) + " | "
             + " | ".join(f"{p} / {f}" for p, f in pairs) + " |",
             "| --- " * (2 + len(impls) + len(pairs)) + "|"]
    for batch, cache in sorted({(k[1], k[2]) for k in data}):
        times = [data.get((i, batch, cache)) for i in impls]
        ratios = []
        for p, f in pairs:
            tp, tf = data.get((p, batch, cache)), data.get((f, batch, cache))
            ratios.append(tp / tf if tp and tf else None)
        lines.append(f"| {batch} | {_k(cache)} | " + " | ".join(_cell(t, "{:.1f}") for t in times)
                     + " | " + " | ".join(_cell(r, "{:.2f}") for r in ratios) + " |")
    return lines


def decode_gpu_tables(run: Run) -> list[str]:
    """KV-cache decoding, GPU time: each peer's time over flashcore's (DecodeRatio), and the
    TB/s of each implementation (DecodeBandwidth), per batch and cache length."""
    bw = run.get(f"{DECODE_MODULE}DecodeBandwidth.track_bandwidth")
    ratio = run.get(f"{DECODE_MODULE}DecodeRatio.track_ratio")
    lines = []
    for data, what, first, fmt in (
            (ratio, "Time of the peer / time of flashcore (above 1, flashcore is faster):",
             "peer", "{:.3f}"),
            (bw, "TB/s of K+V cache read per step:", "implementation", "{:.2f}")):
        if not data:
            continue
        caches = sorted({k[2] for k in data})
        lines += [what, "", f"| {first} | batch | "
                  + " | ".join(f"cache {_k(c)}" for c in caches) + " |",
                  "| --- " * (2 + len(caches)) + "|"]
        for impl, batch in sorted({(k[0], k[1]) for k in data},
                                  key=lambda x: (x[0] != "flashcore", x[0], x[1])):
            cells = [data.get((impl, batch, c)) for c in caches]
            lines.append(f"| {impl} | {batch} | " + " | ".join(_cell(c, fmt) for c in cells)
                         + " |")
        lines.append("")
    return lines


def compile_table(run: Run) -> list[str]:
    cold = run.get("bench_jit.KernelCompile.track_cold_compile")
    warm = run.get("bench_jit.KernelCompile.track_warm_load")
    keys = sorted(set(cold) | set(warm), key=str)
    if not keys:
        return []
    lines = ["| pass | headdim | causal | cold compile (s) | load from disk cache (s) |",
             "| --- | --- | --- | --- | --- |"]
    for k in keys:
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {_cell(cold.get(k), '{:.2f}')} | "
                     f"{_cell(warm.get(k), '{:.3f}')} |")
    return lines


def numpy_table(run: Run) -> list[str]:
    fwd = run.get("bench_numpy.NumpyAttention.time_forward")
    bwd = run.get("bench_numpy.NumpyAttention.time_backward")
    if not (fwd or bwd):
        return []
    lines = ["| seqlen | headdim | causal | forward (ms) | backward (ms) |",
             "| --- | --- | --- | --- | --- |"]
    for k in sorted(set(fwd) | set(bwd)):
        f, b = fwd.get(k), bwd.get(k)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {_cell(f and f * 1e3, '{:.1f}')} | "
                     f"{_cell(b and b * 1e3, '{:.1f}')} |")
    return lines


# --------------------------------------------------------------------------------------------

#: every group the page can show, in page order: (asv class, what it gives)
GROUPS = [
    ("Throughput", "TFLOP/s plots"),
    ("Ratio", "time ratios to the SDPA peers"),
    ("DropoutRatio", "attention dropout against the peers and against no dropout"),
    ("OddHeadDimRatio", "head dims 59 and 111 against the padded call"),
    ("TrainStepWallClock", "wall-clock of the tiny training step"),
    ("DecodeRatio", "decode GPU-time ratios"),
    ("DecodeBandwidth", "decode TB/s"),
    ("DecodeWallClock", "decode wall-clock"),
    ("DecodeGraphReplay", "decode CUDA-graph replay time"),
    ("PeakMemory", "peak memory plot"),
    ("KernelCompile", "kernel compile and load times"),
    ("NumpyAttention", "NumPy reference backend times"),
]


def _when(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d") if ms else "?"


def _newer_runs(runs: list[Run], run: Run) -> list[tuple[Run, list[str]]]:
    """Later runs on the same machine that measured groups this page shows from ``run``:
    (run, those groups), oldest first. Named on the page, their figures not shown."""
    shown = {g for g, _ in GROUPS} & run.groups()
    later = sorted((r for r in runs if r.machine == run.machine and r.commit != run.commit
                    and (r.date, r.started) > (run.date, run.started)),
                   key=lambda r: (r.date, r.started))
    out = []
    for r in later:
        common = [g for g, _ in GROUPS if g in shown and g in r.groups()]
        if common:
            out.append((r, common))
    return out


def _header(results_dir: Path, run: Run, runs: list[Run] = ()) -> list[str]:
    m = machine_info(results_dir, run.machine)
    facts = ", ".join(f"{m[k]}" for k in ("cpu", "os") if m.get(k))
    have = run.groups()
    measured = [f"`{g}`" for g, _ in GROUPS if g in have]
    missing = [f"`{g}` ({what})" for g, what in GROUPS if g not in have]
    lines = [f"**Commit `{run.commit[:8]}`, machine `{run.machine}`.** Every figure on this page "
             f"comes from this one asv run (committed {_when(run.date)}, measured "
             f"{_when(run.started)}, environment `{run.env}`"
             f"{f', {facts}' if facts else ''}); flashcore and its peers were measured in the "
             "same run. Results of other commits are not mixed in.", "",
             f"This run measured {', '.join(measured) or 'no group the page shows'}."]
    if missing:
        lines[-1] += (" Not measured in it, so not shown: " + ", ".join(missing) + ". Those "
                      "figures appear when the run the page is built from measures the group.")
    newer = _newer_runs(list(runs), run)
    if newer:
        lines += ["", "Later commits measured some of these groups again (their figures are in "
                  "their result files, `asv_benchmarks/results/`, not on this page): "
                  + "; ".join(f"`{r.commit[:8]}` ({_when(r.date)}: "
                              + ", ".join(f"`{g}`" for g in groups) + ")"
                              for r, groups in newer) + "."]
    return lines + [""]


def generate(results_dir: Path, out: Path, commit: str | None = None,
             machine: str | None = None) -> str:
    """Write ``benchmarks.md`` (and the plots the chosen run allows) into ``out``; return the
    Markdown. ``commit`` / ``machine`` default to ``$FLASHCORE_BENCH_COMMIT`` /
    ``$FLASHCORE_BENCH_MACHINE``, then to the newest run (:func:`select_run`)."""
    commit = commit or os.environ.get("FLASHCORE_BENCH_COMMIT") or None
    machine = machine or os.environ.get("FLASHCORE_BENCH_MACHINE") or None
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.png")):
        old.unlink()
    runs = load_runs(results_dir) if results_dir.is_dir() else []
    run = select_run(runs, commit, machine)
    rel = out.name  # the page that includes benchmarks.md sits next to this folder
    md = ["<!-- generated by docs/scripts/make_plots.py from asv_benchmarks/results: "
          "do not edit -->", ""]
    if run is None:
        md += ["```{note}",
               f"**No benchmark results are committed yet.** `asv_benchmarks/results/` holds "
               f"{len(runs)} result file(s), none with a measurement. The tables and plots of "
               "this page appear once the suite has run (`asv_benchmarks/run_gpu.sh`) and its "
               "results are committed.", "```", ""]
        return _write(out, md)
    md += _header(results_dir, run, runs)
    for which in ("forward", "forward_backward", "backward"):
        p = plot_throughput(run, which, out)
        if p:
            md += [f"### Throughput, {PASS_TITLES[which]}", "",
                   f"![{PASS_TITLES[which]} TFLOP/s against sequence length]({rel}/{p.name})", ""]
    t = ratio_table(run)
    if t:
        md += ["### flashcore relative to its peers", "",
               "Time of the peer divided by time of flashcore, both measured in one process "
               "(`Ratio`): above 1, flashcore is faster. flashcore through its CuPy API, the "
               "peers through torch autograd; 16k tokens per batch, hidden 2048, bf16.", ""]
        md += t + [""]
    for group, title, text in PEER_RATIO_SECTIONS:
        t = peer_ratio_table(run, group, ("seqlen", "headdim", "mask"))
        if t:
            md += [f"### {title}", "", text, ""] + t + [""]
    t = train_step_table(run)
    if t:
        md += ["### Tiny training step, wall-clock", "",
               "Host wall-clock per step (`TrainStepWallClock`), 1 × 128 × 2 × 64 bf16, causal: "
               "a loop of steps ended by one synchronisation, best of several loops. "
               "flashcore through `flashcore.attention` on torch tensors, the peers through "
               "torch SDPA; forward under `torch.no_grad()`, forward + backward through "
               "autograd. At this size the step is bound by per-call host cost. The ratio "
               "columns are the peer's time over flashcore's: above 1, flashcore is faster.",
               ""] + t + [""]
    gpu_t = decode_gpu_tables(run)
    wall = decode_us_table(run.get(f"{DECODE_MODULE}DecodeWallClock.track_step_us"))
    replay = decode_us_table(run.get(f"{DECODE_MODULE}DecodeGraphReplay.track_replay_us"))
    if gpu_t or wall or replay:
        md += ["### Decoding with a KV cache", "",
               "One query token, 32 query heads over 8 kv heads, headdim 128, bf16, a full "
               "cache of the given length per sequence.", ""]
    if gpu_t:
        md += ["GPU time of a step with the L2 flushed before it "
               "(`flashcore.bench.gpu_time_l2_flushed`); flashcore through its decode launcher "
               "with its default split rule, SDPA on the same contiguous K/V.", ""] + gpu_t
    if wall:
        md += ["Host wall-clock per step (`DecodeWallClock`), steps back to back ended by one "
               "synchronisation: the launch and the Python around it, or the GPU work where "
               "that is longer. flashcore through `flashcore.attention_with_kvcache` on a "
               "contiguous cache and on a paged one (pages of 256), SDPA cuDNN on the "
               "contiguous cache. Ratio columns: the peer's time over flashcore's, above 1 "
               "flashcore is faster.", ""] + wall + [""]
    if replay:
        md += ["GPU time of one step replayed from a CUDA graph (`DecodeGraphReplay`, L2 "
               "flushed before each replay, median); ratio columns as above.", ""] + replay + [""]
    p = plot_memory(run, out)
    if p:
        md += ["### Memory", "",
               "Peak device memory a call allocates beyond its inputs. The dotted line is "
               "the score matrix that attention computed without tiling would hold. For "
               "flashcore's PyTorch backend, runs up to commit 960bf83 count torch's "
               "allocator only: the backward's fp32 dQ accumulator comes from CuPy's pool, "
               "which the CuPy line includes.", "",
               f"![peak memory against sequence length]({rel}/{p.name})", ""]
    t = compile_table(run)
    if t:
        md += ["### Kernel compile and load time", ""] + t + [""]
    t = numpy_table(run)
    if t:
        md += ["### NumPy reference backend (CPU)", "", "Batch 2, 4 heads, float32.", ""]
        md += t + [""]
    return _write(out, md)


def _write(out: Path, md: list[str]) -> str:
    text = "\n".join(md)
    (out / "benchmarks.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Tables and plots for the benchmark page, from the "
                                             "asv results of one commit.")
    ap.add_argument("--commit", help="hash (prefix) of the commit whose results the page shows "
                                     "(default: $FLASHCORE_BENCH_COMMIT, else the newest "
                                     "commit with GPU results)")
    ap.add_argument("--machine", help="asv machine name, when the commit has results on several")
    ap.add_argument("--results", type=Path, default=REPO / "asv_benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "_generated")
    args = ap.parse_args(argv)
    try:
        generate(args.results, args.out, args.commit, args.machine)
    except ValueError as e:
        ap.error(str(e))
    print(f"make_plots: wrote {args.out}: "
          + ", ".join(sorted(p.name for p in args.out.iterdir())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
