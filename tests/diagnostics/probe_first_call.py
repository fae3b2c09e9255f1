"""What the first calls of a fresh process cost (issue #14; needs a GPU).

    python tests/diagnostics/probe_first_call.py [--profile] [--same-thread]

The tiny training step (1 x 128 x 2 x 64 bf16, causal), as ``bench_callpath.py tiny`` runs it:
a forward without grad, then forward+backward steps. Prints the wall time of the import, of
each of the first 10 calls of each kind and of the rest of the first 1000 steps, so that
one-time costs (kernel loading from the disk cache, imports, device queries, the engine's
device thread) show apart from the steady state. ``--profile``: cProfile of the first forward
and of the first step, run with the autograd engine's device threads off
(``--same-thread`` without profiling does the same) so that the backward runs on the profiled
thread; the top entries by cumulative time; and of 300 calls after the first 1000.

The calls are timed by flashcore.bench (``wall_time``: one call ended by a synchronisation;
``host_loop_us``: the rest of the first 1000). The imports and the CUDA context stay timed here
with ``time.perf_counter``: flashcore.bench cannot be imported before ``import flashcore`` is
timed, and its timers synchronise the device before they start, which would make the context
before the clock runs.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

t_start = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
import flashcore  # noqa: E402

t_fc = time.perf_counter()

from flashcore.bench import host_loop_us, wall_time  # noqa: E402  (after the timed imports)


def _top(prof, n=30):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(n)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--same-thread", action="store_true")
    args = ap.parse_args()
    print(f"import torch {1e3 * (t_torch - t_start):.0f} ms, flashcore "
          f"{1e3 * (t_fc - t_torch):.0f} ms", flush=True)
    if args.profile or args.same_thread:
        torch.autograd.set_multithreading_enabled(False)
    shape = (1, 128, 2, 64)
    t0 = time.perf_counter()
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    print(f"tensors (CUDA context) {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)

    def fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def step():
        o = flashcore.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(o, (qg, kg, vg), do)

    for name, fn in (("fwd", fwd), ("step", step)):
        times = []
        for i in range(10):
            if args.profile and i == 0:
                prof = cProfile.Profile()
                # profiled from the call to the end of wall_time's synchronisation
                times.append(wall_time(lambda: (prof.enable(), fn())))
                prof.disable()
                print(f"--- cProfile of the first {name}\n{_top(prof)}", flush=True)
                continue
            times.append(wall_time(fn))
        rest = host_loop_us(fn, steps=990, warmup=0, rounds=1) * 990 * 1e-6
        import sys
        print(f"after the first {name}: CuPy imported: {'cupy' in sys.modules}", flush=True)
        print(f"{name}: first 10 calls (ms) " + " ".join(f"{1e3 * t:.2f}" for t in times)
              + f"; the next 990 {1e6 * rest / 990:.1f} us a call; first 1000 "
              f"{1e6 * (sum(times) + rest) / 1000:.1f} us a call", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            print(f"--- cProfile of 300 more {name} calls\n{_top(prof, 40)}", flush=True)


if __name__ == "__main__":
    main()
