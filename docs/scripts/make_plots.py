"""Turn the committed asv results into the benchmark page's plots and tables.

Reads ``asv_benchmarks/results/<machine>/<commit>-<env>.json`` (asv's own result files), picks
for each machine the newest commit with GPU results, and writes into the output folder:

* ``throughput_<pass>.png``: TFLOP/s against sequence length, one panel per head dim and mask,
  one line per implementation (flashcore's backends and the SDPA peers), for the forward, the
  backward and the forward+backward;
* ``memory.png``: peak device memory against sequence length, with the seqlen x seqlen score
  matrix that exact attention without tiling would have to hold, for scale;
* ``benchmarks.md``: the text the documentation includes: which machine, commit and date the
  figures come from, the plots, and the ratio / compile-time tables, all read from the results.
  When no GPU results are committed, it says so: no figure here is ever typed by hand.

    python docs/scripts/make_plots.py [--results asv_benchmarks/results] [--out docs/_generated]
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import itertools
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_MODULE = "bench_attention_gpu."
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
        return sum(len(v) for n, v in self.values.items() if n.startswith(GPU_MODULE))

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


def newest_gpu_run(runs: list[Run]) -> Run | None:
    gpu = [r for r in runs if r.n_gpu()]
    return max(gpu, key=lambda r: (r.date, r.started, r.n_gpu())) if gpu else None


def newest_with(runs: list[Run], *names: str) -> Run | None:
    """The newest run holding results of any of the benchmarks ``names``: a device session may
    run only part of the suite, so each figure comes from the newest run that has it (and
    says which one)."""
    have = [r for r in runs if any(r.get(n) for n in names)]
    return max(have, key=lambda r: (r.date, r.started)) if have else None


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

def ratio_table(run: Run) -> list[str]:
    data = run.get(f"{GPU_MODULE}Ratio.track_ratio")
    if not data:
        return []
    seqlens = sorted({k[2] for k in data})
    lines = ["| peer | pass | headdim | mask | " + " | ".join(f"{s // 1024}k" for s in seqlens)
             + " |", "| --- " * (4 + len(seqlens)) + "|"]
    for peer, which, hd, causal in sorted({(k[0], k[1], k[3], k[4]) for k in data}):
        cells = [data.get((peer, which, s, hd, causal)) for s in seqlens]
        lines.append(f"| {peer} | {PASS_TITLES[which]} | {hd} | {'causal' if causal else 'none'} | "
                     + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    return lines


DECODE_MODULE = "bench_decode_gpu."


def decode_tables(run: Run) -> list[str]:
    """KV-cache decoding: TB/s of each implementation, and flashcore's ratio to each peer, per
    batch and cache length (rows: batch; columns: cache)."""
    bw = run.get(f"{DECODE_MODULE}DecodeBandwidth.track_bandwidth")
    ratio = run.get(f"{DECODE_MODULE}DecodeRatio.track_ratio")
    lines = []
    for data, what, fmt in ((bw, "TB/s of K+V cache read per step", "{:.2f}"),
                            (ratio, "time of the peer / time of flashcore", "{:.3f}")):
        if not data:
            continue
        caches = sorted({k[2] for k in data})
        lines += [f"{what}:", "", "| implementation | batch | "
                  + " | ".join(f"cache {c // 1024}k" for c in caches) + " |",
                  "| --- " * (2 + len(caches)) + "|"]
        for impl, batch in sorted({(k[0], k[1]) for k in data},
                                  key=lambda x: (x[0] != "flashcore", x[0], x[1])):
            cells = [data.get((impl, batch, c)) for c in caches]
            label = impl if data is bw else f"flashcore vs {impl}"
            lines.append(f"| {label} | {batch} | "
                         + " | ".join("–" if c is None else fmt.format(c) for c in cells) + " |")
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
        c, w = cold.get(k), warm.get(k)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'–' if c is None else f'{c:.2f}'} | "
                     f"{'–' if w is None else f'{w:.3f}'} |")
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
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'–' if f is None else f'{f * 1e3:.1f}'} | "
                     f"{'–' if b is None else f'{b * 1e3:.1f}'} |")
    return lines


# --------------------------------------------------------------------------------------------

def _when(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d") if ms else "?"


def _describe(results_dir: Path, run: Run) -> str:
    m = machine_info(results_dir, run.machine)
    facts = ", ".join(f"{m[k]}" for k in ("cpu", "os") if m.get(k))
    return (f"machine `{run.machine}`{f' ({facts})' if facts else ''}, commit `{run.commit[:8]}` "
            f"of {_when(run.date)}, environment `{run.env}`")


def generate(results_dir: Path, out: Path) -> str:
    """Write the plots and ``benchmarks.md`` into ``out``; return the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.png")):
        old.unlink()
    runs = load_runs(results_dir) if results_dir.is_dir() else []
    gpu = newest_gpu_run(runs)
    rel = out.name  # the page that includes benchmarks.md sits next to this folder
    md = ["<!-- generated by docs/scripts/make_plots.py from asv_benchmarks/results: "
          "do not edit -->", ""]
    if gpu is None:
        md += ["```{note}",
               "**No GPU benchmark results are committed yet.** `asv_benchmarks/results/` holds "
               f"{len(runs)} result file(s), none with a GPU measurement. The plots and tables "
               "of this page are drawn from those files only; they appear once the suite has "
               "run on a GPU machine (`asv_benchmarks/run_gpu.sh`) and its results are "
               "committed.", "```", ""]
    else:
        md += ["Each figure below comes from the newest committed run that holds it (named "
               "under the figure). Within a figure every line comes from that one run, so "
               "flashcore and its peers were measured on the same machine, software and day.",
               ""]
        for which in ("forward", "forward_backward", "backward"):
            r = newest_with(runs, f"{GPU_MODULE}Throughput.track_{which}")
            p = plot_throughput(r, which, out) if r else None
            if p:
                md += [f"### Throughput, {PASS_TITLES[which]}", "",
                       f"![{PASS_TITLES[which]} TFLOP/s against sequence length]({rel}/{p.name})",
                       "", f"From {_describe(results_dir, r)}.", ""]
        r = newest_with(runs, f"{GPU_MODULE}Ratio.track_ratio")
        t = ratio_table(r) if r else []
        if t:
            md += ["### flashcore relative to its peers", "",
                   "Time of the peer divided by time of flashcore (CuPy API), both measured in "
                   f"one process: above 1, flashcore is faster. From {_describe(results_dir, r)}.",
                   ""] + t + [""]
        r = newest_with(runs, f"{DECODE_MODULE}DecodeRatio.track_ratio",
                        f"{DECODE_MODULE}DecodeBandwidth.track_bandwidth")
        t = decode_tables(r) if r else []
        if t:
            md += ["### Decoding with a KV cache", "",
                   "One query token, 32 query heads over 8 kv heads, headdim 128, bf16, a full "
                   "contiguous cache; GPU time of a step with the L2 flushed before it "
                   "(`flashcore.bench.gpu_time_l2_flushed`), flashcore through its decode "
                   "launcher with its default split rule, SDPA on the same K/V. From "
                   f"{_describe(results_dir, r)}.", ""] + t
        r = newest_with(runs, f"{GPU_MODULE}PeakMemory.track_peak_memory_forward",
                        f"{GPU_MODULE}PeakMemory.track_peak_memory_backward")
        p = plot_memory(r, out) if r else None
        if p:
            md += ["### Memory", "",
                   "Peak device memory a call allocates beyond its inputs. The dotted line is "
                   "the score matrix that attention computed without tiling would hold. For "
                   "flashcore's PyTorch backend, runs up to commit 960bf83 count torch's "
                   "allocator only: the backward's fp32 dQ accumulator comes from CuPy's pool, "
                   "which the CuPy line includes.", "",
                   f"![peak memory against sequence length]({rel}/{p.name})", "",
                   f"From {_describe(results_dir, r)}.", ""]
        r = newest_with(runs, "bench_jit.KernelCompile.track_cold_compile",
                        "bench_jit.KernelCompile.track_warm_load")
        t = compile_table(r) if r else []
        if t:
            md += ["### Kernel compile and load time", "", f"From {_describe(results_dir, r)}.",
                   ""] + t + [""]
    cpu = [r for r in runs if numpy_table(r)]
    if cpu:
        r = max(cpu, key=lambda r: (r.date, r.started))
        md += ["### NumPy reference backend (CPU)", "",
               f"From {_describe(results_dir, r)}; batch 2, 4 heads, float32.", ""]
        md += numpy_table(r) + [""]
    text = "\n".join(md)
    (out / "benchmarks.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Plots for the benchmark page, from asv results.")
    ap.add_argument("--results", type=Path, default=REPO / "asv_benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "_generated")
    args = ap.parse_args(argv)
    generate(args.results, args.out)
    print(f"make_plots: wrote {args.out}: "
          + ", ".join(sorted(p.name for p in args.out.iterdir())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
