// flashcore: forward kernel for Hopper (sm_90a): warpgroup MMA (wgmma) with operands read
// straight from shared memory. Launcher: flashcore/kernels/forward.py (the sm90 family; the
// Ampere-class flash_fwd.cu serves every other configuration and device).
//
// Status: first version, opt-in (FLASHCORE_SM90=1) until the GPU suite has verified it.
//
// One CTA = 2 warpgroups (256 threads) computes a 128-row x headdim output tile (head dim 64,
// 128 or 256; key blocks of 128, or 64 at 256 where O alone takes 128 registers) for one
// (batch, head). Warpgroup wg owns tile rows [64 wg, 64 wg + 64): per key block
//   S  = Q K^T        wgmma m64n128k16, A = Q and B = K from shared memory (both K-major)
//   online softmax on S in registers (exp2, scale folded in; FA2's per-row state)
//   O += P V          wgmma m64n128k16, A = P from registers (S packed to 16 bits: the
//                     accumulator layout is the A-register layout), B = V from shared memory
//                     read N-major (imm-trans-b), so V is used in its natural [key][d] layout
// The tensor cores read shared memory directly: no ldmatrix, no per-warp operand traffic
// through registers (what bounds the mma.sync kernel at about half of the Hopper peak).
//
// Pipeline: Q once; v0 double-buffers K and V (the next block's cp.async issued before the
// current block's MMAs), v1 keeps a 3-stage ring loaded two steps ahead (see its loop).
// cp.async writes through the generic proxy and wgmma reads through the async proxy: every
// thread fences (fence.proxy.async) after its copies land, then the CTA synchronises, before
// any wgmma reads the tile.
//
// Shared memory (1024-byte aligned; each [128 rows][64 cols] block 16 KiB, 128-byte swizzle,
// the same physical layout as flash_fwd.cu's tiles): Q 32 KiB, then K and V rings of 32 KiB
// tiles, 2 stages (v0: 161 KiB in all) or 3 (v1: 225 KiB).
//
// Masking, alignment and outputs are those of flash_fwd.cu (bottom-right causal, windows with
// block skipping, varlen, GQA; rows that see no key get O = 0 and lse = -inf; NaN propagates).
// Dropout as flash_fwd.cu draws it (one Philox call per 16 x 16 tile of P, after the row sums:
// the lse is the undropped one's). Not in this version (the launcher routes them to
// flash_fwd.cu): other head dims, softcap, ALiBi, paged K/V.
#include "flash_dropout.cuh"
#include "flash_params.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace fc_h {

constexpr int kBlockM = 128;     // query rows per CTA (2 warpgroups x 64)
// Keys per block: 128 (head dims 64, 128) or 64 (head dim 256, whose O needs 128 registers).
template <int kD>
struct BlockN {
    static constexpr int value = kD == 256 ? 64 : 128;
};
constexpr int kNThreads = 256;
constexpr fc_u32 kColBlock = 128u * 128u;        // bytes of one [128 rows][64 cols] block

using fc_sm90::load_tile;     // (256 threads: kNThreads)
using fc_sm90::stg32;

}  // namespace fc_h

// Template parameters: Elem (fc_bf16 / fc_fp16); kD: head dim (64 or 128, exact);
// Is_local: a window side is bounded (causal
// included), giving block skipping and boundary masks; kPipe: v1 (softmax of the next block
// overlapped with P V of this one) instead of v0; Is_dropout: attention dropout
// (flash_dropout.cuh).
template <typename Elem, int kD, bool Is_local, bool kPipe, bool Is_dropout>
__global__ void __launch_bounds__(256, 1)
flash_fwd_sm90_kernel(const FlashParams params) {
    using namespace fc_h;
    static_assert(kD == 64 || kD == 128 || kD == 256, "head dims 64, 128 and 256");
    constexpr int kBlockN = BlockN<kD>::value;
    static_assert(!(kPipe && kD == 256), "v1's 3-stage ring does not fit at head dim 256");
    constexpr fc_u32 kQTile = (fc_u32)(kD / 64) * kColBlock;           // 128 x kD
    constexpr fc_u32 kKVBlock = (fc_u32)kBlockN * 128u;                // [kBlockN][64] block
    constexpr fc_u32 kTile = (fc_u32)(kD / 64) * kKVBlock;             // one K or V tile
    constexpr int kNT = kBlockN / 8;    // n8 tiles of S per thread row pair
    constexpr int kDT = kD / 8;         // n8 tiles of O (16)

    extern __shared__ unsigned char smem_raw[];
    const fc_u32 sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
    constexpr fc_u32 kStages = kPipe ? 3u : 2u;
    const fc_u32 sK = sQ + kQTile;             // kStages K buffers
    const fc_u32 sV = sK + kStages * kTile;    // kStages V buffers

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wg = warp >> 2;          // warpgroup: tile rows [64 wg, 64 wg + 64)
    const int g = lane >> 2;
    const int t = lane & 3;

    const int m_block = Is_local ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;

    // ---- sequence geometry (as flash_fwd.cu) ----------------------------------------------
    long long q_row0 = 0, k_row0 = 0;
    int sq = params.seqlen_q, sk = params.seqlen_k;
    if (params.cu_seqlens_q != nullptr) {
        const FcSeqRange r = fc_seq_range(params.cu_seqlens_q, b, params.total_q, params.seqlen_q);
        q_row0 = r.row0;
        sq = r.len;
    }
    if (params.cu_seqlens_k != nullptr) {
        const FcSeqRange r = fc_seq_range(params.cu_seqlens_k, b, params.total_k, params.seqlen_k);
        k_row0 = r.row0;
        sk = r.len;
    }
    const int m0 = m_block * kBlockM;
    if (m0 >= sq) return;
    const int off = sk - sq;

    const int hk = h / (params.nheads / params.nheads_k);
    const fc_u16* gQ = static_cast<const fc_u16*>(params.q) + (long long)b * params.q_batch_stride
                       + (q_row0 + m0) * params.q_row_stride + (long long)h * params.q_head_stride;
    const fc_u16* gK = static_cast<const fc_u16*>(params.k) + (long long)b * params.k_batch_stride
                       + k_row0 * params.k_row_stride + (long long)hk * params.k_head_stride;
    const fc_u16* gV = static_cast<const fc_u16*>(params.v) + (long long)b * params.v_batch_stride
                       + k_row0 * params.v_row_stride + (long long)hk * params.v_head_stride;
    // element offset of this tile's first output row (16-bit, or float32 with o_fp32)
    const long long o_off = (long long)b * params.o_batch_stride
                            + (q_row0 + m0) * params.o_row_stride + (long long)h * params.o_head_stride;
    fc_u16* gO = static_cast<fc_u16*>(params.o) + o_off;
    float* gLse = params.lse + (long long)b * params.lse_batch_stride
                  + (long long)h * params.lse_head_stride + q_row0 + m0;
    const int rows_q = min(kBlockM, sq - m0);

    const bool left_bounded = Is_local && params.window_left < FC_WINDOW_NONE;
    const bool right_bounded = Is_local && params.window_right < FC_WINDOW_NONE;
    int n_block_max = (sk + kBlockN - 1) / kBlockN;
    int n_block_min = 0;
    if (right_bounded) {
        const long long hi = (long long)(m0 + rows_q - 1) + off + params.window_right + 1;
        const int nb = hi <= 0 ? 0 : (int)min((hi + kBlockN - 1) / kBlockN, (long long)n_block_max);
        n_block_max = min(n_block_max, nb);
    }
    if (left_bounded) {
        const long long lo = (long long)m0 + off - params.window_left;
        if (lo > 0) n_block_min = (int)min(lo / kBlockN, (long long)n_block_max);
    }
    if (n_block_max <= n_block_min) {   // no row of this tile sees a key: O = 0, lse = -inf
        for (int idx = tid; idx < kBlockM * (kD / 2); idx += kNThreads) {
            const int r = idx / (kD / 2), c = idx % (kD / 2);
            if (r < rows_q) {
                if (params.o_fp32)
                    *reinterpret_cast<float2*>(static_cast<float*>(params.o) + o_off
                                               + (long long)r * params.o_row_stride + 2 * c) =
                        make_float2(0.f, 0.f);
                else
                    stg32(gO + (long long)r * params.o_row_stride + 2 * c, 0u);
            }
        }
        for (int r = tid; r < rows_q; r += kNThreads) gLse[r] = -INFINITY;
        return;
    }

    // ---- prologue: Q (v0 also the first K and V, one group each; v1 loads its own) ---------
    int n_block = n_block_max - 1;
    load_tile<kBlockM, kD>(sQ, gQ, params.q_row_stride, rows_q, tid);
    if constexpr (!kPipe) {
        cp_async_commit();
        const int n0 = n_block * kBlockN;
        load_tile<kBlockN, kD>(sK, gK + (long long)n0 * params.k_row_stride, params.k_row_stride, sk - n0, tid);
        load_tile<kBlockN, kD>(sV, gV + (long long)n0 * params.v_row_stride, params.v_row_stride, sk - n0, tid);
        cp_async_commit();
    }

    // ---- per-thread row state: rows 64 wg + 16 (warp % 4) + g + 8 r --------------------------
    float acc_o[kDT * 4];
#pragma unroll
    for (int i = 0; i < kDT * 4; ++i) acc_o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};
    const int warp_row0 = 64 * wg + 16 * (warp & 3);
    const int row_pos0 = m0 + warp_row0 + g + off;   // i + off of this thread's row half 0
    const int win_r = right_bounded ? min(params.window_right, sq) : 0;
    const int win_l = left_bounded ? min(params.window_left, sk) : 0;
    const float mult = params.scale_log2;
    const int blk_hi = right_bounded ? min(sk, m0 + off + win_r + 1) : sk;
    const int blk_lo = left_bounded ? m0 + kBlockM - 1 + off - win_l : 0;

    // Q descriptors of this warpgroup's 64 rows: k-step kk reads columns 16 kk .. 16 kk + 15,
    // i.e. column block kk / 4 at byte offset 32 (kk % 4) inside the 128-byte rows.
    const fc_u32 sQwg = sQ + (fc_u32)wg * 64u * 128u;

    // ---- the steps of one key block ------------------------------------------------------
    // Pin the registers an MMA reads or writes in program order (fence_operand): before its
    // issue (no write to them moves below it) and after its wait (no read moves above it).
    auto settle_s = [&](float (&s)[kNT * 4]) {
#pragma unroll
        for (int i = 0; i < kNT * 4; ++i) fence_operand(s[i]);
    };
    auto settle_pv = [&](fc_u32 (&pa)[kBlockN / 16][4]) {
#pragma unroll
        for (int i = 0; i < kDT * 4; ++i) fence_operand(acc_o[i]);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) fence_operand(pa[kk][e]);
    };
    // S = Q K^T into s (asynchronous: committed as one wgmma group, not waited for).
    auto issue_s = [&](float (&s)[kNT * 4], fc_u32 buf) {
        settle_s(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
            const fc_u32 qoff = (fc_u32)(kk >> 2) * kColBlock + (fc_u32)(kk & 3) * 32u;
            const fc_u32 koff = (fc_u32)(kk >> 2) * kKVBlock + (fc_u32)(kk & 3) * 32u;
            Wgmma<Elem>::ss(s, wgmma_desc_k(sQwg + qoff),
                            wgmma_desc_k(sK + buf + koff), kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    };
    // O += P V (asynchronous, one group). B = V (keys x d), N-major: 64-column blocks of d are
    // kKVBlock apart (LBO), groups of 8 keys 1024 bytes apart (SBO); k-step kk starts at key
    // 16 kk.
    auto issue_pv = [&](fc_u32 (&pa)[kBlockN / 16][4], fc_u32 buf) {
        settle_pv(pa);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
            Wgmma<Elem>::rs_tb(acc_o, pa[kk],
                               wgmma_desc_mn(sV + buf + (fc_u32)kk * 16u * 128u, kKVBlock), 1);
        wgmma_commit();
    };
    // Mask the scores of the block at key n0 (boundary blocks only). Element e of n8 tile j:
    // row half r = e / 2, key n0 + 8 j + 2 t + (e & 1).
    auto mask_s = [&](float (&s)[kNT * 4], int n0) {
        if (!(n0 + kBlockN > blk_hi || n0 < blk_lo)) return;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int pos = row_pos0 + 8 * r - n0 - 2 * t;   // i + off - (n0 + 2t)
            int hi = sk - n0 - 2 * t;
            if (right_bounded) hi = min(hi, pos + win_r + 1);
            const int lo = left_bounded ? pos - win_l : -kBlockN;
#pragma unroll
            for (int j = 0; j < kNT; ++j)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const int jr = j * 8 + (e & 1);
                    if (jr >= hi || jr < lo) s[4 * j + e] = -INFINITY;
                }
        }
    };
    // Online softmax (as flash_fwd.cu): s -> P (fp32), row max and sum updated; corr is the
    // factor the O of the earlier blocks must be multiplied by.
    auto softmax = [&](float (&s)[kNT * 4], float (&corr)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
            mx = quad_max(mx);
            const float m_scaled = (mx == -INFINITY) ? 0.f : mx * mult;
            corr[r] = fc_exp2(row_max[r] * mult - m_scaled);
            row_max[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < kNT; ++j)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const float p = fc_exp2(fmaf(s[4 * j + e], mult, -m_scaled));
                    s[4 * j + e] = p;
                    sum += p;
                }
            row_sum[r] = row_sum[r] * corr[r] + sum;
        }
    };
    // Dropout (flash_dropout.cuh), applied as P is packed (after the row sums).
    FcDropout drop{};
    if constexpr (Is_dropout)
        drop = fc_dropout_setup(params.dropout_rng, params.dropout_threshold, params.dropout_scale);
    const int drop_bh = b * params.nheads + h;
    auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
        for (int j = 0; j < kDT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= corr[e >> 1];
    };
    // P (16-bit) as the A operand of k-step kk (keys n0 + 16 kk ..): tiles 2kk, 2kk+1. With
    // dropout, times the factors of that 16 x 16 tile (one Philox call: fc_dropout_keep_s, bit
    // 4 r + 2 u + e = row half r, tile 2kk + u, column e).
    auto pack_p = [&](const float (&s)[kNT * 4], fc_u32 (&pa)[kBlockN / 16][4], int n0) {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            if constexpr (Is_dropout) {
                const unsigned int keep =
                    fc_dropout_keep_s(drop, drop_bh, m0 + warp_row0, n0 + 16 * kk, g, t);
                auto f = [&](int bit) { return fc_dropout_keep_factor(drop, keep, bit); };
                pa[kk][0] = Elem::pack2(s[8 * kk + 0] * f(0), s[8 * kk + 1] * f(1));
                pa[kk][1] = Elem::pack2(s[8 * kk + 2] * f(4), s[8 * kk + 3] * f(5));
                pa[kk][2] = Elem::pack2(s[8 * kk + 4] * f(2), s[8 * kk + 5] * f(3));
                pa[kk][3] = Elem::pack2(s[8 * kk + 6] * f(6), s[8 * kk + 7] * f(7));
            } else {
                pa[kk][0] = Elem::pack2(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = Elem::pack2(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = Elem::pack2(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = Elem::pack2(s[8 * kk + 6], s[8 * kk + 7]);
            }
        }
    };
    auto load_kv = [&](int nb, fc_u32 buf) {
        const int n1 = nb * kBlockN;
        load_tile<kBlockN, kD>(sK + buf, gK + (long long)n1 * params.k_row_stride, params.k_row_stride,
                  sk - n1, tid);
        load_tile<kBlockN, kD>(sV + buf, gV + (long long)n1 * params.v_row_stride, params.v_row_stride,
                  sk - n1, tid);
    };

    float s[kNT * 4];
#pragma unroll
    for (int i = 0; i < kNT * 4; ++i) s[i] = 0.f;
    fc_u32 pa[kBlockN / 16][4];
    float corr[2];

    if constexpr (!kPipe) {
        // v0: S, softmax, PV one after the other per block (the two warpgroups overlap each
        // other between the barriers).
        for (int it = 0; n_block >= n_block_min; ++it, --n_block) {
            const int n0 = n_block * kBlockN;
            const fc_u32 buf = (fc_u32)(it & 1) * kTile;
            // Prefetch the next block into the other buffers (freed by the barrier that ended
            // the previous iteration); always commit, so that "all but the newest group" below
            // means "everything up to this block".
            if (n_block - 1 >= n_block_min) load_kv(n_block - 1, kTile - buf);
            cp_async_commit();
            cp_async_wait<1>();      // Q and this block's K, V have landed (for this thread)
            fence_proxy_async();     // ... and are visible to the async proxy
            __syncthreads();         // ... for every thread

            issue_s(s, buf);
            wgmma_wait<0>();
            settle_s(s);
            mask_s(s, n0);
            softmax(s, corr);
            rescale_o(corr);
            pack_p(s, pa, n0);
            issue_pv(pa, buf);
            wgmma_wait<0>();
            settle_pv(pa);
            __syncthreads();         // every warpgroup is done with this block's buffers
        }
    } else {
        // v1 (FA3's intra-warpgroup overlap): while the tensor cores run P_i V_i, the
        // warpgroup computes the softmax of block i+1, whose S was issued just before.
        //   step i:  wait for block i+1 (loaded two steps earlier) + barrier
        //            S_{i+1} = Q K_{i+1}^T issued, then O += P_i V_i issued
        //            wait for S_{i+1} only (wgmma groups retire in order), softmax it
        //            wait for P_i V_i; O *= corr; P_{i+1} packed
        //            barrier; block i+3 into the stage block i used
        // K/V ring of 3 stages (block j in stage j % 3). cp.async groups: {Q, B0}, {B1}, {B2},
        // then one per step ({B_{i+3}} or empty), so at the top of step i "all but the newest
        // group" is everything up to B_{i+1}.
        int nb = n_block;                       // block i (walking down)
        auto stage = [&](int j) { return (fc_u32)(j % 3) * kTile; };
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            if (nb - j >= n_block_min) load_kv(nb - j, stage(j));
            cp_async_commit();
        }
        cp_async_wait<2>();                     // Q and the first block landed
        fence_proxy_async();
        __syncthreads();
        issue_s(s, stage(0));
        wgmma_wait<0>();
        settle_s(s);
        mask_s(s, nb * kBlockN);
        softmax(s, corr);                       // O is 0: no rescale
        pack_p(s, pa, nb * kBlockN);
        int it = 0;
        for (; nb - 1 >= n_block_min; ++it, --nb) {   // every block but the last
            cp_async_wait<1>();                 // block i+1 landed
            fence_proxy_async();
            __syncthreads();
            issue_s(s, stage(it + 1));          // S_{i+1}
            issue_pv(pa, stage(it));            // O += P_i V_i
            wgmma_wait<1>();                    // S_{i+1} done (P_i V_i may still run)
            settle_s(s);
            mask_s(s, (nb - 1) * kBlockN);
            softmax(s, corr);
            wgmma_wait<0>();
            settle_pv(pa);
            rescale_o(corr);
            pack_p(s, pa, (nb - 1) * kBlockN);
            __syncthreads();                    // both warpgroups are done with stage(it)
            if (nb - 3 >= n_block_min) load_kv(nb - 3, stage(it));
            cp_async_commit();
        }
        issue_pv(pa, stage(it));                // the last block
        wgmma_wait<0>();
        settle_pv(pa);
    }

    // ---- epilogue: O / l (NaN propagates: l == 0 only for rows that saw no key), lse ----------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(row_sum[r]);
        const float inv = l == 0.f ? 0.f : 1.f / l;
        const int row = warp_row0 + g + 8 * r;
        if (row < rows_q) {
            if (params.o_fp32) {      // unrounded float32 output, 8 bytes a store
                float* orow = static_cast<float*>(params.o) + o_off
                              + (long long)row * params.o_row_stride;
#pragma unroll
                for (int j = 0; j < kDT; ++j)
                    *reinterpret_cast<float2*>(orow + 8 * j + 2 * t) =
                        make_float2(acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv);
            } else {
                fc_u16* orow = gO + (long long)row * params.o_row_stride;
#pragma unroll
                for (int j = 0; j < kDT; ++j)
                    stg32(orow + 8 * j + 2 * t,
                          Elem::pack2(acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv));
            }
            if (t == 0)
                gLse[row] = l == 0.f ? -INFINITY : row_max[r] * params.softmax_scale + logf(l);
        }
    }
}
