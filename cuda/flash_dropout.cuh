// flashcore: attention dropout's random stream (flashcore/dropout.py defines it; this is the
// same function). Philox4x32-10 keyed by the call's rng_state (seed, offset), counter
// (query row, 4 * (col >> 5) + ((col >> 1) & 3), batch * nheads + head, offset mod 2^32): one
// call gives the 8 probabilities (16 bits each) of columns 2t, 2t+1 of four adjacent n8 tiles
// of one row -- exactly what one thread holds in the forward's mma fragments.
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

// The 4 words of the Philox call that holds (row, col) for head index bh.
FC_HD FcPhilox4 fc_dropout_words(const FcDropout& d, int bh, int row, int col) {
    return fc_philox((unsigned int)row, 4u * ((unsigned int)col >> 5) + (((unsigned int)col >> 1) & 3u),
                     (unsigned int)bh, d.off, d.k0, d.k1);
}

// The 16 random bits of (row, col) out of its call's words.
FC_HD unsigned int fc_dropout_bits(const FcPhilox4& w, int col) {
    const int wi = (col >> 3) & 3;
    const unsigned int word = wi == 0 ? w.x : wi == 1 ? w.y : wi == 2 ? w.z : w.w;
    return (word >> (16 * (col & 1))) & 0xFFFFu;
}

// The factor of probability (row, col): 0 when dropped, scale when kept.
FC_HD float fc_dropout_factor(const FcDropout& d, int bh, int row, int col) {
    return fc_dropout_bits(fc_dropout_words(d, bh, row, col), col) >= d.threshold ? d.scale : 0.f;
}
