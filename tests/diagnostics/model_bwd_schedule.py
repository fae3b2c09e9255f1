"""A list-scheduling model of the Hopper dK/dV kernel's tiles over the SMs (no GPU): the time of
a backward at the ANCHORS sizes when each tile (key block, kv head, batch) costs a fixed part
plus a part a step of its walk over the query blocks, under three ways of handing tiles out:
one CTA a tile (the hardware hands the grid out in order, each CTA paying the fixed cost),
persistent CTAs taking tiles c, c + SMs, ... (static), and persistent CTAs taking the next tile
of the hand-out order when they are free (dynamic, the kernel's scheduler). The hand-out order
is the kernel's: key blocks x fastest, or with a causal mask chunk by chunk, the longest walks
first (fc_pipe::chunked_tile, transcribed).

    python tests/diagnostics/model_bwd_schedule.py [--fixed 9.3] [--persistent-fixed 4]
                                                    [--step 2.18] [--sms 132]

The defaults are head dim 128's fit to run 81's kernel times (docs/performance-log.md, session
28): 9.3 us a CTA + 2.18 us a 64-query step; the persistent kernel's fixed cost is a guess.
"""
from __future__ import annotations

import argparse
import heapq


def chunked_tile(linear, nx, ny, nz):
    """cuda/sm90_pipeline.cuh's chunked_tile: (x, y, z) of hand-out number `linear`."""
    c = max(4, nx // 8)
    g_count, full = ny * nz, nx // c
    per = c * g_count
    if linear // per < full:
        ch = linear // per
        w = linear - ch * per
        g = w // c
        x = ch * c + (w - g * c)
    else:
        r = nx - full * c
        w = linear - full * per
        g = w // r
        x = full * c + (w - g * r)
    return x, g % ny, g // ny


def walks(seqlen, headdim, causal, block_m, tokens=16384, hidden=2048, block_n=128):
    """Steps of each tile's walk, in the hand-out order."""
    b, h = tokens // seqlen, hidden // headdim
    nx = seqlen // block_n
    out = []
    for t in range(nx * h * b):
        x = chunked_tile(t, nx, h, b)[0] if causal else t % nx
        n0 = x * block_n
        out.append(-(-(seqlen - n0) // block_m) if causal else seqlen // block_m)
    return out


def makespan_dynamic(steps, fixed, step, sms):
    free = [0.0] * sms
    heapq.heapify(free)
    for n in steps:
        heapq.heappush(free, heapq.heappop(free) + fixed + step * n)
    return max(free)


def makespan_static(steps, fixed, step, sms):
    load = [0.0] * sms
    for i, n in enumerate(steps):
        load[i % sms] += fixed + step * n
    return max(load)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--fixed", type=float, default=9.3, help="us a CTA, one tile a CTA")
    ap.add_argument("--persistent-fixed", type=float, default=4.0, help="us a tile, persistent")
    ap.add_argument("--step", type=float, default=2.18, help="us a step of a walk")
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args()
    print(f"# d{a.headdim}, {a.block_m}-query steps, {a.sms} SMs: us (ideal: the work over the "
          f"SMs at the persistent fixed cost)")
    for causal in (False, True):
        for s in (1024, 2048, 4096, 16384):
            st = walks(s, a.headdim, causal, a.block_m)
            one = makespan_dynamic(st, a.fixed, a.step, a.sms)
            stat = makespan_static(st, a.persistent_fixed, a.step, a.sms)
            dyn = makespan_dynamic(st, a.persistent_fixed, a.step, a.sms)
            ideal = sum(a.persistent_fixed + a.step * n for n in st) / a.sms
            print(f"{'causal' if causal else 'full'} {s:>6}: one tile a CTA {one:8.1f} | "
                  f"persistent static {stat:8.1f} ({stat / ideal - 1:+.1%}) dynamic {dyn:8.1f} "
                  f"({dyn / ideal - 1:+.1%}) | ideal {ideal:8.1f}")


if __name__ == "__main__":
    main()
