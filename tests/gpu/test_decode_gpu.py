"""The KV-cache decoding kernels (cuda/flash_decode.cu via flashcore.kernels.decode) against a
dense float64 reference built here: the valid part of each sequence's cache is gathered on the
host into (1, sk, hk, d) and given to naive_forward (independent of the kvcache reference).

flash-attn's rule: max error <= 2x that of the same computation in the low precision. Outputs
are poisoned (NaN) before each run; cache rows past cache_seqlens and unused pages are NaN too,
so any read outside the valid keys shows up.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from refutils import assert_flash_rule, quantize, to_dev
from flashcore.reference import naive_forward
from flashcore.spec import forward_spec

pytestmark = pytest.mark.gpu


def _cp():
    import cupy
    return cupy


def make_cache(rng, dtype, b, lens, hk, d, page_size, max_len):
    """Host float32 cache (NaN outside the valid keys), device cache, block_table, gather fn."""
    if page_size is None:
        kc = np.full((b, max_len, hk, d), np.nan, np.float32)
        vc = np.full((b, max_len, hk, d), np.nan, np.float32)
        for i, n in enumerate(lens):
            kc[i, :n] = quantize(rng.standard_normal((n, hk, d)).astype(np.float32), dtype)
            vc[i, :n] = quantize(rng.standard_normal((n, hk, d)).astype(np.float32), dtype)

        def gather(c, i):
            return c[i, :lens[i]]
        return kc, vc, None, gather
    max_blocks = math.ceil(max_len / page_size)
    nblocks = b * max_blocks + 3
    kc = np.full((nblocks, page_size, hk, d), np.nan, np.float32)
    vc = np.full((nblocks, page_size, hk, d), np.nan, np.float32)
    perm = rng.permutation(nblocks - 1)   # the last block is never used (NaN): unused entries
    bt = np.full((b, max_blocks), nblocks - 1, np.int32)
    k = 0
    for i, n in enumerate(lens):
        for j in range(math.ceil(n / page_size)):
            blk = perm[k]
            k += 1
            bt[i, j] = blk
            rows = min(page_size, n - j * page_size)
            kc[blk, :rows] = quantize(rng.standard_normal((rows, hk, d)).astype(np.float32), dtype)
            vc[blk, :rows] = quantize(rng.standard_normal((rows, hk, d)).astype(np.float32), dtype)

    def gather(c, i):
        t = np.arange(lens[i])
        return c[bt[i, t // page_size], t % page_size]
    return kc, vc, bt, gather


class Problem:
    """One decode problem: host inputs (float32, the values the device holds), device inputs."""

    def __init__(self, dtype, b, sq, h, hk, d, lens, *, page_size=None, max_len=None,
                 causal=False, window=(-1, -1), softcap=0.0, alibi=None, seed=0):
        cp = _cp()
        rng = np.random.default_rng(seed)
        self.dtype, self.b, self.sq, self.h, self.hk, self.d = dtype, b, sq, h, hk, d
        self.lens = list(lens)
        max_len = max_len or max(max(lens), 1)
        self.q32 = quantize(rng.standard_normal((b, sq, h, d)).astype(np.float32), dtype)
        self.kc, self.vc, self.bt, self.gather = make_cache(rng, dtype, b, lens, hk, d,
                                                            page_size, max_len)
        self.slopes = None
        if alibi is not None:
            self.slopes = rng.uniform(0.02, 0.3, size=(h,) if alibi == "per_head" else (b, h)
                                      ).astype(np.float32)
        self.window, self.causal, self.softcap = window, causal, softcap
        wl, wr = window
        if causal:
            wr = 0
        self.wl, self.wr = wl, wr
        self.q_d, self.kc_d, self.vc_d = (to_dev(x, dtype) for x in (self.q32, self.kc, self.vc))
        self.seqlens_d = cp.asarray(np.asarray(lens, np.int32))
        self.bt_d = None if self.bt is None else cp.asarray(self.bt)
        self.slopes_d = None if self.slopes is None else cp.asarray(self.slopes)

    def outputs(self):
        """Fresh output arrays, poisoned with NaN."""
        cp = _cp()
        out = cp.full((self.b, self.sq, self.h, self.d), cp.nan, dtype=self.q_d.dtype)
        lse = cp.full((self.b, self.h, self.sq), cp.nan, dtype=cp.float32)
        return out, lse

    def launch(self, out, lse, num_splits=0):
        from flashcore.kernels.decode import launch_decode
        return launch_decode(
            self.q_d, self.kc_d, self.vc_d, out, lse, cache_seqlens=self.seqlens_d,
            block_table=self.bt_d, softmax_scale=1.0 / math.sqrt(self.d),
            window_left=self.wl, window_right=self.wr, softcap=self.softcap,
            alibi_slopes=self.slopes_d, num_splits=num_splits)

    def check(self, out, lse):
        """flash-attn's error rule against the float64 reference, -inf / zero empty rows."""
        got_o = out.get().astype(np.float64)
        got_l = lse.get().astype(np.float64)
        assert np.isfinite(got_o).all(), "non-finite output (unwritten, NaN read from the cache?)"
        assert not np.isnan(got_l).any(), "NaN / unwritten lse"
        b, sq, h, d, dtype = self.b, self.sq, self.h, self.d, self.dtype
        kw = dict(causal=self.causal,
                  window_size=(self.window[0], -1 if self.causal else self.window[1]),
                  softcap=self.softcap)
        ro = np.zeros((b, sq, h, d))
        lo = np.zeros((b, sq, h, d))
        rl = np.full((b, h, sq), -np.inf)
        for i, n in enumerate(self.lens):
            if n == 0:
                continue
            k32, v32 = self.gather(self.kc, i)[None], self.gather(self.vc, i)[None]
            qb = self.q32[i:i + 1]
            s64 = None
            if self.slopes is not None:
                s64 = (self.slopes[None] if self.slopes.ndim == 1
                       else self.slopes[i:i + 1]).astype(np.float64)
            hi_spec = forward_spec(qb.astype(np.float64), k32.astype(np.float64),
                                   v32.astype(np.float64), **kw)
            o_hi, l_hi = naive_forward(hi_spec, qb.astype(np.float64), k32.astype(np.float64),
                                       v32.astype(np.float64), s64)
            lo_spec = forward_spec(qb, k32, v32, **kw)
            o_lo, _ = naive_forward(lo_spec, qb, k32, v32,
                                    None if s64 is None else s64.astype(np.float32),
                                    round_to=dtype)
            ro[i], lo[i], rl[i] = o_hi[0], o_lo[0], l_hi[0]
        ro = np.nan_to_num(ro)   # rows with no visible key: 0 by convention
        lo = np.nan_to_num(lo)
        assert_flash_rule("out", got_o, ro, lo, 2)
        assert np.array_equal(np.isneginf(got_l), np.isneginf(rl)), "lse -inf pattern differs"
        fin = np.isfinite(rl)
        if fin.any():
            assert np.abs(got_l[fin] - rl[fin]).max() <= 1e-3 * max(1.0, np.abs(rl[fin]).max()), \
                "lse"
        assert np.all(got_o[~np.isfinite(rl).transpose(0, 2, 1)] == 0), "masked rows must be 0"


def run_decode(dtype, b, sq, h, hk, d, lens, *, page_size=None, max_len=None, causal=False,
               window=(-1, -1), softcap=0.0, alibi=None, num_splits=0, seed=0):
    p = Problem(dtype, b, sq, h, hk, d, lens, page_size=page_size, max_len=max_len,
                causal=causal, window=window, softcap=softcap, alibi=alibi, seed=seed)
    out, lse = p.outputs()
    used = p.launch(out, lse, num_splits)
    assert used >= 1
    if num_splits > 0:
        assert used == num_splits
    p.check(out, lse)
    return used


DTYPES = ["float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16, 48, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_gqa_one_token(dtype, d, page_size, num_splits):
    # lengths not multiples of the page size, one empty sequence; pages of 48 neither divide a
    # key block nor are a multiple of one (a thread's rows of a block still lie in one page)
    lens = [1000, 37, 0, 513]
    run_decode(dtype, 4, 1, 32, 8, d, lens, page_size=page_size, max_len=1100,
               num_splits=num_splits, seed=d + (page_size or 1) + num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_causal(dtype, sq, page_size, num_splits):
    run_decode(dtype, 3, sq, 32, 8, 128, [777, 3, 250], page_size=page_size, causal=True,
               num_splits=num_splits, seed=sq * 7 + num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(100, 0), (64, 8), (0, 0), (5, -1)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window(dtype, window, num_splits):
    run_decode(dtype, 2, 4, 8, 2, 128, [900, 70], page_size=16, window=window,
               num_splits=num_splits, seed=window[0] + num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 72, 128, 200])
@pytest.mark.parametrize("heads", [(32, 8), (6, 2), (8, 1), (4, 4)])
def test_decode_headdims_and_groups(dtype, d, heads):
    # MQA 8:1 with sq 5 gives 40 packed rows: two m16 slices per CTA and several m-blocks
    run_decode(dtype, 2, 5, heads[0], heads[1], d, [300, 1], causal=True, num_splits=0,
               seed=d + heads[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_softcap_alibi(dtype, num_splits):
    run_decode(dtype, 2, 2, 8, 2, 64, [400, 129], softcap=30.0, num_splits=num_splits, seed=1)
    run_decode(dtype, 2, 2, 8, 2, 64, [400, 129], alibi="per_head", causal=True,
               num_splits=num_splits, seed=2)
    run_decode(dtype, 2, 1, 8, 2, 128, [400, 129], alibi="per_batch", page_size=16,
               num_splits=num_splits, seed=3)


def test_decode_more_splits_than_blocks():
    # splits with no key block write lse = -inf only; the combine must skip them
    run_decode("bfloat16", 2, 1, 32, 8, 128, [100, 7], num_splits=40, seed=5)


def test_decode_long_cache_split_heuristic():
    used = run_decode("bfloat16", 1, 1, 32, 8, 128, [16384], num_splits=0, seed=9)
    assert used > 1   # batch 1 x 8 kv heads cannot fill the GPU


def test_decode_strided_out():
    cp = _cp()
    from flashcore.kernels.decode import launch_decode
    rng = np.random.default_rng(3)
    b, sq, h, hk, d = 2, 1, 8, 2, 64
    q = to_dev(rng.standard_normal((b, sq, h, d)).astype(np.float32), "float16")
    kc = to_dev(rng.standard_normal((b, 50, hk, d)).astype(np.float32), "float16")
    vc = to_dev(rng.standard_normal((b, 50, hk, d)).astype(np.float32), "float16")
    big = cp.full((b, sq, h + 3, d + 8), cp.nan, cp.float16)
    out = big[:, :, :h, :d]
    lse = cp.empty((b, h, sq), cp.float32)
    ref_o = cp.empty((b, sq, h, d), cp.float16)
    ref_l = cp.empty((b, h, sq), cp.float32)
    kw = dict(cache_seqlens=cp.asarray(np.array([50, 20], np.int32)), softmax_scale=0.125,
              window_left=-1, window_right=-1, num_splits=2)
    launch_decode(q, kc, vc, out, lse, **kw)
    launch_decode(q, kc, vc, ref_o, ref_l, **kw)
    assert cp.array_equal(out, ref_o) and cp.array_equal(lse, ref_l)
    assert cp.isnan(big[:, :, h:, :]).all()



@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_nan_query_propagates(num_splits):
    """A NaN in one query head poisons that head's output and lse only -- with split-KV too,
    where every split's partial lse is NaN and the combine must not read the row as empty."""
    cp = _cp()
    from flashcore.kernels.decode import launch_decode
    rng = np.random.default_rng(11)
    b, sq, h, hk, d = 2, 1, 8, 2, 64
    qh = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    qh[1, 0, 5, 7] = np.nan
    q = to_dev(qh, "bfloat16")
    kc = to_dev(rng.standard_normal((b, 300, hk, d)).astype(np.float32), "bfloat16")
    vc = to_dev(rng.standard_normal((b, 300, hk, d)).astype(np.float32), "bfloat16")
    out = cp.empty_like(q)
    out.view(cp.uint16).fill(0x7FC0)   # poison: bf16 NaN
    lse = cp.full((b, h, sq), 7.0, cp.float32)
    launch_decode(q, kc, vc, out, lse, cache_seqlens=cp.asarray(np.array([300, 170], np.int32)),
                  softmax_scale=0.125, window_left=-1, window_right=-1, num_splits=num_splits)
    o = out.get().astype(np.float32)
    bad = ~np.isfinite(o)
    assert bad[1, 0, 5].all(), "the NaN query's output is not NaN"
    bad[1, 0, 5] = False
    assert not bad.any(), "a NaN query poisoned another head or batch"
    lh = lse.get()
    assert np.isnan(lh[1, 5, 0]), f"lse of the NaN row is {lh[1, 5, 0]}, expected NaN"
    lh[1, 5, 0] = 0.0
    assert np.isfinite(lh).all()


# ---------------- split-KV: fused combine (one launch) vs the combine kernel ----------------

@pytest.fixture
def combine_mode():
    """set(on) picks the fused combine (True) or the two-kernel path; the fused and cluster
    settings are restored afterwards."""
    from flashcore.kernels import decode
    was, was_cluster = decode.fused_combine_enabled(), decode.cluster_merge_enabled()
    yield decode.set_fused_combine
    decode.set_fused_combine(was)
    decode.set_cluster_merge(was_cluster)


# (fused, cluster): the merge inside a thread-block cluster (sm_90+, up to 16 splits; elsewhere
# the same as the next), the fused global-memory merge, the separate combine kernel
_MERGES = ((True, True), (True, False), (False, False))


def _both_paths(p, num_splits, set_fused, reps=1):
    """Run p with every merge path: the cluster merge, the fused combine and the combine kernel,
    all with the same tile configuration (the cluster kernels' own, which the others then take
    too): the results must be the same bits (the same arithmetic, in the same order, merges the
    same partials). Returns (out, lse) of the default call (default tiles and merge), which the
    caller checks against the reference."""
    from flashcore.kernels import decode
    set_fused(True)
    decode.set_cluster_merge(True)
    out_d, lse_d = p.outputs()
    assert p.launch(out_d, lse_d, num_splits) == num_splits
    tile = decode.headdim_tile(p.d)
    cfg = decode.decode_config(p.d, True, decode._m_tiles(p.d, p.sq * (p.h // p.hk)))
    res = {}
    decode.set_config_override(tile, cfg)
    try:
        for fused, cluster in _MERGES:
            set_fused(fused)
            decode.set_cluster_merge(cluster)
            for _ in range(reps):
                out, lse = p.outputs()
                used = p.launch(out, lse, num_splits)
                assert used == num_splits
            res[fused, cluster] = (out, lse)
    finally:
        decode.set_config_override(tile, None)
        decode.set_cluster_merge(True)
    cp = _cp()
    to, tl = res[False, False]
    for mode in _MERGES[:2]:
        fo, fl = res[mode]
        assert cp.array_equal(fo.view(cp.uint16), to.view(cp.uint16)), f"{mode} != two-kernel output"
        assert cp.array_equal(fl.view(cp.uint32), tl.view(cp.uint32)), f"{mode} != two-kernel lse"
    p.check(*res[True, True])
    return out_d, lse_d


def test_cluster_merge_is_used_on_sm90():
    """On compute capability 9.0+ a call with 2 to 16 splits launches the cluster kernel (so
    that the comparisons above cover it), and a call with more splits does not."""
    cp = _cp()
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("the cluster merge needs sm_90")
    from flashcore import jit
    from flashcore.kernels import decode
    assert decode.cluster_merge_enabled()
    p = Problem("bfloat16", 1, 1, 32, 8, 128, [20000], seed=11)
    for ns, want in ((8, True), (16, True), (17, False)):
        jit.clear_memory_cache()
        out, lse = p.outputs()
        assert p.launch(out, lse, ns) == ns
        p.check(out, lse)
        used = [key[3] for key in jit._kernels if key[2] == "flash_decode.cu"]
        assert any(n.startswith("flash_decode_cluster_kernel") for n in used) == want, used


def _counters_are_zero():
    """Every counter array the fused combine used is back to all zeros."""
    cp = _cp()
    cp.cuda.Device().synchronize()
    from flashcore.kernels import decode
    for key, buf in decode._COUNTERS.items():
        # (a torch call's counters are TorchArrays: torch tests may run in the same process)
        n = int(buf.t.count_nonzero()) if hasattr(buf, "t") else int(cp.count_nonzero(buf))
        assert n == 0, f"counters of {key} not reset"


@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("num_splits", [2, 3, 16, 250])
def test_fused_combine_matches_two_kernels_and_reference(page_size, num_splits, combine_mode):
    # 20000 keys: 313 blocks of 64, so 250 splits mix 1- and 2-block splits with empty ones;
    # 300 and 5 keys: most splits of those sequences are empty; 0 keys: every split is empty
    p = Problem("bfloat16", 4, 1, 8, 2, 128, [20000, 300, 0, 5], page_size=page_size,
                max_len=20100, seed=num_splits + (page_size or 1))
    out, lse = _both_paths(p, num_splits, combine_mode)
    p.check(out, lse)
    _counters_are_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("case", ["gqa_sq4_causal", "mqa_two_mblocks", "window", "d64_alibi",
                                  "d256_softcap", "d72"])
def test_fused_combine_cases(dtype, page_size, case, combine_mode):
    kw = dict(
        gqa_sq4_causal=dict(b=3, sq=4, h=32, hk=8, d=128, lens=[777, 3, 250], causal=True),
        # MQA 8:1 x 5 query rows = 40 packed rows: two m16 slices, two m-blocks per kv head
        mqa_two_mblocks=dict(b=2, sq=5, h=8, hk=1, d=128, lens=[1500, 1], causal=True),
        window=dict(b=2, sq=4, h=8, hk=2, d=128, lens=[900, 70], window=(64, 8)),
        d64_alibi=dict(b=2, sq=2, h=8, hk=2, d=64, lens=[1400, 129], alibi="per_batch",
                       causal=True),
        d256_softcap=dict(b=2, sq=1, h=8, hk=2, d=256, lens=[1000, 17], softcap=30.0),
        d72=dict(b=2, sq=2, h=6, hk=2, d=72, lens=[640, 0]),
    )[case]
    b, sq, h, hk, d, lens = (kw.pop(x) for x in ("b", "sq", "h", "hk", "d", "lens"))
    p = Problem(dtype, b, sq, h, hk, d, lens, page_size=page_size, seed=len(case), **kw)
    for num_splits in (3, 7):
        out, lse = _both_paths(p, num_splits, combine_mode)
        p.check(out, lse)
    _counters_are_zero()


def test_fused_combine_back_to_back_calls(combine_mode):
    """20 calls in a row, no synchronisation between them, alternating two layouts with
    different group and split counts (replays of their launch plans after the first): every
    call's result equals the first of its layout, bit for bit (the counters are reset by each
    launch), and the counters are zero at the end."""
    cp = _cp()
    combine_mode(True)
    pa = Problem("bfloat16", 1, 1, 32, 8, 128, [4096], seed=1)
    pb = Problem("float16", 3, 2, 16, 4, 64, [1000, 0, 33], page_size=16, max_len=1024, seed=2)
    results = {id(pa): [], id(pb): []}
    for i in range(20):
        p, ns = (pa, 16) if i % 2 == 0 else (pb, 5)
        out, lse = p.outputs()
        assert p.launch(out, lse, ns) == ns
        results[id(p)].append((out, lse))
    for p in (pa, pb):
        (o0, l0), *rest = results[id(p)]
        p.check(o0, l0)
        for o, l in rest:
            assert cp.array_equal(o.view(cp.uint16), o0.view(cp.uint16))
            assert cp.array_equal(l.view(cp.uint32), l0.view(cp.uint32))
    _counters_are_zero()


def test_fused_combine_two_streams_concurrently(combine_mode):
    """Calls queued alternately on two streams (which run concurrently) use each its own
    counters: every result equals the same call run alone."""
    cp = _cp()
    from flashcore.kernels import decode
    combine_mode(True)
    decode.set_cluster_merge(False)     # the counters are what this test is about
    probs = [Problem("bfloat16", 1, 1, 32, 8, 128, [16384], seed=3),
             Problem("bfloat16", 1, 1, 32, 8, 128, [16384], seed=4)]
    alone = []
    for p in probs:
        out, lse = p.outputs()
        p.launch(out, lse, 16)
        p.check(out, lse)
        alone.append((out, lse))
    streams = [cp.cuda.Stream(non_blocking=True) for _ in probs]
    got = [[], []]
    for _ in range(10):
        for j, (p, st) in enumerate(zip(probs, streams)):
            with st:
                out, lse = p.outputs()
                p.launch(out, lse, 16)
                got[j].append((out, lse))
    for st in streams:
        st.synchronize()
    for j in range(2):
        o0, l0 = alone[j]
        for o, l in got[j]:
            assert cp.array_equal(o.view(cp.uint16), o0.view(cp.uint16)), f"stream {j}"
            assert cp.array_equal(l.view(cp.uint32), l0.view(cp.uint32)), f"stream {j}"
    dev = cp.cuda.Device().id
    ptrs = {decode._COUNTERS[(dev, st.ptr)].data.ptr for st in streams}
    assert len(ptrs) == 2, "the streams shared a counter array"
    _counters_are_zero()


@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("window", [(-1, -1), (40, 0), (0, 0)])
def test_fused_combine_empty_and_short_sequences(page_size, window, combine_mode):
    """cache_seqlens with 0 and lengths shorter than one split (or one key block): the CTAs
    whose split has no key still arrive (lse -inf), so every group is merged exactly once."""
    lens = [0, 1, 5, 63, 64, 65, 200, 0]
    p = Problem("bfloat16", len(lens), 2, 16, 4, 128, lens, page_size=page_size, max_len=256,
                window=window, seed=7)
    for num_splits in (2, 16, 64):
        out, lse = _both_paths(p, num_splits, combine_mode)
        p.check(out, lse)
    _counters_are_zero()


def test_fused_combine_many_groups(combine_mode):
    """More groups (sequences x kv heads x m-blocks) than the first counter array holds
    (1024): the array grows, zero-filled, and every group is merged."""
    rng = np.random.default_rng(8)
    lens = [int(x) for x in rng.integers(0, 200, size=160)]
    p = Problem("float16", 160, 1, 16, 8, 64, lens, page_size=16, max_len=208, seed=8)
    out, lse = _both_paths(p, 2, combine_mode)   # 1280 groups
    p.check(out, lse)
    _counters_are_zero()


@pytest.mark.parametrize("fused", [True, False])
def test_fused_combine_nan_query(fused, combine_mode):
    combine_mode(fused)
    test_decode_nan_query_propagates(3)


# ---------------- append + rotary ----------------

def _rotary_ref(x, cos, sin, pos, interleaved):
    """x (s, nh, d) float64 at positions pos (s,): flash-attn's apply_rotary_emb."""
    r = 2 * cos.shape[1]
    c, s_ = cos[pos][:, None, :], sin[pos][:, None, :]
    y = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        y[..., 0:r:2] = x1 * c - x2 * s_
        y[..., 1:r:2] = x1 * s_ + x2 * c
    else:
        x1, x2 = x[..., :r // 2], x[..., r // 2:r]
        y[..., :r // 2] = x1 * c - x2 * s_
        y[..., r // 2:r] = x1 * s_ + x2 * c
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("rotary", [None, "plain", "interleaved"])
def test_rotary_append(dtype, page_size, rotary):
    cp = _cp()
    from flashcore.kernels.decode import launch_rotary_append
    rng = np.random.default_rng(4)
    b, hk, h, d, s_new, rd = 3, 2, 4, 64, 3, 32
    before = [10, 0, 29]
    max_len = 40
    lens_after = [n + s_new for n in before]
    # pages are allocated for the lengths after the append; rows past `before` get overwritten
    kc, vc, bt, gather = make_cache(rng, dtype, b, lens_after, hk, d, page_size, max_len)
    kc = np.nan_to_num(kc)
    vc = np.nan_to_num(vc)
    k_new = quantize(rng.standard_normal((b, s_new, hk, d)).astype(np.float32), dtype)
    v_new = quantize(rng.standard_normal((b, s_new, hk, d)).astype(np.float32), dtype)
    q = quantize(rng.standard_normal((b, s_new, h, d)).astype(np.float32), dtype)
    cos = sin = None
    if rotary:
        ang = rng.uniform(0, 2 * np.pi, size=(64, rd // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc_d, vc_d = to_dev(kc, dtype), to_dev(vc, dtype)
    q_out = launch_rotary_append(
        kc_d, vc_d, to_dev(k_new, dtype), to_dev(v_new, dtype),
        cp.asarray(np.asarray(before, np.int32)), None if bt is None else cp.asarray(bt),
        None if cos is None else cp.asarray(cos), None if sin is None else cp.asarray(sin),
        rotary == "interleaved", q=to_dev(q, dtype))
    got_k = kc_d.get().astype(np.float32)
    got_v = vc_d.get().astype(np.float32)
    got_q = q_out.get().astype(np.float64)
    rel = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10   # one ulp of the stored value
    for i in range(b):
        pos = before[i] + np.arange(s_new)
        if page_size is None:
            gk, gv = got_k[i, pos], got_v[i, pos]
            old_k, old_v = got_k[i, :before[i]], got_v[i, :before[i]]
        else:
            gk = got_k[bt[i, pos // page_size], pos % page_size]
            gv = got_v[bt[i, pos // page_size], pos % page_size]
            t = np.arange(before[i])
            old_k = got_k[bt[i, t // page_size], t % page_size]
            old_v = got_v[bt[i, t // page_size], t % page_size]
        # rows before the append are untouched; v is copied bit-exactly
        assert np.array_equal(old_k, gather(kc, i)[:before[i]])
        assert np.array_equal(old_v, gather(vc, i)[:before[i]])
        assert np.array_equal(gv, v_new[i])
        if rotary:
            want_k = _rotary_ref(k_new[i].astype(np.float64), cos, sin, pos, rotary == "interleaved")
            want_q = _rotary_ref(q[i].astype(np.float64), cos, sin, pos, rotary == "interleaved")
            assert (np.abs(gk - want_k) <= rel * np.abs(want_k) + 1e-4).all()
            assert (np.abs(got_q[i] - want_q) <= rel * np.abs(want_q) + 1e-4).all()
            assert np.array_equal(gk[..., rd:], k_new[i][..., rd:])
        else:
            assert np.array_equal(gk, k_new[i])
            assert np.array_equal(got_q[i], q[i])
    assert lens_after  # the caller then decodes with cache_seqlens = before + s_new


# ---------------- cache_leftpad: each sequence's keys start at its own row ----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,sq", [(False, 1), (True, 1), (True, 3)])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("api", [False, True])
def test_decode_cache_leftpad(dtype, causal, sq, num_splits, api):
    """The valid keys of sequence i sit at rows [leftpad[i], leftpad[i] + n_i) of a cache whose
    rows before them are NaN (any read of the padding shows in the output): the result must be
    the reference over the valid keys alone."""
    import flashcore
    cp = _cp()
    lens, pads = [300, 1, 777, 0], [5, 64, 0, 33]
    p = Problem(dtype, 4, sq, 8, 2, 128, lens, causal=causal, seed=11)
    cap = max(n + lp for n, lp in zip(lens, pads)) + 7
    kc = np.full((4, cap, 2, 128), np.nan, np.float32)
    vc = np.full((4, cap, 2, 128), np.nan, np.float32)
    for i, (n, lp) in enumerate(zip(lens, pads)):
        kc[i, lp:lp + n], vc[i, lp:lp + n] = p.kc[i, :n], p.vc[i, :n]
    kc_d, vc_d = to_dev(kc, dtype), to_dev(vc, dtype)
    seqlens = cp.asarray(np.array([n + lp for n, lp in zip(lens, pads)], np.int32))
    leftpad = cp.asarray(np.array(pads, np.int32))
    out, lse = p.outputs()
    if api:
        out, lse = flashcore.attention_with_kvcache(
            p.q_d, kc_d, vc_d, cache_seqlens=seqlens, cache_leftpad=leftpad, causal=causal,
            num_splits=num_splits, out=out, lse=lse, return_lse=True)
    else:
        from flashcore.kernels.decode import launch_decode
        launch_decode(p.q_d, kc_d, vc_d, out, lse, cache_seqlens=seqlens,
                      cache_leftpad=leftpad, softmax_scale=1.0 / math.sqrt(128),
                      window_left=-1, window_right=0 if causal else -1, num_splits=num_splits)
    p.check(out, lse)


# ---------------- head dims that are no multiple of 8: padded as flash-attn pads them ----------

@pytest.mark.parametrize("d", [59, 111])
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("torch_api", [False, True])
def test_decode_odd_headdims_pad_like_flash_attn(d, page_size, torch_api):
    """An odd head dim decodes (q, the caches and the new keys padded with zero columns, the
    appended rows copied back, as flash-attn does): the output and the caches equal those of
    the same call made on explicitly zero-padded arrays (the kernels' own path, bit for bit),
    and the output is the float64 oracle's within the flash-attn rule; the caches' padding
    never reaches the caller's arrays."""
    import flashcore
    cp = _cp()
    dtype = "bfloat16"
    rng = np.random.default_rng(d + (page_size or 0))
    b, hk, h, s_new, rd = 3, 2, 4, 2, 32
    before = [10, 0, 300]
    lens_after = [n + s_new for n in before]
    kc, vc, bt, gather = make_cache(rng, dtype, b, lens_after, hk, d, page_size, 320)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    q = quantize(rng.standard_normal((b, s_new, h, d)).astype(np.float32), dtype)
    k_new = quantize(rng.standard_normal((b, s_new, hk, d)).astype(np.float32), dtype)
    v_new = quantize(rng.standard_normal((b, s_new, hk, d)).astype(np.float32), dtype)
    ang = rng.uniform(0, 2 * np.pi, size=(400, rd // 2))
    cos, sin = (to_dev(f(ang).astype(np.float32), dtype) for f in (np.cos, np.sin))   # q's dtype
    lens = cp.asarray(np.asarray(before, np.int32))
    table = None if bt is None else cp.asarray(bt)
    d8 = -(-d // 8) * 8

    def pad(x):
        p = np.zeros((*x.shape[:-1], d8), np.float32)
        p[..., :d] = x
        return p

    def call(q_, kc_, vc_, k_, v_, scale):
        args = [to_dev(x, dtype) for x in (q_, kc_, vc_, k_, v_)]
        kw = dict(cache_seqlens=lens, block_table=table, rotary_cos=cos, rotary_sin=sin,
                  causal=True, softmax_scale=scale)
        if torch_api:
            import torch
            t = [torch.from_dlpack(x) for x in args]
            out = flashcore.attention_with_kvcache(*t, **{n: (torch.from_dlpack(a) if a is not None
                                                              and not isinstance(a, (bool, float))
                                                              else a) for n, a in kw.items()})
            out = cp.from_dlpack(out)
        else:
            out = flashcore.attention_with_kvcache(*args, **kw)
        return out.get().astype(np.float32), args[1].get().astype(np.float32), \
            args[2].get().astype(np.float32)

    scale = 1.0 / math.sqrt(d)
    got, got_kc, got_vc = call(q, kc, vc, k_new, v_new, scale)
    want, want_kc, want_vc = call(pad(q), pad(kc), pad(vc), pad(k_new), pad(v_new), scale)
    assert got.shape == q.shape and got_kc.shape == kc.shape
    assert np.array_equal(got, want[..., :d])
    assert np.array_equal(got_kc, want_kc[..., :d]) and np.array_equal(got_vc, want_vc[..., :d])
    # the oracle: the updated cache (as the kernels stored it) and the rotated query, float64
    from flashcore.reference import apply_rotary
    qr = apply_rotary(
        q.astype(np.float64), cos.get().astype(np.float64), sin.get().astype(np.float64),
        np.asarray(before)[:, None] + np.arange(s_new), False)
    for i in range(b):
        n = lens_after[i]
        ks, vs = gather(got_kc, i)[:n].astype(np.float64), gather(got_vc, i)[:n].astype(np.float64)
        args = [x[None] for x in (qr[i], ks, vs)]
        ro, _ = naive_forward(forward_spec(*args, causal=True), *args)
        lo_args = [quantize(x.astype(np.float32), dtype)[None] for x in (qr[i], ks, vs)]
        lo, _ = naive_forward(forward_spec(*lo_args, causal=True), *lo_args, round_to=dtype)
        assert_flash_rule(f"seq{i}", got[i][None].astype(np.float64), ro, lo, 2)


# ---------------- key_mask: a per-key mask (padding with holes) ----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("causal,sq,window", [(False, 1, (-1, -1)), (True, 4, (-1, -1)),
                                              (True, 1, (300, 0))])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_key_mask(dtype, page_size, causal, sq, window, num_splits):
    """key_mask with holes (NaN in every masked row of the cache, so a masked key that is read
    shows), through the public function, against the float64 oracle over each sequence's
    attended keys (kept and inside the window; the last sq keys are kept, so causal over the
    gathered keys is causal over positions), with the flash-attn rule; a sequence whose keys
    are all masked gives 0 and -inf. num_splits 0 at 5000 keys takes the sm_90 cluster merge."""
    import flashcore
    cp = _cp()
    rng = np.random.default_rng(sum(map(ord, f"{dtype}{page_size}{causal}{sq}{num_splits}")))
    lens = [5000, 1, 777, 0, 300]
    b, h, hk, d = len(lens), 8, 2, 128
    p = Problem(dtype, b, sq, h, hk, d, lens, page_size=page_size, max_len=5003, causal=causal,
                window=window, seed=3)
    cap = 5003 if page_size is None else p.bt.shape[1] * page_size
    keep = rng.random((b, cap)) < 0.7
    keep[2] = False                     # every key masked
    keep[4, :250] = False               # a long run masked (whole blocks)
    for i, n in enumerate(lens):
        if i != 2:
            keep[i, max(n - sq, 0):n] = True
    kc, vc = p.kc.copy(), p.vc.copy()   # NaN at the masked keys
    for i, n in enumerate(lens):
        for t in np.flatnonzero(~keep[i, :n]):
            slot = (i, t) if page_size is None else (p.bt[i, t // page_size], t % page_size)
            kc[slot], vc[slot] = np.nan, np.nan
    out, lse = p.outputs()
    out, lse = flashcore.attention_with_kvcache(
        p.q_d, to_dev(kc, dtype), to_dev(vc, dtype), cache_seqlens=p.seqlens_d,
        block_table=p.bt_d, causal=causal, window_size=window, num_splits=num_splits,
        key_mask=cp.asarray(keep), out=out, lse=lse, return_lse=True)
    got_o, got_l = out.get().astype(np.float64), lse.get().astype(np.float64)
    assert np.isfinite(got_o).all(), "non-finite output: a masked (NaN) key was read"
    ro, lo = np.zeros((b, sq, h, d)), np.zeros((b, sq, h, d))
    rl = np.full((b, h, sq), -np.inf)
    wl = window[0]
    for i, n in enumerate(lens):
        t = np.arange(n)
        sel = keep[i, :n] & ((t >= n - 1 - wl) if wl >= 0 else True)   # (window: sq == 1)
        if not sel.any():
            continue
        k32, v32 = p.gather(kc, i)[sel][None], p.gather(vc, i)[sel][None]
        qb = p.q32[i:i + 1]
        x64 = [x.astype(np.float64) for x in (qb, k32, v32)]
        o_hi, l_hi = naive_forward(forward_spec(*x64, causal=causal), *x64)
        o_lo, _ = naive_forward(forward_spec(qb, k32, v32, causal=causal), qb, k32, v32,
                                round_to=dtype)
        ro[i], lo[i], rl[i] = o_hi[0], o_lo[0], l_hi[0]
    assert_flash_rule("out", got_o, np.nan_to_num(ro), np.nan_to_num(lo), 2)
    assert np.array_equal(np.isneginf(got_l), np.isneginf(rl))
    fin = np.isfinite(rl)
    assert np.abs(got_l[fin] - rl[fin]).max() <= 1e-3 * max(1.0, np.abs(rl[fin]).max())
    assert (got_o[2] == 0).all() and (got_o[3] == 0).all() and np.isneginf(got_l[2]).all()


def test_decode_key_mask_all_true_equals_no_mask():
    """An all-True mask gives the unmasked call's result bit for bit (same kernel, same sums)."""
    import flashcore
    cp = _cp()
    p = Problem("bfloat16", 3, 1, 32, 8, 128, [4000, 17, 900], causal=True, seed=4)
    a = flashcore.attention_with_kvcache(p.q_d, p.kc_d, p.vc_d, cache_seqlens=p.seqlens_d,
                                         causal=True)
    m = cp.ones((3, p.kc_d.shape[1]), dtype=cp.bool_)
    b = flashcore.attention_with_kvcache(p.q_d, p.kc_d, p.vc_d, cache_seqlens=p.seqlens_d,
                                         causal=True, key_mask=m)
    assert bool((a == b).all())


def test_peak_memory_bandwidth_of_this_device():
    """What the split rule reads (jit.peak_memory_bandwidth, from the driver's memory clock and
    bus width): a plausible peak for a GPU, 0.5-20 TB/s (H100 SXM 3.35, H200 4.8)."""
    from flashcore import jit
    bw = jit.peak_memory_bandwidth(_cp().cuda.Device().id)
    assert 5e11 < bw < 2e13, bw
