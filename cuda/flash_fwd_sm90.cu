// flashcore: forward kernels for Hopper (sm_90a): warpgroup MMA (wgmma) with operands read
// straight from shared memory. Launcher: flashcore/kernels/forward.py (the sm90 family; the
// Ampere-class flash_fwd.cu serves every other configuration and device).
//
// Two kernels share every piece of arithmetic below (FwdBlock: the CTA's sequence geometry;
// FwdRows: masking, the online softmax, P's packing with dropout, the epilogue; issue_s /
// issue_pv: the two products):
//
//  * flash_fwd_sm90_ws_kernel (the default): warp-specialised. Warpgroup 0 is the producer:
//    one thread issues TMA loads (tensor maps from flashcore/kernels/tma.py) of Q and of K
//    and V into a ring of mbarrier-guarded stages (sm90_pipeline.cuh), and the warpgroup
//    gives its registers to the consumer warpgroups (setmaxnreg 24 / 240 for two; three at
//    head dim 64, 24 / 160, as FA3's 192-row tiles there). Persistent (the default without a
//    window): one CTA per SM takes tiles from a dynamic scheduler, the K/V ring running on
//    from one tile into the next. Each consumer
//    owns 64 rows of the Q tile and, per key block, issues S_{i+1} = Q K_{i+1}^T and
//    O += P_i V_i together, then runs the softmax of S_{i+1} while P_i V_i is on the tensor
//    cores (intra-warpgroup overlap). With ping-pong, two named barriers make the consumers
//    issue their products in turn, so that one's softmax runs under the other's products.
//    Loads need 16-byte-aligned bases and row/head/batch strides (TMA); other strides take
//    flash_fwd_sm90_kernel; varlen calls run one tile a CTA (Is_varlen), over a packed or
//    (16-bit) a paged cache.
//  * flash_fwd_sm90_kernel (v0 / v1): the two warpgroups load their own tiles with cp.async
//    and meet at __syncthreads between key blocks; v1 keeps a 3-stage ring and overlaps
//    the softmax of block i+1 with P_i V_i as above.
//
// The products:
//   S  = Q K^T        wgmma m64nNk16, A = Q and B = K from shared memory (both K-major)
//   O += P V          wgmma m64nDk16, A = P from registers (S packed to 16 bits: the
//                     accumulator layout is the A-register layout), B = V from shared memory
//                     read N-major (imm-trans-b), so V is used in its natural [key][d] layout.
//
// Shared memory: tiles stored as [d / 64][rows][64] 16-bit elements, 128-byte swizzled (the
// layout TMA's SWIZZLE_128B writes, and the one load_tile writes), each block 1024-aligned.
//
// flash_fwd_sm90_fp8_kernel: the warp-specialised kernel on float8_e4m3fn q, k, v
// (FlashAttention-3's FP8 forward), the same body (ws_forward) with k32 e4m3 products:
//   S  = Q K^T        wgmma m64nNk32 e4m3, both from shared memory, K-major (128 e4m3 per
//                     128-byte row: one swizzled column block at head dim 128, two at 256)
//   O += P V          wgmma m64nDk32 e4m3, A = P from registers (pack_e4m3), B = V^T from
//                     shared memory, K-major: FP8 wgmma takes no transposed operand, so the
//                     producer warpgroup transposes each V tile in shared memory after its TMA
//                     load (transpose_v), storing the keys in the order in which P's
//                     accumulator registers already hold them (no shuffle of P).
// The descales fold into the scores' scale (q_descale * k_descale) and into the epilogue's
// 1 / l (v_descale). Head dims 128 (192-key blocks) and 256 (128-key blocks); varlen calls
// one tile a CTA (Is_varlen: the producer zeroes the raw V rows past a sequence's end);
// softcap (Has_softcap); no dropout, ALiBi or paged K/V (the launcher refuses them by name).
//
// Masking, alignment and outputs are those of flash_fwd.cu (bottom-right causal, windows with
// block skipping, varlen, GQA; rows that see no key get O = 0 and lse = -inf; NaN propagates).
// Dropout as flash_fwd.cu draws it (one Philox call per 16 x 16 tile of P, after the row sums:
// the lse is the undropped one's). Not here (the launcher routes them to flash_fwd.cu): other
// head dims, softcap, ALiBi, and paged K/V outside varlen.
#include "flash_dropout.cuh"
#include "diag_timeline.cuh"
#include "flash_params.cuh"
#include "ptx.cuh"
#include "sm90_pipeline.cuh"
#include "wgmma.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace fc_h {

constexpr int kBlockM = 128;     // query rows per CTA (2 consumer warpgroups x 64; the ws
                                 // kernels take kBM = 64 x their consumer warpgroups)
// Keys per block: 128 (head dims 64, 128) or 64 (head dim 256, whose O needs 128 registers).
template <int kD>
struct BlockN {
    static constexpr int value = kD == 256 ? 64 : 128;
};
constexpr fc_u32 kColBlock = 128u * 128u;        // bytes of one [128 rows][64 cols] block

using fc_sm90::load_tile;     // (256 threads)
using fc_sm90::stg32;

// The (batch, head, query block) of a CTA: where its rows and keys are, and which key blocks
// [n_block_min, n_block_max) hold a key that one of its rows sees.
template <int kBlockN, bool Is_local, int kBM = kBlockM>
struct FwdBlock {
    long long q_row0, k_row0;   // first row of the sequence in q / k (varlen), else 0
    int sq, sk, off, m0, rows_q, h, hk, b;
    int n_block_min, n_block_max;
    bool left_bounded, right_bounded;

    __device__ __forceinline__ FwdBlock(const FlashParams& p, int m_block, int h_, int b_) {
        h = h_;
        b = b_;
        q_row0 = 0;
        k_row0 = 0;
        sq = p.seqlen_q;
        sk = p.seqlen_k;
        if (p.cu_seqlens_q != nullptr) {
            const FcSeqRange r = fc_seq_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
            q_row0 = r.row0;
            sq = r.len;
        }
        if (p.cu_seqlens_k != nullptr) {
            const FcSeqRange r = fc_seq_range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);
            k_row0 = r.row0;
            sk = r.len;
        }
        m0 = m_block * kBM;
        off = sk - sq;
        rows_q = min(kBM, sq - m0);
        hk = h / (p.nheads / p.nheads_k);
        left_bounded = Is_local && p.window_left < FC_WINDOW_NONE;
        right_bounded = Is_local && p.window_right < FC_WINDOW_NONE;
        n_block_max = (sk + kBlockN - 1) / kBlockN;
        n_block_min = 0;
        if (right_bounded) n_block_max = min(n_block_max, blocks_seen(p, m0 + rows_q - 1));
        if (left_bounded) {
            const long long lo = (long long)m0 + off - p.window_left;
            if (lo > 0) n_block_min = (int)min(lo / kBlockN, (long long)n_block_max);
        }
    }
    // Right-bounded window: the key blocks that rows m0 .. last_row see (keys < last_row + off
    // + window_right + 1), at most all of the sequence's (after sk and off are set).
    __device__ __forceinline__ int blocks_seen(const FlashParams& p, int last_row) const {
        const long long hi = (long long)last_row + off + p.window_right + 1;
        const int all = (sk + kBlockN - 1) / kBlockN;
        return hi <= 0 ? 0 : (int)min((hi + kBlockN - 1) / kBlockN, (long long)all);
    }
    __device__ __forceinline__ bool empty_rows() const { return m0 >= sq; }
    __device__ __forceinline__ bool no_keys() const { return n_block_max <= n_block_min; }
    // element offset of the tile's first output row (16-bit, or float32 with o_fp32)
    __device__ __forceinline__ long long o_off(const FlashParams& p) const {
        return (long long)b * p.o_batch_stride + (q_row0 + m0) * p.o_row_stride
               + (long long)h * p.o_head_stride;
    }
    __device__ __forceinline__ float* lse_ptr(const FlashParams& p) const {
        return p.lse + (long long)b * p.lse_batch_stride + (long long)h * p.lse_head_stride
               + q_row0 + m0;
    }
    // A tile none of whose rows sees a key: O = 0, lse = -inf (threads [0, n) of the CTA).
    __device__ __forceinline__ void store_empty(const FlashParams& p, int kD, int tid, int n) const {
        const long long oo = o_off(p);
        for (int idx = tid; idx < kBM * (kD / 2); idx += n) {
            const int r = idx / (kD / 2), c = idx % (kD / 2);
            if (r < rows_q) {
                if (p.o_fp32)
                    *reinterpret_cast<float2*>(static_cast<float*>(p.o) + oo
                                               + (long long)r * p.o_row_stride + 2 * c) =
                        make_float2(0.f, 0.f);
                else
                    stg32(static_cast<fc_u16*>(p.o) + oo + (long long)r * p.o_row_stride + 2 * c, 0u);
            }
        }
        float* lse = lse_ptr(p);
        for (int r = tid; r < rows_q; r += n) lse[r] = -INFINITY;
    }
};

// FC_DIAG_RESCALE_THRESHOLD=T (timing and tests): the conditional rescale (FwdRows::softmax)
// at threshold T in every forward kernel, FP8 and the v0 / v1 kernels included, and T = 0 off
// in all of them, head dim 256 too (the A/B's baseline); by default the warp-specialised kernel
// picks its own (kRescaleThreshold there).
#ifdef FC_DIAG_RESCALE_THRESHOLD
constexpr int kFcRescaleThreshold = FC_DIAG_RESCALE_THRESHOLD;
#else
constexpr int kFcRescaleThreshold = 0;
#endif

// One consumer thread's rows (64 wg + 16 (warp % 4) + g + 8 r, r = 0, 1 of the tile, ct its
// index among the 256 consumer threads) and their state: O's accumulators, the running row
// max and sum; and the steps of one key block on them.
template <typename Elem, int kD, int kBlockN, bool Is_local, bool Is_dropout, int kBM = kBlockM>
struct FwdRows {
    static constexpr int kNT = kBlockN / 8;    // n8 tiles of S
    static constexpr int kDT = kD / 8;         // n8 tiles of O
    float acc_o[kDT * 4];
    float row_max[2], row_sum[2];
    int warp_row0, g, t, row_pos0, win_r, win_l, blk_hi, blk_lo, sk, m0, drop_bh;
    bool left_bounded, right_bounded;
    float mult;
    FcDropout drop;

    __device__ __forceinline__ FwdRows(const FlashParams& p,
                                       const FwdBlock<kBlockN, Is_local, kBM>& blk, int ct) {
        const int lane = ct & 31, warp = ct >> 5;
        g = lane >> 2;
        t = lane & 3;
#pragma unroll
        for (int i = 0; i < kDT * 4; ++i) acc_o[i] = 0.f;
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.f;
        warp_row0 = 64 * (warp >> 2) + 16 * (warp & 3);
        m0 = blk.m0;
        sk = blk.sk;
        row_pos0 = m0 + warp_row0 + g + blk.off;   // i + off of row half 0
        left_bounded = blk.left_bounded;
        right_bounded = blk.right_bounded;
        win_r = right_bounded ? min(p.window_right, blk.sq) : 0;
        win_l = left_bounded ? min(p.window_left, blk.sk) : 0;
        mult = p.scale_log2;
        blk_hi = right_bounded ? min(blk.sk, m0 + blk.off + win_r + 1) : blk.sk;
        blk_lo = left_bounded ? m0 + kBM - 1 + blk.off - win_l : 0;
        drop_bh = blk.b * p.nheads + blk.h;
        drop = FcDropout{};
        if constexpr (Is_dropout)
            drop = fc_dropout_setup(p.dropout_rng, p.dropout_threshold, p.dropout_scale);
    }

    // Mask the scores of the block at key n0 (boundary blocks only). Element e of n8 tile j:
    // row half r = e / 2, key n0 + 8 j + 2 t + (e & 1).
    __device__ __forceinline__ void mask(float (&s)[kNT * 4], int n0) const {
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
    }
    // Online softmax (as flash_fwd.cu): s -> P (fp32), row max and sum updated; corr is the
    // factor the O of the earlier blocks must be multiplied by. Returns whether one of the
    // thread's rows took a new maximum: where no row of a warp did, every corr is 1 (exactly,
    // with kExact) and the caller may skip rescale (the same bits; FlashAttention-4 skips it
    // the same way).
    // kPolyEvery: every kPolyEvery-th n8 tile's exponentials on the FMA pipe (fc_exp2_poly),
    // 0: none. kExact: corr exactly 1 where a maximum did not move (the callers that skip).
    // kThreshold > 0: FlashAttention-4's conditional rescale. The row's reference maximum
    // moves only where the block's maximum passes it by more than 2^kThreshold in P (or it is
    // still -inf); P <= 2^kThreshold otherwise, the same relative rounding in 16 bits. Where no
    // row of a warp moved, corr is exactly 1 and the caller skips O's rescale; the epilogue's
    // lse takes the reference, with which the row sum agrees. (Not with FP8: P up to 2^8 stays
    // within e4m3's 448, yet the FP8 GPU tests fail the flash-attn rule with it at 2.5-4x the
    // emulated error (run 120 of the performance log): consistent with the FP8 wgmma's
    // narrower accumulation, where the earlier blocks' O sits up to 2^8 below the new terms.)
    template <int kPolyEvery = 0, bool kExact = false, int kThreshold = kFcRescaleThreshold>
    __device__ __forceinline__ bool softmax(float (&s)[kNT * 4], float (&corr)[2]) {
        bool grew = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
            mx = quad_max(mx);
            float m_scaled;
            if constexpr (kThreshold > 0) {
                const bool move = row_max[r] == -INFINITY ||
                                  (mx - row_max[r]) * mult > (float)kThreshold;
                grew |= move;
                const float ref = move ? mx : row_max[r];
                corr[r] = !move ? 1.f
                          : row_max[r] == -INFINITY ? 0.f : fc_exp2((row_max[r] - ref) * mult);
                mx = ref;
                m_scaled = (mx == -INFINITY) ? 0.f : mx * mult;
            } else {
                grew |= mx != row_max[r];
                m_scaled = (mx == -INFINITY) ? 0.f : mx * mult;
                // kExact: the difference first, exactly 1 for an unchanged maximum (for the
                // skip: row_max * mult - m_scaled, contracted into one FFMA, leaves m_scaled's
                // rounding, and 2^that is a few ulps off 1; where nothing skips, the register or
                // so that this costs spilled the FP8 d128 softcap kernel)
                if constexpr (kExact)
                    corr[r] = mx == -INFINITY ? 0.f : fc_exp2((row_max[r] - mx) * mult);
                else
                    corr[r] = fc_exp2(row_max[r] * mult - m_scaled);
            }
            row_max[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < kNT; ++j)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const float x = fmaf(s[4 * j + e], mult, -m_scaled);
                    const float pr = kPolyEvery > 0 && j % kPolyEvery == kPolyEvery - 1
                                         ? fc_exp2_poly(x) : fc_exp2(x);
                    s[4 * j + e] = pr;
                    sum += pr;
                }
            row_sum[r] = row_sum[r] * corr[r] + sum;
        }
        return grew;
    }
    __device__ __forceinline__ void rescale(const float (&corr)[2]) {
#pragma unroll
        for (int j = 0; j < kDT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= corr[e >> 1];
    }
    // P (16-bit) as the A operand of k-step kk (keys n0 + 16 kk ..): tiles 2kk, 2kk+1. With
    // dropout, the packed pairs ANDed with the masks of that 16 x 16 tile (word w: row half
    // w >> 1, key half w & 1), drawn for two tiles at a time (fc_dropout_masks2: one
    // Philox call per lane, shared with lane ^ 4); the 1 / (1 - p) goes into the epilogue's
    // scale (store).
    __device__ __forceinline__ void pack(const float (&s)[kNT * 4], fc_u32 (&pa)[kBlockN / 16][4],
                                         int n0) const {
        unsigned int mask[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            if constexpr (Is_dropout) {
                if ((kk & 1) == 0) {
                    const int kb = kk + 1 < kBlockN / 16 ? kk + 1 : kk;
                    fc_dropout_masks2(drop, drop_bh, m0 + warp_row0, n0 + 16 * kk,
                                      m0 + warp_row0, n0 + 16 * kb, g, t, mask[0], mask[1]);
                }
                const unsigned int (&m)[4] = mask[kk & 1];
                pa[kk][0] = Elem::pack2(s[8 * kk + 0], s[8 * kk + 1]) & m[0];
                pa[kk][1] = Elem::pack2(s[8 * kk + 2], s[8 * kk + 3]) & m[2];
                pa[kk][2] = Elem::pack2(s[8 * kk + 4], s[8 * kk + 5]) & m[1];
                pa[kk][3] = Elem::pack2(s[8 * kk + 6], s[8 * kk + 7]) & m[3];
            } else {
                pa[kk][0] = Elem::pack2(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = Elem::pack2(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = Elem::pack2(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = Elem::pack2(s[8 * kk + 6], s[8 * kk + 7]);
            }
        }
    }
    // P (fp32, in [0, 1]) as the e4m3 A operand of the FP8 P V product, k-step kk (keys
    // n0 + 32 kk ..: the n8 tiles 4kk .. 4kk + 3, in s[16 kk ..]). The FP8 A fragment wants
    // columns 4t .. 4t + 3 (and 16 + 4t ..) of each k32 step where this thread holds columns
    // 2t, 2t + 1 of each n8 tile: no data moves between threads, the thread's own eight values
    // per row half fill its four A bytes in this order:
    //   A column 4t + i  <-  key 2t + (i & 1) + 8 (i >> 1)   (+16 for the upper half),
    // and the producer stores V^T's keys in the same order (transpose_v), so that the sum over
    // keys pairs every P with its own V row.
    __device__ __forceinline__ void pack_e4m3(const float (&s)[kNT * 4],
                                              fc_u32 (&pa)[kBlockN / 32][4]) const {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 32; ++kk) {
            const float* x = s + 16 * kk;   // x[4 j + 2 r + e]: tile 4 kk + j, row half r
            pa[kk][0] = fc_f32x4_to_e4m3x4(x[0], x[1], x[4], x[5]);
            pa[kk][1] = fc_f32x4_to_e4m3x4(x[2], x[3], x[6], x[7]);
            pa[kk][2] = fc_f32x4_to_e4m3x4(x[8], x[9], x[12], x[13]);
            pa[kk][3] = fc_f32x4_to_e4m3x4(x[10], x[11], x[14], x[15]);
        }
    }
    // Epilogue: O * o_scale / l (NaN propagates: l == 0 only for rows that saw no key), lse
    // of the scores times s_scale (the FP8 kernel's descales; 1 otherwise), or with kCapped
    // (softcap: the rows hold tanh of the scaled scores) times the softcap. With dropout the
    // kept probabilities' 1 / (1 - p) is applied here, once per output element (pack). O goes
    // to global memory from the registers, or, with to_smem, into the warpgroup's O buffer sO
    // (stage_o) for the caller's TMA store; lse always from the registers. (to_smem is a
    // uniform flag, not sO != 0: a condition on the thread-dependent address made ptxas treat
    // the branch as divergent and move the main loop's barrier addresses out of uniform
    // registers.)
    template <bool kCapped = false>
    __device__ __forceinline__ void store(const FlashParams& p,
                                          const FwdBlock<kBlockN, Is_local, kBM>& blk,
                                          float o_scale = 1.f, float s_scale = 1.f,
                                          bool to_smem = false, fc_u32 sO = 0u) const {
        if constexpr (Is_dropout) o_scale *= drop.scale;
        const long long oo = blk.o_off(p);
        float* lse = blk.lse_ptr(p);
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[r]);
            inv[r] = l == 0.f ? 0.f : o_scale / l;
            const int row = warp_row0 + g + 8 * r;
            if (row < blk.rows_q) {
                if (to_smem) {
                    // (stage_o below, every row)
                } else if (p.o_fp32) {      // unrounded float32 output, 8 bytes a store
                    float* orow = static_cast<float*>(p.o) + oo + (long long)row * p.o_row_stride;
#pragma unroll
                    for (int j = 0; j < kDT; ++j)
                        *reinterpret_cast<float2*>(orow + 8 * j + 2 * t) =
                            make_float2(acc_o[4 * j + 2 * r] * inv[r], acc_o[4 * j + 2 * r + 1] * inv[r]);
                } else {
                    fc_u16* orow = static_cast<fc_u16*>(p.o) + oo + (long long)row * p.o_row_stride;
#pragma unroll
                    for (int j = 0; j < kDT; ++j)
                        stg32(orow + 8 * j + 2 * t,
                              Elem::pack2(acc_o[4 * j + 2 * r] * inv[r], acc_o[4 * j + 2 * r + 1] * inv[r]));
                }
                if (t == 0)
                    lse[row] = l == 0.f ? -INFINITY
                                        : row_max[r] * (kCapped ? p.softcap : p.softmax_scale * s_scale)
                                              + logf(l);
            }
        }
        if (to_smem) stage_o(sO, inv);
    }
    // This thread's O rows times inv, as 16-bit elements, into the warpgroup's O buffer sO:
    // [kD / 64][64 rows][128 bytes] with TMA's 128-byte swizzle (16-byte chunk c of row r at
    // c ^ (r % 8); sO 1024-aligned), the box layout of the output's tensor map. One stmatrix.x4
    // per 16 columns: matrices (rows 0-7, columns 8j..), (rows 8-15, 8j..), (rows 0-7, 8j + 8..),
    // (rows 8-15, 8j + 8..) of the warp's 16 rows, each register the accumulator pair that
    // lane (g, t) holds (row g, columns 2t, 2t + 1): the n8 tile's own layout. The 8 rows of a
    // matrix fall in 8 different chunks: no bank conflicts. Every row is written (rows past
    // the sequence's end included: the store clips them).
    __device__ __forceinline__ void stage_o(fc_u32 sO, const float (&inv)[2]) const {
        const int lane = 4 * g + t, mi = lane >> 3;
        const int row = (warp_row0 & 63) + 8 * (mi & 1) + (lane & 7);   // in the warpgroup's 64
#pragma unroll
        for (int jj = 0; jj < kDT / 2; ++jj) {
            const int j0 = 2 * jj, j1 = 2 * jj + 1;
            const int chunk = 2 * jj + (mi >> 1);                        // 8 columns
            const fc_u32 addr = sO + (fc_u32)(chunk >> 3) * (64u * 128u) + (fc_u32)row * 128u
                                + ((fc_u32)((chunk & 7) ^ (row & 7)) << 4);
            stmatrix_x4(addr, Elem::pack2(acc_o[4 * j0] * inv[0], acc_o[4 * j0 + 1] * inv[0]),
                        Elem::pack2(acc_o[4 * j0 + 2] * inv[1], acc_o[4 * j0 + 3] * inv[1]),
                        Elem::pack2(acc_o[4 * j1] * inv[0], acc_o[4 * j1 + 1] * inv[0]),
                        Elem::pack2(acc_o[4 * j1 + 2] * inv[1], acc_o[4 * j1 + 3] * inv[1]));
        }
    }
};

// Pin the registers an MMA reads or writes in program order (fence_operand): before its issue
// (no write to them moves below it) and after its wait (no read moves above it).
template <int N>
__device__ __forceinline__ void settle(float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) fence_operand(x[i]);
}
template <int N>
__device__ __forceinline__ void settle(fc_u32 (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) fence_operand(x[i][e]);
}

// S = Q K^T into s (asynchronous: committed as one wgmma group, not waited for). sQwg: this
// warpgroup's 64 rows of Q; sKb: the K tile. Each k-step reads 32 bytes of the rows (16
// 16-bit elements, or 32 e4m3 ones: Elem = fc_e4m3, wgmma k32): k-step kk is column block
// kk / 4 at byte offset 32 (kk % 4) inside the 128-byte rows.
template <typename Elem, int kD, int kBlockN, int kBM = kBlockM, int kNS>
__device__ __forceinline__ void issue_s(float (&s)[kNS], fc_u32 sQwg, fc_u32 sKb) {
    constexpr fc_u32 kKVBlock = (fc_u32)kBlockN * 128u;
    constexpr fc_u32 kQColBlock = (fc_u32)kBM * 128u;      // one [kBM rows][128 B] block of Q
    settle(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD * Elem::kBytes / 32; ++kk) {
        const fc_u32 qoff = (fc_u32)(kk >> 2) * kQColBlock + (fc_u32)(kk & 3) * 32u;
        const fc_u32 koff = (fc_u32)(kk >> 2) * kKVBlock + (fc_u32)(kk & 3) * 32u;
        Wgmma<Elem>::ss(s, wgmma_desc_k(sQwg, qoff), wgmma_desc_k(sKb, koff), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}
// O += P V (asynchronous, one group). B = V (keys x d), N-major: 64-column blocks of d are
// kKVBlock apart (LBO), groups of 8 keys 1024 bytes apart (SBO); k-step kk starts at key 16 kk.
template <typename Elem, int kBlockN, int kNO>
__device__ __forceinline__ void issue_pv(float (&acc_o)[kNO], fc_u32 (&pa)[kBlockN / 16][4],
                                         fc_u32 sVb) {
    constexpr fc_u32 kKVBlock = (fc_u32)kBlockN * 128u;
    settle(acc_o);
    settle(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
        Wgmma<Elem>::rs_tb(acc_o, pa[kk], wgmma_desc_mn(sVb, (fc_u32)kk * 16u * 128u, kKVBlock), 1);
    wgmma_commit();
}

// FP8: O += P V with P (e4m3, pack_e4m3's order) from registers and B = V^T from shared
// memory, K-major (FP8 wgmma has no transposed B): sVt holds [kBlockN / 128][kD][128] bytes,
// row n = head-dim column n, its 128 bytes the keys of one 128-key block in transpose_v's
// order; k-step kk (32 keys) is block kk / 4 at byte offset 32 (kk % 4); N = kD.
template <int kD, int kBlockN, int kNO>
__device__ __forceinline__ void issue_pv_e4m3(float (&acc_o)[kNO], fc_u32 (&pa)[kBlockN / 32][4],
                                              fc_u32 sVt) {
    static_assert(kNO == kD / 2, "O is 64 x kD per warpgroup");
    settle(acc_o);
    settle(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 32; ++kk) {
        const fc_u32 voff = (fc_u32)(kk >> 2) * (fc_u32)(kD * 128) + (fc_u32)(kk & 3) * 32u;
        Wgmma<fc_e4m3>::rs(acc_o, pa[kk], wgmma_desc_k(sVt, voff), 1);
    }
    wgmma_commit();
}

// FP8: V (as TMA wrote it: [kD / 128][kBlockN][128] bytes, 128-byte swizzled rows of head-dim
// columns, one per key) transposed into V^T (issue_pv_e4m3's layout) by the 4 warps of the
// producer warpgroup (ptid: 0..127), in shared memory. A warp's unit is 32 keys (k0..) x 16
// head-dim columns (d0..): one ldmatrix.x4.trans reads the four 8-key x 16-byte matrices (as
// b16: lane (r, c) gets, of matrix m, keys k0 + 8m + 2c, +1 at columns d0 + 2r, +1), two byte
// permutes per pair of matrices regroup them by head-dim column, and one stmatrix.x4 writes
// them as rows d0 + 2i + e of V^T (matrix 2 h + e: the 16 keys k0 + 16 h ..), lane (r, c)'s
// word at bytes 4c .. 4c + 3: keys 2c, 2c + 1, 8 + 2c, 9 + 2c of those 16, which is the order
// pack_e4m3 gives P's columns. (The stores meet 2-way bank conflicts: rows 2i + e of a matrix
// repeat every 4 in the swizzle; the loads have none.)
//   kBlockN > 128 (192 or 224 at head dim 128): V^T is [ceil(kBlockN / 128)][kD][128] bytes,
// key chunk c's 128-byte rows holding keys 128 c .. (the last chunk's rows part-filled), and the
// units (32 keys g, 16 columns j) are dealt out evenly: warp w takes kPer in a row, g-major.
template <int kD, int kBlockN>
__device__ __forceinline__ void transpose_v(fc_u32 sVt, fc_u32 sV, int ptid) {
    static_assert(kBlockN % 32 == 0 && (kBlockN / 32) * (kD / 16) % 4 == 0,
                  "units of 32 keys x 16 columns, dealt to 4 warps");
    const int lane = ptid & 31, warp = ptid >> 5;
    const int mi = lane >> 3, i = lane & 7;       // the matrix and row this lane addresses
    const int e = mi & 1, h = mi >> 1;
    const int row = 2 * i + e;                    // V^T row d0 + row
    if constexpr (kBlockN == 128) {
        // unit j of warp w: keys k0 = 32 w, head-dim columns d0 = 16 j
        const fc_u32 src0 = sV + (fc_u32)(32 * warp + 8 * mi + i) * 128u;
        const fc_u32 dst0 = sVt + (fc_u32)row * 128u
                            + ((fc_u32)((2 * warp + h) ^ (row & 7)) << 4);
        // (unrolled by 4: fully unrolled, the loads of every unit are hoisted and the
        // producer's registers spill)
#pragma unroll 4
        for (int j = 0; j < kD / 16; ++j) {
            const fc_u32 src = src0 + (fc_u32)(j >> 3) * (fc_u32)(kBlockN * 128)
                               + ((fc_u32)((j & 7) ^ i) << 4);
            fc_u32 w[4];
            ldmatrix_x4_trans(w, src);
            stmatrix_x4(dst0 + (fc_u32)j * 2048u, fc_prmt(w[0], w[1], 0x6420u),
                        fc_prmt(w[0], w[1], 0x7531u), fc_prmt(w[2], w[3], 0x6420u),
                        fc_prmt(w[2], w[3], 0x7531u));
        }
    } else {
        constexpr int kJ = kD / 16, kPer = (kBlockN / 32) * kJ / 4;
#pragma unroll 4
        for (int t = 0; t < kPer; ++t) {
            const int u = warp * kPer + t, g = u / kJ, j = u % kJ;
            const int c = g >> 2, gw = g & 3;     // 128-key chunk, 32-key slot in it
            const fc_u32 src = sV + (fc_u32)(32 * g + 8 * mi + i) * 128u
                               + (fc_u32)(j >> 3) * (fc_u32)(kBlockN * 128)
                               + ((fc_u32)((j & 7) ^ i) << 4);
            const fc_u32 dst = sVt + (fc_u32)c * (fc_u32)(kD * 128) + (fc_u32)row * 128u
                               + ((fc_u32)((2 * gw + h) ^ (row & 7)) << 4) + (fc_u32)j * 2048u;
            fc_u32 w[4];
            ldmatrix_x4_trans(w, src);
            stmatrix_x4(dst, fc_prmt(w[0], w[1], 0x6420u), fc_prmt(w[0], w[1], 0x7531u),
                        fc_prmt(w[2], w[3], 0x6420u), fc_prmt(w[2], w[3], 0x7531u));
        }
    }
}

}  // namespace fc_h

// Template parameters: Elem (fc_bf16 / fc_fp16); kD: head dim (64, 128 or 256, exact);
// Is_local: a window side is bounded (causal included), giving block skipping and boundary
// masks; kPipe: v1 (softmax of the next block overlapped with P V of this one) instead of v0;
// Is_dropout: attention dropout (flash_dropout.cuh).
template <typename Elem, int kD, bool Is_local, bool kPipe, bool Is_dropout>
__global__ void __launch_bounds__(256, 1)
flash_fwd_sm90_kernel(const FlashParams params) {
    using namespace fc_h;
    static_assert(kD == 64 || kD == 128 || kD == 256, "head dims 64, 128 and 256");
    constexpr int kBlockN = BlockN<kD>::value;
    static_assert(!(kPipe && kD == 256), "v1's 3-stage ring does not fit at head dim 256");
    constexpr fc_u32 kQTile = (fc_u32)(kD / 64) * kColBlock;           // 128 x kD
    constexpr fc_u32 kTile = (fc_u32)(kD / 64) * (fc_u32)kBlockN * 128u;  // one K or V tile
    constexpr int kNT = kBlockN / 8;

    extern __shared__ unsigned char smem_raw[];
    const fc_u32 sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
    constexpr fc_u32 kStages = kPipe ? 3u : 2u;
    const fc_u32 sK = sQ + kQTile;             // kStages K buffers
    const fc_u32 sV = sK + kStages * kTile;    // kStages V buffers

    const int tid = threadIdx.x;
    const int wg = tid >> 7;           // warpgroup: tile rows [64 wg, 64 wg + 64)
    const int m_block = Is_local ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const FwdBlock<kBlockN, Is_local> blk(params, m_block, blockIdx.y, blockIdx.z);
    if (blk.empty_rows()) return;
    if (blk.no_keys()) {
        blk.store_empty(params, kD, tid, 256);
        return;
    }
    const fc_u16* gQ = static_cast<const fc_u16*>(params.q) + (long long)blk.b * params.q_batch_stride
                       + (blk.q_row0 + blk.m0) * params.q_row_stride + (long long)blk.h * params.q_head_stride;
    const fc_u16* gK = static_cast<const fc_u16*>(params.k) + (long long)blk.b * params.k_batch_stride
                       + blk.k_row0 * params.k_row_stride + (long long)blk.hk * params.k_head_stride;
    const fc_u16* gV = static_cast<const fc_u16*>(params.v) + (long long)blk.b * params.v_batch_stride
                       + blk.k_row0 * params.v_row_stride + (long long)blk.hk * params.v_head_stride;
    const int sk = blk.sk;
    const int n_block_min = blk.n_block_min;

    // ---- prologue: Q (v0 also the first K and V, one group each; v1 loads its own) ---------
    int n_block = blk.n_block_max - 1;
    load_tile<kBlockM, kD>(sQ, gQ, params.q_row_stride, blk.rows_q, tid);
    auto load_kv = [&](int nb, fc_u32 buf) {
        const int n1 = nb * kBlockN;
        load_tile<kBlockN, kD>(sK + buf, gK + (long long)n1 * params.k_row_stride, params.k_row_stride,
                  sk - n1, tid);
        load_tile<kBlockN, kD>(sV + buf, gV + (long long)n1 * params.v_row_stride, params.v_row_stride,
                  sk - n1, tid);
    };
    if constexpr (!kPipe) {
        cp_async_commit();
        load_kv(n_block, 0);
        cp_async_commit();
    }

    FwdRows<Elem, kD, kBlockN, Is_local, Is_dropout> rows(params, blk, tid);
    const fc_u32 sQwg = sQ + (fc_u32)wg * 64u * 128u;
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

            issue_s<Elem, kD, kBlockN>(s, sQwg, sK + buf);
            wgmma_wait<0>();
            settle(s);
            rows.mask(s, n0);
            rows.softmax(s, corr);
            rows.rescale(corr);
            rows.pack(s, pa, n0);
            issue_pv<Elem, kBlockN>(rows.acc_o, pa, sV + buf);
            wgmma_wait<0>();
            settle(rows.acc_o);
            settle(pa);
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
        issue_s<Elem, kD, kBlockN>(s, sQwg, sK + stage(0));
        wgmma_wait<0>();
        settle(s);
        rows.mask(s, nb * kBlockN);
        rows.softmax(s, corr);                  // O is 0: no rescale
        rows.pack(s, pa, nb * kBlockN);
        int it = 0;
        for (; nb - 1 >= n_block_min; ++it, --nb) {   // every block but the last
            cp_async_wait<1>();                 // block i+1 landed
            fence_proxy_async();
            __syncthreads();
            issue_s<Elem, kD, kBlockN>(s, sQwg, sK + stage(it + 1));   // S_{i+1}
            issue_pv<Elem, kBlockN>(rows.acc_o, pa, sV + stage(it));    // O += P_i V_i
            wgmma_wait<1>();                    // S_{i+1} done (P_i V_i may still run)
            settle(s);
            rows.mask(s, (nb - 1) * kBlockN);
            rows.softmax(s, corr);
            wgmma_wait<0>();
            settle(rows.acc_o);
            settle(pa);
            rows.rescale(corr);
            rows.pack(s, pa, (nb - 1) * kBlockN);
            __syncthreads();                    // both warpgroups are done with stage(it)
            if (nb - 3 >= n_block_min) load_kv(nb - 3, stage(it));
            cp_async_commit();
        }
        issue_pv<Elem, kBlockN>(rows.acc_o, pa, sV + stage(it));   // the last block
        wgmma_wait<0>();
        settle(rows.acc_o);
        settle(pa);
    }
    rows.store(params, blk);
}

// The tensor maps of the warp-specialised kernels (flashcore/kernels/tma.py encodes them):
// q (d, seqlen_q, nheads, batch) with boxes of 128 bytes x 128 rows, k and v (d, seqlen_k,
// nheads_k, batch) with boxes of 128 bytes x kBlockN rows (64 16-bit elements, or 128 e4m3
// ones, per row); 128-byte swizzle, zero fill. Varlen: (d, total, heads, 1) of the packed arrays.
struct alignas(64) FcFwdMaps {
    FcTensorMap q, k, v, o;    // o: (d, seqlen_q, nheads, batch) of the output, boxes of 128 bytes
                               // x 64 rows, when params.o_tma (else a copy of q's, unused)
};

namespace fc_h {

// The body of both warp-specialised kernels (see the top of the file). 128 + 2 kBM threads:
// warpgroup 0 produces, 1 .. kBM / 64 consume (64 query rows each). Elem: the output's 16-bit
// type; In: the inputs' (Elem, or fc_e4m3: the FP8 forward). kBlockN: keys per block;
// kStages: K/V ring depth; kPingPong: the consumers issue their products in turn (named
// barriers 1 .. kBM / 64); kPersistent: one CTA per SM takes tiles from the dynamic scheduler.
//
// FP8 differs in three places. The producer warpgroup loads V by TMA into a two-deep ring of
// its own (raw) and transposes each block into the V^T stage the consumers read
// (transpose_v: all four warps; thread 0 issues the loads between blocks), so full_v counts
// the 128 producer threads instead of TMA bytes, and the producer keeps 24 registers. The
// products are k32 e4m3 ones with P packed by pack_e4m3. The scores' scale takes
// q_descale * k_descale and the output's v_descale (per batch and key head; none = 1).
// Is_varlen (16-bit, one tile a CTA): the maps see each packed array as one sequence (batch 1),
// a tile's rows from its sequence's offsets; V rows past the sequence's end in the one key
// block that holds them (the walk's first) are zeroed before any P V product reads them (the
// masks already give their scores -inf; P = 0 times such a row, NaN possibly, would not be 0).
// Over a paged cache (16-bit varlen with params.block_table; the windowed instantiation) the
// producer reads each key block from its page by TMA, or, for pages that do not hold whole
// key blocks, copies it with cp.async (see `paged` below).
//
// The epilogue (kOBufs > 0: the host launches an instantiation with O buffers only for dense
// calls whose 16-bit output TMA can write, params.o_tma set) goes through shared
// memory: each consumer warpgroup writes its 64 x kD rows of O into an O buffer (stage_o), and
// one of its threads stores the buffer by TMA, the tensor map clipping the rows past the
// sequence's end; with kOBufs = kCons each warpgroup has a buffer of its own (reused once its
// last store has read it: bulk_wait_read), with kOBufs = 1 (two consumers, where shared memory
// holds one buffer only) the two take it in turn, consumer 0 first, each store's thread
// arriving on the mbarrier o_free once its store has read the buffer. kOBufs = 0 (varlen calls,
// float32 outputs and outputs that TMA cannot write among them) stores from the registers.
template <typename Elem, typename In, int kD, int kBM, int kBlockN, bool Is_local,
          bool Is_dropout, int kStages, bool kPingPong, bool kPersistent, bool Is_varlen = false,
          bool Has_softcap = false, int kOBufs = 0>
__device__ __forceinline__ void ws_forward(const FlashParams& params, const FcFwdMaps& maps) {
    using namespace fc_pipe;
    constexpr bool Is_fp8 = In::kBytes == 1;
    constexpr int kCons = kBM / 64;                                     // consumer warpgroups
    constexpr int kThreads = 128 * (kCons + 1);
    constexpr fc_u32 kConsumers = 128u * (fc_u32)kCons;                 // consumer threads
    static_assert(kCons == 2 || (kCons == 3 && !Is_fp8), "2 consumer warpgroups, or 3 (16-bit)");
    constexpr int kRowElems = 128 / In::kBytes;                          // per 128-byte row
    constexpr fc_u32 kQColBlock = (fc_u32)kBM * 128u;                   // [kBM rows][128 B]
    constexpr fc_u32 kQTile = (fc_u32)(kD / kRowElems) * kQColBlock;    // kBM x kD
    constexpr fc_u32 kKVBlock = (fc_u32)kBlockN * 128u;                 // [kBlockN][128 B] block
    constexpr fc_u32 kTile = (fc_u32)(kD / kRowElems) * kKVBlock;       // one K or V tile
    constexpr int kNT = kBlockN / 8;
    constexpr int kRaw = Is_fp8 ? 2 : 0;                                // FP8: V as loaded
    // FP8 at head dim 128: 16 scores a clock per SM from the products against MUFU's 16
    // exponentials, so the softmax is the bound; every 8th n8 tile's exponentials go to the FMA
    // pipe (fc_exp2_poly: 9 issue slots for a MUFU op's 8 clocks): +0-6% (runs 102-103 of the
    // performance log; every 4th or 2nd tile slower); not with softcap (not measured there).
    // FC_DIAG_POLY_EVERY overrides (timing; 0: none).
#ifdef FC_DIAG_POLY_EVERY
    constexpr int kPolyEvery = FC_DIAG_POLY_EVERY;
#else
    constexpr int kPolyEvery = Is_fp8 && kD == 128 && !Has_softcap ? 8 : 0;
#endif
    // O's rescale skipped after key blocks where no row of a warp took a new maximum, at head
    // dims 64 and 256 (run 103, same process: d64 +0-5%, d256 level to +2%, FP8 d256 +0-9%);
    // at 128 the branch cost more than the multiplies (bf16 -8% to +1%, FP8 with the FMA-pipe
    // exponentials -2 to -6%).
    // FC_DIAG_RESCALE_ALWAYS: after every block (timing; the same corr, so the same bits).
    // The conditional rescale (FwdRows::softmax's kThreshold: the reference maximum moves only
    // past 2^8 in P, so that O's rescale is skipped for most blocks) in the 16-bit kernels at
    // head dim 256: runs 116 and 119 of the performance log (H100, same process, over the
    // default): +1-6% in 4 of 6 and +2-5% in 5 of 6 d256 cells (-1% in the other), but d128
    // -2 to -4% and d64 mixed (-6% to +1%); not with FP8 (see softmax).
#ifdef FC_DIAG_RESCALE_THRESHOLD
    constexpr int kRescaleThreshold = FC_DIAG_RESCALE_THRESHOLD;
#else
    constexpr int kRescaleThreshold = !Is_fp8 && kD == 256 ? 8 : 0;
#endif
    constexpr bool kExactCorr = kD != 128;
#ifdef FC_DIAG_RESCALE_ALWAYS
    constexpr bool kSkipRescale = false;
#else
    constexpr bool kSkipRescale = kExactCorr || kRescaleThreshold > 0;   // (corr 1: no row moved)
#endif
    // Ping-pong's turns: per tile (the last consumer opens the tile's first turn after its
    // first softmax and skips its last hand-over), or, FC_DIAG_PP_CHAIN (timing: the A/B of
    // FlashAttention-3's order), one chain through all of a CTA's tiles: the last consumer
    // opens the first turn once, before the first tile, and every turn is handed on, so that
    // consumer 0 may issue the products of a tile's second block while the last consumer is
    // still in the previous tile's epilogue (the first S and the last P V stay outside the
    // turns in both; consumer 0 takes the chain's last hand-over after its last tile).
#ifdef FC_DIAG_PP_CHAIN
    constexpr bool kPPChain = kPingPong;
#else
    constexpr bool kPPChain = false;
#endif
    // The softmax of S_{i+1} is written to run under this warpgroup's own P_i V_i (between
    // wgmma_wait<1> and wgmma_wait<0>), but ptxas schedules register-only arithmetic freely
    // across WARPGROUP.DEPBAR and barriers, and left alone it puts the wait for P_i V_i
    // before the whole softmax: in every instantiation read (nvcc 13.0, 16-bit and FP8, head
    // dims 64 / 128 / 256; the PTX has the exponentials before the wait), so the softmax
    // starts only once the product is done. The fence ends the basic block after the softmax
    // with a branch on the row sums (schedule_after), above which ptxas does not hoist the
    // wait: the exponentials then all precede it. On by default in the 16-bit kernels at head
    // dims 64 and 256 without dropout (session 36 of the performance log, H100, same run: d64
    // +1-5% but a level 2k causal cell, d256 +2-13%; at d128 -3% to +2%, FP8 d128 -5 to -8%,
    // FP8 d256 level: off there). Not with dropout (its d128 kernel spills 28 bytes with it
    // under nvcc 13) nor in the FP8 softcap kernels at head dim 256 (4-12 bytes under NVRTC
    // 12). FC_DIAG_SOFTMAX_FENCE: wherever it fits (all 16-bit and FP8 kernels but those),
    // FC_DIAG_SOFTMAX_FENCE_DROPOUT: with dropout too, FC_DIAG_NO_SOFTMAX_FENCE: nowhere (the
    // A/Bs; timing only, the same bits).
#if defined(FC_DIAG_NO_SOFTMAX_FENCE)
    constexpr bool kSoftmaxFence = false;
#elif defined(FC_DIAG_SOFTMAX_FENCE_DROPOUT)   // (and with dropout)
    constexpr bool kSoftmaxFence = !(Has_softcap && kD == 256);
#elif defined(FC_DIAG_SOFTMAX_FENCE)
    constexpr bool kSoftmaxFence = !Is_dropout && !(Has_softcap && kD == 256);
#else
    constexpr bool kSoftmaxFence = !Is_fp8 && !Is_dropout && (kD == 64 || kD == 256);
#endif
    static_assert(!(Is_fp8 && Is_dropout), "FP8 attention is forward only, without dropout");
    static_assert(!Is_varlen || !kPersistent, "varlen: one tile a CTA");
    static_assert(kOBufs == 0 || kOBufs == kCons || (kOBufs == 1 && kCons == 2),
                  "an O buffer per consumer warpgroup, or one that two consumers take in turn");
    constexpr fc_u32 kOTile = (fc_u32)kD * 128u;                        // 64 x kD, 16-bit
    // Registers after reallocation. __launch_bounds__(kThreads, 1) starts every thread at
    // 65536 / kThreads rounded down to 8 (384: 168; 512: 128), and the split must not exceed
    // what the block holds (a consumer's setmaxnreg.inc waits until the pool has the
    // registers: an overdrawn split hangs, as the FP8 kernel's first 32 / 240 did). FP8's
    // producer transposes V within the same 24. The persistent producer's tile loop needs
    // more than 24 (ptxas spills it): 40 / 232 there, and 32 / 160 with 3 consumers; so does
    // the paged producer's unrolled copy (kPagedOk: the windowed varlen instantiations; the
    // loop rolled up within 24 took 1.16-1.23x as long at pages of 16, run 179).
    constexpr int kEntryRegs = (65536 / kThreads) / 8 * 8;
    constexpr int kPagedCh = kD / 8;                                // 16-byte chunks a row
    constexpr int kPagedRPT = kBlockN * kPagedCh / 128;             // rows a producer thread
    constexpr bool kPagedOk = Is_varlen && !Is_fp8 && Is_local && kBlockN * kPagedCh % 128 == 0
                              && kPagedRPT >= 1 && 16 % kPagedRPT == 0;
    constexpr bool kRichProducer = kPersistent || kPagedOk;
    constexpr int kProducerRegs = kRichProducer ? (kCons == 3 ? 32 : 40) : 24;
    constexpr int kConsumerRegs = kCons == 3 ? 160 : (kRichProducer ? 232 : 240);
    static_assert(128 * kProducerRegs + (int)kConsumers * kConsumerRegs <= kThreads * kEntryRegs,
                  "the register split overdraws the block's registers");

    extern __shared__ unsigned char smem_raw[];
    const fc_u32 sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const fc_u32 sK = sQ + kQTile;
    // FP8: a V^T stage is [ceil(kBlockN / 128)][kD][128] bytes (transpose_v), kTile but at
    // 192- and 224-key blocks
    constexpr fc_u32 kVtTile = Is_fp8 ? (fc_u32)((kBlockN + 127) / 128) * (fc_u32)kD * 128u
                                      : kTile;
    const fc_u32 sV = sK + (fc_u32)kStages * kTile;       // (FP8: V^T)
    const fc_u32 sVraw = sV + (fc_u32)kStages * kVtTile;  // (FP8 only)
    const fc_u32 sO = sVraw + (fc_u32)kRaw * kTile;       // kOBufs O buffers
    // mbarriers after the tiles: full Q, empty Q, then full K, full V, empty K, empty V (one
    // per stage each), then (FP8) the raw V ring's full barriers, then the tile scheduler's
    // two slots (full, empty each), the slots themselves (two int32) and (kOBufs = 1) o_free
    const fc_u32 bars = sO + (fc_u32)kOBufs * kOTile;
    const fc_u32 bar_q = bars, empty_q = bars + 8u;
    auto full_k = [&](int st) { return bars + 8u * (fc_u32)(2 + st); };
    auto full_v = [&](int st) { return bars + 8u * (fc_u32)(2 + kStages + st); };
    auto empty_k = [&](int st) { return bars + 8u * (fc_u32)(2 + 2 * kStages + st); };
    auto empty_v = [&](int st) { return bars + 8u * (fc_u32)(2 + 3 * kStages + st); };
    auto raw_full = [&](int r) { return bars + 8u * (fc_u32)(2 + 4 * kStages + r); };
    const fc_u32 sched = bars + 8u * (fc_u32)(2 + 4 * kStages + kRaw);
    auto slot_full = [&](int j) { return sched + 8u * (fc_u32)j; };
    auto slot_empty = [&](int j) { return sched + 16u + 8u * (fc_u32)j; };
    auto slot = [&](int j) { return sched + 32u + 4u * (fc_u32)j; };
    const fc_u32 o_free = sched + 40u;
    // the threads that read the slots: the consumers, and the FP8 producer's other 127
    constexpr fc_u32 kSlotReaders = Is_fp8 ? kConsumers + 127u : kConsumers;

    // The CTA's tiles. One per CTA (the grid is (query blocks, heads, batch)), or, persistent,
    // a dynamic schedule: the first tile is blockIdx.x, then producer thread 0 takes the next
    // from a global counter (params.split_counter: zero before the launch; the CTA that takes
    // its last value puts it back to zero) and hands it to the CTA's other threads through a
    // two-deep ring of shared-memory slots. Tiles are numbered in (batch, head, query block)
    // order, the query block fastest, so that the CTAs at work at one time share a head's K
    // and V in L2; with a window (causal) a head's query blocks go last to first (longest
    // first), a chunk of them for every head in turn (fc_pipe::chunked_tile).
    const int num_m = kPersistent ? (params.seqlen_q + kBM - 1) / kBM : (int)gridDim.x;
    const int n_tiles = kPersistent ? num_m * params.nheads * params.batch : 1;
    auto next_tile = [&]() {      // (producer thread 0)
        const int c = atomicAdd(params.split_counter, 1);
        if (c == n_tiles - 1) atomicExch(params.split_counter, 0);   // the last of n_tiles takes
        return c + (int)gridDim.x;
    };
    auto publish = [&](int u, int tile) {   // (producer thread 0) tile number u of this CTA
        const int j = u & 1;
        if (u >= 2) mbar_wait(slot_empty(j), (fc_u32)((u >> 1) - 1) & 1u);
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(slot(j)), "r"(tile) : "memory");
        mbar_arrive(slot_full(j));
    };
    auto receive = [&](int u) {
        const int j = u & 1;
        mbar_wait(slot_full(j), (fc_u32)(u >> 1) & 1u);
        int tile;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(tile) : "r"(slot(j)) : "memory");
        mbar_arrive(slot_empty(j));
        return tile;
    };
    // With a window (causal), tiles go out chunk by chunk, longest first (chunked_tile).
    auto tile_block = [&](int tile) {
        int m = (int)blockIdx.x, h = (int)blockIdx.y, b = (int)blockIdx.z;
        if constexpr (Is_local) {
            const FcTileXYZ t = kPersistent ? chunked_tile(tile, num_m, params.nheads, params.batch)
                                            : chunked_tile(linear_block(), (int)gridDim.x,
                                                           (int)gridDim.y, (int)gridDim.z);
            m = t.x;
            h = t.y;
            b = t.z;
        } else if constexpr (kPersistent) {
            m = tile % num_m;
            const int bh = tile / num_m;
            h = bh % params.nheads;
            b = bh / params.nheads;
        }
        return FwdBlock<kBlockN, Is_local, kBM>(params, Is_local ? num_m - 1 - m : m, h, b);
    };
    auto runs = [](const FwdBlock<kBlockN, Is_local, kBM>& blk) { return !blk.empty_rows() && !blk.no_keys(); };

    const int tid = threadIdx.x;
    const int wg = tid >> 7;
    // Varlen over a paged cache (16-bit, params.block_table set; the host launches the
    // windowed instantiation, whose key blocks, 128 keys at head dims 64 and 128 and 64 at
    // 256, divide pages of 128 and 256 and split into runs of kPagedRPT rows that divide 16).
    // The maps of k and v see the pool (num_blocks, page_size, h_k, d). Pages that hold whole
    // key blocks are read by TMA, one box per column block; others (paged_cp) are copied by
    // the producer warpgroup with cp.async (the producer says how).
    const bool paged = kPagedOk && params.block_table != nullptr;
    const bool paged_cp = paged && params.page_size % kBlockN != 0;
    if constexpr (!kPersistent) {
        const FwdBlock<kBlockN, Is_local, kBM> blk = tile_block(0);
        if (blk.empty_rows()) return;
        if (blk.no_keys()) {
            blk.store_empty(params, kD, tid, kThreads);
            return;
        }
    }

    if (tid == 0) {
        tma_prefetch_map(maps.q);
        tma_prefetch_map(maps.k);
        tma_prefetch_map(maps.v);
        mbar_init(bar_q, 1);
        mbar_init(empty_q, kConsumers);
        for (int st = 0; st < kStages; ++st) {
            mbar_init(full_k(st), paged_cp ? 128 : 1);
            mbar_init(full_v(st), Is_fp8 || paged_cp ? 128 : 1);
            mbar_init(empty_k(st), kConsumers);
            mbar_init(empty_v(st), kConsumers);
        }
        for (int r = 0; r < kRaw; ++r) mbar_init(raw_full(r), 1);
        for (int j = 0; j < 2; ++j) {
            mbar_init(slot_full(j), 1);
            mbar_init(slot_empty(j), kSlotReaders);
        }
        if (kOBufs == 1) mbar_init(o_free, 1);
        fence_barrier_init();
    }
    __syncthreads();

    // Pipeline positions carried from tile to tile: kv = key blocks through the K/V ring so
    // far (block it of a tile is use (kv + it) / kStages of stage (kv + it) % kStages), nq = Q
    // tiles so far (Q's barriers flip once per tile).
    int kv = 0, nq = 0;
    if (wg == 0) {
        // ---- producer ----------------------------------------------------------------
        setmaxnreg_dec<kProducerRegs>();
        // (16-bit: thread 0 issues every load; over a paged cache of pages that do not hold
        // whole key blocks the warpgroup copies K and V, see below)
        if (!Is_fp8 && !paged_cp && tid != 0) return;
        FC_TL_CTA_BEGIN(0);
        int tile = kPersistent ? (int)blockIdx.x : 0;
        for (int u = 0;; ++u) {
            int next = n_tiles;
            if constexpr (kPersistent) {
                if (tid == 0) {
                    publish(u, tile);
                    if (tile < n_tiles) next = next_tile();   // (its latency hides under the loads)
                } else {
                    tile = receive(u);
                }
            }
            if (tile >= n_tiles) break;
            const FwdBlock<kBlockN, Is_local, kBM> blk = tile_block(tile);
            FC_TL_STAMP(0, nq, FC_TL_TILE_SLOT, 0);
            FC_TL_VALUE(0, nq, FC_TL_TILE_SLOT, 6, tile);
            tile = next;
            if (!runs(blk)) continue;
            const int n_iter = blk.n_block_max - blk.n_block_min;   // >= 1
            auto n0_of = [&](int it) { return (blk.n_block_max - 1 - it) * kBlockN; };
            auto load_q = [&]() {
                if (nq > 0) mbar_wait(empty_q, (fc_u32)(nq - 1) & 1u);   // the last tile's S done
                mbar_expect_tx(bar_q, kQTile);
#pragma unroll
                for (int c = 0; c < kD / kRowElems; ++c)
                    tma_load_4d(sQ + (fc_u32)c * kQColBlock, maps.q, bar_q, kRowElems * c,
                                (Is_varlen ? (int)blk.q_row0 : 0) + blk.m0, blk.h,
                                Is_varlen ? 0 : blk.b);
            };
            // Paged (see the top of ws_forward). Pages that hold whole key blocks: TMA reads a
            // block as one box per column block at (row in page, pool block), thread 0 reading
            // the table entry of the next block one block ahead (page_at).
            const int* bt = params.block_table + (long long)blk.b * params.block_table_batch_stride;
            int pg = 0, prow = 0;     // (the block being loaded: pool block, row in it)
            auto page_at = [&](int it, int& row) {
                const int n0 = n0_of(it), q = n0 / params.page_size;
                row = n0 - q * params.page_size;
                return fc_pool_block(bt[q], params.num_blocks);
            };
            auto load_k = [&](int it) {
                const int u = kv + it, st = u % kStages;
                if (u >= kStages) mbar_wait(empty_k(st), ((fc_u32)(u / kStages) & 1u) ^ 1u);
#ifdef FC_DIAG_KV_HALF   // (timing only: every other block reuses a stage's stale K, wrong results)
                if (u >= kStages && (u & 1)) { mbar_arrive(full_k(st)); return; }
#endif
                mbar_expect_tx(full_k(st), kTile);
#pragma unroll
                for (int c = 0; c < kD / kRowElems; ++c)
                    tma_load_4d(sK + (fc_u32)st * kTile + (fc_u32)c * kKVBlock, maps.k, full_k(st),
                                kRowElems * c,
                                paged ? prow : (Is_varlen ? (int)blk.k_row0 : 0) + n0_of(it),
                                blk.hk, paged ? pg : Is_varlen ? 0 : blk.b);
            };
            // V of block it into `dst`, completing on `bar`
            auto load_v = [&](int it, fc_u32 dst, fc_u32 bar) {
#ifdef FC_DIAG_KV_HALF   // (and V: half the K/V bytes from L2, the same products)
                if (!Is_fp8 && kv + it >= kStages && ((kv + it) & 1)) { mbar_arrive(bar); return; }
#endif
                mbar_expect_tx(bar, kTile);
#pragma unroll
                for (int c = 0; c < kD / kRowElems; ++c)
                    tma_load_4d(dst + (fc_u32)c * kKVBlock, maps.v, bar, kRowElems * c,
                                paged ? prow : (Is_varlen ? (int)blk.k_row0 : 0) + n0_of(it),
                                blk.hk, paged ? pg : Is_varlen ? 0 : blk.b);
            };
            if (paged_cp) {
                // Pages that do not hold whole key blocks (pages of 16, vLLM's): the warpgroup
                // copies each block with cp.async, thread t kRPT consecutive rows of 16-byte
                // column chunk t % kCh from row (t / kCh) kRPT on. kRPT divides 16 (kPagedOk) and
                // pages are multiples of 16, so a thread's rows lie in one page: one table entry
                // a block. Rows past the sequence's end are zero-filled. The full barriers count
                // the 128 threads, each arriving once its copies have landed
                // (cp.async.mbarrier.arrive, FlashAttention-3's paged producer's arrival; the
                // thread goes on at once).
                const int pc = tid % kPagedCh, pr0 = (tid / kPagedCh) * kPagedRPT;
                auto copy_block = [&](int it, fc_u32 dst, const void* base, long long block_stride,
                                      long long row_stride, long long head_stride) {
                    const int t0 = n0_of(it) + pr0;
                    const int valid = blk.sk - t0;        // rows of this thread's run with keys
                    const fc_u16* src = static_cast<const fc_u16*>(base)
                                        + (long long)blk.hk * head_stride + pc * 8;
                    if (valid > 0) {          // (else nothing is read: the pool's first row)
                        const int q = t0 / params.page_size;
                        src += (long long)fc_pool_block(bt[q], params.num_blocks) * block_stride
                               + (long long)(t0 - q * params.page_size) * row_stride;
                    }
                    // (row pr0 + i's chunk pc & 7 at (pc ^ i) & 7 of its 128 bytes: pr0 % 8 = 0;
                    // the run's rows past the sequence's end lie in its page and are not read)
                    fc_u32 d = dst + (fc_u32)(pc >> 3) * kKVBlock + (fc_u32)pr0 * 128u;
                    const fc_u32 cx = (fc_u32)(pc & 7) * 16u;
#pragma unroll
                    for (int i = 0; i < kPagedRPT; ++i) {
                        cp_async_16(d + (cx ^ (fc_u32)((i & 7) * 16)), src, i < valid);
                        src += row_stride;
                        d += 128u;
                    }
                };
                for (int it = 0; it < n_iter; ++it) {
                    const int u = kv + it, st = u % kStages;
                    if (u >= kStages) mbar_wait(empty_k(st), ((fc_u32)(u / kStages) & 1u) ^ 1u);
                    copy_block(it, sK + (fc_u32)st * kTile, params.k, params.k_batch_stride,
                               params.k_row_stride, params.k_head_stride);
                    cp_async_mbar_arrive(full_k(st));
                    if (it == 0 && tid == 0) load_q();
                    if (u >= kStages) mbar_wait(empty_v(st), ((fc_u32)(u / kStages) & 1u) ^ 1u);
                    copy_block(it, sV + (fc_u32)st * kTile, params.v, params.v_batch_stride,
                               params.v_row_stride, params.v_head_stride);
                    cp_async_mbar_arrive(full_v(st));
                }
                cp_async_commit();         // (the thread's copies landed before it exits)
                cp_async_wait<0>();
            } else if constexpr (!Is_fp8) {
                // K of the first block before Q: its stage frees while the last tile's S
                // products run, Q's only once the last of them is done
                int pg_next = 0, prow_next = 0;
                if (paged) pg_next = page_at(0, prow_next);
                for (int it = 0; it < n_iter; ++it) {
                    const int u = kv + it, st = u % kStages;
                    FC_TL_STAMP(0, nq, it, 0);
                    if (paged) {
                        pg = pg_next;
                        prow = prow_next;
                        if (it + 1 < n_iter) pg_next = page_at(it + 1, prow_next);   // (one ahead)
                    }
                    load_k(it);
                    FC_TL_STAMP(0, nq, it, 1);
                    if (it == 0) load_q();
                    if (it == 0) FC_TL_STAMP(0, nq, FC_TL_TILE_SLOT, 1);
                    if (u >= kStages) mbar_wait(empty_v(st), ((fc_u32)(u / kStages) & 1u) ^ 1u);
                    FC_TL_STAMP(0, nq, it, 2);
                    load_v(it, sV + (fc_u32)st * kTile, full_v(st));
                    FC_TL_STAMP(0, nq, it, 3);
                }
            } else {
                // thread 0 issues the loads one block ahead (K into the ring, V into the raw
                // ring), then the warpgroup transposes V of this block into its V^T stage;
                // named barrier 3 ends a block: the raw buffer it read is free for the load of
                // block it + 2 (issued at the top of step it + 1). The raw ring's position is
                // kv + it too.
                if (tid == 0) {
                    load_k(0);
                    load_v(0, sVraw + (fc_u32)(kv & 1) * kTile, raw_full(kv & 1));
                    load_q();
                }
                for (int it = 0; it < n_iter; ++it) {
                    const int u = kv + it, st = u % kStages;
                    FC_TL_STAMP(0, nq, it, 0);
                    if (tid == 0 && it + 1 < n_iter) {
                        load_k(it + 1);
                        load_v(it + 1, sVraw + (fc_u32)((u + 1) & 1) * kTile, raw_full((u + 1) & 1));
                    }
                    FC_TL_STAMP(0, nq, it, 1);
                    mbar_wait(raw_full(u & 1), (fc_u32)(u >> 1) & 1u);
                    if (u >= kStages) mbar_wait(empty_v(st), ((fc_u32)(u / kStages) & 1u) ^ 1u);
                    FC_TL_STAMP(0, nq, it, 2);
                    if constexpr (Is_varlen) {
                        // the walk's first block, the last of the tile's keys: its rows past the
                        // sequence's end (the next sequence's, or of none: NaN included) zeroed
                        // in the raw V before the transpose, so that P's zeros meet zeros
                        // (tile-uniform; fenced: the buffer is TMA's again two blocks on)
                        const int valid = blk.sk - n0_of(0);
                        if (it == 0 && valid < kBlockN) {
                            zero_tile_rows<kD / kRowElems, kBlockN>(
                                sVraw + (fc_u32)(u & 1) * kTile, valid, tid, 128);
                            fence_proxy_async();
                            named_sync(3, 128);
                        }
                    }
                    __syncwarp();
#ifndef FC_DIAG_FP8_NO_TRANSPOSE     // (timing only: V^T left as it is, wrong results)
                    transpose_v<kD, kBlockN>(sV + (fc_u32)st * kVtTile, sVraw + (fc_u32)(u & 1) * kTile,
                                             tid);
#endif
                    fence_proxy_async();    // the stores, visible to the consumers' wgmma
                    mbar_arrive(full_v(st));
                    FC_TL_STAMP(0, nq, it, 3);
                    named_sync(3, 128);
                }
            }
            kv += n_iter;
            ++nq;
        }
        FC_TL_CTA_END(0);
        return;
    }

    // ---- consumers -------------------------------------------------------------------------
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1;                     // consumer warpgroup: tile rows [64 cw, 64 cw + 64)
    // (this warpgroup's Q rows, a uniform base for the S product's descriptors; FP8 keeps it
    // per lane: made uniform there, ptxas spilled 48-52 bytes in the softcap kernels)
    const fc_u32 sQwg = Is_fp8 ? sQ + (fc_u32)cw * 64u * 128u
                               : warp_uniform(sQ + (fc_u32)cw * 64u * 128u);
    FC_TL_CTA_BEGIN(1 + cw);
    if (kPPChain && cw == kCons - 1) named_arrive(1, 256);
    for (int u = 0;; ++u) {
        const int tile = kPersistent ? receive(u) : u;
        if (tile >= n_tiles) break;
        // (the timeline's tile number: Q tiles so far, as the producer's)
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 0);
        const FwdBlock<kBlockN, Is_local, kBM> blk = tile_block(tile);
        if (blk.empty_rows()) continue;
        if (blk.no_keys()) {            // (persistent only: the one-tile CTA returned above)
            blk.store_empty(params, kD, tid - 128, (int)kConsumers);
            continue;
        }
        const int n_iter = blk.n_block_max - blk.n_block_min;   // >= 1
        FwdRows<Elem, kD, kBlockN, Is_local, Is_dropout, kBM> rows(params, blk, tid - 128);
        float s_scale = 1.f;                       // FP8: q_descale * k_descale
        float v_scale = 1.f;                       // FP8: v_descale (the epilogue's)
        float cap_in = 0.f;                        // softcap: s -> tanh(s cap_in)
        if constexpr (Is_fp8) {
            const long long di = (long long)blk.b * params.nheads_k + blk.hk;
            if (params.q_descale != nullptr) s_scale *= params.q_descale[di];
            if (params.k_descale != nullptr) s_scale *= params.k_descale[di];
            if (params.v_descale != nullptr) v_scale = params.v_descale[di];
            // (softcap: the descales and the softmax scale go into cap_in; the rows hold
            // t = tanh(s cap_in), whose softmax is exp(softcap (t - max t)): params.scale_log2
            // = softcap log2(e), and the lse is softcap max t + log l)
            if constexpr (Has_softcap)
                cap_in = __fdividef(params.softmax_scale * s_scale, params.softcap);
            else
                rows.mult *= s_scale;
        }
        float s[kNT * 4];
#pragma unroll
        for (int i = 0; i < kNT * 4; ++i) s[i] = 0.f;
        // the score modifications before the mask (DESIGN.md's order: scale, softcap, mask;
        // the softcap's factor is in rows.mult)
        auto cap = [&]() {
            if constexpr (Has_softcap) {
#pragma unroll
                for (int i = 0; i < kNT * 4; ++i) s[i] = fc_tanh(s[i] * cap_in);
            }
        };
        fc_u32 pa[Is_fp8 ? kBlockN / 32 : kBlockN / 16][4];
        float corr[2];
        auto stage_of = [&](int it) { return (kv + it) % kStages; };
        auto parity_of = [&](int it) { return (fc_u32)((kv + it) / kStages) & 1u; };
        auto pack = [&](int n0) {
            if constexpr (Is_fp8) {
#ifndef FC_DIAG_FP8_NO_PACK           // (timing only: P's registers as they were, wrong results)
                rows.pack_e4m3(s, pa);
#else
                if (n0 == (blk.n_block_max - 1) * kBlockN) rows.pack_e4m3(s, pa);
#endif
            }
            else
                rows.pack(s, pa, n0);
        };
        auto issue_pv_ = [&](fc_u32 sVb) {
            if constexpr (Is_fp8)
                issue_pv_e4m3<kD, kBlockN>(rows.acc_o, pa, sVb);
            else
                issue_pv<Elem, kBlockN>(rows.acc_o, pa, sVb);
        };

        // Causal (a right-bounded window): the walk's first `skip` blocks may lie wholly past
        // the last key that this warpgroup's rows see (the tile's later rows see them; at head
        // dim 64's 192-row tiles 10% of the (warpgroup, block) steps at 2k keys, 8% at 4k). The
        // warpgroup releases their stages and passes their ping-pong turns without a product,
        // so that every barrier still sees its arrivals; its walk starts at block `skip`. The
        // tile's last warpgroup never skips (its rows are the tile's last). At least one block
        // is walked. Three consumer warpgroups only (head dim 64; run 183 of the performance
        // log: +2.7-3.9% at 1k-2k causal, +1.6% at 4k); with two, a warpgroup skips one block
        // in every tile at most, and the FP8 causal softcap and the paged d256 dropout kernels
        // spill with the code (NVRTC 12). (FC_DIAG_NO_WG_SKIP: every block walked, the A/B's
        // control.)
        int skip = 0;
#ifndef FC_DIAG_NO_WG_SKIP
        if constexpr (Is_local && kCons == 3) {
            if (blk.right_bounded) {
                const int seen = blk.blocks_seen(params, blk.m0 + min(64 * cw + 63, blk.rows_q - 1));
                skip = min(blk.n_block_max - seen, n_iter - 1);   // (seen <= n_block_max)
                skip = (int)warp_uniform((fc_u32)skip);   // (the stages' addresses stay uniform)
            }
        }
#endif
        // varlen: the walk's first block, the last of the tile's keys: past the sequence's end?
        // (tile-uniform; FP8: the producer zeroes the raw V instead) Consumer warpgroup 0 zeroes
        // those V rows, all consumers meet at named barrier 4 (the ping-pong's are 1 .. kCons)
        // before any P V product (after S_0, so that S_0 does not wait for V_0; a warpgroup
        // that skips block 0 meets it while it passes that block)
        auto zero_v0 = [&]() {
            if constexpr (Is_varlen && !Is_fp8) {
                const int valid = blk.sk - (blk.n_block_max - 1) * kBlockN;
                if (valid < kBlockN) {
                    mbar_wait(full_v(stage_of(0)), parity_of(0));
                    if (cw == 0)
                        zero_tile_rows<kD / kRowElems, kBlockN>(sV + (fc_u32)stage_of(0) * kTile,
                                                                valid, tid - 128, 128);
                    fence_proxy_async();
                    named_sync(4, (int)kConsumers);
                }
            }
        };
        for (int j = 0; j < skip; ++j) {
            mbar_wait(full_k(stage_of(j)), parity_of(j));
            mbar_arrive(empty_k(stage_of(j)));
            mbar_wait(full_v(stage_of(j)), parity_of(j));
            if (j == 0) zero_v0();
            mbar_arrive(empty_v(stage_of(j)));
            if (kPingPong) {                      // (turn j of the loop below, passed; the last
                named_sync(1 + cw, 256);          // warpgroup, whose last hand-over is left out,
                named_arrive(1 + (cw + 1) % kCons, 256);   // never skips)
            }
        }

        int nb = blk.n_block_max - 1 - skip;
        FC_TL_VALUE(1 + cw, nq, FC_TL_TILE_SLOT, 7, n_iter);
        FC_TL_STAMP(1 + cw, nq, FC_TL_QWAIT_STEP, 0);
        mbar_wait(bar_q, (fc_u32)nq & 1u);
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 1);
        mbar_wait(full_k(stage_of(skip)), parity_of(skip));
        issue_s<In, kD, kBlockN, kBM>(s, sQwg, sK + (fc_u32)stage_of(skip) * kTile);
        wgmma_wait<0>();
        settle(s);
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 2);
        mbar_arrive(empty_k(stage_of(skip)));
        cap();
        rows.mask(s, nb * kBlockN);
        rows.template softmax<kPolyEvery, kExactCorr, kRescaleThreshold>(s, corr);   // O is 0
        pack(nb * kBlockN);
        if (skip == 0) zero_v0();
        // Ping-pong: consumer cw issues its products after named barrier 1 + cw, then hands
        // the turn to the next (cw + 1, the last to consumer 0). The last consumer opens the
        // first turn for consumer 0 and skips its last hand-over, so that every barrier sees
        // as many arrivals as waits within a tile.
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 3);
        if (kPingPong && !kPPChain && cw == kCons - 1 && n_iter > 1) named_arrive(1, 256);
        for (int it = skip; it < n_iter - 1; ++it, --nb) {   // every block but the last
            const int st0 = stage_of(it), st1 = stage_of(it + 1);
            FC_TL_STAMP(1 + cw, nq, it, 0);
            mbar_wait(full_k(st1), parity_of(it + 1));
            mbar_wait(full_v(st0), parity_of(it));
            FC_TL_STAMP(1 + cw, nq, it, 1);
            if (kPingPong) named_sync(1 + cw, 256);
            FC_TL_STAMP(1 + cw, nq, it, 2);
            issue_s<In, kD, kBlockN, kBM>(s, sQwg, sK + (fc_u32)st1 * kTile);   // S_{i+1}
            issue_pv_(sV + (fc_u32)st0 * kVtTile);                         // O += P_i V_i
            if (kPingPong && (kPPChain || !(cw == kCons - 1 && it == n_iter - 2)))
                named_arrive(1 + (cw + 1) % kCons, 256);
            FC_TL_STAMP(1 + cw, nq, it, 3);
            wgmma_wait<1>();                       // S_{i+1} done (P_i V_i may still run)
            settle(s);
            FC_TL_STAMP(1 + cw, nq, it, 4);
            mbar_arrive(empty_k(st1));
            cap();
            rows.mask(s, (nb - 1) * kBlockN);
            const bool grew =
                rows.template softmax<kPolyEvery, kExactCorr, kRescaleThreshold>(s, corr);
            if constexpr (kSoftmaxFence)
                schedule_after(rows.row_sum[0] + rows.row_sum[1]);   // (see kSoftmaxFence)
            FC_TL_STAMP(1 + cw, nq, it, 5);
            wgmma_wait<0>();
            settle(rows.acc_o);
            settle(pa);
            FC_TL_STAMP(1 + cw, nq, it, 6);
            mbar_arrive(empty_v(st0));
            if (!kSkipRescale || __any_sync(0xFFFFFFFFu, grew)) rows.rescale(corr);
            pack((nb - 1) * kBlockN);
            FC_TL_STAMP(1 + cw, nq, it, 7);
        }
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 4);
        mbar_arrive(empty_q);                      // every S of the tile is done: Q is free
        {
            const int last = n_iter - 1;
            mbar_wait(full_v(stage_of(last)), parity_of(last));
            issue_pv_(sV + (fc_u32)stage_of(last) * kVtTile);
            wgmma_wait<0>();
            settle(rows.acc_o);
            settle(pa);
            mbar_arrive(empty_v(stage_of(last)));
        }
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 5);
        // the epilogue (see above): O through this warpgroup's buffer and a TMA store, or
        // from the registers
#ifndef FC_DIAG_O_STG     // (timing only: O stored from the registers, as without O buffers)
        const bool o_tma = kOBufs > 0 && !Is_varlen && params.o_tma;
#else
        const bool o_tma = false;
#endif
        // (the one thread's bulk operations are guarded instructions, not branches: see
        // sm90_pipeline.cuh)
        const bool issuer = (tid & 127) == 0;
        const fc_u32 sOwg = sO + (kOBufs == 1 ? 0u : (fc_u32)cw * kOTile);
        if (o_tma) {
            if constexpr (kOBufs == 1) {
                // use 2 nq + cw waits for the previous use's arrival; every thread of the
                // warpgroup waits (its own last arrival, two uses back, is done: the thread that
                // made it took part in this tile's products since, so the parity cannot be a
                // phase behind)
                const int use = 2 * nq + cw;
                if (use > 0) mbar_wait(o_free, (fc_u32)(use - 1) & 1u);
            } else {
                bulk_wait_read_if<0>(issuer);      // the last tile's store has read the buffer
            }
            FC_TL_STAMP(1 + cw, nq, FC_TL_EPI_STEP, 0);
            named_sync(8 + cw, 128);
        }
        FC_TL_STAMP(1 + cw, nq, FC_TL_EPI_STEP, 1);
        rows.template store<Has_softcap>(params, blk, v_scale, s_scale, o_tma, sOwg);
        FC_TL_STAMP(1 + cw, nq, FC_TL_EPI_STEP, 2);
        if (o_tma) {
            fence_proxy_async();                   // the buffer's stores, seen by the TMA unit
            named_sync(8 + cw, 128);
            FC_TL_STAMP(1 + cw, nq, FC_TL_EPI_STEP, 3);
#pragma unroll
            for (int c = 0; c < kD / 64; ++c)
                tma_store_4d_if(issuer, maps.o, sOwg + (fc_u32)c * (64u * 128u), 64 * c,
                                blk.m0 + 64 * cw, blk.h, blk.b);
            bulk_commit_if(issuer);
            FC_TL_STAMP(1 + cw, nq, FC_TL_EPI_STEP, 4);
            if constexpr (kOBufs == 1) {
                bulk_wait_read_if<0>(issuer);
                mbar_arrive_if(issuer, o_free);
            }
        }
        FC_TL_STAMP(1 + cw, nq, FC_TL_TILE_SLOT, 6);
        kv += n_iter;
        ++nq;
    }
    if (kPPChain && cw == 0) named_sync(1, 256);            // the chain's last hand-over
    if (kOBufs > 0) bulk_wait_if<0>((tid & 127) == 0);    // this warpgroup's stores done
    FC_TL_CTA_END(1 + cw);
}

}  // namespace fc_h

// Warp-specialised forward, 16-bit inputs (see the top of the file and ws_forward). kBM: query
// rows per tile (64 per consumer warpgroup: 128, or 192 at head dim 64); kBlockN: keys per
// block (64, 128, or 176 as FA3 takes at head dim 128; 80 at head dim 256, as FA3); kStages: K/V ring depth; kPingPong: the
// consumers issue their products in turn; kPersistent: a grid of at most one CTA per SM, each
// taking tiles from the dynamic scheduler (grid (query blocks, heads, batch) otherwise).
// Is_varlen: varlen calls (one tile a CTA; ws_forward says how). kOBufs: O buffers for the
// TMA-store epilogue (ws_forward), as many as shared memory holds (flashcore/kernels/forward.py).
template <typename Elem, int kD, int kBM, int kBlockN, bool Is_local, bool Is_dropout,
          int kStages, bool kPingPong, bool kPersistent, bool Is_varlen = false, int kOBufs = 0>
__global__ void __launch_bounds__(2 * kBM + 128, 1)   // kBM / 64 consumer warpgroups + 1
flash_fwd_sm90_ws_kernel(const FlashParams params, const __grid_constant__ FcFwdMaps maps) {
    static_assert(kD == 64 || kD == 128 || kD == 256, "head dims 64, 128 and 256");
    static_assert((kBlockN == 64 || kBlockN == 128 || kBlockN == 176 || kBlockN == 80) &&
                  (kD != 256 || kBlockN == 64 || kBlockN == 80),
                  "key blocks of 64, 128 or 176 (the S wgmma's N); 64 or 80 at head dim 256");
    static_assert(kBM == 128 || (kBM == 192 && kD == 64), "128-row tiles, or 192 at head dim 64");
    fc_h::ws_forward<Elem, Elem, kD, kBM, kBlockN, Is_local, Is_dropout, kStages, kPingPong,
                     kPersistent, Is_varlen, false, kOBufs>(params, maps);
}

// Warp-specialised forward of float8_e4m3fn q, k, v (FlashAttention-3's FP8 forward; the
// tensor maps read them as bytes): out in Elem (fc_bf16 / fc_fp16, or float32 with
// params.o_fp32), lse float32. Head dims 128 and 256 (128-byte rows: one or two column
// blocks); kBlockN = 128 keys (one 128-byte V^T row); 128-row tiles.
template <typename Elem, int kD, int kBlockN, bool Is_local, int kStages, bool kPingPong,
          bool kPersistent, bool Is_varlen = false, bool Has_softcap = false, int kOBufs = 0>
__global__ void __launch_bounds__(384, 1)
flash_fwd_sm90_fp8_kernel(const FlashParams params, const __grid_constant__ FcFwdMaps maps) {
    static_assert(kD == 128 || kD == 256, "FP8: head dims 128 and 256");
    static_assert(kBlockN == 128 || ((kBlockN == 192 || kBlockN == 224) && kD == 128),
                  "FP8: key blocks of 128 (one 128-byte row of V^T), or 192 / 224 at head dim 128");
    fc_h::ws_forward<Elem, fc_e4m3, kD, 128, kBlockN, Is_local, false, kStages, kPingPong,
                     kPersistent, Is_varlen, Has_softcap, kOBufs>(params, maps);
}
