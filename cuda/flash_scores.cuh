// flashcore: the score modifications and the online softmax step of an mma.sync accumulator
// fragment, shared by the FlashAttention-2-class forward (flash_fwd.cu) and the decode kernel
// (flash_decode.cu); and fc_mask_copies, which the backward kernels use too.
//
// The fragment: s[kMT][kNT][4], kMT m16 row tiles by kNT n8 column tiles of the scores; element
// e of tile (mt, nt) is row half r = e / 2 (rows g and g + 8 of the m16 tile) and column
// nt * 8 + (e & 1) relative to the lane's first key column (2t into each n8 tile). The order of
// the modifications is DESIGN.md's: scale, softcap, ALiBi, mask.
#pragma once

#include "ptx.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Masks in a copy of their own: fc_mask_copies<kSplit>(masked, body) runs body(true) where
// `masked` holds and body(false) elsewhere. body (a lambda taking the flag) is inlined at each
// call, so its flag is a constant in each copy and the unmasked copy carries no mask
// instruction. One copy testing a runtime flag inside is what ptxas if-converts, and a
// predicated-off instruction still takes its issue slot: nvcc 13 put 155 of them in every step of
// the d128 causal dK/dV loop (737 instructions a step, 532 with two copies), and the d128 decode
// kernel's key-mask loads and mask selects were ~170 of each block's 896. kSplit false (where a
// second copy's registers made ptxas spill): body(masked), the one copy. Used by the backward
// (flash_bwd.cu, flash_bwd_sm90.cu) and the decode kernel.
template <bool kSplit = true, typename Body>
__device__ __forceinline__ void fc_mask_copies(bool masked, Body&& body) {
    if (kSplit) {
        if (masked)
            body(true);
        else
            body(false);
        return;
    }
    body(masked);
}

// P as the A fragment of the m16n8k16 P V step kk: the S accumulators of key tiles 2kk and
// 2kk + 1 are exactly it (a0 = row g, keys 2t..2t+1 = tile 2kk's c0, c1; a1 = row g + 8 = its
// c2, c3; a2 / a3 the same of tile 2kk + 1), packed to 16-bit pairs by Elem::pack2. P never
// touches shared memory (the FlashAttention-2-class forward and the decode kernel).
template <typename Elem, int kMT, int kNT>
__device__ __forceinline__ void fc_pack_p(const float (&s)[kMT][kNT][4], int kk,
                                          fc_u32 (&pa)[kMT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        pa[mt][0] = Elem::pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = Elem::pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = Elem::pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = Elem::pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
}

// Every element of a fragment (scores, or O's accumulators) zeroed.
template <int kMT, int kNT>
__device__ __forceinline__ void fc_zero_fragment(float (&s)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
}

// Q's A fragment of m16 tile mt and k16 step kk: from qf (kQInRegs: loaded once) or by ldmatrix
// at q_addr(mt, kk).
template <bool kQInRegs, int kQM, int kQK, typename QAddr>
__device__ __forceinline__ void fc_q_frag(fc_u32 (&qa)[4], const fc_u32 (&qf)[kQM][kQK][4],
                                          QAddr&& q_addr, int mt, int kk) {
    if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[e] = qf[mt][kk][e];
    } else {
        ldmatrix_x4(qa, q_addr(mt, kk));
    }
}

// Two n8 tiles, acc[.][n] and acc[.][n + 1], += every m-tile's A fragment times the B
// fragments b[0..1] and b[2..3] (an x4 ldmatrix's, or the FP8 cache's converted ones).
template <typename Elem, int kMT, int kN>
__device__ __forceinline__ void fc_mma_pair(float (&acc)[kMT][kN][4], int n,
                                            const fc_u32 (&a)[kMT][4], fc_u32 b00, fc_u32 b01,
                                            fc_u32 b10, fc_u32 b11) {
    const fc_u32 b0[2] = {b00, b01};
    const fc_u32 b1[2] = {b10, b11};
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        Elem::mma(acc[mt][n], a[mt], b0);
        Elem::mma(acc[mt][n + 1], a[mt], b1);
    }
}

// S = Q K^T over one key block, 16-bit operands (m16n8k16): s (kMT m16 by kNT n8 tiles)
// zeroed, then for each of the kKD k16 steps of the head dim, Q's A fragments (kQInRegs: qf,
// loaded once; else by ldmatrix at q_addr(mt, kk)) against K's B fragments, one x4 ldmatrix per
// pair of n8 tiles from the tile_off tile of kRows keys at sK (column blocks of kW; this warp's
// keys from row krow0; k_off: fc_ldmatrix_offsets). The FlashAttention-2-class forward and the
// decode kernel's 16-bit caches.
template <typename Elem, int kKD, int kRows, int kW, bool kQInRegs, int kMT, int kNT, int kQM,
          int kQK, typename QAddr>
__device__ __forceinline__ void fc_qk_product(float (&s)[kMT][kNT][4],
                                              const fc_u32 (&qf)[kQM][kQK][4], QAddr&& q_addr,
                                              fc_u32 sK, int krow0, const int (&k_off)[kW / 16]) {
    constexpr int kJW = kW / 16;
    fc_zero_fragment(s);
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
        fc_u32 qa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) fc_q_frag<kQInRegs>(qa[mt], qf, q_addr, mt, kk);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            fc_u32 kb[4];
            ldmatrix_x4(kb, sK + 2u * ((kk / kJW) * (kRows * kW) + (krow0 + np * 16) * kW
                                       + k_off[kk % kJW]));
            fc_mma_pair<Elem>(s, 2 * np, qa, kb[0], kb[1], kb[2], kb[3]);
        }
    }
}

// O += P V over one key block, 16-bit operands: P straight from the S accumulators (fc_pack_p),
// V^T's B fragments by x4 ldmatrix.trans from the tile_off tile of kRows keys at sV (column
// blocks of kW; this warp's keys from row vrow0; a_off: fc_ldmatrix_offsets).
template <typename Elem, int kRows, int kW, int kMT, int kNT, int kDT>
__device__ __forceinline__ void fc_pv_product(float (&acc_o)[kMT][kDT][4],
                                              const float (&s)[kMT][kNT][4], fc_u32 sV, int vrow0,
                                              const int (&a_off)[kW / 16]) {
    constexpr int kJW = kW / 16;
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
        fc_u32 pa[kMT][4];
        fc_pack_p<Elem>(s, kk, pa);
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
            fc_u32 vb[4];
            ldmatrix_x4_trans(vb, sV + 2u * ((dp / kJW) * (kRows * kW) + (vrow0 + kk * 16) * kW
                                             + a_off[dp % kJW]));
            fc_mma_pair<Elem>(acc_o, 2 * dp, pa, vb[0], vb[1], vb[2], vb[3]);
        }
    }
}

// x *= factor, every element of a fragment (scores, or O's accumulators).
template <int kMT, int kNT>
__device__ __forceinline__ void fc_mul_fragment(float (&s)[kMT][kNT][4], float factor) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] *= factor;
}

// softcap: s = cap tanh(s cap_in) (the scale is in cap_in); else with ALiBi the softmax scale
// applied here, before the bias (otherwise it is folded into the exponent's multiplier).
template <bool Has_softcap, bool Has_alibi, int kMT, int kNT>
__device__ __forceinline__ void fc_scale_scores(float (&s)[kMT][kNT][4], float softcap,
                                                float cap_in, float softmax_scale) {
    if constexpr (Has_softcap) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = softcap * fc_tanh(s[mt][nt][e] * cap_in);
    } else if constexpr (Has_alibi) {
        fc_mul_fragment(s, softmax_scale);
    }
}

// ALiBi: s -= slope(mt, r) |d0(mt, r) - column|, d0 the row's query position (i + sk - sq)
// minus the lane's first key column: one int -> float per row, a constant offset per element.
template <int kMT, int kNT, typename Slope, typename D0>
__device__ __forceinline__ void fc_alibi_scores(float (&s)[kMT][kNT][4], Slope slope, D0 d0_of) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float d0 = (float)d0_of(mt, r);
            const float sl = slope(mt, r);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e)
                    s[mt][nt][e] -= sl * fabsf(d0 - (float)(nt * 8 + (e & 1)));
        }
}

// The mask of a boundary block: row (mt, r), at pos_of(mt, r) = its query position (i + sk - sq)
// minus the lane's first key column, sees the columns [lo, hi) with hi = min(hi0, pos + wr + 1)
// (hi0 = sk minus that first column) and lo = pos - wl; a masked score is -inf, so its
// exponent gives exactly 0.
template <int kMT, int kNT, int kBlockN, typename Pos>
__device__ __forceinline__ void fc_mask_scores(float (&s)[kMT][kNT][4], Pos pos_of, int hi0,
                                               bool left_bounded, bool right_bounded, int win_l,
                                               int win_r) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int pos = pos_of(mt, r);
            int hi = hi0;
            if (right_bounded) hi = min(hi, pos + win_r + 1);
            const int lo = left_bounded ? pos - win_l : -kBlockN;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const int jr = nt * 8 + (e & 1);
                    if (jr >= hi || jr < lo) s[mt][nt][e] = -INFINITY;
                }
        }
}

// The caller's per-key mask (decoding's key_mask): the bits of this lane's keys of a block that
// are kept, bit 2 nt + j for key kc0 + nt * 8 + j (tile nt, element e with e & 1 == j). Bytes
// are read only for keys below n (the sequence's): never past the mask's row.
template <int kNT>
__device__ __forceinline__ unsigned fc_key_mask_bits(const unsigned char* keep, int kc0, int n) {
    static_assert(2 * kNT <= 32, "one bit a key");
    unsigned bits = 0u;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int kc = kc0 + nt * 8 + j;
            if (kc < n && __ldg(keep + kc) != 0) bits |= 1u << (2 * nt + j);
        }
    return bits;
}

// Scores of the keys whose bit is clear set to -inf (after fc_mask_scores).
template <int kMT, int kNT>
__device__ __forceinline__ void fc_apply_key_mask(float (&s)[kMT][kNT][4], unsigned bits) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (!((bits >> (2 * nt + j)) & 1u))
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    s[mt][nt][j] = -INFINITY;
                    s[mt][nt][2 + j] = -INFINITY;
                }
}

// The online softmax step. New max m' = max(m, rowmax(S)); O and l are rescaled by
// 2^((m - m') mult); P = 2^(S mult - m' mult), one FFMA and one ex2 per score, written over s.
// A row that has seen only masked keys has m' = -inf: the exponent offset is taken as 0 (so
// -inf - (-inf) never happens), P = 2^-inf = 0, and the stored max stays -inf. The partial sums
// stay per lane (each lane's 2 columns per tile); the quad is reduced once at the end, which is
// valid since the correction is quad-uniform.
// (Decoding skipped O's rescale where no row of a warp took a new maximum, with a correction
// computed from the difference (m - m') mult so that it was exactly 1 there, until run 110 of
// the performance log measured the skip level with or 1% behind the rescale after every block.)
template <int kMT, int kNT, int kDT>
__device__ __forceinline__ void fc_online_softmax(float (&s)[kMT][kNT][4],
                                                  float (&row_max)[kMT][2],
                                                  float (&row_sum)[kMT][2],
                                                  float (&acc_o)[kMT][kDT][4], float mult) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[mt][r];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
                mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
            mx = quad_max(mx);
            const float m_scaled = (mx == -INFINITY) ? 0.f : mx * mult;
            const float c = fc_exp2(row_max[mt][r] * mult - m_scaled);   // 0 if old was -inf
            row_max[mt][r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const float p = fc_exp2(fmaf(s[mt][nt][e], mult, -m_scaled));
                    s[mt][nt][e] = p;
                    sum += p;
                }
            row_sum[mt][r] = row_sum[mt][r] * c + sum;
#pragma unroll
            for (int j = 0; j < kDT; ++j) {
                acc_o[mt][j][2 * r] *= c;
                acc_o[mt][j][2 * r + 1] *= c;
            }
        }
}
