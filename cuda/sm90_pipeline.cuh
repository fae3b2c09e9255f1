// flashcore: the Hopper (sm_90a) pipeline pieces: tensor-memory-accelerator (TMA) loads that
// complete on shared-memory mbarriers, the barriers themselves, named barriers between
// warpgroups, and register reallocation between warpgroups (setmaxnreg).
//
// A producer/consumer pipeline of S stages uses two mbarriers per stage:
//   full[s]  count 1: the producer's arrive.expect_tx(bytes); the TMA copies complete the
//            transaction bytes, and the phase flips when all of them have landed.
//   empty[s] count = consumer threads: every consumer thread arrives once it no longer reads
//            the stage (its wgmma reading it has retired).
// Use u of stage s (u = iteration / S) waits on full[s] with parity u & 1; the producer's
// refill for use u >= 1 waits on empty[s] with parity (u - 1) & 1.
//
// TMA copies write shared memory through the async proxy, which wgmma also reads through: no
// proxy fence is needed between them (unlike cp.async or st.shared, see wgmma.cuh).
#pragma once
#include "ptx.cuh"

// A CUDA driver tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned), encoded on the
// host by flashcore/kernels/tma.py and passed to the kernel as a __grid_constant__ parameter.
struct alignas(64) FcTensorMap {
    fc_u64 opaque[16];
};

namespace fc_pipe {

__device__ __forceinline__ void mbar_init(fc_u32 bar, fc_u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (the TMA unit) and other threads.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(fc_u32 bar, fc_u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(fc_u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// An arrival on `bar` once every cp.async this thread has issued so far has landed (the
// barrier's count includes it: .noinc), without waiting for them here.
__device__ __forceinline__ void cp_async_mbar_arrive(fc_u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(fc_u32 bar, fc_u32 parity) {
    fc_u32 done;
    do {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// One box of a rank-4 tensor map (coordinates innermost first, in elements; boxes reaching
// past the tensor's extent are zero-filled, and still count their full bytes) into shared
// memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(fc_u32 dst, const FcTensorMap& map, fc_u32 bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(reinterpret_cast<fc_u64>(&map)), "r"(bar),
           "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
// Bulk operations issued by the threads with `pred` (one thread of a warpgroup), as guarded
// instructions rather than a branch: the warpgroup's threads stay converged through the
// forward's epilogue, and ptxas keeps the main loop's shared-memory addresses in uniform
// registers (bulk_commit, bulk_wait_read and bulk_wait: see below).
//
// tma_store_4d_if: one box of shared memory at `src` (laid out as the map's box, swizzle
// included) stored into a rank-4 tensor map's tensor at the coordinates (innermost first, in
// elements; the parts of the box past the tensor's extent are not written), as part of the
// issuing thread's current bulk group. The writing threads fence their shared-memory stores
// for the async proxy (fence_proxy_async) and meet the issuing thread at a barrier first.
__device__ __forceinline__ void tma_store_4d_if(bool pred, const FcTensorMap& map, fc_u32 src,
                                                int c0, int c1, int c2, int c3) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "@p cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n}\n"
        :: "l"(reinterpret_cast<fc_u64>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
           "r"((int)pred)
        : "memory");
}
__device__ __forceinline__ void bulk_commit_if(bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p cp.async.bulk.commit_group;\n}\n"
                 :: "r"((int)pred) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read_if(bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p cp.async.bulk.wait_group.read %0;\n}\n"
                 :: "n"(N), "r"((int)pred) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_if(bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p cp.async.bulk.wait_group %0;\n}\n"
                 :: "n"(N), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void mbar_arrive_if(bool pred, fc_u32 bar) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
                 "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
                 :: "r"(bar), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const FcTensorMap& map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<fc_u64>(&map)) : "memory");
}

// Bulk reduce-add without a tensor map: `bytes` (a multiple of 16) of fp32 at shared address
// `src` added element by element into global memory at `dst` (both 16-byte aligned), in L2,
// as part of the issuing thread's current bulk group. bulk_commit closes the group;
// bulk_wait_read<N> waits until at most N of the thread's groups still read shared memory (the
// source may then be overwritten), bulk_wait<N> until at most N are incomplete.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, fc_u32 src, fc_u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// Register reallocation: the producer warpgroup gives registers back, the consumers take them.
// Effective only with a register cap at entry (__launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` counts the arriving and the
// waiting threads together.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Varlen calls of the warp-specialised kernels: their tensor maps see a packed array as one
// sequence, so a block that ends past its sequence holds the next sequence's rows (or rows of
// no sequence: anything, NaN included) where the dense maps' out-of-bounds fill leaves zeros.
// This zeroes rows [r0, kRows) of a [kColBlocks][kRows][128-byte] shared tile (a swizzled row
// is its own 128 bytes, so whole rows are zeroed whatever the swizzle), thread t of n. The
// caller fences the stores for the async proxy and synchronises its threads before a product
// reads the tile. (The column-block loop stays rolled: unrolled, it costs the callers'
// registers.)
template <int kColBlocks, int kRows>
__device__ __forceinline__ void zero_tile_rows(fc_u32 tile, int r0, int t, int n) {
    const int chunks = (kRows - r0) * 8;                     // 16-byte chunks a column block
#pragma unroll 1
    for (int c = 0; c < kColBlocks; ++c)
#pragma unroll 1
        for (int i = t; i < chunks; i += n)
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n"
                         :: "r"(tile + (fc_u32)(c * kRows + r0 + (i >> 3)) * 128u
                                + (fc_u32)(i & 7) * 16u), "r"(0u) : "memory");
}

// The order in which a causal or windowed grid's tiles are handed out. A grid of nx x ny x nz
// tiles whose x = 0 tile of every (y, z) is the longest (and x = nx - 1 the shortest: the
// forward's query blocks taken last to first, the backward's key blocks first to last) is
// taken chunk by chunk: the first c blocks of x for every (y, z), then the next c, ...,
// c = max(4, nx / 8). Against x fastest (each (y, z) from its longest tile to its shortest in
// turn, so that the last (y, z)'s longest tiles start last), this keeps the tail short (a
// list-scheduling model over 132 SMs: 7% past the ideal at 2k and 4k keys, 1-2% chunked) while
// c tiles of one (y, z) still run side by side, sharing its loads in L2. `linear`: the tile's
// number in the hand-out order; returns (x, y, z).
struct FcTileXYZ {
    int x, y, z;
};
__device__ __forceinline__ FcTileXYZ chunked_tile(int linear, int nx, int ny, int nz) {
    const int c = max(4, nx / 8);
    const int g_count = ny * nz, full = nx / c, per = c * g_count;
    int x, g;
    if (linear / per < full) {
        const int ch = linear / per, w = linear - ch * per;
        g = w / c;
        x = ch * c + (w - g * c);
    } else {                                     // the last, partial chunk (nx - full c wide)
        const int r = nx - full * c, w = linear - full * per;
        g = w / r;
        x = full * c + (w - g * r);
    }
    return FcTileXYZ{x, g % ny, g / ny};
}

// A CTA's number in the hand-out order of its 3-D grid: blockIdx.x fastest, as the hardware
// launches them.
__device__ __forceinline__ int linear_block() {
    return (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}

}  // namespace fc_pipe
