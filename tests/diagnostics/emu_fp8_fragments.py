"""CPU emulation of the FP8 decode kernel's register fragments (cuda/flash_decode.cu, Is_fp8):
the B fragments of Q K^T and P V built from e4m3 bytes with ldmatrix + cvt (+ prmt), the
permuted Q tile, and the column-permuted O accumulators mapped back in the merge's slab store.

    python tests/diagnostics/emu_fp8_fragments.py

Lane-level model of the instructions (PTX ISA):
  ldmatrix .m8n8 .b16 (x4): lanes 8i .. 8i + 7 give the row addresses (16 bytes) of matrix i;
    lane L = 4g + t receives in register i the 16-bit elements (row g, cols 2t, 2t + 1) of
    matrix i (low half first); with .trans the elements (rows 2t, 2t + 1, col g).
  cvt.rn.f16x2.e4m3x2: 16 bits (byte 0 low) -> f16x2 (byte 0's value in the low half).
  prmt.b32 d, a, 0, sel: byte i of d = byte sel[4i + 3 : 4i] of {0, a}.
  mma.m16n8k16 (row.col): A a0 = (g, 2t + j), a1 = (g + 8, 2t + j), a2 = (g, 2t + 8 + j),
    a3 = (g + 8, 2t + 8 + j); B b0 = (k 2t + j, n g), b1 = (k 2t + 8 + j, n g);
    C c_{j} = (g, 2t + j), c_{2 + j} = (g + 8, 2t + j).
Byte values are indices into a random table (the cvt is a lookup), so only the index mapping
is tested; every product is compared with the plain Q K^T and P V of the same values.
"""
from __future__ import annotations

import numpy as np

W = 64          # kW: swizzle column-block width (16-bit units)
JW = W // 16    # kJW


def swz(cols, row, col):
    chunks = cols // 8
    chunk = col >> 3
    if chunks >= 8:
        sw = chunk ^ (row & 7)
    elif chunks == 4:
        sw = chunk ^ ((row >> 1) & 3)
    else:
        sw = chunk
    return row * cols + (sw << 3) + (col & 7)


def tile_off(rows, row, col):   # units
    return (col // W) * (rows * W) + swz(W, row, col % W)


def lane_off(lr, hc, j):
    return swz(W, lr, j * 16 + hc * 8)


def ldmatrix_x4(mem16, addrs, trans=False):
    """mem16: array of 16-bit units (objects: any value per unit); addrs[lane] unit address.
    Returns regs[lane][i] = (lo unit, hi unit)."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        rows = [mem16[addrs[8 * i + r]: addrs[8 * i + r] + 8] for r in range(8)]
        for L in range(32):
            g, t = L // 4, L % 4
            if trans:
                regs[L][i] = (rows[2 * t][g], rows[2 * t + 1][g])
            else:
                regs[L][i] = (rows[g][2 * t], rows[g][2 * t + 1])
    return regs


def bytes_of(reg):   # a 32-bit register of two 16-bit units of byte pairs -> 4 bytes
    (b0, b1), (b2, b3) = reg
    return [b0, b1, b2, b3]


def prmt(reg4, sel):
    return [reg4[(sel >> (4 * i)) & 0xF] for i in range(4)]


def mma(acc, A_regs, B_regs):
    """acc[lane][4] += fragments; A_regs[lane][4] (pairs of values), B_regs[lane][2]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for L in range(32):
        g, t = L // 4, L % 4
        for j in range(2):
            A[g, 2 * t + j] = A_regs[L][0][j]
            A[g + 8, 2 * t + j] = A_regs[L][1][j]
            A[g, 2 * t + 8 + j] = A_regs[L][2][j]
            A[g + 8, 2 * t + 8 + j] = A_regs[L][3][j]
            B[2 * t + j, g] = B_regs[L][0][j]
            B[2 * t + 8 + j, g] = B_regs[L][1][j]
    D = A @ B
    for L in range(32):
        g, t = L // 4, L % 4
        for j in range(2):
            acc[L][j] += D[g, 2 * t + j]
            acc[L][2 + j] += D[g + 8, 2 * t + j]


def run(d, block_n=64, n_warps=4, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(256)              # e4m3 byte -> value (any bijection-free map)
    cvt = lambda pair: (table[pair[0]], table[pair[1]])
    wn = block_n // n_warps
    kd = d // 16
    ld = d // 2                                     # kLD: 16-bit units per FP8 row
    Kb = rng.integers(0, 256, size=(block_n, d))    # cache bytes of one key block
    Vb = rng.integers(0, 256, size=(block_n, d))
    Q = rng.standard_normal((16, d))
    # the loader: row r's 16-byte chunk lc (units lc * 8 ..) at tile_off(block_n, r, lc * 8)
    memK = [None] * (block_n * ld)
    memV = [None] * (block_n * ld)
    for r in range(block_n):
        for lc in range(ld // 8):
            o = tile_off(block_n, r, lc * 8)
            for u in range(8):
                memK[o + u] = (Kb[r, 16 * lc + 2 * u], Kb[r, 16 * lc + 2 * u + 1])
                memV[o + u] = (Vb[r, 16 * lc + 2 * u], Vb[r, 16 * lc + 2 * u + 1])
    # Q tile: natural order first, then the kernel's permutation pass
    memQ = [None] * (16 * d)
    for r in range(16):
        for c in range(d):
            memQ[tile_off(16, r, c)] = Q[r, c]
    for r in range(16):
        for c in range(kd):
            a0, a1 = tile_off(16, r, 16 * c), tile_off(16, r, 16 * c + 8)
            w = [(memQ[a0 + 2 * e], memQ[a0 + 2 * e + 1]) for e in range(4)]
            x = [(memQ[a1 + 2 * e], memQ[a1 + 2 * e + 1]) for e in range(4)]
            for e, word in enumerate((w[0], w[2], x[0], x[2])):
                memQ[a0 + 2 * e], memQ[a0 + 2 * e + 1] = word
            for e, word in enumerate((w[1], w[3], x[1], x[3])):
                memQ[a1 + 2 * e], memQ[a1 + 2 * e + 1] = word
    a_off = [[lane_off(L & 15, L >> 4, j) for j in range(JW)] for L in range(32)]
    k_off = [[lane_off((L & 7) + ((L >> 4) << 3), (L >> 3) & 1, j) for j in range(JW)]
             for L in range(32)]
    Kval, Vval = table[Kb], table[Vb]
    err = 0.0
    for warp in range(n_warps):
        wn0 = warp * wn
        # ---- S = Q K^T (the kernel's FP8 branch) ----
        nt_ = wn // 8
        s = [[[0.0] * 4 for _ in range(32)] for _ in range(nt_)]
        for kp in range(kd // 2):
            qa = [ldmatrix_x4(memQ, [(2 * kp + h) // JW * (16 * W) + a_off[L][(2 * kp + h) % JW]
                                     for L in range(32)]) for h in range(2)]
            for np_ in range(nt_ // 2):
                kb = ldmatrix_x4(memK, [kp // JW * (block_n * W) + (wn0 + np_ * 16) * W
                                        + k_off[L][kp % JW] for L in range(32)])
                for q in range(2):
                    for h in range(2):
                        B = [[cvt(kb[L][2 * q + h][0]), cvt(kb[L][2 * q + h][1])]
                             for L in range(32)]
                        mma(s[2 * np_ + q], qa[h], B)
        S_ref = Q @ Kval[wn0:wn0 + wn].T
        for nt in range(nt_):
            for L in range(32):
                g, t = L // 4, L % 4
                for e in range(4):
                    ref = S_ref[g + 8 * (e // 2), nt * 8 + 2 * t + (e & 1)]
                    err = max(err, abs(s[nt][L][e] - ref))
        # ---- O += P V (P: any 16 x wn matrix, A fragments as in the bf16 path) ----
        P = rng.standard_normal((16, wn))
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(d // 8)]
        for kk in range(wn // 16):
            pa = [[tuple(P[g + 8 * (i & 1), kk * 16 + 2 * t + 8 * (i >> 1) + j] for j in (0, 1))
                   for i in range(4)] for g, t in ((L // 4, L % 4) for L in range(32))]
            for cp in range(d // 32):
                vb = ldmatrix_x4(memV, [cp // JW * (block_n * W) + (wn0 + kk * 16) * W
                                        + a_off[L][cp % JW] for L in range(32)], trans=True)
                for h in range(2):
                    be, bo = [], []
                    for L in range(32):
                        x0 = prmt(bytes_of(vb[L][2 * h]), 0x3120)
                        x1 = prmt(bytes_of(vb[L][2 * h + 1]), 0x3120)
                        be.append([cvt((x0[0], x0[1])), cvt((x1[0], x1[1]))])
                        bo.append([cvt((x0[2], x0[3])), cvt((x1[2], x1[3]))])
                    c = 2 * cp + h
                    mma(acc[2 * c], pa, be)
                    mma(acc[2 * c + 1], pa, bo)
        # the merge's slab store: dims 16c + 4t .. + 3 of rows g, g + 8
        slab = np.full((16, d), np.nan)
        for L in range(32):
            g, t = L // 4, L % 4
            for r in range(2):
                for c in range(d // 16):
                    slab[g + 8 * r, 16 * c + 4 * t: 16 * c + 4 * t + 4] = (
                        acc[2 * c][L][2 * r], acc[2 * c + 1][L][2 * r],
                        acc[2 * c][L][2 * r + 1], acc[2 * c + 1][L][2 * r + 1])
        O_ref = P @ Vval[wn0:wn0 + wn]
        err = max(err, float(np.nanmax(np.abs(slab - O_ref))), 0.0)
        assert not np.isnan(slab).any(), "a slab column was never written"
    return err


def run_16bit(d, block_n=64, n_warps=4, seed=1):
    """The same lane model on the 16-bit path (verified on the GPU): K through ldmatrix, V
    through ldmatrix.trans, straight into the B registers. Anchors the model's conventions."""
    rng = np.random.default_rng(seed)
    wn = block_n // n_warps
    K = rng.standard_normal((block_n, d))
    V = rng.standard_normal((block_n, d))
    Q = rng.standard_normal((16, d))
    memK, memV, memQ = [None] * (block_n * d), [None] * (block_n * d), [None] * (16 * d)
    for r in range(block_n):
        for c in range(d):
            memK[tile_off(block_n, r, c)] = K[r, c]
            memV[tile_off(block_n, r, c)] = V[r, c]
    for r in range(16):
        for c in range(d):
            memQ[tile_off(16, r, c)] = Q[r, c]
    a_off = [[lane_off(L & 15, L >> 4, j) for j in range(JW)] for L in range(32)]
    k_off = [[lane_off((L & 7) + ((L >> 4) << 3), (L >> 3) & 1, j) for j in range(JW)]
             for L in range(32)]
    err = 0.0
    for warp in range(n_warps):
        wn0 = warp * wn
        s = [[[0.0] * 4 for _ in range(32)] for _ in range(wn // 8)]
        for kk in range(d // 16):
            qa = ldmatrix_x4(memQ, [kk // JW * (16 * W) + a_off[L][kk % JW] for L in range(32)])
            for np_ in range(wn // 16):
                kb = ldmatrix_x4(memK, [kk // JW * (block_n * W) + (wn0 + np_ * 16) * W
                                        + k_off[L][kk % JW] for L in range(32)])
                mma(s[2 * np_], qa, [[kb[L][0], kb[L][1]] for L in range(32)])
                mma(s[2 * np_ + 1], qa, [[kb[L][2], kb[L][3]] for L in range(32)])
        S_ref = Q @ K[wn0:wn0 + wn].T
        for nt in range(wn // 8):
            for L in range(32):
                g, t = L // 4, L % 4
                for e in range(4):
                    err = max(err, abs(s[nt][L][e]
                                       - S_ref[g + 8 * (e // 2), nt * 8 + 2 * t + (e & 1)]))
        P = rng.standard_normal((16, wn))
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(d // 8)]
        for kk in range(wn // 16):
            pa = [[tuple(P[g + 8 * (i & 1), kk * 16 + 2 * t + 8 * (i >> 1) + j] for j in (0, 1))
                   for i in range(4)] for g, t in ((L // 4, L % 4) for L in range(32))]
            for dp in range(d // 16):
                vb = ldmatrix_x4(memV, [dp // JW * (block_n * W) + (wn0 + kk * 16) * W
                                        + a_off[L][dp % JW] for L in range(32)], trans=True)
                mma(acc[2 * dp], pa, [[vb[L][0], vb[L][1]] for L in range(32)])
                mma(acc[2 * dp + 1], pa, [[vb[L][2], vb[L][3]] for L in range(32)])
        O_ref = P @ V[wn0:wn0 + wn]
        for j in range(d // 8):
            for L in range(32):
                g, t = L // 4, L % 4
                for e in range(4):
                    err = max(err, abs(acc[j][L][e]
                                       - O_ref[g + 8 * (e // 2), 8 * j + 2 * t + (e & 1)]))
    return err


if __name__ == "__main__":
    for d, bn in ((128, 64), (256, 64)):
        e = run_16bit(d, bn)
        print(f"16-bit path (the model's anchor) d{d} block_n {bn}: max |err| = {e:.3g}")
        assert e < 1e-9, e
    for d, bn in ((128, 64), (256, 64), (128, 128)):
        e = run(d, bn)
        print(f"FP8 fragments d{d} block_n {bn}: max |err| = {e:.3g}")
        assert e < 1e-9, e
    print("ok")
