"""The split-count choice of the decode launcher (host-side arithmetic, no GPU needed)."""
from __future__ import annotations

import pytest

from flashcore.kernels.decode import choose_num_splits, num_splits_heuristic

H200_SMS, CTAS_PER_SM, BLOCK_N = 132, 2, 64     # d128 decode: 2 CTAs per SM, 64-key blocks


@pytest.mark.parametrize("batch, cache, wave_rule, chosen", [
    # the H200 sweep of 2026-11-29 (32 q heads over 8 kv heads, d128): the wave rule's pick and
    # the pick measured best, which choose_num_splits must reproduce
    (1, 4096, 32, 8), (1, 16384, 29, 16), (1, 131072, 29, 16),
    (8, 4096, 4, 4), (8, 16384, 4, 4), (8, 131072, 4, 4),
    (64, 4096, 1, 1), (64, 131072, 1, 1),
])
def test_measured_shapes(batch, cache, wave_rule, chosen):
    base, nb = batch * 8, cache // BLOCK_N
    assert num_splits_heuristic(base, H200_SMS * CTAS_PER_SM, nb) == wave_rule
    assert choose_num_splits(base, H200_SMS, CTAS_PER_SM, nb) == chosen


@pytest.mark.parametrize("base", [1, 2, 3, 8, 40, 131, 132, 500])
@pytest.mark.parametrize("nb", [1, 5, 8, 9, 64, 1000, 5000])
def test_bounds(base, nb):
    s = choose_num_splits(base, H200_SMS, CTAS_PER_SM, nb)
    assert 1 <= s <= max(1, nb // 8)                       # every split walks >= 8 blocks
    assert s <= num_splits_heuristic(base, H200_SMS * CTAS_PER_SM, nb)
    if nb >= 8 * 16 and base * 16 < H200_SMS:              # few CTAs: still enough to fill SMs
        assert base * s >= min(H200_SMS // 2, base * (nb // 8))


def test_max_splits_matches_the_kernels_weight_table():
    """The launcher caps the split count at MAX_SPLITS; the combine (fused or not) keeps one
    weight per split in a table of fc_dec::kMaxSplits floats per warp."""
    import re
    from flashcore import jit
    from flashcore.kernels.decode import MAX_SPLITS
    src = (jit.cuda_dir() / "flash_decode.cu").read_text()
    m = re.search(r"constexpr int kMaxSplits = (\d+);", src)
    assert m and int(m.group(1)) == MAX_SPLITS


# ---- sm_90 unsplit tiles and the two-split fallback (decode.single_config, sm90_num_splits) ----

from flashcore.kernels.decode import (  # noqa: E402
    DecodeConfig, single_config, sm90_num_splits, wave_efficiency)

ONE, TWO, THREE = DecodeConfig(64, 4, 4), DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 2)
H100, H200 = 3.35e12, 4.8e12     # peak DRAM bandwidth, bytes/s


@pytest.mark.parametrize("batch, tile", [
    # (batch of 8 kv heads on 132 SMs -> the tile the H200 sweep measured best or within 1%)
    (12, ONE), (16, ONE),                 # one wave of one CTA per SM
    (17, TWO), (20, TWO),                 # 136-160 CTAs: one per SM would leave a 2nd wave
    (24, THREE), (32, THREE), (40, THREE), (48, THREE),   # all resident only at three per SM
    (33, ONE), (64, ONE), (66, ONE), (80, ONE), (128, ONE), (256, ONE),  # full waves
    (50, TWO), (56, TWO),                 # ragged either way: two per SM measured 3-10% ahead
])
def test_single_config_follows_the_wave_sweep(batch, tile):
    cfg, eff = single_config(128, batch * 8, 132)            # (cache length not given)
    assert cfg == tile
    assert 0 < eff <= 1
    assert single_config(128, batch * 8, 132, 16384)[0] == tile


@pytest.mark.parametrize("batch, tile", [(12, TWO), (16, TWO), (33, TWO), (64, TWO), (66, TWO),
                                         (80, ONE), (128, ONE), (17, TWO), (40, THREE)])
def test_single_config_short_caches_take_two_per_sm_on_full_waves(batch, tile):
    assert single_config(128, batch * 8, 132, 4096)[0] == tile


def test_wave_efficiency():
    assert wave_efficiency(100, 132) == 1.0
    assert wave_efficiency(264, 132) == 1.0
    assert wave_efficiency(136, 132) == pytest.approx(136 / 264)
    assert wave_efficiency(512, 132) == pytest.approx(512 / 528)


def test_two_splits_only_for_ragged_waves_of_long_caches():
    blocks = lambda keys: keys // 128  # noqa: E731  (the cluster tile's 128-key blocks)
    # batch 50, 16k: ragged (0.76) and long -> 2; at 4k the unsplit tile stays
    assert sm90_num_splits(400, 132, blocks(16384), 128, 1, 16384, H200) == 2
    assert sm90_num_splits(400, 132, blocks(4096), 128, 1, 4096, H200) == 1
    # full waves stay unsplit at any length; the cluster rule's own counts are untouched
    assert sm90_num_splits(512, 132, blocks(131072), 128, 1, 131072, H200) == 1
    assert sm90_num_splits(8, 132, blocks(16384), 128, 1, 16384, H200) == 8
    # batch 1 at 128k: 8 cluster splits would walk 128 blocks each over half the SMs -> the
    # global rule (0)
    assert sm90_num_splits(8, 132, blocks(131072), 128, 1, 131072, H200) == 0
    # ... but not where the memory is slow enough for half the SMs: the H100 measured the
    # cluster's 8 ahead there (run 212)
    assert sm90_num_splits(8, 132, blocks(131072), 128, 1, 131072, H100) == 8
    assert sm90_num_splits(8, 132, blocks(16384), 128, 1, 16384, H100) == 8
    assert sm90_num_splits(64, 132, blocks(16384), 128, 1, 16384, H200) == 2
    # two m16 slices, or a head dim without candidates: the cluster rule alone
    assert sm90_num_splits(400, 132, blocks(16384), 128, 2, 16384, H200) == 1
    assert sm90_num_splits(400, 132, blocks(16384), 64, 1, 16384, H200) == 1


@pytest.mark.parametrize("tile, cfg, ok", [
    (128, (64, 4, 3), True), (128, (128, 4, 3), True), (128, (256, 8, 3), True),
    (64, (128, 4, 3), True), (256, (64, 4, 3), True), (128, (16, 1, 2), True),
    # a thread would copy 32 rows of a block: they could span pages of 16
    (128, (256, 4, 3), False), (256, (128, 4, 3), False),
    (128, (64, 4, 1), False), (128, (48, 4, 3), False),
])
def test_config_override_keeps_a_threads_rows_in_one_page(tile, cfg, ok):
    """The decode kernels copy rows block_n * tile / (256 n_warps) a thread, consecutive in a
    paged cache: an override must make that a divisor of 16, or it is refused by name."""
    from flashcore.kernels import decode
    try:
        if ok:
            decode.set_config_override(tile, cfg)
            assert decode.decode_config(tile) == DecodeConfig(*cfg)
        else:
            with pytest.raises(ValueError, match="cfg: block_n"):
                decode.set_config_override(tile, cfg)
    finally:
        decode.set_config_override(tile, None)
