// flashcore: warpgroup MMA (wgmma, sm_90a) wrappers for the Hopper kernels.
//
// Only sources compiled for sm_90a include this header (the instructions do not exist before
// Hopper, and sm_90 without the "a" suffix lacks them too). Operand lists are spelled out:
// an m64n128k16 MMA with fp32 accumulators holds 64 of them per thread.
//
// Accumulator layout (per warpgroup of 4 warps, m64nNk16, fp32): warp w of the group owns rows
// 16w .. 16w + 15; lane (g = lane / 4, t = lane % 4) holds, for each n8 tile j, d[4j + 0/1] =
// (row 16w + g, cols 8j + 2t, +1) and d[4j + 2/3] = (row 16w + g + 8, same cols): the mma.sync
// C layout, tile by tile. The A operand from registers (rs_*) uses the mma.sync m16n8k16 A
// layout, so an S accumulator packed to 16 bits is the A operand of the next MMA as it stands.
#pragma once
#include "ptx.cuh"

// What both Hopper sources need around the MMAs: 32-bit stores, and the loader that writes a
// tile in the layout the descriptors below read.
namespace fc_sm90 {

__device__ __forceinline__ void stg32(void* p, fc_u32 v) {
    asm volatile("st.global.b32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void sts32(fc_u32 addr, fc_u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts128f(fc_u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// A ROWS x D tile (rows of `row_stride` elements from gsrc) into the swizzled layout
// [D / 64][ROWS][64] (each block ROWS * 128 bytes) with cp.async; rows >= rows_valid are
// zero-filled. 256 threads: thread -> (16-byte column chunk tid % C, row tid / C), C = D / 8
// chunks per row, passes of 256 / C rows (a multiple of 8: the swizzle phase is constant per
// thread).
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(fc_u32 sdst, const fc_u16* gsrc, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int kC = D / 8;                  // 16-byte chunks per row
    constexpr int kRS = 256 / kC;              // rows per pass
    static_assert(kRS % 8 == 0 && ROWS % kRS == 0, "load split");
    const int c = tid % kC;                    // columns 8c .. 8c + 7
    const int r0 = tid / kC;
    const fc_u32 s0 = sdst + (fc_u32)(c >> 3) * (fc_u32)(ROWS * 128)
                      + 2u * (fc_u32)swz<64>(r0, (c & 7) * 8);
    const fc_u16* src = gsrc + (long long)r0 * row_stride + c * 8;
#pragma unroll
    for (int it = 0; it < ROWS / kRS; ++it) {
        const bool pred = r0 + it * kRS < rows_valid;
        cp_async_16(s0 + (fc_u32)(it * kRS) * 128u, pred ? src : gsrc, pred);
        src += kRS * row_stride;
    }
}

}  // namespace fc_sm90

// Shared-memory matrix descriptor: start address, leading and stride byte offsets (all >> 4),
// 128-byte swizzle (layout type 1 in bits 62-63). Tiles are stored as [cols / 64][rows][64]
// 16-bit elements with the 16-byte chunk XOR-ed with (row % 8) (swz<64> in ptx.cuh), i.e. the
// canonical 128-byte-swizzled layout, each [rows][64] block 1024-byte aligned.
//   K-major operand (contiguous along K): SBO = 1024 (next 8 rows), LBO unused (1).
//   MN-major operand (contiguous along M/N; B with imm-trans-b = 1): LBO = distance between
//   64-column blocks along N, SBO = 1024 (next 8 rows along K).
// The tile is at base + off, both multiples of 16. The low word is base >> 4 plus a constant
// (LBO's field and off >> 4, off being a k-step's offset, known at compile time in the
// unrolled loops): one add a descriptor on a value common to every descriptor of that base,
// where building each whole from base + off took four. Shared-memory addresses are below 2^18
// (228 KB at most), so the 14-bit address field holds (base + off) >> 4 and the sum cannot
// carry into LBO.
__device__ __forceinline__ fc_u64 wgmma_desc(fc_u32 base, fc_u32 off, fc_u32 lbo_bytes,
                                             fc_u32 sbo_bytes) {
    const fc_u32 lo = (base >> 4) + (((lbo_bytes >> 4) << 16) + (off >> 4));
    const fc_u32 hi = (sbo_bytes >> 4) | (1u << 30);
    return ((fc_u64)hi << 32) | lo;
}

// Descriptors of the two operand kinds. K-major: contiguous along K; SBO = 1024 between groups
// of 8 rows, LBO unused (1). MN-major (read with imm-trans-a/b = 1): `atoms` = the distance
// between 64-element blocks along M/N (LBO), 1024 between groups of 8 rows along K (SBO), as
// CUTLASS's canonical layouts have it. FC_WGMMA_MN_SWAP swaps the two, as a diagnostic for the
// GPU fault locator (tests/diagnostics/probe_sm90.py): the PTX ISA's wording of these offsets for
// MN-major swizzled layouts can be read either way.
__device__ __forceinline__ fc_u64 wgmma_desc_k(fc_u32 base, fc_u32 off = 0u) {
    return wgmma_desc(base, off, 16u, 1024u);
}
__device__ __forceinline__ fc_u64 wgmma_desc_mn(fc_u32 base, fc_u32 off, fc_u32 atoms) {
#ifdef FC_WGMMA_MN_SWAP
    return wgmma_desc(base, off, 1024u, atoms);
#else
    return wgmma_desc(base, off, atoms, 1024u);
#endif
}

// x, which the caller knows to be the same in every lane of the warp (a warpgroup's offset
// into a tile), as a value the compiler knows to be so (broadcast from lane 0, as CUTLASS does
// with the warpgroup index): the descriptors built on it then live in uniform registers, where
// wgmma reads them, rather than in per-lane ones copied over for every product (the dK/dV
// kernels: 4-8% fewer instructions a step; the 16-bit forward's Q base, 1-3%). (The warpgroup
// index itself made so moved ptxas to spill in several kernels.)
__device__ __forceinline__ fc_u32 warp_uniform(fc_u32 x) {
    return __shfl_sync(0xFFFFFFFFu, x, 0);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// that wgmma reads through. Each writing thread fences, then the CTA synchronises.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pin a register's value in program order relative to the (volatile) wgmma instructions:
// the compiler may not move its definition below, or its uses above, this point.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void fence_operand(fc_u32& x) { asm volatile("" : "+r"(x) :: "memory"); }

// An ordering point for ptxas, which moves register-only arithmetic across wgmma waits and
// barriers at will: the branch on v ends a basic block, so that the computation of v (and
// what it depends on) is issued before the block ends, and ptxas does not hoist a wgmma_wait
// that follows above it. Never taken for v >= 0 or NaN (and harmless if taken).
__device__ __forceinline__ void schedule_after(float v) {
    if (v < 0.f) asm volatile("nanosleep.u32 0;\n");
}

template <typename Elem> struct Wgmma;

// D (64 x N, fp32) (+)= A (64 x 16, shared, K-major) * B (16 x N, shared, K-major): ss, N = 32,
// 128 or 176 (chosen by the accumulator array's size); ss_n128<TA, TB>: N = 128 with either
// operand read transposed (imm-trans-a / imm-trans-b)
// D (64 x N, fp32) (+)= A (64 x 16, registers) * B (16 x N, shared, N-major): rs_tb, N = 256,
// 128 or 64 (chosen by the accumulator array's size)
// D (64 x 64, fp32) (+)= A (64 x 16, shared) * B (16 x 64, shared): ss (both K-major) and
// ss_tt (A M-major, B N-major: imm-trans-a = imm-trans-b = 1)
// scale_d = 0 overwrites D, 1 accumulates.
// One specialisation per element type; T is the PTX type name (bf16, f16).
// The accumulator operands d[0] .. d[N - 1] of a wgmma ("+f": read and written), in runs of 8.
#define FC_WGMMA_ACC8(i) \
      "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), \
      "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define FC_WGMMA_ACC16 FC_WGMMA_ACC8(0), FC_WGMMA_ACC8(8)
#define FC_WGMMA_ACC32 FC_WGMMA_ACC16, FC_WGMMA_ACC8(16), FC_WGMMA_ACC8(24)
#define FC_WGMMA_ACC40 FC_WGMMA_ACC32, FC_WGMMA_ACC8(32)
#define FC_WGMMA_ACC64 FC_WGMMA_ACC40, FC_WGMMA_ACC8(40), FC_WGMMA_ACC8(48), FC_WGMMA_ACC8(56)
#define FC_WGMMA_ACC88 FC_WGMMA_ACC64, FC_WGMMA_ACC8(64), FC_WGMMA_ACC8(72), FC_WGMMA_ACC8(80)
#define FC_WGMMA_ACC96 FC_WGMMA_ACC88, FC_WGMMA_ACC8(88)
#define FC_WGMMA_ACC112 FC_WGMMA_ACC96, FC_WGMMA_ACC8(96), FC_WGMMA_ACC8(104)
#define FC_WGMMA_ACC128 FC_WGMMA_ACC112, FC_WGMMA_ACC8(112), FC_WGMMA_ACC8(120)

#define FC_WGMMA_SPECIALISE(ELEM, T)                                                          \
template <> struct Wgmma<ELEM> {                                                             \
    static __device__ __forceinline__ void ss(float (&d)[64], fc_u64 desc_a, fc_u64 desc_b,  \
                                              int scale_d) {                                 \
        ss_n128<0, 0>(d, desc_a, desc_b, scale_d);                                           \
    }                                                                                        \
    template <int TA, int TB>                                                                \
    static __device__ __forceinline__ void ss_n128(float (&d)[64], fc_u64 desc_a,            \
                                                   fc_u64 desc_b, int scale_d) {             \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." #T "." #T " "                     \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                                                      \
            "%64, %65, p, 1, 1, %67, %68;\n}\n"                                              \
            : FC_WGMMA_ACC64                                                                 \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));                     \
    }                                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[16], fc_u64 desc_a, fc_u64 desc_b,  \
                                              int scale_d) {                                 \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n32k16.f32." #T "." #T " "                      \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                                                                      \
            "%16, %17, p, 1, 1, 0, 0;\n}\n"                                                 \
            : FC_WGMMA_ACC16                                                                 \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                       \
    }                                                                                        \
    static __device__ __forceinline__ void rs_tb(float (&d)[64], const fc_u32 (&a)[4],       \
                                                 fc_u64 desc_b, int scale_d) {               \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." #T "." #T " "                     \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                                                      \
            "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                  \
            : FC_WGMMA_ACC64                                                                 \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));        \
    }                                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[32], fc_u64 desc_a, fc_u64 desc_b,  \
                                              int scale_d) {                                 \
        ss_n64<0, 0>(d, desc_a, desc_b, scale_d);                                            \
    }                                                                                        \
    static __device__ __forceinline__ void ss_tt(float (&d)[32], fc_u64 desc_a,              \
                                                 fc_u64 desc_b, int scale_d) {               \
        ss_n64<1, 1>(d, desc_a, desc_b, scale_d);                                            \
    }                                                                                        \
    template <int TA, int TB>                                                                \
    static __device__ __forceinline__ void ss_n64(float (&d)[32], fc_u64 desc_a,             \
                                                  fc_u64 desc_b, int scale_d) {              \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." #T "." #T " "                      \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                                                    \
            "%32, %33, p, 1, 1, %35, %36;\n}\n"                                              \
            : FC_WGMMA_ACC32                                                                 \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));                     \
    }                                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[40], fc_u64 desc_a, fc_u64 desc_b,  \
                                              int scale_d) {                                 \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n80k16.f32." #T "." #T " "                      \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "                                                                      \
            "%40, %41, p, 1, 1, 0, 0;\n}\n"                                                 \
            : FC_WGMMA_ACC40                                                                 \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                       \
    }                                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[88], fc_u64 desc_a, fc_u64 desc_b,  \
                                              int scale_d) {                                 \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n176k16.f32." #T "." #T " "                     \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, "                                                                      \
            "%88, %89, p, 1, 1, 0, 0;\n}\n"                                                 \
            : FC_WGMMA_ACC88                                                                 \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                       \
    }                                                                                        \
    static __device__ __forceinline__ void rs_tb(float (&d)[128], const fc_u32 (&a)[4],      \
                                                 fc_u64 desc_b, int scale_d) {               \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                   \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32." #T "." #T " "                     \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "                                                                   \
            "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                             \
            : FC_WGMMA_ACC128                                                                \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));        \
    }                                                                                        \
    static __device__ __forceinline__ void rs_tb(float (&d)[32], const fc_u32 (&a)[4],       \
                                                 fc_u64 desc_b, int scale_d) {               \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                    \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." #T "." #T " "                      \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                                                    \
            "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                  \
            : FC_WGMMA_ACC32                                                                 \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));        \
    }                                                                                        \
};

FC_WGMMA_SPECIALISE(fc_bf16, bf16)
FC_WGMMA_SPECIALISE(fc_fp16, f16)
#undef FC_WGMMA_SPECIALISE

// ---- float8_e4m3fn operands (the FP8 forward) -----------------------------------------------
// The tag of e4m3 inputs (one byte each); CuPy holds them as uint8 arrays of the bits.
struct fc_e4m3 {
    static constexpr int kBytes = 1;
};

// Four floats as four e4m3 bytes (a in the low byte), round to nearest even, saturating to
// +-448 (NaN stays NaN). cvt packs its first source into the high half.
__device__ __forceinline__ fc_u32 fc_f32x4_to_e4m3x4(float a, float b, float c, float d) {
    fc_u32 r;
    asm("{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

// Byte permute: byte i of the result is byte sel[4i+3:4i] of {b, a} (a = bytes 0-3).
__device__ __forceinline__ fc_u32 fc_prmt(fc_u32 a, fc_u32 b, fc_u32 sel) {
    fc_u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// stmatrix (sm_90): four 8 x 8 b16 matrices from registers, lane l giving the address of row
// l % 8 of matrix l / 8; lane (r = l / 4, c = l % 4)'s register m lands in row r of matrix m,
// bytes 4c .. 4c + 3 (the ldmatrix fragment, stored).
__device__ __forceinline__ void stmatrix_x4(fc_u32 addr, fc_u32 r0, fc_u32 r1, fc_u32 r2,
                                            fc_u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// D (64 x N, fp32) (+)= A (64 x 32 e4m3) * B (32 x N e4m3), k32. FP8 wgmma takes both shared
// operands K-major only (no transpose flags). ss: A and B from shared memory; rs: A from
// registers, four b32 of four bytes each: register 2h + v of lane (g, t) of warp w holds row
// 16w + g + 8v, columns 16h + 4t .. 16h + 4t + 3 (low byte first), as CUTLASS's ALayout_64x32
// and the PTX ISA's k32 A-fragment figure have it. N = 128, 192, 224 or 256 (the accumulator's
// size).
template <> struct Wgmma<fc_e4m3> {
    static __device__ __forceinline__ void ss(float (&d)[64], fc_u64 desc_a, fc_u64 desc_b,
                                              int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC64
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
    static __device__ __forceinline__ void ss(float (&d)[96], fc_u64 desc_a, fc_u64 desc_b,
                                              int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
            "%96, %97, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC96
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
    static __device__ __forceinline__ void ss(float (&d)[112], fc_u64 desc_a, fc_u64 desc_b,
                                              int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %114, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n224k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}, "
            "%112, %113, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC112
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
    static __device__ __forceinline__ void ss(float (&d)[128], fc_u64 desc_a, fc_u64 desc_b,
                                              int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
            "%128, %129, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC128
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
    static __device__ __forceinline__ void rs(float (&d)[64], const fc_u32 (&a)[4],
                                              fc_u64 desc_b, int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC64
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
    static __device__ __forceinline__ void rs(float (&d)[128], const fc_u32 (&a)[4],
                                              fc_u64 desc_b, int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
            "{%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
            : FC_WGMMA_ACC128
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
};
#undef FC_WGMMA_ACC64
#undef FC_WGMMA_ACC32
#undef FC_WGMMA_ACC16
#undef FC_WGMMA_ACC128
#undef FC_WGMMA_ACC88
#undef FC_WGMMA_ACC96
