// flashcore: backward dK/dV kernel for Hopper (sm_90a): warpgroup MMAs (wgmma) reading their
// operands from shared memory. Launcher: flashcore/kernels/backward.py (the sm90 family). The
// preprocess (D = rowsum(dO * O)) and the dQ conversion are flash_bwd.cu's kernels, whose
// helpers (sequence geometry, score math, masks) this file reuses by including it.
//
// Head dims 64, 128 and 256 (its own kernel, at the end of the file), fp16/bf16,
// causal/windows/varlen/GQA, dropout, dQ added to an fp32 accumulator in tile order (one bulk
// reduce-add of a warpgroup's tile a step: "dQ in tile order" below); softcap, ALiBi, other
// head dims and deterministic mode stay on flash_bwd.cu. The default on compute capability 9.0
// (FLASHCORE_SM90_BWD=0 turns it off).
//
// One CTA = 2 warpgroups (256 threads) owns a block of 128 keys of one (batch, kv head);
// warpgroup w owns keys [64 w, 64 w + 64). dK and dV of its keys stay in fp32 registers while
// the CTA walks the query heads of the GQA group and the query blocks (64 rows) that can see
// the key block. Per query block, per warpgroup (the orientation of flash_bwd.cu: accumulator
// rows are keys, columns are queries):
//   S^T  = K_w Q^T        wgmma m64n{kBlockM}k16, A = K (K-major), B = Q (K-major)
//   dP^T = V_w dO^T       the same with V and dO
//   P^T, dS^T             elementwise, from the forward's lse and D (BwdScoreMath)
//   dV_w += P^T dO        wgmma m64n128k16, A = P^T from registers, B = dO read N-major
//   dK_w += dS^T Q        the same with dS^T and Q
//   dS^T -> shared ([key][query], 16-bit), then after a barrier
//   d128: dQ[:, 64 w:64 w+64] = dS K[:, 64 w:64 w+64]    m64n64k16 over all 128 keys, A = dS
//         read M-major from the [key][query] tile (imm-trans-a), B = K read N-major
//         (imm-trans-b); staged in shared memory and added to the fp32 dq_accum as one bulk
//         reduce-add of the warpgroup's tile (see "dQ in tile order" below)
//   d64:  dQ += dS[:, keys_w] K[keys_w, :]   the same instruction over the warpgroup's own 64
//         keys: each warpgroup adds its partial product of the same tile
// Shared memory (1024-byte aligned, every tile [rows][64 columns] blocks with the 128-byte
// swizzle of the forward): K, V kD / 4 KiB each; Q, dO 2 stages of kBlockM x kD x 2 bytes
// each (kD / 8 KiB at 64-query steps); dS^T 16 KiB per 64 queries (double-buffered in the
// warp-specialised kernel); lse and D 2 x 2 x kBlockM floats; the warp-specialised kernel (d64, d128)
// and the cp.async kernel add two 16 KiB dQ staging tiles (the d256 kernel stages in its Q /
// dO stage tiles).
//
// Two kernels run these steps (DkdvWarpgroup holds one warpgroup's share of a step):
//  * flash_bwd_dkdv_sm90_ws_kernel (the default): warp-specialised, as the
//    forward's. Warpgroup 0 produces: one thread loads K and V once and Q and dO per step with
//    TMA into a 2-stage ring of mbarrier-guarded stages, the warp's lanes write the step's
//    lse and D beside them; the two consumer warpgroups never load, and meet only at one
//    named barrier per step (dS^T written, before the dQ product reads it; dS^T is
//    double-buffered, so that barrier also frees the other buffer). Varlen calls too
//    (Is_varlen: maps over the packed arrays, zero_rows_past).
//    Head dim 128 steps over 64 queries, 64 over 128 (each warpgroup's dQ tile: its own 64
//    query rows, all columns; a few bytes spill in the consumers' 240 registers).
//  * flash_bwd_dkdv_sm90_kernel: both warpgroups load with cp.async and meet at __syncthreads
//    (arrays TMA cannot read).
#include "flash_bwd.cu"
#include "sm90_pipeline.cuh"
#include "wgmma.cuh"
#include "diag_timeline.cuh"

namespace fc_hb {

constexpr int kBlockN = 128;        // keys per CTA
constexpr fc_u32 kKBlock = 128u * 128u;   // one [128 rows][64 cols] block (K, V, dS^T)
template <int kD> constexpr fc_u32 kKTile = (fc_u32)(kD / 64) * kKBlock;   // K or V: 128 x kD
// Q or dO: kBM x kD, in [kD / 64][kBM rows][64 cols] blocks of kBM * 128 bytes
template <int kD, int kBM> constexpr fc_u32 kQTile = (fc_u32)(kD / 64) * (fc_u32)(kBM * 128);

using fc_sm90::load_tile;     // (256 threads)
using fc_sm90::stg32;
using fc_sm90::sts32;

}  // namespace fc_hb


// Row `row` (counted from the sequence's first) of head h, batch b in the fp32 dQ accumulator,
// which holds whole 64-row tiles: a varlen sequence starts at its own tile (BwdSeq::q_tile_off,
// 0 for dense calls).
__device__ __forceinline__ float* dq_accum_row(const FlashParams& p, const BwdSeq& seq, int b,
                                               int h, int row) {
    return p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride
           + (seq.q_tile_off + row) * p.dq_accum_row_stride;
}

// The warp-specialised dK/dV kernels' barrier block at `base` (8 bytes each): the K/V barrier,
// then kStages full, then kStages empty (sm90_pipeline.cuh says how a ring uses them).
template <int kStages>
struct BwdBars {
    static constexpr fc_u32 kBytes = 8u * (fc_u32)(1 + 2 * kStages);
    fc_u32 base;
    __device__ __forceinline__ fc_u32 kv() const { return base; }
    __device__ __forceinline__ fc_u32 full(int st) const { return base + 8u * (fc_u32)(1 + st); }
    __device__ __forceinline__ fc_u32 empty(int st) const {
        return base + 8u * (fc_u32)(1 + kStages + st);
    }
};

// The CTA's (key block, kv head, batch): from the grid as launched or, with a window (causal:
// a key block's walk is longer the earlier the block), chunk by chunk over the key blocks,
// the longest first (fc_pipe::chunked_tile).
template <bool Is_local>
__device__ __forceinline__ fc_pipe::FcTileXYZ bwd_block_order() {
    if constexpr (Is_local)
        return fc_pipe::chunked_tile(fc_pipe::linear_block(), (int)gridDim.x, (int)gridDim.y,
                                     (int)gridDim.z);
    else
        return fc_pipe::FcTileXYZ{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
}

namespace fc_hb {

// The dK/dV epilogue from the registers, for a consumer warpgroup holding dK and dV of 64 keys
// (from `key0`) x kCols columns (from `col0`) in the wgmma accumulator layout (rows 16 wl + g +
// 8 r, columns 8 j + 2 t; wt: the thread's index in the warpgroup): dK * softmax_scale and dV
// as 16-bit, 4 bytes a thread, rows past the sequence's keys skipped.
template <typename Elem, int kCols>
__device__ __forceinline__ void dkdv_store_regs(const FlashParams& p, const BwdSeq& seq, int b,
                                                int hk, int key0, int col0,
                                                const float (&acc_dk)[kCols / 2],
                                                const float (&acc_dv)[kCols / 2], int wt) {
    const float scale = p.softmax_scale;
    const int wl = wt >> 5, g = (wt >> 2) & 7, t = wt & 3;
    fc_u16* gdk = static_cast<fc_u16*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride + col0;
    fc_u16* gdv = static_cast<fc_u16*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride + col0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 16 * wl + g + 8 * r;
        if (key < seq.sk) {
            fc_u16* dkr = gdk + (seq.k_off + key) * p.dk_row_stride;
            fc_u16* dvr = gdv + (seq.k_off + key) * p.dv_row_stride;
#pragma unroll
            for (int j = 0; j < kCols / 8; ++j) {
                stg32(dkr + 8 * j + 2 * t, Elem::pack2(acc_dk[4 * j + 2 * r] * scale,
                                                       acc_dk[4 * j + 2 * r + 1] * scale));
                stg32(dvr + 8 * j + 2 * t,
                      Elem::pack2(acc_dv[4 * j + 2 * r], acc_dv[4 * j + 2 * r + 1]));
            }
        }
    }
}

// The dK/dV epilogue through shared memory, for a consumer warpgroup holding dK and dV of 64
// keys (from `key0`) x kCols columns (from `col0`) in the wgmma accumulator layout (rows 16 wl +
// g + 8 r, columns 8 j + 2 t): dK * softmax_scale and dV as 16-bit are staged in the K and V
// tiles at sKw / sVw (the warpgroup's 64 rows of [kCols / 64] blocks of kBlockBytes, 128-byte
// rows whose 16-byte chunks are XOR-swizzled by row & 7: a warp's 4-byte stores, 8 rows x 16
// bytes, fall in 32 distinct banks), then each row leaves whole, 16 bytes a thread (wt: the
// thread's index in the warpgroup; bar: the warpgroup's named barrier). Writing the fragments
// straight out (dkdv_store_regs: 8 rows x 16 bytes a warp store) is the pattern that ran the old
// dQ conversion at half the bandwidth. Returns false, writing nothing, where dk's or dv's rows
// are not 16-byte aligned (a view; CTA-uniform): the caller stores from the registers.
template <typename Elem, int kCols, fc_u32 kBlockBytes>
__device__ __forceinline__ bool dkdv_store_staged(const FlashParams& p, const BwdSeq& seq, int b,
                                                  int hk, int key0, int col0,
                                                  const float (&acc_dk)[kCols / 2],
                                                  const float (&acc_dv)[kCols / 2], fc_u32 sKw,
                                                  fc_u32 sVw, int wt, int bar) {
    fc_u16* gdk = static_cast<fc_u16*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride
                  + (seq.k_off + key0) * p.dk_row_stride + col0;
    fc_u16* gdv = static_cast<fc_u16*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride
                  + (seq.k_off + key0) * p.dv_row_stride + col0;
    const unsigned long long bits = reinterpret_cast<unsigned long long>(gdk)
        | reinterpret_cast<unsigned long long>(gdv)
        | (unsigned long long)(p.dk_row_stride * 2) | (unsigned long long)(p.dv_row_stride * 2);
    if (bits & 15) return false;
    const float scale = p.softmax_scale;
    const int wl = wt >> 5, g = (wt >> 2) & 7, t = wt & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fc_u32 row = (fc_u32)(16 * wl + g + 8 * r);          // row & 7 = g
#pragma unroll
        for (int j = 0; j < kCols / 8; ++j) {
            const fc_u32 off = (fc_u32)(j >> 3) * kBlockBytes + row * 128u
                               + (fc_u32)(((j & 7) ^ g) << 4) + 4u * (fc_u32)t;
            sts32(sKw + off, Elem::pack2(acc_dk[4 * j + 2 * r] * scale,
                                         acc_dk[4 * j + 2 * r + 1] * scale));
            sts32(sVw + off, Elem::pack2(acc_dv[4 * j + 2 * r], acc_dv[4 * j + 2 * r + 1]));
        }
    }
    fc_pipe::named_sync(bar, 128);                                 // the warpgroup's rows staged
    constexpr int kChunks = kCols / 8;                             // 16-byte chunks a row
    const int rows = min(64, seq.sk - key0);                       // its keys in range
    for (int i = wt; i < rows * kChunks; i += 128) {
        const int row = i / kChunks, c = i % kChunks;
        const fc_u32 off = (fc_u32)(c >> 3) * kBlockBytes + (fc_u32)row * 128u
                           + (fc_u32)(((c & 7) ^ (row & 7)) << 4);
        fc_u32 x[4], y[4];
        lds128(x, sKw + off);
        lds128(y, sVw + off);
        *reinterpret_cast<uint4*>(gdk + (long long)row * p.dk_row_stride + 8 * c) =
            make_uint4(x[0], x[1], x[2], x[3]);
        *reinterpret_cast<uint4*>(gdv + (long long)row * p.dv_row_stride + 8 * c) =
            make_uint4(y[0], y[1], y[2], y[3]);
    }
    return true;
}

// One consumer warpgroup's share of the key block (keys [64 wg, 64 wg + 64) of the CTA's 128;
// ct: the thread's index among the 256 consumer threads): dK and dV in fp32 registers, and the
// two halves of a step over one query block (m0, head h).
// kSplitMask: the elementwise step in two copies, with and without the mask (fc_mask_copies);
// false where a second copy's registers made ptxas spill (the cp.async kernel; the warp-
// specialised d64 kernel with dropout: 44-100 -> 116-176 bytes).
template <typename Elem, int kD, int kBlockM, bool Is_local, bool Is_dropout,
          bool kSplitMask = true>
struct DkdvWarpgroup {
    static constexpr int kAcc = kD / 2;          // dK, dV of 64 keys x kD per warpgroup
    static constexpr int kSAcc = kBlockM / 2;    // S^T, dP^T: 64 keys x kBlockM queries
    static constexpr fc_u32 kQBlock = (fc_u32)kBlockM * 128u;   // one [kBlockM rows][64 cols] block
    float acc_dk[kAcc], acc_dv[kAcc];
    float acc_s[kSAcc], acc_dp[kSAcc];                    // S^T, dP^T of a step
    fc_u32 pa[kBlockM / 16][4], dsa[kBlockM / 16][4];   // P^T, dS^T as A operands of dV, dK
    int wg, wl, g, t, key0;
    fc_u32 kw_off;                                        // the slice's rows inside K / V blocks

    __device__ __forceinline__ explicit DkdvWarpgroup(int ct) {
        const int lane = ct & 31, warp = ct >> 5;
        wg = warp >> 2;
        wl = warp & 3;
        g = lane >> 2;
        t = lane & 3;
        key0 = 64 * wg + 16 * wl + g;                     // + 8 r
        kw_off = warp_uniform((fc_u32)wg * 64u * 128u);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    }

    template <int N>
    __device__ __forceinline__ static void pin(float (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) fence_operand(x[i]);
    }
    __device__ __forceinline__ static void pin(fc_u32 (&a)[kBlockM / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) fence_operand(a[kk][e]);
    }

    // First half, in two parts. issue_sdp: S^T = K_w Q^T and dP^T = V_w dO^T issued into
    // acc_s, acc_dp (one commit group; the warp-specialised kernel issues a step's while the
    // previous step's dQ tile is staged). grads: once they are done, P^T and dS^T from the
    // query rows' lse and D (sLb, sDb: -lse in log2 units and D of rows m0 ..), dS^T stored to
    // sdSb ([key][query], 16-bit, swizzled), and dV_w += P^T dO, dK_w += dS^T Q issued (not
    // waited). The caller fences the dS^T stores for the async proxy and synchronises the
    // consumers before the second half.
    __device__ __forceinline__ void issue_sdp(fc_u32 sK, fc_u32 sV, fc_u32 sQb, fc_u32 sdOb) {
#pragma unroll
        for (int i = 0; i < kSAcc; ++i) acc_s[i] = acc_dp[i] = 0.f;   // (the last step's are dead)
        pin(acc_s);
        pin(acc_dp);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
            const fc_u32 ko = (fc_u32)(kk >> 2) * kKBlock + (fc_u32)(kk & 3) * 32u;
            const fc_u32 qo = (fc_u32)(kk >> 2) * kQBlock + (fc_u32)(kk & 3) * 32u;
            Wgmma<Elem>::ss(acc_s, wgmma_desc_k(sK + kw_off, ko), wgmma_desc_k(sQb, qo),
                            kk > 0 ? 1 : 0);
            Wgmma<Elem>::ss(acc_dp, wgmma_desc_k(sV + kw_off, ko), wgmma_desc_k(sdOb, qo),
                            kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        pin(acc_s);
        pin(acc_dp);
    }

    // P^T, dS^T from S^T, dP^T (acc_s, acc_dp, done) into pa, dsa. Element e of n8 tile j: key
    // key0 + 8 (e >> 1), query 8 j + 2 t + (e & 1). 16-bit A operands (k = queries): k-step kk
    // takes n8 tiles 2kk and 2kk+1, packed as soon as they are computed (fewer fp32 values live
    // at once). Dropout: the keep masks of two 16 x 16 tiles (queries 16 kk.., keys key0 - g..)
    // at a time, one Philox call per lane shared with lane ^ 4 (BwdScoreMath::keep2_st).
    // masked: the copy with the mask's compares or the one without (fc_mask_copies).
    __device__ __forceinline__ void p_ds(const BwdScoreMath& sm, int m0, int n0, const float* sLb,
                                         const float* sDb, bool masked) {
        unsigned int keep2[2] = {0u, 0u};   // tiles kk (even) and kk + 1: one call per lane
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            if constexpr (Is_dropout) {
                if ((kk & 1) == 0)
                    sm.keep2_st(m0 + 16 * kk, n0 + key0 - g,
                                m0 + 16 * (kk + 1 < kBlockM / 16 ? kk + 1 : kk), n0 + key0 - g,
                                g, t, keep2[0], keep2[1]);
            }
            const unsigned int keep = keep2[kk & 1];
#pragma unroll
            for (int j = 2 * kk; j < 2 * kk + 2; ++j) {
                const int qc = 8 * j + 2 * t;
                const float2 nl = *reinterpret_cast<const float2*>(sLb + qc);
                const float2 dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sm.template apply<false, false, Is_local, Is_dropout>(
                        acc_s[4 * j + e], acc_dp[4 * j + e], m0 + qc + (e & 1),
                        n0 + key0 + 8 * (e >> 1), (e & 1) ? nl.y : nl.x, (e & 1) ? dd.y : dd.x,
                        masked,
                        Is_dropout ? sm.keep_factor(keep, 4 * (j & 1) + e) : 1.f);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pa[kk][e] = Elem::pack2(acc_s[8 * kk + 2 * e], acc_s[8 * kk + 2 * e + 1]);
                dsa[kk][e] = Elem::pack2(acc_dp[8 * kk + 2 * e], acc_dp[8 * kk + 2 * e + 1]);
            }
        }
    }

    __device__ __forceinline__ void grads(const FlashParams& p, const BwdSeq& seq, int b, int h,
                                          int m0, int n0, int off, fc_u32 sQb, fc_u32 sdOb,
                                          const float* sLb, const float* sDb, fc_u32 sdSb) {
        constexpr int kBlockN = 128;
        const BwdScoreMath sm = bwd_score_math(p, b, h, seq, false);
        const bool need_mask = bwd_need_mask<Is_local, kBlockM, kBlockN>(p, seq, m0, n0, off);

        wgmma_wait<0>();
        pin(acc_s);
        pin(acc_dp);
        fc_mask_copies<kSplitMask>(need_mask, [&](const bool masked) {
            p_ds(sm, m0, n0, sLb, sDb, masked);
        });

        // dS^T to shared memory, before the MMAs that read dsa are issued (an in-flight
        // wgmma's A registers may not be accessed)
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int key = key0 + 8 * r, q = 8 * j + 2 * t;
                sts32(sdSb + (fc_u32)(q >> 6) * kKBlock + 2u * (fc_u32)swz<64>(key, q & 63),
                               dsa[j >> 1][(j & 1) * 2 + r]);
            }

        // dV_w += P^T dO, dK_w += dS^T Q: B read N-major (d blocks kQBlock apart)
        pin(acc_dv);
        pin(acc_dk);
        pin(pa);
        pin(dsa);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            const fc_u32 ro = (fc_u32)kk * 16u * 128u;   // queries 16 kk ..
            Wgmma<Elem>::rs_tb(acc_dv, pa[kk], wgmma_desc_mn(sdOb, ro, kQBlock), 1);
            Wgmma<Elem>::rs_tb(acc_dk, dsa[kk], wgmma_desc_mn(sQb, ro, kQBlock), 1);
        }
        wgmma_commit();
    }

    // Second half, once the whole dS^T tile is in sdSb: dQ = dS K (A = dS^T read M-major,
    // B = K read N-major) into acc_dq. d128: columns [64 wg, 64 wg + 64) over all keys; d64
    // with 64-query blocks: all columns over the warpgroup's keys (both warpgroups add); d64
    // with 128-query blocks: queries [64 wg, 64 wg + 64) over all keys. Waits for every product
    // of the step (after it, this warpgroup reads none of the step's tiles).
    __device__ __forceinline__ void dq_product(fc_u32 sK, fc_u32 sdSb, float (&acc_dq)[32]) {
        constexpr int kBlockN = 128;
        constexpr bool kSplitKeys = kD == 64 && kBlockM == 64;
        constexpr int kDqSteps = kSplitKeys ? 64 / 16 : kBlockN / 16;
        const int kk0 = kSplitKeys ? 4 * wg : 0;
        const fc_u32 kcol = kD == 128 ? warp_uniform((fc_u32)wg * kKBlock) : 0u;
        const fc_u32 qblk = kBlockM == 128 ? warp_uniform((fc_u32)wg * kKBlock) : 0u;
        const fc_u32 k0o = kSplitKeys ? warp_uniform((fc_u32)kk0 * 16u * 128u) : 0u;
#pragma unroll
        for (int i = 0; i < 32; ++i) acc_dq[i] = 0.f;
        pin(acc_dq);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kDqSteps; ++kk) {
            const fc_u32 ro = (fc_u32)kk * 16u * 128u;   // keys 16 (kk0 + kk) ..
            Wgmma<Elem>::ss_tt(acc_dq, wgmma_desc_mn(sdSb + qblk + k0o, ro, kKBlock),
                               wgmma_desc_mn(sK + kcol + k0o, ro, kKBlock), kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();          // dV, dK and dQ products done
        pin(acc_dq);
        pin(acc_dv);
        pin(acc_dk);
        pin(pa);
        pin(dsa);
    }

    // Epilogue: dK * softmax_scale and dV as 16-bit, from the registers (dkdv_store_regs).
    __device__ __forceinline__ void store(const FlashParams& p, const BwdSeq& seq, int b, int hk,
                                          int n0) const {
        dkdv_store_regs<Elem, kD>(p, seq, b, hk, n0 + 64 * wg, 0, acc_dk, acc_dv,
                                  32 * wl + 4 * g + t);
    }

    // The same through shared memory (dkdv_store_staged): this warpgroup's 64 rows of the K and
    // V tiles, once no consumer reads K or V again (the caller synchronises both warpgroups).
    __device__ __forceinline__ void store_staged(const FlashParams& p, const BwdSeq& seq, int b,
                                                 int hk, int n0, fc_u32 sK, fc_u32 sV) const {
        if (!dkdv_store_staged<Elem, kD, kKBlock>(p, seq, b, hk, n0 + 64 * wg, 0, acc_dk, acc_dv,
                                                  sK + (fc_u32)wg * 64u * 128u,
                                                  sV + (fc_u32)wg * 64u * 128u,
                                                  32 * wl + 4 * g + t, 3 + wg))
            store(p, seq, b, hk, n0);
    }
};

}  // namespace fc_hb

// ---- dQ in tile order ------------------------------------------------------------------
// Each step's dQ of a warpgroup (64 query rows x kN / 2 columns, kN floats a thread in the
// wgmma accumulator layout) is added to the accumulator by ONE bulk reduce-add of the whole
// tile, as FlashAttention-3 does, in place of kN / 2 red.global.add a thread: the fp32
// accumulator holds whole 64-row tiles (a dense call's rows padded to a multiple of 64, a varlen
// call's sequences each starting a tile: BwdSeq::q_tile_off; zeroed by
// flash_bwd_preprocess_kernel<.., true>), each in the threads' own order --
// [column group w][float4 k][thread ct][4] -- which flash_bwd_convert_dq_tiled_kernel reads
// back. Float4 k of thread ct = (wl, g, t) holds rows 16 wl + g (its first two floats) and
// 16 wl + g + 8 (last two), columns w kN / 2 + 8 k + 2 t and + 1 (one column group, w = 0,
// where a warpgroup holds all the tile's columns: head dim 64).

// dq_tile_store stores the fragment to `region` in that order (float4 k of thread c at
// (128 k + c) x 16 bytes: a warp's store is 512 contiguous bytes, free of bank conflicts);
// dq_tile_commit, once the warpgroup's stores are done (named barrier `bar`), has its first
// thread add the region to `gtile` with one bulk reduce-add (none when `add` is false: a tile
// wholly past the last query row, which the accumulator does not hold) and commit it;
// dq_tile_add does both. `ct`: the thread's index among the consumers. The caller frees
// `region`: that thread waits for the group's read (bulk_wait_read) before anything writes it
// again.
template <int kN>
__device__ __forceinline__ void dq_tile_store(const float (&acc)[kN], fc_u32 region, int ct) {
    const int c = ct & 127;
#pragma unroll
    for (int k = 0; k < kN / 4; ++k)
        fc_sm90::sts128f(region + (fc_u32)(128 * k + c) * 16u, acc[4 * k], acc[4 * k + 1],
                         acc[4 * k + 2], acc[4 * k + 3]);
}

template <int kN>
__device__ __forceinline__ void dq_tile_commit(fc_u32 region, float* gtile, int ct, int bar,
                                               bool add) {
    using namespace fc_pipe;
    fence_proxy_async();          // the stores, for the bulk copy's async-proxy read
    named_sync(bar, 128);
    if ((ct & 127) == 0) {
#if defined(FC_DIAG_BWD_HALF_DQ) && defined(FC_DIAG_BWD_NO_DQ)
#error "FC_DIAG_BWD_HALF_DQ and FC_DIAG_BWD_NO_DQ: one at a time"
#endif
#if defined(FC_DIAG_BWD_HALF_DQ)  // (timing only: half of each tile added, wrong results)
        if (add) bulk_reduce_add_f32(gtile, region, (fc_u32)kN * 64u * 4u);
#elif !defined(FC_DIAG_BWD_NO_DQ) // (timing only: dQ computed, never added, wrong results)
        if (add) bulk_reduce_add_f32(gtile, region, (fc_u32)kN * 128u * 4u);
#endif
        bulk_commit();
    }
}

template <int kN>
__device__ __forceinline__ void dq_tile_add(const float (&acc)[kN], fc_u32 region, float* gtile,
                                            int ct, int bar, bool add = true) {
    dq_tile_store<kN>(acc, region, ct);
    dq_tile_commit<kN>(region, gtile, ct, bar, add);
}

// dq = dq_accum * softmax_scale -> 16-bit from the tile order above (head dim
// kD split into kGroups column groups, one per warpgroup: 2 where two warpgroups share a
// tile's rows, 1 where one warpgroup holds all its columns). Grid (ceil(seqlen_q / 64), nheads,
// batch), 256 threads, one 64-row tile a CTA. The tile is read in its order (each warp 512
// contiguous bytes a load), converted and staged row-major in shared memory (rows padded by 16
// bytes: the staging stores of a warp, 8 rows x 4 pairs, fall in 32 distinct banks), then
// written out a row at a time, 16 bytes a thread where dq's base and row stride allow it (whole
// 32-byte sectors), else 4. Writing the tile order's pairs straight to dq (8 rows x 16 bytes a
// warp store) ran at half the bandwidth (session 28: 107-149 us against cuDNN's 55-59 for the
// same 16k-token conversion).
template <typename Elem, int kD, int kGroups>
__global__ void __launch_bounds__(256) flash_bwd_convert_dq_tiled_kernel(const FlashParams p) {
    constexpr int kRows = 64, kChunks = kD / (8 * kGroups);  // float4s a thread of a group
    constexpr int kPitch = kD + 8;                            // staged row, 16-bit elements
    __shared__ __align__(16) fc_u16 stage[kRows * kPitch];
    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq = bwd_seq(p, b);
    const int m0 = blockIdx.x * kRows;
    if (m0 >= seq.sq) return;
    const float* tile = dq_accum_row(p, seq, b, h, m0);
    const float scale = p.softmax_scale;
    constexpr int kIters = kGroups * kChunks * 128 / 256;    // float4s a thread
    static_assert(kIters * 256 == kGroups * kChunks * 128, "whole float4s a thread");
    float4 v[kIters];                                         // every load in flight first
#pragma unroll
    for (int it = 0; it < kIters; ++it)
        v[it] = *reinterpret_cast<const float4*>(tile + 4 * (threadIdx.x + 256 * it));
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int idx = threadIdx.x + 256 * it;
        const int w = idx / (kChunks * 128), k = (idx >> 7) % kChunks, ct = idx & 127;
        const int row = 16 * (ct >> 5) + ((ct >> 2) & 7);
        const int col = w * (kD / kGroups) + 8 * k + 2 * (ct & 3);
        *reinterpret_cast<fc_u32*>(stage + row * kPitch + col) =
            Elem::pack2(v[it].x * scale, v[it].y * scale);
        *reinterpret_cast<fc_u32*>(stage + (row + 8) * kPitch + col) =
            Elem::pack2(v[it].z * scale, v[it].w * scale);
    }
    __syncthreads();
    fc_u16* gdq = static_cast<fc_u16*>(p.dq) + b * p.dq_batch_stride
                  + (seq.q_off + m0) * p.dq_row_stride + h * p.dq_head_stride;
    const int rows = min(kRows, seq.sq - m0);
    const bool wide =
        ((reinterpret_cast<unsigned long long>(gdq) | (p.dq_row_stride * 2)) & 15) == 0;
    if (wide) {
        constexpr int kVecs = kD / 8;
        for (int i = threadIdx.x; i < rows * kVecs; i += 256) {
            const int r = i / kVecs, c = 8 * (i % kVecs);
            *reinterpret_cast<uint4*>(gdq + r * p.dq_row_stride + c) =
                *reinterpret_cast<const uint4*>(stage + r * kPitch + c);
        }
    } else {
        constexpr int kPairs = kD / 2;
        for (int i = threadIdx.x; i < rows * kPairs; i += 256) {
            const int r = i / kPairs, c = 2 * (i % kPairs);
            *reinterpret_cast<fc_u32*>(gdq + r * p.dq_row_stride + c) =
                *reinterpret_cast<const fc_u32*>(stage + r * kPitch + c);
        }
    }
}

template <typename Elem, int kD, int kBlockM, bool Is_local, bool Is_dropout>
__global__ void __launch_bounds__(256, 1) flash_bwd_dkdv_sm90_kernel(const FlashParams p) {
    using namespace fc_hb;
    static_assert(kD == 64 || kD == 128, "the Hopper dK/dV kernel covers head dims 64 and 128");
    static_assert(kBlockM == 64 || (kBlockM == 128 && kD == 64), "query blocks: 64, or 128 at d64");
    constexpr fc_u32 kKT = kKTile<kD>, kQT = kQTile<kD, kBlockM>;
    extern __shared__ unsigned char smem_raw[];
    const fc_u32 sK = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const fc_u32 sV = sK + kKT;
    const fc_u32 sQ = sV + kKT;                  // 2 stages
    const fc_u32 sdO = sQ + 2u * kQT;            // 2 stages
    const fc_u32 sdS = sdO + 2u * kQT;           // [kBlockM / 64][128 keys][64 queries]
    float* sLse = reinterpret_cast<float*>(smem_raw + (sdS + (fc_u32)(kBlockM / 64) * kKBlock
                                                       - smem_u32(smem_raw)));
    float* sDsum = sLse + 2 * kBlockM;
    // each warpgroup's dQ staging tile (64 x 64 fp32) after lse and D
    const fc_u32 sDq = (sdS + (fc_u32)(kBlockM / 64) * kKBlock + 16u * kBlockM + 127u) & ~127u;

    const fc_pipe::FcTileXYZ blk_xyz = bwd_block_order<Is_local>();
    const int n_block = blk_xyz.x, hk = blk_xyz.y, b = blk_xyz.z;
    const int tid = threadIdx.x;
    const BwdSeq seq = bwd_seq(p, b);
    const int n0 = n_block * kBlockN;
    if (n0 >= seq.sk) return;
    const BwdKeyWalk kw = bwd_key_walk<Is_local, kBlockM, kBlockN>(p, seq, b, hk, n0);
    const int n_iter = kw.n_iter;
    const fc_u16* gq = kw.gq;
    const fc_u16* gdo = kw.gdo;

    if (n_iter > 0) {
        load_tile<kBlockN, kD>(sK, static_cast<const fc_u16*>(p.k) + b * p.k_batch_stride
                               + (seq.k_off + n0) * p.k_row_stride + hk * p.k_head_stride,
                           p.k_row_stride, kw.rows_k, tid);
        load_tile<kBlockN, kD>(sV, static_cast<const fc_u16*>(p.v) + b * p.v_batch_stride
                               + (seq.k_off + n0) * p.v_row_stride + hk * p.v_head_stride,
                           p.v_row_stride, kw.rows_k, tid);
        const int mm = kw.m_begin * kBlockM;
        load_tile<kBlockM, kD>(sQ, gq + static_cast<long long>(mm) * p.q_row_stride + kw.h0 * p.q_head_stride,
                           p.q_row_stride, seq.sq - mm, tid);
        load_tile<kBlockM, kD>(sdO, gdo + static_cast<long long>(mm) * p.do_row_stride + kw.h0 * p.do_head_stride,
                           p.do_row_stride, seq.sq - mm, tid);
        cp_async_commit();
        if (tid < kBlockM) bwd_row_stats(p, b, kw.h0, seq, mm + tid, sLse[tid], sDsum[tid]);
    }

    DkdvWarpgroup<Elem, kD, kBlockM, Is_local, Is_dropout, false> w(tid);
    int h = kw.h0, m_block = kw.m_begin;
    for (int it = 0; it < n_iter; ++it) {
        const fc_u32 buf = (fc_u32)(it & 1);
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();

        int h_next, m_next;
        bwd_walk_next(h, m_block, kw.m_begin, kw.m_end, h_next, m_next);
        const bool has_next = it + 1 < n_iter;
        float nl_next = 0.f, ds_next = 0.f;
        if (has_next) {
            const int mm = m_next * kBlockM;
            load_tile<kBlockM, kD>(sQ + (buf ^ 1u) * kQT,
                               gq + static_cast<long long>(mm) * p.q_row_stride + h_next * p.q_head_stride,
                               p.q_row_stride, seq.sq - mm, tid);
            load_tile<kBlockM, kD>(sdO + (buf ^ 1u) * kQT,
                               gdo + static_cast<long long>(mm) * p.do_row_stride + h_next * p.do_head_stride,
                               p.do_row_stride, seq.sq - mm, tid);
            cp_async_commit();
            if (tid < kBlockM) bwd_row_stats(p, b, h_next, seq, mm + tid, nl_next, ds_next);
        }

        const int m0 = m_block * kBlockM;
        w.issue_sdp(sK, sV, sQ + buf * kQT, sdO + buf * kQT);
        w.grads(p, seq, b, h, m0, n0, kw.off, sQ + buf * kQT, sdO + buf * kQT,
                sLse + buf * kBlockM, sDsum + buf * kBlockM, sdS);
        fence_proxy_async();      // the dS^T stores, for the dQ product's async-proxy reads
        // (the staging tiles, read by the previous step's bulk copies)
        if (it > 0 && (threadIdx.x & 127) == 0) fc_pipe::bulk_wait_read<0>();
        __syncthreads();          // the whole dS^T tile is written (and the staging tiles free)
        // A warpgroup's dQ tile: d128, columns 64 wg.. of the block's rows; d64 with
        // 128-query blocks, all columns of its own 64 rows; d64 with 64-query blocks, both
        // warpgroups' partial products of the same tile (both added).
        float acc_dq[32];
        w.dq_product(sK, sdS, acc_dq);
        // (d64 with 128-query blocks: the second warpgroup's rows may all lie past the
        // last query, where the accumulator, padded to 64 rows, has no tile)
        const int row0 = m0 + (kBlockM == 128 ? 64 * w.wg : 0);
        dq_tile_add<32>(acc_dq, sDq + (fc_u32)w.wg * (64u * 64u * 4u),
                        dq_accum_row(p, seq, b, h, row0) + (kD == 128 ? w.wg * 64 * 64 : 0),
                        tid, 1 + w.wg, row0 < seq.sq);

        __syncthreads();          // dS^T, this stage's Q / dO and lse / D are free
        if (has_next && tid < kBlockM) {
            sLse[(buf ^ 1u) * kBlockM + tid] = nl_next;
            sDsum[(buf ^ 1u) * kBlockM + tid] = ds_next;
        }
        h = h_next;
        m_block = m_next;
    }
    w.store(p, seq, b, hk, n0);
    // (shared memory stays until the last bulk copy has read it)
    if ((threadIdx.x & 127) == 0) fc_pipe::bulk_wait<0>();
}

// The tensor maps of the warp-specialised dK/dV kernel (flashcore/kernels/tma.py): k, v with
// boxes of 64 x 128 (the key block), q and dout with boxes of 64 x kBlockM.
struct alignas(64) FcBwdMaps {
    FcTensorMap q, k, v, dout;
};

// The producer of the warp-specialised dK/dV kernels, run by warp 0 (lane 0 issues the copies;
// every lane writes lse and D): K and V of the key block once (boxes of 64 columns x kBlockN
// keys, [kD / 64][kBlockN][64] in shared memory), then per step of the walk Q and dO of the
// query block (boxes of 64 x kBlockM) into stage `it % kStages` of the ring, and the rows'
// lse and D beside them. Barriers at `bars`: the K/V barrier, kStages full, kStages empty.
// Is_varlen: the maps see each packed array as one sequence of total rows (batch 1), so a
// sequence's rows start at its offset; rows past its end are another sequence's (or no
// sequence's), which the consumers zero before reading (zero_rows_past).
template <int kD, int kBlockM, int kBlockN, int kStages, bool Is_varlen = false>
__device__ __forceinline__ void bwd_produce(const FlashParams& p, const BwdSeq& seq,
                                            const FcBwdMaps& maps, const BwdKeyWalk& kw, int b,
                                            int hk, int n0, int lane, fc_u32 sK, fc_u32 sV,
                                            fc_u32 sQ, fc_u32 sdO, float* sLse, float* sDsum,
                                            fc_u32 bars) {
    using namespace fc_pipe;
    const BwdBars<kStages> bar{bars};
    constexpr fc_u32 kKBlk = (fc_u32)kBlockN * 128u;   // one [kBlockN rows][64 cols] block
    constexpr fc_u32 kQBlk = (fc_u32)kBlockM * 128u;
    constexpr fc_u32 kKT = (fc_u32)(kD / 64) * kKBlk, kQT = (fc_u32)(kD / 64) * kQBlk;
    if (lane == 0) {
        mbar_expect_tx(bar.kv(), 2u * kKT);
        const int k_row = (Is_varlen ? (int)seq.k_off : 0) + n0;
#pragma unroll
        for (int c = 0; c < kD / 64; ++c) {
            tma_load_4d(sK + (fc_u32)c * kKBlk, maps.k, bar.kv(), 64 * c, k_row, hk,
                        Is_varlen ? 0 : b);
            tma_load_4d(sV + (fc_u32)c * kKBlk, maps.v, bar.kv(), 64 * c, k_row, hk,
                        Is_varlen ? 0 : b);
        }
    }
    int h = kw.h0, m_block = kw.m_begin;
    for (int it = 0; it < kw.n_iter; ++it) {
        const int st = it % kStages;
        const fc_u32 ph = (fc_u32)(it / kStages) & 1u;
        const int mm = m_block * kBlockM;
        FC_TL_STAMP(0, 0, it, 0);
        if (it >= kStages) mbar_wait(bar.empty(st), ph ^ 1u);
        FC_TL_STAMP(0, 0, it, 1);
#ifdef FC_DIAG_BWD_NO_QLOAD    // (timing only: Q and dO loaded for the first stages alone, wrong results)
        const bool load = it < kStages;
#else
        constexpr bool load = true;
#endif
        if (lane == 0) {
            // (varlen: the sequence's rows from its offset, batch 0 of the maps)
            const int q_row = (Is_varlen ? (int)seq.q_off : 0) + mm, mb = Is_varlen ? 0 : b;
            mbar_expect_tx(bar.full(st), load ? 2u * kQT : 0u);
#pragma unroll
            for (int c = 0; c < kD / 64 && load; ++c) {
                tma_load_4d(sQ + (fc_u32)st * kQT + (fc_u32)c * kQBlk, maps.q, bar.full(st),
                            64 * c, q_row, h, mb);
                tma_load_4d(sdO + (fc_u32)st * kQT + (fc_u32)c * kQBlk, maps.dout, bar.full(st),
                            64 * c, q_row, h, mb);
            }
        }
        for (int r = lane; r < kBlockM; r += 32)
            bwd_row_stats(p, b, h, seq, mm + r, sLse[st * kBlockM + r], sDsum[st * kBlockM + r]);
        mbar_arrive(bar.full(st));            // (release: the stores above are seen)
        FC_TL_STAMP(0, 0, it, 2);
        bwd_walk_next(h, m_block, kw.m_begin, kw.m_end, h, m_block);
    }
}

// The start of a warp-specialised dK/dV kernel once its walk is known: thread 0 prefetches the
// tensor maps and initialises the barriers at `bars` (the K/V barrier, kStages full, kStages
// empty), then warpgroup 0 gives its registers back and its warp 0 runs the producer. Returns
// true in the two consumer warpgroups (their registers raised), false in the producer's.
template <int kD, int kBlockM, int kBlockN, int kStages, bool Is_varlen = false>
__device__ __forceinline__ bool bwd_ws_start(const FlashParams& p, const BwdSeq& seq,
                                             const FcBwdMaps& maps, const BwdKeyWalk& kw, int b,
                                             int hk, int n0, fc_u32 sK, fc_u32 sV, fc_u32 sQ,
                                             fc_u32 sdO, float* sLse, float* sDsum, fc_u32 bars) {
    using namespace fc_pipe;
    const int tid = threadIdx.x;
    if (tid == 0) {
        tma_prefetch_map(maps.q);
        tma_prefetch_map(maps.k);
        tma_prefetch_map(maps.v);
        tma_prefetch_map(maps.dout);
        const BwdBars<kStages> bar{bars};
        mbar_init(bar.kv(), 1);
        for (int st = 0; st < kStages; ++st) {
            mbar_init(bar.full(st), 1 + 32);   // the TMA's expect_tx + the warp's lse / D stores
            mbar_init(bar.empty(st), 256);
        }
        fence_barrier_init();
    }
    __syncthreads();
    if (tid < 128) {
        setmaxnreg_dec<24>();
        if (tid < 32)
            bwd_produce<kD, kBlockM, kBlockN, kStages, Is_varlen>(p, seq, maps, kw, b, hk, n0,
                                                                  tid & 31, sK, sV, sQ, sdO,
                                                                  sLse, sDsum, bars);
        return false;
    }
    setmaxnreg_inc<240>();
    return true;
}

// Varlen, warp-specialised: when a block ends past its sequence (valid < kRows), rows
// [valid, kRows) of the two [kD / 64][kRows][64] tiles that TMA filled from the packed arrays
// (K and V, or Q and dO) are zeroed by the 256 consumer threads (ct; fc_pipe::zero_tile_rows),
// fenced for the async proxy, and the consumers meet at named barrier 1 before any product
// reads the tiles (CTA-uniform): the products would mix those rows into the valid ones
// (0 * NaN).
template <int kD, int kRows>
__device__ __forceinline__ void zero_rows_past(fc_u32 tile_a, fc_u32 tile_b, int valid, int ct) {
    if (valid >= kRows) return;
    fc_pipe::zero_tile_rows<kD / 64, kRows>(tile_a, valid, ct, 256);
    fc_pipe::zero_tile_rows<kD / 64, kRows>(tile_b, valid, ct, 256);
    fence_proxy_async();
    fc_pipe::named_sync(1, 256);
}

// Warp-specialised dK/dV kernel (see the top of the file): 384 threads, warpgroup 0 produces,
// 1 and 2 consume. Dense calls, or (Is_varlen) varlen calls: the maps over the packed arrays,
// rows past a sequence's end zeroed in shared memory (zero_rows_past).
template <typename Elem, int kD, int kBlockM, bool Is_local, bool Is_dropout,
          bool Is_varlen = false>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dkdv_sm90_ws_kernel(const FlashParams p, const __grid_constant__ FcBwdMaps maps) {
    using namespace fc_hb;
    using namespace fc_pipe;
    static_assert(kD == 64 || kD == 128, "the Hopper dK/dV kernel covers head dims 64 and 128");
    static_assert(kBlockM == 64 || (kBlockM == 128 && kD == 64), "query blocks: 64, or 128 at d64");
    using Consumer = DkdvWarpgroup<Elem, kD, kBlockM, Is_local, Is_dropout,
                                   !(kD == 64 && Is_dropout)>;
    constexpr int kStages = 2;
    constexpr fc_u32 kKT = kKTile<kD>, kQT = kQTile<kD, kBlockM>;
    constexpr fc_u32 kQBlock = (fc_u32)kBlockM * 128u;
    constexpr fc_u32 kSdS = (fc_u32)(kBlockM / 64) * kKBlock;   // one dS^T buffer
    extern __shared__ unsigned char smem_raw[];
    const fc_u32 base = smem_u32(smem_raw);
    const fc_u32 sK = (base + 1023u) & ~1023u;
    const fc_u32 sV = sK + kKT;
    const fc_u32 sQ = sV + kKT;                        // kStages
    const fc_u32 sdO = sQ + kStages * kQT;             // kStages
    const fc_u32 sdS = sdO + kStages * kQT;            // 2 buffers
    const fc_u32 sStats = sdS + 2u * kSdS;             // lse, D: kStages x 2 x kBlockM floats
    float* sLse = reinterpret_cast<float*>(smem_raw + (sStats - base));
    float* sDsum = sLse + kStages * kBlockM;
    const fc_u32 bars = sStats + (fc_u32)(2 * kStages * kBlockM) * 4u;
    // each consumer warpgroup's dQ staging tile (64 x 64 fp32), after the 5 barriers
    const fc_u32 sDq = (bars + BwdBars<kStages>::kBytes + 127u) & ~127u;
    const BwdBars<kStages> bar{bars};

    const fc_pipe::FcTileXYZ blk_xyz = bwd_block_order<Is_local>();
    const int n_block = blk_xyz.x, hk = blk_xyz.y, b = blk_xyz.z;
    const int tid = threadIdx.x;
    const int wg = tid >> 7;
    const BwdSeq seq = bwd_seq(p, b);
    const int n0 = n_block * kBlockN;
    if (n0 >= seq.sk) return;
    const BwdKeyWalk kw = bwd_key_walk<Is_local, kBlockM, kBlockN>(p, seq, b, hk, n0);
    const int n_iter = kw.n_iter;
    if (n_iter == 0) {            // no query sees these keys: dK = dV = 0
        if (wg > 0) Consumer(tid - 128).store(p, seq, b, hk, n0);
        return;
    }

    if (!bwd_ws_start<kD, kBlockM, kBlockN, kStages, Is_varlen>(p, seq, maps, kw, b, hk, n0, sK,
                                                                sV, sQ, sdO, sLse, sDsum, bars))
        return;

    // ---- consumers -------------------------------------------------------------------------
    Consumer w(tid - 128);
    FC_TL_CTA_BEGIN(wg);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 0);
    FC_TL_VALUE(wg, 0, FC_TL_TILE_SLOT, 7, n_iter);
    mbar_wait(bar.kv(), 0);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 1);
    if constexpr (Is_varlen) zero_rows_past<kD, kBlockN>(sK, sV, seq.sk - n0, tid - 128);
    int h = kw.h0, m_block = kw.m_begin;
    static_assert((kD == 128 && kBlockM == 64) || (kD == 64 && kBlockM == 128),
                  "dQ tiles of 64 x 64 a warpgroup");
    // Step it's S^T and dP^T are issued as soon as its stage is full and the step before's dQ
    // tile is in its staging tile: that tile's bulk reduce-add is handed over while they run.
    float acc_dq[32];
    float* dq_tile = nullptr;     // the step before's dQ tile in dq_accum (nullptr: none)
    const fc_u32 sDqw = sDq + (fc_u32)w.wg * (64u * 64u * 4u);   // this warpgroup's staging
    auto stage_dq = [&](int it) {  // step it - 1's tile, once step it - 2's copy has read the
        if (it > 1) {              // staging tile
            if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();
            named_sync(3 + w.wg, 128);
        }
        dq_tile_store<32>(acc_dq, sDqw, tid - 128);
    };
    for (int it = 0; it < n_iter; ++it) {
        const int st = it % kStages;
        const fc_u32 sdSb = sdS + (fc_u32)(it & 1) * kSdS;
        const int m0 = m_block * kBlockM;
        FC_TL_STAMP(wg, 0, it, 0);
        mbar_wait(bar.full(st), (fc_u32)(it / kStages) & 1u);
        FC_TL_STAMP(wg, 0, it, 1);
        if constexpr (Is_varlen)   // (m0 < sq on the walk)
            zero_rows_past<kD, kBlockM>(sQ + (fc_u32)st * kQT, sdO + (fc_u32)st * kQT,
                                        seq.sq - m0, tid - 128);
        if (it > 0) stage_dq(it);
        FC_TL_STAMP(wg, 0, it, 2);
#ifdef FC_DIAG_BWD_NO_OVERLAP     // (timing only: the step before's tile handed over first)
        if (it > 0) dq_tile_commit<32>(sDqw, dq_tile, tid - 128, 3 + w.wg, dq_tile != nullptr);
#endif
        w.issue_sdp(sK, sV, sQ + (fc_u32)st * kQT, sdO + (fc_u32)st * kQT);
        FC_TL_STAMP(wg, 0, it, 3);
#ifndef FC_DIAG_BWD_NO_OVERLAP
        if (it > 0) dq_tile_commit<32>(sDqw, dq_tile, tid - 128, 3 + w.wg, dq_tile != nullptr);
#endif
        FC_TL_STAMP(wg, 0, it, 4);
        w.grads(p, seq, b, h, m0, n0, kw.off, sQ + (fc_u32)st * kQT, sdO + (fc_u32)st * kQT,
                sLse + st * kBlockM, sDsum + st * kBlockM, sdSb);
        FC_TL_STAMP(wg, 0, it, 5);
        fence_proxy_async();      // the dS^T stores, for the dQ product's async-proxy reads
        // The whole dS^T tile is written; and (dS^T double-buffered) every consumer is past the
        // previous step, whose dQ product read the buffer the next step writes.
        named_sync(1, 256);
        FC_TL_STAMP(wg, 0, it, 6);
        w.dq_product(sK, sdSb, acc_dq);
        FC_TL_STAMP(wg, 0, it, 7);
        mbar_arrive(bar.empty(st));   // this stage's Q, dO, lse and D are no longer read
        // d128: columns 64 wg.. of the block's 64 rows; d64 (128-query blocks): all columns of
        // rows 64 wg.., which may lie wholly past the last query (no tile there: nothing added)
        const int row0 = m0 + (kD == 64 ? 64 * w.wg : 0);
        dq_tile = row0 < seq.sq
            ? dq_accum_row(p, seq, b, h, row0) + (kD == 128 ? w.wg * 64 * 64 : 0) : nullptr;
        bwd_walk_next(h, m_block, kw.m_begin, kw.m_end, h, m_block);
    }
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 4);
    stage_dq(n_iter);
    dq_tile_commit<32>(sDqw, dq_tile, tid - 128, 3 + w.wg, dq_tile != nullptr);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 5);
#ifdef FC_DIAG_BWD_REG_STORE      // (timing: dK and dV stored from the registers, 4 bytes a thread)
    w.store(p, seq, b, hk, n0);
#else
    named_sync(1, 256);           // every consumer's last product done: K and V are free
    w.store_staged(p, seq, b, hk, n0, sK, sV);
#endif
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 6);
    FC_TL_CTA_END(wg);
    // (shared memory stays until the last bulk copy has read it)
    if ((threadIdx.x & 127) == 0) bulk_wait<0>();
}

// ---- head dim 256 --------------------------------------------------------------------------
// dK and dV of 128 keys x 256 columns would take 256 fp32 registers a thread in two
// warpgroups, so the d256 kernel takes 64 keys per CTA and splits every product between its
// two consumer warpgroups instead of giving each its own keys. Per step (query block m0 of 64
// rows, head h), warpgroup w (accumulator rows: keys 0..63 for all products but dQ):
//   S^T, dP^T for queries [32 w, 32 w + 32)    m64n32k16 over d (K, Q and V, dO K-major)
//   P^T, dS^T of those queries                 elementwise, in fp32 registers
//   P^T, dS^T -> shared (16-bit, [key][query], one 64 x 64 block each, double-buffered)
//   -- named barrier: both halves written --
//   dV[:, 128 w ..] += P^T dO[:, 128 w ..]     m64n128k16, A = P^T K-major, B = dO N-major
//   dK[:, 128 w ..] += dS^T Q[:, 128 w ..]     the same with dS^T and Q
//   dQ[:, 128 w ..]  = dS K[:, 128 w ..]       m64n128k16, A = dS^T M-major, B = K N-major;
//                                              rows: queries, staged in the step's Q (w = 0)
//                                              or dO (w = 1) tile and added to dq_accum as
//                                              one bulk copy
// A step's S^T and dP^T are issued once the step before's dQ tiles are staged and handed to
// their bulk copies, which run under them (the kernel's loop, below).
// Registers: dK, dV 64 + 64, dQ 64 (S^T, dP^T, 16 + 16, are dead by then). Shared memory:
// K, V 32 KiB each, Q and dO 2 stages x 32 KiB each, P^T and dS^T 2 x 8 KiB each: 224 KiB.
namespace fc_hb {

template <typename Elem, bool Is_local, bool Is_dropout>
struct Dkdv256Warpgroup {
    static constexpr int kD = 256, kBM = 64, kBN = 64;
    static constexpr fc_u32 kBlk = 64u * 128u;     // one [64 rows][64 cols] block
    float acc_dk[64], acc_dv[64];                  // keys 16 wl + g + 8 r, columns 128 wg + ..
    float acc_s[16], acc_dp[16];                   // S^T, dP^T of a step (issue_scores)
    int wg, wl, g, t, key0;

    __device__ __forceinline__ explicit Dkdv256Warpgroup(int ct) {
        const int lane = ct & 31, warp = ct >> 5;
        wg = warp >> 2;
        wl = warp & 3;
        g = lane >> 2;
        t = lane & 3;
        key0 = 16 * wl + g;                        // + 8 r
#pragma unroll
        for (int i = 0; i < 64; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    }

    template <int N>
    __device__ __forceinline__ static void pin(float (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) fence_operand(x[i]);
    }

    // issue_scores: S^T, dP^T of this warpgroup's 32 queries issued into acc_s, acc_dp (one
    // commit group, not waited: they run under the step before's dQ copies, handed over just
    // before). finish_scores: once they are done, P^T and dS^T from them, both
    // stored to sPb and sdSb. The caller fences the stores for the async proxy and synchronises
    // the consumers.
    __device__ __forceinline__ void issue_scores(fc_u32 sK, fc_u32 sV, fc_u32 sQb, fc_u32 sdOb) {
        const fc_u32 q0o = warp_uniform((fc_u32)(32 * wg) * 128u);   // this warpgroup's queries
#pragma unroll
        for (int i = 0; i < 16; ++i) acc_s[i] = acc_dp[i] = 0.f;
        pin(acc_s);
        pin(acc_dp);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
            const fc_u32 ko = (fc_u32)(kk >> 2) * kBlk + (fc_u32)(kk & 3) * 32u;
            Wgmma<Elem>::ss(acc_s, wgmma_desc_k(sK, ko), wgmma_desc_k(sQb + q0o, ko),
                            kk > 0 ? 1 : 0);
            Wgmma<Elem>::ss(acc_dp, wgmma_desc_k(sV, ko), wgmma_desc_k(sdOb + q0o, ko),
                            kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        pin(acc_s);
        pin(acc_dp);
    }

    __device__ __forceinline__ void finish_scores(const FlashParams& p, const BwdSeq& seq, int b,
                                                  int h, int m0, int n0, int off,
                                                  const float* sLb, const float* sDb, fc_u32 sPb,
                                                  fc_u32 sdSb) {
        const BwdScoreMath sm = bwd_score_math(p, b, h, seq, false);
        const bool need_mask = bwd_need_mask<Is_local, kBM, kBN>(p, seq, m0, n0, off);
        wgmma_wait<0>();
        pin(acc_s);
        pin(acc_dp);
        fc_mask_copies(need_mask, [&](const bool masked) {
            p_ds(sm, m0, n0, sLb, sDb, sPb, sdSb, masked);
        });
    }

    // P^T, dS^T from S^T, dP^T (done), stored to sPb, sdSb. Element e of n8 tile j: key key0 +
    // 8 (e >> 1), query q0 + 8 j + 2 t + (e & 1). Dropout: the keep masks of the two 16 x 16
    // tiles (queries q0 .., q0 + 16 ..; keys 16 wl ..), one Philox call per lane
    // (BwdScoreMath::keep2_st). masked: with or without the mask's compares
    // (fc_mask_copies).
    __device__ __forceinline__ void p_ds(const BwdScoreMath& sm, int m0, int n0, const float* sLb,
                                         const float* sDb, fc_u32 sPb, fc_u32 sdSb, bool masked) {
        const int q0 = 32 * wg;
        unsigned int keep2[2] = {0u, 0u};
        if constexpr (Is_dropout)
            sm.keep2_st(m0 + q0, n0 + key0 - g, m0 + q0 + 16, n0 + key0 - g, g, t, keep2[0],
                        keep2[1]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int qc = q0 + 8 * j + 2 * t;
            const float2 nl = *reinterpret_cast<const float2*>(sLb + qc);
            const float2 dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                sm.template apply<false, false, Is_local, Is_dropout>(
                    acc_s[4 * j + e], acc_dp[4 * j + e], m0 + qc + (e & 1),
                    n0 + key0 + 8 * (e >> 1), (e & 1) ? nl.y : nl.x, (e & 1) ? dd.y : dd.x,
                    masked,
                    Is_dropout ? sm.keep_factor(keep2[j >> 1], 4 * (j & 1) + e) : 1.f);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const fc_u32 o = 2u * (fc_u32)swz<64>(key0 + 8 * r, qc);
                sts32(sPb + o, Elem::pack2(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
                sts32(sdSb + o, Elem::pack2(acc_dp[4 * j + 2 * r], acc_dp[4 * j + 2 * r + 1]));
            }
        }
    }

    // Once both warpgroups' P^T and dS^T are in shared memory: dV and dK of this warpgroup's
    // columns (issued), dQ of its columns over the 64 keys into acc_dq (rows: queries 16 wl + g
    // + 8 r, columns 8 j + 2 t of this warpgroup's 128), all waited for. After it this
    // warpgroup reads none of the step's tiles.
    __device__ __forceinline__ void grads_product(fc_u32 sK, fc_u32 sQb, fc_u32 sdOb, fc_u32 sPb,
                                                  fc_u32 sdSb, float (&acc_dq)[64]) {
        const fc_u32 col = warp_uniform((fc_u32)(2 * wg) * kBlk);   // its first d block
#pragma unroll
        for (int i = 0; i < 64; ++i) acc_dq[i] = 0.f;
        pin(acc_dv);
        pin(acc_dk);
        pin(acc_dq);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) {     // over queries
            const fc_u32 ro = (fc_u32)kk * 16u * 128u;
            Wgmma<Elem>::template ss_n128<0, 1>(acc_dv, wgmma_desc_k(sPb, (fc_u32)kk * 32u),
                                                wgmma_desc_mn(sdOb + col, ro, kBlk), 1);
            Wgmma<Elem>::template ss_n128<0, 1>(acc_dk, wgmma_desc_k(sdSb, (fc_u32)kk * 32u),
                                                wgmma_desc_mn(sQb + col, ro, kBlk), 1);
        }
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {     // over keys
            const fc_u32 ro = (fc_u32)kk * 16u * 128u;
            Wgmma<Elem>::template ss_n128<1, 1>(acc_dq, wgmma_desc_mn(sdSb, ro, kBlk),
                                                wgmma_desc_mn(sK + col, ro, kBlk), kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin(acc_dq);
        pin(acc_dv);
        pin(acc_dk);
    }

    // Epilogue: dK * softmax_scale and dV as 16-bit, from the registers (dkdv_store_regs):
    // keys 16 wl + g + 8 r, this warpgroup's columns.
    __device__ __forceinline__ void store(const FlashParams& p, const BwdSeq& seq, int b, int hk,
                                          int n0) const {
        dkdv_store_regs<Elem, 128>(p, seq, b, hk, n0, 128 * wg, acc_dk, acc_dv,
                                   32 * wl + 4 * g + t);
    }

    // The same through shared memory (dkdv_store_staged): this warpgroup's two column blocks
    // of the K and V tiles, once both warpgroups' last products are done.
    __device__ __forceinline__ void store_staged(const FlashParams& p, const BwdSeq& seq, int b,
                                                 int hk, int n0, fc_u32 sK, fc_u32 sV) const {
        if (!dkdv_store_staged<Elem, 128, kBlk>(p, seq, b, hk, n0, 128 * wg, acc_dk, acc_dv,
                                                sK + 2u * (fc_u32)wg * kBlk,
                                                sV + 2u * (fc_u32)wg * kBlk,
                                                32 * wl + 4 * g + t, 3 + wg))
            store(p, seq, b, hk, n0);
    }
};

}  // namespace fc_hb

// The head-dim-256 dK/dV kernel (see above): 384 threads, warpgroup 0 produces (bwd_produce,
// boxes of 64 rows), 1 and 2 consume. Dense calls, or (Is_varlen) varlen calls as the d128
// warp-specialised kernel takes them.
template <typename Elem, bool Is_local, bool Is_dropout, bool Is_varlen = false>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dkdv_sm90_d256_kernel(const FlashParams p, const __grid_constant__ FcBwdMaps maps) {
    using namespace fc_hb;
    using namespace fc_pipe;
    using Wg = Dkdv256Warpgroup<Elem, Is_local, Is_dropout>;
    constexpr int kD = 256, kBlockM = Wg::kBM, kBlockN = Wg::kBN, kStages = 2;
    constexpr fc_u32 kTile = 4u * Wg::kBlk;            // K, V, one stage of Q or dO: 32 KiB
    extern __shared__ unsigned char smem_raw[];
    const fc_u32 base = smem_u32(smem_raw);
    const fc_u32 sK = (base + 1023u) & ~1023u;
    const fc_u32 sV = sK + kTile;
    const fc_u32 sQ = sV + kTile;                      // kStages
    const fc_u32 sdO = sQ + kStages * kTile;           // kStages
    const fc_u32 sP = sdO + kStages * kTile;           // 2 buffers
    const fc_u32 sdS = sP + 2u * Wg::kBlk;             // 2 buffers
    const fc_u32 sStats = sdS + 2u * Wg::kBlk;         // lse, D: kStages x 2 x kBlockM floats
    float* sLse = reinterpret_cast<float*>(smem_raw + (sStats - base));
    float* sDsum = sLse + kStages * kBlockM;
    const fc_u32 bars = sStats + (fc_u32)(2 * kStages * kBlockM) * 4u;
    const BwdBars<kStages> bar{bars};

    const fc_pipe::FcTileXYZ blk_xyz = bwd_block_order<Is_local>();
    const int n_block = blk_xyz.x, hk = blk_xyz.y, b = blk_xyz.z;
    const int tid = threadIdx.x;
    const int wg = tid >> 7;
    const BwdSeq seq = bwd_seq(p, b);
    const int n0 = n_block * kBlockN;
    if (n0 >= seq.sk) return;
    const BwdKeyWalk kw = bwd_key_walk<Is_local, kBlockM, kBlockN>(p, seq, b, hk, n0);
    const int n_iter = kw.n_iter;
    if (n_iter == 0) {            // no query sees these keys: dK = dV = 0
        if (wg > 0) Wg(tid - 128).store(p, seq, b, hk, n0);
        return;
    }

    if (!bwd_ws_start<kD, kBlockM, kBlockN, kStages, Is_varlen>(p, seq, maps, kw, b, hk, n0, sK,
                                                                sV, sQ, sdO, sLse, sDsum, bars))
        return;

    Wg w(tid - 128);
    FC_TL_CTA_BEGIN(wg);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 0);
    FC_TL_VALUE(wg, 0, FC_TL_TILE_SLOT, 7, n_iter);
    mbar_wait(bar.kv(), 0);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 1);
    if constexpr (Is_varlen) zero_rows_past<kD, kBlockN>(sK, sV, seq.sk - n0, tid - 128);
    // Step it's S^T and dP^T are issued as soon as its stage is full and the step before's dQ
    // tiles are in that step's Q / dO tiles: their bulk reduce-adds run while the products do
    // (S^T and dP^T, 32 registers a thread, are live where the step before's dQ, 64, no
    // longer is; kEarlyDq below: handed over just before the issue). That stage goes back to
    // the producer once the copies have read it, after this step's scores.
    // (FC_DIAG_BWD_NO_OVERLAP, timing only: the order before, each step's tiles handed over at
    // its end, its stage released at the top of the step after.)
#ifdef FC_DIAG_BWD_NO_OVERLAP
    constexpr bool kOverlap = false;
#else
    constexpr bool kOverlap = true;
#endif
    // The step before's dQ tiles are handed to their bulk copies before this step's S^T and
    // dP^T are issued, which gives the copies the issue's ~1,500 clocks before release_prev
    // waits for their reads (at head dim 256 that read, 64 KiB of reduce-adds a CTA a step, is
    // the longest wait of the step; the step -14% in clocks, fwd+bwd +4%: runs 199 and 202 in
    // docs/performance-log.md). (FC_DIAG_BWD256_LATE_DQ, timing only: handed over after the
    // issue, the order before; the d64 / d128 kernel keeps that order, its
    // FC_DIAG_BWD_NO_OVERLAP being this one and 3-5% slower there.)
#ifdef FC_DIAG_BWD256_LATE_DQ
    constexpr bool kEarlyDq = false;
#else
    constexpr bool kEarlyDq = true;
#endif
    // The step before's stage, holding its dQ tiles: back to the producer once the bulk copy
    // has read this warpgroup's (its issuing thread waits; the phase needs every consumer's
    // arrival, so it cannot complete before both copies have read).
    auto release_prev = [&](int it) {
        if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();
        mbar_arrive(bar.empty((it - 1) % kStages));
    };
    int h = kw.h0, m_block = kw.m_begin;
    float acc_dq[64];
    float* dq_tile = nullptr;     // the step's (kOverlap: the step before's) dQ tile in dq_accum
    fc_u32 sDqw = 0;              // and where this warpgroup stages it
    for (int it = 0; it < n_iter; ++it) {
        const int st = it % kStages;
        const fc_u32 buf = (fc_u32)(it & 1) * Wg::kBlk;
        const int m0 = m_block * kBlockM;
        const fc_u32 sQb = sQ + (fc_u32)st * kTile, sdOb = sdO + (fc_u32)st * kTile;
        FC_TL_STAMP(wg, 0, it, 0);
        if (!kOverlap && it > 0) release_prev(it);
        mbar_wait(bar.full(st), (fc_u32)(it / kStages) & 1u);
        FC_TL_STAMP(wg, 0, it, 1);
        if constexpr (Is_varlen)   // (m0 < sq on the walk)
            zero_rows_past<kD, kBlockM>(sQb, sdOb, seq.sq - m0, tid - 128);
        if (kOverlap && it > 0) dq_tile_store<64>(acc_dq, sDqw, tid - 128);
        FC_TL_STAMP(wg, 0, it, 2);
        if (kEarlyDq && kOverlap && it > 0)
            dq_tile_commit<64>(sDqw, dq_tile, tid - 128, 3 + w.wg, true);
        w.issue_scores(sK, sV, sQb, sdOb);
        FC_TL_STAMP(wg, 0, it, 3);
        if (!kEarlyDq && kOverlap && it > 0)
            dq_tile_commit<64>(sDqw, dq_tile, tid - 128, 3 + w.wg, true);
        FC_TL_STAMP(wg, 0, it, 4);
        w.finish_scores(p, seq, b, h, m0, n0, kw.off, sLse + st * kBlockM, sDsum + st * kBlockM,
                        sP + buf, sdS + buf);
        FC_TL_STAMP(wg, 0, it, 5);
        if (kOverlap && it > 0) release_prev(it);
        fence_proxy_async();      // the P^T / dS^T stores, for the products' async-proxy reads
        // Both halves of P^T and dS^T are written; and (double-buffered) both warpgroups are
        // past the previous step, whose products read the buffers the next step writes.
        named_sync(1, 256);
        FC_TL_STAMP(wg, 0, it, 6);
        w.grads_product(sK, sQb, sdOb, sP + buf, sdS + buf, acc_dq);
        FC_TL_STAMP(wg, 0, it, 7);
        // Both warpgroups' products done: the stage's Q and dO tiles can take their dQ tiles.
        named_sync(2, 256);
        sDqw = w.wg == 0 ? sQb : sdOb;
        dq_tile = dq_accum_row(p, seq, b, h, m0) + w.wg * 64 * 128;
        if (!kOverlap) dq_tile_add<64>(acc_dq, sDqw, dq_tile, tid - 128, 3 + w.wg);
        bwd_walk_next(h, m_block, kw.m_begin, kw.m_end, h, m_block);
    }
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 4);
    if (kOverlap) dq_tile_add<64>(acc_dq, sDqw, dq_tile, tid - 128, 3 + w.wg);
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 5);
#ifdef FC_DIAG_BWD_REG_STORE      // (timing: dK and dV stored from the registers, 4 bytes a thread)
    w.store(p, seq, b, hk, n0);
#else
    // (the last step's named barrier 2: both warpgroups' products are done, K and V are free)
    w.store_staged(p, seq, b, hk, n0, sK, sV);
#endif
    FC_TL_STAMP(wg, 0, FC_TL_TILE_SLOT, 6);
    FC_TL_CTA_END(wg);
    // (shared memory stays until the last bulk copy has read it)
    if ((threadIdx.x & 127) == 0) bulk_wait<0>();
}
