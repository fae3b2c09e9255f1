"""What attention dropout costs (issue: the flash-attn drop-in, "dropout throughput >= 0.9x the
no-dropout path"), through the public API on torch tensors, at the ANCHORS sizes.
With --defines, one column per variant (`v1`, `v2`, ...): flashcore with dropout p and that
variant's NVRTC options on its Hopper kernels (a variant is NAME[=V] or several joined by `+`,
each -DNAME[=V], config ``sm90_defines``; e.g. FC_DIAG_PHILOX_ROUNDS=0, timing only: what the
random stream itself costs), and its ratio p0/variant; first, whether each changes the outputs'
bits (dq is summed with atomics, so its bits may differ run to run anyway).

    python tests/diagnostics/bench_dropout.py [--seqlen 4096 16384] [--headdim 64 128]
                                              [--p 0.1] [--rounds 3] [--json F]
                                              [--defines VARIANT ...]

e.g. ``--defines FC_DIAG_SOFTMAX_FENCE_DROPOUT FC_DIAG_PHILOX_ROUNDS=0
FC_DIAG_SOFTMAX_FENCE_DROPOUT+FC_DIAG_PHILOX_ROUNDS=0`` (three columns).

For each cell (16k tokens per batch, hidden 2048, bf16, causal and not): GPU time of the
forward (no grad) and of forward+backward through autograd, for flashcore with dropout p,
flashcore without dropout, and SDPA's flash and cuDNN kernels with the same dropout (the random
state drawn per call, as a training step does). Prints ms and the ratios flashcore(p=0) /
flashcore(p) (what dropout costs: >= 0.9 is the bound) and peer / flashcore (> 1: faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from flashcore import config
from flashcore.bench import AttentionProblem, shape_for


def same_outputs(headdims, p, defines):
    """With --defines: the forward and backward with and without them on one small problem per
    head dim (causal and not, odd lengths) and the same random state, compared bit for bit (a
    define that only moves work must give the same bits, dq's atomic sums aside; a timing-only
    one, as FC_DIAG_PHILOX_ROUNDS, must not)."""
    import torch
    import flashcore
    for d in headdims:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(d + causal)
            q, k, v, do = (torch.randn(2, 1000, 16, d, device="cuda", generator=g,
                                       dtype=torch.bfloat16) for _ in range(4))
            rs = torch.tensor([1234 + d, 77], device="cuda", dtype=torch.int64)
            res = []
            for defs in ((), defines):
                with config.override(sm90_defines=defs):
                    out, lse = flashcore.attention_forward(q, k, v, causal=causal, dropout_p=p,
                                                           rng_state=rs)
                    grads = flashcore.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                         dropout_p=p, rng_state=rs)
                    res.append((out, lse) + tuple(grads))
            same = [bool(torch.equal(x, y)) for x, y in zip(*res)]
            diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(*res))
            print(f"# same bits with {' '.join(defines)} at d{d} {'causal' if causal else 'full'}"
                  f" (out, lse, dq, dk, dv): {same}, largest difference {diff:.3g}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation of a cell this many times, in turn, the "
                         "order rotated by one each round, and report the median (3 or more "
                         "when variants differ by a few percent)")
    ap.add_argument("--json")
    ap.add_argument("--defines", nargs="+", default=[],
                    help="variants: NAME[=V], several joined by '+'; a column each")
    a = ap.parse_args(argv)
    rows = []
    impls = (("fc", "torch", a.p), ("fc_p0", "torch", 0.0), ("flash", "sdpa_flash", a.p),
             ("cudnn", "sdpa_cudnn", a.p))
    variants = {f"v{i + 1}": tuple(f"-D{x}" for x in v.split("+"))
                for i, v in enumerate(a.defines)}
    impls += tuple((n, "torch", a.p) for n in variants)
    for n, defs in variants.items():
        print(f"# {n}: {' '.join(defs)}")
    print(f"{'cell':24s} {'pass':8s} " + " ".join(f"{n:>8s}" for n, *_ in impls)
          + "   p0/p  flash/fc cudnn/fc" + "".join(f"  p0/{n}" for n in variants))
    for defs in variants.values():
        same_outputs(a.headdim, a.p, defs)
    for s in a.seqlen:
        for d in a.headdim:
            for causal in (False, True):
                shape = shape_for(s, d)
                probs, runs = {}, {}
                for name, impl, p in impls:
                    try:
                        with config.override(sm90_defines=variants.get(name, ())):
                            probs[name] = AttentionProblem(impl, *shape, causal, dropout_p=p)
                            runs[name] = []
                    except (NotImplementedError, RuntimeError) as e:
                        print(f"# {name} at {shape} causal={causal}: {str(e)[:120]}")
                names = list(probs)
                for r in range(max(1, a.rounds)):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        try:
                            with config.override(sm90_defines=variants.get(name, ())):
                                runs[name].append({w: probs[name].seconds(w) * 1e3
                                                   for w in ("forward", "forward_backward")})
                        except (NotImplementedError, RuntimeError) as e:
                            print(f"# {name} at {shape} causal={causal}: {str(e)[:120]}")
                probs.clear()
                ms = {n: ({w: statistics.median(x[w] for x in runs[n])
                           for w in ("forward", "forward_backward")} if runs.get(n) else None)
                      for n, *_ in impls}
                for w in ("forward", "forward_backward"):
                    t = {n: (ms[n][w] if ms[n] else float("nan")) for n, *_ in impls}
                    row = dict(seqlen=s, headdim=d, causal=causal, which=w, **t)
                    rows.append(row)
                    cell = f"{s}/d{d}/{'causal' if causal else 'full'}"
                    print(f"{cell:24s} {w[:8]:8s} " + " ".join(f"{t[n]:8.3f}" for n, *_ in impls)
                          + f"   {t['fc_p0'] / t['fc']:.2f}  {t['flash'] / t['fc']:.2f}"
                          f"     {t['cudnn'] / t['fc']:.2f}"
                          + "".join(f"   {t['fc_p0'] / t[n]:5.2f}" for n in variants),
                          flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
