"""Tile sweep for the forward and backward kernels on the GPU (a tuning tool, not a test).

For each candidate tile: compile (in parallel, filling the kernel cache), check the result
against the default tile on random data, report registers / local memory, and time it with
flashcore.bench.gpu_time (CUDA events per call, L2 flushed, median: what triton's do_bench
measured here before) at the ANCHORS sizes (flashcore.bench.shape_for, flops, random_arrays).
Prints one line per variant and a best-of table.   python tests/diagnostics/sweep_tiles.py [--quick]
"""
import concurrent.futures as cf
import itertools
import math
import os
import sys

FWD = {
    64: [(128, 64, 4, True), (128, 128, 8, True), (128, 128, 4, True), (64, 64, 4, True), (128, 64, 8, True)],
    128: [(128, 64, 8, True), (128, 64, 4, True), (128, 64, 4, False), (128, 128, 8, True),
          (128, 128, 8, False), (64, 64, 4, True), (128, 32, 4, True), (64, 128, 4, True)],
    256: [(128, 64, 8, False), (64, 64, 4, False), (128, 32, 8, False), (64, 32, 4, False), (64, 64, 4, True)],
}
# 3-tuples: flash_bwd_dkdv_kernel (v1); 6-tuples (block_m, block_n, warps, s_wn, k_wn, q_wm):
# flash_bwd_dkdv2_kernel (2-D warp layouts). The reference ("default") is the launcher's table.
BWD = {
    64: [(128, 128, 8), (64, 128, 8), (64, 64, 4),
         (64, 128, 8, 4, 4, 2), (128, 128, 8, 4, 4, 4), (128, 128, 8, 2, 4, 4), (64, 128, 8, 2, 4, 2)],
    128: [(64, 128, 8), (128, 128, 8),
          (64, 128, 8, 4, 4, 2), (64, 128, 8, 2, 4, 2), (64, 128, 8, 4, 4, 4), (64, 128, 8, 8, 4, 2)],
    256: [(64, 64, 8), (32, 64, 8),
          (64, 64, 8, 2, 2, 2), (64, 64, 8, 4, 2, 2), (64, 64, 8, 2, 2, 4)],
}


def _no_launch_plans():
    """The sweep swaps tile tables under the launchers: recorded launch plans would replay the
    tables of the first call (flashcore/kernels/plans.py), so they are switched off."""
    from flashcore.kernels import plans
    plans.set_enabled(False)


def _compile_one(args):
    try:
        return _compile(args)
    except Exception as e:  # a tile the kernel's static checks refuse
        kind, d, tile, causal = args
        return kind, d, tile, causal, None, f"{type(e).__name__}: {str(e)[:200]}"


def _compile(args):
    kind, d, tile, causal = args
    import cupy
    from flashcore import jit
    from flashcore.kernels import backward, forward
    cc = int(cupy.cuda.Device().compute_capability)
    if kind == "fwd":
        forward.set_tile_override(d, forward.TileConfig(*tile))
        name = forward.kernel_name("bfloat16", d, causal, False, False)
        k = jit.get_kernel("flash_fwd.cu", name, 0, cc)
    else:
        t = backward.BwdTile(*tile)
        name = backward._dkdv_name("fc_bf16", d, t, causal, False, False, True, True)
        k = jit.get_kernel("flash_bwd.cu", name, 0, cc)
    return kind, d, tile, causal, k.num_regs, k.local_size_bytes


def main():
    quick = "--quick" in sys.argv
    import cupy
    import torch
    import flashcore
    from flashcore.bench import flops as flop_count, gpu_time, random_arrays, shape_for
    from flashcore.kernels import backward, forward
    _no_launch_plans()

    jobs = [] if "--bwd-only" in sys.argv else \
        [("fwd", d, t, c) for d, ts in FWD.items() for t in ts for c in (False, True)]
    jobs += [("bwd", d, t, c) for d, ts in BWD.items() for t in ts for c in (False, True)]
    res = {}
    with cf.ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 4)) as ex:
        for kind, d, tile, causal, regs, local in ex.map(_compile_one, jobs):
            if regs is None:
                print(f"{kind} d{d} tile {tile} causal={causal}: does not compile: {local}")
                continue
            res[(kind, d, tile, causal)] = (regs, local)
    seqlens = [4096] if quick else [2048, 16384]
    rows = []
    for (kind, d, tile, causal), (regs, local) in res.items():
        for s in seqlens:
            b, _, h, _ = shape_for(s, d)
            q, k, v, do = random_arrays("torch", [(b, s, h, d)] * 4, seed=s + d)
            cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
            flops = flop_count(b, s, h, d, causal)
            # reference: default tiles
            forward._OVERRIDES.clear()
            o_ref, l_ref = flashcore.attention_forward(cq, ck, cv, causal=causal)
            g_ref = flashcore.attention_backward(cdo, cq, ck, cv, o_ref, l_ref, causal=causal) if kind == "bwd" else None
            saved = dict(backward._DKDV_TILES)
            try:
                if kind == "fwd":
                    forward.set_tile_override(d, forward.TileConfig(*tile))
                    o, l = flashcore.attention_forward(cq, ck, cv, causal=causal)
                    err = float(cupy.abs(o.astype(cupy.float32) - o_ref.astype(cupy.float32)).max())
                    t = gpu_time(lambda: flashcore.attention_forward(cq, ck, cv, causal=causal),
                                 "cupy")
                    tf = flops / t / 1e12
                else:
                    backward._DKDV_TILES[d] = (backward.BwdTile(*tile),)
                    gr = flashcore.attention_backward(cdo, cq, ck, cv, o_ref, l_ref, causal=causal)
                    err = max(float(cupy.abs(a.astype(cupy.float32) - r.astype(cupy.float32)).max())
                              for a, r in zip(gr, g_ref))
                    t = gpu_time(lambda: flashcore.attention_backward(cdo, cq, ck, cv, o_ref, l_ref, causal=causal),
                                 "cupy")
                    tf = flop_count(b, s, h, d, causal, "backward") / t / 1e12
            finally:
                forward._OVERRIDES.clear()
                backward._DKDV_TILES.clear()
                backward._DKDV_TILES.update(saved)
            rows.append((kind, d, causal, s, tile, regs, local, err, tf))
            print(f"{kind} d{d} {'causal' if causal else 'full  '} s{s:<6d} tile {tile}: regs {regs} "
                  f"local {local} B, max|diff vs default| {err:.2e}, {tf:6.1f} TFLOP/s", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    for d, s in itertools.product((64, 128, 256), seqlens):
        b, _, h, _ = shape_for(s, d)
        q, k, v, do = random_arrays("torch", [(b, s, h, d)] * 4, seed=s + d)
        cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
        o, l = flashcore.attention_forward(cq, ck, cv)
        flops = flop_count(b, s, h, d, False, "backward")
        for det in (False, True):
            t = gpu_time(lambda: flashcore.attention_backward(cdo, cq, ck, cv, o, l, deterministic=det),
                         "cupy")
            print(f"bwd d{d} s{s} default tiles deterministic={det}: {flops / t / 1e12:6.1f} TFLOP/s", flush=True)
        del q, k, v, do
    print("\nbest per (kernel, headdim, causal), geomean over seqlens, among variants with diff < 0.05:")
    key = lambda r: (r[0], r[1], r[2])
    for kk, grp in itertools.groupby(sorted(rows, key=key), key=key):
        grp = list(grp)
        by_tile = {}
        for r in grp:
            by_tile.setdefault(r[4], []).append(r)
        scored = []
        for tile, rs in by_tile.items():
            ok = all(r[7] < 0.05 for r in rs)
            gm = math.exp(sum(math.log(r[8]) for r in rs) / len(rs))
            scored.append((ok, gm, tile, rs[0][6]))
        scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
        line = "  ".join(f"{t}{'' if ok else '!'}{'(spill ' + str(loc) + ')' if loc else ''} {gm:.0f}" for ok, gm, t, loc in scored)
        print(f"{kk[0]} d{kk[1]} {'causal' if kk[2] else 'full  '}: {line}")


if __name__ == "__main__":
    main()
