"""Varlen calls' speed (packed sequences of random lengths) on each kernel route, beside the
dense call at the mean length: TFLOP/s (flash-attn's count over the sequences), forward and
backward alone, through the CuPy API (GPU time, L2 flushed). No SDPA peer takes packed
sequences, so the dense flashcore call is the yardstick. Needs an H100/H200.

    python tests/diagnostics/bench_varlen.py [--seqlen 1024 4096] [--headdim 128 256]
                                             [--causal] [--variants default cpasync]
                                             [--pages 16 128]

Lengths: seqlen/2 to 3 seqlen/2, odd (partial tiles), ~16k tokens in all, hidden 2048, bf16.
Variants: ``default`` (the warp-specialised kernels' varlen instantiations where they apply),
``cpasync`` (``sm90_fwd_ws`` and ``sm90_bwd_ws`` off: the cp.async Hopper kernels, the
Ampere-class dK/dV kernel at head dim 256). ``--pages``: the forward also over a paged cache of
these page sizes (prefill reading the same keys from pages in a shuffled order of the pool,
``block_table``; on sm_90 the warp-specialised kernel's varlen instantiation, and the
Ampere-class kernel beside it as ``fa2-class``), with its largest difference from the packed
call.
"""
from __future__ import annotations

import argparse

from flashcore import config
from flashcore.bench import AttentionProblem, flops, gpu_time, random_arrays, shape_for

VARIANTS = {"default": {},
            "cpasync": {"sm90_fwd_ws": False, "sm90_bwd_ws": False}}


def varlen_row(s, d, causal, variants, seed=0, pages=()):
    """TFLOP/s of the varlen forward and backward over random lengths around ``s``."""
    import numpy as np
    import cupy
    import flashcore
    _, _, h, _ = shape_for(s, d)
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < 16384 - s // 2:
        lens.append(int(rng.integers(s // 2, 3 * s // 2)) | 1)     # odd lengths: partial tiles
    total = sum(lens)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v, do = random_arrays("cupy", [(total, h, d)] * 4, seed)
    f = {w: sum(flops(1, n, h, d, causal, w) for n in lens) for w in ("forward", "backward")}
    row = {}
    for name, settings in variants.items():
        with config.override(**settings):
            out, lse = flashcore.varlen_attention_forward(q, k, v, cu, cu, max(lens), max(lens),
                                                          causal=causal)

            def fwd():
                return flashcore.varlen_attention_forward(q, k, v, cu, cu, max(lens), max(lens),
                                                          causal=causal)

            def bwd():
                return flashcore.varlen_attention_backward(do, q, k, v, out, lse, cu, cu,
                                                           max(lens), max(lens), causal=causal)
            bwd()
            row[f"{name} fwd"] = f["forward"] / gpu_time(fwd, "cupy") / 1e12
            row[f"{name} bwd"] = f["backward"] / gpu_time(bwd, "cupy") / 1e12
    for page in pages:          # the same keys, paged
        per = max(-(-n // page) for n in lens)
        pool = len(lens) * per
        perm = rng.permutation(pool).astype(np.int32)
        table = perm.reshape(len(lens), per)
        kc, vc = (cupy.zeros((pool, page, x.shape[1], d), x.dtype) for x in (k, v))
        for i, n in enumerate(lens):
            t = np.arange(n)
            blk, r = cupy.asarray(table[i, t // page]), cupy.asarray(t % page)
            a = int(cu[i])
            kc[blk, r], vc[blk, r] = k[a:a + n], v[a:a + n]
        bt = cupy.asarray(table)

        def paged_fwd():
            return flashcore.varlen_attention_forward(q, kc, vc, cu, cu, max(lens), max(lens),
                                                      causal=causal, block_table=bt)
        ref = flashcore.varlen_attention_forward(q, k, v, cu, cu, max(lens), max(lens),
                                                 causal=causal)[0]
        diff = float(cupy.abs(paged_fwd()[0].astype(cupy.float32) - ref.astype(cupy.float32)).max())
        row[f"paged{page} fwd"] = f["forward"] / gpu_time(paged_fwd, "cupy") / 1e12
        row[f"paged{page} maxdiff"] = diff
        with config.override(sm90_fwd_ws=False):     # (the Ampere-class kernel's, as before)
            row[f"paged{page} fa2-class"] = f["forward"] / gpu_time(paged_fwd, "cupy") / 1e12
    return len(lens), row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--pages", type=int, nargs="*", default=[])
    a = ap.parse_args()
    variants = {k: VARIANTS[k] for k in a.variants}
    print(f"# varlen forward / backward alone, TFLOP/s, bf16, ~16k tokens, causal={a.causal}")
    for d in a.headdim:
        for s in a.seqlen:
            n, row = varlen_row(s, d, a.causal, variants, pages=a.pages)
            b, _, h, _ = shape_for(s, d)
            for w in ("forward", "backward"):
                row[f"dense {w[:3]}"] = AttentionProblem("cupy", b, s, h, d, a.causal).tflops(
                    w, flops(b, s, h, d, a.causal, w))
            print(f"d{d} s~{s} ({n} seqs) " + "  ".join(
                f"{k}: {v:.2g}" if "maxdiff" in k else f"{k}: {v:.0f}" for k, v in row.items()),
                flush=True)


if __name__ == "__main__":
    main()
