"""The Hopper FP8 forward (cuda/flash_fwd_sm90.cu: flash_fwd_sm90_fp8_kernel).

CPU (CI): a model of the kernel's two data orders -- P's e4m3 A fragment packed from the score
accumulators as they lie (pack_e4m3) and V^T's keys as the producer's transpose stores them
(transpose_v: ldmatrix.trans, byte permutes, stmatrix, through the 128-byte swizzle) -- showing
that they pair every probability with its own key; the launcher's names, shared-memory budget
and refusals.

GPU (compute capability 9.0): the kernel against the float64 attention of the dequantised
inputs with the flash-attn rule in FP8 (its error at most twice that of the same FP8
computation emulated in NumPy, flashcore.reference.fp8_forward, plus the output's rounding),
on fresh random data: odd lengths, causal, windows, GQA, per-tensor and per-(batch, key head)
descales, outputs NaN-filled before the call; CuPy uint8 arrays and torch.float8_e4m3fn
tensors; and what is refused on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore.kernels import forward
from flashcore.reference import fp8_dequantize, fp8_forward, naive_forward
from flashcore.spec import forward_spec

ml_dtypes = pytest.importorskip("ml_dtypes", reason="float8_e4m3fn arrays need ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn
SMEM_LIMIT = 232448     # H100/H200 opt-in dynamic shared memory per block


# ---- CPU: the data orders of the P V product ----------------------------------------------------

def _pack_e4m3_keys(kk):
    """For each (lane, A register, byte) of k-step kk: the key (column of S) whose probability
    pack_e4m3 puts there, and the A column the wgmma reads it as (the PTX ISA's k32 A fragment:
    register 2h + v of lane (g, t) holds row g + 8v, columns 16h + 4t + byte)."""
    pairs = {}
    for lane in range(32):
        g, t = lane // 4, lane % 4
        # accumulator element 4j + 2r + e of n8 tile j: row g + 8r, column 8j + 2t + e
        key_of = {4 * j + 2 * r + e: (g + 8 * r, 8 * j + 2 * t + e)
                  for j in range(32) for r in (0, 1) for e in (0, 1)}
        x = [16 * kk + i for i in range(16)]       # pack_e4m3's x[] (s + 16 kk)
        regs = [(x[0], x[1], x[4], x[5]), (x[2], x[3], x[6], x[7]),
                (x[8], x[9], x[12], x[13]), (x[10], x[11], x[14], x[15])]
        for reg, elems in enumerate(regs):
            h, v = reg >> 1, reg & 1
            for byte, el in enumerate(elems):
                row, key = key_of[el]
                assert row == g + 8 * v, "P's bytes stay in their row"
                pairs[(g + 8 * v, 16 * h + 4 * t + byte)] = key - 32 * kk
    return pairs


def _swz(row, byte):
    """Byte offset of (row, byte) in a 128-byte-swizzled [rows][128] block."""
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def _transpose_v_model(d, block_n=128):
    """transpose_v's stores, executed on a V whose element (key, col) is key: the V^T tile as
    the wgmma reads it (K-major, 128-byte swizzle): vt[n][k] for head-dim row n, K column k.
    ldmatrix.x4.trans (b16): lane l addresses row l % 8 of matrix l // 8; lane (r, c) receives
    of matrix m the b16 elements (row 2c, col r) low and (row 2c + 1, col r) high. stmatrix.x4:
    lane l addresses row l % 8 of matrix l // 8; lane (r, c)'s register m goes to row r,
    bytes 4c .. 4c + 3 of matrix m."""
    raw = np.zeros((d // 128) * block_n * 128, np.int64)    # TMA's layout of V, as bytes
    for key in range(block_n):
        for col in range(d):
            raw[(col // 128) * block_n * 128 + _swz(key, col % 128)] = key
    chunks = -(-block_n // 128)                            # 128-key chunks of V^T
    mem = np.full(chunks * d * 128, -1, np.int64)          # V^T: [chunks][d][128] bytes
    units_per_warp = (block_n // 32) * (d // 16) // 4
    for warp in range(4):
        for t in range(units_per_warp):
            if block_n == 128:          # unit j of warp w: keys 32 w, columns 16 j
                g, j = warp, t
            else:                       # dealt out evenly, g-major
                u = warp * units_per_warp + t
                g, j = u // (d // 16), u % (d // 16)
            c, gw = g >> 2, g & 3
            addr_ld, addr_st = {}, {}
            for lane in range(32):                         # the kernel's address formulas
                mi, i = lane >> 3, lane & 7
                e, h = mi & 1, mi >> 1
                row = 2 * i + e
                addr_ld[lane] = ((32 * g + 8 * mi + i) * 128 + (j >> 3) * block_n * 128
                                 + (((j & 7) ^ i) << 4))
                addr_st[lane] = (c * d * 128 + row * 128 + (((2 * gw + h) ^ (row & 7)) << 4)
                                 + j * 2048)
            for lane in range(32):
                r, c = lane // 4, lane % 4
                w = []
                for m in range(4):
                    def b16(row_, col_):
                        a = addr_ld[8 * m + row_] + 2 * col_
                        return raw[a], raw[a + 1]
                    lo, hi = b16(2 * c, r), b16(2 * c + 1, r)
                    w.append([lo[0], lo[1], hi[0], hi[1]])
                def prmt(a, b, sel):
                    both = a + b
                    return [both[(sel >> (4 * i)) & 7] for i in range(4)]
                regs = [prmt(w[0], w[1], 0x6420), prmt(w[0], w[1], 0x7531),
                        prmt(w[2], w[3], 0x6420), prmt(w[2], w[3], 0x7531)]
                for m, word in enumerate(regs):
                    a = addr_st[8 * m + r] + 4 * c
                    mem[a:a + 4] = word
    used = np.array([c * d * 128 + _swz(n, k) for c in range(chunks) for n in range(d)
                     for k in range(min(128, block_n - 128 * c))])
    assert (mem[used] >= 0).all(), "every byte of V^T that holds a key is written"
    return np.array([[mem[(k // 128) * d * 128 + _swz(n, k % 128)] for k in range(block_n)]
                     for n in range(d)])


@pytest.mark.parametrize("d,block_n", [(128, 128), (256, 128), (128, 192)])
def test_p_and_vt_orders_pair_each_probability_with_its_key(d, block_n):
    vt = _transpose_v_model(d, block_n)
    for n in range(d):          # (every head-dim row of V^T holds the same key order)
        np.testing.assert_array_equal(vt[n], vt[0])
    assert sorted(vt[0]) == list(range(block_n))      # each key once
    for kk in range(block_n // 32):
        for (row, col), key in _pack_e4m3_keys(kk).items():
            assert vt[0][32 * kk + col] - 32 * kk == key, (kk, row, col)


def test_the_v_transpose_reads_only_its_own_keys_and_columns():
    """Each V^T row n holds column n of V (checked with V's element (key, col) = col)."""
    d, block_n = 256, 128
    raw = np.zeros((d // 128) * block_n * 128, np.int64)
    for key in range(block_n):
        for col in range(d):
            raw[(col // 128) * block_n * 128 + _swz(key, col % 128)] = col
    # the same walk as the model, reading columns instead of keys
    for warp in range(4):
        for j in range(d // 16):
            for lane in range(32):
                mi, i = lane >> 3, lane & 7
                a = (32 * warp + 8 * mi + i) * 128 + (j >> 3) * block_n * 128 \
                    + (((j & 7) ^ i) << 4)
                assert set(raw[a:a + 16]) == set(range(16 * j, 16 * j + 16))


# ---- CPU: the launcher's tables and refusals -------------------------------------------------

def test_instantiations_and_shared_memory_budget():
    names = forward.fp8_instantiations()
    # (16 one tile a CTA, 8 persistent (head dim 128), 16 varlen) x with and without softcap,
    # + head dim 128's 16 dense ones without O buffers (outputs that TMA cannot write)
    assert len(names) == 96
    assert all(n.startswith("flash_fwd_sm90_fp8_kernel<fc_") for n in names)
    for d in forward.FP8_HEADDIMS:
        assert forward.fp8_smem(d) <= SMEM_LIMIT
    # two O buffers at head dim 128 (the TMA-store epilogue; none with softcap), none at 256
    assert forward.fp8_o_buffers(128) == 2 and forward.fp8_o_buffers(128, softcap=True) == 0
    assert forward.fp8_o_buffers(256) == 0
    assert forward.fp8_smem(128, softcap=True) <= SMEM_LIMIT
    assert forward.fp8_kernel_name("bfloat16", 128, False, True) == \
        "flash_fwd_sm90_fp8_kernel<fc_bf16, 128, 192, false, 2, true, true, false, false, 2>"
    # a float32 output, or one that TMA cannot write: the instantiation without O buffers
    for name in (forward.fp8_kernel_name("float32", 128, False, True),
                 forward.fp8_kernel_name("bfloat16", 128, False, True, o_tma=False)):
        assert name == "flash_fwd_sm90_fp8_kernel<fc_bf16, 128, 192, false, 2, true, true>"
    assert forward.fp8_smem(128, o_tma=False) == forward.fp8_smem(128) - 2 * 128 * 128
    assert forward.fp8_kernel_name("float16", 256, True, False) == \
        "flash_fwd_sm90_fp8_kernel<fc_fp16, 256, 128, true, 2, false, false>"
    # no persistent kernel at head dim 256 (its consumers would spill in 232 registers)
    assert forward.fp8_kernel_name("float16", 256, False, False) == \
        "flash_fwd_sm90_fp8_kernel<fc_fp16, 256, 128, false, 2, false, false>"
    # varlen: one tile a CTA, whatever the persistent setting
    assert forward.fp8_kernel_name("bfloat16", 128, True, True, True, varlen=True) == \
        "flash_fwd_sm90_fp8_kernel<fc_bf16, 128, 192, true, 2, true, false, true>"
    assert forward.fp8_kernel_name("bfloat16", 128, False, True, False, softcap=True) == \
        "flash_fwd_sm90_fp8_kernel<fc_bf16, 128, 192, false, 2, true, false, false, true>"


def test_refusals_name_the_argument():
    from flashcore import config
    with config.override(sm90_fp8_fwd=False):   # (on by default)
        (why,) = forward.fp8_reasons(90, 128)
    assert "'q'" in why and "FLASHCORE_SM90_FP8_FWD" in why
    assert forward.fp8_reasons(90, 128) == []
    assert forward.fp8_reasons(90, 256) == []
    (why,) = forward.fp8_reasons(80, 128)
    assert "'q'" in why and "9.0" in why and "8.0" in why
    (why,) = forward.fp8_reasons(100, 128)
    assert "'q'" in why and "10.0" in why
    (why,) = forward.fp8_reasons(90, 64)
    assert "'q'" in why and "headdim 64" in why
    assert "'block_table'" in forward.fp8_reasons(90, 128, paged=True)[0]
    assert "'alibi_slopes'" in forward.fp8_reasons(90, 128, alibi=True)[0]
    assert "'dropout_p'" in forward.fp8_reasons(90, 128, dropout=True)[0]


def test_params_carry_the_three_descales():
    from flashcore.kernels.params import make_params, params_dtype
    names = params_dtype().names
    assert {"q_descale", "k_descale", "v_descale"} <= set(names)
    p = make_params(q_descale=0x1000, k_descale=0x2000, v_descale=None)
    assert int(p["q_descale"]) == 0x1000 and int(p["v_descale"]) == 0


# ---- GPU ---------------------------------------------------------------------------------------

def _quantised(rng, b, sq, sk, h, hk, d, per_head=True):
    """float8_e4m3fn q, k, v with descales (per (batch, key head), or one per tensor), and the
    float64 values they stand for."""
    q8s, scales = [], []
    for n, heads in ((sq, h), (sk, hk), (sk, hk)):
        x = rng.standard_normal((b, n, heads, d)) * rng.uniform(0.5, 3.0, (b, 1, heads, 1))
        if per_head:
            amax = np.abs(x).reshape(b, n, hk, heads // hk, d).max(axis=(1, 3, 4))   # (b, hk)
            scale = np.maximum(amax / 448.0, 1e-6).astype(np.float32)
        else:
            scale = np.float32(max(np.abs(x).max() / 448.0, 1e-6)).reshape(())
        full = np.broadcast_to(scale, (b, hk))
        per = np.repeat(full, heads // hk, axis=1)[:, None, :, None]
        q8s.append((x / per).astype(E4M3))
        scales.append(np.asarray(scale, np.float32))
    exact = [fp8_dequantize(x8, s, hk).astype(np.float64) for x8, s in zip(q8s, scales)]
    return q8s, scales, exact


def _lse_tolerance(q, k, scale):
    """Per (batch, head, query): 2e-2 plus what Hopper's FP8 tensor cores can lose in a score.
    Their accumulation keeps around 14 bits (DeepSeek-V3's technical report, section 3.3.2),
    so each of the d / 32 wgmma k-steps of a score may round away 2^-13 of the magnitude summed
    so far: |error| <= (d / 32) 2^-13 scale max_j sum_i |q_i k_ji| (keys masked or not), and
    the LSE moves by at most its largest score's error. (Run 22 saw 0.028 at an LSE of 29.7,
    d 256, where this allows about 0.1.)"""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    ka = np.repeat(np.abs(k), h // hk, axis=2)
    mags = np.einsum("bqhd,bkhd->bhqk", np.abs(q), ka).max(axis=-1)
    return 2e-2 + (d / 32) * 2.0 ** -13 * scale * mags


def _poisoned(shape, dtype):
    """A CuPy array of ``dtype`` filled with NaN (through its bits: no arithmetic on bf16)."""
    import cupy
    a = cupy.empty(shape, dtype)
    nan_bits = {2: (cupy.uint16, 0x7FC0 if dtype.name == "bfloat16" else 0x7E00),
                4: (cupy.uint32, 0x7FC00000)}[dtype.itemsize]
    a.view(nan_bits[0]).fill(nan_bits[1])
    return a


def _require_hopper():
    import cupy
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the FP8 kernel needs compute capability 9.0")


def _ran_fp8():
    from flashcore import jit
    return any("flash_fwd_sm90_fp8_kernel" in str(k) for k in jit._kernels)


# (b, sq, sk, h, hk, kw, per-(batch, key head) descales)
CASES = [
    (2, 1, 1, 4, 2, {}, True),
    (2, 17, 17, 4, 4, {"causal": True}, True),
    (1, 255, 1000, 4, 1, {}, False),
    (2, 1000, 255, 2, 2, {"causal": True}, True),
    (1, 1000, 1000, 4, 2, {"window_size": (100, 20)}, True),
    (2, 255, 1000, 4, 2, {"window_size": (300, -1)}, False),
    (1, 17, 1000, 2, 1, {"causal": True, "window_size": (64, 0)}, True),
    (3, 129, 257, 6, 3, {"softmax_scale": 0.05}, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}h{c[3]}/{c[4]}"
                         f"-{'-'.join(map(str, c[5].items()))}-{'bh' if c[6] else 'tensor'}")
def test_cupy_fp8_matches_the_flash_attn_rule_in_fp8(case, d):
    _require_hopper()
    _check_fp8_case(case, d)


def _check_fp8_case(case, d):
    import cupy
    from flashcore.backends.base import get_backend
    b, sq, sk, h, hk, kw, per_head = case
    rng = np.random.default_rng()      # fresh data every run
    (q8, k8, v8), ds, exact = _quantised(rng, b, sq, sk, h, hk, d, per_head)
    want, want_lse = naive_forward(forward_spec(*exact, **kw), *exact)
    emul, _ = fp8_forward(forward_spec(q8, k8, v8, **kw), q8, k8, v8, tuple(ds))
    emul_err = np.abs(emul - want).max()
    lse_tol = _lse_tolerance(exact[0], exact[1], kw.get("softmax_scale", d ** -0.5))
    gq, gk, gv = (cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8))
    gds = [cupy.asarray(x) for x in ds]
    spec = forward_spec(gq, gk, gv, **kw, q_descale=gds[0], k_descale=gds[1], v_descale=gds[2])
    assert spec.dtype == "float8_e4m3fn"
    for odt in ("bfloat16", "float16", "float32"):
        npdt = np.dtype(ml_dtypes.bfloat16) if odt == "bfloat16" else np.dtype(odt)
        out = _poisoned(q8.shape, npdt)                     # NaN-filled outputs
        lse = _poisoned((b, h, sq), np.dtype(np.float32))
        get_backend("cupy").forward(spec, gq, gk, gv, out=out, lse=lse, descales=tuple(gds),
                                    fp8_out=odt)
        o = cupy.asnumpy(out).astype(np.float64)
        assert np.isfinite(o).all()
        # the output's own rounding on top of the rule (bfloat16: 2^-8 relative)
        eps = np.abs(want).max() * (2.0 ** -8 if odt == "bfloat16" else 2.0 ** -11)
        err = np.abs(o - want).max()
        assert err <= 2 * emul_err + eps, (odt, err, emul_err)
        got_lse = cupy.asnumpy(lse)
        # (rows that see no key: -inf in both)
        lse_err = np.where(got_lse == want_lse, 0.0, np.abs(got_lse - want_lse))
        assert (lse_err <= lse_tol).all(), (odt, lse_err.max(), lse_tol.min())
    assert _ran_fp8()
    # the public function, bfloat16 out by default
    out, lse = flashcore.attention_forward(gq, gk, gv, q_descale=gds[0], k_descale=gds[1],
                                           v_descale=gds[2], **kw)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and lse.dtype == np.float32
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - want).max() <= \
        2 * emul_err + np.abs(want).max() * 2.0 ** -8


@pytest.mark.gpu
def test_no_descale_means_one_and_strided_views_read_in_place():
    import cupy
    _require_hopper()
    rng = np.random.default_rng()
    # e4m3 values of unit scale, as they stand (a tensor quantised with a descale of 1)
    q8, k8, v8 = (rng.standard_normal((2, 300, n, 128)).astype(E4M3) for n in (4, 2, 2))
    gq, gk, gv = (cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8))
    base, lse = flashcore.attention_forward(gq, gk, gv, out_dtype="float32", causal=True)
    ones = cupy.ones((2, 2), cupy.float32)
    same, lse1 = flashcore.attention_forward(gq, gk, gv, q_descale=ones, k_descale=ones,
                                             v_descale=ones, out_dtype="float32", causal=True)
    cupy.testing.assert_array_equal(base, same)
    cupy.testing.assert_array_equal(lse, lse1)
    # a strided view (every other head of a wider array: TMA reads it in place) gives the
    # contiguous call's result
    wide = cupy.zeros((2, 300, 8, 128), cupy.uint8)
    wide[:, :, ::2] = gq
    view, _ = flashcore.attention_forward(wide[:, :, ::2], gk, gv, out_dtype="float32",
                                          causal=True)
    cupy.testing.assert_array_equal(base, view)
    # and the flash-attn rule in FP8 (descales 1: the e4m3 values are the inputs)
    exact = [x.astype(np.float64) for x in (q8, k8, v8)]
    want, _ = naive_forward(forward_spec(*exact, causal=True), *exact)
    emul, _ = fp8_forward(forward_spec(q8, k8, v8, causal=True), q8, k8, v8)
    err = np.abs(cupy.asnumpy(base) - want).max()
    assert err <= 2 * np.abs(emul - want).max() + np.abs(want).max() * 2.0 ** -11, err


@pytest.mark.gpu
def test_torch_fp8_tensors_run_the_kernel():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    _require_hopper()
    rng = np.random.default_rng()
    (q8, k8, v8), ds, exact = _quantised(rng, 2, 200, 333, 4, 2, 256)
    want, _ = naive_forward(forward_spec(*exact, causal=True), *exact)
    emul, _ = fp8_forward(forward_spec(q8, k8, v8, causal=True), q8, k8, v8, tuple(ds))
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
                  for x in (q8, k8, v8))
    td = [torch.from_numpy(x).cuda() for x in ds]
    out = flashcore.attention(tq, tk, tv, causal=True, q_descale=td[0], k_descale=td[1],
                              v_descale=td[2])
    assert out.dtype == torch.bfloat16 and out.is_cuda
    err = np.abs(out.float().cpu().numpy() - want).max()
    assert err <= 2 * np.abs(emul - want).max() + np.abs(want).max() * 2.0 ** -8
    from flashcore.flash_attn import flash_attn_func     # FlashAttention-3's keywords
    again = flash_attn_func(tq, tk, tv, causal=True, q_descale=td[0], k_descale=td[1],
                            v_descale=td[2])
    assert torch.equal(again, out)
    with pytest.raises(TypeError, match="'q'.*forward only"):
        flashcore.attention(tq.clone().requires_grad_(True), tk, tv)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("case", [(2, 129, 300, 4, 2, {"softcap": 5.0}, True),
                                  (1, 300, 257, 4, 1, {"softcap": 2.0, "causal": True}, False),
                                  (1, 1000, 1000, 2, 2, {"softcap": 30.0,
                                                         "window_size": (100, 20)}, True)],
                         ids=["full", "causal", "window"])
def test_fp8_softcap_matches_the_flash_attn_rule_in_fp8(case, d):
    """Softcap on the FP8 kernel (the capped scores in natural units, the descales and the
    softmax scale inside the tanh's argument): the rule in FP8 against the float64 attention
    of the dequantised inputs, as the other FP8 cases."""
    _require_hopper()
    _check_fp8_case(case, d)


# sequence lengths of the varlen cases: an empty one, none a multiple of the tiles
_VARLEN_Q = [70, 0, 257, 33]
_VARLEN_K = [200, 5, 400, 33]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (50, 10)}],
                         ids=["full", "causal", "window"])
def test_varlen_fp8_matches_each_sequence_alone(d, kw):
    """Packed FP8 sequences (the varlen kernel: one tile a CTA, the rows past each sequence's
    end in the first key block zeroed by the producer, so that the next sequence's bytes, NaN
    included, never reach a product) against each sequence's own float64 attention, with the
    flash-attn rule in FP8; poisoned outputs; NaN bytes in the keys of the sequence that has
    no queries, which the first sequence's last key block reads."""
    import cupy
    _require_hopper()
    rng = np.random.default_rng()
    h, hk, nseq = 4, 2, len(_VARLEN_Q)
    # packed e4m3 q, k, v with per-(sequence, key head) descales (1 for the empty sequence)
    packed, ds = [], []
    for lens, heads in ((_VARLEN_Q, h), (_VARLEN_K, hk), (_VARLEN_K, hk)):
        xs, sc = [], np.ones((nseq, hk), np.float32)
        for i, n in enumerate(lens):
            x = rng.standard_normal((n, heads, d)) * rng.uniform(0.5, 3.0, (1, heads, 1))
            if n:
                amax = np.abs(x).reshape(n, hk, heads // hk, d).max(axis=(0, 2, 3))
                sc[i] = np.maximum(amax / 448.0, 1e-6)
            xs.append(x / np.repeat(sc[i], heads // hk)[None, :, None])
        packed.append(np.concatenate(xs).astype(E4M3))
        ds.append(sc)
    q8, k8, v8 = packed
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                  for n in (_VARLEN_Q, _VARLEN_K))
    # the keys of the sequence without queries are NaN bytes: no product may use them, and
    # the first sequence's last key block reads them (past its end)
    for x in (k8, v8):
        x.view(np.uint8)[cu_k[1]:cu_k[2]] = 0x7F
    gq, gk, gv = (cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8))
    gds = [cupy.asarray(x) for x in ds]
    gcu = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k))
    spec = forward_spec(gq, gk, gv, **gcu, varlen=True, max_seqlen_q=max(_VARLEN_Q),
                        max_seqlen_k=max(_VARLEN_K), q_descale=gds[0], k_descale=gds[1],
                        v_descale=gds[2], **kw)
    assert spec.dtype == "float8_e4m3fn" and spec.varlen
    from flashcore.backends.base import get_backend
    out = _poisoned(q8.shape, np.dtype(np.float32))          # NaN-filled outputs
    lse = _poisoned((h, q8.shape[0]), np.dtype(np.float32))
    get_backend("cupy").forward(spec, gq, gk, gv, **gcu, out=out, lse=lse,
                                descales=tuple(gds), fp8_out="float32")
    assert _ran_fp8()
    # the public function gives the same bits
    pub, pub_lse = flashcore.varlen_attention_forward(
        gq, gk, gv, gcu["cu_seqlens_q"], gcu["cu_seqlens_k"], max(_VARLEN_Q),
        max(_VARLEN_K), q_descale=gds[0], k_descale=gds[1], v_descale=gds[2],
        out_dtype="float32", **kw)
    cupy.testing.assert_array_equal(pub, out)
    cupy.testing.assert_array_equal(pub_lse, lse)
    o, got_lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    assert np.isfinite(o).all()
    for i in range(nseq):
        rows = slice(cu_q[i], cu_q[i + 1])
        if _VARLEN_Q[i] == 0:
            continue
        keys = slice(cu_k[i], cu_k[i + 1])
        q8s, k8s, v8s = q8[None, rows], k8[None, keys], v8[None, keys]
        dss = [x[i:i + 1] for x in ds]
        exact = [fp8_dequantize(x, dd, hk).astype(np.float64)
                 for x, dd in zip((q8s, k8s, v8s), dss)]
        want, want_lse = naive_forward(forward_spec(*exact, **kw), *exact)
        emul, _ = fp8_forward(forward_spec(q8s, k8s, v8s, **kw), q8s, k8s, v8s, tuple(dss))
        err = np.abs(o[rows] - want[0]).max()
        bound = 2 * np.abs(emul - want).max() + np.abs(want).max() * 2.0 ** -11
        assert err <= bound, (i, err, bound)
        tol = _lse_tolerance(exact[0], exact[1], d ** -0.5)[0]
        lse_err = np.where(got_lse[:, rows] == want_lse[0], 0.0,
                           np.abs(got_lse[:, rows] - want_lse[0]))
        assert (lse_err <= tol).all(), (i, lse_err.max())


@pytest.mark.gpu
def test_gpu_refusals_are_named():
    import cupy
    from flashcore.backends.base import NotSupportedError
    _require_hopper()
    rng = np.random.default_rng(5)
    (q8, k8, v8), _, _ = _quantised(rng, 1, 64, 64, 2, 2, 64)
    g = [cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8)]
    with pytest.raises(NotSupportedError, match="headdim 64"):
        flashcore.attention_forward(*g)
    (q8, k8, v8), _, _ = _quantised(rng, 1, 64, 64, 2, 2, 128)
    g = [cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8)]
    with pytest.raises(TypeError, match="'q'.*forward only"):
        flashcore.attention_backward(g[0], *g, g[0], cupy.zeros((1, 2, 64), cupy.float32))
