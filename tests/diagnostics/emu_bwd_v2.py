"""CPU model of flash_bwd_dkdv2_kernel's fragment dataflow (no GPU): swizzle, BwdLdsm lane
addressing, ldmatrix(.trans) x4 and mma.m16n8k16 lane layouts, ported 1:1 from the CUDA source.
P and dS are taken as S and dP (identity elementwise step) so the check is exact linear algebra:
dV = (K Q^T) dO, dK = (V dO^T) Q, dQ = (V dO^T)^T K.   python3 tests/diagnostics/emu_bwd_v2.py"""
import itertools
import numpy as np


def swz(COLS, row, col):
    kch = COLS // 8
    chunk = col >> 3
    sw = chunk ^ (row & 7) if kch % 8 == 0 else chunk ^ ((row >> 1) & 3)
    return row * COLS + (sw << 3) + (col & 7)


class Ldsm:
    def __init__(self, COLS, pattern, lane, xor_lo=0):
        self.COLS = COLS
        self.kHalf = 4 if (COLS // 8) % 8 == 0 else 2
        row = (lane & 7) + ((lane >> 3) & 1) * 8 if pattern == 0 else (lane & 7) + (lane >> 4) * 8
        lo = (lane >> 4) if pattern == 0 else ((lane >> 3) & 1)
        rsw = (row & 7) if self.kHalf == 4 else ((row >> 1) & 3)
        self.lane_off = row * COLS * 2
        self.sw = ((lo ^ rsw) << 4) ^ (xor_lo << 5)

    def __call__(self, r0, c):
        kH = self.kHalf
        return self.lane_off + r0 * self.COLS * 2 + (c // kH) * (kH * 32) + (self.sw ^ ((c % kH) << 5))


def ldsm_x4(smem, addrs, trans):  # addrs: 32 byte addresses; returns regs[lane][4] of (lo, hi)
    out = [[None] * 4 for _ in range(32)]
    for m in range(4):
        rows = [smem[addrs[8 * m + r] // 2: addrs[8 * m + r] // 2 + 8] for r in range(8)]
        assert all(addrs[8 * m + r] % 16 == 0 for r in range(8))
        M = np.array(rows)
        if trans:
            M = M.T
        for l in range(32):
            out[l][m] = (M[l // 4, 2 * (l % 4)], M[l // 4, 2 * (l % 4) + 1])
    return out


def mma(acc, a, b):  # acc[lane][4], a[lane][4] pairs, b[lane][2] pairs
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for l in range(32):
        g, t = l >> 2, l & 3
        for i, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[r, k], A[r, k + 1] = a[l][i]
        for i, k in enumerate([2 * t, 2 * t + 8]):
            B[k, g], B[k + 1, g] = b[l][i]
    C = A @ B
    for l in range(32):
        g, t = l >> 2, l & 3
        acc[l][0] += C[g, 2 * t]; acc[l][1] += C[g, 2 * t + 1]
        acc[l][2] += C[g + 8, 2 * t]; acc[l][3] += C[g + 8, 2 * t + 1]


def run(d, M, N, W, SWn, KWn, QWm, seed=0):
    rng = np.random.default_rng(seed)
    K, V = rng.integers(-3, 4, (N, d)).astype(float), rng.integers(-3, 4, (N, d)).astype(float)
    Q, dO = rng.integers(-3, 4, (M, d)).astype(float), rng.integers(-3, 4, (M, d)).astype(float)
    sK, sV, sQ, sdO = (np.zeros(R * d) for R in (N, N, M, M))
    for R, src, dst in ((N, K, sK), (N, V, sV), (M, Q, sQ), (M, dO, sdO)):
        for r, c in itertools.product(range(R), range(d)):
            dst[swz(d, r, c)] = src[r, c]
    sP, sdS = np.zeros(N * M), np.zeros(N * M)
    SWm, KWd, QWd = W // SWn, W // KWn, W // QWm
    STn, STm = N // SWn, M // SWm
    SMi, SNt = STn // 16, STm // 8
    KTn, KCols = N // KWn, d // KWd
    KMi, KNt = KTn // 16, KCols // 8
    QTm, QCols = M // QWm, d // QWd
    QMi, QSteps = QTm // 16, QCols // 16
    dKo, dVo, dQo = np.zeros((N, d)), np.zeros((N, d)), np.zeros((M, d))
    # phase 1: S^T, dP^T, store
    for warp in range(W):
        swn, swm = warp % SWn, warp // SWn
        sk0, sq0 = swn * STn, swm * STm
        ldA = [Ldsm(d, 0, l) for l in range(32)]; ldB = [Ldsm(d, 1, l) for l in range(32)]
        for (sA, sB, name) in ((sV, sdO, "dp"), (sK, sQ, "s")):
            acc = [[[[0.0] * 4 for _ in range(32)] for _ in range(SNt)] for _ in range(SMi)]
            for kk in range(d // 16):
                a = [ldsm_x4(sA, [ldA[l](sk0 + 16 * mi, kk) for l in range(32)], False) for mi in range(SMi)]
                for nt in range(0, SNt, 2):
                    bb = ldsm_x4(sB, [ldB[l](sq0 + nt * 8, kk) for l in range(32)], False)
                    b0 = [[bb[l][0], bb[l][1]] for l in range(32)]; b1 = [[bb[l][2], bb[l][3]] for l in range(32)]
                    for mi in range(SMi):
                        mma(acc[mi][nt], a[mi], b0); mma(acc[mi][nt + 1], a[mi], b1)
            dst = sdS if name == "dp" else sP
            for nt in range(SNt):
                for mi in range(SMi):
                    for l in range(32):
                        g, t = l >> 2, l & 3
                        qc = sq0 + nt * 8 + 2 * t; kr = sk0 + 16 * mi + g
                        a4 = acc[mi][nt][l]
                        o = swz(M, kr, qc); dst[o], dst[o + 1] = a4[0], a4[1]
                        o = swz(M, kr + 8, qc); dst[o], dst[o + 1] = a4[2], a4[3]
    # phase 2: dV, dK
    for warp in range(W):
        kwn, kwd = warp % KWn, warp // KWn
        kk0 = kwn * KTn
        ldAk = [Ldsm(d, 0, l, kwd) for l in range(32)]; ldmA = [Ldsm(M, 0, l) for l in range(32)]
        adv = [[[[0.0] * 4 for _ in range(32)] for _ in range(KNt)] for _ in range(KMi)]
        adk = [[[[0.0] * 4 for _ in range(32)] for _ in range(KNt)] for _ in range(KMi)]
        for ks in range(M // 16):
            ap = [ldsm_x4(sP, [ldmA[l](kk0 + 16 * mi, ks) for l in range(32)], False) for mi in range(KMi)]
            ads = [ldsm_x4(sdS, [ldmA[l](kk0 + 16 * mi, ks) for l in range(32)], False) for mi in range(KMi)]
            for nt in range(0, KNt, 2):
                bo = ldsm_x4(sdO, [ldAk[l](ks * 16, KWd * (nt // 2)) for l in range(32)], True)
                bq = ldsm_x4(sQ, [ldAk[l](ks * 16, KWd * (nt // 2)) for l in range(32)], True)
                for mi in range(KMi):
                    mma(adv[mi][nt], ap[mi], [[bo[l][0], bo[l][1]] for l in range(32)])
                    mma(adv[mi][nt + 1], ap[mi], [[bo[l][2], bo[l][3]] for l in range(32)])
                    mma(adk[mi][nt], ads[mi], [[bq[l][0], bq[l][1]] for l in range(32)])
                    mma(adk[mi][nt + 1], ads[mi], [[bq[l][2], bq[l][3]] for l in range(32)])
        for mi in range(KMi):
            for l in range(32):
                g, t = l >> 2, l & 3
                for half in range(2):
                    j = kk0 + 16 * mi + g + 8 * half
                    for nt in range(KNt):
                        col = (KWd * (nt // 2) + kwd) * 16 + (nt & 1) * 8 + 2 * t
                        dKo[j, col:col + 2] += adk[mi][nt][l][2 * half:2 * half + 2]
                        dVo[j, col:col + 2] += adv[mi][nt][l][2 * half:2 * half + 2]
    # phase 3: dQ (single pass model: kQPassSteps = QSteps)
    for warp in range(W):
        qwm, qwd = warp % QWm, warp // QWm
        ldAq = [Ldsm(d, 0, l, qwd) for l in range(32)]; ldmB = [Ldsm(M, 1, l) for l in range(32)]
        acc = [[[[0.0] * 4 for _ in range(32)] for _ in range(2 * QSteps)] for _ in range(QMi)]
        for ks in range(N // 16):
            a = [ldsm_x4(sdS, [ldmB[l](0, qwm * QMi + mi) + ks * 16 * M * 2 for l in range(32)], True) for mi in range(QMi)]
            for nt in range(0, 2 * QSteps, 2):
                bk = ldsm_x4(sK, [ldAq[l](ks * 16, QWd * (nt // 2)) for l in range(32)], True)
                for mi in range(QMi):
                    mma(acc[mi][nt], a[mi], [[bk[l][0], bk[l][1]] for l in range(32)])
                    mma(acc[mi][nt + 1], a[mi], [[bk[l][2], bk[l][3]] for l in range(32)])
        for mi in range(QMi):
            for l in range(32):
                g, t = l >> 2, l & 3
                for half in range(2):
                    i = qwm * QTm + 16 * mi + 8 * half + g
                    for nt in range(2 * QSteps):
                        col = QWd * (nt // 2) * 16 + qwd * 16 + (nt & 1) * 8 + 2 * t
                        dQo[i, col:col + 2] += acc[mi][nt][l][2 * half:2 * half + 2]
    S, dP = K @ Q.T, V @ dO.T
    ok = (np.array_equal(dVo, S @ dO), np.array_equal(dKo, dP @ Q), np.array_equal(dQo, dP.T @ K))
    print(f"d{d} M{M} N{N} W{W} s_wn{SWn} k_wn{KWn} q_wm{QWm}: dV {ok[0]} dK {ok[1]} dQ {ok[2]}", flush=True)
    return all(ok)


if __name__ == "__main__":
    cfgs = [(64, 128, 128, 8, 4, 4, 4), (128, 128, 128, 8, 4, 4, 4), (128, 64, 128, 8, 4, 4, 2), (64, 128, 64, 8, 4, 4, 4),
            (256, 64, 64, 8, 2, 2, 2), (64, 64, 128, 8, 4, 4, 2), (96, 64, 128, 8, 4, 4, 4)]
    assert all([run(*c) for c in cfgs])
