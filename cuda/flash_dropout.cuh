// flashcore: attention dropout's random stream (flashcore/dropout.py defines it; this is the
// same function). Philox4x32-7 keyed by the call's rng_state (seed, offset); one call gives the
// 16 probabilities (8 random bits each) of a 4 x 4 group of a 16 x 16 tile: queries with bits 0
// and 3 free, keys likewise. A GPU thread holds 8 of a group's 16 in either orientation (S:
// rows = queries; S^T: rows = keys), its neighbour lane ^ 4 the other 8; so a lane draws one call
// for one of two tiles, its neighbour the call of the other tile, and they swap halves: one call
// per 16 probabilities in every pass (fc_dropout_keep2).
#pragma once

#ifndef FC_HD
#ifdef __CUDACC__
#define FC_HD __host__ __device__ __forceinline__
#else
#define FC_HD inline
#endif
#endif

#ifdef FC_DIAG_PHILOX_ROUNDS     // (timing only: another stream, which the tests reject; 0: the
#define FC_PHILOX_ROUNDS FC_DIAG_PHILOX_ROUNDS   // counters as the bits, the masking kept)
#else
#define FC_PHILOX_ROUNDS 7
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
    for (int r = 0; r < FC_PHILOX_ROUNDS; ++r) {
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
    unsigned int threshold;     // r8 < threshold drops (0: no dropout)
    float scale;                // 1 / (1 - p)
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

// The 4 words of the Philox call of the group that holds (query, key) for head index bh: the
// 16 probabilities of queries {i, i + 1, i + 8, i + 9} x keys {j, j + 1, j + 8, j + 9}, i and
// j the query and key with bits 0 and 3 cleared, inside one 16 x 16 tile.
FC_HD FcPhilox4 fc_dropout_words(const FcDropout& d, int bh, int query, int key) {
    const unsigned int i = (unsigned int)query, j = (unsigned int)key;
    return fc_philox(((i >> 4) << 2) | ((i >> 1) & 3u), ((j >> 4) << 2) | ((j >> 1) & 3u),
                     (unsigned int)bh, d.off, d.k0, d.k1);
}

// The 8 random bits of (query, key) out of its call's words: byte 2 (query & 1) + (key & 1) of
// word 2 ((query >> 3) & 1) + ((key >> 3) & 1).
FC_HD unsigned int fc_dropout_bits(const FcPhilox4& w, int query, int key) {
    const int wi = 2 * ((query >> 3) & 1) + ((key >> 3) & 1);
    const unsigned int word = wi == 0 ? w.x : wi == 1 ? w.y : wi == 2 ? w.z : w.w;
    return (word >> (8 * (2 * (query & 1) + (key & 1)))) & 0xFFu;
}

// Keep masks of a thread's fragment of one 16 x 16 tile: 8 probabilities, each named by its
// fragment bit k = 4 hi + 2 mid + e,
//   S   (rows = queries; lane (g, t)): query row0 + g + 8 hi, key col0 + 8 mid + 2 t + e,
//   S^T (rows = keys):                 query col0 + 8 hi + 2 t + e, key row0 + g + 8 mid,
// stored at bit 16 e + (k >> 1) of the mask (fc_dropout_keep_factor reads it).
FC_HD float fc_dropout_keep_factor(const FcDropout& d, unsigned int keep, int k) {
    return (keep >> (16 * (k & 1) + (k >> 1))) & 1u ? d.scale : 0.f;
}

// prmt.b32 (default mode) over the eight bytes of (a, b): nibble n of sel names the source of
// result byte n (0-3: a's bytes, 4-7: b's); with the nibble's bit 3 set, the result byte is the
// top bit of that byte, replicated.
FC_HD unsigned int fc_perm(unsigned int a, unsigned int b, unsigned int sel) {
#ifdef __CUDA_ARCH__
    unsigned int r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
#else
    const unsigned long long x = a | ((unsigned long long)b << 32);
    unsigned int r = 0;
    for (int k = 0; k < 4; ++k) {
        const unsigned int s = (sel >> (4 * k)) & 15u;
        unsigned int byte = (unsigned int)(x >> (8 * (s & 7u))) & 0xFFu;
        if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
        r |= byte << (8 * k);
    }
    return r;
#endif
}

// The masks below come from per-byte compares, four probabilities an instruction: the
// forward's pair masks in 24 instructions a call besides Philox's (30 in the earlier form that
// added 256 - threshold to each byte spread into a 16-bit half), fc_dropout_lane's a few fewer
// too (nvcc 13 SASS: -40 / -25 a block in the d128 / d64 dropout forward, -13 a step in the d128
// dK/dV kernel). Measured (runs 116 and 119 of the performance log, H100, the same bits; run
// 119 two A/Bs in one process): the d128 forward with dropout level to +11% (+9-11% in 3 of 8
// cells), its forward+backward +1.5-6% in 6 of 8 cells, -6% in one; d64 forward 0.2-2.6%
// slower, forward+backward within 3% either way.
// The keep flags of a word's four probabilities at once: bit 7 of each byte set iff that byte
// is >= threshold (1 .. 255). t = (x | 0x80..) - (threshold & 0x7F) per byte borrows nothing
// across bytes and has bit 7 iff x's low 7 bits reach threshold's; then x >= threshold iff (bit
// 7 of x or of t) where threshold < 128, (bit 7 of x and of t) where it is >= 128: the majority
// of x, t and 0x80.. or 0 (one LOP3).
FC_HD unsigned int fc_dropout_flags(const FcDropout& d, unsigned int x) {
    const unsigned int lo = (d.threshold & 0x7Fu) * 0x01010101u;
    const unsigned int k = d.threshold < 128u ? 0x80808080u : 0u;
    const unsigned int t = (x | 0x80808080u) - lo;
    return (x & t) | (k & (x | t));
}

// What one lane draws, as two masks in the layout above: `mine`, its own 8 probabilities of
// that tile, and `theirs`, those of lane ^ 4 (bits outside 0-3 and 16-19 are left undefined:
// fc_dropout_keep_factor reads those only). A side's bytes of column e (S: 2 b + e, S^T:
// 2 e + b) of words 0, 1 (and 2, 3) go into one register by a sign-replicating permutation,
// bytes [w0 e0, w1 e0, w0 e1, w1 e1] each 0 or 0xFF, so that bits 7, 8, 23 and 24 hold word 0's
// and 1's flags: shifted right by 7 they are bits 0, 1, 16, 17, and words 2, 3 shifted by 5
// bits 2, 3, 18, 19 (one LOP3 merges the two).
FC_HD void fc_dropout_lane(const FcDropout& d, int bh, int q0, int k0, int g, int t,
                           bool transposed, unsigned int& mine, unsigned int& theirs) {
    const FcPhilox4 w = transposed ? fc_dropout_words(d, bh, q0 + 2 * t, k0 + g)
                                   : fc_dropout_words(d, bh, q0 + g, k0 + 2 * t);
    const unsigned int f0 = fc_dropout_flags(d, w.x), f1 = fc_dropout_flags(d, w.y);
    const unsigned int f2 = fc_dropout_flags(d, w.z), f3 = fc_dropout_flags(d, w.w);
    const unsigned int b = (unsigned int)g & 1u;
    unsigned int out[2];
#pragma unroll
    for (int side = 0; side < 2; ++side) {
        const unsigned int bb = side ? 1u - b : b;
        const unsigned int c0 = transposed ? bb : 2u * bb, c1 = c0 + (transposed ? 2u : 1u);
        const unsigned int sel = (c0 | 8u) | ((c0 + 4u) | 8u) << 4 | (c1 | 8u) << 8 |
                                 ((c1 + 4u) | 8u) << 12;
        const unsigned int x = fc_perm(f0, f1, sel), y = fc_perm(f2, f3, sel);
        out[side] = ((x >> 7) & 0x00030003u) | ((y >> 5) & ~0x00030003u);
    }
    mine = out[0];
    theirs = out[1];
}

// The forward's form of a lane's draw (S: rows = queries; the call of fc_dropout_lane for the
// tile at (q0, k0)): `flags` the keep flags of the call's four words (fc_dropout_flags: bit 7
// of each byte), and `theirs` the bytes of lane ^ 4 (bytes 2 b', 2 b' + 1 of each word, b' its g
// & 1), words 2j and 2j + 1 in register j.
FC_HD void fc_dropout_lane_flags(const FcDropout& d, int bh, int q0, int k0, int g, int t,
                                 unsigned int (&flags)[4], unsigned int (&theirs)[2]) {
    const FcPhilox4 w = fc_dropout_words(d, bh, q0 + g, k0 + 2 * t);
    flags[0] = fc_dropout_flags(d, w.x);
    flags[1] = fc_dropout_flags(d, w.y);
    flags[2] = fc_dropout_flags(d, w.z);
    flags[3] = fc_dropout_flags(d, w.w);
    const unsigned int sel = (g & 1) ? 0x5410u : 0x7632u;   // lane ^ 4's bytes of two words
    theirs[0] = fc_perm(flags[0], flags[1], sel);
    theirs[1] = fc_perm(flags[2], flags[3], sel);
}

// From a lane's flags and `other` (what lane ^ 4 drew for it: fc_dropout_lane_flags' theirs),
// the masks of tiles A and B as below: a sign-replicating byte permutation each, from the
// lane's own word (bytes 2 b, 2 b + 1) or from the neighbour's register (word 2j's bytes at 4,
// 5, word 2j + 1's at 6, 7); A is the tile an even lane drew itself, B an odd lane's.
FC_HD void fc_dropout_pair_masks(const unsigned int (&flags)[4], const unsigned int (&other)[2],
                                 bool odd, unsigned int (&mask_a)[4], unsigned int (&mask_b)[4]) {
    const unsigned int own = odd ? 0xBBAAu : 0x9988u;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const unsigned int drawn = (w & 1) ? 0xFFEEu : 0xDDCCu;
        mask_a[w] = fc_perm(flags[w], other[w >> 1], odd ? drawn : own);
        mask_b[w] = fc_perm(flags[w], other[w >> 1], odd ? own : drawn);
    }
}

#ifdef __CUDACC__
// The keep masks of two 16 x 16 tiles, A at (qa, ka) and B at (qb, kb) (B may be A), for this
// lane's fragment (S or S^T), one Philox call per lane: lanes with even g draw A's group, odd g
// B's, and each pair of lanes (lane, lane ^ 4) swaps halves. Warp-synchronous.
__device__ __forceinline__ void fc_dropout_keep2(const FcDropout& d, int bh, int qa, int ka,
                                                 int qb, int kb, int g, int t, bool transposed,
                                                 unsigned int& keep_a, unsigned int& keep_b) {
    const bool odd = (g & 1) != 0;
    unsigned int mine, theirs;
    fc_dropout_lane(d, bh, odd ? qb : qa, odd ? kb : ka, g, t, transposed, mine, theirs);
    const unsigned int other = __shfl_xor_sync(0xFFFFFFFFu, theirs, 4);
    keep_a = odd ? other : mine;
    keep_b = odd ? mine : other;
}

// The same draw as fc_dropout_keep2 in S (transposed = false), as the forward's masks of P's
// packed pairs (fc_dropout_pair_masks): 24 instructions a call besides Philox's (the flags, 2
// merges, 2 shuffles, 8 masks), where unpacking fc_dropout_keep2's bits into masks took about
// 60. Warp-synchronous.
__device__ __forceinline__ void fc_dropout_masks2(const FcDropout& d, int bh, int qa, int ka,
                                                  int qb, int kb, int g, int t,
                                                  unsigned int (&mask_a)[4],
                                                  unsigned int (&mask_b)[4]) {
    const bool odd = (g & 1) != 0;
    unsigned int mine[4], theirs[2], other[2];
    fc_dropout_lane_flags(d, bh, odd ? qb : qa, odd ? kb : ka, g, t, mine, theirs);
    other[0] = __shfl_xor_sync(0xFFFFFFFFu, theirs[0], 4);
    other[1] = __shfl_xor_sync(0xFFFFFFFFu, theirs[1], 4);
    fc_dropout_pair_masks(mine, other, odd, mask_a, mask_b);
}
#endif
