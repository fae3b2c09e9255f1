"""What bounds the Hopper dK/dV kernels: the backward alone (TFLOP/s, GPU time, L2 flushed) of
the d128 and d256 kernels as they are, and with two timing-only defines that give wrong
results (cuda/flash_bwd_sm90.cu): FC_DIAG_BWD_NO_DQ (dQ computed, never added to dq_accum:
no bulk reduce-add) and FC_DIAG_BWD_NO_QLOAD (Q and dO loaded for the first
two steps only: no L2 -> shared traffic after them), and both. Against SDPA cuDNN's and
flash's backward in the same run. Needs an H100/H200. (The element-wise dQ reduction that the
tile-ordered one replaced: run 36 in docs/performance-log.md.)

``--varlen``: the same over packed sequences of random lengths (seqlen/2 to 3·seqlen/2, 16k
tokens in all), through ``varlen_attention_backward``; there is no varlen peer in SDPA, so the
dense flashcore backward at the mean length stands beside it. The variant "varlen ws" runs
varlen calls on the warp-specialised kernels (``sm90_bwd_ws_varlen``).

    python tests/diagnostics/probe_bwd_bound.py [--seqlen 4096 16384] [--headdim 128 256]
                                                [--variants "as is" "no dQ adds" ...] [--varlen]
"""
from __future__ import annotations

import argparse

from flashcore import config
from flashcore.bench import AttentionProblem as Problem, flops, shape_for

VARIANTS = {"as is": {},
            "no dQ adds": {"sm90_defines": ("-DFC_DIAG_BWD_NO_DQ",)},
            "no Q/dO reloads": {"sm90_defines": ("-DFC_DIAG_BWD_NO_QLOAD",)},
            "neither": {"sm90_defines": ("-DFC_DIAG_BWD_NO_DQ", "-DFC_DIAG_BWD_NO_QLOAD")},
            # varlen calls on the warp-specialised kernels (--varlen; written in session 20)
            "varlen ws": {"sm90_bwd_ws_varlen": True}}


def varlen_row(s, d, causal, variants, seed=0):
    """TFLOP/s of the varlen backward (CuPy) over random lengths around ``s``."""
    import numpy as np
    import cupy
    import flashcore
    from flashcore.bench import gpu_time, random_arrays
    _, _, h, _ = shape_for(s, d)
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < 16384 - s // 2:
        lens.append(int(rng.integers(s // 2, 3 * s // 2)) | 1)     # odd lengths: partial tiles
    total = sum(lens)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v, do = random_arrays("cupy", [(total, h, d)] * 4, seed)
    f = sum(flops(1, n, h, d, causal, "backward") for n in lens)
    row = {}
    for name, settings in variants.items():
        with config.override(**settings):
            out, lse = flashcore.varlen_attention_forward(q, k, v, cu, cu, max(lens), max(lens),
                                                          causal=causal)

            def bwd():
                return flashcore.varlen_attention_backward(do, q, k, v, out, lse, cu, cu,
                                                           max(lens), max(lens), causal=causal)
            bwd()
            row[name] = f / gpu_time(bwd, "cupy") / 1e12
    return len(lens), row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--varlen", action="store_true")
    a = ap.parse_args()
    variants = {k: VARIANTS[k] for k in a.variants}
    if a.varlen:
        print(f"# varlen backward alone, TFLOP/s, bf16, ~16k tokens, causal={a.causal}")
        for d in a.headdim:
            for s in a.seqlen:
                n, row = varlen_row(s, d, a.causal, variants)
                b, _, h, _ = shape_for(s, d)
                row["dense fc"] = Problem("cupy", b, s, h, d, a.causal).tflops(
                    "backward", flops(b, s, h, d, a.causal, "backward"))
                print(f"d{d} s~{s} ({n} seqs) " + "  ".join(f"{k}: {v:.0f}" for k, v in row.items()),
                      flush=True)
        return
    print("# backward alone, TFLOP/s (flash-attn count), bf16, 16k tokens, hidden 2048")
    for d in a.headdim:
        for s in a.seqlen:
            b, _, h, _ = shape_for(s, d)
            f = flops(b, s, h, d, a.causal, "backward")
            row = {}
            for peer in ("sdpa_cudnn", "sdpa_flash"):
                row[peer] = Problem(peer, b, s, h, d, a.causal).tflops("backward", f)
            for name, settings in variants.items():
                with config.override(**settings):
                    row[name] = Problem("cupy", b, s, h, d, a.causal).tflops("backward", f)
            print(f"d{d} s{s} " + "  ".join(f"{k}: {v:.0f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
