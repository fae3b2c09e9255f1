// flashcore: FlashAttention-2 style forward kernel (Ampere-class path: mma.sync, ldmatrix,
// cp.async). Runs on sm_80 and newer, compiled by NVRTC (see flashcore/jit.py); the launcher is
// flashcore/kernels/forward.py.
//
// One CTA computes a kBlockM x headdim tile of the output for one (batch, head). It walks the
// key/value blocks that the mask leaves visible, from the last one down to the first, keeping
//   * the Q fragments of its rows in registers (kQInRegs) or in shared memory,
//   * S = Q K^T (fp32), the running row max m and row sum l, and the un-normalised O (fp32)
//     in registers,
// and writes O / l (16-bit) and lse = log(l) + m (float32, natural log) at the end.
//
// Warp split (FA2): warp w owns rows [w * 16 * kMT, (w + 1) * 16 * kMT) of the Q tile, as kMT
// m16 slices. A row's scores live in the four lanes of one mma quad, so the softmax needs only
// two shuffles per reduction and no shared-memory exchange between warps. kMT = 2 makes every
// K / V fragment fetched by ldmatrix feed two mma instead of one, halving the shared-memory
// traffic per FLOP (which is what bounds mma.sync attention at 16 rows per warp).
//
// Pipeline: K and V are double-buffered, each tile its own cp.async group, issued one whole
// iteration ahead:   groups in flight ... K[i] V[i] | K[i+1] V[i+1]
//   top of iteration i:  wait_group 1 (K[i] landed; V[i] may still fly) + __syncthreads
//                        (also: every warp is done with iteration i-1, so its buffers are free)
//                        issue K[i+1], V[i+1] into the other buffers
//                        S = Q K[i]^T, mask, online softmax
//   middle:              wait_group 2 (V[i] landed) + __syncthreads
//                        O += P V[i]
// Groups are committed even when empty (last iteration) so that the counts stay uniform.
//
// Shared memory: Q (kBlockM x D), K[2] and V[2] (kBlockN x D each), 16-bit, stored in column
// blocks of W = 64 (or 32) elements, i.e. [D / W][rows][W], and inside a block the 16-byte
// chunk index is XOR-swizzled with the row (swz<W> in ptx.cuh). The 8 row addresses of one
// ldmatrix phase then fall in 8 different bank groups, and so do the cp.async writes of 8
// consecutive threads. Column blocks make head dims 96 and 192 (not a multiple of 64) swizzle
// without leaving the row.
#include "flash_params.cuh"
#include "flash_dropout.cuh"
#include "ptx.cuh"
#include "flash_scores.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace fc_fwd {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void sts32(fc_u32 addr, fc_u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}

// The generic copy of load_tile and load_tile_paged (16-byte chunks that do not split into whole
// rows a thread: head dims 96 and 192), chunk by chunk; off(r, c): the element offset from gsrc
// of row r's chunk c, taken only for the chunks copied (the others are zero-filled).
template <int ROWS, int D, int W, int NT, bool Is_even_d, typename Off>
__device__ __forceinline__ void copy_chunks(fc_u32 sdst, const fc_u16* gsrc, int rows_valid,
                                            int headdim, int tid, Off off) {
    constexpr int kCPR = D / 8;
    constexpr int kTotal = ROWS * kCPR;
    constexpr int kIters = (kTotal + NT - 1) / NT;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int idx = tid + it * NT;
        if (kTotal % NT != 0 && idx >= kTotal) break;
        const int r = idx / kCPR;
        const int c = idx % kCPR;
        const bool pred = r < rows_valid && (Is_even_d || c * 8 < headdim);
        const fc_u16* src = pred ? gsrc + off(r, c) : gsrc;
        cp_async_16(sdst + 2u * (fc_u32)tile_off<W, ROWS>(r, c * 8), src, pred);
    }
}

// Copy a ROWS x D tile (rows of `row_stride` elements starting at gsrc) into a swizzled shared
// tile. Rows >= rows_valid and columns >= headdim are zero-filled by cp.async (src-size 0), so
// padded keys give S = 0 before masking and padded V rows / columns contribute exactly 0.
template <int ROWS, int D, int W, int NT, bool Is_even_d>
__device__ __forceinline__ void load_tile(fc_u32 sdst, const fc_u16* gsrc, long long row_stride,
                                          int rows_valid, int headdim, int tid) {
    constexpr int kCPR = D / 8;             // 16-byte chunks per row
    if constexpr (NT % kCPR == 0 && (ROWS * kCPR) % NT == 0 && (NT / kCPR) % 8 == 0) {
        // Fast path: each thread owns one column chunk and every kRS-th row. kRS is a multiple
        // of 8, so the swizzle of its rows is the same and the shared address advances by a
        // constant; the global address advances by kRS rows. Only two 64-bit values live
        // across the loop (keeping one per chunk costs registers the mma loop needs).
        constexpr int kRS = NT / kCPR;
        const int r0 = tid / kCPR;
        const int c = tid % kCPR;
        const bool col_ok = Is_even_d || c * 8 < headdim;
        const fc_u32 s0 = sdst + 2u * (fc_u32)tile_off<W, ROWS>(r0, c * 8);
        const fc_u16* src = gsrc + (long long)r0 * row_stride + c * 8;
        const long long step = (long long)kRS * row_stride;
#pragma unroll
        for (int it = 0; it < ROWS / kRS; ++it) {
            const bool pred = col_ok && r0 + it * kRS < rows_valid;
            cp_async_16(s0 + 2u * it * kRS * W, pred ? src : gsrc, pred);
            src += step;
        }
    } else {
        copy_chunks<ROWS, D, W, NT, Is_even_d>(sdst, gsrc, rows_valid, headdim, tid,
            [=](int r, int c) { return (long long)r * row_stride + c * 8; });
    }
}

// load_tile for the keys n0 .. n0 + ROWS - 1 of a paged cache: key t is row t % page_size of
// pool block bt[t / page_size] (clamped into the pool), gsrc the head's base in block 0;
// page_size any multiple of 16. Where the threads split the tile's rows evenly, a thread copies
// kRPT consecutive rows (a divisor of 16) starting at a multiple of kRPT: they lie in one
// page, so a thread reads one table entry and does one division a tile. Otherwise (head dims
// 96 and 192: few chunks a thread) each chunk looks up its own row. A row past rows_valid is
// not copied (zero-filled) and its table entry not read: rows_valid = sk - n0 with sk at most
// the table's capacity keeps every index read inside the table's row.
template <int ROWS, int D, int W, int NT, bool Is_even_d>
__device__ __forceinline__ void load_tile_paged(fc_u32 sdst, const fc_u16* gsrc, const int* bt,
                                                int n0, int page_size, int num_blocks,
                                                long long block_stride, long long row_stride,
                                                int rows_valid, int headdim, int tid) {
    constexpr int kCPR = D / 8;             // 16-byte chunks per row
    if constexpr (NT % kCPR == 0 && (ROWS * kCPR) % NT == 0 && 16 % (ROWS * kCPR / NT) == 0) {
        constexpr int kRPT = ROWS * kCPR / NT;
        const int r0 = (tid / kCPR) * kRPT;
        const int c = tid % kCPR;
        const bool col_ok = Is_even_d || c * 8 < headdim;
        const int t0 = n0 + min(r0, rows_valid - 1);   // (rows_valid >= 1)
        const int pg = t0 / page_size;
        const fc_u16* src = gsrc + (long long)fc_pool_block(bt[pg], num_blocks) * block_stride
                            + (long long)(n0 + r0 - pg * page_size) * row_stride + c * 8;
#pragma unroll
        for (int i = 0; i < kRPT; ++i) {
            const bool pred = col_ok && r0 + i < rows_valid;
            cp_async_16(sdst + 2u * (fc_u32)tile_off<W, ROWS>(r0 + i, c * 8),
                        pred ? src + (long long)i * row_stride : gsrc, pred);
        }
    } else {
        copy_chunks<ROWS, D, W, NT, Is_even_d>(sdst, gsrc, rows_valid, headdim, tid,
            [=](int r, int c) {
                const int t = n0 + r, pg = t / page_size;
                return (long long)fc_pool_block(bt[pg], num_blocks) * block_stride
                       + (long long)(t - pg * page_size) * row_stride + c * 8;
            });
    }
}

}  // namespace fc_fwd

// Template parameters (all compile-time):
//   Elem        fc_bf16 / fc_fp16
//   kHeadDim    head-dim tile: 32, 64, 96, 128, 192, 256 (the real headdim may be smaller)
//   kBlockM     query rows per CTA;  kBlockN keys per iteration;  kNWarps warps per CTA
//   kQInRegs    keep the Q fragments in registers for the whole CTA (else ldmatrix per k-step)
//   Is_local    any window side bounded (causal included): block skipping + boundary masks
//   Has_softcap s -> softcap * tanh(s * scale / softcap)
//   Has_alibi   s -> s - slope * |i + sk - sq - j|
//   Is_even_d   real headdim == kHeadDim (no column predicates)
//   Is_paged    varlen over a paged cache (params.block_table; load_tile_paged)
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kQInRegs,
          bool Is_local, bool Has_softcap, bool Has_alibi, bool Is_even_d, bool Is_dropout,
          bool Is_paged = false>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_fwd_kernel(const FlashParams params) {
    using namespace fc_fwd;
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kMT = kBlockM / (16 * kNWarps);   // m16 slices per warp
    constexpr int kNT = kBlockN / 8;                // n8 tiles of S per slice
    constexpr int kDT = kHeadDim / 8;               // n8 tiles of O per slice
    constexpr int kKD = kHeadDim / 16;              // k16 steps of Q K^T
    constexpr int kW = (kHeadDim % 64 == 0) ? 64 : 32;  // swizzle column-block width
    constexpr int kJW = kW / 16;                    // 16-column steps per column block
    // Scores are kept raw (unscaled) when only a scale applies, so that the exponent is one
    // FFMA: exp(scale * (s - m)) = 2^(s * scale_log2 - m * scale_log2). With softcap or ALiBi
    // the scores are first mapped to natural-log units (scaled, capped, biased), and the
    // exponent multiplier becomes log2(e).
    constexpr bool kNatural = Has_softcap || Has_alibi;
    static_assert(kBlockM % (16 * kNWarps) == 0, "kBlockM must be a multiple of 16 * kNWarps");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "tiles must be multiples of 16");
    static_assert(kHeadDim % kW == 0, "head-dim tile must be a multiple of the swizzle width");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const fc_u32 sQ = smem_u32(smem_raw);
    const fc_u32 sK = sQ + 2u * kBlockM * kHeadDim;           // two K buffers
    const fc_u32 sV = sK + 2u * 2 * kBlockN * kHeadDim;       // two V buffers
    constexpr fc_u32 kKVBytes = 2u * kBlockN * kHeadDim;      // one K (or V) buffer

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;   // mma group: accumulator rows g and g + 8
    const int t = lane & 3;    // thread in quad: accumulator columns 2t, 2t + 1

    // Heavier m-blocks first when the mask makes the work uneven (causal: late rows see more).
    const int m_block = Is_local ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;

    // ---- sequence geometry ------------------------------------------------------------------
    long long q_row0 = 0, k_row0 = 0;   // first row of this sequence in packed (varlen) tensors
    int sq = params.seqlen_q, sk = params.seqlen_k;
    if (params.cu_seqlens_q != nullptr) {
        const FcSeqRange r = fc_seq_range(params.cu_seqlens_q, b, params.total_q, params.seqlen_q);
        q_row0 = r.row0;
        sq = r.len;
    }
    // Paged K/V (varlen over a paged cache, block_table given): sequence b's key t is row
    // t % page_size of pool block block_table[b][t / page_size]; cu_seqlens_k gives only the
    // lengths (its rows are not packed anywhere), so the sequence starts at row 0 of its pages.
    constexpr bool paged = Is_paged;
    if (params.cu_seqlens_k != nullptr) {
        const FcSeqRange r = fc_seq_range(params.cu_seqlens_k, b, params.total_k, params.seqlen_k);
        k_row0 = paged ? 0 : r.row0;
        sk = r.len;
    }
    const int m0 = m_block * kBlockM;
    if (m0 >= sq) return;   // varlen: this sequence is shorter than the grid's max
    const int off = sk - sq;   // bottom-right alignment: row i is "at" key i + off

    const int hk = h / (params.nheads / params.nheads_k);
    const fc_u16* gQ = static_cast<const fc_u16*>(params.q) + (long long)b * params.q_batch_stride
                       + (q_row0 + m0) * params.q_row_stride + (long long)h * params.q_head_stride;
    const fc_u16* gK = static_cast<const fc_u16*>(params.k) + (long long)hk * params.k_head_stride
                       + (paged ? 0ll : (long long)b * params.k_batch_stride
                                        + k_row0 * params.k_row_stride);
    const fc_u16* gV = static_cast<const fc_u16*>(params.v) + (long long)hk * params.v_head_stride
                       + (paged ? 0ll : (long long)b * params.v_batch_stride
                                        + k_row0 * params.v_row_stride);
    // The K and V tiles of key block row n0 (a multiple of kBlockN), rows past sk zero-filled.
    // Paged: any page size (a multiple of 16), load_tile_paged; the table entries are clamped
    // into the pool, and sk <= seqlen_k <= max_blocks * page_size keeps every table index read
    // inside its row.
    const int* bt = paged ? params.block_table + (long long)b * params.block_table_batch_stride
                          : nullptr;
    auto load_kv = [&](fc_u32 sdst, const fc_u16* g, int n0, long long block_stride,
                       long long row_stride) {
        if constexpr (paged)
            load_tile_paged<kBlockN, kHeadDim, kW, kNThreads, Is_even_d>(
                sdst, g, bt, n0, params.page_size, params.num_blocks, block_stride, row_stride,
                sk - n0, params.headdim, tid);
        else
            load_tile<kBlockN, kHeadDim, kW, kNThreads, Is_even_d>(
                sdst, g + (long long)n0 * row_stride, row_stride, sk - n0, params.headdim, tid);
    };
    fc_u16* gO = static_cast<fc_u16*>(params.o) + (long long)b * params.o_batch_stride
                 + (q_row0 + m0) * params.o_row_stride + (long long)h * params.o_head_stride;
    // (o_fp32: the same element offsets in a float32 output)
    float* gOf = static_cast<float*>(params.o) + (long long)b * params.o_batch_stride
                 + (q_row0 + m0) * params.o_row_stride + (long long)h * params.o_head_stride;
    float* gLse = params.lse + (long long)b * params.lse_batch_stride
                  + (long long)h * params.lse_head_stride + q_row0 + m0;
    const int rows_q = min(kBlockM, sq - m0);   // valid rows of this tile

    // ---- which key blocks can be visible at all ---------------------------------------------
    // Blocks entirely outside the window of every row of this tile are skipped, not masked:
    // with causal masking that halves the work, with a sliding window it makes it O(window).
    const bool left_bounded = Is_local && params.window_left < FC_WINDOW_NONE;
    const bool right_bounded = Is_local && params.window_right < FC_WINDOW_NONE;
    int n_block_max = (sk + kBlockN - 1) / kBlockN;
    int n_block_min = 0;
    if (right_bounded) {
        // last visible key of the tile's last valid row, + 1
        const long long hi = (long long)(m0 + rows_q - 1) + off + params.window_right + 1;
        const int nb = hi <= 0 ? 0 : (int)min((hi + kBlockN - 1) / kBlockN, (long long)n_block_max);
        n_block_max = min(n_block_max, nb);
    }
    if (left_bounded) {
        const long long lo = (long long)m0 + off - params.window_left;  // first row's first key
        if (lo > 0) n_block_min = (int)min(lo / kBlockN, (long long)n_block_max);
    }

    if (n_block_max <= n_block_min) {
        // No row of this tile sees any key (sk = 0, causal with sq > sk, windows):
        // output exactly 0, lse = -inf.
        constexpr int kCPR = kHeadDim / 8;
        const fc_u32 zero[4] = {0u, 0u, 0u, 0u};
        for (int idx = tid; idx < kBlockM * kCPR; idx += kNThreads) {
            const int r = idx / kCPR, c = idx % kCPR;
            if (r < rows_q && (Is_even_d || c * 8 < params.headdim)) {
                if (params.o_fp32) {   // 8 floats: two 16-byte chunks
                    float* d = gOf + (long long)r * params.o_row_stride + c * 8;
                    stg128(reinterpret_cast<fc_u16*>(d), zero);
                    stg128(reinterpret_cast<fc_u16*>(d + 4), zero);
                } else {
                    stg128(gO + (long long)r * params.o_row_stride + c * 8, zero);
                }
            }
        }
        for (int r = tid; r < rows_q; r += kNThreads) gLse[r] = -INFINITY;
        return;
    }

    // ---- prologue: Q, then the first K and V tiles, three cp.async groups ----------------
    const int headdim = params.headdim;
    int n_block = n_block_max - 1;
    load_tile<kBlockM, kHeadDim, kW, kNThreads, Is_even_d>(sQ, gQ, params.q_row_stride, rows_q,
                                                           headdim, tid);
    cp_async_commit();
    {
        const int n0 = n_block * kBlockN;
        load_kv(sK, gK, n0, params.k_batch_stride, params.k_row_stride);
        cp_async_commit();
        load_kv(sV, gV, n0, params.v_batch_stride, params.v_row_stride);
        cp_async_commit();
    }

    // ---- per-lane ldmatrix offsets (fc_ldmatrix_offsets: the fragment layouts) -------------
    int a_off[kJW], k_off[kJW];
    fc_ldmatrix_offsets<kW>(lane, a_off, k_off);
    const int warp_row0 = warp * 16 * kMT;   // first tile row owned by this warp
    const fc_u32 sQw = sQ + 2u * warp_row0 * kW;

    auto q_addr = [&](int mt, int kk) -> fc_u32 {
        return sQw + 2u * ((kk / kJW) * (kBlockM * kW) + mt * 16 * kW + a_off[kk % kJW]);
    };

    // ---- Q fragments ----------------------------------------------------------------------
    fc_u32 qf[kQInRegs ? kMT : 1][kQInRegs ? kKD : 1][4];
    if constexpr (kQInRegs) {
        cp_async_wait<2>();   // Q landed (K, V of the first block may still be in flight)
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int kk = 0; kk < kKD; ++kk) ldmatrix_x4(qf[mt][kk], q_addr(mt, kk));
    }

    // ---- per-row state --------------------------------------------------------------------
    // Thread rows: slice mt, half r -> tile row warp_row0 + mt*16 + g + 8r.
    float acc_o[kMT][kDT][4];
    fc_zero_fragment(acc_o);
    float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[mt][r] = -INFINITY;
            row_sum[mt][r] = 0.f;
        }
    // Diagonal position i + sk - sq of this thread's first row (slice 0, half 0); the others
    // are + mt*16 + 8r. Row bounds are derived from it where needed instead of being kept in
    // registers (register pressure is what limits the tile sizes). The window sizes are
    // clamped to values with the same meaning (a right window >= sq or a left window >= sk
    // reaches past every key) so that the int arithmetic below cannot overflow.
    const int row_pos0 = m0 + warp_row0 + g + off;
    const int win_r = right_bounded ? min(params.window_right, sq) : 0;
    const int win_l = left_bounded ? min(params.window_left, sk) : 0;
    float alibi_slope = 0.f;
    if constexpr (Has_alibi)
        alibi_slope = params.alibi_slopes[(long long)b * params.alibi_batch_stride + h];
    const float mult = kNatural ? kLog2e : params.scale_log2;
    FcDropout drop{};
    const int drop_bh = b * params.nheads + h;
    if constexpr (Is_dropout)
        drop = fc_dropout_setup(params.dropout_rng, params.dropout_threshold, params.dropout_scale);
    const float cap_in = Has_softcap ? params.softmax_scale / params.softcap : 0.f;

    // A block needs the element mask iff it is not fully visible to every row of the tile
    // (rows past sq included: they are computed but never stored, masking them is harmless).
    const int blk_hi = right_bounded ? min(sk, m0 + off + win_r + 1) : sk;   // upper-mask free below
    const int blk_lo = left_bounded ? m0 + kBlockM - 1 + off - win_l : 0;    // lower-mask free from

    // ---- main loop over key blocks, last to first ----------------------------------------
    for (int it = 0; n_block >= n_block_min; ++it, --n_block) {
        const int n0 = n_block * kBlockN;
        const fc_u32 buf = (fc_u32)(it & 1) * kKVBytes;

        cp_async_wait<1>();   // K[it] landed
        __syncthreads();      // ... for every thread; and buffers of iteration it-1 are free

        if (n_block - 1 >= n_block_min) {   // prefetch the next block into the other buffers
            const int n1 = n0 - kBlockN;
            const fc_u32 nbuf = kKVBytes - buf;
            load_kv(sK + nbuf, gK, n1, params.k_batch_stride, params.k_row_stride);
            cp_async_commit();
            load_kv(sV + nbuf, gV, n1, params.v_batch_stride, params.v_row_stride);
            cp_async_commit();
        } else {
            cp_async_commit();
            cp_async_commit();
        }

        // S = Q K^T  (fp32 accumulators, kMT x kNT n8 tiles)
        float s[kMT][kNT][4];
        fc_qk_product<Elem, kKD, kBlockN, kW, kQInRegs>(s, qf, q_addr, sK + buf, 0, k_off);

        // Score modifications, in the order of DESIGN.md: scale, softcap, ALiBi, mask; then the
        // online softmax step (flash_scores.cuh). A row's position relative to this lane's
        // first key column n0 + 2t: i + off - (n0 + 2t).
        auto pos_of = [&](int mt, int r) { return row_pos0 + mt * 16 + 8 * r - n0 - 2 * t; };
        fc_scale_scores<Has_softcap, Has_alibi>(s, params.softcap, cap_in, params.softmax_scale);
        if constexpr (Has_alibi)
            fc_alibi_scores(s, [&](int, int) { return alibi_slope; }, pos_of);
        const bool need_mask = n0 + kBlockN > blk_hi || n0 < blk_lo;
        if (need_mask)      // only boundary blocks (usually one or two per tile)
            fc_mask_scores<kMT, kNT, kBlockN>(s, pos_of, sk - n0 - 2 * t, left_bounded,
                                              right_bounded, win_l, win_r);
        fc_online_softmax(s, row_max, row_sum, acc_o, mult);

        // Dropout: P (not the row sums: the lse stays the undropped one's) times 0 or
        // 1 / keep-probability. The 8 probabilities of this lane in a 16 x 16 tile (rows g,
        // g + 8; columns 2t, 2t + 1 of two adjacent n8 tiles); two tiles per Philox call, shared
        // with lane ^ 4 (flash_dropout.cuh).
        if constexpr (Is_dropout) {
            static_assert(kNT % 2 == 0, "dropout: whole 16-key tiles per block");
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int n4 = 0; n4 < kNT; n4 += 4) {
                    const int row0 = m0 + warp_row0 + mt * 16;
                    const int nb = n4 + 2 < kNT ? n4 + 2 : n4;
                    unsigned int keep[2];
                    fc_dropout_keep2(drop, drop_bh, row0, n0 + n4 * 8, row0, n0 + nb * 8, g, t,
                                     false, keep[0], keep[1]);
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        if (x == 1 && nb == n4) break;
                        const int n2 = x ? nb : n4;
#pragma unroll
                        for (int bit = 0; bit < 8; ++bit)   // row g + 8 r, tile n2 + u, column e
                            s[mt][n2 + ((bit >> 1) & 1)][2 * (bit >> 2) + (bit & 1)] *=
                                fc_dropout_keep_factor(drop, keep[x], bit);
                    }
                }
        }

        cp_async_wait<2>();   // V[it] landed (K[it+1], V[it+1] may still be in flight)
        __syncthreads();

        // O += P V, P straight from the S accumulators
        fc_pv_product<Elem, kBlockN, kW>(acc_o, s, sV + buf, 0, a_off);
    }
    // Every group still pending is an empty one from the last iteration.

    // ---- epilogue: O / l, lse ---------------------------------------------------------------
    // lse in natural-log units of the modified scores: m * scale + ln(l) (raw scores) or
    // m + ln(l) (natural-unit scores). l == 0 only for rows that saw no visible key.
    const float lse_scale = kNatural ? 1.f : params.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[mt][r]);
            // l == 0: no visible key (0, lse -inf). l NaN (a NaN input reached this row): the
            // NaN propagates to O and lse instead of reading as a fully masked row.
            const float inv = l == 0.f ? 0.f : 1.f / l;
#pragma unroll
            for (int j = 0; j < kDT; ++j) {
                acc_o[mt][j][2 * r] *= inv;
                acc_o[mt][j][2 * r + 1] *= inv;
            }
            const int row = warp_row0 + mt * 16 + g + 8 * r;
            if (t == 0 && row < rows_q)
                gLse[row] = l == 0.f ? -INFINITY : row_max[mt][r] * lse_scale + logf(l);
        }

    if (params.o_fp32) {
        // Unrounded float32 output: each lane's two adjacent columns straight from the
        // accumulators, 8 bytes a store (the launcher requires an 8-byte aligned o).
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + mt * 16 + g + 8 * r;
                if (row >= rows_q) continue;
                float* orow = gOf + (long long)row * params.o_row_stride;
#pragma unroll
                for (int j = 0; j < kDT; ++j)
                    if (Is_even_d || j * 8 < headdim)
                        *reinterpret_cast<float2*>(orow + j * 8 + 2 * t) =
                            make_float2(acc_o[mt][j][2 * r], acc_o[mt][j][2 * r + 1]);
            }
        return;
    }

    // Stage O through this warp's own rows of the Q tile (no other warp reads them, and Q is
    // no longer needed), then write 16-byte chunks, coalesced along each row.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < kDT; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + mt * 16 + g + 8 * r;
                sts32(sQ + 2u * tile_off<kW, kBlockM>(row, j * 8 + 2 * t),
                      Elem::pack2(acc_o[mt][j][2 * r], acc_o[mt][j][2 * r + 1]));
            }
    __syncwarp();
    {
        constexpr int kCPR = kHeadDim / 8;
        constexpr int kChunks = 16 * kMT * kCPR;   // this warp's rows
        static_assert(kChunks % 32 == 0, "warp-owned output tile must split over 32 lanes");
#pragma unroll
        for (int it = 0; it < kChunks / 32; ++it) {
            const int idx = lane + it * 32;
            const int row = warp_row0 + idx / kCPR;
            const int c = idx % kCPR;
            fc_u32 v[4];
            lds128(v, sQ + 2u * tile_off<kW, kBlockM>(row, c * 8));
            if (row < rows_q && (Is_even_d || c * 8 < headdim))
                stg128(gO + (long long)row * params.o_row_stride + c * 8, v);
        }
    }
}
