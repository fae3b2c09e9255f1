"""Where a batch-1 decode call's time goes (H200, a diagnostic for the decode-speed target).

Three parts, 32 query heads over 8 kv heads, headdim 128, bf16, one query token:

  peers    torch.profiler of torch SDPA (cuDNN and flash backends) and of flashcore's decode on
           the target shapes: kernel names, grid, block, registers, shared memory, durations
  scaling  GPU time (flashcore.bench.gpu_time_l2_flushed: events per call) of flashcore's decode at
           batch 1 over cache lengths x split counts x tile configurations, with cuDNN and a
           plain read of the same bytes at each length: the fixed cost (time at one key block
           per CTA) against the cost per block
  combine  the split merge's cost: fused, two kernels, the decode kernel alone
  --ncu    one call each of flashcore's decode and cuDNN's at batch 1, cache 4k (for
           ``ncu --clock-control none ... python tests/diagnostics/decode_anatomy.py --ncu``)

    python tests/diagnostics/decode_anatomy.py [peers] [scaling] [--ncu]
"""
from __future__ import annotations

import sys

from bench_decode import _read_kernel_time

from flashcore.bench import gpu_time_l2_flushed as _time    # GPU time of fn(), s, L2 flushed

H, HK, D = 32, 8, 128


def _problem(b, sk):
    """(flashcore's call with a split count, SDPA pinned to a backend, the problem)."""
    from flashcore.bench import DecodeProblem
    pb = DecodeProblem(b, sk, H, HK, D)
    return pb.run, pb.sdpa, pb


def peers():
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.bench import kernel_events
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    print("# peers: kernels launched per call (torch.profiler)")
    for b, sk in ((1, 4096), (1, 16384), (1, 131072), (8, 4096)):
        ours, sdpa, _ = _problem(b, sk)
        fns = {"flashcore": ours, "cuDNN": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
               "sdpa-flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)}
        for name, fn in fns.items():
            with stream:
                ev = kernel_events(fn)
            for e in ev:
                a = e.get("args", {})
                print(f"b{b} {sk // 1024}k {name:10s} {e['dur']:7.2f} us grid {a.get('grid')} "
                      f"block {a.get('block')} regs {a.get('registers per thread')} "
                      f"smem {a.get('shared memory')} | {e['name'][:110]}")


def scaling():
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.kernels import decode as dm
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    configs = [None, (64, 4, 4), (64, 4, 5), (128, 4, 3)]
    splits = (1, 2, 4, 8, 12, 16, 24, 32)
    print("# scaling, batch 1: GPU time in us (L2 flushed); columns = split counts")
    print(f"{'cache':>6} {'config':>12} | " + " ".join(f"{s:>6}" for s in splits)
          + " | cuDNN   read")
    for sk in (1024, 4096, 16384, 65536):
        ours, sdpa, pb = _problem(1, sk)
        t_cud = _time(lambda: sdpa(SDPBackend.CUDNN_ATTENTION)) * 1e6
        buf = torch.cat([pb.k_cache.reshape(-1), pb.v_cache.reshape(-1)])
        with stream:
            t_read = _read_kernel_time(buf) * 1e6
        for cfg in configs:
            dm.set_config_override(128, cfg)
            cells = []
            with stream:
                for ns in splits:
                    try:
                        ours(ns)
                        cells.append(f"{_time(lambda ns=ns: ours(ns)) * 1e6:6.2f}")
                    except Exception as e:    # a configuration that does not fit
                        cells.append(f"{type(e).__name__[:6]:>6}")
            dm.set_config_override(128, None)
            name = "default" if cfg is None else ",".join(map(str, cfg))
            print(f"{sk:>6} {name:>12} | " + " ".join(cells) + f" | {t_cud:6.2f} {t_read:6.2f}")
        del buf
        torch.cuda.empty_cache()


def combine_cost():
    """Batch 1, caches 4k and 16k, 4 to 16 splits: the default call (the cluster merge on
    sm_90), the fused global-memory merge, the two-kernel call, and the decode kernel alone
    (partials written, never merged): what the merge costs each way."""
    import cupy as cp
    import torch
    from flashcore.kernels import decode as dm, plans
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    print("# split merge cost, batch 1 (us): cluster (default) | fused global | two-kernel | "
          "decode kernel alone")
    for sk in (4096, 16384):
        ours, _, _ = _problem(1, sk)
        with stream:
            for ns in (4, 8, 12, 16):
                t_c = _time(lambda: ours(ns)) * 1e6
                dm.set_cluster_merge(False)
                try:
                    t_f = _time(lambda: ours(ns)) * 1e6
                    dm.set_fused_combine(False)
                    plans.clear()
                    ours(ns)
                    t_two = _time(lambda: ours(ns)) * 1e6
                    plan = [p for p in plans.PLANS.values()
                            if isinstance(p, plans.Plan) and p.result == ns][0]
                    alone = plans.Plan(plan.device_id, plan.launches[:1], plan.template,
                                       plan.scratch, plan.result)
                    t_a = _time(lambda: alone.run({})) * 1e6
                finally:
                    dm.set_fused_combine(True)
                    dm.set_cluster_merge(True)
                    plans.clear()
                print(f"{sk // 1024:>4}k {ns:>3} splits | {t_c:6.2f} | {t_f:6.2f} | {t_two:6.2f} "
                      f"| {t_a:6.2f}")


def ncu_calls():
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend
    ours, sdpa, _ = _problem(1, 4096)
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    with stream:
        ours()
        sdpa(SDPBackend.CUDNN_ATTENTION)
        torch.cuda.synchronize()


if __name__ == "__main__":
    args = sys.argv[1:] or ["peers", "scaling", "combine"]
    if "--ncu" in args:
        ncu_calls()
    if "peers" in args:
        peers()
    if "scaling" in args:
        scaling()
    if "combine" in args:
        combine_cost()
