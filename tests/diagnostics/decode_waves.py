"""Decode at the memory ceiling (a diagnostic for the two cells of the decode target where
flashcore and cuDNN are level): TB/s of K+V bytes against batch at a 4k cache, across wave
counts (8 kv heads per sequence, one CTA per SM for the unsplit tile: batch 16.5 is one wave of
132 SMs), flashcore unsplit and with 2 splits, cuDNN alongside; and batch 1 / 128k over split
counts and merges. GPU time with the L2 flushed (flashcore.bench.gpu_time_l2_flushed), as in
bench_decode.py.

    python tests/diagnostics/decode_waves.py            # the tables
    python tests/diagnostics/decode_waves.py --configs  # unsplit tiles x batch (waves), 4k and 16k
    python tests/diagnostics/decode_waves.py --ncu B S  # one flashcore step and one cuDNN step of
                                                # batch B, cache S, between cudaProfilerStart/Stop
                                                # (run under ncu --profile-from-start off)
"""
from __future__ import annotations

import sys

from flashcore.bench import gpu_time_l2_flushed as _time    # GPU time of fn(), s, L2 flushed


def tables():
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.bench import DecodeProblem
    from flashcore.kernels import decode as dm

    print("batch cache waves | flashcore(splits) TB/s | 2 splits | cuDNN | ratio")
    for b in (16, 17, 32, 33, 48, 50, 64, 66, 96, 99, 128):
        pb = DecodeProblem(b, 4096)
        with pb.stream:
            ns = pb.run()
            t = _time(pb.run)
            t2 = _time(lambda: pb.run(2))
        tc = _time(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
        n = pb.nbytes
        print(f"{b:5d} {4:4d}k {b * 8 / 132:5.2f} | {n / t / 1e12:.3f} ({ns}) | {n / t2 / 1e12:.3f} | "
              f"{n / tc / 1e12:.3f} | {tc / t:.3f}")
        del pb
    print("batch 1, 128k: splits / merge | TB/s   (cuDNN below)")
    pb = DecodeProblem(1, 131072)
    with pb.stream:
        for ns in (8, 12, 16, 24, 32, 33, 48, 64, 66):
            for cl in ((True, False) if ns <= dm.MAX_CLUSTER else (False,)):
                dm.set_cluster_merge(cl)
                try:
                    pb.run(ns)
                    t = _time(lambda: pb.run(ns))
                    print(f"  {ns:3d} {'cluster' if cl else 'global'} | {pb.nbytes / t / 1e12:.3f}")
                except Exception as e:
                    print(f"  {ns:3d} {cl}: {type(e).__name__}: {str(e)[:70]}")
        dm.set_cluster_merge(True)
        t = _time(pb.run)
    tc = _time(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
    print(f"  default {pb.nbytes / t / 1e12:.3f}   cuDNN {pb.nbytes / tc / 1e12:.3f}")


CONFIGS = [(64, 4, 4), (64, 4, 3), (64, 4, 2), (128, 4, 2), (32, 2, 4), (32, 2, 3)]


def configs():
    """Each unsplit tile (and 2 splits with the default rule's tiles) against batch, where the
    waves of one-CTA-per-SM tiles fall between integers; cuDNN alongside."""
    from torch.nn.attention import SDPBackend
    from flashcore.bench import DecodeProblem
    from flashcore.kernels import decode as dm

    print("cache batch waves(1/SM) | cuDNN | " + " | ".join(f"{c[0]}x{c[1]}x{c[2]}" for c in CONFIGS)
          + " | 2 splits | default")
    for sk, batches in ((4096, (8, 12, 16, 17, 20, 24, 32, 33, 40, 48, 50, 56, 64, 66, 80, 96,
                                 99, 128, 160, 192, 256)),
                        (16384, (16, 17, 24, 33, 40, 50, 56, 64, 66, 96)),
                        (131072, (17, 50, 64))):
        for b in batches:
            pb = DecodeProblem(b, sk)
            tc = _time(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
            row = []
            ref = None
            with pb.stream:
                for cfg in CONFIGS:
                    dm.set_config_override(128, cfg)
                    try:
                        pb.run(1)
                        o = pb.out.float().clone()
                        ref = o if ref is None else ref
                        assert float((o - ref).abs().max()) < 0.05
                        row.append(pb.nbytes / _time(lambda: pb.run(1)) / 1e12)
                    except Exception as e:
                        print(f"  {cfg}: {type(e).__name__}: {str(e)[:70]}")
                        row.append(float("nan"))
                dm.set_config_override(128, None)
                row.append(pb.nbytes / _time(lambda: pb.run(2)) / 1e12)
                ns = pb.run()
                row.append(pb.nbytes / _time(pb.run) / 1e12)
            print(f"{sk // 1024:4d}k {b:5d} {b * 8 / 132:5.2f} | {pb.nbytes / tc / 1e12:.3f} | "
                  + " | ".join(f"{x:.3f}" for x in row) + f" ({ns})")
            del pb


def ncu_target(b, s):
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.bench import DecodeProblem
    pb = DecodeProblem(b, s)
    with pb.stream:
        for _ in range(3):
            pb.run()
            pb.sdpa(SDPBackend.CUDNN_ATTENTION)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        pb.run()
        pb.sdpa(SDPBackend.CUDNN_ATTENTION)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        i = sys.argv.index("--ncu")
        ncu_target(int(sys.argv[i + 1]), int(sys.argv[i + 2]))
    elif "--configs" in sys.argv:
        configs()
    else:
        tables()
