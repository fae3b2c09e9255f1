"""The ring's chunked schedule on one GPU (context parallelism, issue #18's single-GPU
measure): every rank's local work -- its query shard against each K/V shard the ring brings,
merged through the lse in float32 (flashcore.distributed.hop_forward, the code the ring runs)
-- executed back to back on one GPU, against one unchunked call over the whole sequence. The
ratio (unchunked time / chunked time) is what the ring's compute costs over a single call; the
communication (overlapped by the ring on a separate stream) is not in it. Forward only. Each
time: flashcore.bench.wall_time (one call ended by a synchronisation, best of 3 after a warm-up
call), as bench_ring_multi.py times its calls; inputs flashcore.bench.random_arrays, FLOPs
flashcore.bench.flops.

    python tests/diagnostics/bench_ring_chunked.py [--seqlens 131072,262144] [--worlds 4,8]
"""
from __future__ import annotations

import sys


def main(seqlens=(131072, 262144), worlds=(4, 8), heads=16, heads_k=4, headdim=128):
    import torch
    import flashcore
    from flashcore.bench import flops, random_arrays, wall_time
    from flashcore.distributed import _chunks, _hop_blocks, hop_forward, shard

    def timed(fn):
        return wall_time(fn, reps=3, warmup=1)

    print("seqlen world layout causal | unchunked ms  TF/s | chunked ms  TF/s | ratio | max|diff|")
    for n in seqlens:
        q, k, v = random_arrays("torch", [(1, n, heads, headdim), (1, n, heads_k, headdim),
                                          (1, n, heads_k, headdim)], seed=0)
        for causal in (True, False):
            f = flops(1, n, heads, headdim, causal)
            with torch.no_grad():
                ref = flashcore.attention_forward(q, k, v, causal=causal)[0]
                t_one = timed(lambda: flashcore.attention_forward(q, k, v, causal=causal))
                for world in worlds:
                    for layout in (("zigzag", "contiguous") if causal else ("contiguous",)):
                        qs_ = [shard(q, world, r, layout) for r in range(world)]
                        ks_ = [shard(k, world, r, layout) for r in range(world)]
                        vs_ = [shard(v, world, r, layout) for r in range(world)]
                        per = len(_chunks(layout, world, 0))
                        window = (-1, 0) if causal else (-1, -1)
                        outs = []

                        def schedule():
                            outs.clear()
                            for rank in range(world):
                                ql = qs_[rank]
                                m = ql.shape[1] // per
                                acc = (torch.zeros(ql.shape, device="cuda"),
                                       torch.full((1, heads, ql.shape[1]), float("-inf"),
                                                  device="cuda"))
                                for step in range(world):
                                    src = (rank - step) % world
                                    hop_forward(acc, ql, ks_[src], vs_[src],
                                                _hop_blocks(layout, world, rank, src, window, m),
                                                None)
                                outs.append(acc[0])
                        t_ch = timed(schedule)
                        got = flashcore.distributed.unshard(outs, layout)
                        diff = float((got - ref.float()).abs().max())
                        print(f"RING {n:7d} {world:5d} {layout:10s} {str(causal):5s} | "
                              f"{t_one * 1e3:8.1f} {f / t_one / 1e12:5.0f} | "
                              f"{t_ch * 1e3:8.1f} {f / t_ch / 1e12:5.0f} | "
                              f"{t_one / t_ch:5.3f} | {diff:.1e}")
                        del qs_, ks_, vs_, outs
        del q, k, v, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    a = sys.argv
    kw = {}
    if "--seqlens" in a:
        kw["seqlens"] = tuple(int(x) for x in a[a.index("--seqlens") + 1].split(","))
    if "--worlds" in a:
        kw["worlds"] = tuple(int(x) for x in a[a.index("--worlds") + 1].split(","))
    main(**kw)
