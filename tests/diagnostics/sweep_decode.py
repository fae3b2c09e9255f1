"""Decode policy sweep (H200, a tuning aid): tile configuration (block_n, warps, stages) x split
count x split merge (inside a thread-block cluster, or through global memory) at batch 1 and 8,
caches 4k / 16k / 128k (32 q heads over 8 kv heads, d128, bf16, contiguous cache, or paged with
``--page-size``), GPU time as in bench_decode.py, with cuDNN's time on the same shape (a
contiguous cache: SDPA takes no paged one). Every variant's output is checked against the first
variant's (the same math, so within bf16 rounding of it).

    python tests/diagnostics/sweep_decode.py [--top K] [--batches 1,8,64] [--more-configs]
                                             [--splits 8,16,33] [--caches 4096,131072]
                                             [--page-size 256] [--configs 128,8,3/256,8,3]
    python tests/diagnostics/sweep_decode.py --ab "-DFC_DIAG_X" [--batches ..] [--caches ..]
                                             [--page-size 256]

``--configs``: these tile configurations (block_n,n_warps,stages, slash-separated) instead of
the default list. ``--ab DEFINES``: instead of the sweep, flashcore's default call (its own split count and tile)
built as it is and with DEFINES (``flashcore.config``'s ``sm90_defines``), timed in turn over
five rounds in one process, the median of each and cuDNN's, and whether the outputs are equal
bit for bit.
"""
from __future__ import annotations

import sys

from flashcore.bench import gpu_time_l2_flushed as _time    # GPU time of fn(), s, L2 flushed

CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3)]
SPLITS = {1: (4, 8, 12, 16, 24, 32), 8: (2, 4, 8, 16), 64: (1, 2)}


def _problem(b, sk, page_size):
    """(cuDNN's GPU time on the contiguous cache of this shape, the DecodeProblem to time: that
    cache, or a paged one of ``page_size`` made after the contiguous one is freed)."""
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.bench import DecodeProblem
    pb = DecodeProblem(b, sk, 32, 8, 128)
    t_cudnn = _time(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
    if page_size:
        pb = None
        torch.cuda.empty_cache()
        pb = DecodeProblem(b, sk, 32, 8, 128, page_size=page_size)
    return t_cudnn, pb


def main(top=6, batches=(1, 8), configs=None, splits=None, caches=(4096, 16384, 131072),
         page_size=None):
    configs = configs or CONFIGS
    import torch
    from flashcore.kernels import decode as dm

    print("batch cache | cuDNN TB/s | default TB/s (splits) | best variants: "
          "config/splits/merge TB/s")
    for b in batches:
        for sk in caches:
            t_cudnn, pb = _problem(b, sk, page_size)
            nbytes, out, stream = pb.nbytes, pb.out, pb.stream
            call = pb.run
            res, ref, worst = [], None, 0.0
            with stream:
                used = call()
                t_def = _time(call)
                for cfg in configs:
                    dm.set_config_override(128, cfg)
                    for ns in splits or SPLITS[b]:
                        for cluster in ((True, False) if 1 < ns <= dm.MAX_CLUSTER else (False,)):
                            dm.set_cluster_merge(cluster)
                            try:
                                call(ns)
                                o = out.float().clone()
                                if ref is None:
                                    ref = o
                                worst = max(worst, float((o - ref).abs().max()))
                                t = _time(lambda ns=ns: call(ns))
                                res.append((nbytes / t / 1e12, cfg, ns, cluster))
                            except Exception as e:   # a variant that does not fit
                                print(f"  {cfg} {ns} {cluster}: {type(e).__name__}: {str(e)[:60]}")
                dm.set_config_override(128, None)
                dm.set_cluster_merge(True)
            res.sort(reverse=True)
            cells = " ".join(f"{c[0]},{c[1]},{c[2]}/{ns}/{'cl' if cl else 'gl'} {tb:.2f}"
                             for tb, c, ns, cl in res[:top])
            print(f"{b:5d} {sk // 1024:4d}k | {nbytes / t_cudnn / 1e12:.2f} | "
                  f"{nbytes / t_def / 1e12:.2f} ({used}) | {cells} | max diff {worst:.1e}")
            for tb, c, ns, cl in res:
                print(f"      {b} {sk // 1024}k {c} {ns:>3} {'cluster' if cl else 'global '} "
                      f"{tb:.3f}", file=sys.stderr)
            pb = out = None
            torch.cuda.empty_cache()


def ab(defines, batches, caches, page_size, rounds=5):
    import statistics
    import torch
    from flashcore import config
    print(f"batch cache | cuDNN TB/s | default TB/s | with {' '.join(defines)} TB/s | ratio | "
          "bits equal")
    for b in batches:
        for sk in caches:
            t_cudnn, pb = _problem(b, sk, page_size)
            times = {(): [], tuple(defines): []}
            outs = {}
            with pb.stream:
                for _ in range(rounds):
                    for d in times:
                        config.set(sm90_defines=d)
                        pb.out.fill_(float("nan"))
                        pb.run()
                        outs[d] = pb.out.clone()
                        times[d].append(_time(pb.run))
            config.set(sm90_defines=())
            t0, t1 = (statistics.median(v) for v in times.values())
            same = torch.equal(*outs.values())
            print(f"{b:5d} {sk // 1024:4d}k | {pb.nbytes / t_cudnn / 1e12:.3f} | "
                  f"{pb.nbytes / t0 / 1e12:.3f} | {pb.nbytes / t1 / 1e12:.3f} | {t0 / t1:.3f} | "
                  f"{same}", flush=True)
            pb = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    a = sys.argv

    def ints(flag, default):
        return tuple(int(x) for x in a[a.index(flag) + 1].split(",")) if flag in a else default
    page = int(a[a.index("--page-size") + 1]) if "--page-size" in a else None
    if "--ab" in a:
        ab(a[a.index("--ab") + 1].split(), ints("--batches", (1, 8)),
           ints("--caches", (16384, 131072)), page)
    else:
        cfgs = None
        if "--configs" in a:
            cfgs = [tuple(int(x) for x in c.split(","))
                    for c in a[a.index("--configs") + 1].split("/")]
        elif "--more-configs" in a:
            cfgs = CONFIGS + [(64, 4, 2), (32, 2, 4)]
        main(int(a[a.index("--top") + 1]) if "--top" in a else 6, ints("--batches", (1, 8)),
             cfgs,
             ints("--splits", None), ints("--caches", (4096, 16384, 131072)), page)
