"""Sliding-window scaling (H200): time of a windowed causal attention against full attention at
the same length, forward and forward+backward, through the CuPy API.

batch 1, 16 heads of 128, fp16, seqlen 16k and 64k; window_size = (w - 1, 0) for w = 1k, 4k.
Blocks wholly outside the window are skipped, so the time should follow the visible area
(about s*w keys) rather than s^2. Printed: milliseconds, the speed-up over full causal and
over full (non-causal) attention, and the ideal speed-up by visible area. The problem is
flashcore.bench.AttentionProblem ('cupy', with its ``window_size``), the GPU time its
``seconds`` (flashcore.bench.gpu_time: CUDA events per call, L2 flushed, median).

    python tests/diagnostics/bench_window.py
"""
from __future__ import annotations


def area(s, causal, w=None):
    """Visible (query, key) pairs."""
    if w is None:
        return s * (s + 1) / 2 if causal else s * s
    return sum(min(i + 1, w) for i in range(s))


def main():
    import cupy as cp
    from flashcore.bench import AttentionProblem
    b, h, d = 1, 16, 128
    print(f"# sliding window, b={b} h={h} d={d} fp16, GPU time: CUDA events median, L2 flushed")
    print(f"{'seqlen':>6} {'window':>7} {'pass':>7} | {'ms':>8} {'x causal':>9} {'ideal':>6} "
          f"{'x full':>7} {'ideal':>6}")
    for s in (16384, 65536):
        res = {}
        for name, causal, window in (("full", False, None), ("causal", True, None),
                                     ("1k", True, (1023, 0)), ("4k", True, (4095, 0))):
            # the same inputs (seed) for every variant
            pb = AttentionProblem("cupy", b, s, h, d, causal, seed=s, dtype="float16",
                                  window_size=window)
            res[name] = (pb.seconds("forward"), pb.seconds("forward_backward"))
            del pb
        for name in ("full", "causal", "1k", "4k"):
            w = {"1k": 1024, "4k": 4096}.get(name)
            a = area(s, name != "full", w)
            for i, p in enumerate(("fwd", "fwd+bwd")):
                t = res[name][i]
                print(f"{s:>6} {name:>7} {p:>7} | {t * 1e3:>8.2f} {res['causal'][i] / t:>9.2f} "
                      f"{area(s, True) / a:>6.2f} {res['full'][i] / t:>7.2f} {area(s, False) / a:>6.2f}")
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
