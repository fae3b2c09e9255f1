"""The Hopper forward kernel (cuda/flash_fwd_sm90.cu, wgmma) against the float64 oracle with
the flash-attn rule, on compute capability 9.0 only. The family is switched on for these tests
(it is opt-in until they pass on the H200), and each test checks that the wgmma kernel, not
the Ampere-class one, is the kernel that ran. Backward passes use the existing kernels on the
Hopper forward's output and LSE, so they check that LSE too.
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


@pytest.fixture(autouse=True)
def sm90_on():
    from flashcore.kernels import forward
    if _cc() != 90:
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    forward.set_sm90(True)
    yield
    forward.set_sm90(False)


def _ran_sm90(dtype, local):
    from flashcore import jit
    from flashcore.kernels import forward
    name = forward.sm90_kernel_name(dtype, local)
    return any(k[2] == forward.SM90_SOURCE and k[3] == name for k in jit._kernels)


SEQS = [(1, 1), (17, 113), (113, 203), (203, 17), (128, 128), (1023, 2049), (2049, 1023),
        (4096, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQS, ids=[f"{a}x{b}" for a, b in SEQS])
def test_matrix(dtype, causal, sq, sk):
    b = 2 if sq * sk < 1_000_000 else 1
    heads = (6, 2) if causal else (4, 4)
    run_case(dtype, b, sq, sk, heads[0], heads[1], 128, causal=causal,
             seed=(sq * 31 + sk) % 1000, backward=sq * sk < 5_000_000)
    assert _ran_sm90(dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (127, 0), (300, -1), (-1, 77)])
def test_windows(dtype, window):
    run_case(dtype, 2, 517, 611, 6, 3, 128, window=window, seed=7)
    assert _ran_sm90(dtype, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa_strided(dtype):
    run_case(dtype, 2, 333, 257, 8, 1, 128, causal=True, seed=3, strided=True)
    run_case(dtype, 2, 257, 333, 8, 2, 128, seed=4, strided=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_no_inf_nan(dtype):
    run_case(dtype, 1, 700, 900, 4, 4, 128, qscale=5.0, kvscale=3.0, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(dtype):
    # causal with seqlen_q > seqlen_k: the first sq - sk rows see no key (0, lse = -inf)
    run_case(dtype, 2, 300, 100, 4, 2, 128, causal=True, seed=9)


def test_varlen_with_empty_sequences():
    import cupy as cp
    import flashcore
    from flashcore.backends.numpy_backend import naive_forward
    from flashcore.spec import forward_spec
    from refutils import assert_flash_rule, quantize, to_dev
    rng = np.random.default_rng(21)
    lens_q, lens_k = [5, 0, 300, 129], [7, 3, 0, 260]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q32 = quantize(rng.standard_normal((cq[-1], 4, 128)).astype(np.float32), "bfloat16")
    k32 = quantize(rng.standard_normal((ck[-1], 2, 128)).astype(np.float32), "bfloat16")
    v32 = quantize(rng.standard_normal((ck[-1], 2, 128)).astype(np.float32), "bfloat16")
    out, lse = flashcore.varlen_attention_forward(
        *(to_dev(x, "bfloat16") for x in (q32, k32, v32)), cp.asarray(cq), cp.asarray(ck),
        causal=True)
    got = out.get().astype(np.float64)
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
    assert _ran_sm90("bfloat16", True)


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
