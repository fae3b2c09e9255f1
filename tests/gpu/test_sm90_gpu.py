"""The Hopper kernels (cuda/flash_fwd_sm90.cu, cuda/flash_bwd_sm90.cu, wgmma) against the
float64 oracle with the flash-attn rule, on compute capability 9.0 only. They are the default
there; each test switches the variant it checks on explicitly and asserts that the wgmma
kernel, not the Ampere-class one, is the kernel that ran.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cupy_gpu import run_case

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16"]


def _cc():
    import cupy
    return int(cupy.cuda.Device().compute_capability)


_VARIANT = {"name": "v0"}


@pytest.fixture(autouse=True, params=["v0", "v1", "ws", "ws-no-pingpong", "ws-one-tile"])
def sm90_on(request):
    """The Hopper family on, in one of its forward variants (v0 and v1: cp.async; ws: the
    warp-specialised TMA kernel with ping-pong, persistent wherever such a kernel exists, as
    by default; ws-no-pingpong: the same without ping-pong; ws-one-tile: one tile per CTA),
    and the process's kernel and plan caches emptied, so that
    _ran_sm90 sees only what this test loaded."""
    from flashcore import config, jit
    from flashcore.kernels import plans
    if _cc() != 90:
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    jit.clear_memory_cache()
    plans.clear()
    _VARIANT["name"] = request.param
    ws = request.param.startswith("ws")
    # the wgmma kernel at every length, here
    persistent = request.param != "ws-one-tile"
    with config.override(sm90_fwd=True, sm90_fwd_pipelined=request.param != "v0",
                         sm90_fwd_ws=ws, sm90_fwd_pingpong=request.param != "ws-no-pingpong",
                         sm90_fwd_persistent=persistent, sm90_fwd_d64_min_seqlen_k=0):
        yield
    plans.clear()


def _ran_sm90(dtype, local, d=128, varlen=False):
    """The variant under test ran (varlen calls: the ws kernel's varlen instantiation)."""
    from flashcore import jit
    from flashcore.kernels import forward
    if _VARIANT["name"].startswith("ws") and d in forward.SM90_HEADDIMS:
        name = forward.sm90_ws_kernel_name(dtype, d, local, varlen=varlen)
    else:
        name = forward.sm90_kernel_name(dtype, d, local, _VARIANT["name"] != "v0")
    return any(k[2] == forward.SM90_SOURCE and k[3] == name for k in jit._kernels)


SEQS = [(1, 1), (17, 113), (113, 203), (203, 17), (128, 128), (1023, 2049), (2049, 1023),
        (4096, 4096)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQS, ids=[f"{a}x{b}" for a, b in SEQS])
def test_matrix(dtype, causal, sq, sk, d):
    b = 2 if sq * sk < 1_000_000 else 1
    heads = (6, 2) if causal else (4, 4)
    run_case(dtype, b, sq, sk, heads[0], heads[1], d, causal=causal,
             seed=(sq * 31 + sk) % 1000, backward=sq * sk < 5_000_000)
    assert _ran_sm90(dtype, causal, d)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_many_tiles_per_cta(causal, d):
    # 2 x 20 heads x 8 query blocks = 320 tiles: persistent CTAs (one per SM at most) take two
    # or three each, of different lengths when causal; the K/V ring and Q's barriers carry over
    run_case("bfloat16", 2, 900, 1000, 20, 4, d, causal=causal, seed=11 + d, backward=False)
    assert _ran_sm90("bfloat16", causal, d)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (0, 0)])
def test_many_tiles_and_keyless_tiles_per_cta(d, window):
    """Persistent CTAs taking 4-7 tiles each (3 x 24 heads x 8-12 query blocks), causal or
    windowed tiles of one or two key blocks, and (more queries than keys, bottom-right
    aligned) tiles none of whose rows sees a key, written as O = 0 between two tiles; the K/V
    ring and Q's barriers carry over. Against the oracle, then a second call bit for bit (a
    race would move bits)."""
    if _VARIANT["name"] not in ("ws", "ws-no-pingpong"):
        pytest.skip("the persistent kernels: the ws variants")
    import cupy as cp
    import flashcore
    run_case("bfloat16", 3, 1500, 400, 24, 8, d, window=window, seed=d + window[0],
             backward=False)
    assert _ran_sm90("bfloat16", window != (-1, -1), d)
    rng = np.random.default_rng(window[0] + 5)
    q = cp.asarray(rng.standard_normal((3, 1500, 24, d)), dtype=cp.float32).astype(cp.float16)
    k, v = (cp.asarray(rng.standard_normal((3, 400, 8, d)), dtype=cp.float32).astype(cp.float16)
            for _ in range(2))
    outs = []
    for _ in range(2):
        o = cp.full(q.shape, cp.nan, q.dtype)
        lse = cp.full((3, 24, 1500), cp.nan, cp.float32)
        o, lse = flashcore.attention_forward(q, k, v, out=o, lse=lse, window_size=window)
        outs.append((o.get(), lse.get()))
    assert not np.isnan(outs[0][1]).any()
    for a, e in zip(outs[0], outs[1]):
        assert np.array_equal(a.view(np.uint8), e.view(np.uint8))


@pytest.mark.parametrize("d", [40, 72, 96, 192])
def test_other_head_dims_stay_on_the_ampere_kernel(d):
    run_case("bfloat16", 1, 130, 150, 4, 2, d, causal=True, seed=d, backward=False)
    assert not _ran_sm90("bfloat16", True, d) and not _ran_sm90("bfloat16", True, 128)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (127, 0), (300, -1), (-1, 77)])
def test_windows(dtype, window, d):
    run_case(dtype, 2, 517, 611, 6, 3, d, window=window, seed=7)
    assert _ran_sm90(dtype, True, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa_strided(dtype):
    run_case(dtype, 2, 333, 257, 8, 1, 128, causal=True, seed=3, strided=True)
    run_case(dtype, 2, 257, 333, 8, 2, 128, seed=4, strided=True)
    assert _ran_sm90(dtype, True) and _ran_sm90(dtype, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_no_inf_nan(dtype):
    run_case(dtype, 1, 700, 900, 4, 4, 128, qscale=5.0, kvscale=3.0, seed=5)
    assert _ran_sm90(dtype, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(dtype):
    # causal with seqlen_q > seqlen_k: the first sq - sk rows see no key (0, lse = -inf)
    run_case(dtype, 2, 300, 100, 4, 2, 128, causal=True, seed=9)
    assert _ran_sm90(dtype, True)


@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_stays_in_its_row_batch_and_head(where):
    import flashcore
    from refutils import to_dev
    rng = np.random.default_rng(54)
    host = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            (("q", (3, 260, 4, 128)), ("k", (3, 300, 2, 128)), ("v", (3, 300, 2, 128)))}
    host[where][1, 5, 0, 3] = np.nan
    out, lse = flashcore.attention_forward(*(to_dev(host[n], "bfloat16") for n in "qkv"),
                                           causal=True)
    bad = ~np.isfinite(out.get().astype(np.float32))
    lbad = np.isnan(lse.get())
    assert not bad[[0, 2]].any() and not bad[1, :, 2:].any()
    if where == "q":
        assert bad[1, 5, 0].all() and bad[1].sum() == bad[1, 5, 0].size
        assert lbad[1, 0, 5] and lbad.sum() == 1
    else:   # key 5 of kv head 0 is seen by every row (causal, offset 40) of heads 0 and 1
        assert bad[1, :, :2].all()
    assert _ran_sm90("bfloat16", True)


def test_varlen_with_empty_sequences():
    import cupy as cp
    from flashcore.reference import naive_forward
    from flashcore.spec import forward_spec
    from refutils import assert_flash_rule, quantize, to_dev
    rng = np.random.default_rng(21)
    lens_q, lens_k = [5, 0, 300, 129], [7, 3, 0, 260]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q32 = quantize(rng.standard_normal((cq[-1], 4, 128)).astype(np.float32), "bfloat16")
    k32 = quantize(rng.standard_normal((ck[-1], 2, 128)).astype(np.float32), "bfloat16")
    v32 = quantize(rng.standard_normal((ck[-1], 2, 128)).astype(np.float32), "bfloat16")
    from flashcore.backends.cupy_backend import CupyBackend
    q, k, v = (to_dev(x, "bfloat16") for x in (q32, k32, v32))
    cqd, ckd = cp.asarray(cq), cp.asarray(ck)
    spec = forward_spec(q, k, v, varlen=True, causal=True, cu_seqlens_q=cqd, cu_seqlens_k=ckd)
    out = cp.empty_like(q)
    out.view(cp.uint16).fill(0x7FC0)                         # poison: bf16 NaN
    lse = cp.full((4, int(cq[-1])), cp.nan, cp.float32)
    out, lse = CupyBackend().forward(spec, q, k, v, cu_seqlens_q=cqd, cu_seqlens_k=ckd,
                                     out=out, lse=lse)
    got = out.get().astype(np.float64)
    gl = lse.get()
    assert np.isfinite(got).all() and not np.isnan(gl).any(), "rows left unwritten"
    empty = slice(cq[2], cq[3])                              # sequence 2 has no keys
    assert (got[empty] == 0).all() and np.isneginf(gl[:, empty]).all()
    for i in range(4):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0:
            continue
        args = [x[None].astype(np.float64) for x in (q32[qs], k32[ks], v32[ks])]
        ro, _ = naive_forward(forward_spec(*args, causal=True), *args)
        lo_args = [x[None] for x in (q32[qs], k32[ks], v32[ks])]
        lo, _ = naive_forward(forward_spec(*lo_args, causal=True), *lo_args, round_to="bfloat16")
        ro = np.nan_to_num(ro)[0]
        assert_flash_rule(f"seq{i}", got[qs], ro, np.nan_to_num(lo)[0], 2)
    assert _ran_sm90("bfloat16", True, varlen=True)


@pytest.mark.parametrize("d,window", [(64, (-1, -1)), (128, (-1, -1)), (128, (-1, 0)),
                                      (256, (-1, 0)), (256, (-1, -1))])
def test_output_through_the_o_buffers(d, window):
    """The TMA-store epilogue (O through shared memory, kOBufs > 0: d64 a buffer per consumer,
    d128 one buffer that two consumers take in turn, d128 windowed two, d256 windowed one; d256
    without a window stores from the registers): a last tile with rows past the end (1000
    rows: 104 of a 128-row tile, 40 of a 192-row one, so whole warpgroups past it) into a
    strided output (a view of a wider, NaN-poisoned buffer: the padding must stay NaN), bit for
    bit the contiguous output's; a float32 output (stored from the registers) equal to it
    before rounding; both against the oracle in run_case's matrix (test_matrix)."""
    if not _VARIANT["name"].startswith("ws"):
        pytest.skip("the warp-specialised kernels")
    import cupy as cp
    import flashcore
    from flashcore.kernels import forward
    from refutils import to_dev
    bufs = forward.sm90_ws_o_buffers(d, window != (-1, -1))
    assert bufs == {(64, False): 3, (128, False): 1, (128, True): 2, (256, True): 1,
                    (256, False): 0}[(d, window != (-1, -1))]
    rng = np.random.default_rng(d + 3)
    q, k, v = (to_dev(rng.standard_normal((2, n, h, d)).astype(np.float32), "float16")
               for n, h in ((1000, 8), (777, 4), (777, 4)))
    o_ref = cp.full(q.shape, cp.nan, q.dtype)
    lse_ref = cp.full((2, 8, 1000), cp.nan, cp.float32)
    o_ref, lse_ref = flashcore.attention_forward(q, k, v, out=o_ref, lse=lse_ref,
                                                 window_size=window)
    assert _ran_sm90(q.dtype.name, window != (-1, -1), d)
    big = cp.full((2, 1000, 11, d + 64), cp.nan, q.dtype)
    o = big[:, :, 1:9, 32:32 + d]
    assert forward._ws_maps(((q, 128), (k, 128), (v, 128)), o, False, bufs)[3] == bool(bufs)
    o, lse = flashcore.attention_forward(q, k, v, out=o, lse=cp.full_like(lse_ref, cp.nan),
                                         window_size=window)
    host, ref = big.get().view(np.uint16), o_ref.get().view(np.uint16)
    assert np.array_equal(host[:, :, 1:9, 32:32 + d], ref)
    pad = np.ones(host.shape, bool)
    pad[:, :, 1:9, 32:32 + d] = False
    assert np.isnan(big.get()[pad].astype(np.float32)).all(), "written outside the output"
    assert cp.array_equal(lse, lse_ref)
    o32 = cp.full(q.shape, cp.nan, cp.float32)
    o32, _ = flashcore.attention_forward(q, k, v, out=o32, lse=cp.full_like(lse_ref, cp.nan),
                                         window_size=window)
    assert cp.array_equal(o32.astype(q.dtype), o_ref)


def test_forward_is_bitwise_repeatable():
    import cupy as cp
    import flashcore
    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal((2, 1000, 8, 128)).astype(np.float16))
               for _ in range(3))
    o0, l0 = flashcore.attention_forward(q, k, v, causal=True)
    for _ in range(50):
        o, l_ = flashcore.attention_forward(q, k, v, causal=True)
        assert cp.array_equal(o, o0) and cp.array_equal(l_, l0)
    assert _ran_sm90("float16", True)



def _under_defines(defines, fn, kernel=""):
    """fn() with the kernels of compute capability 9.0 built with the NVRTC options ``defines``
    (a setting, so a launch-cache key of its own: nothing to clear), and that such a build of a
    kernel whose name starts with ``kernel`` ran."""
    from flashcore import config, jit
    defines = config.get().sm90_defines + tuple(defines)   # (on top of FLASHCORE_SM90_DEFINES)
    with config.override(sm90_defines=defines):
        out = fn()
    assert any(key[4] == defines and key[3].startswith(kernel) for key in jit._kernels), defines
    return out


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_skipped_rescale_gives_the_same_bits(d, causal):
    """The warp-specialised forward skips O's rescale after a key block where no row of a warp
    took a new maximum (FwdRows::softmax; head dims 64 and 256, 128 always rescales): bit for
    bit the output and LSE of the same kernel rescaling after every block
    (FC_DIAG_RESCALE_ALWAYS), with heads whose maxima sit in the first key (a sink: every
    later block skips) and random heads (maxima moving late)."""
    if _VARIANT["name"] != "ws":
        pytest.skip("the warp-specialised kernel as by default")
    import cupy as cp
    import flashcore
    from refutils import to_dev
    rng = np.random.default_rng(d + 7 * causal)
    q, k, v = (rng.standard_normal((2, n, 4, d)).astype(np.float32) for n in (1100, 1500, 1500))
    q[:, :, :2, 0] = 4.0
    k[:, 0, :2, 0] = 40.0            # heads 0 and 1: key 0 dominates every row
    q, k, v = (to_dev(x, "bfloat16") for x in (q, k, v))
    o0, l0 = flashcore.attention_forward(q, k, v, causal=causal)
    assert _ran_sm90("bfloat16", causal, d)
    o1, l1 = _under_defines(("-DFC_DIAG_RESCALE_ALWAYS",),
                            lambda: flashcore.attention_forward(q, k, v, causal=causal))
    assert not np.isnan(o0.get().astype(np.float32)).any()
    assert cp.array_equal(o0.view(cp.uint16), o1.view(cp.uint16)) and cp.array_equal(l0, l1)


@pytest.mark.parametrize("define", ["FC_DIAG_SOFTMAX_FENCE", "FC_DIAG_NO_SOFTMAX_FENCE",
                                    "FC_DIAG_PP_CHAIN", "FC_DIAG_TIMELINE", "FC_DIAG_NO_WG_SKIP",
                                    "FC_DIAG_BWD256_LATE_DQ"])
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_only_defines_give_the_same_bits(define, causal):
    """Builds that move work and leave the arithmetic alone (the softmax kept ahead of the wait
    for P V wherever it fits, or nowhere, ping-pong's turns chained through a CTA's tiles, the
    timeline's stamps, causal key blocks that lie past all of a consumer warpgroup's rows walked
    instead of passed, the d256 backward's dQ tiles handed over after its score products'
    issue): the warp-specialised forward's output and LSE (bf16 at head dims 64,
    128 and 256; FP8 at 128 and 256) and the dK/dV kernels' dK and dV (head dims 64, 128 and
    256: the timeline stamps them), bit for bit those of the default build, on enough query
    tiles (8 x 18 x 4 a call) that every persistent CTA takes several, so that the chain's
    hand-overs between tiles are exercised."""
    if _VARIANT["name"] != "ws":
        pytest.skip("the warp-specialised kernel as by default")
    import cupy as cp
    import flashcore
    from refutils import to_dev
    seed = int(np.random.SeedSequence().entropy % 2**32)     # fresh data every run
    rng = np.random.default_rng(seed)
    calls = []
    for d in (64, 128, 256):
        q, k, v, do = (to_dev(rng.standard_normal((4, n, 8, d)).astype(np.float32), "bfloat16")
                       for n in (2200, 2300, 2300, 2200))
        calls.append(lambda q=q, k=k, v=v: flashcore.attention_forward(q, k, v, causal=causal))
        calls.append(lambda q=q, k=k, v=v, do=do: flashcore.attention_backward(
            do, q, k, v, *flashcore.attention_forward(q, k, v, causal=causal),
            causal=causal)[1:])                                   # dK, dV
        if d != 64:
            # e4m3 bytes of magnitude at most 3.75 (0x47), either sign
            q8, k8, v8 = (cp.asarray(rng.integers(0, 0x48, x.shape, dtype=np.uint8) |
                                     (rng.integers(0, 2, x.shape, dtype=np.uint8) << 7))
                          for x in (q, k, v))
            one = cp.ones((4, 8), cp.float32)
            calls.append(lambda q8=q8, k8=k8, v8=v8, one=one: flashcore.attention_forward(
                q8, k8, v8, causal=causal, q_descale=one, k_descale=0.5 * one,
                v_descale=one))

    def run():
        return [x.copy() for c in calls for x in c()]

    a = run()
    b = _under_defines((f"-D{define}",), run, "flash_")
    assert len(a) == len(b) == 16
    for i, (x, y) in enumerate(zip(a, b)):
        assert not np.isnan(cp.asnumpy(x).astype(np.float32)).any(), (i, seed)
        assert cp.array_equal(x.view(cp.uint8), y.view(cp.uint8)), (define, i, seed)


# ---------------- the Hopper dK/dV kernel (flash_bwd_sm90.cu) ----------------

def _ran_sm90_bwd(dtype, local, d=128, varlen=False, dropout=False):
    """The dK/dV kernel of the fixture's variant ran."""
    from flashcore import config, jit
    from flashcore.kernels import backward
    if d == 256:      # (warp-specialised only)
        name = backward.sm90_d256_kernel_name(dtype, local, dropout)
        return any(k[2] == backward.SM90_SOURCE and k[3] == name for k in jit._kernels)
    ws = config.get().sm90_bwd_ws and d in backward.SM90_WS_HEADDIMS
    name = (backward.sm90_ws_kernel_name(dtype, d, local, dropout=dropout, varlen=varlen) if ws
            else backward.sm90_kernel_name(dtype, d, local, dropout=dropout))
    return any(k[2] == backward.SM90_SOURCE and k[3] == name for k in jit._kernels)


@pytest.fixture(params=[(True, 128), (False, 128), (False, 64)],
                ids=["ws", "cpasync-d64-bm128", "cpasync-d64-bm64"])
def sm90_bwd(request):
    """The Hopper dK/dV kernel on (warp-specialised where it applies, else cp.async, which
    varlen calls take), the forward on the (verified) Ampere-class kernel, so that a failure
    here is the backward's."""
    from flashcore import config
    ws, bm = request.param
    with config.override(sm90_bwd=True, sm90_bwd_ws=ws, sm90_bwd_d64_block_m=bm, sm90_fwd=False):
        yield


BWD_SEQS = [(1, 1), (17, 113), (113, 203), (203, 17), (64, 128), (300, 300), (1023, 2049)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", BWD_SEQS, ids=[f"{a}x{b}" for a, b in BWD_SEQS])
def test_backward_matrix(sm90_bwd, dtype, causal, sq, sk, d):
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    from flashcore import config
    if d in (128, 256) and config.get().sm90_bwd_d64_block_m == 64:
        pytest.skip("the d64 step size does not change this kernel: run once")
    ws = config.get().sm90_bwd_ws
    if d == 256 and not ws:
        pytest.skip("head dim 256 has the warp-specialised kernel only")
    if ws and d == 64 and config.get().sm90_bwd_d64_block_m == 64:
        pytest.skip("the d64 step size is the cp.async kernel's: run once")
    heads = (6, 2) if (sq + sk) % 2 else (4, 4)
    run_case(dtype, 2 if sq * sk < 1_000_000 else 1, sq, sk, heads[0], heads[1], d,
             causal=causal, seed=(sq * 7 + sk + d) % 1000)
    assert _ran_sm90_bwd(dtype, causal, d)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_varlen_no_worse_than_the_ampere_kernel(sm90_bwd, d):
    """Packed sequences (one empty, one with no keys, lengths that are no multiple of the tile):
    each gradient's error against the float64 oracle is at most twice that of the GPU-verified
    Ampere-class kernel on the same inputs, plus a rounding allowance."""
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    from flashcore import config
    cfg = config.get()
    if cfg.sm90_bwd_ws or (d == 128 and cfg.sm90_bwd_d64_block_m == 64):
        pytest.skip("the cp.async kernel's varlen instantiations, each once (the ws kernels' "
                    "are test_backward_varlen_warp_specialised's)")
    import cupy as cp
    import flashcore
    from flashcore import jit
    from flashcore.reference import naive_backward
    from flashcore.kernels import backward
    from flashcore.spec import forward_spec
    from refutils import quantize, to_dev
    rng = np.random.default_rng(23)
    lens_q, lens_k = [70, 0, 257, 33], [90, 5, 300, 0]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    host = [quantize(rng.standard_normal(sh).astype(np.float32), "bfloat16") for sh in
            ((cq[-1], 6, d), (ck[-1], 2, d), (ck[-1], 2, d), (cq[-1], 6, d))]
    q, k, v, do = (to_dev(x, "bfloat16") for x in host)
    cqd, ckd = cp.asarray(cq), cp.asarray(ck)
    out, lse = flashcore.varlen_attention_forward(q, k, v, cqd, ckd, causal=True)
    grads = {}
    for hopper in (True, False):
        backward.set_sm90(hopper)
        jit.clear_memory_cache()
        junk = cp.full(1 << 22, cp.nan, cp.float32)   # the pool's next blocks hold NaN: an
        del junk                                      # accumulator row left unzeroed shows
        g = flashcore.varlen_attention_backward(do, q, k, v, out, lse, cqd, ckd, causal=True)
        grads[hopper] = [x.get().astype(np.float64) for x in g]
        assert _ran_sm90_bwd("bfloat16", True, d, varlen=True) == hopper
    backward.set_sm90(True)
    ref = [np.zeros(x.shape) for x in (host[0], host[1], host[2])]
    for i in range(4):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue          # no visible key: zero gradients (the arrays' initial zeros)
        a = [x[None].astype(np.float64) for x in (host[0][qs], host[1][ks], host[2][ks])]
        gq, gk, gv = naive_backward(forward_spec(*a, causal=True), host[3][qs][None].astype(np.float64), *a)
        ref[0][qs], ref[1][ks], ref[2][ks] = gq[0], gk[0], gv[0]
    for n, r, h_, a_ in zip(("dq", "dk", "dv"), ref, grads[True], grads[False]):
        assert np.isfinite(h_).all(), n
        e_h, e_a = np.abs(h_ - r).max(), np.abs(a_ - r).max()
        assert e_h <= 2 * e_a + 1e-2 * max(1.0, np.abs(r).max()), f"{n}: {e_h} vs Ampere {e_a}"


# Packed sequences for the varlen warp-specialised tests: one empty, one with no key, lengths
# off the tiles, the last ending inside a key block at d128 and d256 alike (its partial blocks
# read the rows after it), and VARLEN_PAD rows of no sequence after the last one, all NaN.
VARLEN_LENS_Q, VARLEN_LENS_K, VARLEN_PAD = [70, 0, 257, 33, 50], [90, 5, 300, 0, 100], 37


def _varlen_nan_padded(d, seed, n_arrays):
    """cu_seqlens (host), the host arrays (bf16-rounded float32, q-like, k-like, k-like, then
    q-like) and their device copies."""
    from refutils import quantize, to_dev
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(VARLEN_LENS_Q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(VARLEN_LENS_K)]).astype(np.int32)
    shapes = [(cq[-1] + VARLEN_PAD, 6, d), (ck[-1] + VARLEN_PAD, 2, d),
              (ck[-1] + VARLEN_PAD, 2, d), (cq[-1] + VARLEN_PAD, 6, d)][:n_arrays]
    host = [quantize(rng.standard_normal(sh).astype(np.float32), "bfloat16") for sh in shapes]
    for x in host:
        x[-VARLEN_PAD:] = np.nan
    return cq, ck, host, [to_dev(x, "bfloat16") for x in host]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(window_size=(40, 5)), dict(causal=True, dropout_p=0.17)],
                         ids=["causal", "full", "window", "causal-dropout"])
def test_backward_varlen_warp_specialised(d, kw):
    """Varlen calls on the warp-specialised kernels (the default: TMA over the packed arrays,
    rows past a sequence zeroed in shared memory), with rows past the last sequence holding NaN
    (rows of no sequence: never to reach a gradient): each gradient finite and its error
    against the float64 oracle at most twice that of the kernel the call takes with
    sm90_bwd_ws off (cp.async at d64 and d128, Ampere-class at d256) on the same inputs, plus a
    rounding allowance; with dropout, the two kernels' gradients agree (the same masks)."""
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    import cupy as cp
    import flashcore
    from flashcore import config, jit
    from flashcore.reference import naive_backward
    from flashcore.kernels import backward
    from flashcore.spec import forward_spec
    lens_q, lens_k, pad = VARLEN_LENS_Q, VARLEN_LENS_K, VARLEN_PAD
    cq, ck, host, (q, k, v, do) = _varlen_nan_padded(d, 29 + d, 4)
    cqd, ckd = cp.asarray(cq), cp.asarray(ck)
    drop = {}
    if kw.get("dropout_p"):
        drop = dict(dropout_p=kw["dropout_p"], rng_state=cp.asarray([7, 3], cp.int64))
    opts = {n: x for n, x in kw.items() if n != "dropout_p"}
    with config.override(sm90_bwd=True, sm90_bwd_ws=True, sm90_fwd=False):
        out, lse = flashcore.varlen_attention_forward(q, k, v, cqd, ckd, **opts, **drop)
        grads = {}
        for ws in (True, False):
            with config.override(sm90_bwd_ws=ws):
                jit.clear_memory_cache()
                junk = cp.full(1 << 22, cp.nan, cp.float32)   # the pool's next blocks hold NaN:
                del junk                                      # an accumulator row left unzeroed shows
                g = flashcore.varlen_attention_backward(do, q, k, v, out, lse, cqd, ckd,
                                                        **opts, **drop)
                grads[ws] = [x.get()[:-pad].astype(np.float64) for x in g]
                local = "window_size" in opts or opts.get("causal", False)
                name = (backward.sm90_d256_kernel_name("bfloat16", local, bool(drop), True)
                        if d == 256 else
                        backward.sm90_ws_kernel_name("bfloat16", d, local,
                                                     dropout=bool(drop), varlen=True))
                ran = any(kk[2] == backward.SM90_SOURCE and kk[3] == name for kk in jit._kernels)
                assert ran == ws, name
    for n, h_, a_ in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert np.isfinite(h_).all(), n
    if drop:
        for n, h_, a_ in zip(("dq", "dk", "dv"), grads[True], grads[False]):
            tol = 2e-2 * max(1.0, np.abs(a_).max())
            assert np.abs(h_ - a_).max() <= tol, f"{n}: {np.abs(h_ - a_).max()} vs {tol}"
        return
    ref = [np.zeros((r, hh, d)) for r, hh in ((cq[-1], 6), (ck[-1], 2), (ck[-1], 2))]
    for i in range(len(lens_q)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue          # no visible key: zero gradients
        a = [x[None].astype(np.float64) for x in (host[0][qs], host[1][ks], host[2][ks])]
        gq, gk, gv = naive_backward(forward_spec(*a, **opts), host[3][qs][None].astype(np.float64),
                                    *a)
        ref[0][qs], ref[1][ks], ref[2][ks] = gq[0], gk[0], gv[0]
    for n, r, h_, a_ in zip(("dq", "dk", "dv"), ref, grads[True], grads[False]):
        e_h, e_a = np.abs(h_ - r).max(), np.abs(a_ - r).max()
        assert e_h <= 2 * e_a + 1e-2 * max(1.0, np.abs(r).max()), f"{n}: {e_h} vs {e_a}"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(window_size=(40, 5)), dict(causal=True, dropout_p=0.17)],
                         ids=["causal", "full", "window", "causal-dropout"])
def test_forward_varlen_warp_specialised(d, kw):
    """Varlen forward calls on the warp-specialised kernel (the default: TMA over the packed
    arrays, V rows past a sequence zeroed in shared memory; head dim 64 from any key count
    here), with NaN in the rows after the last sequence (which ends inside a key block): every
    valid row finite, its error against the float64 oracle at most twice that of the kernel
    the call takes with sm90_fwd_ws off (cp.async), plus a rounding allowance; with dropout
    the two agree (the same masks)."""
    if _VARIANT["name"] != "v0":
        pytest.skip("independent of the fixture's variant: run once")
    import cupy as cp
    import flashcore
    from flashcore import config, jit
    from flashcore.kernels import forward
    from flashcore.reference import naive_forward
    from flashcore.spec import forward_spec
    lens_q, lens_k, pad = VARLEN_LENS_Q, VARLEN_LENS_K, VARLEN_PAD
    cq, ck, host, (q, k, v) = _varlen_nan_padded(d, 31 + d, 3)
    cqd, ckd = cp.asarray(cq), cp.asarray(ck)
    drop = {}
    if kw.get("dropout_p"):
        drop = dict(dropout_p=kw["dropout_p"], rng_state=cp.asarray([5, 9], cp.int64))
    opts = {n: x for n, x in kw.items() if n != "dropout_p"}
    outs, lses = {}, {}
    for ws in (True, False):
        with config.override(sm90_fwd=True, sm90_fwd_ws=ws, sm90_fwd_d64_min_seqlen_k=0):
            jit.clear_memory_cache()
            o, lse = flashcore.varlen_attention_forward(q, k, v, cqd, ckd, **opts, **drop)
            outs[ws] = o.get()[:-pad].astype(np.float64)
            lses[ws] = lse.get()[:, :-pad].astype(np.float64)
            ran = any(kk[2] == forward.SM90_SOURCE and "_ws_kernel" in kk[3]
                      and kk[3].count(",") == 9 for kk in jit._kernels)   # (varlen: 10 args)
            assert ran == ws
    valid = np.concatenate([np.arange(cq[i], cq[i + 1]) for i in range(len(lens_q))
                            if lens_k[i] > 0])
    assert np.isfinite(outs[True][valid]).all()
    # the lse of the two kernels agree closely (one key row too many or too few zeroed moves a
    # row's lse by about the log of its weight); a sequence with no key: O = 0, lse = -inf
    assert np.abs(lses[True][:, valid] - lses[False][:, valid]).max() <= 2e-3
    nokey = np.arange(cq[3], cq[4])
    assert (outs[True][nokey] == 0).all() and np.isneginf(lses[True][:, nokey]).all()
    if drop:
        diff = np.abs(outs[True] - outs[False])[valid].max()
        assert diff <= 2e-2 * max(1.0, np.abs(outs[False][valid]).max()), diff
        return
    ref = np.zeros((cq[-1], 6, d))
    for i in range(len(lens_q)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue
        a = [x[None].astype(np.float64) for x in (host[0][qs], host[1][ks], host[2][ks])]
        ref[qs] = naive_forward(forward_spec(*a, **opts), *a)[0][0]
    e_ws = np.abs(outs[True] - ref)[valid].max()
    e_v = np.abs(outs[False] - ref)[valid].max()
    assert e_ws <= 2 * e_v + 1e-2 * max(1.0, np.abs(ref).max()), (e_ws, e_v)


@pytest.mark.parametrize("how", ["persistent-pp", "one-tile-pp", "one-tile"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (200, 333), (130, 79), (1023, 2049), (4096, 4096)],
                         ids=["1x1", "200x333", "130x79", "1023x2049", "4096x4096"])
def test_forward_d256_80_key_blocks(how, sq, sk):
    """Head dim 256 without a window runs 80-key blocks (FA3's tile: m64n80k16 S products, a
    key block that is no multiple of the swizzle's 8-row pattern's 64-row halves, a last
    block of 1-79 keys) on each of its launch routes (persistent with ping-pong, the default;
    one tile a CTA with and without ping-pong; persistent without ping-pong is not offered:
    it spills), against the oracle."""
    if _VARIANT["name"] != "ws":
        pytest.skip("its own routes: run once")
    from flashcore import config, jit
    from flashcore.kernels import forward, plans
    assert forward.sm90_ws_tile(256, False) == (128, 80, 2)
    plans.clear()
    with config.override(sm90_fwd_persistent=how.startswith("persistent"),
                         sm90_fwd_pingpong=how.endswith("-pp")):
        for dtype in DTYPES:
            jit.clear_memory_cache()
            run_case(dtype, 2 if sq * sk < 1_000_000 else 1, sq, sk, 6, 2, 256,
                     seed=sq + sk, backward=False)
            ran = [kk[3] for kk in jit._kernels if kk[2] == forward.SM90_SOURCE]
            want = forward.sm90_ws_kernel_name(dtype, 256, False, seqlen_k=sk,
                                               persistent=how.startswith("persistent"))
            assert want in ran and ", 256, 128, 80," in want, ran
    plans.clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(5, 3), (127, 0), (-1, 77)])
def test_backward_windows_gqa(sm90_bwd, dtype, window):
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    run_case(dtype, 2, 517, 611, 6, 3, 128, window=window, seed=17)
    run_case(dtype, 2, 333, 257, 8, 1, 128, causal=True, seed=18, strided=True)
    run_case(dtype, 2, 517, 611, 6, 3, 64, window=window, seed=27)
    run_case(dtype, 2, 333, 257, 8, 1, 64, causal=True, seed=28, strided=True)
    assert _ran_sm90_bwd(dtype, True) and _ran_sm90_bwd(dtype, True, 64)
    from flashcore import config
    if config.get().sm90_bwd_ws:
        run_case(dtype, 1, 301, 389, 6, 3, 256, window=window, seed=37)
        run_case(dtype, 1, 333, 257, 8, 1, 256, causal=True, seed=38, strided=True)
        assert _ran_sm90_bwd(dtype, True, 256)


def test_backward_fully_masked_rows_and_deterministic_fallback(sm90_bwd):
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    run_case("bfloat16", 2, 300, 100, 4, 2, 128, causal=True, seed=19)
    run_case("bfloat16", 2, 300, 100, 4, 2, 64, causal=True, seed=29)
    assert _ran_sm90_bwd("bfloat16", True) and _ran_sm90_bwd("bfloat16", True, 64)
    from flashcore import config
    if config.get().sm90_bwd_ws:
        run_case("bfloat16", 2, 300, 100, 4, 2, 256, causal=True, seed=39)
        assert _ran_sm90_bwd("bfloat16", True, 256)
    from flashcore import jit
    jit.clear_memory_cache()
    run_case("bfloat16", 2, 200, 150, 4, 2, 128, causal=True, seed=20, deterministic=True)
    assert not _ran_sm90_bwd("bfloat16", True)     # deterministic mode stays on flash_bwd.cu


def test_hopper_family_is_the_default_on_cc90():
    """With nothing set in the environment, a plain call on an H100/H200 runs the
    warp-specialised wgmma forward and dK/dV kernels, the latter with the tile-ordered dQ
    reduction (its preprocess and convert kernels too)."""
    import os
    import subprocess
    import sys
    if _VARIANT["name"] != "v0":
        pytest.skip("independent of the fixture's variant: run once")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHCORE_SM90")}
    code = """
import cupy as cp, numpy as np, flashcore
from flashcore import jit
from flashcore.kernels import forward, backward
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((1, 300, 4, 128)).astype(np.float16)) for _ in range(4))
out, lse = flashcore.attention_forward(q, k, v, causal=True)
flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
names = {k[3] for k in jit._kernels}
assert forward.sm90_ws_kernel_name("float16", 128, True) in names, names
assert backward.sm90_ws_kernel_name("float16", 128, True) in names, names
assert backward.sm90_convert_tiled_name("float16", 128) in names, names
assert "flash_bwd_preprocess_kernel<fc_fp16, true>" in names, names
q, k, v, do = (cp.asarray(rng.standard_normal((1, 300, 2, 256)).astype(np.float16)) for _ in range(4))
out, lse = flashcore.attention_forward(q, k, v, causal=True)
flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
names = {k[3] for k in jit._kernels}
assert backward.sm90_d256_kernel_name("float16", True) in names, names
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("d, sq, sk, kw", [(128, 203, 117, dict()),
                                          (256, 77, 130, dict(causal=True)),
                                          (128, 300, 211, dict(window_size=(40, 5))),
                                          (64, 113, 203, dict(causal=True))])
def test_backward_dq_tiled_dropout(d, sq, sk, kw):
    """The tile-ordered dQ reduction with dropout, through the public functions (a replay of
    the plan included), against the float64 oracle (test_cupy_gpu's dropout check)."""
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    from flashcore import config
    from test_cupy_gpu import test_dropout_against_the_reference as dropout_check
    with config.override(sm90_bwd=True, sm90_bwd_ws=True):
        dropout_check(d, sq, sk, kw, 0.17)
        assert _ran_sm90_bwd("bfloat16", bool(kw), d, dropout=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_gradients_into_any_aligned_view(d, causal):
    """The dQ conversion and the dK/dV epilogue write whole 16-byte pieces of a row where the
    output's base and row stride allow and 4-byte pairs where they do not: dq, dk and dv as
    views 4 bytes into wider, poisoned buffers (base not 16-byte aligned, row stride not a
    multiple of 8 elements), each checked against the float64 oracle and the buffers' columns
    outside the views left as they were. The same call into fresh arrays (the 16-byte paths) is
    checked beside it; 131 keys: the last key block's second half has no keys."""
    if _VARIANT["name"] != "v0":
        pytest.skip("the backward does not depend on the forward variant: run once")
    import cupy as cp
    import flashcore
    from flashcore import config
    from refutils import assert_flash_rule, quantize, to_dev
    from flashcore.reference import naive_backward, round_to_dtype
    from flashcore.spec import forward_spec
    from test_cupy_gpu import to_host64
    dtype, b, sq, sk, h, hk = "bfloat16", 2, 203, 131, 4, 2
    rng = np.random.default_rng(d + 7 * causal)
    q32, k32, v32, do32 = (quantize(rng.standard_normal(s).astype(np.float32), dtype)
                           for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    q, k, v, do = (to_dev(x, dtype) for x in (q32, k32, v32, do32))
    x64 = [x.astype(np.float64) for x in (q32, k32, v32)]
    hi, lo = forward_spec(*x64, causal=causal), forward_spec(q32, k32, v32, causal=causal)
    rg = naive_backward(hi, do32.astype(np.float64), *x64)
    lg = naive_backward(lo, do32, q32, k32, v32, round_to=dtype)
    with config.override(sm90_bwd=True, sm90_bwd_ws=True):
        out, lse = flashcore.attention_forward(q, k, v, causal=causal)
        wide = [cp.full(x.shape[:-1] + (d + 6,), cp.nan, x.dtype) for x in (q, k, v)]
        calls = {"fresh": [cp.full(x.shape, cp.nan, x.dtype) for x in (q, k, v)],
                 "4 bytes in": [w[..., 2:d + 2] for w in wide]}
        assert all(x.data.ptr % 16 == 4 for x in calls["4 bytes in"])
        for how, grads in calls.items():
            got = flashcore.attention_backward(do, q, k, v, out, lse, causal=causal,
                                               dq=grads[0], dk=grads[1], dv=grads[2])
            for name, x, r, l, into in zip(("dq", "dk", "dv"), got, rg, lg, grads):
                g = to_host64(into)
                assert np.array_equal(to_host64(x), g), (name, how)
                assert np.isfinite(g).all(), (name, how)
                assert_flash_rule(f"{name} ({how})", g, r,
                                  round_to_dtype(l.astype(np.float32), dtype), 3)
        for w in wide:
            rest = to_host64(w)
            assert np.isnan(rest[..., :2]).all() and np.isnan(rest[..., d + 2:]).all()
        assert _ran_sm90_bwd(dtype, causal, d)
