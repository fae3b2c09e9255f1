// flashcore: a kernel timeline for diagnostics (FC_DIAG_TIMELINE; compiled out otherwise).
//
// With -DFC_DIAG_TIMELINE a kernel that calls fc_tl_stamp writes the SM clock (%clock, 32
// bits: intervals are taken modulo 2^32) at points of its choosing into the module's global
// array fc_diag_tl, one lane per warpgroup (thread 0 of it), so that a diagnostic reads back
// where a CTA's time went, phase by phase, without a profiler:
//
//   fc_diag_tl[(((cta * 4 + wg) * FC_TL_TILES + u) * FC_TL_ITERS + it) * 8 + e]
//
// cta: the CTA's linear index (only the first FC_TL_CTAS record), wg: its warpgroup (0 the
// producer), u: the CTA's tile number (the first FC_TL_TILES), it: a step within the tile (the
// first FC_TL_ITERS - 2; a later step's stamps are dropped, so that a long tile's steps do not
// overwrite the two slots after them: FC_TL_TILE_SLOT, stored at it = FC_TL_ITERS - 1, holds
// the tile's own events, FC_TL_CTA_SLOT, at FC_TL_ITERS - 2, the CTA's: fc_tl_cta_begin /
// fc_tl_cta_end), e: the event (0 .. 7). Slots never written keep
// what the diagnostic put there before the launch. tests/diagnostics/probe_timeline.py reads
// it (cuModuleGetGlobal) and says what each event of the Hopper forward and of the
// warp-specialised dK/dV kernel means.
// Timing only: a stamp is a clock read and a global store, kept in program order against the
// kernel's other volatile asm (wgmma, mbarriers, barriers) by its "memory" clobber; ptxas still
// moves register-only arithmetic across it, so an interval holds what the SASS puts between
// its two stamps.
#pragma once

#ifndef FC_TL_CTAS
#define FC_TL_CTAS 132
#endif
#define FC_TL_TILES 8
#define FC_TL_ITERS 128
#define FC_TL_TILE_SLOT (-1)          // (stored at it = FC_TL_ITERS - 1)
#define FC_TL_CTA_SLOT (-2)           // (stored at it = FC_TL_ITERS - 2)
// The forward's consumers reuse two step slots for tile events (a tile whose steps reach them,
// one of more than FC_TL_ITERS - 4 key blocks, overwrites the first or mixes with the second;
// the diagnostic reads them only for shorter tiles): event 0 of step FC_TL_ITERS - 4, the clock
// before the tile's wait for Q; step FC_TL_ITERS - 5, the epilogue's points: 0 the O buffer
// free, 1 past the barrier that follows, 2 O in the buffer (or stored), 3 past the barrier
// after the proxy fence, 4 the TMA stores issued (slot 6 of the tile follows the wait for
// their reads of the buffer).
#define FC_TL_QWAIT_STEP (FC_TL_ITERS - 4)
#define FC_TL_EPI_STEP (FC_TL_ITERS - 5)

#ifdef FC_DIAG_TIMELINE
__device__ unsigned int fc_diag_tl[FC_TL_CTAS * 4 * FC_TL_TILES * FC_TL_ITERS * 8];

__device__ __forceinline__ unsigned int fc_tl_cta() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
__device__ __forceinline__ void fc_tl_put(int wg, int u, int it, int e, unsigned int v) {
    const unsigned int cta = fc_tl_cta();
    if ((threadIdx.x & 127) != 0 || cta >= FC_TL_CTAS || u >= FC_TL_TILES ||
        it >= FC_TL_ITERS - 2)
        return;
    if (it < 0) it += FC_TL_ITERS;          // the tile's and the CTA's slots
    const unsigned int i = (((cta * 4u + (unsigned)wg) * FC_TL_TILES + (unsigned)u) * FC_TL_ITERS
                            + (unsigned)it) * 8u + (unsigned)e;
    asm volatile("st.global.u32 [%0], %1;\n" :: "l"(fc_diag_tl + i), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned int fc_tl_clock() {
    unsigned int c;
    asm volatile("mov.u32 %0, %%clock;\n" : "=r"(c) :: "memory");
    return c;
}
// event e of step it of tile u, warpgroup wg: the clock now
__device__ __forceinline__ void fc_tl_stamp(int wg, int u, int it, int e) {
    if ((threadIdx.x & 127) == 0) fc_tl_put(wg, u, it, e, fc_tl_clock());
}
// the CTA's slot (warpgroup wg): 0 the clock and 1, 2 the global timer (ns, low and high word)
// at its start, 3 .. 5 the same at its end, 6 the SM it ran on
__device__ __forceinline__ void fc_tl_cta_mark(int wg, int e0) {
    if ((threadIdx.x & 127) != 0) return;
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns) :: "memory");
    fc_tl_put(wg, 0, FC_TL_CTA_SLOT, e0, fc_tl_clock());
    fc_tl_put(wg, 0, FC_TL_CTA_SLOT, e0 + 1, (unsigned int)ns);
    fc_tl_put(wg, 0, FC_TL_CTA_SLOT, e0 + 2, (unsigned int)(ns >> 32));
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    fc_tl_put(wg, 0, FC_TL_CTA_SLOT, 6, sm);
}
__device__ __forceinline__ void fc_tl_cta_begin(int wg) { fc_tl_cta_mark(wg, 0); }
__device__ __forceinline__ void fc_tl_cta_end(int wg) { fc_tl_cta_mark(wg, 3); }
#define FC_TL_STAMP(wg, u, it, e) fc_tl_stamp((wg), (u), (it), (e))
// a value instead of a clock (the tile's step count, its number)
#define FC_TL_VALUE(wg, u, it, e, v) fc_tl_put((wg), (u), (it), (e), (unsigned int)(v))
#define FC_TL_CTA_BEGIN(wg) fc_tl_cta_begin(wg)
#define FC_TL_CTA_END(wg) fc_tl_cta_end(wg)
#else
#define FC_TL_STAMP(wg, u, it, e) ((void)0)
#define FC_TL_VALUE(wg, u, it, e, v) ((void)0)
#define FC_TL_CTA_BEGIN(wg) ((void)0)
#define FC_TL_CTA_END(wg) ((void)0)
#endif
