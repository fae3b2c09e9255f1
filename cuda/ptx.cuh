// flashcore: thin wrappers over the PTX instructions the Ampere-class kernels use
// (mma.sync, ldmatrix, cp.async, ex2) and our own 16-bit element types.
//
// No CUDA header is included on purpose: cuda_fp16.h / cuda_bf16.h are not shipped with CuPy,
// and every source must compile under bare NVRTC on a machine with no GPU (CI does that).
#pragma once

typedef unsigned short fc_u16;
typedef unsigned int fc_u32;
typedef unsigned long long fc_u64;

// ---- float8_e4m3fn ----------------------------------------------------------------------------
// Two e4m3 values (the low 16 bits of x: low byte first) as f16x2, exactly (every e4m3 value,
// NaN included, is an f16 value), converted in hardware (compute capability 8.9 and newer;
// the launchers refuse FP8 inputs below it, and a kernel reaching this there traps). Moving the bits with integer operations instead measured slower on the H200
// (performance log, session 12).
__device__ __forceinline__ fc_u32 fc_e4m3x2_to_f16x2(fc_u32 x) {
    fc_u32 r = 0u;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 a;\ncvt.u16.u32 a, %1;\ncvt.rn.f16x2.e4m3x2 %0, a;\n}" : "=r"(r) : "r"(x));
#else
    (void)x;
    asm volatile("trap;");
#endif
    return r;
}
// The same for the high 16 bits of x (bytes 2, 3: byte 2 in the low half).
__device__ __forceinline__ fc_u32 fc_e4m3x2_hi_to_f16x2(fc_u32 x) {
    fc_u32 r = 0u;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}"
        : "=r"(r) : "r"(x));
#else
    (void)x;
    asm volatile("trap;");
#endif
    return r;
}
// Bytes of x picked by the selector's nibbles (prmt: nibble i names the source byte of byte i).
__device__ __forceinline__ fc_u32 fc_prmt(fc_u32 x, fc_u32 sel) {
    fc_u32 r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "r"(sel));
    return r;
}

// ---- element types -----------------------------------------------------------------------
// Each tag says how to convert to and from float and which mma.sync variant to issue.
struct fc_bf16 {
    static constexpr int kBytes = 2;   // bytes per element
    static __device__ __forceinline__ float to_float(fc_u16 x) {
        return __uint_as_float(static_cast<fc_u32>(x) << 16);
    }
    // Round-to-nearest-even pack of two floats: lo in the low half, hi in the high half.
    static __device__ __forceinline__ fc_u32 pack2(float lo, float hi) {
        fc_u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ fc_u16 from_float(float x) {
        return static_cast<fc_u16>(pack2(x, 0.f) & 0xffffu);
    }
    // d += a * b, m16n8k16, fp32 accumulators.
    static __device__ __forceinline__ void mma(float (&d)[4], const fc_u32 (&a)[4],
                                               const fc_u32 (&b)[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

struct fc_fp16 {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ float to_float(fc_u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ fc_u32 pack2(float lo, float hi) {
        fc_u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ fc_u16 from_float(float x) {
        return static_cast<fc_u16>(pack2(x, 0.f) & 0xffffu);
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const fc_u32 (&a)[4],
                                               const fc_u32 (&b)[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// ---- shared memory addressing ---------------------------------------------------------------
__device__ __forceinline__ fc_u32 smem_u32(const void* p) {
    return static_cast<fc_u32>(__cvta_generic_to_shared(p));
}

// 16 bytes from / to shared memory (16-byte aligned).
__device__ __forceinline__ void lds128(fc_u32 (&r)[4], fc_u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void sts128(fc_u32 addr, fc_u32 a, fc_u32 b, fc_u32 c, fc_u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// ---- ldmatrix ---------------------------------------------------------------------------------
// Each lane passes the shared address of one 16-byte row (lanes 0-7 matrix 0, 8-15 matrix 1, ...).
__device__ __forceinline__ void ldmatrix_x4(fc_u32 (&r)[4], fc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(fc_u32 (&r)[4], fc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(fc_u32 (&r)[2], fc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(fc_u32 (&r)[2], fc_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---- cp.async -----------------------------------------------------------------------------------
// 16-byte global -> shared copy that bypasses L1. When pred is false nothing is read and the
// 16 destination bytes are zero-filled (src-size 0), so out-of-range rows/columns become 0.
__device__ __forceinline__ void cp_async_16(fc_u32 smem_addr, const void* gmem, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr), "l"(gmem), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// ---- math ------------------------------------------------------------------------------------------
__device__ __forceinline__ float fc_exp2(float x) {  // 2^x, flushes denormals; ex2(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// 2^x on the FMA pipe, not the MUFU unit (FlashAttention-4's idea: where the softmax of fast
// products runs out of MUFU throughput, 16 exponentials a clock per SM, the FMA pipe has room):
// x rounded to j + f with f in [-0.5, 0.5] by adding 1.5 * 2^23 (j lands in the sum's low
// bits), 2^f by a cubic (relative error 1.0e-4, p(0) = 1: the row's maximum gets 1), times 2^j
// built in the exponent field. x is clamped at -127 (max.NaN: NaN stays NaN), where 2^j's bits
// are 0: masked scores (-inf) give +0, as ex2 does. 9 instructions, 1 MUFU fewer.
__device__ __forceinline__ float fc_exp2_poly(float x) {
    float t;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(t) : "f"(x), "f"(-127.f));
    const float r = t + 12582912.f;
    const float f = t - (r - 12582912.f);
    const float p = fmaf(fmaf(fmaf(0x1.c2a0b8p-5f, f, 0x1.f00b96p-3f), f, 0x1.62f5f8p-1f), f, 1.f);
    return p * __uint_as_float((__float_as_uint(r) << 23) + 0x3F800000u);
}
// tanh accurate to a few fp32 ulps in absolute terms: 1 - 2 / (2^(2x log2 e) + 1).
// tanh.approx.f32 has ~2^-11 relative error, which a softcap c multiplies into score errors of
// c * 5e-4; and the forward and backward must use the same function, since the backward
// rebuilds P from the forward's LSE. Saturates cleanly: +inf -> 1 (rcp(inf) = 0), -inf -> -1.
__device__ __forceinline__ float fc_tanh(float x) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * 2.885390081777927f));  // 2 log2(e)
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
    return 1.f - 2.f * r;
}
// Reductions over the 4 lanes of an mma quad (lanes 4g .. 4g+3 hold one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// ---- swizzled tile addressing ------------------------------------------------------------------
// A shared tile of ROWS x COLS 16-bit elements stored row-major in 16-byte chunks; the chunk
// index is XOR-ed with (row % 8) so that the 8 rows read by one ldmatrix phase hit 8 different
// bank groups. COLS must be a multiple of 64 (128-byte rows) for the XOR to stay in the row;
// for narrower tiles (COLS = 32) the XOR uses (row / 2) % 4 over 4 chunks.
template <int COLS>
__device__ __forceinline__ int swz(int row, int col) {  // element offset of (row, col)
    constexpr int kChunks = COLS / 8;
    const int chunk = col >> 3;
    int sw;
    if constexpr (kChunks >= 8) {
        sw = chunk ^ (row & 7);
    } else if constexpr (kChunks == 4) {
        sw = chunk ^ ((row >> 1) & 3);
    } else {
        sw = chunk;
    }
    return row * COLS + (sw << 3) + (col & 7);
}

// Element offset of (row, col) in a ROWS x D tile stored as [D / W][ROWS][W], swizzled: the
// mma.sync kernels' shared tiles (flash_fwd.cu, flash_decode.cu). Column blocks make head dims
// 96 and 192 (not a multiple of 64) swizzle without leaving the row.
template <int W, int ROWS>
__device__ __forceinline__ int tile_off(int row, int col) {
    return (col / W) * (ROWS * W) + swz<W>(row, col % W);
}

// The lane-dependent part of an ldmatrix address inside one column block: lane row lr (the
// row within a 16-row group; group bases are multiples of 16, so they do not change the XOR)
// and lane half hc (0: columns 0-7 of the 16-column step j, 1: columns 8-15).
template <int W>
__device__ __forceinline__ int lane_off(int lr, int hc, int j) {
    return swz<W>(lr, j * 16 + hc * 8);
}

// A lane's ldmatrix offsets in a tile_off tile, per 16-column step j of a column block.
// a_off: the A operand (Q) and V^T (ldmatrix.trans) share the lane pattern: lanes 0-15 give
// rows 0-15 of the left 8 columns, lanes 16-31 rows 0-15 of the right 8 columns. For Q this
// yields a0..a3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
// (rows 8-15, k 8-15); for V (rows = keys) the transposed matrices are b0/b1 of d-tile 0,
// then b0/b1 of d-tile 1. k_off: K (B operand of Q K^T, non-transposed, rows = keys): lanes
// 0-7 keys 0-7 / d 0-7, 8-15 keys 0-7 / d 8-15, 16-23 keys 8-15 / d 0-7, 24-31 keys 8-15 /
// d 8-15, giving b0/b1 of key-tile 0, then b0/b1 of key-tile 1.
template <int W>
__device__ __forceinline__ void fc_ldmatrix_offsets(int lane, int (&a_off)[W / 16],
                                                    int (&k_off)[W / 16]) {
    const int a_lr = lane & 15, a_hc = lane >> 4;
    const int k_lr = (lane & 7) + ((lane >> 4) << 3), k_hc = (lane >> 3) & 1;
#pragma unroll
    for (int j = 0; j < W / 16; ++j) {
        a_off[j] = lane_off<W>(a_lr, a_hc, j);
        k_off[j] = lane_off<W>(k_lr, k_hc, j);
    }
}

// 16-byte global store (no vector-type headers needed).
__device__ __forceinline__ void stg128(void* p, const fc_u32 (&r)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n"
                 :: "l"(p), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
