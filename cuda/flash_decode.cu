// flashcore: KV-cache decoding (Flash-Decoding) on the Ampere-class path (mma.sync, ldmatrix,
// cp.async), sm_80 and newer. Launcher: flashcore/kernels/decode.py.
//
// flash_decode_kernel: one CTA per (batch, kv head, m-block, split).
//   * M packing (GQA/MQA): the G = nheads / nheads_k query heads that share kv head hk and the
//     seqlen_q query rows form sq * G "packed rows", p = qi * G + (h - hk * G). A CTA owns
//     kBlockM = 16 * kMT consecutive packed rows, so every K/V byte is read once per kv head
//     (per m-block) instead of once per query head.
//   * The keys are streamed in blocks of kBlockN through a kStages-deep cp.async ring (one
//     commit group per block: K and V together). Inside a block, warp w owns keys
//     [w * kWN, (w + 1) * kWN): it computes S = Q K^T for ALL packed rows of the tile over its
//     keys and keeps its own running max / sum / O in registers (FA2's per-row state, but the
//     warps split N instead of M, since M is tiny when decoding). The four partial softmax
//     states are merged through shared memory at the end.
//   * Split-KV: the visible key blocks of the tile (after window skipping) are cut into
//     num_splits contiguous ranges, one per blockIdx.z. With num_splits > 1 (Is_split) each CTA
//     writes fp32 O (already normalised by its own sum) and its LSE to scratch, and the last
//     CTA of the group (fused combine) or the combine kernel merges them; on sm_90,
//     flash_decode_cluster_kernel keeps the partials in shared memory instead and the group's
//     CTAs, one cluster, merge them through DSMEM (see cluster_merge). Otherwise the CTA writes
//     the 16-bit output and the LSE directly.
//   * Paged cache: token t lives at block block_table[b, t / page_size], row t % page_size.
//     A key block may span pages (page_size 16 with kBlockN 64 or 128), but the kRPT rows a
//     thread copies of a block are consecutive tokens starting at a multiple of kRPT (which
//     divides 16, and so every page size): they lie in one page, so a thread reads one
//     block-table entry a block and addresses its rows as in a contiguous cache, whatever
//     the page size. The entries of the next key block are read one block ahead into
//     registers, so their latency hides behind a block of compute; the walk from block to
//     block is incremental (one division per CTA), and the prologue requests the entries of
//     its second block before it waits for those of its first.
//
// Masking and alignment are exactly those of flash_fwd.cu (bottom-right causal, windows,
// softcap, ALiBi; rows that see no key get O = 0 and lse = -inf).
//
// flash_decode_combine_kernel: one warp per output row (b, h, qi):
//   m = max lse_s (skipping -inf), L = m + log sum exp(lse_s - m), O = sum exp(lse_s - L) O_s.
//
// flash_append_kv_kernel: writes new k/v rows into the cache (contiguous or paged) at
// cache_seqlens_before[b] + t, optionally applying rotary embedding (fp32 math), and also
// serves q -> q_out rotation.
#include "flash_params.cuh"
#include "ptx.cuh"
#include "flash_scores.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

template <typename E, bool Fp8> struct fc_mma_elem {
    using type = E;
    static constexpr bool kConvertQ = false;
};
template <> struct fc_mma_elem<fc_bf16, true> {
    using type = fc_fp16;
    static constexpr bool kConvertQ = true;   // q's bf16 tile becomes fp16 (flash_decode_body)
};

namespace fc_dec {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void stg128f(float* p, float a, float b, float c, float d) {
    asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};\n"
                 :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ void sts64f(fc_u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" :: "r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void sts128f(fc_u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ void lds128f(float (&r)[4], fc_u32 addr) {
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(r[0]), "=f"(r[1]), "=f"(r[2]), "=f"(r[3]) : "r"(addr));
}

// Loads of the split partials, through L2 only (.cg): in the fused combine they were written by
// other CTAs of the same launch, and a line of this SM's L1 filled earlier in the launch (a
// neighbouring group's rows share lines) could be stale. When pred is false nothing is read
// and the destination keeps its value. "memory": never moved across the fences.
__device__ __forceinline__ void ldcg_f32_pred(float& x, const float* p, bool pred) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
                 " @p ld.global.cg.f32 %0, [%1];\n}\n"
                 : "+f"(x) : "l"(p), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void ldcg_f32x8_pred(float (&x)[8], const float* p, bool pred) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
                 " @p ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%8];\n"
                 " @p ld.global.cg.v4.f32 {%4,%5,%6,%7}, [%9];\n}\n"
                 : "+f"(x[0]), "+f"(x[1]), "+f"(x[2]), "+f"(x[3]),
                   "+f"(x[4]), "+f"(x[5]), "+f"(x[6]), "+f"(x[7])
                 : "l"(p), "l"(p + 4), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" :: "l"(p));
}

constexpr int kMaxSplits = 256;   // the combine's weight table (decode.py MAX_SPLITS)

// Merge the num_splits partial results of one output row R = (b * nheads + h) * sq + qi: one
// warp, lane owns columns [8 lane, 8 lane + 8) (headdim <= 256), sW is the warp's table of
// kMaxSplits floats. Used by the combine kernel and by the fused combine (the last split CTA
// of a group), so both give the same bits:
//   m = max lse_s (NaN if any is NaN), L = m + log sum exp(lse_s - m), O = sum exp(lse_s - L) O_s
//   in split order; no split saw a key (m = -inf): lse = -inf, O = 0.
// Every lane returns through the trailing __syncwarp (sW is reused by the warp's next row).
template <typename Elem>
__device__ __forceinline__ void combine_row(const FlashParams& params, long long R, int b, int h,
                                            int qi, float* sW, int lane) {
    constexpr int kPerLane = kMaxSplits / 32;
    const int S = params.num_splits;
    const int headdim = params.headdim;
    const long long rows = (long long)params.batch * params.nheads * params.seqlen_q;

    float ls[kPerLane];   // lse of splits lane + 32 i: one round trip for all of them
    float m = -INFINITY;
    bool has_nan = false;  // fmaxf drops NaN: a NaN split must not make the row read as empty
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int s = lane + 32 * i;
        ls[i] = -INFINITY;
        ldcg_f32_pred(ls[i], params.lse_accum + s * rows + R, s < S);
        has_nan |= ls[i] != ls[i];
        m = fmaxf(m, ls[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (__any_sync(0xffffffffu, has_nan)) m = __int_as_float(0x7fffffff);

    float* lse_out = params.lse + (long long)b * params.lse_batch_stride
                     + (long long)h * params.lse_head_stride + qi;
    fc_u16* out = static_cast<fc_u16*>(params.o) + (long long)b * params.o_batch_stride
                  + (long long)qi * params.o_row_stride + (long long)h * params.o_head_stride;
    const int c = lane * 8;
    if (m == -INFINITY) {   // no split saw a key (warp-uniform)
        if (lane == 0) *lse_out = -INFINITY;
        if (c < headdim) {
            const fc_u32 zero[4] = {0u, 0u, 0u, 0u};
            stg128(out + c, zero);
        }
        return;
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < S) sum += expf(ls[i] - m);   // exp(-inf) = 0
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float L = m + logf(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < S) sW[lane + 32 * i] = expf(ls[i] - L);
    __syncwarp();
    if (lane == 0) *lse_out = L;
    if (c < headdim) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        const float* src = params.o_accum + R * headdim + c;
        const long long split_stride = rows * headdim;
        // Eight splits per step, their loads issued together. Splits with weight 0 (-inf lse:
        // their O was never written; or underflow) are neither read nor added.
        for (int s0 = 0; s0 < S; s0 += 8) {
            float w[8], x[8][8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                w[j] = s0 + j < S ? sW[s0 + j] : 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) x[j][e] = 0.f;
                ldcg_f32x8_pred(x[j], src + (s0 + j) * split_stride, w[j] != 0.f);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (w[j] != 0.f) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] = fmaf(w[j], x[j][e], acc[e]);
                }
        }
        fc_u32 v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = Elem::pack2(acc[2 * e], acc[2 * e + 1]);
        stg128(out + c, v);
    }
    __syncwarp();
}

// Fused combine, run by every CTA of a split launch once its partial O / lse are stored (or,
// for a CTA whose split has no key, its lse = -inf): arrive on the group's counter; the last
// CTA of the group to arrive merges the group's rows (packed rows [m0, m0 + rows_valid) of kv
// head hk) and resets the counter to 0 for the next launch. Uniform over the CTA: every thread
// calls it. sFlag: one int of shared memory; sW: kNWarps * kMaxSplits floats of shared memory,
// both free for reuse (the caller's last reads of them are behind the first barrier below).
template <typename Elem, int kNWarps>
__device__ __forceinline__ void split_arrive_and_combine(const FlashParams& params, int b, int hk,
                                                         int m0, int rows_valid, int* sFlag,
                                                         float* sW) {
    __threadfence();   // release: this thread's partial stores are visible GPU-wide ...
    __syncthreads();   // ... for every thread of the CTA, before the arrival below
    if (threadIdx.x == 0) {
        int* ctr = params.split_counter + ((long long)blockIdx.x * gridDim.y + blockIdx.y);
        const int arrived = atomicAdd(ctr, 1);
        const int last = arrived == params.num_splits - 1;
        if (last) atomicExch(ctr, 0);   // all splits arrived: nobody touches it in this launch
        *sFlag = last;
    }
    __syncthreads();
    if (*sFlag == 0) return;   // CTA-uniform
    __threadfence();   // acquire: the other splits' partials, read below through L2
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int G = params.nheads / params.nheads_k;
    const int sq = params.seqlen_q;
    for (int r = warp; r < rows_valid; r += kNWarps) {   // warp-uniform
        const int qi = (m0 + r) / G, h = hk * G + (m0 + r) % G;
        combine_row<Elem>(params, ((long long)b * params.nheads + h) * sq + qi, b, h, qi,
                          sW + warp * kMaxSplits, lane);
    }
}


// ---- split-KV merge inside a thread-block cluster (sm_90+) -----------------------------------
// The kCluster splits of a group (one (sequence, kv head, m-block)) form one cluster along
// gridDim.z. Each CTA leaves its partial (O normalised by its own sum, fp32, and its lse) in its
// own shared memory; after a cluster barrier the CTAs merge the group's rows between them,
// reading every split's partial through distributed shared memory, and a second barrier keeps
// each CTA's shared memory alive until all reads of it are done. No global scratch, no fence,
// no counter: the merge costs two cluster barriers and one round of DSMEM reads.
__device__ __forceinline__ fc_u32 cluster_ctarank() {
    fc_u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {   // every thread of every CTA of the cluster
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ fc_u32 mapa_rank(fc_u32 addr, fc_u32 rank) {
    fc_u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_dsmem_f32(fc_u32 addr) {
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ void ld_dsmem_f32x4(float (&x)[4], fc_u32 addr) {
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(addr) : "memory");
}

// The merge of one output chunk (packed row r of the group, columns [8c, 8c + 8)) from the
// kCluster partials: sPartO (fp32 [kBlockM][kHeadDim]) and sPartL (fp32 [kBlockM]) at the same
// shared addresses in every CTA of the cluster. The same arithmetic, in the same order, as
// combine_row (the fused and two-kernel paths), so all three give the same bits: m = max lse_s
// (NaN if any is NaN); the sum of exp(lse_s - m) in the order of combine_row's warp butterfly;
// L = m + log(sum); O = sum over s in order of exp(lse_s - L) * O_s, splits of weight 0 skipped.
template <typename Elem, int kCluster, int kHeadDim>
__device__ __forceinline__ void cluster_combine_chunk(const FlashParams& params, fc_u32 sPartO,
                                                      fc_u32 sPartL, int r, int c, int b, int h,
                                                      int qi) {
    static_assert(kCluster >= 2 && kCluster <= 16, "cluster merge: 2 to 16 splits");
    float ls[kCluster];
    float x[8][8];   // eight splits' O chunks: the first eight requested with the lse values
    auto load_chunks = [&](int s0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (s0 + j < kCluster) {
                const fc_u32 a = mapa_rank(sPartO + 4u * (fc_u32)(r * kHeadDim + c * 8), s0 + j);
                float lo[4], hi[4];
                ld_dsmem_f32x4(lo, a);
                ld_dsmem_f32x4(hi, a + 16u);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    x[j][e] = lo[e];
                    x[j][4 + e] = hi[e];
                }
            }
        }
    };
    float m = -INFINITY;
    bool has_nan = false;
#pragma unroll
    for (int s = 0; s < kCluster; ++s) ls[s] = ld_dsmem_f32(mapa_rank(sPartL + 4u * r, s));
    load_chunks(0);
#pragma unroll
    for (int s = 0; s < kCluster; ++s) {
        has_nan |= ls[s] != ls[s];
        m = fmaxf(m, ls[s]);
    }
    if (has_nan) m = __int_as_float(0x7fffffff);
    float* lse_out = params.lse + (long long)b * params.lse_batch_stride
                     + (long long)h * params.lse_head_stride + qi;
    fc_u16* out = static_cast<fc_u16*>(params.o) + (long long)b * params.o_batch_stride
                  + (long long)qi * params.o_row_stride + (long long)h * params.o_head_stride
                  + c * 8;
    if (m == -INFINITY) {   // no split saw a key
        if (c == 0) *lse_out = -INFINITY;
        const fc_u32 zero[4] = {0u, 0u, 0u, 0u};
        stg128(out, zero);
        return;
    }
    float t[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) t[i] = i < kCluster ? expf(ls[i] - m) : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = t[i] + t[i + 8];   // combine_row's xor-8 step, ...
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
#pragma unroll
    for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
    const float L = m + logf(t[0] + t[1]);                 // ... down to xor-1 (lane 0's sum)
    if (c == 0) *lse_out = L;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int s0 = 0; s0 < kCluster; s0 += 8) {
        if (s0 > 0) load_chunks(s0);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (s0 + j < kCluster) {
                const float w = expf(ls[s0 + j] - L);
                if (w != 0.f) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] = fmaf(w, x[j][e], acc[e]);
                }
            }
        }
    }
    fc_u32 v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = Elem::pack2(acc[2 * e], acc[2 * e + 1]);
    stg128(out, v);
}

// The cluster merge, called by every thread of every CTA of the cluster exactly once, after
// the CTA's partial is in sPartO / sPartL (rows [0, rows_valid) of the group). CTA of rank k
// merges the chunks i = k, k + kCluster, ... of the group's rows_valid * (headdim / 8) chunks.
template <typename Elem, int kCluster, int kHeadDim, int kNThreads, bool Is_even_d>
__device__ __forceinline__ void cluster_merge(const FlashParams& params, int b, int hk, int m0,
                                              int rows_valid, fc_u32 sPartO, fc_u32 sPartL) {
    constexpr int kCPR = kHeadDim / 8;
    cluster_sync_all();   // every split's partial is in its shared memory
    const int rank = (int)cluster_ctarank();
    const int G = params.nheads / params.nheads_k;
    for (int it = threadIdx.x * kCluster + rank; it < rows_valid * kCPR;
         it += kCluster * kNThreads) {
        const int r = it / kCPR, c = it % kCPR;
        if (!(Is_even_d || c * 8 < params.headdim)) continue;
        cluster_combine_chunk<Elem, kCluster, kHeadDim>(params, sPartO, sPartL, r, c, b,
                                                        hk * G + (m0 + r) % G, (m0 + r) / G);
    }
    cluster_sync_all();   // no CTA leaves while another still reads its shared memory
}

}  // namespace fc_dec

// Template parameters:
//   Elem        fc_bf16 / fc_fp16
//   kHeadDim    head-dim tile: 64, 128, 256 (the real headdim, a multiple of 8, may be smaller)
//   kBlockN     keys per pipeline stage;  kNWarps warps, each owning kBlockN / kNWarps keys
//   kStages     cp.async ring depth (K + V of one key block per stage)
//   kMT         m16 slices per CTA: kBlockM = 16 * kMT packed rows
//   kPaged      0: a contiguous cache; 1: block_table addressing (any page size: see above).
//               (Session 48's kPaged 2 for pages of a multiple of kBlockN is this path now: a
//               per-row page walk for blocks that span pages doubled the main loop's code,
//               which missed in the instruction cache, performance log sessions 48-49.)
//   Is_local    any window side bounded (causal included)
//   Has_softcap, Has_alibi, Is_even_d (headdim == kHeadDim)
//   Is_split    write fp32 partials to o_accum / lse_accum for the combine kernel
//   kCluster    0, or (sm_90+, Is_split) the split count, merged inside the cluster of the
//               group's kCluster CTAs (flash_decode_cluster_kernel) instead of through global
//               scratch
template <typename Elem, int kHeadDim, int kBlockN, int kNWarps, int kStages, int kMT,
          int kPaged, bool Is_local, bool Has_softcap, bool Has_alibi, bool Is_even_d,
          bool Is_split, int kCluster, bool Is_fp8>
__device__ __forceinline__ void flash_decode_body(const FlashParams& params) {
    using namespace fc_dec;
    // The products' element type: q's, or with an FP8 cache fp16 (one conversion instruction
    // per two cache values, from the bytes in registers: no 16-bit copy of the cache in shared
    // memory; q is converted once, see the Q tile below)
    using EM = typename fc_mma_elem<Elem, Is_fp8>::type;
    constexpr bool Is_paged = kPaged != 0;
    static_assert(kPaged == 0 || kPaged == 1, "kPaged: 0 or 1");
    static_assert(kCluster == 0 || Is_split, "a cluster merge merges splits");
    static_assert(!Is_fp8 || (Is_even_d && kHeadDim >= 128), "FP8 caches: head dims 128, 256");
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kBlockM = 16 * kMT;
    constexpr int kWN = kBlockN / kNWarps;          // keys per warp per block
    constexpr int kNT = kWN / 8;                    // n8 tiles of S per slice
    constexpr int kDT = kHeadDim / 8;               // n8 tiles of O per slice
    constexpr int kKD = kHeadDim / 16;              // k16 steps of Q K^T
    constexpr int kW = 64;                          // swizzle column-block width
    constexpr int kJW = kW / 16;
    constexpr bool kNatural = Has_softcap || Has_alibi;
    constexpr bool kQInRegs = kMT * kHeadDim <= 128;
    constexpr int kCPR = kHeadDim / 8;              // 16-byte chunks per row of q / out
    // K/V rows as the loads see them, in 16-bit units: an FP8 row is kHeadDim / 2 of them
    constexpr int kLD = Is_fp8 ? kHeadDim / 2 : kHeadDim;
    constexpr int kLCPR = kLD / 8;                  // 16-byte chunks per K/V row
    constexpr int kRS = kNThreads / kLCPR;          // rows covered by one pass of the CTA
    constexpr int kRPT = kBlockN / kRS;             // rows copied per thread per K (or V) tile
    constexpr fc_u32 kTileBytes = 2u * kBlockN * kLD;
    constexpr fc_u32 kStageBytes = 2u * kTileBytes;   // K then V
    constexpr fc_u32 kQBytes = 2u * kBlockM * kHeadDim;
    constexpr int kRedStride = kHeadDim + 8;        // floats per row of a reduction slab
    constexpr fc_u32 kRedBytes = (fc_u32)kNWarps * kBlockM * kRedStride * 4;
    // The ring region: the K/V stages, reused after the main loop for the reduction slabs (and
    // the cluster merge's partial). FP8 stages hold half the bytes: there the region is the
    // larger of the two (decode.py _ring_bytes mirrors this).
    constexpr fc_u32 kPostBytes = kRedBytes + 4u * kBlockM * kHeadDim + 4u * kBlockM;
    constexpr fc_u32 kRingBytes = Is_fp8 && kPostBytes > kStages * kStageBytes
                                  ? kPostBytes : kStages * kStageBytes;
    static_assert(kWN % 16 == 0, "each warp needs whole k16 steps of keys");
    static_assert(kHeadDim % kW == 0, "head-dim tile must be a multiple of 64");
    static_assert(kNThreads % kLCPR == 0 && kBlockN % kRS == 0, "load split");
    static_assert(kStages >= 2, "at least double buffering");
    static_assert(kRedBytes <= kRingBytes, "reduction slabs must fit in the K/V ring");
    static_assert((fc_u32)kNWarps * kMaxSplits * 4 <= kRingBytes && kQBytes >= 4,
                  "fused combine: weight tables in the ring, the flag in the Q tile");
    static_assert(!Is_paged || 16 % kRPT == 0, "paged: a thread's rows of a block in one page");
    static_assert(kCluster == 0
                  || kRedBytes + 4u * kBlockM * kHeadDim + 4u * kBlockM <= kRingBytes,
                  "cluster merge: the partial O and lse after the reduction slabs, in the ring");

    // Shared memory: Q | ring of kStages x (K, V) | stats (max, sum per warp and row; 1/L).
    // After the main loop the ring is reused for the per-warp O slabs (fp32).
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const fc_u32 sQ = smem_u32(smem_raw);
    const fc_u32 sKV = sQ + kQBytes;
    const fc_u32 sRed = sKV;
    float* sMax = reinterpret_cast<float*>(smem_raw + kQBytes + kRingBytes);
    float* sSum = sMax + kNWarps * kBlockM;
    float* sInv = sSum + kNWarps * kBlockM;
    // Cluster merge: this CTA's partial O (fp32 [kBlockM][kHeadDim]) and lse, in the ring after
    // the reduction slabs (the ring is free once the main loop is done).
    const fc_u32 sPartO = sKV + kRedBytes;
    const fc_u32 sPartL = sPartO + 4u * kBlockM * kHeadDim;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;

    const int hk = blockIdx.x % params.nheads_k;
    const int b = blockIdx.x / params.nheads_k;
    const int m_block = blockIdx.y;
    const int split = blockIdx.z;
    const int G = params.nheads / params.nheads_k;
    const int sq = params.seqlen_q;
    // keys [start, cache_seqlens[b]) of the cache; start > 0 only with cache_leftpad
    // (contiguous caches: the key and value bases move by start rows below)
    const int sk_end = fc_cache_len(params.cache_seqlens, b, params.seqlen_k);
    const int start = Is_paged ? 0 : fc_cache_start(params.cache_leftpad, b, sk_end);
    const int sk = sk_end - start;
    // the caller's key mask from this sequence's first key (row `start` of its cache): masked
    // keys are neither loaded (their tile rows zero-filled) nor attended
    const unsigned char* key_keep =
        params.key_mask == nullptr ? nullptr
        : static_cast<const unsigned char*>(params.key_mask)
              + (long long)b * params.key_mask_batch_stride + start;
    const int m0 = m_block * kBlockM;
    const int rows_valid = min(kBlockM, sq * G - m0);
    const int off = sk - sq;
    const int headdim = params.headdim;

    // Packed row p -> (query row qi, query head h).
    auto row_qi = [&](int r) { return (m0 + r) / G; };
    auto row_h = [&](int r) { return hk * G + (m0 + r) % G; };
    auto lse_ptr = [&](int r) -> float* {
        const int qi = row_qi(r), h = row_h(r);
        if constexpr (Is_split)
            return params.lse_accum
                   + (((long long)split * params.batch + b) * params.nheads + h) * sq + qi;
        else
            return params.lse + (long long)b * params.lse_batch_stride
                   + (long long)h * params.lse_head_stride + qi;
    };

    // ---- the key blocks this CTA walks ---------------------------------------------------
    const bool left_bounded = Is_local && params.window_left < FC_WINDOW_NONE;
    const bool right_bounded = Is_local && params.window_right < FC_WINDOW_NONE;
    const int qi_first = m0 / G;
    const int qi_last = (m0 + rows_valid - 1) / G;
    int n_block_max = (sk + kBlockN - 1) / kBlockN;
    int n_block_min = 0;
    if (right_bounded) {
        const long long hi = (long long)qi_last + off + params.window_right + 1;
        const int nb = hi <= 0 ? 0 : (int)min((hi + kBlockN - 1) / kBlockN, (long long)n_block_max);
        n_block_max = min(n_block_max, nb);
    }
    if (left_bounded) {
        const long long lo = (long long)qi_first + off - params.window_left;
        if (lo > 0) n_block_min = (int)min(lo / kBlockN, (long long)n_block_max);
    }
    const int n_total = max(n_block_max - n_block_min, 0);
    const int per_split = (n_total + params.num_splits - 1) / params.num_splits;
    const int nb_begin = n_block_min + split * per_split;
    const int nb_end = min(nb_begin + per_split, n_block_max);

    if (nb_begin >= nb_end) {
        // Nothing visible to this CTA: lse = -inf; O = 0 (a split's O is never read when its
        // lse is -inf, so the split path writes only the lse). A split CTA still arrives on its
        // group's counter (fused combine): every CTA of a group arrives exactly once.
        if constexpr (kCluster > 0) {
            float* pl = reinterpret_cast<float*>(smem_raw + (sPartL - sQ));
            for (int r = tid; r < rows_valid; r += kNThreads) pl[r] = -INFINITY;
            cluster_merge<Elem, kCluster, kHeadDim, kNThreads, Is_even_d>(
                params, b, hk, m0, rows_valid, sPartO, sPartL);
            return;
        }
        for (int r = tid; r < rows_valid; r += kNThreads) *lse_ptr(r) = -INFINITY;
        if constexpr (Is_split) {
            if (params.split_counter != nullptr)
                split_arrive_and_combine<Elem, kNWarps>(
                    params, b, hk, m0, rows_valid, reinterpret_cast<int*>(smem_raw),
                    reinterpret_cast<float*>(smem_raw + kQBytes));
        } else {
            const fc_u32 zero[4] = {0u, 0u, 0u, 0u};
            for (int idx = tid; idx < kBlockM * kCPR; idx += kNThreads) {
                const int r = idx / kCPR, c = idx % kCPR;
                if (r < rows_valid && (Is_even_d || c * 8 < headdim))
                    stg128(static_cast<fc_u16*>(params.o) + (long long)b * params.o_batch_stride
                               + (long long)row_qi(r) * params.o_row_stride
                               + (long long)row_h(r) * params.o_head_stride + c * 8,
                           zero);
            }
        }
        return;
    }

    // ---- Q tile (gathered rows), one cp.async group -----------------------------------------
    {
        const fc_u16* q = static_cast<const fc_u16*>(params.q);
        constexpr int kIters = (kBlockM * kCPR + kNThreads - 1) / kNThreads;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int idx = tid + it * kNThreads;
            if ((kBlockM * kCPR) % kNThreads != 0 && idx >= kBlockM * kCPR) break;
            const int r = idx / kCPR, c = idx % kCPR;
            const bool pred = r < rows_valid && (Is_even_d || c * 8 < headdim);
            const fc_u16* src = q;
            if (pred)
                src = q + (long long)b * params.q_batch_stride
                      + (long long)row_qi(r) * params.q_row_stride
                      + (long long)row_h(r) * params.q_head_stride + c * 8;
            cp_async_16(sQ + 2u * (fc_u32)tile_off<kW, kBlockM>(r, c * 8), src, pred);
        }
        cp_async_commit();
    }

    // ---- K/V block loads ---------------------------------------------------------------------
    // Thread owns 16-byte column chunk lc of rows row_of(i), i < kRPT: 16 (d128) threads cover
    // one row, so each warp reads whole contiguous rows; a contiguous cache interleaves the
    // threads' rows (lr0 + i kRS), a paged one gives each row group kRPT consecutive rows
    // (lr0 kRPT + i: one page, see above).
    const int lr0 = tid / kLCPR;
    const int lc = tid % kLCPR;
    auto row_of = [&](int i) { return Is_paged ? lr0 * kRPT + i : lr0 + i * kRS; };
    const bool col_ok = Is_even_d || lc * 8 < headdim;
    const fc_u16* gK = static_cast<const fc_u16*>(params.k) + (long long)hk * params.k_head_stride
                       + (Is_paged ? 0ll : (long long)b * params.k_batch_stride
                                           + (long long)start * params.k_row_stride) + lc * 8;
    const fc_u16* gV = static_cast<const fc_u16*>(params.v) + (long long)hk * params.v_head_stride
                       + (Is_paged ? 0ll : (long long)b * params.v_batch_stride
                                           + (long long)start * params.v_row_stride) + lc * 8;
    const int* bt = Is_paged ? params.block_table + (long long)b * params.block_table_batch_stride
                             : nullptr;
    const int page_size = params.page_size;
    // Paged: the page walk of this thread's rows without a division per block. (wp, wr): page
    // index and row in page of the thread's first row (row_of(0)) of the next block to fetch;
    // a block advances it by kBlockN = bq pages + br rows. Table entries are read at
    // min(index, bt_last): always inside the table row, so no predicate; an entry past the
    // sequence's pages is never used (its rows fail tok < sk).
    int wp = 0, wr = 0, bq = 0, br = 0, bt_last = 0;
    if constexpr (Is_paged) {
        const int tok0 = nb_begin * kBlockN + row_of(0);
        wp = tok0 / page_size;
        wr = tok0 - wp * page_size;
        bq = kBlockN / page_size;
        br = kBlockN - bq * page_size;
        bt_last = max(params.seqlen_k / page_size - 1, 0);
    }
    // The table entry (physical block) of this thread's rows of a fetched block, and the row in
    // page of its first row. Two sets: the prologue fetches block s + 1 before it issues the
    // copies of block s (whose entry it then waits for), so the table reads of the first
    // blocks overlap; the main loop reads the entry of block nb + kStages one block ahead.
    int pgs[2] = {0, 0};
    int pr0[2] = {0, 0};
    auto fetch_pages = [&](int& pg, int& r0) {   // the block after the last fetched one
        if constexpr (Is_paged) {
            r0 = wr;
            pg = fc_pool_block(bt[min(wp, bt_last)], params.num_blocks);
            // keep the table's next lines warm in L2 (page 16: a 128-byte line is 8 blocks)
            if (tid == 0) prefetch_l2(bt + min(wp + 32, bt_last));
            wp += bq;
            wr += br;
            if (wr >= page_size) {
                wr -= page_size;
                ++wp;
            }
        }
    };
    // keyed: a key mask is given (key_keep != nullptr; the main loop's copies pass a constant)
    auto load_kv = [&](int nb, int stage, int pg, int r0, bool keyed) {
        const fc_u32 sK = sKV + (fc_u32)stage * kStageBytes;
        const fc_u32 sV = sK + kTileBytes;
        auto issue = [&](int i, long long ko, long long vo) {
            const int row = row_of(i);
            const int tok = nb * kBlockN + row;
            const bool pred = col_ok && tok < sk && (!keyed || __ldg(key_keep + tok));
            const fc_u32 so = 2u * (fc_u32)tile_off<kW, kBlockN>(row, lc * 8);   // (kLD columns)
            cp_async_16(sK + so, pred ? gK + ko : gK, pred);
            cp_async_16(sV + so, pred ? gV + vo : gV, pred);
        };
        if constexpr (Is_paged) {
            const long long kb = (long long)pg * params.k_batch_stride
                                 + (long long)r0 * params.k_row_stride;
            const long long vb = (long long)pg * params.v_batch_stride
                                 + (long long)r0 * params.v_row_stride;
#pragma unroll
            for (int i = 0; i < kRPT; ++i)
                issue(i, kb + (long long)i * params.k_row_stride,
                      vb + (long long)i * params.v_row_stride);
        } else {
#pragma unroll
            for (int i = 0; i < kRPT; ++i) {
                const long long tok = nb * kBlockN + row_of(i);
                issue(i, tok * params.k_row_stride, tok * params.v_row_stride);
            }
        }
    };

    // ---- prologue: kStages - 1 blocks in flight ----------------------------------------------
    // (paged: the entries of block s + 1 are requested before the copies of block s wait for
    // theirs; afterwards set kPgMain holds the entries of block nb_begin + kStages - 1)
    constexpr int kPgMain = (kStages - 1) & 1;
    fetch_pages(pgs[0], pr0[0]);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (nb_begin + s < nb_end) {
            fetch_pages(pgs[(s + 1) & 1], pr0[(s + 1) & 1]);
            load_kv(nb_begin + s, s, pgs[s & 1], pr0[s & 1], key_keep != nullptr);
        }
        cp_async_commit();
    }

    // ---- FP8 cache: the Q tile rewritten in place for the products with byte fragments.
    // With a bfloat16 q it becomes fp16, times 2^-qs where qs >= 0 keeps the tile's largest |q|
    // below 2^15 (exact; fp16 holds every bf16 value in range to at least bf16's precision),
    // and 2^qs moves into the keys' descale. Either way the head dim is permuted inside each
    // 16-column chunk: stored column m holds dim pi(m), pi(2t + j) = 4t + j,
    // pi(8 + 2t + j) = 4t + 2 + j (t < 4, j < 2), i.e. the chunk's first 8 columns are its
    // 32-bit words 0, 2, 4, 6 and the last 8 its words 1, 3, 5, 7. An ldmatrix of 8 keys x 16
    // bytes of K gives lane 4g + t the bytes of dims 4t .. 4t + 3 of key g, whose two halves,
    // converted, are the B registers of k positions 2t, 2t + 1 and 2t + 8, 2t + 9 (main loop).
    float q_unscale = 1.f;
    if constexpr (Is_fp8) {
        cp_async_wait<kStages - 1>();   // the Q group (the oldest) landed
        __syncthreads();
        [[maybe_unused]] float f = 1.f;
        if constexpr (fc_mma_elem<Elem, Is_fp8>::kConvertQ) {
            constexpr int kQChunks = kBlockM * kCPR;
            int* sQmax = reinterpret_cast<int*>(sMax);   // (free until the merge)
            if (tid == 0) *sQmax = 0;
            int e_max = 0;
            for (int idx = tid; idx < kQChunks; idx += kNThreads) {
                fc_u32 w[4];
                lds128(w, sQ + 2u * (fc_u32)tile_off<kW, kBlockM>(idx / kCPR, (idx % kCPR) * 8));
#pragma unroll
                for (int e = 0; e < 4; ++e)   // the largest exponent field of a finite value
                    e_max = max(e_max, (int)max((w[e] >> 7) & 0xFFu, (w[e] >> 23) & 0xFFu) % 255);
            }
            __syncthreads();
            atomicMax(sQmax, e_max);
            __syncthreads();
            const int qs = max(*sQmax - 127 - 14, 0);   // |q| < 2^(e - 126) <= 2^15 after scaling
            f = __int_as_float((127 - qs) << 23);       // 2^-qs (qs <= 113)
            q_unscale = __int_as_float((127 + qs) << 23);
        }
        constexpr int kC16 = kHeadDim / 16;   // 16-column chunks per row
        for (int idx = tid; idx < kBlockM * kC16; idx += kNThreads) {
            const int r = idx / kC16, c = idx % kC16;
            const fc_u32 a0 = sQ + 2u * (fc_u32)tile_off<kW, kBlockM>(r, 16 * c);
            const fc_u32 a1 = sQ + 2u * (fc_u32)tile_off<kW, kBlockM>(r, 16 * c + 8);
            fc_u32 w[4], x[4];   // the chunk's words 0-3 and 4-7
            lds128(w, a0);
            lds128(x, a1);
            if constexpr (fc_mma_elem<Elem, Is_fp8>::kConvertQ) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    w[e] = EM::pack2(Elem::to_float((fc_u16)(w[e] & 0xFFFFu)) * f,
                                     Elem::to_float((fc_u16)(w[e] >> 16)) * f);
                    x[e] = EM::pack2(Elem::to_float((fc_u16)(x[e] & 0xFFFFu)) * f,
                                     Elem::to_float((fc_u16)(x[e] >> 16)) * f);
                }
            }
            sts128(a0, w[0], w[2], x[0], x[2]);
            sts128(a1, w[1], w[3], x[1], x[3]);
        }
        __syncthreads();
    }

    // ---- per-lane ldmatrix offsets (fc_ldmatrix_offsets: the fragment layouts) -------------
    int a_off[kJW], k_off[kJW];
    fc_ldmatrix_offsets<kW>(lane, a_off, k_off);
    auto q_addr = [&](int mt, int kk) -> fc_u32 {
        return sQ + 2u * ((kk / kJW) * (kBlockM * kW) + mt * 16 * kW + a_off[kk % kJW]);
    };
    fc_u32 qf[kQInRegs ? kMT : 1][kQInRegs ? kKD : 1][4];
    if constexpr (kQInRegs) {
        cp_async_wait<kStages - 1>();   // the Q group (the oldest) landed
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int kk = 0; kk < kKD; ++kk) ldmatrix_x4(qf[mt][kk], q_addr(mt, kk));
    }

    // ---- per-row state ---------------------------------------------------------------------
    // Thread rows: slice mt, half r -> tile row mt * 16 + g + 8r (the same for every warp).
    float acc_o[kMT][kDT][4];
    fc_zero_fragment(acc_o);
    float row_max[kMT][2], row_sum[kMT][2];
    int row_pos[kMT][2];          // i + sk - sq of the row's query
    float slope[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[mt][r] = -INFINITY;
            row_sum[mt][r] = 0.f;
            const int rr = mt * 16 + g + 8 * r;
            row_pos[mt][r] = row_qi(rr) + off;
            slope[mt][r] = 0.f;
            if constexpr (Has_alibi) {
                // rows past the tile's valid rows read the slope of a valid head (never stored)
                const int rc = rr < rows_valid ? rr : 0;
                slope[mt][r] = params.alibi_slopes[(long long)b * params.alibi_batch_stride + row_h(rc)];
            }
        }
    const int win_r = right_bounded ? min(params.window_right, sq) : 0;
    const int win_l = left_bounded ? min(params.window_left, sk) : 0;
    const float mult = kNatural ? kLog2e : params.scale_log2;
    const float cap_in = Has_softcap ? params.softmax_scale / params.softcap : 0.f;
    // Blocks that need no element mask: fully below every row's right edge and the tail,
    // fully above every row's left edge (the tile's last row, padding rows included).
    const int blk_hi = right_bounded ? min(sk, qi_first + off + win_r + 1) : sk;
    const int blk_lo = left_bounded ? (m0 + kBlockM - 1) / G + off - win_l : 0;
    const int wn0 = warp * kWN;   // this warp's first key row inside a block
    // FP8 caches: the (batch, kv head)'s descales (nullptr: 1)
    const float k_scale = (Is_fp8 && params.k_descale != nullptr
                           ? params.k_descale[(long long)b * params.nheads_k + hk] : 1.f) * q_unscale;
    const float v_scale = Is_fp8 && params.v_descale != nullptr
                          ? params.v_descale[(long long)b * params.nheads_k + hk] : 1.f;

    // ---- main loop ------------------------------------------------------------------------
    // In two copies (fc_mask_copies), with and without a key mask (keyed: the caller's
    // key_mask), and each block's mask and softmax in two, a boundary block's (or a keyed one's)
    // with the mask and the others' without.
    int stage = 0;
    int load_stage = kStages - 1;
    auto main_loop = [&](const bool keyed) {
        for (int nb = nb_begin; nb < nb_end; ++nb) {
            cp_async_wait<kStages - 2>();   // block nb landed (this thread's copies)
            __syncthreads();                // everyone's; and the ring slot of nb - 1 is free

            if (nb + kStages - 1 < nb_end) {
                load_kv(nb + kStages - 1, load_stage, pgs[kPgMain], pr0[kPgMain], keyed);
                fetch_pages(pgs[kPgMain], pr0[kPgMain]);   // block nb + kStages
            }
            cp_async_commit();   // possibly empty: keeps the group count uniform
            load_stage = (load_stage + 1 == kStages) ? 0 : load_stage + 1;

            const fc_u32 sKb = sKV + (fc_u32)stage * kStageBytes;
            const fc_u32 sVb = sKb + kTileBytes;
            stage = (stage + 1 == kStages) ? 0 : stage + 1;
            const int n0 = nb * kBlockN;
            // (read before the products, used after them)
            const unsigned keep_bits =
                keyed ? fc_key_mask_bits<kNT>(key_keep, n0 + wn0 + 2 * t, sk) : ~0u;

            // S = Q K^T over this warp's kWN keys
            float s[kMT][kNT][4];
            if constexpr (Is_fp8) {
                fc_zero_fragment(s);
                // The FP8 tile: a key row is kHeadDim bytes (kLD 16-bit units in the swizzled
                // layout); its 16-byte chunk c holds dims 16c .. 16c + 15. One x4 ldmatrix per
                // pair of chunks (2kp, 2kp + 1) and pair of key octets (k_off's lane order):
                // kb[2q + h] is octet q's 8 x 16-byte matrix of chunk 2kp + h, lane 4g + t holding
                // the bytes of dims 4t .. 4t + 3 of key g: converted, the two B registers of the
                // k16 step 2kp + h against Q's permuted chunk (see the Q tile).
#pragma unroll
                for (int kp = 0; kp < kKD / 2; ++kp) {
                    fc_u32 qa[2][kMT][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt)
                            fc_q_frag<kQInRegs>(qa[h][mt], qf, q_addr, mt, 2 * kp + h);
#pragma unroll
                    for (int np = 0; np < kNT / 2; ++np) {
                        fc_u32 kb[4];
                        ldmatrix_x4(kb, sKb + 2u * ((kp / kJW) * (kBlockN * kW)
                                                    + (wn0 + np * 16) * kW + k_off[kp % kJW]));
#pragma unroll
                        for (int q = 0; q < 2; ++q)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const fc_u32 bb[2] = {fc_e4m3x2_to_f16x2(kb[2 * q + h]),
                                                      fc_e4m3x2_hi_to_f16x2(kb[2 * q + h])};
#pragma unroll
                                for (int mt = 0; mt < kMT; ++mt)
                                    EM::mma(s[mt][2 * np + q], qa[h][mt], bb);
                            }
                    }
                }
            } else {
                fc_qk_product<EM, kKD, kBlockN, kW, kQInRegs>(s, qf, q_addr, sKb, wn0, k_off);
            }

            if constexpr (Is_fp8)   // the keys' descale (the scores of K's stored values)
                fc_mul_fragment(s, k_scale);

            // scale, softcap, ALiBi, mask (DESIGN.md order), then the online softmax step (per
            // warp; flash_scores.cuh). Element e of tile nt: row half r = e / 2, key
            // n0 + wn0 + nt*8 + 2t + (e & 1).
            const int kc0 = n0 + wn0 + 2 * t;   // this lane's first key column
            auto pos_of = [&](int mt, int r) { return row_pos[mt][r] - kc0; };
            fc_scale_scores<Has_softcap, Has_alibi>(s, params.softcap, cap_in,
                                                    params.softmax_scale);
            if constexpr (Has_alibi)
                fc_alibi_scores(s, [&](int mt, int r) { return slope[mt][r]; }, pos_of);
            const bool boundary = n0 + kBlockN > blk_hi || n0 < blk_lo;
            auto softmax_step = [&](const bool masked) {
                if (masked && boundary)
                    fc_mask_scores<kMT, kNT, kBlockN>(s, pos_of, sk - kc0, left_bounded,
                                                      right_bounded, win_l, win_r);
                if (masked && keyed) fc_apply_key_mask(s, keep_bits);
                fc_online_softmax(s, row_max, row_sum, acc_o, mult);
            };
            fc_mask_copies(boundary || keyed, softmax_step);

            // O += P V over this warp's keys (P straight from the S accumulators)
            if constexpr (Is_fp8) {
#pragma unroll
                for (int kk = 0; kk < kWN / 16; ++kk) {
                    fc_u32 pa[kMT][4];
                    fc_pack_p<EM>(s, kk, pa);
                    // One x4 ldmatrix.trans per pair of 16-byte chunks (2cp, 2cp + 1) of the
                    // warp's 16 keys (a_off's lane order): vb[2h] keys 0-7 and vb[2h + 1] keys
                    // 8-15 of chunk c = 2cp + h. Lane 4g + t gets the 16-bit units (key 2t, unit
                    // g) and (key 2t + 1, unit g), i.e. bytes [V(2t, 2g), V(2t, 2g + 1),
                    // V(2t + 1, 2g), V(2t + 1, 2g + 1)] (dims relative to 16c). prmt 0x3120 makes
                    // the low half bytes {0, 2} (dim 2g, keys 2t, 2t + 1) and the high half bytes
                    // {1, 3} (dim 2g + 1): converted, the B registers of two n8 tiles, acc_o[2c]
                    // ("even": column g is dim 16c + 2g) and acc_o[2c + 1] ("odd": dim
                    // 16c + 2g + 1). The merge below maps them back.
#pragma unroll
                    for (int cp = 0; cp < kHeadDim / 32; ++cp) {
                        fc_u32 vb[4];
                        ldmatrix_x4_trans(vb, sVb + 2u * ((cp / kJW) * (kBlockN * kW)
                                                          + (wn0 + kk * 16) * kW
                                                          + a_off[cp % kJW]));
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const fc_u32 x0 = fc_prmt(vb[2 * h], 0x3120u);
                            const fc_u32 x1 = fc_prmt(vb[2 * h + 1], 0x3120u);
                            fc_mma_pair<EM>(acc_o, 2 * (2 * cp + h), pa,
                                            fc_e4m3x2_to_f16x2(x0), fc_e4m3x2_to_f16x2(x1),
                                            fc_e4m3x2_hi_to_f16x2(x0), fc_e4m3x2_hi_to_f16x2(x1));
                        }
                    }
                }
            } else {
                fc_pv_product<EM, kBlockN, kW>(acc_o, s, sVb, wn0, a_off);
            }
        }
    };
    fc_mask_copies(key_keep != nullptr, main_loop);
    cp_async_wait<0>();   // only empty groups can be pending; the ring is about to be reused
    if constexpr (Is_fp8)   // the values' descale
        fc_mul_fragment(acc_o, v_scale);

    // ---- merge the warps' partial softmax states ---------------------------------------------
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[mt][r]);
            if (t == 0) {
                const int rr = mt * 16 + g + 8 * r;
                sMax[warp * kBlockM + rr] = row_max[mt][r];
                sSum[warp * kBlockM + rr] = l;
            }
        }
    __syncthreads();   // stats visible; every warp is done reading the ring

    const float lse_scale = kNatural ? 1.f : params.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rr = mt * 16 + g + 8 * r;
            float M = -INFINITY;
#pragma unroll
            for (int w = 0; w < kNWarps; ++w) M = fmaxf(M, sMax[w * kBlockM + rr]);
            const float Ms = (M == -INFINITY) ? 0.f : M * mult;
            float L = 0.f;
#pragma unroll
            for (int w = 0; w < kNWarps; ++w)
                L += fc_exp2(sMax[w * kBlockM + rr] * mult - Ms) * sSum[w * kBlockM + rr];
            const float f = fc_exp2(row_max[mt][r] * mult - Ms);   // 0 when this warp saw nothing
            const float inv = L == 0.f ? 0.f : 1.f / L;   // NaN L propagates (see flash_fwd)
            if (warp == 0 && t == 0) {
                sInv[rr] = inv;
                if (rr < rows_valid) {
                    const float lse_v = L == 0.f ? -INFINITY : M * lse_scale + logf(L);
                    if constexpr (kCluster > 0)
                        reinterpret_cast<float*>(smem_raw + (sPartL - sQ))[rr] = lse_v;
                    else
                        *lse_ptr(rr) = lse_v;
                }
            }
            const fc_u32 slab = sRed + 4u * (fc_u32)((warp * kBlockM + rr) * kRedStride);
            if constexpr (Is_fp8) {
                // tile 2c + p, element 2r + i holds dim 16c + 4t + 2i + p (see the P V product):
                // dims 16c + 4t .. 16c + 4t + 3 of the row, in one store
#pragma unroll
                for (int c = 0; c < kDT / 2; ++c)
                    sts128f(slab + 4u * (c * 16 + 4 * t), acc_o[mt][2 * c][2 * r] * f,
                            acc_o[mt][2 * c + 1][2 * r] * f, acc_o[mt][2 * c][2 * r + 1] * f,
                            acc_o[mt][2 * c + 1][2 * r + 1] * f);
            } else {
#pragma unroll
                for (int j = 0; j < kDT; ++j)
                    sts64f(slab + 4u * (j * 8 + 2 * t), acc_o[mt][j][2 * r] * f,
                           acc_o[mt][j][2 * r + 1] * f);
            }
        }
    __syncthreads();

    // ---- sum the slabs, normalise, store (8 columns per thread and step, coalesced) -----------
    for (int idx = tid; idx < kBlockM * kCPR; idx += kNThreads) {
        const int r = idx / kCPR, c = idx % kCPR;
        if (r >= rows_valid || !(Is_even_d || c * 8 < headdim)) continue;
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) {
            const fc_u32 a = sRed + 4u * (fc_u32)((w * kBlockM + r) * kRedStride + c * 8);
            float x[4], y[4];
            lds128f(x, a);
            lds128f(y, a + 16u);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[e] += x[e];
                o[4 + e] += y[e];
            }
        }
        const float inv = sInv[r];
        const int qi = row_qi(r), h = row_h(r);
        if constexpr (kCluster > 0) {
            const fc_u32 dst = sPartO + 4u * (fc_u32)(r * kHeadDim + c * 8);
            sts64f(dst, o[0] * inv, o[1] * inv);
            sts64f(dst + 8u, o[2] * inv, o[3] * inv);
            sts64f(dst + 16u, o[4] * inv, o[5] * inv);
            sts64f(dst + 24u, o[6] * inv, o[7] * inv);
        } else if constexpr (Is_split) {
            float* dst = params.o_accum
                         + ((((long long)split * params.batch + b) * params.nheads + h) * sq + qi)
                               * headdim + c * 8;
            stg128f(dst, o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
            stg128f(dst + 4, o[4] * inv, o[5] * inv, o[6] * inv, o[7] * inv);
        } else {
            fc_u32 v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = Elem::pack2(o[2 * e] * inv, o[2 * e + 1] * inv);
            stg128(static_cast<fc_u16*>(params.o) + (long long)b * params.o_batch_stride
                       + (long long)qi * params.o_row_stride + (long long)h * params.o_head_stride
                       + c * 8,
                   v);
        }
    }
    if constexpr (kCluster > 0) {
        cluster_merge<Elem, kCluster, kHeadDim, kNThreads, Is_even_d>(params, b, hk, m0,
                                                                      rows_valid, sPartO, sPartL);
    } else if constexpr (Is_split) {
        // Fused combine: the flag in the Q tile, the weight tables in the ring (both free now;
        // the barrier inside orders them after the slab reads above).
        if (params.split_counter != nullptr)
            split_arrive_and_combine<Elem, kNWarps>(params, b, hk, m0, rows_valid,
                                                    reinterpret_cast<int*>(smem_raw),
                                                    reinterpret_cast<float*>(smem_raw + kQBytes));
    }
}

// Is_fp8: the cache is float8_e4m3fn (Elem is q's type), with params.k_descale / v_descale.
template <typename Elem, int kHeadDim, int kBlockN, int kNWarps, int kStages, int kMT,
          int kPaged, bool Is_local, bool Has_softcap, bool Has_alibi, bool Is_even_d,
          bool Is_split, bool Is_fp8>
__global__ void __launch_bounds__(kNWarps * 32, 2)
flash_decode_kernel(const FlashParams params) {
    flash_decode_body<Elem, kHeadDim, kBlockN, kNWarps, kStages, kMT, kPaged, Is_local,
                      Has_softcap, Has_alibi, Is_even_d, Is_split, 0, Is_fp8>(params);
}

// Split-KV with the merge inside a cluster (sm_90+): grid (batch * nheads_k, m-blocks,
// kCluster), one cluster per group along z. kCluster > 8 needs the non-portable cluster size
// allowed on the function (the launcher sets it). Not declared for older targets
// (__cluster_dims__ does not compile there; the launcher never asks for it below sm_90).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template <typename Elem, int kHeadDim, int kBlockN, int kNWarps, int kStages, int kMT,
          int kPaged, bool Is_local, bool Has_softcap, bool Has_alibi, bool Is_even_d,
          int kCluster, bool Is_fp8>
__global__ void __cluster_dims__(1, 1, kCluster) __launch_bounds__(kNWarps * 32, 2)
flash_decode_cluster_kernel(const FlashParams params) {
    flash_decode_body<Elem, kHeadDim, kBlockN, kNWarps, kStages, kMT, kPaged, Is_local,
                      Has_softcap, Has_alibi, Is_even_d, true, kCluster, Is_fp8>(params);
}
#endif

// Merge the splits (the two-kernel path, split_counter == nullptr): one warp per output row
// (b, h, qi); 4 warps per CTA. num_splits <= 256. The same per-row code as the fused combine.
template <typename Elem>
__global__ void __launch_bounds__(128)
flash_decode_combine_kernel(const FlashParams params) {
    using namespace fc_dec;
    __shared__ float sW[4][kMaxSplits];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sq = params.seqlen_q;
    const long long rows = (long long)params.batch * params.nheads * sq;
    const long long R = (long long)blockIdx.x * 4 + warp;   // (b * nheads + h) * sq + qi
    if (R >= rows) return;   // warp-uniform
    const int qi = (int)(R % sq);
    const long long bh = R / sq;
    const int h = (int)(bh % params.nheads);
    const int b = (int)(bh / params.nheads);
    combine_row<Elem>(params, R, b, h, qi, sW[warp], lane);
}

// Write new rows into a cache (or rotate q into q_out). One thread per pair of elements, so a
// rotation reads both inputs before writing both outputs (in-place safe).
//   src  (batch, seqlen, nheads, headdim) with strides (src_bs, src_rs, src_hs)
//   dst  row pos = (dst_row_offsets ? dst_row_offsets[b] : 0) + t of sequence b:
//        contiguous: dst + b*dst_bs + pos*dst_rs + h*dst_hs
//        paged:      dst + block_table[b*bt_stride + pos/page_size]*dst_bs
//                        + (pos%page_size)*dst_rs + h*dst_hs
//        rows outside [0, capacity) and blocks outside [0, num_blocks) are skipped
//   rotary (Has_rotary): position rot_offsets[b] + t of cos/sin (fp32, (seqlen_ro, rotary_dim/2),
//        contiguous); non-interleaved rotates (x[i], x[i + rd/2]), interleaved (x[2i], x[2i+1]),
//        i < rd/2: o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin. Dims >= rotary_dim are copied.
template <typename Elem, bool Is_paged, bool Has_rotary, bool Interleaved>
__global__ void __launch_bounds__(256)
flash_append_kv_kernel(const fc_u16* __restrict__ src, long long src_bs, long long src_rs,
                       long long src_hs, fc_u16* dst, long long dst_bs, long long dst_rs,
                       long long dst_hs, const int* dst_row_offsets, const int* block_table,
                       long long bt_stride, int page_size, const float* cos_t,
                       const float* sin_t, const int* rot_offsets, int rotary_dim, int seqlen_ro,
                       int batch, int seqlen, int nheads, int headdim, int capacity,
                       int num_blocks) {
    const int half_d = headdim / 2;
    const long long total = (long long)batch * seqlen * nheads * half_d;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int u = (int)(idx % half_d);
    long long rest = idx / half_d;
    const int h = (int)(rest % nheads);
    rest /= nheads;
    const int t = (int)(rest % seqlen);
    const int b = (int)(rest / seqlen);

    const int rd = Has_rotary ? rotary_dim : 0;
    const int half_r = rd / 2;
    int j1, j2;
    const bool rotate = Has_rotary && u < half_r;
    if (rotate) {
        j1 = Interleaved ? 2 * u : u;
        j2 = Interleaved ? 2 * u + 1 : u + half_r;
    } else {
        j1 = rd + 2 * (u - half_r);
        j2 = j1 + 1;
    }
    const fc_u16* s = src + (long long)b * src_bs + (long long)t * src_rs + (long long)h * src_hs;
    fc_u16 o1 = s[j1], o2 = s[j2];
    if (rotate) {
        int pos = rot_offsets[b] + t;
        pos = min(max(pos, 0), seqlen_ro - 1);   // the caller validates; never read out of bounds
        const float c = cos_t[(long long)pos * half_r + u];
        const float sn = sin_t[(long long)pos * half_r + u];
        const float x1 = Elem::to_float(o1), x2 = Elem::to_float(o2);
        o1 = Elem::from_float(x1 * c - x2 * sn);
        o2 = Elem::from_float(x2 * c + x1 * sn);
    }
    const int pos = (dst_row_offsets != nullptr ? dst_row_offsets[b] : 0) + t;
    // A row past the cache (a bad cache_seqlens) or in a block outside the pool (a bad
    // block_table entry) is not written: nothing outside the cache is ever touched.
    if (pos < 0 || pos >= capacity) return;
    fc_u16* d;
    if constexpr (Is_paged) {
        const int blk = block_table[(long long)b * bt_stride + pos / page_size];
        if (blk < 0 || blk >= num_blocks) return;
        d = dst + (long long)blk * dst_bs + (long long)(pos % page_size) * dst_rs
            + (long long)h * dst_hs;
    } else {
        d = dst + (long long)b * dst_bs + (long long)pos * dst_rs + (long long)h * dst_hs;
    }
    d[j1] = o1;
    d[j2] = o2;
}
