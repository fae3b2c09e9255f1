"""Attention dropout: the stream (flashcore.dropout, Philox4x32-7), the reference, the tiled
NumPy backend, autograd on torch CPU tensors, and what is refused."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore import dropout as D
from flashcore.reference import naive_backward, naive_forward
from flashcore.spec import forward_spec


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10 (the round function the stream's 7
    rounds repeat)."""
    assert [int(x) for x in D.philox4x32(0, 0, 0, 0, 0, 0, rounds=10)] == \
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    assert [int(x) for x in D.philox4x32(m, m, m, m, m, m, rounds=10)] == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert [int(x) for x in D.philox4x32(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344,
                                         0xA4093822, 0x299F31D0, rounds=10)] == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    assert D.ROUNDS == 7 and [int(x) for x in D.philox4x32(1, 2, 3, 4, 5, 6)] == \
        [int(x) for x in D.philox4x32(1, 2, 3, 4, 5, 6, rounds=7)]


def test_keep_rate_and_scale():
    st = np.array([7, 11], np.int64)
    for p in (0.1, 0.5, 0.9):
        m = D.keep_mask(st, p, np.arange(8), np.arange(128), np.arange(256))
        n = m.size
        keep = 1 - D.threshold(p) / 256
        assert abs(m.mean() - keep) < 4 * np.sqrt(keep * (1 - keep) / n)
        assert D.keep_scale(p) == pytest.approx(1 / (1 - p), rel=1e-12)
    assert D.keep_mask(st, 0.0, np.arange(2), np.arange(3), np.arange(4)).all()


def test_p_is_rounded_to_a_multiple_of_1_256():
    """8 random bits per probability (flash-attn's precision): p rounds to k / 256, at least
    1 / 256 when p > 0; kept values are scaled by 1 / (1 - p) as flash-attn scales them."""
    assert D.effective_p(0.1) == 26 / 256 and D.effective_p(0.5) == 0.5
    assert D.effective_p(0.001) == 1 / 256 and D.effective_p(0.0) == 0.0
    assert D.effective_p(0.999) == 255 / 256
    for p in (0.01, 0.1, 0.3, 0.9):
        assert abs(D.effective_p(p) - p) <= 1 / 512
        assert D.keep_scale(p) == 1 / (1 - p)


def test_masks_depend_on_every_coordinate_and_the_state():
    st = np.array([7, 11], np.int64)
    base = D.keep_mask(st, 0.5, np.arange(4), np.arange(64), np.arange(64))
    assert not np.array_equal(base[0], base[1])                       # heads
    assert not np.array_equal(base[:, :32], base[:, 32:])             # rows
    assert not np.array_equal(base[..., :32], base[..., 32:])         # columns
    for other in ([8, 11], [7, 12], [7, 11 + (1 << 32)]):
        assert not np.array_equal(
            base, D.keep_mask(np.array(other, np.int64), 0.5, np.arange(4), np.arange(64),
                              np.arange(64)))
    # a sub-block is the same stream (what a tile of a kernel regenerates)
    sub = D.keep_mask(st, 0.5, np.array([2]), np.arange(40, 50), np.arange(17, 33))
    assert np.array_equal(sub[0], base[2, 40:50, 17:33])


def _inputs(rng, b=2, sq=37, sk=45, h=4, hk=2, d=16):
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d)),
            rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sq, h, d)))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(9, 3)),
                                dict(softcap=2.0, causal=True)])
def test_tiled_backend_equals_the_reference_and_gradients_are_exact(kw):
    rng = np.random.default_rng(0)
    q, k, v, do = _inputs(rng)
    st = np.array([123, 456], np.int64)
    out, lse = flashcore.attention_forward(q, k, v, dropout_p=0.3, rng_state=st, **kw)
    spec = forward_spec(q, k, v, dropout_p=0.3, rng_state=st, **kw)
    ro, rl = naive_forward(spec, q, k, v, rng_state=st)
    np.testing.assert_allclose(out, ro, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, rl, atol=1e-12, rtol=0)
    # the lse is the undropped one's
    np.testing.assert_allclose(lse, flashcore.attention_forward(q, k, v, **kw)[1], atol=1e-12)
    grads = flashcore.attention_backward(do, q, k, v, out, lse, dropout_p=0.3, rng_state=st, **kw)
    for g, r in zip(grads, naive_backward(spec, do, q, k, v, rng_state=st)):
        np.testing.assert_allclose(g, r, atol=1e-11, rtol=0)
    # central differences of <out, do> in a few coordinates (the mask is fixed by rng_state)
    eps = 1e-6
    for which, idx in ((0, (1, 5, 3, 2)), (1, (0, 7, 1, 4)), (2, (1, 44, 0, 9))):
        args = [q, k, v]
        plus, minus = (a.copy() for a in (args[which], args[which]))
        plus[idx] += eps
        minus[idx] -= eps

        def f(x):
            a = list(args)
            a[which] = x
            return (flashcore.attention_forward(*a, dropout_p=0.3, rng_state=st, **kw)[0]
                    * do).sum()
        fd = (f(plus) - f(minus)) / (2 * eps)
        assert fd == pytest.approx(grads[which][idx], rel=1e-5, abs=1e-8)


def test_expectation_is_the_undropped_attention():
    rng = np.random.default_rng(1)
    q, k, v, _ = _inputs(rng, b=1, sq=8, sk=16, h=2, hk=2, d=8)
    want = flashcore.attention(q, k, v)
    mean = np.mean([flashcore.attention_forward(q, k, v, dropout_p=0.5,
                                                rng_state=np.array([s, 0], np.int64))[0]
                    for s in range(400)], axis=0)
    assert np.abs(mean - want).max() < 0.15


def test_varlen_uses_sequence_positions():
    """Sequence b of a varlen call draws as batch entry b of a padded call of its length."""
    rng = np.random.default_rng(2)
    st = np.array([5, 9], np.int64)
    q, k, v, _ = _inputs(rng, b=2, sq=10, sk=12)
    cu_q, cu_k = np.array([0, 10, 20], np.int32), np.array([0, 12, 24], np.int32)
    out, _ = flashcore.varlen_attention_forward(q.reshape(20, 4, 16), k.reshape(24, 2, 16),
                                                v.reshape(24, 2, 16), cu_q, cu_k, causal=True,
                                                dropout_p=0.4, rng_state=st)
    dense, _ = flashcore.attention_forward(q, k, v, causal=True, dropout_p=0.4, rng_state=st)
    np.testing.assert_allclose(out, dense.reshape(20, 4, 16), atol=1e-12)


def test_autograd_on_torch_cpu_tensors_and_reproducibility():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    torch.manual_seed(3)
    o1 = flashcore.attention(q, k, v, causal=True, dropout_p=0.2)
    torch.manual_seed(3)
    o2 = flashcore.attention(q, k, v, causal=True, dropout_p=0.2)
    o3 = flashcore.attention(q, k, v, causal=True, dropout_p=0.2)
    assert torch.equal(o1, o2) and not torch.equal(o1, o3)
    st = torch.tensor([11, 12], dtype=torch.int64)
    o = flashcore.attention(q, k, v, causal=True, dropout_p=0.2, rng_state=st)
    do = torch.randn_like(o)
    gq, gk, gv = torch.autograd.grad(o, (q, k, v), do)
    spec = forward_spec(*(x.detach().numpy() for x in (q, k, v)), causal=True, dropout_p=0.2,
                        rng_state=st.numpy())
    want = naive_backward(spec, do.numpy(), *(x.detach().numpy() for x in (q, k, v)),
                          rng_state=st.numpy())
    for a, b in zip((gq, gk, gv), want):
        np.testing.assert_allclose(a.numpy(), b, atol=1e-11)
    # q is k is v (deduplicated inputs) with dropout
    x = q.detach().clone().requires_grad_()
    y = flashcore.attention(x, x, x, dropout_p=0.2, rng_state=st)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kw, exc, words", [
    (dict(dropout_p=1.0), ValueError, "'dropout_p'.*\\[0, 1\\)"),
    (dict(dropout_p=-0.1), ValueError, "'dropout_p'"),
    (dict(dropout_p="0.1"), TypeError, "'dropout_p'"),
    (dict(dropout_p=0.1), ValueError, "'rng_state'.*None"),
    (dict(dropout_p=0.1, rng_state=np.array([1, 2], np.int32)), TypeError, "'rng_state'.*int64"),
    (dict(dropout_p=0.1, rng_state=np.array([1, 2, 3], np.int64)), TypeError, "'rng_state'"),
])
def test_refusals_name_the_argument(kw, exc, words):
    q = np.ones((1, 3, 2, 8))
    with pytest.raises(exc, match=words):
        flashcore.attention_forward(q, q, q, **kw)


def _host_program(tmp_path, name, source):
    """The C++ program ``source`` (which includes cuda/flash_dropout.cuh through the {header}
    placeholder) compiled for this machine's CPU; skips where there is no C++ compiler."""
    import shutil
    import subprocess
    from flashcore.jit import cuda_dir
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    src = tmp_path / f"{name}.cpp"
    src.write_text(source.replace("{header}", str(cuda_dir() / "flash_dropout.cuh")))
    exe = tmp_path / name
    r = subprocess.run([cxx, "-O1", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def test_the_cuda_header_draws_the_same_stream(tmp_path):
    """cuda/flash_dropout.cuh (compiled for the host here) against flashcore.dropout: the
    stream, the fragment helpers' bits in both orientations, the forward's packed masks, at
    thresholds on both sides of 128 (the per-byte compare's two cases) and at the ends of
    their range."""
    import subprocess
    exe = _host_program(tmp_path, "t", '''#include <cstdio>
#include <cstdlib>
#include "{header}"
int main(int, char** argv) {
    long long st[2] = {atoll(argv[1]), atoll(argv[2])};
    FcDropout d = fc_dropout_setup(st, atoi(argv[3]), 1.f);
    for (int bh = 0; bh < 3; ++bh)
        for (int i = 0; i < 5; ++i) {
            for (int j = 0; j < 70; ++j)
                std::printf("%d", fc_dropout_bits(fc_dropout_words(d, bh, 7 * i, j), 7 * i, j) >= d.threshold);
            std::printf("\\n");
        }
    // the fragment helpers: a 32 x 32 block at (16, 32) of head 1, as the 32 lanes of a warp
    // hold it in S (rows = queries) and in S^T (rows = keys), drawn by fc_dropout_keep2 with
    // its lane ^ 4 exchange emulated: tiles paired (A, B) and alone (A = B)
    int cnt[2][32][32] = {};
    const int pairs[3][4] = {{16, 32, 16, 48}, {32, 32, 32, 32}, {32, 48, 32, 48}};
    for (int tr = 0; tr < 2; ++tr)
        for (int pi = 0; pi < 3; ++pi) {
            const int* pr = pairs[pi];
            unsigned int mine[32], theirs[32], fm[32][4], ft[32][2];
            for (int lane = 0; lane < 32; ++lane) {
                const int g = lane >> 2, t = lane & 3, odd = g & 1;
                fc_dropout_lane(d, 1, odd ? pr[2] : pr[0], odd ? pr[3] : pr[1], g, t, tr != 0,
                                mine[lane], theirs[lane]);
                if (!tr)    // the forward's masks (fc_dropout_masks2), from the same call
                    fc_dropout_lane_flags(d, 1, odd ? pr[2] : pr[0], odd ? pr[3] : pr[1], g, t,
                                          fm[lane], ft[lane]);
            }
            for (int lane = 0; lane < 32 && !tr; ++lane) {
                const unsigned int other[2] = {ft[lane ^ 4][0], ft[lane ^ 4][1]};
                unsigned int ma[4], mb[4];
                fc_dropout_pair_masks(fm[lane], other, ((lane >> 2) & 1) != 0, ma, mb);
                const unsigned int keep_a = (lane >> 2) & 1 ? theirs[lane ^ 4] : mine[lane];
                const unsigned int keep_b = (lane >> 2) & 1 ? mine[lane] : theirs[lane ^ 4];
                for (int w = 0; w < 4; ++w)
                    for (int e = 0; e < 2; ++e) {
                        const unsigned int half = 0xFFFFu << (16 * e), bit = 16 * e + w;
                        if ((ma[w] & half) != (((keep_a >> bit) & 1) ? half : 0u)) return 4;
                        if ((mb[w] & half) != (((keep_b >> bit) & 1) ? half : 0u)) return 4;
                    }
            }
            for (int lane = 0; lane < 32; ++lane) {
                const int g = lane >> 2, t = lane & 3, odd = g & 1;
                const unsigned int keep[2] = {odd ? theirs[lane ^ 4] : mine[lane],
                                               odd ? mine[lane] : theirs[lane ^ 4]};
                for (int x = 0; x < (pr[0] == pr[2] && pr[1] == pr[3] ? 1 : 2); ++x) {
                    const int q0 = pr[2 * x], k0 = pr[2 * x + 1];
                    for (int k = 0; k < 8; ++k) {
                        const int hi = k >> 2, mid = (k >> 1) & 1, e = k & 1;
                        const int qq = tr ? q0 + 8 * hi + 2 * t + e : q0 + g + 8 * hi;
                        const int kk = tr ? k0 + g + 8 * mid : k0 + 8 * mid + 2 * t + e;
                        const int bit = (keep[x] >> (16 * e + (k >> 1))) & 1;
                        cnt[tr][qq - 16][kk - 32] += 1 + bit;
                        // the factor helper reads the same bit
                        if ((fc_dropout_keep_factor(d, keep[x], k) != 0.f) != (bit != 0)) return 3;
                    }
                }
            }
        }
    for (int i = 0; i < 32; ++i) {
        for (int j = 0; j < 32; ++j) std::printf("%d", cnt[0][i][j] - 1);
        std::printf(" ");
        for (int j = 0; j < 32; ++j) std::printf("%d", cnt[1][i][j] - 1);
        std::printf("\\n");
    }
}
''')
    seed, offset = -1234567890123, (3 << 32) + 987654321
    st = np.array([seed, offset], np.int64)
    for p in (0.3, 0.7, 0.5, 1 / 256, 255 / 256):
        thr = D.threshold(p)
        got = subprocess.run([str(exe), str(seed), str(offset), str(thr)], check=True,
                             capture_output=True, text=True).stdout.split()
        m = D.keep_mask(st, p, np.arange(3), 7 * np.arange(5), np.arange(70)).reshape(15, 70)
        assert 0 < m.mean() < 1 or thr in (1, 255)
        assert got[:15] == ["".join("1" if x else "0" for x in row) for row in m], p
        # every element of the block written exactly once by the fragment helpers (a count of
        # 1 or 2 printed as 0 or 1), both orientations equal to the stream
        block = D.keep_mask(st, p, np.array([1]), np.arange(16, 48), np.arange(32, 64))[0]
        want = "".join("1" if x else "0" for x in np.asarray(block).ravel())
        assert [len(x) for x in got[15:]] == [32] * 64 and "".join(got[15::2]) == want, p
        assert "".join(got[16::2]) == want, p


def test_return_attn_probs_encodes_the_dropout_the_way_flash_attn_tests_read_it():
    """flash_attn_func(..., return_attn_probs=True) with dropout: the signs are the mask the
    call used (rebuilding the output from them gives the output), and flash-attn's own test
    normalisation (running max per 128-key block, blocks walked from the last) turns the
    magnitudes into the probabilities."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from flashcore import flash_attn as fa
    g = torch.Generator().manual_seed(0)
    b, sq, sk, h, d = 2, 70, 300, 2, 16
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, sk, h, d, generator=g, dtype=torch.float64)
    for causal in (False, True):
        torch.manual_seed(1)
        out, lse, s = fa.flash_attn_func(q, k, v, 0.3, causal=causal, return_attn_probs=True)
        assert s.shape == (b, h, sq, sk)
        keep = s >= 0
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
        if causal:
            i = torch.arange(sq)[:, None] + sk - sq
            scores = scores.masked_fill(torch.arange(sk)[None, :] > i, float("-inf"))
        p = torch.softmax(scores, -1)
        blocks = scores.split(128, dim=-1)
        bmax = torch.stack([x.amax(-1) for x in blocks], -1)
        run = torch.cummax(bmax.flip(-1), -1).values.flip(-1)
        norm = torch.cat([a * torch.exp(m - lse)[..., None]
                          for a, m in zip(s.abs().split(128, dim=-1), run.unbind(-1))], -1)
        torch.testing.assert_close(norm, p, atol=1e-12, rtol=1e-10)
        scale = D.keep_scale(0.3)
        want = torch.einsum("bhqk,bkhd->bqhd", p * keep * scale, v)
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.manual_seed(1)
    _, _, none = fa.flash_attn_func(q, k, v, 0.0, return_attn_probs=True)
    assert none is None
