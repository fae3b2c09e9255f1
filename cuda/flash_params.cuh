// flashcore: the one parameter struct that crosses the Python/CUDA boundary.
//
// It is passed BY VALUE to every kernel. flashcore/kernels/params.py builds the matching
// NumPy structured scalar; the two definitions must stay in the same order with the same
// types (a test compares offsetof() on the CUDA side with the NumPy dtype).
//
// Conventions (see DESIGN.md):
//  * q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_k, headdim), strides
//    in ELEMENTS; the last dimension is contiguous. Varlen: cu_seqlens_q/k are non-null, the
//    batch strides are 0 and the row offset of sequence b is cu_seqlens[b].
//  * lse / dsoftmax_sum: float32 (batch, nheads, seqlen_q), or (nheads, total_q) for varlen
//    (lse_batch_stride = 0 there; the row offset comes from cu_seqlens_q).
//  * window: query row i (0-based in its sequence) sees key column j iff
//        i + (sk - sq) - window_left <= j <= i + (sk - sq) + window_right
//    An unbounded side is passed as FC_WINDOW_NONE (a large positive number), so causal is
//    (FC_WINDOW_NONE, 0). sk and sq are the per-sequence lengths (varlen: from cu_seqlens).
//  * softcap > 0: s -> softcap * tanh(s / softcap) after scaling, before ALiBi and the mask.
//  * ALiBi adds -slope * |i + sk - sq - j|; slope = alibi_slopes[b * alibi_batch_stride + h].
//  * KV-cache decoding (flash_decode.cu): k/v point at the cache. sk of sequence b is
//    cache_seqlens[b]; seqlen_k is unused. Contiguous cache: (batch, seqlen_cache, nheads_k, d)
//    with the usual strides. Paged cache (block_table != nullptr): (num_blocks, page_size,
//    nheads_k, d); k/v_batch_stride is the stride between blocks, k/v_row_stride the stride
//    within one; token t of sequence b is row t % page_size of block
//    block_table[b * block_table_batch_stride + t / page_size] (64-bit arithmetic).
//    Split-KV (num_splits > 1): each split writes fp32 partial results to
//    o_accum (num_splits, batch, nheads, seqlen_q, headdim) and lse_accum
//    (num_splits, batch, nheads, seqlen_q), both contiguous. They are merged either by the last
//    split CTA of each (batch, kv head, m-block) to finish (split_counter != nullptr: one int32
//    arrival counter per group, zero before the launch and reset to zero by that CTA), or by
//    the separate combine kernel (split_counter == nullptr).
#pragma once

#define FC_WINDOW_NONE (1 << 30)

struct FlashParams {
    // ---- pointers (device addresses) --------------------------------------------------
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    const void* dout;          // backward only
    void* dq;                  // backward only
    void* dk;                  // backward only
    void* dv;                  // backward only
    float* dq_accum;           // backward: fp32 scratch, (batch, seqlen_q_rounded, nheads, hdim_rounded)
    float* dsoftmax_sum;       // backward: D = rowsum(dO * O), same layout as lse
    const int* cu_seqlens_q;   // nullptr unless varlen
    const int* cu_seqlens_k;   // nullptr unless varlen
    const float* alibi_slopes; // nullptr unless ALiBi

    // ---- strides, in elements ---------------------------------------------------------
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long dq_accum_batch_stride, dq_accum_row_stride, dq_accum_head_stride;
    long long lse_batch_stride, lse_head_stride;
    long long alibi_batch_stride;

    // ---- sizes ------------------------------------------------------------------------
    int batch;
    int nheads;
    int nheads_k;
    int headdim;               // the real head dim (<= the kernel's tile head dim)
    int seqlen_q;              // max_seqlen_q for varlen
    int seqlen_k;              // max_seqlen_k for varlen
    int window_left;           // FC_WINDOW_NONE when unbounded
    int window_right;          // FC_WINDOW_NONE when unbounded; 0 for causal

    // ---- scalars ----------------------------------------------------------------------
    float softmax_scale;
    float scale_log2;          // softmax_scale * log2(e) (softcap: log2(e) only, see kernels)
    float softcap;             // 0 when off
    float _pad0;

    // ---- KV-cache decoding (flash_decode.cu; appended, zero for the other kernels) -------
    const int* cache_seqlens;  // int32 (batch,): valid keys of each sequence
    const int* block_table;    // int32 (batch, max_blocks); nullptr for a contiguous cache
    float* o_accum;            // split-KV scratch, fp32 (num_splits, batch, nheads, seqlen_q, headdim)
    float* lse_accum;          // split-KV scratch, fp32 (num_splits, batch, nheads, seqlen_q)
    long long block_table_batch_stride;
    int page_size;             // rows per cache block (paged), a multiple of 16
    int num_splits;            // key-range splits per (batch, kv head, m-block); 1 = no combine
    int* split_counter;        // split-KV fused combine: int32 arrival counters, one per
                               // (batch, kv head, m-block), all 0 between launches; nullptr =
                               // the separate combine kernel merges the splits

    // ---- bounds for values read from device arrays (see "Trusted values" above) ----------
    int total_q;               // varlen: rows of the packed q (and out, lse); else 0
    int total_k;               // varlen: rows of the packed k and v; else 0
    int num_blocks;            // paged decoding: blocks in the cache pool; else 0
    int _pad1;
    const int* cache_leftpad;  // contiguous decoding: int32 (batch,), sequence b's keys are rows
                               // cache_leftpad[b] .. cache_seqlens[b] - 1; nullptr = from row 0
    int o_fp32;                // forward: o is float32 (partial outputs kept unrounded, e.g. for
                               // merging through the lse); its strides in float elements
    int o_tma;                 // forward, warp-specialised kernels with an O buffer: the tensor
                               // map maps.o describes o, which the epilogue writes by TMA stores
    const void* dropout_rng;   // attention dropout: int64 (seed, offset) on the device (see
                               // flash_dropout.cuh); nullptr without dropout
    int dropout_threshold;     // r8 < threshold drops (flashcore.dropout)
    float dropout_scale;       // 1 / (1 - p)
    const float* k_descale;    // decoding over an FP8 (e4m3) cache: float32 (batch, nheads_k),
    const float* v_descale;    // the cache's values times these; nullptr = 1
                               // (the FP8 forward, flash_fwd_sm90.cu: q, k, v of float8_e4m3fn,
    const float* q_descale;    // their values times q/k/v_descale[b * nheads_k + key head])
    const void* key_mask;      // decoding: bytes (batch, seqlen_k), key t of sequence b (t from
                               // row 0 of its cache) attended only where
                               // key_mask[b * key_mask_batch_stride + t] != 0; nullptr = all
    long long key_mask_batch_stride;
};

// ---- trusted values, guarded addresses -------------------------------------------------------
// cu_seqlens, cache_seqlens and block_table are read only by the kernels (a default call never
// reads them back to the host: no sync, and CUDA graphs can capture the call). flashcore trusts
// them as flash-attn does, but every address formed from them is clamped into its array, so a
// bad value gives a wrong result, never an access outside the arrays. Debug mode
// (FLASHCORE_DEBUG=1) checks them on the host with named errors instead.

// Sequence b of a packed (varlen) tensor of `total` rows: its first row and its length, at most
// `max_len` (the grid's rows per sequence).
struct FcSeqRange {
    long long row0;
    int len;
};
__device__ __forceinline__ FcSeqRange fc_seq_range(const int* cu, int b, int total, int max_len) {
    const int a = min(max(cu[b], 0), total);
    const int e = min(max(cu[b + 1], a), total);
    FcSeqRange r;
    r.row0 = a;
    r.len = min(e - a, max_len);
    return r;
}

// The keys of sequence b in a KV cache of `capacity` rows per sequence (params.seqlen_k).
__device__ __forceinline__ int fc_cache_len(const int* cache_seqlens, int b, int capacity) {
    return min(max(cache_seqlens[b], 0), capacity);
}

// The first key row of sequence b (cache_leftpad, flash-attn's), within [0, len].
__device__ __forceinline__ int fc_cache_start(const int* cache_leftpad, int b, int len) {
    return cache_leftpad == nullptr ? 0 : min(max(cache_leftpad[b], 0), len);
}

// A block_table entry as a block of the pool (num_blocks of them).
__device__ __forceinline__ int fc_pool_block(int entry, int num_blocks) {
    return min(max(entry, 0), num_blocks - 1);
}
