"""Launcher for the KV-cache decoding kernels ``cuda/flash_decode.cu`` (mma.sync, sm_80 and newer;
the cluster merge on sm_90).

``launch_decode`` runs attention of a few query rows against a KV cache (contiguous or paged),
with split-KV (Flash-Decoding) and GQA head packing; ``launch_rotary_append`` writes new k/v
rows into the cache, optionally applying rotary embedding to them (and to q).

Split-KV merges the splits' partial results in the decode kernel itself, so a split call is
one launch. On sm_90 with 2 to 16 splits the splits of each (sequence, kv head, m-block) form a
thread-block cluster and merge through distributed shared memory
(``flash_decode_cluster_kernel``; ``FLASHCORE_DECODE_CLUSTER=0`` or ``set_cluster_merge(False)``
turns it off). Otherwise the fused combine: the last CTA of each group to finish merges, counted
on a persistent int32 arrival counter per (device, stream) that the kernel leaves at zero.
``FLASHCORE_DECODE_FUSED_COMBINE=0`` in the environment, or ``set_fused_combine(False)``, selects
the two-kernel path (decode, then ``flash_decode_combine_kernel``). All three merge with the same
arithmetic in the same order: on the same tiles they give the same bits.

The caller has validated shapes, dtypes and devices. Arrays are CuPy arrays or
:class:`flashcore.kernels.device.TorchArray` (see that module).
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

from .common import (_as_input, _strides, _strides_fit, _used_strides_ok, elem_tag as _elem_tag,
                     kernel_dtype_name as _dtype_name, smallest_tile, tpl_bool as _b,
                     window_arg as _window)
import numpy as np

from .. import config
from . import device, plans
from .device import lib_of
from .params import WINDOW_NONE, as_kernel_arg, make_params

__all__ = ["launch_decode", "launch_rotary_append", "instantiations", "num_splits_heuristic",
           "choose_num_splits",
           "kernel_name", "combine_name", "append_name", "DecodeConfig", "decode_config",
           "HEADDIM_TILES", "MAX_SPLITS", "set_fused_combine", "fused_combine_enabled",
           "split_counter", "MAX_CLUSTER", "set_cluster_merge", "cluster_merge_enabled",
           "cluster_kernel_name", "sm90_instantiations"]

SOURCE = "flash_decode.cu"
HEADDIM_TILES = (64, 128, 256)
FP8_HEADDIMS = (128, 256)     # head dims of the FP8-cache kernels (a 16-byte chunk: 16 columns)
# FP8 caches, measured on the H200 (GQA 32/8, d128, bf16 q): session 12, 32 splits of 4k keys
# ran batch 1 / 128k in 115.8 us (the default rule's 8 splits: 253.4; the bf16 cache 140.7).
# With the fragments built in registers (session 14), batch 8 / 128k (64 groups) ran best on
# the default rule's 2 splits: 492.8 us against 532.1 for 32 (bf16 953.9). Hence: from 64k
# keys, at most 32 (batch, kv head, m-block) groups.
_FP8_MANY_SPLITS_MIN_KEYS = 65536
_FP8_MANY_SPLITS_MAX_GROUPS = 32
MAX_SPLITS = 256          # the combine's shared weight table (fc_dec::kMaxSplits)
_SPLIT_CAP = 128          # the heuristic never goes beyond this
_LOG2E = 1.4426950408889634
_SMEM_PER_SM = 233472     # H100/H200: 228 KiB per SM (1 KiB of it reserved per CTA)


class DecodeConfig(NamedTuple):
    block_n: int   # keys per pipeline stage
    n_warps: int   # warps per CTA, each owning block_n / n_warps keys of a stage
    stages: int    # cp.async ring depth


# Every stage holds K and V of block_n keys: 32 KiB at d64/d128 (three stages: two CTAs per
# SM, ~192 KiB of loads in flight per SM) and 64 KiB at d256 (one CTA per SM).
_CONFIGS = {
    64: DecodeConfig(128, 4, 3),
    128: DecodeConfig(64, 4, 3),
    256: DecodeConfig(64, 4, 3),
}
# The split kernels that merge inside a cluster (sm_90) run few CTAs, one per SM: at d128 they
# take 128-key stages (three stages, 192 KiB: one CTA per SM, 128 KiB of loads in flight). The
# policy sweep on the H200 (tests/diagnostics/sweep_decode.py, docs/performance-log.md session 4)
# measured this best at batch 1 (caches 4k-128k); the other tiles keep their configuration
# (d64 already streams 128-key stages; d256 holds one CTA per SM at 64 keys).
_CLUSTER_CONFIGS = {
    64: DecodeConfig(128, 4, 3),
    128: DecodeConfig(128, 4, 3),
    256: DecodeConfig(64, 4, 3),
}


_CONFIG_OVERRIDE: dict = {}


def set_config_override(headdim_tile_: int, cfg: DecodeConfig | None) -> None:
    """Use ``cfg`` (block_n, n_warps, stages) instead of the default for a head-dim tile (None:
    back to the default); a tuning aid (tests/diagnostics/sweep_decode.py). block_n / n_warps must be a
    multiple of 16, and the rows a thread copies of a block (block_n * tile / (256 n_warps))
    must divide 16 (so that they lie in one page of a paged cache). Recorded launch plans are
    dropped."""
    if cfg is None:
        _CONFIG_OVERRIDE.pop(headdim_tile_, None)
    else:
        cfg = DecodeConfig(*cfg)
        rows = cfg.block_n * headdim_tile_ // (256 * cfg.n_warps)
        if cfg.block_n % (16 * cfg.n_warps) or cfg.stages < 2 or rows < 1 or 16 % rows:
            raise ValueError(f"cfg: block_n / n_warps must be a multiple of 16, block_n * "
                             f"{headdim_tile_} / (256 n_warps) must divide 16 and stages >= 2, "
                             f"got {cfg}")
        _CONFIG_OVERRIDE[headdim_tile_] = cfg
    plans.clear()


def headdim_tile(headdim: int) -> int:
    return smallest_tile(headdim, HEADDIM_TILES)


# Unsplit launches on sm_90 (d128, one m16 slice): the tile is chosen by how the CTAs fill the
# GPU's resident slots, from three that differ only in pipeline depth and so in CTAs per SM:
# four 64-key stages (136 KiB: one CTA per SM), three (101 KiB: two), two (69 KiB: three). The
# H200 sweep over batch (tests/diagnostics/decode_waves.py --configs, docs/performance-log.md session 5)
# found the step's time set by the last, partial wave: at a 4k cache, batch 17 (136 CTAs) ran at
# 2.55 TB/s with one CTA per SM (two waves, the second of 4 CTAs) and 3.53 with two (one wave);
# batch 50 at 3.66 against 4.02. single_config() encodes what the sweep measured best.
_SINGLE_CANDIDATES = {128: (DecodeConfig(64, 4, 4), DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 2))}


# Where even the best unsplit tile leaves the last wave ragged (wave efficiency < 0.9) and the
# caches are long, two splits merged in a cluster halve every CTA and so the ragged tail: batch
# 50 at 16k ran at 4.45 TB/s split against 3.93-3.99 unsplit (cuDNN 4.11); at 4k the split's
# fixed costs ate the gain (3.95 against 4.02), hence the length floor.
_SPLIT2_MIN_KEYS = 8192


def ctas_per_sm(smem: int) -> int:
    return max(1, min(4, _SMEM_PER_SM // (smem + 1024)))


def wave_efficiency(ctas: int, slots: int) -> float:
    """The fraction of the launch's wave-slots that hold a CTA (1 when every CTA is resident
    at once): ctas / (waves rounded up x slots)."""
    if ctas <= slots:
        return 1.0
    w = ctas / slots
    return w / math.ceil(w)


# Full waves of short CTAs (caches up to 4k keys, at most four waves of one CTA per SM): two CTAs
# per SM, at the same wave efficiency, overlap one CTA's start and end with the other's loads;
# the H200 measured them 0.7-1.1% ahead at batch 12-66 (4k), twice, and 1% behind at 16k.
_SHORT_KEYS = 4096


def single_config(headdim: int, ctas: int, num_sms: int, keys: int = 0) -> tuple[DecodeConfig, float]:
    """``(tile, wave efficiency)`` of an unsplit launch of ``ctas`` CTAs on ``num_sms`` SMs (sm_90,
    a head-dim tile in _SINGLE_CANDIDATES, one m16 slice); batches below are of 8 kv heads on
    132 SMs, each measured in the sweep:

    - one CTA per SM (the deepest pipeline) when its waves are full (efficiency >= 0.95, within
      0.02 of the best candidate's): batch <= 16, 33, 64, 66, 80, 128, 256; two per SM instead
      where the CTAs are short (``keys`` <= _SHORT_KEYS) and make at most four such waves, at
      the same efficiency;
    - else two per SM when that holds every CTA at once with at most 1.3 CTAs per SM on average:
      batch 17-21 (2.55 -> 3.53 TB/s at batch 17, 4k);
    - else three per SM when that holds every CTA at once: batch 22-32, 34-48;
    - else the best wave efficiency, two per SM first on a tie: batch 50-62 (3.03-3.76 waves of
      one per SM, 1.52-1.88 of two; two per SM ran 3-10% faster there).
    """
    cands = _SINGLE_CANDIDATES[headdim_tile(headdim)]
    slots = [num_sms * ctas_per_sm(smem_bytes(headdim, 1, cfg=c)) for c in cands]
    eff = [wave_efficiency(ctas, n) for n in slots]
    best = max(eff)
    if eff[0] >= 0.95 and eff[0] >= best - 0.02:
        if 0 < keys <= _SHORT_KEYS and ctas <= 4 * num_sms and eff[1] >= eff[0] - 0.02:
            return cands[1], eff[1]
        return cands[0], eff[0]
    if ctas <= slots[1] and ctas <= 1.3 * num_sms:
        return cands[1], eff[1]
    if ctas <= slots[2]:
        return cands[2], eff[2]
    i = max((1, 0, 2), key=lambda j: eff[j])      # first of the best, in this order
    return cands[i], eff[i]


# FP8 caches (one m16 slice) at d128: 128-key stages, three deep, for every launch kind. The
# H200 sweep with the fragments built in registers (session 13, bench_fp8_decode.py --fp8-cfg;
# tokens/s against the bf16 cache at batch 1 / 16k, 1 / 128k, 8 / 16k, 8 / 128k, 64 / 16k):
# 1.31 / 1.59 / 1.71 / 1.80 / 1.91, against 1.30 / 1.61 / 1.71 / 1.72 / 1.59 with the 16-bit
# tiles' choices and 1.09-1.89 with 64-key stages six deep.
_FP8_CONFIGS = {128: DecodeConfig(128, 4, 3)}


def decode_config(headdim: int, cluster: bool = False, m_tiles: int = 1,
                  single_ctas: int = 0, num_sms: int = 0, keys: int = 0,
                  fp8: bool = False) -> DecodeConfig:
    """The tile configuration of the decode kernel for ``headdim`` (an override set by
    set_config_override wins): for the split kernels that merge inside a cluster
    (``cluster``), for an unsplit launch of ``single_ctas`` CTAs on ``num_sms`` SMs over
    ``keys`` keys per sequence (sm_90: single_config), or the default. Two m16 slices (more
    than 16 packed rows) keep the default: with deeper stages their accumulators would spill."""
    d = headdim_tile(headdim)
    over = _CONFIG_OVERRIDE.get(d)
    if over:
        return over
    if fp8 and m_tiles == 1 and d in _FP8_CONFIGS:
        return _FP8_CONFIGS[d]
    if m_tiles == 1:
        if cluster:
            return _CLUSTER_CONFIGS[d]
        if single_ctas and num_sms and d in _SINGLE_CANDIDATES:
            return single_config(headdim, single_ctas, num_sms, keys)[0]
    return _CONFIGS[d]


def _m_tiles(headdim: int, packed_rows: int) -> int:
    """m16 slices per CTA: two when the packed rows exceed 16 (d <= 128: registers allow)."""
    return 2 if packed_rows > 16 and headdim_tile(headdim) <= 128 else 1


def _ring_bytes(d: int, cfg: DecodeConfig, fp8: bool = False, m_tiles: int = 1) -> int:
    """The K/V ring region: 16-bit stages; FP8 stages (half the bytes) take at least what the
    region holds after the main loop, the reduction slabs and the cluster merge's partial O and
    lse (the kernel's kRingBytes)."""
    if fp8:
        rows = 16 * m_tiles
        post = cfg.n_warps * rows * (d + 8) * 4 + 4 * rows * d + 4 * rows
        return max(cfg.stages * 2 * cfg.block_n * d, post)
    return cfg.stages * 4 * cfg.block_n * d


def smem_bytes(headdim: int, m_tiles: int, cluster: bool = False,
               cfg: DecodeConfig | None = None, fp8: bool = False) -> int:
    d = headdim_tile(headdim)
    cfg = cfg or decode_config(headdim, cluster, m_tiles, fp8=fp8)
    block_m = 16 * m_tiles
    return (2 * block_m * d + _ring_bytes(d, cfg, fp8, m_tiles)
            + (2 * cfg.n_warps + 1) * block_m * 4)


def kernel_name(dtype_name: str, headdim: int, m_tiles: int, paged: bool, is_local: bool,
                has_softcap: bool, has_alibi: bool, is_split: bool,
                cfg: DecodeConfig | None = None, fp8: bool = False) -> str:
    """``paged``: a block_table addresses the cache (the kernel's kPaged 1; any page size).
    ``fp8``: the cache is float8_e4m3fn (``dtype_name`` is q's)."""
    d = headdim_tile(headdim)
    cfg = cfg or decode_config(headdim, fp8=fp8)
    return (f"flash_decode_kernel<{_elem_tag(dtype_name)}, {d}, {cfg.block_n}, {cfg.n_warps}, "
            f"{cfg.stages}, {m_tiles}, {int(paged)}, {_b(is_local)}, {_b(has_softcap)}, "
            f"{_b(has_alibi)}, {_b(headdim == d)}, {_b(is_split)}, {_b(fp8)}>")


def cluster_kernel_name(dtype_name: str, headdim: int, m_tiles: int, paged: bool,
                        is_local: bool, has_softcap: bool, has_alibi: bool, splits: int,
                        fp8: bool = False) -> str:
    """The split kernel whose ``splits`` CTAs per group merge inside their cluster (sm_90+);
    ``paged`` as in kernel_name."""
    d = headdim_tile(headdim)
    cfg = decode_config(headdim, True, m_tiles, fp8=fp8)
    return (f"flash_decode_cluster_kernel<{_elem_tag(dtype_name)}, {d}, {cfg.block_n}, "
            f"{cfg.n_warps}, {cfg.stages}, {m_tiles}, {int(paged)}, {_b(is_local)}, "
            f"{_b(has_softcap)}, {_b(has_alibi)}, {_b(headdim == d)}, {splits}, {_b(fp8)}>")


def combine_name(dtype_name: str) -> str:
    return f"flash_decode_combine_kernel<{_elem_tag(dtype_name)}>"


def append_name(dtype_name: str, paged: bool, rotary: bool, interleaved: bool) -> str:
    return (f"flash_append_kv_kernel<{_elem_tag(dtype_name)}, {_b(paged)}, {_b(rotary)}, "
            f"{_b(interleaved and rotary)}>")


def _variants(dtype_names=("float16", "bfloat16")):
    """(dtype, headdim, m_tiles, paged, is_local, has_softcap, has_alibi) for every head-dim
    tile (and a smaller head dim in it), both m-slice counts where they exist, every flag
    (``paged`` both ways)."""
    for dt in dtype_names:
        for d in HEADDIM_TILES:
            for hd in (d, d - 8):
                for mt in ((1, 2) if d <= 128 else (1,)):
                    for paged in (False, True):
                        for flags in itertools.product((False, True), repeat=3):
                            yield (dt, hd, mt, paged) + flags


def instantiations() -> list[str]:
    """Every template name the launchers can produce (CI compiles a stratified sample)."""
    names = []
    for dt in ("float16", "bfloat16"):
        for v in _variants((dt,)):
            for spl in (False, True):
                names.append(kernel_name(*v, spl))
        for v in _variants((dt,)):          # unsplit launches on sm_90 (single_config)
            d = headdim_tile(v[1])
            if v[2] == 1 and d in _SINGLE_CANDIDATES:
                for cfg in _SINGLE_CANDIDATES[d]:
                    if cfg != _CONFIGS[d]:
                        names.append(kernel_name(*v, False, cfg))
        names.append(combine_name(dt))
        for paged in (False, True):
            for rot, inter in ((False, False), (True, False), (True, True)):
                names.append(append_name(dt, paged, rot, inter))
    return names


def sm90_instantiations() -> list[str]:
    """The cluster-merge kernels (sm_90+ only): every flag combination for each head-dim tile
    and dtype, split counts 2 to MAX_CLUSTER; and the FP8-cache kernels (sm_89+), head dims
    128 and 256 (CI compiles a stratified sample)."""
    fp8 = [v for v in _variants() if v[1] in FP8_HEADDIMS]
    return ([cluster_kernel_name(*v, c) for v in _variants() for c in range(2, MAX_CLUSTER + 1)]
            + [kernel_name(*v, spl, fp8=True) for v in fp8 for spl in (False, True)]
            + [cluster_kernel_name(*v, c, fp8=True) for v in fp8
               for c in range(2, MAX_CLUSTER + 1)])


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                         max_splits: int = _SPLIT_CAP) -> int:
    """flash-attn's rule: one split when the CTAs fill the GPU; else the smallest split count
    whose wave efficiency is within 85% of the best (counts that give the same number of
    blocks per split as one split fewer are not eligible)."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    if max_splits <= 1:
        return 1

    def eligible(s):
        return s == 1 or math.ceil(num_n_blocks / s) != math.ceil(num_n_blocks / (s - 1))

    eff = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = batch_nheads_mblocks * s / num_sms
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    for s in range(1, max_splits + 1):
        if s in eff and eff[s] >= 0.85 * best:
            return s
    return 1


def choose_num_splits(base_ctas: int, num_sms: int, ctas_per_sm: int, num_n_blocks: int) -> int:
    """Split count for ``num_splits=0``: flash-attn's wave rule over the CTA slots, then two
    bounds from a sweep on the H200 (docs/performance-log.md, 2026-11-29; batch 1 and 8,
    8 kv heads, d128, caches 4k-128k): a split should walk at least 8 key blocks, and more
    than 16 splits per (sequence, kv head, m-block) only pays when it is needed to give each
    SM a CTA. At batch 1 these bounds picked the measured best (8, 16, 16 splits at 4k, 16k,
    128k: 0.92, 1.92, 3.83 TB/s against 0.71, 1.73, 3.54 for the wave rule alone); at batch 8
    the wave rule's 4 was already the best measured and is kept."""
    s = num_splits_heuristic(base_ctas, num_sms * ctas_per_sm, num_n_blocks)
    return max(1, min(s, num_n_blocks // 8, max(16, num_sms // max(1, base_ctas))))


def cluster_num_splits(base_ctas: int, num_sms: int, num_n_blocks: int) -> int:
    """Split count for ``num_splits=0`` where the splits merge inside a cluster (sm_90): no
    split when the groups (sequences x kv heads x m-blocks) already fill 80% of the SMs; else
    as many splits as give every group's splits an SM of their own, at most 8 (a portable
    cluster) and at most half the key blocks. The H200 sweep (32 q over 8 kv heads, d128,
    caches 4k-128k) measured 8 splits best at batch 1 and 2 at batch 8, both this rule.
    Returns 0 when the cap of 8 would leave more than three quarters of the SMs idle while the
    keys could be spread further (few groups, say one MQA sequence): the caller then takes the
    global-merge rule, which spreads them over many more CTAs."""
    if base_ctas >= 0.8 * num_sms:
        return 1
    s_max = min(num_sms // max(1, base_ctas), num_n_blocks // 2)
    s = max(1, min(8, s_max))
    if s_max > 8 and base_ctas * s < num_sms // 4:
        return 0
    return s


# Where the cluster rule would leave at least half the SMs idle and each of its splits would
# walk this many key blocks or more, the global-merge rule's larger split count pays on a
# device with an H200's memory bandwidth (4.8 TB/s peak; half the SMs may not draw it;
# batch 1, 8 kv heads, d128, 128k keys: paged (256) 16 splits merged through global memory took
# 140 us against 149 for the cluster rule's 8, docs/performance-log.md session 8; contiguous,
# 3.86 TB/s against 3.79, session 13). At 16k the cluster's 8 stayed best (paged 30.8 us
# against 33.6; contiguous 2.30 against 2.10 TB/s). On the H100 (3.35 TB/s) the cluster's 8
# stayed ahead at 128k too (run 212, GPU time / CUDA-graph replay: contiguous 179.4 / 179.5 us
# against the global 16's 185.7 / 186.2, paged 181.6 / 181.4 against 187.0 / 187.3). Hence a
# bandwidth floor between the two devices, the H200's measurements being from sessions 8 and
# 13 (older kernels): memory bandwidth as the reason is a hypothesis that fits both, and
# devices between them (H100 NVL ~3.9 TB/s, GH200 with HBM3 ~4.0) take the cluster rule
# unmeasured.
_GLOBAL_MIN_BLOCKS_PER_SPLIT = 128
_GLOBAL_MIN_PEAK_BANDWIDTH = 4.1e12      # bytes/s


def sm90_num_splits(base_ctas: int, num_sms: int, num_n_blocks: int, headdim: int,
                    m_tiles: int, max_seqlen_k: int, peak_bandwidth: float) -> int:
    """The split count for ``num_splits=0`` on sm_90 (cluster merge available): the cluster rule
    (cluster_num_splits; 0 hands over to the global rule), and two splits where the rule says
    one but the best unsplit tile leaves a ragged last wave of long CTAs (_SPLIT2_MIN_KEYS).
    Long walks over half-idle SMs go to the global rule where the device's ``peak_bandwidth``
    (bytes/s) is that of an H200 (see above)."""
    s = cluster_num_splits(base_ctas, num_sms, num_n_blocks)
    if (s > 1 and 2 * base_ctas * s <= num_sms
            and num_n_blocks // s >= _GLOBAL_MIN_BLOCKS_PER_SPLIT
            and peak_bandwidth >= _GLOBAL_MIN_PEAK_BANDWIDTH):
        return 0
    if (s == 1 and m_tiles == 1 and max_seqlen_k >= _SPLIT2_MIN_KEYS and num_n_blocks >= 4
            and headdim_tile(headdim) in _SINGLE_CANDIDATES
            and single_config(headdim, base_ctas, num_sms)[1] < 0.9):
        return 2
    return s


# ---- fused combine ---------------------------------------------------------------------------

# ---- cluster merge (sm_90+) --------------------------------------------------------------------
# With 2 to MAX_CLUSTER splits on compute capability 9.0 or newer, the splits of a group form a
# thread-block cluster and merge through distributed shared memory (flash_decode_cluster_kernel):
# no fp32 scratch, no fence, no arrival counter. Measured on the H200 (docs/performance-log.md,
# session 4): the global-memory merge cost about 4.4 us of a 17.5 us batch-1 call. Counts above
# 8 need a non-portable cluster size; a device that refuses a size falls back to the
# global-memory merge for it.
MAX_CLUSTER = 16
_CLUSTER_REFUSED: set = set()     # (device id, kernel name) whose cluster launch was refused
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
# Driver errors that mean "this cluster cannot be launched here" (invalid cluster size, out of
# resources, not supported); any other error is raised as it is.
_CLUSTER_REFUSALS = (912, 701, 801)


def _cluster_layout_fits(headdim: int, m_tiles: int, cfg: DecodeConfig, fp8: bool = False) -> bool:
    """The cluster kernel keeps its partial O and lse in the K/V ring after the reduction
    slabs (the kernel's static_assert): whether ``cfg`` leaves room (a tile override may not)."""
    d = headdim_tile(headdim)
    rows = 16 * m_tiles
    red = cfg.n_warps * rows * (d + 8) * 4
    return red + 4 * rows * d + 4 * rows <= _ring_bytes(d, cfg, fp8, m_tiles)


def set_cluster_merge(on: bool) -> None:
    """Merge split-KV partials inside a thread-block cluster where the device allows it (True,
    the default on sm_90+) or through global memory (False: the fused or two-kernel path).
    Launch plans key on the choice. The paths merge with the same arithmetic, but the cluster
    path has its own split rule and tiles, so turning it off can change the result's rounding."""
    config.set(decode_cluster=bool(on))


def cluster_merge_enabled() -> bool:
    return config.get().decode_cluster


def set_fused_combine(on: bool) -> None:
    """Merge split-KV partials in the decode kernel (True, the default) or with the separate
    combine kernel (False). Launch plans key on the choice, so no plan needs dropping."""
    config.set(decode_fused_combine=bool(on))


def fused_combine_enabled() -> bool:
    return config.get().decode_fused_combine


# (device id, stream handle) -> int32 array of arrival counters, all zero between launches
# (each launch's last CTA per group puts its counter back to 0). One per stream, so that calls
# running concurrently on different streams never share a counter; calls on one stream are
# ordered. Grown (a new zero-filled array, on that stream) when a launch has more groups.
_COUNTERS: dict = {}


def split_counter(device_id: int, groups: int, xp) -> int:
    """Address of at least ``groups`` zeroed int32 arrival counters for the current stream of
    ``device_id`` in namespace ``xp``'s library (the stream the next launch goes to; made by
    that library's allocator)."""
    key = (device_id, device.current_stream(xp, device_id))
    buf = _COUNTERS.get(key)
    if buf is None or buf.size < groups:
        n = max(groups, 1024, 2 * (0 if buf is None else buf.size))
        with device.scope(device_id):
            buf = xp.zeros((n,), dtype=np.int32)
        _COUNTERS[key] = buf   # the old array returns to the pool, reused in stream order
    return buf.data.ptr


def existing_split_counter(device_id: int, stream: int, groups: int):
    """The address of ``stream``'s counters if it has at least ``groups`` of them, else None
    (a replayed plan then runs in full once, which makes them)."""
    buf = _COUNTERS.get((device_id, stream))
    return None if buf is None or buf.size < groups else buf.data.ptr


def _sm_count(device_id: int) -> int:
    from ..jit import device_facts
    return device_facts(device_id)[2]


def _int32_contig(arr):
    return lib_of(arr).ascontiguousarray(arr, dtype=np.int32)    # (arr itself when it is one)


def launch_decode(q, k_cache, v_cache, out, lse, *, cache_seqlens, block_table=None,
                  softmax_scale: float, window_left: int, window_right: int,
                  softcap: float = 0.0, alibi_slopes=None, num_splits: int = 0,
                  cache_leftpad=None, k_descale=None, v_descale=None, key_mask=None) -> int:
    """:func:`decode_launches` returning the number of splits used."""
    return decode_launches(q, k_cache, v_cache, out, lse, cache_seqlens=cache_seqlens,
                           block_table=block_table, softmax_scale=softmax_scale,
                           window_left=window_left, window_right=window_right, softcap=softcap,
                           alibi_slopes=alibi_slopes, num_splits=num_splits,
                           cache_leftpad=cache_leftpad, k_descale=k_descale,
                           v_descale=v_descale, key_mask=key_mask)[0]


def _decide(max_seqlen_k, *, device_id, hopper, cluster_ok, dtype_name, batch, nheads_k,
            m_blocks, m_tiles, seqlen_q, headdim, wl, wr, page_size, has_softcap, has_alibi,
            num_splits, fp8):
    """A decode launch's decisions for a cache of ``max_seqlen_k`` keys (the rest of the call
    given): ``(split count, cluster merge, kernel name, tile configuration, shared memory)``.
    Host-side only (no read of cache_seqlens, which would synchronise); a function of the
    cache's length for a call's other arguments, so that a plan recorded for one length
    can tell whether another would launch alike (:func:`_relength`)."""
    is_local = wl != WINDOW_NONE or wr != WINDOW_NONE

    def key_blocks(cfg):   # key blocks a group walks (before splitting)
        n_blocks = max(1, math.ceil(max_seqlen_k / cfg.block_n))
        if wl != WINDOW_NONE:
            span = wl + seqlen_q + (0 if wr == WINDOW_NONE else wr)
            n_blocks = min(n_blocks, math.ceil(span / cfg.block_n) + 1)
        return n_blocks

    # keys a sequence's query rows can see at most (the window bounds them, not the cache)
    span_keys = max_seqlen_k if wl == WINDOW_NONE else \
        min(max_seqlen_k, wl + seqlen_q + (0 if wr == WINDOW_NONE else wr))
    cluster_declined = False     # the cluster split rule handed the count to the global rule
    if num_splits is None or num_splits <= 0:
        base_ctas = batch * nheads_k * m_blocks
        if cluster_ok:
            cl_cfg = decode_config(headdim, True, m_tiles, fp8=fp8)
            from ..jit import peak_memory_bandwidth
            num_splits = sm90_num_splits(base_ctas, _sm_count(device_id), key_blocks(cl_cfg),
                                         headdim, m_tiles, span_keys if hopper else 0,
                                         peak_memory_bandwidth(device_id))
            cluster_declined = num_splits == 0
        if not cluster_ok or cluster_declined:
            num_splits = choose_num_splits(base_ctas, _sm_count(device_id),
                                           ctas_per_sm(smem_bytes(headdim, m_tiles, fp8=fp8)),
                                           key_blocks(decode_config(headdim, fp8=fp8)))
        if (fp8 and base_ctas <= _FP8_MANY_SPLITS_MAX_GROUPS
                and span_keys >= _FP8_MANY_SPLITS_MIN_KEYS):
            # long caches of few groups take splits of 4k keys (at most 32, merged through
            # global memory): see _FP8_MANY_SPLITS_MIN_KEYS
            num_splits = max(int(num_splits), min(32, span_keys // 4096))
    num_splits = int(max(1, min(int(num_splits), MAX_SPLITS)))
    is_split = num_splits > 1

    cluster = is_split and cluster_ok and not cluster_declined and num_splits <= MAX_CLUSTER
    if cluster:
        cl_cfg = decode_config(headdim, True, m_tiles, fp8=fp8)
        name = cluster_kernel_name(dtype_name, headdim, m_tiles, bool(page_size), is_local,
                                   has_softcap, has_alibi, num_splits, fp8)
        cluster = ((device_id, name) not in _CLUSTER_REFUSED
                   and _cluster_layout_fits(headdim, m_tiles, cl_cfg, fp8))
    cfg = decode_config(headdim, cluster, m_tiles,
                        single_ctas=0 if is_split or not hopper else batch * nheads_k * m_blocks,
                        num_sms=_sm_count(device_id), keys=span_keys, fp8=fp8)
    smem = smem_bytes(headdim, m_tiles, cfg=cfg, fp8=fp8)
    if not cluster:
        name = kernel_name(dtype_name, headdim, m_tiles, bool(page_size), is_local,
                           has_softcap, has_alibi, is_split, cfg, fp8)
    return num_splits, cluster, name, cfg, smem


def decode_launches(q, k_cache, v_cache, out, lse, *, cache_seqlens, block_table=None,
                    softmax_scale: float, window_left: int, window_right: int,
                    softcap: float = 0.0, alibi_slopes=None, num_splits: int = 0,
                    cache_leftpad=None, k_descale=None, v_descale=None, key_mask=None):
    """Attention of q against a KV cache; ``out`` and ``lse`` are written in place.

    q, out: (b, sq, h, d) float16/bfloat16; lse: float32 (b, h, sq) contiguous.
    k_cache, v_cache: (b_cache, seqlen_cache, hk, d), or paged (num_blocks, page_size, hk, d)
    with int32 ``block_table`` (b, max_blocks). ``cache_seqlens`` int32 (b,): the valid keys of
    each sequence. Windows use -1 for unbounded (causal = (-1, 0)). ``num_splits`` 0 picks the
    split count (on sm_90 the cluster rule, cluster_num_splits; elsewhere flash-attn's wave rule
    with the bounds of choose_num_splits). FP8 caches: uint8 arrays holding float8_e4m3fn
    values (head dims 128 and 256, compute capability 8.9 and newer), read as
    ``cache * descale[b, hk]`` with ``k_descale`` / ``v_descale`` float32 (b, hk) contiguous,
    or None for 1. ``key_mask``: bool (b, seqlen_cache) (paged: (b, max_blocks * page_size))
    with a contiguous last dimension, or None: key t of sequence b (counted from row 0 of its
    cache) is attended only where ``key_mask[b, t]``. Returns
    ``(splits used, plans.Piece or None)``. With more than one
    split the partials are merged inside a thread-block cluster (sm_90, up to 16 splits), else
    in the decode kernel (fused combine), unless ``set_fused_combine(False)`` /
    ``FLASHCORE_DECODE_FUSED_COMBINE=0`` (the combine kernel).
    """
    xp = lib_of(q)
    cfg_now = config.get()
    fused = cfg_now.decode_fused_combine
    given = (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, cache_leftpad,
             k_descale, v_descale, key_mask)

    fp8 = k_cache.dtype == np.uint8
    q = _as_input(q)
    # (FP8: uint8 caches, copied 16 bytes at a time: strides multiples of 16 elements)
    k_cache, v_cache = _as_input(k_cache, 16 if fp8 else 8), _as_input(v_cache, 16 if fp8 else 8)
    out_final = None
    if out.size and not _used_strides_ok(out, 8, 16):
        out_final, out = out, xp.empty(out.shape, out.dtype)
    dtype_name = _dtype_name(q)
    batch, seqlen_q, nheads, headdim = (int(x) for x in q.shape)
    nheads_k = int(k_cache.shape[2])
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return 1, None
    if not softmax_scale > 0.0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    paged = block_table is not None
    group = nheads // nheads_k
    packed_rows = seqlen_q * group
    m_tiles = _m_tiles(headdim, packed_rows)
    m_blocks = math.ceil(packed_rows / (16 * m_tiles))
    if batch * nheads_k > 2**31 - 1 or m_blocks > 65535:
        raise ValueError("decode grid too large "
                         f"(batch * nheads_k = {batch * nheads_k}, m-blocks = {m_blocks})")
    device_id = q.device.id
    from ..jit import device_facts, get_kernel
    cc = device_facts(device_id)[0]
    if fp8 and (cc < 89 or headdim not in FP8_HEADDIMS):
        raise ValueError(
            "argument 'k_cache': a float8_e4m3fn cache is decoded on compute capability 8.9 or "
            f"newer with head dim 128 or 256; got compute capability {cc / 10:.1f}, head dim "
            f"{headdim}")
    # Splits merge inside a thread-block cluster on sm_90 (the fused path's default there);
    # that path has its own split rule and tile configuration.
    cluster_ok = fused and cfg_now.decode_cluster and cc >= 90

    wl, wr = _window(window_left), _window(window_right)
    has_softcap = softcap is not None and softcap > 0.0
    has_alibi = alibi_slopes is not None

    cache_seqlens = _int32_contig(cache_seqlens)
    if cache_leftpad is not None:
        cache_leftpad = _int32_contig(cache_leftpad)
    if key_mask is not None and key_mask.shape[1] > 1 and key_mask.strides[1] != 1:
        key_mask = xp.ascontiguousarray(key_mask)
    if paged:
        block_table = block_table if block_table.dtype == np.int32 else block_table.astype(np.int32)
        if block_table.strides[-1] != 4:
            block_table = xp.ascontiguousarray(block_table)
        page_size = int(k_cache.shape[1])
        if page_size < 16 or page_size % 16:
            raise ValueError(f"page_size must be a positive multiple of 16, got {page_size}")
        max_seqlen_k = int(block_table.shape[1]) * page_size
    else:
        page_size = 0
        max_seqlen_k = int(k_cache.shape[1])

    hopper = cc // 10 == 9      # the sm_90 tile rules were measured on the H200 only
    decide = functools.partial(
        _decide, device_id=device_id, hopper=hopper, cluster_ok=cluster_ok,
        dtype_name=dtype_name, batch=batch, nheads_k=nheads_k, m_blocks=m_blocks,
        m_tiles=m_tiles, seqlen_q=seqlen_q, headdim=headdim, wl=wl, wr=wr, page_size=page_size,
        has_softcap=has_softcap, has_alibi=has_alibi, num_splits=num_splits, fp8=fp8)
    choice = decide(max_seqlen_k)
    requested, (num_splits, cluster, name, cfg, smem) = num_splits, choice
    is_split = num_splits > 1
    defines = config.get().sm90_defines if cc == 90 else ()   # (a diagnostic's: none by default)
    kernel = get_kernel(SOURCE, name, device_id, cc, smem, defines)

    o_accum = lse_accum = None
    counter = None
    if is_split and not cluster:
        o_accum = xp.empty((num_splits, batch, nheads, seqlen_q, headdim), np.float32)
        lse_accum = xp.empty((num_splits, batch, nheads, seqlen_q), np.float32)
        if fused:
            counter = split_counter(device_id, batch * nheads_k * m_blocks, xp)

    qs, ks, vs, os_ = _strides(q), _strides(k_cache), _strides(v_cache), _strides(out)
    if fp8:      # the kernel addresses a byte cache in 16-bit units (strides multiples of 16)
        ks, vs = tuple(x // 2 for x in ks), tuple(x // 2 for x in vs)
        k_descale, v_descale = (None if x is None else
                                xp.ascontiguousarray(x, dtype=np.float32)
                                for x in (k_descale, v_descale))
    alibi_bs = 0
    if has_alibi:
        alibi_slopes = xp.ascontiguousarray(alibi_slopes, dtype=np.float32)
        if alibi_slopes.ndim == 2:
            alibi_bs = alibi_slopes.strides[0] // 4
    params = make_params(
        q=q.data.ptr, k=k_cache.data.ptr, v=v_cache.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
        alibi_slopes=alibi_slopes.data.ptr if has_alibi else None,
        q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
        k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
        v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
        o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
        lse_batch_stride=lse.strides[0] // 4, lse_head_stride=lse.strides[1] // 4,
        alibi_batch_stride=alibi_bs,
        batch=batch, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
        seqlen_q=seqlen_q, seqlen_k=max_seqlen_k, window_left=wl, window_right=wr,
        softmax_scale=float(softmax_scale),
        scale_log2=_LOG2E if has_softcap else float(softmax_scale) * _LOG2E,
        softcap=float(softcap) if has_softcap else 0.0,
        cache_seqlens=cache_seqlens.data.ptr,
        block_table=block_table.data.ptr if paged else None,
        o_accum=o_accum.data.ptr if o_accum is not None else None,
        lse_accum=lse_accum.data.ptr if lse_accum is not None else None,
        block_table_batch_stride=(block_table.strides[0] // 4) if paged else 0,
        page_size=page_size, num_splits=num_splits, split_counter=counter,
        num_blocks=int(k_cache.shape[0]) if paged else 0,
        cache_leftpad=None if cache_leftpad is None or paged else cache_leftpad.data.ptr,
        k_descale=None if k_descale is None else k_descale.data.ptr,
        v_descale=None if v_descale is None else v_descale.data.ptr,
        key_mask=None if key_mask is None else key_mask.data.ptr,
        key_mask_batch_stride=0 if key_mask is None else key_mask.strides[0],
    )
    args = (as_kernel_arg(params),)     # an opaque struct: see params.as_kernel_arg
    launches = [(kernel, (batch * nheads_k, m_blocks, num_splits), (cfg.n_warps * 32, 1, 1),
                 smem)]
    if is_split and not fused:
        comb = get_kernel(SOURCE, combine_name(dtype_name), device_id, cc)
        launches.append((comb, (math.ceil(batch * nheads * seqlen_q / 4), 1, 1), (128, 1, 1), 0))
    stream = device.current_stream(xp, device_id)
    with device.scope(device_id):
        if cluster:
            try:
                if num_splits > 8:      # a non-portable cluster size: allowed on the function
                    kernel.set_attribute(_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                kernel(launches[0][1], launches[0][2], args, shared_mem=smem, stream=stream)
            except device.CUDADriverError as e:
                if getattr(e, "status", None) not in _CLUSTER_REFUSALS:
                    raise
                # this cluster is refused here (its size, or its resources): this kernel takes
                # the global-memory merge from now on (the call asked again as it asked: its
                # decisions, _decide, now see the refusal, and so do those of a plan made for
                # another length from the one it records)
                _CLUSTER_REFUSED.add((device_id, name))
                plans.clear()
                return decode_launches(given[0], given[1], given[2], out_final if out_final
                                     is not None else out, lse, cache_seqlens=given[3],
                                     block_table=given[4], softmax_scale=softmax_scale,
                                     window_left=window_left, window_right=window_right,
                                     softcap=softcap, alibi_slopes=given[5],
                                     num_splits=requested, cache_leftpad=given[6],
                                     k_descale=given[7], v_descale=given[8],
                                     key_mask=given[9])
        else:
            for kern, grid, block, sm in launches:
                kern(grid, block, args, shared_mem=sm, stream=stream)
        if out_final is not None:
            out_final[...] = out
    piece = None
    if out_final is None and all(
            a is b for a, b in zip((q, k_cache, v_cache, cache_seqlens, block_table,
                                    alibi_slopes, cache_leftpad, k_descale, v_descale,
                                    key_mask), given)):
        scratch = {} if o_accum is None else {"o_accum": o_accum.nbytes,
                                              "lse_accum": lse_accum.nbytes}
        piece = plans.Piece(launches, params, scratch,
                            ("split_counter", batch * nheads_k * m_blocks, existing_split_counter)
                            if counter else None,
                            relength=None if paged else functools.partial(
                                _relength, decide, choice, fp8, key_mask is not None,
                                (batch, nheads_k, headdim)))
    return num_splits, piece


def _relength(decide, choice, fp8, masked, dims, capacity, k_strides, v_strides, mask_stride):
    """A plan's ``relength`` (plans.Piece): the struct fields that a contiguous-cache decode
    launch takes from the cache's length, for a cache of ``capacity`` keys whose k_cache and
    v_cache have ``k_strides`` and ``v_strides`` (elements, in the launcher's (batch, seq, heads,
    headdim) order) and whose key mask's rows are ``mask_stride`` apart; None when that cache
    would launch otherwise (another split count, kernel or tile: ``decide``, the launch's
    decisions as a function of the length, gives another ``choice``) or be copied first
    (:func:`_as_input`'s rule; ``dims``: the cache's batch, heads and head dim). The rest of
    the call is the recorded one's: the caller's key says so."""
    shape = (dims[0], capacity, dims[1], dims[2])
    multiple = 16 if fp8 else 8
    if capacity < 1 or not (_strides_fit(shape, k_strides, multiple)
                            and _strides_fit(shape, v_strides, multiple)):
        return None
    if decide(capacity) != choice:
        return None
    if fp8:      # (as decode_launches: 16-bit units)
        k_strides, v_strides = (tuple(x // 2 for x in st) for st in (k_strides, v_strides))
    return {"seqlen_k": capacity,
            "k_batch_stride": k_strides[0], "k_row_stride": k_strides[1],
            "k_head_stride": k_strides[2],
            "v_batch_stride": v_strides[0], "v_row_stride": v_strides[1],
            "v_head_stride": v_strides[2],
            "key_mask_batch_stride": mask_stride if masked else 0}


def launch_rotary_append(k_cache, v_cache, k_new, v_new, cache_seqlens_before, block_table,
                         rotary_cos, rotary_sin, rotary_interleaved, q=None, q_out=None,
                         seqlen_offsets=None):
    """Write k_new / v_new (b, s_new, hk, d) into the cache at rows cache_seqlens_before[b] + t.

    The cache is contiguous (b_cache, seqlen_cache, hk, d) or paged (num_blocks, page_size, hk, d)
    with ``block_table``. With ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2),
    rotary embedding (flash-attn's convention, fp32 math) is applied to k_new at positions
    offsets[b] + t and, when ``q`` is given, to q at offsets[b] + i into ``q_out`` (allocated
    when None), where offsets = ``seqlen_offsets`` if given, else ``cache_seqlens_before``.
    ``q_out`` may be ``q`` itself. Returns ``q_out`` (or None without q).
    """
    xp = lib_of(k_cache)
    paged = block_table is not None
    rotary = rotary_cos is not None
    dtype_name = _dtype_name(k_cache)
    device_id = k_cache.device.id
    from ..jit import device_facts, get_kernel
    cc = device_facts(device_id)[0]

    seqlens = _int32_contig(cache_seqlens_before)
    rot_off = _int32_contig(seqlen_offsets) if seqlen_offsets is not None else seqlens
    if rotary:
        cos = xp.ascontiguousarray(rotary_cos, dtype=np.float32)
        sin = xp.ascontiguousarray(rotary_sin, dtype=np.float32)
        rotary_dim, seqlen_ro = 2 * int(cos.shape[1]), int(cos.shape[0])
        cos_p, sin_p = cos.data.ptr, sin.data.ptr
    else:
        rotary_dim = seqlen_ro = 0
        cos_p = sin_p = 0
    if paged:
        block_table = _int32_contig(block_table)
        bt_p, bt_stride, page_size = block_table.data.ptr, block_table.strides[0] // 4, int(k_cache.shape[1])
        capacity, num_blocks = int(block_table.shape[1]) * page_size, int(k_cache.shape[0])
    else:
        bt_p, bt_stride, page_size = 0, 0, 0
        capacity, num_blocks = int(k_cache.shape[1]), 0

    def run(src, dst, dst_paged, rot, row_offsets_ptr, cap):
        if src.size == 0:
            return
        if src.strides[-1] != src.dtype.itemsize:
            src = xp.ascontiguousarray(src)
        b, s, nh, d = (int(x) for x in src.shape)
        ss, ds = _strides(src), _strides(dst)
        kern = get_kernel(SOURCE, append_name(dtype_name, dst_paged, rot, bool(rotary_interleaved)),
                          device_id, cc)
        total = b * s * nh * (d // 2)
        i64, i32, ptr = np.int64, np.int32, np.uint64
        args = (ptr(src.data.ptr), i64(ss[0]), i64(ss[1]), i64(ss[2]),
                ptr(dst.data.ptr), i64(ds[0]), i64(ds[1]), i64(ds[2]),
                ptr(row_offsets_ptr), ptr(bt_p if dst_paged else 0), i64(bt_stride),
                i32(page_size), ptr(cos_p if rot else 0), ptr(sin_p if rot else 0),
                ptr(rot_off.data.ptr), i32(rotary_dim if rot else 0), i32(seqlen_ro),
                i32(b), i32(s), i32(nh), i32(d),
                i32(cap), i32(num_blocks))
        kern((math.ceil(total / 256), 1, 1), (256, 1, 1), args, stream=stream)

    stream = device.current_stream(xp, device_id)
    with device.scope(device_id):
        if k_new is not None:
            run(k_new, k_cache, paged, rotary, seqlens.data.ptr, capacity)
        if v_new is not None:
            run(v_new, v_cache, paged, False, seqlens.data.ptr, capacity)
        if q is not None:
            if q_out is None:
                q_out = xp.empty_like(q)
            if rotary:
                run(q, q_out, False, True, 0, int(q.shape[1]))
            elif q_out is not q:
                q_out[...] = q
    return q_out
