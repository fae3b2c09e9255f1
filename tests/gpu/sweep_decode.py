"""Decode tile sweep (H200, a tuning aid): block_n / warps / stages x split count at batch 1 and
8 (32 q heads over 8 kv heads, d128, bf16, contiguous cache), GPU time as in bench_decode.py.
Each configuration's output is checked against the default configuration's first.

    python tests/gpu/sweep_decode.py
"""
from __future__ import annotations

import math

from bench_decode import _time


def main():
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashcore.kernels import decode as dm

    h, hk, d = 32, 8, 128
    configs = [None, (64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 4, 2)]
    dev = torch.device("cuda")
    print("batch cache | cuDNN | config(block_n,warps,stages): best splits TB/s [splits:TB/s ...]")
    for b, sk in ((1, 4096), (1, 16384), (1, 131072), (8, 4096), (8, 16384)):
        nbytes = 2 * b * sk * hk * d * 2
        q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, 1, device=dev, dtype=torch.float32)
        seqlens = torch.full((b,), sk, device=dev, dtype=torch.int32)
        cq, ck, cv, co, cl, cs = (cp.from_dlpack(x) for x in (q, kc, vc, out, lse, seqlens))
        scale = 1.0 / math.sqrt(d)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            t_cudnn = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
        ref = None
        cells = []
        with stream:
            for cfg in configs:
                dm.set_config_override(128, cfg)
                try:
                    res = []
                    for ns in (0, 4, 8, 12, 16, 24, 32):
                        if ns and ns * b * hk > 2048:
                            continue
                        used = dm.launch_decode(cq, ck, cv, co, cl, cache_seqlens=cs,
                                                softmax_scale=scale, window_left=-1,
                                                window_right=-1, num_splits=ns)
                        o = out.float().clone()
                        if ref is None:
                            ref = o
                        err = float((o - ref).abs().max())
                        t = _time(lambda ns=ns: dm.launch_decode(
                            cq, ck, cv, co, cl, cache_seqlens=cs, softmax_scale=scale,
                            window_left=-1, window_right=-1, num_splits=ns))
                        res.append((nbytes / t / 1e12, used, ns == 0, err))
                    best = max(res)
                    name = "default" if cfg is None else str(cfg)
                    maxerr = max(r[3] for r in res)
                    cells.append(f"{name}: best {best[1]} {best[0]:.2f} (heur {[r for r in res if r[2]][0][1]}: "
                                 f"{[r for r in res if r[2]][0][0]:.2f}) err {maxerr:.1e} ["
                                 + " ".join(f"{r[1]}:{r[0]:.2f}" for r in res if not r[2]) + "]")
                except Exception as e:  # a configuration that does not fit
                    cells.append(f"{cfg}: {type(e).__name__}: {str(e)[:80]}")
        dm.set_config_override(128, None)
        print(f"{b:5d} {sk // 1024:4d}k | {nbytes / t_cudnn / 1e12:.2f} |")
        for c in cells:
            print("      " + c)


if __name__ == "__main__":
    main()
