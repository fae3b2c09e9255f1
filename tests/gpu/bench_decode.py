"""Decode benchmark (H200): TB/s of K+V cache bytes actually read / time, for batch 1/8/64 x
cache 4k/16k/128k, 32 query heads over 8 kv heads, headdim 128, bf16, one query token.

Peers measured in the same run: torch SDPA with the flash backend and with the cuDNN backend
(enable_gqa=True), and a plain read of the same number of bytes (torch sum over a buffer of
that size). flashcore is run contiguous and paged (page 256), with the split heuristic.

    python tests/gpu/bench_decode.py
"""
from __future__ import annotations

import math
import sys

import numpy as np


def _time(fn, iters=50, warmup=10):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return float(np.median(ts))


def main():
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashcore.kernels.decode import launch_decode

    h, hk, d = 32, 8, 128
    dev = torch.device("cuda")
    print(f"{'batch':>5} {'cache':>6} | {'flashcore':>9} {'paged':>7} {'splits':>6} | "
          f"{'sdpa-fa':>7} {'cuDNN':>7} | {'read':>6}  (TB/s of K+V bytes)")
    for b in (1, 8, 64):
        for sk in (4096, 16384, 131072):
            nbytes = 2 * b * sk * hk * d * 2
            if nbytes > 40e9:
                continue
            q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
            kc = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
            vc = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            lse = torch.empty(b, h, 1, device=dev, dtype=torch.float32)
            seqlens = torch.full((b,), sk, device=dev, dtype=torch.int32)
            cq, ck, cv, co, cl, cs = (cp.from_dlpack(x) for x in (q, kc, vc, out, lse, seqlens))
            scale = 1.0 / math.sqrt(d)
            res = {}
            stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
            with stream:
                splits = launch_decode(cq, ck, cv, co, cl, cache_seqlens=cs, softmax_scale=scale,
                                       window_left=-1, window_right=-1)
                res["flashcore"] = _time(lambda: launch_decode(
                    cq, ck, cv, co, cl, cache_seqlens=cs, softmax_scale=scale,
                    window_left=-1, window_right=-1))
                # paged, page 256, blocks in a shuffled order
                ps = 256
                nblk = b * sk // ps
                perm = torch.randperm(nblk, device=dev).to(torch.int32)
                kp = kc.reshape(nblk, ps, hk, d)[perm.argsort()].contiguous()
                vp = vc.reshape(nblk, ps, hk, d)[perm.argsort()].contiguous()
                bt = perm.reshape(b, sk // ps).contiguous()
                ckp, cvp, cbt = (cp.from_dlpack(x) for x in (kp, vp, bt))
                res["paged"] = _time(lambda: launch_decode(
                    cq, ckp, cvp, co, cl, cache_seqlens=cs, block_table=cbt, softmax_scale=scale,
                    window_left=-1, window_right=-1))
                del kp, vp
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            for name, be in (("sdpa-fa", SDPBackend.FLASH_ATTENTION),
                             ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        res[name] = _time(lambda: F.scaled_dot_product_attention(
                            qt, kt, vt, enable_gqa=True))
                except Exception as e:  # backend unavailable for these shapes
                    print(f"  ({name}: {type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
                    res[name] = float("nan")
            buf = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16).normal_()
            res["read"] = _time(lambda buf=buf: buf.sum(dtype=torch.float32))
            del buf
            tb = {k: nbytes / t / 1e12 for k, t in res.items()}
            print(f"{b:>5} {sk // 1024:>5}k | {tb['flashcore']:>9.2f} {tb['paged']:>7.2f} "
                  f"{splits:>6} | {tb['sdpa-fa']:>7.2f} {tb['cuDNN']:>7.2f} | {tb['read']:>6.2f}")
            del q, kc, vc, out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
