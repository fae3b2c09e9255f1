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
