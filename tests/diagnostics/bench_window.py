"""Sliding-window scaling (H200): time of a windowed causal attention against full attention at
the same length, forward and forward+backward, through the CuPy API.

batch 1, 16 heads of 128, fp16, seqlen 16k and 64k; window_size = (w - 1, 0) for w = 1k, 4k.
Blocks wholly outside the window are skipped, so the time should follow the visible area
(about s*w keys) rather than s^2. Printed: milliseconds, the speed-up over full causal and
over full (non-causal) attention, and the ideal speed-up by visible area.

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
    import flashcore
    from flashcore.bench import _timer
    timer, how = _timer()
    h, d = 16, 128
    print(f"# sliding window, b=1 h={h} d={d} fp16, {how}")
    print(f"{'seqlen':>6} {'window':>7} {'pass':>7} | {'ms':>8} {'x causal':>9} {'ideal':>6} "
          f"{'x full':>7} {'ideal':>6}")
    cp.random.seed(0)
    for s in (16384, 65536):
        q, k, v, do = (cp.random.standard_normal((1, s, h, d), dtype=cp.float32)
                       .astype(cp.float16) for _ in range(4))
        res = {}
        for name, kw in (("full", dict(causal=False)), ("causal", dict(causal=True)),
                         ("1k", dict(causal=True, window_size=(1023, 0))),
                         ("4k", dict(causal=True, window_size=(4095, 0)))):
            out, lse = flashcore.attention_forward(q, k, v, **kw)

            def fwd():
                flashcore.attention_forward(q, k, v, **kw)

            def fb():
                o, l_ = flashcore.attention_forward(q, k, v, **kw)
                flashcore.attention_backward(do, q, k, v, o, l_, **kw)
            res[name] = (timer(fwd), timer(fb))
        for name in ("full", "causal", "1k", "4k"):
            w = {"1k": 1024, "4k": 4096}.get(name)
            a = area(s, name != "full", w)
            for i, p in enumerate(("fwd", "fwd+bwd")):
                t = res[name][i]
                print(f"{s:>6} {name:>7} {p:>7} | {t * 1e3:>8.2f} {res['causal'][i] / t:>9.2f} "
                      f"{area(s, True) / a:>6.2f} {res['full'][i] / t:>7.2f} {area(s, False) / a:>6.2f}")
        q = k = v = do = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
