"""Decode benchmark (H200): TB/s of K+V cache bytes actually read / time, for batch 1/8/64 x
cache 4k/16k/128k, GPU time per call (flashcore.bench.gpu_time_l2_flushed: CUDA events per call,
L2 flushed, median), 32 query heads over 8 kv heads, headdim 128, bf16, one query token.

Peers measured in the same run: torch SDPA with the flash backend and with the cuDNN backend
(enable_gqa=True), and the best plain read of the same number of bytes (torch's sum over a
buffer of that size, or a 16-byte-load read kernel at a few grid sizes). flashcore is run
contiguous and paged (page 256, flashcore.bench.DecodeProblem's paged cache), with the split
heuristic. The host cost per call at batch 1 / 4k: flashcore.bench.host_loop_us.
At batch 1 and 8 the split-KV merge is also timed both ways: fused into the decode kernel (the
default, one launch) and with the separate combine kernel (FLASHCORE_DECODE_FUSED_COMBINE=0).

    python tests/diagnostics/bench_decode.py
    python tests/diagnostics/bench_decode.py --defines NAME[=VALUE] ... [--rounds 3]

``--defines``: instead, the decode kernels built with each of the NVRTC defines (timing-only
diagnostics, through the ``sm90_defines`` setting) against the default build, through the public
``flashcore.attention_with_kvcache``, contiguous and paged, every variant timed in turn for
``--rounds`` rounds (median), SDPA cuDNN in the same process.
"""
from __future__ import annotations

import sys

from flashcore.bench import DecodeProblem, host_loop_us
from flashcore.bench import gpu_time_l2_flushed as _time    # GPU time of fn(), s, L2 flushed

_READ_SRC = r"""
extern "C" __global__ void read_pass(const uint4* __restrict__ src, long long n16,
                                     unsigned int* __restrict__ sink) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {     // four 16-byte loads in flight
        const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride);
        const uint4 c = __ldcs(src + i + 2 * stride), d = __ldcs(src + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w
             ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = __ldcs(src + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;   // keeps the loads; practically never stores
}
"""


def _read_kernel_time(buf):
    """The best of a few grid sizes of a plain 16-byte-load read pass over ``buf``."""
    import cupy as cp
    import torch
    k = cp.RawKernel(_READ_SRC, "read_pass")
    src = cp.from_dlpack(buf.view(torch.uint8))
    n16 = src.size // 16
    sink = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    best = float("inf")
    for blocks_per_sm in (2, 4, 8):
        grid = (min(sms * blocks_per_sm, max(1, (n16 + 511) // 512)),)
        best = min(best, _time(lambda g=grid: k(g, (512,), (src, cp.int64(n16), sink))))
    return best


def _host_us(fn):
    """Host time per call (launch cost), microseconds: 200 calls back to back, then a sync."""
    return host_loop_us(fn, steps=200, warmup=10, rounds=1, warmup_s=0.0)


def main():
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore.kernels import decode as decode_mod

    h, hk, d = 32, 8, 128
    host_line = ""
    sweep, picked = [], {}
    fusion = []     # (batch, cache, splits, layout, fused TB/s, two-kernel TB/s)
    dev = torch.device("cuda")
    print(f"{'batch':>5} {'cache':>6} | {'flashcore':>9} {'paged':>7} {'splits':>6} | "
          f"{'sdpa-fa':>7} {'cuDNN':>7} | {'read':>6}  (TB/s of K+V bytes)")
    for b in (1, 8, 64):
        for sk in (4096, 16384, 131072):
            nbytes = 2 * b * sk * hk * d * 2
            if nbytes > 40e9:
                continue
            pb = DecodeProblem(b, sk, h, hk, d)
            res = {}
            stream = pb.stream
            with stream:
                splits = pb.run()
                res["flashcore"] = _time(pb.run)
                if b <= 8:   # the split count, swept (the heuristic's pick is "splits")
                    for ns in (8, 16, 24, 32, 48, 64, 96, 128):
                        if ns * b * 8 > 4096 or ns == splits:
                            continue
                        sweep.append((b, sk, ns, nbytes / _time(lambda ns=ns: pb.run(ns)) / 1e12))
                    sweep.append((b, sk, splits, nbytes / res["flashcore"] / 1e12))
                    picked[(b, sk)] = splits
                # paged, page 256, blocks in a shuffled order (the same stream: torch's)
                pbp = DecodeProblem(b, sk, h, hk, d, page_size=256)
                res["paged"] = _time(pbp.run)
                if b <= 8 and splits > 1:   # the same calls with the separate combine kernel
                    fused_was = decode_mod.fused_combine_enabled()
                    decode_mod.set_fused_combine(False)
                    try:
                        two = _time(pb.run)
                        two_p = _time(pbp.run)
                    finally:
                        decode_mod.set_fused_combine(fused_was)
                    tag = "default" if fused_was else "two-kernel(default)"
                    fusion.append((b, sk, splits, "contiguous", nbytes / res["flashcore"] / 1e12,
                                   nbytes / two / 1e12, tag))
                    fusion.append((b, sk, splits, "paged256", nbytes / res["paged"] / 1e12,
                                   nbytes / two_p / 1e12, tag))
                pbp = None
            for name, be in (("sdpa-fa", SDPBackend.FLASH_ATTENTION),
                             ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
                try:
                    res[name] = _time(lambda be=be: pb.sdpa(be))
                except Exception as e:  # backend unavailable for these shapes
                    print(f"  ({name}: {type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
                    res[name] = float("nan")
            buf = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16).normal_()
            with stream:
                res["read"] = min(_time(lambda buf=buf: buf.sum(dtype=torch.float32)),
                                  _read_kernel_time(buf))
            del buf
            tb = {k: nbytes / t / 1e12 for k, t in res.items()}
            print(f"{b:>5} {sk // 1024:>5}k | {tb['flashcore']:>9.2f} {tb['paged']:>7.2f} "
                  f"{splits:>6} | {tb['sdpa-fa']:>7.2f} {tb['cuDNN']:>7.2f} | {tb['read']:>6.2f}")
            if b == 1 and sk == 4096:   # host cost per call, where decoding is launch-bound
                import flashcore
                with stream:
                    hk_ = _host_us(pb.run)
                    api = _host_us(lambda: flashcore.attention_with_kvcache(
                        pb.cq, pb.ck, pb.cv, cache_seqlens=pb.cs))
                cud = _host_us(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
                host_line = (f"# host per call at batch 1, cache 4k: launch_decode {hk_:.1f} us, "
                             f"flashcore.attention_with_kvcache (CuPy) {api:.1f} us, "
                             f"torch SDPA cuDNN {cud:.1f} us")
            pb = None
            torch.cuda.empty_cache()
    print(host_line)
    if fusion:
        print("# split-KV merge: the default path (the cluster merge on sm_90, else the fused "
              "combine, unless FLASHCORE_DECODE_FUSED_COMBINE=0) vs the separate combine kernel, "
              "TB/s")
        for bb, sk, ns, lay, tf, tt, tag in fusion:
            print(f"{bb:>5} {sk // 1024:>5}k {lay:>10} {ns:>3} splits | {tag} {tf:.2f} | "
                  f"two-kernel {tt:.2f} | ratio {tf / tt:.3f}")
    print("# split-count sweep (contiguous cache), TB/s; * = the heuristic's pick")
    for bb, sk in sorted({(x[0], x[1]) for x in sweep}):
        cells = sorted((ns, tb) for b_, s_, ns, tb in sweep if (b_, s_) == (bb, sk))
        best = max(cells, key=lambda c: c[1])
        print(f"{bb:>5} {sk // 1024:>5}k | best {best[0]:>3} splits {best[1]:.2f} | " + " ".join(
            f"{ns}{'*' if ns == picked[(bb, sk)] else ''}:{tb:.2f}" for ns, tb in cells))


def defines_table(defines, rounds):
    """The decode cells with each define against the default build (TB/s of K+V bytes, GPU time
    with the L2 flushed, median of the rounds; ratio to SDPA cuDNN)."""
    import statistics
    import torch
    from torch.nn.attention import SDPBackend
    from flashcore import config
    variants = [("default", ())] + [(n, (f"-D{n}",)) for n in defines]
    print("# K+V TB/s (ratio to SDPA cuDNN): " + " | ".join(
        f"{v} contiguous, paged" for v, _ in variants))
    # (batch 64 at 128k left out: two 34 GB caches and their rounds would fill a device call)
    for b, sk in ((1, 4096), (1, 16384), (1, 131072), (8, 4096), (8, 16384), (8, 131072),
                  (64, 4096), (64, 16384)):
        pb = DecodeProblem(b, sk, seed=b + sk)
        pbp = DecodeProblem(b, sk, seed=b + sk, page_size=256)
        times = {}
        with pb.stream:
            for _ in range(rounds):
                for v, defs in variants:
                    with config.override(sm90_defines=defs):
                        for lay, prob in (("c", pb), ("p", pbp)):
                            prob.api()      # (compiles the variant's kernels)
                            times.setdefault((v, lay), []).append(_time(prob.api))
            cud = _time(lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION))
        cells = []
        for v, _ in variants:
            tc, tp = (statistics.median(times[(v, lay)]) for lay in ("c", "p"))
            cells.append(f"{v} {pb.nbytes / tc / 1e12:.2f} ({cud / tc:.3f}), "
                         f"{pb.nbytes / tp / 1e12:.2f} ({cud / tp:.3f})")
        print(f"{b:>3} {sk // 1024:>4}k | cuDNN {pb.nbytes / cud / 1e12:.2f} | "
              + " | ".join(cells), flush=True)
        pb = pbp = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--defines", nargs="+", metavar="NAME[=V]")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.defines:
        defines_table(a.defines, a.rounds)
    else:
        main()
