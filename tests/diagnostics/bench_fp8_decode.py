"""Decoding over an FP8 (float8_e4m3fn) KV cache against the same call over a bfloat16 cache
(issue #17: the goal is close to twice the tokens per second at one cache length).

    python tests/diagnostics/bench_fp8_decode.py [--cells 1x4096,8x16384,...] [--splits 0,16,32]
                                                 [--paged PAGE_SIZE]
                                                 [--fp8-cfg 64,4,3/64,4,4/128,4,3]
                                                 [--defines NAME[,NAME...]]

Through the public API, as a user calls it: ``flashcore.attention_with_kvcache`` on torch CUDA
tensors (q bf16, one query token, GQA 32/8, head dim 128, full caches, ``cache_seqlens`` a CUDA
int32 tensor, per-(batch, kv head) descales for the FP8 cache; the bf16 problem is
``flashcore.bench.DecodeProblem``'s, the FP8 cache ``fp8_quantise`` of it), timed by
``flashcore.bench.gpu_time`` (CUDA events, L2 flushed, median). ``--splits``: the FP8 call also
with these ``num_splits`` (0: flashcore's choice). Prints GPU time, the ratio bf16 / fp8 (the
tokens/s ratio), the FP8 cache's bytes per second and the largest difference of any FP8
variant's output from the first one's. ``--paged``: both caches paged (pages of
PAGE_SIZE tokens in a shuffled order named by an int32 ``block_table``). ``--fp8-cfg``: the
FP8 calls also with these decode tiles (block_n, n_warps, stages; ``decode.set_config_override``
for head dim 128 around the FP8 calls only; the bf16 call keeps the default tiles), one column
each after the default's. ``--defines``: the kernels built with each timing-only define (the
``sm90_defines`` setting), one column each: the FP8 call's time (its ratio to the default bf16
call, TB/s) and the bf16 call's under the same define.
"""
from __future__ import annotations

import sys

CELLS = ((1, 4096), (1, 16384), (1, 131072), (8, 4096), (8, 16384), (8, 131072),
         (64, 4096), (64, 16384))


def main(argv):
    import torch
    import flashcore
    from flashcore.bench import (DECODE_HEADDIM, DECODE_HEADS, DECODE_HEADS_K, DecodeProblem,
                                 fp8_quantise, gpu_time)

    cells = CELLS
    splits = (0,)
    if "--cells" in argv:
        cells = tuple(tuple(int(x) for x in c.split("x"))
                      for c in argv[argv.index("--cells") + 1].split(","))
    page = int(argv[argv.index("--paged") + 1]) if "--paged" in argv else 0
    if "--splits" in argv:
        splits = tuple(int(x) for x in argv[argv.index("--splits") + 1].split(","))
    from flashcore.kernels import decode as dm
    cfgs = (None,)
    if "--fp8-cfg" in argv:
        cfgs += tuple(dm.DecodeConfig(*(int(x) for x in c.split(",")))
                      for c in argv[argv.index("--fp8-cfg") + 1].split("/"))
    runs = [(s, c, ()) for c in cfgs for s in splits]
    if "--defines" in argv:
        runs += [(0, None, (f"-D{n}",)) for n in argv[argv.index("--defines") + 1].split(",")]
    from flashcore import config
    h, hk, d = DECODE_HEADS, DECODE_HEADS_K, DECODE_HEADDIM     # 32, 8, 128
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}; GQA {h}/{hk}, d{d}, "
          f"q bf16, {'paged (%d)' % page if page else 'contiguous'} caches; us per step (GPU "
          "time, L2 flushed)")
    print("batch  cache | bf16 cache | " + " | ".join(
        f"fp8 splits={s or 'auto'}{'' if c is None else ' cfg=%d,%d,%d' % c}"
        + (" " + " ".join(x[2:] for x in dfs) + " (ratio, TB/s; bf16 us)" if dfs
           else " (ratio, TB/s)")
        for s, c, dfs in runs))
    g = torch.Generator(device="cuda").manual_seed(0)     # the pages' order
    for b, sk in cells:
        pb = DecodeProblem(b, sk, h, hk, d, seed=b * 100003 + sk)   # contiguous bf16 caches
        q, k16, v16, lens = pb.q, pb.k_cache, pb.v_cache, pb.cache_seqlens
        del pb      # (paged: the contiguous caches go when k16, v16 name the pages)
        (k8, kd), (v8, vd) = fp8_quantise(k16), fp8_quantise(v16)
        pg = {}
        if page:
            perm = torch.randperm(b * sk // page, device="cuda", generator=g)
            pg["block_table"] = perm.view(b, sk // page).to(torch.int32)

            def paged(x):
                p = x.reshape(b * sk // page, page, hk, d)
                out = torch.empty_like(p)
                out[perm] = p
                return out
            k16, v16, k8, v8 = paged(k16), paged(v16), paged(k8), paged(v8)
        dm.set_config_override(d, None)
        t16 = gpu_time(lambda: flashcore.attention_with_kvcache(q, k16, v16, cache_seqlens=lens,
                                                                **pg))
        cells_out = []
        ref8, worst = None, 0.0       # every FP8 variant's output against the first one's
        for s, c, dfs in runs:
            dm.set_config_override(d, c)
            try:
                with config.override(sm90_defines=dfs):
                    def call8():
                        return flashcore.attention_with_kvcache(
                            q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd,
                            num_splits=s, **pg)
                    o8 = call8().float()
                    if ref8 is None:
                        ref8 = o8
                    worst = max(worst, float((o8 - ref8).abs().max()))
                    t8 = gpu_time(call8)
                    t16d = gpu_time(lambda: flashcore.attention_with_kvcache(
                        q, k16, v16, cache_seqlens=lens, **pg)) if dfs else None
            finally:
                dm.set_config_override(d, None)
            tb = 2 * b * sk * hk * d / t8 / 1e12
            cells_out.append(f"{t8 * 1e6:8.1f} ({t16 / t8:4.2f}, {tb:4.2f}"
                             + (f"; {t16d * 1e6:.1f})" if dfs else ")"))
        print(f"{b:5d} {sk:6d} | {t16 * 1e6:10.1f} | " + " | ".join(cells_out)
              + f" | max diff {worst:.1e}", flush=True)
        del k16, v16, k8, v8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
