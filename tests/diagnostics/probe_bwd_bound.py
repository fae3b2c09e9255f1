"""What bounds the Hopper dK/dV kernels: the backward alone (TFLOP/s, GPU time, L2 flushed) of
the d128 and d256 kernels as they are, and with timing-only defines that give wrong results
(cuda/flash_bwd_sm90.cu): FC_DIAG_BWD_NO_DQ (dQ computed, never added to dq_accum: no bulk
reduce-add), FC_DIAG_BWD_HALF_DQ (half of each dQ tile added), FC_DIAG_BWD_NO_QLOAD (Q and dO
loaded for the first two steps only: no L2 -> shared traffic after them), and the first and
last together; and the other VARIANTS below.
Against SDPA cuDNN's and flash's backward in the same run. Needs an H100/H200. (The
element-wise dQ reduction that the tile-ordered one replaced: run 36 in
docs/performance-log.md; varlen calls: tests/diagnostics/bench_varlen.py.)

    python tests/diagnostics/probe_bwd_bound.py [--seqlen 4096 16384] [--headdim 128 256]
                                                [--variants "as is" "no dQ adds" ...]
"""
from __future__ import annotations

import argparse

from flashcore import config
from flashcore.bench import AttentionProblem as Problem, flops, shape_for

VARIANTS = {"as is": {},
            "no dQ adds": {"sm90_defines": ("-DFC_DIAG_BWD_NO_DQ",)},
            # (half of each dQ tile added: what halving the reduce-add traffic would give;
            # CTA pairs summing their tiles in distributed shared memory first measured below
            # the kernel as is, run 205 in docs/performance-log.md)
            "half dQ adds": {"sm90_defines": ("-DFC_DIAG_BWD_HALF_DQ",)},
            "no Q/dO reloads": {"sm90_defines": ("-DFC_DIAG_BWD_NO_QLOAD",)},
            "neither": {"sm90_defines": ("-DFC_DIAG_BWD_NO_DQ", "-DFC_DIAG_BWD_NO_QLOAD")},
            # (each step's S^T, dP^T issued after the step before's dQ tile is handed to its
            # bulk copy, not before; head dim 256: that tile handed over at its step's end and
            # the stage released at the top of the step after, the order before 2026-12-04)
            "no overlap": {"sm90_defines": ("-DFC_DIAG_BWD_NO_OVERLAP",)},
            # (dK and dV written from the registers, 4 bytes a thread, not staged in shared
            # memory and written 16 bytes a thread)
            "register stores": {"sm90_defines": ("-DFC_DIAG_BWD_REG_STORE",)},
            # (head dims 64 and 128: the cp.async kernel in place of the warp-specialised one)
            "cp.async": {"sm90_bwd_ws": False},
            # (the Ampere-class kernels, flash_bwd.cu, as on an A100 or at other head dims)
            "Ampere-class": {"sm90_bwd": False}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    a = ap.parse_args()
    variants = {k: VARIANTS[k] for k in a.variants}
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
