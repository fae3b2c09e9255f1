// flashcore: attention backward, Ampere-class path (mma.sync m16n8k16, ldmatrix, cp.async).
//
// FlashAttention-2 structure, four kernels (flashcore/kernels/backward.py launches them):
//
//   1. flash_bwd_preprocess_kernel   D = rowsum(dO * O) in fp32 -> p.dsoftmax_sum (lse layout);
//                                    zeroes its rows of p.dq_accum (allocated uninitialised).
//   2. flash_bwd_dkdv_kernel         one CTA per (key block, kv head, batch). K and V of the block
//                                    stay in shared memory; the CTA loops over the query heads of
//                                    its GQA group and over the query blocks that can see the key
//                                    block, recomputing the probabilities from lse, and keeps dK,
//                                    dV in fp32 registers for the whole loop: the GQA sum over the
//                                    sharing query heads is free and deterministic. With
//                                    Atomic_dq it also adds dS*K of every block into the fp32
//                                    p.dq_accum with red.global.add.
//   3a. flash_bwd_convert_dq_kernel  (atomic mode) dq = dq_accum * softmax_scale -> 16-bit.
//   3b. flash_bwd_dq_kernel          (deterministic mode) one CTA per (query block, head, batch)
//                                    loops over key blocks and accumulates dQ in registers: no
//                                    atomics, so the summation order (and every bit) is fixed.
//
// Math (per head; s = scaled, capped, biased, masked score of the forward):
//   P   = exp(s - lse)                      (lse = -inf for a row with no visible key)
//   dV  = P^T dO          dP = dO V^T       D = rowsum(dO * O) = rowsum(P * dP)
//   dS  = P * (dP - D) * ds/dS_raw,  ds/dS_raw = scale (no softcap) or scale * (1 - tanh^2)
//   dK  = dS^T Q          dQ = dS K
// The factor softmax_scale is left out of dS (which is rounded to 16 bits as an mma operand,
// and is better conditioned without it) and applied once to dK at the end and to dQ in the
// convert kernel / the dQ kernel's epilogue.
//
// Orientation of the key-block kernel. Its warps own KEY rows: a warp computes the transposed
// scores S^T = K Q^T for 16 keys x (its share of) the query block, so the mma accumulator rows
// are keys and its columns are queries. That is exactly the row layout of the A operand of
// dV += P^T dO and dK += dS^T Q (rows = keys, reduction over queries), so when one warp owns a
// key row over the whole query block and the whole head dim (the "register reuse" configs,
// head dim <= 128) P^T and dS^T go from the fp32 accumulators straight into A fragments, as P
// does in the forward's P V product, and never touch shared memory. Only dS^T is stored (as
// 16-bit, [key][query]) because dQ = dS K reduces over keys, i.e. across warps. For head dims
// 192/256 one warp cannot hold dK and dV for 16 keys x the whole head dim (that would be 256
// fp32 registers), so two warps split the head dim for dK/dV and the query block for S^T; P^T
// then also goes through shared memory.
//
// Shared tiles are row-major 16-bit with 16-byte chunks XOR-swizzled by the row (bwd_swz
// below); every writer (cp.async, st.shared of dS/P) and every reader (ldmatrix) goes through
// the same function, so the swizzle is consistent by construction.
#include "flash_params.cuh"
#include "flash_dropout.cuh"
#include "ptx.cuh"
#include "flash_scores.cuh"

#define FC_BWD_LOG2E 1.4426950408889634f

// ---- small helpers (backward-local) ---------------------------------------------------------

// Swizzled element offset of (row, col) in a ROWS x COLS tile. Rows whose chunk count is a
// multiple of 8 XOR the chunk with row % 8 (within its aligned group of 8 chunks); rows of 4 or
// 12 chunks (32 / 96 columns) XOR with (row / 2) % 4 within the aligned group of 4 chunks, which
// keeps the 8 rows of one ldmatrix phase on 8 distinct 16-byte bank groups in both cases.
template <int COLS>
__device__ __forceinline__ int bwd_swz(int row, int col) {
    constexpr int kChunks = COLS / 8;
    static_assert(COLS % 32 == 0, "tile width must be a multiple of 32 elements");
    const int chunk = col >> 3;
    int sw;
    if constexpr (kChunks % 8 == 0) {
        sw = chunk ^ (row & 7);
    } else {
        sw = chunk ^ ((row >> 1) & 3);
    }
    return row * COLS + (sw << 3) + (col & 7);
}

template <int COLS>
__device__ __forceinline__ fc_u32 bwd_saddr(const fc_u16* base, int row, int col) {
    return smem_u32(base + bwd_swz<COLS>(row, col));
}

// Per-lane ldmatrix addressing without re-deriving the swizzle at every call (ptxas otherwise
// hoists dozens of loop-invariant addresses into registers). An ldmatrix.x4 reads a 16x16 block
// whose lanes each supply one 16-byte row; lane l's row inside the block and its chunk-low bit
// are fixed for the kernel, and because a block starts at a row that is a multiple of 16, the
// row's swizzle value is fixed too. Two lane patterns cover every ldmatrix here:
//   kLdsmA: row (l & 7) + 8 * ((l >> 3) & 1), chunk-lo l >> 4  -> A fragment (plain) / B pair (.trans)
//   kLdsmB: row (l & 7) + 8 * (l >> 4), chunk-lo (l >> 3) & 1  -> B pair (plain) / A fragment (.trans)
// The 16-column step c of a block is chunk 2c + lo; inside a swizzle group of 2*kHalf chunks,
// (2c + lo) ^ rsw = ((lo ^ rsw) ^ 2c), so the byte offset is a per-lane constant XOR an
// immediate. xor_lo lets warps that interleave 16-column steps (step kSplit * i + w) fold their
// w into the lane constant and call with c = kSplit * i (valid for kSplit in {1, 2}).
enum { kLdsmA = 0, kLdsmB = 1 };
template <int COLS>
struct BwdLdsm {
    static constexpr int kHalf = (COLS / 8) % 8 == 0 ? 4 : 2;  // 16-column steps per swizzle group
    fc_u32 lane_off;                                            // bytes
    fc_u32 sw;                                                  // bytes
    __device__ __forceinline__ BwdLdsm(int pattern, int lane, int xor_lo = 0) {
        const int row = pattern == kLdsmA ? (lane & 7) + ((lane >> 3) & 1) * 8 : (lane & 7) + (lane >> 4) * 8;
        const int lo = pattern == kLdsmA ? (lane >> 4) : ((lane >> 3) & 1);
        const int rsw = kHalf == 4 ? (row & 7) : ((row >> 1) & 3);
        lane_off = static_cast<fc_u32>(row * COLS * 2);
        sw = static_cast<fc_u32>(((lo ^ rsw) << 4) ^ (xor_lo << 5));
    }
    // Byte offset from the tile start of this lane's row for the block at rows r0.. (r0 % 16 == 0)
    // and 16-column step c (compile-time after unrolling).
    __device__ __forceinline__ fc_u32 operator()(int r0, int c) const {
        return lane_off + static_cast<fc_u32>(r0 * COLS * 2) + (c / kHalf) * (kHalf * 32) +
               (sw ^ static_cast<fc_u32>((c % kHalf) << 5));
    }
};

// fp32 reduction into global memory (no return value: red, not atom). sm_90 has a 2-wide vector
// form, which halves the number of reduction instructions for dQ.
__device__ __forceinline__ void bwd_red_add2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr + 1), "f"(b) : "memory");
#endif
}

__device__ __forceinline__ float bwd_rcp(float x) {  // rcp(+inf) = 0
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The forward and the backward share one tanh (ptx.cuh explains the choice).
__device__ __forceinline__ float bwd_tanh(float x) { return fc_tanh(x); }

// Where one sequence of the batch lives (varlen: rows of the packed tensors).
struct BwdSeq {
    long long q_off, k_off;  // first row of the sequence in the packed tensors (0 otherwise)
    long long q_tile_off;    // its first row in a tile-ordered dQ accumulator (the Hopper
                             // kernels'): varlen, q_off + 64 b rounded down to whole 64-row
                             // tiles, so that every sequence's rows start a tile and its last
                             // tile ends before the next sequence's first; 0 otherwise
    int sq, sk;
};
__device__ __forceinline__ BwdSeq bwd_seq(const FlashParams& p, int b) {
    BwdSeq s;
    s.q_off = 0;
    s.k_off = 0;
    s.q_tile_off = 0;
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
        const FcSeqRange r = fc_seq_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
        s.q_off = r.row0;
        s.q_tile_off = (r.row0 + 64ll * b) & ~63ll;
        s.sq = r.len;
    }
    if (p.cu_seqlens_k != nullptr) {
        const FcSeqRange r = fc_seq_range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);
        s.k_off = r.row0;
        s.sk = r.len;
    }
    return s;
}

// cp.async a ROWS x COLS 16-bit tile (row r at g + r * row_stride) into a swizzled shared tile.
// Rows >= rows_valid and columns >= cols_valid are zero-filled (the source is not read; its
// address is clamped to g so that no out-of-range address is even formed).
template <int ROWS, int COLS, int NT, bool Is_even_d>
__device__ __forceinline__ void bwd_load_tile(fc_u16* s, const fc_u16* g, long long row_stride,
                                              int rows_valid, int cols_valid, int tid) {
    constexpr int kChunksPerRow = COLS / 8;
    constexpr int kTotal = ROWS * kChunksPerRow;
#pragma unroll
    for (int it = 0; it < (kTotal + NT - 1) / NT; ++it) {
        const int idx = it * NT + tid;
        if (kTotal % NT == 0 || idx < kTotal) {
            const int r = idx / kChunksPerRow;
            const int c = (idx % kChunksPerRow) * 8;
            const bool pred = r < rows_valid && (Is_even_d || c < cols_valid);
            const fc_u16* src = pred ? g + r * row_stride + c : g;
            cp_async_16(bwd_saddr<COLS>(s, r, c), src, pred);
        }
    }
}

// The dQ tile width handled by one warp per pass of the key-block kernel's dQ product: as wide
// as possible (64 columns = 32 fp32 registers) while dividing the head dim evenly.
template <int kHeadDim, int kWarpsD>
struct BwdDqCols {
    static constexpr int value = kHeadDim <= 128 && kHeadDim % (64 * kWarpsD) == 0 ? 64
                               : kHeadDim % (48 * kWarpsD) == 0 ? 48
                               : kHeadDim % (32 * kWarpsD) == 0 ? 32
                               : 16;
    static_assert(kHeadDim % (value * kWarpsD) == 0, "no dQ column split for this head dim");
};

// ---- the walk of a key-block CTA over (query head, query block) ---------------------------------
// Query blocks [m_begin, m_end) that can see at least one key of the block at n0 (the same for
// every head of the GQA group): all of them, or, with a window, those its band reaches.
// off = sk - sq.
template <bool Is_local, int kBlockM, int kBlockN>
__device__ __forceinline__ void bwd_query_blocks(const FlashParams& p, const BwdSeq& seq, int n0,
                                                 int off, int& m_begin, int& m_end) {
    m_begin = 0;
    m_end = (seq.sq + kBlockM - 1) / kBlockM;
    if constexpr (Is_local) {
        const long long n1 = min(n0 + kBlockN, seq.sk);
        const long long lo = max(0LL, static_cast<long long>(n0) - off - p.window_right);
        const long long hi =
            min(static_cast<long long>(seq.sq) - 1, n1 - 1 - off + p.window_left);
        if (lo > hi) {
            m_end = 0;
        } else {
            m_begin = static_cast<int>(lo / kBlockM);
            m_end = static_cast<int>(hi / kBlockM) + 1;
        }
    }
}

// The step after (h, m_block) of a key-block CTA's walk: the next query block of the same head,
// or the first block of the next head of the GQA group.
__device__ __forceinline__ void bwd_walk_next(int h, int m_block, int m_begin, int m_end,
                                              int& h_next, int& m_next) {
    h_next = h;
    m_next = m_block + 1;
    if (m_next == m_end) {
        m_next = m_begin;
        ++h_next;
    }
}

// What a key-block CTA of the backward (the dK/dV kernels of both families) derives from its
// key block n0 of sequence b and its kv head hk before its walk over (query head, query block):
// off = sk - sq, the GQA group (ratio heads from h0), the query blocks [m_begin, m_end) that
// see the block, the walk's length, and the sequence's first rows of q and dO.
struct BwdKeyWalk {
    int off, ratio, h0, m_begin, m_end, n_iter, rows_k;
    const fc_u16* gq;
    const fc_u16* gdo;
};
template <bool Is_local, int kBlockM, int kBlockN>
__device__ __forceinline__ BwdKeyWalk bwd_key_walk(const FlashParams& p, const BwdSeq& seq,
                                                   int b, int hk, int n0) {
    BwdKeyWalk w;
    w.off = seq.sk - seq.sq;
    w.ratio = p.nheads / p.nheads_k;
    w.h0 = hk * w.ratio;
    bwd_query_blocks<Is_local, kBlockM, kBlockN>(p, seq, n0, w.off, w.m_begin, w.m_end);
    const int n_m = w.m_end > w.m_begin ? w.m_end - w.m_begin : 0;
    w.n_iter = n_m * w.ratio;
    w.gq = static_cast<const fc_u16*>(p.q) + b * p.q_batch_stride + seq.q_off * p.q_row_stride;
    w.gdo = static_cast<const fc_u16*>(p.dout) + b * p.do_batch_stride +
            seq.q_off * p.do_row_stride;
    w.rows_k = seq.sk - n0;
    return w;
}

// ---- 1. preprocess: D = rowsum(dO * O) --------------------------------------------------------
// Grid (ceil(seqlen_q / 64), nheads, batch), 256 threads: groups of 8 lanes own one row at a
// time, each lane reading 16-byte chunks of dO and O (head dim is a multiple of 8).
// Full_tiles: the dQ accumulator holds whole 64-row tiles (the tile-ordered layout of the Hopper
// kernels' dQ reduction, flash_bwd_sm90.cu: a dense call's rows padded to a multiple of 64, a
// varlen call's sequences each starting a tile at BwdSeq::q_tile_off): all 64 rows of the CTA's
// tile are zeroed.
template <typename Elem, bool Full_tiles = false>
__global__ void __launch_bounds__(256) flash_bwd_preprocess_kernel(const FlashParams p) {
    constexpr int kRows = 64;
    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq = bwd_seq(p, b);
    const int m0 = blockIdx.x * kRows;
    if (m0 >= seq.sq) return;
    const int grp = threadIdx.x >> 3, l8 = threadIdx.x & 7;
    const int nchunks = p.headdim >> 3;
#pragma unroll
    for (int r = grp; r < kRows; r += 32) {
        const int i = m0 + r;
        float acc = 0.f;
        if (i < seq.sq) {
            const long long row = seq.q_off + i;
            const fc_u16* o = static_cast<const fc_u16*>(p.o) + b * p.o_batch_stride +
                              row * p.o_row_stride + h * p.o_head_stride;
            const fc_u16* dout = static_cast<const fc_u16*>(p.dout) + b * p.do_batch_stride +
                                 row * p.do_row_stride + h * p.do_head_stride;
            for (int c = l8; c < nchunks; c += 8) {
                const uint4 vo = *reinterpret_cast<const uint4*>(o + c * 8);
                const uint4 vd = *reinterpret_cast<const uint4*>(dout + c * 8);
                const fc_u32 wo[4] = {vo.x, vo.y, vo.z, vo.w};
                const fc_u32 wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc += Elem::to_float(static_cast<fc_u16>(wo[e] & 0xffffu)) *
                           Elem::to_float(static_cast<fc_u16>(wd[e] & 0xffffu));
                    acc += Elem::to_float(static_cast<fc_u16>(wo[e] >> 16)) *
                           Elem::to_float(static_cast<fc_u16>(wd[e] >> 16));
                }
            }
        }
        // All 32 lanes shuffle (rows past the end contribute 0): the 8 lanes of a group reduce.
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (l8 == 0 && i < seq.sq) {
            p.dsoftmax_sum[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_off + i] = acc;
        }
    }
    // The fp32 dQ accumulator's rows of this CTA start at zero (the dK/dV kernel, launched
    // next on the stream, adds into them): the launcher allocates it uninitialised, so no
    // separate fill is launched. Rows are dq_accum_row_stride (the head-dim tile) floats, a
    // multiple of 4: 16-byte stores.
    if (p.dq_accum != nullptr) {
        const int rows = Full_tiles ? kRows : min(kRows, seq.sq - m0);
        const int n4 = (int)(p.dq_accum_row_stride >> 2);
        float* base = p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride +
                      ((Full_tiles ? seq.q_tile_off : seq.q_off) + m0) * p.dq_accum_row_stride;
        for (int idx = threadIdx.x; idx < rows * n4; idx += blockDim.x) {
            const int r = idx / n4, c = idx - r * n4;
            *reinterpret_cast<float4*>(base + r * p.dq_accum_row_stride + 4 * c) =
                make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
}

// ---- shared elementwise step: P and dS from the raw score and dP ---------------------------------
// Everything in fp32. neg_lse2 = -lse * log2(e), or -inf for a row that must not contribute
// (no visible key: forward lse = -inf; or a row past seqlen_q): exp2(finite + -inf) = +0, so the
// row's P and dS are exactly 0 -- never exp2(-inf - (-inf)) = NaN. Masked elements are zeroed by
// a select, not by pushing -inf through the exponent.
struct BwdScoreMath {
    float scale_log2;   // softmax_scale * log2(e)                  (no softcap)
    float cap_in;       // softmax_scale / softcap                  (softcap)
    float cap_log2;     // softcap * log2(e)                        (softcap)
    float slope_log2;   // alibi slope * log2(e)                    (alibi)
    int off;            // sk - sq
    int wl, wr;         // window (FC_WINDOW_NONE = unbounded)
    int sk;
    int bh;             // batch * nheads + head (dropout's stream)
    FcDropout drop;     // dropout (threshold 0: none)

    // With dropout (factor zf of element (i, j): 0, or 1 / keep probability, regenerated from
    // the forward's stream by the caller, a fragment at a time: dropout_keep_s / _st): O =
    // (P∘Z) V, so s_to_p becomes P∘Z (for dV) and dS = P∘(dP∘Z - D) with D = rowsum(dO∘O) as
    // without.
    template <bool Has_softcap, bool Has_alibi, bool Is_local, bool Is_dropout = false>
    __device__ __forceinline__ void apply(float& s_to_p, float& dp_to_ds, int i, int j,
                                          float neg_lse2, float dsum, bool need_mask,
                                          float zf = 1.f) const {
        float x, dtanh = 1.f;
        if constexpr (Has_softcap) {
            const float tt = bwd_tanh(s_to_p * cap_in);
            x = fmaf(tt, cap_log2, neg_lse2);
            dtanh = fmaf(-tt, tt, 1.f);
        } else {
            x = fmaf(s_to_p, scale_log2, neg_lse2);
        }
        if constexpr (Has_alibi) {
            x -= slope_log2 * fabsf(static_cast<float>(i + off - j));
        }
        float pr = fc_exp2(x);
        if (need_mask) {
            const int rel = j - i - off;  // visible iff -wl <= rel <= wr
            bool vis = j < sk;
            if constexpr (Is_local) vis = vis && rel >= -wl && rel <= wr;
            pr = vis ? pr : 0.f;
        }
        float ds = pr * (Is_dropout ? fmaf(dp_to_ds, zf, -dsum) : dp_to_ds - dsum);
        if constexpr (Has_softcap) ds *= dtanh;
        s_to_p = Is_dropout ? pr * zf : pr;
        dp_to_ds = ds;
    }

    __device__ __forceinline__ float keep_factor(unsigned int keep, int bit) const {
        return fc_dropout_keep_factor(drop, keep, bit);
    }
    // Keep masks of the 16 x 16 tiles A at (query qa, key ka) and B (qb, kb; may be A): a
    // thread's S^T fragments (rows = keys) or S fragments (rows = queries); one Philox call per
    // lane, warp-synchronous. Bit layouts: flash_dropout.cuh.
    __device__ __forceinline__ void keep2_st(int qa, int ka, int qb, int kb, int g, int t,
                                             unsigned int& keep_a, unsigned int& keep_b) const {
        fc_dropout_keep2(drop, bh, qa, ka, qb, kb, g, t, true, keep_a, keep_b);
    }
    __device__ __forceinline__ void keep2_s(int qa, int ka, int qb, int kb, int g, int t,
                                            unsigned int& keep_a, unsigned int& keep_b) const {
        fc_dropout_keep2(drop, bh, qa, ka, qb, kb, g, t, false, keep_a, keep_b);
    }
};

// Whether the kernels below run a step's elementwise code in two copies (fc_mask_copies): with a
// causal mask or a window (Is_local) and compiled for sm_90 or newer. Without a window the keys'
// end is the only mask, a few compares a step, and a second copy made ptxas spill more (NVRTC 12:
// 16 -> 84 bytes in the d128 v2 kernel); on sm_80, where no measurement can be taken here,
// ptxas spilled more in 10 of the 54 local instantiations checked (up to +56 bytes): one copy
// there, as before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <bool Is_local> constexpr bool kBwdSplitMask = Is_local;
#else
template <bool Is_local> constexpr bool kBwdSplitMask = false;
#endif

__device__ __forceinline__ BwdScoreMath bwd_score_math(const FlashParams& p, int b, int h,
                                                       const BwdSeq& seq, bool has_alibi) {
    BwdScoreMath m;
    m.scale_log2 = p.softmax_scale * FC_BWD_LOG2E;
    m.cap_in = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;
    m.cap_log2 = p.softcap * FC_BWD_LOG2E;
    m.slope_log2 = has_alibi ? p.alibi_slopes[b * p.alibi_batch_stride + h] * FC_BWD_LOG2E : 0.f;
    m.off = seq.sk - seq.sq;
    m.wl = p.window_left;
    m.wr = p.window_right;
    m.sk = seq.sk;
    m.bh = b * p.nheads + h;
    m.drop = FcDropout{};
    if (p.dropout_rng != nullptr)
        m.drop = fc_dropout_setup(p.dropout_rng, p.dropout_threshold, p.dropout_scale);
    return m;
}

// -neg lse in log2 units and D for query row i of head h (see BwdScoreMath).
__device__ __forceinline__ void bwd_row_stats(const FlashParams& p, int b, int h, const BwdSeq& seq,
                                              int i, float& neg_lse2, float& dsum) {
    if (i < seq.sq) {
        const long long o = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_off + i;
        const float l = p.lse[o];
        neg_lse2 = l == -__int_as_float(0x7f800000) ? l : -l * FC_BWD_LOG2E;
        dsum = p.dsoftmax_sum[o];
    } else {
        neg_lse2 = -__int_as_float(0x7f800000);
        dsum = 0.f;
    }
}

// ---- the key-block kernels' shared pieces (flash_bwd_dkdv_kernel, flash_bwd_dkdv2_kernel) --------

// Their dynamic shared memory, carved (layout in the comment of flash_bwd_dkdv_kernel below);
// sP takes no room when P^T stays in registers (has_p false).
template <int kHeadDim, int kBlockM, int kBlockN>
struct BwdTiles {
    fc_u16 *sK, *sV, *sQ, *sdO, *sdS, *sP;
    float *sLse, *sDsum;
    __device__ __forceinline__ BwdTiles(unsigned char* raw, bool has_p) {
        sK = reinterpret_cast<fc_u16*>(raw);
        sV = sK + kBlockN * kHeadDim;
        sQ = sV + kBlockN * kHeadDim;
        sdO = sQ + 2 * kBlockM * kHeadDim;
        sdS = sdO + 2 * kBlockM * kHeadDim;
        sP = sdS + kBlockN * kBlockM;
        sLse = reinterpret_cast<float*>(sP + (has_p ? kBlockN * kBlockM : 0));
        sDsum = sLse + 2 * kBlockM;
    }
};

// The key block's K and V tiles (cp.async, left uncommitted: the first Q/dO load commits them).
template <int kBlockN, int kHeadDim, int kNT, bool Is_even_d>
__device__ __forceinline__ void bwd_load_kv(const FlashParams& p, const BwdSeq& seq, int b, int hk,
                                            int n0, int rows_k, fc_u16* sK, fc_u16* sV, int tid) {
    bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
        sK, static_cast<const fc_u16*>(p.k) + b * p.k_batch_stride + (seq.k_off + n0) * p.k_row_stride +
                hk * p.k_head_stride, p.k_row_stride, rows_k, p.headdim, tid);
    bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
        sV, static_cast<const fc_u16*>(p.v) + b * p.v_batch_stride + (seq.k_off + n0) * p.v_row_stride +
                hk * p.v_head_stride, p.v_row_stride, rows_k, p.headdim, tid);
}

// Query block m_block of head h: its Q and dO tiles into sQ / sdO (cp.async, committed), and
// the row statistics of its rows (threads tid < kBlockM; plain loads) into nl / ds.
template <int kBlockM, int kHeadDim, int kNT, bool Is_even_d>
__device__ __forceinline__ void bwd_load_qdo(const FlashParams& p, const BwdSeq& seq, int b,
                                             const fc_u16* gq, const fc_u16* gdo, int h, int m_block,
                                             fc_u16* sQ, fc_u16* sdO, int tid, float& nl, float& ds) {
    const int mm = m_block * kBlockM;
    bwd_load_tile<kBlockM, kHeadDim, kNT, Is_even_d>(
        sQ, gq + static_cast<long long>(mm) * p.q_row_stride + h * p.q_head_stride,
        p.q_row_stride, seq.sq - mm, p.headdim, tid);
    bwd_load_tile<kBlockM, kHeadDim, kNT, Is_even_d>(
        sdO, gdo + static_cast<long long>(mm) * p.do_row_stride + h * p.do_head_stride,
        p.do_row_stride, seq.sq - mm, p.headdim, tid);
    cp_async_commit();
    if (tid < kBlockM) bwd_row_stats(p, b, h, seq, mm + tid, nl, ds);
}

// Whether the (m0, n0) tile needs the elementwise mask: keys past the end (zero-filled K gives
// S = 0, not -inf), or, with a window, a tile not wholly inside it (its extreme key - query
// differences). The three tile kernels below and the Hopper dK/dV kernels (flash_bwd_sm90.cu).
template <bool Is_local, int kBlockM, int kBlockN>
__device__ __forceinline__ bool bwd_need_mask(const FlashParams& p, const BwdSeq& seq, int m0, int n0,
                                              int off) {
    bool need_mask = n0 + kBlockN > seq.sk;
    if constexpr (Is_local) {
        const int rel_min = n0 - (m0 + kBlockM - 1) - off;
        const int rel_max = n0 + kBlockN - 1 - m0 - off;
        need_mask = need_mask || rel_min < -p.window_left || rel_max > p.window_right;
    }
    return need_mask;
}

// One step of a key-block CTA's walk (BwdKeyBlockWalk): query block m0 of query head h,
// whose Q / dO tiles and row statistics (-lse log2 e, D) are in buffer buf.
struct BwdStep {
    int h, m0;
    fc_u32 uQb, udOb;                  // shared addresses of the Q and dO tiles
    const float* sLb;
    const float* sDb;
    BwdScoreMath sm;
    bool need_mask;
};

// The walk of a key-block CTA (both kernels below) over its (query head, query block) steps:
// K and V loaded once, Q and dO double-buffered (cp.async), the next step's tiles and row
// statistics requested at the start of each step (begin), before its work, and its statistics
// stored to shared memory after it (end). The barrier in begin also orders the step's reads of
// the buffers before the next step's prefetch into them, and the work's shared-memory writes
// (dS^T, P^T) after every warp's reads of the last step's.
template <int kHeadDim, int kBlockM, int kBlockN, int kNT, bool Is_local, bool Has_alibi,
          bool Is_even_d>
struct BwdKeyBlockWalk {
    int h, m_block;                    // this step's query head and block
    // (m_next before h_next, ds_next before nl_next: the order in which the kernels' PTX comes
    // out as it did with these as locals)
    int m_next, h_next, buf;
    bool has_next;
    float ds_next, nl_next;            // the next step's row statistics (threads < kBlockM)

    __device__ __forceinline__ BwdKeyBlockWalk(const FlashParams& p, const BwdSeq& seq,
                                               const BwdKeyWalk& kw, int b, int hk, int n0,
                                               const BwdTiles<kHeadDim, kBlockM, kBlockN>& tiles,
                                               int tid) {
        if (kw.n_iter > 0) {
            bwd_load_kv<kBlockN, kHeadDim, kNT, Is_even_d>(p, seq, b, hk, n0, kw.rows_k,
                                                           tiles.sK, tiles.sV, tid);
            bwd_load_qdo<kBlockM, kHeadDim, kNT, Is_even_d>(p, seq, b, kw.gq, kw.gdo, kw.h0,
                                                            kw.m_begin, tiles.sQ, tiles.sdO, tid,
                                                            tiles.sLse[tid], tiles.sDsum[tid]);
        }
        h = kw.h0;
        m_block = kw.m_begin;
    }
    __device__ __forceinline__ BwdStep begin(const FlashParams& p, const BwdSeq& seq,
                                             const BwdKeyWalk& kw, int b, int n0,
                                             const BwdTiles<kHeadDim, kBlockM, kBlockN>& tiles,
                                             int tid, int it) {
        buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();

        // Prefetch the next (head, query block) into the other buffers.
        bwd_walk_next(h, m_block, kw.m_begin, kw.m_end, h_next, m_next);
        has_next = it + 1 < kw.n_iter;
        nl_next = 0.f;
        ds_next = 0.f;
        if (has_next)
            bwd_load_qdo<kBlockM, kHeadDim, kNT, Is_even_d>(
                p, seq, b, kw.gq, kw.gdo, h_next, m_next,
                tiles.sQ + (buf ^ 1) * kBlockM * kHeadDim,
                tiles.sdO + (buf ^ 1) * kBlockM * kHeadDim, tid, nl_next, ds_next);

        const int m0 = m_block * kBlockM;
        // (rows past seqlen_q need no mask: their neg_lse2 is -inf, so P = 0 there)
        return BwdStep{h, m0, smem_u32(tiles.sQ) + buf * (kBlockM * kHeadDim * 2),
                       smem_u32(tiles.sdO) + buf * (kBlockM * kHeadDim * 2),
                       tiles.sLse + buf * kBlockM, tiles.sDsum + buf * kBlockM,
                       bwd_score_math(p, b, h, seq, Has_alibi),
                       bwd_need_mask<Is_local, kBlockM, kBlockN>(p, seq, m0, n0, kw.off)};
    }
    __device__ __forceinline__ void end(const BwdTiles<kHeadDim, kBlockM, kBlockN>& tiles,
                                        int tid) {
        if (has_next && tid < kBlockM) {
            tiles.sLse[(buf ^ 1) * kBlockM + tid] = nl_next;
            tiles.sDsum[(buf ^ 1) * kBlockM + tid] = ds_next;
        }
        h = h_next;
        m_block = m_next;
    }
};

// ---- 2. key-block kernel: dK, dV (and dQ through atomics) ------------------------------------------
//
// Grid (ceil(seqlen_k / kBlockN), nheads_k, batch), kNWarps * 32 threads, dynamic shared memory
// (elements of 16 bits unless noted):
//   sK, sV        kBlockN x kHeadDim           loaded once
//   sQ, sdO       2 x kBlockM x kHeadDim       double-buffered over the (head, query block) loop
//   sdS           kBlockN x kBlockM            dS^T ([key][query]) of the current block
//   sP            kBlockN x kBlockM            P^T, only when warps split the head dim (kSplit 2)
//   sLse, sDsum   2 x kBlockM fp32             -lse*log2e and D of the current / next block
//
// Warp roles: kWarpsN = kBlockN / 16 warps along the keys; kSplit = kNWarps / kWarpsN warps along
// the queries (S^T, dP^T) and along the head dim (dK, dV). For the dQ product the warps are laid
// out kWarpsMC (16 query rows each) x kWarpsDC (head-dim columns), in passes over the head dim.
//
// Per iteration: wait for this block's Q/dO, barrier, prefetch the next block's Q/dO (cp.async)
// and its row statistics (plain loads into registers, stored to shared at the end of the
// iteration, behind the compute), then
//   S^T = K Q^T, dP^T = V dO^T  ->  P, dS (fp32, registers)  ->  dS^T (and P^T) to shared, barrier
//   dV += P^T dO, dK += dS^T Q  ->  (Atomic_dq) dQ_accum += dS K.
// Two barriers per iteration: the one at the top also guarantees that every warp has finished
// reading the buffers that this iteration's prefetch overwrites, and the sdS/sP written below.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool Is_local,
          bool Has_softcap, bool Has_alibi, bool Is_even_d, bool Atomic_dq, bool Is_dropout>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_bwd_dkdv_kernel(const FlashParams p) {
    constexpr int kNT = kNWarps * 32;
    constexpr int kWarpsN = kBlockN / 16;
    static_assert(kBlockN % 16 == 0 && kNWarps % kWarpsN == 0, "warps must tile the key block");
    constexpr int kSplit = kNWarps / kWarpsN;
    constexpr bool kReuse = kSplit == 1;           // P^T / dS^T A fragments straight from registers
    constexpr int kTileMA = kBlockM / kSplit;      // queries per warp in S^T / dP^T
    constexpr int kColsB = kHeadDim / kSplit;      // dK / dV columns per warp
    static_assert(kTileMA % 16 == 0 && kColsB % 16 == 0, "bad warp tiling");
    // Queries per S^T sub-chunk (see the iteration body): the whole warp tile when P goes through
    // shared memory, else 64 (head dim <= 64) or 32 columns.
    constexpr int kSubM = !kReuse ? kTileMA : (kHeadDim <= 64 ? (kTileMA < 64 ? kTileMA : 64)
                                                              : (kTileMA < 32 ? kTileMA : 32));
    constexpr int kNtA = kSubM / 8;
    constexpr int kNtB = kColsB / 8;
    constexpr int kWarpsMC = kBlockM / 16 < kNWarps ? kBlockM / 16 : kNWarps;
    static_assert(kWarpsMC * 16 == kBlockM && kNWarps % kWarpsMC == 0, "bad dQ warp tiling");
    constexpr int kWarpsDC = kNWarps / kWarpsMC;
    constexpr int kDqCols = BwdDqCols<kHeadDim, kWarpsDC>::value;
    constexpr int kDqPasses = kHeadDim / (kDqCols * kWarpsDC);
    constexpr bool kDsToSmem = Atomic_dq || !kReuse;
    // Interleaved column steps (BwdLdsm's xor_lo) need the interleave factor to divide the
    // swizzle group's steps.
    static_assert(kSplit <= BwdLdsm<kHeadDim>::kHalf && kWarpsDC <= BwdLdsm<kHeadDim>::kHalf &&
                  (kSplit & (kSplit - 1)) == 0 && (kWarpsDC & (kWarpsDC - 1)) == 0,
                  "column interleave must be a power of two <= the swizzle group's 16-column steps");

    extern __shared__ __align__(128) unsigned char bwd_smem_raw[];
    const BwdTiles<kHeadDim, kBlockM, kBlockN> tiles(bwd_smem_raw, !kReuse);
    fc_u16 *sK = tiles.sK, *sV = tiles.sV, *sdS = tiles.sdS, *sP = tiles.sP;

    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const BwdSeq seq = bwd_seq(p, b);
    const int n0 = n_block * kBlockN;
    if (n0 >= seq.sk) return;  // varlen: this sequence has fewer key blocks
    const BwdKeyWalk kw = bwd_key_walk<Is_local, kBlockM, kBlockN>(p, seq, b, hk, n0);

    // dK, dV accumulators: warp (wn, ws) owns keys wn*16.. and head-dim columns ws*kColsB..
    const int wn = warp % kWarpsN, ws = warp / kWarpsN;
    const int kn0 = wn * 16;
    const int qa0 = ws * kTileMA;
    // dK/dV columns: warp ws takes the 16-column steps c = kSplit * i + ws (interleaved, so
    // that the step's swizzle term is a compile-time immediate; see BwdLdsm).
    const BwdLdsm<kHeadDim> ldA(kLdsmA, lane), ldB(kLdsmB, lane), ldAw(kLdsmA, lane, ws);
    const BwdLdsm<kBlockM> ldmA(kLdsmA, lane);
    const fc_u32 uK = smem_u32(sK), uV = smem_u32(sV);
    const fc_u32 udS = smem_u32(sdS), uP = smem_u32(sP);
    float acc_dk[kNtB][4], acc_dv[kNtB][4];
#pragma unroll
    for (int nt = 0; nt < kNtB; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[nt][e] = acc_dv[nt][e] = 0.f;

    BwdKeyBlockWalk<kHeadDim, kBlockM, kBlockN, kNT, Is_local, Has_alibi, Is_even_d> walk(
        p, seq, kw, b, hk, n0, tiles, tid);
    for (int it = 0; it < kw.n_iter; ++it) {
        const BwdStep st = walk.begin(p, seq, kw, b, n0, tiles, tid, it);
        const int h = st.h, m0 = st.m0;
        const fc_u32 uQb = st.uQb, udOb = st.udOb;
        const float* sLb = st.sLb;
        const float* sDb = st.sDb;
        const BwdScoreMath& sm = st.sm;
        const bool need_mask = st.need_mask;

        // The warp's queries are processed in sub-chunks of kSubM (register reuse configs only),
        // so that only kSubM/8 n-tiles of S^T and dP^T are live next to the dK/dV accumulators.
#pragma unroll
        for (int mc = 0; mc < kTileMA / kSubM; ++mc) {
            const int qs0 = qa0 + mc * kSubM;  // first query (in the tile) of this sub-chunk

            // ---- S^T = K Q^T and dP^T = V dO^T: keys kn0..+16 x queries qs0..+kSubM ------------
            // A = K / V rows (row-major [key][d] = mma's "row" A: plain ldmatrix); B = Q / dO,
            // whose [query][d] storage is the "col" (n-major) layout mma wants for B: plain too.
            float acc_s[kNtA][4], acc_dp[kNtA][4];
#pragma unroll
            for (int nt = 0; nt < kNtA; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[nt][e] = acc_dp[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                fc_u32 ak[4], av[4];
                ldmatrix_x4(ak, uK + ldA(kn0, kk));
                ldmatrix_x4(av, uV + ldA(kn0, kk));
#pragma unroll
                for (int nt = 0; nt < kNtA; nt += 2) {
                    fc_u32 bq[4], bo[4];
                    ldmatrix_x4(bq, uQb + ldB(qs0 + nt * 8, kk));
                    ldmatrix_x4(bo, udOb + ldB(qs0 + nt * 8, kk));
                    const fc_u32 bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
                    const fc_u32 bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
                    Elem::mma(acc_s[nt], ak, bq0);
                    Elem::mma(acc_s[nt + 1], ak, bq1);
                    Elem::mma(acc_dp[nt], av, bo0);
                    Elem::mma(acc_dp[nt + 1], av, bo1);
                }
            }

            // ---- P and dS. (nt, e): key kn0 + g + 8*(e>>1), query qs0 + nt*8 + 2t + (e&1) ----
            // dropout: keep[0] holds n-tiles nt, nt + 1 (one 16 x 16 tile), keep[1] the next
            // tile's (drawn together: one Philox call per lane per two tiles)
            fc_mask_copies<kBwdSplitMask<Is_local>>(need_mask, [&](const bool masked) {
                unsigned int keep[2] = {0u, 0u};
#pragma unroll
                for (int nt = 0; nt < kNtA; ++nt) {
                    const int qc = qs0 + nt * 8 + 2 * t;
                    const float2 nl = *reinterpret_cast<const float2*>(sLb + qc);
                    const float2 dd = *reinterpret_cast<const float2*>(sDb + qc);
                    if constexpr (Is_dropout) {
                        if ((nt & 3) == 0) {
                            const int qa = m0 + qs0 + nt * 8, qb = nt + 2 < kNtA ? qa + 16 : qa;
                            sm.keep2_st(qa, n0 + kn0, qb, n0 + kn0, g, t, keep[0], keep[1]);
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        sm.template apply<Has_softcap, Has_alibi, Is_local, Is_dropout>(
                            acc_s[nt][e], acc_dp[nt][e], m0 + qc + (e & 1),
                            n0 + kn0 + g + (e >> 1) * 8, (e & 1) ? nl.y : nl.x,
                            (e & 1) ? dd.y : dd.x, masked,
                            Is_dropout ? sm.keep_factor(keep[(nt >> 1) & 1], 4 * (nt & 1) + e)
                                       : 1.f);
                    }
                }
            });

            // 16-bit copies: [nt][0] = key row g (queries 2t, 2t+1), [nt][1] = key row g + 8.
            fc_u32 pp[kNtA][2], dsp[kNtA][2];
#pragma unroll
            for (int nt = 0; nt < kNtA; ++nt) {
                pp[nt][0] = Elem::pack2(acc_s[nt][0], acc_s[nt][1]);
                pp[nt][1] = Elem::pack2(acc_s[nt][2], acc_s[nt][3]);
                dsp[nt][0] = Elem::pack2(acc_dp[nt][0], acc_dp[nt][1]);
                dsp[nt][1] = Elem::pack2(acc_dp[nt][2], acc_dp[nt][3]);
            }
            if constexpr (kDsToSmem) {
                // dS^T tile [key][query]: two adjacent queries are one 32-bit word in one chunk.
#pragma unroll
                for (int nt = 0; nt < kNtA; ++nt) {
                    const int qc = qs0 + nt * 8 + 2 * t;
                    *reinterpret_cast<fc_u32*>(sdS + bwd_swz<kBlockM>(kn0 + g, qc)) = dsp[nt][0];
                    *reinterpret_cast<fc_u32*>(sdS + bwd_swz<kBlockM>(kn0 + g + 8, qc)) = dsp[nt][1];
                    if constexpr (!kReuse) {
                        *reinterpret_cast<fc_u32*>(sP + bwd_swz<kBlockM>(kn0 + g, qc)) = pp[nt][0];
                        *reinterpret_cast<fc_u32*>(sP + bwd_swz<kBlockM>(kn0 + g + 8, qc)) = pp[nt][1];
                    }
                }
            }
            if constexpr (!kReuse) __syncthreads();  // P^T, dS^T of the partner warp

            // ---- dV += P^T dO, dK += dS^T Q: keys kn0..+16 x this warp's columns, k = queries ----
            // A (P^T / dS^T, [key][query]) comes from this warp's own accumulators (kReuse: the
            // accumulators of n-tiles 2ks, 2ks+1 are exactly the m16k16 A fragment of k-step ks)
            // or from shared memory (plain ldmatrix, addressed like K above). B = dO / Q as
            // [query][d] = [k][n] row-major, the transpose of mma's "col" B: ldmatrix.trans.
#pragma unroll
            for (int ks = 0; ks < (kReuse ? kSubM : kBlockM) / 16; ++ks) {
                fc_u32 a_p[4], a_ds[4];
                if constexpr (kReuse) {
                    a_p[0] = pp[2 * ks][0];
                    a_p[1] = pp[2 * ks][1];
                    a_p[2] = pp[2 * ks + 1][0];
                    a_p[3] = pp[2 * ks + 1][1];
                    a_ds[0] = dsp[2 * ks][0];
                    a_ds[1] = dsp[2 * ks][1];
                    a_ds[2] = dsp[2 * ks + 1][0];
                    a_ds[3] = dsp[2 * ks + 1][1];
                } else {
                    ldmatrix_x4(a_p, uP + ldmA(kn0, ks));
                    ldmatrix_x4(a_ds, udS + ldmA(kn0, ks));
                }
                const int qk0 = (kReuse ? qs0 : 0) + ks * 16;
#pragma unroll
                for (int nt = 0; nt < kNtB; nt += 2) {
                    fc_u32 bo[4], bq[4];
                    ldmatrix_x4_trans(bo, udOb + ldAw(qk0, kSplit * (nt / 2)));
                    ldmatrix_x4_trans(bq, uQb + ldAw(qk0, kSplit * (nt / 2)));
                    const fc_u32 bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
                    const fc_u32 bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
                    Elem::mma(acc_dv[nt], a_p, bo0);
                    Elem::mma(acc_dv[nt + 1], a_p, bo1);
                    Elem::mma(acc_dk[nt], a_ds, bq0);
                    Elem::mma(acc_dk[nt + 1], a_ds, bq1);
                }
            }
        }

        // ---- dQ_accum += dS K: queries x head dim, k = keys of this block -----------------------
        // A = dS [query][key], stored transposed as dS^T [key][query]: ldmatrix.trans of the 8x8
        // blocks (key k0.., query q0..) hands lane (g, t) the elements (query g, keys 2t, 2t+1),
        // i.e. the A fragment. B = K [key][d] = [k][n]: ldmatrix.trans as for dO above.
        if constexpr (Atomic_dq) {
            if constexpr (kReuse) __syncthreads();  // the whole dS^T tile is in shared memory
            const int wm = warp % kWarpsMC, wd = warp / kWarpsMC;
            const int q0c = wm * 16;
            const int i0 = m0 + q0c + g;
            // Columns: warp wd takes the 16-column steps kWarpsDC * i + wd (interleaved).
            const BwdLdsm<kHeadDim> ldAc(kLdsmA, lane, wd);
            const fc_u32 udSc = udS + BwdLdsm<kBlockM>(kLdsmB, lane)(0, wm);
            // This lane's two rows, with its column offset (wd * 16 + 2t) folded in, so that each
            // reduction below is the pointer plus a compile-time immediate.
            float* dqa0 = p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride +
                          (seq.q_off + i0) * p.dq_accum_row_stride + wd * 16 + 2 * t;
            float* dqa1 = dqa0 + 8 * p.dq_accum_row_stride;
            const bool row0_ok = i0 < seq.sq, row1_ok = i0 + 8 < seq.sq;
#pragma unroll
            for (int pass = 0; pass < kDqPasses; ++pass) {
                constexpr int kSteps = kDqCols / 16;  // 16-column steps per warp per pass
                float acc[kDqCols / 8][4];
#pragma unroll
                for (int nt = 0; nt < kDqCols / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < kBlockN / 16; ++ks) {
                    fc_u32 a[4];
                    ldmatrix_x4_trans(a, udSc + ks * 16 * kBlockM * 2);
#pragma unroll
                    for (int nt = 0; nt < kDqCols / 8; nt += 2) {
                        fc_u32 bk[4];
                        ldmatrix_x4_trans(bk, uK + ldAc(ks * 16, kWarpsDC * (pass * kSteps + nt / 2)));
                        const fc_u32 b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
                        Elem::mma(acc[nt], a, b0);
                        Elem::mma(acc[nt + 1], a, b1);
                    }
                }
                // Rows past seqlen_q are skipped: in varlen they belong to the next sequence.
#pragma unroll
                if (row0_ok) {
#pragma unroll
                    for (int nt = 0; nt < kDqCols / 8; ++nt)
                        bwd_red_add2(dqa0 + kWarpsDC * (pass * kSteps + nt / 2) * 16 + (nt & 1) * 8,
                                     acc[nt][0], acc[nt][1]);
                }
                if (row1_ok) {
#pragma unroll
                    for (int nt = 0; nt < kDqCols / 8; ++nt)
                        bwd_red_add2(dqa1 + kWarpsDC * (pass * kSteps + nt / 2) * 16 + (nt & 1) * 8,
                                     acc[nt][2], acc[nt][3]);
                }
            }
        }
        walk.end(tiles, tid);
    }

    // ---- epilogue: dK * softmax_scale, dV, as 16-bit (zeros for a block no query sees) -------
    const float scale = p.softmax_scale;
    fc_u16* gdk = static_cast<fc_u16*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride;
    fc_u16* gdv = static_cast<fc_u16*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = n0 + kn0 + g + half * 8;
        if (j < seq.sk) {
            const long long rk = (seq.k_off + j) * p.dk_row_stride;
            const long long rv = (seq.k_off + j) * p.dv_row_stride;
#pragma unroll
            for (int nt = 0; nt < kNtB; ++nt) {
                const int col = (kSplit * (nt / 2) + ws) * 16 + (nt & 1) * 8 + 2 * t;
                if (Is_even_d || col < p.headdim) {
                    *reinterpret_cast<fc_u32*>(gdk + rk + col) =
                        Elem::pack2(acc_dk[nt][2 * half] * scale, acc_dk[nt][2 * half + 1] * scale);
                    *reinterpret_cast<fc_u32*>(gdv + rv + col) =
                        Elem::pack2(acc_dv[nt][2 * half], acc_dv[nt][2 * half + 1]);
                }
            }
        }
    }
}

// ---- 2'. key-block kernel, 2-D warp layouts ("v2"): dK, dV (and dQ through atomics) -------------
//
// Same job, grid, loop, prefetch and math as flash_bwd_dkdv_kernel; only the warp tiling of the
// five products differs. The v1 kernel gives each warp 16 keys x the whole head dim, so every
// ldmatrix of Q / dO feeds only two mma (m = 16 keys) and K / V are reloaded per query chunk:
// shared-memory (LSU) throughput, not the tensor pipe, bounds it. Here each product has its own
// 2-D warp grid, FA2-style, so that every ldmatrix.x4 feeds more mma:
//   S^T = K Q^T, dP^T = V dO^T   kSWn x (kNWarps / kSWn) warps over keys x queries
//   dV += P^T dO, dK += dS^T Q   kKWn x (kNWarps / kKWn) warps over keys x head dim
//   dQ_accum += dS K             kQWm x (kNWarps / kQWm) warps over queries x head dim
// P^T and dS^T go through shared memory ([key][query], 16-bit, swizzled) between the first and
// the other products. dP^T is computed before S^T so that only one GEMM's fragments are live next
// to both accumulators. d128 (64 x 128 tile, 8 warps, 4/4/2): per warp and query block 152
// ldmatrix.x4-equivalents for 320 mma, against 204 in v1.
//
// Shared: sK, sV (kBlockN x d), sQ, sdO (2 x kBlockM x d), sP, sdS (kBlockN x kBlockM), sLse,
// sDsum (2 x kBlockM fp32). Two barriers per iteration: the top one (this block's Q / dO landed;
// everyone is done with the previous iteration's sP / sdS and the other Q / dO buffer) and one
// after the P^T / dS^T stores.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kSWn, int kKWn,
          int kQWm, bool Is_local, bool Has_softcap, bool Has_alibi, bool Is_even_d, bool Atomic_dq,
          bool Is_dropout>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_bwd_dkdv2_kernel(const FlashParams p) {
    constexpr int kNT = kNWarps * 32;
    static_assert(kNWarps % kSWn == 0 && kNWarps % kKWn == 0 && kNWarps % kQWm == 0, "bad warp grid");
    // S^T / dP^T: warp tile kSTn keys x kSTm queries.
    constexpr int kSWm = kNWarps / kSWn;
    constexpr int kSTn = kBlockN / kSWn, kSTm = kBlockM / kSWm;
    static_assert(kSTn % 16 == 0 && kSTm % 16 == 0, "bad S warp tile");
    constexpr int kSMi = kSTn / 16, kSNt = kSTm / 8;
    // dK / dV: warp tile kKTn keys x kKCols columns (16-column steps interleaved by kKWd).
    constexpr int kKWd = kNWarps / kKWn;
    constexpr int kKTn = kBlockN / kKWn, kKCols = kHeadDim / kKWd;
    static_assert(kKTn % 16 == 0 && kKCols % 16 == 0, "bad dK/dV warp tile");
    constexpr int kKMi = kKTn / 16, kKNt = kKCols / 8;
    // dQ: warp tile kQTm queries x kQCols columns (16-column steps interleaved by kQWd), in
    // passes of at most 64 accumulator registers.
    constexpr int kQWd = kNWarps / kQWm;
    constexpr int kQTm = kBlockM / kQWm, kQCols = kHeadDim / kQWd;
    static_assert(kQTm % 16 == 0 && kQCols % 16 == 0, "bad dQ warp tile");
    constexpr int kQMi = kQTm / 16;
    constexpr int kQSteps = kQCols / 16;                                  // 16-col steps per warp
    constexpr int kQPassSteps = (kQMi * kQSteps * 8 <= 64) ? kQSteps
                              : (kQSteps % 2 == 0 && kQMi * kQSteps * 4 <= 64) ? kQSteps / 2 : 1;
    constexpr int kQPasses = kQSteps / kQPassSteps;
    static_assert(kQSteps % kQPassSteps == 0, "bad dQ passes");
    static_assert(kKWd <= BwdLdsm<kHeadDim>::kHalf && (kKWd & (kKWd - 1)) == 0 &&
                  kQWd <= BwdLdsm<kHeadDim>::kHalf && (kQWd & (kQWd - 1)) == 0,
                  "column interleave must be a power of two <= the swizzle group's 16-column steps");
    static_assert(kBlockM % 32 == 0, "kBlockM: P^T / dS^T tile width");

    extern __shared__ __align__(128) unsigned char bwd_smem_raw[];
    const BwdTiles<kHeadDim, kBlockM, kBlockN> tiles(bwd_smem_raw, true);
    fc_u16 *sK = tiles.sK, *sV = tiles.sV, *sdS = tiles.sdS, *sP = tiles.sP;

    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const BwdSeq seq = bwd_seq(p, b);
    const int n0 = n_block * kBlockN;
    if (n0 >= seq.sk) return;  // varlen: this sequence has fewer key blocks
    const BwdKeyWalk kw = bwd_key_walk<Is_local, kBlockM, kBlockN>(p, seq, b, hk, n0);

    const int swn = warp % kSWn, swm = warp / kSWn;
    const int sk0 = swn * kSTn, sq0 = swm * kSTm;
    const int kwn = warp % kKWn, kwd = warp / kKWn;
    const int kk0 = kwn * kKTn;
    const int qwm = warp % kQWm, qwd = warp / kQWm;

    const BwdLdsm<kHeadDim> ldA(kLdsmA, lane), ldB(kLdsmB, lane);
    const BwdLdsm<kHeadDim> ldAk(kLdsmA, lane, kwd), ldAq(kLdsmA, lane, qwd);
    const BwdLdsm<kBlockM> ldmA(kLdsmA, lane);
    const fc_u32 uK = smem_u32(sK), uV = smem_u32(sV);
    const fc_u32 udS = smem_u32(sdS), uP = smem_u32(sP);

    float acc_dk[kKMi][kKNt][4], acc_dv[kKMi][kKNt][4];
#pragma unroll
    for (int mi = 0; mi < kKMi; ++mi)
#pragma unroll
        for (int nt = 0; nt < kKNt; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[mi][nt][e] = acc_dv[mi][nt][e] = 0.f;

    BwdKeyBlockWalk<kHeadDim, kBlockM, kBlockN, kNT, Is_local, Has_alibi, Is_even_d> walk(
        p, seq, kw, b, hk, n0, tiles, tid);
    for (int it = 0; it < kw.n_iter; ++it) {
        const BwdStep st = walk.begin(p, seq, kw, b, n0, tiles, tid, it);
        const int h = st.h, m0 = st.m0;
        const fc_u32 uQb = st.uQb, udOb = st.udOb;
        const float* sLb = st.sLb;
        const float* sDb = st.sDb;
        const BwdScoreMath& sm = st.sm;
        const bool need_mask = st.need_mask;

        {
            // ---- dP^T = V dO^T, then S^T = K Q^T: keys sk0..+kSTn x queries sq0..+kSTm --------
            // A = V / K rows (plain ldmatrix), B = dO / Q [query][d] (plain ldmatrix), as in v1.
            float acc_s[kSMi][kSNt][4], acc_dp[kSMi][kSNt][4];
#pragma unroll
            for (int mi = 0; mi < kSMi; ++mi)
#pragma unroll
                for (int nt = 0; nt < kSNt; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[mi][nt][e] = acc_dp[mi][nt][e] = 0.f;
            // acc += A B^T over the head dim: A's rows (V or K) this warp's keys, B's (dO or Q)
            // its queries
            auto keys_x_queries = [&](float (&acc)[kSMi][kSNt][4], fc_u32 uA, fc_u32 uB) {
#pragma unroll
                for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                    fc_u32 a[kSMi][4];
#pragma unroll
                    for (int mi = 0; mi < kSMi; ++mi)
                        ldmatrix_x4(a[mi], uA + ldA(sk0 + 16 * mi, kk));
#pragma unroll
                    for (int nt = 0; nt < kSNt; nt += 2) {
                        fc_u32 bb[4];
                        ldmatrix_x4(bb, uB + ldB(sq0 + nt * 8, kk));
                        const fc_u32 b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
                        for (int mi = 0; mi < kSMi; ++mi) {
                            Elem::mma(acc[mi][nt], a[mi], b0);
                            Elem::mma(acc[mi][nt + 1], a[mi], b1);
                        }
                    }
                }
            };
            keys_x_queries(acc_dp, uV, udOb);
            keys_x_queries(acc_s, uK, uQb);

            // ---- P, dS; (mi, nt, e): key sk0 + 16 mi + g + 8 (e>>1), query sq0 + nt*8 + 2t + (e&1)
            // Stored as 16-bit P^T / dS^T [key][query]: two adjacent queries are one 32-bit word.
            fc_mask_copies<kBwdSplitMask<Is_local>>(need_mask, [&](const bool masked) {
                unsigned int keep[kSMi];   // dropout: n-tiles nt, nt + 1 of each key tile mi
#pragma unroll
                for (int nt = 0; nt < kSNt; ++nt) {
                    const int qc = sq0 + nt * 8 + 2 * t;
                    const float2 nl = *reinterpret_cast<const float2*>(sLb + qc);
                    const float2 dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
                    for (int mi = 0; mi < kSMi; ++mi) {
                        if constexpr (Is_dropout) {
                            if ((nt & 1) == 0 && (mi & 1) == 0) {   // key tiles mi, mi + 1 at once
                                unsigned int next;
                                const int ka = n0 + sk0 + 16 * mi;
                                sm.keep2_st(m0 + sq0 + nt * 8, ka, m0 + sq0 + nt * 8,
                                            mi + 1 < kSMi ? ka + 16 : ka, g, t, keep[mi], next);
                                if (mi + 1 < kSMi) keep[mi + 1] = next;
                            }
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            sm.template apply<Has_softcap, Has_alibi, Is_local, Is_dropout>(
                                acc_s[mi][nt][e], acc_dp[mi][nt][e], m0 + qc + (e & 1),
                                n0 + sk0 + 16 * mi + g + (e >> 1) * 8, (e & 1) ? nl.y : nl.x,
                                (e & 1) ? dd.y : dd.x, masked,
                                Is_dropout ? sm.keep_factor(keep[mi], 4 * (nt & 1) + e)
                                           : 1.f);
                        }
                        const int kr = sk0 + 16 * mi + g;
                        *reinterpret_cast<fc_u32*>(sP + bwd_swz<kBlockM>(kr, qc)) =
                            Elem::pack2(acc_s[mi][nt][0], acc_s[mi][nt][1]);
                        *reinterpret_cast<fc_u32*>(sP + bwd_swz<kBlockM>(kr + 8, qc)) =
                            Elem::pack2(acc_s[mi][nt][2], acc_s[mi][nt][3]);
                        *reinterpret_cast<fc_u32*>(sdS + bwd_swz<kBlockM>(kr, qc)) =
                            Elem::pack2(acc_dp[mi][nt][0], acc_dp[mi][nt][1]);
                        *reinterpret_cast<fc_u32*>(sdS + bwd_swz<kBlockM>(kr + 8, qc)) =
                            Elem::pack2(acc_dp[mi][nt][2], acc_dp[mi][nt][3]);
                    }
                }
            });
        }
        __syncthreads();  // the whole P^T / dS^T tile is in shared memory

        // ---- dV += P^T dO, dK += dS^T Q: keys kk0..+kKTn x this warp's columns, k = queries ----
        // A = P^T / dS^T (plain ldmatrix), B = dO / Q [query][d] = [k][n]: ldmatrix.trans.
#pragma unroll
        for (int ks = 0; ks < kBlockM / 16; ++ks) {
            fc_u32 ap[kKMi][4], ads[kKMi][4];
#pragma unroll
            for (int mi = 0; mi < kKMi; ++mi) {
                ldmatrix_x4(ap[mi], uP + ldmA(kk0 + 16 * mi, ks));
                ldmatrix_x4(ads[mi], udS + ldmA(kk0 + 16 * mi, ks));
            }
#pragma unroll
            for (int nt = 0; nt < kKNt; nt += 2) {
                fc_u32 bo[4], bq[4];
                ldmatrix_x4_trans(bo, udOb + ldAk(ks * 16, kKWd * (nt / 2)));
                ldmatrix_x4_trans(bq, uQb + ldAk(ks * 16, kKWd * (nt / 2)));
                const fc_u32 bo0[2] = {bo[0], bo[1]}, bo1[2] = {bo[2], bo[3]};
                const fc_u32 bq0[2] = {bq[0], bq[1]}, bq1[2] = {bq[2], bq[3]};
#pragma unroll
                for (int mi = 0; mi < kKMi; ++mi) {
                    Elem::mma(acc_dv[mi][nt], ap[mi], bo0);
                    Elem::mma(acc_dv[mi][nt + 1], ap[mi], bo1);
                    Elem::mma(acc_dk[mi][nt], ads[mi], bq0);
                    Elem::mma(acc_dk[mi][nt + 1], ads[mi], bq1);
                }
            }
        }

        // ---- dQ_accum += dS K: queries x head dim, k = keys of this block -------------------------
        // A = dS [query][key] from dS^T [key][query] by ldmatrix.trans; B = K [key][d]: .trans.
        if constexpr (Atomic_dq) {
            // This lane's address in the 16-query column step qwm * kQMi + mi of dS^T (row 0).
            const BwdLdsm<kBlockM> ldmB(kLdsmB, lane);
            fc_u32 udSq[kQMi];
#pragma unroll
            for (int mi = 0; mi < kQMi; ++mi) udSq[mi] = udS + ldmB(0, qwm * kQMi + mi);
            const int i0 = m0 + qwm * kQTm + g;
            float* dqa = p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride +
                         (seq.q_off + i0) * p.dq_accum_row_stride + qwd * 16 + 2 * t;
#pragma unroll
            for (int pass = 0; pass < kQPasses; ++pass) {
                float acc[kQMi][2 * kQPassSteps][4];
#pragma unroll
                for (int mi = 0; mi < kQMi; ++mi)
#pragma unroll
                    for (int nt = 0; nt < 2 * kQPassSteps; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mi][nt][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < kBlockN / 16; ++ks) {
                    fc_u32 a[kQMi][4];
#pragma unroll
                    for (int mi = 0; mi < kQMi; ++mi) {
                        ldmatrix_x4_trans(a[mi], udSq[mi] + ks * 16 * kBlockM * 2);
                    }
#pragma unroll
                    for (int nt = 0; nt < 2 * kQPassSteps; nt += 2) {
                        fc_u32 bk[4];
                        ldmatrix_x4_trans(bk, uK + ldAq(ks * 16, kQWd * (pass * kQPassSteps + nt / 2)));
                        const fc_u32 b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
#pragma unroll
                        for (int mi = 0; mi < kQMi; ++mi) {
                            Elem::mma(acc[mi][nt], a[mi], b0);
                            Elem::mma(acc[mi][nt + 1], a[mi], b1);
                        }
                    }
                }
#pragma unroll
                for (int mi = 0; mi < kQMi; ++mi) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        if (i0 + 16 * mi + 8 * half < seq.sq) {
                            float* dq_row = dqa + (16 * mi + 8 * half) * p.dq_accum_row_stride;
#pragma unroll
                            for (int nt = 0; nt < 2 * kQPassSteps; ++nt)
                                bwd_red_add2(dq_row + kQWd * (pass * kQPassSteps + nt / 2) * 16 + (nt & 1) * 8,
                                             acc[mi][nt][2 * half], acc[mi][nt][2 * half + 1]);
                        }
                    }
                }
            }
        }
        walk.end(tiles, tid);
    }

    // ---- epilogue: dK * softmax_scale, dV, as 16-bit (zeros for a block no query sees) -------
    const float scale = p.softmax_scale;
    fc_u16* gdk = static_cast<fc_u16*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride;
    fc_u16* gdv = static_cast<fc_u16*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride;
#pragma unroll
    for (int mi = 0; mi < kKMi; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int j = n0 + kk0 + 16 * mi + g + half * 8;
            if (j < seq.sk) {
                const long long rk = (seq.k_off + j) * p.dk_row_stride;
                const long long rv = (seq.k_off + j) * p.dv_row_stride;
#pragma unroll
                for (int nt = 0; nt < kKNt; ++nt) {
                    const int col = (kKWd * (nt / 2) + kwd) * 16 + (nt & 1) * 8 + 2 * t;
                    if (Is_even_d || col < p.headdim) {
                        *reinterpret_cast<fc_u32*>(gdk + rk + col) = Elem::pack2(
                            acc_dk[mi][nt][2 * half] * scale, acc_dk[mi][nt][2 * half + 1] * scale);
                        *reinterpret_cast<fc_u32*>(gdv + rv + col) =
                            Elem::pack2(acc_dv[mi][nt][2 * half], acc_dv[mi][nt][2 * half + 1]);
                    }
                }
            }
        }
    }
}

// ---- 3a. convert: dq = dq_accum * softmax_scale ------------------------------------------------
// Grid (ceil(seqlen_q / 64), nheads, batch), 256 threads, two columns per step.
template <typename Elem>
__global__ void __launch_bounds__(256) flash_bwd_convert_dq_kernel(const FlashParams p) {
    constexpr int kRows = 64;
    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq = bwd_seq(p, b);
    const int m0 = blockIdx.x * kRows;
    if (m0 >= seq.sq) return;
    const int pairs = p.headdim >> 1;
    const int rows = min(kRows, seq.sq - m0);
    for (int idx = threadIdx.x; idx < rows * pairs; idx += 256) {
        const int r = idx / pairs;
        const int c = (idx - r * pairs) * 2;
        const long long row = seq.q_off + m0 + r;
        const float2 v = *reinterpret_cast<const float2*>(
            p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride +
            row * p.dq_accum_row_stride + c);
        *reinterpret_cast<fc_u32*>(static_cast<fc_u16*>(p.dq) + b * p.dq_batch_stride +
                                   row * p.dq_row_stride + h * p.dq_head_stride + c) =
            Elem::pack2(v.x * p.softmax_scale, v.y * p.softmax_scale);
    }
}

// ---- 3b. deterministic dQ: one CTA per (query block, head, batch) ----------------------------------
//
// Warps own 16 query rows each (kBlockM = 16 * kNWarps), the forward's orientation: S = Q K^T
// and dP = dO V^T have query rows, dS goes from the accumulators straight into the A fragments of
// dQ += dS K, and dQ stays in fp32 registers over the whole key loop -- a fixed summation order,
// hence bitwise reproducible. Shared: sQ, sdO (kBlockM x kHeadDim), sK, sV (2 x kBlockN x
// kHeadDim, double-buffered over the key blocks). The row statistics live in registers.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool Is_local,
          bool Has_softcap, bool Has_alibi, bool Is_even_d, bool Is_dropout>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_bwd_dq_kernel(const FlashParams p) {
    constexpr int kNT = kNWarps * 32;
    static_assert(kBlockM == 16 * kNWarps, "one warp per 16 query rows");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "bad tile");
    constexpr int kNtS = kBlockN / 8;
    static_assert(kNtS % 2 == 0, "whole 16-key tiles (dropout draws per 16 x 16 tile)");
    constexpr int kNtD = kHeadDim / 8;

    extern __shared__ __align__(128) unsigned char bwd_smem_raw[];
    fc_u16* sQ = reinterpret_cast<fc_u16*>(bwd_smem_raw);
    fc_u16* sdO = sQ + kBlockM * kHeadDim;
    fc_u16* sK = sdO + kBlockM * kHeadDim;
    fc_u16* sV = sK + 2 * kBlockN * kHeadDim;

    const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const BwdSeq seq = bwd_seq(p, b);
    const int m0 = m_block * kBlockM;
    if (m0 >= seq.sq) return;
    const int off = seq.sk - seq.sq;
    const int hk = h / (p.nheads / p.nheads_k);

    // Key blocks visible from this query block.
    int n_begin = 0, n_end = (seq.sk + kBlockN - 1) / kBlockN;
    if constexpr (Is_local) {
        const long long m1 = min(m0 + kBlockM, seq.sq);
        const long long lo = max(0LL, static_cast<long long>(m0) + off - p.window_left);
        const long long hi = min(static_cast<long long>(seq.sk) - 1, m1 - 1 + off + p.window_right);
        if (lo > hi) {
            n_end = 0;
        } else {
            n_begin = static_cast<int>(lo / kBlockN);
            n_end = static_cast<int>(hi / kBlockN) + 1;
        }
    }

    const fc_u16* gk = static_cast<const fc_u16*>(p.k) + b * p.k_batch_stride + seq.k_off * p.k_row_stride +
                       hk * p.k_head_stride;
    const fc_u16* gv = static_cast<const fc_u16*>(p.v) + b * p.v_batch_stride + seq.k_off * p.v_row_stride +
                       hk * p.v_head_stride;

    float acc_dq[kNtD][4];
#pragma unroll
    for (int nt = 0; nt < kNtD; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[nt][e] = 0.f;

    const int i0 = m0 + warp * 16 + g;  // this lane's rows: i0 (e = 0, 1) and i0 + 8 (e = 2, 3)
    float nl[2], dd[2];
    bwd_row_stats(p, b, h, seq, i0, nl[0], dd[0]);
    bwd_row_stats(p, b, h, seq, i0 + 8, nl[1], dd[1]);
    const BwdScoreMath sm = bwd_score_math(p, b, h, seq, Has_alibi);
    const BwdLdsm<kHeadDim> ldA(kLdsmA, lane), ldB(kLdsmB, lane);
    const fc_u32 uQw = smem_u32(sQ) + ldA(warp * 16, 0) - ldA(0, 0);  // this warp's 16 rows
    const fc_u32 udOw = smem_u32(sdO) + ldA(warp * 16, 0) - ldA(0, 0);

    if (n_end > n_begin) {
        const long long qrow = seq.q_off + m0;
        bwd_load_tile<kBlockM, kHeadDim, kNT, Is_even_d>(
            sQ, static_cast<const fc_u16*>(p.q) + b * p.q_batch_stride + qrow * p.q_row_stride +
                    h * p.q_head_stride, p.q_row_stride, seq.sq - m0, p.headdim, tid);
        bwd_load_tile<kBlockM, kHeadDim, kNT, Is_even_d>(
            sdO, static_cast<const fc_u16*>(p.dout) + b * p.do_batch_stride + qrow * p.do_row_stride +
                     h * p.do_head_stride, p.do_row_stride, seq.sq - m0, p.headdim, tid);
        const int nn = n_begin * kBlockN;
        bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
            sK, gk + static_cast<long long>(nn) * p.k_row_stride, p.k_row_stride, seq.sk - nn, p.headdim, tid);
        bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
            sV, gv + static_cast<long long>(nn) * p.v_row_stride, p.v_row_stride, seq.sk - nn, p.headdim, tid);
        cp_async_commit();
    }

    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int buf = (n_block - n_begin) & 1;
        cp_async_wait<0>();
        __syncthreads();  // tiles visible; everyone is done with the other buffer
        if (n_block + 1 < n_end) {
            const int nn = (n_block + 1) * kBlockN;
            bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
                sK + (buf ^ 1) * kBlockN * kHeadDim, gk + static_cast<long long>(nn) * p.k_row_stride,
                p.k_row_stride, seq.sk - nn, p.headdim, tid);
            bwd_load_tile<kBlockN, kHeadDim, kNT, Is_even_d>(
                sV + (buf ^ 1) * kBlockN * kHeadDim, gv + static_cast<long long>(nn) * p.v_row_stride,
                p.v_row_stride, seq.sk - nn, p.headdim, tid);
            cp_async_commit();
        }
        const fc_u32 uKb = smem_u32(sK) + buf * (kBlockN * kHeadDim * 2);
        const fc_u32 uVb = smem_u32(sV) + buf * (kBlockN * kHeadDim * 2);
        const int n0 = n_block * kBlockN;

        // S = Q K^T, dP = dO V^T (rows = this warp's 16 queries): A = Q / dO plain ldmatrix,
        // B = K / V as [key][d] = mma's "col" B layout: plain ldmatrix.
        float acc_s[kNtS][4], acc_dp[kNtS][4];
#pragma unroll
        for (int nt = 0; nt < kNtS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[nt][e] = acc_dp[nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            fc_u32 aq[4], ao[4];
            ldmatrix_x4(aq, uQw + ldA(0, kk));
            ldmatrix_x4(ao, udOw + ldA(0, kk));
#pragma unroll
            for (int nt = 0; nt < kNtS; nt += 2) {
                fc_u32 bk[4], bv[4];
                ldmatrix_x4(bk, uKb + ldB(nt * 8, kk));
                ldmatrix_x4(bv, uVb + ldB(nt * 8, kk));
                const fc_u32 bk0[2] = {bk[0], bk[1]}, bk1[2] = {bk[2], bk[3]};
                const fc_u32 bv0[2] = {bv[0], bv[1]}, bv1[2] = {bv[2], bv[3]};
                Elem::mma(acc_s[nt], aq, bk0);
                Elem::mma(acc_s[nt + 1], aq, bk1);
                Elem::mma(acc_dp[nt], ao, bv0);
                Elem::mma(acc_dp[nt + 1], ao, bv1);
            }
        }

        const bool need_mask = bwd_need_mask<Is_local, kBlockM, kBlockN>(p, seq, m0, n0, off);
        // Accumulator (nt, e): query row i0 + 8*(e>>1), key col n0 + nt*8 + 2t + (e&1).
        // dropout: keep[0] holds n-tiles nt, nt + 1 (one 16 x 16 tile), keep[1] the next tile's
        fc_mask_copies<kBwdSplitMask<Is_local>>(need_mask, [&](const bool masked) {
            unsigned int keep[2] = {0u, 0u};
#pragma unroll
            for (int nt = 0; nt < kNtS; ++nt) {
                if constexpr (Is_dropout) {
                    if ((nt & 3) == 0)
                        sm.keep2_s(i0 - g, n0 + nt * 8, i0 - g,
                                   n0 + (nt + 2 < kNtS ? nt + 2 : nt) * 8, g, t, keep[0], keep[1]);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sm.template apply<Has_softcap, Has_alibi, Is_local, Is_dropout>(
                        acc_s[nt][e], acc_dp[nt][e], i0 + (e >> 1) * 8,
                        n0 + nt * 8 + 2 * t + (e & 1), nl[e >> 1], dd[e >> 1], masked,
                        Is_dropout ? sm.keep_factor(keep[(nt >> 1) & 1],
                                                    2 * (e & 2) + 2 * (nt & 1) + (e & 1))
                                   : 1.f);
            }
        });

        // dQ += dS K: the dS accumulators of n-tiles 2ks, 2ks+1 form the A fragment of k-step ks;
        // B = K [key][d] = [k][n] row-major: ldmatrix.trans.
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            fc_u32 a[4];
            a[0] = Elem::pack2(acc_dp[2 * ks][0], acc_dp[2 * ks][1]);
            a[1] = Elem::pack2(acc_dp[2 * ks][2], acc_dp[2 * ks][3]);
            a[2] = Elem::pack2(acc_dp[2 * ks + 1][0], acc_dp[2 * ks + 1][1]);
            a[3] = Elem::pack2(acc_dp[2 * ks + 1][2], acc_dp[2 * ks + 1][3]);
#pragma unroll
            for (int nt = 0; nt < kNtD; nt += 2) {
                fc_u32 bk[4];
                ldmatrix_x4_trans(bk, uKb + ldA(ks * 16, nt / 2));
                const fc_u32 b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
                Elem::mma(acc_dq[nt], a, b0);
                Elem::mma(acc_dq[nt + 1], a, b1);
            }
        }
    }

    // Epilogue: dq = acc * softmax_scale (zeros for a block that sees no key).
    const float scale = p.softmax_scale;
    fc_u16* gdq = static_cast<fc_u16*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int i = i0 + half * 8;
        if (i < seq.sq) {
            const long long r = (seq.q_off + i) * p.dq_row_stride;
#pragma unroll
            for (int nt = 0; nt < kNtD; ++nt) {
                const int col = nt * 8 + 2 * t;
                if (Is_even_d || col < p.headdim)
                    *reinterpret_cast<fc_u32*>(gdq + r + col) =
                        Elem::pack2(acc_dq[nt][2 * half] * scale, acc_dq[nt][2 * half + 1] * scale);
            }
        }
    }
}
