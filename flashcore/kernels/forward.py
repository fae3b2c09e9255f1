"""Launcher for the forward kernel ``cuda/flash_fwd.cu`` (Ampere-class path, sm_80 and newer).

The caller (the CuPy backend) has validated shapes, dtypes and devices; this module picks the
tile configuration for the head dim, builds the template name and the ``FlashParams`` struct,
and launches on the current stream of the arrays' library (CuPy arrays, or torch tensors as
:class:`flashcore.kernels.device.TorchArray`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .common import (_as_input, _int64_pair, _strides, _used_strides_ok, elem_tag as _elem_tag,
                     kernel_dtype_name as _dtype_name, smallest_tile, tpl_bool as _b,
                     window_arg as _window)
import numpy as np

from .. import config
from .. import dropout as _dropout
from . import device, plans
from .device import lib_of
from .params import WINDOW_NONE, as_kernel_arg, make_params

__all__ = ["launch_forward", "kernel_name", "instantiations", "tile_config", "smem_bytes",
           "set_tile_override", "TileConfig", "HEADDIM_TILES", "set_sm90", "sm90_applies",
           "sm90_kernel_name", "sm90_ws_kernel_name", "sm90_instantiations", "SM90_SOURCE",
           "launch_forward_fp8", "fp8_kernel_name", "fp8_instantiations", "fp8_reasons",
           "FP8_HEADDIMS"]

SOURCE = "flash_fwd.cu"
HEADDIM_TILES = (32, 64, 96, 128, 192, 256)
_LOG2E = 1.4426950408889634


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    n_warps: int
    q_in_regs: bool


# Tile per head-dim tile (H100/H200: ~227 KiB shared memory per block, 64K registers per SM).
# Warp w owns 16 * kMT query rows, kMT = block_m / (16 * n_warps). With kMT = 2 every K / V
# fragment read by ldmatrix feeds two mma (half the shared-memory traffic per FLOP) but the
# O and S accumulators double. The choice was made on the ptxas report (sm_90a, 255 registers
# at most, zero spill bytes required for every variant):
#   d32 : 128x128, 8 warps, kMT=1, Q in regs  (40 KiB smem; tiny mma, softmax-bound: big key
#         blocks amortise the row reductions, 8 warps overlap ex2 with mma)
#   d64 : 128x64, 4 warps, kMT=2, Q in regs   (48 KiB; S 64 + O 64 + Q 32 fp32 regs; FA2 also
#         runs d64 with 32 rows per warp)
#   d96 : 128x64, 8 warps, kMT=1, Q in regs   (72 KiB)
#   d128: 128x64, 4 warps, kMT=2, Q from smem (64 KiB; FA2's tile. O 128 + S 64 regs per
#         thread: ptxas 13 spills 40 B (80 B causal), yet on the H200 it ran 355 TFLOP/s
#         against 293 for 128x64 / 8 warps / Q in regs (2026-11-29 sweep, tests/diagnostics/sweep_tiles.py):
#         each K/V fragment feeds two mma, halving shared-memory reads per FLOP)
#   d192: 128x64, 8 warps, kMT=1, Q from smem (144 KiB; Q in regs spills)
#   d256: 128x64, 8 warps, kMT=1, Q from smem (192 KiB; O alone is 128 regs per thread)
# K and V are double-buffered (prefetched one whole iteration ahead): 2 * 2 * block_n * d.
_TILES: dict[int, TileConfig] = {
    32: TileConfig(128, 128, 8, True),
    64: TileConfig(128, 64, 4, True),
    96: TileConfig(128, 64, 8, True),
    128: TileConfig(128, 64, 4, False),
    192: TileConfig(128, 64, 8, False),
    256: TileConfig(128, 64, 8, False),
}

# Variants whose extra per-score work (mask bounds, tanh, ALiBi distance) pushes the primary
# tile over the register limit use a lighter one (found by compiling every variant):
#   d64 : kMT=1 (8 warps) unless plain (no softcap / ALiBi) and not (local with an odd headdim)
#   d128: 128x64, 8 warps, Q in regs (no spills) with softcap, ALiBi or an odd headdim
#   d192: 32 keys per block when local with headdim < 192
#   d256: 32 keys per block when local with softcap or ALiBi
_FALLBACK: dict[int, TileConfig] = {
    64: TileConfig(128, 64, 8, True),
    128: TileConfig(128, 64, 8, True),
    192: TileConfig(128, 32, 8, False),
    256: TileConfig(128, 32, 8, False),
}


def _needs_fallback(d: int, is_local: bool, has_softcap: bool, has_alibi: bool,
                    is_even_d: bool) -> bool:
    if d == 64:
        return has_softcap or has_alibi or (is_local and not is_even_d)
    if d == 128:
        return has_softcap or has_alibi or not is_even_d
    if d == 192:
        return is_local and not is_even_d
    if d == 256:
        return is_local and (has_softcap or has_alibi)
    return False


# Benchmarking hook: tile_config() returns these first (never set in normal use; names made
# with an override are not in instantiations()).
_OVERRIDES: dict[int, TileConfig] = {}


def set_tile_override(headdim_tile_: int, cfg: TileConfig | None) -> None:
    """Force a tile configuration for one head-dim tile (for tuning sweeps); None clears it."""
    if cfg is None:
        _OVERRIDES.pop(headdim_tile_, None)
    else:
        cfg = TileConfig(*cfg)
        if cfg.block_m % (16 * cfg.n_warps) or cfg.block_n % 16:
            raise ValueError(f"invalid tile {cfg}: block_m % (16 * n_warps) and block_n % 16 "
                             "must be 0")
        _OVERRIDES[headdim_tile_] = cfg
    plans.clear()      # (after the change) recorded launches used the previous tiles


def tile_config(headdim_tile_: int, is_local: bool = False, has_softcap: bool = False,
                has_alibi: bool = False, is_even_d: bool = True) -> TileConfig:
    """Tile configuration for a head-dim tile and kernel variant."""
    if headdim_tile_ in _OVERRIDES:
        return _OVERRIDES[headdim_tile_]
    if _needs_fallback(headdim_tile_, is_local, has_softcap, has_alibi, is_even_d):
        return _FALLBACK[headdim_tile_]
    return _TILES[headdim_tile_]


def headdim_tile(headdim: int) -> int:
    """The smallest kernel head-dim tile that holds ``headdim`` (a multiple of 8, <= 256)."""
    return smallest_tile(headdim, HEADDIM_TILES)


def smem_bytes(d: int, cfg: TileConfig) -> int:
    """Dynamic shared memory of one CTA: Q tile + double-buffered K and V tiles, 16-bit."""
    return 2 * (cfg.block_m * d + 4 * cfg.block_n * d)


def kernel_name(dtype_name: str, headdim: int, is_local: bool, has_softcap: bool,
                has_alibi: bool, dropout: bool = False, paged: bool = False) -> str:
    """The NVRTC name expression of the kernel for these settings.

    ``headdim`` is the real head dim; the tile is the next size up and ``Is_even_d`` says
    whether they are equal. ``paged``: varlen over a paged cache (Is_paged).
    """
    d = headdim_tile(headdim)
    cfg = tile_config(d, is_local, has_softcap or dropout, has_alibi, headdim == d)
    return (f"flash_fwd_kernel<{_elem_tag(dtype_name)}, {d}, {cfg.block_m}, {cfg.block_n}, "
            f"{cfg.n_warps}, {_b(cfg.q_in_regs)}, {_b(is_local)}, {_b(has_softcap)}, "
            f"{_b(has_alibi)}, {_b(headdim == d)}, {_b(dropout)}"
            + (", true>" if paged else ">"))


def instantiations() -> list[str]:
    """Every template name :func:`launch_forward` can produce (CI compiles a sample)."""
    names = []
    for dt in ("float16", "bfloat16"):
        for d in HEADDIM_TILES:
            for even in (True, False):
                hd = d if even else d - 8   # any real headdim below the tile gives the same name
                for loc in (False, True):
                    for cap in (False, True):
                        for ali in (False, True):
                            for drop in (False, True):
                                for paged in (False, True):
                                    names.append(kernel_name(dt, hd, loc, cap, ali, drop, paged))
    return names


# ---- the Hopper family (cuda/flash_fwd_sm90.cu: wgmma from shared memory) ------------------
SM90_SOURCE = "flash_fwd_sm90.cu"
SM90_HEADDIMS = (64, 128, 256)


def _sm90_block_n(headdim: int) -> int:
    return 64 if headdim == 256 else 128        # BlockN<kD> in the source


def _sm90_pipelined(headdim: int, pipelined: bool) -> bool:
    return pipelined and headdim != 256           # v1's 3-stage ring does not fit at d256


def sm90_smem(headdim: int, pipelined: bool) -> int:
    """Q (128 x headdim) + 2 (v0) or 3 (v1) stages of K and V (block_n x headdim), 16-bit, +
    alignment slack."""
    stages = 3 if _sm90_pipelined(headdim, pipelined) else 2
    return 2 * 128 * headdim + stages * 2 * (2 * _sm90_block_n(headdim) * headdim) + 1024


# On by default (compute capability 9.0), v1: verified by the GPU suite on the H200, where v1
# measured at least as fast as v0 at head dims 64 and 128 (docs/performance-log.md).
# At head dim 64 the Hopper kernels take calls from sm90_fwd_d64_min_seqlen_k keys (512): the
# warp-specialised one measured 0.90-0.92x SDPA cuDNN at 512-1k against the Ampere-class
# kernel's 0.68-0.70 (causal 0.71-0.76 against 0.66-0.67; run 80, docs/performance-log.md).
def set_sm90(enabled: bool, pipelined: bool | None = None, ws: bool | None = None) -> None:
    """Use the Hopper (wgmma) forward kernels where they apply (compute capability 9.0, head
    dim 64, 128 or 256, no softcap or ALiBi): ``flashcore.config`` settings ``sm90_fwd``,
    ``sm90_fwd_ws`` (the warp-specialised TMA kernel for dense calls) and
    ``sm90_fwd_pipelined`` (the cp.async kernel's v1: the softmax of the next key block
    overlapped with P V of this one; head dim 256 always runs v0, the 3-stage ring does not
    fit). On by default; FLASHCORE_SM90=0 / FLASHCORE_SM90_WS=0 / FLASHCORE_SM90_PIPE=0 in the
    environment."""
    changes = {"sm90_fwd": bool(enabled)}
    if pipelined is not None:
        changes["sm90_fwd_pipelined"] = bool(pipelined)
    if ws is not None:
        changes["sm90_fwd_ws"] = bool(ws)
    config.set(**changes)


def set_sm90_defines(defines) -> None:
    """Compile the kernels for compute capability 9.0 (the Hopper forward and backward, and the
    decode kernels there) with these extra NVRTC options (a diagnostic; see cuda/wgmma.cuh):
    the ``sm90_defines`` setting."""
    config.set(sm90_defines=tuple(defines))


def sm90_applies(cc: int, headdim: int, has_softcap: bool, has_alibi: bool,
                 seqlen_k: int | None = None) -> bool:
    cfg = config.get()
    if headdim == 64 and seqlen_k is not None and seqlen_k < cfg.sm90_fwd_d64_min_seqlen_k:
        return False
    return (cfg.sm90_fwd and cc == 90 and headdim in SM90_HEADDIMS and not has_softcap
            and not has_alibi)


def sm90_kernel_name(dtype_name: str, headdim: int, is_local: bool,
                     pipelined: bool | None = None, dropout: bool = False) -> str:
    pipe = _sm90_pipelined(headdim, config.get().sm90_fwd_pipelined if pipelined is None else pipelined)
    return (f"flash_fwd_sm90_kernel<{_elem_tag(dtype_name)}, {headdim}, {_b(is_local)}, "
            f"{_b(pipe)}, {_b(dropout)}>")


# The warp-specialised kernel (TMA producer, block_m / 64 consumer warpgroups): (query rows per
# tile, keys per block, K/V ring depth) per (head dim, local). FA3's tiles: 192 x 128 at head
# dim 64 (three consumer warpgroups), 176-key blocks at head dim 128 when no window bounds the
# keys (its causal tile is 128 too), 80-key blocks at head dim 256 (measured on the H200: 1.05-
# 1.07x the 64-key blocks, session 21; the windowed tile keeps 64); the ring as deep as shared
# memory allows.
_WS_TILES = {(64, False): (192, 128, 3), (64, True): (192, 128, 3), (128, False): (128, 176, 2),
             (128, True): (128, 128, 2), (256, False): (128, 80, 2), (256, True): (128, 64, 2)}


def sm90_ws_tile(headdim: int, is_local: bool) -> tuple[int, int, int]:
    """(block_m, block_n, stages) of the warp-specialised kernel, with dropout or without (with
    fc_dropout_masks2 the dropout kernel fits three warpgroups' 160 registers at head dim 64
    without spills, NVRTC 12 and nvcc 13; measured on the H200, session 30 of the performance
    log: 1.12-1.19x the two-warpgroup tile it had)."""
    return _WS_TILES[(headdim, bool(is_local))]


_SMEM_LIMIT = 232448     # H100 / H200: the most dynamic shared memory a block may take


# The TMA-store epilogue against the registers' stores, on the H200 (same process, 3 rounds,
# TFLOP/s ratio to cuDNN at 2k / 4k / 16k; performance log, runs 62 and 66). First version (run
# 62): head dim 128 +1-5%, but head dim 64 6-9% slower and FP8 -4% to +2%: the epilogue
# branched on the thread's buffer address, ptxas took the branch for divergent and moved the
# main loop's barrier addresses out of uniform registers (d64: 20 of 20 barrier waits on vector
# registers against 8 of 20, 32-80 bytes of spills; main's d128 causal kernel too). With the
# branch on the uniform o_tma flag and the one thread's bulk operations as guarded
# instructions (run 66): d128 causal 0.99 / 1.00 / 1.08 against 0.91 / 0.96 / 1.03, d128 full
# 0.94 / 0.95 / 1.04 against 0.90 / 0.94 / 1.07, d256 causal 0.91 / 0.95 / 0.96 against
# 0.87 / 0.92 / 1.00, d64 level (+-2%), FP8 d128 +3% / +6% (4k full / causal), +1% / +1.5%
# (16k); geomean over the 18 cells 0.983 against 0.967. The FP8 kernel with softcap spills
# with buffers (8-36 bytes, persistent) and keeps the registers' stores.


def o_buffers(base_smem: int, block_m: int, headdim: int) -> int:
    """The O buffers of a 16-bit warp-specialised kernel whose other shared memory is
    ``base_smem`` (its TMA-store epilogue, ws_forward in cuda/flash_fwd_sm90.cu; 64 rows x
    headdim elements each): one per consumer warpgroup where they fit, else one that two
    consumers take in turn (its mbarrier: 8 bytes), else none (O stored from the registers):
    3 at head dim 64, 1 at 128 (176-key blocks leave 19 KiB), 2 at 128 with a window, none at
    256 (80-key blocks leave 2 KiB), 1 at 256 with a window; FP8 (e4m3 inputs, 16-bit output)
    2 at 128, none at 256."""
    cons, tile = block_m // 64, 128 * headdim
    if base_smem + cons * tile <= _SMEM_LIMIT:
        return cons
    if cons == 2 and base_smem + tile + 8 <= _SMEM_LIMIT:
        return 1
    return 0


def _o_bytes(bufs: int, headdim: int) -> int:
    return bufs * 128 * headdim + (8 if bufs == 1 else 0)


def _ws_base_smem(headdim: int, is_local: bool) -> int:
    """Q + the K/V ring + the mbarriers (8 bytes each: Q full and empty, 4 per stage, 4 of the
    tile scheduler) and its two int32 slots + alignment slack."""
    block_m, block_n, stages = sm90_ws_tile(headdim, is_local)
    return (2 * block_m * headdim + stages * 2 * (2 * block_n * headdim) + 8 * (7 + 4 * stages)
            + 1024)


def sm90_ws_o_buffers(headdim: int, is_local: bool) -> int:
    """The 16-bit warp-specialised kernel's O buffers (o_buffers)."""
    return o_buffers(_ws_base_smem(headdim, is_local), sm90_ws_tile(headdim, is_local)[0],
                     headdim)


def sm90_ws_smem(headdim: int, is_local: bool, o_tma: bool = True) -> int:
    """Q + the K/V ring + the mbarriers + the O buffers (o_buffers; none for a call whose
    output TMA cannot write, ``o_tma`` False) + alignment slack."""
    bufs = sm90_ws_o_buffers(headdim, is_local) if o_tma else 0
    return _ws_base_smem(headdim, is_local) + _o_bytes(bufs, headdim)


def sm90_ws_pingpong(headdim: int, seqlen_k: int, is_local: bool = False) -> bool:
    """Whether the consumers take turns (the ``sm90_fwd_pingpong`` setting; by default, as
    measured on the H200: at head dim 64, below 8k keys at 128 and 256, and at 256 without a
    window at any length, where the persistent 80-key kernel without ping-pong spills)."""
    pp = config.get().sm90_fwd_pingpong
    if pp is not None:
        return pp
    return headdim == 64 or seqlen_k < 8192 or (headdim == 256 and not is_local)


def ws_persistent_exists(headdim: int, is_local: bool = False, dropout: bool = False,
                         fp8: bool = False, pingpong: bool = True) -> bool:
    """Whether a persistent warp-specialised kernel exists for a call: its producer takes 40
    registers and the consumers 232, in which the FP8 one at head dim 256, at head dim 256 the
    windowed one and the 80-key one without ping-pong, and the dropout ones without ping-pong
    spill (ptxas), so those run one tile per CTA."""
    return (not (headdim == 256 and (fp8 or is_local or not pingpong))
            and not (dropout and not pingpong))


def sm90_ws_persistent(headdim: int, is_local: bool, dropout: bool = False,
                       fp8: bool = False, tiles: int = 0, pingpong: bool = True) -> bool:
    """Whether the warp-specialised kernels run persistent CTAs: the ``sm90_fwd_persistent``
    setting (on by default: measured on the H200, session 15 of the performance log), where
    such a kernel exists and the call's ``tiles`` fit the kernel's int32 tile numbers (with room
    for the scheduler's last fetches past the end)."""
    return (config.get().sm90_fwd_persistent and tiles < 2 ** 30
            and ws_persistent_exists(headdim, is_local, dropout, fp8, pingpong))


def ws_grid(persistent: bool, grid_m: int, nheads: int, batch: int, device_id: int,
            xp) -> tuple:
    """The warp-specialised kernels' grid and tile counter: ((query blocks, heads, batch),
    None), or, persistent, (one CTA per SM (at most one per tile), the address of the current
    stream's zeroed int32 counter, from which the CTAs take tiles and which the kernel leaves
    at zero: decode's split counters; ``xp`` the arrays' namespace, whose stream it is)."""
    if not persistent:
        return (grid_m, nheads, batch), None
    from ..jit import device_facts
    from .decode import split_counter
    return ((max(1, min(grid_m * nheads * batch, device_facts(device_id)[2])), 1, 1),
            split_counter(device_id, 1, xp))


def _ws_maps(qkv_rows, out, varlen: bool, bufs: int):
    """The tensor maps of a warp-specialised launch: q, k, v (``qkv_rows``: (array, box rows)
    each), then the output's (boxes of 64 rows) where the kernel has O buffers (``bufs``) and
    TMA can write ``out`` (a dense 16-bit array), else q's again (unused). Returns ``(maps,
    specs, roles, o_tma)``, or None when TMA cannot read q, k or v; where ``o_tma`` is False
    the call launches the instantiation without O buffers (its name and shared memory take
    ``o_tma``), so that a kernel with O buffers knows at compile time that it stores through
    them."""
    from .tma import maps_for
    o_tma = bool(bufs) and not varlen and out.dtype.itemsize == 2
    ws = maps_for(*qkv_rows, (_as4(out, varlen), 64)) if o_tma else None
    if ws is None:        # (no O buffers, or TMA cannot write ``out`` / read q, k or v)
        o_tma = False
        ws = maps_for(*qkv_rows, qkv_rows[0])
    if ws is None:
        return None
    return ws[0], ws[1], ("q", "k", "v", "o" if o_tma else "q"), o_tma


def _ws_piece(launch, params, ws, counter):
    """The launch plan of a warp-specialised launch (its tensor maps re-encoded per call; the
    tile counter, persistent, looked up per stream)."""
    from .decode import existing_split_counter
    return plans.Piece([launch], params, maps=list(zip(ws[2], ws[1])),
                       counter=None if counter is None
                       else ("split_counter", 1, existing_split_counter))


def sm90_ws_kernel_name(dtype_name: str, headdim: int, is_local: bool, dropout: bool = False,
                        seqlen_k: int = 0, pingpong: bool | None = None,
                        persistent: bool | None = None, varlen: bool = False,
                        o_tma: bool = True) -> str:
    """varlen: the instantiation for varlen calls (one tile a CTA, O stored from the
    registers); the others take the O buffers that fit (sm90_ws_o_buffers), except for an
    output that TMA cannot write (``o_tma`` False: float32, or strides a tensor map cannot
    take), which is stored from the registers by the instantiation without buffers: a kernel
    with O buffers always stores through them (_ws_maps)."""
    block_m, block_n, stages = sm90_ws_tile(headdim, is_local)
    pp = sm90_ws_pingpong(headdim, seqlen_k, is_local) if pingpong is None else pingpong
    pers = False if varlen else (sm90_ws_persistent(headdim, is_local, dropout, pingpong=pp)
                                 if persistent is None else persistent)
    bufs = 0 if varlen or not o_tma else sm90_ws_o_buffers(headdim, is_local)
    tail = ", true" if varlen else f", false, {bufs}" if bufs else ""
    return (f"flash_fwd_sm90_ws_kernel<{_elem_tag(dtype_name)}, {headdim}, {block_m}, {block_n}, "
            f"{_b(is_local)}, {_b(dropout)}, {stages}, {_b(pp)}, {_b(pers)}{tail}>")


def sm90_instantiations() -> list[str]:
    """Every template name of the Hopper forward (compiled for sm_90a only), the FP8 kernel's
    included."""
    flags = (False, True)
    return sorted({sm90_kernel_name(dt, d, loc, pipe, drop) for dt in ("float16", "bfloat16")
                   for d in SM90_HEADDIMS for loc in flags for pipe in flags for drop in flags}
                  | {sm90_ws_kernel_name(dt, d, loc, drop, pingpong=pp, persistent=pers,
                                         o_tma=ot)
                     for dt in ("float16", "bfloat16") for d in SM90_HEADDIMS for loc in flags
                     for drop in flags for pp in flags for pers in flags for ot in flags
                     if ws_persistent_exists(d, loc, drop, pingpong=pp) or not pers}
                  | {sm90_ws_kernel_name(dt, d, loc, drop, pingpong=pp, varlen=True)
                     for dt in ("float16", "bfloat16") for d in SM90_HEADDIMS for loc in flags
                     for drop in flags for pp in flags}
                  | set(fp8_instantiations()))


# ---- the FP8 forward (cuda/flash_fwd_sm90.cu: flash_fwd_sm90_fp8_kernel) ---------------------
# float8_e4m3fn q, k, v (CuPy uint8 arrays of the bits), compute capability 9.0, dense calls
# whose arrays TMA can read (others are copied into contiguous ones first), varlen (packed) and
# softcap calls included.
FP8_HEADDIMS = (128, 256)
FP8_MIN_COMPUTE_CAPABILITY = FP8_MAX_COMPUTE_CAPABILITY = 90
FP8_OUT_DTYPES = ("bfloat16", "float16", "float32")
# (keys per block, K / V^T ring depth) per head dim. Head dim 128: 192-key blocks, FA3's
# direction there (V^T in two 128-key chunks, two stages: 177 KiB; measured on the H200, run 48
# of the performance log: +3-7% over 128-key blocks with three stages, 4k and 16k, causal and
# not). Head dim 256: 128-key blocks (one 128-byte V^T row), the ring as deep as shared memory
# allows next to the producer's two raw V buffers (Q 32 KiB + 2 x (K 32 + V^T 32) + raw 2 x 32
# = 224 KiB).
_FP8_TILES = {128: (192, 2), 256: (128, 2)}


def fp8_tile(headdim: int) -> tuple[int, int]:
    """(block_n, stages) of the FP8 kernel."""
    return _FP8_TILES[headdim]


def _fp8_base_smem(headdim: int) -> int:
    block_n, stages = fp8_tile(headdim)
    vt_keys = -(-block_n // 128) * 128
    return (128 * headdim + (stages + 2) * block_n * headdim + stages * vt_keys * headdim
            + 8 * (9 + 4 * stages) + 1024)


def fp8_o_buffers(headdim: int, softcap: bool = False) -> int:
    """The FP8 kernel's O buffers (o_buffers); none with softcap (its persistent kernels spill
    with them)."""
    return 0 if softcap else o_buffers(_fp8_base_smem(headdim), 128, headdim)


def fp8_smem(headdim: int, softcap: bool = False, o_tma: bool = True) -> int:
    """Q + the K and V^T rings + the raw V ring (2) + the mbarriers (2 Q, 4 per stage, 2 raw, 4
    of the tile scheduler) and its two int32 slots + the O buffers (fp8_o_buffers; none for
    an output that TMA cannot write, ``o_tma`` False) + alignment slack, 1-byte elements. (A
    V^T stage holds whole 128-key chunks: 256 keys' room at 192-key blocks.)"""
    bufs = fp8_o_buffers(headdim, softcap) if o_tma else 0
    return _fp8_base_smem(headdim) + _o_bytes(bufs, headdim)


def fp8_pingpong() -> bool:
    """Whether the FP8 kernel's consumers take turns (the ``sm90_fwd_pingpong`` setting; by
    default on: with products at twice the 16-bit rate the softmax is the longer pipe, and
    ping-pong runs one warpgroup's under the other's products; measured on the H200 in session
    14 of the performance log, on and off within 2% of each other at d128 and d256)."""
    pp = config.get().sm90_fwd_pingpong
    return True if pp is None else pp


def fp8_kernel_name(out_dtype: str, headdim: int, is_local: bool,
                    pingpong: bool | None = None, persistent: bool | None = None,
                    varlen: bool = False, softcap: bool = False, o_tma: bool = True) -> str:
    """``out_dtype``: bfloat16 or float16 (the kernel's Elem), or float32 (Elem unused: the
    bfloat16 instantiation without O buffers writes float32 with ``o_fp32``). Varlen calls:
    one tile a CTA. ``o_tma`` False: an output that TMA cannot write, stored from the
    registers by the instantiation without O buffers (as sm90_ws_kernel_name)."""
    block_n, stages = fp8_tile(headdim)
    elem = _elem_tag("bfloat16" if out_dtype == "float32" else out_dtype)
    pp = fp8_pingpong() if pingpong is None else pingpong
    pers = False if varlen else (sm90_ws_persistent(headdim, is_local, fp8=True)
                                 if persistent is None else persistent)
    bufs = 0 if varlen or not o_tma or out_dtype == "float32" else fp8_o_buffers(headdim,
                                                                                 softcap)
    tail = (f", false, {_b(softcap)}, {bufs}>" if bufs else
            f", {_b(varlen)}, true>" if softcap else ", true>" if varlen else ">")
    return (f"flash_fwd_sm90_fp8_kernel<{elem}, {headdim}, {block_n}, {_b(is_local)}, "
            f"{stages}, {_b(pp)}, {_b(pers)}" + tail)


def fp8_instantiations() -> list[str]:
    """Every template name of the FP8 forward (dense: one tile a CTA or persistent; varlen;
    each with and without softcap)."""
    flags = (False, True)
    return sorted({fp8_kernel_name(dt, d, loc, pp, pers, var, cap, ot)
                   for dt in ("float16", "bfloat16") for d in FP8_HEADDIMS for loc in flags
                   for pp in flags for pers in flags for var in flags for cap in flags
                   for ot in flags
                   if (ws_persistent_exists(d, loc, fp8=True) or not pers)
                   and not (var and pers)})


def _check_grid(batch: int, nheads: int, softmax_scale: float) -> None:
    """What every forward launch needs of its arguments beyond the spec's checks."""
    if not softmax_scale > 0.0:
        # The kernels keep raw scores and fold the scale into the exponent, which assumes
        # a positive scale (the row max of s is the row max of s * scale).
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    if nheads > 65535 or batch > 65535:
        raise ValueError(f"the forward grid allows at most 65535 heads and 65535 sequences "
                         f"(got nheads={nheads}, batch={batch})")


def fp8_reasons(cc: int, headdim: int, *, alibi=False, paged=False, dropout=False) -> list[str]:
    """Why the FP8 kernel cannot run a call (each reason names its argument), or []."""
    r = []
    if not config.get().sm90_fp8_fwd:
        r.append("argument 'q': float8_e4m3fn inputs on the GPU need the Hopper FP8 forward "
                 "kernel, which is turned off (FLASHCORE_SM90_FP8_FWD=0 or "
                 "flashcore.config.set(sm90_fp8_fwd=False)); NumPy arrays and torch CPU tensors "
                 "run on the NumPy reference")
    if not FP8_MIN_COMPUTE_CAPABILITY <= cc <= FP8_MAX_COMPUTE_CAPABILITY:
        r.append(f"argument 'q': float8_e4m3fn inputs run on compute capability 9.0 (Hopper: "
                 f"FP8 wgmma), this device has {cc / 10:.1f}")
    if headdim not in FP8_HEADDIMS:
        r.append(f"argument 'q': float8_e4m3fn inputs take headdim 128 or 256 on the GPU, got "
                 f"headdim {headdim}")
    if paged:
        r.append("argument 'block_table': None with float8_e4m3fn inputs on the GPU (the "
                 "warp-specialised TMA kernel reads dense or packed arrays, not a paged cache)")
    if alibi:
        r.append("argument 'alibi_slopes': None with float8_e4m3fn inputs on the GPU")
    if dropout:
        r.append("argument 'dropout_p': 0.0 with float8_e4m3fn inputs")
    return r


def _fp8_bytes(arr):
    """An FP8 input as the tensor maps read it: uint8, base and used strides multiples of 16
    bytes (else a contiguous copy)."""
    return _as_input(arr, 16)


def _as4(a, varlen: bool):
    """The tensor maps' view of an input: varlen (total, heads, headdim) as (1, total, ...)."""
    return a[None] if varlen else a


def _geometry(q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, max_seqlen_k, block_table=None):
    """A forward launch's (batch, seqlen_q, seqlen_k, capacity, strides): dense (b, s, h, d)
    arrays, or varlen (total, h, d) ones with int32 ``cu_seqlens_q`` (b + 1,), k and v paged
    (num_blocks, page_size, h_k, d) with ``block_table``. ``capacity``: the key rows a varlen
    sequence can hold; ``strides``: make_params' stride arguments, in elements (varlen: no
    batch stride, the row offset comes from cu_seqlens; paged: the block stride)."""
    qs, ks, vs, os_ = _strides(q), _strides(k), _strides(v), _strides(out)
    if cu_seqlens_q is None:
        batch, seqlen_q, seqlen_k, capacity = int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), 0
        lse_st = (lse.strides[0] // 4, lse.strides[1] // 4)
    else:
        paged = block_table is not None
        batch = int(cu_seqlens_q.shape[0]) - 1
        # (no read of cu_seqlens: without the longest lengths, the packed totals bound them)
        capacity = int(block_table.shape[1]) * int(k.shape[1]) if paged else int(k.shape[0])
        seqlen_q = int(q.shape[0]) if max_seqlen_q is None else int(max_seqlen_q)
        seqlen_k = min(capacity if max_seqlen_k is None else int(max_seqlen_k), capacity)
        qs, os_ = (0,) + qs, (0,) + os_
        if not paged:
            ks, vs = (0,) + ks, (0,) + vs
        lse_st = (0, lse.strides[0] // 4)
    strides = {}
    for name, st in zip("qkvo", (qs, ks, vs, os_)):
        strides.update({f"{name}_batch_stride": st[0], f"{name}_row_stride": st[1],
                        f"{name}_head_stride": st[2]})
    strides.update(lse_batch_stride=lse_st[0], lse_head_stride=lse_st[1])
    return batch, seqlen_q, seqlen_k, capacity, strides


def launch_forward_fp8(q, k, v, out, lse, *, softmax_scale: float, window_left: int,
                       window_right: int, q_descale=None, k_descale=None, v_descale=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, softcap: float = 0.0):
    """Run the FP8 forward: ``out`` and ``lse`` written in place.

    q (b, sq, h, d), k and v (b, sk, h_k, d): uint8 CuPy arrays of float8_e4m3fn bits, d 128 or
    256; or, varlen, (total, h, d) with int32 ``cu_seqlens_*`` (b + 1,) (the longest lengths
    bound by the totals when not given, as launch_forward); out like q in bfloat16, float16 or
    float32; lse float32 (b, h, sq) or, varlen, (h, total_q), contiguous; ``softcap`` > 0:
    the scores capped (softcap tanh(s / softcap), after the scale); descales None (1) or
    contiguous float32 (b, h_k) CuPy arrays. Windows use -1 for unbounded. The caller has
    checked the device (compute capability 9.0). Returns the launch as a :class:`plans.Piece`,
    or None (a copy was involved, or nothing was launched).
    """
    from ..jit import device_facts, get_kernel

    xp = lib_of(q)
    given = (q, k, v)
    q, k, v = _fp8_bytes(q), _fp8_bytes(k), _fp8_bytes(v)
    out_final = None
    if out.size and not _used_strides_ok(out, 8 if out.dtype.itemsize == 2 else 4, 16):
        out_final, out = out, xp.empty(out.shape, out.dtype)
    varlen = cu_seqlens_q is not None
    nheads, headdim, nheads_k = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
    batch, seqlen_q, seqlen_k, _, strides = _geometry(q, k, v, out, lse, cu_seqlens_q,
                                                      max_seqlen_q, max_seqlen_k)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return None
    _check_grid(batch, nheads, softmax_scale)
    device_id = q.device.id
    cc = device_facts(device_id)[0]
    has_softcap = softcap is not None and softcap > 0.0
    why = fp8_reasons(cc, headdim)
    if why:
        raise ValueError("; ".join(why))
    wl, wr = _window(window_left), _window(window_right)
    is_local = wl != WINDOW_NONE or wr != WINDOW_NONE
    block_n = fp8_tile(headdim)[0]
    ws = _ws_maps(tuple((_as4(a, varlen), rows) for a, rows in ((q, 128), (k, block_n), (v, block_n))),
                  out, varlen, fp8_o_buffers(headdim, has_softcap))
    if ws is None:       # (cannot happen for the arrays _fp8_bytes makes)
        raise ValueError("the FP8 forward's tensor maps could not be encoded for these arrays")
    out_dtype = out.dtype.name
    smem = fp8_smem(headdim, has_softcap, ws[3])
    grid_m = math.ceil(seqlen_q / 128)
    persistent = not varlen and sm90_ws_persistent(headdim, is_local, fp8=True,
                                                   tiles=grid_m * nheads * batch)
    kernel = get_kernel(SM90_SOURCE, fp8_kernel_name(out_dtype, headdim, is_local,
                                                     persistent=persistent, varlen=varlen,
                                                     softcap=has_softcap, o_tma=ws[3]),
                        device_id, cc, smem, config.get().sm90_defines)
    params = make_params(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
        cu_seqlens_q=cu_seqlens_q.data.ptr if varlen else None,
        cu_seqlens_k=cu_seqlens_k.data.ptr if varlen else None,
        total_q=int(q.shape[0]) if varlen else 0, total_k=int(k.shape[0]) if varlen else 0,
        **strides, batch=batch, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=wl, window_right=wr,
        o_fp32=int(out.dtype == np.float32), o_tma=int(ws[3]),
        # (softcap: the kernel holds t = tanh(scaled score / softcap), its softmax's exponent
        # is softcap (t - max t): the softcap times log2(e))
        softmax_scale=float(softmax_scale),
        scale_log2=float(softcap) * _LOG2E if has_softcap else float(softmax_scale) * _LOG2E,
        softcap=float(softcap) if has_softcap else 0.0,
        q_descale=None if q_descale is None else q_descale.data.ptr,
        k_descale=None if k_descale is None else k_descale.data.ptr,
        v_descale=None if v_descale is None else v_descale.data.ptr,
    )
    grid, counter = ws_grid(persistent, grid_m, nheads, batch, device_id, xp)
    if counter is not None:
        params["split_counter"] = counter
    block = (384, 1, 1)
    with device.scope(device_id):
        kernel(grid, block, (as_kernel_arg(params), ws[0].arg()), shared_mem=smem,
               stream=device.current_stream(xp, device_id))
        if out_final is not None:
            out_final[...] = out
    if out_final is None and all(a is b for a, b in zip((q, k, v), given)):
        return _ws_piece((kernel, grid, block, smem), params, ws, counter)
    return None


def launch_forward(q, k, v, out, lse, *, softmax_scale: float, window_left: int,
                   window_right: int, softcap: float = 0.0, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, block_table=None, dropout_p: float = 0.0,
                   rng_state=None) -> None:
    """Run the forward kernel: ``out`` and ``lse`` are written in place.

    q, k, v, out: (b, s, h, d) or, varlen, (total, h, d) with int32 ``cu_seqlens_*`` (b + 1,).
    Varlen over a paged cache: k, v (num_blocks, page_size, h_k, d) with an int32
    ``block_table`` (b, max_blocks); cu_seqlens_k then gives the key lengths only (both
    families; page_size a multiple of 16). Dropout (``dropout_p`` > 0): ``rng_state``
    an int64 (seed, offset) CuPy array, the stream of flashcore.dropout (both families).
    lse: float32 (b, h, sq) or, varlen, (h, total_q), contiguous. Windows use -1 for unbounded.
    ``out`` may be float32 (16-bit inputs): the output is then written unrounded.
    Returns the launch as a :class:`plans.Piece`, or None when it cannot be replayed with new
    addresses alone (an input or the output went through a copy; nothing was launched).
    """
    xp = lib_of(q)
    given = (q, k, v)
    given_table = block_table
    dropout = bool(dropout_p) and dropout_p > 0.0
    given_rng = rng_state
    if dropout:
        rng_state = _int64_pair(rng_state)

    # cp.async and the 16-byte output stores move 8 elements at a time: inputs with other
    # strides (or unaligned bases) are copied; an output like that is written through a
    # temporary and copied back.
    q, k, v = _as_input(q), _as_input(k), _as_input(v)
    paged = block_table is not None
    if paged:
        block_table = block_table if block_table.dtype == np.int32 else \
            block_table.astype(np.int32)
        if block_table.strides[-1] != 4:
            block_table = xp.ascontiguousarray(block_table)
    out_final = None
    if out.size and not _used_strides_ok(out, 8, 16):
        out_final, out = out, xp.empty(out.shape, out.dtype)
    varlen = cu_seqlens_q is not None
    dtype_name = _dtype_name(q)
    headdim = int(q.shape[-1])
    nheads, nheads_k = int(q.shape[-2]), int(k.shape[-2])
    batch, seqlen_q, seqlen_k, capacity, strides = _geometry(
        q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, max_seqlen_k, block_table)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return None
    _check_grid(batch, nheads, softmax_scale)

    wl, wr = _window(window_left), _window(window_right)
    is_local = wl != WINDOW_NONE or wr != WINDOW_NONE
    has_softcap = softcap is not None and softcap > 0.0
    has_alibi = alibi_slopes is not None

    from ..jit import device_facts, get_kernel
    device_id = q.device.id
    cc = device_facts(device_id)[0]
    ws = None     # (maps, specs, roles, o_tma): the warp-specialised Hopper kernel
    persistent = False
    # Paged K/V (varlen): the warp-specialised kernel's windowed varlen instantiation (its key
    # blocks divide pages of 128 and 256, which TMA reads a block at a time; other pages its
    # producer copies with cp.async; no window bounds the keys unless the call's does); the
    # Ampere-class kernel where the warp-specialised one is off or TMA cannot read the arrays.
    cfg_ = config.get()
    use_sm90 = sm90_applies(cc, headdim, has_softcap, has_alibi, seqlen_k) \
        and (not paged or cfg_.sm90_fwd_ws)
    ws_local = is_local or paged
    if use_sm90 and cfg_.sm90_fwd_ws:
        block_m, block_n, _ = sm90_ws_tile(headdim, ws_local)
        # (a paged map's boxes: whole key blocks, or, where the producer copies, unused)
        kv_rows = block_n if not paged or int(k.shape[1]) % block_n == 0 else 16
        ws = _ws_maps(((_as4(q, varlen), block_m),
                       (k if paged else _as4(k, varlen), kv_rows),
                       (v if paged else _as4(v, varlen), kv_rows)),
                      out, varlen, sm90_ws_o_buffers(headdim, ws_local))
        use_sm90 = ws is not None or not paged
    if use_sm90:
        grid_m = math.ceil(seqlen_q / (block_m if ws is not None else 128))
        if ws is not None:
            smem = sm90_ws_smem(headdim, ws_local, ws[3])
            pingpong = sm90_ws_pingpong(headdim, seqlen_k, ws_local)
            persistent = not varlen and sm90_ws_persistent(headdim, is_local, dropout,
                                                           tiles=grid_m * nheads * batch,
                                                           pingpong=pingpong)
            kernel = get_kernel(SM90_SOURCE, sm90_ws_kernel_name(dtype_name, headdim, ws_local,
                                                                 dropout, seqlen_k, pingpong,
                                                                 persistent=persistent,
                                                                 varlen=varlen, o_tma=ws[3]),
                                device_id, cc, smem, cfg_.sm90_defines)
            block = (128 + 2 * block_m, 1, 1)
        else:
            smem = sm90_smem(headdim, cfg_.sm90_fwd_pipelined)
            kernel = get_kernel(SM90_SOURCE, sm90_kernel_name(dtype_name, headdim, is_local,
                                                              dropout=dropout),
                                device_id, cc, smem, cfg_.sm90_defines)
            block = (256, 1, 1)
    else:
        d = headdim_tile(headdim)
        cfg = tile_config(d, is_local, has_softcap or dropout, has_alibi, headdim == d)
        name = kernel_name(dtype_name, headdim, is_local, has_softcap, has_alibi, dropout,
                           paged)
        smem = smem_bytes(d, cfg)
        kernel = get_kernel(SOURCE, name, device_id, cc, smem)
        grid_m, block = math.ceil(seqlen_q / cfg.block_m), (cfg.n_warps * 32, 1, 1)

    alibi_bs = 0
    if has_alibi and alibi_slopes.ndim == 2:
        alibi_bs = alibi_slopes.strides[0] // 4
    params = make_params(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
        cu_seqlens_q=cu_seqlens_q.data.ptr if varlen else None,
        cu_seqlens_k=cu_seqlens_k.data.ptr if varlen else None,
        alibi_slopes=alibi_slopes.data.ptr if has_alibi else None,
        **strides,
        alibi_batch_stride=alibi_bs,
        batch=batch, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=wl, window_right=wr,
        total_q=int(q.shape[0]) if varlen else 0,
        total_k=(batch * capacity if paged else int(k.shape[0])) if varlen else 0,
        block_table=block_table.data.ptr if paged else None,
        block_table_batch_stride=block_table.strides[0] // 4 if paged else 0,
        page_size=int(k.shape[1]) if paged else 0, num_blocks=int(k.shape[0]) if paged else 0,
        o_fp32=int(out.dtype == np.float32), o_tma=int(ws is not None and ws[3]),
        dropout_rng=rng_state.data.ptr if dropout else None,
        dropout_threshold=_dropout.threshold(dropout_p) if dropout else 0,
        dropout_scale=_dropout.keep_scale(dropout_p) if dropout else 0.0,
        softmax_scale=float(softmax_scale),
        # With softcap the kernel works on capped scores in natural units: only log2(e) left.
        scale_log2=_LOG2E if has_softcap else float(softmax_scale) * _LOG2E,
        softcap=float(softcap) if has_softcap else 0.0,
    )
    grid, counter = ws_grid(persistent, grid_m, nheads, batch, device_id, xp)
    if counter is not None:
        params["split_counter"] = counter
    args = (as_kernel_arg(params),) if ws is None else (as_kernel_arg(params), ws[0].arg())
    with device.scope(device_id):
        kernel(grid, block, args, shared_mem=smem, stream=device.current_stream(xp, device_id))
        if out_final is not None:
            out_final[...] = out
    if out_final is None and all(a is b for a, b in zip((q, k, v), given)) \
            and (not paged or block_table is given_table) \
            and (not dropout or rng_state is given_rng):
        if ws is None:
            return plans.Piece([(kernel, grid, block, smem)], params)
        return _ws_piece((kernel, grid, block, smem), params, ws, counter)
    return None
