"""The backward at an ANCHORS size: a target for Nsight Compute, or its kernels one by one.

    ncu --clock-control none -k regex:dkdv --launch-skip 2 --launch-count 1 \
        python3 tests/diagnostics/profile_bwd.py 128 4096 [causal]
    python3 tests/diagnostics/profile_bwd.py --kernels [--headdim 64 128 256]
        [--seqlen 1024 4096] [--causal]

``--kernels``: torch.profiler's durations of every kernel one backward launches, flashcore's
(``flashcore.attention`` through autograd) beside SDPA cuDNN's and flash's (the same inputs,
their layout): how much of a backward is its preprocess (D = rowsum(dO * O), the dQ
accumulator's zeroing) and its dQ conversion against the dK/dV kernel itself. A profile, not a
timing (one call each after warm-up; the L2 is not flushed).
"""
import argparse
import sys

from flashcore.bench import AttentionProblem, flops, kernel_events, shape_for


def _ncu_target(d, s, causal):
    import cupy

    import flashcore
    from flashcore.bench import random_arrays
    b, _, h, _ = shape_for(s, d)
    q, k, v, do = random_arrays("cupy", [(b, s, h, d)] * 4, seed=0, dtype="float16")
    for _ in range(3):
        o, l = flashcore.attention_forward(q, k, v, causal=causal)
        flashcore.attention_backward(do, q, k, v, o, l, causal=causal)
    cupy.cuda.Device().synchronize()
    print("done")


def kernels(headdims, seqlens, causal):
    print("# backward kernels, one call each (torch.profiler, us); bf16, 16k tokens, hidden 2048")
    summary = []
    for d in headdims:
        for s in seqlens:
            b, _, h, _ = shape_for(s, d)
            f = flops(b, s, h, d, causal, "backward")
            row = [f"d{d} s{s}{' causal' if causal else ''}"]
            for impl in ("torch", "sdpa_cudnn", "sdpa_flash"):
                try:
                    pb = AttentionProblem(impl, b, s, h, d, causal)
                except NotImplementedError as e:
                    print(f"  {impl}: {e}")
                    continue
                ks = [(e["name"], float(e["dur"])) for e in kernel_events(pb.backward)]
                total = sum(t for _, t in ks)
                main = max(t for _, t in ks)
                name = "flashcore" if impl == "torch" else impl
                print(f"{row[0]} {name}: {len(ks)} kernels, {total:.1f} us "
                      f"({f / total / 1e6:.0f} TFLOP/s), largest {main:.1f} us, "
                      f"others {total - main:.1f} us ({100 * (total - main) / total:.1f}%)")
                for n, t in ks:
                    print(f"    {t:9.1f} us  {n[:120]}")
                row.append(f"{name} {total:.0f} us (others {total - main:.0f})")
            summary.append(" | ".join(row))
    print("# summary")
    for line in summary:
        print(line)


def main(argv):
    if argv and argv[0] == "--kernels":
        ap = argparse.ArgumentParser()
        ap.add_argument("--kernels", action="store_true")
        ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
        ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
        ap.add_argument("--causal", action="store_true")
        a = ap.parse_args(argv)
        kernels(a.headdim, a.seqlen, a.causal)
        return
    d = int(argv[0]) if len(argv) > 0 else 128
    s = int(argv[1]) if len(argv) > 1 else 4096
    _ncu_target(d, s, len(argv) > 2 and argv[2] == "causal")


if __name__ == "__main__":
    main(sys.argv[1:])
