// flashcore: attention dropout's random stream (flashcore/dropout.py defines it; this is the
// same function). Philox4x32-10 keyed by the call's rng_state (seed, offset), counter
// (query row with bit 3 squeezed out, key column with bits 0 and 3 squeezed out, batch * nheads
// + head, offset mod 2^32): one call gives the 8 probabilities (16 bits each) of a 2 x 4 group
// of a 16 x 16 tile (fc_dropout_words), one per 8 elements in the forward and the backward.
#pragma once

#ifndef FC_HD
#ifdef __CUDACC__
#define FC_HD __host__ __device__ __forceinline__
#else
#define FC_HD inline
#endif
#endif

struct FcPhilox4 {
    unsigned int x, y, z, w;
};

FC_HD unsigned int fc_mulhi(unsigned int a, unsigned int b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return (unsigned int)(((unsigned long long)a * b) >> 32);
#endif
}

FC_HD FcPhilox4 fc_philox(unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
                          unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = fc_mulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = fc_mulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    FcPhilox4 o;
    o.x = c0;
    o.y = c1;
    o.z = c2;
    o.w = c3;
    return o;
}

// The per-call constants of the stream.
struct FcDropout {
    unsigned int k0, k1, off;   // key and counter word 3 (see flashcore/dropout.py)
    unsigned int threshold;     // r16 < threshold drops (0: no dropout)
    float scale;                // 65536 / (65536 - threshold)
};

// From the device pair rng_state = (seed, offset) (int64), the threshold and scale.
FC_HD FcDropout fc_dropout_setup(const void* rng_state, int threshold, float scale) {
    FcDropout d;
    const unsigned long long* s = static_cast<const unsigned long long*>(rng_state);
    const unsigned long long seed = s[0], offset = s[1];
    d.k0 = (unsigned int)seed;
    d.k1 = (unsigned int)(seed >> 32) ^ (unsigned int)(offset >> 32);
    d.off = (unsigned int)offset;
    d.threshold = (unsigned int)threshold;
    d.scale = scale;
    return d;
}

// The 4 words of the Philox call that holds (row, col) for head index bh. One call covers the
// 8 probabilities of a 2 x 4 group: rows {r, r + 8} and columns {c, c + 1, c + 8, c + 9} with
// r and c the row and column with bit 3 (and for the column bit 0) cleared -- inside one
// 16 x 16 tile. That is what one thread holds of an mma/wgmma accumulator in either
// orientation: rows g, g + 8 and columns 2t, 2t + 1 of two adjacent n8 tiles in S (queries x
// keys), and, in S^T (keys x queries), half of a group that the neighbour lane (lane ^ 4,
// whose key differs in bit 0) completes.
FC_HD FcPhilox4 fc_dropout_words(const FcDropout& d, int bh, int row, int col) {
    const unsigned int r = (unsigned int)row, c = (unsigned int)col;
    return fc_philox(((r >> 4) << 3) | (r & 7u), ((c >> 4) << 2) | ((c >> 1) & 3u),
                     (unsigned int)bh, d.off, d.k0, d.k1);
}

// The 16 random bits of (row, col) out of its call's words.
FC_HD unsigned int fc_dropout_bits(const FcPhilox4& w, int row, int col) {
    const int wi = 2 * ((row >> 3) & 1) + ((col >> 3) & 1);
    const unsigned int word = wi == 0 ? w.x : wi == 1 ? w.y : wi == 2 ? w.z : w.w;
    return (word >> (16 * (col & 1))) & 0xFFFFu;
}

// The factor of bit `bit` of a keep mask (fc_dropout_keep_s / fc_dropout_keep_st): 0 when
// dropped, scale when kept.
FC_HD float fc_dropout_keep_factor(const FcDropout& d, unsigned int keep, int bit) {
    return (keep >> bit) & 1u ? d.scale : 0.f;
}

// Keep bits of a thread's S fragment (rows = queries) in the 16 x 16 tile at (i0, j0), both
// multiples of 16, lane (g, t): bit 4 r + 2 u + e is row i0 + g + 8 r, column j0 + 8 u + 2 t + e.
// One Philox call.
FC_HD unsigned int fc_dropout_keep_s(const FcDropout& d, int bh, int i0, int j0, int g, int t) {
    const FcPhilox4 w = fc_dropout_words(d, bh, i0 + g, j0 + 2 * t);
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
    unsigned int keep = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k)   // k = 4 r + 2 u + e: word 2 r + u, half e
        keep |= (((words[k >> 1] >> (16 * (k & 1))) & 0xFFFFu) >= d.threshold ? 1u : 0u) << k;
    return keep;
}

// The S^T fragment (rows = keys) of the tile at (query q0, key k0), multiples of 16, lane
// (g, t): bit 4 u + 2 r + e is query q0 + 8 u + 2 t + e, key k0 + g + 8 r. The lane's own call
// is the group of query q0 + 2 t + (g & 1), keys k0 + (g & ~1) + {0, 1, 8, 9}: its half for
// key bit 0 = g & 1 is `mine`; the other half, `theirs`, belongs to lane ^ 4 -- placed at the
// bits that lane reads (fc_dropout_keep_st exchanges them).
FC_HD void fc_dropout_keep_st_lane(const FcDropout& d, int bh, int q0, int k0, int g, int t,
                                   unsigned int& mine, unsigned int& theirs) {
    const int b = g & 1;
    const FcPhilox4 w = fc_dropout_words(d, bh, q0 + 2 * t + b, k0 + (g & ~1));
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
    mine = theirs = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {   // k = 2 u + r: word 2 u + r (query bit 3 u, key bit 3 r)
        const unsigned int pos = 1u << (2 * k + b);   // 4 u + 2 r + e with e = b
        mine |= ((words[k] >> (16 * b)) & 0xFFFFu) >= d.threshold ? pos : 0u;
        theirs |= ((words[k] >> (16 * (1 - b))) & 0xFFFFu) >= d.threshold ? pos : 0u;
    }
}

#ifdef __CUDACC__
// Warp-synchronous (every lane of the warp calls it together).
__device__ __forceinline__ unsigned int fc_dropout_keep_st(const FcDropout& d, int bh, int q0,
                                                           int k0, int g, int t) {
    unsigned int mine, theirs;
    fc_dropout_keep_st_lane(d, bh, q0, k0, g, t, mine, theirs);
    return mine | __shfl_xor_sync(0xFFFFFFFFu, theirs, 4);
}
#endif
