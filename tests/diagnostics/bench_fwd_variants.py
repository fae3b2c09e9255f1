"""The Hopper kernels' variants against torch SDPA (flash and cuDNN backends), in one process.

    python tests/diagnostics/bench_fwd_variants.py [--seqlen 1024 4096 16384] [--headdim 64 128 256]
        [--causal both|yes|no] [--variants ws ws-nopp v1] [--mode fwd fwdbwd] [--rounds N]
        [--json FILE]

Every figure goes through the public API (``flashcore.attention`` on torch CUDA tensors, forward
under ``torch.no_grad``, forward+backward through autograd) at the ANCHORS.md sizes (16k tokens
per batch, hidden 2048), timed by ``flashcore.bench.gpu_time`` (CUDA events, L2 flushed,
median). Variants: ``ws`` the warp-specialised TMA kernel as the defaults choose it,
``ws-pp`` / ``ws-nopp`` with / without ping-pong, ``ws-bn128`` / ``ws-bn176`` with 128 / 176
keys per block at head dim 128 (both pingpong settings as the defaults choose), ``ws-s3`` with a
3-stage ring at head dim 128 (128-key blocks), ``ws-bn64`` 64-key blocks at head dim 256 (the tile before
session 21's 80), ``ws-kvhalf`` a timing-only probe
(``FC_DIAG_KV_HALF``: every other key block reuses its stage's stale K and V, so half the K/V
bytes come from L2 for the same products; wrong results), ``ws-ostg`` the defaults with O stored
from the registers instead of through the O buffers and TMA (``FC_DIAG_O_STG``), ``ws-rescale`` O
rescaled after every key block (``FC_DIAG_RESCALE_ALWAYS``), ``ws-ppchain`` ping-pong's turns
chained through each CTA's tiles as FlashAttention-3 orders them (``FC_DIAG_PP_CHAIN``),
``ws-fence`` the softmax kept ahead of the wait for the warpgroup's own P V product
(``FC_DIAG_SOFTMAX_FENCE``, everywhere it fits), ``ws-thr8`` O rescaled only where a row's
maximum passes its reference by more than 2^8 in P (``FC_DIAG_RESCALE_THRESHOLD=8``) in every
kernel (by default only the 16-bit ones at head dim 256); any of them followed by
``+DEFINE[=VALUE]`` parts adds those NVRTC defines (e.g. ``ws-fence+FC_DIAG_PP_CHAIN``,
``ws-bn128+FC_DIAG_SOFTMAX_FENCE``), ``ws-bcp`` the defaults with the cp.async dK/dV kernel
instead of the warp-specialised one, ``v1`` / ``v0`` the cp.async kernels, ``ampere`` the
mma.sync kernel, ``ws-1t`` one tile per CTA, ``ws-pers`` persistent CTAs
wherever such a kernel exists (``-pp`` / ``-nopp``: with / without ping-pong), ``ws-bm128``
128-row tiles (two consumer warpgroups) at head dim 64 (``-1t``: one tile per CTA). Each variant's output is compared with the first variant's (max abs difference), a
cross-check only: the GPU tests hold the correctness checks against the float64 oracle.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys

_WS = dict(sm90_fwd=True, sm90_fwd_ws=True)
# variant: (settings, tile table entries of the warp-specialised kernel to use instead)
VARIANTS = {
    "ws": (_WS, {}),
    "ws-pp": (dict(_WS, sm90_fwd_pingpong=True), {}),
    "ws-nopp": (dict(_WS, sm90_fwd_pingpong=False), {}),
    "ws-bn128": (_WS, {(128, False): (128, 128, 2)}),
    "ws-bn176": (_WS, {(128, False): (128, 176, 2)}),
    "ws-s3": (_WS, {(128, False): (128, 128, 3), (128, True): (128, 128, 3)}),
    "ws-bm128": (_WS, {(64, False): (128, 128, 3), (64, True): (128, 128, 3)}),
    "ws-bm128-1t": (dict(_WS, sm90_fwd_persistent=False),
                    {(64, False): (128, 128, 3), (64, True): (128, 128, 3)}),
    "ws-bcp": (dict(_WS, sm90_bwd_ws=False), {}),
    "ws-1t": (dict(_WS, sm90_fwd_persistent=False), {}),
    "ws-pers": (dict(_WS, sm90_fwd_persistent=True), {}),
    "ws-pers-nopp": (dict(_WS, sm90_fwd_persistent=True, sm90_fwd_pingpong=False), {}),
    "ws-pers-pp": (dict(_WS, sm90_fwd_persistent=True, sm90_fwd_pingpong=True), {}),
    "ws-bn64": (_WS, {(256, False): (128, 64, 2)}),
    "ws-kvhalf": (dict(_WS, sm90_defines=("-DFC_DIAG_KV_HALF",)), {}),
    # O stored from the registers where the kernels have O buffers (the epilogue before them)
    "ws-ostg": (dict(_WS, sm90_defines=("-DFC_DIAG_O_STG",)), {}),
    # O rescaled after every key block, as before the skip where no row of a warp took a new
    # maximum (head dims 64 and 256)
    "ws-rescale": (dict(_WS, sm90_defines=("-DFC_DIAG_RESCALE_ALWAYS",)), {}),
    # ping-pong's turns chained through a CTA's tiles, FlashAttention-3's order (the first S and
    # the last P V outside the turns; FC_DIAG_PP_CHAIN)
    "ws-ppchain": (dict(_WS, sm90_defines=("-DFC_DIAG_PP_CHAIN",)), {}),
    # the softmax kept ahead of the wait for the warpgroup's own P V product (ptxas otherwise
    # waits first; FC_DIAG_SOFTMAX_FENCE)
    "ws-fence": (dict(_WS, sm90_defines=("-DFC_DIAG_SOFTMAX_FENCE",)), {}),
    # O rescaled only where a row's maximum passes its reference by more than 2^8 in P
    # (FlashAttention-4's conditional rescale; FC_DIAG_RESCALE_THRESHOLD=8), in every kernel
    # (by default the 16-bit ones at head dim 256 only)
    "ws-thr8": (dict(_WS, sm90_defines=("-DFC_DIAG_RESCALE_THRESHOLD=8",)), {}),
    "v1": (dict(sm90_fwd=True, sm90_fwd_ws=False, sm90_fwd_pipelined=True), {}),
    "v0": (dict(sm90_fwd=True, sm90_fwd_ws=False, sm90_fwd_pipelined=False), {}),
    "ampere": (dict(sm90_fwd=False), {}),
}


def _parse_variant(name):
    """(settings, tiles) of a variant name: one of VARIANTS, optionally followed by
    ``+DEFINE[=VALUE]`` parts, extra NVRTC defines on top of the variant's (e.g.
    ``ws-bn128+FC_DIAG_SOFTMAX_FENCE``)."""
    base, *extra = name.split("+")
    if base not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"unknown variant {base!r} (expected one of {sorted(VARIANTS)}, then +DEFINE ...)")
    settings, tiles = VARIANTS[base]
    if extra:
        settings = dict(settings, sm90_defines=tuple(settings.get("sm90_defines", ()))
                        + tuple(f"-D{x}" for x in extra))
    return settings, tiles


def _variant_name(name):
    _parse_variant(name)
    return name


@contextlib.contextmanager
def variant(name):
    """The variant's settings and tiles for the block (launch plans dropped around it: a tile
    table change is no setting, so the plans' keys do not see it)."""
    from flashcore import config
    from flashcore.kernels import forward, plans
    settings, tiles = _parse_variant(name)
    saved = dict(forward._WS_TILES)
    forward._WS_TILES.update(tiles)
    plans.clear()
    try:
        with config.override(sm90_fwd_d64_min_seqlen_k=0, **settings):
            yield
    finally:
        forward._WS_TILES.clear()
        forward._WS_TILES.update(saved)
        plans.clear()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--variants", nargs="+", default=["ws", "ws-nopp", "v1"], type=_variant_name,
                   help="names from VARIANTS, each optionally with +DEFINE[=VALUE] parts "
                        "(extra NVRTC defines on top of the variant's)")
    p.add_argument("--mode", nargs="+", default=["fwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--rounds", type=int, default=1,
                   help="time every implementation of a cell this many times, in turn, and "
                        "report the median (3 or more when variants differ by a few percent)")
    p.add_argument("--json")
    a = p.parse_args(argv)

    import torch
    from flashcore.bench import AttentionProblem, flops, shape_for

    which = {"fwd": "forward", "fwdbwd": "forward_backward"}
    rows = []
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, TFLOP/s "
          f"(ratio to SDPA cuDNN)")
    for d in a.headdim:
        for causal in {"both": [False, True], "yes": [True], "no": [False]}[a.causal]:
            for s in a.seqlen:
                b, _, h, _ = shape_for(s, d)
                row = {"headdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                # every implementation's problem first, then the timings in rounds that visit
                # them in turn (the median of the rounds), each round starting one later: a
                # drift of the GPU's clocks during the cell, or a place in the order, then
                # reaches every implementation alike (session 42: three kernels of identical
                # SASS visited in a fixed order timed 7% apart at one cell). A control for the
                # spread: a variant under a define that nothing reads (ws+FC_DIAG_CONTROL)
                impls = []
                for peer in ("sdpa_flash", "sdpa_cudnn"):
                    try:
                        impls.append((peer, contextlib.nullcontext,
                                      AttentionProblem(peer, b, s, h, d, causal, seed=s + d)))
                    except Exception as e:   # a peer that cannot take the shape
                        row[f"{peer}_error"] = str(e)[:100]
                for var in a.variants:
                    impls.append((var, functools.partial(variant, var),
                                  AttentionProblem("torch", b, s, h, d, causal, seed=s + d)))
                times = {(name, m): [] for name, _, _ in impls for m in a.mode}
                for r in range(a.rounds):
                    k = r % len(impls)
                    for name, ctx, pb in impls[k:] + impls[:k]:
                        try:
                            with ctx():
                                for m in a.mode:
                                    times[(name, m)].append(pb.seconds(which[m]))
                        except Exception as e:
                            if name not in ("sdpa_flash", "sdpa_cudnn"):
                                raise
                            row[f"{name}_error"] = str(e)[:100]   # a peer that cannot run it
                            impls.remove((name, ctx, pb))
                for (name, m), ts in times.items():
                    if f"{name}_error" not in row:
                        row[f"{name}_{m}"] = (flops(b, s, h, d, causal, which[m])
                                              / statistics.median(ts) / 1e12)
                first = None
                for name, ctx, pb in impls[len(impls) - len(a.variants):]:
                    with ctx():
                        out = pb.forward().float()
                    if first is None:
                        first = out
                    else:
                        row[f"{name}_maxdiff"] = float((out - first).abs().max())
                    del out
                del impls, first
                torch.cuda.empty_cache()
                rows.append(row)
                cells = []
                for m in a.mode:
                    ref = row.get(f"sdpa_cudnn_{m}", float("nan"))
                    cells.append(f"{m}: flash {row.get(f'sdpa_flash_{m}', float('nan')):5.0f} "
                                 f"cudnn {ref:5.0f} | " + " ".join(
                                     f"{v} {row[f'{v}_{m}']:5.0f} ({row[f'{v}_{m}'] / ref:4.2f})"
                                     for v in a.variants))
                diffs = " ".join(f"{v}:{row[f'{v}_maxdiff']:.1e}" for v in a.variants[1:])
                print(f"d{d:<3} {'causal' if causal else 'full  '} {s:>6} | " + " || ".join(cells)
                      + f" | maxdiff {diffs}", flush=True)
    for m in a.mode:
        for v in a.variants:
            r = [row[f"{v}_{m}"] / row[f"sdpa_cudnn_{m}"] for row in rows
                 if row.get(f"sdpa_cudnn_{m}")]
            if r:
                gm = math.exp(sum(map(math.log, r)) / len(r))
                print(f"SUMMARY {m} {v}/cudnn: geomean {gm:.3f} min {min(r):.3f} max {max(r):.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
