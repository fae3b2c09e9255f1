"""The CuPy backend's kernels against the float64 NumPy oracle, with the flash-attn rule:
max error <= 2x that of the same computation in the low precision (3x for gradients).

Outputs are poisoned (NaN) before each run, inputs are fresh random data, sizes are odd.
"""
from __future__ import annotations


import numpy as np
import pytest

from refutils import assert_flash_rule, quantize, to_dev
from flashcore.reference import naive_backward, naive_forward, round_to_dtype
from flashcore.spec import forward_spec

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16"]


def _cp():
    import cupy
    return cupy


def to_host64(x):
    return x.get().astype(np.float64)


def _slopes(kind, b, h, rng):
    if kind is None:
        return None
    shape = (h,) if kind == "per_head" else (b, h)
    return rng.uniform(0.02, 0.3, size=shape).astype(np.float32)


def run_case(dtype, b, sq, sk, h, hk, d, causal=False, window=(-1, -1), softcap=0.0,
             alibi=None, seed=0, qscale=1.0, kvscale=1.0, backward=True, deterministic=False,
             strided=False, api=False):
    """One case against the oracle; ``api=True`` goes through the public functions (with the
    poisoned outputs passed as ``out=`` ... ``dv=``), where launch plans are recorded and
    replayed, instead of the backend."""
    cp = _cp()
    from flashcore.backends.cupy_backend import CupyBackend
    rng = np.random.default_rng(seed)
    q32 = quantize(rng.standard_normal((b, sq, h, d)).astype(np.float32) * qscale, dtype)
    k32 = quantize(rng.standard_normal((b, sk, hk, d)).astype(np.float32) * kvscale, dtype)
    v32 = quantize(rng.standard_normal((b, sk, hk, d)).astype(np.float32) * kvscale, dtype)
    do32 = quantize(rng.standard_normal((b, sq, h, d)).astype(np.float32), dtype)
    slopes = _slopes(alibi, b, h, rng)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    q, k, v, do = (to_dev(x, dtype) for x in (q32, k32, v32, do32))
    if strided:   # non-contiguous head/seq strides, contiguous last dim
        def widen(x):
            big = cp.zeros((x.shape[0], x.shape[1], x.shape[2] + 3, x.shape[3] + 8), x.dtype)
            big[:, :, :x.shape[2], :x.shape[3]] = x
            return big[:, :, :x.shape[2], :x.shape[3]]
        q, k, v, do = (widen(x) for x in (q, k, v, do))
        assert not q.flags.c_contiguous
    spec = forward_spec(q, k, v, alibi_slopes=None if slopes is None else cp.asarray(slopes),
                        deterministic=deterministic, **kw)
    be = CupyBackend()
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)           # poison
    lse = cp.full((b, h, sq), cp.nan, dtype=cp.float32)
    if api:
        import flashcore
        out, lse = flashcore.attention_forward(
            q, k, v, out=out, lse=lse, deterministic=deterministic,
            alibi_slopes=None if slopes is None else cp.asarray(slopes), **kw)
    else:
        out, lse = be.forward(spec, q, k, v, out=out, lse=lse,
                              alibi_slopes=None if slopes is None else cp.asarray(slopes))
    s64 = None if slopes is None else (np.broadcast_to(slopes[None], (b, h)) if slopes.ndim == 1 else slopes)
    hi_spec = forward_spec(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64), **kw)
    ro, rl = naive_forward(hi_spec, q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64), s64)
    lo_spec = forward_spec(q32, k32, v32, **kw)
    lo_o, _ = naive_forward(lo_spec, q32, k32, v32, s64, round_to=dtype)
    got_o = to_host64(out)
    assert np.isfinite(got_o).all(), "non-finite output (unwritten or NaN)"
    assert_flash_rule("out", got_o, ro, lo_o, 2)
    got_l = lse.get().astype(np.float64)
    assert not np.isnan(got_l).any(), "NaN / unwritten lse"
    assert np.array_equal(np.isneginf(got_l), np.isneginf(rl)), "lse -inf pattern differs"
    fin = np.isfinite(rl)
    if fin.any():
        assert np.abs(got_l[fin] - rl[fin]).max() <= 1e-3 * max(1.0, np.abs(rl[fin]).max()), "lse"
    if not backward:
        return
    dq = cp.full(q.shape, cp.nan, q.dtype)
    dk = cp.full(k.shape, cp.nan, k.dtype)
    dv = cp.full(v.shape, cp.nan, v.dtype)
    if api:
        dq, dk, dv = flashcore.attention_backward(
            do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=deterministic,
            alibi_slopes=None if slopes is None else cp.asarray(slopes), **kw)
    else:
        dq, dk, dv = be.backward(spec, do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                                 alibi_slopes=None if slopes is None else cp.asarray(slopes))
    rg = naive_backward(hi_spec, do32.astype(np.float64), q32.astype(np.float64),
                        k32.astype(np.float64), v32.astype(np.float64), s64)
    lg = naive_backward(lo_spec, do32, q32, k32, v32, s64, round_to=dtype)
    for name, got, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), rg, lg):
        g = to_host64(got)
        assert np.isfinite(g).all(), f"{name}: non-finite gradient"
        assert_flash_rule(name, g, r, round_to_dtype(l.astype(np.float32), dtype), 3)
    return out, lse, (dq, dk, dv)


# ---------- the main matrix: every tile and odd head dims, both dtypes, odd seqlens ----------
HEADDIMS = [32, 40, 64, 72, 96, 128, 192, 200, 256]
SEQS = [(1, 1), (17, 113), (113, 203), (203, 17), (1023, 2049), (2049, 1023)]
MATRIX = []
for i, d in enumerate(HEADDIMS):
    for j, (sq, sk) in enumerate(SEQS):
        if d >= 192 and sq * sk > 2_000_000 and j % 2:
            continue
        causal = (i + j) % 2 == 1
        heads = [(6, 2), (6, 1), (4, 4)][(i + j) % 3]
        MATRIX.append((d, sq, sk, causal, heads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,sq,sk,causal,heads", MATRIX,
                         ids=[f"d{d}-{sq}x{sk}-{'c' if c else 'f'}-{h[0]}:{h[1]}" for d, sq, sk, c, h in MATRIX])
def test_matrix(dtype, d, sq, sk, causal, heads):
    b = 2 if sq * sk < 1_000_000 else 1
    run_case(dtype, b, sq, sk, heads[0], heads[1], d, causal=causal, seed=hash((d, sq, sk)) % 1000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_both_causal_settings_each_tile(dtype, d, causal):
    run_case(dtype, 2, 300, 300, 4, 2, d, causal=causal, seed=11)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_large_scores_no_inf_nan(dtype, d):
    # flash-attn's stress: q x5, k and v x3 push scores past the fp16 range
    run_case(dtype, 2, 257, 311, 4, 2, d, qscale=5.0, kvscale=3.0, causal=True, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(dtype):
    cp = _cp()
    out, lse, grads = run_case(dtype, 2, 300, 100, 4, 2, 64, causal=True, seed=3)
    assert bool(cp.all(out[:, :200] == 0)) and bool(cp.all(cp.isneginf(lse[:, :, :200])))
    assert bool(cp.all(grads[0][:, :200] == 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(64, 0), (17, 33), (-1, 5), (100, -1), (0, 0)])
@pytest.mark.parametrize("d", [64, 128])
def test_sliding_window(dtype, window, d):
    run_case(dtype, 2, 333, 517, 4, 2, d, window=window, seed=17)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_softcap(dtype, d):
    run_case(dtype, 2, 211, 257, 4, 2, d, softcap=10.0, qscale=3.0, causal=True, seed=19)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alibi", ["per_head", "per_batch_head"])
def test_alibi(dtype, alibi):
    run_case(dtype, 2, 211, 257, 4, 2, 64, alibi=alibi, causal=True, seed=23)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype):
    run_case(dtype, 2, 129, 177, 4, 2, 64, strided=True, seed=29)


@pytest.mark.parametrize("softmax_scale", [1e-4, 3.0])
def test_extreme_softmax_scale(softmax_scale):
    import flashcore
    rng = np.random.default_rng(31)
    q, k, v = (to_dev(rng.standard_normal(s).astype(np.float32), "bfloat16")
               for s in ((1, 100, 2, 64), (1, 130, 2, 64), (1, 130, 2, 64)))
    out, lse = flashcore.attention_forward(q, k, v, softmax_scale=softmax_scale)
    h = [x.get().astype(np.float64) for x in (q, k, v)]
    spec = forward_spec(*h, softmax_scale=softmax_scale)
    ro, rl = naive_forward(spec, *h)
    assert np.isfinite(out.get().astype(np.float32)).all()
    assert np.abs(out.get().astype(np.float64) - ro).max() < 5e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_with_empty_sequences(dtype):
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(37)
    lens_q, lens_k = [5, 0, 130, 1, 77], [9, 4, 200, 0, 77]
    h, hk, d = 6, 2, 64
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q32 = quantize(rng.standard_normal((cu_q[-1], h, d)).astype(np.float32), dtype)
    k32 = quantize(rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32), dtype)
    v32 = quantize(rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32), dtype)
    do32 = quantize(rng.standard_normal(q32.shape).astype(np.float32), dtype)
    q, k, v, do = (to_dev(x, dtype) for x in (q32, k32, v32, do32))
    for causal in (False, True):
        out, lse = flashcore.varlen_attention_forward(q, k, v, cp.asarray(cu_q), cp.asarray(cu_k),
                                                      causal=causal)
        dq, dk, dv = flashcore.varlen_attention_backward(do, q, k, v, out, lse, cp.asarray(cu_q),
                                                         cp.asarray(cu_k), causal=causal)
        ro, rl = flashcore.varlen_attention_forward(*(x.astype(np.float64) for x in (q32, k32, v32)),
                                                    cu_q, cu_k, causal=causal)
        lo, _ = flashcore.varlen_attention_forward(q32, k32, v32, cu_q, cu_k, causal=causal)
        assert_flash_rule("out", to_host64(out), ro, quantize(lo, dtype), 2, atol=2e-3)
        gl = lse.get()
        assert np.array_equal(np.isneginf(gl), np.isneginf(rl))
        rg = flashcore.varlen_attention_backward(*(x.astype(np.float64) for x in (do32, q32, k32, v32)),
                                                 ro, rl, cu_q, cu_k, causal=causal)
        for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), rg):
            g = to_host64(g)
            assert np.isfinite(g).all(), name
            assert np.abs(g - r).max() < 0.05 * max(1.0, np.abs(r).max()), name


@pytest.mark.parametrize("d", [64, 128])
def test_forward_is_bitwise_repeatable(d):
    """A race shows up as a result that moves between identical runs."""
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(41)
    q, k, v = (to_dev(rng.standard_normal(s).astype(np.float32), "bfloat16")
               for s in ((2, 1000, 4, d), (2, 1000, 2, d), (2, 1000, 2, d)))
    o0, l0 = flashcore.attention_forward(q, k, v, causal=True)
    for _ in range(250):
        o, l = flashcore.attention_forward(q, k, v, causal=True)
        assert bool((o.view(cp.uint16) == o0.view(cp.uint16)).all())
        assert bool((l == l0).all())


@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_backward_bitwise(d):
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(43)
    q, k, v, do = (to_dev(rng.standard_normal(s).astype(np.float32), "bfloat16")
                   for s in ((2, 777, 6, d), (2, 901, 2, d), (2, 901, 2, d), (2, 777, 6, d)))
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    ref = flashcore.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(10):
        g = flashcore.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
        for a, b in zip(g, ref):
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


def test_deterministic_matches_reference():
    run_case("bfloat16", 2, 333, 444, 6, 2, 128, causal=True, deterministic=True, seed=47)


def test_bad_headdim_refused_before_launch():
    import flashcore
    from flashcore.backends.base import NotSupportedError
    rng = np.random.default_rng(0)
    q = to_dev(rng.standard_normal((1, 8, 2, 264)).astype(np.float32), "float16")
    with pytest.raises(NotSupportedError, match="headdim 264"):
        flashcore.attention_forward(q, q, q)
    q = _cp().asarray(rng.standard_normal((1, 8, 2, 64)).astype(np.float32))
    with pytest.raises(NotSupportedError, match="float32"):
        flashcore.attention_forward(q, q, q)


# Head dims that are no multiple of 8: padded with zero columns (flash-attn's way), forward
# and backward, against the oracle with the flash-attn rule.
ODD_HEADDIMS = [(1, (37, 29), True), (3, (64, 64), False), (17, (130, 77), True),
                (33, (1, 200), False), (100, (257, 300), True), (250, (65, 129), False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,seqs,causal", ODD_HEADDIMS)
def test_head_dims_not_multiple_of_8(dtype, d, seqs, causal):
    run_case(dtype, 2, seqs[0], seqs[1], 4, 2, d, causal=causal, seed=d)
    run_case(dtype, 1, seqs[0], seqs[1], 2, 1, d, causal=causal, seed=d + 1, api=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_inf_propagates_only_where_the_math_says(where, dtype):
    """A +inf input element poisons exactly the outputs exact attention makes non-finite
    (refutils.inf_case), never another row, head or batch; its lse likewise."""
    import flashcore
    from refutils import inf_case
    q, k, v, must, may = inf_case(np.random.default_rng(12), where)
    out, lse = flashcore.attention_forward(*(to_dev(x, dtype) for x in (q, k, v)), causal=True)
    bad = ~np.isfinite(out.get().astype(np.float32))
    assert bad[must].all(), "an output the +inf reaches is finite"
    assert not bad[~may].any(), "the +inf reached an output it cannot reach"
    lbad = np.isnan(lse.get())                      # (b, h, sq); rows made NaN have NaN lse
    assert not lbad[[0, 2]].any() and not lbad[1, 2:].any()


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_stays_in_its_batch_and_head(where):
    """A NaN input poisons only outputs that depend on it: never another batch or head, and a
    NaN in q only its own row (same property as the NumPy reference's test)."""
    import flashcore
    rng = np.random.default_rng(53)
    host = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            (("q", (3, 130, 4, 64)), ("k", (3, 150, 2, 64)), ("v", (3, 150, 2, 64)))}
    host[where][1, 5, 0, 3] = np.nan
    q, k, v = (to_dev(host[n], "bfloat16") for n in "qkv")
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    bad = ~np.isfinite(out.get().astype(np.float32))
    assert not bad[0].any() and not bad[2].any(), "another batch was poisoned"
    assert not bad[1, :, 2:].any(), "another head group was poisoned"
    if where == "q":
        assert bad[1, 5, 0].all() and bad[1].sum() == bad[1, 5, 0].size
        lh = lse.get()
        assert np.isnan(lh[1, 0, 5]), "the NaN row's lse reads as a fully masked row"
        lh[1, 0, 5] = 0.0
        assert np.isfinite(lh).all()
    else:   # every row that sees key 5 (causal, offset 20: all rows) is NaN in heads 0-1
        assert bad[1, :, :2][..., slice(None) if where == "k" else 3].all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_replayed_launch_plans_take_new_pointers(dtype, deterministic):
    """The second and third calls of a layout replay the plan the first recorded
    (flashcore/kernels/plans.py) with new arrays: each result is checked against the oracle."""
    from flashcore.kernels import plans
    plans.clear()
    for seed in (31, 32, 33):
        run_case(dtype, 2, 300, 257, 6, 2, 128, causal=True, seed=seed,
                 deterministic=deterministic, api=True)
        assert sum(k[0] == "fwd" for k in plans.PLANS) == 1
        assert sum(k[0] == "bwd" for k in plans.PLANS) == 1


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_contiguous_input_with_unaligned_base(where):
    """A contiguous array whose base is not 16-byte aligned (a flat slice at an odd offset) is
    copied before the kernels read it with 16-byte loads: same result as the aligned array."""
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(8)
    arrs = {n: cp.asarray(rng.standard_normal((2, 77, 4, 64)).astype(np.float16)) for n in "qkv"}
    ref, ref_l = flashcore.attention_forward(arrs["q"], arrs["k"], arrs["v"], causal=True)
    flat = cp.empty(arrs[where].size + 3, cp.float16)
    odd = flat[3:].reshape(arrs[where].shape)
    odd[...] = arrs[where]
    assert odd.flags.c_contiguous and odd.data.ptr % 16 != 0
    got, got_l = flashcore.attention_forward(*(odd if n == where else arrs[n] for n in "qkv"),
                                             causal=True)
    assert cp.array_equal(got, ref) and cp.array_equal(got_l, ref_l)


def _poison_pool(nbytes=256 << 20):
    """Fill free memory of CuPy's pool with NaN: a scratch buffer that a kernel should have
    initialised and did not then reads NaN (the dQ accumulator is allocated uninitialised)."""
    cp = _cp()
    junk = cp.full(nbytes // 4, cp.nan, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    del junk


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dq_accumulator_is_zeroed_by_preprocess(d, causal):
    """The preprocess kernel zeroes the fp32 dQ accumulator's rows (there is no separate fill):
    over a memory pool full of NaN, the gradients are still finite and right (on cc 9.0 the
    Hopper dK/dV kernel at d64/d128, the Ampere one at d256)."""
    _poison_pool()
    run_case("bfloat16", 2, 203, 150, 4, 2, d, causal=causal, seed=d + causal)


def test_dq_accumulator_is_zeroed_by_preprocess_varlen():
    _poison_pool()
    test_varlen_with_empty_sequences("float16")


@pytest.mark.parametrize("d, page, kw", [
    (128, 128, dict(causal=True)), (64, 256, dict()), (96, 128, dict(window_size=(100, 7))),
    (128, 256, dict(softcap=4.0, causal=True)), (256, 128, dict(causal=True)),
    (40, 128, dict(causal=True)),
    # pages smaller than the key tile, or no multiple of it: one page per thread's rows (d128,
    # d64, d256, d40), a lookup per chunk (d96, d192)
    (128, 16, dict(causal=True)), (64, 48, dict()), (96, 16, dict(window_size=(100, 7))),
    (192, 48, dict(causal=True)), (256, 16, dict(softcap=4.0)), (40, 16, dict(causal=True)),
    # on sm_90 the warp-specialised kernel (windowed instantiation, 128-key blocks at d64 and
    # d128, 64 at d256): pages of whole blocks by TMA, others copied by its producer
    (128, 256, dict()), (128, 48, dict()), (256, 48, dict()), (64, 32, dict(causal=True)),
    (128, 64, dict(window_size=(100, 7))), (256, 64, dict()), (64, 128, dict(causal=True)),
])
@pytest.mark.parametrize("api", ["cupy", "torch"])
def test_varlen_over_a_paged_cache(d, page, kw, api):
    """Chunked prefill over a paged cache (block_table, pages in a random order of a larger
    pool, an empty sequence, lengths not multiples of anything) against the float64 oracle on
    the keys gathered into packed rows, with the flash-attn rule; the second call (a launch
    plan's replay) equals the first bit for bit. The pages' rows past each sequence's end, and
    the pool's blocks no table entry names, hold NaN: a kernel must not let them into the
    output. On sm_90 the head dims of the warp-specialised kernel run its varlen
    instantiation (TMA boxes within pages). (The outputs are new arrays: nothing to poison; a
    row left unwritten would not be finite or would miss the rule.)"""
    cp = _cp()
    import flashcore
    from flashcore import jit
    from flashcore.kernels import forward, plans
    jit.clear_memory_cache()
    plans.clear()
    rng = np.random.default_rng(d + page)
    dtype = "bfloat16"
    lens_q, lens_k = [37, 0, 1, 200], [301, 0, 129, 700]
    h, hk, b = 8, 2, len(lens_q)
    per = max(-(-n // page) for n in lens_k)
    pool = b * per + 5
    kc32 = quantize(rng.standard_normal((pool, page, hk, d)).astype(np.float32), dtype)
    vc32 = quantize(rng.standard_normal((pool, page, hk, d)).astype(np.float32), dtype)
    q32 = quantize(rng.standard_normal((sum(lens_q), h, d)).astype(np.float32), dtype)
    table = rng.permutation(pool)[: b * per].reshape(b, per).astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rows = np.concatenate([table[i, np.arange(n) // page] * page + np.arange(n) % page
                           for i, n in enumerate(lens_k)])
    kp32, vp32 = kc32.reshape(-1, hk, d)[rows], vc32.reshape(-1, hk, d)[rows]
    poisoned = np.ones(pool * page, bool)
    poisoned[rows] = False
    kc_dev, vc_dev = kc32.copy(), vc32.copy()
    kc_dev.reshape(-1, hk, d)[poisoned] = np.nan
    vc_dev.reshape(-1, hk, d)[poisoned] = np.nan
    q, kc, vc = (to_dev(x, dtype) for x in (q32, kc_dev, vc_dev))
    args = (cp.asarray(cu_q), cp.asarray(cu_k))
    if api == "torch":
        torch = pytest.importorskip("torch")
        q, kc, vc, t_table = (torch.from_dlpack(x) for x in (q, kc, vc, cp.asarray(table)))
        args = tuple(torch.from_dlpack(x) for x in args)
        out = flashcore.varlen_attention(q, kc, vc, *args, max(lens_q), max(lens_k),
                                         block_table=t_table, **kw)
        out2 = flashcore.varlen_attention(q, kc, vc, *args, max(lens_q), max(lens_k),
                                          block_table=t_table, **kw)   # (the replay)
        got = out.float().cpu().numpy().astype(np.float64)
        assert torch.equal(out, out2)
    else:
        out, lse = flashcore.varlen_attention_forward(q, kc, vc, *args,
                                                      block_table=cp.asarray(table), **kw)
        out2, _ = flashcore.varlen_attention_forward(q, kc, vc, *args,
                                                     block_table=cp.asarray(table), **kw)
        got = to_host64(out)
        assert bool((out == out2).all())
    from flashcore import config
    if forward.sm90_applies(jit.device_facts(0)[0], d, "softcap" in kw, False, max(lens_k)) \
            and config.get().sm90_fwd_ws:
        want = forward.sm90_ws_kernel_name(dtype, d, True, varlen=True)   # (windowed: paged)
        ran = {k[3] for k in jit._kernels if k[2] == forward.SM90_SOURCE}
        assert any(n.split(",")[:6] == want.split(",")[:6] and n.endswith(", true>")
                   for n in ran), ran
    ro = np.zeros(got.shape)
    lo = np.zeros(got.shape)
    for i in range(b):      # per sequence: float64, and the same computation in bf16
        sq_, sk_ = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue
        x = (q32[None, sq_], kp32[None, sk_], vp32[None, sk_])
        spec = forward_spec(*(a.astype(np.float64) for a in x), **kw)
        ro[sq_] = naive_forward(spec, *(a.astype(np.float64) for a in x))[0][0]
        lo[sq_] = naive_forward(forward_spec(*x, **kw), *x, round_to=dtype)[0][0]
    assert np.isfinite(got).all()
    assert_flash_rule("out", got, ro, lo, 2)


@pytest.mark.parametrize("d, kw", [(128, dict(causal=True)), (96, dict()), (64, dict(causal=True)),
                                   (256, dict(window_size=(50, 0))), (128, dict(softcap=5.0))])
@pytest.mark.parametrize("api", ["cupy", "torch", "varlen"])
def test_float32_output_is_the_16_bit_one_unrounded(d, kw, api):
    """out_dtype=float32 (both kernel families; rows with no visible key included): the output
    rounded to bf16 is the 16-bit call's output bit for bit, the lse is the same, and its error
    against the float64 oracle is below the 16-bit output's."""
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(d)
    b, sq, sk, h, hk = 2, 131, 97, 4, 2                # sq > sk, causal: rows see nothing
    q32, k32, v32 = (quantize(rng.standard_normal(s).astype(np.float32), "bfloat16")
                     for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    q, k, v = (to_dev(x, "bfloat16") for x in (q32, k32, v32))
    if api == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_dlpack(x) for x in (q, k, v))
        o32, l32 = flashcore.attention_forward(q, k, v, out_dtype=torch.float32, **kw)
        o16, l16 = flashcore.attention_forward(q, k, v, **kw)
        assert o32.dtype == torch.float32
        o32, l32, o16, l16 = (cp.from_dlpack(x) for x in (o32, l32, o16, l16))
    elif api == "varlen":
        cu_q = cp.asarray(np.array([0, sq, 2 * sq], np.int32))
        cu_k = cp.asarray(np.array([0, sk, 2 * sk], np.int32))
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        o32, l32 = flashcore.varlen_attention_forward(*flat, cu_q, cu_k, sq, sk,
                                                      out_dtype="float32", **kw)
        o16, l16 = flashcore.varlen_attention_forward(*flat, cu_q, cu_k, sq, sk, **kw)
        o32, o16 = o32.reshape(b, sq, h, d), o16.reshape(b, sq, h, d)
        l32 = l32.reshape(h, b, sq).transpose(1, 0, 2)
        l16 = l16.reshape(h, b, sq).transpose(1, 0, 2)
    else:
        o32 = cp.full(q.shape, cp.nan, dtype=cp.float32)     # poison, preallocated float32
        o32, l32 = flashcore.attention_forward(q, k, v, out=o32, **kw)
        o16, l16 = flashcore.attention_forward(q, k, v, **kw)
    assert o32.dtype == cp.float32
    g32 = o32.get()
    assert np.isfinite(g32).all()
    np.testing.assert_array_equal(round_to_dtype(g32, "bfloat16"), to_host64(o16))
    np.testing.assert_array_equal(l32.get(), l16.get())
    spec = forward_spec(*(x.astype(np.float64) for x in (q32, k32, v32)), **kw)
    ro, _ = naive_forward(spec, *(x.astype(np.float64) for x in (q32, k32, v32)))
    assert np.abs(g32 - ro).max() <= np.abs(to_host64(o16) - ro).max()


@pytest.mark.parametrize("d, sq, sk, kw", [
    (64, 113, 203, dict(causal=True)), (128, 203, 117, dict()), (256, 77, 130, dict(causal=True)),
    (96, 130, 130, dict(window_size=(40, 5))), (128, 300, 300, dict(causal=True, deterministic=True)),
    (64, 190, 257, dict(softcap=5.0)), (40, 70, 90, dict()),
])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_against_the_reference(d, sq, sk, kw, p):
    """Dropout forward and backward (CuPy, through the public functions: the second call of a
    layout replays its plan with a new rng_state) against the float64 oracle drawing the same
    stream, with the flash-attn rule against the same computation in bf16 (2x out, 3x grads);
    poisoned outputs; a different rng_state gives a different output."""
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(d * 1000 + sq)
    dtype, b, h, hk = "bfloat16", 2, 6, 2
    q32, k32, v32, do32 = (quantize(rng.standard_normal(s).astype(np.float32), dtype)
                           for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    q, k, v, do = (to_dev(x, dtype) for x in (q32, k32, v32, do32))
    kw = dict(kw)
    det = kw.pop("deterministic", False)
    for seed in (11, 12):          # the second: a replay with another state
        st = np.array([seed, 3 * seed], np.int64)
        o = cp.full(q.shape, cp.nan, q.dtype)
        lse = cp.full((b, h, sq), cp.nan, cp.float32)
        out, lse = flashcore.attention_forward(q, k, v, out=o, lse=lse, dropout_p=p,
                                               rng_state=cp.asarray(st), **kw)
        dq, dk, dv = (cp.full(x.shape, cp.nan, x.dtype) for x in (q, k, v))
        dq, dk, dv = flashcore.attention_backward(do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                                                  dropout_p=p, rng_state=cp.asarray(st),
                                                  deterministic=det, **kw)
        x64 = [x.astype(np.float64) for x in (q32, k32, v32)]
        hi = forward_spec(*x64, dropout_p=p, rng_state=st, **kw)
        lo = forward_spec(q32, k32, v32, dropout_p=p, rng_state=st, **kw)
        ro, rl = naive_forward(hi, *x64, rng_state=st)
        lo_o, _ = naive_forward(lo, q32, k32, v32, rng_state=st, round_to=dtype)
        assert_flash_rule("out", to_host64(out), ro, lo_o, 2)
        fin = np.isfinite(rl)
        assert np.abs(lse.get()[fin] - rl[fin]).max() < 1e-3 * max(1.0, np.abs(rl[fin]).max())
        rg = naive_backward(hi, do32.astype(np.float64), *x64, rng_state=st)
        lg = naive_backward(lo, do32, q32, k32, v32, rng_state=st, round_to=dtype)
        for name, got, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), rg, lg):
            g = to_host64(got)
            assert np.isfinite(g).all(), name
            assert_flash_rule(name, g, r, round_to_dtype(l.astype(np.float32), dtype), 3)
        if seed == 11:
            first = to_host64(out)
    assert not np.array_equal(first, to_host64(out))


@pytest.mark.parametrize("d", [64, 128])
def test_dropout_varlen_and_torch_autograd(d):
    """Varlen dropout draws per sequence (equal to the padded call); on CUDA tensors the state
    comes from torch's generator on the device: torch.manual_seed reproduces a step bit for bit,
    and autograd's gradients equal the explicit backward's with that state."""
    cp = _cp()
    torch = pytest.importorskip("torch")
    import flashcore
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(2, 150, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 150, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    st = torch.tensor([5, 6], device="cuda", dtype=torch.int64)
    dense, _ = flashcore.attention_forward(q, k, v, causal=True, dropout_p=0.3, rng_state=st)
    cu = torch.tensor([0, 150, 300], device="cuda", dtype=torch.int32)
    flat, _ = flashcore.varlen_attention_forward(q.reshape(300, 4, d), k.reshape(300, 2, d),
                                                 v.reshape(300, 2, d), cu, cu, 150, 150,
                                                 causal=True, dropout_p=0.3, rng_state=st)
    assert torch.equal(flat, dense.reshape(300, 4, d))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    torch.manual_seed(9)
    o1 = flashcore.attention(qg, kg, vg, causal=True, dropout_p=0.3, deterministic=True)
    torch.manual_seed(9)
    o2 = flashcore.attention(qg, kg, vg, causal=True, dropout_p=0.3, deterministic=True)
    assert torch.equal(o1, o2)
    do = torch.randn_like(o1)
    grads = torch.autograd.grad(o1, (qg, kg, vg), do)
    torch.manual_seed(9)
    state = torch.empty(2, dtype=torch.int64, device="cuda").random_()
    o3, lse = flashcore.attention_forward(q, k, v, causal=True, dropout_p=0.3, rng_state=state)
    assert torch.equal(o3, o1)
    want = flashcore.attention_backward(do, q, k, v, o3, lse, causal=True, dropout_p=0.3,
                                        rng_state=state, deterministic=True)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def test_float32_out_only_where_a_kernel_writes_it():
    """A float32 ``out`` for 16-bit inputs is the forward's unrounded output; the decode
    kernels write 16-bit only, so there it is refused by name, as is an ``out`` whose dtype
    contradicts ``out_dtype``."""
    cp = _cp()
    import flashcore
    rng = np.random.default_rng(3)
    q = to_dev(rng.standard_normal((1, 1, 4, 64)).astype(np.float32), "bfloat16")
    kc = to_dev(rng.standard_normal((1, 32, 2, 64)).astype(np.float32), "bfloat16")
    with pytest.raises(ValueError, match="argument 'out'"):
        flashcore.attention_with_kvcache(q, kc, kc, cache_seqlens=cp.asarray([5], cp.int32),
                                         out=cp.empty(q.shape, cp.float32))
    with pytest.raises(ValueError, match="argument 'out'"):
        flashcore.attention_forward(q, kc, kc, out_dtype="float32",
                                    out=cp.empty(q.shape, q.dtype))
