"""What attention dropout costs (issue: the flash-attn drop-in, "dropout throughput >= 0.9x the
no-dropout path"), through the public API on torch tensors, at the ANCHORS sizes.

    python tests/diagnostics/bench_dropout.py [--seqlen 4096 16384] [--headdim 64 128]
                                              [--p 0.1] [--json F]

For each cell (16k tokens per batch, hidden 2048, bf16, causal and not): GPU time of the
forward (no grad) and of forward+backward through autograd, for flashcore with dropout p,
flashcore without dropout, and SDPA's flash and cuDNN kernels with the same dropout (the random
state drawn per call, as a training step does). Prints ms and the ratios flashcore(p=0) /
flashcore(p) (what dropout costs: >= 0.9 is the bound) and peer / flashcore (> 1: faster).
"""
from __future__ import annotations

import argparse
import json
import sys

from flashcore.bench import AttentionProblem, shape_for


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    impls = (("fc", "torch", a.p), ("fc_p0", "torch", 0.0), ("flash", "sdpa_flash", a.p),
             ("cudnn", "sdpa_cudnn", a.p))
    print(f"{'cell':24s} {'pass':8s} " + " ".join(f"{n:>8s}" for n, *_ in impls)
          + "   p0/p  flash/fc cudnn/fc")
    for s in a.seqlen:
        for d in a.headdim:
            for causal in (False, True):
                shape = shape_for(s, d)
                ms = {}
                for name, impl, p in impls:
                    try:
                        prob = AttentionProblem(impl, *shape, causal, dropout_p=p)
                        ms[name] = {w: prob.seconds(w) * 1e3 for w in ("forward",
                                                                       "forward_backward")}
                        del prob
                    except (NotImplementedError, RuntimeError) as e:
                        ms[name] = None
                        print(f"# {name} at {shape} causal={causal}: {str(e)[:120]}")
                for w in ("forward", "forward_backward"):
                    t = {n: (ms[n][w] if ms[n] else float("nan")) for n, *_ in impls}
                    row = dict(seqlen=s, headdim=d, causal=causal, which=w, **t)
                    rows.append(row)
                    cell = f"{s}/d{d}/{'causal' if causal else 'full'}"
                    print(f"{cell:24s} {w[:8]:8s} " + " ".join(f"{t[n]:8.3f}" for n, *_ in impls)
                          + f"   {t['fc_p0'] / t['fc']:.2f}  {t['flash'] / t['fc']:.2f}"
                          f"     {t['cudnn'] / t['fc']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
