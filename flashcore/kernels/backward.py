"""Launcher for the backward kernels in ``cuda/flash_bwd.cu`` (Ampere-class path, sm_80 and newer).

One backward call runs three kernels on the arrays' library's current stream:

1. ``flash_bwd_preprocess_kernel``: D = rowsum(dO * O), fp32, in the layout of ``lse``.
2. ``flash_bwd_dkdv_kernel``: one CTA per (key block, kv head, batch); dK and dV for the whole
   GQA group in registers, written once. In the default (atomic) mode it also adds dS K into an
   fp32 ``dq_accum`` scratch with fp32 reductions, so the order in which CTAs add -- and the
   last bits of dQ -- vary from run to run.
3. atomic mode: ``flash_bwd_convert_dq_kernel`` (dq = dq_accum * softmax_scale, 16-bit);
   ``deterministic=True``: ``flash_bwd_dq_kernel`` instead, one CTA per (query block, head,
   batch) that recomputes S, P, dP, dS and sums dQ in registers in a fixed order (bitwise
   reproducible, about 40% more backward FLOPs).

The caller (the CuPy backend) has validated shapes, dtypes and devices.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from .common import (ELEM_TAGS, _as_input, _as_output, _int64_pair, _strides, smallest_tile,
                     tpl_bool as _b, window_arg as _window)
import numpy as np

from .. import config
from .. import dropout as _dropout
from . import device, plans
from .device import lib_of
from .params import WINDOW_NONE, as_kernel_arg, make_params

__all__ = ["launch_backward", "instantiations", "BwdTile", "dkdv_tiles", "dq_tiles",
           "dkdv_smem_bytes", "dq_smem_bytes", "HEADDIM_TILES", "set_sm90", "sm90_applies",
           "sm90_kernel_name", "sm90_ws_kernel_name", "sm90_instantiations", "SM90_SOURCE"]

SOURCE = "flash_bwd.cu"
HEADDIM_TILES = (32, 64, 96, 128, 192, 256)
_LOG2E = 1.4426950408889634
_ROWS_PER_CTA = 64   # preprocess / convert kernels: query rows per CTA (kRows in the source)
_SMALL_THREADS = 256


class BwdTile(NamedTuple):
    block_m: int   # query rows per block
    block_n: int   # keys per block
    n_warps: int
    # 2-D warp layouts of ``flash_bwd_dkdv2_kernel`` (all 0: the v1 kernel, ``flash_bwd_dkdv_kernel``):
    # warps along the keys for S^T / dP^T, along the keys for dK / dV, along the queries for dQ.
    s_wn: int = 0
    k_wn: int = 0
    q_wm: int = 0

    @property
    def v2(self) -> bool:
        return self.s_wn > 0


# Key-block kernel tiles, in order of preference; the first whose shared memory fits the device
# is used (H100/H200: 227 KiB per block, A100: 163 KiB, sm_86/89: 99 KiB). With block_n = 16 *
# n_warps every warp owns 16 keys over the whole head dim and P^T / dS^T feed the dV / dK
# products straight from registers ("register reuse"); head dims 192/256 need two warps per 16
# keys (dK + dV of 16 keys x 256 columns would be 256 fp32 registers per thread), so P^T goes
# through shared memory there. Registers (ptxas, sm_90a) decided the rest:
#   d32 : 128x128, 8 warps    d64: 128x128, 8 warps       (dK+dV 32/64 regs, S/dP in 64-col chunks)
#   d96 : 64x128, 8 warps     d128: 64x128, 8 warps       (dK+dV 96/128 regs, S/dP in 32-col chunks)
#   d192: 64x64, 8 warps      d256: 64x64, 8 warps        (warps split the head dim in two)
_DKDV_TILES: dict[int, tuple[BwdTile, ...]] = {
    32: (BwdTile(128, 128, 8), BwdTile(64, 128, 8)),
    64: (BwdTile(128, 128, 8), BwdTile(64, 128, 8), BwdTile(64, 64, 4)),
    96: (BwdTile(64, 128, 8), BwdTile(64, 64, 4)),
    128: (BwdTile(64, 128, 8, 4, 4, 2), BwdTile(64, 128, 8), BwdTile(32, 64, 4)),
    192: (BwdTile(64, 64, 8), BwdTile(32, 64, 8)),
    256: (BwdTile(64, 64, 8, 2, 2, 2), BwdTile(64, 64, 8), BwdTile(32, 64, 8)),
}
# 6-field tiles select flash_bwd_dkdv2_kernel (2-D warp layouts per product, FA2-style; P^T and
# dS^T through shared memory: ~25% fewer shared-memory bytes per mma at d128). Chosen on the
# H200 (2026-11-29, tests/diagnostics/sweep_tiles.py, backward alone, geomean of s2k and s16k):
#   d128: 263 vs 238 TFLOP/s (v1) full, 232 vs 213 causal;  d256: 201 vs 196, 186 vs 184.
#   d64: no v2 layout beat v1 (239 vs 237 full, 214 vs 218 causal): v1 stays.
# The v1 tiles behind them are the fallbacks for devices with less shared memory.


# Other v2 layouts the tuning sweep tries: listed so that CI compiles them too.
_EXTRA_V2_CANDIDATES: dict[int, tuple[BwdTile, ...]] = {
    64: (BwdTile(64, 128, 8, 4, 4, 2), BwdTile(128, 128, 8, 4, 4, 4)),
}


def _dkdv_table(d: int) -> tuple[BwdTile, ...]:
    return _DKDV_TILES[d]


# Deterministic dQ kernel: block_m = 16 * n_warps (one warp per 16 query rows), K/V
# double-buffered; dQ (16 x d per warp, d/2 fp32 registers per thread) lives in registers.
_DQ_TILES: dict[int, tuple[BwdTile, ...]] = {
    32: (BwdTile(128, 64, 8), BwdTile(64, 64, 4)),
    64: (BwdTile(128, 64, 8), BwdTile(64, 64, 4)),
    96: (BwdTile(128, 64, 8), BwdTile(64, 64, 4)),
    128: (BwdTile(128, 64, 8), BwdTile(64, 64, 4)),
    192: (BwdTile(64, 32, 4),),
    256: (BwdTile(64, 32, 4),),
}


def dkdv_tiles(d: int) -> tuple[BwdTile, ...]:
    return _dkdv_table(d)


def dq_tiles(d: int) -> tuple[BwdTile, ...]:
    return _DQ_TILES[d]


def dkdv_smem_bytes(d: int, t: BwdTile) -> int:
    """sK, sV + double-buffered sQ, sdO + sdS (+ sP without register reuse) + 2 x 2 x block_m fp32."""
    reuse = t.block_n // 16 == t.n_warps and not t.v2
    tiles = 2 * t.block_n * d + 4 * t.block_m * d + t.block_n * t.block_m * (1 if reuse else 2)
    return 2 * tiles + 4 * 4 * t.block_m


def dq_smem_bytes(d: int, t: BwdTile) -> int:
    """sQ, sdO + double-buffered sK, sV, 16-bit."""
    return 2 * (2 * t.block_m * d + 4 * t.block_n * d)


def headdim_tile(headdim: int) -> int:
    return smallest_tile(headdim, HEADDIM_TILES)


_ELEM = ELEM_TAGS


def _dkdv_name(elem: str, d: int, t: BwdTile, is_local: bool, has_softcap: bool, has_alibi: bool,
               even_d: bool, atomic_dq: bool, dropout: bool = False) -> str:
    if t.v2:
        return (f"flash_bwd_dkdv2_kernel<{elem}, {d}, {t.block_m}, {t.block_n}, {t.n_warps}, "
                f"{t.s_wn}, {t.k_wn}, {t.q_wm}, "
                f"{_b(is_local)}, {_b(has_softcap)}, {_b(has_alibi)}, {_b(even_d)}, {_b(atomic_dq)}, "
                f"{_b(dropout)}>")
    return (f"flash_bwd_dkdv_kernel<{elem}, {d}, {t.block_m}, {t.block_n}, {t.n_warps}, "
            f"{_b(is_local)}, {_b(has_softcap)}, {_b(has_alibi)}, {_b(even_d)}, {_b(atomic_dq)}, "
            f"{_b(dropout)}>")


def _dq_name(elem: str, d: int, t: BwdTile, is_local: bool, has_softcap: bool, has_alibi: bool,
             even_d: bool, dropout: bool = False) -> str:
    return (f"flash_bwd_dq_kernel<{elem}, {d}, {t.block_m}, {t.block_n}, {t.n_warps}, "
            f"{_b(is_local)}, {_b(has_softcap)}, {_b(has_alibi)}, {_b(even_d)}, {_b(dropout)}>")


def instantiations() -> list[str]:
    """Every template name :func:`launch_backward` can produce (CI compiles a sample)."""
    names = []
    flags = [(loc, cap, ali, even) for loc in (False, True) for cap in (False, True)
             for ali in (False, True) for even in (True, False)]
    for elem in ("fc_fp16", "fc_bf16"):
        names.append(f"flash_bwd_preprocess_kernel<{elem}>")
        names.append(f"flash_bwd_preprocess_kernel<{elem}, true>")   # (whole 64-row tiles)
        names.append(f"flash_bwd_convert_dq_kernel<{elem}>")
        for d in HEADDIM_TILES:
            for loc, cap, ali, even in flags:
                for t in _DKDV_TILES[d] + _EXTRA_V2_CANDIDATES.get(d, ()):
                    for atomic in (True, False):
                        for drop in (False, True):
                            names.append(_dkdv_name(elem, d, t, loc, cap, ali, even, atomic,
                                                    drop))
                for t in _DQ_TILES[d]:
                    for drop in (False, True):
                        names.append(_dq_name(elem, d, t, loc, cap, ali, even, drop))
    return names


# ---- the Hopper family (cuda/flash_bwd_sm90.cu: the dK/dV kernel on wgmma) ------------------
SM90_SOURCE = "flash_bwd_sm90.cu"
SM90_HEADDIMS = (64, 128)


def sm90_smem(headdim: int, block_m: int = 64) -> int:
    """K, V (128 x d), Q and dO (2 stages of block_m x d), dS^T (128 x block_m), lse and D (2
    stages of block_m each), + alignment; a 64 x 64 fp32 dQ staging tile per warpgroup
    (128-byte aligned)."""
    return (2 * (2 * 128 * headdim) + 2 * 2 * (2 * block_m * headdim) + 2 * 128 * block_m
            + 2 * 2 * block_m * 4 + 1024 + 128 + 2 * 64 * 64 * 4)


# On by default (compute capability 9.0): verified by the GPU suite on the H200. Head dim 64
# runs 128-query steps (a warpgroup per 64 queries: 1.19-1.27x SDPA flash forward+backward on
# the H200, against 0.91-1.03x with 64-query steps); FLASHCORE_SM90_BWD_D64_BM=64 for those.
def set_sm90(enabled: bool, d64_block_m: int | None = None) -> None:
    """Use the Hopper (wgmma) dK/dV kernel where it applies (compute capability 9.0, head dim
    64 or 128, no softcap or ALiBi, not deterministic): the ``flashcore.config`` settings
    ``sm90_bwd`` and ``sm90_bwd_d64_block_m`` (64 or 128 queries per step of the cp.async kernel
    at head dim 64; the warp-specialised one, the default, takes 128). On
    by default; FLASHCORE_SM90_BWD=0 in the environment."""
    config.set(sm90_bwd=bool(enabled),
               **({} if d64_block_m is None else {"sm90_bwd_d64_block_m": d64_block_m}))


def sm90_block_m(headdim: int) -> int:
    return config.get().sm90_bwd_d64_block_m if headdim == 64 else 64


def sm90_applies(cc: int, headdim: int, has_softcap: bool, has_alibi: bool,
                 deterministic: bool) -> bool:
    """A Hopper dK/dV kernel can take the call (head dim 256: dense calls only, see
    launch_backward)."""
    return (config.get().sm90_bwd and cc == 90 and headdim in SM90_HEADDIMS + (256,)
            and not has_softcap
            and not has_alibi and not deterministic)


def sm90_kernel_name(dtype_name: str, headdim: int, is_local: bool,
                     block_m: int | None = None, dropout: bool = False) -> str:
    bm = sm90_block_m(headdim) if block_m is None else block_m
    return (f"flash_bwd_dkdv_sm90_kernel<{_ELEM[dtype_name]}, {headdim}, {bm}, {_b(is_local)}, "
            f"{_b(dropout)}>")


# The warp-specialised dK/dV kernel: head dims 64 and 128. Its consumers have 240 registers;
# at head dim 128 it steps over 64 queries (measured on the H200, forward+backward against
# cuDNN: 0.76-0.85x against the cp.async kernel's 0.67-0.79x), at head dim 64 over 128 (each
# warpgroup's dQ tile: its own 64 query rows, all columns; 20-96 bytes spilled; run 47, the
# backward alone: 1.16-1.30x the cp.async kernel, 0.92-1.04x cuDNN).
SM90_WS_HEADDIMS = (64, 128)


def sm90_ws_block_m(headdim: int) -> int:
    """Queries per step of the warp-specialised dK/dV kernel."""
    return 128 if headdim == 64 else 64


def sm90_ws_kernel_name(dtype_name: str, headdim: int, is_local: bool, dropout: bool = False,
                        varlen: bool = False) -> str:
    """The warp-specialised dK/dV kernel (TMA producer, two consumer warpgroups); varlen: its
    instantiation over the packed arrays."""
    return (f"flash_bwd_dkdv_sm90_ws_kernel<{_ELEM[dtype_name]}, {headdim}, "
            f"{sm90_ws_block_m(headdim)}, "
            f"{_b(is_local)}, {_b(dropout)}{', true' if varlen else ''}>")


# The Hopper dK/dV kernels' dQ reduction, in tile order: the fp32 accumulator holds whole 64-row
# tiles (a varlen call's sequences each starting a tile), each in the order the kernel's threads
# store it, added with one bulk reduce-add a warpgroup a step; the preprocess kernel zeroes
# whole tiles, and its own convert kernel reads the order back (cuda/flash_bwd_sm90.cu). Run 36
# (H200): the backward alone +3-4% at d64, +16-22% at d128, +5-7% at d256 over red.global.add a
# fragment element; varlen calls within -5%..+2.5% of it.
def sm90_convert_tiled_name(dtype_name: str, headdim: int) -> str:
    """(Head dim 64: a warpgroup's tile holds all the columns; 128 and 256: two warpgroups'
    column groups.)"""
    return (f"flash_bwd_convert_dq_tiled_kernel<{_ELEM[dtype_name]}, {headdim}, "
            f"{1 if headdim == 64 else 2}>")


def sm90_ws_smem(headdim: int, block_m: int) -> int:
    """K, V (128 x d), Q and dO (2 stages of block_m x d), dS^T (2 buffers of 128 x block_m),
    lse and D (2 stages of block_m each), 5 mbarriers, + alignment; a 64 x 64 fp32 dQ staging
    tile per consumer warpgroup (128-byte aligned)."""
    return (2 * (2 * 128 * headdim) + 2 * 2 * (2 * block_m * headdim) + 2 * 2 * 128 * block_m
            + 2 * 2 * block_m * 4 + 8 * 5 + 1024 + 128 + 2 * 64 * 64 * 4)


# Head dim 256: its own warp-specialised kernel (64 keys per CTA, every product split between
# the two consumer warpgroups: dK and dV of 128 keys would not fit their registers). Dense calls
# whose arrays TMA can read, with the warp-specialised kernels on (``sm90_bwd_ws``); the others
# keep flash_bwd.cu's kernels.
SM90_D256_BLOCK = 64     # keys per CTA and queries per step


def sm90_d256_kernel_name(dtype_name: str, is_local: bool, dropout: bool = False,
                          varlen: bool = False) -> str:
    return (f"flash_bwd_dkdv_sm90_d256_kernel<{_ELEM[dtype_name]}, {_b(is_local)}, "
            f"{_b(dropout)}{', true' if varlen else ''}>")


def sm90_d256_smem() -> int:
    """K, V, Q and dO stages (six 64 x 256 tiles), P^T and dS^T (2 buffers of 64 x 64 each),
    lse and D (2 stages of 64 each), 5 mbarriers, + alignment: 231,464 bytes (the H100/H200
    opt-in limit is 232,448)."""
    return 6 * 2 * 64 * 256 + 4 * 2 * 64 * 64 + 2 * 2 * 64 * 4 + 8 * 5 + 1024


def sm90_instantiations() -> list[str]:
    flags = (False, True)
    dts = ("float16", "bfloat16")
    names = [sm90_kernel_name(dt, d, loc, bm, drop) for dt in dts
             for d, bm in ((64, 64), (64, 128), (128, 64)) for loc in flags for drop in flags]
    names += [sm90_ws_kernel_name(dt, d, loc, drop, vl) for dt in dts
              for d in SM90_WS_HEADDIMS for loc in flags for drop in flags for vl in flags]
    names += [sm90_d256_kernel_name(dt, loc, drop, vl) for dt in dts for loc in flags
              for drop in flags for vl in flags]
    return names + [sm90_convert_tiled_name(dt, d) for dt in dts for d in (64, 128, 256)]


@functools.lru_cache(maxsize=None)
def _pick(tiles, smem_fn, d: int, limit: int, what: str) -> tuple[BwdTile, int]:
    for t in tiles:
        n = smem_fn(d, t)
        if n <= limit:
            return t, n
    raise ValueError(
        f"flash backward ({what}): head dim tile {d} needs {smem_fn(d, tiles[-1])} bytes of shared "
        f"memory per block in its smallest configuration; this device allows {limit}")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def launch_backward(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, window_left: int,
                    window_right: int, softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, dropout_p: float = 0.0,
                    rng_state=None) -> None:
    """Compute dq, dk, dv (written in place) for attention with the forward's settings.
    Dropout (``dropout_p`` > 0): ``rng_state`` the forward's int64 (seed, offset) on the
    device; the mask is regenerated (both families).

    q, out, dout, dq: (b, sq, h, d); k, v, dk, dv: (b, sk, hk, d); or, varlen, (total, h, d) with
    int32 ``cu_seqlens_q/k`` (b + 1,). lse: float32 (b, h, sq) or, varlen, (h, total_q), as the
    forward wrote it (-inf for rows that see no key). Windows use -1 for unbounded; causal is
    (-1, 0). ``alibi_slopes``: None, float32 (h,) or (b, h). For GQA, dk/dv hold the sums over
    the query heads that share a key head. Returns the launches as a :class:`plans.Piece`, or
    None when they cannot be replayed with new addresses alone (copies were made).
    """
    from ..jit import device_facts, get_kernel

    xp = lib_of(q)
    given = (q, k, v, out, dout, lse, alibi_slopes)

    varlen = cu_seqlens_q is not None
    dtype_name = q.dtype.name
    elem = _ELEM[dtype_name]
    headdim = int(q.shape[-1])
    d = headdim_tile(headdim)
    even_d = headdim == d
    nheads, nheads_k = int(q.shape[-2]), int(k.shape[-2])

    device_id = q.device.id
    cc, smem_limit, _ = device_facts(device_id)

    if varlen:
        batch = int(cu_seqlens_q.shape[0]) - 1
        cu_seqlens_q = xp.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
        cu_seqlens_k = xp.ascontiguousarray(cu_seqlens_k, dtype=np.int32)
        # (no read of cu_seqlens: without the longest lengths, the packed totals bound them)
        if max_seqlen_q is None:
            max_seqlen_q = int(q.shape[0])
        if max_seqlen_k is None:
            max_seqlen_k = int(k.shape[0])
        seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        total_q = int(q.shape[0])
    else:
        batch, seqlen_q, seqlen_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        total_q = 0
    if batch == 0 or seqlen_k == 0:
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
        return None

    # Inputs the kernels read with cp.async / 16-byte loads; outputs written 4 bytes at a time.
    q, k, v, out, dout = (_as_input(a) for a in (q, k, v, out, dout))
    (dq_w, dq_back), (dk_w, dk_back), (dv_w, dv_back) = (_as_output(a) for a in (dq, dk, dv))
    # lse and D share one set of strides (lse_batch_stride, lse_head_stride, row stride 1).
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    dsoftmax_sum = xp.empty_like(lse)

    def bhr(arr):  # (batch, row, head) strides in elements
        st = _strides(arr)
        return (0, st[0], st[1]) if varlen else (st[0], st[1], st[2])

    q_b, q_r, q_h = bhr(q)
    k_b, k_r, k_h = bhr(k)
    v_b, v_r, v_h = bhr(v)
    o_b, o_r, o_h = bhr(out)
    do_b, do_r, do_h = bhr(dout)
    dq_b, dq_r, dq_h = bhr(dq_w)
    dk_b, dk_r, dk_h = bhr(dk_w)
    dv_b, dv_r, dv_h = bhr(dv_w)
    if varlen:
        lse_b, lse_h = 0, lse.strides[0] // 4
    else:
        lse_b, lse_h = lse.strides[0] // 4, lse.strides[1] // 4

    if alibi_slopes is not None:
        alibi_slopes = xp.ascontiguousarray(alibi_slopes, dtype=np.float32)
        alibi_b = nheads if alibi_slopes.ndim == 2 else 0

    wl, wr = _window(window_left), _window(window_right)
    is_local = not (wl == WINDOW_NONE and wr == WINDOW_NONE)
    dropout = bool(dropout_p) and dropout_p > 0.0
    if dropout:
        given = given + (rng_state,)
        rng_state = _int64_pair(rng_state)
    has_softcap = softcap is not None and softcap > 0.0
    has_alibi = alibi_slopes is not None

    # The dK/dV kernel: a Hopper one ("d256", "ws": warp-specialised, with their tensor maps
    # `ws`; "cpasync") or None (flash_bwd.cu's). Varlen calls take the warp-specialised ones
    # too, their maps over the packed arrays seen as one sequence (batch 1).
    cfg = config.get()
    hopper, ws = None, None
    if sm90_applies(cc, headdim, has_softcap, has_alibi, deterministic):
        from .tma import maps_for

        def as4(a):     # (varlen: (total, heads, headdim) -> (1, total, heads, headdim), a view)
            return a[None] if varlen else a
        if headdim == 256:
            if cfg.sm90_bwd_ws and sm90_d256_smem() <= smem_limit:
                ws = maps_for((as4(q), SM90_D256_BLOCK), (as4(k), SM90_D256_BLOCK),
                              (as4(v), SM90_D256_BLOCK), (as4(dout), SM90_D256_BLOCK))
                hopper = None if ws is None else "d256"
        else:
            hopper = "cpasync"
            if cfg.sm90_bwd_ws and headdim in SM90_WS_HEADDIMS:
                # boxes: 64 x block_m of q and dout, 64 x 128 of k and v
                bm = sm90_ws_block_m(headdim)
                ws = maps_for((as4(q), bm), (as4(k), 128), (as4(v), 128), (as4(dout), bm))
                hopper = "cpasync" if ws is None else "ws"
    dq_tiled = hopper is not None     # (the Hopper kernels add dQ in tile order)

    # Scratch: fp32 dQ accumulator, (b, h, sq, d_tile) or, varlen, (h, total_q, d_tile): each
    # block's dQ tile is one contiguous slab; rows past a sequence's end are never touched
    # (the tile-ordered dQ reduction: rows padded to whole 64-row tiles, each tile in the
    # kernel's own order, all of it zeroed and added to; varlen: sequence b's tiles start at
    # row (cu_seqlens_q[b] + 64 b) rounded down to a tile, so total_q + 64 batch rows hold
    # them all, BwdSeq::q_tile_off in flash_bwd.cu).
    # Uninitialised: the preprocess kernel zeroes the rows of every sequence before the dK/dV
    # kernel adds into them (one launch fewer than a separate fill).
    dq_accum = None
    dqa_b = dqa_r = dqa_h = 0
    if not deterministic:
        if varlen:
            rows = total_q + _ROWS_PER_CTA * batch if dq_tiled else total_q
            dq_accum = xp.empty((nheads, rows, d), dtype=np.float32)
            dqa_b, dqa_h, dqa_r = 0, rows * d, d
        else:   # (tile-ordered: whole 64-row tiles)
            rows = _cdiv(seqlen_q, _ROWS_PER_CTA) * _ROWS_PER_CTA if dq_tiled else seqlen_q
            dq_accum = xp.empty((batch, nheads, rows, d), dtype=np.float32)
            dqa_b, dqa_h, dqa_r = nheads * rows * d, rows * d, d

    def ptr(a):
        return None if a is None else a.data.ptr

    params = make_params(
        q=ptr(q), k=ptr(k), v=ptr(v), o=ptr(out), lse=ptr(lse), dout=ptr(dout),
        dq=ptr(dq_w), dk=ptr(dk_w), dv=ptr(dv_w), dq_accum=ptr(dq_accum),
        dsoftmax_sum=ptr(dsoftmax_sum),
        cu_seqlens_q=ptr(cu_seqlens_q) if varlen else None,
        cu_seqlens_k=ptr(cu_seqlens_k) if varlen else None,
        alibi_slopes=ptr(alibi_slopes),
        q_batch_stride=q_b, q_row_stride=q_r, q_head_stride=q_h,
        k_batch_stride=k_b, k_row_stride=k_r, k_head_stride=k_h,
        v_batch_stride=v_b, v_row_stride=v_r, v_head_stride=v_h,
        o_batch_stride=o_b, o_row_stride=o_r, o_head_stride=o_h,
        do_batch_stride=do_b, do_row_stride=do_r, do_head_stride=do_h,
        dq_batch_stride=dq_b, dq_row_stride=dq_r, dq_head_stride=dq_h,
        dk_batch_stride=dk_b, dk_row_stride=dk_r, dk_head_stride=dk_h,
        dv_batch_stride=dv_b, dv_row_stride=dv_r, dv_head_stride=dv_h,
        dq_accum_batch_stride=dqa_b, dq_accum_row_stride=dqa_r, dq_accum_head_stride=dqa_h,
        lse_batch_stride=lse_b, lse_head_stride=lse_h,
        alibi_batch_stride=alibi_b if has_alibi else 0,
        batch=batch, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=wl, window_right=wr,
        total_q=int(q.shape[0]) if varlen else 0, total_k=int(k.shape[0]) if varlen else 0,
        softmax_scale=float(softmax_scale), scale_log2=float(softmax_scale) * _LOG2E,
        softcap=float(softcap) if has_softcap else 0.0,
        dropout_rng=ptr(rng_state) if dropout else None,
        dropout_threshold=_dropout.threshold(dropout_p) if dropout else 0,
        dropout_scale=_dropout.keep_scale(dropout_p) if dropout else 0.0,
    )
    args = (as_kernel_arg(params),)
    launched = []   # (kernel, grid, block, shared memory), in order: the plan of this layout

    stream = device.current_stream(xp, device_id)

    def launch(kern, grid, block, smem=0, extra=()):
        kern(grid, block, args + extra, shared_mem=smem, stream=stream)
        launched.append((kern, grid, block, smem))

    with device.scope(device_id):
        m_small = _cdiv(seqlen_q, _ROWS_PER_CTA)
        if m_small > 0:
            pre = get_kernel(SOURCE, f"flash_bwd_preprocess_kernel<{elem}"
                             + (", true>" if dq_tiled else ">"), device_id, cc)
            launch(pre, (m_small, nheads, batch), (_SMALL_THREADS,))

        defines = cfg.sm90_defines if cc == 90 else ()   # (a diagnostic's: none by default)
        if hopper == "d256":
            smem = sm90_d256_smem()
            kern = get_kernel(SM90_SOURCE, sm90_d256_kernel_name(dtype_name, is_local, dropout,
                                                                 varlen),
                              device_id, cc, smem, defines)
            launch(kern, (_cdiv(seqlen_k, SM90_D256_BLOCK), nheads_k, batch), (384,), smem,
                   (ws[0].arg(),))
        elif hopper == "ws":
            smem = sm90_ws_smem(headdim, sm90_ws_block_m(headdim))
            kern = get_kernel(SM90_SOURCE, sm90_ws_kernel_name(dtype_name, headdim, is_local,
                                                               dropout, varlen),
                              device_id, cc, smem, defines)
            # (the other launches take the struct alone: cuLaunchKernel reads as many
            # parameters as a kernel declares, so a plan may pass the maps to all)
            launch(kern, (_cdiv(seqlen_k, 128), nheads_k, batch), (384,), smem, (ws[0].arg(),))
        elif hopper == "cpasync":
            bm = sm90_block_m(headdim)
            smem = sm90_smem(headdim, bm)
            kern = get_kernel(SM90_SOURCE, sm90_kernel_name(dtype_name, headdim, is_local,
                                                            dropout=dropout),
                              device_id, cc, smem, defines)
            launch(kern, (_cdiv(seqlen_k, 128), nheads_k, batch), (256,), smem)
        else:
            t, smem = _pick(_dkdv_table(d), dkdv_smem_bytes, d, smem_limit, "dK/dV kernel")
            name = _dkdv_name(elem, d, t, is_local, has_softcap, has_alibi, even_d,
                              not deterministic, dropout)
            kern = get_kernel(SOURCE, name, device_id, cc, smem, defines)
            launch(kern, (_cdiv(seqlen_k, t.block_n), nheads_k, batch), (32 * t.n_warps,), smem)

        if m_small > 0:
            if deterministic:
                t, smem = _pick(_DQ_TILES[d], dq_smem_bytes, d, smem_limit, "dQ kernel")
                name = _dq_name(elem, d, t, is_local, has_softcap, has_alibi, even_d, dropout)
                kern = get_kernel(SOURCE, name, device_id, cc, smem, defines)
                launch(kern, (_cdiv(seqlen_q, t.block_m), nheads, batch), (32 * t.n_warps,), smem)
            elif dq_tiled:
                conv = get_kernel(SM90_SOURCE, sm90_convert_tiled_name(dtype_name, headdim),
                                  device_id, cc, 0, defines)
                launch(conv, (m_small, nheads, batch), (_SMALL_THREADS,))
            else:
                conv = get_kernel(SOURCE, f"flash_bwd_convert_dq_kernel<{elem}>", device_id, cc)
                launch(conv, (m_small, nheads, batch), (_SMALL_THREADS,))

    piece = None
    if (dq_back is None and dk_back is None and dv_back is None
            and all(a is b for a, b in zip((q, k, v, out, dout, lse, alibi_slopes)
                                           + ((rng_state,) if dropout else ()), given))):
        scratch = {"dsoftmax_sum": dsoftmax_sum.nbytes}
        if dq_accum is not None:
            scratch["dq_accum"] = dq_accum.nbytes     # zeroed by the preprocess kernel
        maps = None if ws is None else list(zip(("q", "k", "v", "dout"), ws[1]))
        piece = plans.Piece(launched, params, scratch, maps=maps)

    for work, dest in ((dq_w, dq_back), (dk_w, dk_back), (dv_w, dv_back)):
        if dest is not None:
            dest[...] = work
    return piece
